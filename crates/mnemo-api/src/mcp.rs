//! mnemo as MCP tools. Each tool is one `/v1` endpoint: a call becomes that endpoint's HTTP
//! request, so it is parsed, authorized and answered exactly as the API answers it (the same
//! checks, the same error codes, the same tenant rules), and nothing here can name a tenant.
//!
//! Two transports serve the same [`MnemoMcp`]: streamable HTTP at `/mcp` on mnemo-server
//! ([`http_service`], where the token is the MCP request's bearer and the call goes through the
//! API's router in process), and stdio in the `mnemo-mcp` binary (which forwards each call to a
//! running server with a token from its environment).

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{Method, Request, request::Parts};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, ServerHandler};
use serde_json::{Map, Value, json};
use tower::ServiceExt;

use crate::{ApiError, schema};

/// What the server tells an agent when it connects.
const INSTRUCTIONS: &str = "mnemo is your long-term memory. Call recall before answering anything that may \
depend on earlier conversations, facts about the user, documents or tool outputs you no longer see (and \
always when the conversation was trimmed for length): do not guess. Call remember_fact when you learn a \
durable fact about the user or yourself (a fact about yourself needs a token naming the user, or a \
service token naming no session). Your tenant, user and agent come from your token, never from \
arguments; so does your session when the token names one.";

/// One tool: its name, what it is for, the endpoint it calls and the arguments it takes.
#[derive(Debug)]
pub struct ToolSpec {
    name: &'static str,
    description: &'static str,
    method: Method,
    /// The endpoint; `{arg}` is an argument that goes into the path instead of the body.
    path: &'static str,
    /// The arguments a GET sends as its query.
    query: &'static [&'static str],
    /// Query arguments the tool sends when the call leaves them out, where an agent needs a
    /// narrower default than the endpoint's.
    defaults: &'static [(&'static str, &'static str)],
    read_only: bool,
    destructive: bool,
    /// Calling it again with the same arguments changes nothing more.
    idempotent: bool,
    /// The arguments' JSON Schema.
    schema: fn() -> Value,
}

