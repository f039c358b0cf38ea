//! `mnemo-runbook export|import`, the real binary: a round trip of 10,000 rows and more gives the
//! same content, a second import changes nothing, and a bad file is refused naming its line,
//! writing nothing.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use mnemo_core::{MemoryText, Scope, SourceKind, SourceRef, TenantId};
use mnemo_store::BulkRow;
use mnemo_testkit::{TestApp, TestDb, binary, principal, token};
use serde_json::json;
use uuid::Uuid;

const BULK_ROWS: usize = 10_000;

struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
}

async fn runbook(db_url: &str, args: &[&str], stdout_to: Option<&Path>) -> Run {
    let mut command = tokio::process::Command::new(binary("mnemo-runbook").expect("mnemo-runbook is built"));
    command.env_clear().env("MNEMO_DATABASE_URL", db_url).env("MNEMO_LOG", "warn").args(args);
    let output = command.output().await.expect("runbook runs");
    if let Some(path) = stdout_to {
        std::fs::write(path, &output.stdout).expect("output file");
    }
    Run {
        ok: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("mnemo-portability-{}-{}-{name}", std::process::id(), Uuid::new_v4()))
}

fn lines_of(path: &Path) -> Vec<String> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).expect("export")).read_to_string(&mut text).expect("gzip");
    text.lines().map(str::to_owned).collect()
}

fn write_gz(path: &Path, lines: &[String]) {
    let mut out =
        flate2::write::GzEncoder::new(std::fs::File::create(path).expect("file"), flate2::Compression::fast());
    for line in lines {
        writeln!(out, "{line}").expect("write");
    }
    out.finish().expect("gzip");
}

/// The rows of an export, sorted, without the header (which carries the export's time).
fn content(path: &Path) -> Vec<String> {
    let mut lines = lines_of(path);
    lines.remove(0);
    lines.sort();
    lines
}

/// A tenant with every kind of row: bulk memories with vectors, facts with a supersede chain and
/// a relation, a long tool output, a workspace file with two versions, an anonymized row.
async fn populated() -> TestApp {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let fact = |content: &str| json!({ "content": content, "scope": "user", "key": "home_city" });
    let old = app.client.post("/v1/facts", Some(&t), &fact("Alice lives in Paris")).await.body["id"].clone();
    let new = app.client.post("/v1/facts", Some(&t), &fact("Alice moved to Lyon")).await.body["id"].clone();
    let related = json!({ "content": "Alice likes trains", "scope": "user", "relations": [{ "type": "related_to", "target": new }] });
    assert_eq!(app.client.post("/v1/facts", Some(&t), &related).await.status, 201);
    let long = json!({ "source_kind": "tool_output", "source_ref": "call-1", "content": "y".repeat(20_000) });
    assert_eq!(app.client.post("/v1/memories", Some(&t), &long).await.status, 201);
    for content in ["# Notes\n\nv1\n", "# Notes\n\nv2\n"] {
        let put = app.client.put("/v1/workspace/files/memory/notes.md", Some(&t), &json!({ "content": content })).await;
        assert!(put.status < 300, "{:?}", put.body);
    }
    let gone = json!({ "source_kind": "chat_message", "source_ref": "m-gone", "content": "forget me" });
    let gone = app.client.post("/v1/memories", Some(&t), &gone).await.body["id"].clone();
    sqlx::query(
        "UPDATE memory_items SET superseded_by = $2::uuid, superseded_at = now(), valid_to = now() WHERE id = $1::uuid",
    )
    .bind(old.as_str())
    .bind(new.as_str())
    .execute(&app.db.pool)
    .await
    .expect("a chain");
    sqlx::query("UPDATE memory_items SET content = '', deleted_at = now(), anonymized_at = now() WHERE id = $1::uuid")
        .bind(gone.as_str())
        .execute(&app.db.pool)
        .await
        .expect("an anonymized row");
    let tenant = TenantId::parse("acme").expect("tenant");
    let rows: Vec<BulkRow> = (0..BULK_ROWS)
        .map(|i| BulkRow {
            id: Uuid::now_v7(),
            tenant: tenant.clone(),
            scope: Scope::Tenant,
            session: None,
            user: None,
            agent: None,
            kind: SourceKind::DocumentChunk,
            source_ref: SourceRef::parse(&format!("chunk-{i}")).expect("ref"),
            content: MemoryText::parse(&format!("chunk {i} of the manual")).expect("text"),
            created_at: None,
            deleted_at: None,
            vector: Some((0..384).map(|d| ((i + d) % 7) as f32 / 7.0).collect()),
        })
        .collect();
    app.db.store().bulk_load("all-MiniLM-L6-v2", &rows).await.expect("bulk load");
    app
}

#[tokio::test]
async fn a_round_trip_gives_the_same_content_and_a_second_import_changes_nothing() {
    let source = populated().await;
    // A fact deleted an hour ago, not yet anonymized.
    sqlx::query(
        "UPDATE memory_items SET deleted_at = now() - interval '1 hour', valid_to = now() - interval '1 hour'
         WHERE content = 'Alice likes trains'",
    )
    .execute(&source.db.pool)
    .await
    .expect("a deleted fact");
    let first = temp("first.jsonl.gz");
    let run = runbook(&source.db.url, &["export", "--tenant", "acme", "--with-vectors"], Some(&first)).await;
    assert!(run.ok, "{}", run.stderr);
    let exported = content(&first);
    assert!(exported.len() > 2 * BULK_ROWS, "{} lines", exported.len());
    for table in ["memory_items", "memory_embeddings", "tool_outputs", "memory_relations", "workspace_file_versions"] {
        assert!(exported.iter().any(|l| l.contains(&format!("\"table\":\"{table}\""))), "{table} exported");
    }

    let target = TestDb::new().await;
    // A dry run checks the whole file and reports what it would write, and writes nothing.
    let dry_args = ["import", "--dry-run", "--tenant", "acme", first.to_str().expect("path")];
    let dry = runbook(&target.url, &dry_args, None).await;
    assert!(dry.ok && dry.stdout.contains("nothing was written"), "{}", dry.stderr);
    assert!(dry.stdout.lines().any(|l| l.starts_with("memory_items") && !l.contains(" 0 written")), "{}", dry.stdout);
    assert_eq!(target.count("SELECT count(*) FROM memory_items").await, 0);
    assert_eq!(target.count("SELECT count(*) FROM workspace_files").await, 0);
    let run = runbook(&target.url, &["import", "--tenant", "acme", first.to_str().expect("path")], None).await;
    assert!(run.ok, "{}", run.stderr);
    // Each step of the writing is shown as it begins (a large tenant's take minutes).
    for step in ["checking references (", "writing memory_items (", "writing workspace_files (", "committing ("] {
        assert!(run.stderr.contains(step), "{step:?} in {}", run.stderr);
    }
    let again = runbook(&target.url, &["import", "--tenant", "acme", first.to_str().expect("path")], None).await;
    assert!(again.ok, "{}", again.stderr);
    let tables: Vec<&str> = again.stdout.lines().filter(|l| l.contains(" written ")).collect();
    assert!(tables.len() >= 5, "a line per table: {}", again.stdout);
    for line in tables {
        assert!(line.contains(" 0 written"), "a second import wrote: {line}");
    }

    // The copy's retirements have their audit rows, written once: its chains check as sound.
    let audited = "SELECT count(*) FROM audit_log WHERE actor = 'import' AND reason = 'imported'";
    assert_eq!(target.count(audited).await, 4, "one supersede, two deletions and one anonymization");
    // Stamped when they happened at the source, so as-of reads of the copy tell the same history.
    let stamped = "SELECT count(*) FROM audit_log a JOIN memory_items m ON m.id = a.item_id
                   WHERE a.actor = 'import' AND a.created_at = COALESCE(m.superseded_at, m.anonymized_at, m.deleted_at)";
    assert_eq!(target.count(stamped).await, 4);
    let deleted_fact = "SELECT count(*) FROM audit_log a JOIN memory_items m ON m.id = a.item_id
                        WHERE a.event = 'memory.delete' AND m.source_kind = 'fact' AND m.anonymized_at IS NULL";
    assert_eq!(target.count(deleted_fact).await, 1, "the deleted fact reads deleted in the copy's history");
    let check = runbook(&target.url, &["judge", "check", "--tenant", "acme", "--json"], None).await;
    assert!(check.ok, "{}{}", check.stdout, check.stderr);
    let check: serde_json::Value = serde_json::from_str(&check.stdout).expect("json");
    assert_eq!((check["superseded"].as_i64(), check["unaudited"].as_i64()), (Some(1), Some(0)), "{check}");

    let second = temp("second.jsonl.gz");
    let run = runbook(&target.url, &["export", "--tenant", "acme", "--with-vectors"], Some(&second)).await;
    assert!(run.ok, "{}", run.stderr);
    assert!(content(&second) == exported, "the round trip changed the content");
    let chain: i64 = sqlx::query_scalar("SELECT count(*) FROM memory_items WHERE superseded_by IS NOT NULL")
        .fetch_one(&target.pool)
        .await
        .expect("count");
    assert_eq!(chain, 1);

    // Without vectors, the importing side embeds again.
    let bare = temp("bare.jsonl.gz");
    assert!(runbook(&source.db.url, &["export", "--tenant", "acme"], Some(&bare)).await.ok);
    // A tenant the database holds nothing of (a mistyped name) is refused, not exported empty.
    let typo = runbook(&source.db.url, &["export", "--tenant", "acmee"], None).await;
    assert!(!typo.ok && typo.stderr.contains("nothing to export"), "{}", typo.stderr);
    let fresh = TestDb::new().await;
    let run = runbook(&fresh.url, &["import", "--tenant", "acme", bare.to_str().expect("path")], None).await;
    assert!(run.ok, "{}", run.stderr);
    let unembedded: i64 = sqlx::query_scalar("SELECT count(*) FROM memory_items WHERE embedded_model IS NULL")
        .fetch_one(&fresh.pool)
        .await
        .expect("count");
    assert!(unembedded >= BULK_ROWS as i64, "{unembedded} rows left to embed");
    let embedded = "SELECT count(*) FROM memory_items WHERE tenant_id = 'acme' AND embedded_model IS NOT NULL";
    let embedded = source.db.count(embedded).await;
    assert!(run.stdout.contains(&format!("\n{embedded} items to embed again")), "{embedded}: {}", run.stdout);
    assert_eq!(fresh.count("SELECT count(*) FROM memory_items WHERE embedded_model IS NOT NULL").await, 0);
    // Again: nothing new, nothing more to embed.
    let run = runbook(&fresh.url, &["import", "--tenant", "acme", bare.to_str().expect("path")], None).await;
    assert!(run.ok && run.stdout.contains("\n0 items to embed again"), "{}{}", run.stdout, run.stderr);
    for path in [first, second, bare] {
        let _ = std::fs::remove_file(path);
    }
}

