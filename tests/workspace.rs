//! Agent workspace files over HTTP against a real PostgreSQL: the core files on first use, every
//! operation and its answers, every bad path, versions and audit rows, the prompt and the
//! context window's workspace section, and isolation between tenants, agents and users.

use std::time::Duration;

use mnemo_config::vars;
use mnemo_core::{AgentId, FileKey, TenantId, UserId, WorkspacePath};
use mnemo_testkit::{TestApp, WorkerProcess, principal, token, wait_until};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

/// The default `MNEMO_WORKSPACE_MAX_FILE_BYTES`, which an archive does not grow past.
const MAX: usize = 256 * 1024;

fn files(reply: &Value) -> Vec<(String, i64, bool)> {
    reply["files"]
        .as_array()
        .expect("files")
        .iter()
        .map(|f| {
            (f["path"].as_str().unwrap_or("").to_owned(), f["sort_order"].as_i64().unwrap_or(-1), f["enabled"] == true)
        })
        .collect()
}

/// A context call is a use too: a new user's first window holds the core files, as the window
/// after any workspace route would.
#[tokio::test]
async fn a_first_context_call_creates_the_core_files() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), Some("s1")));
    // A call whose own message does not fit is refused before anything is written.
    let long = json!({ "max_input_tokens": 64, "current_message": "word ".repeat(200) });
    let refused = app.client.post("/v1/sessions/s1/context", Some(&t), &long).await;
    assert_eq!((refused.status, refused.code()), (400, "invalid_field"), "{:?}", refused.body);
    assert_eq!(app.db.count("SELECT count(*) FROM workspace_files").await, 0);
    let window = app.client.post("/v1/sessions/s1/context", Some(&t), &json!({ "current_message": "hi" })).await;
    assert_eq!(window.status, 200, "{:?}", window.body);
    let first = &window.body["messages"][0];
    assert_eq!(first["role"], "system", "{first}");
    assert!(first["content"].as_str().unwrap_or("").contains("--- AGENTS.md ---"), "{first}");
    let listed = app.client.get("/v1/workspace/files", Some(&t)).await;
    assert_eq!(files(&listed.body).len(), 4, "{:?}", listed.body);
}

#[tokio::test]
async fn core_files_on_first_use_then_write_edit_patch_and_delete() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    let listed = app.client.get("/v1/workspace/files", Some(&t)).await;
    assert_eq!(listed.status, 200, "{:?}", listed.body);
    let expected = [("AGENTS.md", 0), ("SOUL.md", 1), ("PROFILE.md", 2), ("MEMORY.md", 3)];
    assert_eq!(files(&listed.body), expected.map(|(p, o)| (p.to_owned(), o, true)));
    let memory = app.client.get("/v1/workspace/files/MEMORY.md", Some(&t)).await;
    assert!(memory.body["content"].as_str().unwrap_or("").starts_with("# MEMORY.md"));

    let note = "/v1/workspace/files/memory/2026-04-01.md";
    let created = app.client.put(note, Some(&t), &json!({ "content": "# 2026-04-01\n- booked the train\n" })).await;
    assert_eq!((created.status, created.body["result"].as_str()), (201, Some("created")), "{:?}", created.body);
    assert_eq!(created.body["bytes_written"], 32);
    let again =
        app.client.put(note, Some(&t), &json!({ "content": "# 2026-04-01\n- booked the train\n- packed\n" })).await;
    assert_eq!(
        (again.status, again.body["result"].as_str(), again.body["version"].as_i64()),
        (200, Some("overwritten"), Some(2))
    );
    let read = app.client.get(note, Some(&t)).await;
    assert_eq!((read.body["enabled"].as_bool(), read.body["sort_order"].as_i64()), (Some(false), Some(100)));

    let edit = format!("{note}/edit");
    let missing = app.client.post(&edit, Some(&t), &json!({ "old_text": "plane", "new_text": "x" })).await;
    assert_eq!((missing.status, missing.code()), (409, "edit_text_not_found"));
    let twice = app.client.post(&edit, Some(&t), &json!({ "old_text": "- ", "new_text": "* " })).await;
    assert_eq!((twice.status, twice.code()), (409, "edit_text_ambiguous"));
    let all =
        app.client.post(&edit, Some(&t), &json!({ "old_text": "- ", "new_text": "* ", "replace_all": true })).await;
    assert_eq!((all.status, all.body["replaced"].as_i64()), (200, Some(2)), "{:?}", all.body);
    let once = app.client.post(&edit, Some(&t), &json!({ "old_text": "packed", "new_text": "packed light" })).await;
    assert_eq!(once.body["replaced"], 1);
    // Two matches of 140,000 bytes each would make 280,045 bytes, over the 256 KiB a file holds.
    let big = json!({ "old_text": "*", "new_text": "x".repeat(140_000), "replace_all": true });
    let too_large = app.client.post(&edit, Some(&t), &big).await;
    assert_eq!((too_large.status, too_large.code()), (400, "content_too_long"));
    assert!(too_large.body["error"]["message"].as_str().is_some_and(|m| m.contains("280045")), "{:?}", too_large.body);
    let read = app.client.get(note, Some(&t)).await;
    assert_eq!(read.body["content"], "# 2026-04-01\n* booked the train\n* packed light\n");

    let patched = app.client.patch(note, Some(&t), &json!({ "enabled": true, "sort_order": 4 })).await;
    assert_eq!((patched.status, patched.body["enabled"].as_bool()), (200, Some(true)), "{:?}", patched.body);
    let under = app.client.get("/v1/workspace/files?prefix=memory%2F", Some(&t)).await;
    assert_eq!(files(&under.body), [("memory/2026-04-01.md".to_owned(), 4, true)]);
    // A page at a time, in the same order: the pages join to the whole list.
    let whole = app.client.get("/v1/workspace/files", Some(&t)).await;
    assert_eq!((files(&whole.body).len(), &whole.body["next_cursor"]), (5, &json!(null)));
    let (mut paged, mut cursor) = (Vec::new(), None::<String>);
    loop {
        let query = cursor.map_or(String::new(), |c| format!("&cursor={c}"));
        let page = app.client.get(&format!("/v1/workspace/files?limit=2{query}"), Some(&t)).await;
        assert!(files(&page.body).len() <= 2, "{:?}", page.body);
        paged.extend(files(&page.body));
        cursor = page.body["next_cursor"].as_str().map(str::to_owned);
        if cursor.is_none() {
            break;
        }
    }
    assert_eq!(paged, files(&whole.body));
    // A cursor naming a path with NUL in it, too (it used to answer 500).
    // Nor a repeated parameter, a number with a sign, or a cursor with one.
    for query in [
        "limit=0",
        "limit=1001",
        "cursor=4_zz",
        "cursor=x",
        "cursor=0_00",
        "limit=2&limit=1000",
        "limit=+2",
        "cursor=0_+a",
        "cursor=+0_61",
    ] {
        let refused = app.client.get(&format!("/v1/workspace/files?{query}"), Some(&t)).await;
        assert_eq!((refused.status, refused.code()), (400, "invalid_field"), "{query}");
    }

    let deleted = app.client.delete(note, Some(&t)).await;
    assert_eq!((deleted.status, deleted.body["deleted"].as_bool()), (200, Some(true)));
    assert_eq!(app.client.get(note, Some(&t)).await.status, 404);
    assert_eq!(app.client.delete(note, Some(&t)).await.status, 404);
    assert_eq!(files(&app.client.get("/v1/workspace/files", Some(&t)).await.body).len(), 4);

    // Every state is kept, and each change has an audit row naming the actor, without content.
    let key = FileKey {
        tenant: TenantId::parse("acme").expect("tenant"),
        agent: AgentId::parse("helper").expect("agent"),
        user: Some(UserId::parse("ann").expect("user")),
        path: WorkspacePath::parse("memory/2026-04-01.md").expect("path"),
    };
    let history = app.db.store().file_history(&key).await.expect("history");
    let versions: Vec<(i32, bool)> = history.iter().map(|v| (v.version, v.deleted)).collect();
    assert_eq!(versions, [(1, false), (2, false), (3, false), (4, false), (5, false), (6, true)]);
    assert!(history.iter().all(|v| v.actor == "api"));
    // Not over the limit a file holds now (it may have been lowered since).
    let over = app.db.store().restore_file(&key, 2, 10, "runbook").await.expect("restore");
    assert_eq!(over, mnemo_store::Restored::TooLarge { bytes: 41 });
    let restored = app.db.store().restore_file(&key, 2, MAX, "runbook").await.expect("restore");
    assert_eq!(restored, mnemo_store::Restored::As(7));
    let read = app.client.get(note, Some(&t)).await;
    assert_eq!(read.body["content"], "# 2026-04-01\n- booked the train\n- packed\n");
    let audit = app.db.count("SELECT count(*) FROM audit_log WHERE event = 'workspace.change'").await;
    assert_eq!(audit, 4 + 7, "four core files and seven changes");
    let leaked = app.db.count("SELECT count(*) FROM audit_log WHERE details::text LIKE '%booked%'").await;
    assert_eq!(leaked, 0);

    // Places that overlap are two places: "x\nx\n" is in "x\nx\nx\n" at its first and second line.
    let lines = "/v1/workspace/files/memory/lines.md";
    assert_eq!(app.client.put(lines, Some(&t), &json!({ "content": "x\nx\nx\n" })).await.status, 201);
    let overlapping = json!({ "old_text": "x\nx\n", "new_text": "y\n" });
    let reply = app.client.post(&format!("{lines}/edit"), Some(&t), &overlapping).await;
    assert_eq!((reply.status, reply.code()), (409, "edit_text_ambiguous"), "{:?}", reply.body);
    assert_eq!(app.client.get(lines, Some(&t)).await.body["content"], "x\nx\nx\n");
}

