//! The embedding pipeline end to end: the real server and worker binaries, the real local model,
//! crashes, a scripted OpenAI-compatible provider that fails on cue, and housekeeping.

use std::time::Duration;

use mnemo_testkit::{
    Answer, ScriptedEmbeddings, ServerProcess, TestDb, WorkerProcess, free_port, principal, token, wait_until,
};
use serde_json::json;
use uuid::Uuid;

const MODEL: &str = "all-MiniLM-L6-v2";

async fn embedded(db: &TestDb) -> i64 {
    db.count("SELECT count(*) FROM memory_items WHERE embedded_model IS NOT NULL").await
}

/// The tenant every test here writes as.
fn acme() -> mnemo_core::TenantId {
    mnemo_core::TenantId::parse("acme").expect("tenant")
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Writes `n` chat messages through the real server and returns their ids.
async fn write_messages(server: &ServerProcess, n: usize, text: impl Fn(usize) -> String) -> Vec<Uuid> {
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let mut ids = Vec::new();
    for i in 0..n {
        let body = json!({ "source_kind": "chat_message", "source_ref": format!("m-{i}"), "content": text(i) });
        let reply = server.client.post("/v1/memories", Some(&t), &body).await;
        assert_eq!(reply.status, 201, "{:?}", reply.body);
        ids.push(reply.body["id"].as_str().and_then(|s| s.parse().ok()).expect("id"));
    }
    ids
}

/// Two jobs naming one row in one batch (a recovered orphan and its re-queued copy): the row is
/// read and saved once, and the batch goes through; a failure of one of them afterwards leaves
/// the saved row alone.
#[tokio::test]
async fn a_row_named_by_two_jobs_of_one_batch_is_embedded_once() {
    let app = mnemo_testkit::TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let body = json!({ "source_kind": "chat_message", "source_ref": "m-1", "content": "the early train" });
    let reply = app.client.post("/v1/memories", Some(&t), &body).await;
    let id: Uuid = reply.body["id"].as_str().and_then(|s| s.parse().ok()).expect("id");
    let store = app.db.store();
    let row = mnemo_store::queue::EmbedRow { tenant_id: acme(), item_id: id, content_sha256: String::new() };
    let rows = store.rows_to_embed(&[row.clone(), row.clone()], MODEL, false).await.expect("read");
    assert_eq!(rows.len(), 1);
    let vector = |x: f32| mnemo_store::NewVector {
        id,
        tenant_id: rows[0].tenant_id.clone(),
        content_sha256: rows[0].content_sha256.clone(),
        embedding: vec![x; 384],
        previous_id: None,
    };
    let saved = store.save_vectors(MODEL, vec![vector(0.1), vector(0.2)]).await.expect("saved");
    assert_eq!(saved, [id]);

    // A job of the same row whose model call failed meanwhile (a second retry chain after a
    // crash) records nothing on a row that has its current vector, and queues no retry; for
    // another model, whose vector it lacks, the failure counts.
    let failed = |retry_after| mnemo_store::EmbedFailure { job: &row, error: "gave up".to_owned(), retry_after };
    store.record_embed_failures(MODEL, &[failed(None), failed(Some(Duration::from_secs(60)))]).await.expect("recorded");
    let state = "SELECT count(*) FROM memory_items WHERE embed_attempts = 0 AND embed_error IS NULL";
    assert_eq!(app.db.count(state).await, 1, "a row with its vector marked failed");
    assert_eq!(app.db.count("SELECT count(*) FROM apalis.jobs WHERE run_at > now()").await, 0);
    store.record_embed_failures("another-model", &[failed(Some(Duration::from_secs(60)))]).await.expect("recorded");
    assert_eq!(app.db.count("SELECT count(*) FROM memory_items WHERE embed_attempts = 1").await, 1);
    assert_eq!(app.db.count("SELECT count(*) FROM apalis.jobs WHERE run_at > now()").await, 1);

    // Anonymized while its model call ran: the failure (whose text may quote the input) is not
    // recorded, and no retry is queued.
    sqlx::query("UPDATE memory_items SET anonymized_at = now() WHERE id = $1")
        .bind(id)
        .execute(&app.db.pool)
        .await
        .expect("anonymized");
    store
        .record_embed_failures("a-third-model", &[failed(None), failed(Some(Duration::from_secs(60)))])
        .await
        .expect("none");
    assert_eq!(
        app.db.count("SELECT count(*) FROM memory_items WHERE embed_attempts = 1 AND embed_error IS NULL").await,
        1
    );
    assert_eq!(app.db.count("SELECT count(*) FROM apalis.jobs WHERE run_at > now()").await, 1);
}

/// A job queued again after a failure is a new apalis row (its attempts start at 0): it carries
/// the failures before it in its metadata, which the worker's backoff grows with.
#[tokio::test]
async fn a_job_queued_again_after_failures_carries_their_count() {
    let db = TestDb::new().await;
    let store = db.store();
    let tenant_id = acme();
    let job = mnemo_store::queue::JudgeJob { tenant_id, item_id: Uuid::now_v7() };
    store.retry_failed(&job, Duration::from_secs(60), 3).await.expect("queued");
    store.retry_after(&job, Duration::from_secs(60)).await.expect("queued");
    let counts: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT metadata -> 'mnemo_failures' FROM apalis.jobs ORDER BY metadata -> 'mnemo_failures'",
    )
    .fetch_all(&db.pool)
    .await
    .expect("jobs");
    assert_eq!(counts, [Some("3".to_owned()), None]);
}

