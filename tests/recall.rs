//! `POST /v1/recall` against a real PostgreSQL: scopes and their 401s, class priors, retired
//! rows, the degraded flag, a failing embedder, a scripted TEI reranker that fails on cue, and
//! randomized tenant isolation. Query vectors come from a scripted OpenAI-compatible provider
//! (bag of words), and rows get the same vectors, so rankings are deterministic; one test runs
//! the real worker and local model end to end.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mnemo_config::{Env, RecallSettings, ServerSettings, vars};
use mnemo_core::{MemoryText, Principal, RecallClass, RecallRequest, RecallScope, Scope, SourceKind, SourceRef};
use mnemo_recall::{Recall, RecallOptions};
use mnemo_store::{BulkRow, CommonLexemes, SearchScope};
use mnemo_testkit::{
    Answer, LazyEmbedder, RerankAnswer, ScriptedEmbeddings, ScriptedReranker, ServerProcess, TestApp, WorkerProcess,
    binary, embed_like_the_provider, free_port, principal, server_env, token, unit_bag_of_words, wait_until,
};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use uuid::Uuid;

const MODEL: &str = "scripted";
const DIMS: usize = 64;

struct Fixture {
    app: TestApp,
    provider: ScriptedEmbeddings,
}

impl Fixture {
    async fn start(extra: &[(&str, &str)]) -> Self {
        let provider = ScriptedEmbeddings::start(DIMS).await;
        let mut env = provider.env(MODEL);
        env.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
        Self { app: TestApp::spawn_with(&env).await, provider }
    }

    async fn write(&self, who: &Principal, kind: &str, source_ref: &str, content: &str) -> Uuid {
        id_of(self.try_write(who, kind, source_ref, content).await)
    }

    async fn try_write(&self, who: &Principal, kind: &str, source_ref: &str, content: &str) -> mnemo_testkit::Reply {
        let body = json!({ "source_kind": kind, "source_ref": source_ref, "content": content });
        self.app.client.post("/v1/memories", Some(&token(who)), &body).await
    }

    async fn fact(&self, who: &Principal, scope: &str, content: &str) -> Uuid {
        id_of(self.try_fact(who, scope, content).await)
    }

    async fn try_fact(&self, who: &Principal, scope: &str, content: &str) -> mnemo_testkit::Reply {
        let body = json!({ "scope": scope, "content": content });
        self.app.client.post("/v1/facts", Some(&token(who)), &body).await
    }

    async fn embed_all(&self) {
        embed_like_the_provider(&self.app.db.store(), MODEL, DIMS).await;
    }

    async fn recall(&self, who: &Principal, body: Value) -> Value {
        let reply = self.app.client.post("/v1/recall", Some(&token(who)), &body).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        reply.body
    }

    /// The Rust API the server uses, over the same database and provider.
    fn recall_api(&self) -> Recall {
        let settings = ServerSettings::from_env(&self.env()).expect("settings");
        Recall::new(self.app.db.store(), Arc::new(LazyEmbedder::new(settings.embed)), None, RecallSettings::default())
    }

    fn env(&self) -> Env {
        server_env(&self.app.db.url, &self.env_pairs())
    }

    /// The database and the scripted provider, as environment variables.
    fn env_pairs(&self) -> Vec<(&'static str, String)> {
        let mut pairs = self.provider.env(MODEL);
        pairs.push((vars::DATABASE_URL, self.app.db.url.clone()));
        pairs
    }
}

fn id_of(reply: mnemo_testkit::Reply) -> Uuid {
    assert!(reply.status == 201 || reply.status == 200, "{:?}", reply.body);
    reply.body["id"].as_str().and_then(|s| s.parse().ok()).expect("id")
}

