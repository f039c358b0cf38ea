//! The contradiction judge against a real PostgreSQL and a scripted OpenAI-compatible chat server:
//! SUPERSEDE, DUPLICATE and KEEP, copies and keyed facts without a model call, candidates that never leave their
//! bucket, every failure failing open, the disabled judge, concurrent judgements, revival with
//! as-of reads and recall, `judge clear`, and the real worker end to end. Facts get the scripted
//! embedding provider's bag-of-words vectors, so "I live in Tokyo" and "I live in Paris" are
//! close (distance 0.25) and unrelated facts are not; the scripted judge supersedes a candidate
//! that starts with the same three words as the new fact.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use mnemo_config::vars;
use mnemo_core::{FactScope, Judge, Label, Principal, TenantId};
use mnemo_jobs::{JudgePolicy, judge_batch, judge_pending};
use mnemo_models::OpenAiJudge;
use mnemo_store::queue::JudgeJob;
use mnemo_testkit::{
    ChatAnswer, ScriptedChat, ScriptedEmbeddings, TestApp, WorkerProcess, binary, embed_like_the_provider, principal,
    token, wait_until,
};
use serde_json::{Value, json};
use uuid::Uuid;

const MODEL: &str = "scripted";
const DIMS: usize = 64;

fn policy(batch_size: usize) -> JudgePolicy {
    JudgePolicy { batch_size, max_wait: Duration::from_millis(5), topk: 5, threshold: 0.7 }
}

struct Fixture {
    app: TestApp,
    chat: ScriptedChat,
    provider: ScriptedEmbeddings,
}

impl Fixture {
    async fn start() -> Self {
        let provider = ScriptedEmbeddings::start(DIMS).await;
        let app = TestApp::spawn_with(&provider.env(MODEL)).await;
        let chat = ScriptedChat::start().await;
        chat.expect_key("test-key");
        Self { app, chat, provider }
    }

    async fn fact(&self, who: &Principal, content: &str) -> Uuid {
        self.remember(who, json!({ "scope": "user", "content": content })).await.0
    }

    /// The row and `was_new`.
    async fn remember(&self, who: &Principal, body: Value) -> (Uuid, bool) {
        let reply = self.app.client.post("/v1/facts", Some(&token(who)), &body).await;
        assert!(reply.status == 201 || reply.status == 200, "{:?}", reply.body);
        let id = reply.body["id"].as_str().and_then(|s| s.parse().ok()).expect("id");
        (id, reply.body["was_new"].as_bool().expect("was_new"))
    }

    fn judge(&self, timeout: Duration) -> Option<Arc<dyn Judge>> {
        let judge = OpenAiJudge::new(Some(&self.chat.base_url), "test-key", "scripted-judge", timeout).expect("judge");
        Some(Arc::new(judge))
    }

    /// Embeds what waits and judges every pending fact.
    async fn settle(&self, judge: Option<Arc<dyn Judge>>) {
        embed_like_the_provider(&self.app.db.store(), MODEL, DIMS).await;
        judge_pending(&self.app.db.store(), judge, policy(20), "test").await.expect("judge");
    }

    async fn row(&self, id: Uuid) -> Row {
        sqlx::query_as(
            "SELECT superseded_by, judge_outcome AS outcome, judge_at IS NOT NULL AS judged,
                    valid_to IS NOT NULL AS validity_ended
             FROM memory_items WHERE id = $1",
        )
        .bind(id)
        .fetch_one(&self.app.db.pool)
        .await
        .expect("row")
    }

    /// `id` as a judge job reads it, pending.
    async fn pending(&self, id: Uuid) -> mnemo_store::PendingFact {
        let job = JudgeJob { tenant_id: TenantId::parse("acme").expect("tenant"), item_id: id };
        self.app.db.store().pending_facts(&[job]).await.expect("pending").pop().expect("a pending fact")
    }

    /// Dates `fact`'s validity a second before `other`'s, as for a writer that began first.
    async fn valid_before(&self, fact: Uuid, other: Uuid) {
        sqlx::query(
            "UPDATE memory_items SET valid_from = (SELECT valid_from - interval '1 second' FROM memory_items WHERE id = $2)
             WHERE id = $1",
        )
        .bind(fact)
        .bind(other)
        .execute(&self.app.db.pool)
        .await
        .expect("an older validity");
    }

    /// (event, item, related, reason) of every audit row, oldest first.
    async fn audit(&self) -> Vec<(String, Option<Uuid>, Option<Uuid>, Option<String>)> {
        sqlx::query_as("SELECT event, item_id, related_item_id, reason FROM audit_log ORDER BY id")
            .fetch_all(&self.app.db.pool)
            .await
            .expect("audit")
    }

    /// The new fact and the existing facts of each judge request, in order.
    fn asked(&self) -> Vec<(String, Vec<String>)> {
        self.chat
            .requests()
            .iter()
            .map(|r| {
                let prompt = r["messages"][1]["content"].as_str().unwrap_or_default().to_owned();
                let unquote = |text: &str| serde_json::from_str(text).expect("a quoted text");
                let new = unquote(prompt.lines().nth(1).unwrap_or_default());
                let existing =
                    prompt.lines().filter_map(|l| l.split_once("] ").map(|(_, text)| unquote(text))).collect();
                (new, existing)
            })
            .collect()
    }
}

/// A judgement made without a model that retires nothing.
fn retiring_nothing(outcome: mnemo_core::JudgeOutcome, reason: &'static str) -> mnemo_store::Judgement {
    mnemo_store::Judgement {
        unless_retired: outcome,
        retire: Vec::new(),
        reason,
        model: None,
        candidates: 0,
        failure_may_pass: false,
    }
}

#[derive(Debug, sqlx::FromRow)]
struct Row {
    superseded_by: Option<Uuid>,
    outcome: Option<String>,
    judged: bool,
    validity_ended: bool,
}

#[tokio::test]
async fn a_contradiction_supersedes_with_an_audit_row_and_a_compatible_fact_is_kept() {
    let f = Fixture::start().await;
    let who = principal("acme", Some("u1"), None, None);
    let tokyo = f.fact(&who, "I live in Tokyo").await;
    let tea = f.fact(&who, "my favourite drink is sencha").await;
    f.settle(f.judge(Duration::from_secs(5))).await;
    let paris = f.fact(&who, "I live in Paris").await;
    let office = f.fact(&who, "I work in Paris").await;
    f.settle(f.judge(Duration::from_secs(5))).await;

    let tokyo_row = f.row(tokyo).await;
    assert_eq!(tokyo_row.superseded_by, Some(paris));
    assert!(tokyo_row.validity_ended);
    assert_eq!(f.row(paris).await.outcome.as_deref(), Some("superseded"));
    // "I work in Paris" is close to both, but neither says the same thing: kept.
    let office_row = f.row(office).await;
    assert_eq!((office_row.superseded_by, office_row.outcome.as_deref()), (None, Some("kept")));
    assert_eq!(f.row(paris).await.superseded_by, None);
    let tea_row = f.row(tea).await;
    assert_eq!((tea_row.superseded_by, tea_row.outcome.as_deref()), (None, Some("no_candidates")));

    let audit = f.audit().await;
    assert_eq!(audit, vec![("supersede".to_owned(), Some(tokyo), Some(paris), Some("model".to_owned()))]);
    let details: Value =
        sqlx::query_scalar("SELECT details FROM audit_log").fetch_one(&f.app.db.pool).await.expect("x");
    assert_eq!(details, json!({"model": "scripted-judge"}));
    let content_in_audit = f
        .app
        .db
        .count("SELECT count(*) FROM audit_log WHERE (details::text || coalesce(reason, '')) ~* 'tokyo|paris'")
        .await;
    assert_eq!(content_in_audit, 0);

    // The structured answer was bounded: only the real labels, at most one per candidate.
    let requests = f.chat.requests();
    let last = requests.last().expect("a request");
    assert_eq!(last["response_format"]["type"], "json_schema");
    let schema = &last["response_format"]["json_schema"]["schema"]["properties"]["decisions"];
    assert_eq!(
        schema["maxItems"].as_u64(),
        Some(schema["items"]["properties"]["id"]["enum"].as_array().expect("enum").len() as u64)
    );
    assert!(last["max_tokens"].as_u64().is_some_and(|m| m > 0 && m < 1000));
}