#[tokio::test]
async fn five_hundred_rows_are_embedded_by_the_local_model() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let worker = WorkerProcess::start::<&str>(&db.url, &[]).await.expect("worker");
    let topics = ["I live in Tokyo", "My home is in Tokyo", "I like pizza", "The invoice is due on Friday"];
    let ids = write_messages(&server, 500, |i| format!("{} (note {i})", topics[i % 4])).await;

    assert!(
        wait_until(Duration::from_secs(240), || async { embedded(&db).await == 500 }).await,
        "not all rows embedded"
    );
    let store = db.store();
    let mut vectors = Vec::new();
    for id in &ids[..4] {
        vectors.push(store.vector(&acme(), *id, MODEL).await.expect("read").expect("vector"));
    }
    for v in &vectors {
        assert_eq!(v.len(), 384);
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-3, "norm {norm}");
    }
    let close = cosine(&vectors[0], &vectors[1]);
    let far = cosine(&vectors[0], &vectors[2]);
    assert!(close > far + 0.2, "Tokyo/Tokyo {close} vs Tokyo/pizza {far}");
    assert_eq!(db.count("SELECT count(*) FROM memory_embeddings").await, 500, "one vector per row");
    assert!(worker.metric("mnemo_embed_rows_embedded_total").await >= 500.0);
    let status = worker.terminate().await.expect("clean stop");
    assert!(status.success(), "worker exit: {status}");
}

#[tokio::test]
async fn a_killed_worker_loses_nothing_and_embeds_nothing_twice() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    write_messages(&server, 300, |i| format!("message number {i} about the quarterly report")).await;
    let fast_orphans = [("MNEMO_WORKER_ORPHAN_TIMEOUT_S", "3"), ("MNEMO_EMBED_BATCH_SIZE", "16")];

    let first = WorkerProcess::start(&db.url, &fast_orphans).await.expect("worker");
    assert!(wait_until(Duration::from_secs(120), || async { embedded(&db).await >= 30 }).await);
    first.kill().await;
    let after_kill = embedded(&db).await;
    assert!(after_kill < 300, "the kill came too late to test anything ({after_kill} embedded)");

    let second = WorkerProcess::start(&db.url, &fast_orphans).await.expect("second worker");
    assert!(wait_until(Duration::from_secs(180), || async { embedded(&db).await == 300 }).await, "rows lost");
    assert_eq!(db.count("SELECT count(*) FROM memory_embeddings").await, 300, "a row embedded twice");
    let stuck = || async { db.count("SELECT count(*) FROM apalis.jobs WHERE status IN ('Running', 'Queued')").await };
    assert!(wait_until(Duration::from_secs(60), || async { stuck().await == 0 }).await, "jobs stuck Running");
    second.kill().await;
}

/// The settings that make the worker embed through `provider`, which takes only the key they name.
fn openai_env(provider: &ScriptedEmbeddings) -> Vec<(&'static str, String)> {
    provider.expect_key("test-key");
    vec![
        ("MNEMO_EMBED_PROVIDER", "openai".into()),
        ("MNEMO_EMBED_MODEL", "scripted-embedder".into()),
        ("MNEMO_EMBED_DIMENSIONS", provider.dimensions.to_string()),
        ("MNEMO_EMBED_BASE_URL", provider.base_url.clone()),
        ("MNEMO_EMBED_API_KEY", "test-key".into()),
        ("MNEMO_EMBED_TIMEOUT_MS", "700".into()),
    ]
}

/// An endpoint's settings are mnemo's alone: a key read from a file, newline and all, is the
/// key, and OpenAI's variables mnemo does not read (an organization and a project, here ones no
/// header could carry) are not sent anywhere.
#[tokio::test]
async fn a_key_from_a_file_works_and_openai_s_other_variables_stay_out() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(32).await;
    let mut env = openai_env(&provider);
    env.retain(|(name, _)| *name != "MNEMO_EMBED_API_KEY");
    env.push(("MNEMO_EMBED_API_KEY", "test-key\n".into()));
    env.push(("OPENAI_ORG_ID", "org\nnot-a-header".into()));
    env.push(("OPENAI_PROJECT_ID", "project\nnot-a-header".into()));
    write_messages(&server, 1, |_| "a row with a careful key".into()).await;
    let worker = WorkerProcess::start(&db.url, &env).await.expect("worker");
    assert!(
        wait_until(Duration::from_secs(30), || async { embedded(&db).await == 1 }).await,
        "never embedded: {:?}",
        provider.served()
    );
    worker.kill().await;
}

#[tokio::test]
async fn transient_failures_are_retried_with_growing_delays() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(32).await;
    provider.then([Answer::Status(500), Answer::Hang(Duration::from_secs(2)), Answer::Malformed, Answer::Status(503)]);
    let env = openai_env(&provider);
    let ids = write_messages(&server, 1, |_| "a row that will get there".into()).await;
    let worker = WorkerProcess::start(&db.url, &env).await.expect("worker");

    assert!(wait_until(Duration::from_secs(90), || async { embedded(&db).await == 1 }).await, "never embedded");
    let (attempts, error): (i32, Option<String>) =
        sqlx::query_as("SELECT embed_attempts, embed_error FROM memory_items WHERE id = $1")
            .bind(ids[0])
            .fetch_one(&db.pool)
            .await
            .expect("row");
    assert_eq!(
        (attempts, error),
        (4, None),
        "one attempt per scripted failure, then success: {:?} {:?}",
        provider.served(),
        provider.gaps()
    );
    assert!(provider.models().iter().all(|m| m == "scripted-embedder"), "{:?}", provider.models());
    let gaps = provider.gaps();
    assert_eq!(gaps.len(), 4, "five requests: four failures and the success");
    // Attempt n waits 2^(n-1) s ± 50% (the growth itself is checked by mnemo-jobs' unit test):
    // no retry came at once, and together they waited at least 0.5 + 1 + 2 + 4 s. Under load a
    // delayed job can wait longer for the interval poll, never less.
    assert!(gaps[0] >= Duration::from_millis(450), "{gaps:?}");
    assert!(gaps.iter().sum::<Duration>() >= Duration::from_millis(7400), "{gaps:?}");
    assert_eq!(worker.metric("mnemo_embed_failures_total").await, 4.0);
    worker.kill().await;
}

