//! The OpenAPI 3.1 document of the HTTP API, built from the same body schemas the MCP tools use
//! (`schema.rs`) and the error-code table. Served at `/openapi.json`; `docs/openapi.json` is a
//! copy a test keeps equal, and `tests/openapi.rs` fuzzes the server against it.

use axum::Json;
use serde_json::{Map, Value, json};

use crate::ERROR_CODES;
use crate::schema::{self, nullable_optionals};

/// `GET /openapi.json`.
pub async fn serve() -> Json<Value> {
    Json(document())
}

/// One operation: its method, what it does, its body and answers.
struct Op {
    method: &'static str,
    id: &'static str,
    summary: &'static str,
    params: Vec<Value>,
    body: Option<Value>,
    /// Success statuses and their answers' schemas.
    answers: Vec<(u16, Value)>,
    /// The error statuses it can answer.
    errors: &'static [u16],
    public: bool,
}

impl Op {
    fn new(method: &'static str, id: &'static str, summary: &'static str) -> Self {
        Self { method, id, summary, params: Vec::new(), body: None, answers: Vec::new(), errors: &[], public: false }
    }
    fn param(mut self, param: Value) -> Self {
        self.params.push(param);
        self
    }
    fn body(mut self, body: Value) -> Self {
        self.body = Some(nullable_optionals(body));
        self
    }
    fn answer(mut self, status: u16, schema: Value) -> Self {
        self.answers.push((status, schema));
        self
    }
    fn errors(mut self, errors: &'static [u16]) -> Self {
        self.errors = errors;
        self
    }
    fn public(mut self) -> Self {
        self.public = true;
        self
    }

    fn render(self) -> Value {
        let mut responses = Map::new();
        for (status, schema) in self.answers {
            let media = if self.id == "metrics" { "text/plain" } else { "application/json" };
            let content = json!({ media: { "schema": schema } });
            responses.insert(status.to_string(), json!({ "description": status_text(status), "content": content }));
        }
        // Any request may fail inside, or reach a route with a method it lacks.
        let mut errors: Vec<u16> = self.errors.iter().copied().chain([405, 500]).collect();
        if !self.public {
            // A token may lack the identity an operation needs, or be bound to another session;
            // its tenant may be over its rate; the database may be unreachable. A body sent where
            // none is read is read to be refused, and may be too large or too slow too.
            errors.extend([401, 403, 408, 413, 429, 503]);
        }
        if self.body.is_some() {
            // A body may be refused, arrive too slowly, or not fit on a full disk (operations
            // without a body that write name 507 themselves: the workspace's reads create its
            // core files on first use).
            errors.extend([400, 408, 413, 415, 507]);
        }
        errors.sort_unstable();
        errors.dedup();
        for status in errors {
            responses.insert(status.to_string(), json!({ "$ref": format!("#/components/responses/E{status}") }));
        }
        let mut op = json!({ "operationId": self.id, "summary": self.summary, "responses": responses });
        if !self.params.is_empty() {
            op["parameters"] = Value::Array(self.params);
        }
        if let Some(body) = self.body {
            op["requestBody"] = json!({ "required": true, "content": { "application/json": { "schema": body } } });
        }
        if self.public {
            op["security"] = json!([]);
        }
        op
    }
}

fn status_text(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        _ => "Answer",
    }
}

fn path_param(name: &str, description: &str) -> Value {
    json!({ "name": name, "in": "path", "required": true, "schema": { "type": "string", "minLength": 1 }, "description": description })
}

fn query_param(name: &str, schema: Value, description: &str) -> Value {
    json!({ "name": name, "in": "query", "required": false, "schema": schema, "description": description })
}

fn refs(name: &str) -> Value {
    json!({ "$ref": format!("#/components/schemas/{name}") })
}

/// An object answer: every listed field is present.
fn answer(properties: Value) -> Value {
    let required: Vec<&String> = properties.as_object().map(|p| p.keys().collect()).unwrap_or_default();
    json!({ "type": "object", "properties": properties, "required": required })
}

fn nullable(kind: &str) -> Value {
    json!({ "type": [kind, "null"] })
}

fn time() -> Value {
    json!({ "type": "string", "format": "date-time" })
}

fn uuid() -> Value {
    json!({ "type": "string", "format": "uuid" })
}

