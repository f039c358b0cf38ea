//! A scripted OpenAI-compatible embeddings server: it answers `POST /v1/embeddings` as the real
//! protocol does, and fails exactly as a test tells it to (status codes, hangs, malformed bodies,
//! wrong dimensions), one scripted answer per request, then succeeds.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use mnemo_config::vars;
use serde_json::{Value, json};

/// One scripted answer.
#[derive(Debug, Clone)]
pub enum Answer {
    Status(u16),
    /// This status (a 429 or 503) with `Retry-After: secs`.
    Busy {
        status: u16,
        retry_after_secs: u64,
    },
    /// Sleeps this long before answering normally (past the client's timeout, a timeout).
    Hang(Duration),
    Malformed,
    WrongDimension,
    /// The first input's vector one number longer, the others right.
    FirstWrongDimension,
    /// Every vector all zeros (a misbehaving endpoint).
    ZeroVectors,
    /// A well-formed answer padded past 2 MiB (a misbehaving endpoint or proxy).
    Oversized,
}

#[derive(Debug, Default)]
struct Script {
    answers: VecDeque<Answer>,
    /// While set, every request gets this answer, whatever is queued.
    outage: Option<Answer>,
    /// A request with an input containing this text gets this status, whatever the script says.
    refuse_containing: Option<(String, StatusCode)>,
    requests: usize,
    inputs: usize,
    arrivals: Vec<std::time::Instant>,
    /// The `dimensions` field of each request.
    dimensions_asked: Vec<Option<u64>>,
    /// The `model` field of each request.
    models: Vec<String>,
    /// When set, a request without `Authorization: Bearer <key>` gets a 401, as a provider's.
    key: Option<String>,
}

/// The running server.
#[derive(Debug, Clone)]
pub struct ScriptedEmbeddings {
    pub base_url: String,
    pub dimensions: usize,
    script: Arc<Mutex<Script>>,
}

impl ScriptedEmbeddings {
    pub async fn start(dimensions: usize) -> Self {
        let script = Arc::new(Mutex::new(Script::default()));
        let app = axum::Router::new()
            .route("/v1/embeddings", axum::routing::post(embeddings))
            .with_state((script.clone(), dimensions));
        let (addr, _) = crate::serve(app).await;
        Self { base_url: format!("http://{addr}/v1"), dimensions, script }
    }

    /// The settings that make mnemo embed through this server, as model `model`.
    pub fn env(&self, model: &str) -> Vec<(&'static str, String)> {
        vec![
            (vars::EMBED_PROVIDER, "openai".to_owned()),
            (vars::EMBED_MODEL, model.to_owned()),
            (vars::EMBED_DIMENSIONS, self.dimensions.to_string()),
            (vars::EMBED_BASE_URL, self.base_url.clone()),
        ]
    }

    /// Queues answers for the next requests, in order.
    pub fn then(&self, answers: impl IntoIterator<Item = Answer>) {
        self.script.lock().expect("script").answers.extend(answers);
    }

    /// From now on every request gets `answer` (a failure, a hang, garbage), until `None` ends
    /// the outage.
    pub fn outage(&self, answer: Option<Answer>) {
        self.script.lock().expect("script").outage = answer;
    }

    /// A request with an input containing `marker` is refused with 413, a permanent failure,
    /// in TEI's shape of error (not OpenAI's).
    pub fn refuse_inputs_containing(&self, marker: &str) {
        self.fail_inputs_containing(marker, 413);
    }

    /// A request with an input containing `marker` gets `status` (503: a transient failure).
    pub fn fail_inputs_containing(&self, marker: &str, status: u16) {
        let status = StatusCode::from_u16(status).expect("an HTTP status");
        self.script.lock().expect("script").refuse_containing = Some((marker.to_owned(), status));
    }

