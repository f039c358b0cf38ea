use std::collections::HashMap;
use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{FilterExt, Targets, filter_fn};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::{Env, Problems, vars};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// `MNEMO_LOG` is a tracing filter (default `info`); `MNEMO_LOG_FORMAT` is `text` or `json`.
/// Traces are exported when OpenTelemetry's standard endpoint variable is set.
#[derive(Debug, Clone)]
pub struct LogSettings {
    pub filter: String,
    pub format: LogFormat,
    pub traces: Option<TraceExport>,
}

/// Traces exported over OTLP/HTTP with protobuf to `OTEL_EXPORTER_OTLP_ENDPOINT` (+ `/v1/traces`)
/// or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`. The exporter reads the other standard variables
/// itself (`OTEL_EXPORTER_OTLP_HEADERS`, `_TIMEOUT`, `OTEL_BSP_*`, `OTEL_RESOURCE_ATTRIBUTES`).
#[derive(Debug, Clone)]
pub struct TraceExport {
    /// `OTEL_SERVICE_NAME`, or `service.name` in `OTEL_RESOURCE_ATTRIBUTES`, when set; otherwise
    /// the binary's name.
    pub service_name: Option<String>,
}

impl LogSettings {
    pub(crate) fn read(env: &Env, problems: &mut Problems) -> Self {
        // rmcp logs each /mcp message's session at info, with what the client says it is;
        // async-openai logs a provider's error and unreadable answers whole at warn and error,
        // and they may quote the input (mnemo classes and logs each failure itself).
        // A filter of the operator's own keeps async-openai off and rmcp at warn unless it
        // names them: `debug` to troubleshoot must not bring providers' answers, or whole tool
        // calls and their results, into the logs.
        let filter = match env.get(vars::LOG) {
            None => "info,rmcp=warn,async_openai=off".to_owned(),
            Some(own) => guarded_filter(own),
        };
        if let Err(e) = EnvFilter::try_new(&filter) {
            problems.0.push(format!("{}={filter:?} is not a tracing filter: {e}", vars::LOG));
        } else if let Some(word) = env.get(vars::LOG).and_then(lone_target) {
            problems.0.push(format!(
                "{}: {word:?} is a target, not a level: alone it logs that target and nothing else \
                 (levels: error, warn, info, debug, trace, off; a target beside one: warn,{word})",
                vars::LOG
            ));
        }
        let format = match env.get(vars::LOG_FORMAT) {
            None | Some("text") => LogFormat::Text,
            Some("json") => LogFormat::Json,
            Some(other) => {
                problems.0.push(format!("{}={other:?} must be text or json", vars::LOG_FORMAT));
                LogFormat::Text
            }
        };
        Self { filter, format, traces: TraceExport::read(env, problems) }
    }
}

/// The bare word of a filter that names targets only (`warning`, `verbose`, `mnemo_api`): a
/// filter with no level for the rest logs nothing else, which a misspelt level does silently.
fn lone_target(filter: &str) -> Option<&str> {
    let directives: Vec<&str> = filter.split(',').map(str::trim).filter(|d| !d.is_empty()).collect();
    let is_level = |d: &str| d.parse::<tracing_subscriber::filter::LevelFilter>().is_ok();
    if directives.iter().any(|d| is_level(d)) {
        return None;
    }
    directives.into_iter().find(|d| !d.contains(['=', '[']))
}

impl TraceExport {
    fn read(env: &Env, problems: &mut Problems) -> Option<Self> {
        let set = |name| env.get(name).is_some_and(|v| !v.trim().is_empty());
        let disabled = env.get(vars::OTEL_SDK_DISABLED).is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
        if disabled || !(set(vars::OTEL_ENDPOINT) || set(vars::OTEL_TRACES_ENDPOINT)) {
            return None;
        }
        // The traces' own variable wins over the general one, as the exporter reads them.
        let protocol = [vars::OTEL_TRACES_PROTOCOL, vars::OTEL_PROTOCOL]
            .into_iter()
            .find_map(|name| env.get(name).map(|value| (name, value)));
        if let Some((name, value)) = protocol.filter(|(_, value)| value.trim() != "http/protobuf") {
            problems.0.push(format!("{name}={value:?}: mnemo exports traces over http/protobuf only"));
        }
        let from_attributes = env.get(vars::OTEL_RESOURCE_ATTRIBUTES).and_then(|pairs| {
            pairs.split(',').find_map(|pair| pair.trim().strip_prefix("service.name=").map(str::to_owned))
        });
        Some(Self { service_name: env.get(vars::OTEL_SERVICE_NAME).map(str::to_owned).or(from_attributes) })
    }
}

