//! Consolidation of daily notes into MEMORY.md against a real PostgreSQL and the scripted chat
//! server: the watermark, the day range, the budget, failures that change nothing, one run at a
//! time, throttled requests from extraction, and the endpoint.

use std::sync::Arc;
use std::time::Duration;

use mnemo_config::{ContextSettings, Env, TokenizerName, WorkspaceSettings, vars};
use mnemo_core::{AgentId, TenantId, UserId, Workspace};
use mnemo_jobs::{ConsolidateReport, ConsolidateRunner, MAX_NOTES_CHARS};
use mnemo_store::ConsolidationRequest;
use mnemo_store::queue::ConsolidateJob;
use mnemo_testkit::{ChatAnswer, ScriptedChat, TestApp, principal, token};
use serde_json::json;

fn runner(app: &TestApp, chat: &ScriptedChat, extra: &[(&'static str, &str)]) -> ConsolidateRunner {
    chat.expect_key("test");
    let mut pairs = vec![
        (vars::LLM_MODEL, "scripted".to_owned()),
        (vars::LLM_BASE_URL, chat.base_url.clone()),
        (vars::LLM_API_KEY, "test".to_owned()),
    ];
    pairs.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
    let env = Env::from_pairs(pairs);
    ConsolidateRunner {
        store: app.db.store(),
        consolidator: mnemo_models::consolidator(&ContextSettings::from_env(&env).expect("context")).expect("model"),
        counter: Arc::new(mnemo_models::Tokenizer::new(TokenizerName::O200kBase)),
        worker: format!("test-{}", uuid::Uuid::new_v4().simple()),
        settings: WorkspaceSettings::from_env(&env).expect("workspace").consolidation,
        stale_after: Duration::from_secs(60),
    }
}

fn job() -> ConsolidateJob {
    ConsolidateJob {
        tenant_id: TenantId::parse("acme").expect("tenant"),
        agent_id: AgentId::parse("helper").expect("agent"),
        user_id: UserId::parse("ann").expect("user"),
    }
}

/// The workspace `job()` consolidates.
fn workspace() -> Workspace {
    Workspace {
        tenant: TenantId::parse("acme").expect("tenant"),
        agent: AgentId::parse("helper").expect("agent"),
        user: Some(UserId::parse("ann").expect("user")),
    }
}

fn day(days_ago: u64) -> String {
    (chrono::Utc::now().date_naive() - chrono::Days::new(days_ago)).format("%Y-%m-%d").to_string()
}

async fn note(app: &TestApp, t: &str, days_ago: u64, text: &str) {
    let path = format!("/v1/workspace/files/memory/{}.md", day(days_ago));
    let reply = app.client.put(&path, Some(t), &json!({ "content": text })).await;
    assert!(reply.status < 300, "{:?}", reply.body);
}

/// The budget a consolidation's system prompt tells, in characters.
fn told(system: &str) -> Option<usize> {
    system.split("under ").nth(1)?.split(' ').next()?.parse().ok()
}

async fn memory(app: &TestApp, t: &str) -> String {
    let reply = app.client.get("/v1/workspace/files/MEMORY.md", Some(t)).await;
    reply.body["content"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn the_watermark_and_day_range_decide_what_is_read_and_memory_changes_only_on_success() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    note(&app, &t, 0, "- booked Lisbon").await;
    note(&app, &t, 1, "- compared trains").await;
    note(&app, &t, 7, "- a week ago").await;
    note(&app, &t, 20, "- long ago").await;
    let runner = runner(&app, &chat, &[(vars::CONSOLIDATE_MAX_MEMORY_TOKENS, "200")]);

    // Over budget: nothing changes, and the notes are read again next time.
    let before = memory(&app, &t).await;
    chat.then([ChatAnswer::Content(
        json!({ "should_update": true, "reason": "r", "memory_content": "word ".repeat(1000) }).to_string(),
    )]);
    assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::Failed { reason: "over_budget".into() });
    chat.then([ChatAnswer::Malformed]);
    assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::Failed { reason: "unparsable".into() });
    // Within the token budget but past the file limit: no edit of it could then be saved.
    let small_files = self::runner(
        &app,
        &chat,
        &[(vars::CONSOLIDATE_MAX_MEMORY_TOKENS, "200"), (vars::WORKSPACE_MAX_FILE_BYTES, "1024")],
    );
    chat.then([ChatAnswer::Content(
        json!({ "should_update": true, "reason": "r", "memory_content": "=".repeat(1100) }).to_string(),
    )]);
    assert_eq!(small_files.run(&job()).await.expect("run"), ConsolidateReport::Failed { reason: "too_large".into() });
    assert_eq!(memory(&app, &t).await, before);

    assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::Updated { notes: 2 });
    assert_eq!(memory(&app, &t).await, format!("# MEMORY.md\n\n- consolidated {}, {}\n", day(1), day(0)));
    let prompt =
        chat.requests().last().expect("a request")["messages"][1]["content"].as_str().expect("prompt").to_owned();
    // 7 days are today and the 6 before it.
    assert!(prompt.contains("- booked Lisbon") && !prompt.contains("ago"), "{prompt}");
    let system = chat.requests()[0]["messages"][0]["content"].as_str().unwrap_or_default().to_owned();
    assert!(told(&system).is_some_and(|n| (700..=800).contains(&n)), "about four characters a token: {system}");

    // Nothing new since the watermark, nor in a note enabled for prompts (its text unchanged);
    // then one changed note is read alone.
    assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::NothingNew);
    let enable = format!("/v1/workspace/files/memory/{}.md", day(1));
    assert_eq!(app.client.patch(&enable, Some(&t), &json!({ "enabled": true })).await.status, 200);
    assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::NothingNew);
    note(&app, &t, 0, "- booked Lisbon\n- packed").await;
    assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::Updated { notes: 1 });
    // A model that keeps MEMORY.md as it is still moves the watermark.
    note(&app, &t, 1, "- compared trains again").await;
    chat.then([ChatAnswer::Content(json!({ "should_update": false, "reason": "nothing new" }).to_string())]);
    assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::Kept { notes: 1 });
    assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::NothingNew);
    let actors = app.db.count("SELECT count(*) FROM workspace_file_versions WHERE actor = 'consolidation'").await;
    assert_eq!(actors, 2);

    // Switched off: a new note is not read, the model is not asked, MEMORY.md stays.
    note(&app, &t, 0, "- booked Lisbon\n- packed\n- left").await;
    let (asked, kept) = (chat.requests().len(), memory(&app, &t).await);
    let off = self::runner(&app, &chat, &[(vars::CONSOLIDATE_ENABLED, "false")]);
    assert_eq!(off.run(&job()).await.expect("run"), ConsolidateReport::Disabled);
    assert_eq!((chat.requests().len(), memory(&app, &t).await), (asked, kept));
    assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::Updated { notes: 1 }, "the note waited");
    // Nor is one asked for by hand.
    let switched_off = TestApp::spawn_with(&[(vars::CONSOLIDATE_ENABLED, "false")]).await;
    let reply = switched_off.client.post("/v1/agents/helper/consolidate", Some(&t), &json!({})).await;
    assert_eq!((reply.status, reply.body.clone()), (202, json!({ "queued": false, "skipped": "disabled" })));
    assert_eq!(switched_off.db.count("SELECT count(*) FROM apalis.jobs WHERE job_type = 'consolidate'").await, 0);
}

