//! A session's conversation over HTTP: its messages in order (`GET /v1/sessions/{sid}/messages`)
//! and the context window for the next model call (`POST /v1/sessions/{sid}/context`), which
//! always fits the caller's budget and never waits for a chat model (a memory pack's query is
//! embedded as recall's is, within recall's wait).

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use std::time::Duration;

use mnemo_core::{
    AskerCounter, CompactionTrigger, DEFAULT_TOOL_NAME, InvalidInput, Keep, MAX_COMPACTION_MESSAGES, MEMORY_PREFIX,
    MESSAGE_OVERHEAD_TOKENS, MIN_PART_TOKENS, Placed, Principal, RecallRequest, Role, ScopeError, Section, SessionId,
    TokenCounter, TriggerSource, Window, WindowError, WindowInput, WindowMessage, Workspace, assemble, compaction_cut,
    history_room, tail_suffices,
};
use mnemo_recall::{PackRequest, RecallOptions, build_pack};
use mnemo_store::{MessageCursor, PendingCompaction, SessionMessage, SessionState, spoken_by};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::auth::Authenticated;
use crate::body::{JsonObject, PathPart, page_limit, query_params};
use crate::{ApiError, AppState};

/// The messages one page returns unless asked for another number.
const DEFAULT_PAGE: usize = 100;
/// The most history one context call reads; a longer session needs compaction to be complete.
const MAX_HISTORY: usize = 100_000;
/// The newest messages of a session the extraction gates read: at least twice the most
/// `MNEMO_EXTRACT_MIN_MESSAGES` may ask for.
const GATE_MESSAGES: i64 = 2 * mnemo_config::MAX_EXTRACT_MIN_MESSAGES as i64;
/// Budgets a context call accepts: below the smallest nothing useful fits; the largest is past
/// any model's window, so a larger one is a mistake.
const MIN_INPUT_TOKENS: i64 = 64;
const MAX_INPUT_TOKENS: i64 = 10_000_000;
const DEFAULT_INPUT_TOKENS: i64 = 128_000;
/// The fewest tokens a compaction keeps verbatim at one call's asking, however small its budget:
/// a call with a small budget (a router model's) trims its own window each time, and must not
/// fold into the summary for good what the session's calls with larger budgets still show.
const MIN_KEEP_AT_MOST: u64 = 1_024;

/// The query a message asks a memory pack with: its end (a paste's question is usually there),
/// as much as a query holds, cut at a character boundary, without the NUL bytes a query may not
/// hold; `None` when nothing but whitespace is left.
fn message_query(message: &str) -> Option<String> {
    let end = &message[message.ceil_char_boundary(message.len().saturating_sub(mnemo_core::MAX_QUERY_BYTES))..];
    let query = end.replace('\0', " ");
    (!query.trim().is_empty()).then_some(query)
}

/// A memory pack a context call asks for.
enum AskedPack {
    Pack(PackRequest),
    /// Asked for `current_message`, which holds nothing to ask with (empty or whitespace).
    NoQuery,
}

/// A session's rows are read by a token bound to that session, or by a service token (no user,
/// no session) of the tenant.
fn session_for(principal: &Principal, raw: &str) -> Result<SessionId, ApiError> {
    let session = SessionId::parse(raw)?;
    match (&principal.session, &principal.user) {
        (Some(bound), _) if *bound == session => Ok(session),
        (None, None) => Ok(session),
        _ => Err(ScopeError::SessionMismatch.into()),
    }
}

