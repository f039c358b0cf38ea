//! Compaction against a real PostgreSQL, the real worker binary and the testkit's scripted chat
//! server: triggers and their off switches, what is kept, the incremental prompt, one summary
//! row per compaction however often the job runs, truncation when the model fails, overflow
//! recovery, and isolation between sessions and tenants.

use std::sync::Arc;
use std::time::Duration;

use mnemo_config::{ContextSettings, Env, TokenizerName, vars};
use mnemo_core::{
    CompactionOutcome, CompactionTrigger, Gates, Keep, MemoryText, NewMemory, SUMMARY_PREFIX, SessionId, TenantId,
    summary_source_ref,
};
use mnemo_jobs::{CompactPolicy, CompactReport, Compactor, SUMMARY_RETRIES};
use mnemo_store::Recording;
use mnemo_store::queue::CompactJob;
use mnemo_testkit::{ChatAnswer, ScriptedChat, TestApp, WorkerProcess, principal, token};
use serde_json::{Value, json};

/// The settings that make the worker use `chat`, which takes only the key they name.
fn llm_env(chat: &ScriptedChat) -> Vec<(&'static str, String)> {
    chat.expect_key("test");
    vec![
        (vars::LLM_MODEL, "scripted-summarizer".to_owned()),
        (vars::LLM_BASE_URL, chat.base_url.clone()),
        (vars::LLM_API_KEY, "test".to_owned()),
        (vars::LLM_TIMEOUT_MS, "1500".to_owned()),
    ]
}

/// Writes a chat message. Source refs are unique per tenant, so each gets a fresh suffix.
async fn say(app: &TestApp, token: &str, source_ref: &str, role: &str, content: &str) {
    let source_ref = format!("{source_ref}-{}", uuid::Uuid::now_v7().simple());
    let body = json!({ "source_kind": "chat_message", "source_ref": source_ref, "role": role, "content": content });
    let reply = app.client.post("/v1/memories", Some(token), &body).await;
    assert_eq!(reply.status, 201, "{body}: {:?}", reply.body);
}

/// `turns` user/assistant pairs, numbered from `from`.
async fn turns(app: &TestApp, token: &str, from: usize, turns: usize) {
    for i in from..from + turns {
        say(app, token, &format!("u{i}"), "user", &format!("question {i} about the trip to Lisbon")).await;
        say(app, token, &format!("a{i}"), "assistant", &format!("answer {i}: take the early train")).await;
    }
}

async fn context(app: &TestApp, token: &str, sid: &str, body: Value) -> Value {
    let reply = app.client.post(&format!("/v1/sessions/{sid}/context"), Some(token), &body).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    reply.body
}

fn contents(context: &Value) -> Vec<String> {
    context["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["content"].as_str().unwrap_or("").to_owned())
        .collect()
}

/// A compactor in this process, as the worker builds one, over `settings`.
fn compactor(app: &TestApp, settings: &ContextSettings) -> Compactor {
    Compactor {
        store: app.db.store(),
        summarizer: mnemo_models::summarizer(settings).expect("summarizer"),
        counter: Arc::new(mnemo_models::Tokenizer::new(TokenizerName::O200kBase)),
        policy: CompactPolicy::from_settings(settings),
        extraction: Some(Gates::default()),
    }
}

fn settings(pairs: Vec<(&'static str, String)>) -> ContextSettings {
    ContextSettings::from_env(&Env::from_pairs(pairs)).expect("settings")
}

fn job(tenant: &str, session: &str) -> CompactJob {
    CompactJob {
        tenant_id: TenantId::parse(tenant).expect("tenant"),
        session_id: SessionId::parse(session).expect("session"),
        trigger: CompactionTrigger::Messages,
        keep: None,
        keep_at_most: None,
        summary_failures: 0,
    }
}

async fn compact_jobs(app: &TestApp) -> i64 {
    app.db.count("SELECT count(*) FROM apalis.jobs WHERE job_type = 'compact'").await
}

#[tokio::test]
async fn a_session_past_its_trigger_is_answered_at_once_and_the_worker_brings_the_summary() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn_with(&[(vars::COMPACT_TRIGGER_MESSAGES, "6"), (vars::COMPACT_TRIGGER_RATIO, "0")]).await;
    let t = token(&principal("acme", Some("ann"), None, Some("s1")));
    turns(&app, &t, 0, 5).await;

    // Past the trigger: the answer comes at once, with every message (they fit), and a job.
    let first = context(&app, &t, "s1", json!({})).await;
    assert_eq!(first["diagnostics"]["compaction"], "scheduled");
    assert_eq!(first["diagnostics"]["trigger"], "messages");
    assert_eq!(first["messages"].as_array().map(Vec::len), Some(10));
    // Asking again while it is pending queues nothing more.
    let again = context(&app, &t, "s1", json!({})).await;
    assert_eq!(again["diagnostics"]["compaction"], "scheduled");
    assert_eq!(compact_jobs(&app).await, 1);

    let worker = WorkerProcess::start(
        &app.db.url,
        &[&llm_env(&chat)[..], &[(vars::WORKER_QUEUES, "compact".to_owned())]].concat(),
    )
    .await
    .expect("worker");
    let done = context(&app, &t, "s1", json!({ "wait_ms": 20_000 })).await;
    assert_eq!(done["diagnostics"]["compaction"], "used", "{done}");
    let texts = contents(&done);
    // The summary, as a user message with the marker, then the last two turns verbatim.
    assert_eq!(done["messages"][0]["role"], "user");
    assert!(texts[0].starts_with(SUMMARY_PREFIX), "{}", texts[0]);
    assert!(texts[0].contains("6 new messages since the start"), "{}", texts[0]);
    assert_eq!(
        &texts[1..],
        [
            "question 3 about the trip to Lisbon",
            "answer 3: take the early train",
            "question 4 about the trip to Lisbon",
            "answer 4: take the early train"
        ]
    );
    assert_eq!(done["diagnostics"]["messages_since_compaction"], 4);
    assert!(done["diagnostics"]["summary"]["id"].is_string());
    let requests = chat.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0]["model"], "scripted-summarizer");
    // The model is asked for 300 tokens and cut off only past the 600 compaction's own bound
    // allows: a summary a little over its instruction is not lost to `finish_reason: length`.
    assert_eq!(requests[0]["max_tokens"], 600);
    let system = requests[0]["messages"][0]["content"].as_str().expect("system").to_owned();
    assert!(system.contains("at most 300 tokens"), "{system}");
    let prompt = requests[0]["messages"][1]["content"].as_str().expect("prompt").to_owned();
    assert!(prompt.starts_with("PREVIOUS SUMMARY:\n(none)"), "{prompt}");
    assert!(prompt.contains("[user] \"question 0") && prompt.contains("[assistant] \"answer 2"), "{prompt}");
    assert!(!prompt.contains("question 3"), "kept turns are not summarized: {prompt}");

    // Later messages: the next summary is built from the previous one and only the new messages.
    turns(&app, &t, 5, 3).await;
    let next = context(&app, &t, "s1", json!({ "wait_ms": 20_000 })).await;
    assert_eq!(next["diagnostics"]["compaction"], "used", "{next}");
    let requests = chat.requests();
    assert_eq!(requests.len(), 2);
    let prompt = requests[1]["messages"][1]["content"].as_str().expect("prompt");
    let (previous, new) = prompt.split_once("NEW MESSAGES:").expect("two parts");
    assert!(previous.starts_with("PREVIOUS SUMMARY:\n\"SESSION INTENT"), "{prompt}");
    assert!(!new.contains("question 0") && !new.contains("answer 2"), "{prompt}");
    assert!(new.contains("question 3") && new.contains("answer 5"), "{prompt}");
    assert!(!new.contains("question 6"), "{prompt}");
    assert!(contents(&next)[0].contains("6 new messages since the previous summary"));
    assert_eq!(app.db.count("SELECT count(*) FROM memory_items WHERE source_kind = 'session_summary'").await, 2);
    assert_eq!(app.db.count("SELECT count(*) FROM session_compactions WHERE outcome = 'summarized'").await, 2);
    // Nothing was lost: every message is still stored and listed.
    assert_eq!(app.db.count("SELECT count(*) FROM memory_items WHERE source_kind = 'chat_message'").await, 16);
    drop(worker);
}