/// The budget is told in the characters its tokens hold in the text at hand: about four in
/// English, fewer in Japanese, where four a token would ask for an answer the check refuses.
#[tokio::test]
async fn the_budget_is_told_in_the_characters_its_tokens_hold() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    let told = |chat: &ScriptedChat| {
        let system = chat.requests().last().expect("a request")["messages"][0]["content"].clone();
        self::told(system.as_str().expect("system")).expect("a budget")
    };
    let runner = runner(&app, &chat, &[(vars::CONSOLIDATE_MAX_MEMORY_TOKENS, "1000")]);
    note(&app, &t, 0, "- booked the early train to Lisbon and a hotel near the river").await;
    runner.run(&job()).await.expect("run");
    let english = told(&chat);
    assert!((3600..=4000).contains(&english), "English: about four characters a token: {english}");
    note(&app, &t, 0, "- リスボン行きの早朝の列車と川の近くのホテルを予約した。母は来月東京に来る。").await;
    runner.run(&job()).await.expect("run");
    let japanese = told(&chat);
    assert!((1000..3000).contains(&japanese), "Japanese: fewer characters a token: {japanese}");
    // The model may still answer up to the budget's tokens and the JSON around them.
    assert_eq!(chat.requests().last().expect("a request")["max_tokens"], 1000 * 4 / 3 + 200);
}

/// Notes longer than one prompt should hold: a run shows the oldest that fit, records only
/// those as read, and asks for the run that shows the rest.
#[tokio::test]
async fn notes_past_what_one_run_shows_wait_for_the_next_run() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    let long = |marker: &str| format!("- {marker}\n{}", "a day of notes. ".repeat(MAX_NOTES_CHARS / 16 / 2));
    for (days_ago, marker) in [(2, "alpha"), (1, "beta"), (0, "gamma")] {
        note(&app, &t, days_ago, &long(marker)).await;
    }
    let runner = runner(&app, &chat, &[]);
    assert_eq!(runner.run(&job()).await.expect("first"), ConsolidateReport::Updated { notes: 1 });
    assert_eq!(runner.run(&job()).await.expect("second"), ConsolidateReport::Updated { notes: 1 });
    assert_eq!(runner.run(&job()).await.expect("third"), ConsolidateReport::Updated { notes: 1 });
    assert_eq!(runner.run(&job()).await.expect("done"), ConsolidateReport::NothingNew);
    let shown: Vec<Vec<&str>> = chat
        .requests()
        .iter()
        .map(|r| {
            let prompt = r["messages"][1]["content"].as_str().unwrap_or_default();
            ["alpha", "beta", "gamma"].into_iter().filter(|m| prompt.contains(&format!("- {m}"))).collect()
        })
        .collect();
    assert_eq!(shown, [vec!["alpha"], vec!["beta"], vec!["gamma"]]);
    // Each run that left notes out asked for the next.
    assert_eq!(app.db.count("SELECT count(*) FROM apalis.jobs WHERE job_type = 'consolidate'").await, 2);
}

