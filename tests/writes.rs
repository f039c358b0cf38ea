//! The write path over HTTP against a real PostgreSQL: idempotency, scopes, facts, elided tool
//! outputs, tenant isolation, and the embed job that travels with each new row.

use mnemo_core::MAX_CONTENT_BYTES;
use mnemo_testkit::{TestApp, principal, token};
use serde_json::{Value, json};
use sqlx::Row;

fn chat(source_ref: &str, content: &str) -> Value {
    json!({ "source_kind": "chat_message", "source_ref": source_ref, "content": content })
}

#[tokio::test]
async fn a_repeated_write_finds_its_row() {
    let app = TestApp::spawn().await;
    let token = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));

    let first = app.client.post("/v1/memories", Some(&token), &chat("m-1", "hello there")).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(first.body["was_new"], true);
    let second = app.client.post("/v1/memories", Some(&token), &chat("m-1", "hello there")).await;
    assert_eq!(second.status, 200, "{:?}", second.body);
    assert_eq!(second.body["was_new"], false);
    assert_eq!(first.body["id"], second.body["id"]);

    assert_eq!(app.db.count("SELECT count(*) FROM memory_items").await, 1);
    assert_eq!(app.db.count("SELECT count(*) FROM apalis.jobs").await, 1, "only the new row queued a job");
}

#[tokio::test]
async fn sixteen_concurrent_duplicates_land_on_one_row() {
    let app = TestApp::spawn().await;
    let token = token(&principal("acme", None, None, Some("s1")));
    let writes = (0..16).map(|_| {
        let client = app.client.clone();
        let token = token.clone();
        tokio::spawn(async move { client.post("/v1/memories", Some(&token), &chat("dup", "same words")).await })
    });
    let mut replies = Vec::new();
    for write in writes {
        replies.push(write.await.expect("task"));
    }
    let new: Vec<_> = replies.iter().filter(|r| r.body["was_new"] == true).collect();
    assert_eq!(new.len(), 1, "exactly one write reports was_new: {replies:?}");
    assert_eq!(new[0].status, 201);
    assert!(replies.iter().all(|r| r.body["id"] == new[0].body["id"]));
    assert!(replies.iter().filter(|r| r.body["was_new"] == false).all(|r| r.status == 200));
    assert_eq!(app.db.count("SELECT count(*) FROM memory_items").await, 1);
    assert_eq!(app.db.count("SELECT count(*) FROM apalis.jobs").await, 1);
}

#[tokio::test]
async fn different_content_under_the_same_source_ref_is_a_conflict() {
    let app = TestApp::spawn().await;
    let token = token(&principal("acme", None, None, Some("s1")));
    assert_eq!(app.client.post("/v1/memories", Some(&token), &chat("m-1", "first")).await.status, 201);
    let reply = app.client.post("/v1/memories", Some(&token), &chat("m-1", "second")).await;
    assert_eq!((reply.status, reply.code()), (409, "source_ref_conflict"));
    let content: String =
        sqlx::query_scalar("SELECT content FROM memory_items").fetch_one(&app.db.pool).await.expect("row");
    assert_eq!(content, "first");
    // The same words as another role, or another tool call, are another message too; the same
    // message again is a retry.
    let turn = |role: &str, call: Option<&str>| {
        let mut body = chat("m-2", "ok");
        body["role"] = json!(role);
        if let Some(call) = call {
            body["tool_call_id"] = json!(call);
        }
        body
    };
    assert_eq!(app.client.post("/v1/memories", Some(&token), &turn("tool", Some("c1"))).await.status, 201);
    for other in [turn("assistant", None), turn("tool", Some("c2"))] {
        let reply = app.client.post("/v1/memories", Some(&token), &other).await;
        assert_eq!((reply.status, reply.code()), (409, "source_ref_conflict"), "{other}");
    }
    let retry = app.client.post("/v1/memories", Some(&token), &turn("tool", Some("c1"))).await;
    assert_eq!((retry.status, &retry.body["was_new"]), (200, &json!(false)));
}

