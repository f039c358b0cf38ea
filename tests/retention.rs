//! Retention against a real PostgreSQL, the real runbook and worker binaries: soft deletes
//! through the API, dry runs that leave every row byte-identical, complete anonymization that
//! recall never undoes, the safety floor, resuming after kill -9, tenant policies that fall back
//! with a warning, and user erasure that leaves no content of the user anywhere. Retirement
//! times are moved into the past with SQL, as the only stand-in for waiting 30 days.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use mnemo_config::vars;
use mnemo_core::{MemoryText, NewMemory, Principal, SessionId, TenantId};
use mnemo_testkit::{
    ScriptedEmbeddings, TestApp, TestDb, WorkerProcess, binary, embed_like_the_provider, principal, token, wait_until,
};
use serde_json::{Value, json};
use uuid::Uuid;

const MODEL: &str = "scripted";
const DIMS: usize = 64;

struct Fixture {
    app: TestApp,
    provider: ScriptedEmbeddings,
}

impl Fixture {
    async fn start() -> Self {
        let provider = ScriptedEmbeddings::start(DIMS).await;
        Self { app: TestApp::spawn_with(&provider.env(MODEL)).await, provider }
    }

    fn db(&self) -> &TestDb {
        &self.app.db
    }

    async fn write(&self, who: &Principal, path: &str, body: Value) -> Uuid {
        let reply = self.app.client.post(path, Some(&token(who)), &body).await;
        assert!(reply.status == 201 || reply.status == 200, "{path}: {:?}", reply.body);
        reply.body["id"].as_str().and_then(|s| s.parse().ok()).expect("id")
    }

    async fn message(&self, who: &Principal, source_ref: &str, content: &str) -> Uuid {
        let body = json!({ "source_kind": "chat_message", "source_ref": source_ref, "content": content });
        self.write(who, "/v1/memories", body).await
    }

    async fn fact(&self, who: &Principal, content: &str) -> Uuid {
        self.write(who, "/v1/facts", json!({ "scope": "user", "content": content })).await
    }

    async fn delete(&self, who: &Principal, id: &str) -> mnemo_testkit::Reply {
        self.app.client.delete(&format!("/v1/memories/{id}"), Some(&token(who))).await
    }

    /// The contents recall returns for a keyword query.
    async fn recalled(&self, who: &Principal, query: &str) -> Vec<String> {
        let reply =
            self.app.client.post("/v1/recall", Some(&token(who)), &json!({ "query": query, "top_k": 20 })).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        let items = reply.body["items"].as_array().expect("items");
        items.iter().map(|i| i["content"].as_str().unwrap_or_default().to_owned()).collect()
    }

    /// Runs the runbook with the scripted provider's settings plus `env`, without blocking the
    /// runtime that serves the scripted provider.
    async fn runbook(&self, env: &[(&str, &str)], args: &[&str]) -> Output {
        tokio::process::Command::new(binary("mnemo-runbook").expect("runbook"))
            .args(args)
            .env_clear()
            .env(vars::DATABASE_URL, &self.db().url)
            .envs(self.provider.env(MODEL))
            .envs(env.iter().copied())
            .output()
            .await
            .expect("runbook runs")
    }

    async fn runbook_json(&self, env: &[(&str, &str)], args: &[&str]) -> Value {
        let output = self.runbook(env, args).await;
        assert!(output.status.success(), "{args:?}: {}", String::from_utf8_lossy(&output.stderr));
        serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: {e}: {}", String::from_utf8_lossy(&output.stdout)))
    }

    async fn exec(&self, sql: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned())).execute(&self.db().pool).await.expect(sql);
    }
}

/// A digest of every memory row, vector and tool output payload, byte for byte.
async fn checksum(db: &TestDb) -> String {
    sqlx::query_scalar(
        "SELECT concat_ws(' ',
            (SELECT md5(string_agg(m::text, '|' ORDER BY m.id)) FROM memory_items m),
            (SELECT md5(string_agg(e::text, '|' ORDER BY e.item_id, e.model)) FROM memory_embeddings e),
            (SELECT md5(string_agg(t::text, '|' ORDER BY t.key)) FROM tool_outputs t))",
    )
    .fetch_one(&db.pool)
    .await
    .expect("checksum")
}

/// Rows that are anonymized only in part, or not anonymized but scrubbed: must be none.
async fn half_anonymized(db: &TestDb) -> i64 {
    db.count(
        "SELECT count(*) FROM memory_items m WHERE
            (m.anonymized_at IS NOT NULL AND (
                m.content <> '[REDACTED]' OR m.user_id IS NOT NULL OR m.agent_id IS NOT NULL
                OR m.session_id IS NOT NULL OR m.metadata <> '{}' OR m.tsv IS NOT NULL
                OR m.source_ref NOT LIKE '%|anonymized' OR m.tool_output_key IS NOT NULL
                OR EXISTS (SELECT 1 FROM memory_embeddings e WHERE e.item_id = m.id)
                OR EXISTS (SELECT 1 FROM tool_outputs t WHERE t.item_id = m.id)
                OR NOT EXISTS (SELECT 1 FROM audit_log a WHERE a.item_id = m.id AND a.event = 'memory.anonymize')))
         OR (m.anonymized_at IS NULL AND m.content = '[REDACTED]')",
    )
    .await
}

#[tokio::test]
async fn delete_soft_deletes_only_what_the_caller_may_and_leaves_recall_at_once() {
    let f = Fixture::start().await;
    let ann = principal("acme", Some("ann"), None, Some("s1"));
    let bob = principal("acme", Some("bob"), None, Some("s2"));
    let service = principal("acme", None, None, None);
    let other_tenant = principal("globex", None, None, None);
    let note = f.message(&ann, "m1", "the launch code word is heliotrope").await;
    let fact = f.fact(&ann, "I prefer window seats").await;
    let big = "x".repeat(20_000);
    let tool = json!({ "source_kind": "tool_output", "source_ref": "call-1", "content": format!("heliotrope {big}") });
    let tool = f.write(&ann, "/v1/memories", tool).await;
    let key: String = sqlx::query_scalar("SELECT tool_output_key FROM memory_items WHERE id = $1")
        .bind(tool)
        .fetch_one(&f.db().pool)
        .await
        .expect("key");
    assert_eq!(f.recalled(&ann, "heliotrope").await.len(), 2);

    // Another user, another tenant, a malformed id: nothing changes.
    assert_eq!(f.delete(&bob, &fact.to_string()).await.status, 404);
    assert_eq!(f.delete(&other_tenant, &note.to_string()).await.status, 404);
    assert_eq!(f.delete(&ann, &Uuid::now_v7().to_string()).await.status, 404);
    let bad = f.delete(&ann, "not-a-uuid").await;
    assert_eq!((bad.status, bad.code()), (400, "invalid_field"));
    assert_eq!(f.db().count("SELECT count(*) FROM memory_items WHERE deleted_at IS NOT NULL").await, 0);

    // Its user deletes a fact, a service deletes the user's message; deleting twice is answered.
    let deleted = f.delete(&ann, &fact.to_string()).await;
    assert_eq!((deleted.status, deleted.body["already_deleted"].as_bool()), (200, Some(false)));
    let deleted = f.delete(&service, &note.to_string()).await;
    assert_eq!((deleted.status, deleted.body["already_deleted"].as_bool()), (200, Some(false)));
    let again = f.delete(&ann, &note.to_string()).await;
    assert_eq!((again.status, again.body["already_deleted"].as_bool()), (200, Some(true)));
    assert_eq!(again.body["deleted_at"], deleted.body["deleted_at"]);
    assert_eq!(f.delete(&ann, &tool.to_string()).await.status, 200);

    assert!(f.recalled(&ann, "heliotrope").await.is_empty(), "deleted rows leave recall at once");
    assert!(f.recalled(&ann, "window seats").await.is_empty());
    assert_eq!(f.app.client.get(&format!("/v1/tool-outputs/{key}"), Some(&token(&ann))).await.status, 404);
    let audit: Vec<(String, Option<String>, String)> =
        sqlx::query_as("SELECT event, reason, details::text FROM audit_log ORDER BY id")
            .fetch_all(&f.db().pool)
            .await
            .expect("audit");
    assert_eq!(audit.len(), 3, "one audit row per deletion, none for the repeat: {audit:?}");
    assert!(audit.iter().all(|(event, _, details)| event == "memory.delete" && !details.contains("heliotrope")));
    assert_eq!(audit[1].1.as_deref(), Some("service"));

    // A retried message under a deleted key is refused; the same fact asserted again revives it.
    let retry = f
        .app
        .client
        .post(
            "/v1/memories",
            Some(&token(&ann)),
            &json!({ "source_kind": "chat_message", "source_ref": "m1", "content": "the launch code word is heliotrope" }),
        )
        .await;
    assert_eq!((retry.status, retry.code()), (409, "memory_deleted"));
    assert_eq!(f.fact(&ann, "I prefer window seats").await, fact);
    assert_eq!(f.recalled(&ann, "window seats").await, ["I prefer window seats"]);

    // An agent fact deleted by a service token is not brought back by another user of the agent
    // restating it (the row names its first writer, whose erasure would take it).
    let agent_fact = json!({ "scope": "agent", "content": "the office closes at six" });
    let ann = principal("acme", Some("ann"), Some("helper"), None);
    let written = f.app.client.post("/v1/facts", Some(&token(&ann)), &agent_fact).await;
    assert_eq!(written.status, 201, "{:?}", written.body);
    let id = written.body["id"].as_str().expect("id").to_owned();
    let service = principal("acme", None, Some("helper"), None);
    assert_eq!(f.delete(&service, &id).await.status, 200);
    let bob = principal("acme", Some("bob"), Some("helper"), None);
    let restated = f.app.client.post("/v1/facts", Some(&token(&bob)), &agent_fact).await;
    assert_eq!((restated.status, restated.code()), (409, "memory_deleted"), "{:?}", restated.body);
    let again = f.app.client.post("/v1/facts", Some(&token(&ann)), &agent_fact).await;
    assert_eq!((again.status, again.body["id"].as_str()), (200, Some(id.as_str())), "its writer restates it");
}

