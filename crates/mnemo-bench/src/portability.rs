//! Export and import of one tenant at scale, through the real `mnemo-runbook export` and
//! `import` processes: N rows are bulk-loaded into a fresh database, exported to a file, and
//! imported into another fresh database; each direction is timed and the row counts compared.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, ensure};
use mnemo_config::{Env, vars};
use mnemo_core::{MemoryText, Scope, SessionId, SourceKind, SourceRef, TenantId, UserId};
use mnemo_store::BulkRow;
use serde_json::json;
use uuid::Uuid;

use crate::embedding::fresh;

const TENANT: &str = "bench";
const LOAD_BATCH: usize = 5000;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Rows of the exported tenant.
    #[arg(long, default_value_t = 1_000_000)]
    rows: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let env = Env::from_process()?;
    let runbook = std::env::current_exe()?.with_file_name("mnemo-runbook");
    ensure!(runbook.exists(), "{} is missing: build it beside mnemo-bench (scripts/bench.sh does)", runbook.display());

    let (source, store) = fresh(&env).await?;
    // A load, not a measurement: without the full-text index, which export does not read.
    drop(store.drop_fulltext_index().await?);
    let tenant = TenantId::parse(TENANT)?;
    let (session, user) = (SessionId::parse("bench-session")?, UserId::parse("bench-user")?);
    let started = Instant::now();
    let mut batch = Vec::with_capacity(LOAD_BATCH);
    for i in 0..args.rows {
        // Chat messages of one session and facts of one user, as a tenant's memory is.
        let (scope, kind) =
            if i % 4 == 0 { (Scope::User, SourceKind::Fact) } else { (Scope::Session, SourceKind::ChatMessage) };
        batch.push(BulkRow {
            id: Uuid::now_v7(),
            tenant: tenant.clone(),
            scope,
            session: (scope == Scope::Session).then(|| session.clone()),
            user: Some(user.clone()),
            agent: None,
            kind,
            source_ref: SourceRef::parse(&format!("r{i}"))?,
            content: MemoryText::parse(&format!(
                "Row {i}: the customer asked about order {} and the refund for the spring campaign.",
                i * 7 % 100_003
            ))?,
            created_at: None,
            deleted_at: None,
            vector: None,
        });
        if batch.len() == LOAD_BATCH || i + 1 == args.rows {
            store.bulk_load("bench-model", &std::mem::take(&mut batch)).await?;
        }
    }
    eprintln!("loaded {} rows in {:.0} s", args.rows, started.elapsed().as_secs_f64());

    let file = std::env::temp_dir().join(format!("mnemo-bench-export-{}.jsonl.gz", Uuid::new_v4().simple()));
    let result = export_and_import(&env, &runbook, &source, &file, args.rows).await;
    let _ = std::fs::remove_file(&file);
    let (export_s, bytes, import_s, imported) = result?;
    ensure!(imported == args.rows as i64, "imported {imported} rows of {}", args.rows);

    let (export_rate, import_rate) = (args.rows as f64 / export_s, args.rows as f64 / import_s);
    if args.json {
        println!(
            "{}",
            json!({ "scenario": "portability", "rows": args.rows, "file_bytes": bytes,
                    "export_s": export_s, "export_rows_per_s": export_rate,
                    "import_s": import_s, "import_rows_per_s": import_rate })
        );
    } else {
        println!("| rows | file MB | export s | export rows/s | import s | import rows/s |");
        println!("|---:|---:|---:|---:|---:|---:|");
        println!(
            "| {} | {:.1} | {export_s:.1} | {export_rate:.0} | {import_s:.1} | {import_rate:.0} |",
            args.rows,
            bytes as f64 / 1e6
        );
    }
    Ok(())
}

/// Runs the export into `file` and the import into a fresh database; returns the export's
/// seconds and bytes, the import's seconds and the rows the target then holds.
async fn export_and_import(
    env: &Env,
    runbook: &PathBuf,
    source: &str,
    file: &PathBuf,
    rows: usize,
) -> anyhow::Result<(f64, u64, f64, i64)> {
    let output = std::fs::File::create(file).with_context(|| format!("creating {}", file.display()))?;
    let mut export = tokio::process::Command::new(runbook);
    export.args(["export", "--tenant", TENANT]).stdout(output);
    let export_s = timed(export, source).await?;
    let bytes = std::fs::metadata(file)?.len();
    eprintln!("exported {rows} rows in {export_s:.1} s ({:.1} MB)", bytes as f64 / 1e6);

    let (target, target_store) = fresh(env).await?;
    let mut import = tokio::process::Command::new(runbook);
    import.args(["import", "--tenant", TENANT]).arg(file);
    let import_s = timed(import, &target).await?;
    let imported = target_store.footprint("bench-model", 384).await?.memory_rows;
    Ok((export_s, bytes, import_s, imported))
}

/// Runs a runbook command against the database at `url`; returns its seconds.
async fn timed(mut command: tokio::process::Command, url: &str) -> anyhow::Result<f64> {
    let started = Instant::now();
    let status = command.env(vars::DATABASE_URL, url).status().await?;
    ensure!(status.success(), "{:?} failed: {status}", command.as_std().get_args().next().unwrap_or_default());
    Ok(started.elapsed().as_secs_f64())
}