#[tokio::test]
async fn bad_paths_large_files_and_missing_identities_are_refused_and_write_nothing() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    let _ = app.client.get("/v1/workspace/files", Some(&t)).await;
    let before = app.db.count("SELECT count(*) FROM workspace_file_versions").await;
    for path in [
        "notes.txt",
        "..%2FMEMORY.md",
        "a%2F..%2FMEMORY.md",
        "%2Fetc%2Fx.md",
        "a%5Cb.md",
        "a%07b.md",
        "a/b/c/d/e.md",
        "a//b.md",
        ".md",
    ] {
        let reply = app.client.put(&format!("/v1/workspace/files/{path}"), Some(&t), &json!({ "content": "x" })).await;
        assert_eq!((reply.status, reply.code()), (400, "invalid_path"), "{path}: {:?}", reply.body);
    }
    let long = format!("/v1/workspace/files/{}.md", "x".repeat(201));
    assert_eq!(app.client.put(&long, Some(&t), &json!({ "content": "x" })).await.code(), "invalid_path");
    let big = "x".repeat(256 * 1024 + 1);
    let reply = app.client.put("/v1/workspace/files/MEMORY.md", Some(&t), &json!({ "content": big })).await;
    assert_eq!((reply.status, reply.code()), (400, "content_too_long"));
    let reply = app.client.put("/v1/workspace/files/MEMORY.md", Some(&t), &json!({ "content": "a\u{0}b" })).await;
    assert_eq!((reply.status, reply.code()), (400, "nul_byte"));
    let reply = app.client.patch("/v1/workspace/files/MEMORY.md", Some(&t), &json!({ "sort_order": 99_999 })).await;
    assert_eq!((reply.status, reply.code()), (400, "invalid_field"));
    // A PATCH changing nothing names both fields it takes.
    let reply = app.client.patch("/v1/workspace/files/MEMORY.md", Some(&t), &json!({})).await;
    assert_eq!((reply.status, reply.code()), (400, "missing_field"));
    assert!(reply.body["error"]["message"].as_str().is_some_and(|m| m.contains("sort_order")), "{:?}", reply.body);
    // A daily note of a day to come (beyond one day of slack for writers ahead of UTC).
    // Three days on: two, should midnight pass between this line and the server's.
    let later = chrono::Utc::now().date_naive() + chrono::Days::new(3);
    let path = format!("/v1/workspace/files/memory/{}.md", later.format("%Y-%m-%d"));
    let reply = app.client.put(&path, Some(&t), &json!({ "content": "x" })).await;
    assert_eq!((reply.status, reply.code()), (400, "invalid_path"), "{:?}", reply.body);
    let reply = app
        .client
        .post("/v1/workspace/files/MEMORY.md/edit", Some(&t), &json!({ "old_text": "", "new_text": "x" }))
        .await;
    assert_eq!((reply.status, reply.code()), (400, "invalid_field"));
    assert_eq!(app.db.count("SELECT count(*) FROM workspace_file_versions").await, before);

    // No agent claim: no workspace. No user claim: the agent's files only.
    let no_agent = token(&principal("acme", Some("ann"), None, None));
    let reply = app.client.get("/v1/workspace/files", Some(&no_agent)).await;
    assert_eq!((reply.status, reply.code()), (401, "missing_identity"));
    let agent_only = token(&principal("acme", None, Some("helper"), None));
    let reply = app.client.get("/v1/workspace/files/PROFILE.md", Some(&agent_only)).await;
    assert_eq!((reply.status, reply.code()), (401, "missing_identity"));
    let reply = app.client.get("/v1/workspace/files", Some(&agent_only)).await;
    assert_eq!(files(&reply.body).iter().map(|f| f.0.as_str()).collect::<Vec<_>>(), ["AGENTS.md", "SOUL.md"]);
}

