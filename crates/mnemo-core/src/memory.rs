use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};

use crate::{
    AgentId, FactScope, FileKey, InvalidInput, MemoryText, Origin, Principal, Role, Scope, SessionId, SourceKind,
    SourceRef, TenantId, ToolOutputKey, ToolOutputText, Typed, TypedInput, UserId, Visibility, WorkspacePath,
    fact_source_ref,
};

/// Caller-supplied metadata: a JSON object of at most 16 KiB with no NUL anywhere (PostgreSQL's
/// jsonb cannot hold `\u0000`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Metadata(serde_json::Map<String, serde_json::Value>);

impl Metadata {
    pub const MAX_BYTES: usize = 16 * 1024;

    pub fn parse(value: serde_json::Value) -> Result<Self, InvalidInput> {
        const FIELD: &str = "metadata";
        let serde_json::Value::Object(map) = value else {
            return Err(InvalidInput::UnknownValue {
                field: FIELD,
                value: "a non-object".to_owned(),
                expected: "a JSON object",
            });
        };
        let size = serde_json::to_vec(&map).map_or(usize::MAX, |bytes| bytes.len());
        if size > Self::MAX_BYTES {
            return Err(InvalidInput::TooLong { field: FIELD, max: Self::MAX_BYTES, actual: size });
        }
        if map.iter().any(|(k, v)| k.contains('\0') || contains_nul(v)) {
            return Err(InvalidInput::NulByte { field: FIELD });
        }
        Ok(Self(map))
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::Value::Object(self.0.clone())
    }
}

fn contains_nul(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::String(s) => s.contains('\0'),
        serde_json::Value::Array(items) => items.iter().any(contains_nul),
        serde_json::Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || contains_nul(v)),
        _ => false,
    }
}

/// An optional label that makes a fact replace older facts with the same label in its bucket
/// ("home_city"), without asking a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FactKey(String);

impl FactKey {
    pub fn parse(raw: &str) -> Result<Self, InvalidInput> {
        const FIELD: &str = "key";
        const MAX: usize = 256;
        if raw.trim().is_empty() {
            return Err(InvalidInput::Empty { field: FIELD });
        }
        if raw.len() > MAX {
            return Err(InvalidInput::TooLong { field: FIELD, max: MAX, actual: raw.len() });
        }
        if raw.contains('\0') {
            return Err(InvalidInput::NulByte { field: FIELD });
        }
        if raw.chars().any(char::is_control) {
            return Err(InvalidInput::ControlChar { field: FIELD });
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Why a write was refused by the scope rules.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScopeError {
    #[error("{0} rows belong to a session: give session_id or use a token with a sid claim")]
    MissingSession(SourceKind),
    #[error("this token may write only to the session it is bound to (a user's token without one, to none it names)")]
    SessionMismatch,
    #[error("document chunks are tenant-wide and take no session_id")]
    SessionNotAllowed,
    #[error("a {0}-scope fact needs a token that names the {0} (claim {claim})", claim = match .0 { FactScope::User => "sub", FactScope::Agent => "agent" })]
    MissingIdentity(FactScope),
    #[error(
        "an agent-scope fact from a token bound to a session needs its user (claim sub): only a service token (no sub, no sid) writes one without a user"
    )]
    AgentFactNeedsUser,
    #[error("scope session searches the token's session: use a token with a sid claim")]
    RecallWithoutSession,
    #[error("workspace files belong to an agent: use a token with an agent claim")]
    WorkspaceNeedsAgent,
    #[error("this workspace file is about a user: use a token with a sub claim")]
    WorkspaceNeedsUser,
    #[error("the token names another agent")]
    AgentMismatch,
    #[error(
        "the agent's own files are shared by all its users: change them with a service token that names the agent (no sub, no sid claim)"
    )]
    AgentFileReadOnly,
    #[error(
        "a system message from a token bound to a session needs its user (claim sub), whose system messages go in as marked user messages: only a service token (no sub, no sid) writes instructions"
    )]
    SystemMessageNeedsUser,
    #[error(
        "an agent's fact restricted to allowed_roles needs a token holding one of them: a writer may not restrict a fact to readers it is not one of"
    )]
    RolesNotHeld,
    #[error(
        "document chunks are shared by the whole tenant: write them with a service token (no sub, no sid claim); a user's own notes are facts or workspace files"
    )]
    DocumentChunkNeedsService,
}

