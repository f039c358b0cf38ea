//! The OpenAPI document: the served one is the checked-in `docs/openapi.json`, and the real
//! server, fuzzed against it by schemathesis with a real token, never answers 5xx and answers
//! only what the document says (statuses, content types, bodies; every 4xx the error-code body),
//! and refuses what breaks the document's schemas.

use mnemo_config::vars;
use mnemo_testkit::{ServerProcess, TestApp, TestDb, free_port, principal, test_python, token};

#[tokio::test]
async fn the_served_document_is_the_checked_in_one() {
    let app = TestApp::spawn().await;
    let served = app.client.get("/openapi.json", None).await;
    assert_eq!(served.status, 200);
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/openapi.json");
    let checked_in: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("docs/openapi.json")).expect("JSON");
    assert!(served.body == checked_in, "docs/openapi.json differs from what /openapi.json serves: run `make openapi`");
}

/// A value its schema allows: the first of a choice, the lower bound of a range, every property
/// of an object, an array of one item.
fn sample(schema: &serde_json::Value) -> serde_json::Value {
    use serde_json::{Value, json};
    if let Some(first) = schema["oneOf"].as_array().and_then(|o| o.first()) {
        return sample(first);
    }
    if let Some(first) = schema["enum"].as_array().and_then(|e| e.iter().find(|v| !v.is_null())) {
        return first.clone();
    }
    let kind = match &schema["type"] {
        Value::Array(kinds) => kinds[0].as_str().unwrap_or("null"),
        kind => kind.as_str().unwrap_or("null"),
    };
    match (kind, schema["format"].as_str()) {
        ("string", Some("uuid")) => json!("0193a5b0-0000-7000-8000-000000000001"),
        ("string", Some("date-time")) => json!("2026-05-02T14:23:01Z"),
        ("string", _) => json!("sample"),
        ("integer" | "number", _) => schema.get("minimum").cloned().unwrap_or(json!(1)),
        ("boolean", _) => json!(true),
        ("array", _) => json!([sample(&schema["items"])]),
        ("object", _) => Value::Object(
            schema["properties"]
                .as_object()
                .map(|p| p.iter().map(|(name, s)| (name.clone(), sample(s))).collect())
                .unwrap_or_default(),
        ),
        _ => Value::Null,
    }
}

/// The parser takes every field the document describes: a body with all of them is never refused
/// as `unknown_field` (schemathesis' negative cases could not tell).
#[tokio::test]
async fn every_documented_field_is_one_its_endpoint_takes() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let document = mnemo_api::openapi::document();
    let mut checked = 0;
    for (path, item) in document["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("operations") {
            let Some(schema) = op.pointer("/requestBody/content/application~1json/schema") else { continue };
            let uri = path
                .replace("{sid}", "s1")
                .replace("{agent}", "a1")
                .replace("{path}", "memory%2Fsample.md")
                .replace("{id}", "0193a5b0-0000-7000-8000-000000000001");
            // Each choice of a body that is one of several shapes.
            let bodies =
                schema["oneOf"].as_array().map_or_else(|| vec![sample(schema)], |o| o.iter().map(sample).collect());
            for body in bodies {
                let reply = match method.as_str() {
                    "post" => app.client.post(&uri, Some(&t), &body).await,
                    "put" => app.client.put(&uri, Some(&t), &body).await,
                    "patch" => app.client.patch(&uri, Some(&t), &body).await,
                    other => panic!("a body on {other}"),
                };
                assert!(
                    !matches!(reply.code(), "unknown_field" | "tenant_in_body"),
                    "{method} {path} refused a documented field: {body} → {:?}",
                    reply.body
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 12, "only {checked} bodies checked");
}

/// Cases per operation: `MNEMO_FUZZ_EXAMPLES` (`make fuzz` sets 500), else a number that keeps
/// `make test` quick (a few thousand cases in all, with the coverage and stateful phases).
const DEFAULT_EXAMPLES: u32 = 50;

#[tokio::test]
async fn schemathesis_finds_nothing_against_the_real_server() {
    let python = test_python();
    let schemathesis = python.parent().expect("the venv's bin").join("schemathesis");
    let examples = std::env::var("MNEMO_FUZZ_EXAMPLES").map_or(DEFAULT_EXAMPLES, |n| n.parse().expect("a number"));
    let db = TestDb::new().await;
    // No compaction triggers: with one pending and no worker to do it, every fuzzed context call
    // waits out its whole `wait_ms` (up to 30 s), and one run took 350 s instead of 30.
    let quiet = [(vars::COMPACT_TRIGGER_RATIO, "0"), (vars::COMPACT_TRIGGER_MESSAGES, "0")];
    let server = ServerProcess::start_with(&db.app_url, free_port(), &quiet).await.expect("server starts");
    let fuzzer = principal("fuzz", Some("u1"), Some("a1"), Some("s1"));
    // schemathesis keeps its example database and reports in its working directory.
    let workdir = std::env::temp_dir().join(format!("mnemo-schemathesis-{}", std::process::id()));
    std::fs::create_dir_all(&workdir).expect("a working directory");

    let run = tokio::process::Command::new(schemathesis)
        .current_dir(&workdir)
        .arg("--config-file")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/schemathesis.toml"))
        .arg("run")
        .arg(format!("{}/openapi.json", server.client.base))
        // Every check but positive_data_acceptance: some rules are not schema-expressible (an
        // id's characters, limits in bytes, labels, one field bounded by another), so data the
        // schema allows may still be refused, with a 400 and its code.
        .args(["--checks", "all", "--exclude-checks", "positive_data_acceptance"])
        // One worker: with two, Hypothesis' lambda-source cache races between threads ("AST
        // constructor recursion depth mismatch", a runtime error of the tool, not of mnemo).
        .args(["--max-examples", &examples.to_string(), "--workers", "1", "--no-color"])
        // Hypothesis' generation-speed check trips when the suite's other tests hold the CPU.
        .args(["--suppress-health-check", "too_slow"])
        .env("MNEMO_FUZZ_TOKEN", token(&fuzzer))
        .env("MNEMO_FUZZ_SID", "s1")
        .env("MNEMO_FUZZ_AGENT", "a1")
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(std::time::Duration::from_secs(1200), run)
        .await
        .expect("schemathesis finishes within 20 minutes")
        .expect("schemathesis runs");
    let _ = std::fs::remove_dir_all(&workdir);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "schemathesis failed:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    let summary = stdout.lines().find(|l| l.contains("generated,")).unwrap_or("no summary");
    println!("schemathesis: {}", summary.trim());
}