#[tokio::test]
async fn what_a_compaction_takes_out_of_the_window_is_extracted_without_the_conversation_ending() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn_with(&[(vars::COMPACT_TRIGGER_MESSAGES, "6"), (vars::COMPACT_TRIGGER_RATIO, "0")]).await;
    let ann = token(&principal("acme", Some("ann"), Some("helper"), Some("s1")));
    say(&app, &ann, "early", "user", "remember: I am allergic to peanuts").await;
    say(&app, &ann, "noted", "assistant", "Noted: no peanuts in any recipe.").await;
    turns(&app, &ann, 0, 4).await;
    // A token without an agent has no workspace to extract into; too short a conversation does
    // not pass the gates (the same as a completed one).
    let bob = token(&principal("acme", Some("bob"), None, Some("s2")));
    turns(&app, &bob, 0, 1).await;
    // An agent's service token answering in bob's session gives bob no workspace.
    let service = token(&principal("acme", None, Some("helper"), Some("s2")));
    say(&app, &service, "service", "assistant", "The early train leaves at seven.").await;
    turns(&app, &bob, 1, 4).await;
    let cy = token(&principal("acme", Some("cy"), Some("helper"), Some("s3")));
    for i in 0..10 {
        say(&app, &cy, &format!("cy{i}"), "user", "ok").await;
    }
    for (t, sid) in [(&ann, "s1"), (&bob, "s2"), (&cy, "s3")] {
        assert_eq!(context(&app, t, sid, json!({})).await["diagnostics"]["compaction"], "scheduled");
    }

    let worker = WorkerProcess::start(
        &app.db.url,
        &[
            &llm_env(&chat)[..],
            &[(vars::WORKER_QUEUES, "compact,extract".to_owned()), (vars::EXTRACT_COOLDOWN_S, "0".to_owned())],
        ]
        .concat(),
    )
    .await
    .expect("worker");
    let done = context(&app, &ann, "s1", json!({ "wait_ms": 20_000 })).await;
    assert_eq!(done["diagnostics"]["compaction"], "used", "{done}");
    assert!(!contents(&done).iter().any(|c| c.contains("peanuts")), "the early turn left the window: {done}");
    let remembered = "SELECT count(*) FROM memory_items
                      WHERE source_kind = 'fact' AND user_id = 'ann' AND content = 'I am allergic to peanuts'";
    let extracted =
        mnemo_testkit::wait_until(Duration::from_secs(30), || async { app.db.count(remembered).await == 1 }).await;
    assert!(extracted, "the early fact was not extracted");
    // Asked for with the record, through the last message it covers, for ann with her agent.
    let asked: (String, String, String, bool) = sqlx::query_as(
        "SELECT e.trigger_source, e.agent_id, e.user_id, e.through_id = c.through_id
         FROM memory_extractions e JOIN session_compactions c USING (tenant_id, session_id)
         WHERE e.session_id = 's1'",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("one extraction of s1");
    assert_eq!(asked, ("compaction".to_owned(), "helper".to_owned(), "ann".to_owned(), true));
    let compacted = "SELECT count(*) FROM session_compactions WHERE session_id IN ('s2', 's3')";
    assert!(mnemo_testkit::wait_until(Duration::from_secs(20), || async { app.db.count(compacted).await == 2 }).await);
    assert_eq!(app.db.count("SELECT count(*) FROM memory_extractions WHERE session_id <> 's1'").await, 0);

    // The conversation's completion is shown only what came after: the compaction's extraction
    // read the rest, and its daily entry is not written twice.
    say(&app, &ann, "late", "user", "remember: I moved to Porto last week").await;
    let reply = app.client.post("/v1/sessions/s1/complete", Some(&ann), &json!({"trigger_source": "web"})).await;
    assert_eq!(reply.body["queued"], true, "{:?}", reply.body);
    let done = "SELECT count(*) FROM memory_extractions WHERE session_id = 's1' AND status = 'done'";
    assert!(mnemo_testkit::wait_until(Duration::from_secs(30), || async { app.db.count(done).await == 2 }).await);
    let transcripts: Vec<String> = chat
        .requests()
        .iter()
        .filter_map(|r| r["messages"][1]["content"].as_str().and_then(|p| p.split_once("CONVERSATION:\n")))
        .map(|(_, conversation)| conversation.to_owned())
        .collect();
    assert_eq!(transcripts.len(), 2, "{transcripts:?}");
    assert!(transcripts[0].contains("peanuts") && !transcripts[0].contains("Porto"), "{}", transcripts[0]);
    assert!(transcripts[1].contains("Porto") && !transcripts[1].contains("peanuts"), "{}", transcripts[1]);
    drop(worker);

    // A client cannot name a compaction as a conversation's end.
    let reply = app.client.post("/v1/sessions/s1/complete", Some(&ann), &json!({"trigger_source": "compaction"})).await;
    assert_eq!((reply.status, reply.body["error"]["code"].as_str()), (400, Some("invalid_value")), "{:?}", reply.body);
}

/// A participant's name is sent with each message, so it counts toward the token trigger as it
/// does in the window: forty short messages under a long name pass half of an 800-token budget
/// (their text alone would not).
#[tokio::test]
async fn a_participants_name_counts_toward_the_token_trigger() {
    let app = TestApp::spawn_with(&[(vars::COMPACT_TRIGGER_RATIO, "0.5"), (vars::COMPACT_TRIGGER_MESSAGES, "0")]).await;
    let t = token(&principal("acme", None, None, Some("s1")));
    for i in 0..40 {
        let body = json!({ "source_kind": "chat_message", "source_ref": format!("n{i}"),
                           "role": if i % 2 == 0 { "user" } else { "assistant" },
                           "name": "a_participant_with_a_rather_long_name", "content": "ok" });
        assert_eq!(app.client.post("/v1/memories", Some(&t), &body).await.status, 201);
    }
    let window = context(&app, &t, "s1", json!({ "max_input_tokens": 800 })).await;
    assert_eq!(window["diagnostics"]["trigger"], "tokens", "{}", window["diagnostics"]);
}