/// A validated row to remember: its scope and identities follow the rules of its kind, and its
/// tenant is the principal's.
#[derive(Debug, Clone)]
pub struct NewMemory {
    pub tenant: TenantId,
    pub scope: Scope,
    pub session: Option<SessionId>,
    pub user: Option<UserId>,
    pub agent: Option<AgentId>,
    pub kind: SourceKind,
    pub source_ref: SourceRef,
    pub content: MemoryText,
    /// sha256 of everything the caller sent (the full payload of an elided tool output).
    pub content_sha256: [u8; 32],
    /// The full payload behind an elided tool output.
    pub tool_output: Option<(ToolOutputKey, String)>,
    pub metadata: Metadata,
    pub event_time: Option<DateTime<Utc>>,
    pub fact_key: Option<FactKey>,
    /// For a conversation's rows (chat messages, tool outputs): who said it and its tokens.
    pub turn: Option<Turn>,
    /// Layer, importance, visibility and the rest; defaults follow the kind and scope.
    pub typed: Typed,
    /// The session a fact was stated in, when there was one: promotion counts the sessions a
    /// memory was seen in.
    pub seen_in: Option<SessionId>,
}

/// A row's place in its conversation: its role, the tool call it makes or answers, and its
/// token count, made once when it is written so a context window never tokenizes history again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    pub role: Role,
    pub tool_call_id: Option<String>,
    pub tool_name: Option<String>,
    pub tokens: u32,
    /// The counter that made `tokens` ([`crate::TokenCounter::name`]).
    pub counted_by: String,
}

impl Turn {
    /// The longest tool call id or tool name accepted.
    pub const MAX_ID_BYTES: usize = 256;

    /// A turn of `role`. A tool result must name the call it answers; ids and names are short
    /// and free of control characters.
    pub fn parse(
        role: Role,
        tool_call_id: Option<&str>,
        tool_name: Option<&str>,
        tokens: u32,
        counted_by: &str,
    ) -> Result<Self, InvalidInput> {
        let check = |field: &'static str, raw: Option<&str>| -> Result<Option<String>, InvalidInput> {
            let Some(raw) = raw else { return Ok(None) };
            if raw.trim().is_empty() {
                return Err(InvalidInput::Empty { field });
            }
            if raw.len() > Self::MAX_ID_BYTES {
                return Err(InvalidInput::TooLong { field, max: Self::MAX_ID_BYTES, actual: raw.len() });
            }
            if raw.contains('\0') {
                return Err(InvalidInput::NulByte { field });
            }
            if raw.chars().any(char::is_control) {
                return Err(InvalidInput::ControlChar { field });
            }
            Ok(Some(raw.to_owned()))
        };
        let tool_call_id = check("tool_call_id", tool_call_id)?;
        if role == Role::Tool && tool_call_id.is_none() {
            return Err(InvalidInput::Empty { field: "tool_call_id" });
        }
        // Only a call and its result are paired by an id; a user's or a system message holding
        // one would be stored with it and then dropped from every window without a word.
        if tool_call_id.is_some() && !matches!(role, Role::Tool | Role::Assistant) {
            return Err(InvalidInput::UnknownValue {
                field: "role",
                value: role.to_string(),
                expected: "assistant or tool on a message with a tool_call_id (a call or its result)",
            });
        }
        Ok(Self { role, tool_call_id, tool_name: check("name", tool_name)?, tokens, counted_by: counted_by.to_owned() })
    }
}

/// What every constructor shares.
#[derive(Debug, Clone, Default)]
pub struct Extras {
    pub metadata: Metadata,
    pub event_time: Option<DateTime<Utc>>,
}

fn sha256(text: &str) -> [u8; 32] {
    Sha256::digest(text.as_bytes()).into()
}

/// A session-scoped row goes into the token's own session, or into any session named by a
/// service token (no user, no session): as a session is read. A user's token without a session
/// naming one would write into sessions, other users' too, that it cannot read.
fn session_for(principal: &Principal, kind: SourceKind, given: Option<SessionId>) -> Result<SessionId, ScopeError> {
    match (given, &principal.session) {
        (Some(given), Some(bound)) if &given != bound => Err(ScopeError::SessionMismatch),
        (Some(_), None) if principal.user.is_some() => Err(ScopeError::SessionMismatch),
        (Some(given), _) => Ok(given),
        (None, Some(bound)) => Ok(bound.clone()),
        (None, None) => Err(ScopeError::MissingSession(kind)),
    }
}