/// Every tool, in the order an agent sees them.
static TOOLS: &[ToolSpec] = &[
    ToolSpec {
        name: "recall",
        description: "Search your memory: chat messages and tool outputs of this session, facts about the user \
            and about you, the tenant's documents, summaries and notes. Keyword and semantic matches are fused; a \
            date in the query (\"on 13 March 2024\", \"last May\", \"yesterday\") also searches what was written \
            then. Call it before answering a question that may depend on something said or learned earlier, and \
            whenever the conversation was trimmed for length: do not guess. Returns items with their content, kind \
            and score; a tool output's preview may name a tout_ key for get_tool_output.",
        method: Method::POST,
        path: "/v1/recall",
        read_only: true,
        destructive: false,
        query: &[],
        defaults: &[],
        idempotent: true,
        schema: schema::recall_body,
    },
    ToolSpec {
        name: "memory_pack",
        description: "Your memories most relevant to a query, grouped by layer (working, episodic, semantic, \
            procedural) and rendered as one Markdown block within a token budget. Use it to load background for a \
            new task in one call; use recall for a specific question.",
        method: Method::POST,
        path: "/v1/memory-pack",
        read_only: true,
        destructive: false,
        query: &[],
        defaults: &[],
        idempotent: true,
        schema: schema::pack_body,
    },
    ToolSpec {
        name: "remember",
        description: "Store a chat message, a tool output or a document chunk so it can be recalled later \
            (a document chunk is recalled by every user of the tenant, and only a service token writes one). \
            source_ref identifies it: writing the same source_ref again with the same content changes nothing \
            (was_new is false), with other content is a source_ref_conflict. Tool outputs longer than 16 KiB are \
            kept whole behind a tout_ key.",
        method: Method::POST,
        path: "/v1/memories",
        read_only: false,
        destructive: false,
        query: &[],
        defaults: &[],
        idempotent: true,
        schema: schema::memory_body,
    },
    ToolSpec {
        name: "remember_fact",
        description: "Remember a durable fact about the user (scope user) or about yourself (scope agent), across \
            sessions: a preference, a goal, a constraint, something true about them. Asserting the same fact again \
            changes nothing (brings it back if you had withdrawn it or a newer fact had replaced it). A fact that contradicts an older one retires the older one in the background; you \
            never need to delete it yourself.",
        method: Method::POST,
        path: "/v1/facts",
        read_only: false,
        // A fact under an existing key, or one the judge finds contradicting, retires the older.
        destructive: true,
        query: &[],
        defaults: &[],
        idempotent: true,
        schema: schema::fact_body,
    },
    ToolSpec {
        name: "forget",
        description: "Delete one memory by its id (from recall or remember). A user's token deletes only that \
            user's memories (bound to a session, of sessions' memories only that session's; a session's summary only \
            when it summarized that user's words alone). Deleting twice answers the first deletion.",
        method: Method::DELETE,
        path: "/v1/memories/{id}",
        read_only: false,
        destructive: true,
        query: &[],
        defaults: &[],
        idempotent: true,
        schema: forget_schema,
    },
    ToolSpec {
        name: "get_tool_output",
        description: "The full text of a long tool output whose recalled preview names a tout_ key, a page at a \
            time: at most max_bytes (default 65536) from byte offset (default 0). While next_offset is not null, \
            call again with offset set to it to read on; total_bytes is the whole output's size.",
        method: Method::GET,
        path: "/v1/tool-outputs/{key}",
        read_only: true,
        destructive: false,
        query: &["offset", "max_bytes"],
        defaults: &[("max_bytes", "65536")],
        idempotent: true,
        schema: tool_output_schema,
    },
    ToolSpec {
        name: "list_files",
        description: "List your workspace files (PROFILE.md, MEMORY.md, daily notes under memory/, your own \
            files) with their sizes and versions, up to limit (default 1000) at a time: while next_cursor is not \
            null, call again with cursor set to it for the rest.",
        method: Method::GET,
        path: "/v1/workspace/files",
        read_only: true,
        destructive: false,
        query: &["prefix", "cursor", "limit"],
        defaults: &[],
        idempotent: true,
        schema: list_files_schema,
    },
    ToolSpec {
        name: "read_file",
        description: "Read one workspace file, such as MEMORY.md or memory/2026-05-02.md.",
        method: Method::GET,
        path: "/v1/workspace/files/{path}",
        read_only: true,
        destructive: false,
        query: &[],
        defaults: &[],
        idempotent: true,
        schema: read_file_schema,
    },
    ToolSpec {
        name: "write_file",
        description: "Replace a workspace file's whole content (creating it if needed). With a user, you write \
            only their PROFILE.md, MEMORY.md and files under memory/; the agent's own files are read-only \
            (agent_file_read_only). Every write is a new version. Pass the version you read as expected_version, so that a change made since (by another \
            session, or mnemo's own consolidation) is not overwritten. To change part of a file, use edit_file.",
        method: Method::PUT,
        path: "/v1/workspace/files/{path}",
        read_only: false,
        destructive: true,
        query: &[],
        defaults: &[],
        // Each call is one more version of the file.
        idempotent: false,
        schema: write_file_schema,
    },
    ToolSpec {
        name: "edit_file",
        description: "Replace exact text in a workspace file: old_text must appear exactly once (or set \
            replace_all). Read the file first and copy old_text from it. With a user, only their PROFILE.md, \
            MEMORY.md and files under memory/ can be edited.",
        method: Method::POST,
        path: "/v1/workspace/files/{path}/edit",
        read_only: false,
        // It replaces text, as write_file does (both keep the old versions).
        destructive: true,
        query: &[],
        defaults: &[],
        idempotent: false,
        schema: edit_file_schema,
    },
];

// --- argument schemas: the endpoint's body, plus its path arguments ---------------------------

/// The largest page of a tool output one call reads: a model reads it whole, and the answer is
/// held in memory twice (its JSON and its text).
const MAX_PAGE_BYTES: u64 = 1 << 20;