#[tokio::test]
async fn each_trigger_fires_past_its_threshold_and_zero_turns_it_off() {
    // Tokens: 40 words a message, a 2,000-token budget, 0.5 of it.
    let app = TestApp::spawn_with(&[(vars::COMPACT_TRIGGER_RATIO, "0.5"), (vars::COMPACT_TRIGGER_MESSAGES, "0")]).await;
    let t = token(&principal("acme", None, None, Some("s1")));
    let words = "word ".repeat(40);
    say(&app, &t, "m0", "user", &words).await;
    let under = context(&app, &t, "s1", json!({ "max_input_tokens": 2000 })).await;
    assert_eq!(
        (under["diagnostics"]["compaction"].as_str(), under["diagnostics"]["trigger"].as_str()),
        (Some("none"), None)
    );
    for i in 1..30 {
        say(&app, &t, &format!("m{i}"), if i % 2 == 0 { "user" } else { "assistant" }, &words).await;
    }
    let over = context(&app, &t, "s1", json!({ "max_input_tokens": 2000 })).await;
    assert_eq!(over["diagnostics"]["trigger"], "tokens", "{over}");
    assert_eq!(over["diagnostics"]["compaction"], "scheduled");
    assert!(over["diagnostics"]["tokens"]["total"].as_u64().expect("total") <= 2000);
    // Same history, a budget it is small against: no trigger.
    let roomy = context(&app, &t, "s1", json!({ "max_input_tokens": 100_000 })).await;
    assert!(roomy["diagnostics"]["trigger"].is_null(), "{roomy}");
    // The trigger counts the whole window: the history (1,350 tokens) is under half of a
    // 4,000-token budget alone, and over it with a 1,500-token system prompt (and over half of
    // the 2,500 tokens that prompt leaves the history, below which it never fires).
    let alone = context(&app, &t, "s1", json!({ "max_input_tokens": 4000 })).await;
    assert!(alone["diagnostics"]["trigger"].is_null(), "{}", alone["diagnostics"]);
    let prompted = json!({ "max_input_tokens": 4000, "system_prompt": "rule ".repeat(1500) });
    let prompted = context(&app, &t, "s1", prompted).await;
    assert_eq!(prompted["diagnostics"]["trigger"], "tokens", "{}", prompted["diagnostics"]);
    // A long current message counts towards the trigger, but what the job keeps outlasts the call:
    // it is sized without the message (half of about 4,000 tokens, not of the 2,400 it leaves).
    let app = TestApp::spawn_with(&[(vars::COMPACT_TRIGGER_RATIO, "0.5"), (vars::COMPACT_TRIGGER_MESSAGES, "0")]).await;
    for i in 0..30 {
        say(&app, &t, &format!("m{i}"), if i % 2 == 0 { "user" } else { "assistant" }, &words).await;
    }
    let pasted = json!({ "max_input_tokens": 4000, "current_message": "paste ".repeat(1600) });
    let pasted = context(&app, &t, "s1", pasted).await;
    assert_eq!(pasted["diagnostics"]["trigger"], "tokens", "{}", pasted["diagnostics"]);
    let keep_at_most: i64 = sqlx::query_scalar(
        "SELECT (convert_from(job, 'UTF8')::jsonb->>'keep_at_most')::int8 FROM apalis.jobs WHERE job_type = 'compact'",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("the job");
    assert!((1900..=2000).contains(&keep_at_most), "{keep_at_most}");
    // A system prompt past the trigger alone does not ask for a summary at every turn: the
    // history (three turns, 270 tokens) must first pass half the 1,500 tokens it leaves.
    let s2 = token(&principal("acme", None, None, Some("s2")));
    for i in 0..6 {
        say(&app, &s2, &format!("n{i}"), if i % 2 == 0 { "user" } else { "assistant" }, &words).await;
    }
    let crowded = json!({ "max_input_tokens": 4000, "system_prompt": "rule ".repeat(2500) });
    let crowded = context(&app, &s2, "s2", crowded).await;
    assert!(crowded["diagnostics"]["trigger"].is_null(), "{}", crowded["diagnostics"]);

    // Messages: more than 5 since the last compaction (and more than the two turns it keeps).
    let app = TestApp::spawn_with(&[(vars::COMPACT_TRIGGER_RATIO, "0"), (vars::COMPACT_TRIGGER_MESSAGES, "5")]).await;
    turns(&app, &t, 0, 2).await;
    say(&app, &t, "u2", "user", "one more").await;
    let five = context(&app, &t, "s1", json!({})).await;
    assert!(five["diagnostics"]["trigger"].is_null(), "5 is not more than 5: {five}");
    say(&app, &t, "a2", "assistant", "and a reply").await;
    let six = context(&app, &t, "s1", json!({})).await;
    assert_eq!(six["diagnostics"]["trigger"], "messages");
    // Past the trigger but nothing before the kept turns: a compaction would cover nothing, so
    // none is asked for.
    let app = TestApp::spawn_with(&[(vars::COMPACT_TRIGGER_RATIO, "0"), (vars::COMPACT_TRIGGER_MESSAGES, "5")]).await;
    say(&app, &t, "u0", "user", "look these up").await;
    for i in 0..4 {
        let call = json!({ "source_kind": "chat_message", "source_ref": format!("call{i}"), "role": "assistant",
            "tool_call_id": format!("c{i}"), "name": "search", "content": "{}" });
        let result = json!({ "source_kind": "tool_output", "source_ref": format!("c{i}"), "name": "search", "content": "found" });
        for body in [call, result] {
            assert_eq!(app.client.post("/v1/memories", Some(&t), &body).await.status, 201);
        }
    }
    let one_turn = context(&app, &t, "s1", json!({})).await;
    assert!(one_turn["diagnostics"]["trigger"].is_null(), "{one_turn}");
    assert_eq!(compact_jobs(&app).await, 0);
    // Nor when compaction keeps more tokens than the session holds (MNEMO_COMPACT_KEEP_TOKENS):
    // the call decides as the job's plan would cut, and no job that finds nothing is queued.
    let keep_all = [
        (vars::COMPACT_TRIGGER_RATIO, "0"),
        (vars::COMPACT_TRIGGER_MESSAGES, "5"),
        (vars::COMPACT_KEEP_TOKENS, "100000"),
    ];
    let app = TestApp::spawn_with(&keep_all).await;
    turns(&app, &t, 0, 4).await;
    let kept_whole = context(&app, &t, "s1", json!({})).await;
    assert!(kept_whole["diagnostics"]["trigger"].is_null(), "{kept_whole}");
    assert_eq!(compact_jobs(&app).await, 0);

    // Both off: nothing is ever scheduled, however long or full the session.
    let app = TestApp::spawn_with(&[(vars::COMPACT_TRIGGER_RATIO, "0"), (vars::COMPACT_TRIGGER_MESSAGES, "0")]).await;
    for i in 0..60 {
        say(&app, &t, &format!("m{i}"), "user", &words).await;
    }
    let off = context(&app, &t, "s1", json!({ "max_input_tokens": 500 })).await;
    assert_eq!(off["diagnostics"]["compaction"], "none");
    assert!(off["diagnostics"]["trigger"].is_null());
    assert_eq!(compact_jobs(&app).await, 0);
    assert!(off["diagnostics"]["tokens"]["total"].as_u64().expect("total") <= 500);
}

#[tokio::test]
async fn keep_pairs_and_keep_tokens_never_split_a_tool_call_from_its_results() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", None, None, Some("s1")));
    turns(&app, &t, 0, 2).await;
    say(&app, &t, "u2", "user", "look it up").await;
    let call = json!({ "source_kind": "chat_message", "source_ref": "call", "role": "assistant",
        "tool_call_id": "c1", "name": "search", "content": "{\"q\": \"Lisbon trains\"}" });
    assert_eq!(app.client.post("/v1/memories", Some(&t), &call).await.status, 201);
    let long_result = format!("RESULT-HEAD {} RESULT-TAIL", "timetable ".repeat(600));
    let result = json!({ "source_kind": "tool_output", "source_ref": "c1", "name": "search", "content": long_result });
    assert_eq!(app.client.post("/v1/memories", Some(&t), &result).await.status, 201);
    say(&app, &t, "a2", "assistant", "the 7:05 train").await;

    // Keep a few tokens: the final answer alone is under them, the tool result is far over; the
    // cut falls after the whole call and result, never between them.
    let keep = settings([llm_env(&chat), vec![(vars::COMPACT_KEEP_TOKENS, "50".to_owned())]].concat());
    assert_eq!(CompactPolicy::from_settings(&keep).keep, Keep::Tokens(50));
    let report = compactor(&app, &keep).run(&job("acme", "s1")).await.expect("compaction");
    assert_eq!(report, CompactReport::Compacted { messages: 7, outcome: CompactionOutcome::Summarized, reason: None });
    let after = context(&app, &t, "s1", json!({})).await;
    assert_eq!(contents(&after)[1..], ["the 7:05 train"]);
    // The pre-pass cut the long result to a preview before the model read it.
    let prompt = chat.requests()[0]["messages"][1]["content"].as_str().expect("prompt").to_owned();
    assert!(prompt.contains("RESULT-HEAD") && prompt.contains("RESULT-TAIL") && prompt.contains("characters omitted"));
    assert!(prompt.len() < long_result.len(), "the result went to the model whole");
    assert!(prompt.contains(r#"[assistant calls search] "{\"q\": \"Lisbon trains\"}""#), "{prompt}");

    // Keep pairs: a fresh session whose last turn holds the call; it stays whole with its result.
    let t2 = token(&principal("acme", None, None, Some("s2")));
    turns(&app, &t2, 0, 3).await;
    say(&app, &t2, "u9", "user", "look it up").await;
    let call2 = json!({ "source_kind": "chat_message", "source_ref": "call2", "role": "assistant",
        "tool_call_id": "c2", "name": "search", "content": "{\"q\": \"Porto trains\"}" });
    let result2 = json!({ "source_kind": "tool_output", "source_ref": "c2", "name": "search", "content": "7:05" });
    for body in [call2, result2] {
        assert_eq!(app.client.post("/v1/memories", Some(&t2), &body).await.status, 201);
    }
    let pairs = settings([llm_env(&chat), vec![(vars::COMPACT_KEEP_PAIRS, "1".to_owned())]].concat());
    let report = compactor(&app, &pairs).run(&job("acme", "s2")).await.expect("compaction");
    assert!(matches!(report, CompactReport::Compacted { messages: 6, .. }), "{report:?}");
    let after = context(&app, &t2, "s2", json!({})).await;
    let roles: Vec<&str> =
        after["messages"].as_array().expect("messages").iter().map(|m| m["role"].as_str().unwrap_or("")).collect();
    assert_eq!(roles, ["user", "user", "assistant", "tool"], "{after}");
    assert_eq!(after["messages"][2]["tool_calls"][0]["id"], "c2");
}

/// The job cuts where the server that asked judged there was something to cut: by the server's
/// keep, whatever the worker's own settings say, and never keeping fewer than 1,024 tokens for
/// one call's small budget (a router model's call must not fold for good what calls with larger
/// budgets show verbatim).
#[tokio::test]
async fn a_job_cuts_as_the_server_that_asked_for_it_judged() {
    let chat = ScriptedChat::start().await;
    // The worker's settings: its default keep (two turns).
    let worker = settings(llm_env(&chat));
    let queued = |app: &TestApp| {
        let pool = app.db.pool.clone();
        async move {
            let job: Vec<u8> = sqlx::query_scalar("SELECT job FROM apalis.jobs WHERE job_type = 'compact'")
                .fetch_one(&pool)
                .await
                .expect("the job");
            serde_json::from_slice::<CompactJob>(&job).expect("a compact job")
        }
    };
    let t = token(&principal("acme", None, None, Some("s1")));

    // The server keeps one turn.
    let app = TestApp::spawn_with(&[
        (vars::COMPACT_KEEP_PAIRS, "1"),
        (vars::COMPACT_TRIGGER_MESSAGES, "5"),
        (vars::COMPACT_TRIGGER_RATIO, "0"),
    ])
    .await;
    turns(&app, &t, 0, 3).await;
    assert_eq!(context(&app, &t, "s1", json!({})).await["diagnostics"]["trigger"], "messages");
    let job = queued(&app).await;
    assert_eq!(job.keep, Some(Keep::Turns(1)));
    let report = compactor(&app, &worker).run(&job).await.expect("job");
    assert!(matches!(report, CompactReport::Compacted { messages: 4, .. }), "{report:?}");

    // A 300-token budget: half of its room is far less than the two turns kept (about 180
    // tokens), yet the job keeps them.
    let app = TestApp::spawn_with(&[(vars::COMPACT_TRIGGER_RATIO, "0.5"), (vars::COMPACT_TRIGGER_MESSAGES, "0")]).await;
    let words = "word ".repeat(40);
    for i in 0..30 {
        say(&app, &t, &format!("m{i}"), if i % 2 == 0 { "user" } else { "assistant" }, &words).await;
    }
    let small = context(&app, &t, "s1", json!({ "max_input_tokens": 300 })).await;
    assert_eq!(small["diagnostics"]["trigger"], "tokens", "{}", small["diagnostics"]);
    let job = queued(&app).await;
    assert_eq!(job.keep_at_most, Some(1_024));
    let report = compactor(&app, &worker).run(&job).await.expect("job");
    assert!(matches!(report, CompactReport::Compacted { messages: 26, .. }), "{report:?}");
}

#[tokio::test]
async fn a_duplicated_or_retried_job_leaves_one_summary_and_one_record() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", None, None, Some("s1")));
    turns(&app, &t, 0, 5).await;
    let settings = settings(llm_env(&chat));
    let (a, b) = (compactor(&app, &settings), compactor(&app, &settings));
    // Slow enough that both read the session before either records its compaction, and two
    // different summaries, as a real model would write.
    chat.delay_every_answer(Duration::from_millis(300));
    let summary = |n: u8| format!("SESSION INTENT: trip\nSUMMARY: version {n}\nARTIFACTS: none\nNEXT STEPS: none");
    chat.then([ChatAnswer::Content(summary(1)), ChatAnswer::Content(summary(2))]);
    // Two at once (a duplicated job), then the same job again (a retry).
    let once = job("acme", "s1");
    let (first, second) = tokio::join!(a.run(&once), b.run(&once));
    // One is recorded; the other finds it recorded and says so.
    let mut reports = [first.expect("first"), second.expect("second")];
    reports.sort_by_key(|r| matches!(r, CompactReport::Overtaken));
    assert!(matches!(reports[0], CompactReport::Compacted { messages: 6, .. }), "{reports:?}");
    assert_eq!(reports[1], CompactReport::Overtaken);
    assert_eq!(a.run(&job("acme", "s1")).await.expect("retry"), CompactReport::NothingToCompact);
    // Each wrote its own summary; the one not recorded is anonymized at once.
    let summaries = "SELECT count(*) FROM memory_items WHERE source_kind = 'session_summary'";
    assert_eq!(app.db.count(summaries).await, 2);
    assert_eq!(app.db.count(&format!("{summaries} AND anonymized_at IS NULL")).await, 1);
    assert_eq!(app.db.count("SELECT count(*) FROM session_compactions").await, 1);
    assert_eq!(app.db.count("SELECT count(*) FROM session_compaction_requests").await, 0);
    // The summary row's source_ref names the session, where its plan started, the last message
    // it covers and its text.
    let (source_ref, content): (String, String) = sqlx::query_as(
        "SELECT m.source_ref, m.content FROM memory_items m JOIN session_compactions c ON c.summary_id = m.id",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("summary");
    let through: uuid::Uuid =
        sqlx::query_scalar("SELECT through_id FROM session_compactions").fetch_one(&app.db.pool).await.expect("record");
    let session = SessionId::parse("s1").expect("session");
    assert_eq!(source_ref, summary_source_ref(&session, None, through, &content).as_str());
    assert!(source_ref.starts_with(&format!("session-summary:s1:start:{}:", through.simple())), "{source_ref}");
    // It is queued for embedding like every row, so recall finds it.
    let rows = app.db.count("SELECT count(*) FROM memory_items").await;
    assert_eq!(rows, 12, "10 messages and the two summaries");
    let queued = "SELECT count(DISTINCT i->>'item_id') FROM apalis.jobs, \
                  jsonb_array_elements(convert_from(job, 'UTF8')::jsonb->'items') AS i WHERE job_type = 'embed'";
    assert_eq!(app.db.count(queued).await, rows);
}

#[tokio::test]
async fn a_long_backlog_is_compacted_over_several_jobs_and_a_long_agent_turn_is_cut_by_tokens() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", None, None, Some("s1")));
    turns(&app, &t, 0, 150).await;
    // 500-token chunks: a job summarizes at most four of them (about 2,000 tokens of the
    // session's 4,000), then asks for the next job; each builds on the summary before it.
    let small = settings([llm_env(&chat), vec![(vars::COMPACT_CHUNK_TOKENS, "500".to_owned())]].concat());
    let mut covered = Vec::new();
    loop {
        let calls_before = chat.requests().len();
        match compactor(&app, &small).run(&job("acme", "s1")).await.expect("job") {
            CompactReport::Compacted { messages, .. } => covered.push(messages),
            CompactReport::NothingToCompact => break,
            report @ (CompactReport::Overtaken | CompactReport::MessagesChanged | CompactReport::Retrying { .. }) => {
                panic!("one job at a time over a session nobody changes is always recorded: {report:?}")
            }
        }
        assert!(chat.requests().len() - calls_before <= 4, "at most four model calls a job");
        let pending = app.db.count("SELECT count(*) FROM session_compaction_requests").await;
        assert_eq!(pending, i64::from(covered.iter().sum::<usize>() < 296), "the rest is asked for: {covered:?}");
    }
    assert!(covered.len() >= 2, "{covered:?}");
    assert_eq!(covered.iter().sum::<usize>(), 296, "everything but the last two turns: {covered:?}");
    let prompt = chat.requests()[4]["messages"][1]["content"].as_str().expect("prompt").to_owned();
    assert!(prompt.starts_with("PREVIOUS SUMMARY:\n\"SESSION INTENT"), "{prompt}");

    // One user message and a long run of tool calls: the kept turn alone is the whole session,
    // so a caller's budget bounds what is kept, cut between calls, never inside one.
    let t2 = token(&principal("acme", None, None, Some("s2")));
    say(&app, &t2, "u", "user", "research the trains").await;
    for i in 0..20 {
        let call = json!({ "source_kind": "chat_message", "source_ref": format!("s2-call{i}"), "role": "assistant",
            "tool_call_id": format!("s2-c{i}"), "name": "search", "content": "{\"page\": 1}" });
        let result = json!({ "source_kind": "tool_output", "source_ref": format!("s2-c{i}"), "name": "search",
            "content": "a timetable ".repeat(10) });
        for body in [call, result] {
            assert_eq!(app.client.post("/v1/memories", Some(&t2), &body).await.status, 201);
        }
    }
    let by_turns = compactor(&app, &settings(llm_env(&chat)));
    let nothing = by_turns.run(&job("acme", "s2")).await.expect("turns only");
    assert_eq!(nothing, CompactReport::NothingToCompact);
    let bounded = by_turns.run(&CompactJob { keep_at_most: Some(200), ..job("acme", "s2") }).await.expect("bounded");
    let CompactReport::Compacted { messages: cut, .. } = bounded else { panic!("{bounded:?}") };
    assert!(cut > 1 && cut % 2 == 1, "the user message and the older call pairs, whole: {cut}");
    let after = context(&app, &t2, "s2", json!({})).await;
    assert_eq!(after["messages"][1]["role"], "assistant", "{after}");
    assert!(after["messages"][1]["tool_calls"].is_array(), "the window starts at a call, not a result");
}

/// Messages of more than half a chunk each take a model call each: a job still makes no more
/// calls than its chunk limit.
#[tokio::test]
async fn a_job_makes_no_more_model_calls_than_its_chunk_limit() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let compactor = one_call_per_message(&app, &chat).await;
    assert_eq!(compactor.policy.max_chunks, 4);
    let report = compactor.run(&job("acme", "s1")).await.expect("job");
    let CompactReport::Compacted { messages, .. } = report else { panic!("{report:?}") };
    assert_eq!((chat.requests().len(), messages), (4, 4), "one call per message, four messages");
}