/// An endpoint that asks for a wait (Retry-After) is not called again sooner: the retry is due
/// that late, though the first backoff is 0.5–1.5 s.
#[tokio::test]
async fn a_retry_waits_as_long_as_the_endpoint_asked() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(32).await;
    provider.then([Answer::Busy { status: 429, retry_after_secs: 60 }]);
    let env = openai_env(&provider);
    write_messages(&server, 1, |_| "a row behind a rate limit".into()).await;
    let worker = WorkerProcess::start(&db.url, &env).await.expect("worker");
    let failed = "SELECT count(*) FROM memory_items WHERE embed_attempts = 1";
    assert!(wait_until(Duration::from_secs(30), || async { db.count(failed).await == 1 }).await, "never tried");
    let due_late = "SELECT count(*) FROM apalis.jobs WHERE job_type = 'embed' AND status = 'Pending' \
                    AND run_at > now() + interval '50 seconds'";
    assert!(wait_until(Duration::from_secs(10), || async { db.count(due_late).await == 1 }).await);
    assert_eq!(provider.served().0, 1, "not asked again");
    worker.kill().await;
}

#[tokio::test]
async fn a_refused_row_fails_alone_and_the_batch_goes_through() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(32).await;
    provider.refuse_inputs_containing("POISON");
    let env = openai_env(&provider);
    // Written before the worker starts, so one batch holds them all. The row after the refused
    // one is refused too for its previous turn, then embedded alone.
    let ids =
        write_messages(&server, 6, |i| if i == 3 { "POISON pill".into() } else { format!("fine text {i}") }).await;
    let worker = WorkerProcess::start(&db.url, &env).await.expect("worker");

    assert!(
        wait_until(Duration::from_secs(30), || async {
            db.count("SELECT count(*) FROM memory_items WHERE embed_error IS NOT NULL OR embedded_model IS NOT NULL")
                .await
                == 6
        })
        .await
    );
    assert_eq!(embedded(&db).await, 5);
    let poisoned: Option<String> = sqlx::query_scalar("SELECT embed_error FROM memory_items WHERE id = $1")
        .bind(ids[3])
        .fetch_one(&db.pool)
        .await
        .expect("row");
    assert!(poisoned.as_deref().is_some_and(|e| e.starts_with("http_4xx")), "{poisoned:?}");
    assert_eq!(db.count("SELECT sum(embed_attempts) FROM memory_items").await, 1, "only the refused row failed");
    worker.kill().await;
}

#[tokio::test]
async fn a_chat_message_is_embedded_with_the_turn_before_it() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(64).await;
    let turns = ["Caroline: I went to the pottery class", "Melanie: did she like it", "Caroline: she loved it"];
    let ids = write_messages(&server, 3, |i| turns[i].to_owned()).await;
    // A turn only some roles may see never lends its words to the vector of one that others see.
    // No write path gives a chat message roles yet, so the restriction is set directly.
    let session = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let mut more = Vec::new();
    for (source_ref, content) in [("m-3", "Caroline: my diagnosis came back"), ("m-4", "Melanie: how was it")] {
        let body = json!({ "source_kind": "chat_message", "source_ref": source_ref, "content": content });
        let reply = server.client.post("/v1/memories", Some(&session), &body).await;
        assert_eq!(reply.status, 201, "{:?}", reply.body);
        more.push(reply.body["id"].as_str().and_then(|s| s.parse::<Uuid>().ok()).expect("id"));
    }
    sqlx::query("UPDATE memory_items SET allowed_roles = '{coach}' WHERE id = $1")
        .bind(more[0])
        .execute(&db.pool)
        .await
        .expect("restrict");
    let t = token(&principal("acme", Some("u1"), Some("a1"), None));
    let fact = json!({ "content": "Caroline does pottery", "scope": "user" });
    let reply = server.client.post("/v1/facts", Some(&t), &fact).await;
    assert_eq!(reply.status, 201, "{:?}", reply.body);
    let fact_id: Uuid = reply.body["id"].as_str().and_then(|s| s.parse().ok()).expect("id");
    let worker = WorkerProcess::start(&db.url, &openai_env(&provider)).await.expect("worker");
    assert!(wait_until(Duration::from_secs(30), || async { embedded(&db).await == 6 }).await, "never embedded");

    let store = db.store();
    let vector = |id: Uuid| {
        let store = store.clone();
        async move { store.vector(&acme(), id, "scripted-embedder").await.expect("read").expect("vector") }
    };
    let bag = |text: &str| mnemo_testkit::unit_bag_of_words(text, 64);
    assert_eq!(vector(ids[0]).await, bag(turns[0]), "the first turn has nothing before it");
    assert_eq!(vector(ids[2]).await, bag(&format!("{}\n{}", turns[2], turns[1])), "content, then the turn before");
    assert_eq!(vector(fact_id).await, bag("Caroline does pottery"), "a fact is embedded alone");
    let restricted = bag(&format!("Caroline: my diagnosis came back\n{}", turns[2]));
    assert_eq!(vector(more[0]).await, restricted, "an open turn may lend its words to a restricted one");
    assert_eq!(
        vector(more[1]).await,
        bag(&format!("Melanie: how was it\n{}", turns[2])),
        "the restricted turn is passed over"
    );
    let stored: String = sqlx::query_scalar("SELECT content FROM memory_items WHERE id = $1")
        .bind(ids[2])
        .fetch_one(&db.pool)
        .await
        .expect("row");
    assert_eq!(stored, turns[2], "the stored content is unchanged");
    worker.kill().await;

    // Turned off, a message is embedded alone.
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let ids = write_messages(&server, 3, |i| turns[i].to_owned()).await;
    let mut env = openai_env(&provider);
    env.push(("MNEMO_EMBED_PREVIOUS_TURN", "false".into()));
    let worker = WorkerProcess::start(&db.url, &env).await.expect("worker");
    assert!(wait_until(Duration::from_secs(30), || async { embedded(&db).await == 3 }).await, "never embedded");
    let vector = db.store().vector(&acme(), ids[2], "scripted-embedder").await.expect("read").expect("vector");
    assert_eq!(vector, bag(turns[2]));
    worker.kill().await;
}