fn forget_schema() -> Value {
    schema::object(&["id"], json!({ "id": schema::memory_id() }))
}

fn tool_output_schema() -> Value {
    schema::object(
        &["key"],
        json!({
            "key": schema::tool_output_key(),
            "offset": { "type": "integer", "minimum": 0, "description": "The byte to start at: 0, or next_offset." },
            "max_bytes": {
                "type": "integer", "minimum": 1, "maximum": MAX_PAGE_BYTES,
                "description": "At most this many bytes (default 65536, at most 1 MiB).",
            },
        }),
    )
}

fn list_files_schema() -> Value {
    schema::object(
        &[],
        json!({
            "prefix": schema::file_prefix(),
            "cursor": { "type": "string", "description": "next_cursor of the page before." },
            "limit": { "type": "integer", "minimum": 1, "maximum": 1000, "description": "Page size (default 1000)." },
        }),
    )
}

fn read_file_schema() -> Value {
    schema::object(&["path"], json!({ "path": schema::file_path() }))
}

fn write_file_schema() -> Value {
    schema::with_path(schema::file_write_body())
}

fn edit_file_schema() -> Value {
    schema::with_path(schema::file_edit_body())
}

// --- calls -----------------------------------------------------------------------------------

/// A tool call as the HTTP request to its endpoint.
#[derive(Debug, Clone)]
pub struct ApiCall {
    pub method: Method,
    /// Path and query, encoded.
    pub uri: String,
    pub body: Option<Value>,
}

/// The endpoint's answer.
#[derive(Debug, Clone)]
pub struct ApiAnswer {
    pub status: u16,
    pub body: Value,
}

impl ApiAnswer {
    /// A body that is not JSON becomes `null`, which [`tool_result`] reports as an error.
    pub fn from_bytes(status: u16, bytes: &[u8]) -> Self {
        Self { status, body: serde_json::from_slice(bytes).unwrap_or(Value::Null) }
    }
}

/// The longest string a tool call puts into the request's path or query: past every bound the
/// endpoints set (a workspace path's is 200 bytes), and far inside what a URI may hold (64 KiB),
/// so that an over-long argument is refused as bad input, not failed as an unreachable API.
const MAX_URI_FIELD_BYTES: usize = 4096;
const URI_FIELD_BOUND: &str = "at most 4096 bytes";

impl ToolSpec {
    fn tool(&self) -> Tool {
        let Value::Object(schema) = (self.schema)() else { unreachable!("every schema is an object") };
        let annotations = ToolAnnotations::new()
            .read_only(self.read_only)
            .destructive(self.destructive)
            .idempotent(self.idempotent)
            .open_world(false);
        Tool::new(self.name, self.description, schema).with_annotations(annotations)
    }