/// One tool call whose calls and results take more chunks than a job asks for is truncated
/// without a model call: asked in as many calls as it takes, it could outlast the job's timeout
/// on every try, and be asked again forever.
#[tokio::test]
async fn a_unit_too_large_for_one_job_is_truncated_without_a_model_call() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", None, None, Some("s1")));
    let long = about_260_tokens();
    // Six parallel calls and their results open the session: one unit of twelve messages.
    for i in 0..6 {
        let call = json!({ "source_kind": "chat_message", "source_ref": format!("call{i}"), "role": "assistant",
            "tool_call_id": format!("c{i}"), "name": "search", "content": format!("{{\"q\": \"{long}\"}}") });
        assert_eq!(app.client.post("/v1/memories", Some(&t), &call).await.status, 201);
    }
    for i in 0..6 {
        let result =
            json!({ "source_kind": "tool_output", "source_ref": format!("c{i}"), "name": "search", "content": long });
        assert_eq!(app.client.post("/v1/memories", Some(&t), &result).await.status, 201);
    }
    turns(&app, &t, 0, 3).await;
    let compactor =
        compactor(&app, &settings([llm_env(&chat), vec![(vars::COMPACT_CHUNK_TOKENS, "500".to_owned())]].concat()));
    assert_eq!(compactor.policy.max_chunks, 4);
    let report = compactor.run(&job("acme", "s1")).await.expect("job");
    let truncated = CompactionOutcome::Truncated;
    assert_eq!(
        report,
        CompactReport::Compacted { messages: 12, outcome: truncated, reason: Some("unit_too_large".into()) }
    );
    assert!(chat.requests().is_empty(), "no model call");
}

/// Ten turns in session s1 of about 260 tokens a message, and a compactor with 500-token
/// chunks: two messages never share a chunk, seven fit in four chunks' worth of tokens.
async fn one_call_per_message(app: &TestApp, chat: &ScriptedChat) -> Compactor {
    let t = token(&principal("acme", None, None, Some("s1")));
    let long = about_260_tokens();
    for i in 0..10 {
        say(app, &t, &format!("u{i}"), "user", &format!("question {i} {long}")).await;
        say(app, &t, &format!("a{i}"), "assistant", &format!("answer {i} {long}")).await;
    }
    compactor(app, &settings([llm_env(chat), vec![(vars::COMPACT_CHUNK_TOKENS, "500".to_owned())]].concat()))
}

fn about_260_tokens() -> String {
    let tokenizer = mnemo_models::Tokenizer::new(TokenizerName::O200kBase);
    let mut long = String::from("about the trip:");
    while mnemo_core::TokenCounter::count(&tokenizer, &long) < 260 {
        long.push_str(" the early train to Lisbon");
    }
    long
}