/// A file as large as `MNEMO_WORKSPACE_MAX_FILE_BYTES` allows goes in, whatever the tool-output
/// limit the request body's size was once tied to alone.
#[tokio::test]
async fn a_file_within_its_own_limit_is_not_refused_for_its_body_size() {
    let app = TestApp::spawn_with(&[(vars::MAX_TOOL_OUTPUT_BYTES, "16384")]).await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    let content = "x".repeat(200 * 1024);
    let reply = app.client.put("/v1/workspace/files/memory/notes.md", Some(&t), &json!({ "content": content })).await;
    assert_eq!(reply.status, 201, "{:?}", reply.body);
}

#[tokio::test]
async fn the_prompt_renders_enabled_files_in_order_and_the_context_window_injects_it() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), Some("s1")));
    let agent = token(&principal("acme", None, Some("helper"), None));
    for (path, content, by) in
        [("AGENTS.md", "Answer in French.", &agent), ("SOUL.md", "", &agent), ("MEMORY.md", "Ann takes trains.", &t)]
    {
        let reply =
            app.client.put(&format!("/v1/workspace/files/{path}"), Some(by), &json!({ "content": content })).await;
        assert!(reply.status < 300, "{:?}", reply.body);
    }
    let reply = app.client.put("/v1/workspace/files/notes.md", Some(&agent), &json!({ "content": "disabled" })).await;
    assert_eq!(reply.status, 201);
    // A user reads the agent's shared files but cannot change them.
    let reply = app.client.put("/v1/workspace/files/AGENTS.md", Some(&t), &json!({ "content": "Obey me." })).await;
    assert_eq!((reply.status, reply.code()), (403, "agent_file_read_only"));
    let reply = app.client.delete("/v1/workspace/files/SOUL.md", Some(&t)).await;
    assert_eq!((reply.status, reply.code()), (403, "agent_file_read_only"));
    // Nor does a session's token without a user, which would pass for the service.
    let visitor = token(&principal("acme", None, Some("helper"), Some("s9")));
    let reply =
        app.client.put("/v1/workspace/files/AGENTS.md", Some(&visitor), &json!({ "content": "Obey me." })).await;
    assert_eq!((reply.status, reply.code()), (403, "agent_file_read_only"));
    let edit = json!({ "old_text": "French", "new_text": "Klingon" });
    let reply = app.client.post("/v1/workspace/files/AGENTS.md/edit", Some(&visitor), &edit).await;
    assert_eq!((reply.status, reply.code()), (403, "agent_file_read_only"));
    assert_eq!(app.client.get("/v1/workspace/files/AGENTS.md", Some(&visitor)).await.status, 200, "it reads them");
    // A refused change writes nothing, not even a new user's core files.
    let bob = token(&principal("acme", Some("bob"), Some("helper"), None));
    let reply = app.client.put("/v1/workspace/files/AGENTS.md", Some(&bob), &json!({ "content": "Obey me." })).await;
    assert_eq!((reply.status, reply.code()), (403, "agent_file_read_only"));
    let reply =
        app.client.put("/v1/workspace/files/memory/2021-02-30.md", Some(&bob), &json!({ "content": "x" })).await;
    assert_eq!((reply.status, reply.code()), (400, "invalid_path"));
    // An edit whose old text no file can hold is refused unwritten.
    let edit = json!({ "old_text": "a\u{0}", "new_text": "b" });
    let reply = app.client.post("/v1/workspace/files/MEMORY.md/edit", Some(&bob), &edit).await;
    assert_eq!((reply.status, reply.code()), (400, "nul_byte"), "{:?}", reply.body);
    assert_eq!(app.db.count("SELECT count(*) FROM workspace_files WHERE user_id = 'bob'").await, 0);
    // Today's note, yesterday's, and one older than the recent days.
    let today = chrono::Utc::now().date_naive();
    for (days_ago, text) in [(0, "- booked Lisbon"), (1, "- compared trains"), (30, "- long ago")] {
        let day = today - chrono::Days::new(days_ago);
        let path = format!("/v1/workspace/files/memory/{}.md", day.format("%Y-%m-%d"));
        assert_eq!(app.client.put(&path, Some(&t), &json!({ "content": text })).await.status, 201);
    }
    let prompt = app.client.get("/v1/workspace/prompt", Some(&t)).await;
    let text = prompt.body["prompt"].as_str().expect("prompt");
    assert!(text.starts_with("--- AGENTS.md ---\nAnswer in French.\n\n--- PROFILE.md ---\n"), "{text}");
    let yesterday = (today - chrono::Days::new(1)).format("%Y-%m-%d");
    let memory = format!(
        "# Memory\n\n## Long-term Memory\nAnn takes trains.\n\n## Today's Notes\n- booked Lisbon\n\n\
## Recent Context\n### {yesterday}\n- compared trains"
    );
    assert!(text.ends_with(&memory), "{text}");
    assert!(!text.contains("SOUL.md") && !text.contains("disabled") && !text.contains("long ago"), "{text}");

    // The agent's files, then the user's part: their profile and the memory sections.
    assert_eq!(prompt.body["files"].as_str(), Some("--- AGENTS.md ---\nAnswer in French."));
    let users = prompt.body["memory"].as_str().expect("memory").to_owned();
    assert!(users.starts_with("--- PROFILE.md ---\n") && users.ends_with(&memory), "{users}");

    let body = json!({ "source_kind": "chat_message", "source_ref": "m1", "role": "user", "content": "hello" });
    assert_eq!(app.client.post("/v1/memories", Some(&t), &body).await.status, 201);
    let window = app.client.post("/v1/sessions/s1/context", Some(&t), &json!({ "system_prompt": "Be kind." })).await;
    let messages = window.body["messages"].as_array().expect("messages");
    assert_eq!(messages[0]["content"], "Be kind.");
    // The agent's files an operator set are instructions; the user's profile and notes, which
    // models and users wrote, are reference, under a marker, never in a system message.
    assert_eq!(
        (messages[1]["role"].as_str(), messages[1]["content"].as_str()),
        (Some("system"), prompt.body["files"].as_str())
    );
    let marked = format!("{}\n{users}", mnemo_core::MEMORY_PREFIX);
    assert_eq!((messages[2]["role"].as_str(), messages[2]["content"].as_str()), (Some("user"), Some(marked.as_str())));
    assert!(
        messages
            .iter()
            .filter(|m| m["role"] == "system")
            .all(|m| !m["content"].as_str().unwrap_or("").contains("booked Lisbon"))
    );
    assert_eq!(messages[3]["content"], "hello");
    let tokens = &window.body["diagnostics"]["tokens"];
    assert!(
        tokens["injected"].as_u64().is_some_and(|n| n > 0) && tokens["memory"].as_u64().is_some_and(|n| n > 0),
        "{tokens}"
    );

    // A long system prompt, and a workspace that would take half the budget on its own: the files
    // and the notes shrink to what is left (here, nothing), and the call is answered.
    assert!(prompt.body["tokens"].as_u64().is_some_and(|n| n > 50), "{:?}", prompt.body);
    for (budget, workspace_placed) in [(100, false), (200, true)] {
        let body =
            json!({ "system_prompt": "Be kind. ".repeat(18), "current_message": "and?", "max_input_tokens": budget });
        let window = app.client.post("/v1/sessions/s1/context", Some(&t), &body).await;
        assert_eq!(window.status, 200, "{:?}", window.body);
        let tokens = &window.body["diagnostics"]["tokens"];
        assert!(tokens["total"].as_u64().is_some_and(|n| n <= budget), "{tokens}");
        assert_eq!(tokens["injected"].as_u64().is_some_and(|n| n > 0), workspace_placed, "{tokens}");
        assert_eq!(window.body["messages"][0]["content"], "Be kind. ".repeat(18));
    }
}