/// An operator's `MNEMO_LOG` filter with rmcp kept at warn and async-openai off unless it names
/// them: at debug, rmcp logs whole tool calls and results, async-openai a provider's answers.
pub fn guarded_filter(own: &str) -> String {
    let mut filter = own.to_owned();
    if !own.contains("rmcp") {
        filter.push_str(",rmcp=warn");
    }
    if !own.contains("async_openai") {
        filter.push_str(",async_openai=off");
    }
    filter
}

/// An error with its causes, for a log line or a message: their own texts often leave them out.
pub fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// Keeps the trace exporter alive; dropping it sends the spans still buffered. Hold it until
/// `main` returns.
#[derive(Debug)]
#[must_use = "the spans still buffered are sent when this is dropped"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            tracing::warn!(error = %e, "traces still buffered could not be sent");
        }
    }
}

/// Installs the process-wide subscriber: logs to stderr, and spans to the OTLP endpoint when
/// one is configured. Call once, first thing in `main`; `service` names the binary in traces.
pub fn init_tracing(settings: &LogSettings, service: &str) -> Result<Telemetry, String> {
    let filter = EnvFilter::try_new(&settings.filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let logs = match settings.format {
        LogFormat::Text => logs.boxed(),
        LogFormat::Json => logs.json().boxed(),
    }
    // Events only: a log line carries its own fields, not the spans around it, so logs read the
    // same with traces on or off (and spans cost nothing when no exporter wants them).
    .with_filter(filter.and(filter_fn(|meta| meta.is_event())));
    let Some(export) = &settings.traces else {
        tracing_subscriber::registry().with(logs).init();
        return Ok(Telemetry { provider: None });
    };
    // The exporter's HTTP client uses rustls with ring, as the model clients do; installing it
    // fails only when another provider is in already, which is as good.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .map_err(|e| format!("cannot set up the OTLP trace exporter: {e}"))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(export.service_name.clone().unwrap_or_else(|| service.to_owned()))
        .build();
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
    // mnemo's own spans, whatever MNEMO_LOG keeps in the logs: a trace is only whole with all of
    // them, and a library's spans (sqlx, apalis, hyper) would start traces of their own.
    let spans = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("mnemo"))
        .with_filter(Targets::new().with_target("mnemo", tracing::Level::INFO));
    tracing_subscriber::registry().with(logs).with(spans).init();
    Ok(Telemetry { provider: Some(provider) })
}

/// The W3C `traceparent` of the current span, when traces are exported: what a job carries to
/// the worker that runs it.
pub fn traceparent() -> Option<String> {
    let context = Span::current().context();
    if !context.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&context, &mut carrier);
    carrier.remove("traceparent")
}

/// Makes `span` (not yet entered) continue the trace `traceparent` names, with its `tracestate`:
/// a request's caller's, or the span that queued a job. Absent or malformed, `span` starts a
/// trace of its own.
pub fn continue_trace(span: &Span, traceparent: Option<&str>, tracestate: Option<&str>) {
    let Some(traceparent) = traceparent else { return };
    let mut carrier = HashMap::from([("traceparent".to_owned(), traceparent.to_owned())]);
    if let Some(state) = tracestate {
        carrier.insert("tracestate".to_owned(), state.to_owned());
    }
    let context = TraceContextPropagator::new().extract(&carrier);
    if context.span().span_context().is_valid() {
        let _ = span.set_parent(context);
    }
}

/// A span for work done once for many callers (a group commit, a batch of rows to embed or of
/// facts to judge): a child of the first traced caller's span, linked to the others' (up to 128,
/// the SDK's limit). Its trace is the first caller's: what the batch queues continues that trace,
/// and the other callers are reached through the links.
pub fn batch_span<'a>(name: &'static str, callers: impl IntoIterator<Item = &'a Span>) -> Span {
    let mut callers = callers.into_iter().filter(|caller| !caller.is_disabled());
    let Some(first) = callers.next() else {
        return tracing::info_span!("batch", otel.name = name);
    };
    let span = tracing::info_span!(parent: first, "batch", otel.name = name);
    let mut linked = std::collections::HashSet::from([first.id()]);
    for caller in callers {
        if linked.len() == 128 {
            break;
        }
        if linked.insert(caller.id()) {
            span.follows_from(caller);
        }
    }
    span
}