/// A chunk that fails after others were summarized keeps what they summarized: the record
/// covers their messages, and the next job goes on from there. A first chunk that fails is a
/// failure as before.
#[tokio::test]
async fn a_chunk_that_fails_keeps_the_chunks_summarized_before_it() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let compactor = one_call_per_message(&app, &chat).await;
    let summarized =
        |messages| CompactReport::Compacted { messages, outcome: CompactionOutcome::Summarized, reason: None };
    let by_the_rule = || ChatAnswer::Hang(Duration::ZERO);
    let requests = "SELECT count(*) FROM session_compaction_requests";
    let latest_summary = "SELECT content FROM memory_items m JOIN session_compactions c ON c.summary_id = m.id \
                          ORDER BY c.through_time DESC LIMIT 1";

    // A failure that passes, at the third chunk.
    chat.then([by_the_rule(), by_the_rule(), ChatAnswer::Status(500)]);
    assert_eq!(compactor.run(&job("acme", "s1")).await.expect("job"), summarized(2));
    assert_eq!(app.db.count(requests).await, 1, "the rest is asked for");
    let summary: String = sqlx::query_scalar(latest_summary).fetch_one(&app.db.pool).await.expect("summary");
    assert!(summary.contains("1 new messages since the previous summary; last: [assistant] answer 0"), "{summary}");

    // An answer that cannot be used, at the second chunk: the next job builds on the first part.
    chat.then([by_the_rule(), ChatAnswer::Malformed]);
    assert_eq!(compactor.run(&job("acme", "s1")).await.expect("job"), summarized(1));
    let prompt = chat.requests()[3]["messages"][1]["content"].as_str().expect("prompt").to_owned();
    assert!(prompt.contains("last: [assistant] answer 0"), "built on the summary before it: {prompt}");
    let summary: String = sqlx::query_scalar(latest_summary).fetch_one(&app.db.pool).await.expect("summary");
    assert!(summary.contains("last: [user] question 1"), "{summary}");

    // At the first chunk, nothing was summarized: the job truncates as before.
    chat.then([ChatAnswer::Malformed]);
    let report = compactor.run(&job("acme", "s1")).await.expect("job");
    let truncated = CompactionOutcome::Truncated;
    assert_eq!(report, CompactReport::Compacted { messages: 4, outcome: truncated, reason: Some("unparsable".into()) });
    let covered = "SELECT sum(messages)::bigint FROM session_compactions";
    assert_eq!(app.db.count(covered).await, 7, "2 + 1 + 4 messages, none twice");

    // A chunk that ended between a call and its result: the summary kept is the one before it,
    // which read only what its record covers.
    let t2 = token(&principal("acme", None, None, Some("s2")));
    let long = about_260_tokens();
    say(&app, &t2, "u", "user", &format!("research the trains {long}")).await;
    let call = json!({ "source_kind": "chat_message", "source_ref": "s2-call", "role": "assistant",
        "tool_call_id": "s2-c", "name": "search", "content": format!("{{\"q\": \"{long}\"}}") });
    let result = json!({ "source_kind": "tool_output", "source_ref": "s2-c", "name": "search", "content": long });
    for body in [call, result] {
        assert_eq!(app.client.post("/v1/memories", Some(&t2), &body).await.status, 201);
    }
    turns(&app, &t2, 0, 3).await;
    chat.then([by_the_rule(), by_the_rule(), ChatAnswer::Status(500)]);
    assert_eq!(compactor.run(&job("acme", "s2")).await.expect("job"), summarized(1));
    let summary: String = sqlx::query_scalar(
        "SELECT m.content FROM memory_items m JOIN session_compactions c ON c.summary_id = m.id \
         WHERE c.session_id = 's2'",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("summary");
    assert!(summary.contains("1 new messages since the start; last: [user] research the trains"), "{summary}");
}

/// A model that answers garbage, or fails on the last try, truncates; nothing stored is lost.
#[tokio::test]
async fn a_failing_hanging_or_garbage_model_truncates_and_loses_nothing() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let settings = settings(llm_env(&chat));
    // A well-formed summary far over its max_tokens (300), from a server that ignored them.
    let sprawling = format!(
        "SESSION INTENT: x\nSUMMARY: {}\nARTIFACTS: none\nNEXT STEPS: none",
        "they talked about the weather again ".repeat(150)
    );
    let cases: [(&str, ChatAnswer, &str); 6] = [
        ("s1", ChatAnswer::Status(500), "http_5xx"),
        ("s2", ChatAnswer::Hang(Duration::from_secs(3)), "timeout"),
        ("s3", ChatAnswer::Content("Sure! Here is a summary: they talked.".into()), "unparsable"),
        ("s4", ChatAnswer::Runaway, "truncated"),
        ("s5", ChatAnswer::Malformed, "unparsable"),
        ("s7", ChatAnswer::Content(sprawling), "too_long"),
    ];
    // A failure that passes (a 5xx, a timeout) truncates only on the last try.
    let last_try = CompactJob { summary_failures: SUMMARY_RETRIES.len() as u32, ..job("acme", "s1") };
    for (sid, answer, reason) in cases {
        let t = token(&principal("acme", None, None, Some(sid)));
        turns(&app, &t, 0, 4).await;
        chat.then([answer]);
        let job = CompactJob { session_id: SessionId::parse(sid).expect("session"), ..last_try.clone() };
        let report = compactor(&app, &settings).run(&job).await.expect("a failed model is not a failed job");
        assert_eq!(
            report,
            CompactReport::Compacted {
                messages: 4,
                outcome: CompactionOutcome::Truncated,
                reason: Some(reason.into())
            },
            "{sid}"
        );
        let window = context(&app, &t, sid, json!({})).await;
        assert_eq!(contents(&window).len(), 4, "{sid}: the window starts after the truncated messages");
        assert!(window["diagnostics"]["summary"].is_null());
        let listed = app.client.get(&format!("/v1/sessions/{sid}/messages"), Some(&t)).await;
        assert_eq!(listed.body["messages"].as_array().map(Vec::len), Some(8), "{sid}: every message is still there");
    }
    assert_eq!(app.db.count("SELECT count(*) FROM memory_items WHERE source_kind = 'session_summary'").await, 0);

    // No model at all: truncation, recorded as such.
    let t = token(&principal("acme", None, None, Some("s6")));
    turns(&app, &t, 0, 3).await;
    let none = compactor(&app, &ContextSettings::default()).run(&job("acme", "s6")).await.expect("truncation");
    assert_eq!(
        none,
        CompactReport::Compacted {
            messages: 2,
            outcome: CompactionOutcome::Truncated,
            reason: Some("no_model".into())
        }
    );
}

/// An outage of the model is waited out: each try that meets it queues the job again, later,
/// records nothing and keeps the session's one request; once the model answers, the messages are
/// summarized, with nothing left out.
#[tokio::test]
async fn a_model_outage_is_waited_out_before_anything_is_truncated() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let settings = settings(llm_env(&chat));
    let t = token(&principal("acme", None, None, Some("s1")));
    turns(&app, &t, 0, 4).await;
    let store = app.db.store();
    let (tenant, session) = (TenantId::parse("acme").expect("tenant"), SessionId::parse("s1").expect("session"));
    assert!(
        store.request_compaction(&tenant, &session, CompactionTrigger::Messages, None, None).await.expect("request")
    );
    chat.outage(Some(ChatAnswer::Status(503)));
    // The worker takes the queued job: it is the one run below.
    let take =
        "UPDATE apalis.jobs SET status = 'Running' WHERE job_type = 'compact' AND status IN ('Pending', 'Queued')";
    let fetched = "UPDATE apalis.jobs SET status = 'Queued' WHERE job_type = 'compact' AND status = 'Pending'";
    let waiting = "SELECT count(*) FROM apalis.jobs WHERE job_type = 'compact' AND status IN ('Pending', 'Queued')";
    sqlx::query(take).execute(&app.db.pool).await.expect("take");
    let mut job = job("acme", "s1");
    for (failures, after) in SUMMARY_RETRIES.iter().enumerate() {
        let report = compactor(&app, &settings).run(&job).await.expect("job");
        assert_eq!(report, CompactReport::Retrying { reason: "http_5xx".into(), after: *after }, "try {failures}");
        let queued = format!(
            "SELECT count(*) FROM apalis.jobs WHERE job_type = 'compact' AND status = 'Pending' \
             AND convert_from(job, 'UTF8')::jsonb->>'summary_failures' = '{}' \
             AND run_at > now() + make_interval(secs => {})",
            failures + 1,
            after.as_secs() - 5
        );
        assert_eq!(app.db.count(&queued).await, 1, "try {failures}: queued again, due later");
        // A duplicate of the job (or an operator's --now) meets the outage too, and queues no
        // second chain of tries, also once a worker has fetched the waiting one.
        sqlx::query(fetched).execute(&app.db.pool).await.expect("fetch");
        let duplicate = compactor(&app, &settings).run(&job).await.expect("job");
        assert!(matches!(duplicate, CompactReport::Retrying { .. }), "{duplicate:?}");
        assert_eq!(app.db.count(waiting).await, 1, "try {failures}: one job waits");
        sqlx::query(take).execute(&app.db.pool).await.expect("take");
        job.summary_failures += 1;
    }
    assert_eq!(app.db.count("SELECT count(*) FROM session_compactions").await, 0, "nothing recorded");
    // The request is the retried job's: a trigger now queues no second job.
    let before = compact_jobs(&app).await;
    assert!(
        !store.request_compaction(&tenant, &session, CompactionTrigger::Messages, None, None).await.expect("request")
    );
    assert_eq!(compact_jobs(&app).await, before);

    chat.outage(None);
    let report = compactor(&app, &settings).run(&job).await.expect("job");
    assert_eq!(report, CompactReport::Compacted { messages: 4, outcome: CompactionOutcome::Summarized, reason: None });
    let window = context(&app, &t, "s1", json!({})).await;
    assert!(window["diagnostics"]["summary"]["id"].is_string(), "{window}");
    assert!(contents(&window)[0].contains("4 new messages since the start"), "{window}");
}