/// `GET /v1/sessions/{sid}/messages?cursor=…&limit=…`: the session's messages in order, a page
/// at a time; `next_cursor` is null on the last page.
pub async fn messages(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    PathPart(sid): PathPart,
    RawQuery(query): RawQuery,
) -> Result<Json<Value>, ApiError> {
    let session = session_for(&principal, &sid)?;
    let (mut cursor, mut limit) = (None, DEFAULT_PAGE);
    for pair in query_params(query.as_deref())? {
        match pair {
            ("cursor", raw) => cursor = Some(parse_cursor(raw)?),
            ("limit", raw) => limit = page_limit(raw)?,
            (other, _) => return Err(ApiError::unknown_field(other)),
        }
    }
    let rows = state.store.session_messages(&principal.tenant, &session, cursor, limit as i64 + 1).await?;
    let more = rows.len() > limit;
    let page = &rows[..rows.len().min(limit)];
    let next = more.then(|| page.last().map(|m| format_cursor(m.cursor()))).flatten();
    let messages: Vec<Value> = page.iter().map(message_json).collect();
    Ok(Json(json!({ "messages": messages, "next_cursor": next })))
}

fn message_json(m: &SessionMessage) -> Value {
    json!({
        "id": m.id,
        "source_kind": m.source_kind.as_str(),
        "role": m.role.as_str(),
        "content": m.content,
        "tool_call_id": m.tool_call_id,
        "name": m.tool_name,
        "token_count": m.token_count,
        "event_time": m.event_time,
    })
}

/// Cursors are opaque to clients: the last message's event time (µs) and id.
fn format_cursor(c: MessageCursor) -> String {
    format!("{}_{}", c.event_time.timestamp_micros(), c.id.simple())
}

/// PostgreSQL's earliest time (4714-11-24 BC), in µs from the Unix epoch: a cursor before it
/// names no message, and the database would refuse it.
const EARLIEST_MICROS: i64 = -210_866_803_200_000_000;

fn parse_cursor(raw: &str) -> Result<MessageCursor, ApiError> {
    let (micros, id) = raw.split_once('_').ok_or_else(invalid_cursor)?;
    let event_time =
        micros.parse::<i64>().ok().filter(|&m| m >= EARLIEST_MICROS).and_then(DateTime::<Utc>::from_timestamp_micros);
    match (event_time, Uuid::try_parse(id)) {
        (Some(event_time), Ok(id)) => Ok(MessageCursor { event_time, id }),
        _ => Err(invalid_cursor()),
    }
}

fn invalid_cursor() -> ApiError {
    ApiError::InvalidField { field: "cursor", expected: "a cursor from an earlier page" }
}

