use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use mnemo_core::{
    Category, Extras, FactKey, FactScope, InvalidInput, Label, Layer, MAX_ALLOWED_ROLES, MAX_RELATIONS, MemoryText,
    Metadata, NewMemory, Origin, Principal, RecallRequest, RecallScope, Relation, RelationType, Role, SessionId,
    SourceKind, SourceRef, ToolOutputKey, ToolOutputText, Turn, TypedInput, Unit, Visibility,
};
use mnemo_recall::{MemoryPack, PackRequest, PackTopK, RecallOptions, RecalledItem, build_pack};
use mnemo_store::{MIGRATOR, Remembered, Store, StoreError};
use serde_json::json;

use crate::auth::Authenticated;
use crate::body::{JsonObject, PathPart, query_number, query_params};
use crate::{ApiError, AppState};

/// `{id, was_new}`: 201 when this write made the row, 200 when it already existed.
fn remembered(kind: SourceKind, r: Remembered) -> Response {
    metrics::counter!("mnemo_memory_writes_total", "kind" => kind.as_str(), "was_new" => if r.was_new { "true" } else { "false" })
        .increment(1);
    let status = if r.was_new { StatusCode::CREATED } else { StatusCode::OK };
    (status, Json(json!({ "id": r.id, "was_new": r.was_new }))).into_response()
}

/// Reads `metadata` and `event_time`, which every write takes.
fn extras(body: &mut JsonObject) -> Result<Extras, ApiError> {
    let metadata = body.take_opt_object("metadata")?.map(Metadata::parse).transpose()?.unwrap_or_default();
    let event_time = body.take_opt_time("event_time")?;
    Ok(Extras { metadata, event_time })
}

/// `POST /v1/memories`: a chat message, tool output or document chunk.
pub async fn remember(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    body: JsonObject,
) -> Result<Response, ApiError> {
    let memory = memory_from(&state, &principal, body)?;
    Ok(remembered(memory.kind, state.writes.remember(memory).await?))
}