#[tokio::test]
async fn the_same_message_under_a_ref_another_session_holds_is_a_conflict() {
    let app = TestApp::spawn().await;
    let first = token(&principal("acme", Some("u1"), None, Some("s1")));
    let other = token(&principal("acme", Some("u2"), None, Some("s2")));
    assert_eq!(app.client.post("/v1/memories", Some(&first), &chat("m-1", "same words")).await.status, 201);

    // Landing on the first session's row would lose this write from its own session.
    let reply = app.client.post("/v1/memories", Some(&other), &chat("m-1", "same words")).await;
    assert_eq!((reply.status, reply.code()), (409, "source_ref_conflict"), "{:?}", reply.body);
    assert!(reply.body.get("id").is_none(), "the other session's row id is not told");
    // A retry from the row's own session still finds it.
    assert_eq!(app.client.post("/v1/memories", Some(&first), &chat("m-1", "same words")).await.status, 200);
    let sessions: Vec<String> =
        sqlx::query_scalar("SELECT session_id FROM memory_items").fetch_all(&app.db.pool).await.expect("rows");
    assert_eq!(sessions, ["s1"]);
}

#[tokio::test]
async fn each_kind_lands_in_its_scope_with_the_token_identities() {
    let app = TestApp::spawn().await;
    let bound = token(&principal("acme", Some("u1"), Some("a1"), Some("s-token")));
    let service = token(&principal("acme", None, None, None));

    let chat_reply = app.client.post("/v1/memories", Some(&bound), &chat("m-1", "from the token's session")).await;
    let tool = json!({ "source_kind": "tool_output", "source_ref": "call-1", "content": "42 rows",
        "session_id": "s-body", "event_time": "2026-05-02T14:23:01.234567+00:00", "metadata": {"tool": "sql"} });
    let tool_reply = app.client.post("/v1/memories", Some(&service), &tool).await;
    let chunk = json!({ "source_kind": "document_chunk", "source_ref": "doc-1#0", "content": "Handbook, page one" });
    let chunk_reply = app.client.post("/v1/memories", Some(&service), &chunk).await;
    assert_eq!((chat_reply.status, tool_reply.status, chunk_reply.status), (201, 201, 201));

    let rows = sqlx::query(
        "SELECT source_ref, scope, session_id, user_id, agent_id, metadata, event_time::text AS event_time
         FROM memory_items ORDER BY source_ref",
    )
    .fetch_all(&app.db.pool)
    .await
    .expect("rows");
    let row = |i: usize, col: &str| -> Option<String> { rows[i].get(col) };
    // call-1, doc-1#0, m-1
    assert_eq!((row(0, "scope"), row(0, "session_id")), (Some("session".into()), Some("s-body".into())));
    assert_eq!(row(0, "user_id"), None, "a service token writes no user");
    assert_eq!(row(0, "event_time").as_deref(), Some("2026-05-02 14:23:01.234567+00"));
    assert_eq!(rows[0].get::<Value, _>("metadata"), json!({"tool": "sql"}));
    assert_eq!((row(1, "scope"), row(1, "session_id")), (Some("tenant".into()), None));
    assert_eq!((row(2, "scope"), row(2, "session_id")), (Some("session".into()), Some("s-token".into())));
    assert_eq!((row(2, "user_id"), row(2, "agent_id")), (Some("u1".into()), Some("a1".into())));
}