/// Random tenants, agents and users write files; each then reads what its token reaches and
/// finds exactly its agent's files and its own user files, never another's.
#[tokio::test]
async fn files_never_cross_tenants_agents_or_users() {
    let app = TestApp::spawn().await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    let (tenants, agents, users) = (["t1", "t2"], ["a1", "a2"], ["u1", "u2", "u3"]);
    let mut written: Vec<(&str, &str, &str, String, String)> = Vec::new();
    for i in 0..24 {
        let (tenant, agent, user) =
            (tenants[rng.random_range(0..2)], agents[rng.random_range(0..2)], users[rng.random_range(0..3)]);
        let path = ["PROFILE.md", "AGENTS.md", "memory/2026-04-01.md", "tools.md"][rng.random_range(0..4)];
        let content = format!("secret {i} of {tenant}/{agent}/{user}");
        // The agent's own files are written with the agent's token, a user's with the user's.
        let agent_file = path == "AGENTS.md" || path == "tools.md";
        let t = token(&principal(tenant, (!agent_file).then_some(user), Some(agent), None));
        let reply =
            app.client.put(&format!("/v1/workspace/files/{path}"), Some(&t), &json!({ "content": content })).await;
        assert!(reply.status < 300, "{:?}", reply.body);
        written.push((tenant, agent, user, path.to_owned(), content));
    }
    for tenant in tenants {
        for agent in agents {
            for user in users {
                let t = token(&principal(tenant, Some(user), Some(agent), None));
                for path in ["PROFILE.md", "AGENTS.md", "memory/2026-04-01.md", "tools.md"] {
                    let reply = app.client.get(&format!("/v1/workspace/files/{path}"), Some(&t)).await;
                    let agent_file = path == "AGENTS.md" || path == "tools.md";
                    // The last write this token's tenant, agent (and user, for user files) made.
                    let expected = written
                        .iter()
                        .rev()
                        .find(|w| w.0 == tenant && w.1 == agent && w.3 == path && (agent_file || w.2 == user))
                        .map(|w| w.4.clone());
                    match expected {
                        Some(content) => {
                            assert_eq!(reply.body["content"], content.as_str(), "{tenant}/{agent}/{user} {path}")
                        }
                        None => {
                            let content = reply.body["content"].as_str().unwrap_or("");
                            assert!(!content.contains("secret"), "{tenant}/{agent}/{user} {path} read {content}");
                        }
                    }
                }
            }
        }
    }
}

async fn runbook(app: &TestApp, args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(mnemo_testkit::binary("mnemo-runbook").expect("runbook"))
        .args(args)
        .env_clear()
        .env(mnemo_config::vars::DATABASE_URL, &app.db.url)
        .output()
        .await
        .expect("runbook runs")
}

#[tokio::test]
async fn the_runbook_lists_prints_and_restores_any_version() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), None));
    for content in ["first profile", "second profile"] {
        let reply = app.client.put("/v1/workspace/files/PROFILE.md", Some(&t), &json!({ "content": content })).await;
        assert!(reply.status < 300);
    }
    let owner = ["--tenant", "acme", "--agent", "helper", "--user", "ann"];
    let ls = runbook(&app, &[&["workspace", "ls"][..], &owner, &["--json"]].concat()).await;
    let listed: Value = serde_json::from_slice(&ls.stdout).expect("json");
    assert_eq!(listed["files"].as_array().map(Vec::len), Some(4));
    let history =
        runbook(&app, &[&["workspace", "history"][..], &owner, &["--path", "PROFILE.md", "--json"]].concat()).await;
    let history: Value = serde_json::from_slice(&history.stdout).expect("json");
    let versions: Vec<i64> =
        history["versions"].as_array().expect("versions").iter().filter_map(|v| v["version"].as_i64()).collect();
    assert_eq!(versions, [1, 2], "two writes, the first creating it (not from its template)");
    // A mistyped path is no file, not an empty history.
    let typo = runbook(&app, &[&["workspace", "history"][..], &owner, &["--path", "PROFLE.md"]].concat()).await;
    let stderr = String::from_utf8_lossy(&typo.stderr);
    assert!(!typo.status.success() && stderr.contains("no such file: PROFLE.md"), "{stderr}");
    let cat =
        runbook(&app, &[&["workspace", "cat"][..], &owner, &["--path", "PROFILE.md", "--version", "1"]].concat()).await;
    assert_eq!(String::from_utf8_lossy(&cat.stdout), "first profile");
    let cat = runbook(&app, &[&["workspace", "cat"][..], &owner, &["--path", "PROFILE.md", "--json"]].concat()).await;
    let cat: Value = serde_json::from_slice(&cat.stdout).expect("json");
    assert_eq!(cat["path"], "PROFILE.md");
    let reindex = runbook(&app, &["workspace", "reindex", "--tenant", "acme", "--json"]).await;
    let reindex: Value = serde_json::from_slice(&reindex.stdout).expect("json");
    assert_eq!(reindex["files"], 1, "MEMORY.md (a template: nothing to index, counted)");
    let bad_zone = runbook(&app, &["memory", "time-zone", "--tenant", "acme", "--set", "Mars/Olympus_Mons"]).await;
    assert!(!bad_zone.status.success() && String::from_utf8_lossy(&bad_zone.stderr).contains("unknown time zone"));
    let zone = runbook(&app, &["memory", "time-zone", "--tenant", "acme", "--set", "Asia/Tokyo", "--json"]).await;
    let zone: Value = serde_json::from_slice(&zone.stdout).expect("json");
    assert_eq!(zone["time_zone"], "Asia/Tokyo");
    let restore = runbook(
        &app,
        &[&["workspace", "restore"][..], &owner, &["--path", "PROFILE.md", "--version", "1", "--json"]].concat(),
    )
    .await;
    assert!(restore.status.success(), "{}", String::from_utf8_lossy(&restore.stderr));
    let read = app.client.get("/v1/workspace/files/PROFILE.md", Some(&t)).await;
    assert_eq!((read.body["content"].as_str(), read.body["version"].as_i64()), (Some("first profile"), Some(3)));
    let actor =
        app.db.count("SELECT count(*) FROM audit_log WHERE event = 'workspace.change' AND actor = 'runbook'").await;
    assert_eq!(actor, 1);
    // Without --user a user's file is refused, and nothing changes.
    let refused = runbook(
        &app,
        &["workspace", "restore", "--tenant", "acme", "--agent", "helper", "--path", "PROFILE.md", "--version", "2"],
    )
    .await;
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--user"));
}

