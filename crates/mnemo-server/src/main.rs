//! `mnemo-server`: the HTTP API. Configuration comes from `MNEMO_*` environment variables.

use anyhow::Context;
use mnemo_config::{Env, ServerSettings};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    mnemo_models::keep_elementwise_ops_on_one_thread();
    let settings = ServerSettings::from_env(&Env::from_process()?)?;
    let _telemetry = mnemo_config::init_tracing(&settings.log, "mnemo-server").map_err(anyhow::Error::msg)?;
    mnemo_api::run(settings, mnemo_config::shutdown_signal()).await.context("mnemo-server failed")
}