fn components() -> Value {
    let codes: Vec<&str> = ERROR_CODES.iter().map(|(code, _, _)| *code).collect();
    let mut responses = Map::new();
    let mut statuses: Vec<u16> = ERROR_CODES.iter().map(|(_, status, _)| *status).collect();
    statuses.extend([405]);
    statuses.sort_unstable();
    statuses.dedup();
    for status in statuses {
        let listed: Vec<String> = ERROR_CODES
            .iter()
            .filter(|(_, s, _)| *s == status)
            .map(|(code, _, meaning)| format!("`{code}`: {meaning}"))
            .collect();
        let mut response = json!({
            "description": listed.join("; "),
            "content": { "application/json": { "schema": refs("Error") } },
        });
        if status == 429 {
            response["headers"] = json!({ "Retry-After": {
                "description": "Seconds until the tenant's rate allows another request",
                "schema": { "type": "integer" },
            }});
        }
        responses.insert(format!("E{status}"), response);
    }
    let file_meta = answer(json!({
        "path": { "type": "string" }, "size_bytes": { "type": "integer" }, "enabled": { "type": "boolean" },
        "sort_order": { "type": "integer" }, "version": { "type": "integer" }, "updated_at": time(),
        "owner": { "type": "string", "enum": ["agent", "user"] },
    }));
    let file = answer(json!({
        "path": { "type": "string" }, "content": { "type": "string" }, "size_bytes": { "type": "integer" },
        "enabled": { "type": "boolean" }, "sort_order": { "type": "integer" }, "version": { "type": "integer" },
        "created_at": time(), "updated_at": time(),
    }));
    json!({
        "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer", "bearerFormat": "JWT",
            "description": "Claims: tenant (required), sub (a user), agent, sid (a session), roles, exp (required)." } },
        "responses": responses,
        "schemas": {
            "Error": {
                "type": "object",
                "required": ["error"],
                "properties": {
                    "error": {
                        "type": "object",
                        "required": ["code", "message"],
                        "properties": { "code": { "type": "string", "enum": codes }, "message": { "type": "string" } },
                    },
                    "results": {
                        "description": "`batch_rejected` only: each item's result, in order (the refused ones say why)",
                        "type": "array",
                        "items": { "oneOf": [refs("Remembered"), refs("Error")] },
                    },
                },
            },
            "Remembered": answer(json!({ "id": uuid(), "was_new": { "type": "boolean" } })),
            "BatchResults": answer(json!({
                "results": { "type": "array", "items": { "oneOf": [refs("Remembered"), refs("Error")] } },
                "written": { "type": "integer", "minimum": 0 },
            })),
            "RecalledItem": answer(json!({
                "id": uuid(), "source_kind": { "type": "string" }, "source_ref": { "type": "string" },
                "content": { "type": "string" }, "event_time": time(), "layer": { "type": "string" },
                "score": { "type": "number" },
            })),
            "FileMeta": file_meta,
            "File": file,
        },
    })
}