#[tokio::test]
async fn a_keyed_fact_supersedes_its_key_without_a_model_call() {
    let f = Fixture::start().await;
    let who = principal("acme", Some("u1"), None, None);
    let other = principal("acme", Some("u2"), None, None);
    let keyed = |content: &str| json!({ "scope": "user", "content": content, "key": "home_city" });
    let (tokyo, _) = f.remember(&who, keyed("home is Tokyo")).await;
    let (theirs, _) = f.remember(&other, keyed("home is Lima")).await;
    f.settle(f.judge(Duration::from_secs(5))).await;
    let (paris, _) = f.remember(&who, keyed("home is Paris now")).await;
    f.settle(f.judge(Duration::from_secs(5))).await;

    assert!(f.chat.requests().is_empty(), "keyed facts never ask the model");
    assert_eq!(f.row(tokyo).await.superseded_by, Some(paris));
    assert_eq!(f.row(theirs).await.superseded_by, None, "another user's key is another bucket");
    assert_eq!(f.row(paris).await.outcome.as_deref(), Some("superseded"));
    assert_eq!(f.audit().await, vec![("supersede".to_owned(), Some(tokyo), Some(paris), Some("key_match".to_owned()))]);

    // With the model step disabled, keys still work.
    let (lisbon, _) = f.remember(&who, keyed("home is Lisbon")).await;
    f.settle(None).await;
    assert_eq!(f.row(paris).await.superseded_by, Some(lisbon));
}

/// A fact asserted again with a key it does not hold takes the key, as a newer statement: the
/// key was not dropped behind a 200, leaving two live facts of one key. Only its writer re-keys.
#[tokio::test]
async fn a_fact_asserted_again_with_a_key_takes_it() {
    let f = Fixture::start().await;
    let who = principal("acme", Some("u1"), Some("a1"), None);
    let keyed = |content: &str| json!({ "scope": "user", "content": content, "key": "home_city" });
    let (paris, _) = f.remember(&who, json!({ "scope": "user", "content": "home is Paris" })).await;
    let (lyon, _) = f.remember(&who, keyed("home is Lyon")).await;
    f.settle(None).await;
    assert_eq!(f.row(paris).await.superseded_by, None, "no key yet: nothing to replace");

    let (again, was_new) = f.remember(&who, keyed("home is Paris")).await;
    assert_eq!((again, was_new), (paris, false));
    f.settle(None).await;
    assert_eq!(f.row(lyon).await.superseded_by, Some(paris), "the re-keyed fact is the newer statement");
    assert_eq!(f.row(paris).await.superseded_by, None);
    let key = "SELECT count(*) FROM memory_items WHERE fact_key = 'home_city' AND superseded_by IS NULL";
    assert_eq!(f.app.db.count(key).await, 1, "one live fact of the key");

    // Another user of the agent asserting the agent's fact with a key does not re-key the
    // writer's fact.
    let other = principal("acme", Some("u2"), Some("a1"), None);
    let agent_fact = json!({ "scope": "agent", "content": "the office is in Nantes" });
    let (office, _) = f.remember(&who, agent_fact.clone()).await;
    let mut with_key = agent_fact;
    with_key["key"] = json!("office");
    assert_eq!(f.remember(&other, with_key).await, (office, false));
    let keys = "SELECT count(*) FROM memory_items WHERE fact_key = 'office'";
    assert_eq!(f.app.db.count(keys).await, 0);
}

#[tokio::test]
async fn candidates_never_leave_the_bucket() {
    let f = Fixture::start().await;
    let u1 = principal("acme", Some("u1"), Some("a1"), None);
    let u2 = principal("acme", Some("u2"), None, None);
    let elsewhere = principal("globex", Some("u1"), None, None);
    let judge = f.judge(Duration::from_secs(5));

    let rome = f.fact(&u1, "I live in Rome").await;
    f.settle(judge.clone()).await;
    let oslo = f.fact(&u1, "I live in Oslo").await;
    let lima = f.fact(&u2, "I live in Lima").await;
    let quito = f.remember(&u1, json!({ "scope": "agent", "content": "I live in Quito" })).await.0;
    let cairo = f.fact(&elsewhere, "I live in Cairo").await;
    f.settle(judge.clone()).await;
    assert_eq!(f.row(rome).await.superseded_by, Some(oslo));

    // Paris is judged before Berlin, which is newer than it.
    let paris = f.fact(&u1, "I live in Paris").await;
    let berlin = f.fact(&u1, "I live in Berlin").await;
    embed_like_the_provider(&f.app.db.store(), MODEL, DIMS).await;
    judge_pending(&f.app.db.store(), judge, policy(1), "test").await.expect("judge");

    let asked = f.asked();
    let existing_for = |new: &str| asked.iter().filter(|(n, _)| n == new).map(|(_, e)| e.clone()).collect::<Vec<_>>();
    // Rome is already superseded; Berlin is newer; Lima, Quito and Cairo are other buckets.
    assert_eq!(existing_for("I live in Paris"), vec![vec!["I live in Oslo".to_owned()]]);
    assert_eq!(existing_for("I live in Berlin"), vec![vec!["I live in Paris".to_owned()]]);
    for (new, existing) in &asked {
        for text in existing {
            assert!(!["Lima", "Quito", "Cairo"].iter().any(|c| text.contains(c)), "{new} was compared with {text}");
        }
    }
    for (id, live) in [(oslo, false), (paris, false), (berlin, true), (lima, true), (quito, true), (cairo, true)] {
        assert_eq!(f.row(id).await.superseded_by.is_none(), live, "{id}");
    }
}

/// A fact replaces only older facts with exactly its readers (`visibility`, `allowed_roles`),
/// and an agent's fact restricted to roles is written only by a token holding one of them: no
/// writer retires a fact it cannot read, and no reader loses a fact to one they cannot read.
#[tokio::test]
async fn a_fact_replaces_only_facts_read_by_the_same_readers() {
    let f = Fixture::start().await;
    let mut hr = principal("acme", Some("ann"), Some("helper"), None);
    hr.roles = vec![Label::parse("roles", "hr").expect("role")];
    let plain = principal("acme", Some("bob"), Some("helper"), None);
    let judge = f.judge(Duration::from_secs(5));
    let agent_fact = |content: &str, extra: Value| {
        let mut body = json!({ "scope": "agent", "content": content });
        body.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        body
    };

    // Keyed: the open fact and the hr fact share a key, not readers.
    let (restricted, _) =
        f.remember(&hr, agent_fact("band is B3", json!({ "key": "band", "allowed_roles": ["hr"] }))).await;
    let (open, _) = f.remember(&plain, agent_fact("band is public", json!({ "key": "band" }))).await;
    // Judged by the model: the same first three words, other readers.
    let (rome, _) = f.remember(&hr, agent_fact("office is in Rome", json!({ "allowed_roles": ["hr"] }))).await;
    let (oslo, _) = f.remember(&plain, agent_fact("office is in Oslo", json!({}))).await;
    let (lima, _) = f.remember(&plain, agent_fact("office is in Lima", json!({ "visibility": "tenant" }))).await;
    f.settle(judge.clone()).await;
    for id in [restricted, open, rome, oslo, lima] {
        assert_eq!(f.row(id).await.superseded_by, None, "{id} was retired by a fact of other readers");
    }

    // A writer without the role cannot step into the hr facts' bucket.
    let facts = "SELECT count(*) FROM memory_items WHERE source_kind = 'fact'";
    let before = f.app.db.count(facts).await;
    let reply = f
        .app
        .client
        .post(
            "/v1/facts",
            Some(&token(&plain)),
            &agent_fact("band is B1", json!({ "key": "band", "allowed_roles": ["hr"] })),
        )
        .await;
    assert_eq!((reply.status, reply.body["error"]["code"].as_str()), (403, Some("roles_not_held")), "{:?}", reply.body);
    assert_eq!(f.app.db.count(facts).await, before, "a refused fact writes nothing");
    // A user's own fact stays open to that user whatever its roles.
    f.remember(&plain, json!({ "scope": "user", "content": "I like tea", "allowed_roles": ["hr"] })).await;

    // Within the same readers, facts replace each other as before.
    let (newer, _) = f.remember(&hr, agent_fact("band is B4", json!({ "key": "band", "allowed_roles": ["hr"] }))).await;
    let (paris, _) = f.remember(&plain, agent_fact("office is in Paris", json!({}))).await;
    f.settle(judge).await;
    assert_eq!(f.row(restricted).await.superseded_by, Some(newer));
    assert_eq!(f.row(oslo).await.superseded_by, Some(paris));
    for id in [open, rome, lima] {
        assert_eq!(f.row(id).await.superseded_by, None, "{id}");
    }
    let asked = f.asked();
    let compared = |new: &str, old: &str| {
        asked.iter().any(|(n, existing)| n.contains(new) && existing.iter().any(|e| e.contains(old)))
    };
    for (new, old) in [("Oslo", "Rome"), ("Lima", "Rome"), ("Lima", "Oslo"), ("Paris", "Rome"), ("Paris", "Lima")] {
        assert!(!compared(new, old), "{new} was compared with {old}, a fact of other readers");
    }
    assert!(compared("Paris", "Oslo"), "facts of the same readers are compared");
    let check = runbook(&f, &["judge", "check", "--tenant", "acme", "--json"]);
    assert_eq!(check["retired_wrongly"], 0, "{check}");
}

