//! Retention: how long the safety-floor check takes on a large tenant, and how fast a sweep
//! anonymizes. One tenant of `--rows` chat rows (every fifth soft-deleted 40 days ago, so
//! `--rows / 5` are due), each retired row with a 384-dimension vector as the local model makes,
//! bulk-loaded with `Store::bulk_load` (a load, not a measurement) and then vacuumed and
//! analyzed as autovacuum would. The floor check is `Store::sweep_plan` (the counts a sweep
//! decides on), timed warm; the sweep is `mnemo_jobs::sweep_tenant`, the function the worker
//! and the runbook run. Then two users of the same tenant are erased with
//! `mnemo_jobs::erase_user` (the runbook's `erase`): one whose `--erase-messages` messages have
//! no replies, and one each of whose messages an agent's reply follows (taken with it), so the
//! cost of finding the replies is a ratio of the same run.

use std::time::{Duration, Instant};

use chrono::{DateTime, TimeDelta, Utc};
use mnemo_config::{Env, RetentionSettings};
use mnemo_core::{MemoryText, RetentionPolicy, Scope, SessionId, SourceKind, SourceRef, TenantId, UserId};
use mnemo_jobs::{SweepOptions, sweep_tenant};
use mnemo_store::BulkRow;
use serde_json::json;
use uuid::Uuid;

use crate::embedding::fresh;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Rows in the tenant; a fifth of them are due.
    #[arg(long, default_value_t = 1_000_000)]
    rows: u64,
    /// Rows anonymized per transaction.
    #[arg(long, default_value_t = 100)]
    batch_size: u32,
    /// Times the floor check is repeated.
    #[arg(long, default_value_t = 5)]
    checks: usize,
    /// Messages of each of the two users erased after the sweep.
    #[arg(long, default_value_t = 20_000)]
    erase_messages: u64,
    #[arg(long)]
    json: bool,
}

const TENANT: &str = "bench";
/// The two users erased after the sweep, and whether an agent's reply follows each message.
const ERASED_USERS: [(&str, bool); 2] = [("erased-plain", false), ("erased-replied", true)];
const LOAD_BATCH: u64 = 50_000;
/// The local model's name and dimension: retired rows carry a vector as it makes them.
const MODEL: &str = "all-MiniLM-L6-v2";
const DIMENSIONS: usize = 384;
const TOPICS: [&str; 5] = [
    "the quarterly report",
    "a flight to Lisbon",
    "the vet visit for the cat",
    "database migrations",
    "a birthday dinner",
];

/// Row `i` of the tenant: a chat message written 60 days ago; every fifth was soft-deleted 40
/// days ago and keeps its vector until a sweep anonymizes it.
fn row(tenant: &TenantId, now: DateTime<Utc>, i: u64) -> anyhow::Result<BulkRow> {
    let deleted = i.is_multiple_of(5);
    Ok(BulkRow {
        // Ids in load order, as the write path's time-ordered ids would be.
        id: Uuid::from_u128((1 << 120) | u128::from(i)),
        tenant: tenant.clone(),
        scope: Scope::Session,
        session: Some(SessionId::parse(&format!("session-{}", i % 1000))?),
        user: Some(UserId::parse(&format!("user-{}", i % 5000))?),
        agent: None,
        kind: SourceKind::ChatMessage,
        source_ref: SourceRef::parse(&format!("msg-{i}"))?,
        content: MemoryText::parse(&format!(
            "message {i} about {}, written the way people write to an assistant, with a few more words",
            TOPICS[(i % 5) as usize]
        ))?,
        created_at: Some(now - TimeDelta::days(60)),
        deleted_at: deleted.then(|| now - TimeDelta::days(40)),
        vector: deleted.then(|| vec![0.05; DIMENSIONS]),
    })
}