impl NewMemory {
    /// A chat message: session-scoped, written under the caller's user and agent.
    pub fn chat_message(
        principal: &Principal,
        source_ref: SourceRef,
        content: MemoryText,
        session: Option<SessionId>,
        extras: Extras,
    ) -> Result<Self, ScopeError> {
        let session = session_for(principal, SourceKind::ChatMessage, session)?;
        Ok(Self::session_row(principal, SourceKind::ChatMessage, source_ref, content, session, extras))
    }

    /// A tool output: session-scoped; past 16 KiB the row keeps a preview and the whole payload
    /// goes to the tool output store.
    pub fn tool_output(
        principal: &Principal,
        source_ref: SourceRef,
        output: ToolOutputText,
        session: Option<SessionId>,
        extras: Extras,
    ) -> Result<Self, ScopeError> {
        let session = session_for(principal, SourceKind::ToolOutput, session)?;
        let content_sha256 = sha256(output.as_str());
        let stored = output.into_stored(&principal.tenant, &source_ref);
        let mut row = Self::session_row(principal, SourceKind::ToolOutput, source_ref, stored.preview, session, extras);
        row.content_sha256 = content_sha256;
        row.tool_output = stored.elided;
        Ok(row)
    }

    fn session_row(
        principal: &Principal,
        kind: SourceKind,
        source_ref: SourceRef,
        content: MemoryText,
        session: SessionId,
        extras: Extras,
    ) -> Self {
        Self {
            tenant: principal.tenant.clone(),
            scope: Scope::Session,
            session: Some(session),
            user: principal.user.clone(),
            agent: principal.agent.clone(),
            kind,
            source_ref,
            content_sha256: sha256(content.as_str()),
            content,
            tool_output: None,
            metadata: extras.metadata,
            event_time: extras.event_time,
            fact_key: None,
            turn: None,
            typed: Typed::defaults(kind, Scope::Session, Origin::Api, None),
            seen_in: None,
        }
    }

    /// A session's summary, written by compaction under the identities of the messages it
    /// summarizes (so erasing their user erases it too).
    pub fn session_summary(
        tenant: TenantId,
        session: SessionId,
        user: Option<UserId>,
        agent: Option<AgentId>,
        source_ref: SourceRef,
        content: MemoryText,
        event_time: DateTime<Utc>,
    ) -> Self {
        Self {
            tenant,
            scope: Scope::Session,
            session: Some(session),
            user,
            agent,
            kind: SourceKind::SessionSummary,
            source_ref,
            content_sha256: sha256(content.as_str()),
            content,
            tool_output: None,
            metadata: Metadata::default(),
            event_time: Some(event_time),
            fact_key: None,
            turn: None,
            typed: Typed::defaults(SourceKind::SessionSummary, Scope::Session, Origin::Consolidation, None),
            seen_in: None,
        }
    }

    /// The file a [`NewMemory::workspace_note`] piece's source_ref names.
    pub fn workspace_note_path(source_ref: &str) -> Option<WorkspacePath> {
        let rest = source_ref.strip_prefix("workspace:")?.split_once(':')?.1;
        WorkspacePath::parse(&rest[..rest.rfind("@v")?]).ok()
    }

    /// A piece of a user's recallable workspace file (`MEMORY.md`, a daily note) as of `version`,
    /// in the user's class under the file's agent. The source_ref names the version that first
    /// held the piece: `workspace:{sha256(agent, user)[:16]}:{path}@v{version}#{index}`.
    pub fn workspace_note(key: &FileKey, version: i32, index: usize, chunk: &str) -> Result<Self, InvalidInput> {
        let content = MemoryText::parse(chunk)?;
        let owner = key.user.as_ref().map_or("", |u| u.as_str());
        let who = hex::encode(Sha256::digest(format!("{}\0{owner}", key.agent).as_bytes()));
        let source_ref = SourceRef::parse(&format!("workspace:{}:{}@v{version}#{index}", &who[..16], key.path))?;
        let metadata = serde_json::json!({ "path": key.path.as_str(), "version": version });
        Ok(Self {
            tenant: key.tenant.clone(),
            scope: Scope::User,
            session: None,
            user: key.user.clone(),
            agent: Some(key.agent.clone()),
            kind: SourceKind::WorkspaceNote,
            source_ref,
            content_sha256: sha256(content.as_str()),
            content,
            tool_output: None,
            metadata: Metadata::parse(metadata)?,
            event_time: None,
            fact_key: None,
            turn: None,
            typed: Typed::defaults(
                SourceKind::WorkspaceNote,
                Scope::User,
                Origin::Consolidation,
                Some(key.path.as_str()),
            ),
            seen_in: None,
        })
    }