/// The source_refs of a recall answer, in order.
fn refs(answer: &Value) -> Vec<String> {
    answer["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|i| i["source_ref"].as_str().expect("ref").to_owned())
        .collect()
}

/// Search `classes` of `who`'s tenant, every kind, live rows, no roles.
fn every_kind<'a>(who: &'a Principal, classes: &'a [RecallClass]) -> SearchScope<'a> {
    SearchScope { tenant: &who.tenant, classes, kinds: &[], include_superseded: false, roles: &[], user: None }
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// A vector of `DIMS` random components, of length 1.
fn random_unit(rng: &mut StdRng) -> Vec<f32> {
    let raw: Vec<f32> = (0..DIMS).map(|_| rng.random_range(-1.0..1.0)).collect();
    let norm = raw.iter().map(|x| x * x).sum::<f32>().sqrt();
    raw.iter().map(|x| x / norm).collect()
}

/// A row of `who`'s in `scope` (a chat message in its session, or a shared chunk) written `at`,
/// with a random vector, for `Store::bulk_load`.
fn random_row(
    rng: &mut StdRng,
    who: &Principal,
    scope: Scope,
    source_ref: &str,
    at: chrono::DateTime<chrono::Utc>,
) -> BulkRow {
    BulkRow {
        id: Uuid::now_v7(),
        tenant: who.tenant.clone(),
        scope,
        session: (scope == Scope::Session).then(|| who.session.clone()).flatten(),
        user: None,
        agent: None,
        kind: if scope == Scope::Session { SourceKind::ChatMessage } else { SourceKind::DocumentChunk },
        source_ref: SourceRef::parse(source_ref).expect("ref"),
        content: MemoryText::parse("row").expect("text"),
        created_at: Some(at),
        deleted_at: None,
        vector: Some(random_unit(rng)),
    }
}

#[tokio::test]
async fn each_scope_searches_its_own_class_and_needs_its_identity() {
    let f = Fixture::start(&[]).await;
    let me = principal("acme", Some("u1"), Some("a1"), Some("s1"));
    let other = principal("acme", Some("u2"), Some("a2"), Some("s2"));
    f.write(&me, "chat_message", "mine", "alpha note in my session").await;
    f.write(&me, "chat_message", "mine-too", "alpha second note in my session").await;
    f.write(&other, "chat_message", "theirs", "alpha note in another session").await;
    f.write(&me, "tool_output", "call-1", "alpha tool result").await;
    f.write(&principal("acme", None, None, None), "document_chunk", "doc-1", "alpha document chunk").await;
    let my_fact = f.fact(&me, "user", "alpha fact about me").await;
    f.fact(&other, "user", "alpha fact about someone else").await;
    let agent_fact = f.fact(&me, "agent", "alpha fact this agent learned").await;
    f.fact(&other, "agent", "alpha fact another agent learned").await;
    f.embed_all().await;

    let found = |scope: &str| {
        let f = &f;
        let me = &me;
        let scope = scope.to_owned();
        async move { f.recall(me, json!({ "query": "alpha", "scope": scope, "top_k": 20 })).await }
    };
    assert_eq!(sorted(refs(&found("session").await)), ["call-1", "mine", "mine-too"]);
    assert_eq!(refs(&found("tenant").await), ["doc-1"]);
    let user = found("user").await;
    assert_eq!(user["items"][0]["id"], json!(my_fact), "{user}");
    assert_eq!(user["total"], 1);
    let agent = found("agent").await;
    assert_eq!(agent["items"][0]["id"], json!(agent_fact));
    assert_eq!(agent["total"], 1);
    let any = found("any").await;
    assert_eq!(any["total"], 6, "{any}");
    assert_eq!(any["degraded"], false);
    assert_eq!(any["rerank_used"], false, "no reranker is configured");
    let item = &any["items"][0];
    for field in ["id", "source_kind", "source_ref", "content", "event_time", "score"] {
        assert!(!item[field].is_null(), "{field} missing from {item}");
    }

    // The default scope is any, and source_kinds narrows it.
    let facts = f.recall(&me, json!({ "query": "alpha", "source_kinds": ["fact"], "top_k": 20 })).await;
    assert_eq!(facts["total"], 2);
    let chunks = f.recall(&me, json!({ "query": "alpha", "source_kinds": ["document_chunk"] })).await;
    assert_eq!(refs(&chunks), ["doc-1"]);
    assert_eq!(f.recall(&me, json!({ "query": "alpha" })).await["total"], 5, "top_k defaults to 5");

    // A scope whose identity the token lacks is a 401; any searches what the token can reach.
    let service = principal("acme", None, None, None);
    for scope in ["user", "agent", "session"] {
        let reply =
            f.app.client.post("/v1/recall", Some(&token(&service)), &json!({ "query": "alpha", "scope": scope })).await;
        assert_eq!((reply.status, reply.code()), (401, "missing_identity"), "{scope}: {:?}", reply.body);
    }
    assert_eq!(refs(&f.recall(&service, json!({ "query": "alpha" })).await), ["doc-1"]);
}

#[tokio::test]
async fn bad_recall_requests_get_clear_errors() {
    let f = Fixture::start(&[]).await;
    let me = principal("acme", Some("u1"), None, Some("s1"));
    let t = token(&me);
    let cases = [
        (json!({}), 400, "missing_field"),
        (json!({ "query": "  " }), 400, "invalid_field"),
        (json!({ "query": 5 }), 400, "invalid_field"),
        (json!({ "query": "x", "top_k": 0 }), 400, "invalid_field"),
        (json!({ "query": "x", "top_k": 21 }), 400, "invalid_field"),
        (json!({ "query": "x", "top_k": "5" }), 400, "invalid_field"),
        (json!({ "query": "x", "scope": "galaxy" }), 400, "invalid_value"),
        (json!({ "query": "x", "source_kinds": ["email"] }), 400, "invalid_value"),
        (json!({ "query": "x", "source_kinds": "chat_message" }), 400, "invalid_field"),
        (json!({ "query": "x", "enable_rerank": "yes" }), 400, "invalid_field"),
        (json!({ "query": "x", "tenant_id": "other" }), 400, "tenant_in_body"),
        (json!({ "query": "x", "session_id": "s9" }), 400, "unknown_field"),
        (json!({ "query": "x".repeat(5000) }), 400, "invalid_field"),
    ];
    for (body, status, code) in cases {
        let reply = f.app.client.post("/v1/recall", Some(&t), &body).await;
        assert_eq!((reply.status, reply.code()), (status, code), "{body}: {:?}", reply.body);
    }
    let reply = f.app.client.post("/v1/recall", None, &json!({ "query": "x" })).await;
    assert_eq!((reply.status, reply.code()), (401, "missing_token"));

    // Text that is no query language: stop words only, tsquery operators, quotes, backslashes.
    f.write(&me, "chat_message", "m1", "it's in C:\\temp & ready").await;
    for query in ["the of and", "a & b | !c:* <-> 'd'", "it's", "C:\\temp", "(((", "ÜBER 東京 🙂"] {
        let reply = f.app.client.post("/v1/recall", Some(&t), &json!({ "query": query })).await;
        assert_eq!(reply.status, 200, "{query}: {:?}", reply.body);
    }
    // Its words are still searched: the row is found by the one that is not punctuation.
    let reply = f.app.client.post("/v1/recall", Some(&t), &json!({ "query": "C:\\temp" })).await;
    assert_eq!(refs(&reply.body), ["m1"], "{:?}", reply.body);
}

#[tokio::test]
async fn class_priors_order_the_classes_and_zero_leaves_one_out() {
    // The same text in the session and the tenant class ranks first in each; the priors decide.
    let order = |extra: &'static [(&'static str, &'static str)]| async move {
        let f = Fixture::start(extra).await;
        let me = principal("acme", None, None, Some("s1"));
        f.write(&me, "chat_message", "said", "the launch date is friday").await;
        f.write(&principal("acme", None, None, None), "document_chunk", "written", "the launch date is friday").await;
        f.embed_all().await;
        refs(&f.recall(&me, json!({ "query": "launch date" })).await)
    };
    assert_eq!(order(&[]).await, ["said", "written"], "session 1.3 beats tenant 1.0");
    assert_eq!(order(&[(vars::RECALL_WEIGHT_TENANT, "2")]).await, ["written", "said"]);
    assert_eq!(order(&[(vars::RECALL_WEIGHT_SESSION, "0")]).await, ["written"], "0 suppresses the class");
    assert_eq!(order(&[(vars::RECALL_WEIGHT_SESSION, "-1")]).await, ["said", "written"], "bad values fall back");
    assert_eq!(order(&[(vars::RECALL_WEIGHT_SESSION, "many")]).await, ["said", "written"], "bad values fall back");
}

#[tokio::test]
async fn superseded_deleted_and_anonymized_rows_never_return() {
    let f = Fixture::start(&[]).await;
    let me = principal("acme", Some("u1"), None, Some("s1"));
    let old = f.fact(&me, "user", "I live in Tokyo").await;
    let new = f.fact(&me, "user", "I live in Paris").await;
    let deleted = f.write(&me, "chat_message", "deleted", "we talked about where I live").await;
    let service = principal("acme", None, None, None);
    let anonymized = f.write(&service, "document_chunk", "anonymized", "where I live is in the file").await;
    f.embed_all().await;
    let db = &f.app.db.pool;
    sqlx::query("UPDATE memory_items SET superseded_by = $2, superseded_at = now(), valid_to = now() WHERE id = $1")
        .bind(old)
        .bind(new)
        .execute(db)
        .await
        .expect("supersede");
    sqlx::query("UPDATE memory_items SET deleted_at = now() WHERE id = $1")
        .bind(deleted)
        .execute(db)
        .await
        .expect("delete");
    sqlx::query("UPDATE memory_items SET anonymized_at = now(), content = '[REDACTED]' WHERE id = $1")
        .bind(anonymized)
        .execute(db)
        .await
        .expect("anonymize");

    let answer = f.recall(&me, json!({ "query": "where do I live", "top_k": 20 })).await;
    let ids: Vec<Value> = answer["items"].as_array().expect("items").iter().map(|i| i["id"].clone()).collect();
    assert_eq!(ids, [json!(new)], "{answer}");

    // The admin path may include superseded facts, never deleted or anonymized rows.
    let request = RecallRequest::new("where do I live").expect("query").top_k(20).expect("top_k");
    let admin = RecallOptions { include_superseded: true, ..RecallOptions::default() };
    let recalled = f.recall_api().recall_with(&me, &request, admin).await.expect("recall");
    let mut ids: Vec<Uuid> = recalled.items.iter().map(|i| i.id).collect();
    ids.sort();
    let mut expected = vec![old, new];
    expected.sort();
    assert_eq!(ids, expected);
    // The runbook's admin recall is the same code.
    let mut runbook = tokio::process::Command::new(binary("mnemo-runbook").expect("runbook"));
    runbook.env_clear().envs(f.env_pairs()).args(["recall", "--tenant", "acme", "--user", "u1", "--scope", "user"]);
    let output = runbook.args(["--include-superseded", "--json", "where do I live"]).output().await.expect("runbook");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let answer: Value = serde_json::from_slice(&output.stdout).expect("json");
    assert_eq!(answer["items"].as_array().map(Vec::len), Some(2), "{answer}");

    let anonymized_query = RecallRequest::new("REDACTED").expect("query").scope(RecallScope::Tenant);
    let admin = RecallOptions { include_superseded: true, ..RecallOptions::default() };
    assert!(f.recall_api().recall_with(&me, &anonymized_query, admin).await.expect("recall").items.is_empty());
}

#[tokio::test]
async fn degraded_until_the_searched_rows_have_vectors() {
    let f = Fixture::start(&[]).await;
    let me = principal("acme", None, None, Some("s1"));
    let elsewhere = principal("acme", None, None, Some("s2"));
    f.write(&me, "chat_message", "m1", "the deploy key rotates monthly").await;
    f.embed_all().await;
    f.write(&elsewhere, "chat_message", "m2", "an unrelated pending row").await;
    let answer = f.recall(&me, json!({ "query": "deploy key", "scope": "session" })).await;
    assert_eq!(answer["degraded"], false, "a pending row in another session is not searched");

    f.write(&me, "chat_message", "m3", "the deploy key lives in the vault").await;
    let answer = f.recall(&me, json!({ "query": "deploy key", "scope": "session" })).await;
    assert_eq!(answer["degraded"], true);
    assert_eq!(sorted(refs(&answer)), ["m1", "m3"], "full text still finds the pending row");
    f.embed_all().await;
    let answer = f.recall(&me, json!({ "query": "deploy key", "scope": "session" })).await;
    assert_eq!(answer["degraded"], false);
    assert_eq!(sorted(refs(&answer)), ["m1", "m3"], "embedded rows are found through the full-text index");

    // An import elsewhere in the tenant that the embed workers have not reached: up to as many
    // waiting rows as the keyword half stems from their content (4,096), recall in s1 misses
    // nothing; one more, and rows beyond those are found by neither half.
    let store = f.app.db.store();
    let mut rng = StdRng::seed_from_u64(3);
    let import = |range: std::ops::Range<usize>, rng: &mut StdRng| -> Vec<BulkRow> {
        range.map(|i| random_row(rng, &elsewhere, Scope::Session, &format!("import-{i}"), chrono::Utc::now())).collect()
    };
    let waiting = async |rows: Vec<BulkRow>| {
        store.bulk_load(MODEL, &rows).await.expect("bulk load");
        let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
        sqlx::query("UPDATE memory_items SET embedded_model = NULL WHERE id = ANY($1)")
            .bind(&ids)
            .execute(store.pool())
            .await
            .expect("mark waiting");
    };
    waiting(import(0..4096, &mut rng)).await;
    let answer = f.recall(&me, json!({ "query": "deploy key", "scope": "session" })).await;
    assert_eq!(answer["degraded"], false, "4,096 rows waiting elsewhere are all looked through");
    waiting(import(4096..4097, &mut rng)).await;
    let answer = f.recall(&me, json!({ "query": "deploy key", "scope": "session" })).await;
    assert_eq!(answer["degraded"], true, "4,097 are more than recall looks through");
}

/// A question of more distinct words than the keyword half searches by keeps the rarest: the
/// one word that finds the row is never the one left out.
/// The period's list only adds candidates: when it cannot be ranked (here the tenant's calendar
/// is gone), the recall answers from the other lists, `degraded`, instead of failing.
#[tokio::test]
async fn a_failing_extra_list_leaves_the_recall_degraded_not_failed() {
    let f = Fixture::start(&[]).await;
    let me = principal("acme", None, None, Some("s1"));
    f.write(&me, "chat_message", "m1", "the deploy key rotated in May 2023").await;
    f.embed_all().await;
    let question = json!({ "query": "when did the deploy key rotate in 2023?", "scope": "session" });
    assert_eq!(f.recall(&me, question.clone()).await["degraded"], false);
    sqlx::query("ALTER FUNCTION tenant_time_zone(text) RENAME TO tenant_time_zone_gone")
        .execute(&f.app.db.pool)
        .await
        .expect("rename");
    let answer = f.recall(&me, question).await;
    assert_eq!(answer["degraded"], true, "{answer}");
    assert_eq!(refs(&answer), ["m1"]);
}

/// A half whose statement fails (a timeout, a replica's connection lost; here a table it reads
/// is gone) leaves the answer to the other half, `degraded`; both failing fail the recall.
#[tokio::test]
async fn a_failing_half_leaves_the_recall_to_the_other() {
    let f = Fixture::start(&[]).await;
    let me = principal("acme", None, None, Some("s1"));
    f.write(&me, "chat_message", "m1", "the deploy key rotated on Tuesday").await;
    f.embed_all().await;
    let question = json!({ "query": "when did the deploy key rotate?", "scope": "session" });
    assert_eq!(f.recall(&me, question.clone()).await["degraded"], false);
    let exec = |sql: &'static str| {
        let pool = f.app.db.pool.clone();
        async move { sqlx::query(sql).execute(&pool).await.expect(sql) }
    };
    for (away, back) in [
        // The keyword half's counts, then the vector half's vectors.
        ("ALTER TABLE tenant_text RENAME TO tenant_text_away", "ALTER TABLE tenant_text_away RENAME TO tenant_text"),
        (
            "ALTER TABLE memory_embeddings RENAME TO memory_embeddings_away",
            "ALTER TABLE memory_embeddings_away RENAME TO memory_embeddings",
        ),
    ] {
        exec(away).await;
        let answer = f.recall(&me, question.clone()).await;
        assert_eq!((refs(&answer), &answer["degraded"]), (vec!["m1".to_owned()], &json!(true)), "{away}: {answer}");
        exec(back).await;
    }
    exec("ALTER TABLE tenant_text RENAME TO tenant_text_away").await;
    exec("ALTER TABLE memory_embeddings RENAME TO memory_embeddings_away").await;
    let failed = f.app.client.post("/v1/recall", Some(&token(&me)), &question).await;
    assert!(failed.status >= 500, "{:?}", failed.body);
    // Nor is a failed keyword half beside a question that could not be embedded an empty answer.
    exec("ALTER TABLE memory_embeddings_away RENAME TO memory_embeddings").await;
    f.provider.then([Answer::Status(500)]);
    let unembedded = json!({ "query": "who rotated the deploy key?", "scope": "session" });
    let failed = f.app.client.post("/v1/recall", Some(&token(&me)), &unembedded).await;
    assert!(failed.status >= 500, "{:?}", failed.body);
}