/// The rows an export holds of one table, as JSON.
fn rows_of(path: &Path, table: &str) -> Vec<serde_json::Value> {
    let lines = lines_of(path);
    let marker = format!("\"table\":\"{table}\"");
    lines.iter().filter(|l| l.contains(&marker)).map(|l| serde_json::from_str(l).expect("json")).collect()
}

#[tokio::test]
async fn an_export_since_carries_later_changes_to_an_earlier_copy() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let mut ids = Vec::new();
    for (kind, reference, content) in [
        ("chat_message", "m-kept", "nothing happens to me".to_owned()),
        ("chat_message", "m-deleted", "delete me later".to_owned()),
        ("tool_output", "call-1", "y".repeat(20_000)),
    ] {
        let body = json!({ "source_kind": kind, "source_ref": reference, "content": content });
        let written = app.client.post("/v1/memories", Some(&t), &body).await;
        assert_eq!(written.status, 201, "{:?}", written.body);
        ids.push(written.body["id"].as_str().expect("id").to_owned());
    }
    let full = temp("full.jsonl.gz");
    assert!(runbook(&app.db.url, &["export", "--tenant", "acme"], Some(&full)).await.ok);
    let copy = TestDb::new().await;
    let run = runbook(&copy.url, &["import", "--tenant", "acme", full.to_str().expect("path")], None).await;
    assert!(run.ok, "{}", run.stderr);
    assert_eq!(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM tool_outputs").fetch_one(&copy.pool).await.expect("count"),
        1
    );

    // After the copy: one row soft-deleted through the API; the tool output anonymized as
    // retention does it (row redacted, payload deleted, its source_ref renamed so the key is
    // free), and a new tool output written under the freed source_ref.
    let since: String =
        sqlx::query_scalar("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')")
            .fetch_one(&app.db.pool)
            .await
            .expect("now");
    assert_eq!(app.client.delete(&format!("/v1/memories/{}", ids[1]), Some(&t)).await.status, 200);
    sqlx::query(
        "WITH payload AS (DELETE FROM tool_outputs WHERE item_id = $1::uuid)
         UPDATE memory_items SET content = '[REDACTED]', tool_output_key = NULL, anonymized_at = now(),
                                 deleted_at = now(), source_ref = source_ref || '|anonymized'
         WHERE id = $1::uuid",
    )
    .bind(&ids[2])
    .execute(&app.db.pool)
    .await
    .expect("anonymize");
    let again = json!({ "source_kind": "tool_output", "source_ref": "call-1", "content": "z".repeat(20_000) });
    let reused = app.client.post("/v1/memories", Some(&t), &again).await;
    assert_eq!(reused.status, 201, "{:?}", reused.body);
    let reused = reused.body["id"].as_str().expect("id").to_owned();

    let later = temp("later.jsonl.gz");
    let run = runbook(&app.db.url, &["export", "--tenant", "acme", "--since", &since], Some(&later)).await;
    assert!(run.ok, "{}", run.stderr);
    let mut exported: Vec<String> =
        rows_of(&later, "memory_items").iter().map(|l| l["row"]["id"].as_str().expect("id").to_owned()).collect();
    exported.sort();
    let mut changed = vec![ids[1].clone(), ids[2].clone(), reused.clone()];
    changed.sort();
    assert_eq!(exported, changed, "the export since holds exactly the rows changed since");

    // The copy faded the row the source deleted, after the delete: its own access clock, which
    // does not make its row the later one.
    sqlx::query("UPDATE memory_items SET faded_at = now() WHERE id = $1::uuid")
        .bind(&ids[1])
        .execute(&copy.pool)
        .await
        .expect("fade");
    let run = runbook(&copy.url, &["import", "--tenant", "acme", later.to_str().expect("path")], None).await;
    assert!(run.ok, "{}", run.stderr);
    let items = run.stdout.lines().find(|l| l.starts_with("memory_items ")).expect("the items' line");
    assert!(items.contains(" 1 written") && items.contains(" 2 updated"), "{items}");
    let deleted: bool = sqlx::query_scalar("SELECT deleted_at IS NOT NULL FROM memory_items WHERE id = $1::uuid")
        .bind(&ids[1])
        .fetch_one(&copy.pool)
        .await
        .expect("row");
    assert!(deleted, "the deletion reached the copy");
    let (content, anonymized): (String, bool) =
        sqlx::query_as("SELECT content, anonymized_at IS NOT NULL FROM memory_items WHERE id = $1::uuid")
            .bind(&ids[2])
            .fetch_one(&copy.pool)
            .await
            .expect("row");
    assert!(anonymized && content == "[REDACTED]", "the anonymization reached the copy");
    let payloads: Vec<String> =
        sqlx::query_scalar("SELECT item_id::text FROM tool_outputs").fetch_all(&copy.pool).await.expect("payloads");
    assert_eq!(payloads, vec![reused], "the copy kept a payload its source erased, or lost the new one");

    // Again: the copy is as new as the file, so nothing changes; and the older full export
    // brought in again does not undo the changes.
    for file in [&later, &full] {
        let again = runbook(&copy.url, &["import", "--tenant", "acme", file.to_str().expect("path")], None).await;
        assert!(again.ok, "{}", again.stderr);
        let tables: Vec<&str> = again.stdout.lines().filter(|l| l.contains(" written ")).collect();
        assert!(tables.len() >= 5, "a line per table: {}", again.stdout);
        for line in tables {
            assert!(line.contains(" 0 written") && line.contains(" 0 updated"), "{line}");
        }
    }
    let redacted: i64 = sqlx::query_scalar("SELECT count(*) FROM memory_items WHERE content = '[REDACTED]'")
        .fetch_one(&copy.pool)
        .await
        .expect("count");
    assert_eq!(redacted, 1);
    for path in [full, later] {
        let _ = std::fs::remove_file(path);
    }
}

/// `changed_at` follows a row's state, which is every column the change trigger names; the keys
/// and the bookkeeping are the rest. A new column must be one or the other.
#[tokio::test]
async fn every_memory_column_is_state_or_bookkeeping() {
    const KEYS_AND_BOOKKEEPING: &[&str] = &[
        "id",
        "tenant_id",
        "changed_at",
        "tsv",
        "embedded_model",
        "embed_attempts",
        "embed_failing_since",
        "embed_error",
        "embed_enqueued_at",
        "judge_enqueued_at",
        // Counts reopens only so that a judgement in flight across one is dropped.
        "judge_reopens",
        // Set and cleared only with judge_at and the outcome, which are state.
        "judge_retry_at",
        "last_accessed_at",
        "access_count",
        // Fading goes by the access clock, which is each copy's own.
        "faded_at",
    ];
    let db = TestDb::new().await;
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns
         WHERE table_schema = current_schema() AND table_name = 'memory_items'",
    )
    .fetch_all(&db.pool)
    .await
    .expect("columns");
    let trigger: String =
        sqlx::query_scalar("SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgname = 'memory_items_changed'")
            .fetch_one(&db.pool)
            .await
            .expect("the change trigger");
    // PostgreSQL prints the row comparison column by column.
    let named = |c: &str| trigger.to_lowercase().contains(&format!("old.{c} is distinct from new.{c})"));
    let unclassified: Vec<&String> =
        columns.iter().filter(|c| !KEYS_AND_BOOKKEEPING.contains(&c.as_str()) && !named(c)).collect();
    assert!(unclassified.is_empty(), "columns neither state nor bookkeeping: {unclassified:?}");
}

