//! An agent's workspace files over HTTP, for the agent and user the token names: list, read,
//! replace, find-and-replace, enable and order, delete, and the enabled files rendered for a
//! prompt. Every operation is one store call, which the MCP server of a later issue calls too.

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use mnemo_core::{
    FileKey, InvalidInput, MemoryNotes, PromptFile, ScopeError, Workspace, WorkspacePath, WorkspacePrompt,
    render_prompt,
};
use mnemo_recall::PlacedNotes;
use mnemo_store::{ConsolidationRequest, Edited, FileMeta, WorkspaceFile, Written};
use serde_json::{Value, json};

use crate::auth::Authenticated;
use crate::body::{JsonObject, MAX_PAGE, PathPart, page_limit, query_number, query_params};
use crate::{ApiError, AppState};

/// Who changed a file through the API, in its version and audit rows.
const ACTOR: &str = "api";
/// `sort_order` values accepted.
const SORT_ORDERS: std::ops::RangeInclusive<i64> = -10_000..=10_000;

/// The workspace the token reaches, its core files created on first use (but `writing`, which
/// the caller's PUT creates).
async fn workspace(
    state: &AppState,
    principal: &mnemo_core::Principal,
    writing: Option<&WorkspacePath>,
) -> Result<Workspace, ApiError> {
    let workspace = Workspace::of(principal)?;
    state.store.ensure_core_files(&workspace, &state.workspace.templates, writing).await?;
    Ok(workspace)
}

/// The methods of a file route: `…/{path}/edit` shares the files' wildcard route and takes only
/// POST, a file itself takes the others. `None` for a path that is not a file route.
pub fn file_route_methods(uri_path: &str) -> Option<&'static str> {
    let path = uri_path.strip_prefix("/v1/workspace/files/")?;
    Some(if path.ends_with("/edit") { EDIT_METHODS } else { FILE_METHODS })
}

const EDIT_METHODS: &str = "POST";
const FILE_METHODS: &str = "GET, PUT, PATCH, DELETE";

/// Refuses a method other than POST on `…/{path}/edit` before the handler reads its body's
/// fields (a body that is not a JSON object is refused first, by its extractor).
fn not_edit(path: &str) -> Result<(), ApiError> {
    if path.ends_with("/edit") { Err(ApiError::MethodNotAllowed(Some(EDIT_METHODS))) } else { Ok(()) }
}

async fn file_key(state: &AppState, principal: &mnemo_core::Principal, raw: &str) -> Result<FileKey, ApiError> {
    let key = key_of(principal, raw)?;
    workspace(state, principal, None).await?;
    Ok(key)
}

/// The key `raw` names in the token's workspace, without creating anything.
fn key_of(principal: &mnemo_core::Principal, raw: &str) -> Result<FileKey, ApiError> {
    Ok(Workspace::of(principal)?.file(WorkspacePath::parse(raw)?)?)
}

/// The key of a file to change (with `new_name`, one a PUT may create, so not from a template
/// first): the agent's shared files are changed only by a service token (no user, no session),
/// so no user, nor a session's token without one, can rewrite what every user's prompt holds.
/// Checked before the core files are created, so a change the token may not make writes
/// nothing (any other request, refused or not, creates them: they are made on first use).
async fn writable_key(
    state: &AppState,
    principal: &mnemo_core::Principal,
    raw: &str,
    new_name: bool,
) -> Result<FileKey, ApiError> {
    let key = key_of(principal, raw)?;
    if key.user.is_none() && !principal.is_service() {
        return Err(ScopeError::AgentFileReadOnly.into());
    }
    if new_name {
        key.path.check_new_name(chrono::Utc::now().date_naive())?;
    }
    workspace(state, principal, new_name.then_some(&key.path)).await?;
    Ok(key)
}

fn meta_json(m: &FileMeta) -> Value {
    json!({
        "path": m.path.as_str(), "size_bytes": m.size_bytes, "enabled": m.enabled, "sort_order": m.sort_order,
        "version": m.version, "updated_at": m.updated_at, "owner": if m.user_id.is_empty() { "agent" } else { "user" },
    })
}

fn file_json(f: &WorkspaceFile) -> Value {
    json!({
        "path": f.path.as_str(), "content": f.content, "size_bytes": f.size_bytes, "enabled": f.enabled,
        "sort_order": f.sort_order, "version": f.version, "created_at": f.created_at, "updated_at": f.updated_at,
    })
}

