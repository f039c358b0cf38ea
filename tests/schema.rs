//! The schema itself: migrations are re-runnable, the audit log cannot be changed, and readiness
//! follows the database.

use std::time::Duration;

use mnemo_store::MIGRATOR;
use mnemo_testkit::{Client, TestApp, TestDb, WorkerProcess, wait_until};

/// A migration this build does not know, as a newer build's `migrate` leaves one.
async fn migrated_by_a_newer_build(pool: &sqlx::PgPool) {
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (29991231000000, 'from a newer build', true, '\\x00', 0)",
    )
    .execute(pool)
    .await
    .expect("a newer build's migration");
}

#[tokio::test]
async fn migrations_are_current_and_re_runnable() {
    let db = TestDb::new().await;
    assert!(MIGRATOR.status(&db.pool).await.expect("status").is_current());
    MIGRATOR.run(&db.pool).await.expect("a second run is a no-op");
    assert!(MIGRATOR.status(&db.pool).await.expect("status").is_current());
}

/// `migrate` says what it applies (`--dry-run`: and applies nothing), and stops, changing
/// nothing, on a database a newer build migrated (a migration this build does not know).
#[tokio::test]
async fn the_runbook_refuses_to_migrate_a_database_a_newer_build_migrated() {
    let db = TestDb::new().await;
    let runbook = |args: &[&str]| {
        std::process::Command::new(mnemo_testkit::binary("mnemo-runbook").expect("runbook"))
            .args(args)
            .env_clear()
            .env(mnemo_config::vars::DATABASE_URL, &db.url)
            .output()
            .expect("runbook runs")
    };
    let migrate = || runbook(&["migrate"]);
    let current = migrate();
    assert!(current.status.success(), "{}", String::from_utf8_lossy(&current.stderr));
    assert!(String::from_utf8_lossy(&current.stdout).contains("(0 migrations applied now)"));
    // The last migration undone in the history: a dry run names it, and it stays pending.
    let history = "SELECT max(version) FROM _sqlx_migrations WHERE success";
    let last: i64 = sqlx::query_scalar(history).fetch_one(&db.pool).await.expect("the last migration");
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = $1").bind(last).execute(&db.pool).await.expect("undo");
    let dry = runbook(&["migrate", "--dry-run"]);
    let name = MIGRATOR.description(last).expect("a migration of this build");
    let listed = String::from_utf8_lossy(&dry.stderr);
    assert!(dry.status.success() && listed.contains(&format!("{last} {name}")), "{listed}");
    assert!(MIGRATOR.status(&db.pool).await.expect("status").pending == [last], "nothing applied");
    migrated_by_a_newer_build(&db.pool).await;
    let newer = migrate();
    let stderr = String::from_utf8_lossy(&newer.stderr);
    assert!(!newer.status.success() && stderr.contains("migrated by a newer mnemo"), "{stderr}");
}

/// Migrate, then deploy: a worker of the older build that starts in between (restarted by a
/// drain or a crash) runs, as the older server stays ready; one on a database not yet migrated
/// stops, saying so.
#[tokio::test]
async fn a_worker_starts_on_a_schema_a_newer_build_migrated_but_not_on_an_older_one() {
    let db = TestDb::new().await;
    migrated_by_a_newer_build(&db.pool).await;
    let mut worker = WorkerProcess::start(&db.url, &[] as &[(&str, &str)]).await.expect("the worker starts");
    assert!(worker.try_wait().expect("status").is_none());
    worker.terminate().await.expect("a clean stop");

    let last: i64 = sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE version < 29991231000000")
        .fetch_one(&db.pool)
        .await
        .expect("the last migration");
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version >= $1").bind(last).execute(&db.pool).await.expect("older");
    let mut worker = std::process::Command::new(mnemo_testkit::binary("mnemo-worker").expect("worker"));
    worker
        .env_clear()
        .env(mnemo_config::vars::DATABASE_URL, &db.url)
        .env(mnemo_config::vars::WORKER_LISTEN, "127.0.0.1:0");
    if let Ok(dir) = std::env::var(mnemo_config::vars::LOCAL_MODEL_DIR) {
        worker.env(mnemo_config::vars::LOCAL_MODEL_DIR, dir);
    }
    let refused = worker.output().expect("the worker runs");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("mnemo-runbook migrate"), "{stderr}");
}