/// A user's token bound to a session deletes of the rows of sessions only that session's, as it
/// reads them, and its user's rows of no session; a user's token deletes a session's summary
/// (which carries the last user it covers, for their erasure) only when its compactions
/// summarized that user's words alone: it holds everyone's words.
#[tokio::test]
async fn a_users_token_deletes_neither_another_sessions_rows_nor_a_shared_summary() {
    let f = Fixture::start().await;
    let in_s1 = principal("acme", Some("ann"), None, Some("s1"));
    let in_s2 = principal("acme", Some("ann"), None, Some("s2"));
    let note = f.message(&in_s1, "m1", "see you on monday").await;
    let bobs = f.message(&principal("acme", Some("bob"), None, Some("s1")), "b1", "and me on tuesday").await;
    let alone = f.message(&in_s2, "m2", "a session of my own").await;
    // s3: Carol wrote, then was erased (the record names nobody), then Ann alone; s4: a record
    // naming nobody beside another user's live message; s5: the same, Dan's message anonymized
    // since and the reply to it marked as his.
    let in_s3 = principal("acme", Some("ann"), None, Some("s3"));
    f.message(&principal("acme", Some("carol"), None, Some("s3")), "c1", "carol was here").await;
    let (after_erased, later) = (f.message(&in_s3, "m3", "first").await, f.message(&in_s3, "m4", "then").await);
    let in_s4 = principal("acme", Some("ann"), None, Some("s4"));
    f.message(&in_s4, "m5", "here too").await;
    let bob_s4 = f.message(&principal("acme", Some("bob"), None, Some("s4")), "b2", "and me").await;
    let in_s5 = principal("acme", Some("ann"), None, Some("s5"));
    f.message(&in_s5, "m6", "hello").await;
    let dans = f.message(&principal("acme", Some("dan"), None, Some("s5")), "d1", "my address is 4 Elm St").await;
    let to_dan = f.message(&principal("acme", None, None, Some("s5")), "r1", "Noted, Dan").await;
    let fact = f.fact(&in_s1, "I prefer window seats").await;
    let summary = |sid: &str, text: &str| {
        let session = SessionId::parse(sid).expect("session");
        NewMemory::session_summary(
            TenantId::parse("acme").expect("tenant"),
            session.clone(),
            Some(mnemo_core::UserId::parse("ann").expect("user")),
            None,
            mnemo_core::summary_source_ref(&session, None, Uuid::now_v7(), text),
            MemoryText::parse(text).expect("text"),
            chrono::Utc::now(),
        )
    };
    let store = f.db().store();
    // Carol's erasure, before the summaries (it would take a summary of her session).
    let carol = mnemo_core::UserId::parse("carol").expect("user");
    let acme = TenantId::parse("acme").expect("tenant");
    mnemo_jobs::erase_user(&store, &acme, &carol, 100, false, "test", |_, _| {}).await.expect("erasure");
    let shared = store.remember(&summary("s1", "Ann and Bob planned the trip")).await.expect("a summary").id;
    let own = store.remember(&summary("s2", "Ann kept a session of her own")).await.expect("a summary").id;
    let after = store.remember(&summary("s3", "Ann went on alone")).await.expect("a summary").id;
    let unknown = store.remember(&summary("s4", "Ann and someone")).await.expect("a summary").id;
    let marked = store.remember(&summary("s5", "Ann and Dan")).await.expect("a summary").id;
    // Their compactions, naming whose words they summarized.
    let records = [
        ("s1", bobs, shared, vec!["ann", "bob"]),
        ("s2", alone, own, vec!["ann"]),
        ("s3", after_erased, after, vec![]),
        ("s3", later, after, vec!["ann"]),
        ("s4", bob_s4, unknown, vec![]),
        ("s5", to_dan, marked, vec![]),
    ];
    for (sid, through, summary, writers) in records {
        sqlx::query(
            "INSERT INTO session_compactions
                 (tenant_id, session_id, through_id, through_time, messages, outcome, summary_id, model, trigger,
                  participants)
             VALUES ('acme', $1, $2, now(), 2, 'summarized', $3, 'm', 'threshold',
                     ARRAY(SELECT encode(sha256(convert_to(w, 'UTF8')), 'hex') FROM unnest($4::text[]) w))",
        )
        .bind(sid)
        .bind(through)
        .bind(summary)
        .bind(writers)
        .execute(&f.db().pool)
        .await
        .expect("a compaction");
    }

    // Dan's message as a sweep leaves it: anonymized, and the reply to it marked with his hash.
    sqlx::query(
        "UPDATE memory_items SET user_id = NULL, session_id = NULL, content = '[REDACTED]', anonymized_at = now() WHERE id = $1",
    )
    .bind(dans)
    .execute(&f.db().pool)
    .await
    .expect("anonymized");
    sqlx::query(
        "UPDATE memory_items SET reply_to_user_sha256 = encode(sha256(convert_to('dan', 'UTF8')), 'hex') WHERE id = $1",
    )
    .bind(to_dan)
    .execute(&f.db().pool)
    .await
    .expect("marked");

    assert_eq!(f.delete(&in_s2, &note.to_string()).await.status, 404, "another session's message");
    let everywhere = principal("acme", Some("ann"), None, None);
    for who in [&in_s1, &everywhere] {
        assert_eq!(f.delete(who, &shared.to_string()).await.status, 404, "a shared summary, by {who:?}");
    }
    let deleted = "SELECT count(*) FROM memory_items WHERE deleted_at IS NOT NULL AND anonymized_at IS NULL";
    assert_eq!(f.db().count(deleted).await, 0);
    assert_eq!(f.delete(&in_s2, &own.to_string()).await.status, 200, "the summary of her own session");
    assert_eq!(f.delete(&in_s3, &after.to_string()).await.status, 200, "its other writer was erased");
    assert_eq!(f.delete(&in_s4, &unknown.to_string()).await.status, 404, "a record naming nobody, bob still there");
    assert_eq!(f.delete(&in_s5, &marked.to_string()).await.status, 404, "a reply to dan is still there");
    assert_eq!(f.delete(&in_s2, &fact.to_string()).await.status, 200, "her fact is of no session");
    assert_eq!(f.delete(&in_s1, &note.to_string()).await.status, 200);
    let session_token = principal("acme", None, None, Some("s1"));
    assert_eq!(f.delete(&session_token, &shared.to_string()).await.status, 200, "the session's own token");
}