/// `POST /v1/sessions/{sid}/context`: the messages to send for the next model call, in the
/// OpenAI chat format, within `max_input_tokens − reserve_output_tokens`, with what it cost.
/// Never waits for a model: when a trigger fires, a `compact` job is queued and the answer is the
/// best window there is now (the previous summary and the tail that fits); `wait_ms` lets a
/// caller wait that long for the job's summary.
pub async fn context(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    PathPart(sid): PathPart,
    body: JsonObject,
) -> Result<Json<Value>, ApiError> {
    let session = session_for(&principal, &sid)?;
    let asked = ContextBody::parse(body)?;
    // Counts the system prompt, sent again at every call, once for the asker, and for it alone:
    // another user of the tenant could time whether a text was counted before.
    let asker = format!("{:?}", (&principal.tenant, &principal.user, &principal.agent, &principal.session));
    let tokenizer = &AskerCounter { counter: state.tokenizer.as_ref(), asker: &asker };
    // A blank message is not placed, as a blank system prompt is not: providers refuse an empty
    // user message.
    let current = asked.current_message.filter(|m| !m.trim().is_empty()).map(|content| WindowMessage {
        role: Role::User,
        tokens: tokenizer.count(&content),
        content,
        tool_call_id: None,
        tool_name: None,
        name_tokens: 0,
    });
    let asked_budget = u32::try_from(asked.max_input_tokens - asked.reserve_output_tokens).unwrap_or(u32::MAX);
    let pack_left_out = match &asked.memory_pack {
        None => None,
        Some(AskedPack::NoQuery) => Some("no_query"),
        Some(AskedPack::Pack(_)) => Some("no_room"),
    };
    // What the caller's own system prompt and current message leave for the workspace and the
    // memory pack (counted as the window counts them): they shrink to fit rather than refuse a
    // call that fits without them. A call that does not fit without them is refused here, before
    // anything is written (the core files below).
    let own = WindowInput {
        system_prompt: asked.system_prompt.as_deref(),
        current: current.as_ref(),
        budget: asked_budget,
        ..Default::default()
    };
    let room = history_room(&own, tokenizer).map_err(budget_too_small)?;
    // The model refused a window that fit by our count (`overflow`): it counts more than we do. A
    // quarter of the budget is left unused (at most what the system prompt and current message
    // leave), so the retry is not the same window again.
    let spare = if asked.overflow { room.min(u64::from(asked_budget / 4)) } else { 0 };
    let budget = asked_budget - u32::try_from(spare).unwrap_or(0);
    // Less the two messages' framing and the memory's marker.
    let framing = 2 * u64::from(MESSAGE_OVERHEAD_TOKENS) + u64::from(tokenizer.count(MEMORY_PREFIX)) + 1;
    let left = (room - spare).saturating_sub(framing);
    // The token's agent workspace: its enabled files and its memory, within their share.
    let workspace = match Workspace::of(&principal) {
        Ok(workspace) => {
            // Created on first use, as every workspace route does: a new user's first window
            // holds the operator's AGENTS.md.
            state.store.ensure_core_files(&workspace, &state.workspace.templates, None).await?;
            let share = state.workspace.prompt_max_tokens.min(u64::from(budget / 2)).min(left);
            Some(crate::workspace::workspace_prompt(&state, &workspace, share).await?)
        }
        Err(_) => None,
    };
    let files = workspace.as_ref().map(|(w, _)| w.files.as_str());
    let notes = workspace.as_ref().map_or("", |(w, _)| w.memory.as_str());
    // The memory pack joins the notes: both are what the agent remembers, placed as reference
    // before the conversation, in what the workspace leaves (none when too little is left).
    let placed = [files.unwrap_or(""), notes].iter().map(|text| u64::from(tokenizer.count(text)) + 2).sum::<u64>();
    let room = left.saturating_sub(placed);
    let pack = match asked.memory_pack {
        Some(AskedPack::Pack(mut pack_request)) if room >= MIN_PART_TOKENS => {
            pack_request.max_budget_tokens =
                pack_request.max_budget_tokens.min(u32::try_from(room).unwrap_or(u32::MAX));
            pack_request.soft_budget_tokens = pack_request.soft_budget_tokens.min(pack_request.max_budget_tokens);
            // MEMORY.md and the recent notes are the memory part's (or, disabled, kept out).
            pack_request.placed_notes = workspace.as_ref().map(|(_, placed)| *placed);
            // The working layer is the path's session: a service token is bound to none.
            let reader = Principal { session: Some(session.clone()), ..principal.clone() };
            Some(build_pack(&state.recall, tokenizer, &reader, &pack_request, &RecallOptions::default()).await?)
        }
        _ => None,
    };
    let memory = [notes, pack.as_ref().map_or("", |p| p.rendered.as_str())]
        .into_iter()
        .filter(|text| !text.is_empty())
        .collect::<Vec<_>>()
        .join("\n\n");
    let request = Request {
        system_prompt: asked.system_prompt.as_deref(),
        injected: files,
        memory: Some(memory.as_str()),
        current: current.as_ref(),
        budget,
        keep_turns: asked.overflow.then_some(state.context.keep_pairs),
        trigger_tokens: (state.context.trigger_ratio * f64::from(budget)) as u64,
        trigger_messages: state.context.trigger_messages,
        compaction_keeps: state.context.compaction_keeps(),
    };
    let mut session_state = state.store.session_state(&principal.tenant, &session).await?;
    let mut built = build(&state, tokenizer, &principal, &session, &session_state, &request).await?;
    let trigger = fired(&built, &request, asked.overflow, state.context.keep_pairs);
    // One request per session at a time: while one is pending (and not stale) nothing is written.
    if let Some(trigger) = trigger
        && session_state.pending.is_none_or(|p| p.is_stale())
    {
        let keeps = Some(request.compaction_keeps);
        state.store.request_compaction(&principal.tenant, &session, trigger, keeps, Some(built.keep_at_most)).await?;
        session_state.pending = Some(PendingCompaction { trigger, since: chrono::Utc::now() });
    }
    if asked.wait_ms > 0 && session_state.pending.is_some_and(|p| !p.is_stale()) {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(asked.wait_ms);
        let mut poll = WAIT_POLL;
        while tokio::time::Instant::now() < deadline {
            tokio::time::sleep(poll.min(deadline - tokio::time::Instant::now())).await;
            poll = (poll * 2).min(MAX_WAIT_POLL);
            let now = state.store.session_state(&principal.tenant, &session).await?;
            if now.through != session_state.through || now.pending.is_none() {
                built = build(&state, tokenizer, &principal, &session, &now, &request).await?;
                session_state = now;
                break;
            }
        }
    }
    metrics::histogram!("mnemo_context_tokens").record(built.window.total_tokens() as f64);
    // A stale request's job is gone: nothing is scheduled until a trigger asks again.
    let compaction = if session_state.pending.is_some_and(|p| !p.is_stale()) {
        "scheduled"
    } else if built.window.summary_used {
        "used"
    } else {
        "none"
    };
    let mut answer = window_json(&built, &session_state, request.budget, compaction, trigger);
    if let Some(pack) = &pack {
        answer["diagnostics"]["memory_pack"] = json!({
            "tokens": pack.tokens,
            "items": pack.items.iter().map(|p| json!({"id": p.id, "layer": p.layer.as_str()})).collect::<Vec<_>>(),
            "degraded": pack.degraded,
        });
    } else if let Some(reason) = pack_left_out {
        answer["diagnostics"]["memory_pack"] = json!({ "tokens": 0, "items": [], "left_out": reason });
    }
    Ok(Json(answer))
}