/// Content is bounded by `MNEMO_WORKSPACE_MAX_FILE_BYTES` and holds no NUL.
fn check_text(state: &AppState, field: &'static str, text: &str) -> Result<(), ApiError> {
    if text.len() > state.workspace.max_file_bytes {
        let (max, actual) = (state.workspace.max_file_bytes, text.len());
        return Err(InvalidInput::TooLong { field, max, actual }.into());
    }
    if text.contains('\0') {
        return Err(InvalidInput::NulByte { field }.into());
    }
    Ok(())
}

/// `GET /v1/workspace/files?prefix=&cursor=&limit=`: the live files, by sort order, a page at a
/// time (1,000 unless `limit` says fewer); `next_cursor` is null on the last page.
pub async fn list(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    RawQuery(query): RawQuery,
) -> Result<Json<Value>, ApiError> {
    let (mut prefix, mut cursor, mut limit) = (String::new(), None, MAX_PAGE);
    for pair in query_params(query.as_deref())? {
        match pair {
            ("prefix", raw) => {
                prefix = percent_decode(raw).ok_or(ApiError::InvalidField {
                    field: "prefix",
                    expected: "a percent-encoded UTF-8 path prefix",
                })?;
                if prefix.contains('\0') {
                    return Err(InvalidInput::NulByte { field: "prefix" }.into());
                }
            }
            ("cursor", raw) => cursor = Some(parse_file_cursor(raw)?),
            ("limit", raw) => limit = page_limit(raw)?,
            (other, _) => return Err(ApiError::unknown_field(other)),
        }
    }
    let workspace = workspace(&state, &principal, None).await?;
    let mut files = state.store.list_files(&workspace, &prefix, cursor.as_ref(), limit as i64 + 1).await?;
    let more = files.len() > limit;
    files.truncate(limit);
    let next = more.then(|| files.last().map(format_file_cursor)).flatten();
    Ok(Json(json!({ "files": files.iter().map(meta_json).collect::<Vec<_>>(), "next_cursor": next })))
}

/// Cursors are opaque to clients: the last file's sort order and its path in hexadecimal (a
/// path may hold any character but NUL).
fn format_file_cursor(f: &FileMeta) -> String {
    let hex: String = f.path.as_str().bytes().map(|b| format!("{b:02x}")).collect();
    format!("{}_{hex}", f.sort_order)
}

fn parse_file_cursor(raw: &str) -> Result<(i32, String), ApiError> {
    let invalid = || ApiError::InvalidField { field: "cursor", expected: "a cursor from an earlier page" };
    let (order, hex) = raw.split_once('_').ok_or_else(invalid)?;
    let digits = order.strip_prefix('-').unwrap_or(order);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid());
    }
    let order = order.parse::<i32>().map_err(|_| invalid())?;
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| hex.as_bytes().get(i..i + 2).and_then(hex_byte))
        .collect::<Option<Vec<u8>>>()
        .ok_or_else(invalid)?;
    let path = String::from_utf8(bytes).map_err(|_| invalid())?;
    // No path holds NUL, and the database refuses it in text.
    if path.contains('\0') {
        return Err(invalid());
    }
    Ok((order, path))
}

/// `GET /v1/workspace/files/{path}`.
pub async fn read(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    PathPart(path): PathPart,
) -> Result<Json<Value>, ApiError> {
    not_edit(&path)?;
    let key = file_key(&state, &principal, &path).await?;
    let file = state.store.read_file(&key).await?.ok_or(ApiError::NotFound)?;
    Ok(Json(file_json(&file)))
}

/// `PUT /v1/workspace/files/{path}` `{content, expected_version?}`: replaces the whole file (201
/// when it is new); with `expected_version`, only while the file is at that version (0: absent),
/// else 409 `file_changed`.
pub async fn write(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    PathPart(path): PathPart,
    mut body: JsonObject,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    not_edit(&path)?;
    let content = body.take_opt_str("content")?.ok_or(ApiError::MissingField("content"))?;
    let expected =
        match body.take_opt_i64("expected_version")? {
            None => None,
            Some(v) => Some(i32::try_from(v).ok().filter(|v| *v >= 0).ok_or(ApiError::InvalidField {
                field: "expected_version",
                expected: "a version number: 0 or more",
            })?),
        };
    body.finish()?;
    check_text(&state, "content", &content)?;
    let key = writable_key(&state, &principal, &path, true).await?;
    let (status, result, version) = match state.store.write_file(&key, &content, ACTOR, expected).await? {
        Written::Created { version } => (StatusCode::CREATED, "created", version),
        Written::Overwritten { version } => (StatusCode::OK, "overwritten", version),
    };
    let answer =
        json!({ "path": key.path.as_str(), "result": result, "bytes_written": content.len(), "version": version });
    Ok((status, Json(answer)))
}

