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

/// One JSON-RPC message, a line on mnemo-mcp's stdin.
async fn send(stdin: &mut tokio::process::ChildStdin, message: &serde_json::Value) {
    use tokio::io::AsyncWriteExt;
    stdin.write_all(format!("{message}\n").as_bytes()).await.expect("write a line");
    stdin.flush().await.expect("flush");
}

/// mnemo-mcp's answers by id, read from its stdout until `ids` all came (or 30 s passed).
async fn answers(
    stdout: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    ids: &[u64],
) -> std::collections::HashMap<u64, serde_json::Value> {
    let mut got = std::collections::HashMap::new();
    let read = async {
        while ids.iter().any(|id| !got.contains_key(id)) {
            let line = stdout.next_line().await.expect("read stdout").expect("mnemo-mcp still runs");
            let message: serde_json::Value = serde_json::from_str(&line).expect("a JSON line");
            if let Some(id) = message["id"].as_u64() {
                got.insert(id, message);
            }
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(30), read).await.expect("the answers come within 30 s");
    got
}

/// mnemo-mcp's stdout, a line at a time.
type McpOut = tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>;

/// `command` (mnemo-mcp with its environment) started on pipes, the MCP handshake done.
async fn mcp_session(
    mut command: tokio::process::Command,
) -> (tokio::process::Child, tokio::process::ChildStdin, McpOut) {
    use serde_json::json;
    use tokio::io::AsyncBufReadExt;

    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("mnemo-mcp starts");
    let mut stdin = child.stdin.take().expect("stdin");
    let mut stdout = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let init =
        json!({ "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": { "name": "t", "version": "0" } });
    send(&mut stdin, &json!({ "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": init })).await;
    assert!(answers(&mut stdout, &[1]).await[&1]["result"]["serverInfo"].is_object());
    send(&mut stdin, &json!({ "jsonrpc": "2.0", "method": "notifications/initialized" })).await;
    (child, stdin, stdout)
}

/// A `tools/call` request.
fn tool_call(id: u64, name: &str, arguments: serde_json::Value) -> serde_json::Value {
    serde_json::json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call", "params": { "name": name, "arguments": arguments } })
}

/// mnemo-mcp over raw stdin and stdout. An API that takes the connection and never answers is a
/// tool error `unavailable` after `MNEMO_MCP_TIMEOUT_S`, whose message, for a call that is not
/// idempotent, says it may have been applied. A line longer than rmcp's default (16 MiB) is
/// read; one past 64 MiB is dropped unanswered, and the session goes on.
#[tokio::test]
async fn mnemo_mcp_says_when_the_api_is_silent_and_reads_long_lines() {
    use serde_json::json;

    let bin = binary("mnemo-mcp").expect("mnemo-mcp is built");
    let mcp_token = token(&principal("acme", Some("u1"), Some("a1"), Some("s1")));
    let timeouts = ["0", "3601", "1.5", "soon"].map(|bad| ("MNEMO_MCP_TIMEOUT_S", bad));
    let urls =
        ["http://", "ftp://example.com", "http://example.com:99999", "localhost:8080"].map(|bad| ("MNEMO_URL", bad));
    for (var, bad) in timeouts.into_iter().chain(urls) {
        let refused = tokio::process::Command::new(&bin)
            .env("MNEMO_TOKEN", &mcp_token)
            .env(var, bad)
            .stdin(Stdio::null())
            .output()
            .await
            .expect("mnemo-mcp runs");
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && stderr.contains(&format!("{var} must be")), "{bad}: {stderr}");
    }
    // A password in the URL is refused without being shown, one holding an unencoded "/" too.
    for bad in ["http://u:s3cret@127.0.0.1:1", "http://svc:p/s3cret@127.0.0.1:1"] {
        let refused = tokio::process::Command::new(&bin)
            .env("MNEMO_TOKEN", &mcp_token)
            .env("MNEMO_URL", bad)
            .stdin(Stdio::null())
            .output()
            .await
            .expect("mnemo-mcp runs");
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && !stderr.contains("s3cret"), "{bad}: {stderr}");
    }

    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = silent.local_addr().expect("address");
    let _held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((connection, _)) = silent.accept().await {
            open.push(connection);
        }
    });
    // A proxy in the environment, which a server on this machine is never reached through (the
    // token would go to it).
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let proxy_address = format!("http://{}", proxy.local_addr().expect("address"));
    let proxied = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let _proxy = tokio::spawn({
        let proxied = proxied.clone();
        async move {
            let mut open = Vec::new();
            while let Ok((connection, _)) = proxy.accept().await {
                proxied.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                open.push(connection);
            }
        }
    });
    let mut command = tokio::process::Command::new(&bin);
    command
        .env("HTTP_PROXY", &proxy_address)
        .env("http_proxy", &proxy_address)
        .env_remove("NO_PROXY")
        .env_remove("no_proxy")
        .env("MNEMO_URL", format!("http://{address}"))
        .env("MNEMO_TOKEN", &mcp_token)
        .env("MNEMO_MCP_TIMEOUT_S", "1");
    let (_child, mut stdin, mut stdout) = mcp_session(command).await;

    let started = std::time::Instant::now();
    send(&mut stdin, &tool_call(2, "recall", json!({ "query": "the trip" }))).await;
    send(&mut stdin, &tool_call(3, "write_file", json!({ "path": "memory/notes.md", "content": "x" }))).await;
    let got = answers(&mut stdout, &[2, 3]).await;
    assert!(started.elapsed() >= std::time::Duration::from_secs(1), "answered before the timeout");
    for (id, words) in [(2, "try again later"), (3, "may have been applied")] {
        let result = &got[&id]["result"];
        assert_eq!(result["isError"], true, "{result}");
        assert_eq!(result["structuredContent"]["error"]["code"], "unavailable", "{result}");
        let message = result["structuredContent"]["error"]["message"].as_str().expect("a message");
        assert!(message.contains(words), "{message}");
    }
    assert_eq!(proxied.load(std::sync::atomic::Ordering::Relaxed), 0, "a local server was reached through the proxy");

    // 20 MiB in one line (over rmcp's default 16 MiB): read and answered (an argument the tool
    // does not take, refused before the API is asked).
    let long = json!({ "key": "tout_x", "owner": "x".repeat(20 << 20) });
    send(&mut stdin, &tool_call(4, "get_tool_output", long)).await;
    let refused = &answers(&mut stdout, &[4]).await[&4]["result"];
    assert_eq!(refused["structuredContent"]["error"]["code"], "unknown_field", "{refused}");
    // 65 MiB: dropped unanswered; the ping after it is answered.
    let too_long = json!({ "key": "tout_x", "owner": "x".repeat(65 << 20) });
    send(&mut stdin, &tool_call(5, "get_tool_output", too_long)).await;
    send(&mut stdin, &json!({ "jsonrpc": "2.0", "id": 6, "method": "ping" })).await;
    let got = answers(&mut stdout, &[6]).await;
    assert!(got[&6]["result"].is_object(), "{:?}", got[&6]);
    assert!(!got.contains_key(&5), "the line over 64 MiB was answered");
}