/// A `{"table", "row"}` line with one field of its row set to `value`.
fn set_field(line: &str, field: &str, value: serde_json::Value) -> String {
    let mut parsed: serde_json::Value = serde_json::from_str(line).expect("a row line");
    parsed["row"][field] = value;
    parsed.to_string()
}

/// Imports `lines` and expects a refusal saying `expected`, with nothing written.
async fn refused(target: &TestDb, name: &str, lines: Vec<String>, extra: &[&str], expected: &str) {
    let path = temp(name);
    write_gz(&path, &lines);
    let mut args = vec!["import", "--tenant", "acme"];
    args.extend(extra);
    args.push(path.to_str().expect("path"));
    let run = runbook(&target.url, &args, None).await;
    let _ = std::fs::remove_file(&path);
    assert!(!run.ok, "{name} was imported");
    assert!(run.stderr.contains(expected), "{name}: expected {expected:?} in {}", run.stderr);
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM memory_items").fetch_one(&target.pool).await.expect("count");
    assert_eq!(rows, 0, "{name} wrote rows");
}

#[tokio::test]
async fn a_bad_file_is_refused_naming_its_line_and_writes_nothing() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    for i in 0..3 {
        let body =
            json!({ "source_kind": "chat_message", "source_ref": format!("m{i}"), "content": format!("message {i}") });
        assert_eq!(app.client.post("/v1/memories", Some(&t), &body).await.status, 201);
    }
    let memory = json!({ "content": "u1 likes tea" });
    assert_eq!(app.client.put("/v1/workspace/files/MEMORY.md", Some(&t), &memory).await.status, 201);
    sqlx::query("INSERT INTO tenant_config (tenant_id, settings) VALUES ('acme', '{\"time_zone\": \"Asia/Tokyo\"}')")
        .execute(&app.db.pool)
        .await
        .expect("acme's settings");
    let good = temp("good.jsonl.gz");
    let run = runbook(&app.db.url, &["export", "--tenant", "acme"], Some(&good)).await;
    assert!(run.ok, "{}", run.stderr);
    let lines = lines_of(&good);
    let item = lines.iter().position(|l| l.contains("\"table\":\"memory_items\"")).expect("an item line");

    let target = TestDb::new().await;

    let mut version = lines.clone();
    version[0] = version[0].replace("\"version\":1", "\"version\":99");
    refused(&target, "version", version, &[], "line 1: export format version 99").await;

    let mut other = lines.clone();
    other[item] = other[item].replace("\"tenant_id\":\"acme\"", "\"tenant_id\":\"globex\"");
    refused(&target, "other tenant", other, &[], &format!("line {}: a row of tenant \"globex\"", item + 1)).await;

    let mut chain = lines.clone();
    let missing = Uuid::now_v7();
    chain[item] = chain[item].replace("\"superseded_by\":null", &format!("\"superseded_by\":\"{missing}\""));
    let expected = format!("line {}: memory_items.superseded_by points at {missing}", item + 1);
    refused(&target, "chain", chain, &[], &expected).await;

    // An erasure line without a usable hash.
    let mut erasure = lines.clone();
    let end = erasure.pop().expect("the end line");
    let rows = serde_json::from_str::<serde_json::Value>(&end).expect("json")["end"]["rows"].as_u64().expect("rows");
    erasure.push(
        json!({"table": "erasures", "row": {"tenant_id": "acme", "user_sha256": "beef", "erased_at": "2026-01-01T00:00:00Z"}})
            .to_string(),
    );
    erasure.push(json!({"end": {"rows": rows + 1}}).to_string());
    let expected = format!("line {}: an erasure needs a user_sha256", erasure.len() - 1);
    refused(&target, "erasure", erasure, &[], &expected).await;

    // An erasure dated after the export.
    let mut future = lines.clone();
    let end = future.pop().expect("the end line");
    let hash = "ab".repeat(32);
    future.push(
        json!({"table": "erasures", "row": {"tenant_id": "acme", "user_sha256": hash, "erased_at": "9999-01-01T00:00:00Z"}})
            .to_string(),
    );
    future.push(json!({"end": {"rows": rows + 1}}).to_string());
    assert!(end.contains(&format!("\"rows\":{rows}")));
    let expected = format!("line {}: an erasure needs", future.len() - 1);
    refused(&target, "future erasure", future.clone(), &[], &expected).await;

    // A header whose time is not one, and an erasure in a file that does not say when it was
    // exported (the erasure could then be dated after it).
    let mut header: serde_json::Value = lines[0].parse().expect("header");
    header["exported_at"] = json!("yesterday");
    let mut bad_time = lines.clone();
    bad_time[0] = header.to_string();
    refused(&target, "bad export time", bad_time, &[], "line 1: exported_at is not an RFC 3339 time").await;
    let mut undated = future.clone();
    header.as_object_mut().expect("header").remove("exported_at");
    undated[0] = header.to_string();
    let dated = undated.len() - 2;
    undated[dated] = undated[dated].replace("9999-01-01", "2026-01-01");
    refused(&target, "undated export", undated, &[], &format!("line {}: an erasure needs", dated + 1)).await;

    // Rows a write would refuse: a reserved source_ref, a path no write accepts, a user's file
    // held by the agent (every user's prompt would show it), a size that is not the content's.
    let cannot = |line: usize, table: &str| format!("line {}: a {table} row this mnemo cannot store", line + 1);
    let mut reserved = lines.clone();
    reserved[item] = set_field(&reserved[item], "source_ref", json!("m0|anonymized"));
    refused(&target, "reserved ref", reserved, &[], &cannot(item, "memory_items")).await;
    let file = lines
        .iter()
        .position(|l| l.contains("\"table\":\"workspace_files\"") && l.contains("\"path\":\"MEMORY.md\""))
        .expect("MEMORY.md's line");
    let mut bad_path = lines.clone();
    bad_path[file] = set_field(&bad_path[file], "path", json!("../notes.txt"));
    refused(&target, "bad path", bad_path, &[], &cannot(file, "workspace_files")).await;
    let mut agents = lines.clone();
    agents[file] = set_field(&agents[file], "user_id", json!(""));
    let expected = format!("{}: MEMORY.md is not a file of the agent", cannot(file, "workspace_files"));
    refused(&target, "agent's memory", agents, &[], &expected).await;
    let mut size = lines.clone();
    size[file] = set_field(&size[file], "size_bytes", json!(1));
    refused(&target, "size", size, &[], &cannot(file, "workspace_files")).await;
    // A fixed offset PostgreSQL would read with its sign inverted, moving every day of the tenant's.
    let config = lines.iter().position(|l| l.contains("\"table\":\"tenant_config\"")).expect("the settings' line");
    let mut offset = lines.clone();
    offset[config] = set_field(&offset[config], "settings", json!({ "time_zone": "UTC+3" }));
    let expected = format!("{}: time_zone \"UTC+3\" is not a region's zone", cannot(config, "tenant_config"));
    refused(&target, "offset zone", offset, &[], &expected).await;
    // A region's name this PostgreSQL does not know (it would read as UTC).
    let mut unknown = lines.clone();
    unknown[config] = set_field(&unknown[config], "settings", json!({ "time_zone": "Mars/Olympus_Mons" }));
    let expected = format!("{}: time_zone \"Mars/Olympus_Mons\" is not one", cannot(config, "tenant_config"));
    refused(&target, "unknown zone", unknown, &[], &expected).await;

    let mut newer = lines.clone();
    let mut header: serde_json::Value = serde_json::from_str(&lines[0]).expect("header");
    assert!(header["schema"].as_i64().is_some_and(|v| v > 0), "{header}");
    header["schema"] = json!(i64::MAX);
    newer[0] = header.to_string();
    refused(&target, "newer schema", newer, &[], "line 1: the file was exported from a newer schema").await;

    // A field no column holds would be dropped without a word.
    let mut unknown = lines.clone();
    unknown[item] = unknown[item].replace("\"tenant_id\":", "\"mood\":\"sunny\",\"tenant_id\":");
    let expected = format!("line {}: memory_items has no column \"mood\"", item + 1);
    refused(&target, "unknown column", unknown, &[], &expected).await;

    // A value of the wrong type, found before anything is written, and one that breaks a
    // constraint, found as the rows are written: both name their line.
    let last_item = lines.iter().rposition(|l| l.contains("\"table\":\"memory_items\"")).expect("an item line");
    assert!(last_item > item);
    let mut bad_time = lines.clone();
    bad_time[last_item] = set_field(&bad_time[last_item], "created_at", json!("the day before"));
    let expected = format!("line {}: a memory_items row this mnemo cannot store: invalid input syntax", last_item + 1);
    refused(&target, "bad time", bad_time, &[], &expected).await;
    let mut out_of_range = lines.clone();
    out_of_range[last_item] = set_field(&out_of_range[last_item], "importance", json!(7));
    let expected = format!("line {}: a memory_items row this mnemo cannot store: new row for relation", last_item + 1);
    refused(&target, "out of range", out_of_range, &[], &expected).await;

    let mut cut = lines.clone();
    cut.pop();
    refused(&target, "no end line", cut, &[], "without its end line").await;

    // Two vectors of one model, of two lengths.
    let mut vectors = lines.clone();
    vectors.pop();
    let items: Vec<serde_json::Value> = lines
        .iter()
        .filter(|l| l.contains("\"table\":\"memory_items\""))
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json")["row"].clone())
        .collect();
    for (item, dims) in items.iter().zip([4, 3]) {
        let embedding = format!("[{}]", vec!["0.5"; dims].join(","));
        let row = json!({"tenant_id": "acme", "item_id": item["id"], "model": "m", "embedding": embedding,
                         "content_sha256": item["content_sha256"]});
        vectors.push(json!({"table": "memory_embeddings", "row": row}).to_string());
    }
    vectors.push(json!({"end": {"rows": rows + 2}}).to_string());
    let expected = format!(
        "line {}: a memory_embeddings row this mnemo cannot store: a vector of 3 dimensions for model m, whose vectors have 4",
        vectors.len() - 1
    );
    refused(&target, "vector lengths", vectors.clone(), &[], &expected).await;
    // All of one length, but not that of the model's index (built for another tenant's vectors).
    assert!(target.store().ensure_vector_index("m", 4).await.expect("index"));
    let three: Vec<String> = vectors.iter().map(|l| l.replace("[0.5,0.5,0.5,0.5]", "[0.5,0.5,0.5]")).collect();
    let first = three.iter().position(|l| l.contains("\"table\":\"memory_embeddings\"")).expect("a vector line");
    let expected = format!(
        "line {}: a memory_embeddings row this mnemo cannot store: a vector of 3 dimensions for model m, whose vectors have 4",
        first + 1
    );
    refused(&target, "index length", three, &[], &expected).await;

    // The bytes cut in the middle of the compressed stream.
    let bytes = std::fs::read(&good).expect("export");
    let truncated = temp("truncated.jsonl.gz");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).expect("write");
    let run = runbook(&target.url, &["import", "--tenant", "acme", truncated.to_str().expect("path")], None).await;
    assert!(!run.ok && run.stderr.contains("truncated"), "{}", run.stderr);
    let _ = std::fs::remove_file(&truncated);

    // Another tenant's export goes in only with --retarget, and then under the new tenant, which
    // keeps its own settings unless --with-settings, which replaces them even though they
    // changed after the file's.
    let run = runbook(&target.url, &["import", "--tenant", "beta", good.to_str().expect("path")], None).await;
    assert!(!run.ok && run.stderr.contains("line 1: the file holds tenant \"acme\""), "{}", run.stderr);
    sqlx::query(
        "INSERT INTO tenant_config (tenant_id, settings, updated_at)
         VALUES ('beta', '{\"time_zone\": \"Europe/Paris\"}', now() + interval '1 day')",
    )
    .execute(&target.pool)
    .await
    .expect("beta's settings");
    let retarget = ["import", "--tenant", "beta", "--retarget", good.to_str().expect("path")];
    let run = runbook(&target.url, &retarget, None).await;
    assert!(run.ok, "{}", run.stderr);
    assert!(run.stdout.contains("settings left out"), "{}", run.stdout);
    let beta: i64 = sqlx::query_scalar("SELECT count(*) FROM memory_items WHERE tenant_id = 'beta'")
        .fetch_one(&target.pool)
        .await
        .expect("count");
    assert_eq!(beta, 4, "three messages and MEMORY.md's piece");
    let zone = || async {
        sqlx::query_scalar::<_, String>("SELECT settings ->> 'time_zone' FROM tenant_config WHERE tenant_id = 'beta'")
            .fetch_one(&target.pool)
            .await
            .expect("zone")
    };
    assert_eq!(zone().await, "Europe/Paris");
    let run = runbook(&target.url, &[&retarget[..], &["--with-settings"]].concat(), None).await;
    assert!(run.ok, "{}", run.stderr);
    assert_eq!(zone().await, "Asia/Tokyo");

    let memory_of_beta = || async {
        sqlx::query_as::<_, (String, i32)>(
            "SELECT content, version FROM workspace_files WHERE tenant_id = 'beta' AND path = 'MEMORY.md'",
        )
        .fetch_one(&target.pool)
        .await
        .expect("beta's file")
    };
    let import_again = |content: &'static str| {
        let (app, t, target) = (&app, &t, &target);
        async move {
            let edit = json!({ "content": content });
            assert_eq!(app.client.put("/v1/workspace/files/MEMORY.md", Some(t), &edit).await.status, 200);
            let again = temp("again.jsonl.gz");
            let run = runbook(&app.db.url, &["export", "--tenant", "acme"], Some(&again)).await;
            assert!(run.ok, "{}", run.stderr);
            let import = ["import", "--tenant", "beta", "--retarget", again.to_str().expect("path")];
            let run = runbook(&target.url, &import, None).await;
            let _ = std::fs::remove_file(&again);
            run
        }
    };
    // The source's file went a version further, though the copy's clock says its own changed
    // later: the history that went further wins (by time alone, its next write would collide).
    sqlx::query("UPDATE workspace_files SET updated_at = now() + interval '1 day' WHERE tenant_id = 'beta'")
        .execute(&target.pool)
        .await
        .expect("a copy's clock ahead");
    let run = import_again("u1 likes coffee").await;
    assert!(run.ok, "{}", run.stderr);
    assert_eq!(memory_of_beta().await, ("u1 likes coffee".to_owned(), 2));

    // Both copies change after that: version 3 holds other text on each side. Imported, the
    // file's history would collide with the next write: refused, unchanged.
    sqlx::query(
        "WITH f AS (UPDATE workspace_files SET content = 'u1 likes beta', size_bytes = 13, version = 3
                    WHERE tenant_id = 'beta' AND path = 'MEMORY.md' RETURNING *)
         INSERT INTO workspace_file_versions (tenant_id, agent_id, user_id, path, version, content, enabled, sort_order, deleted, actor)
         SELECT tenant_id, agent_id, user_id, path, version, content, enabled, sort_order, false, 'api' FROM f",
    )
    .execute(&target.pool)
    .await
    .expect("beta's own edit");
    let run = import_again("u1 likes cocoa").await;
    assert!(!run.ok && run.stderr.contains("workspace file MEMORY.md was changed both"), "{}", run.stderr);
    assert_eq!(memory_of_beta().await, ("u1 likes beta".to_owned(), 3));
    let _ = std::fs::remove_file(&good);
}