/// `POST /v1/workspace/files/{path}/edit` `{old_text, new_text, replace_all?}`: exact
/// find-and-replace; 409 when the text is not there, or is there more than once without
/// `replace_all`.
pub async fn edit(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    PathPart(path): PathPart,
    mut body: JsonObject,
) -> Result<Json<Value>, ApiError> {
    // `POST /v1/workspace/files/{path}` is a file's route with a method it lacks.
    let path = path.strip_suffix("/edit").ok_or(ApiError::MethodNotAllowed(Some(FILE_METHODS)))?;
    let old = body.take_str("old_text")?;
    let new = body.take_opt_str("new_text")?.ok_or(ApiError::MissingField("new_text"))?;
    let replace_all = body.take_opt_bool("replace_all")?.unwrap_or(false);
    body.finish()?;
    if old.is_empty() {
        return Err(InvalidInput::Empty { field: "old_text" }.into());
    }
    // Both checked before the core files are made: text no file can hold is refused unwritten.
    check_text(&state, "old_text", &old)?;
    check_text(&state, "new_text", &new)?;
    let key = writable_key(&state, &principal, path, false).await?;
    let max = state.workspace.max_file_bytes;
    match state.store.edit_file(&key, &old, &new, replace_all, max, ACTOR).await? {
        Edited::Replaced { count, version } => {
            Ok(Json(json!({ "path": key.path.as_str(), "replaced": count, "version": version })))
        }
        Edited::NoSuchFile => Err(ApiError::NotFound),
        Edited::TextNotFound => Err(ApiError::EditTextNotFound),
        Edited::Ambiguous { count } => Err(ApiError::EditTextAmbiguous(count)),
        Edited::TooLarge { bytes } => Err(InvalidInput::TooLong { field: "content", max, actual: bytes }.into()),
    }
}

/// `PATCH /v1/workspace/files/{path}` `{enabled?, sort_order?}`.
pub async fn patch(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    PathPart(path): PathPart,
    mut body: JsonObject,
) -> Result<Json<Value>, ApiError> {
    not_edit(&path)?;
    let enabled = body.take_opt_bool("enabled")?;
    let sort_order = match body.take_opt_i64("sort_order")? {
        Some(n) if !SORT_ORDERS.contains(&n) => {
            let (min, max) = (*SORT_ORDERS.start(), *SORT_ORDERS.end());
            return Err(InvalidInput::OutOfRange { field: "sort_order", min, max }.into());
        }
        n => n.map(|n| n as i32),
    };
    body.finish()?;
    if enabled.is_none() && sort_order.is_none() {
        return Err(ApiError::MissingField("enabled (or sort_order)"));
    }
    let key = writable_key(&state, &principal, &path, false).await?;
    let file = state.store.patch_file(&key, enabled, sort_order, ACTOR).await?.ok_or(ApiError::NotFound)?;
    let mut answer = file_json(&file);
    answer.as_object_mut().map(|o| o.remove("content"));
    Ok(Json(answer))
}

/// `DELETE /v1/workspace/files/{path}`: soft; its versions stay and the runbook restores them.
pub async fn delete(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    PathPart(path): PathPart,
) -> Result<Json<Value>, ApiError> {
    not_edit(&path)?;
    let key = writable_key(&state, &principal, &path, false).await?;
    let version = state.store.delete_file(&key, ACTOR).await?.ok_or(ApiError::NotFound)?;
    Ok(Json(json!({ "path": key.path.as_str(), "deleted": true, "version": version })))
}