/// A maintenance run that fails gives its claim back: the next housekeeping tick runs it, not the
/// next maintenance interval hours later.
#[tokio::test]
async fn a_failed_maintenance_run_is_run_again_at_the_next_tick() {
    let app = TestApp::spawn().await;
    let store = app.db.store();
    let policy = mnemo_jobs::HousekeepingPolicy {
        maintenance: mnemo_config::MaintenanceSettings {
            interval: Duration::from_secs(6 * 3600),
            note_retention_days: 90,
            session_retention_days: 0,
            max_file_bytes: MAX,
        },
        ..mnemo_testkit::housekeeping_policy("m")
    };
    let exec = |sql: &'static str| {
        let pool = app.db.pool.clone();
        async move { sqlx::query(sql).execute(&pool).await.expect(sql) }
    };
    // Its last step fails (the table is away).
    exec("ALTER TABLE access_batches RENAME TO access_batches_away").await;
    assert!(mnemo_jobs::run_housekeeping(&store, "w", &policy).await.is_err());
    assert_eq!(app.db.count("SELECT count(*) FROM maintenance_runs").await, 0, "the claim is given back");
    exec("ALTER TABLE access_batches_away RENAME TO access_batches").await;
    let ran = wait_until(Duration::from_secs(5), || async {
        let _ = mnemo_jobs::run_housekeeping(&store, "w", &policy).await;
        app.db.count("SELECT count(*) FROM maintenance_runs WHERE finished_at IS NOT NULL").await == 1
    })
    .await;
    assert!(ran, "the next tick runs maintenance");
}

