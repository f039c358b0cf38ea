//! The schema itself: migrations are re-runnable, the audit log cannot be changed, and readiness
//! follows the database.

use mnemo_store::MIGRATOR;
use mnemo_testkit::{Client, TestApp, TestDb};

#[tokio::test]
async fn migrations_are_current_and_re_runnable() {
    let db = TestDb::new().await;
    assert!(MIGRATOR.status(&db.pool).await.expect("status").is_current());
    MIGRATOR.run(&db.pool).await.expect("a second run is a no-op");
    assert!(MIGRATOR.status(&db.pool).await.expect("status").is_current());
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
    assert_eq!((ready.status, &ready.body["status"]), (200, &serde_json::json!("ready")));
    assert_eq!(app.client.get("/healthz", None).await.status, 200);

    // Roll one of mnemo's migrations out of the history: the server is no longer ready.
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = (SELECT max(version) FROM _sqlx_migrations)")
        .execute(&app.db.pool)
        .await
        .expect("forget a migration");
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