/// A message deleted through the API leaves recall at once, its words in the vector of the
/// message after it too: that message is embedded again with the turn before the deleted one.
#[tokio::test]
async fn a_deleted_turn_leaves_no_words_in_the_vector_of_the_next() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(64).await;
    let turns = ["Alice: how was the clinic", "Bob: my card pin is 4821", "Alice: ok noted"];
    let ids = write_messages(&server, 3, |i| turns[i].to_owned()).await;
    let worker = WorkerProcess::start(&db.url, &openai_env(&provider)).await.expect("worker");
    assert!(wait_until(Duration::from_secs(30), || async { embedded(&db).await == 3 }).await, "never embedded");
    let store = db.store();
    let vector = || async { store.vector(&acme(), ids[2], "scripted-embedder").await.expect("read") };
    let bag = |text: &str| mnemo_testkit::unit_bag_of_words(text, 64);
    assert_eq!(vector().await, Some(bag(&format!("{}\n{}", turns[2], turns[1]))));

    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let deleted = server.client.delete(&format!("/v1/memories/{}", ids[1]), Some(&t)).await;
    assert_eq!(deleted.status, 200, "{:?}", deleted.body);
    let without = Some(bag(&format!("{}\n{}", turns[2], turns[0])));
    assert!(
        wait_until(Duration::from_secs(30), || async { vector().await == without }).await,
        "the next turn's vector still holds the deleted turn's words"
    );
    worker.kill().await;
}

/// A chat message's vector holds words of the turn before it. When that turn is anonymized (here
/// by its user's erasure) the vector goes and the message is embedded again without them, also
/// when the erasure lands while the message is being embedded.
#[tokio::test]
async fn an_anonymized_turn_leaves_no_words_in_the_vector_of_the_next() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(64).await;
    let mut env = openai_env(&provider);
    // Housekeeping's re-queueing of rows without a vector must not stand in for the mend.
    env.push(("MNEMO_EMBED_GRACE_S", "3600".into()));
    let coach = token(&principal("acme", None, Some("a1"), Some("s1")));
    let write = |user: Option<&'static str>, source_ref: &'static str, content: &'static str| {
        let t = user.map_or(coach.clone(), |u| token(&principal("acme", Some(u), Some("a1"), Some("s1"))));
        let client = server.client.clone();
        async move {
            let body = json!({ "source_kind": "chat_message", "source_ref": source_ref, "content": content });
            let reply = client.post("/v1/memories", Some(&t), &body).await;
            assert_eq!(reply.status, 201, "{:?}", reply.body);
            reply.body["id"].as_str().and_then(|s| s.parse::<Uuid>().ok()).expect("id")
        }
    };
    let greeting = "Coach: how are you today";
    // Replies carrying no user would go with the erased user: the next turns are another user's.
    let answer = "Carol: I am sorry to hear that";
    write(None, "m-0", greeting).await;
    write(Some("alice"), "m-1", "Alice: my diagnosis came back positive").await;
    let reply = write(Some("carol"), "m-2", answer).await;
    write(Some("alice"), "m-3", "Alice: the doctor said it is early").await;
    let later = write(Some("carol"), "m-4", "Carol: that is good news").await;
    let worker = WorkerProcess::start(&db.url, &env).await.expect("worker");
    assert!(wait_until(Duration::from_secs(30), || async { embedded(&db).await == 5 }).await, "never embedded");
    let store = db.store();
    let model = "scripted-embedder";
    let bag = |text: &str| mnemo_testkit::unit_bag_of_words(text, 64);
    let vector = |id: Uuid| {
        let store = store.clone();
        async move { store.vector(&acme(), id, model).await.expect("read") }
    };
    assert_eq!(vector(reply).await, Some(bag(&format!("{answer}\nAlice: my diagnosis came back positive"))));
    // A vector made before migration 036 does not name its turn: the turn's next message is taken.
    sqlx::query("UPDATE memory_embeddings SET previous_id = '00000000-0000-0000-0000-000000000000' WHERE item_id = $1")
        .bind(later)
        .execute(&db.pool)
        .await
        .expect("a vector of before");

    // Failures of its first embedding do not stretch the backoff of the next.
    sqlx::query("UPDATE memory_items SET embed_attempts = 9 WHERE id = $1")
        .bind(reply)
        .execute(&db.pool)
        .await
        .expect("attempts");

    let acme = mnemo_core::TenantId::parse("acme").expect("tenant");
    let user = |u: &str| mnemo_core::UserId::parse(u).expect("user");
    let (erased, _) = store.erase_user_rows(&acme, &user("alice"), Uuid::nil(), 100, "test").await.expect("erase");
    assert_eq!(erased.len(), 2);
    assert_eq!(db.count(&format!("SELECT embed_attempts::bigint FROM memory_items WHERE id = '{reply}'")).await, 0);
    assert!(
        wait_until(Duration::from_secs(30), || async {
            vector(reply).await == Some(bag(&format!("{answer}\n{greeting}")))
                && vector(later).await == Some(bag(&format!("Carol: that is good news\n{answer}")))
        })
        .await,
        "embedded again with the turn before the erased one"
    );
    // The words keyword search weighs by are those of the live rows, each counted once.
    let wrong = "WITH kept AS (SELECT lexeme, documents FROM tenant_lexemes WHERE tenant_id = 'acme'),
                     held AS (SELECT l, count(*) FROM memory_items m CROSS JOIN unnest(tsvector_to_array(m.tsv)) AS l
                              WHERE m.tenant_id = 'acme' AND m.tsv IS NOT NULL GROUP BY 1)
                 SELECT count(*) FROM ((TABLE kept EXCEPT TABLE held) UNION ALL (TABLE held EXCEPT TABLE kept)) d";
    assert_eq!(db.count(wrong).await, 0, "the words' counts are not those of the rows");
    assert_eq!(db.count("SELECT documents FROM tenant_lexemes WHERE lexeme = 'sorri'").await, 1);
    worker.kill().await;

    // Read with a turn that is erased before its vector is stored: the vector is refused and the
    // row queued again (its own job is spent by then).
    write(Some("bob"), "m-5", "Bob: my salary is ninety thousand").await;
    let noted = write(Some("carol"), "m-6", "Carol: noted").await;
    sqlx::query("DELETE FROM apalis.jobs WHERE job_type = 'embed'").execute(&db.pool).await.expect("take the jobs");
    let row = mnemo_store::queue::EmbedRow { tenant_id: acme.clone(), item_id: noted, content_sha256: String::new() };
    let read = store.rows_to_embed(&[row], model, true).await.expect("read");
    let made = mnemo_store::NewVector {
        id: noted,
        tenant_id: acme.clone(),
        content_sha256: read[0].content_sha256.clone(),
        embedding: bag(&mnemo_core::embedding_text(&read[0].content, read[0].previous.as_deref())),
        previous_id: read[0].previous_id,
    };
    assert_eq!(read[0].previous.as_deref(), Some("Bob: my salary is ninety thousand"));
    store.erase_user_rows(&acme, &user("bob"), Uuid::nil(), 100, "test").await.expect("erase");
    assert_eq!(store.save_vectors(model, vec![made]).await.expect("save"), Vec::<Uuid>::new());
    let worker = WorkerProcess::start(&db.url, &env).await.expect("worker");
    assert!(
        wait_until(Duration::from_secs(30), || async {
            vector(noted).await == Some(bag("Carol: noted\nCarol: that is good news"))
        })
        .await,
        "embedded again without the erased turn"
    );
    worker.kill().await;
}