#[tokio::test]
async fn facts_are_keyed_by_identity_and_content() {
    let app = TestApp::spawn().await;
    let user = token(&principal("acme", Some("u1"), Some("a1"), None));
    let fact = json!({ "content": "I live in Tokyo", "scope": "user", "key": "home_city" });

    let first = app.client.post("/v1/facts", Some(&user), &fact).await;
    assert_eq!((first.status, &first.body["was_new"]), (201, &json!(true)), "{:?}", first.body);
    let again = app.client.post("/v1/facts", Some(&user), &fact).await;
    assert_eq!((again.status, &again.body["id"]), (200, &first.body["id"]));

    let agent_fact =
        app.client.post("/v1/facts", Some(&user), &json!({ "content": "I live in Tokyo", "scope": "agent" })).await;
    assert_eq!(agent_fact.status, 201, "the same words in another scope are another fact");

    let row = sqlx::query("SELECT source_ref, scope, user_id, session_id, fact_key, valid_from IS NOT NULL AS valid FROM memory_items WHERE scope = 'user'")
        .fetch_one(&app.db.pool)
        .await
        .expect("fact row");
    // sha256("I live in Tokyo")[:16]
    let digest: String = sqlx::query_scalar("SELECT left(encode(sha256('I live in Tokyo'::bytea), 'hex'), 16)")
        .fetch_one(&app.db.pool)
        .await
        .expect("digest");
    assert_eq!(row.get::<String, _>("source_ref"), format!("fact:user:u1:{digest}"));
    assert_eq!(row.get::<Option<String>, _>("session_id"), None);
    assert_eq!(row.get::<Option<String>, _>("fact_key").as_deref(), Some("home_city"));
    assert!(row.get::<bool, _>("valid"));
}

#[tokio::test]
async fn long_tool_outputs_are_elided_and_readable_by_their_tenant_only() {
    let app = TestApp::spawn().await;
    let acme = token(&principal("acme", None, None, Some("s1")));
    let other = token(&principal("globex", None, None, Some("s1")));
    let full: String = (0..4000).map(|i| format!("row {i}: ok é😀\n")).collect();
    assert!(full.len() > MAX_CONTENT_BYTES);
    let write = json!({ "source_kind": "tool_output", "source_ref": "call-big", "content": full });

    let reply = app.client.post("/v1/memories", Some(&acme), &write).await;
    assert_eq!(reply.status, 201, "{:?}", reply.body);
    let (content, key): (String, String) =
        sqlx::query_as("SELECT content, tool_output_key FROM memory_items").fetch_one(&app.db.pool).await.expect("row");
    assert!(content.len() <= MAX_CONTENT_BYTES);
    assert!(content.starts_with("row 0: ok") && content.ends_with("row 3999: ok é😀\n"));
    assert!(content.contains(&key) && key.starts_with("tout_"));

    let read = app.client.get(&format!("/v1/tool-outputs/{key}"), Some(&acme)).await;
    assert_eq!(read.status, 200);
    assert_eq!(read.body["content"].as_str(), Some(full.as_str()));
    assert_eq!(read.body["item_id"], reply.body["id"]);
    assert_eq!((read.body["total_bytes"].as_u64(), &read.body["next_offset"]), (Some(full.len() as u64), &json!(null)));
    // A page at a time: the pages join to the whole payload.
    let (mut joined, mut offset) = (String::new(), Some(0));
    while let Some(at) = offset {
        let page = app.client.get(&format!("/v1/tool-outputs/{key}?offset={at}&max_bytes=10000"), Some(&acme)).await;
        assert_eq!(page.status, 200, "{:?}", page.body);
        let content = page.body["content"].as_str().expect("content");
        assert!(content.len() <= 10_000 && !content.is_empty());
        joined.push_str(content);
        offset = page.body["next_offset"].as_u64();
    }
    assert_eq!(joined, full);
    // A page shorter than one character holds that whole character ("😀" is 4 bytes at 12).
    let one = app.client.get(&format!("/v1/tool-outputs/{key}?offset=12&max_bytes=1"), Some(&acme)).await;
    assert_eq!((one.body["content"].as_str(), one.body["next_offset"].as_u64()), (Some("😀"), Some(16)));
    for (query, code) in [
        (format!("offset={}", full.len() + 1), "invalid_field"),
        ("offset=11".to_owned(), "invalid_field"), // inside "é"
        ("max_bytes=0".to_owned(), "invalid_field"),
        ("offset=-1".to_owned(), "invalid_field"),
        ("page=2".to_owned(), "unknown_field"),
    ] {
        let refused = app.client.get(&format!("/v1/tool-outputs/{key}?{query}"), Some(&acme)).await;
        assert_eq!((refused.status, refused.code()), (400, code), "{query}");
    }

    let stolen = app.client.get(&format!("/v1/tool-outputs/{key}"), Some(&other)).await;
    assert_eq!((stolen.status, stolen.code()), (404, "not_found"));
    let nonsense = app.client.get("/v1/tool-outputs/tout_nope", Some(&acme)).await;
    assert_eq!((nonsense.status, nonsense.code()), (404, "not_found"));

    // The retried write is recognised by the full payload, not the preview.
    let again = app.client.post("/v1/memories", Some(&acme), &write).await;
    assert_eq!((again.status, &again.body["id"]), (200, &reply.body["id"]));
    assert_eq!(app.db.count("SELECT count(*) FROM tool_outputs").await, 1);
}