#[tokio::test]
async fn a_long_question_searches_by_its_rarest_words() {
    let f = Fixture::start(&[]).await;
    let me = principal("acme", None, None, Some("s1"));
    let common: Vec<String> = (0..40).map(|i| format!("common{i}x")).collect();
    for i in 0..3 {
        f.write(&me, "chat_message", &format!("c{i}"), &common.join(" ")).await;
    }
    f.write(&me, "chat_message", "rare", "the zebrafinch nests in the reeds").await;
    f.embed_all().await;
    let question = format!("{} zebrafinch", common.join(" "));
    let query = mnemo_recall::Query { text: &question, scope: RecallScope::Session, kinds: &[], shown: usize::MAX };
    let options = RecallOptions { halves: mnemo_recall::Halves::KeywordOnly, ..Default::default() };
    let ranked = f.recall_api().ranked(&me, &query, 10, &options).await.expect("recall");
    let refs: Vec<String> = ranked.items.into_iter().map(|i| i.source_ref).collect();
    assert!(refs.contains(&"rare".to_owned()), "{refs:?}");
}

#[tokio::test]
async fn a_failing_embedder_leaves_recall_to_full_text() {
    let f = Fixture::start(&[(vars::RECALL_QUERY_WAIT_MS, "1000")]).await;
    let me = principal("acme", None, None, Some("s1"));
    f.write(&me, "chat_message", "m1", "the quarterly report is late").await;
    f.embed_all().await;
    f.provider.then([Answer::Status(500)]);
    let answer = f.recall(&me, json!({ "query": "quarterly report" })).await;
    assert_eq!((answer["degraded"].clone(), refs(&answer)), (json!(true), vec!["m1".to_owned()]));
    let answer = f.recall(&me, json!({ "query": "quarterly report" })).await;
    assert_eq!(answer["degraded"], false, "the next query embeds again");

    // A provider that hangs (here 4 s, within its 10 s timeout) holds no recall past its wait,
    // nor the ones queued behind it.
    f.provider.then([Answer::Hang(Duration::from_secs(4))]);
    let started = Instant::now();
    let (first, second) = tokio::join!(
        f.recall(&me, json!({ "query": "quarterly report late" })),
        f.recall(&me, json!({ "query": "the report" })),
    );
    assert!(started.elapsed() < Duration::from_secs(3), "waited {:?}", started.elapsed());
    for answer in [first, second] {
        assert_eq!((answer["degraded"].clone(), refs(&answer)), (json!(true), vec!["m1".to_owned()]), "{answer}");
    }
}

