//! A scripted OpenAI-compatible chat server for the contradiction judge and the session
//! summarizer: `POST /v1/chat/completions` answered as the protocol does. When healthy it
//! answers by rules a test can predict: an existing fact is a duplicate when it has the new
//! fact's words in another order ("in Tokyo I live" → "I live in Tokyo"), superseded when it
//! starts with the same three words ("I live in Tokyo" → "I live in Paris"), and kept otherwise;
//! a summary says how many new messages it covered and whether it built on a previous one; an
//! extraction follows the conversation's `remember:` and `my name is` lines. Scripted answers fail
//! as a test says, one per request, or every request during an outage; a server can also refuse
//! `json_schema` for good, as some "compatible" servers do, refuse `max_tokens` and `temperature`
//! as OpenAI's reasoning models do, or answer every request after a fixed delay (for benchmarks).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// One scripted answer.
#[derive(Debug, Clone)]
pub enum ChatAnswer {
    Status(u16),
    /// This status (a 429 or 503) with `Retry-After: secs`.
    Busy {
        status: u16,
        retry_after_secs: u64,
    },
    /// Sleeps this long, then answers by the rule.
    Hang(Duration),
    /// 200 with message content that is not a judgement.
    Malformed,
    /// 200 with a page that is no chat completion at all (a gateway's maintenance page).
    GatewayPage,
    /// 200 with this message content, verbatim.
    Content(String),
    /// Decisions for labels that were never given (f90, f91, …).
    InventedIds,
    /// Keeps listing decisions until `max_tokens`, and says so (`finish_reason: length`).
    Runaway,
    /// The answer by the rule, cut by a content filter (`finish_reason: content_filter`).
    Filtered,
}

#[derive(Debug, Default)]
struct Script {
    answers: VecDeque<ChatAnswer>,
    refuse_json_schema: bool,
    reasoning_model: bool,
    delay: Duration,
    /// While set, every request gets this answer instead of the queued ones.
    outage: Option<ChatAnswer>,
    /// When set, a request without `Authorization: Bearer <key>` gets a 401, as a provider's.
    key: Option<String>,
    requests: Vec<Value>,
}

#[derive(Debug, Clone)]
pub struct ScriptedChat {
    pub base_url: String,
    script: Arc<Mutex<Script>>,
}

impl ScriptedChat {
    pub async fn start() -> Self {
        Self::start_on(0).await
    }

    /// On local port `port` (0: a free one), for a walk-through without a real model.
    pub async fn start_on(port: u16) -> Self {
        let script = Arc::new(Mutex::new(Script::default()));
        let app = axum::Router::new()
            .route("/v1/chat/completions", axum::routing::post(completions))
            .with_state(script.clone());
        let (addr, _) = crate::serve_on(port, app).await;
        Self { base_url: format!("http://{addr}/v1"), script }
    }

    /// Queues answers for the next requests, in order.
    pub fn then(&self, answers: impl IntoIterator<Item = ChatAnswer>) {
        self.script.lock().expect("script").answers.extend(answers);
    }

    /// From now on, requests that ask for `json_schema` get a 500, as one server here does.
    pub fn refuse_json_schema(&self) {
        self.script.lock().expect("script").refuse_json_schema = true;
    }

    /// From now on, requests that carry `max_tokens` or a `temperature` other than 1 get OpenAI's
    /// 400 for a reasoning model (o1, o3, gpt-5, …), in its words.
    pub fn reasoning_model(&self) {
        self.script.lock().expect("script").reasoning_model = true;
    }

    /// Every answer waits this long first.
    pub fn delay_every_answer(&self, delay: Duration) {
        self.script.lock().expect("script").delay = delay;
    }

    /// Until called again with `None`, every request gets `answer` (an outage); the queued
    /// answers wait for the outage to end.
    pub fn outage(&self, answer: Option<ChatAnswer>) {
        self.script.lock().expect("script").outage = answer;
    }

    /// From now on, a request that does not present `key` as its bearer token gets OpenAI's 401.
    pub fn expect_key(&self, key: &str) {
        self.script.lock().expect("script").key = Some(key.to_owned());
    }

    /// The request bodies received so far.
    pub fn requests(&self) -> Vec<Value> {
        self.script.lock().expect("script").requests.clone()
    }
}

