//! Traces over OTLP: a request, the jobs it queues, the worker's batches, the model calls and
//! the statements are one trace across `mnemo-server` and `mnemo-worker`, received by the
//! testkit's OTLP/HTTP receiver as a collector would receive them.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use mnemo_config::vars;
use mnemo_testkit::{
    OtlpReceiver, ReceivedSpan, ScriptedChat, ScriptedEmbeddings, ServerProcess, TestDb, WorkerProcess, free_port,
    principal, token, wait_until,
};
use serde_json::{Value, json};

const MODEL: &str = "scripted-embed";
const DIMS: usize = 64;
/// The span the caller's `traceparent` names: the root of the trace in the server.
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// The spans of `trace` once every name in `names` has arrived (or whatever came in 30 s).
async fn trace_with(otlp: &OtlpReceiver, trace: &str, names: &[&str]) -> Vec<ReceivedSpan> {
    wait_until(Duration::from_secs(30), || async {
        let have: HashSet<String> = otlp.trace(trace).into_iter().map(|s| s.name).collect();
        names.iter().all(|n| have.contains(*n))
    })
    .await;
    otlp.trace(trace)
}

/// Asserts the trace is one tree under the caller's span, and returns each span by name.
fn one_tree(spans: &[ReceivedSpan], names: &[&str]) -> HashMap<String, ReceivedSpan> {
    let by_name: HashMap<String, ReceivedSpan> = spans.iter().map(|s| (s.name.clone(), s.clone())).collect();
    let listed: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    for name in names {
        assert!(by_name.contains_key(*name), "no span {name:?} in the trace: {listed:?}");
    }
    let ids: HashSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    for span in spans {
        assert!(
            span.parent_span_id == CALLER_SPAN || ids.contains(span.parent_span_id.as_str()),
            "{:?} hangs off a span outside the trace: {listed:?}",
            span.name
        );
    }
    by_name
}

fn parent_of<'a>(spans: &'a HashMap<String, ReceivedSpan>, child: &str) -> &'a str {
    let parent = &spans[child].parent_span_id;
    spans.values().find(|s| &s.span_id == parent).map_or("<caller>", |s| s.name.as_str())
}

async fn post(server: &ServerProcess, path: &str, who: &str, trace: &str, body: Value) -> Value {
    let response = reqwest::Client::new()
        .post(format!("{}{path}", server.client.base))
        .bearer_auth(who)
        .header("traceparent", format!("00-{trace}-{CALLER_SPAN}-01"))
        .json(&body)
        .send()
        .await
        .expect("request");
    assert!(response.status().is_success(), "{path}: {}", response.status());
    response.json().await.expect("json")
}