    /// The gaps between successive requests.
    pub fn gaps(&self) -> Vec<Duration> {
        let script = self.script.lock().expect("script");
        script.arrivals.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// The `dimensions` field of each request so far (`None` where it was absent).
    pub fn dimensions_asked(&self) -> Vec<Option<u64>> {
        self.script.lock().expect("script").dimensions_asked.clone()
    }

    /// From now on, a request that does not present `key` as its bearer token gets OpenAI's 401.
    pub fn expect_key(&self, key: &str) {
        self.script.lock().expect("script").key = Some(key.to_owned());
    }

    /// The `model` each request named.
    pub fn models(&self) -> Vec<String> {
        self.script.lock().expect("script").models.clone()
    }

    /// Requests served so far, and the inputs they carried.
    pub fn served(&self) -> (usize, usize) {
        let script = self.script.lock().expect("script");
        (script.requests, script.inputs)
    }
}

/// A deterministic unit-free vector: each word adds to the dimension its hash falls on, so texts
/// that share words point the same way.
pub fn bag_of_words(text: &str, dimensions: usize) -> Vec<f32> {
    let mut v = vec![0.0f32; dimensions];
    for word in text.split_whitespace() {
        let h = word
            .to_lowercase()
            .bytes()
            .fold(1469598103934665603u64, |h, b| (h ^ u64::from(b)).wrapping_mul(1099511628211));
        v[(h % dimensions as u64) as usize] += 1.0;
    }
    v[0] += 0.01; // never all zeros
    v
}

/// [`bag_of_words`] at unit length, as the embedder stores it.
pub fn unit_bag_of_words(text: &str, dimensions: usize) -> Vec<f32> {
    let mut v = bag_of_words(text, dimensions);
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter_mut().for_each(|x| *x /= norm);
    v
}

/// Gives every row without a vector the vector the scripted provider gives its content, as a
/// worker would (which also queues the judge for facts), but without a chat message's previous
/// turn.
pub async fn embed_like_the_provider(store: &mnemo_store::Store, model: &str, dimensions: usize) {
    let rows: Vec<(uuid::Uuid, String, Vec<u8>, String)> =
        sqlx::query_as("SELECT id, tenant_id, content_sha256, content FROM memory_items WHERE embedded_model IS NULL")
            .fetch_all(store.pool())
            .await
            .expect("rows");
    let vectors = rows
        .into_iter()
        .map(|(id, tenant_id, content_sha256, content)| mnemo_store::NewVector {
            id,
            tenant_id: mnemo_core::TenantId::parse(&tenant_id).expect("stored tenant"),
            content_sha256,
            embedding: unit_bag_of_words(&content, dimensions),
            previous_id: None,
        })
        .collect();
    store.save_vectors(model, vectors).await.expect("save vectors");
}

/// OpenAI's 401 for a request that does not present `key` (when one is expected).
pub(crate) fn wrong_key(key: Option<&str>, headers: &HeaderMap) -> Option<(StatusCode, Value)> {
    let key = key?;
    let presented = headers.get(AUTHORIZATION).and_then(|v| v.to_str().ok());
    (presented != Some(format!("Bearer {key}").as_str())).then(|| {
        let message = "Incorrect API key provided.";
        (
            StatusCode::UNAUTHORIZED,
            json!({"error": {"message": message, "type": "invalid_request_error", "code": "invalid_api_key"}}),
        )
    })
}

async fn embeddings(
    State((script, dimensions)): State<(Arc<Mutex<Script>>, usize)>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let inputs: Vec<String> = match &body["input"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items.iter().filter_map(|i| i.as_str().map(str::to_owned)).collect(),
        _ => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": {"message": "input required", "type": "invalid_request_error"}})),
            )
                .into_response();
        }
    };
    let (answer, refused) = {
        let mut s = script.lock().expect("script");
        s.requests += 1;
        s.inputs += inputs.len();
        s.arrivals.push(std::time::Instant::now());
        s.dimensions_asked.push(body["dimensions"].as_u64());
        s.models.push(body["model"].as_str().unwrap_or_default().to_owned());
        if let Some((status, error)) = wrong_key(s.key.as_deref(), &headers) {
            return (status, Json(error)).into_response();
        }
        let refused = s
            .refuse_containing
            .as_ref()
            .filter(|(marker, _)| inputs.iter().any(|i| i.contains(marker.as_str())))
            .map(|(_, status)| *status);
        let answer = s.outage.clone().or_else(|| s.answers.pop_front());
        (answer, refused)
    };
    if let Some(status) = refused {
        let error = json!({"error": "Input validation error: inputs must have less than 512 tokens", "error_type": "Validation"});
        return (status, Json(error)).into_response();
    }
    let (mut dims, mut zeros, mut padding, mut first_longer) = (dimensions, false, String::new(), false);
    match answer {
        Some(Answer::Status(code)) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return (status, Json(json!({"error": {"message": "scripted failure", "type": "server_error"}})))
                .into_response();
        }
        Some(Answer::Busy { status, retry_after_secs }) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::TOO_MANY_REQUESTS);
            let error = Json(json!({"error": {"message": "scripted rate limit", "type": "rate_limit_error"}}));
            return (status, [(axum::http::header::RETRY_AFTER, retry_after_secs.to_string())], error).into_response();
        }
        Some(Answer::Hang(d)) => tokio::time::sleep(d).await,
        Some(Answer::Malformed) => return (StatusCode::OK, "{\"object\": \"list\", \"data\": [").into_response(),
        Some(Answer::WrongDimension) => dims = dimensions + 1,
        Some(Answer::FirstWrongDimension) => first_longer = true,
        Some(Answer::ZeroVectors) => zeros = true,
        Some(Answer::Oversized) => padding = " ".repeat(2 << 20),
        None => {}
    }
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let dims = if first_longer && i == 0 { dims + 1 } else { dims };
            let embedding = if zeros { vec![0.0; dims] } else { bag_of_words(text, dims) };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    let usage = json!({"prompt_tokens": 0, "total_tokens": 0});
    Json(json!({"object": "list", "model": body["model"], "data": data, "usage": usage, "padding": padding}))
        .into_response()
}
