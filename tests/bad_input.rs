//! Every class of bad input gets its status and stable code, and writes nothing: no memory row,
//! no tool output, no job. One table, one server, one database.

use mnemo_api::auth::{Claims, claims_for, sign_claims};
use mnemo_testkit::{TEST_JWT_SECRET, TestApp, principal, token};
use serde_json::{Value, json};

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs()
}

struct Case {
    name: &'static str,
    path: &'static str,
    token: Option<String>,
    content_type: &'static str,
    body: Vec<u8>,
    status: u16,
    code: &'static str,
}

fn case(
    name: &'static str,
    path: &'static str,
    token: &str,
    body: impl Into<Vec<u8>>,
    status: u16,
    code: &'static str,
) -> Case {
    Case {
        name,
        path,
        token: Some(token.to_owned()),
        content_type: "application/json",
        body: body.into(),
        status,
        code,
    }
}

#[tokio::test]
async fn bad_input_is_refused_with_a_code_and_writes_nothing() {
    // A 64 KiB tool output limit leaves the workspace file's 256 KiB the largest content: the
    // body limit is three times that and 64 KiB, 832 KiB.
    let app = TestApp::spawn_with(&[("MNEMO_MAX_TOOL_OUTPUT_BYTES", "65536")]).await;
    let session = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let service = token(&principal("acme", None, None, None));
    let agent_only = token(&principal("acme", None, Some("a1"), None));
    let user_only = token(&principal("acme", Some("u1"), None, None));
    let p = principal("acme", Some("u1"), None, Some("s1"));
    let expired = sign_claims(TEST_JWT_SECRET.as_bytes(), &claims_for(&p, now() - 120)).expect("sign");
    let forged = sign_claims(b"another-secret-another-secret-another", &claims_for(&p, now() + 600)).expect("sign");
    let no_tenant =
        sign_claims(TEST_JWT_SECRET.as_bytes(), &Claims { tenant: None, ..claims_for(&p, now() + 600) }).expect("sign");
    let bad_tenant = sign_claims(
        TEST_JWT_SECRET.as_bytes(),
        &Claims { tenant: Some("a\u{7}b".into()), ..claims_for(&p, now() + 600) },
    )
    .expect("sign");
    // Signed by hand: `Claims` has no `nbf`.
    let not_yet = jsonwebtoken::encode(
        &jsonwebtoken::Header::default(),
        &json!({ "tenant": "acme", "sub": "u1", "sid": "s1", "exp": now() + 7200, "nbf": now() + 3600 }),
        &jsonwebtoken::EncodingKey::from_secret(TEST_JWT_SECRET.as_bytes()),
    )
    .expect("sign");
    let long = "x".repeat(16 * 1024 + 1);
    let chat =
        |content: &str| json!({ "source_kind": "chat_message", "source_ref": "m-1", "content": content }).to_string();

    let mut cases = vec![
        case("malformed json", "/v1/memories", &session, "{\"source_kind\": ", 400, "malformed_json"),
        case("not an object", "/v1/memories", &session, "[1, 2]", 400, "not_an_object"),
        case(
            "a key given twice",
            "/v1/memories",
            &session,
            r#"{"source_kind": "chat_message", "source_ref": "m", "content": "a", "content": "b"}"#,
            400,
            "malformed_json",
        ),
        case(
            "a key given twice in a nested object",
            "/v1/memories",
            &session,
            r#"{"source_kind": "chat_message", "source_ref": "m", "content": "a", "metadata": {"k": 1, "k": 2}}"#,
            400,
            "malformed_json",
        ),
        case(
            "invalid utf-8",
            "/v1/memories",
            &session,
            b"{\"source_kind\": \"chat_message\", \"source_ref\": \"m\", \"content\": \"\xff\xfe\"}".to_vec(),
            400,
            "invalid_utf8",
        ),
        case(
            "unknown field",
            "/v1/memories",
            &session,
            json!({ "source_kind": "chat_message", "source_ref": "m", "content": "x", "colour": "red" }).to_string(),
            400,
            "unknown_field",
        ),
        case(
            "a query on a route that reads none",
            "/v1/memories?expected_version=3",
            &session,
            chat("x"),
            400,
            "unknown_field",
        ),
        case(
            "a chat message dated ahead of the server's clock",
            "/v1/memories",
            &session,
            json!({ "source_kind": "chat_message", "source_ref": "m", "content": "x", "event_time": "2999-01-01T00:00:00Z" })
                .to_string(),
            400,
            "invalid_field",
        ),
        case(
            "a time that is not of the years 0001-9999 in UTC",
            "/v1/facts",
            &session,
            json!({ "content": "x", "scope": "user", "event_time": "9999-12-31T23:59:59-14:00" }).to_string(),
            400,
            "invalid_field",
        ),
        case(
            "a tool output naming its call by a source_ref too long for a call id",
            "/v1/memories",
            &session,
            json!({ "source_kind": "tool_output", "source_ref": "r".repeat(300), "content": "x" }).to_string(),
            400,
            "invalid_field",
        ),
        case(
            "tenant in body",
            "/v1/memories",
            &session,
            json!({ "source_kind": "chat_message", "source_ref": "m", "content": "x", "tenant": "globex" }).to_string(),
            400,
            "tenant_in_body",
        ),
        case(
            "tenant_id in a fact",
            "/v1/facts",
            &session,
            json!({ "content": "x", "scope": "user", "tenant_id": "globex" }).to_string(),
            400,
            "tenant_in_body",
        ),
        case(
            "missing field",
            "/v1/memories",
            &session,
            json!({ "source_kind": "chat_message", "content": "x" }).to_string(),
            400,
            "missing_field",
        ),
        case(
            "wrong type",
            "/v1/memories",
            &session,
            json!({ "source_kind": "chat_message", "source_ref": 7, "content": "x" }).to_string(),
            400,
            "invalid_field",
        ),
        case("empty content", "/v1/memories", &session, chat(""), 400, "empty_content"),
        case("blank content", "/v1/memories", &session, chat(" \n\t"), 400, "empty_content"),
        case("over-long chat message", "/v1/memories", &session, chat(&long), 400, "content_too_long"),
        case(
            "over-long document chunk",
            "/v1/memories",
            &service,
            json!({ "source_kind": "document_chunk", "source_ref": "d", "content": long }).to_string(),
            400,
            "content_too_long",
        ),
        case(
            "over-long fact",
            "/v1/facts",
            &session,
            json!({ "content": long, "scope": "user" }).to_string(),
            400,
            "content_too_long",
        ),
        case("nul in content", "/v1/memories", &session, chat("a\u{0}b"), 400, "nul_byte"),
        case(
            "nul in source_ref",
            "/v1/memories",
            &session,
            json!({ "source_kind": "chat_message", "source_ref": "m\u{0}", "content": "x" }).to_string(),
            400,
            "nul_byte",
        ),
        case(
            "nul in a fact's key",
            "/v1/facts",
            &session,
            json!({ "content": "x", "scope": "user", "key": "k\u{0}" }).to_string(),
            400,
            "nul_byte",
        ),
        case(
            "nul in tool_call_id",
            "/v1/memories",
            &session,
            json!({ "source_kind": "chat_message", "source_ref": "m", "content": "x", "role": "tool",
                    "tool_call_id": "c\u{0}" })
            .to_string(),
            400,
            "nul_byte",
        ),
        case(
            "the anonymized rows' ending in source_ref",
            "/v1/memories",
            &session,
            json!({ "source_kind": "chat_message", "source_ref": "m|anonymized", "content": "x" }).to_string(),
            400,
            "invalid_field",
        ),
        case(
            "the anonymized rows' ending before a '|' in source_ref",
            "/v1/memories",
            &session,
            json!({ "source_kind": "chat_message", "source_ref": "m|anonymized|1", "content": "x" }).to_string(),
            400,
            "invalid_field",
        ),
        case(
            "nul in metadata",
            "/v1/memories",
            &session,
            json!({ "source_kind": "chat_message", "source_ref": "m", "content": "x", "metadata": {"k": ["\u{0}"]} })
                .to_string(),
            400,
            "nul_byte",
        ),
        case(
            "metadata not an object",
            "/v1/memories",
            &session,
            json!({ "source_kind": "chat_message", "source_ref": "m", "content": "x", "metadata": [1] }).to_string(),
            400,
            "invalid_field",
        ),
        case(
            "unknown source_kind",
            "/v1/memories",
            &session,
            json!({ "source_kind": "email", "source_ref": "m", "content": "x" }).to_string(),
            400,
            "invalid_value",
        ),
        case(
            "fact through /v1/memories",
            "/v1/memories",
            &session,
            json!({ "source_kind": "fact", "source_ref": "m", "content": "x" }).to_string(),
            400,
            "invalid_value",
        ),
        case(
            "unknown fact scope",
            "/v1/facts",
            &session,
            json!({ "content": "x", "scope": "session" }).to_string(),
            400,
            "invalid_value",
        ),
        case(
            "empty source_ref",
            "/v1/memories",
            &session,
            json!({ "source_kind": "chat_message", "source_ref": " ", "content": "x" }).to_string(),
            400,
            "invalid_field",
        ),
        case(
            "bad event_time",
            "/v1/memories",
            &session,
            json!({ "source_kind": "chat_message", "source_ref": "m", "content": "x", "event_time": "yesterday" })
                .to_string(),
            400,
            "invalid_field",
        ),
        case("session row without a session", "/v1/memories", &service, chat("x"), 400, "missing_session"),
        case(
            "another session than the token's",
            "/v1/memories",
            &session,
            json!({ "source_kind": "chat_message", "source_ref": "m", "content": "x", "session_id": "s2" }).to_string(),
            403,
            "session_mismatch",
        ),
        case(
            "document chunk with a participant's name",
            "/v1/memories",
            &service,
            json!({ "source_kind": "document_chunk", "source_ref": "d", "content": "x", "name": "handbook" }).to_string(),
            400,
            "invalid_field",
        ),
        case(
            "document chunk with a session",
            "/v1/memories",
            &service,
            json!({ "source_kind": "document_chunk", "source_ref": "d", "content": "x", "session_id": "s1" })
                .to_string(),
            400,
            "session_not_allowed",
        ),
        case(
            "user fact without sub",
            "/v1/facts",
            &agent_only,
            json!({ "content": "x", "scope": "user" }).to_string(),
            401,
            "missing_identity",
        ),
        case(
            "agent fact without agent",
            "/v1/facts",
            &user_only,
            json!({ "content": "x", "scope": "agent" }).to_string(),
            401,
            "missing_identity",
        ),
        case("expired token", "/v1/memories", &expired, chat("x"), 401, "token_expired"),
        case("wrong signature", "/v1/memories", &forged, chat("x"), 401, "invalid_token"),
        case("token not valid for another hour (nbf)", "/v1/memories", &not_yet, chat("x"), 401, "invalid_token"),
        case("token without tenant", "/v1/memories", &no_tenant, chat("x"), 401, "invalid_token"),
        case(
            "token with a control character in the tenant",
            "/v1/memories",
            &bad_tenant,
            chat("x"),
            401,
            "invalid_token",
        ),
        case("garbage token", "/v1/memories", "not.a.jwt", chat("x"), 401, "invalid_token"),
        case(
            "a query with a token that does not verify",
            "/v1/memories?expected_version=3",
            &forged,
            chat("x"),
            401,
            "invalid_token",
        ),
        case(
            "oversized tool output",
            "/v1/memories",
            &session,
            json!({ "source_kind": "tool_output", "source_ref": "c", "content": "y".repeat(70 * 1024) }).to_string(),
            400,
            "content_too_long",
        ),
        case(
            "body over the server limit",
            "/v1/memories",
            &session,
            json!({ "source_kind": "tool_output", "source_ref": "c", "content": "y".repeat(900 * 1024) }).to_string(),
            413,
            "payload_too_large",
        ),
    ];
    cases.push(Case { token: None, ..case("no token", "/v1/memories", "", chat("x"), 401, "missing_token") });
    cases.push(Case {
        token: None,
        ..case("a query and no token", "/v1/memories?expected_version=3", "", chat("x"), 401, "missing_token")
    });
    cases.push(Case {
        content_type: "text/plain",
        ..case("not JSON content type", "/v1/memories", &session, chat("x"), 415, "unsupported_media_type")
    });

    let mut failures = Vec::new();
    for c in &cases {
        let reply = app.client.post_raw(c.path, c.token.as_deref(), c.content_type, c.body.clone()).await;
        let message = reply.body["error"]["message"].as_str().unwrap_or("");
        if reply.status != c.status || reply.code() != c.code || message.is_empty() {
            failures
                .push(format!("{}: expected {} {}, got {} {:?}", c.name, c.status, c.code, reply.status, reply.body));
        }
    }
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));

    for table in ["memory_items", "tool_outputs", "apalis.jobs", "audit_log"] {
        let rows = app.db.count(&format!("SELECT count(*) FROM {table}")).await;
        assert_eq!(rows, 0, "{table} was written by a refused request");
    }
}