#[tokio::test]
async fn a_wrong_dimension_is_retried_until_the_endpoint_answers_right() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(16).await;
    provider.then([Answer::WrongDimension]);
    let env = openai_env(&provider);
    write_messages(&server, 1, |_| "one row".into()).await;
    let worker = WorkerProcess::start(&db.url, &env).await.expect("worker");
    assert!(wait_until(Duration::from_secs(30), || async { embedded(&db).await == 1 }).await, "never embedded");
    let attempts = db.count("SELECT embed_attempts::bigint FROM memory_items WHERE embed_error IS NULL").await;
    assert_eq!(attempts, 1, "one failed attempt, then the retry embedded it");
    // By default no request asks the model to shorten its vectors: many models refuse it.
    assert_eq!(provider.dimensions_asked(), [None, None]);
    worker.kill().await;
}

/// One vector of another length among right ones is that row's failure (the worker's check of
/// each vector fails it alone), not the call's; every vector of another length is a misconfigured
/// model, the whole call's.
#[tokio::test]
async fn one_vector_of_a_wrong_dimension_is_its_rows_failure_not_the_calls() {
    let provider = ScriptedEmbeddings::start(16).await;
    let env = mnemo_config::Env::from_pairs(openai_env(&provider));
    let settings = mnemo_config::EmbedSettings::from_env(&env).expect("settings");
    let embedder = mnemo_models::embedder(&settings).expect("embedder");
    let texts: Vec<String> = ["one row", "another row", "a third row"].map(String::from).into();
    provider.then([Answer::FirstWrongDimension, Answer::WrongDimension]);
    let vectors = embedder.embed(&texts).await.expect("answered");
    assert_eq!(vectors.iter().map(Vec::len).collect::<Vec<_>>(), [17, 16, 16]);
    let misconfigured = embedder.embed(&texts).await.expect_err("a model of another size");
    assert_eq!(misconfigured.kind, "dimension_mismatch");
}

/// All-zero vectors are the endpoint's fault as much as a wrong dimension: the row is retried,
/// not given up for good.
#[tokio::test]
async fn a_zero_vector_is_retried_until_the_endpoint_answers_right() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(16).await;
    provider.then([Answer::ZeroVectors]);
    write_messages(&server, 1, |_| "one row".into()).await;
    let mut env = openai_env(&provider);
    env.push(("MNEMO_EMBED_SEND_DIMENSIONS", "true".into()));
    let worker = WorkerProcess::start(&db.url, &env).await.expect("worker");
    assert!(wait_until(Duration::from_secs(30), || async { embedded(&db).await == 1 }).await, "never embedded");
    let attempts = db.count("SELECT embed_attempts::bigint FROM memory_items WHERE embed_error IS NULL").await;
    assert_eq!(attempts, 1, "one failed attempt, then the retry embedded it");
    assert_eq!(provider.dimensions_asked(), [Some(16), Some(16)], "asked for, as configured");
    worker.kill().await;
}

/// An answer larger than any answer to the request could be is not read to its end: the
/// endpoint's fault, retried, the row embedded once it answers right.
#[tokio::test]
async fn an_answer_over_its_size_bound_is_retried_until_the_endpoint_answers_right() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(16).await;
    provider.then([Answer::Oversized]);
    write_messages(&server, 1, |_| "one row".into()).await;
    // One input a request: the bound is its least, 1 MiB, under the scripted 2 MiB.
    let mut env = openai_env(&provider);
    env.push(("MNEMO_EMBED_MAX_INPUTS", "1".into()));
    let worker = WorkerProcess::start(&db.url, &env).await.expect("worker");
    assert!(wait_until(Duration::from_secs(30), || async { embedded(&db).await == 1 }).await, "never embedded");
    let attempts = db.count("SELECT embed_attempts::bigint FROM memory_items WHERE embed_error IS NULL").await;
    assert_eq!(attempts, 1, "one failed attempt, then the retry embedded it");
    worker.kill().await;
}

/// A row given up on (here a refused input; likewise attempts used up in a long outage) is
/// embedded again by `mnemo-runbook embed-retry` once the cause is mended.
#[tokio::test]
async fn rows_given_up_on_are_embedded_again_by_the_runbook() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(16).await;
    provider.then([Answer::Status(400)]);
    write_messages(&server, 1, |_| "one row".into()).await;
    let worker = WorkerProcess::start(&db.url, &openai_env(&provider)).await.expect("worker");
    let given_up = "SELECT count(*) FROM memory_items WHERE embed_error IS NOT NULL";
    assert!(wait_until(Duration::from_secs(30), || async { db.count(given_up).await == 1 }).await, "not given up");
    let output = std::process::Command::new(mnemo_testkit::binary("mnemo-runbook").expect("built"))
        .args(["embed-retry", "--tenant", "acme", "--json"])
        .env_clear()
        .env("MNEMO_DATABASE_URL", &db.url)
        .output()
        .expect("ran");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(report["queued"], 1);
    // Progress goes to stderr as it goes, with --json too (stdout holds only the answer).
    assert!(String::from_utf8_lossy(&output.stderr).contains("1 rows queued to embed again"));
    assert!(wait_until(Duration::from_secs(30), || async { embedded(&db).await == 1 }).await, "never embedded");
    assert_eq!(db.count(given_up).await, 0);
    worker.kill().await;
}