/// Deleting a fact or a document chunk does not wait on the tenant's text-count lock, which the
/// embed worker's saves hold; a session's row does (a chat message is another vector's previous
/// turn, and a compaction records its summary of the session's rows under that lock).
#[tokio::test]
async fn only_a_deleted_session_row_waits_for_the_embedders_lock() {
    let f = Fixture::start().await;
    let ann = principal("acme", Some("ann"), None, Some("s1"));
    let service = principal("acme", None, None, None);
    let fact = f.fact(&ann, "I prefer window seats").await;
    let chunk = json!({ "source_kind": "document_chunk", "source_ref": "doc-1#0", "content": "a handbook page" });
    let chunk = f.write(&service, "/v1/memories", chunk).await;
    let note = f.message(&ann, "m1", "see you on monday").await;

    let mut holder = f.db().pool.begin().await.expect("begin");
    sqlx::query("SELECT mnemo_lock_text_counts('acme')").execute(&mut *holder).await.expect("lock");
    for (who, id) in [(&ann, fact), (&service, chunk)] {
        let deleted = tokio::time::timeout(Duration::from_secs(5), f.delete(who, &id.to_string())).await;
        assert_eq!(deleted.expect("deleted without waiting for the lock").status, 200);
    }
    let waiting = tokio::spawn({
        let (client, t) = (f.app.client.clone(), token(&ann));
        async move { client.delete(&format!("/v1/memories/{note}"), Some(&t)).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "a session row's deletion takes the lock");
    holder.rollback().await.expect("release");
    assert_eq!(waiting.await.expect("joined").status, 200);
}

/// A fact asserted again while a sweep anonymizes it is refused as deleted: it was answered 200
/// with the id of a row that no longer holds it, and stored nowhere.
#[tokio::test]
async fn a_fact_asserted_again_while_it_is_anonymized_is_refused() {
    let f = Fixture::start().await;
    let ann = principal("acme", Some("ann"), None, None);
    let fact = f.fact(&ann, "I prefer aisle seats").await;
    assert_eq!(f.delete(&ann, &fact.to_string()).await.status, 200);
    // The sweep's transaction holds the row while the write reads it deleted, then anonymizes it.
    let mut sweep = f.db().pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM memory_items WHERE id = $1 FOR UPDATE")
        .bind(fact)
        .execute(&mut *sweep)
        .await
        .expect("lock");
    let write = {
        let client = f.app.client.clone();
        let t = token(&ann);
        tokio::spawn(async move {
            client.post("/v1/facts", Some(&t), &json!({ "scope": "user", "content": "I prefer aisle seats" })).await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!write.is_finished(), "the write waits for the sweep's row lock to revive the fact");
    sqlx::query(
        "UPDATE memory_items SET anonymized_at = now(), content = '[REDACTED]', source_ref = source_ref || '|anonymized'
         WHERE id = $1",
    )
    .bind(fact)
    .execute(&mut *sweep)
    .await
    .expect("anonymize");
    sweep.commit().await.expect("commit");
    let reply = write.await.expect("write");
    assert_eq!((reply.status, reply.code()), (409, "memory_deleted"), "{:?}", reply.body);
    assert_eq!(f.db().count("SELECT count(*) FROM memory_items WHERE anonymized_at IS NULL").await, 0);
}

/// Rows of tenant `acme` for the sweep tests: a deleted message past the soft TTL, one deleted
/// recently, a superseded fact past the superseded TTL, one superseded recently, and a live
/// fact. Returns their ids in that order.
async fn retired_rows(f: &Fixture) -> [Uuid; 5] {
    let ann = principal("acme", Some("ann"), Some("helper"), Some("s1"));
    let old_note = f.message(&ann, "m-old", "my passport number is K1234567").await;
    let new_note = f.message(&ann, "m-new", "my locker code is 9911").await;
    let old_fact = f.fact(&ann, "I live in Tokyo").await;
    let recent_fact = f.fact(&ann, "I live in Osaka").await;
    let live = f.fact(&ann, "I live in Paris").await;
    embed_like_the_provider(&f.db().store(), MODEL, DIMS).await;
    f.exec(&format!(
        "UPDATE memory_items SET metadata = '{{\"mood\": \"calm\"}}' WHERE id = '{old_note}';
         UPDATE memory_items SET deleted_at = now() - interval '40 days' WHERE id = '{old_note}';
         UPDATE memory_items SET deleted_at = now() - interval '5 days' WHERE id = '{new_note}';
         UPDATE memory_items SET superseded_by = '{live}', superseded_at = now() - interval '100 days',
                valid_to = now() - interval '100 days' WHERE id = '{old_fact}';
         UPDATE memory_items SET superseded_by = '{live}', superseded_at = now() - interval '10 days',
                valid_to = now() - interval '10 days' WHERE id = '{recent_fact}';"
    ))
    .await;
    [old_note, new_note, old_fact, recent_fact, live]
}

#[tokio::test]
async fn a_dry_run_reports_and_leaves_every_row_byte_identical() {
    let f = Fixture::start().await;
    let [old_note, _, old_fact, _, _] = retired_rows(&f).await;
    let before = checksum(f.db()).await;

    let report = f.runbook_json(&[], &["anonymize", "--tenant", "acme", "--dry-run", "--json"]).await;
    assert_eq!(report["outcome"], "dry_run");
    assert_eq!(report["due"], json!({ "soft_deleted": 1, "superseded": 1, "total": 2 }));
    let mut listed: Vec<(String, String)> = report["ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|i| (i["id"].as_str().unwrap_or_default().to_owned(), i["reason"].as_str().unwrap_or_default().to_owned()))
        .collect();
    listed.sort();
    let mut expected =
        vec![(old_note.to_string(), "soft_deleted".to_owned()), (old_fact.to_string(), "superseded".to_owned())];
    expected.sort();
    assert_eq!(listed, expected);
    assert_eq!(checksum(f.db()).await, before, "the flag's dry run changed a row");

    // The environment's and the tenant policy's dry runs do the same.
    let env_dry =
        f.runbook_json(&[(vars::ANONYMIZE_DRY_RUN, "true")], &["anonymize", "--tenant", "acme", "--json"]).await;
    assert_eq!(env_dry["outcome"], "dry_run");
    f.exec("INSERT INTO tenant_config (tenant_id, settings) VALUES ('acme', '{\"memory_retention\": {\"dry_run\": true}}')")
        .await;
    let policy_dry = f.runbook_json(&[], &["anonymize", "--tenant", "acme", "--json"]).await;
    assert_eq!(
        (policy_dry["outcome"].as_str(), policy_dry["policy"]["dry_run"].as_bool()),
        (Some("dry_run"), Some(true))
    );
    assert_eq!(checksum(f.db()).await, before, "a policy dry run changed a row");
    assert_eq!(f.db().count("SELECT count(*) FROM audit_log WHERE event LIKE 'memory.anonymize%'").await, 0);
}

#[tokio::test]
async fn a_sweep_anonymizes_completely_keeps_chains_and_never_comes_back() {
    let f = Fixture::start().await;
    let [old_note, new_note, old_fact, recent_fact, live] = retired_rows(&f).await;
    let ann = principal("acme", Some("ann"), Some("helper"), Some("s1"));
    // Another tenant's retired row is not this sweep's business.
    let other = principal("globex", Some("ann"), None, Some("s1"));
    let theirs = f.message(&other, "m-old", "my passport number is K1234567").await;
    f.exec(&format!("UPDATE memory_items SET deleted_at = now() - interval '400 days' WHERE id = '{theirs}'")).await;

    let report = f.runbook_json(&[], &["anonymize", "--tenant", "acme", "--json"]).await;
    assert_eq!(report["outcome"], "done");
    assert_eq!(report["anonymized"], json!({ "soft_deleted": 1, "superseded": 1 }));
    let anonymized: Vec<Uuid> =
        sqlx::query_scalar("SELECT id FROM memory_items WHERE anonymized_at IS NOT NULL ORDER BY id")
            .fetch_all(&f.db().pool)
            .await
            .expect("ids");
    let mut expected = vec![old_note, old_fact];
    expected.sort();
    assert_eq!(anonymized, expected);
    assert_eq!(half_anonymized(f.db()).await, 0);
    for id in [new_note, recent_fact, live, theirs] {
        let untouched = f
            .db()
            .count(&format!("SELECT count(*) FROM memory_items WHERE id = '{id}' AND content <> '[REDACTED]'"))
            .await;
        assert_eq!(untouched, 1, "{id} was not due");
    }
    // The chain stays: the anonymized fact still names the fact that replaced it.
    let (successor, source_ref): (Option<Uuid>, String) =
        sqlx::query_as("SELECT superseded_by, source_ref FROM memory_items WHERE id = $1")
            .bind(old_fact)
            .fetch_one(&f.db().pool)
            .await
            .expect("row");
    assert_eq!(successor, Some(live));
    assert_eq!(source_ref, format!("fact:user:{old_fact}|anonymized"), "no identity or content hash is left");
    let audit: Vec<(Option<Uuid>, Option<String>, String, String)> = sqlx::query_as(
        "SELECT item_id, reason, actor, details::text FROM audit_log WHERE event = 'memory.anonymize' ORDER BY item_id",
    )
    .fetch_all(&f.db().pool)
    .await
    .expect("audit");
    assert_eq!(audit.len(), 2);
    assert!(audit.iter().all(|(_, _, actor, details)| actor == "runbook" && details == "{}"));

    // Recall never returns them: not the API, not the admin path that includes superseded rows.
    let recalled = f.recalled(&ann, "passport number").await;
    assert!(!recalled.is_empty(), "the live rows still answer");
    assert!(recalled.iter().all(|c| !c.contains("passport") && c != "[REDACTED]"), "{recalled:?}");
    let admin = f
        .runbook_json(
            &[],
            &[
                "recall",
                "--tenant",
                "acme",
                "--user",
                "ann",
                "--scope",
                "user",
                "--include-superseded",
                "--top-k",
                "20",
                "--json",
                "I live in",
            ],
        )
        .await;
    let ids: Vec<&str> = admin["items"].as_array().expect("items").iter().filter_map(|i| i["id"].as_str()).collect();
    assert!(ids.contains(&recent_fact.to_string().as_str()), "the admin path shows superseded rows: {admin}");
    assert!(!ids.contains(&old_fact.to_string().as_str()), "but never anonymized ones: {admin}");

    // Running again finds nothing and changes nothing.
    let before = checksum(f.db()).await;
    let again = f.runbook_json(&[], &["anonymize", "--tenant", "acme", "--json"]).await;
    assert_eq!((again["outcome"].as_str(), again["anonymized_total"].as_u64()), (Some("done"), Some(0)));
    assert_eq!(checksum(f.db()).await, before);
    assert_eq!(f.db().count("SELECT count(*) FROM audit_log WHERE event = 'memory.anonymize'").await, 2);

    // The key is free again: the same message id can be written anew.
    let fresh = f.message(&ann, "m-old", "a new message under an old id").await;
    assert_ne!(fresh, old_note);
    let listed = f.runbook_json(&[], &["audit", "--tenant", "acme", "--event", "memory.anonymize", "--json"]).await;
    assert_eq!((listed["entries"].as_array().map(Vec::len), &listed["truncated"]), (Some(2), &json!(false)));
    let first = ["audit", "--tenant", "acme", "--event", "memory.anonymize", "--limit", "1", "--json"];
    let first = f.runbook_json(&[], &first).await;
    assert_eq!((first["entries"].as_array().map(Vec::len), &first["truncated"]), (Some(1), &json!(true)));
    let by_item = f.runbook_json(&[], &["audit", "--item", &old_fact.to_string(), "--json"]).await;
    let events: Vec<&str> =
        by_item["entries"].as_array().expect("entries").iter().filter_map(|e| e["event"].as_str()).collect();
    assert_eq!(events, ["memory.anonymize"]);
}

/// `rows` rows of `tenant`, of which the first `deleted` were soft-deleted 40 days ago.
/// Keys freed by anonymization never collide: a ref whose plain suffix is taken is renamed with
/// `|anonymized|` and its id, which no caller's ref holds, so a message named after another's id
/// cannot make the same key in the same sweep (it failed every later sweep of the tenant).
#[tokio::test]
async fn anonymized_keys_never_collide_whatever_the_refs() {
    let f = Fixture::start().await;
    let ann = principal("acme", Some("ann"), Some("helper"), Some("s1"));
    let first = f.message(&ann, "r", "the first r").await;
    f.exec(&format!("UPDATE memory_items SET deleted_at = now() - interval '400 days' WHERE id = '{first}'")).await;
    f.runbook_json(&[], &["anonymize", "--tenant", "acme", "--json"]).await;
    let again = f.message(&ann, "r", "r again").await;
    let named_after_it = f.message(&ann, &format!("r|{again}"), "named after its id").await;
    f.exec(&format!(
        "UPDATE memory_items SET deleted_at = now() - interval '400 days' WHERE id IN ('{again}', '{named_after_it}')"
    ))
    .await;
    let report = f.runbook_json(&[], &["anonymize", "--tenant", "acme", "--json"]).await;
    assert_eq!(report["outcome"], "done", "{report}");
    let left = f.db().count("SELECT count(*) FROM memory_items WHERE anonymized_at IS NULL").await;
    assert_eq!(left, 0, "every row anonymized");
}

async fn bulk_rows(f: &Fixture, tenant: &str, rows: i64, deleted: i64) {
    f.exec(&format!(
        "INSERT INTO memory_items (id, tenant_id, scope, session_id, user_id, source_kind, source_ref, content,
                                   content_sha256, event_time, deleted_at)
         SELECT gen_random_uuid(), '{tenant}', 'session', 's1', 'ann', 'chat_message', 'bulk-' || i,
                'bulk message number ' || i, sha256(('bulk ' || i)::bytea), now(),
                CASE WHEN i <= {deleted} THEN now() - interval '40 days' END
         FROM generate_series(1, {rows}) AS i"
    ))
    .await;
}

#[tokio::test]
async fn the_safety_floor_refuses_changes_nothing_and_an_operator_can_allow_one_sweep() {
    let f = Fixture::start().await;
    bulk_rows(&f, "acme", 200, 150).await;
    let floor = [(vars::ANONYMIZE_FLOOR_ROWS, "100")];
    let before = checksum(f.db()).await;

    let refused = f.runbook(&floor, &["anonymize", "--tenant", "acme"]).await;
    assert!(!refused.status.success(), "a refused sweep exits non-zero");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("refused by the safety floor") && stderr.contains("--allow-large-sweep 150"), "{stderr}");
    assert_eq!(checksum(f.db()).await, before);
    let refusal: (String, String) = sqlx::query_as(
        "SELECT actor, details::text FROM audit_log WHERE event = 'memory.anonymize.refused' AND tenant_id = 'acme'",
    )
    .fetch_one(&f.db().pool)
    .await
    .expect("one refusal row");
    assert!(refusal.1.contains("\"due\": 150") && refusal.1.contains("\"tenant_rows\": 200"), "{}", refusal.1);

    // A permission for fewer rows than due is not enough.
    let short = f.runbook(&floor, &["anonymize", "--tenant", "acme", "--allow-large-sweep", "149"]).await;
    assert!(!short.status.success());
    assert_eq!(checksum(f.db()).await, before);
    assert_eq!(f.db().count("SELECT count(*) FROM audit_log WHERE event = 'memory.anonymize.refused'").await, 2);

    // A row turns due after the sweep counted them (its delete committed late): the operator's
    // permission is for 150 rows, and the sweep stops there.
    f.exec(
        "CREATE FUNCTION due_late() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN UPDATE memory_items SET deleted_at = now() - interval '40 days' WHERE source_ref = 'bulk-200';
               RETURN NEW; END $$;
         CREATE TRIGGER due_late AFTER INSERT ON audit_log
         FOR EACH ROW WHEN (NEW.event = 'memory.anonymize.allowed') EXECUTE FUNCTION due_late();",
    )
    .await;
    let allowed =
        f.runbook_json(&floor, &["anonymize", "--tenant", "acme", "--allow-large-sweep", "150", "--json"]).await;
    assert_eq!((allowed["outcome"].as_str(), allowed["anonymized_total"].as_u64()), (Some("done"), Some(150)));
    assert_eq!(f.db().count("SELECT count(*) FROM audit_log WHERE event = 'memory.anonymize.allowed'").await, 1);
    assert_eq!(f.db().count("SELECT count(*) FROM memory_items WHERE anonymized_at IS NOT NULL").await, 150);
    assert_eq!(half_anonymized(f.db()).await, 0);

    // Under the default floor (1000 rows) the same share is small enough to go ahead unasked.
    bulk_rows(&f, "initech", 200, 150).await;
    let unasked = f.runbook_json(&[], &["anonymize", "--tenant", "initech", "--json"]).await;
    assert_eq!(unasked["anonymized_total"].as_u64(), Some(150));

    // Under the floor too, a sweep does what its plan counted: rows that turn due while it runs
    // (an import or a bulk delete committing) wait for the next sweep, whose plan the floor checks.
    bulk_rows(&f, "globex", 1000, 100).await;
    f.exec(
        "CREATE FUNCTION all_due() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN UPDATE memory_items SET deleted_at = now() - interval '40 days'
               WHERE tenant_id = 'globex' AND deleted_at IS NULL;
               RETURN NEW; END $$;
         CREATE TRIGGER all_due AFTER INSERT ON audit_log
         FOR EACH ROW WHEN (NEW.event = 'memory.anonymize' AND NEW.tenant_id = 'globex') EXECUTE FUNCTION all_due();",
    )
    .await;
    let batches = [(vars::ANONYMIZE_BATCH_SIZE, "10")];
    let planned = f.runbook_json(&batches, &["anonymize", "--tenant", "globex", "--json"]).await;
    assert_eq!(planned["anonymized_total"].as_u64(), Some(100));
    let anonymized = "SELECT count(*) FROM memory_items WHERE tenant_id = 'globex' AND anonymized_at IS NOT NULL";
    assert_eq!(f.db().count(anonymized).await, 100);
    // An operator's N bounds a sweep under the floor as well.
    f.exec("DROP TRIGGER all_due ON audit_log").await;
    f.exec("UPDATE memory_items SET deleted_at = now() - interval '40 days' WHERE tenant_id = 'initech' AND anonymized_at IS NULL").await;
    let bounded =
        f.runbook_json(&[], &["anonymize", "--tenant", "initech", "--allow-large-sweep", "20", "--json"]).await;
    assert_eq!(bounded["anonymized_total"].as_u64(), Some(20), "{bounded}");
}

#[tokio::test]
async fn a_sweep_killed_mid_way_leaves_whole_rows_and_the_next_one_finishes() {
    let f = Fixture::start().await;
    bulk_rows(&f, "acme", 4000, 4000).await;
    f.exec("INSERT INTO tenant_config (tenant_id, settings) VALUES ('acme', '{\"memory_retention\": {\"batch_size\": 5}}')")
        .await;
    let mut sweep = Command::new(binary("mnemo-runbook").expect("runbook"))
        .args(["anonymize", "--tenant", "acme", "--allow-large-sweep", "4000"])
        .env_clear()
        .env(vars::DATABASE_URL, &f.db().url)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("runbook starts");
    let started = wait_until(Duration::from_secs(30), || async {
        f.db().count("SELECT count(*) FROM memory_items WHERE anonymized_at IS NOT NULL").await >= 50
    })
    .await;
    sweep.kill().expect("kill -9");
    sweep.wait().expect("reaped");
    assert!(started, "the sweep made progress");
    // The server finishes the statement it was running when the client died.
    let gone = wait_until(Duration::from_secs(10), || async {
        f.db().count("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'mnemo'").await
            == 0
    })
    .await;
    assert!(gone, "the killed sweep's connection closed");
    let done = f.db().count("SELECT count(*) FROM memory_items WHERE anonymized_at IS NOT NULL").await;
    assert!(done < 4000, "killed mid-sweep ({done} done)");
    assert_eq!(half_anonymized(f.db()).await, 0, "every row is untouched or fully anonymized");
    assert_eq!(f.db().count("SELECT count(*) FROM audit_log WHERE event = 'memory.anonymize'").await, done);

    let rest = f.runbook_json(&[], &["anonymize", "--tenant", "acme", "--allow-large-sweep", "4000", "--json"]).await;
    assert_eq!(rest["anonymized_total"].as_i64(), Some(4000 - done));
    assert_eq!(f.db().count("SELECT count(*) FROM memory_items WHERE anonymized_at IS NULL").await, 0);
    assert_eq!(half_anonymized(f.db()).await, 0);
    assert_eq!(f.db().count("SELECT count(*) FROM audit_log WHERE event = 'memory.anonymize'").await, 4000);
}

/// Each tick schedules once, and a longer interval (smaller tick numbers) still schedules.
#[tokio::test]
async fn each_tick_schedules_once_whatever_the_interval_was_before() {
    let f = Fixture::start().await;
    retired_rows(&f).await;
    let store = f.db().store();
    let now = chrono::Utc::now().timestamp();
    let (every_minute, every_hour) = (now / 60, now / 3600);
    assert_eq!(store.schedule_retention(every_minute).await.expect("scheduled"), 1);
    assert_eq!(store.schedule_retention(every_minute).await.expect("once"), 0);
    assert_eq!(store.schedule_retention(every_hour).await.expect("after the interval grew"), 1);
}

#[tokio::test]
async fn an_invalid_tenant_policy_falls_back_to_the_defaults_with_a_warning() {
    let f = Fixture::start().await;
    retired_rows(&f).await;
    f.exec(
        "INSERT INTO tenant_config (tenant_id, settings)
         VALUES ('acme', '{\"memory_retention\": {\"soft_ttl_days\": \"soon\", \"superseded_ttl_days\": 7}}')",
    )
    .await;
    let report = f.runbook_json(&[], &["anonymize", "--tenant", "acme", "--dry-run", "--json"]).await;
    let warnings = report["warnings"].as_array().expect("warnings");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let warning = warnings[0].as_str().unwrap_or_default();
    assert!(warning.contains("\"acme\"") && warning.contains("soft_ttl_days"), "{warning}");
    assert_eq!(report["policy"]["soft_ttl_days"], 30, "the invalid field takes the default");
    assert_eq!(report["policy"]["superseded_ttl_days"], 7, "the valid one is kept");
    assert_eq!(report["due"], json!({ "soft_deleted": 1, "superseded": 2, "total": 3 }));
    // The human report shows the warning too.
    let text = f.runbook(&[], &["anonymize", "--tenant", "acme", "--dry-run"]).await;
    assert!(String::from_utf8_lossy(&text.stdout).contains("warning: tenant \"acme\": memory_retention.soft_ttl_days"));
}

/// `retention-policy` sets and removes a tenant's fields one by one, keeping its other settings,
/// audits each change, and refuses bad input changing nothing.
#[tokio::test]
async fn an_operator_sets_a_tenants_policy_field_by_field() {
    let f = Fixture::start().await;
    let f = &f;
    let policy = |extra: &'static [&'static str]| {
        let args = [&["retention-policy", "--tenant", "acme", "--json"][..], extra].concat();
        async move { f.runbook_json(&[(vars::ANONYMIZE_SUP_TTL_DAYS, "60")], &args).await }
    };
    let none = policy(&[]).await;
    assert_eq!((none["settings"].clone(), none["changed"].clone()), (Value::Null, json!(false)));
    assert_eq!(none["policy"]["superseded_ttl_days"], 60, "the shell's default");
    f.exec("INSERT INTO tenant_config (tenant_id, settings) VALUES ('acme', '{\"time_zone\": \"Asia/Tokyo\"}')").await;

    let set = policy(&["--soft-ttl-days", "10", "--dry-run", "true"]).await;
    assert_eq!(set["settings"], json!({ "soft_ttl_days": 10, "dry_run": true }));
    assert_eq!(
        set["policy"],
        json!({ "soft_ttl_days": 10, "superseded_ttl_days": 60, "batch_size": 100, "dry_run": true })
    );
    let set = policy(&["--superseded-ttl-days", "7", "--unset", "dry_run"]).await;
    assert_eq!(set["settings"], json!({ "soft_ttl_days": 10, "superseded_ttl_days": 7 }));
    let zone = "SELECT count(*) FROM tenant_config WHERE settings ->> 'time_zone' = 'Asia/Tokyo'";
    assert_eq!(f.db().count(zone).await, 1, "the tenant's other settings stay");

    // A stored field the sweep ignores is shown with its warning, and can be set right.
    f.exec("UPDATE tenant_config SET settings = jsonb_set(settings, '{memory_retention,batch_size}', '\"many\"')")
        .await;
    let warned = policy(&[]).await;
    assert!(warned["warnings"][0].as_str().is_some_and(|w| w.contains("memory_retention.batch_size")), "{warned}");
    let text = f.runbook(&[], &["retention-policy", "--tenant", "acme"]).await;
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("soft TTL 10 days, superseded TTL 7 days, batches of 100, dry run off"), "{text}");
    assert!(text.contains("warning: tenant \"acme\": memory_retention.batch_size"), "{text}");
    assert_eq!(policy(&["--batch-size", "500"]).await["policy"]["batch_size"], 500);

    let unchanged = policy(&["--unset", "dry_run", "--batch-size", "500"]).await;
    assert_eq!(unchanged["changed"], false, "{unchanged}");
    let audited = "SELECT count(*) FROM audit_log WHERE event = 'tenant.retention_policy' AND tenant_id = 'acme'";
    assert_eq!(f.db().count(audited).await, 3, "one row per change, none for a look or a change to the same");
    let last: Value = sqlx::query_scalar(
        "SELECT details FROM audit_log WHERE event = 'tenant.retention_policy' ORDER BY id DESC LIMIT 1",
    )
    .fetch_one(&f.db().pool)
    .await
    .expect("audit row");
    assert_eq!(last, json!({ "set": { "batch_size": 500 }, "unset": [] }));

    let before =
        f.db().count("SELECT count(*) FROM tenant_config WHERE settings::text LIKE '%\"batch_size\": 500%'").await;
    for (bad, said) in [
        (&["--soft-ttl-days", "40000"][..], "40000"),
        (&["--batch-size", "0"][..], "0"),
        (&["--dry-run", "maybe"][..], "maybe"),
        (&["--unset", "ttl"][..], "ttl"),
        (&["--soft-ttl-days", "3", "--unset", "soft_ttl_days"][..], "soft_ttl_days is both set and unset"),
    ] {
        let args = [&["retention-policy", "--tenant", "acme"][..], bad].concat();
        let refused = f.runbook(&[], &args).await;
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && stderr.contains(said), "{bad:?}: {stderr}");
    }
    assert_eq!(before, 1);
    assert_eq!(
        policy(&[]).await["settings"],
        json!({ "soft_ttl_days": 10, "superseded_ttl_days": 7, "batch_size": 500 })
    );
    assert_eq!(f.db().count(audited).await, 3, "refused: nothing audited");
    // Unsetting a field of a tenant that sets none changes nothing, and writes nothing.
    let nothing =
        f.runbook_json(&[], &["retention-policy", "--tenant", "globex", "--unset", "dry_run", "--json"]).await;
    assert_eq!(nothing["changed"], false, "{nothing}");
    assert_eq!(f.db().count("SELECT count(*) FROM tenant_config WHERE tenant_id = 'globex'").await, 0);
    assert_eq!(f.db().count("SELECT count(*) FROM audit_log WHERE tenant_id = 'globex'").await, 0);
    // A tenant that holds nothing yet may be a typo: said, not refused (a policy may come first).
    let typo = f.runbook(&[], &["retention-policy", "--tenant", "acmee", "--soft-ttl-days", "3"]).await;
    assert!(typo.status.success());
    assert!(String::from_utf8_lossy(&typo.stderr).contains("tenant acmee holds no memory"));
    let listed = f.runbook(&[], &["workspace", "ls", "--tenant", "acmee", "--agent", "helper"]).await;
    assert!(listed.status.success() && String::from_utf8_lossy(&listed.stdout).contains("(no files)"));
    assert!(String::from_utf8_lossy(&listed.stderr).contains("tenant acmee holds no memory"));
    // A permission for no row, or for a sweep that anonymizes nothing, is a mistake.
    for allow in [&["--allow-large-sweep", "0"][..], &["--allow-large-sweep", "5", "--dry-run"]] {
        let refused = f.runbook(&[], &[&["anonymize", "--tenant", "acme"][..], allow].concat()).await;
        assert!(!refused.status.success(), "{allow:?}");
    }
    assert_eq!(f.db().count("SELECT count(*) FROM audit_log WHERE event LIKE 'memory.anonymize%'").await, 0);
}