    /// The request this call makes: path arguments go into the path, the rest into the body (or,
    /// for a GET, the query). Only the endpoint judges the values.
    pub fn call(&self, mut args: Map<String, Value>) -> Result<ApiCall, ApiError> {
        if let Some(field) = crate::body::TENANT_FIELDS.iter().find(|f| args.contains_key(**f)) {
            return Err(ApiError::TenantInBody((*field).to_owned()));
        }
        let mut uri = String::with_capacity(self.path.len() + 32);
        let mut rest = self.path;
        while let Some(open) = rest.find('{') {
            let close = rest[open..].find('}').map_or(rest.len(), |c| open + c);
            let field = &rest[open + 1..close];
            let value = match args.remove(field) {
                // URL parsers resolve a `.` or `..` segment before the endpoint could refuse it,
                // and an over-long one never makes a URI; a file's path gets the code the endpoint
                // would give it.
                Some(Value::String(s)) if s == "." || s == ".." || s.len() > MAX_URI_FIELD_BYTES => {
                    let expected =
                        if s.len() > MAX_URI_FIELD_BYTES { URI_FIELD_BOUND } else { "a name other than . or .." };
                    return Err(match mnemo_core::WorkspacePath::parse(&s) {
                        Err(bad) if field == "path" => bad.into(),
                        _ => ApiError::InvalidField { field, expected },
                    });
                }
                Some(Value::String(s)) if !s.is_empty() => s,
                None | Some(Value::Null) => return Err(ApiError::MissingField(field)),
                Some(_) => return Err(ApiError::InvalidField { field, expected: "a non-empty string" }),
            };
            uri.push_str(&rest[..open]);
            // One segment, slashes and all, so no `..` in it is resolved on the way.
            uri.push_str(&percent_encode(&value));
            rest = &rest[close + 1..];
        }
        uri.push_str(rest);
        if self.method == Method::POST || self.method == Method::PUT {
            return Ok(ApiCall { method: self.method.clone(), uri, body: Some(Value::Object(args)) });
        }
        let mut query = Vec::new();
        for (field, value) in self.defaults {
            if args.get(*field).is_none_or(Value::is_null) {
                query.push(format!("{field}={value}"));
            }
        }
        let schema = (self.schema)();
        for (name, value) in args {
            let Some(field) = self.query.iter().find(|q| **q == name) else {
                return Err(ApiError::unknown_field(&name));
            };
            let whole = matches!(schema["properties"][*field]["type"].as_str(), Some("integer"));
            match value {
                Value::Null => {}
                Value::String(s) if !whole && s.len() > MAX_URI_FIELD_BYTES => {
                    return Err(ApiError::InvalidField { field, expected: URI_FIELD_BOUND });
                }
                Value::String(s) if !whole => query.push(format!("{field}={}", percent_encode(&s))),
                // 5.0 too, as clients that hold every number as a float send it.
                Value::Number(n) if whole => {
                    let max = schema["properties"][*field]["maximum"].as_u64().unwrap_or(u64::MAX);
                    match crate::body::integer(&n).and_then(|n| u64::try_from(n).ok()) {
                        Some(n) if n <= max => query.push(format!("{field}={n}")),
                        _ => {
                            return Err(ApiError::InvalidField { field, expected: "a whole number within its bounds" });
                        }
                    }
                }
                _ if whole => return Err(ApiError::InvalidField { field, expected: "a whole number" }),
                _ => return Err(ApiError::InvalidField { field, expected: "a string" }),
            }
        }
        if !query.is_empty() {
            uri = format!("{uri}?{}", query.join("&"));
        }
        Ok(ApiCall { method: self.method.clone(), uri, body: None })
    }
}

/// Whether an MCP HTTP body is one JSON-RPC `tools/call` request (a batch, or anything
/// unreadable, is not): one whose refusal can be a tool error.
pub fn is_tool_call(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Message<'a> {
        #[serde(borrow)]
        method: Option<std::borrow::Cow<'a, str>>,
    }
    serde_json::from_slice::<Message>(body).is_ok_and(|m| m.method.as_deref() == Some("tools/call"))
}

/// RFC 3986 unreserved characters stay; everything else, `/` too, is %-encoded.
fn percent_encode(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    for byte in raw.bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => out.push(byte as char),
            _ => out.push_str(&format!("%{byte:02X}")),
        }
    }
    out
}

/// The endpoint's answer as a tool result: a success carries the answer as structured content
/// (and as text, for clients that read only text); an error is a tool error carrying the API's
/// `{error: {code, message}}`, so an agent sees `missing_identity`, not a stack trace.
fn tool_result(answer: ApiAnswer) -> CallToolResult {
    if (200..300).contains(&answer.status) && answer.body.is_object() {
        let mut result = CallToolResult::success(vec![ContentBlock::text(answer.body.to_string())]);
        result.structured_content = Some(answer.body);
        return result;
    }
    // Anything but the API's error body (another service at MNEMO_URL, say) is an error too.
    let body = if is_the_apis_error(&answer.body) {
        answer.body
    } else {
        json!({ "error": { "code": "internal", "message": format!("not an answer of mnemo's API (HTTP {})", answer.status) } })
    };
    let mut result = CallToolResult::error(vec![ContentBlock::text(body.to_string())]);
    result.structured_content = Some(body);
    result
}