/// Message `i` of an erased user's conversations (50 sessions of their own, a message every
/// minute a month ago), and with `replied` the agent's reply right after it, carrying no user.
fn conversation(
    tenant: &TenantId,
    now: DateTime<Utc>,
    user: &str,
    i: u64,
    replied: bool,
) -> anyhow::Result<Vec<BulkRow>> {
    let at = now - TimeDelta::days(30) + TimeDelta::minutes(i as i64);
    let session = Some(SessionId::parse(&format!("{user}-session-{}", i % 50))?);
    let row = |n: u128, who: Option<UserId>, text: String, at| -> anyhow::Result<BulkRow> {
        Ok(BulkRow {
            id: Uuid::from_u128((2 << 120) | (u128::from(i) << 2) | n | if replied { 1 << 100 } else { 0 }),
            tenant: tenant.clone(),
            scope: Scope::Session,
            session: session.clone(),
            user: who,
            agent: None,
            kind: SourceKind::ChatMessage,
            source_ref: SourceRef::parse(&format!("{user}-{i}-{n}"))?,
            content: MemoryText::parse(&text)?,
            created_at: Some(at),
            deleted_at: None,
            vector: Some(vec![0.05; DIMENSIONS]),
        })
    };
    let mut rows =
        vec![row(0, Some(UserId::parse(user)?), format!("{user} says {i} about {}", TOPICS[(i % 5) as usize]), at)?];
    if replied {
        rows.push(row(1, None, format!("noted, {user}: {i}"), at + TimeDelta::seconds(1))?);
    }
    Ok(rows)
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let env = Env::from_process()?;
    let (url, store) = fresh(&env).await?;
    let tenant = TenantId::parse(TENANT)?;

    let started = Instant::now();
    let now = Utc::now();
    for start in (1..=args.rows).step_by(LOAD_BATCH as usize) {
        let end = (start + LOAD_BATCH - 1).min(args.rows);
        let rows = (start..=end).map(|i| row(&tenant, now, i)).collect::<anyhow::Result<Vec<_>>>()?;
        store.bulk_load(MODEL, &rows).await?;
        eprintln!("loaded {end}/{} rows ({:.0} s)", args.rows, started.elapsed().as_secs_f64());
    }
    for (user, replied) in ERASED_USERS {
        let mut rows = Vec::new();
        for i in 0..args.erase_messages {
            rows.extend(conversation(&tenant, now, user, i, replied)?);
        }
        store.bulk_load(MODEL, &rows).await?;
    }
    store.vacuum_analyze_memories().await?;
    let load = started.elapsed();
    eprintln!("loaded and vacuumed in {:.0} s", load.as_secs_f64());

    let tenant = TenantId::parse(TENANT)?;
    let policy = RetentionPolicy { batch_size: args.batch_size, ..RetentionPolicy::default() };
    let mut checks = Vec::new();
    let mut plan = None;
    for _ in 0..args.checks.max(1) {
        let t = Instant::now();
        plan = Some(store.sweep_plan(&tenant, &policy).await?);
        checks.push(t.elapsed());
    }
    let plan = plan.ok_or_else(|| anyhow::anyhow!("no floor check ran"))?;
    checks.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    eprintln!(
        "floor check: {} due of {} rows, median {:.1} ms",
        plan.due(),
        plan.tenant_rows,
        ms(checks[checks.len() / 2])
    );

    store.set_retention_settings(&tenant, &json!({ "batch_size": args.batch_size })).await?;
    let settings = RetentionSettings::from_env(&Env::default())?;
    let mut options = SweepOptions::new(&settings, "bench");
    options.allow_large = Some(plan.due());
    let mut reported = Instant::now();
    let report = sweep_tenant(&store, &tenant, &options, |done, due| {
        if reported.elapsed() >= Duration::from_secs(10) {
            reported = Instant::now();
            eprintln!("swept {done}/{due}");
        }
    })
    .await?;
    let swept = report.anonymized_total();
    let seconds = report.elapsed.as_secs_f64();
    let left = store.sweep_plan(&tenant, &policy).await?.due();
    anyhow::ensure!(swept == plan.due() && left == 0, "swept {swept} of {} due, {left} left", plan.due());

    let mut erasures = Vec::new();
    for (user, replied) in ERASED_USERS {
        let user = UserId::parse(user)?;
        let report = mnemo_jobs::erase_user(&store, &tenant, &user, args.batch_size, false, "bench", |_, _| {}).await?;
        let erased: u64 = report.anonymized.values().sum();
        let left = store.erasure_plan(&tenant, &user).await?.rows();
        let expected = args.erase_messages * if replied { 2 } else { 1 };
        anyhow::ensure!(left == 0 && erased == expected, "{erased} rows of {user} erased, {left} left");
        let seconds = report.elapsed.as_secs_f64();
        eprintln!("erased {user}: {erased} rows in {seconds:.1} s");
        erasures.push(json!({ "user": user.as_str(), "rows": erased, "seconds": seconds,
                              "rows_per_second": erased as f64 / seconds }));
    }

    let result = json!({
        "database": url,
        "tenant_rows": plan.tenant_rows,
        "due": plan.due(),
        "floor_check_ms": { "min": ms(checks[0]), "median": ms(checks[checks.len() / 2]),
                            "max": ms(checks[checks.len() - 1]) },
        "batch_size": args.batch_size,
        "swept": swept,
        "sweep_seconds": seconds,
        "rows_per_second": swept as f64 / seconds,
        "over_floor": report.over_floor,
        "load_seconds": load.as_secs_f64(),
        "erasures": erasures,
    });
    if args.json {
        println!("{result}");
    } else {
        println!("tenant rows        {}", plan.tenant_rows);
        println!("due                {}", plan.due());
        println!(
            "floor check        min {:.1} ms, median {:.1} ms, max {:.1} ms ({} runs)",
            ms(checks[0]),
            ms(checks[checks.len() / 2]),
            ms(checks[checks.len() - 1]),
            checks.len()
        );
        println!(
            "sweep              {swept} rows in {seconds:.1} s at batch {}: {:.0} rows/s",
            args.batch_size,
            swept as f64 / seconds
        );
        for e in &erasures {
            println!(
                "erase {:<15}{} rows in {:.1} s at batch {}: {:.0} rows/s",
                e["user"].as_str().unwrap_or_default(),
                e["rows"],
                e["seconds"].as_f64().unwrap_or_default(),
                args.batch_size,
                e["rows_per_second"].as_f64().unwrap_or_default()
            );
        }
    }
    Ok(())
}