#[tokio::test]
async fn maintenance_archives_old_notes_and_prunes_idle_sessions_once_per_interval() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("ann"), Some("helper"), Some("s1")));
    let today = chrono::Utc::now().date_naive();
    let (old, recent) = (today - chrono::Days::new(100), today - chrono::Days::new(10));
    for day in [old, recent] {
        let path = format!("/v1/workspace/files/memory/{}.md", day.format("%Y-%m-%d"));
        assert_eq!(
            app.client.put(&path, Some(&t), &json!({ "content": format!("# {day}\n- notes") })).await.status,
            201
        );
    }
    // Session s1 is in use (an old message and a new one); s0 has been idle for 200 days.
    let long_ago = (chrono::Utc::now() - chrono::Duration::days(200)).to_rfc3339();
    let s0 = token(&principal("acme", Some("ann"), Some("helper"), Some("s0")));
    for (who, source_ref, event_time) in
        [(&t, "old", Some(&long_ago)), (&t, "new", None), (&s0, "idle", Some(&long_ago))]
    {
        let mut body = json!({ "source_kind": "chat_message", "source_ref": source_ref, "content": "hello" });
        if let Some(time) = event_time {
            body["event_time"] = json!(time);
        }
        assert_eq!(app.client.post("/v1/memories", Some(who), &body).await.status, 201);
    }

    // A note named for no real day, stored before such names were refused, sorts first: a page
    // of one row passes it over and archives the real old note after it.
    sqlx::query(
        "INSERT INTO workspace_files SELECT (jsonb_populate_record(NULL::workspace_files,
             to_jsonb(w) || '{\"path\": \"memory/2020-99-99.md\"}')).* FROM workspace_files w WHERE w.path = $1",
    )
    .bind(format!("memory/{}.md", old.format("%Y-%m-%d")))
    .execute(&app.db.pool)
    .await
    .expect("a note of no real day");
    // Nor do ids that do not parse (an agent's with a control character) stop the others.
    sqlx::query(
        "INSERT INTO workspace_files SELECT (jsonb_populate_record(NULL::workspace_files,
             to_jsonb(w) || jsonb_build_object('agent_id', E'a\\x07agent'))).* FROM workspace_files w WHERE w.path = $1",
    )
    .bind(format!("memory/{}.md", old.format("%Y-%m-%d")))
    .execute(&app.db.pool)
    .await
    .expect("a note whose agent's id does not parse");
    // Such a name is refused for a new file; the stored one still reads.
    let bad = app.client.put("/v1/workspace/files/memory/2021-02-30.md", Some(&t), &json!({ "content": "x" })).await;
    assert_eq!((bad.status, bad.code()), (400, "invalid_path"));
    assert_eq!(app.client.get("/v1/workspace/files/memory/2020-99-99.md", Some(&t)).await.status, 200);

    let store = app.db.store();
    let stale = Duration::from_secs(1800);
    assert!(store.claim_maintenance(1, "w1", stale).await.expect("claim"));
    assert!(
        !store.claim_maintenance(1, "w2", stale).await.expect("claimed already"),
        "once per interval across workers"
    );
    // A holder silent past the stale bound (killed mid-run) is taken over, by one worker.
    sqlx::query("UPDATE maintenance_runs SET started_at = now() - interval '31 minutes' WHERE tick = 1")
        .execute(&app.db.pool)
        .await
        .expect("an old claim");
    assert!(store.claim_maintenance(1, "w2", stale).await.expect("taken over"));
    assert!(!store.claim_maintenance(1, "w3", stale).await.expect("held again"));
    // The silent holder coming back neither gives up nor finishes the run it no longer holds.
    store.release_maintenance(1, "w1").await.expect("release");
    assert!(!store.finish_maintenance(1, "w1", Default::default()).await.expect("finish"), "not w1's run");
    assert!(!store.claim_maintenance(1, "w3", stale).await.expect("still held"), "w2's claim was given up by w1");
    let finished = app.db.count("SELECT count(*) FROM maintenance_runs WHERE finished_at IS NOT NULL").await;
    assert_eq!(finished, 0, "w1 finished w2's run");
    assert_eq!(store.archive_daily_notes(today - chrono::Days::new(90), 1, MAX).await.expect("archive"), 1);
    let old_path = format!("/v1/workspace/files/memory/{}.md", old.format("%Y-%m-%d"));
    assert_eq!(app.client.get(&old_path, Some(&t)).await.status, 404);
    let archived =
        app.client.get(&format!("/v1/workspace/files/memory/archive/{}.md", old.format("%Y-%m-%d")), Some(&t)).await;
    assert_eq!(
        (archived.body["enabled"].as_bool(), archived.body["content"].as_str()),
        (Some(false), Some(format!("# {old}\n- notes").as_str()))
    );
    let recent_path = format!("/v1/workspace/files/memory/{}.md", recent.format("%Y-%m-%d"));
    assert_eq!(app.client.get(&recent_path, Some(&t)).await.status, 200);
    assert_eq!(store.archive_daily_notes(today - chrono::Days::new(90), 1000, MAX).await.expect("again"), 0);
    let by_maintenance = app.db.count("SELECT count(*) FROM workspace_file_versions WHERE actor = 'maintenance'").await;
    assert_eq!(by_maintenance, 2, "the archive copy and the note's delete");
    // The same day's note written again: archived beside the first, not in its place.
    let again = app.client.put(&old_path, Some(&t), &json!({ "content": "- more notes" })).await;
    assert_eq!(again.status, 201, "{:?}", again.body);
    assert_eq!(store.archive_daily_notes(today - chrono::Days::new(90), 1000, MAX).await.expect("archive"), 1);
    let archive_path = format!("/v1/workspace/files/memory/archive/{}.md", old.format("%Y-%m-%d"));
    let archived = app.client.get(&archive_path, Some(&t)).await;
    assert_eq!(archived.body["content"], format!("# {old}\n- notes\n\n- more notes"));
    // Written again with what the archive holds already (a restore, say): not added twice.
    let same = app.client.put(&old_path, Some(&t), &json!({ "content": "- more notes\n" })).await;
    assert!(same.status < 300, "{:?}", same.body);
    assert_eq!(store.archive_daily_notes(today - chrono::Days::new(90), 1000, MAX).await.expect("archive"), 1);
    let archived = app.client.get(&archive_path, Some(&t)).await;
    assert_eq!(archived.body["content"], format!("# {old}\n- notes\n\n- more notes"));
    // Text the archive holds only inside a note is a note of its own.
    let fragment = app.client.put(&old_path, Some(&t), &json!({ "content": "more notes" })).await;
    assert!(fragment.status < 300, "{:?}", fragment.body);
    assert_eq!(store.archive_daily_notes(today - chrono::Days::new(90), 1000, MAX).await.expect("archive"), 1);
    let archived = app.client.get(&archive_path, Some(&t)).await;
    assert_eq!(archived.body["content"], format!("# {old}\n- notes\n\n- more notes\n\nmore notes"));
    // A note that would take the archive past the file limit stays, whole, where it is.
    let long = "x".repeat(200);
    assert!(app.client.put(&old_path, Some(&t), &json!({ "content": long })).await.status < 300);
    let small = archived.body["content"].as_str().map_or(0, str::len) + 100;
    assert_eq!(store.archive_daily_notes(today - chrono::Days::new(90), 1000, small).await.expect("archive"), 0);
    assert_eq!(app.client.get(&old_path, Some(&t)).await.body["content"], long);
    assert_eq!(app.client.get(&archive_path, Some(&t)).await.body["content"], archived.body["content"]);
    assert_eq!(store.archive_daily_notes(today - chrono::Days::new(90), 1000, MAX).await.expect("archive"), 1);
    // The archived note leaves recall; the recent one stays.
    let live_notes = "SELECT count(*) FROM memory_items WHERE source_kind = 'workspace_note' AND deleted_at IS NULL";
    assert_eq!(app.db.count(&format!("{live_notes} AND metadata ->> 'path' LIKE '%{old}%'")).await, 0);
    assert_eq!(app.db.count(&format!("{live_notes} AND metadata ->> 'path' LIKE '%{recent}%'")).await, 1);

    // A session written today with its real, old dates (a backfill) is not pruned at once: a row
    // is old by both its date and its write. s0's and s1's old rows are aged as if written then.
    let s2 = token(&principal("acme", Some("ann"), Some("helper"), Some("s2")));
    let backfilled = json!({ "source_kind": "chat_message", "source_ref": "backfilled", "content": "hello", "event_time": long_ago });
    assert_eq!(app.client.post("/v1/memories", Some(&s2), &backfilled).await.status, 201);
    sqlx::query("UPDATE memory_items SET created_at = event_time WHERE source_ref IN ('old', 'idle')")
        .execute(&app.db.pool)
        .await
        .expect("aged");
    assert_eq!(store.prune_old_sessions(180, 10_000).await.expect("prune"), 1);
    assert_eq!(store.prune_old_sessions(180, 10_000).await.expect("again"), 0);
    let listed = app.client.get("/v1/sessions/s2/messages", Some(&s2)).await;
    assert_eq!(listed.body["messages"].as_array().map(Vec::len), Some(1), "the backfilled session is kept");
    let listed = app.client.get("/v1/sessions/s0/messages", Some(&s0)).await;
    assert_eq!(listed.body["messages"].as_array().map(Vec::len), Some(0), "the idle session is pruned");
    let listed = app.client.get("/v1/sessions/s1/messages", Some(&t)).await;
    assert_eq!(listed.body["messages"].as_array().map(Vec::len), Some(2), "the session in use keeps its old message");
    let audited = app
        .db
        .count("SELECT count(*) FROM audit_log WHERE reason = 'session_retention' AND actor = 'maintenance'")
        .await;
    assert_eq!(audited, 1);
}

