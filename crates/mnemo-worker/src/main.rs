//! `mnemo-worker`: the worker pool. Configuration comes from `MNEMO_*` environment variables;
//! `--queues` and `--listen` override `MNEMO_WORKER_QUEUES` and `MNEMO_WORKER_LISTEN`.

use anyhow::Context;
use mnemo_config::{Env, WorkerSettings, vars};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut env = Env::from_process();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let (flag, value) = match arg.split_once('=') {
            Some((flag, value)) => (flag.to_owned(), Some(value.to_owned())),
            None => (arg, None),
        };
        let var = match flag.as_str() {
            "--queues" => vars::WORKER_QUEUES,
            "--listen" => vars::WORKER_LISTEN,
            "-h" | "--help" => {
                println!(
                    "mnemo-worker [--queues embed=128,judge=40,retention=1] [--listen 127.0.0.1:9464]\nSettings: MNEMO_* variables (README)."
                );
                return Ok(());
            }
            other => anyhow::bail!("unknown argument {other:?}; try --help"),
        };
        let value = value.or_else(|| args.next()).with_context(|| format!("{flag} needs a value"))?;
        env = env.with(var, value);
    }
    let settings = WorkerSettings::from_env(&env)?;
    mnemo_config::init_tracing(&settings.log);
    let embedder = mnemo_models::embedder(&settings.embed)?;
    let judge = mnemo_models::judge(&settings.judge)?;
    mnemo_jobs::run_worker(settings, embedder, judge, mnemo_config::shutdown_signal())
        .await
        .context("mnemo-worker failed")
}