#[tokio::test]
async fn erasure_leaves_no_content_of_the_user_anywhere() {
    let f = Fixture::start().await;
    let erin = principal("acme", Some("erin"), Some("helper"), Some("s1"));
    let dan = principal("acme", Some("dan"), None, Some("s2"));
    // Her name as the message's participant, which anonymization clears with the content.
    let named = json!({ "source_kind": "chat_message", "source_ref": "e1", "name": "Erin", "content": "my cat is called Zephyrine" });
    f.write(&erin, "/v1/memories", named).await;
    // A system message naming her as its participant: the name goes too.
    let system = json!({ "source_kind": "chat_message", "source_ref": "e0", "role": "system", "name": "Erin", "content": "a member joined" });
    f.write(&erin, "/v1/memories", system).await;
    f.message(&erin, "e2", "Erin again: Zephyrine likes tuna").await;
    let payload = format!("Zephyrine vet records {}", "y".repeat(20_000));
    f.write(&erin, "/v1/memories", json!({ "source_kind": "tool_output", "source_ref": "e-call", "content": payload }))
        .await;
    f.fact(&erin, "my cat Zephyrine is nine").await;
    f.write(&erin, "/v1/facts", json!({ "scope": "agent", "content": "Erin's cat is Zephyrine" })).await;
    let dans = f.message(&dan, "d1", "Dan here: my dog is called Zephyrine too").await;
    // A summary of her session stamped with no user, as a compaction whose last message is the
    // assistant's writes it: it holds her words all the same.
    // Its source_ref, as compaction makes it, names the session and a hash of the text.
    let text = "Erin's cat Zephyrine is nine and likes tuna";
    let session = SessionId::parse("s1").expect("session");
    let summary_ref = mnemo_core::summary_source_ref(&session, None, Uuid::now_v7(), text);
    let summary = NewMemory::session_summary(
        TenantId::parse("acme").expect("tenant"),
        session,
        None,
        None,
        summary_ref.clone(),
        MemoryText::parse(text).expect("text"),
        chrono::Utc::now(),
    );
    f.db().store().remember(&summary).await.expect("a summary");
    embed_like_the_provider(&f.db().store(), MODEL, DIMS).await;
    let before = checksum(f.db()).await;

    let dry = f.runbook_json(&[], &["erase", "--tenant", "acme", "--user", "erin", "--dry-run", "--json"]).await;
    let kinds = json!({ "chat_message": 3, "fact": 2, "session_summary": 1, "tool_output": 1 });
    assert_eq!(dry["rows_by_kind"], kinds);
    assert_eq!((dry["tool_outputs"].as_u64(), dry["embeddings"].as_u64()), (Some(1), Some(7)));
    assert_eq!(checksum(f.db()).await, before, "a dry run changes nothing");

    let erased = f.runbook_json(&[], &["erase", "--tenant", "acme", "--user", "erin", "--json"]).await;
    assert_eq!(erased["anonymized"].as_u64(), Some(7));
    assert_eq!(erased["anonymized_by_kind"], kinds);

    let everywhere = |needle: &str| {
        format!(
            "SELECT (SELECT count(*) FROM memory_items m
                     WHERE m.id <> '{dans}' AND (m::text ILIKE '%{needle}%'))
                  + (SELECT count(*) FROM tool_outputs t WHERE t::text ILIKE '%{needle}%')
                  + (SELECT count(*) FROM audit_log a WHERE a::text ILIKE '%{needle}%')"
        )
    };
    assert_eq!(f.db().count(&everywhere("zephyrine")).await, 0, "content is gone from rows, full text, payloads");
    assert_eq!(f.db().count(&everywhere("erin")).await, 0, "and so is the user's id (the audit keeps a hash)");
    assert_eq!(
        f.db().count("SELECT count(*) FROM memory_items WHERE deleted_at IS NULL AND content = '[REDACTED]'").await,
        0
    );
    assert_eq!(
        f.db().count(&format!("SELECT count(*) FROM memory_embeddings WHERE item_id <> '{dans}'")).await,
        0,
        "no vector of the user is left"
    );
    assert_eq!(half_anonymized(f.db()).await, 0);
    let summary_refs = format!(
        "SELECT count(*) FROM memory_items WHERE source_kind = 'session_summary'
           AND (source_ref LIKE '%:s1:%' OR source_ref LIKE '{}%')",
        summary_ref.as_str()
    );
    assert_eq!(f.db().count(&summary_refs).await, 0, "the summary's ref named her session and hashed her words");
    assert_eq!(f.recalled(&dan, "Zephyrine").await, ["Dan here: my dog is called Zephyrine too"]);
    assert!(f.recalled(&erin, "Zephyrine").await.is_empty());
    let erase_row: String =
        sqlx::query_scalar("SELECT details ->> 'user_sha256' FROM audit_log WHERE event = 'memory.erase'")
            .fetch_one(&f.db().pool)
            .await
            .expect("one erase row");
    assert_eq!(erase_row.len(), 64);
    assert_eq!(
        f.db().count("SELECT count(*) FROM audit_log WHERE event = 'memory.anonymize' AND reason = 'erasure'").await,
        7
    );

    let again = f.runbook_json(&[], &["erase", "--tenant", "acme", "--user", "erin", "--json"]).await;
    assert_eq!(again["anonymized"].as_u64(), Some(0), "erasing twice finds nothing");
    assert!(again["already_erased_at"].is_string(), "{again}");
    // The same keys as an erasure that found something.
    let keys = |v: &serde_json::Value| v.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>());
    assert_eq!(keys(&again), keys(&erased), "{again} against {erased}");
    // A dry run, the operator's check, says what the run would.
    let dry = ["erase", "--tenant", "acme", "--user", "erin", "--dry-run", "--json"];
    assert!(f.runbook_json(&[], &dry).await["already_erased_at"].is_string());
    let typo = f.runbook(&[], &["erase", "--tenant", "acme", "--user", "ernie", "--dry-run"]).await;
    assert!(!typo.status.success() && String::from_utf8_lossy(&typo.stderr).contains("check the id"));

    // A user nothing carries and who was never erased (a mistyped id): refused, nothing audited,
    // unless forced.
    let erasures = "SELECT count(*) FROM audit_log WHERE event = 'memory.erase'";
    let typo = f.runbook(&[], &["erase", "--tenant", "acme", "--user", "ernie"]).await;
    assert!(!typo.status.success());
    assert!(String::from_utf8_lossy(&typo.stderr).contains("check the id"));
    assert_eq!(f.db().count(erasures).await, 1);
    f.runbook_json(&[], &["erase", "--tenant", "acme", "--user", "ernie", "--force", "--json"]).await;
    assert_eq!(f.db().count(erasures).await, 2);

    // A user whose rows are all gone already, named in clear only by their extraction state
    // and a sighting: not a mistyped id; the erasure takes what is left.
    f.exec(
        "INSERT INTO memory_extractions (tenant_id, session_id, through_id, through_time, agent_id, user_id, trigger_source)
         VALUES ('acme', 's7', gen_random_uuid(), now(), 'helper', 'greta', 'web')",
    )
    .await;
    f.exec(
        "INSERT INTO memory_sightings (tenant_id, item_id, session_id, user_id)
         SELECT tenant_id, id, 's7', 'greta' FROM memory_items WHERE tenant_id = 'acme' LIMIT 1",
    )
    .await;
    let greta = f.runbook_json(&[], &["erase", "--tenant", "acme", "--user", "greta", "--json"]).await;
    assert_eq!(greta["other_records"].as_u64(), Some(2), "{greta}");
    assert_eq!(f.db().count(erasures).await, 3);
    let left = "SELECT (SELECT count(*) FROM memory_extractions WHERE user_id = 'greta')
                     + (SELECT count(*) FROM memory_sightings WHERE user_id = 'greta')";
    assert_eq!(f.db().count(left).await, 0);
}