    /// Refuses an agent's fact restricted to roles `principal` holds none of. The judge lets a
    /// fact replace the older facts of its bucket that have the same readers, so such a writer
    /// could otherwise retire facts it cannot read. A user's own facts are always open to that
    /// user, so only agent facts are checked.
    pub fn check_writer_reads(self, principal: &Principal) -> Result<Self, ScopeError> {
        let roles = &self.typed.allowed_roles;
        if self.kind == SourceKind::Fact
            && self.scope == Scope::Agent
            && !roles.is_empty()
            && !roles.iter().any(|r| principal.roles.contains(r))
        {
            return Err(ScopeError::RolesNotHeld);
        }
        Ok(self)
    }

    /// The row with its place in the conversation.
    pub fn with_turn(mut self, turn: Turn) -> Self {
        self.turn = Some(turn);
        self
    }

    /// The row with the typed fields its writer gave, over the defaults of its kind and scope.
    /// A row shared with its agent's users needs an agent.
    pub fn with_typed(mut self, input: TypedInput, origin: Origin) -> Result<Self, InvalidInput> {
        self.typed = Typed::resolve(input, self.kind, self.scope, origin, None)?;
        if self.typed.visibility == Visibility::Agent && self.agent.is_none() {
            return Err(InvalidInput::UnknownValue {
                field: "visibility",
                value: "agent".into(),
                expected: "private tenant (visibility agent needs a token with an agent claim)",
            });
        }
        Ok(self)
    }

    /// A document chunk: tenant-wide, no session, written by the service. A user's token or a
    /// session's would put text every user of the tenant recalls where neither that user's
    /// forgetting nor their erasure reaches it.
    pub fn document_chunk(
        principal: &Principal,
        source_ref: SourceRef,
        content: MemoryText,
        session: Option<SessionId>,
        extras: Extras,
    ) -> Result<Self, ScopeError> {
        if session.is_some() {
            return Err(ScopeError::SessionNotAllowed);
        }
        if !principal.is_service() {
            return Err(ScopeError::DocumentChunkNeedsService);
        }
        Ok(Self {
            tenant: principal.tenant.clone(),
            scope: Scope::Tenant,
            session: None,
            user: None,
            agent: None,
            kind: SourceKind::DocumentChunk,
            source_ref,
            content_sha256: sha256(content.as_str()),
            content,
            tool_output: None,
            metadata: extras.metadata,
            event_time: extras.event_time,
            fact_key: None,
            turn: None,
            typed: Typed::defaults(SourceKind::DocumentChunk, Scope::Tenant, Origin::Api, None),
            seen_in: None,
        })
    }

