//! `mnemo-mcp`: mnemo's MCP tools over stdio, for desktop agents that start their MCP servers as
//! processes. Each tool call is forwarded to a running mnemo-server (`MNEMO_URL`) with the bearer
//! token in `MNEMO_TOKEN`, so the tenant and identities are the token's, exactly as over HTTP.
//! stdout carries the protocol; logs go to stderr.

use std::time::Duration;

use anyhow::{Context, bail};
use mnemo_api::mcp::{ApiAnswer, ApiCall, Forward, MnemoMcp};
use mnemo_config::vars::{LOG, MCP_SERVER_URL as URL, MCP_TIMEOUT_S as TIMEOUT, MCP_TOKEN as TOKEN};
use rmcp::ServiceExt;
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::async_rw::AsyncRwTransport;
use serde_json::json;

const DEFAULT_URL: &str = "http://127.0.0.1:8080";
/// A recall embeds its query and may rerank; a write may wait for group commit. Under the 60 s
/// most MCP clients wait for a call: the agent then reads the tool error (`unavailable`, and for a
/// write that it may have been applied) rather than the client's bare timeout.
const DEFAULT_TIMEOUT_S: u64 = 50;
/// Idle connections are dropped before the server's header timeout (10 s) closes them: a call
/// sent on a connection the server is closing fails, and a write would be reported as possibly
/// applied.
const POOL_IDLE: Duration = Duration::from_secs(5);
const MAX_TIMEOUT_S: u64 = 3600;
/// mnemo's largest answer is a whole tool output (4 MiB by default), which JSON may escape to a
/// few times its size; more than this is not mnemo answering.
const MAX_ANSWER_BYTES: usize = 64 << 20;
/// The longest message (one line) read from stdin.
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Forwards calls over HTTP to mnemo-server.
#[derive(Debug, Clone)]
struct Remote {
    http: reqwest::Client,
    base: String,
    /// `base` without any user and password in it, for messages and logs.
    shown: String,
    bearer: String,
}