/// The row a `POST /v1/memories` body (or one item of a batch) asks for, checked.
fn memory_from(state: &AppState, principal: &Principal, mut body: JsonObject) -> Result<NewMemory, ApiError> {
    let kind = SourceKind::parse(&body.take_str("source_kind")?)?;
    let source_ref = SourceRef::parse(&body.take_str("source_ref")?)?;
    let content = body.take_str("content")?;
    let session = body.take_opt_str("session_id")?.as_deref().map(SessionId::parse).transpose()?;
    let extras = extras(&mut body)?;
    let conversational = matches!(kind, SourceKind::ChatMessage | SourceKind::ToolOutput);
    // The body's schema lists these for every kind: on a document chunk they are a field this
    // kind does not take, not one the endpoint does not know.
    let role = body.take_opt_str("role")?.as_deref().map(Role::parse).transpose()?;
    let (tool_call_id, tool_name) = (body.take_opt_str("tool_call_id")?, body.take_opt_str("name")?);
    if !conversational {
        let given = [("role", role.is_some()), ("tool_call_id", tool_call_id.is_some()), ("name", tool_name.is_some())];
        if let Some((field, _)) = given.into_iter().find(|(_, given)| *given) {
            return Err(ApiError::InvalidField {
                field,
                expected: "absent: only a chat message or a tool output takes it",
            });
        }
    }
    body.finish()?;
    // A session's messages are ordered, compacted and kept by their time: one dated ahead would
    // stay its newest message and outlive its retention. A client's clock may run a little ahead.
    if conversational && extras.event_time.is_some_and(|t| t > chrono::Utc::now() + chrono::TimeDelta::days(1)) {
        return Err(ApiError::InvalidField {
            field: "event_time",
            expected: "a time at most a day ahead of the server's clock for a chat message or tool output",
        });
    }

    let memory = match kind {
        SourceKind::ChatMessage => {
            let role = role.unwrap_or(Role::User);
            if role == Role::Tool && tool_call_id.is_none() {
                return Err(ApiError::MissingField("tool_call_id"));
            }
            // A stored system message instructs the model unless it carries a user (see
            // `SessionMessage::to_window`): a session's token without one would pass for the service.
            if role == Role::System && principal.user.is_none() && !principal.is_service() {
                return Err(mnemo_core::ScopeError::SystemMessageNeedsUser.into());
            }
            let content = MemoryText::parse(&content)?;
            let turn = Turn::parse(
                role,
                tool_call_id.as_deref(),
                tool_name.as_deref(),
                state.tokenizer.count(content.as_str()),
                state.tokenizer.name(),
            )?;
            NewMemory::chat_message(principal, source_ref, content, session, extras)?.with_turn(turn)
        }
        SourceKind::ToolOutput => {
            // A tool output answers the call its source_ref names; it is a tool message.
            if role.is_some_and(|r| r != Role::Tool) {
                return Err(mnemo_core::InvalidInput::UnknownValue {
                    field: "role",
                    value: role.map(|r| r.to_string()).unwrap_or_default(),
                    expected: "tool (a tool output is a tool result)",
                }
                .into());
            }
            let call = match tool_call_id {
                Some(id) => id,
                None if source_ref.as_str().len() > Turn::MAX_ID_BYTES => {
                    return Err(ApiError::InvalidField {
                        field: "source_ref",
                        expected: "at most 256 bytes on a tool output without a tool_call_id: it names the call answered",
                    });
                }
                None => source_ref.as_str().to_owned(),
            };
            let output = ToolOutputText::parse(&content, state.max_tool_output_bytes)?;
            let row = NewMemory::tool_output(principal, source_ref, output, session, extras)?;
            let turn = Turn::parse(
                Role::Tool,
                Some(&call),
                tool_name.as_deref(),
                state.tokenizer.count(row.content.as_str()),
                state.tokenizer.name(),
            )?;
            row.with_turn(turn)
        }
        SourceKind::DocumentChunk => {
            NewMemory::document_chunk(principal, source_ref, MemoryText::parse(&content)?, session, extras)?
        }
        SourceKind::Fact | SourceKind::SessionSummary | SourceKind::WorkspaceNote => {
            return Err(mnemo_core::InvalidInput::UnknownValue {
                field: "source_kind",
                value: kind.to_string(),
                expected: "chat_message tool_output document_chunk (facts go to POST /v1/facts, notes to the workspace)",
            }
            .into());
        }
    };
    Ok(memory)
}

/// `POST /v1/facts`: a fact about the token's user or agent.
pub async fn remember_fact(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    body: JsonObject,
) -> Result<Response, ApiError> {
    let memory = fact_from(&principal, body)?;
    Ok(remembered(SourceKind::Fact, state.writes.remember(memory).await?))
}

/// The fact a `POST /v1/facts` body (or one item of a batch) asks for, checked.
fn fact_from(principal: &Principal, mut body: JsonObject) -> Result<NewMemory, ApiError> {
    let content = MemoryText::parse(&body.take_str("content")?)?;
    let scope = FactScope::parse(&body.take_str("scope")?)?;
    let key = body.take_opt_str("key")?.as_deref().map(FactKey::parse).transpose()?;
    let extras = extras(&mut body)?;
    let typed = typed_input(&mut body)?;
    let origin = match body.take_opt_str("source")?.as_deref().map(Origin::parse).transpose()? {
        None => Origin::Api,
        Some(origin @ (Origin::Api | Origin::User)) => origin,
        Some(other) => {
            return Err(InvalidInput::UnknownValue {
                field: "source",
                value: other.to_string(),
                expected: "user api (extraction and consolidation are mnemo's own)",
            }
            .into());
        }
    };
    body.finish()?;

    Ok(NewMemory::fact(principal, scope, content, key, extras)?
        .with_typed(typed, origin)?
        .check_writer_reads(principal)?)
}