    /// A fact about the token's user or agent. Its source_ref is derived from the identity and
    /// the content, so asserting the same fact twice lands on the same row.
    pub fn fact(
        principal: &Principal,
        scope: FactScope,
        content: MemoryText,
        key: Option<FactKey>,
        extras: Extras,
    ) -> Result<Self, ScopeError> {
        let identity = match scope {
            FactScope::User => principal.user.as_ref().map(UserId::as_str),
            FactScope::Agent => principal.agent.as_ref().map(AgentId::as_str),
        }
        .ok_or(ScopeError::MissingIdentity(scope))?;
        // A fact names its writer, whose facts alone it replaces: a user, or the service, whose
        // facts replace any. A session's token without a user would pass for the service.
        if scope == FactScope::Agent && principal.user.is_none() && !principal.is_service() {
            return Err(ScopeError::AgentFactNeedsUser);
        }
        let source_ref = fact_source_ref(scope, identity, &content);
        Ok(Self {
            tenant: principal.tenant.clone(),
            scope: scope.into(),
            session: None,
            // The bucket's identity, plus the other identity for provenance.
            user: principal.user.clone(),
            agent: principal.agent.clone(),
            kind: SourceKind::Fact,
            source_ref,
            content_sha256: sha256(content.as_str()),
            content,
            tool_output: None,
            metadata: extras.metadata,
            event_time: extras.event_time,
            fact_key: key,
            turn: None,
            typed: Typed::defaults(SourceKind::Fact, scope.into(), Origin::Api, None),
            seen_in: principal.session.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn principal(user: Option<&str>, agent: Option<&str>, session: Option<&str>) -> Principal {
        Principal {
            tenant: TenantId::parse("t").expect("valid"),
            user: user.map(|u| UserId::parse(u).expect("valid")),
            agent: agent.map(|a| AgentId::parse(a).expect("valid")),
            session: session.map(|s| SessionId::parse(s).expect("valid")),
            roles: Vec::new(),
        }
    }

    fn text(s: &str) -> MemoryText {
        MemoryText::parse(s).expect("valid")
    }

    fn source(s: &str) -> SourceRef {
        SourceRef::parse(s).expect("valid")
    }

    fn session(s: &str) -> Option<SessionId> {
        Some(SessionId::parse(s).expect("valid"))
    }

    #[test]
    fn session_rows_take_the_session_from_the_body_or_the_token() {
        let bound = principal(Some("u"), None, Some("s1"));
        let row = NewMemory::chat_message(&bound, source("m1"), text("hi"), None, Extras::default()).expect("ok");
        assert_eq!(row.session, session("s1"));
        assert_eq!(row.user.as_ref().map(UserId::as_str), Some("u"));
        let err = NewMemory::chat_message(&bound, source("m1"), text("hi"), session("s2"), Extras::default());
        assert_eq!(err.unwrap_err(), ScopeError::SessionMismatch);

        let service = principal(None, None, None);
        let err = NewMemory::chat_message(&service, source("m1"), text("hi"), None, Extras::default());
        assert_eq!(err.unwrap_err(), ScopeError::MissingSession(SourceKind::ChatMessage));
        let row = NewMemory::chat_message(&service, source("m1"), text("hi"), session("s9"), Extras::default());
        assert_eq!(row.expect("ok").session, session("s9"));
        // A user's token without a session reads no session, so it writes into none it names.
        let user = principal(Some("u"), None, None);
        let err = NewMemory::chat_message(&user, source("m1"), text("hi"), session("s9"), Extras::default());
        assert_eq!(err.unwrap_err(), ScopeError::SessionMismatch);
    }

    #[test]
    fn facts_need_the_identity_of_their_scope() {
        let agent_only = principal(None, Some("a"), None);
        let err = NewMemory::fact(&agent_only, FactScope::User, text("x"), None, Extras::default());
        assert_eq!(err.unwrap_err(), ScopeError::MissingIdentity(FactScope::User));
        let row = NewMemory::fact(&agent_only, FactScope::Agent, text("x"), None, Extras::default()).expect("ok");
        assert_eq!(row.scope, Scope::Agent);
        assert!(row.source_ref.as_str().starts_with("fact:agent:a:"));
    }

    #[test]
    fn document_chunks_refuse_a_session_and_are_the_service_s_to_write() {
        let service = principal(None, Some("a"), None);
        let err = NewMemory::document_chunk(&service, source("c1"), text("x"), session("s"), Extras::default());
        assert_eq!(err.unwrap_err(), ScopeError::SessionNotAllowed);
        let row = NewMemory::document_chunk(&service, source("c1"), text("x"), None, Extras::default()).expect("ok");
        assert_eq!((row.scope, row.session, row.user), (Scope::Tenant, None, None));
        for who in
            [principal(Some("u"), None, None), principal(None, None, Some("s")), principal(Some("u"), None, Some("s"))]
        {
            let err = NewMemory::document_chunk(&who, source("c1"), text("x"), None, Extras::default());
            assert_eq!(err.unwrap_err(), ScopeError::DocumentChunkNeedsService, "{who:?}");
        }
    }

    #[test]
    fn metadata_must_be_a_small_object_without_nul() {
        assert!(Metadata::parse(json!({"a": [1, "b"]})).is_ok());
        assert!(Metadata::parse(json!([1])).is_err());
        assert!(matches!(Metadata::parse(json!({"a": ["x\u{0}"]})), Err(InvalidInput::NulByte { .. })));
        assert!(matches!(Metadata::parse(json!({"a": "x".repeat(20_000)})), Err(InvalidInput::TooLong { .. })));
    }
}