#[tokio::test]
async fn the_audit_log_refuses_update_delete_and_truncate() {
    let db = TestDb::new().await;
    sqlx::query(
        "INSERT INTO audit_log (tenant_id, event, actor, reason) VALUES ('acme', 'test.event', 'test', 'because')",
    )
    .execute(&db.pool)
    .await
    .expect("appending is allowed");
    for statement in ["UPDATE audit_log SET reason = 'rewritten'", "DELETE FROM audit_log", "TRUNCATE audit_log"] {
        let err = sqlx::query(statement).execute(&db.pool).await.expect_err(statement);
        let code = err.as_database_error().and_then(|e| e.code()).map(|c| c.into_owned());
        assert_eq!(code.as_deref(), Some("42501"), "{statement}: {err}");
    }
    let reason: String = sqlx::query_scalar("SELECT reason FROM audit_log").fetch_one(&db.pool).await.expect("row");
    assert_eq!(reason, "because");
}

#[tokio::test]
async fn readiness_follows_the_schema() {
    let app = TestApp::spawn().await;
    let ready = app.client.get("/readyz", None).await;
    assert_eq!(ready.body, serde_json::json!({ "status": "ready", "schema": "current" }));
    assert_eq!(app.client.get("/healthz", None).await.status, 200);

    // Migrated by a newer build (an upgrade's middle: migrate, then deploy): still ready.
    migrated_by_a_newer_build(&app.db.pool).await;
    let newer = || async { app.client.get("/readyz", None).await.body["schema"] == "newer" };
    assert!(wait_until(Duration::from_secs(5), newer).await, "a newer schema is not a reason to stop serving");

    // Roll one of mnemo's migrations out of the history: the server is no longer ready.
    sqlx::query(
        "DELETE FROM _sqlx_migrations
         WHERE version = (SELECT max(version) FROM _sqlx_migrations WHERE version < 29991231000000)",
    )
    .execute(&app.db.pool)
    .await
    .expect("forget a migration");
    // The last answer is kept a second.
    assert!(
        wait_until(Duration::from_secs(5), || async { app.client.get("/readyz", None).await.status == 503 }).await,
        "still ready"
    );
    let not_ready = app.client.get("/readyz", None).await;
    assert_eq!((not_ready.status, not_ready.code()), (503, "not_ready"));
    assert!(not_ready.body["error"]["message"].as_str().unwrap_or("").contains("mnemo-runbook migrate"));
}

#[tokio::test]
async fn metrics_are_prometheus_text() {
    let app = TestApp::spawn().await;
    let _ = app.client.get("/healthz", None).await;
    let client = Client::new(app.client.base.clone());
    let reply = client.get("/metrics", None).await;
    assert_eq!(reply.status, 200);
    let text = reply.body.as_str().expect("text body");
    assert!(text.contains("mnemo_http_requests_total"), "{text}");
}

/// Invariant 8: every primary, unique and foreign key of a table holding tenant data leads with
/// `tenant_id`, so the data can be distributed by tenant. Tables without a tenant column are
/// mnemo's own bookkeeping (housekeeping ticks, judge batches, migrations) and are listed by the
/// query's filter, not by name.
#[tokio::test]
async fn every_key_of_tenant_data_leads_with_the_tenant() {
    let db = TestDb::new().await;
    let keys: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT c.conrelid::regclass::text, c.conname, a.attname
         FROM pg_constraint c
         JOIN pg_namespace n ON n.oid = c.connamespace AND n.nspname = 'public'
         JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1]
         WHERE c.contype IN ('p', 'u', 'f')
           AND EXISTS (SELECT 1 FROM pg_attribute t
                       WHERE t.attrelid = c.conrelid AND t.attname = 'tenant_id' AND NOT t.attisdropped)
         ORDER BY 1, 2",
    )
    .fetch_all(&db.pool)
    .await
    .expect("keys");
    assert!(keys.len() >= 8, "the tenant tables' keys were found: {keys:?}");
    let astray: Vec<_> = keys.iter().filter(|(_, _, first)| first != "tenant_id").collect();
    assert!(astray.is_empty(), "keys that do not lead with tenant_id: {astray:?}");
}

/// What the worker gives up on after a few attempts: a statement the database refuses for what it
/// says. Never what passes: an outage, a full disk, a lost race.
#[tokio::test]
async fn the_store_tells_a_refused_statement_from_one_that_may_pass_later() {
    let db = TestDb::new().await;
    let error = |statement: String| {
        let pool = db.pool.clone();
        async move {
            let e = sqlx::raw_sql(sqlx::AssertSqlSafe(statement.clone())).execute(&pool).await.expect_err(&statement);
            mnemo_store::StoreError::from(e)
        }
    };
    let raise = |code: &str| format!("DO $$ BEGIN RAISE EXCEPTION 'raised' USING ERRCODE = '{code}'; END $$");
    for refused in [
        "SELECT 1 / 0",
        "INSERT INTO audit_log (tenant_id, event, actor) VALUES (NULL, 'test.event', 'test')",
        "SELECT no_such_column FROM audit_log",
        "TRUNCATE audit_log",
    ] {
        assert!(error(refused.to_owned()).await.is_permanent(), "{refused}");
    }
    for code in ["40001", "40P01", "53100", "57P01", "08006", "55P03", "57014", "23505"] {
        assert!(!error(raise(code)).await.is_permanent(), "SQLSTATE {code}");
    }
    let unreachable = <sqlx::PgConnection as sqlx::Connection>::connect("postgres://mnemo@127.0.0.1:1/mnemo")
        .await
        .expect_err("nothing listens");
    assert!(!mnemo_store::StoreError::from(unreachable).is_permanent());
}