/// An erasure cut off after its last row and before its `memory.erase` row (the connection
/// lost, the process killed) is finished by running it again: nothing carries the user any
/// more, and the re-run must not take them for a mistyped id.
#[tokio::test]
async fn an_erasure_cut_off_before_its_audit_row_is_finished_by_running_it_again() {
    let f = Fixture::start().await;
    let erin = principal("acme", Some("erin"), None, Some("s1"));
    f.message(&erin, "e1", "my cat is called Zephyrine").await;
    f.fact(&erin, "my cat Zephyrine is nine").await;
    f.exec(
        "CREATE FUNCTION refuse_erase() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'the connection is lost'; END $$;
         CREATE TRIGGER refuse_erase BEFORE INSERT ON audit_log
         FOR EACH ROW WHEN (NEW.event = 'memory.erase') EXECUTE FUNCTION refuse_erase();",
    )
    .await;
    let cut = f.runbook(&[], &["erase", "--tenant", "acme", "--user", "erin"]).await;
    assert!(!cut.status.success(), "the erasure failed at its audit row");
    let carried = "SELECT count(*) FROM memory_items WHERE user_id = 'erin'";
    assert_eq!(f.db().count(carried).await, 0, "every row was erased before the audit row");
    f.exec("DROP TRIGGER refuse_erase ON audit_log").await;

    let again = f.runbook(&[], &["erase", "--tenant", "acme", "--user", "erin", "--json"]).await;
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert!(String::from_utf8_lossy(&again.stderr).contains("did not finish: finishing it"));
    let erased =
        "SELECT count(*) FROM audit_log WHERE event = 'memory.erase' AND details ->> 'user_sha256' IS NOT NULL";
    assert_eq!(f.db().count(erased).await, 1, "the re-run recorded the erasure");
    // Finished now: a third run says when, and records nothing more.
    let third = f.runbook_json(&[], &["erase", "--tenant", "acme", "--user", "erin", "--json"]).await;
    assert!(third["already_erased_at"].is_string(), "{third}");
    assert_eq!(f.db().count("SELECT count(*) FROM audit_log WHERE event LIKE 'memory.erase%'").await, 3);
}