/// A user's fact shared with its agent (`visibility: agent`) is read by that agent's users: the
/// same user's fact shared with another agent, read by other users, never retires it.
#[tokio::test]
async fn a_users_fact_shared_with_one_agent_is_not_retired_by_one_shared_with_another() {
    let f = Fixture::start().await;
    let judge = f.judge(Duration::from_secs(5));
    let helper = principal("acme", Some("ann"), Some("helper"), None);
    let coach = principal("acme", Some("ann"), Some("coach"), None);
    let shared = |content: &str| json!({ "scope": "user", "content": content, "visibility": "agent" });
    let (acme, _) = f.remember(&helper, shared("I work at Acme")).await;
    let (bolt, _) = f.remember(&coach, shared("I work at Bolt")).await;
    f.settle(judge.clone()).await;
    assert_eq!(f.row(acme).await.superseded_by, None, "retired by a fact helper's users cannot read");
    let (corp, _) = f.remember(&helper, shared("I work at Corp")).await;
    f.settle(judge).await;
    assert_eq!(f.row(acme).await.superseded_by, Some(corp), "facts shared with the same agent replace each other");
    assert_eq!(f.row(bolt).await.superseded_by, None);
    let check = runbook(&f, &["judge", "check", "--tenant", "acme", "--json"]);
    assert_eq!(
        (check["retired_wrongly"].as_i64(), check["buckets_with_several_live"].as_i64()),
        (Some(0), Some(0)),
        "{check}"
    );
}

#[tokio::test]
async fn every_judge_failure_fails_open_and_retires_nothing() {
    let f = Fixture::start().await;
    let judge = f.judge(Duration::from_millis(500));
    let cases: Vec<(&str, Vec<ChatAnswer>)> = vec![
        ("timeout", vec![ChatAnswer::Hang(Duration::from_secs(3))]),
        // A 500 may be a refusal of the format: every format is tried before failing.
        ("http_5xx", vec![ChatAnswer::Status(500), ChatAnswer::Status(500), ChatAnswer::Status(500)]),
        ("model_missing", vec![ChatAnswer::Status(404)]),
        ("unparsable", vec![ChatAnswer::Malformed]),
        ("invented_ids", vec![ChatAnswer::InventedIds]),
        // f1 is the Tokyo fact: one label the model was not shown refuses the whole answer.
        (
            "invented_ids",
            vec![ChatAnswer::Content(
                r#"[{"id": "f1", "decision": "SUPERSEDE"}, {"id": "f2", "decision": "KEEP"}]"#.into(),
            )],
        ),
        ("truncated", vec![ChatAnswer::Runaway]),
        // The rule's answer supersedes Tokyo, but a filter cut it.
        ("unfinished", vec![ChatAnswer::Filtered]),
        // Past the answer's size bound (8 MiB), which the same request would pass again.
        ("answer_too_large", vec![ChatAnswer::Content("x".repeat(9 << 20))]),
    ];
    for (i, (kind, answers)) in cases.into_iter().enumerate() {
        let who = principal("acme", Some(&format!("user{i}")), None, None);
        let tokyo = f.fact(&who, "I live in Tokyo").await;
        f.settle(judge.clone()).await;
        f.chat.then(answers);
        let paris = f.fact(&who, "I live in Paris").await;
        f.settle(judge.clone()).await;

        assert_eq!(f.row(tokyo).await.superseded_by, None, "{kind}: nothing retired");
        let row = f.row(paris).await;
        assert!(row.judged, "{kind}: judge_at is set so the row is not retried");
        assert_eq!(row.outcome.as_deref(), Some("fail_open"), "{kind}");
        // Only the endpoint's state, or its slowness, may pass: asked again later.
        let retry: bool = sqlx::query_scalar("SELECT judge_retry_at IS NOT NULL FROM memory_items WHERE id = $1")
            .bind(paris)
            .fetch_one(&f.app.db.pool)
            .await
            .expect("retry");
        let audit = f.audit().await;
        assert_eq!(audit.last(), Some(&("judge_fail_open".to_owned(), Some(paris), None, Some(kind.to_owned()))));
        assert_eq!(retry, matches!(kind, "timeout" | "http_5xx" | "model_missing"), "{kind}");
    }
    assert_eq!(f.app.db.count("SELECT count(*) FROM memory_items WHERE superseded_by IS NOT NULL").await, 0);

    // A server that is not there at all.
    let gone = OpenAiJudge::new(Some("http://127.0.0.1:9/v1"), "k", "m", Duration::from_secs(1)).expect("judge");
    let who = principal("acme", Some("lonely"), None, None);
    let tokyo = f.fact(&who, "I live in Tokyo").await;
    f.settle(None).await;
    let paris = f.fact(&who, "I live in Paris").await;
    f.settle(Some(Arc::new(gone))).await;
    assert_eq!(f.row(tokyo).await.superseded_by, None);
    assert_eq!(f.row(paris).await.outcome.as_deref(), Some("fail_open"));
}

/// A judge failure that may pass (the endpoint down, overloaded or slow) is asked about again
/// by housekeeping after a wait that doubles with each failure, six times; a failure that the
/// same input would draw again waits for an operator, as does a fact past its six.
#[tokio::test]
async fn a_judge_failure_that_may_pass_is_asked_again_later_and_one_that_would_recur_is_not() {
    let f = Fixture::start().await;
    let judge = f.judge(Duration::from_millis(500));
    let store = f.app.db.store();
    let wait = |id: Uuid| {
        let pool = f.app.db.pool.clone();
        async move {
            sqlx::query_scalar::<_, Option<f64>>(
                "SELECT extract(epoch FROM judge_retry_at - judge_at)::float8 FROM memory_items WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .expect("wait")
        }
    };
    // As if `by` had passed: every wait ends that much sooner.
    let elapse = |by: &'static str| {
        let pool = f.app.db.pool.clone();
        async move {
            sqlx::query("UPDATE memory_items SET judge_retry_at = judge_retry_at - $1::interval")
                .bind(by)
                .execute(&pool)
                .await
                .expect("elapse");
        }
    };
    let rejudge = || async { store.rejudge_passing_failures(100).await.expect("rejudge") };
    let who = principal("acme", Some("u1"), None, None);
    let tokyo = f.fact(&who, "I live in Tokyo").await;
    f.settle(judge.clone()).await;
    f.chat.then([ChatAnswer::Status(503)]);
    let paris = f.fact(&who, "I live in Paris").await;
    f.settle(judge.clone()).await;
    assert_eq!(f.row(paris).await.outcome.as_deref(), Some("fail_open"));
    assert_eq!(wait(paris).await, Some(300.0));
    let status = runbook(&f, &["judge", "status", "--json"]);
    assert_eq!(status["to_ask_again"].as_i64(), Some(1), "{status}");

    elapse("4 minutes").await;
    assert_eq!(rejudge().await, 0, "not before its wait ends");
    elapse("1 minute").await;
    assert_eq!(rejudge().await, 1);
    let cleared: (String, String) = sqlx::query_as(
        "SELECT actor, reason FROM audit_log WHERE event = 'judge_clear' AND item_id = $1 ORDER BY id DESC LIMIT 1",
    )
    .bind(paris)
    .fetch_one(&f.app.db.pool)
    .await
    .expect("audit");
    assert_eq!(cleared, ("housekeeping".to_owned(), "retry".to_owned()));
    // The endpoint is back: the fact is judged, and the contradiction resolved.
    f.settle(judge.clone()).await;
    assert_eq!(f.row(tokyo).await.superseded_by, Some(paris));
    assert_eq!(wait(paris).await, None);

    // An answer that cannot be used would be drawn again: not asked again.
    let who = principal("acme", Some("u2"), None, None);
    f.fact(&who, "I live in Tokyo").await;
    f.settle(judge.clone()).await;
    f.chat.then([ChatAnswer::Malformed]);
    let lima = f.fact(&who, "I live in Lima").await;
    f.settle(judge.clone()).await;
    assert_eq!(f.row(lima).await.outcome.as_deref(), Some("fail_open"));
    assert_eq!(wait(lima).await, None);
    elapse("1 day").await;
    assert_eq!(rejudge().await, 0);

    // Each failure doubles the wait; after the sixth the fact waits for an operator, whose
    // clear starts the count again.
    let who = principal("acme", Some("u3"), None, None);
    f.fact(&who, "I live in Tokyo").await;
    f.settle(judge.clone()).await;
    let oslo = f.fact(&who, "I live in Oslo").await;
    for failure in 0..7 {
        if failure > 0 {
            elapse("1 day").await;
            assert_eq!(rejudge().await, 1, "failure {failure}");
        }
        f.chat.then([ChatAnswer::Status(503)]);
        f.settle(judge.clone()).await;
        assert_eq!(f.row(oslo).await.outcome.as_deref(), Some("fail_open"));
        let expected = (failure < 6).then(|| 300.0 * 2f64.powi(failure));
        assert_eq!(wait(oslo).await, expected, "failure {failure}");
    }
    elapse("30 days").await;
    assert_eq!(rejudge().await, 0);
    let selection = mnemo_store::ClearSelection::Ids(vec![oslo]);
    store.clear_judgements(&selection, None, "runbook", false, 100, &mut |_| {}).await.expect("clear");
    f.chat.then([ChatAnswer::Status(503)]);
    f.settle(judge.clone()).await;
    assert_eq!(wait(oslo).await, Some(300.0), "counted again from the operator's clear");
}