/// An endpoint that refuses the key or does not know the model (401, 403, 404: a key rotated, a
/// model misnamed) is in a state its operator mends: the row is retried and embedded, not given
/// up at the first answer as a refused input is.
#[tokio::test]
async fn an_endpoint_that_refuses_the_key_is_retried_not_given_up() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(16).await;
    provider.then([Answer::Status(401), Answer::Status(403), Answer::Status(404)]);
    write_messages(&server, 1, |_| "one row".into()).await;
    let worker = WorkerProcess::start(&db.url, &openai_env(&provider)).await.expect("worker");
    assert!(wait_until(Duration::from_secs(60), || async { embedded(&db).await == 1 }).await, "never embedded");
    assert_eq!(db.count("SELECT count(*) FROM memory_items WHERE embed_error IS NOT NULL").await, 0);
    assert_eq!(db.count("SELECT embed_attempts::bigint FROM memory_items").await, 3, "three refusals, then a vector");
    worker.kill().await;
}

/// A row whose calls fail while the endpoint answers others and fails new rows too (an endpoint
/// that flaps): each answer brings its retry forward, so it makes its attempts within seconds.
/// It is given up only once it has been failing as long as its backoffs take at their shortest
/// (15.5 s for 6 attempts), and then it is given up: a row that never embeds is not retried
/// forever. Before, it was given up at its sixth attempt, a few seconds after the first.
#[tokio::test]
async fn a_row_whose_retries_are_brought_forward_is_kept_for_its_whole_schedule() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(16).await;
    provider.fail_inputs_containing("flaky", 503);
    let mut env = openai_env(&provider);
    env.push(("MNEMO_EMBED_MAX_ATTEMPTS", "6".into()));
    // Each message alone, and in a call of its own: the others neither carry the failing one's
    // words nor fail in its batch, so they keep succeeding.
    env.push(("MNEMO_EMBED_PREVIOUS_TURN", "false".into()));
    env.push(("MNEMO_EMBED_BATCH_SIZE", "1".into()));
    let worker = WorkerProcess::start(&db.url, &env).await.expect("worker");
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let write = async |source_ref: String, content: &str| {
        let body = json!({ "source_kind": "chat_message", "source_ref": source_ref, "content": content });
        let reply = server.client.post("/v1/memories", Some(&t), &body).await;
        assert_eq!(reply.status, 201, "{:?}", reply.body);
        reply.body["id"].as_str().and_then(|s| s.parse::<Uuid>().ok()).expect("id")
    };
    let flaky = write("flaky".into(), "a flaky row").await;
    let (mut kept_past_its_attempts, mut given_up) = (false, false);
    let started = std::time::Instant::now();
    for i in 0.. {
        assert!(started.elapsed() < Duration::from_secs(90), "never given up");
        // Other rows keep the endpoint answering, and new rows failing at their first attempt
        // say it fails (a retry failing alone does not: that may be the row's own trouble).
        write(format!("other-{i}"), &format!("row {i} about the garden")).await;
        write(format!("flaky-{i}"), &format!("another flaky row {i}")).await;
        tokio::time::sleep(Duration::from_millis(250)).await;
        let (attempts, error, failing_secs): (i32, bool, Option<f64>) = sqlx::query_as(
            "SELECT embed_attempts, embed_error IS NOT NULL,
                    extract(epoch FROM now() - embed_failing_since)::float8
             FROM memory_items WHERE id = $1",
        )
        .bind(flaky)
        .fetch_one(&db.pool)
        .await
        .expect("row");
        let failing_secs = failing_secs.unwrap_or_default();
        if error {
            assert!(failing_secs >= 15.5, "given up after {attempts} attempts in {failing_secs:.1} s");
            given_up = true;
            break;
        }
        kept_past_its_attempts |= attempts >= 6;
    }
    assert!(given_up && kept_past_its_attempts, "its retries were not brought forward past its 6 attempts");
    assert!(embedded(&db).await >= 2, "the other rows were embedded");
    worker.kill().await;
}

/// A row whose input draws a server error (some endpoints answer 500 for one input) fails only
/// itself: before, it failed every row of its batch at each of its retries.
#[tokio::test]
async fn a_row_whose_input_draws_a_server_error_does_not_fail_its_batch() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(16).await;
    provider.fail_inputs_containing("poison", 500);
    write_messages(&server, 8, |i| if i == 5 { "the poison row".into() } else { format!("row {i} about the garden") })
        .await;
    let mut env = openai_env(&provider);
    // Each message alone: a next turn would carry the failing one's words.
    env.push(("MNEMO_EMBED_PREVIOUS_TURN", "false".into()));
    let worker = WorkerProcess::start(&db.url, &env).await.expect("worker");
    assert!(wait_until(Duration::from_secs(30), || async { embedded(&db).await == 7 }).await, "never embedded");
    let poison_failed = "SELECT count(*) FROM memory_items WHERE content LIKE '%poison%' AND embed_attempts >= 1";
    assert!(wait_until(Duration::from_secs(10), || async { db.count(poison_failed).await == 1 }).await);
    let clean = "SELECT count(*) FROM memory_items WHERE content NOT LIKE '%poison%' AND embed_attempts = 0";
    assert_eq!(db.count(clean).await, 7, "the poison row's batch-mates never failed");
    worker.kill().await;
}