/// A file written before columns were added: rows take the columns' defaults, or what the
/// migration that added them gave the rows it found (migration 23: an agent's fact is read as
/// widely as its class, a daily note's pieces are episodic).
#[tokio::test]
async fn a_file_of_an_earlier_schema_takes_the_defaults_of_the_columns_added_since() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    for i in 0..3 {
        let body = json!({ "source_kind": "chat_message", "source_ref": format!("m{i}"), "content": format!("m {i}") });
        assert_eq!(app.client.post("/v1/memories", Some(&t), &body).await.status, 201);
    }
    let service = token(&principal("acme", None, Some("a1"), None));
    let fact = json!({ "scope": "agent", "content": "the office closes at six" });
    assert_eq!(app.client.post("/v1/facts", Some(&service), &fact).await.status, 201);
    let note = "/v1/workspace/files/memory/2026-11-20.md";
    assert!(app.client.put(note, Some(&t), &json!({ "content": "# 2026-11-20\n\n- met Ann\n" })).await.status < 300);
    let file = temp("earlier.jsonl.gz");
    let run = runbook(&app.db.url, &["export", "--tenant", "acme"], Some(&file)).await;
    assert!(run.ok, "{}", run.stderr);
    // As a file written before `tags` (a default) and `importance` (none) existed, and before
    // migration 23's `visibility` and `layer`.
    let lines: Vec<String> = lines_of(&file)
        .into_iter()
        .map(|line| {
            let mut value: serde_json::Value = serde_json::from_str(&line).expect("json");
            if value["table"] == "memory_items" {
                let row = value["row"].as_object_mut().expect("row");
                assert!(row.remove("tags").is_some() && row.remove("importance").is_some());
                assert!(row.remove("visibility").is_some() && row.remove("layer").is_some());
            }
            value.to_string()
        })
        .collect();
    write_gz(&file, &lines);

    let target = TestDb::new().await;
    let run = runbook(&target.url, &["import", "--tenant", "acme", file.to_str().expect("path")], None).await;
    let _ = std::fs::remove_file(&file);
    assert!(run.ok, "{}", run.stderr);
    let rows: Vec<(Vec<String>, Option<f32>)> =
        sqlx::query_as("SELECT tags, importance FROM memory_items WHERE source_kind = 'chat_message'")
            .fetch_all(&target.pool)
            .await
            .expect("rows");
    assert_eq!(rows.len(), 3);
    assert!(rows.iter().all(|(tags, importance)| tags.is_empty() && importance.is_none()), "{rows:?}");
    let backfilled: Vec<(String, String, String)> =
        sqlx::query_as("SELECT source_kind, visibility, layer FROM memory_items WHERE source_kind <> 'chat_message'")
            .fetch_all(&target.pool)
            .await
            .expect("rows");
    assert!(backfilled.contains(&("fact".into(), "agent".into(), "semantic".into())), "{backfilled:?}");
    let note_pieces = backfilled.iter().filter(|(kind, _, _)| kind == "workspace_note");
    assert!(
        note_pieces.clone().count() > 0 && note_pieces.into_iter().all(|(_, _, l)| l == "episodic"),
        "{backfilled:?}"
    );
}