/// The whole document.
pub fn document() -> Value {
    let sid = || path_param("sid", "A session id; a token bound to a session reaches only that one.");
    let file =
        || path_param("path", "A relative .md path, such as MEMORY.md or memory/2026-05-02.md (percent-encoded).");
    let queued = answer(json!({ "queued": { "type": "boolean" }, "skipped": nullable("string") }));
    let written = answer(json!({
        "path": { "type": "string" }, "result": { "type": "string", "enum": ["created", "overwritten"] },
        "bytes_written": { "type": "integer" }, "version": { "type": "integer" },
    }));
    let paths: Vec<(&str, Vec<Op>)> = vec![
        ("/v1/memories", vec![Op::new("post", "remember", "Write a chat message, tool output or document chunk (idempotent by source_ref)")
            .body(schema::memory_body())
            .answer(201, refs("Remembered"))
            .answer(200, refs("Remembered"))
            .errors(&[401, 403, 409])]),
        ("/v1/memories/batch", vec![Op::new("post", "remember_batch", "Write many memories in one transaction")
            .body(schema::batch_body("POST /v1/memories"))
            .answer(200, refs("BatchResults"))]),
        ("/v1/facts", vec![Op::new("post", "remember_fact", "Remember a fact about the token's user or agent")
            .body(schema::fact_body())
            .answer(201, refs("Remembered"))
            .answer(200, refs("Remembered"))
            .errors(&[401, 409])]),
        ("/v1/facts/batch", vec![Op::new("post", "remember_fact_batch", "Remember many facts in one transaction")
            .body(schema::batch_body("POST /v1/facts"))
            .answer(200, refs("BatchResults"))]),
        ("/v1/memories/{id}", vec![Op::new("delete", "forget", "Soft-delete a memory")
            .param(json!({ "name": "id", "in": "path", "required": true, "schema": uuid(), "description": "The memory's id." }))
            .answer(200, answer(json!({ "id": uuid(), "deleted_at": time(), "already_deleted": { "type": "boolean" } })))
            .errors(&[400, 404, 507])]),
        ("/v1/recall", vec![Op::new("post", "recall", "Hybrid recall over the classes the token may see")
            .body(schema::recall_body())
            .answer(200, answer(json!({
                "items": { "type": "array", "items": refs("RecalledItem") }, "total": { "type": "integer" },
                "degraded": { "type": "boolean" }, "rerank_used": { "type": "boolean" },
            })))]),
        ("/v1/memory-pack", vec![Op::new("post", "memory_pack", "Memories per layer within token budgets, rendered")
            .body(schema::pack_body())
            .answer(200, answer(json!({
                "rendered": { "type": "string" },
                "items": { "type": "array", "items": { "allOf": [refs("RecalledItem"), answer(json!({
                    "pack_layer": { "type": "string", "enum": ["working", "episodic", "semantic", "procedural"] },
                    "tokens": { "type": "integer" }, "past_soft_budget": { "type": "boolean" },
                }))] } },
                "diagnostics": { "type": "object" },
            })))]),
        ("/v1/tool-outputs/{key}", vec![Op::new("get", "tool_output", "A long tool output's payload, whole or a page of it")
            .param(path_param("key", "The tout_ key its preview names."))
            .param(query_param("offset", json!({ "type": "integer", "minimum": 0 }), "Byte to start at: 0 (the default) or next_offset."))
            .param(query_param("max_bytes", json!({ "type": "integer", "minimum": 1 }), "At most this many bytes, cut between characters (default: the rest)."))
            .answer(200, answer(json!({
                "key": { "type": "string" }, "item_id": uuid(), "content": { "type": "string" },
                "offset": { "type": "integer" }, "total_bytes": { "type": "integer" }, "next_offset": nullable("integer"),
            })))
            .errors(&[400, 404])]),
        ("/v1/sessions/{sid}/messages", vec![Op::new("get", "session_messages", "A session's messages in order, a page at a time")
            .param(sid())
            .param(query_param("limit", json!({ "type": "integer", "minimum": 1, "maximum": 1000 }), "Page size (default 100)."))
            .param(query_param("cursor", json!({ "type": "string" }), "next_cursor of the page before."))
            .answer(200, answer(json!({
                "messages": { "type": "array", "items": answer(json!({
                    "id": uuid(), "source_kind": { "type": "string" }, "role": { "type": "string" },
                    "content": { "type": "string" }, "tool_call_id": nullable("string"), "name": nullable("string"),
                    "token_count": nullable("integer"), "event_time": time(),
                })) },
                "next_cursor": nullable("string"),
            })))
            .errors(&[400, 403])]),
        ("/v1/sessions/{sid}/context", vec![Op::new("post", "context", "The next model call's messages, within the budget")
            .param(sid())
            .body(schema::context_body())
            .answer(200, answer(json!({ "messages": { "type": "array", "items": { "type": "object" } }, "diagnostics": { "type": "object" } })))
            .errors(&[403])]),
        ("/v1/sessions/{sid}/complete", vec![Op::new("post", "complete", "The conversation is over: ask for its extraction")
            .param(sid())
            .body(schema::complete_body())
            .answer(202, queued.clone())
            .errors(&[403])]),
        ("/v1/sessions/{sid}/extract", vec![Op::new("post", "extract_session", "Extract the conversation now, past the gates")
            .param(sid())
            .body(schema::empty_body())
            .answer(202, queued)
            .errors(&[403])]),
        ("/v1/agents/{agent}/consolidate", vec![Op::new("post", "consolidate_notes", "Consolidate the user's daily notes into MEMORY.md now")
            .param(path_param("agent", "The token's agent."))
            .body(schema::empty_body())
            .answer(202, answer(json!({
                "queued": { "type": "boolean", "description": "False while an earlier request still waits for its run." },
                "skipped": { "type": ["string", "null"], "description": "disabled: consolidation is switched off (MNEMO_CONSOLIDATE_ENABLED); no_daily_notes: the user has no daily note to consolidate." },
            })))
            .errors(&[403])]),
        ("/v1/workspace/files", vec![Op::new("get", "list_files", "The workspace's live files, by sort order, a page at a time")
            .param(query_param("prefix", json!({ "type": "string" }), "Only paths starting with this."))
            .param(query_param("limit", json!({ "type": "integer", "minimum": 1, "maximum": 1000 }), "Page size (default 1000)."))
            .param(query_param("cursor", json!({ "type": "string" }), "next_cursor of the page before."))
            .answer(200, answer(json!({ "files": { "type": "array", "items": refs("FileMeta") }, "next_cursor": nullable("string") })))
            .errors(&[400, 507])]),
        ("/v1/workspace/files/{path}", vec![
            Op::new("get", "read_file", "One workspace file").param(file()).answer(200, refs("File")).errors(&[400, 404, 507]),
            Op::new("put", "write_file", "Replace a workspace file's content (creating it)")
                .param(file())
                .body(schema::file_write_body())
                .answer(201, written.clone())
                .answer(200, written)
                .errors(&[403, 409]),
            Op::new("patch", "patch_file", "Enable, disable or reorder a workspace file")
                .param(file())
                .body(schema::file_patch_body())
                .answer(200, answer(json!({
                    "path": { "type": "string" }, "size_bytes": { "type": "integer" }, "enabled": { "type": "boolean" },
                    "sort_order": { "type": "integer" }, "version": { "type": "integer" },
                    "created_at": time(), "updated_at": time(),
                })))
                .errors(&[403, 404]),
            Op::new("delete", "delete_file", "Delete a workspace file (its versions stay)")
                .param(file())
                .answer(200, answer(json!({ "path": { "type": "string" }, "deleted": { "type": "boolean" }, "version": { "type": "integer" } })))
                .errors(&[400, 403, 404, 507]),
        ]),
        ("/v1/workspace/files/{path}/edit", vec![Op::new("post", "edit_file", "Replace exact text in a workspace file")
            .param(file())
            .body(schema::file_edit_body())
            .answer(200, answer(json!({ "path": { "type": "string" }, "replaced": { "type": "integer" }, "version": { "type": "integer" } })))
            .errors(&[403, 404, 409])]),
        ("/v1/workspace/prompt", vec![Op::new("get", "workspace_prompt", "The enabled files and memory notes rendered for a prompt")
            .param(query_param("max_tokens", json!({ "type": "integer", "minimum": 1, "maximum": 1_000_000 }), "Token budget."))
            .answer(200, answer(json!({ "prompt": { "type": "string" }, "files": { "type": "string" }, "memory": { "type": "string" }, "tokens": { "type": "integer" } })))
            .errors(&[400, 507])]),
        ("/healthz", vec![Op::new("get", "healthz", "The process is up").public().answer(200, answer(json!({ "status": { "type": "string" } })))]),
        ("/readyz", vec![Op::new("get", "readyz", "The database answers and its schema is this build's, or a newer build's")
            .public()
            .answer(200, answer(json!({ "status": { "type": "string" }, "schema": { "type": "string", "enum": ["current", "newer"] } })))
            .errors(&[503])]),
        ("/metrics", vec![Op::new("get", "metrics", "Prometheus metrics").public().answer(200, json!({ "type": "string" }))]),
        ("/openapi.json", vec![Op::new("get", "openapi", "This document").public().answer(200, json!({ "type": "object" }))]),
    ];
    let mut rendered = Map::new();
    for (path, ops) in paths {
        let mut item = Map::new();
        for op in ops {
            item.insert(op.method.to_owned(), op.render());
        }
        rendered.insert(path.to_owned(), Value::Object(item));
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "mnemo",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "A memory platform for AI agents. Every /v1 call carries a bearer JWT; the tenant comes only \
                from it. Errors are {error: {code, message}} with the codes listed under each status. The MCP tools \
                at /mcp are these endpoints (see README, MCP tools).",
        },
        "security": [{ "bearer": [] }],
        "paths": rendered,
        "components": components(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reference_resolves() {
        fn walk(value: &Value, doc: &Value, seen: &mut usize) {
            match value {
                Value::Object(map) => {
                    if let Some(Value::String(target)) = map.get("$ref") {
                        let pointer = target.strip_prefix('#').expect("a local reference");
                        assert!(doc.pointer(pointer).is_some(), "{target} does not resolve");
                        *seen += 1;
                    }
                    map.values().for_each(|v| walk(v, doc, seen));
                }
                Value::Array(items) => items.iter().for_each(|v| walk(v, doc, seen)),
                _ => {}
            }
        }
        let doc = document();
        let mut seen = 0;
        walk(&doc, &doc, &mut seen);
        assert!(seen > 50, "only {seen} references");
    }

    #[test]
    fn every_error_answer_is_listed_where_it_can_happen() {
        let doc = document();
        let mut referenced = std::collections::BTreeSet::new();
        for (path, ops) in doc["paths"].as_object().expect("paths") {
            for (method, op) in ops.as_object().expect("operations") {
                let responses = op["responses"].as_object().expect("responses");
                referenced.extend(responses.keys().cloned());
                if path.starts_with("/v1/") {
                    for status in ["429", "503"] {
                        assert!(responses.contains_key(status), "{method} {path} lacks {status}");
                    }
                }
            }
        }
        for name in doc["components"]["responses"].as_object().expect("responses").keys() {
            let status = name.trim_start_matches('E');
            assert!(referenced.contains(status), "{name} is listed by no operation");
        }
    }

    #[test]
    fn optional_fields_may_be_null_as_the_parser_reads_them() {
        let body = &document()["paths"]["/v1/recall"]["post"]["requestBody"]["content"]["application/json"]["schema"];
        assert_eq!(body["properties"]["query"]["type"], "string");
        assert_eq!(body["properties"]["top_k"]["type"], json!(["integer", "null"]));
        assert!(body["properties"]["scope"]["enum"].as_array().expect("enum").contains(&Value::Null));
    }
}