#[tokio::test]
async fn a_fact_said_again_retires_its_older_copy_which_leaves_its_ratings() {
    let f = Fixture::start().await;
    let who = principal("acme", Some("u1"), None, None);
    let ratings = |id: Uuid| {
        let pool = f.app.db.pool.clone();
        async move {
            sqlx::query_as::<_, (Option<f32>, Option<f32>)>(
                "SELECT importance, confidence FROM memory_items WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .expect("ratings")
        }
    };
    let body = |content: &str, importance: f64, confidence: f64| json!({ "scope": "user", "content": content, "importance": importance, "confidence": confidence });

    // The same words, case and punctuation aside: retired without a model, even with none.
    let first = f.remember(&who, body("I live in Tokyo.", 0.9, 0.4)).await.0;
    f.settle(None).await;
    let again = f.remember(&who, body("i live in tokyo", 0.2, 0.8)).await.0;
    f.settle(None).await;
    assert_eq!(f.row(first).await.superseded_by, Some(again));
    assert_eq!(f.row(again).await.outcome.as_deref(), Some("superseded"));
    assert_eq!(ratings(again).await, (Some(0.9), Some(0.8)), "the copy left standing keeps the higher of each");
    assert!(f.chat.requests().is_empty(), "no model was asked");

    // In other words: the model says DUPLICATE; an unrelated candidate is kept.
    let tea = f.fact(&who, "I live on sencha").await;
    f.settle(None).await;
    let reordered = f.fact(&who, "in Tokyo I live").await;
    f.settle(f.judge(Duration::from_secs(5))).await;
    assert_eq!(f.row(again).await.superseded_by, Some(reordered));
    assert_eq!(f.row(tea).await.superseded_by, None);
    assert_eq!(ratings(reordered).await, (Some(0.9), Some(0.8)));
    assert_eq!(f.asked().last().map(|(new, _)| new.as_str()), Some("in Tokyo I live"));

    let reasons: Vec<(Option<Uuid>, Option<Uuid>, Option<String>)> =
        f.audit().await.into_iter().map(|(_, item, related, reason)| (item, related, reason)).collect();
    assert_eq!(
        reasons,
        vec![
            (Some(first), Some(again), Some("same_words".to_owned())),
            (Some(again), Some(reordered), Some("duplicate".to_owned())),
        ]
    );

    // An unrated statement counts as ½: a copy rated lower leaves it unrated. An episodic
    // statement of a semantic memory takes its layer, so saying it again never makes it fade.
    let other = principal("acme", Some("u2"), None, None);
    let bees = json!({ "scope": "user", "content": "I keep bees.", "importance": 0.2, "layer": "semantic" });
    let rated = f.remember(&other, bees).await.0;
    f.settle(None).await;
    let unrated = f.remember(&other, json!({ "scope": "user", "content": "i keep bees", "layer": "episodic" })).await.0;
    f.settle(None).await;
    assert_eq!(f.row(rated).await.superseded_by, Some(unrated));
    assert_eq!(ratings(unrated).await, (None, None));
    let layer: String = sqlx::query_scalar("SELECT layer FROM memory_items WHERE id = $1")
        .bind(unrated)
        .fetch_one(&f.app.db.pool)
        .await
        .expect("layer");
    assert_eq!(layer, "semantic");

    // A failing model retires nothing, not even a copy of the same words.
    f.chat.then([ChatAnswer::Status(404)]);
    let shouted = f.fact(&who, "In Tokyo, I LIVE").await;
    f.settle(f.judge(Duration::from_secs(5))).await;
    assert_eq!(f.row(shouted).await.outcome.as_deref(), Some("fail_open"));
    assert_eq!(f.row(reordered).await.superseded_by, None);
}

#[tokio::test]
async fn a_server_that_refuses_json_schema_is_asked_for_json_object_from_then_on() {
    let f = Fixture::start().await;
    f.chat.refuse_json_schema();
    let judge = f.judge(Duration::from_secs(5));
    let who = principal("acme", Some("u1"), None, None);
    let tokyo = f.fact(&who, "I live in Tokyo").await;
    f.settle(judge.clone()).await;
    let paris = f.fact(&who, "I live in Paris").await;
    f.settle(judge.clone()).await;
    assert_eq!(f.row(tokyo).await.superseded_by, Some(paris));
    let lima = f.fact(&who, "I live in Lima").await;
    f.settle(judge).await;
    assert_eq!(f.row(paris).await.superseded_by, Some(lima));

    let formats: Vec<String> =
        f.chat.requests().iter().map(|r| r["response_format"]["type"].as_str().unwrap_or("text").to_owned()).collect();
    assert_eq!(formats, ["json_schema", "json_object", "json_object"]);

    // Plain text, with prose around the answer, is read too.
    f.chat.then([ChatAnswer::Content("Sure. f1: SUPERSEDE, since they moved.".to_owned())]);
    let quito = f.fact(&who, "I live in Quito").await;
    f.settle(f.judge(Duration::from_secs(5))).await;
    assert_eq!(f.row(lima).await.superseded_by, Some(quito));
}

/// One transient 5xx to the schema: the judge uses json_object for a while, then asks for the
/// schema again.
#[tokio::test]
async fn after_a_transient_refusal_the_schema_is_tried_again() {
    let f = Fixture::start().await;
    let judge = OpenAiJudge::new(Some(&f.chat.base_url), "test-key", "scripted-judge", Duration::from_secs(5))
        .expect("judge")
        .with_format_probe(Duration::from_secs(3));
    let judge: Option<Arc<dyn Judge>> = Some(Arc::new(judge));
    let who = principal("acme", Some("u1"), None, None);
    f.fact(&who, "I live in Tokyo").await;
    f.settle(judge.clone()).await;
    f.chat.then([ChatAnswer::Status(500)]);
    f.fact(&who, "I live in Paris").await;
    f.settle(judge.clone()).await;
    f.fact(&who, "I live in Lima").await;
    f.settle(judge.clone()).await;
    tokio::time::sleep(Duration::from_millis(3100)).await;
    f.fact(&who, "I live in Quito").await;
    f.settle(judge).await;
    let formats: Vec<String> =
        f.chat.requests().iter().map(|r| r["response_format"]["type"].as_str().unwrap_or("text").to_owned()).collect();
    assert_eq!(formats, ["json_schema", "json_object", "json_object", "json_schema"]);
}

/// A probe of the schema that fails otherwise (here a truncated answer) falls back to the format
/// that worked, and the judgement goes through.
#[tokio::test]
async fn a_probe_that_fails_falls_back_to_the_format_that_worked() {
    let f = Fixture::start().await;
    let judge = OpenAiJudge::new(Some(&f.chat.base_url), "test-key", "scripted-judge", Duration::from_secs(5))
        .expect("judge")
        .with_format_probe(Duration::from_secs(1));
    let judge: Option<Arc<dyn Judge>> = Some(Arc::new(judge));
    let who = principal("acme", Some("u1"), None, None);
    f.fact(&who, "I live in Tokyo").await;
    f.settle(judge.clone()).await;
    f.chat.then([ChatAnswer::Status(500)]);
    let paris = f.fact(&who, "I live in Paris").await;
    f.settle(judge.clone()).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    f.chat.then([ChatAnswer::Runaway]);
    let lima = f.fact(&who, "I live in Lima").await;
    f.settle(judge).await;
    assert_eq!(f.row(paris).await.superseded_by, Some(lima));
    let formats: Vec<String> =
        f.chat.requests().iter().map(|r| r["response_format"]["type"].as_str().unwrap_or("text").to_owned()).collect();
    assert_eq!(formats, ["json_schema", "json_object", "json_schema", "json_object"]);
}

/// OpenAI's reasoning models refuse `max_tokens` and `temperature: 0` with a 400. Each chat
/// client (judge, summarizer, extractor, consolidator) takes that refusal as what it is, asks
/// again with `max_completion_tokens` and the default temperature, and asks that way from then
/// on: one refusal per client, and every answer read.
#[tokio::test]
async fn every_chat_client_asks_a_reasoning_model_in_its_own_terms() {
    use chrono::NaiveDate;
    use mnemo_core::{ConsolidationInput, Consolidator, ExtractionInput, Extractor, Role, Summarizer, TranscriptLine};
    use mnemo_models::{OpenAiConsolidator, OpenAiExtractor, OpenAiSummarizer};

    let chat = ScriptedChat::start().await;
    chat.reasoning_model();
    chat.expect_key("k");
    let (url, timeout) = (Some(chat.base_url.as_str()), Duration::from_secs(5));
    let judge = OpenAiJudge::new(url, "k", "o4-mini", timeout).expect("judge");
    let summarizer = OpenAiSummarizer::new(url, "k", "o4-mini", timeout).expect("summarizer");
    let extractor = OpenAiExtractor::new(url, "k", "o4-mini", timeout, 64 * 1024).expect("extractor");
    let consolidator = OpenAiConsolidator::new(url, "k", "o4-mini", timeout).expect("consolidator");
    let today = NaiveDate::from_ymd_opt(2026, 11, 29).expect("date");
    let line = TranscriptLine { role: Role::User, tool_name: None, is_call: false, content: "hello".to_owned() };
    let extraction = ExtractionInput {
        transcript: mnemo_core::extraction_transcript(&[(Role::User, "remember: I live in Lima")]),
        profile: String::new(),
        memory: String::new(),
        profile_rewritable: true,
        memory_budget: Some(4_000),
        today_note: String::new(),
        today,
    };
    let consolidation = ConsolidationInput {
        memory: String::new(),
        notes: vec![(today, "- moved".to_owned())],
        max_tokens: 1000,
        max_chars: 4000,
    };
    for round in 0..2 {
        let verdicts = judge.judge("I live in Paris", &["I live in Tokyo".to_owned()]).await.expect("judged");
        assert_eq!(verdicts.len(), 1, "round {round}");
        summarizer.summarize(None, std::slice::from_ref(&line), 500).await.expect("summarized");
        let extracted = extractor.extract(&extraction).await.expect("extracted");
        assert_eq!(extracted.facts.len(), 1, "round {round}");
        consolidator.consolidate(&consolidation).await.expect("consolidated");
    }

    let requests = chat.requests();
    assert!(requests.iter().all(|r| r["model"] == "o4-mini"), "each client names its model");
    let refused: Vec<_> = requests.iter().filter(|r| r.get("max_tokens").is_some()).collect();
    assert_eq!(refused.len(), 4, "one refused request per client, none after it");
    assert!(refused.iter().all(|r| r["temperature"] == 0));
    let answered: Vec<_> = requests.iter().filter(|r| r.get("max_tokens").is_none()).collect();
    assert_eq!(answered.len(), 8);
    for r in answered {
        assert!(r.get("temperature").is_none(), "{r}");
        let bound = r["max_completion_tokens"].as_u64().expect("max_completion_tokens");
        assert!(bound > 25_000 && bound < 50_000, "room for the reasoning, and bounded: {bound}");
    }
}

#[tokio::test]
async fn a_fact_waits_for_the_older_facts_of_its_bucket_to_be_embedded() {
    let f = Fixture::start().await;
    let judge = f.judge(Duration::from_secs(5));
    let who = principal("acme", Some("u1"), None, None);
    let tokyo = f.fact(&who, "I live in Tokyo").await;
    let paris = f.fact(&who, "I live in Paris").await;
    // Paris is embedded first, as two batches can finish out of order.
    let store = f.app.db.store();
    let vector = mnemo_testkit::unit_bag_of_words("I live in Paris", DIMS);
    let row: (String, Vec<u8>) = sqlx::query_as("SELECT tenant_id, content_sha256 FROM memory_items WHERE id = $1")
        .bind(paris)
        .fetch_one(&f.app.db.pool)
        .await
        .expect("row");
    let tenant_id = TenantId::parse(&row.0).expect("tenant");
    let paris_vector =
        mnemo_store::NewVector { id: paris, tenant_id, content_sha256: row.1, embedding: vector, previous_id: None };
    store.save_vectors(MODEL, vec![paris_vector]).await.expect("save");
    judge_pending(&store, judge.clone(), policy(20), "test").await.expect("judge");
    assert!(!f.row(paris).await.judged, "Tokyo has no vector yet, so Paris waits");

    f.settle(judge).await;
    assert_eq!(f.row(tokyo).await.superseded_by, Some(paris));
}

#[tokio::test]
async fn a_disabled_judge_sets_judge_at_and_retires_nothing() {
    let f = Fixture::start().await;
    let who = principal("acme", Some("u1"), None, None);
    let tokyo = f.fact(&who, "I live in Tokyo").await;
    let paris = f.fact(&who, "I live in Paris").await;
    f.settle(None).await;
    for id in [tokyo, paris] {
        let row = f.row(id).await;
        assert_eq!((row.superseded_by, row.outcome.as_deref(), row.judged), (None, Some("disabled"), true));
    }
    assert!(f.chat.requests().is_empty());
    let pending = f.app.db.count("SELECT count(*) FROM memory_items WHERE judge_at IS NULL").await;
    assert_eq!(pending, 0, "the pending query cannot loop");
}

#[tokio::test]
async fn concurrent_judgements_leave_exactly_one_live_fact_and_one_decision() {
    let f = Fixture::start().await;
    let judge = f.judge(Duration::from_secs(5));
    let mut pairs = Vec::new();
    for i in 0..8 {
        let who = principal("acme", Some(&format!("user{i}")), None, None);
        let tokyo = f.fact(&who, "I live in Tokyo").await;
        let paris = f.fact(&who, "I live in Paris").await;
        pairs.push((tokyo, paris));
    }
    embed_like_the_provider(&f.app.db.store(), MODEL, DIMS).await;
    // Four workers at once, with duplicate jobs, as a re-queue or a second worker would give.
    let job = |id: Uuid| JudgeJob { tenant_id: TenantId::parse("acme").expect("tenant"), item_id: id };
    let all: Vec<JudgeJob> = pairs.iter().flat_map(|(a, b)| [job(*a), job(*b)]).collect();
    let reversed: Vec<JudgeJob> = all.iter().rev().cloned().collect();
    let store = f.app.db.store();
    let runs = [all.clone(), reversed, all.clone(), all]
        .into_iter()
        .map(|jobs| {
            let (store, judge) = (store.clone(), judge.clone());
            tokio::spawn(async move { judge_batch(&store, judge, policy(20), "w", &jobs).await.expect("batch") })
        })
        .collect::<Vec<_>>();
    let mut judged = 0;
    for run in runs {
        judged += run.await.expect("run").outcomes.len();
    }
    // A Tokyo retired before its own judgement is no longer pending and is never judged.
    let judged_rows = f.app.db.count("SELECT count(*) FROM memory_items WHERE judge_at IS NOT NULL").await;
    assert_eq!(judged as i64, judged_rows, "each fact is judged at most once, whoever gets it");
    for (tokyo, paris) in pairs {
        let live = f
            .app
            .db
            .count(&format!(
                "SELECT count(*) FROM memory_items WHERE id IN ('{tokyo}', '{paris}') AND superseded_by IS NULL"
            ))
            .await;
        assert_eq!(live, 1);
        assert_eq!(f.row(tokyo).await.superseded_by, Some(paris));
        assert_eq!(f.row(paris).await.outcome.as_deref(), Some("superseded"));
    }
    assert_eq!(f.app.db.count("SELECT count(*) FROM audit_log WHERE event = 'supersede'").await, 8);
}

/// A judgement read before its fact was superseded and revived (its model call was in flight)
/// is not taken for the revival's: the revived fact stays pending for its own judgement, which
/// compares it with the fact that had retired it.
#[tokio::test]
async fn a_judgement_made_before_a_revival_leaves_the_revived_fact_pending() {
    let f = Fixture::start().await;
    let judge = f.judge(Duration::from_secs(5));
    let who = principal("acme", Some("u1"), None, None);
    let tokyo = f.fact(&who, "I live in Tokyo").await;
    embed_like_the_provider(&f.app.db.store(), MODEL, DIMS).await;
    let store = f.app.db.store();
    let job = JudgeJob { tenant_id: TenantId::parse("acme").expect("tenant"), item_id: tokyo };
    let stale = store.pending_facts(&[job]).await.expect("pending").pop().expect("tokyo is pending");
    f.settle(judge.clone()).await;
    let paris = f.fact(&who, "I live in Paris").await;
    f.settle(judge).await;
    assert_eq!(f.row(tokyo).await.superseded_by, Some(paris));
    f.remember(&who, json!({ "scope": "user", "content": "I live in Tokyo" })).await;
    assert!(!f.row(tokyo).await.judged, "revived, to be judged again");

    let kept = retiring_nothing(mnemo_core::JudgeOutcome::Kept, "model");
    assert_eq!(store.apply_judgement(&stale, &kept).await.expect("applied"), None, "a judgement of the old validity");
    assert!(!f.row(tokyo).await.judged, "the revival's judgement was taken by a stale one");
}

/// A judgement whose facts to retire were retired by another judgement first records what it
/// found without them: a fact judged with no model to ask (its copies only) is `disabled`, not
/// `kept`, which says a model kept every candidate.
#[tokio::test]
async fn a_judgement_whose_copies_were_retired_first_records_that_no_model_was_asked() {
    let f = Fixture::start().await;
    let who = principal("acme", Some("u1"), None, None);
    let tokyo = f.fact(&who, "I live in Tokyo").await;
    embed_like_the_provider(&f.app.db.store(), MODEL, DIMS).await;
    let store = f.app.db.store();
    let job = JudgeJob { tenant_id: TenantId::parse("acme").expect("tenant"), item_id: tokyo };
    let pending = store.pending_facts(&[job]).await.expect("pending").pop().expect("tokyo is pending");
    // The copy it would retire is no longer a live fact (here: no fact at all).
    let copies_gone = mnemo_store::Judgement {
        unless_retired: mnemo_core::JudgeOutcome::Disabled,
        retire: vec![(Uuid::now_v7(), mnemo_store::Retire::SameWords)],
        reason: "superseded",
        model: None,
        candidates: 1,
        failure_may_pass: false,
    };
    let applied = store.apply_judgement(&pending, &copies_gone).await.expect("applied");
    assert_eq!(applied, Some(mnemo_core::JudgeOutcome::Disabled));
    assert_eq!(f.row(tokyo).await.outcome.as_deref(), Some("disabled"));
    assert_eq!(f.app.db.count("SELECT count(*) FROM audit_log WHERE event = 'supersede'").await, 0);
}

#[tokio::test]
async fn reasserting_a_superseded_fact_revives_it_and_as_of_reads_follow_the_history() {
    let f = Fixture::start().await;
    let judge = f.judge(Duration::from_secs(5));
    let who = principal("acme", Some("u1"), None, None);
    let recall = |f: &Fixture| {
        let token = token(&who);
        let client = f.app.client.clone();
        async move {
            let body = json!({ "query": "where do I live", "scope": "user" });
            let reply = client.post("/v1/recall", Some(&token), &body).await;
            assert_eq!(reply.status, 200, "{:?}", reply.body);
            reply.body["items"]
                .as_array()
                .expect("items")
                .iter()
                .map(|i| i["content"].as_str().expect("c").to_owned())
                .collect::<Vec<_>>()
        }
    };
    let tokyo = f.fact(&who, "I live in Tokyo").await;
    f.settle(judge.clone()).await;
    let t1 = now().await;
    let paris = f.fact(&who, "I live in Paris").await;
    f.settle(judge.clone()).await;
    let t2 = now().await;
    assert_eq!(f.row(tokyo).await.superseded_by, Some(paris));
    assert_eq!(recall(&f).await, ["I live in Paris"]);

    let (again, was_new) = f.remember(&who, json!({ "scope": "user", "content": "I live in Tokyo" })).await;
    assert_eq!((again, was_new), (tokyo, false));
    let revived = f.row(tokyo).await;
    assert_eq!((revived.superseded_by, revived.judged, revived.validity_ended), (None, false, false));
    f.settle(judge).await;
    assert_eq!(f.row(paris).await.superseded_by, Some(tokyo));
    assert_eq!(f.row(tokyo).await.outcome.as_deref(), Some("superseded"));
    assert_eq!(recall(&f).await, ["I live in Tokyo"]);
    let events: Vec<String> = f.audit().await.into_iter().map(|a| a.0).collect();
    assert_eq!(events, ["supersede", "revive", "supersede"]);

    let store = f.app.db.store();
    let acme = TenantId::parse("acme").expect("tenant");
    let live_at = |at: Option<DateTime<Utc>>| {
        let (store, acme) = (store.clone(), acme.clone());
        async move {
            let facts = store.facts(&acme, FactScope::User, "u1", at, false).await.expect("facts");
            facts.into_iter().map(|r| r.content).collect::<Vec<_>>()
        }
    };
    assert_eq!(live_at(Some(t1)).await, ["I live in Tokyo"]);
    assert_eq!(live_at(Some(t2)).await, ["I live in Paris"]);
    assert_eq!(live_at(None).await, ["I live in Tokyo"]);
    let all = store.facts(&acme, FactScope::User, "u1", None, true).await.expect("facts");
    assert_eq!(all.len(), 2);

    // The runbook's admin view shows the chain.
    let output = runbook(&f, &["facts", "--tenant", "acme", "--user", "u1", "--include-superseded", "--json"]);
    let paris_view = output["facts"].as_array().expect("facts").iter().find(|r| r["id"] == paris.to_string()).cloned();
    let paris_view = paris_view.expect("paris listed");
    assert_eq!((paris_view["state"].as_str(), paris_view["chain"].clone()), (Some("superseded"), json!([tokyo])));
}

#[tokio::test]
async fn judge_clear_reopens_fail_open_facts_and_they_are_judged_again() {
    let f = Fixture::start().await;
    let judge = f.judge(Duration::from_secs(5));
    let who = principal("acme", Some("u1"), None, None);
    let tokyo = f.fact(&who, "I live in Tokyo").await;
    f.settle(judge.clone()).await;
    f.chat.then([ChatAnswer::Malformed]);
    let paris = f.fact(&who, "I live in Paris").await;
    f.settle(judge.clone()).await;
    assert_eq!(f.row(paris).await.outcome.as_deref(), Some("fail_open"));

    let listed = runbook(&f, &["judge", "fail-open", "--tenant", "acme", "--json"]);
    let judged_at = listed["facts"][0]["judge_at"].as_str().map(chrono::DateTime::parse_from_rfc3339);
    assert!(judged_at.is_some_and(|t| t.is_ok()), "{listed}");
    assert_eq!(
        listed["facts"],
        json!([{"id": paris, "tenant": "acme", "judge_at": listed["facts"][0]["judge_at"], "reason": "unparsable"}])
    );
    assert_eq!(listed["truncated"], false);
    // With Tokyo failed open too (for a moment), --limit 1 lists one and says there are more.
    let set_tokyo = |outcome: Option<String>| {
        let pool = f.app.db.pool.clone();
        async move {
            sqlx::query("UPDATE memory_items SET judge_outcome = $2 WHERE id = $1")
                .bind(tokyo)
                .bind(outcome)
                .execute(&pool)
                .await
                .expect("outcome")
        }
    };
    let was = f.row(tokyo).await.outcome;
    set_tokyo(Some("fail_open".into())).await;
    let first = runbook(&f, &["judge", "fail-open", "--tenant", "acme", "--limit", "1", "--json"]);
    assert_eq!((first["facts"].as_array().map(Vec::len), &first["truncated"]), (Some(1), &json!(true)));
    set_tokyo(was).await;
    let status = runbook(&f, &["judge", "status", "--json"]);
    assert_eq!((status["outcomes"]["fail_open"].as_i64(), status["judged"].as_i64()), (Some(1), Some(2)));
    assert_eq!(status["fail_open_rate"].as_f64(), Some(0.5));

    let dry = runbook(&f, &["judge", "clear", "--outcome", "fail_open", "--since", "1h", "--dry-run", "--json"]);
    assert_eq!((dry["cleared"].as_i64(), dry["ids"].clone()), (Some(1), json!([paris])));
    assert!(f.row(paris).await.judged, "a dry run changes nothing");
    let cleared = runbook(&f, &["judge", "clear", "--outcome", "fail_open", "--since", "1h", "--json"]);
    assert_eq!(cleared["cleared"].as_i64(), Some(1));
    assert!(!f.row(paris).await.judged);
    assert_eq!(f.app.db.count("SELECT count(*) FROM audit_log WHERE event = 'judge_clear'").await, 1);
    let queued =
        f.app.db.count("SELECT count(*) FROM apalis.jobs WHERE job_type = 'judge' AND status = 'Pending'").await;
    assert!(queued >= 1, "a judge job is queued with the clear");

    f.settle(judge).await;
    assert_eq!(f.row(tokyo).await.superseded_by, Some(paris));
    assert_eq!(f.row(paris).await.outcome.as_deref(), Some("superseded"));
    let check = runbook(&f, &["judge", "check", "--tenant", "acme", "--json"]);
    assert_eq!(
        check,
        json!({"facts": 2, "superseded": 1, "unjudged": 0, "failed_open": 0, "superseded_twice": 0, "unaudited": 0,
               "audit_without_row": 0, "retired_wrongly": 0, "buckets_with_several_live": 0})
    );
    // Anonymizing the retired fact (as retention does, dropping its user) leaves a sound chain.
    sqlx::query("UPDATE memory_items SET user_id = NULL, anonymized_at = now() WHERE id = $1")
        .bind(tokyo)
        .execute(&f.app.db.pool)
        .await
        .expect("anonymize");
    let check = runbook(&f, &["judge", "check", "--tenant", "acme", "--json"]);
    assert_eq!(check["retired_wrongly"], 0, "{check}");
    // A chain that no longer matches its audit row is caught: the successor named by the row
    // is not the one on the fact.
    sqlx::query("UPDATE memory_items SET superseded_by = id WHERE id = $1")
        .bind(tokyo)
        .execute(&f.app.db.pool)
        .await
        .expect("tamper");
    let broken = std::process::Command::new(binary("mnemo-runbook").expect("runbook"))
        .args(["judge", "check", "--tenant", "acme"])
        .env(vars::DATABASE_URL, &f.app.db.url)
        .output()
        .expect("runbook");
    assert!(!broken.status.success());
    let said = String::from_utf8_lossy(&broken.stderr);
    assert!(
        said.contains("1 superseded without their audit row") && said.contains("1 retired by an older fact"),
        "{said}"
    );
    // A misspelt tenant has nothing to check: that is not a pass.
    let misspelt = std::process::Command::new(binary("mnemo-runbook").expect("runbook"))
        .args(["judge", "check", "--tenant", "acmee"])
        .env(vars::DATABASE_URL, &f.app.db.url)
        .output()
        .expect("runbook");
    let said = String::from_utf8_lossy(&misspelt.stderr);
    assert!(!misspelt.status.success() && said.contains("is its name right?"), "{said}");

    let tune = runbook(&f, &["judge", "tune", "--workers", "1", "--json"]);
    assert!(tune["recommended_batch_size"].as_u64().is_some_and(|b| b >= 1), "{tune}");
    assert!(!tune["reasons"].as_array().expect("reasons").is_empty());
    assert_eq!(tune["current_batch_size"], 20, "the default");
    // The batch size in use is read as the workers read it: from the configuration file too.
    let config = std::env::temp_dir().join(format!("mnemo-judge-{}.env", Uuid::new_v4()));
    std::fs::write(&config, "MNEMO_JUDGE_BATCH_SIZE=7\n").expect("write");
    let output = std::process::Command::new(binary("mnemo-runbook").expect("runbook"))
        .args(["judge", "tune", "--workers", "1", "--json"])
        .env_clear()
        .env(vars::DATABASE_URL, &f.app.db.url)
        .env(vars::CONFIG_FILE, &config)
        .output()
        .expect("runbook");
    std::fs::remove_file(&config).expect("remove");
    let tune: Value = serde_json::from_slice(&output.stdout).expect("json");
    assert_eq!(tune["current_batch_size"], 7, "{tune}");
    let bad = std::process::Command::new(binary("mnemo-runbook").expect("runbook"))
        .args(["judge", "clear", "--outcome", "sometimes", "--since", "1h"])
        .env(vars::DATABASE_URL, &f.app.db.url)
        .output()
        .expect("runbook");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown outcome"));
}

/// `judge clear` works in batches, each its own transaction: every fact is cleared once, the
/// oldest judgement first, and a dry run finds the same facts and changes nothing.
#[tokio::test]
async fn judge_clear_clears_in_batches_and_each_fact_once() {
    let f = Fixture::start().await;
    let mut ids = Vec::new();
    for user in ["u1", "u2", "u3"] {
        ids.push(f.fact(&principal("acme", Some(user), None, None), "I live in Tokyo").await);
        f.settle(None).await;
    }
    let store = f.app.db.store();
    let selection = mnemo_store::ClearSelection::Ids(ids.clone());
    let clear = |dry_run: bool| {
        let (store, selection) = (store.clone(), selection.clone());
        async move {
            let mut batches: Vec<Vec<Uuid>> = Vec::new();
            let mut progress = |rows: &[(Uuid, String)]| batches.push(rows.iter().map(|r| r.0).collect());
            let n = store.clear_judgements(&selection, None, "test", dry_run, 2, &mut progress).await.expect("clear");
            (n, batches)
        }
    };
    let in_order = vec![vec![ids[0], ids[1]], vec![ids[2]]];
    assert_eq!(clear(true).await, (3, in_order.clone()));
    assert_eq!(f.app.db.count("SELECT count(*) FROM memory_items WHERE judge_at IS NULL").await, 0, "a dry run");
    assert_eq!(clear(false).await, (3, in_order));
    assert_eq!(f.app.db.count("SELECT count(*) FROM memory_items WHERE judge_at IS NULL").await, 3);
    assert_eq!(f.app.db.count("SELECT count(*) FROM audit_log WHERE event = 'judge_clear'").await, 3);
    assert_eq!(clear(false).await, (0, vec![]), "nothing judged is left to clear");
}

#[tokio::test]
async fn the_worker_judges_embedded_facts_and_counts_fail_opens() {
    let f = Fixture::start().await;
    let mut env = f.provider.env(MODEL);
    env.extend([
        (vars::JUDGE_MODEL, "scripted-judge".to_owned()),
        (vars::JUDGE_BASE_URL, f.chat.base_url.clone()),
        (vars::JUDGE_API_KEY, "test-key".to_owned()),
        (vars::JUDGE_BATCH_SIZE, "5".to_owned()),
    ]);
    let worker = WorkerProcess::start(&f.app.db.url, &env).await.expect("worker");
    let who = principal("acme", Some("u1"), None, None);
    let tokyo = f.fact(&who, "I live in Tokyo").await;
    assert!(wait_until(Duration::from_secs(30), || async { f.row(tokyo).await.judged }).await);
    let paris = f.fact(&who, "I live in Paris").await;
    assert!(
        wait_until(Duration::from_secs(30), || async { f.row(tokyo).await.superseded_by == Some(paris) }).await,
        "the worker superseded Tokyo"
    );
    // An overloaded endpoint is asked once: another answer format would only add to its load.
    f.chat.then([ChatAnswer::Status(503)]);
    let asked = f.chat.requests().len();
    let lima = f.fact(&who, "I live in Lima").await;
    assert!(wait_until(Duration::from_secs(30), || async { f.row(lima).await.judged }).await);
    assert_eq!(f.row(lima).await.outcome.as_deref(), Some("fail_open"));
    assert_eq!(f.chat.requests().len(), asked + 1, "a 503 was asked again in another format");
    assert_eq!(f.row(paris).await.superseded_by, None);
    assert!(f.chat.requests().iter().all(|r| r["model"] == "scripted-judge"), "the judge names its model");
    assert!(worker.metric("mnemo_judge_fail_open_total").await >= 1.0);
    assert!(worker.metric("mnemo_judge_rows_total").await >= 3.0);
    worker.terminate().await.expect("clean stop");
    let outcome = f.app.db.count("SELECT count(*) FROM judge_batches").await;
    assert!(outcome >= 3, "each batch is recorded for judge tune");
}

async fn now() -> DateTime<Utc> {
    tokio::time::sleep(Duration::from_millis(20)).await;
    let t = Utc::now();
    tokio::time::sleep(Duration::from_millis(20)).await;
    t
}

fn runbook(f: &Fixture, args: &[&str]) -> Value {
    let output = std::process::Command::new(binary("mnemo-runbook").expect("runbook"))
        .args(args)
        .env_clear()
        .env(vars::DATABASE_URL, &f.app.db.url)
        .output()
        .expect("runbook");
    assert!(output.status.success(), "{args:?}: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{args:?}: {e}: {}", String::from_utf8_lossy(&output.stdout)))
}