/// Migration 49 moves the vectors into partitions by tenant: a database an earlier build filled
/// keeps every vector, each tenant's in one partition, and its HNSW index, now one per partition.
/// A model's index made on the partitioned table is built once, whoever else tries meanwhile.
#[tokio::test]
async fn the_vectors_move_into_partitions_by_tenant_with_their_index() {
    use mnemo_core::{MemoryText, Scope, SourceKind, SourceRef, TenantId};

    let admin = mnemo_testkit::admin_url();
    let (name, url) = mnemo_store::create_empty_database(&admin, "mnemo_test").await.expect("database");
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    MIGRATOR.run_through(&pool, 20261122000048).await.expect("the schema before migration 49");
    let store = mnemo_store::Store::new(pool.clone());
    let rows: Vec<mnemo_store::BulkRow> = (0..200)
        .map(|i| mnemo_store::BulkRow {
            id: uuid::Uuid::now_v7(),
            tenant: TenantId::parse(["acme", "globex"][i % 2]).expect("tenant"),
            scope: Scope::Tenant,
            session: None,
            user: None,
            agent: None,
            kind: SourceKind::DocumentChunk,
            source_ref: SourceRef::parse(&format!("chunk-{i}")).expect("ref"),
            content: MemoryText::parse(&format!("chunk {i}")).expect("text"),
            created_at: None,
            deleted_at: None,
            vector: Some((0..4).map(|d| ((i + d) % 7) as f32 + 1.0).collect()),
        })
        .collect();
    store.bulk_load("m", &rows).await.expect("bulk load");
    // The index as builds before migration 49 made it.
    sqlx::raw_sql(
        "CREATE INDEX memory_embeddings_hnsw_before_4 ON memory_embeddings
         USING hnsw ((embedding::vector(4)) vector_cosine_ops) WHERE model = 'm'",
    )
    .execute(&pool)
    .await
    .expect("the old index");

    MIGRATOR.run(&pool).await.expect("migration 49");
    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await.expect(sql) }
    };
    assert_eq!(count("SELECT count(*) FROM memory_embeddings").await, 200);
    assert_eq!(count("SELECT count(*) FROM memory_embeddings e JOIN memory_items m ON m.id = e.item_id").await, 200);
    assert_eq!(count("SELECT count(*) FROM pg_inherits WHERE inhparent = 'memory_embeddings'::regclass").await, 16);
    let spread =
        "SELECT max(n) FROM (SELECT count(DISTINCT tableoid) AS n FROM memory_embeddings GROUP BY tenant_id) t";
    assert_eq!(count(spread).await, 1, "a tenant's vectors in more than one partition");
    let index = "SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                 WHERE c.relname = 'memory_embeddings_hnsw_before_4' AND i.indisvalid
                   AND (SELECT count(*) FROM pg_inherits WHERE inhparent = c.oid) = 16";
    assert_eq!(count(index).await, 1, "the HNSW index did not come back over every partition");

    // A new model's index: built by one of two builders at once, valid over every partition.
    let (one, two) = tokio::join!(store.ensure_vector_index("n", 4), store.ensure_vector_index("n", 4));
    let built = [one.expect("one builder"), two.expect("the other")];
    assert_eq!(built.iter().filter(|b| **b).count(), 1, "{built:?}");
    assert!(store.has_vector_index("n", 4).await.expect("validity"));
    assert!(!store.ensure_vector_index("n", 4).await.expect("built already"));
    pool.close().await;
    let _ = mnemo_store::drop_database(&admin, &name).await;
}

/// A connection left in an open transaction by a host that died is ended by PostgreSQL, not
/// kept with its locks until TCP gives up: every store's connections carry the setting.
#[tokio::test]
async fn a_stores_connections_end_a_transaction_left_idle() {
    let db = TestDb::new().await;
    let store = mnemo_store::Store::connect(&db.url, 2).await.expect("store");
    let setting: String =
        sqlx::query_scalar("SHOW idle_in_transaction_session_timeout").fetch_one(store.pool()).await.expect("setting");
    assert_eq!(setting, "10min");
}
