//! The real `mnemo-server` binary: a write survives a kill -9 and a restart.

use mnemo_testkit::{ServerProcess, TestDb, free_port, principal, token};
use serde_json::json;

#[tokio::test]
async fn a_write_survives_a_server_restart() {
    let db = TestDb::new().await;
    let port = free_port();
    let server = ServerProcess::start(&db.app_url, port).await.expect("server starts");
    let t = token(&principal("acme", Some("u1"), None, Some("s1")));
    let write = json!({ "source_kind": "chat_message", "source_ref": "m-1", "content": "remember me" });

    let first = server.client.post("/v1/memories", Some(&t), &write).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    server.kill().await;

    let restarted = ServerProcess::start(&db.app_url, port).await.expect("server restarts");
    assert_eq!(restarted.client.get("/readyz", None).await.status, 200);
    let again = restarted.client.post("/v1/memories", Some(&t), &write).await;
    assert_eq!((again.status, &again.body["was_new"]), (200, &json!(false)));
    assert_eq!(again.body["id"], first.body["id"]);
    let content: String =
        sqlx::query_scalar("SELECT content FROM memory_items").fetch_one(&db.pool).await.expect("row");
    assert_eq!(content, "remember me");
}

/// The accesses recall gathered in the server's last second (queued once a second) are queued
/// when it stops on SIGTERM, not lost with the process.
#[tokio::test]
async fn a_server_stopping_queues_the_accesses_it_gathered() {
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server starts");
    let t = token(&principal("acme", Some("u1"), None, Some("s1")));
    let write = json!({ "source_kind": "chat_message", "source_ref": "m-1", "content": "the blue heron" });
    assert_eq!(server.client.post("/v1/memories", Some(&t), &write).await.status, 201);
    let recalled = server.client.post("/v1/recall", Some(&t), &json!({ "query": "blue heron" })).await;
    assert_eq!(recalled.body["items"][0]["source_ref"], "m-1", "{:?}", recalled.body);
    let stopped = server.terminate().await.expect("stops");
    assert!(stopped.success(), "{stopped}");
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM apalis.jobs WHERE job_type = 'access'")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(queued, 1, "the recall's access was lost with the server");
}