#[tokio::test]
async fn a_memory_whose_source_ref_another_row_holds_is_refused() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let body = json!({ "source_kind": "chat_message", "source_ref": "m0", "content": "message 0" });
    assert_eq!(app.client.post("/v1/memories", Some(&t), &body).await.status, 201);
    let good = temp("clash.jsonl.gz");
    assert!(runbook(&app.db.url, &["export", "--tenant", "acme"], Some(&good)).await.ok);
    let target = TestDb::new().await;
    assert!(runbook(&target.url, &["import", "--tenant", "acme", good.to_str().expect("path")], None).await.ok);

    // The same message under another id (written to each copy on its own, say): the insert would
    // have skipped it as if it were there already.
    let mut lines = lines_of(&good);
    let item = lines.iter().position(|l| l.contains("\"table\":\"memory_items\"")).expect("an item line");
    let id = serde_json::from_str::<serde_json::Value>(&lines[item]).expect("json")["row"]["id"].clone();
    let other = Uuid::now_v7();
    lines[item] = lines[item].replace(id.as_str().expect("id"), &other.to_string());
    let clash = temp("clash2.jsonl.gz");
    write_gz(&clash, &lines);
    let run = runbook(&target.url, &["import", "--tenant", "acme", clash.to_str().expect("path")], None).await;
    assert!(!run.ok, "imported: {}", run.stdout);
    let expected = format!(
        "line {}: its memory's source_ref is held by another row of the tenant ({})",
        item + 1,
        id.as_str().expect("id")
    );
    assert!(run.stderr.contains(&expected), "{}", run.stderr);
    assert_eq!(target.count("SELECT count(*) FROM memory_items").await, 1);
    for path in [good, clash] {
        let _ = std::fs::remove_file(path);
    }
}

#[tokio::test]
async fn an_export_reads_every_table_from_one_snapshot() {
    use futures_util::StreamExt;
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let tenant = TenantId::parse("acme").expect("tenant");
    let store = app.db.store();
    let mut export = store.begin_export().await.expect("an export");
    let items: Vec<_> = export.rows(&tenant, ("memory_items", "changed_at"), None).collect().await;
    assert!(items.is_empty(), "{items:?}");

    // A long tool output written while the export is under way: its item was not exported, so
    // its payload must not be either (an import would refuse the payload as dangling).
    let long = json!({ "source_kind": "tool_output", "source_ref": "call-1", "content": "y".repeat(20_000) });
    assert_eq!(app.client.post("/v1/memories", Some(&t), &long).await.status, 201);
    assert_eq!(app.db.count("SELECT count(*) FROM tool_outputs").await, 1);
    let payloads: Vec<_> = export.rows(&tenant, ("tool_outputs", "created_at"), None).collect().await;
    assert!(payloads.is_empty(), "a payload from after the snapshot: {} rows", payloads.len());
}

#[tokio::test]
async fn an_export_made_before_an_erasure_does_not_bring_the_users_files_back() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let put =
        app.client.put("/v1/workspace/files/memory/notes.md", Some(&t), &json!({ "content": "# Notes\n\nv1\n" })).await;
    assert!(put.status < 300, "{:?}", put.body);
    let said = json!({ "source_kind": "chat_message", "source_ref": "m1", "content": "my secret plan" });
    assert_eq!(app.client.post("/v1/memories", Some(&t), &said).await.status, 201);
    // A memory of the agent's, written by its service, that the user stated again: it stays,
    // the sighting naming the user goes.
    let stated = json!({ "scope": "agent", "content": "the team ships on Fridays", "layer": "episodic" });
    let service = token(&principal("acme", None, Some("a1"), None));
    for by in [&service, &t] {
        let reply = app.client.post("/v1/facts", Some(by), &stated).await;
        assert!(reply.status < 300, "{:?}", reply.body);
    }
    let sightings = "SELECT count(*) FROM memory_sightings x JOIN memory_items m ON m.id = x.item_id
                     WHERE x.user_id = 'u1' AND m.user_id IS NULL";
    assert_eq!(app.db.count(sightings).await, 1);
    let before = temp("before-erasure.jsonl.gz");
    assert!(runbook(&app.db.url, &["export", "--tenant", "acme"], Some(&before)).await.ok);
    let files = "SELECT count(*) FROM workspace_files WHERE user_id = 'u1'";
    assert!(app.db.count(files).await > 0);

    let erased = runbook(&app.db.url, &["erase", "--tenant", "acme", "--user", "u1"], None).await;
    assert!(erased.ok, "{}", erased.stderr);
    assert_eq!(app.db.count(files).await, 0);
    assert_eq!(app.db.count(sightings).await, 0);

    // Restoring the earlier copy over the erased tenant: the memories stay anonymized (an
    // anonymized row is never replaced) and the files stay gone.
    let run = runbook(&app.db.url, &["import", "--tenant", "acme", before.to_str().expect("path")], None).await;
    assert!(run.ok, "{}", run.stderr);
    assert_eq!(app.db.count(files).await, 0, "the erased user's files came back");
    assert_eq!(app.db.count(sightings).await, 0, "the erased user's sightings came back");
    assert!(
        run.stdout.contains("workspace files, versions and sightings of users erased since left out"),
        "{}",
        run.stdout
    );
    assert_eq!(app.db.count("SELECT count(*) FROM workspace_file_versions WHERE user_id = 'u1'").await, 0);
    assert_eq!(app.db.count("SELECT count(*) FROM memory_items WHERE content = 'my secret plan'").await, 0);
    let _ = std::fs::remove_file(&before);
}

/// A tenant moved (full export, then a last export `--since`) whose user was erased at the new
/// place in between: what the user wrote at the old place before the erasure comes in
/// anonymized, and their file, changed at the old place after it, stays gone with every version
/// (its later version alone used to be kept, and the import refused for it).
#[tokio::test]
async fn a_last_export_since_brings_back_nothing_of_a_user_erased_at_the_new_place() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let note = "/v1/workspace/files/memory/notes.md";
    assert!(app.client.put(note, Some(&t), &json!({ "content": "# Notes\n\nv1\n" })).await.status < 300);
    let said = json!({ "source_kind": "chat_message", "source_ref": "m1", "content": "my first plan" });
    assert_eq!(app.client.post("/v1/memories", Some(&t), &said).await.status, 201);
    let full = temp("moved-full.jsonl.gz");
    assert!(runbook(&app.db.url, &["export", "--tenant", "acme"], Some(&full)).await.ok);
    let new_place = TestDb::new().await;
    let run = runbook(&new_place.url, &["import", "--tenant", "acme", full.to_str().expect("path")], None).await;
    assert!(run.ok, "{}", run.stderr);
    let since: String =
        sqlx::query_scalar("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')")
            .fetch_one(&app.db.pool)
            .await
            .expect("now");

    // At the old place, before the erasure at the new one: another message, and one answered
    // by the agent, then deleted and anonymized by retention: the reply is marked as u1's.
    let said = json!({ "source_kind": "chat_message", "source_ref": "m2", "content": "my second plan" });
    assert_eq!(app.client.post("/v1/memories", Some(&t), &said).await.status, 201);
    let said = json!({ "source_kind": "chat_message", "source_ref": "m3", "content": "my third plan" });
    assert_eq!(app.client.post("/v1/memories", Some(&t), &said).await.status, 201);
    let agent = token(&principal("acme", None, Some("a1"), Some("s1")));
    let reply =
        json!({ "source_kind": "chat_message", "source_ref": "r3", "role": "assistant", "content": "noted, u1" });
    assert_eq!(app.client.post("/v1/memories", Some(&agent), &reply).await.status, 201);
    let deleted = "UPDATE memory_items SET deleted_at = now() - interval '1 hour' WHERE content = 'my third plan'";
    sqlx::query(deleted).execute(&app.db.pool).await.expect("deleted");
    let cutoffs = mnemo_store::Cutoffs { deleted_before: chrono::Utc::now(), superseded_before: chrono::Utc::now() };
    let tenant = TenantId::parse("acme").expect("tenant");
    app.db.store().anonymize_due(&tenant, cutoffs, uuid::Uuid::nil(), 10, "test").await.expect("anonymized");
    assert_eq!(app.db.count("SELECT count(*) FROM memory_items WHERE reply_to_user_sha256 IS NOT NULL").await, 1);
    let erased = runbook(&new_place.url, &["erase", "--tenant", "acme", "--user", "u1"], None).await;
    assert!(erased.ok, "{}", erased.stderr);
    // After it: the file changed.
    assert!(app.client.put(note, Some(&t), &json!({ "content": "# Notes\n\nv2\n" })).await.status < 300);

    let last = temp("moved-since.jsonl.gz");
    assert!(runbook(&app.db.url, &["export", "--tenant", "acme", "--since", &since], Some(&last)).await.ok);
    let run = runbook(&new_place.url, &["import", "--tenant", "acme", last.to_str().expect("path")], None).await;
    assert!(run.ok, "{}", run.stderr);
    assert!(
        run.stdout.contains("2 memories of users erased here after they were written anonymized"),
        "the second message and the reply marked as u1's: {}",
        run.stdout
    );
    let plans =
        "SELECT count(*) FROM memory_items WHERE content LIKE 'my % plan' OR content = 'noted, u1' OR user_id = 'u1'";
    assert_eq!(new_place.count(plans).await, 0, "the user's words came back");
    assert_eq!(new_place.count("SELECT count(*) FROM workspace_files WHERE user_id = 'u1'").await, 0);
    assert_eq!(new_place.count("SELECT count(*) FROM workspace_file_versions WHERE user_id = 'u1'").await, 0);
    let audited =
        "SELECT count(*) FROM audit_log WHERE reason = 'erasure' AND actor = 'import' AND item_id IS NOT NULL";
    assert_eq!(new_place.count(audited).await, 2);
    let _ = (std::fs::remove_file(&full), std::fs::remove_file(&last));
}