/// The longest a context call waits for a summary.
const MAX_WAIT_MS: u64 = 30_000;

/// A context call's body, checked.
struct ContextBody {
    max_input_tokens: i64,
    reserve_output_tokens: i64,
    system_prompt: Option<String>,
    current_message: Option<String>,
    overflow: bool,
    wait_ms: u64,
    /// A memory pack for `current_message` (or the pack's own `query`), placed after the
    /// workspace's notes, as reference.
    memory_pack: Option<AskedPack>,
}

impl ContextBody {
    fn parse(mut body: JsonObject) -> Result<Self, ApiError> {
        let tokens = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let max_input_tokens = body.take_opt_usize("max_input_tokens")?.map_or(DEFAULT_INPUT_TOKENS, tokens);
        if !(MIN_INPUT_TOKENS..=MAX_INPUT_TOKENS).contains(&max_input_tokens) {
            let (min, max) = (MIN_INPUT_TOKENS, MAX_INPUT_TOKENS);
            return Err(InvalidInput::OutOfRange { field: "max_input_tokens", min, max }.into());
        }
        let reserve_output_tokens = body.take_opt_usize("reserve_output_tokens")?.map_or(0, tokens);
        if reserve_output_tokens >= max_input_tokens {
            let max = max_input_tokens - 1;
            return Err(InvalidInput::OutOfRange { field: "reserve_output_tokens", min: 0, max }.into());
        }
        let wait_ms = body.take_opt_usize("wait_ms")?.map_or(0, |n| u64::try_from(n).unwrap_or(u64::MAX));
        if wait_ms > MAX_WAIT_MS {
            return Err(InvalidInput::OutOfRange { field: "wait_ms", min: 0, max: MAX_WAIT_MS as i64 }.into());
        }
        let current_message = body.take_opt_str("current_message")?;
        let memory_pack = match body.take_opt_value("memory_pack")? {
            None | Some(Value::Bool(false)) => None,
            Some(Value::Bool(true)) => Some(JsonObject::from_map(Default::default())),
            Some(Value::Object(map)) => Some(JsonObject::from_map(map)),
            Some(_) => {
                return Err(ApiError::InvalidField { field: "memory_pack", expected: "true, false or an object" });
            }
        };
        let memory_pack = memory_pack
            .map(|mut options| {
                // The caller never sent a query to be refused: a message is asked with as it can be
                // (`None`: it holds nothing to ask with).
                let query = match (options.take_opt_str("query")?, &current_message) {
                    (Some(query), _) => Some(RecallRequest::new(&query)?.query),
                    (None, Some(message)) => {
                        message_query(message).map(|q| RecallRequest::new(&q)).transpose()?.map(|r| r.query)
                    }
                    (None, None) => return Err(ApiError::MissingField("memory_pack.query (or current_message)")),
                };
                // The window holds the conversation already: no working memory unless asked.
                let working_given = options.nested_has("top_k", "working");
                // The options are checked even when there is nothing to ask with.
                let mut request = crate::routes::pack_request(&mut options, query.clone().unwrap_or_default())?;
                options.finish()?;
                if query.is_none() {
                    return Ok(AskedPack::NoQuery);
                }
                if !working_given {
                    request.top_k.working = 0;
                }
                // The pack takes at most a quarter of the window.
                let quarter = u32::try_from((max_input_tokens - reserve_output_tokens) / 4).unwrap_or(u32::MAX);
                request.max_budget_tokens = request.max_budget_tokens.min(quarter);
                request.soft_budget_tokens = request.soft_budget_tokens.min(request.max_budget_tokens);
                Ok::<_, ApiError>(AskedPack::Pack(request))
            })
            .transpose()?;
        let parsed = Self {
            max_input_tokens,
            reserve_output_tokens,
            system_prompt: body.take_opt_str("system_prompt")?,
            current_message,
            overflow: body.take_opt_bool("overflow")?.unwrap_or(false),
            wait_ms,
            memory_pack,
        };
        body.finish()?;
        Ok(parsed)
    }
}

