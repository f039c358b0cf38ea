//! Short writes beside context calls with a long system prompt: the real `mnemo-server` (the
//! release binary beside this one), one client writing short chat messages one after another,
//! and 0, 1, 2, … clients asking for a context window with a system prompt of `--bytes` back to
//! back. The context call counts the prompt's tokens, several times, in the request, and a long
//! text's count takes tenths of a second of CPU: this shows what the short writes wait
//! meanwhile. Workers are not run. With `--distinct`, each call's prompt differs from every
//! other's (as different agents' would), so no call finds its prompt's count remembered.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use mnemo_config::{DatabaseSettings, Env, vars};
use serde_json::json;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Clients asking for context windows with a long system prompt beside the short writer,
    /// per level.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,4")]
    long_callers: Vec<usize>,
    /// Bytes of the long system prompt (JSON lines, as a pasted tool answer might be).
    #[arg(long, default_value_t = 4 << 20)]
    bytes: usize,
    /// Seconds per level.
    #[arg(long, default_value_t = 15)]
    seconds: u64,
    /// Each context call's prompt begins with a number of its own, instead of every call sending
    /// the same prompt (as an agent does at each turn).
    #[arg(long)]
    distinct: bool,
    #[arg(long)]
    json: bool,
}

/// One level's figures.
#[derive(Debug)]
struct Level {
    long_callers: usize,
    long_calls: usize,
    short_per_s: f64,
    short_p50_ms: f64,
    short_p99_ms: f64,
    short_max_ms: f64,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.seconds > 0 && args.bytes > 0, "--seconds and --bytes must be above 0");
    let env = Env::from_process()?;
    let database = DatabaseSettings::from_env(&env)?;
    let db = crate::bench_database(&database).await?;
    let secret = format!("bench-{}", uuid::Uuid::new_v4().simple());
    let server_env = [
        (vars::DATABASE_URL, db.url.clone()),
        (vars::JWT_SECRET, secret.clone()),
        (vars::LOG, "warn".to_owned()),
        // The body limit follows the largest tool output.
        (vars::MAX_TOOL_OUTPUT_BYTES, (args.bytes + 1024).to_string()),
    ];
    let server = crate::start_server(&server_env).await?;
    let token = crate::session_token(&secret, "long-prompts")?;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?;
    let line = "{\"id\": 12345, \"name\": \"widget-42\", \"tags\": [\"alpha\", \"beta\"], \"note\": \"The quick brown fox jumps over the lazy dog.\"}\n";
    let payload: Arc<str> =
        line.repeat(args.bytes.div_ceil(line.len())).chars().take(args.bytes).collect::<String>().into();
    let written = Arc::new(AtomicUsize::new(0));
    let calls = Arc::new(AtomicUsize::new(0));
    let mut levels = Vec::new();
    for &long_callers in &args.long_callers {
        let deadline = Instant::now() + Duration::from_secs(args.seconds);
        let mut long = tokio::task::JoinSet::new();
        for _ in 0..long_callers {
            let (http, base, token, payload, calls) =
                (http.clone(), server.client.base.clone(), token.clone(), payload.clone(), calls.clone());
            let distinct = args.distinct;
            long.spawn(async move {
                let mut done = 0;
                while Instant::now() < deadline {
                    let prompt = if distinct {
                        format!("call {}: {payload}", calls.fetch_add(1, Ordering::Relaxed))
                    } else {
                        payload.to_string()
                    };
                    let body =
                        json!({ "max_input_tokens": 10_000_000, "system_prompt": prompt, "current_message": "go on" });
                    let r = http
                        .post(format!("{base}/v1/sessions/s/context"))
                        .bearer_auth(&token)
                        .json(&body)
                        .send()
                        .await?;
                    anyhow::ensure!(r.status().as_u16() == 200, "a context call answered {}", r.status());
                    r.bytes().await?;
                    done += 1;
                }
                anyhow::Ok(done)
            });
        }
        let mut short = Histogram::<u64>::new(3)?;
        let started = Instant::now();
        while Instant::now() < deadline {
            let n = written.fetch_add(1, Ordering::Relaxed);
            let body = json!({ "source_kind": "chat_message", "source_ref": format!("m{n}"),
                               "content": format!("note {n}: the invoices for order {} are in folder {}", n * 7, n % 13) });
            let sent = Instant::now();
            let r =
                http.post(format!("{}/v1/memories", server.client.base)).bearer_auth(&token).json(&body).send().await?;
            anyhow::ensure!(r.status().as_u16() == 201, "a short write answered {}", r.status());
            short.record(sent.elapsed().as_micros() as u64)?;
        }
        let seconds = started.elapsed().as_secs_f64();
        let mut long_calls = 0;
        while let Some(done) = long.join_next().await {
            long_calls += done??;
        }
        let ms = |q: f64| short.value_at_quantile(q) as f64 / 1000.0;
        let level = Level {
            long_callers,
            long_calls,
            short_per_s: short.len() as f64 / seconds,
            short_p50_ms: ms(0.5),
            short_p99_ms: ms(0.99),
            short_max_ms: short.max() as f64 / 1000.0,
        };
        eprintln!("{long_callers} long callers: {level:?}");
        levels.push(level);
    }
    server.kill().await;

    if args.json {
        let list: Vec<_> = levels
            .iter()
            .map(|l| {
                json!({ "long_callers": l.long_callers, "long_calls": l.long_calls, "short_per_s": l.short_per_s,
                        "short_p50_ms": l.short_p50_ms, "short_p99_ms": l.short_p99_ms, "short_max_ms": l.short_max_ms })
            })
            .collect();
        println!(
            "{}",
            json!({ "scenario": "long-prompts", "bytes": args.bytes, "seconds": args.seconds,
                    "distinct": args.distinct, "levels": list })
        );
        return Ok(());
    }
    println!(
        "| callers with a long prompt | context calls answered | short writes/s | short p50 / p99 / max ms |\n|---:|---:|---:|---:|"
    );
    for l in &levels {
        println!(
            "| {} | {} | {:.0} | {:.1} / {:.1} / {:.1} |",
            l.long_callers, l.long_calls, l.short_per_s, l.short_p50_ms, l.short_p99_ms, l.short_max_ms
        );
    }
    let prompts = if args.distinct { "a prompt of its own at each call" } else { "the same prompt at every call" };
    println!("\n{} bytes of system prompt, {prompts}, {} s a level.", args.bytes, args.seconds);
    Ok(())
}