#[tokio::test]
async fn rerank_reorders_when_healthy_and_falls_back_on_any_failure() {
    let reranker = ScriptedReranker::start().await;
    let f = Fixture::start(&[(vars::RERANKER_URL, &reranker.base_url), (vars::RERANKER_TIMEOUT_MS, "300")]).await;
    let me = principal("acme", None, None, Some("s1"));
    for i in 0..6 {
        let text = format!("report {} {}", "quarterly ".repeat(6 - i), "filler ".repeat(i));
        f.write(&principal("acme", None, None, None), "document_chunk", &format!("d{i}"), &text).await;
    }
    f.embed_all().await;

    let merge = f.recall(&me, json!({ "query": "quarterly report", "top_k": 20, "enable_rerank": false })).await;
    assert_eq!(merge["rerank_used"], false);
    assert_eq!(reranker.served().0, 0, "enable_rerank false does not call the reranker");
    let merge_order = refs(&merge);
    assert_eq!(merge_order.len(), 6);

    let reranked = f.recall(&me, json!({ "query": "quarterly report", "top_k": 20 })).await;
    assert_eq!(reranked["rerank_used"], true, "{reranked}");
    let mut reversed = merge_order.clone();
    reversed.reverse();
    assert_eq!(refs(&reranked), reversed, "the scripted reranker reverses what it is given");
    // It was given the question and the candidates' texts, in merge order.
    let asked = reranker.last_request();
    assert_eq!(asked["query"], "quarterly report");
    let contents: Vec<&str> =
        merge["items"].as_array().expect("items").iter().filter_map(|i| i["content"].as_str()).collect();
    assert_eq!(asked["texts"], json!(contents));
    let scores: Vec<f64> =
        reranked["items"].as_array().expect("items").iter().map(|i| i["score"].as_f64().expect("score")).collect();
    assert!(scores.windows(2).all(|w| w[0] >= w[1]), "{scores:?}");

    // Over-fetch: the reranker sees every candidate (up to 20) even when top_k is smaller.
    let top2 = f.recall(&me, json!({ "query": "quarterly report", "top_k": 2 })).await;
    assert_eq!(refs(&top2), reversed[..2]);
    assert_eq!(reranker.served().1, 6);

    for failure in [RerankAnswer::Status(500), RerankAnswer::Hang(Duration::from_secs(3)), RerankAnswer::Garbage] {
        reranker.then([failure.clone()]);
        let started = Instant::now();
        let answer = f.recall(&me, json!({ "query": "quarterly report", "top_k": 20 })).await;
        assert_eq!(answer["rerank_used"], false, "{failure:?}");
        assert_eq!(refs(&answer), merge_order, "{failure:?} falls back to merge order");
        assert!(started.elapsed() < Duration::from_secs(2), "{failure:?} took {:?}", started.elapsed());
    }
    let healthy = f.recall(&me, json!({ "query": "quarterly report", "top_k": 20 })).await;
    assert_eq!(healthy["rerank_used"], true, "healthy again after the failures");
}

#[tokio::test]
async fn a_reranker_that_is_down_does_not_fail_recall() {
    let port = free_port().to_string();
    let url = format!("http://127.0.0.1:{port}");
    let f = Fixture::start(&[(vars::RERANKER_URL, &url)]).await;
    let me = principal("acme", None, None, Some("s1"));
    f.write(&me, "chat_message", "m1", "nobody listens on that port").await;
    f.embed_all().await;
    let answer = f.recall(&me, json!({ "query": "port" })).await;
    assert_eq!((answer["rerank_used"].clone(), refs(&answer)), (json!(false), vec!["m1".to_owned()]));
}

/// Who may see a row: its tenant and the identity of its class.
#[derive(Debug, Clone)]
struct Owner {
    tenant: &'static str,
    class: &'static str,
    identity: Option<String>,
}