#[tokio::test]
async fn a_fact_its_embedding_its_judgement_and_a_recall_are_traced_end_to_end() {
    let db = TestDb::new().await;
    let otlp = OtlpReceiver::start().await;
    let provider = ScriptedEmbeddings::start(DIMS).await;
    let chat = ScriptedChat::start().await;
    let mut env = provider.env(MODEL);
    env.extend([
        (vars::OTEL_ENDPOINT, otlp.endpoint.clone()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".to_owned()),
        // Logs stay quiet: spans are exported whatever MNEMO_LOG keeps.
        (vars::LOG, "warn".to_owned()),
    ]);
    let server = ServerProcess::start_with(&db.app_url, free_port(), &env).await.expect("server");
    env.extend([(vars::JUDGE_MODEL, "scripted-judge".to_owned()), (vars::JUDGE_BASE_URL, chat.base_url.clone())]);
    let _worker = WorkerProcess::start(&db.url, &env).await.expect("worker");
    let who = token(&principal("acme", Some("u1"), None, None));

    // The older fact, judged (against nothing) before the newer one arrives.
    let tokyo =
        post(&server, "/v1/facts", &who, &"1".repeat(32), json!({ "scope": "user", "content": "I live in Tokyo" }))
            .await;
    let judged = format!(
        "SELECT count(*) FROM memory_items WHERE id = '{}' AND judge_at IS NOT NULL",
        tokyo["id"].as_str().expect("id")
    );
    assert!(
        wait_until(Duration::from_secs(30), || async { db.count(&judged).await == 1 }).await,
        "the first fact was never judged"
    );

    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    post(&server, "/v1/facts", &who, trace, json!({ "scope": "user", "content": "I live in Paris" })).await;
    let names = [
        "POST /v1/facts",
        "group commit",
        "remember_many",
        "embed job",
        "embed batch",
        "rows_to_embed",
        "embeddings scripted-embed",
        "save_vectors",
        "judge job",
        "judge batch",
        "pending_facts",
        "judge_candidates",
        "chat scripted-judge",
        "apply_judgement",
    ];
    let spans = trace_with(&otlp, trace, &names).await;
    let spans_by_name = one_tree(&spans, &names);
    let request = &spans_by_name["POST /v1/facts"];
    assert_eq!(
        (request.parent_span_id.as_str(), request.kind, request.service.as_str()),
        (CALLER_SPAN, 2, "mnemo-server")
    );
    assert_eq!(request.attributes.get("http.response.status_code").map(String::as_str), Some("201"));
    // The job continues the trace from the statement that queued it, in the other process.
    for (child, parent) in [
        ("group commit", "POST /v1/facts"),
        ("remember_many", "group commit"),
        ("embed job", "remember_many"),
        ("embed batch", "embed job"),
        ("embeddings scripted-embed", "embed batch"),
        ("judge job", "save_vectors"),
        ("judge batch", "judge job"),
        ("chat scripted-judge", "judge batch"),
    ] {
        assert_eq!(parent_of(&spans_by_name, child), parent, "the parent of {child:?}");
    }
    assert_eq!(spans_by_name["embed job"].service, "mnemo-worker");
    assert_eq!(spans_by_name["embed job"].kind, 5, "a job is a consumer span");
    assert_eq!(spans_by_name["save_vectors"].attributes.get("db.system.name").map(String::as_str), Some("postgresql"));
    assert_eq!(
        spans_by_name["chat scripted-judge"].attributes.get("gen_ai.request.model").map(String::as_str),
        Some("scripted-judge")
    );

    // A recall: its query's embedding and its searches, under the request.
    let recall_trace = "5bf92f3577b34da6a3ce929d0e0e4737";
    post(&server, "/v1/recall", &who, recall_trace, json!({ "query": "where do I live", "top_k": 5 })).await;
    let names =
        ["POST /v1/recall", "query embedding", "embeddings scripted-embed", "keyword", "vector", "recalled_rows"];
    let spans = trace_with(&otlp, recall_trace, &names).await;
    let recall = one_tree(&spans, &names);
    assert_eq!(parent_of(&recall, "query embedding"), "POST /v1/recall");
    assert_eq!(parent_of(&recall, "embeddings scripted-embed"), "query embedding");

    // Names, counts and statuses only: no content in any attribute, nor in any event (a log line).
    for span in otlp.spans() {
        let events = span.events.iter().flat_map(|(name, attributes)| {
            std::iter::once((String::from("event"), name.clone())).chain(attributes.clone())
        });
        for (key, value) in span.attributes.clone().into_iter().chain(events) {
            assert!(
                !["Tokyo", "Paris", "where do I live"].iter().any(|c| value.contains(c)),
                "{}: {key}={value}",
                span.name
            );
        }
    }
}

#[tokio::test]
async fn a_batch_for_many_requests_is_in_its_first_callers_trace_and_links_to_the_others() {
    let db = TestDb::new().await;
    let otlp = OtlpReceiver::start().await;
    let env = [
        (vars::OTEL_ENDPOINT, otlp.endpoint.clone()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".to_owned()),
        (vars::LOG, "warn".to_owned()),
    ];
    let server = ServerProcess::start_with(&db.app_url, free_port(), &env).await.expect("server");
    let who = token(&principal("acme", None, None, Some("s1")));
    // Enough writes at once that the group commit takes several of them in one batch.
    let traces: Vec<String> = (0..32).map(|i| format!("{:032x}", 0xabc000 + i)).collect();
    let mut writes = tokio::task::JoinSet::new();
    for (i, trace) in traces.iter().enumerate() {
        let request = reqwest::Client::new()
            .post(format!("{}/v1/memories", server.client.base))
            .bearer_auth(&who)
            .header("traceparent", format!("00-{trace}-{CALLER_SPAN}-01"))
            .json(&json!({ "source_kind": "chat_message", "source_ref": format!("m{i}"), "content": format!("note {i}") }));
        writes.spawn(async move { request.send().await.expect("request").status().as_u16() });
    }
    while let Some(status) = writes.join_next().await {
        assert_eq!(status.expect("task"), 201);
    }

    let request_spans: HashMap<String, String> = {
        let mut found = HashMap::new();
        wait_until(Duration::from_secs(30), || {
            found = traces
                .iter()
                .filter_map(|t| {
                    otlp.trace(t).into_iter().find(|s| s.name == "POST /v1/memories").map(|s| (t.clone(), s.span_id))
                })
                .collect();
            std::future::ready(found.len() == traces.len())
        })
        .await;
        found
    };
    assert_eq!(request_spans.len(), traces.len(), "a request span never arrived");
    let batches: Vec<ReceivedSpan> = otlp.spans().into_iter().filter(|s| s.name == "group commit").collect();
    // Each request is in exactly one batch: as the trace the batch is in, or as one of its links.
    let mut covered: Vec<&str> = Vec::new();
    for batch in &batches {
        assert!(request_spans.contains_key(&batch.trace_id), "a batch outside the requests' traces");
        assert_eq!(batch.parent_span_id, request_spans[&batch.trace_id], "a batch's parent is its first caller");
        covered.push(&batch.trace_id);
        for (trace, span) in &batch.links {
            assert_eq!(request_spans.get(trace), Some(span), "a link to something but another caller's request");
            assert_ne!(trace, &batch.trace_id, "a batch links to its own trace");
            covered.push(trace);
        }
    }
    covered.sort_unstable();
    let mut expected: Vec<&str> = traces.iter().map(String::as_str).collect();
    expected.sort_unstable();
    assert_eq!(covered, expected, "every request in one batch, once");
    assert!(batches.iter().any(|b| !b.links.is_empty()), "no batch held two requests: {} batches", batches.len());
}