/// A span for one call to a model (`operation` as OpenTelemetry's GenAI conventions name it:
/// `embeddings`, `chat`) with `inputs` texts.
pub fn model_span(operation: &'static str, model: &str, inputs: usize) -> Span {
    tracing::info_span!(
        "model",
        otel.name = %format_args!("{operation} {model}"),
        otel.kind = "client",
        gen_ai.operation.name = operation,
        gen_ai.request.model = model,
        inputs,
    )
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
/// A thread folds the histograms' samples into their summaries every few seconds: otherwise
/// they pile up until a scrape, and a deployment nobody scrapes would grow without end.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            let upkeep = handle.clone();
            let spawned = std::thread::Builder::new().name("metrics-upkeep".into()).spawn(move || {
                loop {
                    std::thread::sleep(std::time::Duration::from_secs(5));
                    upkeep.run_upkeep();
                }
            });
            if let Err(e) = spawned {
                eprintln!("cannot start the metrics upkeep thread ({e}); histograms are folded at each scrape only");
            }
            // Another recorder may be installed already (a test binary running several apps);
            // this handle then renders an empty page rather than failing the process.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(pairs: &[(&str, &str)]) -> (Option<TraceExport>, Vec<String>) {
        let mut problems = Problems::default();
        let export = TraceExport::read(&Env::from_pairs(pairs.iter().copied()), &mut problems);
        (export, problems.0)
    }

    #[test]
    fn a_log_filter_without_a_level_is_refused() {
        let problems = |filter: &str| {
            let mut problems = Problems::default();
            LogSettings::read(&Env::from_pairs([(vars::LOG, filter)]), &mut problems);
            problems.0
        };
        for fine in ["warn", "INFO", "info,mnemo_api=debug", "warn,mnemo_jobs", "mnemo_api=debug", "debug,sqlx=warn"] {
            assert_eq!(problems(fine), Vec::<String>::new(), "{fine}");
        }
        for silent in ["warning", "verbose", "mnemo_api", "7"] {
            let found = problems(silent);
            assert!(found.len() == 1 && found[0].contains("not a level"), "{silent}: {found:?}");
        }
    }

    #[test]
    fn traces_are_exported_only_to_a_configured_endpoint_over_http_protobuf() {
        assert!(read(&[]).0.is_none());
        assert!(read(&[(vars::OTEL_ENDPOINT, " ")]).0.is_none());
        let (export, problems) = read(&[(vars::OTEL_TRACES_ENDPOINT, "http://collector:4318/v1/traces")]);
        assert!(export.is_some_and(|e| e.service_name.is_none()) && problems.is_empty());
        let (export, _) = read(&[(vars::OTEL_ENDPOINT, "http://c:4318"), (vars::OTEL_SERVICE_NAME, "api-eu")]);
        assert_eq!(export.and_then(|e| e.service_name).as_deref(), Some("api-eu"));
        assert!(read(&[(vars::OTEL_ENDPOINT, "http://c:4318"), (vars::OTEL_SDK_DISABLED, "TRUE")]).0.is_none());

        let (_, problems) = read(&[(vars::OTEL_ENDPOINT, "http://c:4317"), (vars::OTEL_PROTOCOL, "grpc")]);
        assert_eq!(problems.len(), 1);
        assert!(problems[0].contains(vars::OTEL_PROTOCOL) && problems[0].contains("http/protobuf"), "{problems:?}");
        // A protocol set for other services matters only when mnemo exports.
        assert!(read(&[(vars::OTEL_PROTOCOL, "grpc")]).1.is_empty());
        // The traces' own protocol wins over the general one.
        let traces_own = [(vars::OTEL_ENDPOINT, "http://c:4318"), (vars::OTEL_PROTOCOL, "grpc")];
        assert!(read(&[&traces_own[..], &[(vars::OTEL_TRACES_PROTOCOL, "http/protobuf")]].concat()).1.is_empty());
        let (export, _) = read(&[
            (vars::OTEL_ENDPOINT, "http://c:4318"),
            (vars::OTEL_RESOURCE_ATTRIBUTES, "a=b, service.name=api-us"),
        ]);
        assert_eq!(export.and_then(|e| e.service_name).as_deref(), Some("api-us"));
    }

    #[test]
    fn an_operators_filter_keeps_async_openai_off_and_rmcp_at_warn_unless_it_names_them() {
        let filter = |log: Option<&str>| {
            let env = Env::from_pairs(log.map(|l| (vars::LOG, l)));
            LogSettings::read(&env, &mut Problems::default()).filter
        };
        assert_eq!(filter(None), "info,rmcp=warn,async_openai=off");
        assert_eq!(filter(Some("debug")), "debug,rmcp=warn,async_openai=off");
        assert_eq!(filter(Some("info,async_openai=warn")), "info,async_openai=warn,rmcp=warn");
        assert_eq!(filter(Some("debug,rmcp=debug")), "debug,rmcp=debug,async_openai=off");
    }
}