#[tokio::test]
async fn tenants_and_identities_never_leak_under_random_traffic() {
    let seed: u64 = rand::rng().random();
    println!("seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let f = Fixture::start(&[]).await;
    let tenants = ["acme", "globex", "initech"];
    let people = ["u1", "u2"];
    let agents = ["a1", "a2"];
    let sessions = ["s1", "s2", "s3"];
    let words = ["invoice", "tokyo", "deploy", "friday", "budget", "vault", "pizza", "report", "launch", "key"];
    let mut owners: HashMap<String, Owner> = HashMap::new();

    for i in 0..300 {
        let tenant = *tenants.choose(&mut rng).expect("tenant");
        let user = *people.choose(&mut rng).expect("user");
        let agent = *agents.choose(&mut rng).expect("agent");
        let session = *sessions.choose(&mut rng).expect("session");
        let who = principal(tenant, Some(user), Some(agent), Some(session));
        // The same texts and source_refs in every tenant.
        let text: Vec<&str> = (0..4).map(|_| *words.choose(&mut rng).expect("word")).collect();
        let text = text.join(" ");
        let source_ref = format!("r{}", i % 40);
        let (reply, owner) = match rng.random_range(0..4) {
            0 => (f.try_write(&who, "chat_message", &source_ref, &text).await, ("session", Some(session))),
            // Document chunks are the service's to write.
            1 => {
                let service = principal(tenant, None, None, None);
                (f.try_write(&service, "document_chunk", &source_ref, &text).await, ("tenant", None))
            }
            2 => (f.try_fact(&who, "user", &text).await, ("user", Some(user))),
            _ => (f.try_fact(&who, "agent", &text).await, ("agent", Some(agent))),
        };
        if reply.status == 409 {
            continue; // the tenant already used this source_ref for other content
        }
        let id = id_of(reply);
        let owner = Owner { tenant, class: owner.0, identity: owner.1.map(str::to_owned) };
        // A repeated write lands on the row it made first.
        owners.entry(id.to_string()).or_insert(owner);
    }
    f.embed_all().await;

    let scopes = ["session", "tenant", "user", "agent", "any"];
    let recall = f.recall_api();
    let search = recall.search();
    let mut returned = 0;
    for _ in 0..200 {
        let tenant = *tenants.choose(&mut rng).expect("tenant");
        let user = rng.random_bool(0.7).then(|| *people.choose(&mut rng).expect("user"));
        let agent = rng.random_bool(0.7).then(|| *agents.choose(&mut rng).expect("agent"));
        let session = rng.random_bool(0.7).then(|| *sessions.choose(&mut rng).expect("session"));
        let who = principal(tenant, user, agent, session);
        let scope = *scopes.choose(&mut rng).expect("scope");
        let query: Vec<&str> = (0..2).map(|_| *words.choose(&mut rng).expect("word")).collect();
        let body = json!({ "query": query.join(" "), "scope": scope, "top_k": 20 });
        let reply = f.app.client.post("/v1/recall", Some(&token(&who)), &body).await;
        if reply.status == 401 {
            continue;
        }
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        // The answer, and beneath it every candidate each SQL path produced: the row fetch
        // filters by tenant too, so only the candidates show a search statement that forgot to.
        let mut seen: Vec<(String, Option<&str>)> = Vec::new();
        for item in reply.body["items"].as_array().expect("items") {
            returned += 1;
            seen.push((item["id"].as_str().expect("id").to_owned(), None));
        }
        let classes = RecallScope::parse(scope).expect("scope").classes(&who).expect("classes");
        let search_scope = every_kind(&who, &classes);
        let text = query.join(" ");
        let keyword = search.keyword(&search_scope, &text, &CommonLexemes::default(), 50).await.expect("keyword");
        let vector = search.vector(&search_scope, &unit_bag_of_words(&text, DIMS), 50).await.expect("vector");
        for (class, ids) in keyword.iter().chain(vector.iter()) {
            seen.extend(ids.iter().map(|id| (id.to_string(), Some(class.as_str()))));
        }
        for (id, class) in seen {
            let owner = owners.get(&id).unwrap_or_else(|| panic!("unknown row {id} (seed {seed})"));
            assert_eq!(owner.tenant, tenant, "row of another tenant (seed {seed})");
            let visible = match owner.class {
                "session" => owner.identity.as_deref() == session,
                "tenant" => true,
                "user" => owner.identity.as_deref() == user,
                _ => owner.identity.as_deref() == agent,
            };
            assert!(visible, "{owner:?} returned to {who:?} with scope {scope} (seed {seed})");
            assert!(scope == "any" || scope == owner.class, "{owner:?} returned for scope {scope} (seed {seed})");
            assert!(class.is_none_or(|c| c == owner.class), "{owner:?} ranked in class {class:?} (seed {seed})");
        }
    }
    assert!(returned > 200, "the recalls found too little to prove anything: {returned}");
}

#[tokio::test]
async fn the_real_pipeline_turns_degraded_off_and_finds_rows_by_meaning() {
    let db = mnemo_testkit::TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server");
    let me = principal("acme", Some("u1"), None, Some("s1"));
    let t = token(&me);
    let body = json!({ "source_kind": "chat_message", "source_ref": "m1", "content": "I live in Tokyo" });
    assert_eq!(server.client.post("/v1/memories", Some(&t), &body).await.status, 201);
    let body = json!({ "source_kind": "chat_message", "source_ref": "m2", "content": "The invoice is due on Friday" });
    assert_eq!(server.client.post("/v1/memories", Some(&t), &body).await.status, 201);

    // No lexeme in common with the row: only the vector half can find it.
    let query = json!({ "query": "which city is my home", "scope": "session" });
    let before = server.client.post("/v1/recall", Some(&t), &query).await;
    assert_eq!((before.status, before.body["degraded"].clone()), (200, json!(true)), "{:?}", before.body);

    let _worker = WorkerProcess::start::<&str>(&db.url, &[]).await.expect("worker");
    let embedded =
        || async { db.count("SELECT count(*) FROM memory_items WHERE embedded_model IS NOT NULL").await == 2 };
    assert!(wait_until(Duration::from_secs(60), embedded).await, "rows not embedded");
    let after = server.client.post("/v1/recall", Some(&t), &query).await;
    assert_eq!(after.body["degraded"], false, "{:?}", after.body);
    assert_eq!(after.body["items"][0]["source_ref"], "m1", "{:?}", after.body);
}

#[tokio::test]
async fn concurrent_queries_are_embedded_together_and_repeated_ones_come_from_the_cache() {
    let f = Fixture::start(&[]).await;
    let me = principal("acme", None, None, Some("s1"));
    f.write(&me, "chat_message", "m1", "the quarterly report is late").await;
    f.embed_all().await;
    let served = f.provider.served();
    // The first embedding call is slow: the queries that arrive meanwhile queue behind it.
    f.provider.then([Answer::Hang(Duration::from_millis(400))]);
    let recall_all = |queries: Vec<String>| {
        let mut set = tokio::task::JoinSet::new();
        for query in queries {
            let (client, t) = (f.app.client.clone(), token(&me));
            set.spawn(async move { client.post("/v1/recall", Some(&t), &json!({ "query": query })).await });
        }
        set.join_all()
    };
    let queries: Vec<String> = (0..12).map(|i| format!("quarterly report number {i}")).collect();
    for reply in recall_all(queries.clone()).await {
        assert_eq!((reply.status, reply.body["degraded"].clone()), (200, json!(false)), "{:?}", reply.body);
        assert_eq!(refs(&reply.body), ["m1"]);
    }
    let (requests, inputs) = f.provider.served();
    assert_eq!(inputs - served.1, 12, "each query embedded once");
    assert!(requests - served.0 <= 3, "12 concurrent queries took {} embedding calls", requests - served.0);
    // The same queries again: every vector comes from the cache.
    for reply in recall_all(queries).await {
        assert_eq!(reply.body["degraded"], false);
    }
    assert_eq!(f.provider.served(), (requests, inputs), "no new embedding call");
}

/// The vector half ranks at most 1,000 rows of a class exactly. A session longer than that still
/// finds its older rows by meaning, through an HNSW scan filtered to it; a tenant class larger
/// than that is searched through the HNSW index, a smaller one exactly; a row that two ways find
/// comes back once.
#[tokio::test]
async fn long_sessions_and_large_tenant_classes_find_their_rows_by_meaning() {
    let f = Fixture::start(&[]).await;
    let store = f.app.db.store();
    let mut rng = StdRng::seed_from_u64(17);
    let start = chrono::Utc::now() - chrono::Duration::days(2);
    let mut rows = |who: &Principal, scope: Scope, n: usize| -> Vec<BulkRow> {
        (0..n)
            .map(|i| {
                let at = start + chrono::Duration::minutes(i as i64);
                random_row(&mut rng, who, scope, &format!("{scope}-{i}"), at)
            })
            .collect()
    };
    // acme: a 1,500-row session and 1,200 shared chunks; globex: a 1,500-row session and 5 chunks.
    let acme = principal("acme", None, None, Some("long"));
    let globex = principal("globex", None, None, Some("long"));
    let (acme_session, acme_shared) = (rows(&acme, Scope::Session, 1500), rows(&acme, Scope::Tenant, 1200));
    let (globex_session, globex_shared) = (rows(&globex, Scope::Session, 1500), rows(&globex, Scope::Tenant, 5));
    for loaded in [&acme_session, &acme_shared, &globex_session, &globex_shared] {
        store.bulk_load(MODEL, loaded).await.expect("bulk load");
    }
    store.ensure_vector_index(MODEL, DIMS).await.expect("vector index");
    // With the statistics autovacuum would gather: without them the planner takes the tables for
    // empty and ranks every class by a sort, never reaching the HNSW scans tested below.
    store.vacuum_analyze_memories().await.expect("analyze");

    let nearest = async |store: &mnemo_store::Store, who: &Principal, class: RecallClass, row: &BulkRow| {
        let search = store.search(MODEL, DIMS);
        let classes = [class];
        let ranked = search
            .vector(&every_kind(who, &classes), row.vector.as_deref().expect("vector"), 10)
            .await
            .expect("search");
        let found = ranked.into_values().next().unwrap_or_default();
        let distinct: std::collections::HashSet<&Uuid> = found.iter().collect();
        assert_eq!(distinct.len(), found.len(), "{}: no candidate twice", row.source_ref);
        assert_eq!(found.first(), Some(&row.id), "{} is its own nearest neighbour", row.source_ref);
        found.len()
    };
    let session = RecallClass::Session(acme.session.clone().expect("session"));
    // The session's oldest row, one just older than the newest 1,000, and the newest.
    for i in [0, 1500 - 1001, 1500 - 1] {
        assert_eq!(nearest(&store, &acme, session.clone(), &acme_session[i]).await, 10);
    }
    for i in [0, 1199] {
        assert_eq!(nearest(&store, &acme, RecallClass::Tenant, &acme_shared[i]).await, 10);
    }
    for i in [0, 4] {
        assert_eq!(nearest(&store, &globex, RecallClass::Tenant, &globex_shared[i]).await, 5, "globex shares 5 rows");
    }

    // An HNSW scan that gives up at once, as one does on a class that is a sliver of a large
    // index: the tenant class is then ranked whole, and the session over its newest 1,000 rows.
    // The cast loads pgvector in this connection first: PostgreSQL refuses to store a setting it
    // does not know yet for a role that is not superuser, and a pooled connection may be fresh.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SELECT '[1]'::vector; \
         ALTER DATABASE {db} SET hnsw.ef_search = 1; ALTER DATABASE {db} SET hnsw.iterative_scan = off",
        db = f.app.db.name
    )))
    .execute(store.pool())
    .await
    .expect("starve the HNSW scans");
    let starved = mnemo_store::Store::connect(&f.app.db.url, 2).await.expect("connect");
    for i in [1500 - 1000, 1500 - 1] {
        assert_eq!(nearest(&starved, &acme, session.clone(), &acme_session[i]).await, 10);
    }
    for i in [0, 1199] {
        assert_eq!(nearest(&starved, &acme, RecallClass::Tenant, &acme_shared[i]).await, 10);
    }
}