/// What a body may hold depends on what the route carries: a tool output within its limit fits
/// even with every character escaped (as Python's json sends it), a query does not get the
/// room of a tool output, and a body of too many small values is refused before it is read
/// whole. A token whose `exp` has a fraction, which RFC 7519 allows, is accepted. A made-up
/// method is counted under one label.
#[tokio::test]
async fn bodies_are_held_to_what_their_route_carries() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    // 3 MiB of text (under the 4 MiB limit), 9 MiB once escaped.
    let escaped = "\\u0434".repeat(1_500_000);
    let body = format!(r#"{{"source_kind": "tool_output", "source_ref": "c1", "content": "{escaped}"}}"#);
    let reply = app.client.post_raw("/v1/memories", Some(&t), "application/json", body.into_bytes()).await;
    assert_eq!(reply.status, 201, "{:?}", reply.body);

    let query = json!({ "query": "x".repeat(300 * 1024) }).to_string();
    let reply = app.client.post_raw("/v1/recall", Some(&t), "application/json", query.into_bytes()).await;
    assert_eq!((reply.status, reply.code()), (413, "payload_too_large"));
    let message = json!({ "source_kind": "chat_message", "source_ref": "m1", "content": "x".repeat(300 * 1024) });
    let reply = app.client.post("/v1/memories", Some(&t), &message).await;
    assert_eq!((reply.status, reply.code()), (400, "content_too_long"), "a write's route takes more");

    let zeros = vec!["0"; 1_000_001].join(",");
    let body = format!(
        r#"{{"source_kind": "chat_message", "source_ref": "m2", "content": "x", "metadata": {{"n": [{zeros}]}}}}"#
    );
    let reply = app.client.post_raw("/v1/memories", Some(&t), "application/json", body.into_bytes()).await;
    assert_eq!((reply.status, reply.code()), (400, "malformed_json"), "{:?}", reply.body);
    assert!(reply.body["error"]["message"].as_str().is_some_and(|m| m.contains("values")), "{:?}", reply.body);

    let fractional = jsonwebtoken::encode(
        &jsonwebtoken::Header::default(),
        &json!({ "tenant": "acme", "sub": "u1", "sid": "s1", "exp": now() as f64 + 600.5 }),
        &jsonwebtoken::EncodingKey::from_secret(TEST_JWT_SECRET.as_bytes()),
    )
    .expect("sign");
    let reply = app.client.post("/v1/recall", Some(&fractional), &json!({ "query": "x" })).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);

    let made_up = reqwest::Method::from_bytes(b"MADEUP").expect("a method token");
    let reply = reqwest::Client::new().request(made_up, format!("{}/v1/recall", app.client.base)).send().await;
    assert!(reply.expect("an answer").status().is_client_error());
    let metrics = app.client.get("/metrics", None).await;
    let text = metrics.body.as_str().map(str::to_owned).unwrap_or_else(|| metrics.body.to_string());
    assert!(text.contains(r#"method="other""#) && !text.contains("MADEUP"), "{text}");

    // An MCP tool call's arguments are held to the same: a repeated key, too many values.
    let repeated = r#"{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "remember_fact",
        "arguments": {"content": "Alice lives in Paris", "content": "Alice lives in Lyon", "scope": "user"}}}"#;
    let call = format!(
        r#"{{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {{"name": "recall", "arguments": {{"query": "x", "pad": [{zeros}]}}}}}}"#
    );
    for body in [repeated.to_owned(), call] {
        let reply = reqwest::Client::new()
            .post(format!("{}/mcp", app.client.base))
            .bearer_auth(&t)
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("request");
        assert_eq!(reply.status().as_u16(), 400);
        let answer: Value = reply.json().await.expect("json");
        assert_eq!(answer["error"]["code"], "malformed_json", "{answer}");
    }
    assert_eq!(app.db.count("SELECT count(*) FROM memory_items WHERE source_kind = 'fact'").await, 0);

    // A GET or DELETE reads no body: fields in one are refused before anything is deleted.
    let written = app
        .client
        .post(
            "/v1/memories",
            Some(&t),
            &json!({"source_kind": "chat_message", "source_ref": "m3", "content": "keep me"}),
        )
        .await;
    let id = written.body["id"].as_str().expect("id").to_owned();
    let put = app.client.put("/v1/workspace/files/MEMORY.md", Some(&t), &json!({"content": "kept"})).await;
    assert!(matches!(put.status, 200 | 201), "{:?}", put.body);
    let with_body = |method: reqwest::Method, path: String, body: &'static str| {
        let request = reqwest::Client::new().request(method, format!("{}{path}", app.client.base));
        request.bearer_auth(&t).header("content-type", "application/json").body(body).send()
    };
    for (method, path, body, code) in [
        (reqwest::Method::DELETE, format!("/v1/memories/{id}"), r#"{"expected_version": 3}"#, "unknown_field"),
        (
            reqwest::Method::DELETE,
            "/v1/workspace/files/MEMORY.md".to_owned(),
            r#"{"tenant_id": "other"}"#,
            "tenant_in_body",
        ),
        (reqwest::Method::GET, "/v1/workspace/files/MEMORY.md".to_owned(), r#"{"version": 1}"#, "unknown_field"),
        (reqwest::Method::DELETE, format!("/v1/memories/{id}"), "not json", "malformed_json"),
    ] {
        let reply = with_body(method, path.clone(), body).await.expect("an answer");
        assert_eq!(reply.status().as_u16(), 400, "{path} {body}");
        let answer: Value = reply.json().await.expect("json");
        assert_eq!(answer["error"]["code"], code, "{path} {body}: {answer}");
    }
    assert_eq!(
        app.db.count("SELECT count(*) FROM memory_items WHERE content = 'keep me' AND deleted_at IS NULL").await,
        1
    );
    assert_eq!(
        app.db.count("SELECT count(*) FROM workspace_files WHERE path = 'MEMORY.md' AND deleted_at IS NULL").await,
        1
    );
    // An empty object is no field.
    let reply =
        with_body(reqwest::Method::GET, "/v1/workspace/files/MEMORY.md".to_owned(), "{}").await.expect("answer");
    assert_eq!(reply.status().as_u16(), 200);
}

/// A refused fact with a bad key, and routes or methods that do not exist, answer in JSON too.
#[tokio::test]
async fn unknown_routes_and_methods_answer_with_codes() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), None, None));
    let missing = app.client.get("/v1/nothing-here", Some(&t)).await;
    assert_eq!((missing.status, missing.code()), (404, "not_found"));
    let method = app.client.get("/v1/memories", Some(&t)).await;
    assert_eq!((method.status, method.code()), (405, "method_not_allowed"));
    let key = app.client.post("/v1/facts", Some(&t), &json!({ "content": "x", "scope": "user", "key": "" })).await;
    assert_eq!((key.status, key.code()), (400, "invalid_field"));
    // An empty filter is no filter: refused. A memory id in another spelling than the schema's.
    let kinds = app.client.post("/v1/recall", Some(&t), &json!({ "query": "x", "source_kinds": [] })).await;
    assert_eq!((kinds.status, kinds.code()), (400, "invalid_field"));
    let simple = uuid::Uuid::now_v7().simple().to_string();
    let id = app.client.delete(&format!("/v1/memories/{simple}"), Some(&t)).await;
    assert_eq!((id.status, id.code()), (400, "invalid_field"));
    // A path parameter that is not UTF-8 once decoded.
    let bytes = app.client.get("/v1/tool-outputs/tout_%FF", Some(&t)).await;
    assert_eq!((bytes.status, bytes.code()), (400, "invalid_field"));
    assert!(bytes.body["error"]["message"].as_str().is_some_and(|m| m.contains("key")), "{:?}", bytes.body);
    let sid = app.client.get("/v1/sessions/%FF/messages", Some(&t)).await;
    assert_eq!((sid.status, sid.code()), (400, "invalid_field"));
    assert!(sid.body["error"]["message"].as_str().is_some_and(|m| m.contains("sid")), "{:?}", sid.body);
    // A file's route lacks POST, its edit route everything else: 405 naming what they take.
    let post = app.client.post("/v1/workspace/files/MEMORY.md", Some(&t), &json!({})).await;
    assert_eq!((post.status, post.code()), (405, "method_not_allowed"));
}