/// A worker whose run was taken over (held past the stale limit) changes nothing when its
/// model call returns; the worker holding the run does.
#[tokio::test]
async fn a_run_taken_over_changes_nothing() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    note(&app, &t, 0, "- booked Lisbon").await;
    chat.delay_every_answer(Duration::from_millis(600));
    let slow = runner(&app, &chat, &[]);
    let eager = ConsolidateRunner { stale_after: Duration::ZERO, ..runner(&app, &chat, &[]) };
    let later = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        eager.run(&job()).await
    };
    let once = job();
    let (lost, kept) = tokio::join!(slow.run(&once), later);
    let lost = lost.expect_err("the run was taken over");
    assert!(
        matches!(&lost, mnemo_jobs::JobError::Store(e) if matches!(**e, mnemo_store::StoreError::RunLost)),
        "{lost:?}"
    );
    assert_eq!(kept.expect("kept"), ConsolidateReport::Updated { notes: 1 });
    let versions = app.db.count("SELECT count(*) FROM workspace_file_versions WHERE actor = 'consolidation'").await;
    assert_eq!(versions, 1);
}

/// A run the user's erasure cuts short (their notes and the run's state deleted under it) ends
/// without an error, which the worker would answer with a retry naming the erased user.
#[tokio::test]
async fn a_run_the_users_erasure_cuts_short_leaves_nothing_naming_them() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    note(&app, &t, 0, "- booked Lisbon").await;
    chat.delay_every_answer(Duration::from_millis(600));
    let runner = runner(&app, &chat, &[]);
    let store = app.db.store();
    let (tenant, user) = (TenantId::parse("acme").expect("tenant"), UserId::parse("ann").expect("user"));
    let erase = async {
        assert!(mnemo_testkit::wait_until(Duration::from_secs(5), || async { chat.requests().len() == 1 }).await);
        mnemo_jobs::erase_user(&store, &tenant, &user, 100, false, "runbook", |_, _| {}).await.expect("erase");
    };
    let once = job();
    let jobs = "SELECT count(*) FROM apalis.jobs WHERE convert_from(job, 'UTF8') LIKE '%\"ann\"%'";
    let queued = app.db.count(jobs).await;
    store.retry_after(&once, Duration::from_secs(3600)).await.expect("retry");
    assert_eq!(app.db.count(jobs).await, queued + 1, "a user with a note is retried");
    let (run, ()) = tokio::join!(runner.run(&once), erase);
    assert_eq!(run.expect("an error would be retried"), ConsolidateReport::NothingNew);
    let naming = "SELECT (SELECT count(*) FROM consolidation_state WHERE user_id = 'ann')
                       + (SELECT count(*) FROM apalis.jobs WHERE convert_from(job, 'UTF8') LIKE '%\"ann\"%')";
    assert_eq!(app.db.count(naming).await, 0);
    assert_eq!(runner.run(&job()).await.expect("again"), ConsolidateReport::NothingNew);
    // The worker's retry after an error, queued once the erasure committed.
    store.retry_failed(&once, Duration::from_secs(1), 1).await.expect("retry");
    assert_eq!(app.db.count(naming).await, 0);
}