/// `POST /v1/memories/batch`: many `POST /v1/memories` bodies in one transaction.
pub async fn remember_batch(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    body: JsonObject,
) -> Result<Response, ApiError> {
    batch(&state, body, |item| memory_from(&state, &principal, item)).await
}

/// `POST /v1/facts/batch`: many `POST /v1/facts` bodies in one transaction.
pub async fn remember_fact_batch(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    body: JsonObject,
) -> Result<Response, ApiError> {
    batch(&state, body, |item| fact_from(&principal, item)).await
}

/// `{items, atomic?}`: each item checked as its single endpoint checks it, the valid ones written
/// in one transaction. Answers one result per item, in order: `{id, was_new}` or that item's
/// `{error: {code, message}}`. With `atomic`, one bad item writes nothing: 400 `batch_rejected`
/// with the results.
async fn batch(
    state: &AppState,
    mut body: JsonObject,
    parse: impl Fn(JsonObject) -> Result<NewMemory, ApiError>,
) -> Result<Response, ApiError> {
    let items = body.take_opt_list("items")?.ok_or(ApiError::MissingField("items"))?;
    let atomic = body.take_opt_bool("atomic")?.unwrap_or(false);
    body.finish()?;
    if !(1..=state.max_batch_items).contains(&items.len()) {
        let max = state.max_batch_items as i64;
        return Err(InvalidInput::OutOfRange { field: "items", min: 1, max }.into());
    }
    // Each item's parse error, or its place among the valid rows (which move out, uncopied).
    // Parsing counts the items' tokens: many megabytes of them would hold a runtime thread.
    let bytes = items.iter().filter_map(|item| item.get("content")?.as_str()).map(str::len).sum();
    let mut valid: Vec<NewMemory> = Vec::with_capacity(items.len());
    let parsed: Vec<Result<(), ApiError>> = mnemo_models::counting(bytes, || {
        items
            .into_iter()
            .map(|item| match item {
                serde_json::Value::Object(map) => parse(JsonObject::from_map(map)).map(|row| valid.push(row)),
                _ => Err(ApiError::InvalidField { field: "items", expected: "a list of objects" }),
            })
            .collect()
    });
    let mut stored = if atomic && parsed.iter().any(Result::is_err) {
        Vec::new()
    } else if atomic {
        state.store.remember_all(&valid).await?
    } else {
        state.store.remember_many(&valid).await?
    }
    .into_iter();
    let results: Vec<Result<Remembered, ApiError>> = parsed
        .into_iter()
        .map(|p| match p {
            Err(e) => Err(e),
            Ok(_) => stored.next().unwrap_or(Err(StoreError::RolledBack)).map_err(ApiError::from),
        })
        .collect();
    let written = results.iter().filter(|r| r.as_ref().is_ok_and(|r| r.was_new)).count();
    metrics::counter!("mnemo_memory_batch_items_total", "outcome" => "written").increment(written as u64);
    let json: Vec<serde_json::Value> = results
        .iter()
        .map(|r| match r {
            Ok(r) => json!({ "id": r.id, "was_new": r.was_new }),
            Err(e) => {
                if let ApiError::Internal(detail) = e {
                    tracing::error!(error = %detail, "a batch item failed");
                }
                e.body()
            }
        })
        .collect();
    // The item that sank an atomic batch: a refused one, not one merely rolled back with it.
    let refused = results.iter().position(|r| r.as_ref().is_err_and(|e| !matches!(e, ApiError::NotWritten)));
    if atomic && let Some(index) = refused.or_else(|| results.iter().position(Result::is_err)) {
        let refused = ApiError::BatchRejected(index);
        let mut body = refused.body();
        body["results"] = json!(json);
        return Ok((refused.status(), Json(body)).into_response());
    }
    Ok(Json(json!({ "results": json, "written": written })).into_response())
}