/// A writer who read a file can make its write conditional on the version it read: a change
/// made since (another session, consolidation) is not overwritten, and nothing is written.
#[tokio::test]
async fn a_write_with_the_version_it_read_overwrites_no_later_change() {
    let app = TestApp::spawn().await;
    let ann = token(&principal("acme", Some("ann"), Some("helper"), None));
    let put = |path: &'static str, body: Value| {
        let (client, ann) = (app.client.clone(), ann.clone());
        async move { client.put(&format!("/v1/workspace/files/{path}"), Some(&ann), &body).await }
    };
    // A new user's first write of a core file, expecting none: the file is the writer's, not
    // the template's (the other core files are created from theirs).
    let first = put("MEMORY.md", json!({ "content": "# MEMORY.md\n\n- one", "expected_version": 0 })).await;
    assert_eq!((first.status, first.body["version"].as_i64()), (201, Some(1)), "{:?}", first.body);
    let profile = app.client.get("/v1/workspace/files/PROFILE.md", Some(&ann)).await;
    assert_eq!((profile.status, profile.body["version"].as_i64()), (200, Some(1)), "{:?}", profile.body);
    let read = first.body["version"].as_i64().expect("version");
    assert!(put("MEMORY.md", json!({ "content": "# MEMORY.md\n\n- one\n- two" })).await.status < 300);
    let stale = put("MEMORY.md", json!({ "content": "# MEMORY.md\n\n- mine", "expected_version": read })).await;
    assert_eq!((stale.status, stale.body["error"]["code"].as_str()), (409, Some("file_changed")), "{:?}", stale.body);
    let now = app.client.get("/v1/workspace/files/MEMORY.md", Some(&ann)).await;
    assert_eq!(now.body["content"], "# MEMORY.md\n\n- one\n- two", "a refused write changes nothing");
    let current = now.body["version"].as_i64().expect("version");
    let fresh = put("MEMORY.md", json!({ "content": "# MEMORY.md\n\n- mine", "expected_version": current })).await;
    assert_eq!((fresh.status, fresh.body["version"].as_i64()), (200, Some(current + 1)), "{:?}", fresh.body);
    // 0: only while the file does not exist.
    assert_eq!(put("memory/plans.md", json!({ "content": "a", "expected_version": 0 })).await.status, 201);
    assert_eq!(put("memory/plans.md", json!({ "content": "b", "expected_version": 0 })).await.status, 409);
    for bad in [json!(-1), json!("1"), json!(1.5)] {
        let reply = put("memory/plans.md", json!({ "content": "c", "expected_version": bad })).await;
        assert_eq!((reply.status, reply.body["error"]["code"].as_str()), (400, Some("invalid_field")), "{bad}");
    }
}