#[tokio::test]
async fn one_run_at_a_time_requests_are_throttled_and_the_endpoint_checks_the_agent() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    note(&app, &t, 0, "- booked Lisbon").await;
    let (a, b) = (runner(&app, &chat, &[]), runner(&app, &chat, &[]));
    chat.delay_every_answer(Duration::from_millis(300));
    let once = job();
    let (ra, rb) = tokio::join!(a.run(&once), b.run(&once));
    let reports = [ra.expect("a"), rb.expect("b")];
    assert!(reports.contains(&ConsolidateReport::Updated { notes: 1 }), "{reports:?}");
    assert!(reports.contains(&ConsolidateReport::Held), "{reports:?}");

    let workspace = workspace();
    let store = app.db.store();
    let throttle = Some(Duration::from_secs(1800));
    assert_eq!(store.request_consolidation(&workspace, throttle).await.expect("first"), ConsolidationRequest::Queued);
    let throttled = store.request_consolidation(&workspace, throttle).await.expect("throttled");
    assert_eq!(throttled, ConsolidationRequest::Waiting);
    // By hand: not throttled, but not queued twice while a request waits for its run.
    let by_hand = async || {
        let reply = app.client.post("/v1/agents/helper/consolidate", Some(&t), &json!({})).await;
        assert_eq!(reply.status, 202, "{:?}", reply.body);
        reply.body["queued"].as_bool().expect("queued")
    };
    assert!(!by_hand().await, "the extraction's request still waits");
    assert_eq!(a.run(&once).await.expect("run"), ConsolidateReport::NothingNew);
    assert!(by_hand().await, "its run has come");
    assert!(!by_hand().await, "and this one waits");
    note(&app, &t, 0, "- booked Lisbon\n- packed").await;
    chat.delay_every_answer(Duration::from_millis(2000));
    let running_now = "SELECT count(*) FROM consolidation_state WHERE running_since IS NOT NULL";
    let (running, asked) = tokio::join!(a.run(&once), async {
        assert!(mnemo_testkit::wait_until(Duration::from_secs(5), || async { chat.requests().len() == 2 }).await);
        let asked = by_hand().await;
        assert_eq!(app.db.count(running_now).await, 1, "asked while the run was still going");
        asked
    });
    assert_eq!(running.expect("run"), ConsolidateReport::Updated { notes: 1 });
    assert!(asked, "asked during a run: the notes may change after it read them");
    let reply = app.client.post("/v1/agents/other/consolidate", Some(&t), &json!({})).await;
    assert_eq!((reply.status, reply.code()), (403, "agent_mismatch"));
    let agent_only = token(&principal("acme", None, Some("helper"), None));
    let reply = app.client.post("/v1/agents/helper/consolidate", Some(&agent_only), &json!({})).await;
    assert_eq!((reply.status, reply.code()), (401, "missing_identity"));
    // A user without a daily note: nothing to consolidate, no job and no state row naming them.
    let bob = token(&principal("acme", Some("bob"), Some("helper"), None));
    let reply = app.client.post("/v1/agents/helper/consolidate", Some(&bob), &json!({})).await;
    assert_eq!((reply.status, reply.body), (202, json!({ "queued": false, "skipped": "no_daily_notes" })));
    assert_eq!(app.db.count("SELECT count(*) FROM consolidation_state WHERE user_id = 'bob'").await, 0);
    // The held run's retry and the extraction's request, then two by hand.
    assert_eq!(app.db.count("SELECT count(*) FROM apalis.jobs WHERE job_type = 'consolidate'").await, 2 + 2);
}

/// A MEMORY.md over the budget and longer than a model is shown is not sent to the model: the
/// run fails as `memory_too_large` (the notes wait) and the file stays as the user wrote it.
/// Within the budget, a file as long is consolidated.
#[tokio::test]
async fn a_memory_too_large_to_rewrite_is_not_sent_to_the_model() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    let long = format!("# MEMORY.md\n\n{}", "- a line the user wrote\n".repeat(1_500));
    assert!(long.len() > mnemo_core::SHOWN_FILE_BYTES);
    let reply = app.client.put("/v1/workspace/files/MEMORY.md", Some(&t), &json!({ "content": long })).await;
    assert!(reply.status < 300, "{:?}", reply.body);
    note(&app, &t, 0, "- booked Lisbon").await;

    let report = runner(&app, &chat, &[]).run(&job()).await.expect("run");
    assert_eq!(report, ConsolidateReport::Failed { reason: "memory_too_large".into() });
    assert!(chat.requests().is_empty(), "the model was asked");
    assert_eq!(memory(&app, &t).await, long);
    // Not a failure the throttle backs off for: no model was paid, and once shortened the file
    // should not wait.
    assert_eq!(app.db.count("SELECT failures::bigint FROM consolidation_state").await, 0);

    chat.then([ChatAnswer::Content(json!({ "should_update": false, "reason": "nothing new" }).to_string())]);
    let roomy = runner(&app, &chat, &[(vars::CONSOLIDATE_MAX_MEMORY_TOKENS, "20000")]);
    assert_eq!(roomy.run(&job()).await.expect("run"), ConsolidateReport::Kept { notes: 1 });
    assert_eq!(chat.requests().len(), 1);
}

/// Each failed run in a row doubles the wait between an extraction's requests: the next run
/// would show the model the same notes. A run that succeeds starts the count again.
#[tokio::test]
async fn requests_wait_longer_after_each_failed_run() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    note(&app, &t, 0, "- booked Lisbon").await;
    let runner = runner(&app, &chat, &[(vars::CONSOLIDATE_MAX_MEMORY_TOKENS, "200")]);
    let workspace = workspace();
    let store = app.db.store();
    let throttle = Duration::from_secs(1800);
    // Whether a request is queued when the last was asked `throttles` throttles ago.
    let asked_after = async |throttles: f64| {
        sqlx::query("UPDATE consolidation_state SET last_requested_at = now() - make_interval(secs => $1)")
            .bind(throttles * throttle.as_secs_f64())
            .execute(store.pool())
            .await
            .expect("age the request");
        store.request_consolidation(&workspace, Some(throttle)).await.expect("request") == ConsolidationRequest::Queued
    };
    let over_budget = || {
        ChatAnswer::Content(
            json!({ "should_update": true, "reason": "r", "memory_content": "word ".repeat(1000) }).to_string(),
        )
    };
    for failures in 1..=2 {
        chat.then([over_budget()]);
        assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::Failed { reason: "over_budget".into() });
        let wait = f64::from(1 << failures);
        assert!(!asked_after(wait - 0.1).await, "after {failures} failures, {wait} throttles");
        assert!(asked_after(wait + 0.1).await, "after {failures} failures, {wait} throttles");
    }
    assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::Updated { notes: 1 });
    assert!(asked_after(1.1).await, "counted again from none");
}