/// Whether a body is the API's error, `{error: {code, message}}`.
fn is_the_apis_error(body: &Value) -> bool {
    body.get("error").is_some_and(|e| e["code"].is_string() && e["message"].is_string())
}

/// What a proxy in front of the API answers when the API is down or slow (its own page, not the
/// API's error body): the API was not reached, or did not answer in time.
const GATEWAY_STATUSES: [u16; 5] = [408, 429, 502, 503, 504];

/// The tool error for an API not reached, or not answering in time. A call that timed out may
/// have been applied: one that is not idempotent (an edit, a new version) must not be sent
/// again blind.
fn unavailable(idempotent: bool) -> ApiAnswer {
    let message = if idempotent {
        "mnemo's API could not be reached or did not answer in time; try again later"
    } else {
        "mnemo's API could not be reached or did not answer in time, and the call may have been \
         applied: read the current state before trying again"
    };
    ApiAnswer { status: 503, body: json!({ "error": { "code": UNAVAILABLE, "message": message } }) }
}

fn refused(error: &ApiError) -> CallToolResult {
    tool_result(ApiAnswer { status: error.status().as_u16(), body: error.body() })
}

/// The tool error's code when the API could not be reached (`mnemo-mcp` and a server that is
/// down or too slow); every other code is the API's own.
pub const UNAVAILABLE: &str = "unavailable";

/// Sends an [`ApiCall`] to mnemo's API on behalf of the MCP client.
pub trait Forward: Clone + Send + Sync + 'static {
    /// `Err` only when the API could not be reached; any answer from it is `Ok`.
    fn forward(
        &self,
        call: ApiCall,
        context: &RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ApiAnswer, String>> + Send;
}

/// The MCP server: [`tools`] over a [`Forward`].
#[derive(Debug, Clone)]
pub struct MnemoMcp<F> {
    forward: F,
}

impl<F: Forward> MnemoMcp<F> {
    pub fn new(forward: F) -> Self {
        Self { forward }
    }
}

impl<F: Forward> ServerHandler for MnemoMcp<F> {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("mnemo", env!("CARGO_PKG_VERSION")))
            .with_instructions(INSTRUCTIONS)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(TOOLS.iter().map(ToolSpec::tool).collect()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        TOOLS.iter().find(|t| t.name == name).map(ToolSpec::tool)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let Some(spec) = TOOLS.iter().find(|t| t.name == request.name) else {
            let name: String = request.name.chars().take(64).collect();
            return Err(ErrorData::invalid_params(format!("no tool named {name:?}"), None));
        };
        let call = match spec.call(request.arguments.unwrap_or_default()) {
            Ok(call) => call,
            Err(e) => return Ok(refused(&e).into()),
        };
        // A tool error, not a protocol one: the agent sees it and may try again later.
        let answer = match self.forward.forward(call, &context).await {
            Ok(answer) if GATEWAY_STATUSES.contains(&answer.status) && !is_the_apis_error(&answer.body) => {
                tracing::warn!(
                    tool = spec.name,
                    status = answer.status,
                    "an MCP tool call met a proxy's error, not the API"
                );
                unavailable(spec.idempotent)
            }
            Ok(answer) => answer,
            Err(e) => {
                tracing::warn!(tool = spec.name, error = %e, "an MCP tool call could not reach the API");
                unavailable(spec.idempotent)
            }
        };
        Ok(tool_result(answer).into())
    }
}

/// The API's own router, called in process with the MCP request's bearer token.
#[derive(Debug, Clone)]
pub struct InProcess {
    api: Router,
}

/// Set by `/mcp` on a tool call over the tenant's rate limit: it is answered `rate_limited`
/// without calling the API.
#[derive(Debug, Clone, Copy)]
pub struct OverLimit(pub std::time::Duration);