#[tokio::test]
async fn pending_facts_of_two_tenants_with_one_id_both_come_back() {
    // An import into a second tenant keeps its rows' ids: two tenants' rows may share one.
    let f = Fixture::start().await;
    let acme = f.fact(&principal("acme", Some("u1"), None, None), "I live in Tokyo").await;
    f.fact(&principal("beta", Some("u1"), None, None), "I live in Tokyo").await;
    sqlx::query("UPDATE memory_items SET id = $1 WHERE tenant_id = 'beta'")
        .bind(acme)
        .execute(&f.app.db.pool)
        .await
        .expect("beta's row takes acme's id");
    embed_like_the_provider(&f.app.db.store(), MODEL, DIMS).await;
    let jobs = ["acme", "beta"].map(|t| JudgeJob { tenant_id: TenantId::parse(t).expect("tenant"), item_id: acme });
    let pending = f.app.db.store().pending_facts(&jobs).await.expect("pending");
    let mut tenants: Vec<&str> = pending.iter().map(|p| p.tenant_id.as_str()).collect();
    tenants.sort();
    assert_eq!(tenants, ["acme", "beta"]);

    // `judge clear --ids` names a fact of one tenant: an id in two needs --tenant.
    f.settle(f.judge(Duration::from_secs(5))).await;
    let id = acme.to_string();
    let output = std::process::Command::new(binary("mnemo-runbook").expect("runbook"))
        .args(["judge", "clear", "--ids", &id, "--json"])
        .env_clear()
        .env(vars::DATABASE_URL, &f.app.db.url)
        .output()
        .expect("runbook");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("give --tenant"), "{stderr}");
    assert_eq!(f.app.db.count("SELECT count(*) FROM memory_items WHERE judge_at IS NULL").await, 0, "nothing cleared");
    let stray = Uuid::now_v7().to_string();
    let cleared = runbook(&f, &["judge", "clear", "--ids", &id, "--ids", &stray, "--tenant", "beta", "--json"]);
    assert_eq!((&cleared["cleared"], &cleared["not_cleared"]), (&json!(1), &json!([stray])), "{cleared}");
    let open: Vec<String> = sqlx::query_scalar("SELECT tenant_id FROM memory_items WHERE judge_at IS NULL")
        .fetch_all(&f.app.db.pool)
        .await
        .expect("cleared");
    assert_eq!(open, ["beta"]);
}