impl Forward for Remote {
    async fn forward(&self, call: ApiCall, _context: &RequestContext<RoleServer>) -> Result<ApiAnswer, String> {
        let mut request = self
            .http
            .request(call.method, format!("{}{}", self.base, call.uri))
            .header(reqwest::header::AUTHORIZATION, &self.bearer);
        if let Some(body) = call.body {
            request = request.json(&body);
        }
        // Without the URL: its path may name a file, a memory or a tool output.
        let mut response = request.send().await.map_err(|e| format!("{}: {}", self.shown, causes(e)))?;
        let status = response.status().as_u16();
        // Redirects are not followed: the token would go to wherever they point, and a POST
        // would come back a GET.
        if response.status().is_redirection() {
            let to = response.headers().get(reqwest::header::LOCATION).and_then(|l| l.to_str().ok()).unwrap_or("?");
            let message =
                format!("{} answered {status}, a redirect to {to}: set {URL} to the address it names", self.shown);
            return Ok(ApiAnswer { status: 502, body: json!({ "error": { "code": "internal", "message": message } }) });
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| format!("{}: {}", self.shown, causes(e)))? {
            if bytes.len() + chunk.len() > MAX_ANSWER_BYTES {
                let message = format!("the answer at {} was over {} MiB", self.shown, MAX_ANSWER_BYTES >> 20);
                // Whatever the status said, this is no answer: a tool error.
                let body = json!({ "error": { "code": "internal", "message": message } });
                return Ok(ApiAnswer { status: 502, body });
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(ApiAnswer::from_bytes(status, &bytes))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            std::env::var(LOG)
                .ok()
                .and_then(|own| tracing_subscriber::EnvFilter::try_new(mnemo_config::guarded_filter(&own)).ok())
                .unwrap_or_else(|| "mnemo_mcp=info,warn".into()),
        )
        .init();
    let token = std::env::var(TOKEN).with_context(|| format!("{TOKEN} must hold a bearer token (JWT) for mnemo"))?;
    if token.trim().is_empty() {
        bail!("{TOKEN} is empty");
    }
    let base = match std::env::var(URL) {
        Err(std::env::VarError::NotPresent) => DEFAULT_URL.to_owned(),
        Err(std::env::VarError::NotUnicode(_)) => bail!("{URL} is not Unicode"),
        Ok(url) => url,
    };
    let base = base.trim_end_matches('/').to_owned();
    let parsed = reqwest::Url::parse(&base).ok().filter(|u| u.host().is_some());
    let Some(parsed) = parsed.filter(|u| matches!(u.scheme(), "http" | "https")) else {
        bail!("{URL} must be an http:// or https:// address with a host, not {:?}", without_credentials(&base));
    };
    // The HTTP client would send them as Basic credentials, an Authorization header beside the
    // bearer token's, and the server reads only one.
    if !parsed.username().is_empty() || parsed.password().is_some() {
        bail!(
            "{URL} holds a user and password ({}): mnemo authenticates with {TOKEN} alone; remove them",
            without_credentials(&base)
        );
    }
    let timeout = match std::env::var(TIMEOUT) {
        Err(std::env::VarError::NotPresent) => DEFAULT_TIMEOUT_S,
        Err(std::env::VarError::NotUnicode(_)) => bail!("{TIMEOUT} is not Unicode"),
        Ok(value) => match value.trim().parse::<u64>() {
            Ok(seconds @ 1..=MAX_TIMEOUT_S) => seconds,
            _ => bail!("{TIMEOUT} must be a whole number of seconds from 1 to {MAX_TIMEOUT_S}, not {value:?}"),
        },
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut http = reqwest::Client::builder()
        .timeout(Duration::from_secs(timeout))
        .pool_idle_timeout(POOL_IDLE)
        .redirect(reqwest::redirect::Policy::none());
    // A server on this machine is never reached through the environment's HTTP_PROXY: the
    // token would go, over plain HTTP, to the proxy.
    let host = parsed.host_str().unwrap_or_default().trim_matches(['[', ']']);
    let loopback =
        host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if loopback {
        http = http.no_proxy();
    }
    let http = http.build().context("cannot build the HTTP client")?;
    let bearer = format!("Bearer {}", token.trim());
    if reqwest::header::HeaderValue::from_str(&bearer).is_err() {
        bail!("{TOKEN} holds characters an HTTP header cannot carry (a line break, say)");
    }
    let shown = without_credentials(&base);
    let remote = Remote { http, base, shown, bearer };
    tracing::info!(url = %remote.shown, "mnemo-mcp serving MCP on stdio");
    // rmcp drops a longer line unanswered; 16 MiB by default, under what the API's body limit
    // allows when an operator raises the file and tool-output bounds.
    let stdio = AsyncRwTransport::<RoleServer, _, _>::new(tokio::io::stdin(), tokio::io::stdout())
        .with_max_line_length(MAX_MESSAGE_BYTES);
    let server = MnemoMcp::new(remote).serve(stdio).await.context("MCP handshake failed")?;
    server.waiting().await.context("MCP session failed")?;
    Ok(())
}

/// An HTTP error with its causes (refused, a name not found, a certificate, a timeout), which
/// its own message leaves out, and without the URL (its path may name a file or a memory).
fn causes(error: reqwest::Error) -> String {
    mnemo_config::with_causes(&error.without_url())
}

/// `url` as it may be shown: without everything up to its last `@` before a query or fragment.
/// A password may hold a `/` left unencoded, and its `@` then comes after what a parser takes
/// for the path's start; a path seldom holds an `@`, and showing less of it costs nothing.
fn without_credentials(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    let end = rest.find(['?', '#']).unwrap_or(rest.len());
    match rest[..end].rfind('@') {
        Some(at) => format!("{scheme}://{}", &rest[at + 1..]),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_the_url_are_never_shown() {
        assert_eq!(without_credentials("https://u:s3cret@mnemo.example:8443/base"), "https://mnemo.example:8443/base");
        assert_eq!(without_credentials("http://127.0.0.1:8080"), "http://127.0.0.1:8080");
        // A password holding an unencoded "/": a parser reads "svc" as the host.
        assert_eq!(without_credentials("http://svc:p/ss@mnemo.internal:8080"), "http://mnemo.internal:8080");
        assert_eq!(without_credentials("http://admin:1234/x@host/base"), "http://host/base");
        assert_eq!(without_credentials("http://host/base?q=a@b"), "http://host/base?q=a@b");
    }
}