/// A question that names a period ("on 13 March 2024", "yesterday") brings that period's rows
/// of each searched class, ranked by the query's vector, as a third list in fusion: they fill
/// most of the top 10 and all come within the top 20 even when the vector half ranks them
/// anywhere and the keyword half finds nothing (RRF with k = 10 lets at most the vector half's
/// best 4 other rows pass the day's last). Days are the tenant's time zone's, read against
/// `as_of` when relative, and another tenant's rows of that day never come.
#[tokio::test]
async fn a_question_that_names_a_day_finds_what_was_written_that_day() {
    let f = Fixture::start(&[]).await;
    let store = f.app.db.store();
    let mut rng = StdRng::seed_from_u64(23);
    let monday =
        chrono::NaiveDate::from_ymd_opt(2024, 3, 11).expect("date").and_hms_opt(12, 0, 0).expect("noon").and_utc();
    // Ten rows a day from Monday to Thursday, in acme's session and in its tenant class; globex
    // writes on Wednesday too.
    let acme = principal("acme", None, None, Some("s1"));
    let globex = principal("globex", None, None, Some("s1"));
    let mut rows = Vec::new();
    for (who, scope, days) in
        [(&acme, Scope::Session, 0..4), (&acme, Scope::Tenant, 0..4), (&globex, Scope::Session, 2..3)]
    {
        for day in days {
            for i in 0..10 {
                let at = monday + chrono::Duration::days(day) + chrono::Duration::minutes(i);
                rows.push(random_row(&mut rng, who, scope, &format!("{scope}-{day}-{i}"), at));
            }
        }
    }
    store.bulk_load(MODEL, &rows).await.expect("bulk load");
    let query_vector = random_unit(&mut rng);
    let recall = f.recall_api();
    let ask = async |question: &str, scope: RecallScope, as_of: chrono::DateTime<chrono::Utc>| -> Vec<String> {
        let query = mnemo_recall::Query { text: question, scope, kinds: &[], shown: usize::MAX };
        let options =
            RecallOptions { query_vector: Some(query_vector.clone()), as_of: Some(as_of), ..Default::default() };
        let ranked = recall.ranked(&acme, &query, 20, &options).await.expect("recall");
        ranked.items.into_iter().map(|i| i.source_ref).collect()
    };
    // How many of the day's ten rows are in the top 10, and in the top 20.
    let of_day = |found: &[String], scope: Scope, day: i64| -> (usize, usize) {
        let written = |r: &&String| r.starts_with(&format!("{scope}-{day}-"));
        (found.iter().take(10).filter(written).count(), found.iter().filter(written).count())
    };
    let friday = monday + chrono::Duration::days(4);

    for question in ["What happened on 13 March 2024?", "what did we say on 2024-03-13", "and on March 13?"] {
        for (recall_scope, scope) in [(RecallScope::Session, Scope::Session), (RecallScope::Tenant, Scope::Tenant)] {
            let found = ask(question, recall_scope, friday).await;
            let (in_10, in_20) = of_day(&found, scope, 2);
            assert!(in_10 >= 6 && in_20 == 10, "{question} ({scope}): {in_10} in the top 10, {in_20} in the top 20");
            // Globex's rows of the day carry the same refs: `in_20 == 10` is what keeps them out.
            assert!(found.iter().all(|r| r.starts_with(scope.as_str())), "only the class asked: {found:?}");
        }
    }
    let (in_10, in_20) =
        of_day(&ask("What happened yesterday?", RecallScope::Session, friday).await, Scope::Session, 3);
    assert!(in_10 >= 6 && in_20 == 10, "yesterday: {in_10} in the top 10, {in_20} in the top 20");
    // The same vector without a period: the vector half's order, which is not Wednesday's rows.
    let undated = ask("What happened then?", RecallScope::Session, friday).await;
    assert!(of_day(&undated, Scope::Session, 2).0 < 6, "undated: {undated:?}");
    assert_eq!(undated.len(), 20);

    // Days are the tenant's: at UTC+14 each noon (UTC) row was written at 2 a.m. the next day,
    // and Friday 9 a.m. (UTC) is 11 p.m. on Friday, whose yesterday holds Wednesday's rows.
    assert!(store.set_time_zone(&acme.tenant, "Pacific/Kiritimati").await.expect("time zone"));
    let friday_morning = friday - chrono::Duration::hours(3);
    for (question, day) in
        [("What happened on 14 March 2024?", 2), ("and on March 13?", 1), ("What happened yesterday?", 2)]
    {
        let (in_10, in_20) = of_day(&ask(question, RecallScope::Session, friday_morning).await, Scope::Session, day);
        assert!(in_10 >= 6 && in_20 == 10, "{question} at UTC+14: {in_10} in the top 10, {in_20} in the top 20");
    }
}