#[tokio::test]
async fn a_keyed_fact_committed_after_a_newer_one_was_judged_is_retired_by_it() {
    let f = Fixture::start().await;
    let who = principal("acme", Some("u1"), None, None);
    let keyed = |content: &str| json!({ "scope": "user", "content": content, "key": "home_city" });
    let (paris, _) = f.remember(&who, keyed("home is Paris")).await;
    f.settle(None).await;
    assert_eq!(f.row(paris).await.outcome.as_deref(), Some("no_candidates"));
    // Tokyo's writer began before Paris's and committed after Paris was judged: its validity is
    // the older one.
    let (tokyo, _) = f.remember(&who, keyed("home is Tokyo")).await;
    f.valid_before(tokyo, paris).await;
    f.settle(None).await;
    f.settle(None).await;
    assert_eq!(f.row(tokyo).await.superseded_by, Some(paris), "two live facts of one key");
    assert_eq!(f.row(paris).await.superseded_by, None);
}

/// A keyed fact's judgement retires the older facts of its key as they stand when it is applied:
/// one whose writer began first and committed while the newer fact was being judged is retired
/// too (the reopen covers a newer fact judged already; this one was not yet).
#[tokio::test]
async fn a_keyed_fact_committed_while_a_newer_one_was_being_judged_is_retired_by_it() {
    let f = Fixture::start().await;
    let who = principal("acme", Some("u1"), None, None);
    let keyed = |content: &str| json!({ "scope": "user", "content": content, "key": "home_city" });
    let store = f.app.db.store();
    let (paris, _) = f.remember(&who, keyed("home is Paris")).await;
    embed_like_the_provider(&store, MODEL, DIMS).await;
    let paris_read = f.pending(paris).await;
    // Tokyo's writer began before Paris's, and commits while Paris is being judged.
    let (tokyo, _) = f.remember(&who, keyed("home is Tokyo")).await;
    f.valid_before(tokyo, paris).await;
    embed_like_the_provider(&store, MODEL, DIMS).await;
    let by_key = retiring_nothing(mnemo_core::JudgeOutcome::NoCandidates, "key_match");
    // Tokyo is judged first: no older fact of its key, and Paris, not judged yet, is not reopened.
    let tokyo_judged = store.apply_judgement(&f.pending(tokyo).await, &by_key).await.expect("tokyo");
    assert_eq!(tokyo_judged, Some(mnemo_core::JudgeOutcome::NoCandidates));
    let paris_judged = store.apply_judgement(&paris_read, &by_key).await.expect("paris");
    assert_eq!(paris_judged, Some(mnemo_core::JudgeOutcome::Superseded));
    assert_eq!(f.row(tokyo).await.superseded_by, Some(paris), "two live facts of one key");
    assert_eq!(f.row(paris).await.superseded_by, None);
}

