//! The MCP server through the official Python MCP client, over streamable HTTP (`/mcp` on the
//! real mnemo-server) and stdio (the real mnemo-mcp forwarding to it). The checks themselves are
//! in `mcp/client.py`; this test starts the servers, makes the tokens and runs it.

use std::process::Stdio;

use mnemo_testkit::{ServerProcess, TestDb, binary, free_port, principal, test_python, token};

#[tokio::test]
async fn the_official_python_client_uses_every_tool_over_both_transports() {
    let python = test_python();
    let db = TestDb::new().await;
    let server = ServerProcess::start(&db.app_url, free_port()).await.expect("server starts");
    let a = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let b = token(&principal("globex", Some("u1"), Some("a1"), Some("s1")));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/mcp/client.py");

    let run = tokio::process::Command::new(python)
        .arg(script)
        .env("MCP_URL", format!("{}/mcp", server.client.base))
        .env("MNEMO_URL", &server.client.base)
        .env("MNEMO_MCP_BIN", binary("mnemo-mcp").expect("mnemo-mcp is built"))
        .env("TOKEN_A", &a)
        .env("TOKEN_B", &b)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(std::time::Duration::from_secs(240), run)
        .await
        .expect("the client finishes within 4 minutes")
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "the MCP client failed:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    for transport in ["http", "stdio"] {
        assert!(stdout.contains(&format!("{transport}: every tool")), "{transport} was not checked: {stdout}");
    }
    assert!(
        stdout.contains("stdio: an unreachable API and a redirect"),
        "the unreachable API was not checked: {stdout}"
    );
}
