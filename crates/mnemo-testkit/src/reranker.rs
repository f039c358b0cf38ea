//! A scripted TEI-compatible reranker: `POST /rerank` with `{query, texts}` answered by
//! `[{index, score}, …]`. When healthy it scores each text by its position, so it reverses the
//! order it was given, which a test can see. Scripted answers fail as the test says, one per
//! request, then it is healthy again.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

#[derive(Debug, Clone)]
pub enum RerankAnswer {
    Status(u16),
    /// Sleeps this long, then answers normally.
    Hang(Duration),
    /// 200 with a body that is not a TEI answer.
    Garbage,
}

#[derive(Debug, Default)]
struct Script {
    answers: VecDeque<RerankAnswer>,
    requests: usize,
    last_request: Value,
}

#[derive(Debug, Clone)]
pub struct ScriptedReranker {
    pub base_url: String,
    script: Arc<Mutex<Script>>,
}

impl ScriptedReranker {
    pub async fn start() -> Self {
        let script = Arc::new(Mutex::new(Script::default()));
        let app = axum::Router::new().route("/rerank", axum::routing::post(rerank)).with_state(script.clone());
        let (addr, _) = crate::serve(app).await;
        Self { base_url: format!("http://{addr}"), script }
    }

    pub fn then(&self, answers: impl IntoIterator<Item = RerankAnswer>) {
        self.script.lock().expect("script").answers.extend(answers);
    }

    /// Requests served so far, and how many texts the last one carried.
    pub fn served(&self) -> (usize, usize) {
        let script = self.script.lock().expect("script");
        (script.requests, script.last_request["texts"].as_array().map_or(0, Vec::len))
    }

    /// The last request's body.
    pub fn last_request(&self) -> Value {
        self.script.lock().expect("script").last_request.clone()
    }
}

async fn rerank(State(script): State<Arc<Mutex<Script>>>, Json(body): Json<Value>) -> Response {
    let texts = body["texts"].as_array().map_or(0, Vec::len);
    let answer = {
        let mut script = script.lock().expect("script");
        script.requests += 1;
        script.last_request = body.clone();
        script.answers.pop_front()
    };
    match answer {
        Some(RerankAnswer::Status(code)) => {
            return (StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), "scripted failure")
                .into_response();
        }
        Some(RerankAnswer::Garbage) => return Json(json!({"scores": "high"})).into_response(),
        Some(RerankAnswer::Hang(delay)) => tokio::time::sleep(delay).await,
        None => {}
    }
    // TEI answers best first.
    let scores: Vec<Value> = (0..texts).rev().map(|i| json!({"index": i, "score": i as f64})).collect();
    Json(Value::Array(scores)).into_response()
}