/// A fact being judged when an older extracted fact is judged (its model call under way) read its
/// older facts without that one: its judgement is dropped, and it is judged again with it.
#[tokio::test]
async fn a_fact_being_judged_when_an_older_extracted_fact_is_judged_is_judged_again() {
    let f = Fixture::start().await;
    let who = principal("acme", Some("u1"), None, None);
    let store = f.app.db.store();
    let lyon = f.fact(&who, "Ann lives in Lyon").await;
    embed_like_the_provider(&store, MODEL, DIMS).await;
    let lyon_read = f.pending(lyon).await;
    // Read from a conversation that ended before Lyon was stated, and committed while Lyon's
    // judgement was being made.
    let oslo = f.fact(&who, "Ann lives in Oslo").await;
    sqlx::query("UPDATE memory_items SET origin = 'extraction' WHERE id = $1")
        .bind(oslo)
        .execute(&f.app.db.pool)
        .await
        .expect("extracted");
    f.valid_before(oslo, lyon).await;
    embed_like_the_provider(&store, MODEL, DIMS).await;
    let nothing_older = retiring_nothing(mnemo_core::JudgeOutcome::NoCandidates, "no_candidates");
    let oslo_judged = store.apply_judgement(&f.pending(oslo).await, &nothing_older).await.expect("oslo");
    assert_eq!(oslo_judged, Some(mnemo_core::JudgeOutcome::NoCandidates));
    // Lyon's judgement, made without Oslo, is dropped; Lyon waits for its next one.
    let stale = store.apply_judgement(&lyon_read, &nothing_older).await.expect("lyon");
    assert_eq!(stale, None, "a judgement that never saw Oslo");
    assert!(!f.row(lyon).await.judged);
    // Judged again (the scripted judge: the same first three words supersede), Lyon replaces Oslo.
    f.settle(f.judge(Duration::from_secs(5))).await;
    assert_eq!(f.row(oslo).await.superseded_by, Some(lyon));
    assert_eq!(f.row(lyon).await.superseded_by, None);
}