/// A proxy in front of the API answering with its own page (502, 504: the API down or slow) is
/// the API not reached: `unavailable`, and for a call that is not idempotent, "may have been
/// applied"; another service's answer with any other status stays `internal`.
#[tokio::test]
async fn mnemo_mcp_reads_a_proxys_error_page_as_the_api_unavailable() {
    use serde_json::json;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let gateway = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = gateway.local_addr().expect("address");
    // Each request in turn gets the next of these pages, then the connection closes.
    let _pages = tokio::spawn(async move {
        for status in ["502 Bad Gateway", "504 Gateway Timeout", "404 Not Found"] {
            let Ok((mut connection, _)) = gateway.accept().await else { return };
            let mut request = vec![0u8; 64 << 10];
            let _ = connection.read(&mut request).await;
            let page = "<html>down</html>";
            let answer = format!(
                "HTTP/1.1 {status}\r\ncontent-type: text/html\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{page}",
                page.len()
            );
            let _ = connection.write_all(answer.as_bytes()).await;
        }
    });
    let mut command = tokio::process::Command::new(binary("mnemo-mcp").expect("mnemo-mcp is built"));
    command
        .env("MNEMO_URL", format!("http://{address}"))
        .env("MNEMO_TOKEN", token(&principal("acme", Some("u1"), Some("a1"), Some("s1"))));
    let (_child, mut stdin, mut stdout) = mcp_session(command).await;
    let expected = [
        (tool_call(2, "recall", json!({ "query": "the trip" })), "unavailable", "try again later"),
        (
            tool_call(3, "write_file", json!({ "path": "memory/notes.md", "content": "x" })),
            "unavailable",
            "may have been applied",
        ),
        (tool_call(4, "recall", json!({ "query": "the trip" })), "internal", "not an answer of mnemo's API (HTTP 404)"),
    ];
    for (id, (request, code, words)) in (2..).zip(expected) {
        send(&mut stdin, &request).await;
        let result = &answers(&mut stdout, &[id]).await[&id]["result"];
        assert_eq!((&result["isError"], &result["structuredContent"]["error"]["code"]), (&json!(true), &json!(code)));
        let message = result["structuredContent"]["error"]["message"].as_str().expect("a message");
        assert!(message.contains(words), "{id}: {message}");
    }
}
