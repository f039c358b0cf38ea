//! JSON Schemas of the request bodies and answers, written once: the MCP tools' arguments
//! (`mcp.rs`) and the OpenAPI document (`openapi.rs`) are built from them. Enumerations come from
//! the domain types the API parses with, so a value a schema offers is one the API takes. A
//! schema states only limits the parser enforces, so what breaks a schema is refused (the
//! OpenAPI fuzz test checks that).

use mnemo_core::{
    Category, FactScope, Layer, MAX_ALLOWED_ROLES, MAX_CONTENT_BYTES, MAX_RELATIONS, MAX_TAGS, MAX_TOP_K, RecallScope,
    RelationType, Role, SourceKind, TriggerSource, Visibility,
};
use mnemo_recall::{PackRequest, PackTopK};
use serde_json::{Value, json};

// --- building blocks -------------------------------------------------------------------------

/// A closed object: a field it does not describe is refused (`unknown_field`).
pub fn object(required: &[&str], properties: Value) -> Value {
    json!({ "type": "object", "properties": properties, "required": required, "additionalProperties": false })
}

pub fn text(description: &str) -> Value {
    json!({ "type": "string", "description": description })
}

/// A string that may not be empty.
fn filled(description: &str) -> Value {
    json!({ "type": "string", "minLength": 1, "description": description })
}

pub fn one_of(values: impl IntoIterator<Item = &'static str>, description: &str) -> Value {
    json!({ "type": "string", "enum": values.into_iter().collect::<Vec<_>>(), "description": description })
}

fn strings(max_items: usize, description: &str) -> Value {
    json!({ "type": "array", "items": { "type": "string" }, "maxItems": max_items, "description": description })
}

fn unit(description: &str) -> Value {
    json!({ "type": "number", "minimum": 0, "maximum": 1, "description": description })
}

fn whole(min: i64, max: i64, description: &str) -> Value {
    json!({ "type": "integer", "minimum": min, "maximum": max, "description": description })
}

fn flag(description: &str) -> Value {
    json!({ "type": "boolean", "description": description })
}

fn metadata() -> Value {
    json!({ "type": "object", "description": "Your own JSON object, kept with the memory (and in its tenant's export); recall and the message list do not return it." })
}

fn event_time() -> Value {
    json!({ "type": "string", "format": "date-time", "description": "When it happened (RFC 3339, of the years 0001-9999 in UTC; a chat message's or tool output's at most a day ahead of the server's clock); default: now." })
}

pub fn memory_id() -> Value {
    json!({ "type": "string", "format": "uuid", "description": "A memory's id." })
}

pub fn tool_output_key() -> Value {
    text("The tout_ key a tool output's preview names.")
}

pub fn file_path() -> Value {
    text("A relative .md path, such as MEMORY.md or memory/2026-05-02.md.")
}

pub fn file_prefix() -> Value {
    text("Only paths starting with this, such as memory/.")
}

/// `body` with the workspace file's `path` as one more required field (an MCP tool's arguments).
pub fn with_path(mut body: Value) -> Value {
    body["properties"]["path"] = file_path();
    body["required"].as_array_mut().expect("a required list").insert(0, json!("path"));
    body
}

// --- request bodies --------------------------------------------------------------------------

pub fn recall_body() -> Value {
    object(
        &["query"],
        json!({
            "query": filled("What to look for, in natural language; keywords and meaning are both matched."),
            "top_k": whole(1, MAX_TOP_K as i64, "How many items (default 5)."),
            "source_kinds": {
                "type": "array",
                "items": one_of(SourceKind::ALL.iter().map(|k| k.as_str()), "A kind of memory."),
                "minItems": 1,
                "description": "Only these kinds (default: all).",
            },
            "scope": one_of(
                RecallScope::ALL.iter().map(|s| s.as_str()),
                "session: this conversation; user: facts about the user; agent: your own facts; tenant: shared \
                 documents; any (default): all of them fused.",
            ),
            "enable_rerank": flag("Rerank with the cross-encoder when one is configured (default true)."),
        }),
    )
}