/// Database failures answer 500 `internal` and say nothing about the database.
#[tokio::test]
async fn internal_errors_do_not_leak_database_details() {
    let app = TestApp::spawn().await;
    sqlx::query("ALTER TABLE memory_items RENAME TO memory_items_gone").execute(&app.db.pool).await.expect("rename");
    let t = token(&principal("acme", None, None, Some("s1")));
    let reply = app
        .client
        .post("/v1/memories", Some(&t), &json!({ "source_kind": "chat_message", "source_ref": "m", "content": "x" }))
        .await;
    assert_eq!((reply.status, reply.code()), (500, "internal"));
    let text = reply.body.to_string();
    assert!(!text.contains("memory_items") && !text.contains("relation"), "{text}");
}

/// Reads from `stream` until the peer closes it or `limit` passes; returns what arrived and
/// whether the peer closed.
async fn read_until_closed(stream: &mut tokio::net::TcpStream, limit: std::time::Duration) -> (String, bool) {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&got).into_owned(), true),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => return (String::from_utf8_lossy(&got).into_owned(), false),
        }
    }
}

#[tokio::test]
async fn slow_clients_are_cut_off() {
    use tokio::io::AsyncWriteExt;
    let app = TestApp::spawn_with(&[("MNEMO_HEADER_TIMEOUT_S", "1"), ("MNEMO_BODY_TIMEOUT_S", "1")]).await;
    let addr = app.client.base.trim_start_matches("http://").to_owned();
    let started = std::time::Instant::now();

    // One header line every 200 ms: without a header timeout this holds the connection open.
    let mut slow_head = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    slow_head.write_all(b"POST /v1/recall HTTP/1.1\r\nHost: mnemo\r\n").await.expect("write");
    let mut closed = false;
    for _ in 0..25 {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        if slow_head.write_all(b"X-Slow: y\r\n").await.is_err() {
            closed = true;
            break;
        }
    }
    if !closed {
        closed = read_until_closed(&mut slow_head, std::time::Duration::from_millis(500)).await.1;
    }
    assert!(closed, "a head trickling in for {:?} kept its connection", started.elapsed());
    assert!(started.elapsed() < std::time::Duration::from_secs(4), "closed only after {:?}", started.elapsed());

    // An idle keep-alive connection is closed by the same timeout.
    let mut idle = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    let (_, closed) = read_until_closed(&mut idle, std::time::Duration::from_secs(3)).await;
    assert!(closed, "an idle connection stayed open");

    // A body trickling in gets 408 with its code once its time is up.
    let token = token(&principal("acme", Some("u1"), None, Some("s1")));
    let slow_body = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    let (mut reader, mut writer) = slow_body.into_split();
    let head = format!(
        "POST /v1/memories HTTP/1.1\r\nHost: mnemo\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"content\": \""
    );
    writer.write_all(head.as_bytes()).await.expect("write");
    let started = std::time::Instant::now();
    let trickle = tokio::spawn(async move {
        for _ in 0..25 {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            if writer.write_all(b"xxxx").await.is_err() {
                break;
            }
        }
    });
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&reply).contains("request_timeout") && started.elapsed().as_secs() < 4 {
        use tokio::io::AsyncReadExt;
        match tokio::time::timeout(std::time::Duration::from_millis(200), reader.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => reply.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
    }
    trickle.abort();
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 408") && reply.contains("request_timeout"), "{reply}");
    assert!(started.elapsed() < std::time::Duration::from_secs(3), "408 only after {:?}", started.elapsed());
    assert_eq!(app.db.count("SELECT count(*) FROM memory_items").await, 0);
}