/// A turn deleted at the source takes its words out of the next turn's vector in a copy kept by
/// exports `--since`: the copy drops the vector made with it and takes the source's new one, and
/// an older file's vector made with it is not brought back.
#[tokio::test]
async fn a_turn_deleted_at_the_source_leaves_the_next_turns_vector_in_a_copy() {
    let app = TestApp::spawn().await;
    let u1 = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let u2 = token(&principal("acme", Some("u2"), Some("a1"), Some("s1")));
    let write = |t: &str, source_ref: &str, content: &str| {
        let body = json!({ "source_kind": "chat_message", "source_ref": source_ref, "content": content });
        let (client, t) = (app.client.clone(), t.to_owned());
        async move {
            let reply = client.post("/v1/memories", Some(&t), &body).await;
            assert_eq!(reply.status, 201, "{:?}", reply.body);
            reply.body["id"].as_str().and_then(|s| s.parse::<Uuid>().ok()).expect("id")
        }
    };
    let said = write(&u1, "m1", "my secret plan").await;
    let answer = write(&u2, "m2", "a fine plan").await;
    let acme = TenantId::parse("acme").expect("tenant");
    let sha: Vec<u8> = sqlx::query_scalar("SELECT content_sha256 FROM memory_items WHERE id = $1")
        .bind(answer)
        .fetch_one(&app.db.pool)
        .await
        .expect("hash");
    let vector = |previous_id: Option<Uuid>| mnemo_store::NewVector {
        id: answer,
        tenant_id: acme.clone(),
        content_sha256: sha.clone(),
        embedding: vec![0.5; 4],
        previous_id,
    };
    assert_eq!(app.db.store().save_vectors("m", vec![vector(Some(said))]).await.expect("save").len(), 1);
    let full = temp("deleted-turn-full.jsonl.gz");
    assert!(runbook(&app.db.url, &["export", "--tenant", "acme", "--with-vectors"], Some(&full)).await.ok);
    let copy = TestDb::new().await;
    assert!(runbook(&copy.url, &["import", "--tenant", "acme", full.to_str().expect("path")], None).await.ok);
    let made_with_it = format!("SELECT count(*) FROM memory_embeddings WHERE previous_id = '{said}'");
    assert_eq!(copy.count(&made_with_it).await, 1);

    let since: String =
        sqlx::query_scalar("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')")
            .fetch_one(&app.db.pool)
            .await
            .expect("now");
    let deleted = app.client.delete(&format!("/v1/memories/{said}"), Some(&u1)).await;
    assert_eq!(deleted.status, 200, "{:?}", deleted.body);
    // The source's worker embeds the answer again, without the deleted turn.
    assert_eq!(app.db.store().save_vectors("m", vec![vector(None)]).await.expect("save").len(), 1);
    let later = temp("deleted-turn-since.jsonl.gz");
    let export = ["export", "--tenant", "acme", "--since", &since, "--with-vectors"];
    assert!(runbook(&app.db.url, &export, Some(&later)).await.ok);
    let run = runbook(&copy.url, &["import", "--tenant", "acme", later.to_str().expect("path")], None).await;
    assert!(run.ok, "{}", run.stderr);
    assert_eq!(copy.count(&made_with_it).await, 0, "the copy kept the deleted turn's words in a vector");
    let fresh = format!("SELECT count(*) FROM memory_embeddings WHERE item_id = '{answer}' AND previous_id IS NULL");
    assert_eq!(copy.count(&fresh).await, 1, "the source's new vector did not come in");

    // The full file from before, imported again, brings no vector made with the deleted turn.
    sqlx::query("DELETE FROM memory_embeddings").execute(&copy.pool).await.expect("no vectors");
    assert!(runbook(&copy.url, &["import", "--tenant", "acme", full.to_str().expect("path")], None).await.ok);
    assert_eq!(copy.count(&made_with_it).await, 0, "an older file brought the deleted turn's words back");
    let _ = (std::fs::remove_file(&full), std::fs::remove_file(&later));
}