/// `GET /v1/workspace/prompt?max_tokens=`: the enabled files in sort order as `--- NAME ---`
/// blocks and the memory sections, within the budget (default
/// `MNEMO_WORKSPACE_PROMPT_MAX_TOKENS`).
pub async fn prompt(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    RawQuery(query): RawQuery,
) -> Result<Json<Value>, ApiError> {
    let mut budget = state.workspace.prompt_max_tokens;
    for pair in query_params(query.as_deref())? {
        match pair {
            ("max_tokens", raw) => {
                budget = query_number("max_tokens", raw, 1..=1_000_000, "a whole number from 1 to 1000000")?
            }
            (other, _) => return Err(ApiError::unknown_field(other)),
        }
    }
    let workspace = workspace(&state, &principal, None).await?;
    let (parts, _) = workspace_prompt(&state, &workspace, budget).await?;
    let prompt = parts.joined();
    let tokens = state.tokenizer.count(&prompt);
    Ok(Json(json!({ "prompt": prompt, "files": parts.files, "memory": parts.memory, "tokens": tokens })))
}

/// The workspace's part of a prompt within `budget` tokens: the enabled files, then the memory
/// sections (MEMORY.md if enabled, today's note and the notes of the days before it, by the
/// tenant's time zone). What `/prompt` answers, and what a context window places after the
/// system prompt (the files as system content, the memory as a marked user message). With the
/// notes the memory part places by rule, and whether they fit uncut.
pub async fn workspace_prompt(
    state: &AppState,
    workspace: &Workspace,
    budget: u64,
) -> Result<(WorkspacePrompt, PlacedNotes), ApiError> {
    let (_, today) = state.store.tenant_today(&workspace.tenant).await?;
    let since = today - chrono::Days::new(u64::from(state.workspace.recent_days));
    let files = state.store.enabled_files(workspace).await?;
    let notes = state.store.daily_notes(workspace, since, today).await?;
    let memory = MemoryNotes {
        long_term: files.iter().find(|f| f.path.as_str() == "MEMORY.md").map(|f| f.content.as_str()),
        today: notes.iter().find(|(day, _)| *day == today).map(|(_, text)| text.as_str()),
        recent: notes.iter().filter(|(day, _)| *day < today).map(|(day, text)| (*day, text.as_str())).collect(),
    };
    let files: Vec<PromptFile<'_>> =
        files.iter().map(|f| PromptFile { path: f.path.as_str(), content: &f.content }).collect();
    let memory_md_disabled = memory.long_term.is_none();
    let prompt = render_prompt(&files, &memory, budget, state.tokenizer.as_ref());
    let placed = PlacedNotes { since, until: today, whole: prompt.notes_whole, memory_md_disabled };
    Ok((prompt, placed))
}

/// The byte two hex digits spell: digits only, as from_str_radix alone also takes a sign ("+A").
fn hex_byte(pair: &[u8]) -> Option<u8> {
    let digits = std::str::from_utf8(pair).ok().filter(|h| h.len() == 2 && h.bytes().all(|b| b.is_ascii_hexdigit()))?;
    u8::from_str_radix(digits, 16).ok()
}

/// `%XX` escapes and `+` decoded; `None` for invalid escapes or UTF-8.
fn percent_decode(raw: &str) -> Option<String> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                out.push(bytes.get(i + 1..i + 3).and_then(hex_byte)?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// `POST /v1/agents/{agent}/consolidate`: consolidate the token's user's daily notes into
/// MEMORY.md now (one run at a time per agent and user; the job queues behind a running one).
pub async fn consolidate(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    PathPart(agent): PathPart,
    body: JsonObject,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    body.finish()?;
    let workspace = Workspace::of(&principal)?;
    if workspace.agent.as_str() != agent {
        return Err(ScopeError::AgentMismatch.into());
    }
    if workspace.user.is_none() {
        return Err(ScopeError::WorkspaceNeedsUser.into());
    }
    if !state.workspace.consolidation.enabled {
        return Ok((StatusCode::ACCEPTED, Json(json!({ "queued": false, "skipped": "disabled" }))));
    }
    let (queued, skipped) = match state.store.request_consolidation(&workspace, None).await? {
        ConsolidationRequest::Queued => (true, None),
        ConsolidationRequest::Waiting => (false, None),
        ConsolidationRequest::NoNote => (false, Some("no_daily_notes")),
    };
    Ok((StatusCode::ACCEPTED, Json(json!({ "queued": queued, "skipped": skipped }))))
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_two_hex_digits_make_an_escape() {
        assert_eq!(super::percent_decode("memory%2Fa+b%C3%A9").as_deref(), Some("memory/a bé"));
        for bad in ["%+A", "%-1", "%G0", "%4", "%"] {
            assert_eq!(super::percent_decode(bad), None, "{bad}");
        }
    }
}