/// A model that asks for a wait (Retry-After on its 503) is tried again no sooner, though the
/// first retry's own delay is shorter; but never later than the longest retry's wait, within
/// which the session's request stays its job's (a stale one would queue a second job).
#[tokio::test]
async fn a_summary_retry_waits_as_long_as_the_model_asked_up_to_the_longest_wait() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let settings = settings(llm_env(&chat));
    let t = token(&principal("acme", None, None, Some("s1")));
    turns(&app, &t, 0, 4).await;
    let longest = SUMMARY_RETRIES[SUMMARY_RETRIES.len() - 1];
    assert!(SUMMARY_RETRIES[0] < Duration::from_secs(170) && Duration::from_secs(170) < longest);
    assert!(longest < mnemo_store::STALE_REQUEST);
    for (asked, waited) in [(170, Duration::from_secs(170)), (290, longest)] {
        chat.then([ChatAnswer::Busy { status: 503, retry_after_secs: asked }]);
        let report = compactor(&app, &settings).run(&job("acme", "s1")).await.expect("job");
        assert_eq!(report, CompactReport::Retrying { reason: "http_5xx".into(), after: waited }, "{asked} s asked");
    }
}

#[tokio::test]
async fn overflow_keeps_the_summary_and_the_last_turns_and_schedules_compaction() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn_with(&[(vars::COMPACT_TRIGGER_MESSAGES, "0"), (vars::COMPACT_TRIGGER_RATIO, "0")]).await;
    let t = token(&principal("acme", None, None, Some("s1")));
    turns(&app, &t, 0, 3).await;
    compactor(&app, &settings(llm_env(&chat))).run(&job("acme", "s1")).await.expect("first compaction");
    turns(&app, &t, 3, 4).await;

    let normal = context(&app, &t, "s1", json!({})).await;
    assert_eq!(normal["diagnostics"]["compaction"], "used");
    assert_eq!(contents(&normal).len(), 1 + 12, "summary and every message since");
    let overflow = context(&app, &t, "s1", json!({ "overflow": true })).await;
    assert_eq!(overflow["diagnostics"]["trigger"], "overflow");
    assert_eq!(overflow["diagnostics"]["compaction"], "scheduled");
    let texts = contents(&overflow);
    assert!(texts[0].starts_with(SUMMARY_PREFIX));
    assert_eq!(
        &texts[1..],
        [
            "question 5 about the trip to Lisbon",
            "answer 5: take the early train",
            "question 6 about the trip to Lisbon",
            "answer 6: take the early train"
        ]
    );
    assert_eq!(chat.requests().len(), 1, "overflow recovery never calls a model");
    // A window that fit by our count, refused by a model that counts more: the retry leaves a
    // quarter of the budget unused.
    let fitted = overflow["diagnostics"]["tokens"]["total"].as_u64().expect("total");
    let again = context(&app, &t, "s1", json!({ "overflow": true, "max_input_tokens": fitted })).await;
    assert_eq!(again["diagnostics"]["budget"].as_u64(), Some(fitted - fitted / 4), "{again}");
    assert!(again["diagnostics"]["tokens"]["total"].as_u64().expect("total") <= fitted - fitted / 4, "{again}");
    let trigger: String = sqlx::query_scalar("SELECT trigger FROM session_compaction_requests")
        .fetch_one(&app.db.pool)
        .await
        .expect("request");
    assert_eq!(trigger, "overflow");
}

#[tokio::test]
async fn compaction_stays_inside_its_session_and_tenant() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let mine = token(&principal("acme", None, None, Some("s1")));
    let neighbour = token(&principal("acme", None, None, Some("s2")));
    let other_tenant = token(&principal("globex", None, None, Some("s1")));
    for t in [&mine, &neighbour, &other_tenant] {
        turns(&app, t, 0, 4).await;
    }
    compactor(&app, &settings(llm_env(&chat))).run(&job("acme", "s1")).await.expect("compaction");
    assert_eq!(contents(&context(&app, &mine, "s1", json!({})).await).len(), 5);
    for (t, sid) in [(&neighbour, "s2"), (&other_tenant, "s1")] {
        let window = context(&app, t, sid, json!({})).await;
        assert_eq!(contents(&window).len(), 8, "{sid}");
        assert!(window["diagnostics"]["summary"].is_null());
        assert!(window["diagnostics"]["window_starts_after"].is_null());
    }
    // Another session's token cannot read or trigger this one's context.
    let reply = app.client.post("/v1/sessions/s1/context", Some(&neighbour), &json!({ "overflow": true })).await;
    assert_eq!((reply.status, reply.code()), (403, "session_mismatch"));
    assert_eq!(app.db.count("SELECT count(*) FROM session_compaction_requests").await, 0);
}

/// Runs the runbook without blocking this test's runtime (the scripted server lives on it).
async fn run_runbook(app: &TestApp, env: &[(&str, String)], args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(mnemo_testkit::binary("mnemo-runbook").expect("runbook"))
        .args(args)
        .env_clear()
        .env(vars::DATABASE_URL, &app.db.url)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .await
        .expect("runbook runs")
}

/// The runbook's JSON answer; it must succeed.
async fn runbook(app: &TestApp, env: &[(&str, String)], args: &[&str]) -> Value {
    let output = run_runbook(app, env, args).await;
    assert!(output.status.success(), "{args:?}: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{args:?}: {e}: {}", String::from_utf8_lossy(&output.stdout)))
}

#[tokio::test]
async fn the_runbook_shows_a_session_and_compacts_it_on_demand() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", None, None, Some("s1")));
    turns(&app, &t, 0, 4).await;
    let args = |command: &'static str, extra: &[&'static str]| {
        [&["session", command, "--tenant", "acme", "--session", "s1", "--json"], extra].concat()
    };

    // A mistyped session is refused by name, and nothing is queued; nor is it shown as empty.
    let shown = run_runbook(&app, &[], &["session", "show", "--tenant", "acme", "--session", "s1x"]).await;
    let stderr = String::from_utf8_lossy(&shown.stderr);
    assert!(!shown.status.success() && stderr.contains("session s1x of tenant acme has no messages"), "{stderr}");
    for extra in [&[][..], &["--dry-run"][..]] {
        let typo = ["session", "compact", "--tenant", "acme", "--session", "s1x", "--json"];
        let refused = run_runbook(&app, &[], &[&typo[..], extra].concat()).await;
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && stderr.contains("session s1x of tenant acme has no messages"), "{stderr}");
    }
    assert_eq!(app.db.count("SELECT count(*) FROM apalis.jobs WHERE job_type = 'compact'").await, 0);

    let plan = runbook(&app, &[], &args("compact", &["--dry-run"])).await;
    assert_eq!(
        (plan["messages"].as_u64(), plan["kept"].as_u64(), plan["would"].as_str()),
        (Some(4), Some(4), Some("truncate"))
    );
    assert_eq!(app.db.count("SELECT count(*) FROM session_compactions").await, 0, "a dry run changes nothing");
    assert_eq!(runbook(&app, &[], &args("compact", &[])).await["queued"], true);
    assert_eq!(runbook(&app, &[], &args("compact", &[])).await["queued"], false, "one request per session");
    let shown = runbook(&app, &[], &args("show", &[])).await;
    assert_eq!(shown["pending"], "operator");
    assert!(shown["messages"][0].get("content").is_none(), "content only with --content");
    assert!(shown["messages"][0].get("name").is_none(), "a participant's name only with --content");
    assert_eq!(shown["truncated"], false);

    // --now without a model here would truncate for good: refused unless asked for.
    let refused = run_runbook(&app, &[], &args("compact", &["--now"])).await;
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--truncate"));
    assert_eq!(app.db.count("SELECT count(*) FROM session_compactions").await, 0, "refused: nothing recorded");

    let now = runbook(&app, &llm_env(&chat), &args("compact", &["--now"])).await;
    assert_eq!((now["messages"].as_u64(), now["outcome"].as_str()), (Some(4), Some("summarized")));
    let shown = runbook(&app, &[], &args("show", &["--content"])).await;
    assert!(shown["pending"].is_null());
    let compacted: Vec<bool> =
        shown["messages"].as_array().expect("messages").iter().map(|m| m["compacted"] == true).collect();
    assert_eq!(compacted, [true, true, true, true, false, false, false, false]);
    assert_eq!(shown["messages"][0]["content"], "question 0 about the trip to Lisbon");
    assert_eq!(shown["compactions"][0]["outcome"], "summarized");
    assert_eq!(shown["compactions"][0]["trigger"], "operator");
    assert_eq!(shown["compactions"][0]["summary_id"], shown["summary_id"]);

    // Without a model, --truncate truncates here and now.
    let t2 = token(&principal("acme", None, None, Some("s2")));
    turns(&app, &t2, 0, 4).await;
    let truncate = ["session", "compact", "--tenant", "acme", "--session", "s2", "--json", "--now", "--truncate"];
    let done = runbook(&app, &[], &truncate).await;
    assert_eq!((done["outcome"].as_str(), done["reason"].as_str()), (Some("truncated"), Some("no_model")));

    // With a model that is down: --now leaves it to the workers' tries, --truncate truncates.
    let t3 = token(&principal("acme", None, None, Some("s3")));
    turns(&app, &t3, 0, 4).await;
    chat.outage(Some(ChatAnswer::Status(502)));
    let s3 = |extra: &[&'static str]| {
        [&["session", "compact", "--tenant", "acme", "--session", "s3", "--json"], extra].concat()
    };
    let retrying = runbook(&app, &llm_env(&chat), &s3(&["--now"])).await;
    assert_eq!((retrying["outcome"].as_str(), retrying["retry_after_s"].as_u64()), (Some("retrying"), Some(15)));
    let done = runbook(&app, &llm_env(&chat), &s3(&["--now", "--truncate"])).await;
    assert_eq!((done["outcome"].as_str(), done["reason"].as_str()), (Some("truncated"), Some("http_5xx")));
}