#[tokio::test]
async fn tenants_never_share_rows() {
    let app = TestApp::spawn().await;
    let acme = token(&principal("acme", Some("u1"), None, Some("s1")));
    let globex = token(&principal("globex", Some("u1"), None, Some("s1")));
    let a = app.client.post("/v1/memories", Some(&acme), &chat("m-1", "same")).await;
    let b = app.client.post("/v1/memories", Some(&globex), &chat("m-1", "same")).await;
    assert_eq!((a.status, b.status), (201, 201), "the same source_ref in two tenants is two rows");
    assert_ne!(a.body["id"], b.body["id"]);
    let fact = json!({ "content": "likes tea", "scope": "user" });
    assert_eq!(app.client.post("/v1/facts", Some(&acme), &fact).await.status, 201);
    assert_eq!(app.client.post("/v1/facts", Some(&globex), &fact).await.status, 201);
    let tenants: Vec<(String, i64)> =
        sqlx::query_as("SELECT tenant_id, count(*) FROM memory_items GROUP BY tenant_id ORDER BY tenant_id")
            .fetch_all(&app.db.pool)
            .await
            .expect("counts");
    assert_eq!(tenants, vec![("acme".to_owned(), 2), ("globex".to_owned(), 2)]);
}

#[tokio::test]
async fn each_new_row_queues_its_embed_job_in_the_same_transaction() {
    let app = TestApp::spawn().await;
    let token = token(&principal("acme", None, None, Some("s1")));
    let reply = app.client.post("/v1/memories", Some(&token), &chat("m-1", "embed me")).await;
    assert_eq!(reply.status, 201);

    let (queue, status, args): (String, String, Vec<u8>) =
        sqlx::query_as("SELECT job_type, status, job FROM apalis.jobs").fetch_one(&app.db.pool).await.expect("job");
    assert_eq!((queue.as_str(), status.as_str()), ("embed", "Pending"));
    let args: Value = serde_json::from_slice(&args).expect("JSON arguments");
    assert_eq!(args["tenant_id"], "acme");
    let sha: String = sqlx::query_scalar("SELECT encode(content_sha256, 'hex') FROM memory_items")
        .fetch_one(&app.db.pool)
        .await
        .expect("sha");
    assert_eq!(args["items"], json!([{ "item_id": reply.body["id"], "content_sha256": sha }]));

    // A refused write queues nothing.
    let refused = app.client.post("/v1/memories", Some(&token), &chat("m-2", "")).await;
    assert_eq!(refused.status, 400);
    assert_eq!(app.db.count("SELECT count(*) FROM apalis.jobs").await, 1);
}