/// The new fact and the labelled existing facts, from the judge's prompt.
fn prompt_facts(body: &Value) -> (String, Vec<(String, String)>) {
    let prompt = body["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default();
    let mut new_fact = String::new();
    let mut existing = Vec::new();
    let mut section = "";
    for line in prompt.lines() {
        if line.starts_with("NEW fact") {
            section = "new";
        } else if line.starts_with("EXISTING facts") {
            section = "existing";
        } else if section == "new" && !line.trim().is_empty() {
            new_fact = unquote(line);
        } else if section == "existing"
            && let Some((label, text)) = line.strip_prefix('[').and_then(|l| l.split_once("] "))
        {
            existing.push((label.to_owned(), unquote(text)));
        }
    }
    (new_fact, existing)
}

/// The text a prompt quoted (a JSON string) at the start of `quoted`; `quoted` itself if it is
/// none.
fn unquote(quoted: &str) -> String {
    serde_json::Deserializer::from_str(quoted)
        .into_iter::<String>()
        .next()
        .and_then(Result::ok)
        .unwrap_or_else(|| quoted.to_owned())
}

/// A message's text from its transcript line (`[role …] "text"`).
fn spoken(line: &str) -> String {
    line.split_once("] ").map_or_else(String::new, |(_, text)| unquote(text))
}

/// A summary a test can predict: how many new messages it covered, whether it built on a
/// previous summary, and the start of the last new message.
fn summary_of(body: &Value) -> String {
    let prompt = body["messages"][1]["content"].as_str().unwrap_or_default();
    let (previous, new) = prompt.split_once("NEW MESSAGES:\n").unwrap_or(("", prompt));
    let lines: Vec<&str> = new.lines().filter(|l| l.starts_with('[')).collect();
    let builds_on = if previous.contains("(none)") { "the start" } else { "the previous summary" };
    let last = lines.last().map(|l| format!("{}] {}", l.split(']').next().unwrap_or_default(), spoken(l)));
    let last: String = last.unwrap_or_default().chars().take(80).collect();
    format!(
        "SESSION INTENT: go on with the conversation\nSUMMARY: {} new messages since {builds_on}; last: {last}\n\
ARTIFACTS: none\nNEXT STEPS: none",
        lines.len()
    )
}

/// An extraction a test can predict, from the conversation's user lines: `remember: TEXT` (or
/// `remember KEY: TEXT`) is a user fact, `my name is NAME` updates the profile, and the daily
/// entry counts the lines and quotes the start of the last one.
fn extraction_of(body: &Value) -> Value {
    let prompt = body["messages"][1]["content"].as_str().unwrap_or_default();
    let conversation = prompt.split_once("CONVERSATION:\n").map_or("", |(_, c)| c);
    let lines: Vec<&str> = conversation.lines().filter(|l| l.starts_with('[')).collect();
    let users: Vec<String> = lines.iter().filter_map(|l| l.strip_prefix("[user] ")).map(unquote).collect();
    let facts: Vec<Value> = users
        .iter()
        .filter_map(|u| u.strip_prefix("remember"))
        .filter_map(|rest| rest.split_once(':'))
        .map(|(key, text)| {
            let key = key.trim();
            json!({ "content": text.trim(), "scope": "user", "key": if key.is_empty() { Value::Null } else { json!(key) } })
        })
        .collect();
    let name =
        users.iter().find_map(|u| u.split_once("my name is ").map(|(_, n)| n.split_whitespace().next().unwrap_or("")));
    let last: String = users.last().cloned().unwrap_or_default().chars().take(60).collect();
    json!({
        "should_update": !lines.is_empty(),
        "reason": "scripted",
        "daily_entry": format!("- {} messages; last: {last}", lines.len()),
        "profile_update": name.map_or(String::new(), |n| format!("# PROFILE.md\n\nName: {n}\n")),
        "memory_update": "",
        "facts": facts,
    })
}

/// A consolidation a test can predict: MEMORY.md names the days of the notes it read.
fn consolidation_of(body: &Value) -> Value {
    let prompt = body["messages"][1]["content"].as_str().unwrap_or_default();
    let days: Vec<&str> = prompt.lines().filter_map(|l| l.strip_prefix("### ")).collect();
    json!({
        "should_update": true,
        "reason": "scripted",
        "memory_content": format!("# MEMORY.md\n\n- consolidated {}\n", days.join(", ")),
    })
}

/// OpenAI's refusal of a request a reasoning model cannot take, as its API words it.
fn reasoning_refusal(script: &Script, body: &Value) -> Option<Value> {
    let refusal = |message: &str, param: &str, code: &str| json!({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}});
    if !script.reasoning_model {
        None
    } else if body.get("max_tokens").is_some() {
        Some(refusal(
            "Unsupported parameter: 'max_tokens' is not supported with this model. Use 'max_completion_tokens' instead.",
            "max_tokens",
            "unsupported_parameter",
        ))
    } else if body.get("temperature").is_some_and(|t| t.as_f64() != Some(1.0)) {
        Some(refusal(
            "Unsupported value: 'temperature' does not support 0 with this model. Only the default (1) value is supported.",
            "temperature",
            "unsupported_value",
        ))
    } else {
        None
    }
}