/// A question that names one participant of the session (the `name` its messages were written
/// with) ranks the session's vector half within that participant's messages, after the session's
/// nearest message whoever wrote it: Melanie's one row about the sunrise comes second although
/// Caroline's rows about it are all nearer, and the rest are hers. A question naming no
/// participant, or two, keeps the vector half's order; another tenant's participant of the same
/// name and session id never comes; and a deleted message of hers is not found.
#[tokio::test]
async fn a_question_that_names_a_participant_ranks_within_their_messages() {
    let f = Fixture::start(&[]).await;
    let acme = principal("acme", None, None, Some("s1"));
    let globex = principal("globex", None, None, Some("s1"));
    let say = async |who: &Principal, source_ref: &str, name: &str, content: &str| -> Uuid {
        let body = json!({ "source_kind": "chat_message", "source_ref": source_ref, "name": name, "content": content });
        id_of(f.app.client.post("/v1/memories", Some(&token(who)), &body).await)
    };
    // Letters, not numbers: one source's similar rows with different numbers would be put newer
    // first (`of_two_disagreeing_statements_from_one_source_the_newer_comes_first`).
    let letter = |i: u8| char::from(b'a' + i);
    for i in 0..12 {
        say(&acme, &format!("caroline-{i}"), "Caroline", &format!("the sunrise painting {}", letter(i))).await;
    }
    say(&acme, "melanie-sunrise", "Melanie", "a sunrise by the lake").await;
    for i in 0..5 {
        say(&acme, &format!("melanie-{i}"), "Melanie", &format!("pottery class {}", letter(i))).await;
    }
    let gone = say(&acme, "melanie-gone", "Melanie", "the sunrise painting").await;
    say(&globex, "globex-melanie", "Melanie", "the sunrise painting").await;
    f.embed_all().await;
    assert_eq!(f.app.client.delete(&format!("/v1/memories/{gone}"), Some(&token(&acme))).await.status, 200);

    let recall = f.recall_api();
    let vector = unit_bag_of_words("the sunrise painting", DIMS);
    let ask = async |question: &str| -> Vec<String> {
        let query = mnemo_recall::Query { text: question, scope: RecallScope::Session, kinds: &[], shown: usize::MAX };
        let options = RecallOptions {
            query_vector: Some(vector.clone()),
            halves: mnemo_recall::Halves::VectorOnly,
            ..Default::default()
        };
        let ranked = recall.ranked(&acme, &query, 10, &options).await.expect("recall");
        ranked.items.into_iter().map(|i| i.source_ref).collect()
    };

    let nearest: Vec<String> = ask("What did the painting show?").await;
    let hers = ask("What did Melanie's painting show?").await;
    assert_eq!(hers.len(), 7, "the nearest, then her live messages only: {hers:?}");
    assert_eq!(hers[..2], [nearest[0].as_str(), "melanie-sunrise"], "{hers:?}");
    assert!(hers[1..].iter().all(|r| r.starts_with("melanie-") && r != "melanie-gone"), "{hers:?}");

    assert!(nearest.iter().all(|r| r.starts_with("caroline-")), "the vector half's order: {nearest:?}");
    assert_eq!(ask("What did Melanie and Caroline paint?").await, nearest, "two participants named");
    assert_eq!(ask("What did Gina paint?").await, nearest, "no participant of that name");
}

/// Two messages from the same participant that say nearly the same thing with different numbers
/// disagree, and the newer comes just above the older, although the older is nearer the question.
/// Another participant's statement keeps its place, and a later mention without numbers (a
/// sunrise painted, then recalled) keeps the order the vectors give. Scores follow the new order.
#[tokio::test]
async fn of_two_disagreeing_statements_from_one_source_the_newer_comes_first() {
    let f = Fixture::start(&[]).await;
    let acme = principal("acme", None, None, Some("s1"));
    let say = async |source_ref: &str, name: &str, day: u32, content: &str| {
        let body = json!({
            "source_kind": "chat_message", "source_ref": source_ref, "name": name, "content": content,
            "event_time": format!("2024-03-{day:02}T12:00:00Z"),
        });
        id_of(f.app.client.post("/v1/memories", Some(&token(&acme)), &body).await);
    };
    say("ann-45", "ann", 1, "my library has 45 sources").await;
    say("bob-60", "bob", 2, "my library has 60 sources").await;
    say("ann-52", "ann", 3, "my library has 52 sources now").await;
    say("ann-painted", "ann", 1, "I painted a lake sunrise").await;
    say("ann-recalled", "ann", 3, "that lake sunrise I painted").await;
    for i in 0..6 {
        say(&format!("filler-{i}"), "ann", 2, &format!("gardening note {i}")).await;
    }
    f.embed_all().await;

    let recall = f.recall_api();
    let ask_showing = async |like: &str, shown: usize| -> Vec<String> {
        let query = mnemo_recall::Query { text: "what is it?", scope: RecallScope::Session, kinds: &[], shown };
        let options = RecallOptions {
            query_vector: Some(unit_bag_of_words(like, DIMS)),
            halves: mnemo_recall::Halves::VectorOnly,
            ..Default::default()
        };
        let ranked = recall.ranked(&acme, &query, 10, &options).await.expect("recall");
        let scores: Vec<f64> = ranked.items.iter().map(|i| i.score).collect();
        assert!(scores.is_sorted_by(|a, b| a >= b), "scores follow the order: {scores:?}");
        ranked.items.into_iter().map(|i| i.source_ref).collect()
    };
    let ask = async |like: &str| ask_showing(like, usize::MAX).await;

    let library = ask("my library has 45 sources").await;
    assert_eq!(library[..3], ["ann-52", "ann-45", "bob-60"], "{library:?}");
    // Only among the rows shown: a caller showing one (a recall of 1 that read more for a
    // reranker) gets the row fusion chose, not the newer statement from below it.
    assert_eq!(ask_showing("my library has 45 sources", 1).await[0], "ann-45");
    let sunrise = ask("I painted a lake sunrise").await;
    assert_eq!(sunrise[..2], ["ann-painted", "ann-recalled"], "{sunrise:?}");
}