#[tokio::test]
async fn the_schedule_queues_each_pair_with_notes_once_per_fire() {
    let app = TestApp::spawn().await;
    for (user, agent) in [("ann", "helper"), ("bob", "helper"), ("ann", "coach")] {
        let t = token(&principal("acme", Some(user), Some(agent), None));
        note(&app, &t, 0, "- a note").await;
    }
    // A pair with no daily notes is not consolidated, nor one whose notes are all archived.
    let quiet = token(&principal("acme", Some("cid"), Some("helper"), None));
    assert_eq!(app.client.get("/v1/workspace/files", Some(&quiet)).await.status, 200);
    let archived = token(&principal("acme", Some("dan"), Some("helper"), None));
    let path = format!("/v1/workspace/files/memory/archive/{}.md", day(100));
    let reply = app.client.put(&path, Some(&archived), &json!({ "content": "- long ago" })).await;
    assert!(reply.status < 300, "{:?}", reply.body);
    // Nor one whose notes are all older than the days a run reads (7).
    let idle = token(&principal("acme", Some("eve"), Some("helper"), None));
    note(&app, &idle, 9, "- nine days ago").await;
    let store = app.db.store();
    let schedule = mnemo_core::CronSchedule::parse("0 2 * * *").expect("valid");
    let fire = schedule.last_fire(chrono::Utc::now().naive_utc()).expect("a fire");
    let night_before = fire - chrono::Duration::days(1);
    assert_eq!(store.schedule_consolidations("UTC", night_before, 7).await.expect("schedule"), 3);
    let again = store.schedule_consolidations("UTC", night_before, 7).await.expect("again");
    assert_eq!(again, 0, "once per fire, across workers");

    // Housekeeping does it on its tick, for the last fire.
    let policy = mnemo_jobs::HousekeepingPolicy {
        consolidate_cron: Some(schedule),
        maintenance: mnemo_config::MaintenanceSettings {
            interval: Duration::from_secs(3600),
            note_retention_days: 0,
            session_retention_days: 0,
            max_file_bytes: 256 * 1024,
        },
        ..mnemo_testkit::housekeeping_policy("m")
    };
    // A step failing at every tick (here pruning, made to fail) does not keep the tick's later
    // steps from running, nor a zone whose schedule fails (Asia/Tokyo, made to fail) the zones
    // after it; the failure is the tick's result.
    assert!(store.set_time_zone(&TenantId::parse("globex").expect("tenant"), "Asia/Tokyo").await.expect("zone"));
    note(&app, &token(&principal("globex", Some("ann"), Some("helper"), None)), 0, "- a note").await;
    for statement in [
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
         RAISE EXCEPTION 'refused'; END $$",
        "CREATE TRIGGER refuse_pruning BEFORE DELETE ON judge_batches \
         FOR EACH STATEMENT EXECUTE FUNCTION refuse()",
        "CREATE TRIGGER refuse_tokyo BEFORE INSERT ON consolidation_fires \
         FOR EACH ROW WHEN (NEW.zone = 'Asia/Tokyo') EXECUTE FUNCTION refuse()",
    ] {
        sqlx::query(statement).execute(&app.db.pool).await.expect(statement);
    }
    let failed = mnemo_jobs::run_housekeeping(&store, "w", &policy).await;
    assert!(failed.is_err(), "the failed step is reported: {failed:?}");
    assert_eq!(store.schedule_consolidations("UTC", fire, 7).await.expect("same fire"), 0, "scheduled all the same");
    assert_eq!(app.db.count("SELECT count(*) FROM apalis.jobs WHERE job_type = 'consolidate'").await, 6);
}