/// The trigger this call fires, if any: overflow recovery always compacts; otherwise the whole
/// window past its share of the budget, or too many messages since the last compaction. A trigger
/// at 0 is off. Nothing fires when a compaction would find nothing to cover: when every message
/// since the last compaction was read, as the job's plan would cut them; otherwise when the kept
/// turns are all that was read and they fit in half the history's room (what a compaction keeps
/// at most).
fn fired(built: &Built, request: &Request<'_>, overflow: bool, keep_pairs: usize) -> Option<CompactionTrigger> {
    let turns_read = built.read.iter().filter(|m| m.role == Role::User).count();
    let more_than_kept = built.compactable.unwrap_or(
        turns_read > keep_pairs
            || (built.read.len() < built.since_compaction && turns_read == keep_pairs)
            || built.history_tokens > built.keep_at_most,
    );
    if built.since_compaction == 0 || !more_than_kept {
        None
    } else if overflow {
        Some(CompactionTrigger::Overflow)
    } else if built.history_trigger > 0 && built.history_tokens > built.history_trigger {
        Some(CompactionTrigger::Tokens)
    } else if request.trigger_messages > 0 && built.since_compaction > request.trigger_messages {
        Some(CompactionTrigger::Messages)
    } else {
        None
    }
}
/// How often a waiting context call looks for the summary: soon at first (a compaction without
/// a model takes milliseconds), then less often.
const WAIT_POLL: Duration = Duration::from_millis(20);
const MAX_WAIT_POLL: Duration = Duration::from_millis(250);

/// What a context call asks for.
struct Request<'a> {
    system_prompt: Option<&'a str>,
    /// The agent's enabled workspace files, rendered.
    injected: Option<&'a str>,
    /// Its notes and the memory pack.
    memory: Option<&'a str>,
    current: Option<&'a WindowMessage>,
    budget: u32,
    keep_turns: Option<usize>,
    /// Window tokens past which compaction is asked for; 0 never.
    trigger_tokens: u64,
    /// Messages since the last compaction past which compaction is asked for; 0 never.
    trigger_messages: usize,
    /// What a compaction keeps (`MNEMO_COMPACT_KEEP_PAIRS` or `_TOKENS`), as the job's plan does.
    compaction_keeps: Keep,
}