impl Forward for InProcess {
    async fn forward(&self, call: ApiCall, context: &RequestContext<RoleServer>) -> Result<ApiAnswer, String> {
        let outer = context.extensions.get::<Parts>();
        if let Some(OverLimit(wait)) = outer.and_then(|p| p.extensions.get::<OverLimit>()) {
            let refused = ApiError::RateLimited(*wait);
            return Ok(ApiAnswer { status: refused.status().as_u16(), body: refused.body() });
        }
        // `/mcp` charged this call when it came in.
        let mut request = Request::builder().method(call.method).uri(call.uri).extension(crate::auth::Charged);
        // `/mcp` verified this header before rmcp saw the request.
        if let Some(bearer) = outer.and_then(|p| p.headers.get(AUTHORIZATION)) {
            request = request.header(AUTHORIZATION, bearer);
        }
        let body = match call.body {
            Some(body) => {
                request = request.header(CONTENT_TYPE, "application/json");
                Body::from(body.to_string())
            }
            None => Body::empty(),
        };
        let request = request.body(body).map_err(|e| e.to_string())?;
        let Ok(response) = self.api.clone().oneshot(request).await;
        let status = response.status().as_u16();
        // The router is mnemo's own: its answers are bounded by what it stores.
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.map_err(|e| e.to_string())?;
        Ok(ApiAnswer::from_bytes(status, &bytes))
    }
}