#[tokio::test]
async fn a_tenant_over_its_rate_gets_429_with_retry_after_and_others_do_not() {
    // One request per 2 s after a burst of 3: slow enough that a loaded machine cannot refill the
    // bucket between the requests below.
    let app = TestApp::spawn_with(&[("MNEMO_RATE_LIMIT_PER_TENANT", "0.5"), ("MNEMO_RATE_LIMIT_BURST", "3")]).await;
    let http = reqwest::Client::new();
    let get = |tenant: &str| {
        let token = token(&principal(tenant, Some("u1"), None, Some("s1")));
        http.get(format!("{}/v1/sessions/s1/messages", app.client.base)).bearer_auth(token).send()
    };
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(get("acme").await.expect("request").status().as_u16());
    }
    assert_eq!(statuses, vec![200, 200, 200, 429], "a burst of 3, then refused");
    let refused = get("acme").await.expect("request");
    assert_eq!(refused.status(), 429);
    let retry_after: u64 = refused.headers()["retry-after"].to_str().expect("ascii").parse().expect("seconds");
    assert!((1..=2).contains(&retry_after), "Retry-After {retry_after}");
    let body: serde_json::Value = refused.json().await.expect("json");
    assert_eq!(body["error"]["code"], "rate_limited");

    assert_eq!(get("globex").await.expect("request").status(), 200, "another tenant is not held back");
    tokio::time::sleep(std::time::Duration::from_secs(retry_after)).await;
    assert_eq!(get("acme").await.expect("request").status(), 200, "the bucket refills");
}

