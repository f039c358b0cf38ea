//! `mnemo-worker`: the worker pool. Configuration comes from `MNEMO_*` environment variables;
//! `--queues` and `--listen` override `MNEMO_WORKER_QUEUES` and `MNEMO_WORKER_LISTEN`.

use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use clap::builder::NonEmptyStringValueParser;
use mnemo_config::{Env, WorkerSettings, vars};

#[derive(Debug, Parser)]
#[command(
    name = "mnemo-worker",
    version,
    about = "mnemo's worker pool: embeds rows, judges facts, sweeps retention, compacts sessions. Settings: MNEMO_* variables (README)."
)]
struct Cli {
    /// Queues to serve, each with an optional concurrency, e.g. `embed,judge=60` (overrides
    /// MNEMO_WORKER_QUEUES; default: every queue, embed at 4 × MNEMO_EMBED_BATCH_SIZE, judge at
    /// 2 × MNEMO_JUDGE_BATCH_SIZE, retention at 1, compact at 8, extract at 4, consolidate at 2,
    /// access at 2). Not empty: a script's unset variable must not serve every queue.
    #[arg(long, value_name = "QUEUES", value_parser = NonEmptyStringValueParser::new())]
    queues: Option<String>,
    /// Where `/metrics` is served (overrides MNEMO_WORKER_LISTEN; default 127.0.0.1:9464).
    #[arg(long, value_name = "ADDR", value_parser = NonEmptyStringValueParser::new())]
    listen: Option<String>,
}

impl Cli {
    /// The flags as variables over `env`, so the config reports their problems with all others.
    fn apply(self, mut env: Env) -> Env {
        for (name, value) in [(vars::WORKER_QUEUES, self.queues), (vars::WORKER_LISTEN, self.listen)] {
            if let Some(value) = value {
                env = env.with(name, value);
            }
        }
        env
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    mnemo_models::keep_elementwise_ops_on_one_thread();
    let env = Cli::parse().apply(Env::from_process()?);
    let settings = WorkerSettings::from_env(&env)?;
    let _telemetry = mnemo_config::init_tracing(&settings.log, "mnemo-worker").map_err(anyhow::Error::msg)?;
    let models = mnemo_jobs::Models {
        embedder: mnemo_models::embedder(&settings.embed)?,
        judge: mnemo_models::judge(&settings.judge)?,
        summarizer: mnemo_models::summarizer(&settings.context)?,
        extractor: mnemo_models::extractor(&settings.context, settings.workspace.max_file_bytes)?,
        consolidator: mnemo_models::consolidator(&settings.context)?,
        counter: Arc::new(mnemo_models::Tokenizer::new(settings.context.tokenizer)),
    };
    mnemo_jobs::run_worker(settings, models, mnemo_config::shutdown_signal()).await.context("mnemo-worker failed")
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;
    use mnemo_core::Queue;

    use super::*;

    #[test]
    fn flags_override_their_variables_and_unknown_ones_are_refused() {
        let (judge, embed) = (Queue::Judge.as_str(), Queue::Embed.as_str());
        let cli = Cli::try_parse_from(["mnemo-worker", "--queues", judge, "--listen=0.0.0.0:9000"]).expect("valid");
        let env = cli.apply(Env::from_pairs([(vars::WORKER_QUEUES, embed), (vars::WORKER_LISTEN, "x")]));
        assert_eq!((env.get(vars::WORKER_QUEUES), env.get(vars::WORKER_LISTEN)), (Some(judge), Some("0.0.0.0:9000")));
        let kept = Cli::try_parse_from(["mnemo-worker"])
            .expect("valid")
            .apply(Env::from_pairs([(vars::WORKER_QUEUES, embed)]));
        assert_eq!(kept.get(vars::WORKER_QUEUES), Some(embed));
        let empty = Cli::try_parse_from(["mnemo-worker", "--queues", ""]).unwrap_err();
        assert_eq!(empty.kind(), ErrorKind::InvalidValue);
        let unknown = Cli::try_parse_from(["mnemo-worker", "--queue", embed]).unwrap_err();
        assert_eq!(unknown.kind(), ErrorKind::UnknownArgument);
        let help = Cli::try_parse_from(["mnemo-worker", "--help"]).unwrap_err();
        assert_eq!(help.kind(), ErrorKind::DisplayHelp);
    }
}
