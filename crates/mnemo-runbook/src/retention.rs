//! Retention for operators: a sweep now (dry run first), user erasure, and the audit log.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::bail;
use chrono::{DateTime, Utc};
use mnemo_config::RetentionSettings;
use mnemo_core::{AuditEvent, RetentionPolicy, TenantId, UserId};
use mnemo_jobs::{DRY_RUN_IDS, ErasureReport, SweepOptions, SweepOutcome, SweepReport};
use mnemo_store::{AuditFilter, ErasurePlan, Store};
use serde_json::{Value, json};
use uuid::Uuid;

/// A progress line on stderr: redrawn in place on a terminal, a line every few seconds otherwise.
struct Progress {
    what: &'static str,
    started: Instant,
    drawn: Option<Instant>,
    terminal: bool,
}

impl Progress {
    fn new(what: &'static str) -> Self {
        Self { what, started: Instant::now(), drawn: None, terminal: std::io::stderr().is_terminal() }
    }

    fn update(&mut self, done: u64, total: u64) {
        let every = if self.terminal { Duration::from_millis(100) } else { Duration::from_secs(5) };
        if self.drawn.is_some_and(|at| at.elapsed() < every) && done < total {
            return;
        }
        self.drawn = Some(Instant::now());
        let seconds = self.started.elapsed().as_secs_f64().max(1e-3);
        let rate = done as f64 / seconds;
        let share = if total == 0 { 1.0 } else { (done as f64 / total as f64).min(1.0) };
        let filled = (share * 30.0).round() as usize;
        let eta = if rate > 0.0 { total.saturating_sub(done) as f64 / rate } else { 0.0 };
        let line = format!(
            "[{}{}] {done}/{total} rows {} ({:.0}%), {rate:.0} rows/s, {eta:.0} s left",
            "#".repeat(filled),
            " ".repeat(30 - filled),
            self.what,
            share * 100.0
        );
        let mut err = std::io::stderr();
        if self.terminal {
            let _ = write!(err, "\r{line}");
        } else {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
    }

    fn finish(&self) {
        if self.terminal && self.drawn.is_some() {
            eprintln!();
        }
    }
}

/// `mnemo-runbook anonymize`: one sweep of one tenant now.
pub async fn anonymize(
    store: &Store,
    settings: &RetentionSettings,
    tenant: &TenantId,
    dry_run: bool,
    allow_large: Option<u64>,
    json: bool,
) -> anyhow::Result<()> {
    warn_if_it_holds_nothing(store, tenant).await?;
    let mut options = SweepOptions::new(settings, "runbook");
    options.dry_run = dry_run;
    options.allow_large = allow_large;
    options.list_ids = true;
    let mut progress = Progress::new("anonymized");
    let report = mnemo_jobs::sweep_tenant(store, tenant, &options, |done, due| progress.update(done, due)).await?;
    progress.finish();
    if json {
        println!("{}", sweep_json(&report));
    } else {
        print_sweep(&report, settings);
    }
    if report.outcome == SweepOutcome::Refused {
        let plan = &report.plan;
        bail!(
            "refused by the safety floor: the sweep would anonymize {} of the tenant's {} rows and redact {} of its {} \
             workspace file versions; either past {:.0}% and past {} is refused. Nothing changed; the refusal is in the \
             audit log. Check them with --dry-run, then allow this sweep with --allow-large-sweep {}",
            plan.due(),
            plan.tenant_rows,
            plan.workspace_versions,
            plan.tenant_versions,
            settings.floor.max_fraction * 100.0,
            settings.floor.floor_rows,
            plan.to_allow()
        );
    }
    Ok(())
}

fn sweep_json(report: &SweepReport) -> Value {
    let p = &report.policy;
    let ids: Vec<_> = report.ids.iter().map(|(id, reason)| json!({ "id": id, "reason": reason.as_str() })).collect();
    json!({
        "tenant": report.tenant.as_str(),
        "policy": { "soft_ttl_days": p.soft_ttl_days, "superseded_ttl_days": p.superseded_ttl_days,
                    "batch_size": p.batch_size, "dry_run": p.dry_run },
        "warnings": report.warnings,
        "outcome": report.outcome.as_str(),
        "due": { "soft_deleted": report.plan.soft_deleted, "superseded": report.plan.superseded,
                 "total": report.plan.due() },
        "tenant_rows": report.plan.tenant_rows,
        "over_floor": report.over_floor,
        "anonymized": report.anonymized,
        "anonymized_total": report.anonymized_total(),
        "workspace_versions_due": report.plan.workspace_versions,
        "tenant_versions": report.plan.tenant_versions,
        "workspace_versions_redacted": report.redacted_versions,
        "ids": ids,
        "seconds": report.elapsed.as_secs_f64(),
    })
}

fn print_sweep(report: &SweepReport, settings: &RetentionSettings) {
    let p = &report.policy;
    println!(
        "tenant {}: soft TTL {} days, superseded TTL {} days, batches of {}{}",
        report.tenant,
        p.soft_ttl_days,
        p.superseded_ttl_days,
        p.batch_size,
        if p.dry_run { ", dry run by policy" } else { "" }
    );
    for warning in &report.warnings {
        println!("  warning: {warning}");
    }
    let plan = &report.plan;
    println!(
        "due: {} rows ({} soft-deleted, {} superseded) of the tenant's {} rows",
        plan.due(),
        plan.soft_deleted,
        plan.superseded,
        plan.tenant_rows
    );
    println!(
        "due: {} workspace file versions (replaced or deleted before the soft TTL) of the tenant's {}",
        plan.workspace_versions, plan.tenant_versions
    );
    if report.over_floor {
        println!(
            "over the safety floor: more than {:.0}% of the tenant's rows or versions and more than {}",
            settings.floor.max_fraction * 100.0,
            settings.floor.floor_rows
        );
    }
    match report.outcome {
        SweepOutcome::DryRun if plan.due() == 0 && plan.workspace_versions == 0 => println!("dry run: nothing is due"),
        SweepOutcome::DryRun if plan.due() == 0 => {
            println!("dry run: nothing changed. No row is due; the workspace versions above would be redacted")
        }
        SweepOutcome::DryRun => {
            println!("dry run: nothing changed. These rows would be anonymized:");
            for (id, reason) in &report.ids {
                println!("  {id}  {}", reason.as_str());
            }
            if plan.due() > DRY_RUN_IDS as u64 {
                println!("  … and {} more", plan.due() - DRY_RUN_IDS as u64);
            }
        }
        SweepOutcome::Refused => {}
        SweepOutcome::Done | SweepOutcome::Unfinished => {
            let by_reason: Vec<String> = report.anonymized.iter().map(|(r, n)| format!("{r} {n}")).collect();
            let seconds = report.elapsed.as_secs_f64();
            println!(
                "anonymized {} rows ({}) in {seconds:.1} s",
                report.anonymized_total(),
                if by_reason.is_empty() { "none".to_owned() } else { by_reason.join(", ") },
            );
            println!("redacted the text of {} workspace file versions", report.redacted_versions);
        }
    }
}

/// The fields `retention-policy` sets and removes.
pub struct PolicyChange {
    pub soft_ttl_days: Option<u32>,
    pub superseded_ttl_days: Option<u32>,
    pub batch_size: Option<u32>,
    pub dry_run: Option<bool>,
    pub unset: Vec<String>,
}

/// A tenant's setting may come before its data, so a name that holds nothing is not refused,
/// only pointed out: it may be a typo.
pub async fn warn_if_it_holds_nothing(store: &Store, tenant: &TenantId) -> anyhow::Result<()> {
    if !store.tenant_holds_data(tenant).await? {
        eprintln!("warning: tenant {tenant} holds no memory and no workspace file yet: is its name right?");
    }
    Ok(())
}

/// `mnemo-runbook retention-policy`: the tenant's retention settings and the policy in force,
/// after changing them when asked.
pub async fn policy(
    store: &Store,
    settings: &RetentionSettings,
    tenant: &TenantId,
    change: PolicyChange,
    json: bool,
) -> anyhow::Result<()> {
    let mut set = serde_json::Map::new();
    let numbers = [
        ("soft_ttl_days", change.soft_ttl_days),
        ("superseded_ttl_days", change.superseded_ttl_days),
        ("batch_size", change.batch_size),
    ];
    for (field, value) in numbers {
        if let Some(value) = value {
            set.insert(field.to_owned(), json!(value));
        }
    }
    if let Some(dry_run) = change.dry_run {
        set.insert("dry_run".to_owned(), json!(dry_run));
    }
    if let Some(both) = change.unset.iter().find(|field| set.contains_key(*field)) {
        bail!("{both} is both set and unset: give one");
    }
    let before = store.retention_settings(tenant).await?;
    let stored = if set.is_empty() && change.unset.is_empty() {
        before.clone()
    } else {
        warn_if_it_holds_nothing(store, tenant).await?;
        let unset: Vec<&str> = change.unset.iter().map(String::as_str).collect();
        Some(store.change_retention_settings(tenant, &set, &unset, "runbook").await?)
    };
    // A tenant without settings has none to change: unsetting a field it never set changes nothing.
    let fields = |settings: &Option<Value>| settings.clone().unwrap_or_else(|| json!({}));
    let changed = fields(&stored) != fields(&before);
    let (policy, warnings) = RetentionPolicy::for_tenant(tenant.as_str(), stored.as_ref(), settings.defaults);
    if json {
        println!(
            "{}",
            json!({ "tenant": tenant.as_str(), "changed": changed, "settings": stored,
                "policy": { "soft_ttl_days": policy.soft_ttl_days, "superseded_ttl_days": policy.superseded_ttl_days,
                            "batch_size": policy.batch_size, "dry_run": policy.dry_run },
                "warnings": warnings })
        );
        return Ok(());
    }
    match stored.as_ref().and_then(Value::as_object).filter(|fields| !fields.is_empty()) {
        Some(fields) => {
            let fields: Vec<String> = fields.iter().map(|(k, v)| format!("{k} {v}")).collect();
            println!("tenant {tenant} sets {}", fields.join(", "));
        }
        None => println!("tenant {tenant} sets no retention field of its own"),
    }
    println!(
        "in force (this shell's MNEMO_ANONYMIZE_* for the rest): soft TTL {} days, superseded TTL {} days, \
         batches of {}, dry run {}",
        policy.soft_ttl_days,
        policy.superseded_ttl_days,
        policy.batch_size,
        if policy.dry_run { "on" } else { "off" }
    );
    for warning in &warnings {
        println!("  warning: {warning}");
    }
    Ok(())
}

/// `mnemo-runbook erase`: every row carrying the user, anonymized now.
pub async fn erase(
    store: &Store,
    settings: &RetentionSettings,
    tenant: &TenantId,
    user: &UserId,
    dry_run: bool,
    force: bool,
    json: bool,
) -> anyhow::Result<()> {
    let (policy, warnings) = store.retention_policy(tenant, settings.defaults).await?;
    for warning in &warnings {
        eprintln!("warning: {warning}");
    }
    // An audit row would read as the erasure of someone whose id was mistyped; a dry run, the
    // operator's check, gives the answer the run would.
    if !force {
        let plan = store.erasure_plan(tenant, user).await?;
        let hash = user.sha256();
        if let Some(at) = store.unfinished_erasure(tenant, &hash).await? {
            let finishing = if dry_run { "the run finishes it" } else { "finishing it" };
            eprintln!("an erasure of user {user} began at {at} and did not finish: {finishing}");
        } else if plan.rows() == 0 && plan.workspace_files == 0 && plan.other_records == 0 {
            let Some(at) = store.last_erasure(tenant, &hash).await? else {
                anyhow::bail!(
                    "no row or workspace file of tenant {tenant} carries user {user}, who was never erased: check \
                     the id (--force erases and audits anyway)"
                );
            };
            if json {
                let nothing = ErasureReport {
                    plan: ErasurePlan::default(),
                    dry_run,
                    anonymized: Default::default(),
                    elapsed: Default::default(),
                };
                println!("{}", erasure_json(&nothing, Some(at)));
            } else {
                println!("user {user} of tenant {tenant} was erased at {at}; nothing carries them since");
            }
            return Ok(());
        }
    }
    let mut progress = Progress::new("erased");
    let report = mnemo_jobs::erase_user(store, tenant, user, policy.batch_size, dry_run, "runbook", |done, total| {
        progress.update(done, total)
    })
    .await?;
    progress.finish();
    if json {
        println!("{}", erasure_json(&report, None));
        return Ok(());
    }
    let plan = &report.plan;
    let kinds: Vec<String> = plan.rows_by_kind.iter().map(|(k, n)| format!("{k} {n}")).collect();
    println!(
        "user {user} of tenant {tenant}: {} rows ({}), {} tool output payloads, {} vectors, {} workspace files, \
         {} other records (extraction and consolidation state, sightings)",
        plan.rows(),
        if kinds.is_empty() { "none".to_owned() } else { kinds.join(", ") },
        plan.tool_outputs,
        plan.embeddings,
        plan.workspace_files,
        plan.other_records
    );
    if dry_run {
        println!("dry run: nothing changed");
    } else {
        let rows: u64 = report.anonymized.values().sum();
        println!("erased: {rows} rows soft-deleted and anonymized in {:.1} s", report.elapsed.as_secs_f64());
    }
    Ok(())
}

/// One shape whether or not anything was erased: `already_erased_at` is set when the user was
/// erased before and nothing carries them since.
fn erasure_json(report: &ErasureReport, already_erased_at: Option<DateTime<Utc>>) -> Value {
    json!({
        "dry_run": report.dry_run,
        "rows_by_kind": report.plan.rows_by_kind,
        "rows": report.plan.rows(),
        "tool_outputs": report.plan.tool_outputs,
        "embeddings": report.plan.embeddings,
        "workspace_files": report.plan.workspace_files,
        "other_records": report.plan.other_records,
        "anonymized_by_kind": report.anonymized,
        "anonymized": report.anonymized.values().sum::<u64>(),
        "seconds": report.elapsed.as_secs_f64(),
        "already_erased_at": already_erased_at,
    })
}

/// `mnemo-runbook audit`: the audit log, newest first.
pub async fn audit(
    store: &Store,
    tenant: Option<TenantId>,
    event: Option<AuditEvent>,
    item: Option<Uuid>,
    since: Option<DateTime<Utc>>,
    limit: i64,
    json: bool,
) -> anyhow::Result<()> {
    // One more than asked for says whether there are more.
    let mut entries = store.audit_entries(&AuditFilter { tenant, event, item, since, limit: limit + 1 }).await?;
    let truncated = entries.len() as i64 > limit;
    entries.truncate(limit as usize);
    if json {
        let entries: Vec<_> = entries
            .iter()
            .map(|e| {
                json!({ "id": e.id, "tenant": e.tenant_id.as_str(), "event": e.event.as_str(), "item_id": e.item_id,
                        "related_item_id": e.related_item_id, "reason": e.reason, "actor": e.actor,
                        "details": e.details, "created_at": e.created_at })
            })
            .collect();
        println!("{}", json!({ "entries": entries, "truncated": truncated }));
        return Ok(());
    }
    for e in &entries {
        let item = e.item_id.map_or("-".to_owned(), |id| id.to_string());
        let related = e.related_item_id.map_or(String::new(), |id| format!(" → {id}"));
        let details = if e.details.as_object().is_some_and(|d| !d.is_empty()) {
            format!("  {}", e.details)
        } else {
            String::new()
        };
        println!(
            "{}  {}  {:<26} {item}{related}  {}  by {}{details}",
            e.created_at.format("%Y-%m-%d %H:%M:%S%.3fZ"),
            e.tenant_id,
            e.event,
            e.reason.as_deref().unwrap_or("-"),
            e.actor
        );
    }
    if entries.is_empty() {
        println!("(no audit rows match)");
    }
    if truncated {
        println!("(the first {limit}; more match: raise --limit, or narrow with --since or --event)");
    }
    Ok(())
}