/// Keyword search ranks by BM25 over counts kept per tenant as rows are embedded: a question's
/// word that few of the tenant's rows hold outweighs one that many hold, however often a row
/// repeats the common one. The counts are each tenant's own: globex's rows, where the words are
/// common the other way round, never change acme's weights.
#[tokio::test]
async fn keyword_search_weighs_words_by_how_few_of_the_tenants_rows_hold_them() {
    let f = Fixture::start(&[]).await;
    let acme = principal("acme", None, None, None);
    let globex = principal("globex", None, None, None);
    for i in 0..12 {
        f.write(&acme, "document_chunk", &format!("orchard-{i}"), "apple orchard, apple harvest, apple cider").await;
    }
    let acme_rare = f.write(&acme, "document_chunk", "crossing", "a zebra crossing near the station").await;
    for i in 0..40 {
        f.write(&globex, "document_chunk", &format!("savanna-{i}"), "zebra herd, zebra foal, zebra stripes").await;
    }
    let globex_rare = f.write(&globex, "document_chunk", "pie", "an apple pie at the station").await;
    f.embed_all().await;

    let counts: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT tenant_id, lexeme, documents FROM tenant_lexemes WHERE lexeme IN ('appl', 'zebra') ORDER BY 1, 2",
    )
    .fetch_all(f.app.db.store().pool())
    .await
    .expect("counts");
    let expected = [("acme", "appl", 12), ("acme", "zebra", 1), ("globex", "appl", 1), ("globex", "zebra", 40)];
    assert_eq!(counts, expected.map(|(t, l, n)| (t.to_owned(), l.to_owned(), n)), "counted once per row, per tenant");

    let search = f.app.db.store().search(MODEL, DIMS);
    for (who, rare) in [(&acme, acme_rare), (&globex, globex_rare)] {
        let classes = [RecallClass::Tenant];
        let ranked = search
            .keyword(&every_kind(who, &classes), "apple zebra", &CommonLexemes::default(), 10)
            .await
            .expect("keyword search");
        let found = ranked.get(&Scope::Tenant).cloned().unwrap_or_default();
        assert_eq!(found.len(), 10, "{}: every row holds a word of the question", who.tenant);
        assert_eq!(found.first(), Some(&rare), "{}: the row with the rare word first", who.tenant);
    }

    // Anonymized, acme's rare row takes its words out of acme's counts: "zebra" is forgotten.
    let store = f.app.db.store();
    store.soft_delete(&acme.tenant, acme_rare, None, None, &[], "test").await.expect("delete").expect("deleted");
    let now = chrono::Utc::now() + chrono::Duration::seconds(1);
    let cutoffs = mnemo_store::Cutoffs { deleted_before: now, superseded_before: now };
    let anonymized = store.anonymize_due(&acme.tenant, cutoffs, Uuid::nil(), 10, "test").await.expect("anonymize");
    assert_eq!(anonymized.len(), 1);
    let acme_counts: Vec<(String, i64)> =
        sqlx::query_as("SELECT lexeme, documents FROM tenant_lexemes WHERE tenant_id = 'acme' ORDER BY 1")
            .fetch_all(store.pool())
            .await
            .expect("counts");
    let rows: (i64,) = sqlx::query_as("SELECT documents FROM tenant_text WHERE tenant_id = 'acme'")
        .fetch_one(store.pool())
        .await
        .expect("rows");
    assert_eq!(rows.0, 12);
    assert!(acme_counts.iter().all(|(_, n)| *n == 12), "only the orchard rows' words are left: {acme_counts:?}");
}

/// A question whose every word is common searches the rarest of them alone, but only while that
/// word is in few enough rows to rank quickly (`alone_up_to`, the row bound over the table's
/// rows): past it the keyword half finds nothing and the vector half answers alone. In a large
/// table the rarest common word matched tens of thousands of rows, all ranked by RUM.
#[tokio::test]
async fn a_question_of_common_words_searches_the_rarest_alone_only_while_it_is_cheap() {
    let f = Fixture::start(&[]).await;
    let acme = principal("acme", None, None, None);
    for i in 0..3 {
        f.write(&acme, "document_chunk", &format!("orchard-{i}"), "apple orchard").await;
    }
    f.embed_all().await;
    let store = f.app.db.store();
    store.analyze_memories().await.expect("analyze");
    let bound = store.common_lexemes(0.01, 5000.0).await.expect("common lexemes").alone_up_to;
    assert!((bound - 5000.0 / 3.0).abs() < 1.0, "the row bound over the table's 3 rows: {bound}");

    let search = store.search(MODEL, DIMS);
    let classes = [RecallClass::Tenant];
    let found = |alone_up_to: f32| {
        let common =
            CommonLexemes { lexemes: vec!["appl".into(), "orchard".into()], frequencies: vec![0.5, 0.9], alone_up_to };
        let (search, scope) = (&search, every_kind(&acme, &classes));
        async move {
            let ranked = search.keyword(&scope, "apple orchard", &common, 10).await.expect("keyword search");
            ranked.get(&Scope::Tenant).map_or(0, Vec::len)
        }
    };
    assert_eq!(found(0.5).await, 3, "the rarest common word, at the bound, is searched alone");
    assert_eq!(found(0.4).await, 0, "past the bound no word is searched");
}

/// Two embed jobs of one row can run at once (a re-queue of a slow job, an orphan's recovery); an
/// erasure can wait on a row while it is being embedded. Either way each row with full text is
/// counted exactly once: the counts equal a count made from the rows.
#[tokio::test]
async fn text_counts_stay_exact_when_saves_and_erasures_race() {
    let f = Fixture::start(&[]).await;
    let acme = principal("acme", Some("alice"), None, None);
    let store = f.app.db.store();
    let mut ids = Vec::new();
    for i in 0..40 {
        ids.push(f.fact(&acme, "user", &format!("alice keeps bees number {i} near the river")).await);
    }
    let rows: Vec<(Uuid, Vec<u8>)> =
        sqlx::query_as("SELECT id, content_sha256 FROM memory_items WHERE tenant_id = 'acme' AND id = ANY($1)")
            .bind(&ids)
            .fetch_all(store.pool())
            .await
            .expect("rows");
    let vector = |id: Uuid, sha: &[u8]| mnemo_store::NewVector {
        id,
        tenant_id: acme.tenant.clone(),
        content_sha256: sha.to_vec(),
        embedding: vec![0.125; DIMS],
        previous_id: None,
    };
    let (half, rest) = rows.split_at(rows.len() / 2);
    // The first half saved twice at once; the second saved while an erasure of alice runs.
    let mut twice = tokio::task::JoinSet::new();
    for (id, sha) in half {
        for _ in 0..2 {
            let (store, v) = (store.clone(), vector(*id, sha));
            twice.spawn(async move { store.save_vectors(MODEL, vec![v]).await.expect("saved") });
        }
    }
    twice.join_all().await;
    let counted = |store: mnemo_store::Store| async move {
        let kept: Vec<(String, i64)> =
            sqlx::query_as("SELECT lexeme, documents FROM tenant_lexemes WHERE tenant_id = 'acme' ORDER BY 1")
                .fetch_all(store.pool())
                .await
                .expect("counts");
        let from_rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT l, count(*) FROM memory_items m CROSS JOIN unnest(tsvector_to_array(m.tsv)) AS l
             WHERE m.tenant_id = 'acme' AND m.tsv IS NOT NULL GROUP BY 1 ORDER BY 1",
        )
        .fetch_all(store.pool())
        .await
        .expect("count from rows");
        (kept, from_rows)
    };
    let (kept, from_rows) = counted(store.clone()).await;
    assert_eq!(kept, from_rows, "a row saved twice at once is counted once");
    assert!(kept.iter().any(|(l, n)| l == "bee" && *n == half.len() as i64), "{kept:?}");

    let mut saves = tokio::task::JoinSet::new();
    for (id, sha) in rest {
        let (store, v) = (store.clone(), vector(*id, sha));
        saves.spawn(async move { store.save_vectors(MODEL, vec![v]).await.expect("saved") });
    }
    let alice = mnemo_core::UserId::parse("alice").expect("user");
    let erased = store.erase_user_rows(&acme.tenant, &alice, Uuid::nil(), 1000, "test").await;
    saves.join_all().await;
    assert_eq!(erased.expect("erased").0.len(), rows.len(), "every row of alice's anonymized");
    let (kept, from_rows) = counted(store.clone()).await;
    assert_eq!(kept, from_rows, "an erasure racing embeddings leaves no word counted");
    assert!(kept.is_empty(), "{kept:?}");
}