/// The typed fields a long-term write may carry (all optional; see README, "Typed memory").
fn typed_input(body: &mut JsonObject) -> Result<TypedInput, ApiError> {
    let unit = |field, value: Option<f64>| value.map(|v| Unit::parse(field, v)).transpose();
    let relations = body.take_opt_list("relations")?.unwrap_or_default();
    if relations.len() > MAX_RELATIONS {
        return Err(InvalidInput::TooMany { field: "relations", max: MAX_RELATIONS, actual: relations.len() }.into());
    }
    let relations = relations
        .into_iter()
        .map(|value| {
            let expected = "a list of {\"type\": \"related_to\" or \"derived_from\", \"target\": memory id}";
            let serde_json::Value::Object(map) = value else {
                return Err(ApiError::InvalidField { field: "relations", expected });
            };
            let mut relation = JsonObject::from_map(map);
            let kind = RelationType::parse(&relation.take_str("type")?)?;
            let target = crate::body::uuid(&relation.take_str("target")?).ok_or(ApiError::InvalidField {
                field: "relations",
                expected: "relation targets that are memory ids (UUIDs)",
            })?;
            relation.finish()?;
            Ok(Relation { kind, target })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    Ok(TypedInput {
        layer: body.take_opt_str("layer")?.as_deref().map(Layer::parse).transpose()?,
        category: body.take_opt_str("category")?.as_deref().map(Category::parse).transpose()?,
        importance: unit("importance", body.take_opt_f64("importance")?)?,
        confidence: unit("confidence", body.take_opt_f64("confidence")?)?,
        tags: Label::tags(&body.take_opt_str_list("tags")?.unwrap_or_default())?,
        relations,
        visibility: body.take_opt_str("visibility")?.as_deref().map(Visibility::parse).transpose()?,
        allowed_roles: Label::parse_list(
            "allowed_roles",
            &body.take_opt_str_list("allowed_roles")?.unwrap_or_default(),
            MAX_ALLOWED_ROLES,
        )?,
    })
}

/// `DELETE /v1/memories/{id}`: soft-deletes a row of the caller's tenant. A user's token deletes
/// only rows carrying its user (bound to a session, of the rows of sessions only its session's,
/// as it reads them; a session's summary only when it summarized their words alone, for it
/// holds everyone's words in the session); a token
/// bound to a session without a user, only rows of that session; a service token (no `sub`, no
/// `sid`) any row of its tenant. Anything else is 404, as if the row did not exist. Deleting
/// twice answers the first deletion.
pub async fn forget(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    PathPart(id): PathPart,
) -> Result<Response, ApiError> {
    let id = crate::body::uuid(&id).ok_or(ApiError::InvalidField { field: "id", expected: "a UUID" })?;
    let (only_session, requested_by) = match (&principal.user, &principal.session) {
        (Some(_), session) => (session.as_ref(), "user"),
        (None, Some(session)) => (Some(session), "session"),
        (None, None) => (None, "service"),
    };
    let deleted = state
        .store
        .soft_delete(&principal.tenant, id, principal.user.as_ref(), only_session, &principal.roles, requested_by)
        .await?
        .ok_or(ApiError::NotFound)?;
    metrics::counter!("mnemo_memory_deletes_total", "already" => if deleted.already { "true" } else { "false" })
        .increment(1);
    let body = json!({
        "id": deleted.id,
        "deleted_at": deleted.deleted_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, false),
        "already_deleted": deleted.already,
    });
    Ok(Json(body).into_response())
}

/// `POST /v1/recall`: hybrid search over the classes the token may see.
pub async fn recall(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    mut body: JsonObject,
) -> Result<Response, ApiError> {
    let mut request = RecallRequest::new(&body.take_str("query")?)?;
    if let Some(top_k) = body.take_opt_usize("top_k")? {
        request = request.top_k(top_k)?;
    }
    if let Some(kinds) = body.take_opt_str_list("source_kinds")? {
        // An empty list would read as "every kind", a filter that came out empty as no filter.
        if kinds.is_empty() {
            return Err(ApiError::InvalidField {
                field: "source_kinds",
                expected: "at least one source kind (leave it out for every kind)",
            });
        }
        let kinds = kinds.iter().map(|k| SourceKind::parse(k)).collect::<Result<Vec<_>, _>>()?;
        request = request.source_kinds(kinds);
    }
    if let Some(scope) = body.take_opt_str("scope")? {
        request = request.scope(RecallScope::parse(&scope)?);
    }
    if let Some(enable) = body.take_opt_bool("enable_rerank")? {
        request = request.enable_rerank(enable);
    }
    body.finish()?;

    let recalled = state.recall.recall(&principal, &request).await?;
    let items: Vec<_> = recalled.items.iter().map(recalled_item).collect();
    let body = json!({
        "total": items.len(),
        "items": items,
        "degraded": recalled.degraded,
        "rerank_used": recalled.rerank_used,
    });
    Ok(Json(body).into_response())
}

/// One recalled item as the API answers it (the runbook prints the same shape).
pub fn recalled_item(item: &RecalledItem) -> serde_json::Value {
    json!({
        "id": item.id,
        "source_kind": item.source_kind.as_str(),
        "source_ref": item.source_ref,
        "content": item.content,
        "event_time": item.event_time.to_rfc3339_opts(chrono::SecondsFormat::Micros, false),
        "layer": item.layer.as_str(),
        "score": item.score,
    })
}

/// `POST /v1/memory-pack`: the memories most relevant to `query`, per layer, within token
/// budgets, rendered under `# Memory`, with what each layer cost and what was left out.
pub async fn memory_pack(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    mut body: JsonObject,
) -> Result<Response, ApiError> {
    let query = RecallRequest::new(&body.take_str("query")?)?.query;
    let request = pack_request(&mut body, query)?;
    body.finish()?;
    let pack =
        build_pack(&state.recall, state.tokenizer.as_ref(), &principal, &request, &RecallOptions::default()).await?;
    Ok(Json(pack_json(&pack, &request)).into_response())
}

/// A pack's budgets and per-layer limits from a body (the pack endpoint's, or the context
/// call's `memory_pack`), over golemcore's defaults.
pub fn pack_request(body: &mut JsonObject, query: String) -> Result<PackRequest, ApiError> {
    let mut budget = |field| -> Result<Option<u32>, ApiError> {
        let Some(value) = body.take_opt_usize(field)? else { return Ok(None) };
        let max = PackRequest::MAX_BUDGET;
        match u32::try_from(value) {
            Ok(value) if (1..=max).contains(&value) => Ok(Some(value)),
            _ => Err(InvalidInput::OutOfRange { field, min: 1, max: i64::from(max) }.into()),
        }
    };
    let (soft, max) = (budget("soft_budget_tokens")?, budget("max_budget_tokens")?);
    // A budget given alone bounds the other's default.
    let soft = soft.unwrap_or(PackRequest::DEFAULT_SOFT_BUDGET.min(max.unwrap_or(u32::MAX)));
    let max = max.unwrap_or(PackRequest::DEFAULT_MAX_BUDGET.max(soft));
    if max < soft {
        return Err(InvalidInput::OutOfRange {
            field: "max_budget_tokens",
            min: i64::from(soft),
            max: i64::from(PackRequest::MAX_BUDGET),
        }
        .into());
    }
    let mut top_k = PackTopK::default();
    if let Some(raw) = body.take_opt_object("top_k")? {
        let serde_json::Value::Object(map) = raw else { unreachable!("take_opt_object returns objects") };
        let mut layers = JsonObject::from_map(map);
        for (field, slot) in [
            ("working", &mut top_k.working),
            ("episodic", &mut top_k.episodic),
            ("semantic", &mut top_k.semantic),
            ("procedural", &mut top_k.procedural),
        ] {
            if let Some(k) = layers.take_opt_usize(field)? {
                if k > PackTopK::MAX {
                    return Err(InvalidInput::OutOfRange { field: "top_k", min: 0, max: PackTopK::MAX as i64 }.into());
                }
                *slot = k;
            }
        }
        layers.finish()?;
    }
    Ok(PackRequest { query, soft_budget_tokens: soft, max_budget_tokens: max, top_k, placed_notes: None })
}

pub fn pack_json(pack: &MemoryPack, request: &PackRequest) -> serde_json::Value {
    let items: Vec<_> = pack
        .items
        .iter()
        .map(|p| {
            let mut item = recalled_item(&p.item);
            item["pack_layer"] = json!(p.layer.as_str());
            item["tokens"] = json!(p.tokens);
            item["past_soft_budget"] = json!(p.past_soft_budget);
            item
        })
        .collect();
    let layers: serde_json::Map<String, serde_json::Value> = pack
        .layers
        .iter()
        .map(|u| {
            (
                u.layer.as_str().to_owned(),
                json!({
                    "items": u.items,
                    "tokens": u.tokens,
                    "candidates": u.candidates,
                    "dropped_by_budget": u.dropped_by_budget,
                    "dropped_by_top_k": u.dropped_by_top_k,
                }),
            )
        })
        .collect();
    json!({
        "rendered": pack.rendered,
        "items": items,
        "diagnostics": {
            "tokens": pack.tokens,
            "soft_phase_tokens": pack.soft_tokens,
            "soft_budget_tokens": request.soft_budget_tokens,
            "max_budget_tokens": request.max_budget_tokens,
            "layers": layers,
            "degraded": pack.degraded,
        },
    })
}

/// `GET /v1/tool-outputs/{key}`: the full payload, to whoever may read its row (README,
/// "Access control").
pub async fn tool_output(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    PathPart(key): PathPart,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let (mut offset, mut max_bytes) = (0, usize::MAX);
    for pair in query_params(query.as_deref())? {
        match pair {
            ("offset", raw) => offset = query_number("offset", raw, 0..=usize::MAX, "a whole number of bytes")?,
            ("max_bytes", raw) => {
                max_bytes = query_number("max_bytes", raw, 1..=usize::MAX, "a whole number of bytes from 1")?
            }
            (other, _) => return Err(ApiError::unknown_field(other)),
        }
    }
    let key = ToolOutputKey::parse(&key).ok_or(ApiError::NotFound)?;
    let store = state.reads.complete().await;
    // A character is at most 4 bytes: enough to find where the page's last one ends, or to
    // take one whole character longer than max_bytes.
    let window = store.tool_output_window(&principal, &key, offset, max_bytes.saturating_add(4)).await?;
    let window = window.ok_or(ApiError::NotFound)?;
    let (content, next_offset) =
        page(&window.bytes, offset, window.total_bytes, max_bytes).ok_or(ApiError::InvalidField {
            field: "offset",
            expected: "0, a next_offset from an earlier answer, or the output's total_bytes",
        })?;
    let body = json!({
        "key": window.key.as_str(), "item_id": window.item_id, "content": content,
        "offset": offset, "total_bytes": window.total_bytes, "next_offset": next_offset,
    });
    Ok(Json(body).into_response())
}

/// At most `max_bytes` of a text from byte `offset`, cut at a character's start (one whole
/// character when it alone is longer), and where the rest starts if any is left; `None` when
/// `offset` is past the end or inside a character. `window` is the text's bytes from `offset`:
/// `max_bytes` + 4 of them, or all that are left; `total` is the text's length.
fn page(window: &[u8], offset: usize, total: usize, max_bytes: usize) -> Option<(&str, Option<usize>)> {
    // A UTF-8 continuation byte is 0b10xxxxxx; any other byte starts a character.
    let starts_char = |i: usize| window.get(i).is_none_or(|b| b & 0xC0 != 0x80);
    if offset > total || !starts_char(0) {
        return None;
    }
    let mut end = window.len().min(max_bytes);
    while !starts_char(end) {
        end -= 1;
    }
    if end == 0 {
        end = (1..window.len()).find(|&i| starts_char(i)).unwrap_or(window.len());
    }
    let content = std::str::from_utf8(&window[..end]).ok()?;
    Some((content, (offset + end < total).then_some(offset + end)))
}

/// `GET /healthz`: the process is up.
pub async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

/// How long a readiness answer is kept. The probe needs no token, so a flood of it must not
/// take the pool's connections: callers take turns, and within this time get the last answer.
const READINESS_KEPT: Duration = Duration::from_secs(1);

/// `GET /readyz`: the database answers and its schema is the one this build expects.
pub async fn readyz(State(state): State<AppState>) -> Result<Json<serde_json::Value>, ApiError> {
    let mut last = state.readiness.lock().await;
    let answer = match last.as_ref().filter(|(at, _)| at.elapsed() < READINESS_KEPT) {
        Some((_, answer)) => answer.clone(),
        None => {
            let answer = readiness(&state.store).await;
            *last = Some((Instant::now(), answer.clone()));
            answer
        }
    };
    drop(last);
    let schema = answer.map_err(ApiError::NotReady)?;
    Ok(Json(json!({ "status": "ready", "schema": schema })))
}

/// Whether the schema is this build's (`current`) or a newer build's (`newer`), or why the API
/// is not ready. A newer schema is the middle of an upgrade (migrate, then deploy): this build
/// stays ready on it, or no server would be until the new ones start.
async fn readiness(store: &Store) -> Result<&'static str, String> {
    store.ping().await.map_err(|e| {
        tracing::warn!(error = %e, "readiness: database unreachable");
        "database unreachable".to_owned()
    })?;
    let schema = MIGRATOR.status(store.pool()).await.map_err(|e| {
        tracing::warn!(error = %e, "readiness: cannot read the applied migrations");
        "cannot read the applied migrations".to_owned()
    })?;
    if !schema.pending.is_empty() {
        return Err(format!("{} migrations pending: run `mnemo-runbook migrate`", schema.pending.len()));
    }
    if !schema.unknown.is_empty() {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| tracing::warn!("the database was migrated by a newer mnemo: deploy it"));
        return Ok("newer");
    }
    Ok("current")
}