/// A file of the user written while their rows are erased (an extraction that read their
/// messages just before the row pass took them) goes too: the erasure ends only when a pass
/// over the files after the rows finds none.
#[tokio::test]
async fn a_file_written_while_the_rows_are_erased_is_erased_too() {
    let f = Fixture::start().await;
    let erin = principal("acme", Some("erin"), Some("helper"), Some("s1"));
    f.message(&erin, "e1", "my cat is called Zephyrine").await;
    // The file lands in the row pass's own transaction, once.
    f.exec(
        "CREATE TABLE landed (once boolean PRIMARY KEY);
         CREATE FUNCTION land_file() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           INSERT INTO landed VALUES (true) ON CONFLICT DO NOTHING;
           IF FOUND THEN
             INSERT INTO workspace_files (tenant_id, agent_id, user_id, path, id, content, size_bytes, enabled, sort_order, version)
             VALUES ('acme', 'helper', 'erin', 'memory/2026-11-27.md', gen_random_uuid(), 'Zephyrine', 9, true, 100, 1);
           END IF;
           RETURN NEW;
         END $$;
         CREATE TRIGGER land_file AFTER INSERT ON audit_log
         FOR EACH ROW WHEN (NEW.event = 'memory.anonymize') EXECUTE FUNCTION land_file();",
    )
    .await;
    f.runbook_json(&[], &["erase", "--tenant", "acme", "--user", "erin", "--json"]).await;
    assert_eq!(f.db().count("SELECT count(*) FROM landed").await, 1, "the file landed during the row pass");
    assert_eq!(f.db().count("SELECT count(*) FROM workspace_files WHERE user_id = 'erin'").await, 0);
}