fn first_words(text: &str) -> Vec<String> {
    text.split_whitespace().take(3).map(str::to_lowercase).collect()
}

fn sorted_words(text: &str) -> Vec<String> {
    let mut words: Vec<String> = text.split_whitespace().map(str::to_lowercase).collect();
    words.sort();
    words
}

fn completion(content: &str, finish_reason: &str) -> Response {
    Json(json!({
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "created": 0,
        "model": "scripted-judge",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }))
    .into_response()
}

async fn completions(
    State(script): State<Arc<Mutex<Script>>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let (answer, refuse, delay) = {
        let mut s = script.lock().expect("script");
        s.requests.push(body.clone());
        // A refused request leaves the scripted answers for the requests that follow.
        let schema_refused = s.refuse_json_schema && body["response_format"]["type"] == "json_schema";
        let refuse = crate::provider::wrong_key(s.key.as_deref(), &headers)
            .or_else(|| {
                schema_refused.then(|| {
                    let error = json!({"error": {"message": "response_format json_schema is not supported", "type": "server_error"}});
                    (StatusCode::INTERNAL_SERVER_ERROR, error)
                })
            })
            .or_else(|| reasoning_refusal(&s, &body).map(|error| (StatusCode::BAD_REQUEST, error)));
        let answer = if refuse.is_some() {
            None
        } else if s.outage.is_some() {
            s.outage.clone()
        } else {
            s.answers.pop_front()
        };
        (answer, refuse, s.delay)
    };
    tokio::time::sleep(delay).await;
    if let Some((status, error)) = refuse {
        return (status, Json(error)).into_response();
    }
    let system = body["messages"][0]["content"].as_str().unwrap_or_default();
    let summarizing = system.contains("SESSION INTENT");
    let extracting = system.contains("should remember after a conversation");
    let consolidating = system.contains("You curate the long-term memory");
    let (new_fact, existing) = prompt_facts(&body);
    let mut finish = "stop";
    match answer {
        Some(ChatAnswer::Status(code)) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return (status, Json(json!({"error": {"message": "scripted failure", "type": "server_error"}})))
                .into_response();
        }
        Some(ChatAnswer::Busy { status, retry_after_secs }) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
            let error = Json(json!({"error": {"message": "scripted overload", "type": "server_error"}}));
            return (status, [(axum::http::header::RETRY_AFTER, retry_after_secs.to_string())], error).into_response();
        }
        Some(ChatAnswer::Hang(d)) => tokio::time::sleep(d).await,
        Some(ChatAnswer::GatewayPage) => {
            let page = "<html><body><h1>Down for maintenance</h1></body></html>";
            return (StatusCode::OK, [(axum::http::header::CONTENT_TYPE, "text/html")], page).into_response();
        }
        Some(ChatAnswer::Malformed) => return completion("{\"decisions\": [{\"id\": \"f1\", \"decis", "stop"),
        Some(ChatAnswer::Content(content)) => return completion(&content, "stop"),
        Some(ChatAnswer::InventedIds) => {
            let decisions: Vec<Value> = (0..existing.len().max(1))
                .map(|i| json!({"id": format!("f{}", 90 + i), "decision": "SUPERSEDE"}))
                .collect();
            return completion(&json!({ "decisions": decisions }).to_string(), "stop");
        }
        Some(ChatAnswer::Runaway) => {
            let decisions: Vec<Value> =
                (1..=40).map(|i| json!({"id": format!("f{i}"), "decision": "SUPERSEDE"})).collect();
            let text = json!({ "decisions": decisions }).to_string();
            let bound = body["max_tokens"].as_u64().or_else(|| body["max_completion_tokens"].as_u64());
            let limit = bound.unwrap_or(64) as usize * 3;
            return completion(&text[..limit.min(text.len())], "length");
        }
        Some(ChatAnswer::Filtered) => finish = "content_filter",
        None => {}
    }
    if summarizing {
        return completion(&summary_of(&body), finish);
    }
    if extracting {
        return completion(&extraction_of(&body).to_string(), finish);
    }
    if consolidating {
        return completion(&consolidation_of(&body).to_string(), finish);
    }
    let new_words = first_words(&new_fact);
    let decisions: Vec<Value> = existing
        .iter()
        .map(|(label, text)| {
            let decision = if sorted_words(text) == sorted_words(&new_fact) {
                "DUPLICATE"
            } else if first_words(text) == new_words {
                "SUPERSEDE"
            } else {
                "KEEP"
            };
            json!({"id": label, "decision": decision})
        })
        .collect();
    completion(&json!({ "decisions": decisions }).to_string(), finish)
}