/// A window and what it was made from.
struct Built {
    window: Window,
    /// The messages read, oldest first (the window's history indexes point here).
    read: Vec<SessionMessage>,
    /// Messages after the last compaction, and the tokens of those and the summary (counted
    /// exactly when every message was read, else at least what was read, past the triggers).
    since_compaction: usize,
    history_tokens: u64,
    /// The most a compaction keeps verbatim: half of what the summary and the history may cost
    /// in this window without its current message (the budget less the system prompt, the
    /// workspace and the memory), and at least [`MIN_KEEP_AT_MOST`].
    keep_at_most: u64,
    /// History tokens past which the whole window passes the token trigger; 0 never.
    history_trigger: u64,
    /// Whether a compaction would cover anything, when every message since the last one was read.
    compactable: Option<bool>,
}

/// Reads the session's newest messages, a page at a time, until they are enough for the window
/// and the triggers ([`tail_suffices`]), and assembles the window from them.
async fn build(
    state: &AppState,
    tokenizer: &dyn TokenCounter,
    principal: &Principal,
    session: &SessionId,
    session_state: &SessionState,
    request: &Request<'_>,
) -> Result<Built, ApiError> {
    let summary = session_state.summary.as_ref().map(|s| s.content.as_str());
    let summary_tokens = summary.map_or(0, |s| u64::from(tokenizer.count(s)));
    let mut input = WindowInput {
        system_prompt: request.system_prompt,
        injected: request.injected,
        memory: request.memory,
        summary,
        history: &[],
        current: request.current,
        budget: request.budget,
        keep_turns: request.keep_turns,
    };
    let room = history_room(&input, tokenizer).map_err(budget_too_small)?;
    // What compaction keeps outlasts this call: sized without its message (a paste would leave
    // the kept turns no room, and they would be folded into the summary for good).
    let lasting_room = match input.current {
        Some(_) => {
            history_room(&WindowInput { current: None, ..input.clone() }, tokenizer).map_err(budget_too_small)?
        }
        None => room,
    };
    let keep_at_most = (lasting_room / 2).max(MIN_KEEP_AT_MOST);
    // The trigger counts the whole window (the system prompt, the workspace, the memory and the
    // current message too), not the history alone; never below half the history's room, so a
    // window whose other parts pass the trigger alone does not ask for a summary at every turn.
    let history_trigger = match request.trigger_tokens {
        0 => 0,
        whole => whole.saturating_sub(u64::from(request.budget).saturating_sub(room)).max(room / 2).max(1),
    };

    let mut read: Vec<SessionMessage> = Vec::new();
    let mut newest_first: Vec<WindowMessage> = Vec::new();
    let mut read_tokens = 0u64;
    let mut page = FIRST_PAGE;
    let exhausted = loop {
        let before = read.last().map(SessionMessage::cursor);
        let rows = state
            .store
            .session_messages_newest_first(&principal.tenant, session, session_state.through, before, page)
            .await?;
        let last_page = rows.len() < page as usize;
        for row in rows {
            let message = row.to_window(tokenizer);
            read_tokens += message.cost();
            newest_first.push(message);
            read.push(row);
        }
        let enough = tail_suffices(&newest_first, room, request.keep_turns)
            && (request.trigger_messages == 0 || read.len() > request.trigger_messages)
            && (history_trigger == 0 || summary_tokens + read_tokens > history_trigger);
        if last_page || enough || read.len() >= MAX_HISTORY {
            break last_page;
        }
        // The next page: what the budget and the triggers still need, at the average cost so far.
        let average = (read_tokens / read.len().max(1) as u64).max(1);
        let tokens_short = (room + 1).max(history_trigger + 1).saturating_sub(read_tokens);
        let rows_short =
            (tokens_short / average + 1).max((request.trigger_messages + 1).saturating_sub(read.len()) as u64);
        page = i64::try_from(rows_short + rows_short / 8 + 8).unwrap_or(MAX_PAGE_READ).clamp(FIRST_PAGE, MAX_PAGE_READ);
    };
    read.reverse();
    newest_first.reverse();
    let history = newest_first;
    let since_compaction = if exhausted {
        read.len()
    } else {
        let count = state.store.count_session_messages(&principal.tenant, session, session_state.through).await?;
        usize::try_from(count).unwrap_or(usize::MAX)
    };
    // Cut as the job's plan cuts: over the oldest messages it reads, by its keep, and keeping at
    // most `keep_at_most`.
    let compactable = exhausted.then(|| {
        let planned = &history[..history.len().min(MAX_COMPACTION_MESSAGES)];
        let at_most = Keep::Tokens(keep_at_most);
        compaction_cut(planned, request.compaction_keeps).max(compaction_cut(planned, at_most)) > 0
    });
    input.history = &history;
    let window = assemble(&input, tokenizer).map_err(budget_too_small)?;
    let history_tokens = summary_tokens + read_tokens;
    Ok(Built { window, read, since_compaction, history_tokens, keep_at_most, history_trigger, compactable })
}

