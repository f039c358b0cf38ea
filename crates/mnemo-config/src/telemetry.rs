use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

use crate::{Env, Problems, vars};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// `MNEMO_LOG` is a tracing filter (default `info`); `MNEMO_LOG_FORMAT` is `text` or `json`.
#[derive(Debug, Clone)]
pub struct LogSettings {
    pub filter: String,
    pub format: LogFormat,
}

impl LogSettings {
    pub(crate) fn read(env: &Env, problems: &mut Problems) -> Self {
        let filter = env.get(vars::LOG).unwrap_or("info").to_owned();
        if let Err(e) = EnvFilter::try_new(&filter) {
            problems.0.push(format!("{}={filter:?} is not a tracing filter: {e}", vars::LOG));
        }
        let format = match env.get(vars::LOG_FORMAT) {
            None | Some("text") => LogFormat::Text,
            Some("json") => LogFormat::Json,
            Some(other) => {
                problems.0.push(format!("{}={other:?} must be text or json", vars::LOG_FORMAT));
                LogFormat::Text
            }
        };
        Self { filter, format }
    }
}

/// Installs the process-wide subscriber, writing to stderr. Call once, first thing in `main`.
pub fn init_tracing(settings: &LogSettings) {
    let filter = EnvFilter::try_new(&settings.filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match settings.format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Resolves on SIGTERM or ctrl-c, whichever comes first.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("ctrl-c received; shutting down"),
        () = terminate => tracing::info!("SIGTERM received; shutting down"),
    }
}

/// The process-wide Prometheus recorder, installed on first use; its handle renders `/metrics`.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            // Another recorder may be installed already (a test binary running several apps);
            // this handle then renders an empty page rather than failing the process.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}
