//! An OTLP/HTTP trace receiver, as the OpenTelemetry Collector serves one: `POST /v1/traces`
//! with an `ExportTraceServiceRequest` in protobuf, answered by an empty export response. It
//! keeps every span it is sent, with the service that sent it, for a test to put traces together.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use prost::Message;

/// One span as received, ids in lowercase hex (a root's `parent_span_id` is empty).
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    /// OTLP's `SpanKind`: 2 server, 3 client, 5 consumer.
    pub kind: i32,
    pub attributes: BTreeMap<String, String>,
    /// (trace id, span id) of each linked span.
    pub links: Vec<(String, String)>,
    /// Each event's name and attributes (a log line inside the span becomes one).
    pub events: Vec<(String, BTreeMap<String, String>)>,
}

#[derive(Debug, Clone)]
pub struct OtlpReceiver {
    /// What `OTEL_EXPORTER_OTLP_ENDPOINT` names (the exporter adds `/v1/traces`).
    pub endpoint: String,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
}

impl OtlpReceiver {
    pub async fn start() -> Self {
        let spans = Arc::new(Mutex::new(Vec::new()));
        let app = axum::Router::new().route("/v1/traces", axum::routing::post(export)).with_state(spans.clone());
        let (addr, _) = crate::serve(app).await;
        Self { endpoint: format!("http://{addr}"), spans }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().expect("spans").clone()
    }

    /// The spans of one trace.
    pub fn trace(&self, trace_id: &str) -> Vec<ReceivedSpan> {
        self.spans().into_iter().filter(|s| s.trace_id == trace_id).collect()
    }
}

async fn export(State(spans): State<Arc<Mutex<Vec<ReceivedSpan>>>>, headers: HeaderMap, body: Bytes) -> Response {
    if headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) != Some("application/x-protobuf") {
        return (StatusCode::UNSUPPORTED_MEDIA_TYPE, "OTLP/HTTP protobuf only").into_response();
    }
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        return (StatusCode::BAD_REQUEST, "not an ExportTraceServiceRequest").into_response();
    };
    let mut received = Vec::new();
    for resource in request.resource_spans {
        let service = resource
            .resource
            .as_ref()
            .and_then(|r| attributes(&r.attributes).remove("service.name"))
            .unwrap_or_default();
        for span in resource.scope_spans.into_iter().flat_map(|s| s.spans) {
            received.push(ReceivedSpan {
                service: service.clone(),
                name: span.name,
                trace_id: hex::encode(&span.trace_id),
                span_id: hex::encode(&span.span_id),
                parent_span_id: hex::encode(&span.parent_span_id),
                kind: span.kind,
                attributes: attributes(&span.attributes),
                links: span.links.iter().map(|l| (hex::encode(&l.trace_id), hex::encode(&l.span_id))).collect(),
                events: span.events.iter().map(|e| (e.name.clone(), attributes(&e.attributes))).collect(),
            });
        }
    }
    spans.lock().expect("spans").extend(received);
    let answer = ExportTraceServiceResponse { partial_success: None }.encode_to_vec();
    ([(header::CONTENT_TYPE, "application/x-protobuf")], answer).into_response()
}

fn attributes(pairs: &[KeyValue]) -> BTreeMap<String, String> {
    pairs.iter().map(|kv| (kv.key.clone(), kv.value.as_ref().map(text).unwrap_or_default())).collect()
}

fn text(value: &AnyValue) -> String {
    match &value.value {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}