fn budget_too_small(error: WindowError) -> ApiError {
    match error {
        WindowError::BudgetTooSmall { .. } => ApiError::InvalidField {
            field: "max_input_tokens",
            expected: "large enough for the system prompt and the current message",
        },
    }
}

/// The first page of a context read, and the largest; pages between are sized by what is still
/// needed.
const FIRST_PAGE: i64 = 128;
const MAX_PAGE_READ: i64 = 4096;

fn window_json(
    built: &Built,
    session_state: &SessionState,
    budget: u32,
    compaction: &str,
    trigger: Option<CompactionTrigger>,
) -> Value {
    let window = &built.window;
    let tokens: serde_json::Map<String, Value> = window
        .tokens
        .iter()
        .map(|(section, n)| (section_name(*section).to_owned(), json!(n)))
        .chain([("total".to_owned(), json!(window.total_tokens()))])
        .collect();
    let truncated: Vec<Value> = window
        .messages
        .iter()
        .filter(|m| m.truncated)
        .filter_map(|m| m.history_index)
        .map(|i| json!(built.read[i].id))
        .collect();
    let summary = session_state
        .summary
        .as_ref()
        .filter(|_| window.summary_used)
        .map(|s| json!({ "id": s.id, "through_message": s.through }));
    json!({
        "messages": openai_messages(&window.messages),
        "diagnostics": {
            "budget": budget,
            "tokens": tokens,
            "summary": summary,
            "window_starts_after": session_state.through.map(|c| c.id),
            "messages_since_compaction": built.since_compaction,
            "messages_kept": window.kept.len(),
            "messages_dropped": built.since_compaction.saturating_sub(window.kept.len()),
            "first_kept": window.kept.first().map(|&i| built.read[i].id),
            "truncated": truncated,
            "compaction": compaction,
            "trigger": trigger.map(CompactionTrigger::as_str),
        },
    })
}

fn section_name(section: Section) -> &'static str {
    match section {
        Section::System => "system",
        Section::Injected => "injected",
        Section::Memory => "memory",
        Section::Summary => "summary",
        Section::History => "history",
        Section::Current => "current",
    }
}