#[tokio::test]
async fn an_mcp_tool_call_costs_one_request_of_the_rate_limit() {
    let app = TestApp::spawn_with(&[("MNEMO_RATE_LIMIT_PER_TENANT", "0.5"), ("MNEMO_RATE_LIMIT_BURST", "3")]).await;
    let http = reqwest::Client::new();
    let token = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let mut answers = Vec::new();
    for id in 1..=4 {
        let call = json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": { "name": "list_files", "arguments": {} } });
        let reply = http
            .post(format!("{}/mcp", app.client.base))
            .bearer_auth(&token)
            .header("accept", "application/json, text/event-stream")
            .json(&call)
            .send()
            .await
            .expect("request");
        let status = reply.status().as_u16();
        let body: Value = reply.json().await.expect("json");
        answers.push((status, body["result"]["isError"].clone(), body["result"]["structuredContent"].clone()));
    }
    // Before, the call to the endpoint inside took a second token: the second call was refused.
    let refused = answers.pop().expect("the fourth");
    for (status, is_error, content) in &answers {
        assert_eq!((*status, is_error), (200, &json!(false)), "{answers:?}");
        assert!(content["files"].is_array(), "{answers:?}");
    }
    // The fourth is over the burst: a tool error the agent can read, with the wait in its message.
    let (status, is_error, content) = refused;
    assert_eq!((status, &is_error), (200, &json!(true)), "{content}");
    assert_eq!(content["error"]["code"], "rate_limited", "{content}");
    assert!(content["error"]["message"].as_str().is_some_and(|m| m.contains("try again in")), "{content}");
}

