//! Many tenants against one real `mnemo-server` (the release binary beside this one): each
//! tenant writes a row and recalls once, with the per-tenant rate limit on, and the server's
//! resident memory is read from `/proc` as the tenants add up. Whatever mnemo keeps per tenant in
//! memory (the rate limiter's buckets, access tracking) must stay bounded: the curve flattens or
//! grows by a bounded amount per tenant, never with every request.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use mnemo_config::{DatabaseSettings, Env, vars};
use serde_json::json;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Distinct tenants.
    #[arg(long, default_value_t = 10_000)]
    tenants: usize,
    /// Resident memory is read after every this many tenants.
    #[arg(long, default_value_t = 1_000)]
    step: usize,
    /// Clients at once.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    #[arg(long)]
    json: bool,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.step > 0 && args.clients > 0, "--step and --clients must be positive");
    let env = Env::from_process()?;
    let database = DatabaseSettings::from_env(&env)?;
    let db = crate::bench_database(&database).await?;
    let secret = format!("bench-{}", uuid::Uuid::new_v4().simple());
    let server = crate::start_server(&[
        (vars::DATABASE_URL, db.url.clone()),
        (vars::JWT_SECRET, secret.clone()),
        (vars::RATE_LIMIT_PER_TENANT, "100".into()),
        (vars::LOG, "warn".into()),
    ])
    .await?;
    let pid = server.id().context("server pid")?;
    let base = server.client.base.clone();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;

    // Every tenant asks the same question, so its vector comes from the query cache after the
    // first: the run measures per-tenant state, not the embedder.
    let mut samples = vec![(0usize, crate::resident_kib(pid)?)];
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    for upto in (args.step..=args.tenants).step_by(args.step) {
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..args.clients {
            let (http, base, secret, next) = (http.clone(), base.clone(), secret.clone(), next.clone());
            tasks.spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= upto {
                        next.fetch_min(upto, Ordering::Relaxed);
                        return anyhow::Ok(());
                    }
                    let token = crate::session_token(&secret, &format!("tenant-{n}"))?;
                    let body = json!({ "source_kind": "chat_message", "source_ref": "m1",
                                       "content": format!("tenant {n} keeps its invoices in the blue folder") });
                    let r = http.post(format!("{base}/v1/memories")).bearer_auth(&token).json(&body).send().await?;
                    anyhow::ensure!(r.status().as_u16() == 201, "write answered {}", r.status());
                    let body = json!({ "query": "where are the invoices", "top_k": 5 });
                    let r = http.post(format!("{base}/v1/recall")).bearer_auth(&token).json(&body).send().await?;
                    anyhow::ensure!(r.status().as_u16() == 200, "recall answered {}", r.status());
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done??;
        }
        samples.push((upto, crate::resident_kib(pid)?));
        eprintln!("{upto} tenants, {:.0} s", started.elapsed().as_secs_f64());
    }
    server.kill().await;

    let (first, last) = (samples[1].1, samples.last().context("samples")?.1);
    let per_tenant = (last as f64 - first as f64) * 1024.0 / (args.tenants - args.step).max(1) as f64;
    if args.json {
        let points: Vec<_> = samples.iter().map(|(t, kib)| json!({ "tenants": t, "rss_kib": kib })).collect();
        println!(
            "{}",
            json!({ "scenario": "tenants", "tenants": args.tenants, "points": points,
                    "bytes_per_tenant_after_first_step": per_tenant, "seconds": started.elapsed().as_secs_f64() })
        );
        return Ok(());
    }
    println!("| tenants | server RSS MiB |\n|---:|---:|");
    for (tenants, kib) in &samples {
        println!("| {tenants} | {:.1} |", *kib as f64 / 1024.0);
    }
    println!(
        "\n{} tenants (one write and one recall each) in {:.0} s; after the first {} tenants: {per_tenant:.0} bytes per tenant",
        args.tenants,
        started.elapsed().as_secs_f64(),
        args.step
    );
    Ok(())
}