/// The window in the OpenAI chat format. An assistant's tool calls become `tool_calls` (its
/// content holds the call's arguments); consecutive calls are one assistant message, as
/// parallel calls are, so their results follow the message that made them. The window placed
/// every result whose call it does not hold as reference text already.
fn openai_messages(placed: &[Placed]) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    let mut calls_open = false;
    for m in placed {
        let is_call = m.role == Role::Assistant && m.tool_call_id.is_some();
        if is_call {
            let call = json!({
                "id": m.tool_call_id,
                "type": "function",
                "function": { "name": m.tool_name.as_deref().unwrap_or(DEFAULT_TOOL_NAME), "arguments": m.content },
            });
            if calls_open && let Some(Value::Array(calls)) = out.last_mut().and_then(|last| last.get_mut("tool_calls"))
            {
                calls.push(call);
                continue;
            }
            out.push(json!({ "role": "assistant", "content": Value::Null, "tool_calls": [call] }));
            calls_open = true;
            continue;
        }
        calls_open = false;
        out.push(match (m.role, m.tool_name.as_deref()) {
            (Role::Tool, _) => json!({ "role": "tool", "tool_call_id": m.tool_call_id, "content": m.content }),
            (role, None) => json!({ "role": role.as_str(), "content": m.content }),
            // The participant who wrote it: OpenAI's `name` when it is one OpenAI takes, else
            // before the text (a name with a space or an accent is refused as a `name`).
            (role, Some(name)) if is_openai_name(name) => {
                json!({ "role": role.as_str(), "name": name, "content": m.content })
            }
            (role, Some(name)) => json!({ "role": role.as_str(), "content": format!("{name}: {}", m.content) }),
        });
    }
    out
}

/// Whether OpenAI takes `name` as a message's `name`: 1 to 64 ASCII letters, digits, `_` or `-`.
fn is_openai_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `POST /v1/sessions/{sid}/complete` `{trigger_source: web|channel|cron}`: the conversation is
/// over; if it passes the gates, its extraction is asked for (once per session and last
/// message). 202 with `{queued, skipped}`: `skipped` names the gate that stopped it.
pub async fn complete(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    PathPart(sid): PathPart,
    mut body: JsonObject,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let source = body.take_opt_str("trigger_source")?.ok_or(ApiError::MissingField("trigger_source"))?;
    let source = match TriggerSource::parse(&source)? {
        // Values of the server's own, not a caller's: outside the set a caller may name.
        TriggerSource::Manual | TriggerSource::Compaction => {
            let expected = "web, channel or cron";
            return Err(InvalidInput::UnknownValue { field: "trigger_source", value: source, expected }.into());
        }
        source => source,
    };
    body.finish()?;
    ask_extraction(&state, &principal, &sid, source).await
}

/// `POST /v1/sessions/{sid}/extract`: extract the conversation now, past the gates (still once
/// per session and last message, and never while the user's extraction is cooling down).
pub async fn extract(
    State(state): State<AppState>,
    Authenticated(principal): Authenticated,
    PathPart(sid): PathPart,
    body: JsonObject,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    body.finish()?;
    ask_extraction(&state, &principal, &sid, TriggerSource::Manual).await
}

async fn ask_extraction(
    state: &AppState,
    principal: &Principal,
    sid: &str,
    source: TriggerSource,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let session = session_for(principal, sid)?;
    let workspace = Workspace::of(principal)?;
    let Some(user) = &workspace.user else { return Err(ScopeError::WorkspaceNeedsUser.into()) };
    let answer = |queued: bool, skipped: Option<&str>| {
        Ok((StatusCode::ACCEPTED, Json(json!({ "queued": queued, "skipped": skipped }))))
    };
    if !state.workspace.extraction.enabled {
        return answer(false, Some("disabled"));
    }
    // The gates read the conversation's end, however long the session, as extraction would show
    // it to this user: their words and the replies to them, not another user's.
    let mut messages =
        state.store.session_messages_newest_first(&principal.tenant, &session, None, None, GATE_MESSAGES).await?;
    messages.reverse();
    let spoken: Vec<(Role, &str)> =
        spoken_by(&messages, user).into_iter().map(|m| (m.role, m.content.as_str())).collect();
    if let Some(gate) = state.workspace.extraction.gates.refuse(source, &spoken) {
        return answer(false, Some(gate));
    }
    let Some(last) = messages.last() else { return answer(false, Some("no_messages")) };
    let queued = state.store.request_extraction(&workspace, &session, last.cursor(), source).await?;
    answer(queued, if queued { None } else { Some("already_asked") })
}