/// A statement that inserts rows queues one embed job per tenant, naming exactly the rows it
/// inserted: not a row whose key was taken, not a row twice.
#[tokio::test]
async fn a_batch_queues_one_embed_job_naming_the_rows_it_inserted() {
    let app = TestApp::spawn().await;
    let token = token(&principal("acme", None, None, Some("s1")));
    let first = app.client.post("/v1/memories", Some(&token), &chat("taken", "first words")).await;
    let items = json!([chat("b-1", "one"), chat("taken", "first words"), chat("b-2", "two"), chat("b-1", "one")]);
    let reply = app.client.post("/v1/memories/batch", Some(&token), &json!({ "items": items })).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let ids = |i: usize| reply.body["results"][i]["id"].as_str().expect("id").to_owned();

    let jobs: Vec<Vec<u8>> = sqlx::query_scalar("SELECT job FROM apalis.jobs WHERE job_type = 'embed' ORDER BY id")
        .fetch_all(&app.db.pool)
        .await
        .expect("jobs");
    let named: Vec<Vec<String>> = jobs
        .iter()
        .map(|job| {
            let args: Value = serde_json::from_slice(job).expect("JSON arguments");
            assert_eq!(args["tenant_id"], "acme");
            let mut ids: Vec<String> = args["items"]
                .as_array()
                .expect("items")
                .iter()
                .map(|i| i["item_id"].as_str().unwrap().to_owned())
                .collect();
            ids.sort();
            ids
        })
        .collect();
    let mut batch = vec![ids(0), ids(2)];
    batch.sort();
    assert_eq!(named, vec![vec![first.body["id"].as_str().expect("id").to_owned()], batch]);

    // A long batch is named by jobs of at most 8 rows, each row once.
    let items: Vec<Value> = (0..130).map(|i| chat(&format!("long-{i}"), "words")).collect();
    let reply = app.client.post("/v1/memories/batch", Some(&token), &json!({ "items": items })).await;
    assert_eq!(reply.body["written"], json!(130), "{:?}", reply.body);
    let sizes: Vec<i64> = sqlx::query_scalar(
        "SELECT jsonb_array_length(convert_from(job, 'UTF8')::jsonb->'items')::int8 FROM apalis.jobs
         WHERE job_type = 'embed' ORDER BY 1 OFFSET 2",
    )
    .fetch_all(&app.db.pool)
    .await
    .expect("jobs");
    assert_eq!(sizes, [vec![2], vec![8; 16]].concat());
    let queued = "SELECT count(DISTINCT i->>'item_id') FROM apalis.jobs, \
                  jsonb_array_elements(convert_from(job, 'UTF8')::jsonb->'items') AS i WHERE job_type = 'embed'";
    assert_eq!(app.db.count(queued).await, 3 + 130);
}