#[tokio::test]
async fn a_tenants_time_zone_decides_the_day_of_its_notes_and_when_its_schedule_fires() {
    let app = TestApp::spawn().await;
    let store = app.db.store();
    let tenant = |t: &str| TenantId::parse(t).expect("tenant");
    assert_eq!(store.tenant_today(&tenant("acme")).await.expect("today").0, "UTC");
    for unknown in ["Mars/Olympus_Mons", "PST", "EST5EDT", "+05", "Etc/GMT+5", ""] {
        assert!(!store.set_time_zone(&tenant("acme"), unknown).await.expect("set"), "{unknown:?}");
    }
    // UTC+14 and UTC-11 the whole year: their days differ from UTC's for half of each day.
    assert!(store.set_time_zone(&tenant("acme"), "Pacific/Kiritimati").await.expect("set"));
    assert!(store.set_time_zone(&tenant("globex"), "Pacific/Pago_Pago").await.expect("set"));
    let local_day = |hours: i64| (chrono::Utc::now() + chrono::Duration::hours(hours)).date_naive();
    let (zone, today) = store.tenant_today(&tenant("acme")).await.expect("today");
    assert_eq!((zone.as_str(), today), ("Pacific/Kiritimati", local_day(14)));
    assert_eq!(store.tenant_today(&tenant("globex")).await.expect("today").1, local_day(-11));
    // A name set by hand that PostgreSQL does not know counts as UTC.
    sqlx::query(
        "INSERT INTO tenant_config (tenant_id, settings) VALUES ('initech', '{\"time_zone\": \"Nowhere/Land\"}')",
    )
    .execute(store.pool())
    .await
    .expect("insert");
    assert_eq!(store.tenant_today(&tenant("initech")).await.expect("today"), ("UTC".to_owned(), local_day(0)));

    // The prompt's "today" is the tenant's.
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    let path = format!("/v1/workspace/files/memory/{}.md", local_day(14));
    app.client.put(&path, Some(&t), &json!({ "content": "- the date line is behind us" })).await;
    let prompt = app.client.get("/v1/workspace/prompt", Some(&t)).await;
    let text = prompt.body["prompt"].as_str().unwrap_or_default();
    assert!(text.contains("## Today's Notes\n- the date line is behind us"), "{text}");

    // Each zone's schedule fires at its own wall-clock time, for its own tenants only.
    for tenant in ["globex", "initech"] {
        let t = token(&principal(tenant, Some("ann"), Some("helper"), None));
        note(&app, &t, 0, "- a note").await;
    }
    let clocks = store.zone_clocks().await.expect("clocks");
    let zones: Vec<&str> = clocks.iter().map(|(zone, _)| zone.as_str()).collect();
    assert_eq!(zones, ["Pacific/Kiritimati", "Pacific/Pago_Pago", "UTC"]);
    let schedule = mnemo_core::CronSchedule::parse("0 2 * * *").expect("valid");
    let mut queued = Vec::new();
    for (zone, now) in &clocks {
        let fire = schedule.last_fire(*now).expect("a fire");
        queued.push(store.schedule_consolidations(zone, fire, 7).await.expect("schedule"));
    }
    assert_eq!(queued, [1, 1, 1], "acme, globex, and initech under UTC");
    let fires: Vec<(String, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as("SELECT zone, fire FROM consolidation_fires ORDER BY zone")
            .fetch_all(store.pool())
            .await
            .expect("fires");
    let at_two = |(zone, fire): &(String, chrono::DateTime<chrono::Utc>), offset: i64| {
        assert_eq!((*fire + chrono::Duration::hours(offset)).format("%H:%M").to_string(), "02:00", "{zone}");
    };
    at_two(&fires[0], 14);
    at_two(&fires[1], -11);
    at_two(&fires[2], 0);
}

/// The nightly schedule and a user's erasure exclude each other (the erasure holds the
/// schedule's lock shared, the schedule alone): a schedule never queues a user whose erasure is
/// under way, and an erasure that comes while a schedule runs deletes what it queued. Each side
/// is held open by hand, doing what the other side's transaction does.
#[tokio::test]
async fn the_nightly_schedule_and_a_users_erasure_never_interleave() {
    let app = TestApp::spawn().await;
    let store = app.db.store();
    for user in ["ann", "bob"] {
        note(&app, &token(&principal("acme", Some(user), Some("helper"), None)), 0, "- a note").await;
    }
    let named = |user: &str| {
        format!(
            "SELECT (SELECT count(*) FROM consolidation_state WHERE user_id = '{user}')
                  + (SELECT count(*) FROM apalis.jobs WHERE job_type = 'consolidate'
                       AND convert_from(job, 'UTF8')::jsonb->>'user_id' = '{user}')"
        )
    };
    // Until a lock waits to be granted (the other side's), at most 30 s.
    let waiting = || async {
        let waits = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted";
        let poll = async {
            while app.db.count(waits).await == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), poll).await.is_ok()
    };

    // An erasure of ann under way (the lock shared, her notes deleted, not committed yet): the
    // schedule waits for it, then finds no note of hers.
    let mut erasure = app.db.pool.begin().await.expect("begin");
    sqlx::query("SELECT pg_advisory_xact_lock_shared(hashtextextended('consolidation schedule', 0))")
        .execute(&mut *erasure)
        .await
        .expect("the schedule's lock, shared");
    for table in ["workspace_file_versions", "workspace_files"] {
        let delete = format!("DELETE FROM {table} WHERE user_id = 'ann'");
        sqlx::query(sqlx::AssertSqlSafe(delete)).execute(&mut *erasure).await.expect("delete");
    }
    let fire = mnemo_core::CronSchedule::parse("0 2 * * *").expect("valid").last_fire(chrono::Utc::now().naive_utc());
    let fire = fire.expect("a fire");
    let scheduling = tokio::spawn({
        let store = store.clone();
        async move { store.schedule_consolidations("UTC", fire, 7).await }
    });
    assert!(waiting().await && !scheduling.is_finished(), "the schedule did not wait for the erasure");
    erasure.commit().await.expect("commit");
    assert_eq!(scheduling.await.expect("join").expect("schedule"), 1, "bob alone");
    assert_eq!(app.db.count(&named("ann")).await, 0);

    // A schedule under way (the lock alone, a job for bob queued, not committed yet): bob's
    // erasure waits for it, then deletes the job.
    let mut schedule = app.db.pool.begin().await.expect("begin");
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('consolidation schedule', 0))")
        .execute(&mut *schedule)
        .await
        .expect("the schedule's lock");
    let bobs = ConsolidateJob { user_id: UserId::parse("bob").expect("user"), ..job() };
    sqlx::query("INSERT INTO apalis.jobs (job, id, job_type) VALUES ($1, gen_random_uuid()::text, 'consolidate')")
        .bind(serde_json::to_vec(&bobs).expect("json"))
        .execute(&mut *schedule)
        .await
        .expect("a job");
    let erasing = tokio::spawn({
        let store = store.clone();
        async move {
            let (tenant, user) = (TenantId::parse("acme").expect("tenant"), UserId::parse("bob").expect("user"));
            store.erase_user_workspace(&tenant, &user).await
        }
    });
    assert!(waiting().await && !erasing.is_finished(), "the erasure did not wait for the schedule");
    schedule.commit().await.expect("commit");
    erasing.await.expect("join").expect("erase");
    assert_eq!(app.db.count(&named("bob")).await, 0, "the schedule's job or state outlived bob's erasure");
}