/// An extracted fact with a key has the newer facts of its key judged again before any other of
/// its bucket: however many newer facts the bucket holds, the user's later statement of the key
/// replaces it.
#[tokio::test]
async fn an_extracted_keyed_fact_reopens_its_key_first() {
    let f = Fixture::start().await;
    let who = principal("acme", Some("u1"), None, None);
    let first = f.fact(&who, "Ann's note number 0").await;
    for i in 1..60 {
        f.fact(&who, &format!("Ann's note number {i}")).await;
    }
    let paris = f.remember(&who, json!({ "scope": "user", "content": "home is Paris", "key": "home_city" })).await.0;
    f.settle(None).await;
    let oslo = f.remember(&who, json!({ "scope": "user", "content": "home is Oslo", "key": "home_city" })).await.0;
    sqlx::query("UPDATE memory_items SET origin = 'extraction' WHERE id = $1")
        .bind(oslo)
        .execute(&f.app.db.pool)
        .await
        .expect("extracted");
    f.valid_before(oslo, first).await;
    f.settle(None).await;
    f.settle(None).await;
    assert_eq!(f.row(oslo).await.superseded_by, Some(paris), "two live facts of one key");
    assert_eq!(f.row(paris).await.superseded_by, None);
}

#[tokio::test]
async fn a_users_agent_fact_replaces_only_what_that_user_wrote() {
    let f = Fixture::start().await;
    let operator = principal("acme", None, Some("helper"), None);
    let bob = principal("acme", Some("bob"), Some("helper"), None);
    let policy = |content: &str| json!({ "scope": "agent", "content": content, "key": "refund_policy" });
    let (official, _) = f.remember(&operator, policy("refunds within 30 days")).await;
    f.settle(None).await;
    // Bob's conversation must not rewrite what the agent's other users recall.
    let (bobs, _) = f.remember(&bob, policy("refunds are always granted")).await;
    f.settle(None).await;
    f.settle(None).await;
    assert_eq!(f.row(official).await.superseded_by, None, "a user's agent fact retired the operator's");
    // His own earlier statement he may replace; a service token replaces any.
    let (again, _) = f.remember(&bob, policy("refunds are always granted, in cash")).await;
    f.settle(None).await;
    assert_eq!(f.row(bobs).await.superseded_by, Some(again));
    let (revised, _) = f.remember(&operator, policy("refunds within 14 days")).await;
    f.settle(None).await;
    assert_eq!(f.row(official).await.superseded_by, Some(revised));
    assert_eq!(f.row(again).await.superseded_by, Some(revised));

    // Bob restating the operator's old policy does not bring it back: revived, it would be
    // judged as the operator's newest statement and retire the revised one.
    let reply = f.app.client.post("/v1/facts", Some(&token(&bob)), &policy("refunds within 30 days")).await;
    assert_eq!(
        (reply.status, reply.body["error"]["code"].as_str()),
        (409, Some("source_ref_conflict")),
        "{:?}",
        reply.body
    );
    f.settle(None).await;
    assert_eq!(f.row(official).await.superseded_by, Some(revised), "another user revived the operator's fact");
    assert_eq!(f.row(revised).await.superseded_by, None);
    // Nor does a token bound to a conversation without a user, which would pass for the service.
    let visitor = principal("acme", None, Some("helper"), Some("s9"));
    let reply = f.app.client.post("/v1/facts", Some(&token(&visitor)), &policy("refunds are granted on request")).await;
    assert_eq!(
        (reply.status, reply.body["error"]["code"].as_str()),
        (401, Some("missing_identity")),
        "{:?}",
        reply.body
    );
    f.settle(None).await;
    assert_eq!(f.row(revised).await.superseded_by, None, "a session's token retired the operator's fact");
    // The operator's own restatement still revives it.
    let (back, was_new) = f.remember(&operator, policy("refunds within 30 days")).await;
    assert_eq!((back, was_new), (official, false));
    f.settle(None).await;
    assert_eq!(f.row(official).await.superseded_by, None);
    assert_eq!(f.row(revised).await.superseded_by, Some(official));
}