/// A batch answers one result per item in order, writes its valid items in one transaction,
/// and, atomic, writes nothing when one item cannot be written.
#[tokio::test]
async fn batches_answer_per_item_and_atomic_ones_all_or_nothing() {
    let app = TestApp::spawn_with(&[("MNEMO_MAX_BATCH_ITEMS", "6")]).await;
    let token = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    app.client.post("/v1/memories", Some(&token), &chat("taken", "first words")).await;
    let rows = || app.db.count("SELECT count(*) FROM memory_items");
    let before = rows().await;

    let items = json!([
        chat("b-1", "one"),
        { "source_kind": "galaxy", "source_ref": "b-2", "content": "x" },
        chat("taken", "other words"),
        chat("b-1", "one"),
        7,
        { "source_kind": "chat_message", "source_ref": "b-3", "content": "x", "tenant_id": "globex" },
    ]);
    let reply = app.client.post("/v1/memories/batch", Some(&token), &json!({ "items": items })).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let results = reply.body["results"].as_array().expect("results");
    let codes: Vec<&str> = results.iter().map(|r| r["error"]["code"].as_str().unwrap_or("ok")).collect();
    assert_eq!(codes, ["ok", "invalid_value", "source_ref_conflict", "ok", "invalid_field", "tenant_in_body"]);
    assert_eq!((results[0]["was_new"].clone(), results[3]["was_new"].clone()), (json!(true), json!(false)));
    assert_eq!(results[0]["id"], results[3]["id"], "an item repeated in one batch lands on one row");
    assert_eq!((reply.body["written"].clone(), rows().await), (json!(1), before + 1));

    // Atomic: one refused item (here by the store: a conflict) writes nothing.
    let items = json!([chat("c-1", "new"), chat("taken", "other words")]);
    let reply = app.client.post("/v1/memories/batch", Some(&token), &json!({ "items": items, "atomic": true })).await;
    assert_eq!((reply.status, reply.code()), (400, "batch_rejected"), "{:?}", reply.body);
    assert_eq!(reply.body["results"][0]["error"]["code"], "not_written");
    assert_eq!(reply.body["results"][1]["error"]["code"], "source_ref_conflict");
    assert!(reply.body["error"]["message"].as_str().unwrap_or("").contains("item 1"), "{:?}", reply.body);
    assert_eq!(rows().await, before + 1, "an atomic batch wrote part of itself");
    // ...and one bad item refused before the store likewise.
    let items = json!([chat("c-1", "new"), { "source_kind": "chat_message", "source_ref": "c-2" }]);
    let reply = app.client.post("/v1/memories/batch", Some(&token), &json!({ "items": items, "atomic": true })).await;
    assert_eq!((reply.status, reply.code()), (400, "batch_rejected"));
    assert_eq!(reply.body["results"][1]["error"]["code"], "missing_field");
    assert_eq!(rows().await, before + 1);

    // Facts, and the limits.
    let facts =
        json!({ "items": [{ "scope": "user", "content": "likes tea" }, { "scope": "session", "content": "x" }] });
    let reply = app.client.post("/v1/facts/batch", Some(&token), &facts).await;
    let codes: Vec<&str> = reply.body["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| r["error"]["code"].as_str().unwrap_or("ok"))
        .collect();
    assert_eq!(codes, ["ok", "invalid_value"]);
    for body in [json!({ "items": [] }), json!({ "items": vec![chat("z", "z"); 7] }), json!({})] {
        let reply = app.client.post("/v1/memories/batch", Some(&token), &body).await;
        assert_eq!(reply.status, 400, "{body}: {:?}", reply.body);
    }
    assert_eq!(rows().await, before + 2);
}

/// Four chat messages handed to `commits` at once, none of which can be written: their errors,
/// and how long the last took to answer.
async fn four_writes_at_once(
    commits: &mnemo_store::GroupCommit,
) -> (Vec<mnemo_store::StoreError>, std::time::Duration) {
    let who = principal("acme", Some("u1"), None, Some("s1"));
    let started = std::time::Instant::now();
    let mut writes = tokio::task::JoinSet::new();
    for n in 0..4 {
        let row = mnemo_core::NewMemory::chat_message(
            &who,
            mnemo_core::SourceRef::parse(&format!("m{n}")).expect("ref"),
            mnemo_core::MemoryText::parse("not written").expect("text"),
            None,
            mnemo_core::Extras::default(),
        )
        .expect("row");
        let commits = commits.clone();
        writes.spawn(async move { commits.remember(row).await });
    }
    let mut failures = Vec::new();
    while let Some(written) = writes.join_next().await {
        failures.push(written.expect("task").expect_err("nothing can be written"));
    }
    (failures, started.elapsed())
}

/// While the database is out of reach, no write waits out more than one connection timeout:
/// the rows queued behind a batch that found it unreachable fail with that batch, instead of each
/// batch after it waiting out a timeout of its own. Here a "database" that accepts connections
/// and never answers, a pool timeout of 1 s, one committer taking one row at a time, and four
/// writes at once: without the drain they take 4 s, one timeout each in turn.
#[tokio::test]
async fn writes_queued_behind_an_unreachable_database_fail_with_the_batch_ahead() {
    use std::time::Duration;

    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
    let url = format!("postgres://mnemo:mnemo@{}/mnemo", silent.local_addr().expect("address"));
    let options: sqlx::postgres::PgConnectOptions = url.parse().expect("url");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(1))
        .connect_lazy_with(options);
    let commits =
        mnemo_store::GroupCommit::start(mnemo_store::Store::new(pool), 1, 1, std::time::Duration::from_secs(60));
    let (failures, took) = four_writes_at_once(&commits).await;
    assert!(failures.iter().all(mnemo_store::StoreError::is_unavailable), "{failures:?}");
    assert!(took < Duration::from_millis(1900), "four writes took {took:?}: more than one timeout");
}