#[tokio::test]
async fn the_worker_sweeps_each_tenant_once_per_tick_and_counts_refusals() {
    let f = Fixture::start().await;
    bulk_rows(&f, "acme", 20, 3).await;
    bulk_rows(&f, "globex", 20, 15).await;
    let mut env = f.provider.env(MODEL);
    env.extend([
        (vars::WORKER_QUEUES, "retention=2".to_owned()),
        (vars::HOUSEKEEPING_INTERVAL_S, "1".to_owned()),
        (vars::ANONYMIZE_INTERVAL_S, "2".to_owned()),
        (vars::ANONYMIZE_FLOOR_ROWS, "10".to_owned()),
    ]);
    let worker = WorkerProcess::start(&f.db().url, &env).await.expect("worker");
    let swept = wait_until(Duration::from_secs(30), || async {
        f.db().count("SELECT count(*) FROM memory_items WHERE tenant_id = 'acme' AND anonymized_at IS NOT NULL").await
            == 3
    })
    .await;
    assert!(swept, "the worker anonymized acme's due rows");
    assert!(
        wait_until(Duration::from_secs(30), || async { worker.metric("mnemo_anonymize_refused_total").await >= 1.0 })
            .await,
        "globex's sweep (15 of 20 rows) was refused and counted"
    );
    // A few ticks later: globex still untouched, one sweep row per tenant and tick.
    tokio::time::sleep(Duration::from_secs(3)).await;
    worker.terminate().await.expect("clean stop");
    assert_eq!(
        f.db()
            .count("SELECT count(*) FROM memory_items WHERE tenant_id = 'globex' AND anonymized_at IS NOT NULL")
            .await,
        0
    );
    assert!(
        f.db()
            .count("SELECT count(*) FROM audit_log WHERE tenant_id = 'globex' AND event = 'memory.anonymize.refused'")
            .await
            >= 1
    );
    assert_eq!(half_anonymized(f.db()).await, 0);
    let results: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT tenant_id, result FROM retention_sweeps WHERE finished_at IS NOT NULL ORDER BY tick, tenant_id",
    )
    .fetch_all(&f.db().pool)
    .await
    .expect("sweeps");
    assert!(results.contains(&("acme".to_owned(), Some("done".to_owned()))), "{results:?}");
    assert!(results.contains(&("globex".to_owned(), Some("refused".to_owned()))), "{results:?}");
}

/// A job whose store fails is not lost and not burnt through apalis' immediate retries: the
/// worker queues it again after a backoff, as often as it takes, and it finishes once the
/// database accepts it again.
#[tokio::test]
async fn a_sweep_that_cannot_be_recorded_runs_again_later_and_finishes() {
    let f = Fixture::start().await;
    bulk_rows(&f, "acme", 20, 3).await;
    // Finishing a sweep fails until the trigger goes.
    f.exec(
        "CREATE FUNCTION refuse_finish() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'sweeps cannot finish now'; END $$;
         CREATE TRIGGER refuse_finish BEFORE UPDATE ON retention_sweeps
         FOR EACH ROW WHEN (NEW.finished_at IS NOT NULL) EXECUTE FUNCTION refuse_finish();",
    )
    .await;
    let mut env = f.provider.env(MODEL);
    env.extend([
        (vars::WORKER_QUEUES, "retention=1".to_owned()),
        (vars::HOUSEKEEPING_INTERVAL_S, "1".to_owned()),
        (vars::ANONYMIZE_INTERVAL_S, "3600".to_owned()),
    ]);
    let worker = WorkerProcess::start(&f.db().url, &env).await.expect("worker");
    // Each retry is a new job, due after a backoff; the failed one is done (apalis' own
    // immediate retries of one job would burn its attempts in milliseconds).
    let retried = wait_until(Duration::from_secs(30), || async {
        f.db().count("SELECT count(*) FROM apalis.jobs WHERE job_type = 'retention'").await >= 3
    })
    .await;
    assert!(retried, "the failing sweep was queued again as new jobs");
    assert!(worker.metric("mnemo_job_retries_total").await >= 2.0);
    assert_eq!(
        f.db().count("SELECT max(attempts)::bigint FROM apalis.jobs WHERE job_type = 'retention'").await,
        1,
        "no job was retried in place"
    );
    assert_eq!(f.db().count("SELECT count(*) FROM retention_sweeps WHERE finished_at IS NOT NULL").await, 0);

    f.exec("DROP TRIGGER refuse_finish ON retention_sweeps").await;
    let finished = wait_until(Duration::from_secs(30), || async {
        f.db().count("SELECT count(*) FROM retention_sweeps WHERE result = 'done'").await == 1
    })
    .await;
    worker.terminate().await.expect("clean stop");
    assert!(finished, "the retried sweep finished once the database accepted it");
    assert_eq!(
        f.db().count("SELECT count(*) FROM memory_items WHERE tenant_id = 'acme' AND anonymized_at IS NOT NULL").await,
        3
    );
    assert_eq!(half_anonymized(f.db()).await, 0);
}