/// A copy kept up to date by exports `--since` drops an erased user's files and sightings: the
/// source deletes them outright, so the export carries the erasure itself.
#[tokio::test]
async fn an_erasure_at_the_source_reaches_a_copy_kept_by_exports_since() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let put =
        app.client.put("/v1/workspace/files/memory/notes.md", Some(&t), &json!({ "content": "# Notes\n\nv1\n" })).await;
    assert!(put.status < 300, "{:?}", put.body);
    let said = json!({ "source_kind": "chat_message", "source_ref": "m1", "content": "my secret plan" });
    let said = app.client.post("/v1/memories", Some(&t), &said).await;
    assert_eq!(said.status, 201);
    // Another user's turn after it, whose vector is made with the words of the turn before it
    // (an agent's reply would be erased with u1).
    let other = token(&principal("acme", Some("u2"), Some("a1"), Some("s1")));
    let answer = json!({ "source_kind": "chat_message", "source_ref": "m2", "content": "a fine plan" });
    let answer = app.client.post("/v1/memories", Some(&other), &answer).await;
    assert_eq!(answer.status, 201);
    let id = |reply: &mnemo_testkit::Reply| reply.body["id"].as_str().and_then(|s| s.parse::<Uuid>().ok()).expect("id");
    let (said, answer) = (id(&said), id(&answer));
    let acme = TenantId::parse("acme").expect("tenant");
    let vector = |item: Uuid, previous_id: Option<Uuid>, sha: Vec<u8>| mnemo_store::NewVector {
        id: item,
        tenant_id: acme.clone(),
        content_sha256: sha,
        embedding: vec![0.5; 4],
        previous_id,
    };
    let shas: Vec<Vec<u8>> =
        sqlx::query_scalar("SELECT content_sha256 FROM memory_items WHERE id = ANY($1) ORDER BY source_ref")
            .bind([said, answer])
            .fetch_all(&app.db.pool)
            .await
            .expect("hashes");
    let vectors = vec![vector(said, None, shas[0].clone()), vector(answer, Some(said), shas[1].clone())];
    assert_eq!(app.db.store().save_vectors("m", vectors).await.expect("save").len(), 2);
    // A compaction of the session whose summary was made from u1's words.
    sqlx::query(
        "INSERT INTO session_compactions
             (tenant_id, session_id, through_id, through_time, messages, outcome, model, trigger, participants)
         VALUES ('acme', 's1', $1, now(), 2, 'summarized', 'm', 'threshold',
                 ARRAY[encode(sha256(convert_to('u1', 'UTF8')), 'hex')])",
    )
    .bind(answer)
    .execute(&app.db.pool)
    .await
    .expect("a compaction");
    let full = temp("copy-full.jsonl.gz");
    assert!(runbook(&app.db.url, &["export", "--tenant", "acme", "--with-vectors"], Some(&full)).await.ok);
    let copy = TestDb::new().await;
    let run = runbook(&copy.url, &["import", "--tenant", "acme", full.to_str().expect("path")], None).await;
    assert!(run.ok, "{}", run.stderr);
    let files = "SELECT count(*) FROM workspace_files WHERE user_id = 'u1'";
    assert!(copy.count(files).await > 0);
    let vectors = "SELECT count(*) FROM memory_embeddings";
    assert_eq!(copy.count(vectors).await, 2);
    let writers = "SELECT count(*) FROM session_compactions WHERE cardinality(participants) > 0";
    assert_eq!(copy.count(writers).await, 1);

    let since: String =
        sqlx::query_scalar("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')")
            .fetch_one(&app.db.pool)
            .await
            .expect("now");
    assert!(runbook(&app.db.url, &["erase", "--tenant", "acme", "--user", "u1"], None).await.ok);
    let later = temp("copy-since.jsonl.gz");
    let run =
        runbook(&app.db.url, &["export", "--tenant", "acme", "--since", &since, "--with-vectors"], Some(&later)).await;
    assert!(run.ok && run.stderr.contains("erasures: 1"), "{}", run.stderr);
    // The copy wrote a version of the erased user's file after the erasure: it goes with its file.
    sqlx::query("UPDATE workspace_file_versions SET created_at = now() + interval '1 hour' WHERE user_id = 'u1'")
        .execute(&copy.pool)
        .await
        .expect("a later version");
    let import = ["import", "--tenant", "acme", later.to_str().expect("path")];
    let run = runbook(&copy.url, &import, None).await;
    assert!(run.ok, "{}", run.stderr);
    assert!(run.stdout.contains("1 erasures recorded"), "{}", run.stdout);
    assert_eq!(copy.count(vectors).await, 0, "a vector holding the erased user's words stays in the copy");
    assert!(run.stdout.contains("1 items to embed again"), "{}", run.stdout);
    assert_eq!(copy.count(files).await, 0, "the erased user's files stay in the copy");
    assert_eq!(copy.count("SELECT count(*) FROM workspace_file_versions WHERE user_id = 'u1'").await, 0);
    assert_eq!(copy.count(writers).await, 0, "the copy still names the erased user as a summary's writer");
    assert_eq!(copy.count("SELECT count(*) FROM memory_items WHERE content = 'my secret plan'").await, 0);
    let audited = "SELECT count(*) FROM audit_log WHERE event = 'memory.erase' AND actor = 'import'";
    assert_eq!(copy.count(audited).await, 1);
    // The same file again records nothing twice; a full copy from before stays without the files.
    assert!(runbook(&copy.url, &import, None).await.ok);
    assert_eq!(copy.count(audited).await, 1);
    assert!(runbook(&copy.url, &["import", "--tenant", "acme", full.to_str().expect("path")], None).await.ok);
    assert_eq!(copy.count(files).await, 0);
    assert_eq!(copy.count(vectors).await, 0, "the older file brought back a vector made with the erased words");
    // A whole export from after the erasure, into a copy from before: the reply's vector, made
    // with the erased words, is dropped and the reply queued once; it keeps its model (its full
    // text stays searchable) though the file brings it without a vector.
    let after = temp("copy-after.jsonl.gz");
    assert!(runbook(&app.db.url, &["export", "--tenant", "acme", "--with-vectors"], Some(&after)).await.ok);
    let second = TestDb::new().await;
    assert!(runbook(&second.url, &["import", "--tenant", "acme", full.to_str().expect("path")], None).await.ok);
    let run = runbook(&second.url, &["import", "--tenant", "acme", after.to_str().expect("path")], None).await;
    assert!(run.ok && run.stdout.contains("\n1 items to embed again"), "{}{}", run.stdout, run.stderr);
    let reply_model = format!("SELECT count(*) FROM memory_items WHERE id = '{answer}' AND embedded_model = 'm'");
    assert_eq!(second.count(&reply_model).await, 1);
    let _ = std::fs::remove_file(after);

    // In another tenant the same hash may name someone else: a retargeted file's erasures are
    // applied or left out as the operator says, never guessed.
    sqlx::query(
        "INSERT INTO workspace_files (tenant_id, agent_id, user_id, path, id, content, size_bytes, enabled, sort_order, version, created_at)
         VALUES ('beta', 'a1', 'u1', 'memory/2026-01-01.md', gen_random_uuid(), 'beta''s u1', 10, true, 100, 1, now() - interval '1 day')",
    )
    .execute(&copy.pool)
    .await
    .expect("beta's u1 has a note");
    let beta_files = "SELECT count(*) FROM workspace_files WHERE tenant_id = 'beta'";
    let beta_erasures = "SELECT count(*) FROM audit_log WHERE tenant_id = 'beta' AND event = 'memory.erase'";
    let retarget = ["import", "--tenant", "beta", "--retarget", later.to_str().expect("path")];
    let run = runbook(&copy.url, &retarget, None).await;
    assert!(!run.ok && run.stderr.contains("--erasures apply"), "{}", run.stderr);
    assert_eq!(copy.count("SELECT count(*) FROM memory_items WHERE tenant_id = 'beta'").await, 0);
    let run = runbook(&copy.url, &[&retarget[..], &["--erasures", "skip"]].concat(), None).await;
    assert!(run.ok && run.stdout.contains("1 erasures of the source tenant left out"), "{}{}", run.stdout, run.stderr);
    assert_eq!((copy.count(beta_files).await, copy.count(beta_erasures).await), (1, 0));
    let run = runbook(&copy.url, &[&retarget[..], &["--erasures", "apply"]].concat(), None).await;
    assert!(run.ok, "{}", run.stderr);
    assert_eq!((copy.count(beta_files).await, copy.count(beta_erasures).await), (0, 1));
    // A tenant that erased its own u1 leaves out the files of a file's u1, unless the operator says
    // the file's ids name other people: then that u1 is someone else, and keeps their files.
    sqlx::query(
        "INSERT INTO workspace_files (tenant_id, agent_id, user_id, path, id, content, size_bytes, enabled, sort_order, version, created_at)
         VALUES ('gamma', 'a1', 'u1', 'memory/2026-01-01.md', gen_random_uuid(), 'gamma''s u1', 11, true, 100, 1, now())",
    )
    .execute(&copy.pool)
    .await
    .expect("gamma's u1 has a note");
    let erased = runbook(&copy.url, &["erase", "--tenant", "gamma", "--user", "u1"], None).await;
    assert!(erased.ok, "{}", erased.stderr);
    let gamma_files = "SELECT count(*) FROM workspace_files WHERE tenant_id = 'gamma' AND user_id = 'u1'";
    let from_before = ["import", "--tenant", "gamma", "--retarget", full.to_str().expect("path")];
    let run = runbook(&copy.url, &from_before, None).await;
    assert!(run.ok && run.stdout.contains("of users erased since left out"), "{}{}", run.stdout, run.stderr);
    assert_eq!(copy.count(gamma_files).await, 0);
    let run = runbook(&copy.url, &[&from_before[..], &["--erasures", "skip"]].concat(), None).await;
    assert!(run.ok && !run.stdout.contains("erased since left out"), "{}{}", run.stdout, run.stderr);
    assert!(copy.count(gamma_files).await > 0, "the file's u1 lost their files to the target's erasure of its own u1");
    for path in [full, later] {
        let _ = std::fs::remove_file(path);
    }
}

#[tokio::test]
async fn a_revival_carried_by_an_export_since_keeps_the_copys_chains_sound() {
    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let fact = |content: &str| json!({ "content": content, "scope": "user", "key": "home_city" });
    let old = app.client.post("/v1/facts", Some(&t), &fact("Alice lives in Paris")).await.body["id"].clone();
    let new = app.client.post("/v1/facts", Some(&t), &fact("Alice moved to Lyon")).await.body["id"].clone();
    sqlx::query("UPDATE memory_items SET superseded_by = $2::uuid, superseded_at = now() WHERE id = $1::uuid")
        .bind(old.as_str())
        .bind(new.as_str())
        .execute(&app.db.pool)
        .await
        .expect("a chain");
    let full = temp("revival-full.jsonl.gz");
    assert!(runbook(&app.db.url, &["export", "--tenant", "acme"], Some(&full)).await.ok);
    let copy = TestDb::new().await;
    assert!(runbook(&copy.url, &["import", "--tenant", "acme", full.to_str().expect("path")], None).await.ok);

    // The user asserts the older fact again: the source revives it (and audits the revival).
    let since: String = sqlx::query_scalar(
        "SELECT to_char(now() AT TIME ZONE 'UTC' - interval '1 second', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("now");
    assert_eq!(app.client.post("/v1/facts", Some(&t), &fact("Alice lives in Paris")).await.status, 200);
    let later = temp("revival-later.jsonl.gz");
    let run = runbook(&app.db.url, &["export", "--tenant", "acme", "--since", &since], Some(&later)).await;
    assert!(run.ok, "{}", run.stderr);
    let run = runbook(&copy.url, &["import", "--tenant", "acme", later.to_str().expect("path")], None).await;
    assert!(run.ok, "{}", run.stderr);

    let check = runbook(&copy.url, &["judge", "check", "--tenant", "acme", "--json"], None).await;
    assert!(check.ok, "the copy's chains: {}{}", check.stdout, check.stderr);
    assert_eq!(copy.count("SELECT count(*) FROM audit_log WHERE event = 'revive' AND actor = 'import'").await, 1);
    // Stamped when the source revived it, so `facts --as-of` reads the copy's history as the source's.
    let revived = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, Vec<chrono::DateTime<chrono::Utc>>>(
            "SELECT array_agg(created_at ORDER BY created_at) FROM audit_log WHERE event = 'revive'",
        )
        .fetch_one(&pool)
        .await
        .expect("revivals")
    };
    assert_eq!(revived(copy.pool.clone()).await, revived(app.db.pool.clone()).await);

    // A deleted fact asserted again is revived too, and the copy audits that revival as well.
    let sync = || async {
        let whole = temp("revival-whole.jsonl.gz");
        assert!(runbook(&app.db.url, &["export", "--tenant", "acme"], Some(&whole)).await.ok);
        let run = runbook(&copy.url, &["import", "--tenant", "acme", whole.to_str().expect("path")], None).await;
        assert!(run.ok, "{}", run.stderr);
        let _ = std::fs::remove_file(whole);
    };
    let tea = json!({ "content": "Alice drinks tea", "scope": "user", "key": "drink" });
    let tea_id = app.client.post("/v1/facts", Some(&t), &tea).await.body["id"].clone();
    sync().await;
    let deleted = app.client.delete(&format!("/v1/memories/{}", tea_id.as_str().expect("id")), Some(&t)).await;
    assert_eq!(deleted.status, 200);
    sync().await;
    assert_eq!(app.client.post("/v1/facts", Some(&t), &tea).await.status, 200);
    sync().await;
    assert_eq!(copy.count("SELECT count(*) FROM audit_log WHERE event = 'revive' AND actor = 'import'").await, 2);
    assert_eq!(revived(copy.pool.clone()).await, revived(app.db.pool.clone()).await);
    // A fact each side deleted on its own (the copy first): the source's later delete is no revival.
    let chess = json!({ "content": "Alice plays chess", "scope": "user", "key": "game" });
    let chess = app.client.post("/v1/facts", Some(&t), &chess).await.body["id"].clone();
    sync().await;
    sqlx::query("UPDATE memory_items SET deleted_at = now() WHERE id = $1::uuid")
        .bind(chess.as_str())
        .execute(&copy.pool)
        .await
        .expect("deleted in the copy");
    let deleted = app.client.delete(&format!("/v1/memories/{}", chess.as_str().expect("id")), Some(&t)).await;
    assert_eq!(deleted.status, 200);
    sync().await;
    assert_eq!(copy.count("SELECT count(*) FROM audit_log WHERE event = 'revive' AND actor = 'import'").await, 2);
    for path in [full, later] {
        let _ = std::fs::remove_file(path);
    }
}