/// A row waiting out a long backoff is retried as soon as the endpoint answers another row: an
/// outage's backlog drains when the endpoint is mended, not minutes later.
#[tokio::test]
async fn rows_waiting_out_a_backoff_are_retried_once_the_endpoint_answers_again() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(16).await;
    provider.then([Answer::Status(503)]);
    let worker = WorkerProcess::start(&db.url, &openai_env(&provider)).await.expect("worker");
    write_messages(&server, 1, |_| "written during the outage".into()).await;
    let failed_once = || async { db.count("SELECT count(*) FROM memory_items WHERE embed_attempts = 1").await == 1 };
    assert!(wait_until(Duration::from_secs(30), failed_once).await, "the first attempt never failed");
    // As if its backoff had grown long over an outage.
    let delayed = sqlx::query("UPDATE apalis.jobs SET run_at = now() + interval '1 hour' WHERE status = 'Pending'")
        .execute(&db.pool)
        .await
        .expect("delay")
        .rows_affected();
    assert_eq!(delayed, 1);

    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let body = json!({ "source_kind": "chat_message", "source_ref": "after", "content": "written after the outage" });
    assert_eq!(server.client.post("/v1/memories", Some(&t), &body).await.status, 201);
    assert!(
        wait_until(Duration::from_secs(20), || async { embedded(&db).await == 2 }).await,
        "the row in backoff was not retried when the endpoint answered again"
    );
    worker.kill().await;
}

#[tokio::test]
async fn housekeeping_fires_once_per_tick_across_workers() {
    let db = TestDb::new().await;
    let provider = ScriptedEmbeddings::start(8).await;
    let mut env = openai_env(&provider);
    env.push(("MNEMO_HOUSEKEEPING_INTERVAL_S", "1".into()));
    let a = WorkerProcess::start(&db.url, &env).await.expect("worker a");
    let b = WorkerProcess::start(&db.url, &env).await.expect("worker b");
    tokio::time::sleep(Duration::from_secs(6)).await;

    // A tick's row is written when it is claimed and its metric when it ends, so the metrics are
    // read first: every run they count has its row by then, and a tick claimed while we read
    // (in flight, or begun between the reads) shows only in the rows.
    let runs = a.metric("mnemo_housekeeping_runs_total").await + b.metric("mnemo_housekeeping_runs_total").await;
    let ticks = db.count("SELECT count(*) FROM housekeeping_ticks").await;
    assert!(ticks >= 4, "only {ticks} ticks in 6 s");
    let runs = runs as i64;
    assert!(
        runs <= ticks && runs >= ticks - 2,
        "{runs} runs for {ticks} ticks: each tick runs once across both workers"
    );
    let workers = db.count("SELECT count(DISTINCT worker) FROM housekeeping_ticks").await;
    assert!(workers >= 1);
    a.kill().await;
    b.kill().await;
}

#[tokio::test]
async fn switching_the_model_fills_new_vectors_and_keeps_the_old() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(8).await;
    let mut env = openai_env(&provider);
    env.push(("MNEMO_EMBED_GRACE_S", "1".into()));
    env.push(("MNEMO_HOUSEKEEPING_INTERVAL_S", "1".into()));
    write_messages(&server, 20, |i| format!("row {i}")).await;

    let a = WorkerProcess::start(&db.url, &env).await.expect("worker with model A");
    assert!(wait_until(Duration::from_secs(30), || async { embedded(&db).await == 20 }).await);
    a.kill().await;

    env.push(("MNEMO_EMBED_MODEL", "scripted-embedder-v2".into()));
    let b = WorkerProcess::start(&db.url, &env).await.expect("worker with model B");
    let on_b =
        || async { db.count("SELECT count(*) FROM memory_items WHERE embedded_model = 'scripted-embedder-v2'").await };
    assert!(
        wait_until(Duration::from_secs(30), || async { on_b().await == 20 }).await,
        "housekeeping did not backfill"
    );
    assert_eq!(db.count("SELECT count(*) FROM memory_embeddings WHERE model = 'scripted-embedder'").await, 20);
    assert_eq!(db.count("SELECT count(*) FROM memory_embeddings WHERE model = 'scripted-embedder-v2'").await, 20);
    b.kill().await;

    // Back to model A, whose vectors are there: the rows say so again, and are not queued again
    // at every housekeeping tick (each then skipped by the worker, forever).
    env.pop();
    let a = WorkerProcess::start(&db.url, &env).await.expect("worker with model A again");
    let on_a = "SELECT count(*) FROM memory_items WHERE embedded_model = 'scripted-embedder'";
    assert!(wait_until(Duration::from_secs(30), || async { db.count(on_a).await == 20 }).await, "never recorded");
    let served = provider.served();
    let queued = || async {
        db.count("SELECT count(*) FROM memory_items WHERE embed_enqueued_at > now() - interval '2.5 seconds'").await
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(queued().await, 0, "housekeeping queued rows that have their vectors");
    assert_eq!(provider.served(), served, "a row was embedded again");
    a.kill().await;
}

#[tokio::test]
async fn a_missing_model_is_a_clear_start_up_error() {
    let db = TestDb::new().await;
    let output = tokio::process::Command::new(mnemo_testkit::binary("mnemo-worker").expect("built"))
        .env_clear()
        .env("MNEMO_DATABASE_URL", &db.url)
        .env("MNEMO_LOCAL_MODEL_DIR", "/nonexistent/model")
        .output()
        .await
        .expect("ran");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("/nonexistent/model") && stderr.contains("scripts/fetch-model.sh"), "{stderr}");
}

#[tokio::test]
async fn another_model_s_folder_is_a_clear_start_up_error() {
    // The folder holds all-MiniLM-L6-v2 (384 dimensions); all-mpnet-base-v2 is named.
    let dir = std::env::var("MNEMO_LOCAL_MODEL_DIR").expect("MNEMO_LOCAL_MODEL_DIR (scripts/test.sh sets it)");
    let db = TestDb::new().await;
    let worker = tokio::process::Command::new(mnemo_testkit::binary("mnemo-worker").expect("built"))
        .env_clear()
        .env("MNEMO_DATABASE_URL", &db.url)
        .env("MNEMO_EMBED_MODEL", "all-mpnet-base-v2")
        .env("MNEMO_LOCAL_MODEL_DIR", &dir)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(60), worker)
        .await
        .expect("the worker started with another model's folder")
        .expect("ran");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("384 dimensions") && stderr.contains("all-mpnet-base-v2 has 768"), "{stderr}");
}