/// A pack's options; `query` is required unless the context call's `current_message` stands in.
fn pack_options(query_required: bool) -> Value {
    let k = |layer: &str| whole(0, PackTopK::MAX as i64, &format!("Most {layer} items."));
    let budget = |what: &str| whole(1, i64::from(PackRequest::MAX_BUDGET), what);
    object(
        if query_required { &["query"] } else { &[] },
        json!({
            "query": filled("What the task is about."),
            "soft_budget_tokens": budget("Tokens the pack fills by relevance (default 1,800)."),
            "max_budget_tokens": budget("Tokens the pack never exceeds (default 3,500; not below the soft budget)."),
            "top_k": {
                "type": "object",
                "properties": { "working": k("working"), "episodic": k("episodic"), "semantic": k("semantic"), "procedural": k("procedural") },
                "additionalProperties": false,
                "description": "Per-layer limits (working 6, episodic 8, semantic 6, procedural 4).",
            },
        }),
    )
}

pub fn pack_body() -> Value {
    pack_options(true)
}

pub fn memory_body() -> Value {
    let kinds = [SourceKind::ChatMessage, SourceKind::ToolOutput, SourceKind::DocumentChunk];
    object(
        &["source_kind", "source_ref", "content"],
        json!({
            "source_kind": one_of(kinds.iter().map(|k| k.as_str()), "What it is."),
            "source_ref": json!({ "type": "string", "minLength": 1, "description": "Your stable id for it (a message id, a tool call id, a chunk id); at most 512 bytes." }),
            "content": filled(&format!("The text; at most {MAX_CONTENT_BYTES} bytes except for tool outputs.")),
            "session_id": text("The conversation it belongs to; default: the token's session (none for a document chunk)."),
            "role": one_of(Role::ALL.iter().map(|r| r.as_str()), "Who said it (chat messages only; default user; a tool output is always tool)."),
            "tool_call_id": text("The tool call a tool message answers, or an assistant message makes (chat messages and tool outputs only; refused on user and system messages)."),
            "name": text("Who wrote a user or assistant message (its participant: a question naming them ranks their messages), or a tool message's tool (chat messages and tool outputs only)."),
            "metadata": metadata(),
            "event_time": event_time(),
        }),
    )
}

pub fn fact_body() -> Value {
    object(
        &["content", "scope"],
        json!({
            "content": filled("The fact, as one self-contained sentence."),
            "scope": one_of(FactScope::ALL.iter().map(|s| s.as_str()), "user: about the user; agent: about you."),
            "key": text("A stable name for what the fact is about (such as home_city); a new fact with the same key replaces the old one."),
            "layer": one_of(Layer::ALL.iter().map(|l| l.as_str()), "episodic: an event; semantic: a lasting fact; procedural: how to do something."),
            "category": one_of(Category::ALL.iter().map(|c| c.as_str()), "What kind of fact it is."),
            "importance": unit("How much it matters, 0 to 1."),
            "confidence": unit("How sure you are, 0 to 1."),
            "tags": strings(MAX_TAGS, "Short labels."),
            "relations": {
                "type": "array",
                "maxItems": MAX_RELATIONS,
                "items": object(&["type", "target"], json!({
                    "type": one_of(RelationType::ALL.iter().map(|r| r.as_str()), "How it relates."),
                    "target": memory_id(),
                })),
                "description": format!("Memories this one relates to; a memory holds at most {MAX_RELATIONS}, counting those an earlier assertion of it added."),
            },
            "visibility": one_of(Visibility::ALL.iter().map(|v| v.as_str()), "Who else may recall it (default: its scope's owner)."),
            "allowed_roles": strings(MAX_ALLOWED_ROLES, "Only tokens with one of these roles may recall it."),
            "source": one_of(["user", "api"], "user: the user said it; api (default): you concluded it."),
            "metadata": metadata(),
            "event_time": event_time(),
        }),
    )
}