#[tokio::test]
async fn mcp_messages_other_than_tool_calls_cost_one_request_each() {
    let app = TestApp::spawn_with(&[("MNEMO_RATE_LIMIT_PER_TENANT", "0.5"), ("MNEMO_RATE_LIMIT_BURST", "3")]).await;
    let http = reqwest::Client::new();
    let token = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let send = |message: Value| {
        http.post(format!("{}/mcp", app.client.base))
            .bearer_auth(&token)
            .header("accept", "application/json, text/event-stream")
            .json(&message)
            .send()
    };
    // A call of no tool, and one with refused arguments, never reach the API: they are charged
    // on the way in all the same, as tools/list is (it was not charged at all before).
    let messages = [
        json!({ "jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": { "name": "nothing", "arguments": {} } }),
        json!({ "jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": { "name": "list_files", "arguments": { "limit": "x" } } }),
        json!({ "jsonrpc": "2.0", "id": 3, "method": "tools/list" }),
        json!({ "jsonrpc": "2.0", "id": 4, "method": "tools/list" }),
    ];
    let mut statuses = Vec::new();
    for message in messages {
        statuses.push(send(message).await.expect("request").status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429], "a burst of 3, then refused");
    let call = json!({ "jsonrpc": "2.0", "id": 5, "method": "tools/call",
        "params": { "name": "list_files", "arguments": {} } });
    let reply = send(call).await.expect("request");
    assert_eq!(reply.status(), 200, "a tool call is refused as a tool error");
    let body: Value = reply.json().await.expect("json");
    assert_eq!(body["result"]["structuredContent"]["error"]["code"], "rate_limited", "{body}");
}