#[tokio::test]
async fn status_reports_queues_backlog_and_workers() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    write_messages(&server, 3, |i| format!("row {i}")).await;
    let runbook = |args: &[&str]| {
        let mut command = std::process::Command::new(mnemo_testkit::binary("mnemo-runbook").expect("built"));
        command.args(args).env_clear().env("MNEMO_DATABASE_URL", &db.url);
        command.output().expect("ran")
    };
    let output = runbook(&["status", "--json"]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    // Every queue is listed, an empty one with zeros (a gauge of a queue gone empty reads 0).
    let queue = |name: &str| report["queues"].as_array().and_then(|q| q.iter().find(|q| q["queue"] == name)).cloned();
    assert_eq!(queue("embed").map(|q| q["pending"].clone()), Some(serde_json::json!(3)), "{report}");
    let judge = queue("judge").expect("an empty queue is listed");
    assert_eq!((judge["pending"].as_i64(), judge["done"].as_i64()), (Some(0), Some(0)), "{report}");
    assert_eq!(report["embeddings"]["pending"], 3);
    assert_eq!(report["workers"]["alive"], 0);
    let text = runbook(&["status"]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("3 rows pending"));
    // A row whose vector was dropped (it held an anonymized turn's words) keeps its model: its
    // embedding given up counts as failed all the same.
    sqlx::query(
        "UPDATE memory_items SET embedded_model = 'all-MiniLM-L6-v2', embed_error = 'given up'
         WHERE id = (SELECT id FROM memory_items ORDER BY id LIMIT 1)",
    )
    .execute(&db.pool)
    .await
    .expect("a re-embedding given up");
    let output = runbook(&["status", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!((&report["embeddings"]["pending"], &report["embeddings"]["failed"]), (&json!(2), &json!(1)), "{report}");
}

#[tokio::test]
async fn sigterm_lets_in_flight_batches_finish() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    write_messages(&server, 200, |i| format!("message {i} about the migration plan")).await;
    let env = [("MNEMO_WORKER_ORPHAN_TIMEOUT_S", "3"), ("MNEMO_EMBED_BATCH_SIZE", "16")];
    let worker = WorkerProcess::start(&db.url, &env).await.expect("worker");
    assert!(wait_until(Duration::from_secs(120), || async { embedded(&db).await >= 20 }).await);
    let status = worker.terminate().await.expect("stops");
    assert!(status.success(), "exit {status}");
    // Nothing the stopped worker started is left half-done: every job it ran finished.
    let running = db.count("SELECT count(*) FROM apalis.jobs WHERE status = 'Running'").await;
    assert_eq!(running, 0, "jobs left Running after a graceful stop");

    let next = WorkerProcess::start(&db.url, &env).await.expect("next worker");
    assert!(wait_until(Duration::from_secs(120), || async { embedded(&db).await == 200 }).await, "rows lost");
    assert_eq!(db.count("SELECT count(*) FROM memory_embeddings").await, 200);
    next.kill().await;
}

#[tokio::test]
async fn a_job_past_its_timeout_runs_again_and_is_not_left_running() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let provider = ScriptedEmbeddings::start(32).await;
    // The model call outlives the 1 s job timeout; the batch it belongs to still finishes.
    provider.then([Answer::Hang(Duration::from_secs(3))]);
    let mut env = openai_env(&provider);
    env.retain(|(name, _)| *name != "MNEMO_EMBED_TIMEOUT_MS");
    env.extend([("MNEMO_EMBED_TIMEOUT_MS", "10000".to_owned()), ("MNEMO_JOB_TIMEOUT_S", "1".to_owned())]);
    write_messages(&server, 1, |_| "a row behind a slow model".into()).await;
    let worker = WorkerProcess::start(&db.url, &env).await.expect("worker");

    assert!(wait_until(Duration::from_secs(30), || async { embedded(&db).await == 1 }).await, "never embedded");
    // The timed-out job was retried as a new one; none stays Running in a live worker's hands
    // (apalis' own timeout left it so until the worker stopped).
    let running = || async { db.count("SELECT count(*) FROM apalis.jobs WHERE status = 'Running'").await };
    assert!(wait_until(Duration::from_secs(20), || async { running().await == 0 }).await, "a job left Running");
    assert!(worker.metric("mnemo_job_retries_total").await >= 1.0, "the timed-out job was retried");
    worker.kill().await;
}

#[tokio::test]
async fn housekeeping_queues_again_only_rows_whose_job_is_gone() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    write_messages(&server, 5, |i| format!("row {i}")).await;
    let jobs = || async { db.count("SELECT count(*) FROM apalis.jobs WHERE job_type = 'embed'").await };
    let before = jobs().await;
    assert!(before >= 1);
    let store = db.store();
    tokio::time::sleep(Duration::from_millis(1100)).await;

    // A backlog older than the grace: every row's job still waits, so nothing is queued twice.
    let requeued = store.requeue_unembedded("scripted-embedder", Duration::from_secs(1), 100).await.expect("requeue");
    assert_eq!((requeued, jobs().await), (0, before));
    // Jobs lost (as an operator's purge would lose them): their rows are queued again.
    sqlx::query("DELETE FROM apalis.jobs").execute(&db.pool).await.expect("purge");
    let requeued = store.requeue_unembedded("scripted-embedder", Duration::from_secs(1), 100).await.expect("requeue");
    assert_eq!(requeued, 5);
    assert!(jobs().await >= 1);

    // Jobs queued again after a failure, waiting out a backoff longer than the grace, are not
    // lost: their rows are not queued a second time.
    let queued: Vec<Vec<u8>> = sqlx::query_scalar("SELECT job FROM apalis.jobs WHERE job_type = 'embed'")
        .fetch_all(&db.pool)
        .await
        .expect("jobs");
    sqlx::query("DELETE FROM apalis.jobs").execute(&db.pool).await.expect("purge");
    for job in &queued {
        let job: mnemo_store::queue::EmbedJob = serde_json::from_slice(job).expect("an embed job");
        store.retry_failed(&job, Duration::from_secs(300), 1).await.expect("retry");
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let requeued = store.requeue_unembedded("scripted-embedder", Duration::from_secs(1), 100).await.expect("requeue");
    assert_eq!(requeued, 0, "rows whose retry waits are not queued again");
}