/// A schedule or request that raced the user's erasure before the two excluded each other left a
/// state row (and a job) naming them; the job, finding no note, removes the row.
#[tokio::test]
async fn a_job_that_finds_no_note_leaves_no_state_row_naming_the_user() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    // bob deleted his only note: his state stays for `memory status`.
    let bob = token(&principal("acme", Some("bob"), Some("helper"), None));
    note(&app, &bob, 0, "- a note").await;
    let path = format!("/v1/workspace/files/memory/{}.md", day(0));
    assert!(app.client.delete(&path, Some(&bob)).await.status < 300);
    for user in ["ann", "bob"] {
        sqlx::query("INSERT INTO consolidation_state (tenant_id, agent_id, user_id, last_requested_at) VALUES ('acme', 'helper', $1, now())")
            .bind(user)
            .execute(&app.db.pool)
            .await
            .expect("a state row");
    }
    // A job that failed before it removed the row is run again for it.
    let store = app.db.store();
    let jobs = "SELECT count(*) FROM apalis.jobs WHERE job_type = 'consolidate'";
    assert!(store.retry_failed(&job(), Duration::from_secs(3600), 1).await.expect("retry"));
    assert_eq!(app.db.count(jobs).await, 1);
    let runner = runner(&app, &chat, &[]);
    let bobs = ConsolidateJob { user_id: UserId::parse("bob").expect("user"), ..job() };
    for job in [job(), bobs] {
        assert_eq!(runner.run(&job).await.expect("run"), ConsolidateReport::NothingNew);
    }
    let left: Vec<String> =
        sqlx::query_scalar("SELECT user_id FROM consolidation_state").fetch_all(&app.db.pool).await.expect("rows");
    assert_eq!(left, ["bob"], "ann, who has no file at all, is named nowhere");
    assert!(!store.retry_failed(&job(), Duration::from_secs(3600), 1).await.expect("retry"), "nothing left to do");
    assert_eq!(app.db.count(jobs).await, 1);
    assert!(chat.requests().is_empty(), "no model call");
}

/// A line the user takes out of a note during the model call never reaches MEMORY.md; a note only
/// added to meanwhile (as extraction adds to today's) does not stop the run.
#[tokio::test]
async fn a_note_that_lost_text_during_the_model_call_changes_nothing() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    note(&app, &t, 0, "- my PIN is 1234\n- booked Lisbon\n").await;
    let runner = runner(&app, &chat, &[]);
    let before = memory(&app, &t).await;
    let answer = |text: &str| {
        ChatAnswer::Content(json!({ "should_update": true, "reason": "r", "memory_content": text }).to_string())
    };
    chat.delay_every_answer(Duration::from_millis(600));
    chat.then([answer("# MEMORY.md\n\n- PIN 1234\n")]);
    let once = job();
    let (report, ()) = tokio::join!(runner.run(&once), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        note(&app, &t, 0, "- booked Lisbon\n").await;
    });
    assert_eq!(report.expect("run"), ConsolidateReport::Failed { reason: "notes_changed".to_owned() });
    assert_eq!(memory(&app, &t).await, before, "MEMORY.md is not written from the text taken out");

    chat.then([answer("# MEMORY.md\n\n- booked Lisbon\n")]);
    let (report, ()) = tokio::join!(runner.run(&once), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        note(&app, &t, 0, "- booked Lisbon\n- and a hotel\n").await;
    });
    assert_eq!(report.expect("run"), ConsolidateReport::Updated { notes: 1 });
    assert_eq!(memory(&app, &t).await, "# MEMORY.md\n\n- booked Lisbon\n");
}