/// Two compactions of one session planned from the same start (a stale request queued again, an
/// operator's `session compact` beside the worker): the second to finish is not recorded, so the
/// summary the first recorded is never dropped for one that does not include it.
#[tokio::test]
async fn a_compaction_planned_before_another_was_recorded_is_not_recorded() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", None, None, Some("s1")));
    turns(&app, &t, 0, 4).await;
    let (tenant, session) = (TenantId::parse("acme").expect("tenant"), SessionId::parse("s1").expect("session"));
    let store = app.db.store();
    let report = compactor(&app, &settings(llm_env(&chat))).run(&job("acme", "s1")).await.expect("job");
    assert!(matches!(report, CompactReport::Compacted { outcome: CompactionOutcome::Summarized, .. }), "{report:?}");
    let recorded = store.session_compactions(&tenant, &session).await.expect("compactions");
    assert_eq!(recorded.len(), 1);

    // The other job planned from the start (no compaction then), covers every message and wrote
    // its summary before recording.
    let messages = store.session_messages(&tenant, &session, None, 100).await.expect("messages");
    let last = messages.last().expect("a message");
    let written = summary_through(&app, last, "the stale plan's summary").await;
    let stale = mnemo_store::NewCompaction {
        from: None,
        through: last.cursor(),
        covered: messages.iter().map(|m| m.id).collect(),
        previous_summary: None,
        outcome: CompactionOutcome::Summarized,
        reason: None,
        summary_id: Some(written.id),
        model: None,
        trigger: CompactionTrigger::Operator,
        extract_for: Vec::new(),
    };
    // A request made after the first job recorded (its follow-up) outlives the overtaken one.
    assert!(
        store.request_compaction(&tenant, &session, CompactionTrigger::Operator, None, None).await.expect("request")
    );
    assert_eq!(
        store.record_compaction(&tenant, &session, &stale, &job("acme", "s1")).await.expect("record"),
        Recording::Overtaken
    );
    assert_eq!(
        app.db.count("SELECT count(*) FROM session_compaction_requests").await,
        1,
        "a later request was cleared"
    );
    let after = store.session_compactions(&tenant, &session).await.expect("compactions");
    assert_eq!(after.len(), 1, "the stale plan's compaction is not recorded");
    let window = context(&app, &t, "s1", json!({})).await;
    assert!(!window["diagnostics"]["summary"].is_null(), "the first job's summary stays in effect");

    // Its summary leaves recall and is anonymized, audited; the recorded one stays; a summary
    // under the same source_ref can be written again.
    assert_eq!(app.db.count(&anonymized(written.id)).await, 1, "the unrecorded summary is anonymized");
    assert_eq!(app.db.count(&live(after[0].summary_id.expect("a summary"))).await, 1, "the recorded one is not");
    let audited =
        format!("SELECT count(*) FROM audit_log WHERE item_id = '{}' AND reason = 'compaction_overtaken'", written.id);
    assert_eq!(app.db.count(&audited).await, 1);
    let next = summary_through(&app, last, "the next compaction's summary").await;
    assert!(next.was_new && next.id != written.id);

    // That one's job crashed before recording: the next compaction that records anonymizes it.
    turns(&app, &t, 4, 3).await;
    let report = compactor(&app, &settings(llm_env(&chat))).run(&job("acme", "s1")).await.expect("job");
    assert!(matches!(report, CompactReport::Compacted { outcome: CompactionOutcome::Summarized, .. }), "{report:?}");
    assert_eq!(app.db.count(&anonymized(next.id)).await, 1, "the crashed job's summary is anonymized");
    assert_eq!(
        app.db
            .count("SELECT count(*) FROM memory_items WHERE source_kind = 'session_summary' AND anonymized_at IS NULL")
            .await,
        2
    );

    // A plan that started at the first of the two records, recorded after the second: overtaken
    // by the latest record, whatever the earlier ones say.
    let recorded = store.session_compactions(&tenant, &session).await.expect("compactions");
    assert_eq!(recorded.len(), 2);
    let first = recorded.iter().min_by_key(|c| (c.through_time, c.through_id)).expect("a record");
    let messages = store.session_messages(&tenant, &session, None, 100).await.expect("messages");
    let from_first = mnemo_store::NewCompaction {
        from: Some(mnemo_store::MessageCursor { event_time: first.through_time, id: first.through_id }),
        through: messages.last().expect("a message").cursor(),
        covered: messages
            .iter()
            .filter(|m| (m.event_time, m.id) > (first.through_time, first.through_id))
            .map(|m| m.id)
            .collect(),
        summary_id: None,
        outcome: CompactionOutcome::Truncated,
        ..stale
    };
    assert_eq!(
        store.record_compaction(&tenant, &session, &from_first, &job("acme", "s1")).await.expect("record"),
        Recording::Overtaken
    );
}

fn live(id: uuid::Uuid) -> String {
    format!("SELECT count(*) FROM memory_items WHERE id = '{id}' AND deleted_at IS NULL AND anonymized_at IS NULL")
}

fn anonymized(id: uuid::Uuid) -> String {
    format!("SELECT count(*) FROM memory_items WHERE id = '{id}' AND deleted_at IS NOT NULL AND content = '[REDACTED]'")
}

/// In a session two users share, a summary stamped with the one who wrote last holds the other's
/// words too. Once the other's messages are anonymized (a retention sweep after they deleted
/// them), no row of theirs names the session; their erasure still finds the summary, by the
/// users its compaction recorded.
#[tokio::test]
async fn an_erasure_finds_a_summary_of_the_users_words_after_their_messages_are_gone() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let xavier = token(&principal("acme", Some("xavier"), None, Some("s1")));
    let yara = token(&principal("acme", Some("yara"), None, Some("s1")));
    turns(&app, &xavier, 0, 3).await;
    turns(&app, &yara, 3, 4).await;
    let compactor = compactor(&app, &settings(llm_env(&chat)));
    let report = compactor.run(&job("acme", "s1")).await.expect("job");
    assert!(matches!(report, CompactReport::Compacted { outcome: CompactionOutcome::Summarized, .. }), "{report:?}");
    let summaries = "SELECT count(*) FROM memory_items WHERE source_kind = 'session_summary' AND anonymized_at IS NULL";
    assert_eq!(app.db.count(&format!("{summaries} AND user_id = 'yara'")).await, 1, "stamped with the last writer");

    // Xavier's messages are deleted and, past the TTL, anonymized by a sweep.
    sqlx::query("UPDATE memory_items SET deleted_at = now() - interval '40 days' WHERE user_id = 'xavier'")
        .execute(&app.db.pool)
        .await
        .expect("deleted");
    let (store, acme) = (app.db.store(), TenantId::parse("acme").expect("tenant"));
    let retention = mnemo_config::RetentionSettings::from_env(&Env::from_pairs(Vec::<(&str, String)>::new()))
        .expect("retention settings");
    let options = mnemo_jobs::SweepOptions::new(&retention, "test");
    let swept = mnemo_jobs::sweep_tenant(&store, &acme, &options, |_, _| {}).await.expect("sweep");
    assert_eq!(swept.anonymized_total(), 6);
    assert_eq!(app.db.count("SELECT count(*) FROM memory_items WHERE user_id = 'xavier'").await, 0);

    let user = mnemo_core::UserId::parse("xavier").expect("user");
    let plan = store.erasure_plan(&acme, &user).await.expect("plan");
    assert_eq!(plan.rows_by_kind.get("session_summary"), Some(&1), "{plan:?}");
    mnemo_jobs::erase_user(&store, &acme, &user, 100, false, "test", |_, _| {}).await.expect("erasure");
    assert_eq!(app.db.count(summaries).await, 0, "the summary holding xavier's words is left");

    // Yara goes on; the next summary holds none of xavier's words, and erasing him again
    // leaves it.
    turns(&app, &yara, 7, 4).await;
    let report = compactor.run(&job("acme", "s1")).await.expect("job");
    assert!(matches!(report, CompactReport::Compacted { outcome: CompactionOutcome::Summarized, .. }), "{report:?}");
    assert_eq!(app.db.count(summaries).await, 1);
    let plan = store.erasure_plan(&acme, &user).await.expect("plan");
    assert_eq!(plan.rows(), 0, "{plan:?}");
    mnemo_jobs::erase_user(&store, &acme, &user, 100, false, "test", |_, _| {}).await.expect("again");
    assert_eq!(app.db.count(summaries).await, 1, "erasing xavier again took yara's later summary");
}

/// The summary a compaction builds on, deleted (or erased with its user) while the model writes
/// the next: the next, which carries it forward, is not recorded either.
#[tokio::test]
async fn a_summary_deleted_while_the_next_is_written_is_not_carried_forward() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", None, None, Some("s1")));
    turns(&app, &t, 0, 4).await;
    let compactor = compactor(&app, &settings(llm_env(&chat)));
    let once = job("acme", "s1");
    assert!(matches!(compactor.run(&once).await.expect("first"), CompactReport::Compacted { .. }));
    let first: uuid::Uuid = sqlx::query_scalar("SELECT summary_id FROM session_compactions")
        .fetch_one(&app.db.pool)
        .await
        .expect("summary");
    turns(&app, &t, 4, 3).await;
    chat.delay_every_answer(Duration::from_millis(600));
    let (report, deleted) = tokio::join!(compactor.run(&once), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        app.client.delete(&format!("/v1/memories/{first}"), Some(&t)).await
    });
    assert_eq!(deleted.status, 200, "{:?}", deleted.body);
    assert_eq!(report.expect("job"), CompactReport::MessagesChanged);
    assert_eq!(app.db.count("SELECT count(*) FROM session_compactions").await, 1, "only the first");
    let live = "SELECT count(*) FROM memory_items WHERE source_kind = 'session_summary' AND deleted_at IS NULL";
    assert_eq!(app.db.count(live).await, 0, "neither summary is live");
}