/// A TCP proxy to the test database that can stop passing bytes on, as a network that drops a
/// connection without a word does: the client's statement is never answered, and PostgreSQL's
/// statement timeout cannot fire (the statement never reached it).
struct Blackhole {
    url: String,
    silent: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Blackhole {
    fn to(db_url: &str) -> Self {
        use std::io::{Read, Write};
        use std::sync::atomic::Ordering;

        let options: sqlx::postgres::PgConnectOptions = db_url.parse().expect("url");
        let target = match options.get_socket() {
            Some(dir) => format!("{}/.s.PGSQL.{}", dir.display(), options.get_port()),
            None => format!("{}:{}", options.get_host(), options.get_port()),
        };
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
        let (credentials, rest) = db_url.split_once('@').expect("credentials");
        let database = rest.split_once('/').expect("database").1.split('?').next().expect("name");
        let url = format!("{credentials}@{}/{database}", listener.local_addr().expect("address"));
        let silent = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Bytes read while silent are held, not dropped: they go on once the network is back.
        fn pass(quiet: std::sync::Arc<std::sync::atomic::AtomicBool>, mut from: impl Read, mut to: impl Write) {
            let mut buf = vec![0u8; 16 * 1024];
            while let Ok(n @ 1..) = from.read(&mut buf) {
                while quiet.load(Ordering::Relaxed) {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
        let quiet = silent.clone();
        std::thread::spawn(move || {
            for inbound in listener.incoming().map_while(Result::ok) {
                let (q1, q2) = (quiet.clone(), quiet.clone());
                let back = inbound.try_clone().expect("clone");
                if target.starts_with('/') {
                    let outbound = std::os::unix::net::UnixStream::connect(&target).expect("database socket");
                    let forth = outbound.try_clone().expect("clone");
                    std::thread::spawn(move || pass(q1, inbound, forth));
                    std::thread::spawn(move || pass(q2, outbound, back));
                } else {
                    let outbound = std::net::TcpStream::connect(&target).expect("database port");
                    let forth = outbound.try_clone().expect("clone");
                    std::thread::spawn(move || pass(q1, inbound, forth));
                    std::thread::spawn(move || pass(q2, outbound, back));
                }
            }
        });
        Self { url, silent }
    }

    fn silence(&self, silent: bool) {
        self.silent.store(silent, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A batch the database never answers (the network dropped the committer's connection without a
/// word) fails after the committers' deadline, instead of holding every write for as long as the
/// kernel takes to give up (about 15 minutes); the connection is closed, and writes go on once
/// the network is back.
#[tokio::test]
async fn a_batch_the_database_never_answers_fails_at_the_deadline_and_writes_go_on() {
    use std::time::Duration;

    let db = mnemo_testkit::TestDb::new().await;
    let network = Blackhole::to(&db.url);
    let store = mnemo_store::Store::connect(&network.url, 2).await.expect("through the proxy");
    let commits = mnemo_store::GroupCommit::start(store, 1, 8, Duration::from_secs(2));
    let who = principal("acme", Some("u1"), None, Some("s1"));
    let row = |n: usize| {
        mnemo_core::NewMemory::chat_message(
            &who,
            mnemo_core::SourceRef::parse(&format!("m{n}")).expect("ref"),
            mnemo_core::MemoryText::parse("hello").expect("text"),
            None,
            mnemo_core::Extras::default(),
        )
        .expect("row")
    };
    assert!(commits.remember(row(1)).await.is_ok_and(|w| w.was_new));
    network.silence(true);
    let started = std::time::Instant::now();
    let lost = tokio::time::timeout(Duration::from_secs(15), commits.remember(row(2))).await.expect("no answer");
    assert!(lost.as_ref().is_err_and(mnemo_store::StoreError::is_unavailable), "{lost:?}");
    assert!(started.elapsed() < Duration::from_secs(12), "answered after {:?}", started.elapsed());
    network.silence(false);
    let again = commits.remember(row(3)).await;
    assert!(again.is_ok_and(|w| w.was_new), "writes go on once the network is back");
}

/// A batch whose statement runs past its timeout fails all its rows at once: written one by one,
/// each would wait out a timeout of its own. Here a lock held elsewhere, a timeout of 1 s, one
/// committer, and four writes at once (the first goes alone, the other three wait and go
/// together): without the rule the last answers after about 5 s, one timeout per row in turn.
#[tokio::test]
async fn a_batch_past_its_statement_timeout_fails_its_rows_together() {
    use std::time::Duration;

    let app = TestApp::spawn().await;
    let options: sqlx::postgres::PgConnectOptions = app.db.url.parse().expect("url");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.options([("statement_timeout", "1000")]))
        .await
        .expect("pool");
    let commits =
        mnemo_store::GroupCommit::start(mnemo_store::Store::new(pool), 1, 8, std::time::Duration::from_secs(60));
    let mut holder = app.db.pool.begin().await.expect("begin");
    sqlx::query("LOCK TABLE memory_items IN ACCESS EXCLUSIVE MODE").execute(&mut *holder).await.expect("lock");
    let (failures, took) = four_writes_at_once(&commits).await;
    assert!(failures.iter().all(mnemo_store::StoreError::is_cancelled), "{failures:?}");
    holder.rollback().await.expect("let go");
    assert!(took < Duration::from_millis(4000), "four writes took {took:?}: one timeout per row");
}

/// A batch whose new rows were committed by their own statement, and whose fact said again
/// (deleted, so revived) then waited past the timeout (its row locked elsewhere): the new rows
/// are answered as written, the revived one fails alone, and is written once the lock is let go.
#[tokio::test]
async fn rows_committed_before_a_batch_failed_are_answered_as_written() {
    let app = TestApp::spawn_with(&[(mnemo_config::vars::STATEMENT_TIMEOUT_S, "1")]).await;
    let token = token(&principal("acme", Some("u1"), None, None));
    let fact = |content: &str| json!({ "scope": "user", "content": content });
    let first = app.client.post("/v1/facts", Some(&token), &fact("Ann lives in Lyon")).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let forget = format!("/v1/memories/{}", first.body["id"].as_str().unwrap_or_default());
    assert_eq!(app.client.delete(&forget, Some(&token)).await.status, 200);
    let mut holder = app.db.pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM memory_items WHERE id = $1::text::uuid FOR UPDATE")
        .bind(first.body["id"].as_str())
        .execute(&mut *holder)
        .await
        .expect("lock the fact");
    let batch = json!({ "items": [fact("Ann swims"), fact("Ann lives in Lyon")] });
    let reply = app.client.post("/v1/facts/batch", Some(&token), &batch).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(reply.body["results"][0]["was_new"], true, "{:?}", reply.body);
    assert_eq!(reply.body["results"][1]["error"]["code"], "not_ready", "{:?}", reply.body);
    holder.rollback().await.expect("let go");
    let again = app.client.post("/v1/facts/batch", Some(&token), &batch).await;
    let results = &again.body["results"];
    assert_eq!((results[0]["was_new"].as_bool(), results[1]["id"].clone()), (Some(false), first.body["id"].clone()));
}

/// A statement that cannot finish (a lock held elsewhere) is cancelled by PostgreSQL after
/// `MNEMO_STATEMENT_TIMEOUT_S`: the request gets 503 `not_ready` rather than holding its
/// connection for as long as the lock is held, and writes go in again once it is let go.
#[tokio::test]
async fn a_statement_past_its_timeout_is_cancelled_and_answered_503() {
    let app = TestApp::spawn_with(&[(mnemo_config::vars::STATEMENT_TIMEOUT_S, "1")]).await;
    let token = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let mut holder = app.db.pool.begin().await.expect("begin");
    sqlx::query("LOCK TABLE memory_items IN ACCESS EXCLUSIVE MODE").execute(&mut *holder).await.expect("lock");
    let started = std::time::Instant::now();
    let reply = app.client.post("/v1/memories", Some(&token), &chat("m-1", "hello")).await;
    assert_eq!((reply.status, reply.code()), (503, "not_ready"), "{:?}", reply.body);
    assert!(started.elapsed() < std::time::Duration::from_secs(15), "{:?}", started.elapsed());
    holder.rollback().await.expect("let go");
    let again = app.client.post("/v1/memories", Some(&token), &chat("m-1", "hello")).await;
    assert_eq!(again.status, 201, "{:?}", again.body);
}