#[tokio::test]
async fn replaced_and_deleted_workspace_texts_are_redacted_after_the_soft_ttl() {
    let f = Fixture::start().await;
    let ann = principal("acme", Some("ann"), Some("helper"), None);
    let put = |path: &'static str, content: &'static str| {
        let f = &f;
        let t = token(&ann);
        async move {
            let reply = f
                .app
                .client
                .put(&format!("/v1/workspace/files/{path}"), Some(&t), &json!({ "content": content }))
                .await;
            assert!(reply.status == 200 || reply.status == 201, "{path}: {:?}", reply.body);
        }
    };
    put("MEMORY.md", "Ann keeps a quokka").await;
    put("MEMORY.md", "Ann keeps a wombat").await;
    put("memory/2026-01-01.md", "Ann saw a platypus").await;
    let deleted = f.app.client.delete("/v1/workspace/files/memory/2026-01-01.md", Some(&token(&ann))).await;
    assert_eq!(deleted.status, 200, "{:?}", deleted.body);
    // Forty days pass (the soft TTL is 30); then the wombat is replaced today.
    f.exec(
        "UPDATE workspace_file_versions SET created_at = created_at - interval '40 days';
            UPDATE workspace_files SET deleted_at = deleted_at - interval '40 days' WHERE deleted_at IS NOT NULL",
    )
    .await;
    put("MEMORY.md", "Ann keeps a numbat").await;
    let holding = |word: &str| {
        format!(
            "SELECT (SELECT count(*) FROM workspace_file_versions WHERE content LIKE '%{word}%')
                  + (SELECT count(*) FROM workspace_files WHERE content LIKE '%{word}%')"
        )
    };

    // Due: MEMORY.md's quokka version, and the note's two (written, deleted).
    let dry = f.runbook_json(&[], &["anonymize", "--tenant", "acme", "--dry-run", "--json"]).await;
    assert_eq!(dry["workspace_versions_due"], 3, "{dry}");
    assert_eq!(f.db().count("SELECT count(*) FROM workspace_file_versions WHERE redacted_at IS NOT NULL").await, 0);
    assert_eq!(f.db().count(&holding("platypus")).await, 3, "the dry run changed a file");

    // The safety floor holds the versions on their own count: 3 of the tenant's 8, past a floor
    // of 1, is refused and changes nothing, until an operator allows as many.
    let floor = [(vars::ANONYMIZE_FLOOR_ROWS, "1")];
    let refused = f.runbook(&floor, &["anonymize", "--tenant", "acme"]).await;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("redact 3 of its 8"), "{stderr}");
    assert!(stderr.contains("--allow-large-sweep 3"), "{stderr}");
    assert_eq!(f.db().count(&holding("platypus")).await, 3, "the refused sweep changed a file");
    let short = f.runbook(&floor, &["anonymize", "--tenant", "acme", "--allow-large-sweep", "2"]).await;
    assert!(!short.status.success());
    assert_eq!(f.db().count(&holding("platypus")).await, 3);

    let allow = ["anonymize", "--tenant", "acme", "--allow-large-sweep", "3", "--json"];
    let swept = f.runbook_json(&floor, &allow).await;
    assert_eq!((swept["outcome"].as_str(), swept["workspace_versions_redacted"].as_u64()), (Some("done"), Some(3)));
    assert_eq!(f.db().count(&holding("quokka")).await, 0, "a version replaced 40 days ago kept its text");
    assert_eq!(f.db().count(&holding("platypus")).await, 0, "a file deleted 40 days ago kept its text");
    // Replaced today, and current: kept.
    assert_eq!(f.db().count(&holding("wombat")).await, 1);
    assert_eq!(f.db().count(&holding("numbat")).await, 2);
    // The history stays, saying what was redacted; the audit rows hold no text.
    let args = ["workspace", "history", "--tenant", "acme", "--agent", "helper", "--user", "ann"];
    let history = f.runbook_json(&[], &[&args[..], &["--path", "MEMORY.md", "--json"]].concat()).await;
    let redacted: Vec<bool> =
        history["versions"].as_array().expect("versions").iter().map(|v| !v["redacted_at"].is_null()).collect();
    assert_eq!(redacted, [true, false, false], "{history}");
    let audited =
        f.db().count("SELECT count(*) FROM audit_log WHERE event = 'workspace.change' AND reason = 'redacted'").await;
    assert_eq!(audited, 2);
    assert_eq!(f.db().count("SELECT count(*) FROM audit_log WHERE details::text ~ 'quokka|platypus'").await, 0);

    // A redacted version cannot be read or restored; nothing changes.
    let mut cat = args.to_vec();
    cat[1] = "cat";
    let read = f.runbook(&[], &[&cat[..], &["--path", "MEMORY.md", "--version", "1"]].concat()).await;
    assert!(!read.status.success() && String::from_utf8_lossy(&read.stderr).contains("redacted"), "{read:?}");
    let mut restore = args.to_vec();
    restore[1] = "restore";
    let restored = f.runbook(&[], &[&restore[..], &["--path", "MEMORY.md", "--version", "1"]].concat()).await;
    assert!(!restored.status.success() && String::from_utf8_lossy(&restored.stderr).contains("redacted"));
    assert_eq!(f.db().count("SELECT max(version)::int8 FROM workspace_files WHERE path = 'MEMORY.md'").await, 3);

    // Nothing is due again.
    let again = f.runbook_json(&[], &["anonymize", "--tenant", "acme", "--json"]).await;
    assert_eq!(
        (again["workspace_versions_due"].as_u64(), again["workspace_versions_redacted"].as_u64()),
        (Some(0), Some(0))
    );

    // A file stored under older path rules, which no longer parses, is redacted all the same.
    f.exec(
        "INSERT INTO workspace_files (tenant_id, agent_id, user_id, path, id, content, size_bytes, enabled, sort_order, version)
         VALUES ('acme', 'helper', 'ann', 'notes.txt', gen_random_uuid(), 'kiwi', 4, false, 100, 2);
         INSERT INTO workspace_file_versions (tenant_id, agent_id, user_id, path, version, content, enabled, sort_order, deleted, actor, created_at)
         VALUES ('acme', 'helper', 'ann', 'notes.txt', 1, 'an old kiwi', false, 100, false, 'api', now() - interval '40 days'),
                ('acme', 'helper', 'ann', 'notes.txt', 2, 'kiwi', false, 100, false, 'api', now() - interval '40 days')",
    )
    .await;
    let legacy = f.runbook_json(&[], &["anonymize", "--tenant", "acme", "--json"]).await;
    assert_eq!(legacy["workspace_versions_redacted"].as_u64(), Some(1), "{legacy}");
    assert_eq!(f.db().count(&holding("old kiwi")).await, 0);

    // A tenant whose only retired text is an agent file's earlier version is swept too.
    let operator = token(&principal("globex", None, Some("helper"), None));
    for content in ["Be brief.", "Be kind."] {
        let reply =
            f.app.client.put("/v1/workspace/files/AGENTS.md", Some(&operator), &json!({ "content": content })).await;
        assert!(reply.status == 200 || reply.status == 201, "{:?}", reply.body);
    }
    assert_eq!(f.db().count("SELECT count(*) FROM memory_items WHERE tenant_id = 'globex'").await, 0);
    let tick = chrono::Utc::now().timestamp() / 60;
    f.db().store().schedule_retention(tick).await.expect("scheduled");
    assert_eq!(f.db().count("SELECT count(*) FROM retention_sweeps WHERE tenant_id = 'globex'").await, 1);
}

/// `--allow-large-sweep N` redacts at most N workspace versions, the oldest first, within one
/// file too; a deleted file's own copy of its text goes with its last version.
#[tokio::test]
async fn a_sweep_redacts_no_more_versions_than_allowed_even_within_one_file() {
    let f = Fixture::start().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    let note = "/v1/workspace/files/memory/2026-01-01.md";
    for content in ["Ann saw a platypus", "Ann saw an echidna", "Ann saw a dingo"] {
        let reply = f.app.client.put(note, Some(&t), &json!({ "content": content })).await;
        assert!(reply.status == 200 || reply.status == 201, "{:?}", reply.body);
    }
    assert_eq!(f.app.client.delete(note, Some(&t)).await.status, 200);
    f.exec(
        "UPDATE workspace_file_versions SET created_at = created_at - interval '40 days';
            UPDATE workspace_files SET deleted_at = deleted_at - interval '40 days' WHERE deleted_at IS NOT NULL",
    )
    .await;
    let due = f.runbook_json(&[], &["anonymize", "--tenant", "acme", "--dry-run", "--json"]).await;
    let due = due["workspace_versions_due"].as_u64().expect("versions due");
    assert!(due >= 3, "{due}");

    let allowed = f.runbook_json(&[], &["anonymize", "--tenant", "acme", "--allow-large-sweep", "2", "--json"]).await;
    assert_eq!(allowed["workspace_versions_redacted"].as_u64(), Some(2), "{allowed}");
    let redacted = "SELECT count(*) FROM workspace_file_versions WHERE redacted_at IS NOT NULL";
    assert_eq!(f.db().count(redacted).await, 2);
    assert_eq!(f.db().count(&format!("{redacted} AND version <= 2")).await, 2, "the oldest first");
    assert_eq!(f.db().count("SELECT count(*) FROM workspace_files WHERE content LIKE '%dingo%'").await, 1);

    let rest = f.runbook_json(&[], &["anonymize", "--tenant", "acme", "--json"]).await;
    assert_eq!(rest["workspace_versions_redacted"].as_u64(), Some(due - 2), "{rest}");
    let texts = "SELECT (SELECT count(*) FROM workspace_file_versions WHERE content LIKE 'Ann saw%')
                      + (SELECT count(*) FROM workspace_files WHERE content LIKE 'Ann saw%')";
    assert_eq!(f.db().count(texts).await, 0);
}