/// `{items, atomic?}`. Items may be anything: each is checked as its single endpoint checks its
/// body, and a bad one (not an object, too) gets its own error in the results instead of refusing
/// the batch.
pub fn batch_body(item: &str) -> Value {
    object(
        &["items"],
        json!({
            "items": {
                "type": "array",
                "minItems": 1,
                "items": {},
                "description": format!("Bodies of {item}, at most MNEMO_MAX_BATCH_ITEMS (1,000 by default)."),
            },
            "atomic": flag("One bad item writes nothing (default false: the good items are written)."),
        }),
    )
}

pub fn context_body() -> Value {
    object(
        &[],
        json!({
            "max_input_tokens": whole(64, 10_000_000, "The model's input budget (default 128,000)."),
            "reserve_output_tokens": { "type": "integer", "minimum": 0, "description": "Tokens kept for the answer; below max_input_tokens (default 0)." },
            "system_prompt": text("Placed first."),
            "current_message": text("The user's new message, placed last (a blank one is not placed)."),
            "overflow": flag("The model refused the last window as too long: keep less this time."),
            "wait_ms": whole(0, 30_000, "Wait this long for a pending compaction's summary (default 0)."),
            "memory_pack": {
                "oneOf": [{ "type": "boolean" }, pack_options(false)],
                "description": "A memory pack for current_message (or the pack's query), placed with the workspace files.",
            },
        }),
    )
}

pub fn complete_body() -> Value {
    let sources = [TriggerSource::Web, TriggerSource::Channel, TriggerSource::Cron];
    object(
        &["trigger_source"],
        json!({ "trigger_source": one_of(sources.iter().map(|s| s.as_str()), "Where the conversation happened.") }),
    )
}

pub fn empty_body() -> Value {
    object(&[], json!({}))
}

pub fn file_write_body() -> Value {
    object(
        &["content"],
        json!({
            "content": text("The file's whole new content (Markdown)."),
            "expected_version": {
                "type": "integer", "minimum": 0, "maximum": i32::MAX,
                "description": "The version you read (0: the file does not exist): if the file is now at another, \
                    nothing is written and the answer is 409 file_changed. Without it, the write replaces whatever is there.",
            },
        }),
    )
}

pub fn file_edit_body() -> Value {
    object(
        &["old_text", "new_text"],
        json!({
            "old_text": filled("Text that is in the file now, exactly."),
            "new_text": text("What replaces it (may be empty)."),
            "replace_all": flag("Replace every occurrence (default: old_text must be unique)."),
        }),
    )
}

pub fn file_patch_body() -> Value {
    let mut body = object(
        &[],
        json!({
            "enabled": flag("Whether the file goes into prompts."),
            "sort_order": whole(-10_000, 10_000, "Its place in prompts, lowest first."),
        }),
    );
    body["minProperties"] = json!(1);
    body
}

/// The body as the HTTP API reads it: an optional field may also be `null`, which means absent.
pub fn nullable_optionals(mut schema: Value) -> Value {
    if let Some(options) = schema.get_mut("oneOf").and_then(Value::as_array_mut) {
        options.iter_mut().for_each(|o| *o = nullable_optionals(o.take()));
    }
    let required: Vec<String> = schema["required"]
        .as_array()
        .map(|r| r.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
        .unwrap_or_default();
    if let Some(properties) = schema.get_mut("properties").and_then(Value::as_object_mut) {
        for (name, property) in properties.iter_mut() {
            let inner = nullable_optionals(property.take());
            *property = if required.contains(name) { inner } else { or_null(inner) };
        }
    }
    if let Some(items) = schema.get_mut("items") {
        *items = nullable_optionals(items.take());
    }
    schema
}

fn or_null(mut schema: Value) -> Value {
    if schema.get("oneOf").is_some() {
        schema["oneOf"].as_array_mut().expect("a list").push(json!({ "type": "null" }));
        return schema;
    }
    if let Some(kind) = schema.get("type").and_then(Value::as_str) {
        schema["type"] = json!([kind, "null"]);
    }
    if let Some(values) = schema.get_mut("enum").and_then(Value::as_array_mut) {
        values.push(Value::Null);
    }
    schema
}