/// A message deleted (or its user erased) while the model writes the summary: the summary, which
/// may quote it, is anonymized and not recorded, and the compaction is planned again without it.
#[tokio::test]
async fn a_message_deleted_while_its_summary_is_written_is_in_no_summary() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", None, None, Some("s1")));
    turns(&app, &t, 0, 4).await;
    let first: uuid::Uuid = sqlx::query_scalar("SELECT id FROM memory_items WHERE source_ref LIKE 'u0-%'")
        .fetch_one(&app.db.pool)
        .await
        .expect("u0");
    chat.delay_every_answer(Duration::from_millis(600));
    let compactor = compactor(&app, &settings(llm_env(&chat)));
    let once = job("acme", "s1");
    let (report, deleted) = tokio::join!(compactor.run(&once), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        app.client.delete(&format!("/v1/memories/{first}"), Some(&t)).await
    });
    assert_eq!(deleted.status, 200, "{:?}", deleted.body);
    assert_eq!(report.expect("job"), CompactReport::MessagesChanged);
    let summaries = "SELECT count(*) FROM memory_items WHERE source_kind = 'session_summary'";
    assert_eq!(app.db.count(summaries).await, 1, "the summary was written");
    assert_eq!(app.db.count(&format!("{summaries} AND content = '[REDACTED]'")).await, 1, "and anonymized");
    assert_eq!(app.db.count("SELECT count(*) FROM session_compactions").await, 0);
    assert_eq!(app.db.count("SELECT count(*) FROM session_compaction_requests").await, 1, "asked for again");
    assert_eq!(compact_jobs(&app).await, 1);

    chat.delay_every_answer(Duration::ZERO);
    let again = compactor.run(&once).await.expect("job");
    assert!(matches!(again, CompactReport::Compacted { outcome: CompactionOutcome::Summarized, .. }), "{again:?}");
    let prompt =
        chat.requests().last().expect("a request")["messages"][1]["content"].as_str().expect("prompt").to_owned();
    assert!(!prompt.contains("question 0 "), "the deleted message went to the model: {prompt}");
    assert_eq!(app.db.count(&format!("{summaries} AND anonymized_at IS NULL")).await, 1);
}

/// A summary that quotes question 0.
const QUOTES_QUESTION_0: &str =
    "SESSION INTENT: trip\nSUMMARY: question 0 about the trip to Lisbon\nARTIFACTS: none\nNEXT STEPS: none";

/// Writes the summary of session s1 through `last` a job's try would write (planned from the
/// session's start): the write's answer.
async fn summary_through(app: &TestApp, last: &mnemo_store::SessionMessage, text: &str) -> mnemo_store::Remembered {
    let session = SessionId::parse("s1").expect("session");
    let summary = NewMemory::session_summary(
        TenantId::parse("acme").expect("tenant"),
        session.clone(),
        None,
        None,
        summary_source_ref(&session, None, last.id, text),
        MemoryText::parse(text).expect("text"),
        last.event_time,
    );
    app.db.store().remember(&summary).await.expect("a try's summary")
}

/// A job that wrote its summary and crashed before recording it, retried after a message it
/// summarized was deleted: the retry records the summary its model writes now, and the earlier
/// try's, which quotes the deleted message, is anonymized. Before, the retry landed on the same
/// source_ref and took the earlier row over.
#[tokio::test]
async fn a_retried_job_never_takes_over_the_summary_of_an_earlier_try() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", None, None, Some("s1")));
    turns(&app, &t, 0, 4).await;
    let (tenant, session) = (TenantId::parse("acme").expect("tenant"), SessionId::parse("s1").expect("session"));
    let compactor = compactor(&app, &settings(llm_env(&chat)));
    let plan = compactor.plan(&tenant, &session, None, None).await.expect("plan");
    let (first, last) = (&plan.messages[0], &plan.messages[plan.cut - 1]);
    let orphan = summary_through(&app, last, QUOTES_QUESTION_0).await.id;
    let deleted = app.client.delete(&format!("/v1/memories/{}", first.id), Some(&t)).await;
    assert_eq!(deleted.status, 200, "{:?}", deleted.body);

    let report = compactor.run(&job("acme", "s1")).await.expect("job");
    assert!(matches!(report, CompactReport::Compacted { outcome: CompactionOutcome::Summarized, .. }), "{report:?}");
    let recorded = app.db.store().session_compactions(&tenant, &session).await.expect("compactions");
    assert_ne!(recorded[0].summary_id, Some(orphan), "the earlier try's summary was taken over");
    assert_eq!(app.db.count(&anonymized(orphan)).await, 1, "the earlier try's summary is anonymized");
    let window = context(&app, &t, "s1", json!({})).await;
    assert!(!contents(&window).iter().any(|m| m.contains("question 0 ")), "{window}");
}

/// A job that crashed after writing its summary, retried after the messages it covered were
/// deleted: the retry finds nothing to compact, and no record may ever come to drop the earlier
/// try's summary, which quotes them. The retry drops it. A job still writing one meanwhile is
/// then not recorded over a dropped summary.
#[tokio::test]
async fn a_job_that_finds_nothing_to_compact_drops_the_summary_an_earlier_try_left() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", None, None, Some("s1")));
    turns(&app, &t, 0, 3).await;
    let (tenant, session) = (TenantId::parse("acme").expect("tenant"), SessionId::parse("s1").expect("session"));
    let compactor = compactor(&app, &settings(llm_env(&chat)));
    let plan = compactor.plan(&tenant, &session, None, None).await.expect("plan");
    assert_eq!(plan.cut, 2, "the first turn is compacted");
    let orphan = summary_through(&app, &plan.messages[1], QUOTES_QUESTION_0).await.id;
    for message in &plan.messages[..2] {
        let deleted = app.client.delete(&format!("/v1/memories/{}", message.id), Some(&t)).await;
        assert_eq!(deleted.status, 200, "{:?}", deleted.body);
    }

    let report = compactor.run(&job("acme", "s1")).await.expect("job");
    assert_eq!(report, CompactReport::NothingToCompact);
    assert_eq!(app.db.count(&anonymized(orphan)).await, 1, "the earlier try's summary is anonymized");
    let window = context(&app, &t, "s1", json!({})).await;
    assert!(!contents(&window).iter().any(|m| m.contains("question 0 ")), "{window}");

    // A job that keeps less (queued by another server or the runbook), between writing its
    // summary and recording it, when another finds nothing: its summary is dropped, so it is not
    // recorded, and is planned again.
    turns(&app, &t, 3, 1).await;
    let plan = compactor.plan(&tenant, &session, None, None).await.expect("plan");
    assert_eq!(plan.cut, 2);
    let written =
        "SESSION INTENT: trip\nSUMMARY: question 1 about the trip to Lisbon\nARTIFACTS: none\nNEXT STEPS: none";
    let written = summary_through(&app, &plan.messages[1], written).await.id;
    app.db.store().nothing_to_compact(&tenant, &session).await.expect("nothing to compact");
    let record = mnemo_store::NewCompaction {
        from: None,
        through: plan.messages[1].cursor(),
        covered: plan.messages[..2].iter().map(|m| m.id).collect(),
        previous_summary: None,
        outcome: CompactionOutcome::Summarized,
        reason: None,
        summary_id: Some(written),
        model: None,
        trigger: CompactionTrigger::Messages,
        extract_for: Vec::new(),
    };
    let recorded =
        app.db.store().record_compaction(&tenant, &session, &record, &job("acme", "s1")).await.expect("record");
    assert_eq!(recorded, Recording::MessagesChanged);
    assert!(app.db.store().session_compactions(&tenant, &session).await.expect("compactions").is_empty());
    // Planned again in the same transaction: the request is kept, with a job waiting for it, so
    // a context call waiting for the compaction never sees the session without one.
    let state = app.db.store().session_state(&tenant, &session).await.expect("state");
    assert!(state.pending.is_some(), "the request is kept");
    let waiting = "SELECT count(*) FROM apalis.jobs WHERE job_type = 'compact' AND status IN ('Pending', 'Queued')";
    assert!(app.db.count(waiting).await >= 1);
}

/// A session whose agent replies with a service token (its replies carry no user): the summary
/// is stamped with the user of the messages it covers, not with the last message's writer, so
/// that the user's erasure finds it even after their messages were anonymized.
#[tokio::test]
async fn a_summary_carries_the_user_of_the_messages_it_covers() {
    let chat = ScriptedChat::start().await;
    let app = TestApp::spawn().await;
    let ann = token(&principal("acme", Some("ann"), None, Some("s1")));
    let agent = token(&principal("acme", None, None, Some("s1")));
    for i in 0..4 {
        say(&app, &ann, &format!("u{i}"), "user", &format!("question {i} about the trip to Lisbon")).await;
        say(&app, &agent, &format!("a{i}"), "assistant", &format!("answer {i}: take the early train")).await;
    }
    let report = compactor(&app, &settings(llm_env(&chat))).run(&job("acme", "s1")).await.expect("job");
    assert!(matches!(report, CompactReport::Compacted { outcome: CompactionOutcome::Summarized, .. }), "{report:?}");
    let stamped = app
        .db
        .count("SELECT count(*) FROM memory_items WHERE source_kind = 'session_summary' AND user_id = 'ann'")
        .await;
    assert_eq!(stamped, 1);
}