/// A moved tenant goes on where it was: extraction's and consolidation's progress travel with it,
/// so no conversation is read (and paid for) again; a consolidation run held at the source holds
/// nothing in the copy; an erasure the file carries takes the user's progress out of the copy,
/// and a copy made before the erasure does not bring it back.
#[tokio::test]
async fn extraction_and_consolidation_progress_travel_with_the_tenant() {
    use mnemo_core::{AgentId, SessionId, UserId, Workspace};
    use std::time::Duration;

    let app = TestApp::spawn().await;
    let t = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let said = json!({ "source_kind": "chat_message", "source_ref": "m1", "content": "I moved to Lyon" });
    assert_eq!(app.client.post("/v1/memories", Some(&t), &said).await.status, 201);
    // The conversation asked for, and extracted as a run that found nothing new ends it; then a
    // consolidation run held (its worker still at it when the export is made).
    let store = app.db.store();
    let workspace = Workspace {
        tenant: TenantId::parse("acme").expect("tenant"),
        agent: AgentId::parse("a1").expect("agent"),
        user: Some(UserId::parse("u1").expect("user")),
    };
    let session = SessionId::parse("s1").expect("session");
    let (event_time, id) = sqlx::query_as("SELECT event_time, id FROM memory_items WHERE source_ref = 'm1'")
        .fetch_one(&app.db.pool)
        .await
        .expect("the message");
    let through = mnemo_store::MessageCursor { event_time, id };
    let extract_job = mnemo_store::queue::ExtractJob {
        tenant_id: workspace.tenant.clone(),
        agent_id: workspace.agent.clone(),
        user_id: UserId::parse("u1").expect("user"),
    };
    let asked = store.request_extraction(&workspace, &session, through, mnemo_core::TriggerSource::Manual).await;
    assert!(asked.expect("asked"));
    let claim = store.claim_extraction(&extract_job, "w1", Duration::ZERO, Duration::from_secs(60)).await;
    assert!(matches!(claim, Ok(mnemo_store::Claim::Claimed)), "{claim:?}");
    let pending = store.pending_extractions(&workspace).await.expect("pending");
    assert_eq!(pending.len(), 1);
    store.finish_extraction(&workspace, "w1", &pending, "done", "nothing_new", true).await.expect("done");
    // A later conversation asked for and not yet attempted: the copy holds it pending.
    let said = json!({ "source_kind": "chat_message", "source_ref": "m2", "content": "I work from home now" });
    assert_eq!(app.client.post("/v1/memories", Some(&t), &said).await.status, 201);
    let (event_time, id) = sqlx::query_as("SELECT event_time, id FROM memory_items WHERE source_ref = 'm2'")
        .fetch_one(&app.db.pool)
        .await
        .expect("the message");
    let later_one = mnemo_store::MessageCursor { event_time, id };
    let asked = store.request_extraction(&workspace, &session, later_one, mnemo_core::TriggerSource::Manual).await;
    assert!(asked.expect("asked"));
    let note = json!({ "content": "- moved to Lyon\n" });
    let put = app.client.put("/v1/workspace/files/memory/2026-11-30.md", Some(&t), &note).await;
    assert!(put.status < 300, "{:?}", put.body);
    store.request_consolidation(&workspace, None).await.expect("asked");
    let job = mnemo_store::queue::ConsolidateJob {
        tenant_id: workspace.tenant.clone(),
        agent_id: workspace.agent.clone(),
        user_id: UserId::parse("u1").expect("user"),
    };
    let claim = |store: mnemo_store::Store, worker: &'static str| {
        let job = job.clone();
        async move { store.claim_consolidation(&job, worker, Duration::from_secs(3600), Duration::from_secs(5)).await }
    };
    assert_eq!(claim(store.clone(), "w1").await.expect("claimed"), mnemo_store::ConsolidationClaim::Claimed);

    let full = temp("progress.jsonl.gz");
    assert!(runbook(&app.db.url, &["export", "--tenant", "acme"], Some(&full)).await.ok);
    let copy = TestDb::new().await;
    let import_full = ["import", "--tenant", "acme", full.to_str().expect("path")];
    let run = runbook(&copy.url, &import_full, None).await;
    assert!(run.ok, "{}", run.stderr);
    // The copy's next extraction of the session starts after the message read at the source.
    let end =
        mnemo_store::MessageCursor { event_time: chrono::Utc::now() + chrono::Duration::days(1), id: Uuid::max() };
    let read = copy.store().last_read(&workspace, &session, end).await.expect("last read");
    assert_eq!(read, Some(through), "the copy would read the session again from its start");
    let state = "SELECT to_jsonb(s) - 'running_since' - 'running_by' FROM consolidation_state s";
    let (ours, theirs): (serde_json::Value, serde_json::Value) = (
        sqlx::query_scalar(state).fetch_one(&app.db.pool).await.expect("source state"),
        sqlx::query_scalar(state).fetch_one(&copy.pool).await.expect("copy state"),
    );
    assert_eq!(ours, theirs);
    assert_eq!(
        claim(copy.store(), "w2").await.expect("claim"),
        mnemo_store::ConsolidationClaim::Claimed,
        "a run held at the source holds the copy's consolidation"
    );

    let now = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
        )
        .fetch_one(&app.db.pool)
        .await
        .expect("now")
    };
    // A failed attempt travels with an export --since and replaces the copy's count.
    let since = now().await;
    let claim = store.claim_extraction(&extract_job, "w1", Duration::ZERO, Duration::from_secs(60)).await;
    assert!(matches!(claim, Ok(mnemo_store::Claim::Claimed)), "{claim:?}");
    let pending = store.pending_extractions(&workspace).await.expect("pending");
    assert_eq!(pending.len(), 1);
    assert_eq!(store.fail_extraction(&workspace, "w1", &pending, "model_error", false, 5).await.expect("failed"), 1);
    let attempted = temp("progress-attempted.jsonl.gz");
    assert!(runbook(&app.db.url, &["export", "--tenant", "acme", "--since", &since], Some(&attempted)).await.ok);
    let run = runbook(&copy.url, &["import", "--tenant", "acme", attempted.to_str().expect("path")], None).await;
    assert!(run.ok, "{}", run.stderr);
    let attempts = format!("SELECT attempts::int8 FROM memory_extractions WHERE through_id = '{id}'");
    assert_eq!(copy.count(&attempts).await, 1, "the copy kept the count from before the attempt");

    let since = now().await;
    assert!(runbook(&app.db.url, &["erase", "--tenant", "acme", "--user", "u1"], None).await.ok);
    // A state row written after the erasure (a schedule that raced it, before the two excluded
    // each other): the source's job forgets it, which no later export carries.
    sqlx::query(
        "INSERT INTO consolidation_state (tenant_id, agent_id, user_id, last_scheduled_at, last_requested_at)
         VALUES ('acme', 'a1', 'u1', now(), now())",
    )
    .execute(&app.db.pool)
    .await
    .expect("a state row after the erasure");
    let later = temp("progress-since.jsonl.gz");
    assert!(runbook(&app.db.url, &["export", "--tenant", "acme", "--since", &since], Some(&later)).await.ok);
    let progress = "SELECT (SELECT count(*) FROM memory_extractions WHERE user_id = 'u1')
                         + (SELECT count(*) FROM consolidation_state WHERE user_id = 'u1')";
    assert_eq!(copy.count(progress).await, 3);
    let run = runbook(&copy.url, &["import", "--tenant", "acme", later.to_str().expect("path")], None).await;
    assert!(run.ok, "{}", run.stderr);
    assert_eq!(copy.count(progress).await, 0, "the erased user's progress stays in the copy");
    assert!(runbook(&copy.url, &import_full, None).await.ok);
    assert_eq!(copy.count(progress).await, 0, "a copy made before the erasure brought the user's progress back");
    for path in [full, attempted, later] {
        let _ = std::fs::remove_file(path);
    }
}
