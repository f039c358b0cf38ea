//! Retention: how long the safety-floor check takes on a large tenant, and how fast a sweep
//! anonymizes. One tenant of `--rows` chat rows (every fifth soft-deleted 40 days ago, so
//! `--rows / 5` are due), each retired row with a 384-dimension vector as the local model makes,
//! bulk-loaded with SQL (a load, not a measurement) and then vacuumed and analyzed as autovacuum
//! would. The floor check is `Store::sweep_plan` (the counts a sweep decides on), timed warm; the
//! sweep is `mnemo_jobs::sweep_tenant`, the function the worker and the runbook run.

use std::time::{Duration, Instant};

use mnemo_config::{Env, RetentionSettings};
use mnemo_core::{RetentionPolicy, TenantId};
use mnemo_jobs::{SweepOptions, sweep_tenant};
use serde_json::json;

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
    #[arg(long)]
    json: bool,
}

const TENANT: &str = "bench";
const LOAD_BATCH: u64 = 50_000;

pub async fn run(args: Args) -> anyhow::Result<()> {
    let env = Env::from_process();
    let (url, store) = fresh(&env).await?;
    let pool = store.pool();

    let started = Instant::now();
    for start in (1..=args.rows).step_by(LOAD_BATCH as usize) {
        let end = (start + LOAD_BATCH - 1).min(args.rows);
        sqlx::query(
            "INSERT INTO memory_items (id, tenant_id, scope, session_id, user_id, source_kind, source_ref, content,
                                       content_sha256, event_time, created_at, deleted_at, embedded_model)
             SELECT ('01' || lpad(to_hex(i), 30, '0'))::uuid, $3, 'session', 'session-' || (i % 1000),
                    'user-' || (i % 5000), 'chat_message', 'msg-' || i,
                    'message ' || i || ' about ' || (ARRAY['the quarterly report', 'a flight to Lisbon',
                        'the vet visit for the cat', 'database migrations', 'a birthday dinner'])[1 + i % 5]
                        || ', written the way people write to an assistant, with a few more words',
                    sha256(('m' || i)::bytea), now() - interval '60 days', now() - interval '60 days',
                    CASE WHEN i % 5 = 0 THEN now() - interval '40 days' END, 'all-MiniLM-L6-v2'
             FROM generate_series($1::bigint, $2::bigint) AS i",
        )
        .bind(i64::try_from(start)?)
        .bind(i64::try_from(end)?)
        .bind(TENANT)
        .execute(pool)
        .await?;
        eprintln!("loaded {end}/{} rows ({:.0} s)", args.rows, started.elapsed().as_secs_f64());
    }
    sqlx::query(
        "INSERT INTO memory_embeddings (tenant_id, item_id, model, embedding, content_sha256)
         SELECT m.tenant_id, m.id, 'all-MiniLM-L6-v2', v.embedding, m.content_sha256
         FROM memory_items m CROSS JOIN (SELECT array_fill(0.05::real, ARRAY[384])::vector AS embedding) v
         WHERE m.deleted_at IS NOT NULL",
    )
    .execute(pool)
    .await?;
    // One statement each: VACUUM cannot run inside the transaction a multi-statement string gets.
    for table in ["memory_items", "memory_embeddings"] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("VACUUM ANALYZE {table}"))).execute(pool).await?;
    }
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

    sqlx::query("INSERT INTO tenant_config (tenant_id, settings) VALUES ($1, $2)")
        .bind(TENANT)
        .bind(json!({ "memory_retention": { "batch_size": args.batch_size } }))
        .execute(pool)
        .await?;
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
    }
    Ok(())
}