/// `GET /metrics`: Prometheus text.
pub async fn metrics(State(state): State<AppState>) -> Response {
    ([("content-type", "text/plain; version=0.0.4")], state.metrics.render()).into_response()
}

#[cfg(test)]
mod tests {
    use super::page;

    /// A page as the handler reads it: the window the database cuts, then [`page`].
    fn byte_range(text: &str, offset: usize, max_bytes: usize) -> Option<(&str, Option<usize>)> {
        let bytes = text.as_bytes();
        let window = &bytes[offset.min(bytes.len())..offset.saturating_add(max_bytes + 4).min(bytes.len())];
        page(window, offset, bytes.len(), max_bytes)
    }

    #[test]
    fn pages_of_a_tool_output_are_cut_between_characters_and_join_to_the_whole() {
        let text = "aé€😀b"; // characters of 1, 2, 3, 4 and 1 bytes
        for max_bytes in 1..=12 {
            let (mut offset, mut joined) = (0, String::new());
            loop {
                let (page, next) = byte_range(text, offset, max_bytes).expect("a page");
                assert!(!page.is_empty() && (page.len() <= max_bytes || page.chars().count() == 1), "{page:?}");
                joined.push_str(page);
                match next {
                    Some(next) => offset = next,
                    None => break,
                }
            }
            assert_eq!(joined, text, "max_bytes {max_bytes}");
        }
        assert_eq!(byte_range(text, 2, 10), None, "inside é");
        assert_eq!(byte_range(text, text.len(), 10), Some(("", None)));
        assert_eq!(byte_range(text, text.len() + 1, 10), None);
    }
}
