//! The judge's operator tools: status, the fail-open list, `judge_at` clearing, batch-size
//! tuning, and the admin view of a bucket's facts with their supersede chains.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use clap::Subcommand;
use mnemo_config::Env;
use mnemo_core::{FactScope, JudgeOutcome, Queue, TenantId};
use mnemo_store::{BatchStats, ClearSelection, FactRecord, Store};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::parse_ttl;

/// Facts `judge clear` clears a transaction: a month of judgements must not hold every fact it
/// clears locked until the last is done.
const CLEAR_BATCH: i64 = 5_000;

#[derive(Debug, Subcommand)]
pub enum JudgeCommand {
    /// Pending facts and the oldest one's age, outcomes per class over a window, the fail-open
    /// rate, and batch timings.
    Status {
        /// How far back outcomes and batches count, like 1h or 7d.
        #[arg(long, default_value = "24h", value_parser = parse_ttl)]
        window: Duration,
        #[arg(long)]
        json: bool,
    },
    /// Facts whose judge failed open (nothing was retired), newest first: ids and reasons only.
    FailOpen {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: Option<TenantId>,
        /// A time (RFC 3339) or an age like 24h.
        #[arg(long, default_value = "24h", value_parser = parse_time)]
        since: DateTime<Utc>,
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// Clear judge_at on judged live facts so the judge runs on them again (with an audit row
    /// each). Select by ids, or by outcome and time.
    #[command(group(clap::ArgGroup::new("selection").required(true).args(["ids", "outcome"])))]
    Clear {
        /// Fact ids, comma-separated or repeated.
        #[arg(long, value_delimiter = ',')]
        ids: Vec<Uuid>,
        /// An outcome: fail_open, disabled, kept, no_candidates or superseded.
        #[arg(long, requires = "since", value_parser = parse_outcome)]
        outcome: Option<JudgeOutcome>,
        /// With --outcome: judged at or after this time (RFC 3339) or age (like 24h).
        #[arg(long, requires = "outcome", value_parser = parse_time)]
        since: Option<DateTime<Utc>>,
        /// Only this tenant's facts (needed with --ids when an id is in two tenants' data).
        #[arg(long, value_parser = TenantId::parse)]
        tenant: Option<TenantId>,
        /// Say which facts would be cleared, and change nothing.
        #[arg(long)]
        dry_run: bool,
        #[arg(long)]
        json: bool,
    },
    /// Check a tenant's supersede chains against the audit log: each retired fact has exactly
    /// one supersede audit row naming its successor, which is newer and of the same bucket.
    /// Exits non-zero when one does not; also counts facts waiting for the judge and facts left
    /// failed open.
    Check {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: TenantId,
        #[arg(long)]
        json: bool,
    },
    /// Recommend a batch size from the measured judge latency, the backlog and a target drain
    /// time, and say why.
    Tune {
        /// How long the backlog may take to drain.
        #[arg(long, default_value = "5m", value_parser = parse_ttl)]
        target_drain: Duration,
        /// How far back batch timings count.
        #[arg(long, default_value = "1h", value_parser = parse_ttl)]
        window: Duration,
        /// The batch size in use now; default: MNEMO_JUDGE_BATCH_SIZE as the workers read it
        /// (the environment, then MNEMO_CONFIG_FILE), else 20.
        #[arg(long)]
        batch_size: Option<usize>,
        /// Judge workers; default: those alive now.
        #[arg(long)]
        workers: Option<usize>,
        #[arg(long)]
        json: bool,
    },
}

fn parse_outcome(raw: &str) -> Result<JudgeOutcome, String> {
    JudgeOutcome::parse(raw).ok_or_else(|| {
        let known: Vec<_> = JudgeOutcome::ALL.iter().map(|o| o.as_str()).collect();
        format!("unknown outcome {raw:?}; one of {}", known.join(", "))
    })
}

/// An RFC 3339 time, or an age like 90s, 30m, 24h or 7d (that long ago).
pub fn parse_time(raw: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(raw.trim()) {
        return Ok(t.with_timezone(&Utc));
    }
    let age = parse_ttl(raw).map_err(|_| format!("{raw:?} is neither an RFC 3339 time nor an age like 24h"))?;
    Ok(Utc::now() - chrono::Duration::from_std(age).map_err(|e| e.to_string())?)
}

pub async fn run(store: &Store, command: JudgeCommand, env: &Env) -> anyhow::Result<()> {
    // How long a worker may be silent and still count as alive.
    let alive_within = mnemo_config::orphan_timeout(env)?;
    match command {
        JudgeCommand::Status { window, json } => status(store, window, json).await,
        JudgeCommand::FailOpen { tenant, since, limit, json } => {
            // One more than asked tells whether there are more.
            let mut rows = store.fail_open_facts(tenant.as_ref(), since, limit.saturating_add(1)).await?;
            let limit = usize::try_from(limit).unwrap_or(usize::MAX);
            let truncated = rows.len() > limit;
            rows.truncate(limit);
            if json {
                let rows: Vec<_> = rows
                    .iter()
                    .map(|r| json!({"id": r.id, "tenant": r.tenant_id.as_str(), "judge_at": r.judge_at, "reason": r.reason}))
                    .collect();
                println!("{}", json!({ "since": since, "facts": rows, "truncated": truncated }));
                return Ok(());
            }
            for r in &rows {
                let reason = r.reason.as_deref().unwrap_or("-");
                println!("{}  {}  {}  {reason}", r.id, r.tenant_id, r.judge_at.to_rfc3339());
            }
            let more = if truncated { " (the first --limit; there are more)" } else { "" };
            println!("{} fail-open facts since {}{more}", rows.len(), since.to_rfc3339());
            Ok(())
        }
        JudgeCommand::Clear { ids, outcome, since, tenant, dry_run, json } => {
            let selection = match (outcome, since) {
                (Some(outcome), Some(since)) => ClearSelection::Outcome { outcome, since },
                _ if !ids.is_empty() => ClearSelection::Ids(ids),
                _ => bail!("give --ids, or --outcome with --since"),
            };
            if let Some(tenant) = &tenant {
                crate::retention::warn_if_it_holds_nothing(store, tenant).await?;
            }
            // An import into another tenant keeps its rows' ids: an id alone may name facts of
            // two tenants, and clearing both would reach past the one the operator meant.
            if let (ClearSelection::Ids(_), None) = (&selection, &tenant) {
                let mut named: Vec<(Uuid, String)> = Vec::new();
                let mut collect = |rows: &[(Uuid, String)]| named.extend_from_slice(rows);
                store.clear_judgements(&selection, None, "runbook", true, CLEAR_BATCH, &mut collect).await?;
                named.sort();
                if let Some(pair) = named.windows(2).find(|w| w[0].0 == w[1].0) {
                    bail!("fact {} is in tenants {} and {}: give --tenant", pair[0].0, pair[0].1, pair[1].1);
                }
            }
            let verb = if dry_run { "would clear" } else { "cleared" };
            let asked: Vec<Uuid> = match &selection {
                ClearSelection::Ids(asked) => asked.clone(),
                ClearSelection::Outcome { .. } => Vec::new(),
            };
            let (mut ids, mut so_far) = (Vec::new(), 0);
            let mut progress = |rows: &[(Uuid, String)]| {
                for (id, tenant) in rows {
                    ids.push(*id);
                    if !json {
                        println!("{id}  {tenant}");
                    }
                }
                so_far += rows.len();
                if rows.len() as i64 == CLEAR_BATCH {
                    eprintln!("{verb} {so_far} facts so far");
                }
            };
            let cleared = store
                .clear_judgements(&selection, tenant.as_ref(), "runbook", dry_run, CLEAR_BATCH, &mut progress)
                .await?;
            // An id pasted from another environment, or of a fact not live or not judged yet, is
            // named rather than passed over.
            let missed: Vec<Uuid> = asked.into_iter().filter(|id| !ids.contains(id)).collect();
            if json {
                println!("{}", json!({ "dry_run": dry_run, "cleared": cleared, "ids": ids, "not_cleared": missed }));
                return Ok(());
            }
            println!("{verb} judge_at on {cleared} facts{}", if dry_run { " (dry run: nothing changed)" } else { "" });
            for id in &missed {
                eprintln!(
                    "not cleared: {id} (no live fact judged so far by that id{})",
                    if tenant.is_some() { " in the tenant" } else { "" }
                );
            }
            Ok(())
        }
        JudgeCommand::Check { tenant, json } => {
            // A misspelt name would check nothing and pass.
            if !store.tenant_holds_data(&tenant).await? {
                bail!("tenant {tenant} holds no memory and no workspace file: nothing to check; is its name right?");
            }
            let check = store.supersede_integrity(&tenant).await?;
            if json {
                println!("{}", serde_json::to_value(check)?);
            } else {
                println!(
                    "{} facts, {} superseded, {} waiting for the judge, {} left failed open, {} buckets with several live facts",
                    check.facts, check.superseded, check.unjudged, check.failed_open, check.buckets_with_several_live
                );
            }
            let broken: Vec<_> = check.broken().iter().map(|(what, n)| format!("{n} {what}")).collect();
            if !broken.is_empty() {
                bail!("the supersede chains of {tenant} do not match the audit log: {}", broken.join(", "));
            }
            if !json {
                println!("the supersede chains match the audit log");
            }
            Ok(())
        }
        JudgeCommand::Tune { target_drain, window, batch_size, workers, json } => {
            let batch_size = match batch_size {
                Some(n) => n,
                None => mnemo_config::JudgeSettings::batch_size_from_env(env)?,
            };
            let status = store.judge_status(window).await?;
            let workers = match workers {
                Some(n) => n,
                None => store
                    .workers(alive_within)
                    .await?
                    .iter()
                    .filter(|w| w.alive && w.queue == Queue::Judge.as_str())
                    .count(),
            };
            let judged: i64 = status.outcomes.iter().map(|(_, n)| n).sum();
            let advice = tune(&TuneInput {
                batches: status.batches,
                backlog: status.pending,
                arrivals_per_second: judged as f64 / window.as_secs_f64(),
                target_drain,
                current: batch_size,
                workers,
            });
            if json {
                println!(
                    "{}",
                    json!({
                        "recommended_batch_size": advice.batch_size,
                        "current_batch_size": batch_size,
                        "backlog": status.pending,
                        "workers": workers,
                        "measured": advice.measured,
                        "reasons": advice.reasons,
                    })
                );
                return Ok(());
            }
            println!("recommended MNEMO_JUDGE_BATCH_SIZE={} (now {batch_size})", advice.batch_size);
            for reason in &advice.reasons {
                println!("  - {reason}");
            }
            Ok(())
        }
    }
}

async fn status(store: &Store, window: Duration, json: bool) -> anyhow::Result<()> {
    let status = store.judge_status(window).await?;
    let judged: i64 = status.outcomes.iter().map(|(_, n)| n).sum();
    let fail_open = status.outcomes.iter().find(|(o, _)| *o == JudgeOutcome::FailOpen).map_or(0, |(_, n)| *n);
    let rate = if judged > 0 { fail_open as f64 / judged as f64 } else { 0.0 };
    let b = status.batches;
    if json {
        let outcomes: serde_json::Map<String, Value> =
            status.outcomes.iter().map(|(o, n)| (o.as_str().to_owned(), json!(n))).collect();
        println!(
            "{}",
            json!({
                "window_seconds": window.as_secs(),
                "pending": status.pending,
                "oldest_pending_seconds": status.oldest_pending_seconds,
                "judged": judged,
                "outcomes": outcomes,
                "fail_open_rate": rate,
                "to_ask_again": status.to_ask_again,
                "batches": batch_json(&b),
            })
        );
        return Ok(());
    }
    let oldest = status.oldest_pending_seconds.map_or("-".to_owned(), |s| format!("{s:.1}s"));
    println!("pending: {} facts (oldest {oldest})", status.pending);
    println!("judged in the last {}: {judged}", humanize(window));
    for (outcome, n) in &status.outcomes {
        println!("  {:<14} {n:>8}", outcome.as_str());
    }
    println!("fail-open rate: {:.2}%", rate * 100.0);
    println!("failed open, to be asked again automatically: {}", status.to_ask_again);
    if b.batches > 0 {
        println!(
            "batches: {} ({} rows), mean {:.0} ms each, slowest model call per batch {:.0} ms on average, {:.1} rows/s per worker",
            b.batches, b.rows, b.mean_wall_ms, b.mean_model_max_ms, b.rows_per_second
        );
    }
    Ok(())
}

fn batch_json(b: &BatchStats) -> Value {
    json!({
        "batches": b.batches, "rows": b.rows, "model_calls": b.model_calls, "mean_wall_ms": b.mean_wall_ms,
        "mean_model_max_ms": b.mean_model_max_ms, "mean_model_call_ms": b.mean_model_call_ms,
        "rows_per_second": b.rows_per_second,
    })
}

fn humanize(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        s if s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s % 3600 == 0 => format!("{}h", s / 3600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

/// What `judge tune` knows.
#[derive(Debug, Clone)]
pub struct TuneInput {
    pub batches: BatchStats,
    pub backlog: i64,
    /// Facts judged per second over the window: the load the judge has to keep up with.
    pub arrivals_per_second: f64,
    pub target_drain: Duration,
    pub current: usize,
    pub workers: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Advice {
    pub batch_size: usize,
    pub measured: Value,
    pub reasons: Vec<String>,
}

const SIZES: [usize; 11] = [1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200];

/// The smallest batch size that drains the backlog within the target and keeps up with twice
/// the recent arrival rate, or the current size if it already does. A batch's model calls run side by side, so a batch takes about the
/// slowest call plus a per-row overhead; larger batches drain faster but put more calls in
/// flight at the model endpoint at once.
pub fn tune(input: &TuneInput) -> Advice {
    let b = &input.batches;
    let mut reasons = Vec::new();
    if b.batches == 0 || b.rows == 0 {
        reasons.push("no judge batches finished in the window, so there is nothing to measure: keep the current size, let the judge run, and ask again (or widen --window)".to_owned());
        return Advice { batch_size: input.current, measured: json!(null), reasons };
    }
    let rows_per_batch = b.rows as f64 / b.batches as f64;
    let latency_ms = b.mean_model_max_ms;
    let overhead_ms = ((b.mean_wall_ms - latency_ms) / rows_per_batch).max(0.0);
    let workers = input.workers.max(1);
    let rate =
        |size: usize| workers as f64 * size as f64 / ((latency_ms + overhead_ms * size as f64).max(1.0) / 1000.0);
    let target = input.target_drain.as_secs_f64();
    let needed = (input.backlog as f64 / target).max(input.arrivals_per_second * 2.0);
    let chosen = SIZES.iter().copied().find(|&s| rate(s) >= needed);
    reasons.push(format!(
        "measured over {} batches: the slowest model call of a batch takes {latency_ms:.0} ms on average, and each row adds {overhead_ms:.1} ms of database work",
        b.batches
    ));
    reasons.push(format!(
        "{} pending facts to drain within {:.0} s and {:.2} facts/s arriving need {needed:.2} facts/s with {workers} worker(s){}",
        input.backlog,
        target,
        input.arrivals_per_second,
        if input.workers == 0 { " (none alive; counted as one)" } else { "" }
    ));
    let size = match chosen {
        // Headroom for bursts: a size that already keeps up is kept.
        Some(smallest) if input.current >= smallest => {
            reasons.push(format!(
                "the current {} judges about {:.1} facts/s, enough; the smallest size that would do is {smallest}",
                input.current,
                rate(input.current)
            ));
            input.current
        }
        Some(size) => {
            reasons.push(format!(
                "batch size {size} judges about {:.1} facts/s; the current {} judges about {:.1}",
                rate(size),
                input.current,
                rate(input.current)
            ));
            size
        }
        None => {
            let max = SIZES[SIZES.len() - 1];
            reasons.push(format!(
                "even batch size {max} judges only about {:.1} facts/s: add judge workers, or accept a longer drain",
                rate(max)
            ));
            max
        }
    };
    if size > input.current {
        reasons.push(format!(
            "a larger batch puts up to {size} calls in flight per worker at the model endpoint: check its rate limits, and keep the judge queue's concurrency at least {size} (MNEMO_WORKER_QUEUES judge={})",
            size * 2
        ));
    } else if size < input.current {
        reasons
            .push("a smaller batch is enough, and puts fewer calls in flight at the model endpoint at once".to_owned());
    }
    let measured = json!({
        "batches": b.batches, "rows_per_batch": rows_per_batch, "slowest_call_ms": latency_ms,
        "overhead_ms_per_row": overhead_ms, "needed_rows_per_second": needed,
    });
    Advice { batch_size: size, measured, reasons }
}

/// The admin view of one bucket's facts.
pub async fn facts(
    store: &Store,
    tenant: &TenantId,
    scope: FactScope,
    identity: &str,
    as_of: Option<DateTime<Utc>>,
    include_superseded: bool,
    json: bool,
) -> anyhow::Result<()> {
    let rows = store.facts(tenant, scope, identity, as_of, include_superseded).await.context("cannot read facts")?;
    if rows.is_empty() {
        crate::retention::warn_if_it_holds_nothing(store, tenant).await?;
    }
    let successors: HashMap<Uuid, Uuid> = rows.iter().filter_map(|r| Some((r.id, r.superseded_by?))).collect();
    let chain = |r: &FactRecord| {
        let mut chain = Vec::new();
        let mut at = r.superseded_by;
        while let Some(next) = at {
            if chain.contains(&next) || chain.len() >= 100 {
                break;
            }
            chain.push(next);
            at = successors.get(&next).copied();
        }
        chain
    };
    let state = |r: &FactRecord| {
        if r.anonymized {
            "anonymized"
        } else if r.live {
            "live"
        } else {
            "superseded"
        }
    };
    if json {
        let items: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({
                    "id": r.id, "state": state(r), "live": r.live, "content": r.content, "key": r.fact_key,
                    "created_at": r.created_at, "valid_from": r.valid_from, "valid_to": r.valid_to,
                    "superseded_by": r.superseded_by, "superseded_at": r.superseded_at,
                    "judge_at": r.judge_at, "judge_outcome": r.judge_outcome, "chain": chain(r),
                })
            })
            .collect();
        println!("{}", json!({ "as_of": as_of, "facts": items }));
        return Ok(());
    }
    for r in &rows {
        let key = r.fact_key.as_deref().map(|k| format!(" [{k}]")).unwrap_or_default();
        let outcome = r.judge_outcome.as_deref().unwrap_or("pending");
        println!("{}  {:<10} judge: {outcome}{key}\n        {}", r.id, state(r), r.content);
        let chain = chain(r);
        if !chain.is_empty() {
            let links: Vec<String> = chain.iter().map(Uuid::to_string).collect();
            println!("        superseded by → {}", links.join(" → "));
        }
    }
    let when = as_of.map_or("now".to_owned(), |t| format!("as of {}", t.to_rfc3339()));
    println!("{} facts ({when})", rows.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(batches: i64, rows: i64, wall: f64, slowest: f64) -> BatchStats {
        BatchStats {
            batches,
            rows,
            model_calls: rows,
            mean_wall_ms: wall,
            mean_model_max_ms: slowest,
            ..Default::default()
        }
    }

    fn input(backlog: i64, batches: BatchStats) -> TuneInput {
        TuneInput {
            batches,
            backlog,
            arrivals_per_second: 0.0,
            target_drain: Duration::from_secs(60),
            current: 1,
            workers: 1,
        }
    }

    #[test]
    fn tune_picks_the_smallest_batch_that_drains_in_time() {
        // 200 ms calls, 1 ms per row: batch 20 does 20 / 0.22 s ≈ 91 rows/s.
        let m = stats(10, 200, 220.0, 200.0);
        // 600 in a minute needs 10/s: batch 5 (5 / 0.205 s ≈ 24/s) is the smallest that does it,
        // batch 2 (≈ 9.9/s) is not enough.
        assert_eq!(tune(&input(600, m)).batch_size, 5);
        assert_eq!(tune(&input(3000, m)).batch_size, 20);
        let hopeless = tune(&input(10_000_000, m));
        assert_eq!(hopeless.batch_size, 200);
        assert!(hopeless.reasons.iter().any(|r| r.contains("add judge workers")));
        let unmeasured = tune(&TuneInput { current: 20, ..input(600, BatchStats::default()) });
        assert_eq!(unmeasured.batch_size, 20);
        let enough = tune(&TuneInput { current: 20, ..input(600, m) });
        assert_eq!(enough.batch_size, 20, "a size that keeps up is kept");
    }

    #[test]
    fn times_are_rfc3339_or_ages() {
        assert!(parse_time("2026-11-22T10:00:00Z").is_ok());
        let hour_ago = parse_time("1h").expect("age");
        assert!((Utc::now() - hour_ago).num_seconds() >= 3599);
        assert!(parse_time("yesterday").is_err());
    }
}