/// A body `/mcp` refuses (a repeated key) is charged all the same: refusing it is no cheaper
/// than answering it, so it must not be a way past the limit.
#[tokio::test]
async fn a_refused_mcp_body_costs_one_request_too() {
    let app = TestApp::spawn_with(&[("MNEMO_RATE_LIMIT_PER_TENANT", "0.5"), ("MNEMO_RATE_LIMIT_BURST", "3")]).await;
    let http = reqwest::Client::new();
    let token = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let send = |body: &'static str| {
        http.post(format!("{}/mcp", app.client.base))
            .bearer_auth(&token)
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let repeated = r#"{"jsonrpc": "2.0", "id": 1, "id": 2, "method": "tools/list"}"#;
    let mut statuses = Vec::new();
    for body in [repeated, repeated, repeated, r#"{"jsonrpc": "2.0", "id": 3, "method": "tools/list"}"#] {
        statuses.push(send(body).await.expect("request").status().as_u16());
    }
    assert_eq!(statuses, [400, 400, 400, 429], "a burst of 3 spent on refused bodies");
}

/// A request refused before its handler (a query on a route that reads none, a GET with a body)
/// is charged as a handler's refusal is: refusing it must not be a way past the limit.
#[tokio::test]
async fn a_query_or_a_body_refused_before_the_handler_costs_one_request_too() {
    let app = TestApp::spawn_with(&[("MNEMO_RATE_LIMIT_PER_TENANT", "0.5"), ("MNEMO_RATE_LIMIT_BURST", "3")]).await;
    let http = reqwest::Client::new();
    let token = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let url = |path: &str| format!("{}{path}", app.client.base);
    let recall = |path: &str| http.post(url(path)).bearer_auth(&token).json(&json!({ "query": "trip" })).send();
    let with_query = recall("/v1/recall?top_k=3").await.expect("request").status().as_u16();
    let with_body = http
        .get(url("/v1/workspace/files"))
        .bearer_auth(&token)
        .header("content-type", "application/json")
        .body(r#"{"limit": 3}"#)
        .send()
        .await
        .expect("request")
        .status()
        .as_u16();
    let again = recall("/v1/recall?top_k=3").await.expect("request").status().as_u16();
    let fine = recall("/v1/recall").await.expect("request").status().as_u16();
    assert_eq!([with_query, with_body, again, fine], [400, 400, 400, 429], "a burst of 3 spent on refusals");
}

/// A client that asks for a long answer and never reads it loses its connection once a write has
/// waited the write timeout (hyper has none); and past the cap, a new connection waits until one
/// ends.
#[tokio::test]
async fn a_client_that_reads_nothing_is_cut_off_and_connections_are_capped() {
    use tokio::io::AsyncWriteExt;
    let app = TestApp::spawn_with(&[
        ("MNEMO_HEADER_TIMEOUT_S", "1"),
        ("MNEMO_WRITE_TIMEOUT_S", "1"),
        ("MNEMO_MAX_TOOL_OUTPUT_BYTES", "16777216"),
        ("MNEMO_MAX_CLIENT_CONNECTIONS", "2"),
    ])
    .await;
    let t = token(&principal("acme", Some("u1"), None, Some("s1")));
    let output = json!({ "source_kind": "tool_output", "source_ref": "big", "content": "y".repeat(12 << 20) });
    let id = app.client.post("/v1/memories", Some(&t), &output).await.body["id"].as_str().expect("id").to_owned();
    let key: String = sqlx::query_scalar("SELECT tool_output_key FROM memory_items WHERE id = $1::uuid")
        .bind(&id)
        .fetch_one(&app.db.pool)
        .await
        .expect("key");
    let addr: std::net::SocketAddr = app.client.base.trim_start_matches("http://").parse().expect("address");

    // More than the kernel's buffers hold: the server's write waits on the client.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("a small receive buffer");
    let mut reader = socket.connect(addr).await.expect("connect");
    let request = format!("GET /v1/tool-outputs/{key} HTTP/1.1\r\nHost: mnemo\r\nAuthorization: Bearer {t}\r\n\r\n");
    reader.write_all(request.as_bytes()).await.expect("write");
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let (got, closed) = read_until_closed(&mut reader, std::time::Duration::from_secs(20)).await;
    assert!(closed, "the connection stayed open");
    assert!(got.len() < 12 << 20, "the whole answer arrived ({} bytes): the write waited on", got.len());

    // Two idle connections take both places: a request waits until the header timeout closes one.
    let idle = [tokio::net::TcpStream::connect(addr).await, tokio::net::TcpStream::connect(addr).await];
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    let reply = mnemo_testkit::Client::new(app.client.base.clone()).get("/healthz", None).await;
    assert_eq!(reply.status, 200);
    assert!(started.elapsed() > std::time::Duration::from_millis(600), "served at once: {:?}", started.elapsed());
    drop(idle);
}