/// A write of a user's file in flight when the user is erased: the erasure waits for it and
/// removes what it wrote. Without the wait, the erasure could not see the version the write had
/// not committed yet, and left it behind with its content.
#[tokio::test]
async fn an_erasure_waits_for_a_write_in_flight_and_removes_what_it_wrote() {
    let app = TestApp::spawn().await;
    let ann = token(&principal("acme", Some("ann"), Some("helper"), None));
    // The file's own lock (`LOCK_FILE`'s key), held as a slow writer of the file would: the
    // API's write waits for it inside its transaction, after taking the user's lock.
    let mut slow_writer = app.db.pool.begin().await.expect("begin");
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('acme/helper/ann/memory/plans.md', 0))")
        .execute(&mut *slow_writer)
        .await
        .expect("lock");
    let client = app.client.clone();
    let write = tokio::spawn(async move {
        let body = json!({ "content": "ann's plans for the weekend" });
        client.put("/v1/workspace/files/memory/plans.md", Some(&ann), &body).await.status
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let store = app.db.store();
    let erase = tokio::spawn(async move {
        let (tenant, user) = (TenantId::parse("acme").expect("tenant"), UserId::parse("ann").expect("user"));
        mnemo_jobs::erase_user(&store, &tenant, &user, 100, false, "runbook", |_, _| {}).await.expect("erase");
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!erase.is_finished(), "the erasure did not wait for the write in flight");
    slow_writer.commit().await.expect("commit");
    assert_eq!(write.await.expect("write"), 201);
    erase.await.expect("erase");
    assert_eq!(app.db.count("SELECT count(*) FROM workspace_file_versions WHERE user_id = 'ann'").await, 0);
    assert_eq!(app.db.count("SELECT count(*) FROM workspace_files WHERE user_id = 'ann'").await, 0);
}

#[tokio::test]
async fn erasing_a_user_removes_their_workspace_files_with_every_version_and_keeps_others() {
    let app = TestApp::spawn().await;
    let ann = token(&principal("acme", Some("ann"), Some("helper"), None));
    let bob = token(&principal("acme", Some("bob"), Some("helper"), None));
    for (t, who) in [(&ann, "ann"), (&bob, "bob")] {
        for content in [format!("{who} v1"), format!("{who} v2")] {
            let reply = app.client.put("/v1/workspace/files/PROFILE.md", Some(t), &json!({ "content": content })).await;
            assert!(reply.status < 300);
        }
    }
    // Recallable files: their pieces are rows carrying the user.
    for path in ["MEMORY.md", "memory/2026-04-01.md"] {
        let body = json!({ "content": "ann's secret plans for the weekend" });
        let reply = app.client.put(&format!("/v1/workspace/files/{path}"), Some(&ann), &body).await;
        assert!(reply.status < 300, "{:?}", reply.body);
    }
    // A name of her own choosing says what the file holds: the audit log keeps it by a hash.
    let named = "memory/divorce-lawyer.md";
    let reply = app.client.put(&format!("/v1/workspace/files/{named}"), Some(&ann), &json!({ "content": "x" })).await;
    assert!(reply.status < 300, "{:?}", reply.body);
    let store = app.db.store();
    let (tenant, user) = (TenantId::parse("acme").expect("tenant"), UserId::parse("ann").expect("user"));
    let plan = store.erasure_plan(&tenant, &user).await.expect("plan");
    assert_eq!(plan.workspace_files, 4, "PROFILE.md, MEMORY.md, the note and her own");
    mnemo_jobs::erase_user(&store, &tenant, &user, 100, false, "runbook", |_, _| {}).await.expect("erase");
    let left = app.db.count("SELECT count(*) FROM workspace_file_versions WHERE content LIKE 'ann%'").await;
    assert_eq!(left, 0, "no version of ann's files is left");
    assert_eq!(app.db.count("SELECT count(*) FROM workspace_files WHERE user_id = 'ann'").await, 0);
    let notes = "SELECT count(*) FROM memory_items WHERE source_kind = 'workspace_note'";
    assert_eq!(app.db.count(&format!("{notes} AND anonymized_at IS NULL")).await, 0);
    assert_eq!(app.db.count(&format!("{notes} AND content LIKE '%secret%'")).await, 0);
    assert_eq!(app.db.count(&format!("{notes} AND source_ref NOT LIKE 'workspace:%|anonymized'")).await, 0);
    assert_eq!(app.db.count(&format!("{notes} AND source_ref LIKE '%memory/%'")).await, 0, "no path or hash kept");
    let bobs = app.client.get("/v1/workspace/files/PROFILE.md", Some(&bob)).await;
    assert_eq!(bobs.body["content"], "bob v2");
    let raw_ids = app.db.count("SELECT count(*) FROM audit_log WHERE details::text LIKE '%\"ann\"%'").await;
    assert_eq!(raw_ids, 0, "audit rows name users only by a hash");
    let names = app.db.count("SELECT count(*) FROM audit_log WHERE details::text LIKE '%lawyer%'").await;
    assert_eq!(names, 0, "a user's own file names only by a hash");
    let standard = app.db.count("SELECT count(*) FROM audit_log WHERE details->>'path' = 'memory/2026-04-01.md'").await;
    assert_eq!(standard, 1, "a dated note by its name");
}

/// The live recall pieces of a file, by id.
async fn pieces(app: &TestApp, path: &str) -> Vec<uuid::Uuid> {
    sqlx::query_scalar(
        "SELECT id FROM memory_items WHERE source_kind = 'workspace_note' AND deleted_at IS NULL
         AND metadata ->> 'path' = $1 ORDER BY source_ref",
    )
    .bind(path)
    .fetch_all(app.db.store().pool())
    .await
    .expect("pieces")
}

#[tokio::test]
async fn memory_and_daily_notes_are_recalled_in_the_users_class_and_reindexed_when_they_change() {
    let app = TestApp::spawn().await;
    let _worker = WorkerProcess::start(&app.db.url, &[(vars::WORKER_QUEUES, "embed")]).await.expect("worker");
    let ann = token(&principal("acme", Some("ann"), Some("helper"), None));
    // A template MEMORY.md is boilerplate: nothing of it is indexed.
    app.client.get("/v1/workspace/files", Some(&ann)).await;
    assert!(pieces(&app, "MEMORY.md").await.is_empty());

    let cats = format!("Ann's cat is called Miso and sleeps on the radiator. {}", "She is an old cat. ".repeat(50));
    let trains = format!("Ann prefers window seats on night trains. {}", "Trains are her habit. ".repeat(50));
    let memory = format!("# MEMORY.md\n\n{cats}\n\n{trains}\n");
    let put = app.client.put("/v1/workspace/files/MEMORY.md", Some(&ann), &json!({ "content": memory })).await;
    assert_eq!(put.status, 200, "{:?}", put.body);
    // Today's note: the worker's maintenance archives notes older than 90 days.
    let day = chrono::Utc::now().date_naive().format("%Y-%m-%d").to_string();
    let note_path = format!("memory/{day}.md");
    let note = &format!("/v1/workspace/files/{note_path}");
    app.client
        .put(note, Some(&ann), &json!({ "content": format!("# {day}\n\n- Ann booked a ferry to Corsica.\n") }))
        .await;
    let before = pieces(&app, "MEMORY.md").await;
    assert_eq!((before.len(), pieces(&app, &note_path).await.len()), (2, 1));
    let embedded = wait_until(Duration::from_secs(30), || async {
        app.db
            .count("SELECT count(*) FROM memory_items WHERE source_kind = 'workspace_note' AND embedded_model IS NULL")
            .await
            == 0
    })
    .await;
    assert!(embedded, "the pieces were not embedded");

    let recall = |t: String, query: &'static str| {
        let client = app.client.clone();
        async move { client.post("/v1/recall", Some(&t), &json!({ "query": query, "scope": "user" })).await.body }
    };
    let found = recall(ann.clone(), "What is the name of Ann's cat?").await;
    assert_eq!(found["items"][0]["source_kind"], "workspace_note", "{found:?}");
    assert!(found["items"][0]["content"].as_str().unwrap_or("").contains("Miso"), "{found:?}");
    let found = recall(ann.clone(), "ferry to Corsica").await;
    assert!(found["items"][0]["source_ref"].as_str().unwrap_or("").contains(&format!(":{note_path}@v1#")), "{found:?}");
    // Another user of the same agent, the same user in another tenant, under another agent or
    // with no agent, find none of it (the user's facts are the user's under every agent; a
    // workspace is one agent's).
    let others = [
        principal("acme", Some("bob"), Some("helper"), None),
        principal("globex", Some("ann"), Some("helper"), None),
        principal("acme", Some("ann"), Some("coach"), None),
        principal("acme", Some("ann"), None, None),
    ];
    for other in others {
        let found = recall(token(&other), "What is the name of Ann's cat?").await;
        assert_eq!(found["items"].as_array().map(Vec::len), Some(0), "{found:?}");
    }

    // Editing the second paragraph keeps the first piece's row and replaces the second's.
    let edit = app
        .client
        .post(
            "/v1/workspace/files/MEMORY.md/edit",
            Some(&ann),
            &json!({ "old_text": "night trains", "new_text": "day trains" }),
        )
        .await;
    assert_eq!(edit.status, 200, "{:?}", edit.body);
    let after = pieces(&app, "MEMORY.md").await;
    assert_eq!(after.len(), 2);
    assert!(after.contains(&before[0]) && !after.contains(&before[1]), "{before:?} → {after:?}");
    let retired = app
        .db
        .count("SELECT count(*) FROM memory_items WHERE source_kind = 'workspace_note' AND deleted_at IS NOT NULL")
        .await;
    assert_eq!(retired, 1);

    // Deleting a note retires its pieces; restoring it brings them back as new rows.
    app.client.delete(note, Some(&ann)).await;
    assert!(pieces(&app, &note_path).await.is_empty());
    let store = app.db.store();
    let key = FileKey {
        tenant: TenantId::parse("acme").expect("id"),
        agent: AgentId::parse("helper").expect("id"),
        user: Some(UserId::parse("ann").expect("id")),
        path: WorkspacePath::parse(&note_path).expect("path"),
    };
    store.restore_file(&key, 1, MAX, "runbook").await.expect("restore");
    assert_eq!(pieces(&app, &note_path).await.len(), 1);

    // Files written before recall indexed them (no pieces) are indexed by the runbook's
    // reindex; pieces already there keep their rows.
    for forget in [
        "DELETE FROM memory_embeddings e USING memory_items m WHERE e.item_id = m.id AND m.metadata ->> 'path' = $1",
        "DELETE FROM memory_items WHERE metadata ->> 'path' = $1",
    ] {
        sqlx::query(forget).bind(&note_path).execute(store.pool()).await.expect("forget the pieces");
    }
    let kept = pieces(&app, "MEMORY.md").await;
    assert_eq!(store.reindex_recallable_files(None, &mut |_, _| {}).await.expect("reindex"), 2);
    assert_eq!(pieces(&app, &note_path).await.len(), 1);
    assert_eq!(pieces(&app, "MEMORY.md").await, kept);
    let again = pieces(&app, &note_path).await;
    store.reindex_recallable_files(Some(&key.tenant), &mut |_, _| {}).await.expect("again");
    assert_eq!(pieces(&app, &note_path).await, again, "idempotent");

    // A piece its user deleted, of the file's current version: a reindex leaves it hidden and
    // goes on (it used to stop at its source_ref, which names a deleted row).
    let deleted = app.client.delete(&format!("/v1/memories/{}", kept[1]), Some(&ann)).await;
    assert_eq!(deleted.status, 200, "{:?}", deleted.body);
    assert_eq!(store.reindex_recallable_files(None, &mut |_, _| {}).await.expect("reindex past a deleted piece"), 2);
    assert_eq!(pieces(&app, "MEMORY.md").await, [kept[0]]);
}