/// Streamable HTTP for `/mcp`: stateless (any replica answers any request) and plain JSON answers.
/// `api` is the router the tools call; the caller puts authentication in front.
pub fn http_service(
    api: Router,
    max_body_bytes: usize,
) -> StreamableHttpService<MnemoMcp<InProcess>, NeverSessionManager> {
    let forward = InProcess { api };
    let mut config = StreamableHttpServerConfig::default();
    config.legacy_session_mode = false;
    config.json_response = true;
    config.sse_keep_alive = None;
    config.max_request_body_bytes = max_body_bytes;
    // The Host check guards servers that trust whoever reaches them; every call here carries its
    // own bearer token, and deployments answer under their own host names.
    let config = config.disable_allowed_hosts();
    StreamableHttpService::new(
        move || Ok(MnemoMcp::new(forward.clone())),
        Arc::new(NeverSessionManager::default()),
        config,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str) -> &'static ToolSpec {
        TOOLS.iter().find(|t| t.name == name).expect("tool")
    }

    fn args(value: Value) -> Map<String, Value> {
        let Value::Object(map) = value else { panic!("an object") };
        map
    }

    #[test]
    fn path_arguments_are_encoded_into_the_path_and_the_rest_is_the_body() {
        let call = spec("edit_file").call(args(json!({ "path": "memory/a b?.md", "old_text": "x", "new_text": "y" })));
        let call = call.expect("a call");
        assert_eq!((call.method, call.uri.as_str()), (Method::POST, "/v1/workspace/files/memory%2Fa%20b%3F.md/edit"));
        assert_eq!(call.body, Some(json!({ "old_text": "x", "new_text": "y" })));

        let call = spec("forget").call(args(json!({ "id": "../facts" }))).expect("a call");
        assert_eq!(call.uri, "/v1/memories/..%2Ffacts");
        let call = spec("list_files").call(args(json!({ "prefix": "memory/" }))).expect("a call");
        assert_eq!(call.uri, "/v1/workspace/files?prefix=memory%2F");
        let call = spec("list_files").call(args(json!({ "limit": 5.0, "cursor": "0_4d" }))).expect("a call");
        assert_eq!(call.uri, "/v1/workspace/files?cursor=0_4d&limit=5");
        // An agent reads a long tool output a page at a time unless it asks for more.
        let call = spec("get_tool_output").call(args(json!({ "key": "tout_x", "offset": 10 }))).expect("a call");
        assert_eq!(call.uri, "/v1/tool-outputs/tout_x?max_bytes=65536&offset=10");
        let call = spec("get_tool_output").call(args(json!({ "key": "tout_x", "max_bytes": 9 }))).expect("a call");
        assert_eq!(call.uri, "/v1/tool-outputs/tout_x?max_bytes=9");
    }

    #[test]
    fn bad_arguments_are_refused_with_the_api_codes() {
        let code = |tool: &str, value: Value| spec(tool).call(args(value)).unwrap_err().code();
        assert_eq!(code("forget", json!({})), "missing_field");
        assert_eq!(code("forget", json!({ "id": 5 })), "invalid_field");
        assert_eq!(code("read_file", json!({ "path": ".." })), "invalid_path");
        assert_eq!(code("forget", json!({ "id": ".." })), "invalid_field");
        assert_eq!(code("get_tool_output", json!({ "key": "tout_x", "tenant": "other" })), "tenant_in_body");
        assert_eq!(code("get_tool_output", json!({ "key": "tout_x", "owner": "x" })), "unknown_field");
        assert_eq!(code("list_files", json!({ "prefix": 1 })), "invalid_field");
        assert_eq!(code("list_files", json!({ "limit": "5" })), "invalid_field");
        assert_eq!(code("list_files", json!({ "limit": 2.5 })), "invalid_field");
        assert_eq!(code("get_tool_output", json!({ "key": "tout_x", "offset": -1 })), "invalid_field");
        // A page over the schema's maximum, which the route would read whole into memory.
        assert_eq!(code("get_tool_output", json!({ "key": "tout_x", "max_bytes": (1 << 20) + 1 })), "invalid_field");
        assert_eq!(code("list_files", json!({ "limit": 1001 })), "invalid_field");
        let page = spec("get_tool_output").call(args(json!({ "key": "tout_x", "max_bytes": 1 << 20 })));
        assert!(page.expect("the largest page").uri.ends_with("max_bytes=1048576"));
        // Past the bound (far inside what a URI holds): bad input, not an unreachable API.
        let long = "x".repeat(MAX_URI_FIELD_BYTES + 1);
        assert_eq!(code("read_file", json!({ "path": format!("{long}.md") })), "invalid_path");
        assert_eq!(code("forget", json!({ "id": long })), "invalid_field");
        assert_eq!(code("list_files", json!({ "prefix": long })), "invalid_field");
        let at_the_bound = "x".repeat(MAX_URI_FIELD_BYTES);
        assert!(spec("forget").call(args(json!({ "id": at_the_bound }))).is_ok());
        assert!(spec("list_files").call(args(json!({ "prefix": at_the_bound }))).is_ok());
    }

    #[test]
    fn only_the_api_error_shape_passes_through_and_anything_else_is_internal() {
        let error_of = |status: u16, body: Value| {
            let result = tool_result(ApiAnswer { status, body });
            assert_eq!(result.is_error, Some(true));
            result.structured_content.expect("structured")["error"].clone()
        };
        let ours = json!({ "error": { "code": "not_found", "message": "no such row" } });
        assert_eq!(error_of(404, ours.clone()), ours["error"]);
        // Another service at MNEMO_URL: its own error shapes are not mnemo's codes.
        assert_eq!(error_of(404, json!({ "error": "Not Found" }))["code"], "internal");
        assert_eq!(error_of(500, json!({ "error": { "code": 7 } }))["code"], "internal");
        assert_eq!(error_of(200, json!([1, 2]))["code"], "internal");
    }

    #[test]
    fn every_schema_is_a_closed_object_whose_required_fields_it_describes() {
        for tool in TOOLS {
            let schema = (tool.schema)();
            assert_eq!(schema["type"], "object", "{}", tool.name);
            assert_eq!(schema["additionalProperties"], false, "{}", tool.name);
            for required in schema["required"].as_array().expect("required") {
                let name = required.as_str().expect("a name");
                assert!(schema["properties"].get(name).is_some(), "{}: {name}", tool.name);
            }
            let path_args = tool
                .path
                .match_indices('{')
                .map(|(open, _)| &tool.path[open + 1..open + tool.path[open..].find('}').expect("closed")]);
            for name in path_args.chain(tool.query.iter().copied()) {
                assert!(schema["properties"].get(name).is_some(), "{}: argument {name}", tool.name);
            }
        }
    }
}