#[tokio::test]
async fn memory_edited_during_the_model_call_is_kept_and_the_notes_are_read_again() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    note(&app, &t, 0, "- a note").await;
    chat.delay_every_answer(Duration::from_millis(600));
    let runner = runner(&app, &chat, &[]);
    let edited = json!({ "content": "# MEMORY.md\n\n- written by hand\n" });
    let once = job();
    let (report, put) = tokio::join!(runner.run(&once), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        app.client.put("/v1/workspace/files/MEMORY.md", Some(&t), &edited).await
    });
    assert!(put.status < 300, "{:?}", put.body);
    assert_eq!(report.expect("run"), ConsolidateReport::Failed { reason: "memory_changed".to_owned() });
    assert_eq!(memory(&app, &t).await, "# MEMORY.md\n\n- written by hand\n");
    let watermark = app.db.count("SELECT count(*) FROM consolidation_state WHERE watermark > '1970-01-02'").await;
    assert_eq!(watermark, 0, "the watermark stays");
    let counted = app.db.count("SELECT count(*) FROM consolidation_state WHERE failures > 0").await;
    assert_eq!(counted, 0, "an edit is not the model's failure: the next request does not wait longer");

    // The notes are left to the next run, which shows the model the edited MEMORY.md.
    chat.delay_every_answer(Duration::ZERO);
    assert_eq!(runner.run(&job()).await.expect("next run"), ConsolidateReport::Updated { notes: 1 });
    let last = chat.requests().last().cloned().expect("a request");
    assert!(last.to_string().contains("written by hand"), "the model saw the edit");
}

#[tokio::test]
async fn a_note_committed_after_a_run_read_the_others_is_consolidated_by_the_next_run() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    note(&app, &t, 1, "- yesterday").await;
    note(&app, &t, 0, "- today").await;
    let runner = runner(&app, &chat, &[]);
    assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::Updated { notes: 2 });

    // Yesterday's note changes in a transaction that began before today's note changed and
    // commits only after a run has read today's note.
    let store = app.db.store();
    let mut slow = store.pool().begin().await.expect("begin");
    sqlx::query(
        "UPDATE workspace_files SET content = content || '- late\n', version = version + 1, updated_at = now()
         WHERE path = $1",
    )
    .bind(format!("memory/{}.md", day(1)))
    .execute(&mut *slow)
    .await
    .expect("update");
    tokio::time::sleep(Duration::from_millis(20)).await;
    note(&app, &t, 0, "- today\n- and more").await;
    assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::Updated { notes: 1 });
    slow.commit().await.expect("commit");

    assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::Updated { notes: 1 }, "the late note");
    let prompt = chat.requests().last().expect("a request")["messages"][1]["content"].as_str().unwrap_or("").to_owned();
    assert!(prompt.contains("- late"), "{prompt}");
    assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::NothingNew);
}

#[tokio::test]
async fn the_dry_run_shows_the_proposal_and_changes_nothing() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    note(&app, &t, 0, "- booked Lisbon").await;
    let runner = runner(&app, &chat, &[]);
    let workspace = workspace();
    let before = memory(&app, &t).await;
    let (input, answer) = runner.propose(&workspace).await.expect("propose").expect("a note to read");
    assert_eq!(input.notes.len(), 1);
    let answer = answer.expect("a model").expect("an answer");
    assert_eq!(answer.memory_content.as_deref(), Some(format!("# MEMORY.md\n\n- consolidated {}\n", day(0)).as_str()));
    assert_eq!(memory(&app, &t).await, before, "nothing applied");
    assert_eq!(app.db.count("SELECT count(*) FROM consolidation_state").await, 0, "no state written");
    // The notes are still new to a real run.
    assert_eq!(runner.run(&job()).await.expect("run"), ConsolidateReport::Updated { notes: 1 });
}

/// `memory consolidate` queues a job only for a pair with daily notes: a mistyped agent or user
/// is refused by name, and nothing is queued.
#[tokio::test]
async fn the_runbook_queues_a_consolidation_only_for_a_pair_with_notes() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    note(&app, &t, 0, "- a note").await;
    let consolidate = |agent: &'static str, user: &'static str| {
        let url = app.db.url.clone();
        async move {
            tokio::process::Command::new(mnemo_testkit::binary("mnemo-runbook").expect("runbook"))
                .args(["memory", "consolidate", "--tenant", "acme", "--agent", agent, "--user", user, "--json"])
                .env_clear()
                .env(vars::DATABASE_URL, url)
                .output()
                .await
                .expect("runbook runs")
        }
    };
    for (agent, user) in [("helper", "anne"), ("helpr", "ann")] {
        let refused = consolidate(agent, user).await;
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && stderr.contains("has no daily notes"), "{agent}/{user}: {stderr}");
    }
    let jobs = "SELECT count(*) FROM apalis.jobs WHERE job_type = 'consolidate'";
    assert_eq!(app.db.count(jobs).await, 0, "refused: nothing queued");
    let queued = consolidate("helper", "ann").await;
    assert!(queued.status.success(), "{}", String::from_utf8_lossy(&queued.stderr));
    let answer: serde_json::Value = serde_json::from_slice(&queued.stdout).expect("json");
    assert_eq!(answer["queued"], true);
    assert_eq!(app.db.count(jobs).await, 1);
}
