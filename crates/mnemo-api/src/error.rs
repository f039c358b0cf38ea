use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use mnemo_core::{InvalidInput, MAX_RELATIONS, ScopeError};
use mnemo_store::StoreError;
use serde_json::json;

/// Every error the API answers with. Each has one HTTP status and one stable snake_case code
/// (see [`ERROR_CODES`]); clients branch on the code, people read the message.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("the request body is not valid JSON: {0}")]
    MalformedJson(String),
    #[error("the request body is not valid UTF-8")]
    InvalidUtf8,
    #[error("the request body must be a JSON object")]
    NotAnObject,
    #[error("unknown field {0:?}")]
    UnknownField(String),
    #[error("missing field {0:?}")]
    MissingField(&'static str),
    #[error("field {field:?} must be {expected}")]
    InvalidField { field: &'static str, expected: &'static str },
    #[error("the tenant comes from the token; a request body may not name one (field {0:?})")]
    TenantInBody(String),
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
    #[error(transparent)]
    Scope(#[from] ScopeError),
    #[error("Content-Type must be application/json")]
    UnsupportedMediaType,
    #[error(
        "the request body is over the server's limit (three times MNEMO_MAX_TOOL_OUTPUT_BYTES or MNEMO_WORKSPACE_MAX_FILE_BYTES, whichever is larger; 256 KiB where no such content goes)"
    )]
    PayloadTooLarge,
    #[error("the request body did not arrive within MNEMO_BODY_TIMEOUT_S")]
    RequestTimeout,
    /// With how long until the tenant may send the next request (also in the message, for an
    /// MCP client, which sees no header).
    #[error("too many requests for this tenant: try again in {} s (Retry-After)", retry_after_secs(.0))]
    RateLimited(std::time::Duration),
    #[error("missing bearer token: send Authorization: Bearer <JWT>")]
    MissingToken,
    #[error("invalid token: {0}")]
    InvalidToken(String),
    #[error("the token has expired")]
    TokenExpired,
    #[error("not found")]
    NotFound,
    #[error("method not allowed")]
    /// With the methods the route takes, when the router does not add them itself.
    MethodNotAllowed(Option<&'static str>),
    #[error("source_ref already names a row with different content")]
    SourceRefConflict,
    #[error("source_ref names a memory that was deleted; it is anonymized after the retention period")]
    MemoryDeleted,
    #[error("relation target {0} is not a memory of this tenant")]
    RelationTargetNotFound(uuid::Uuid),
    #[error("item {0} of the atomic batch could not be written; nothing was written (see results)")]
    BatchRejected(usize),
    #[error("not written: another item of the atomic batch was refused")]
    NotWritten,
    #[error("the file is not at expected_version: it changed after you read it (read it again)")]
    FileChanged,
    #[error("old_text is not in the file")]
    EditTextNotFound,
    #[error("old_text is in the file {0} times: make it unique, or set replace_all")]
    EditTextAmbiguous(usize),
    #[error("not ready: {0}")]
    NotReady(String),
    #[error("the database is out of disk space; nothing was written")]
    StorageFull,
    /// The detail is logged, never sent.
    #[error("internal error")]
    Internal(String),
}

/// The error-code table: code, HTTP status, meaning. Documented in the README.
pub const ERROR_CODES: &[(&str, u16, &str)] = &[
    ("malformed_json", 400, "the body is not JSON"),
    ("invalid_utf8", 400, "the body is not UTF-8"),
    ("not_an_object", 400, "the body is JSON but not an object"),
    (
        "unknown_field",
        400,
        "the body or the query has a field this endpoint does not take (a `GET` or `DELETE` takes no body: one with a field is refused, `{}` passes)",
    ),
    ("missing_field", 400, "a required field is absent"),
    (
        "invalid_field",
        400,
        "a field has the wrong type, or an id is empty, too long or has control characters (a memory id: not in the 8-4-4-4-12 form), or a time is outside the years 0001–9999 (a chat message's or tool output's `event_time`: more than a day ahead of the server's clock), or a query parameter is given twice",
    ),
    (
        "invalid_value",
        400,
        "a field has a value outside its allowed set (source_kind, scope, layer, category, visibility, a relation's type, a label's characters)",
    ),
    ("tenant_in_body", 400, "the body names a tenant; the tenant comes only from the token"),
    ("empty_content", 400, "content is empty or only white space"),
    (
        "content_too_long",
        400,
        "content is over its limit (16 KiB; tool outputs: MNEMO_MAX_TOOL_OUTPUT_BYTES; workspace files: MNEMO_WORKSPACE_MAX_FILE_BYTES)",
    ),
    (
        "invalid_path",
        400,
        "a workspace path is not a relative .md path of at most 4 levels and 200 bytes without .., backslashes or control characters, or names a daily note of no real day or of a day more than one after today (UTC)",
    ),
    ("nul_byte", 400, "a string contains a NUL character"),
    (
        "too_many_values",
        400,
        "a list is over its limit (tags 16, relations 16 a memory, counting those a re-assertion finds, allowed_roles 8)",
    ),
    ("relation_target_not_found", 400, "a relation names a memory that is not a live row of the tenant"),
    (
        "batch_rejected",
        400,
        "an atomic batch has an item that cannot be written; nothing was written (its results say which)",
    ),
    ("missing_session", 400, "a session-scoped write has no session_id and the token no sid"),
    ("session_not_allowed", 400, "a tenant-scoped write names a session"),
    ("missing_token", 401, "no bearer token"),
    ("invalid_token", 401, "the token is malformed, forged, lacks a required claim, or an id in it is invalid"),
    ("token_expired", 401, "the token's exp has passed"),
    (
        "missing_identity",
        401,
        "the scope needs a user (sub), agent or session (sid) claim the token lacks (an agent's fact or a system message from a token with a sid needs its sub)",
    ),
    (
        "session_mismatch",
        403,
        "the token is bound to another session, or is a user's token without one naming a session",
    ),
    ("agent_mismatch", 403, "the path names an agent other than the token's"),
    (
        "agent_file_read_only",
        403,
        "a token with a user (sub) or a session (sid) may read the agent's shared files but not change them",
    ),
    (
        "roles_not_held",
        403,
        "an agent's fact with allowed_roles, written by a token holding none of them (a writer may not restrict a fact to readers it is not one of)",
    ),
    (
        "document_chunk_needs_service",
        403,
        "a document chunk (recalled by every user of the tenant) written with a user's or a session's token: only a service token (no sub, no sid) writes one",
    ),
    ("not_found", 404, "no such route or resource for this tenant"),
    ("method_not_allowed", 405, "the route exists with another method"),
    ("request_timeout", 408, "the request body did not arrive in time"),
    (
        "source_ref_conflict",
        409,
        "the source_ref already holds different content (for a fact: or other visibility or allowed_roles, or it is an agent's fact another user wrote that a newer one replaced; for a chat message or tool output: a row of another session, or of another role or tool call)",
    ),
    ("not_written", 409, "an item of an atomic batch, not written because another item was refused"),
    (
        "memory_deleted",
        409,
        "the source_ref names a deleted row (a deleted fact asserted again by its writer is revived instead, unless a retention sweep anonymizes it meanwhile: then a retry stores it anew)",
    ),
    (
        "file_changed",
        409,
        "a workspace write's expected_version is not the file's version: it changed after it was read",
    ),
    ("edit_text_not_found", 409, "a workspace edit's old_text is not in the file"),
    (
        "edit_text_ambiguous",
        409,
        "a workspace edit's old_text is in the file more than once (places that overlap count) and replace_all is not set",
    ),
    ("payload_too_large", 413, "the request body is over the server's limit"),
    (
        "unsupported_media_type",
        415,
        "Content-Type is given and is not application/json or a +json type (a body without one is read as JSON)",
    ),
    (
        "rate_limited",
        429,
        "the tenant is over its request rate (MNEMO_RATE_LIMIT_PER_TENANT); Retry-After says when to try again",
    ),
    ("internal", 500, "something failed inside mnemo; details are in its log"),
    (
        "not_ready",
        503,
        "the database is unreachable, its schema is older than this build's, or a statement ran past MNEMO_STATEMENT_TIMEOUT_S",
    ),
    (
        "storage_full",
        507,
        "the database is out of disk space; nothing was written, and the same request succeeds once space is freed",
    ),
];

impl ApiError {
    /// The stable code clients branch on.
    /// A field nobody takes, named by its first 64 characters (a name can be of any length).
    pub fn unknown_field(name: &str) -> Self {
        Self::UnknownField(name.chars().take(64).collect())
    }

    pub fn code(&self) -> &'static str {
        self.code_and_status().0
    }

    pub fn status(&self) -> StatusCode {
        self.code_and_status().1
    }

    /// Every variant's code and status, spelled out with no fallback, so a new variant does not
    /// compile until it has both; the tests check each pair is a row of [`ERROR_CODES`].
    fn code_and_status(&self) -> (&'static str, StatusCode) {
        const BAD_REQUEST: StatusCode = StatusCode::BAD_REQUEST;
        const UNAUTHORIZED: StatusCode = StatusCode::UNAUTHORIZED;
        match self {
            Self::MalformedJson(_) => ("malformed_json", BAD_REQUEST),
            Self::InvalidUtf8 => ("invalid_utf8", BAD_REQUEST),
            Self::NotAnObject => ("not_an_object", BAD_REQUEST),
            Self::UnknownField(_) => ("unknown_field", BAD_REQUEST),
            Self::MissingField(_) => ("missing_field", BAD_REQUEST),
            Self::InvalidField { .. } => ("invalid_field", BAD_REQUEST),
            Self::TenantInBody(_) => ("tenant_in_body", BAD_REQUEST),
            Self::Invalid(invalid) => match invalid {
                InvalidInput::NulByte { .. } => ("nul_byte", BAD_REQUEST),
                InvalidInput::Empty { field: "content" } => ("empty_content", BAD_REQUEST),
                InvalidInput::TooLong { field: "content", .. } => ("content_too_long", BAD_REQUEST),
                InvalidInput::UnknownValue { .. } => ("invalid_value", BAD_REQUEST),
                InvalidInput::BadPath { .. } => ("invalid_path", BAD_REQUEST),
                InvalidInput::TooMany { .. } => ("too_many_values", BAD_REQUEST),
                InvalidInput::Empty { .. }
                | InvalidInput::TooLong { .. }
                | InvalidInput::ControlChar { .. }
                | InvalidInput::ReservedSuffix { .. }
                | InvalidInput::OutOfRange { .. } => ("invalid_field", BAD_REQUEST),
            },
            Self::Scope(scope) => match scope {
                ScopeError::MissingSession(_) => ("missing_session", BAD_REQUEST),
                ScopeError::SessionNotAllowed => ("session_not_allowed", BAD_REQUEST),
                ScopeError::SessionMismatch => ("session_mismatch", StatusCode::FORBIDDEN),
                ScopeError::AgentMismatch => ("agent_mismatch", StatusCode::FORBIDDEN),
                ScopeError::AgentFileReadOnly => ("agent_file_read_only", StatusCode::FORBIDDEN),
                ScopeError::RolesNotHeld => ("roles_not_held", StatusCode::FORBIDDEN),
                ScopeError::DocumentChunkNeedsService => ("document_chunk_needs_service", StatusCode::FORBIDDEN),
                ScopeError::MissingIdentity(_)
                | ScopeError::AgentFactNeedsUser
                | ScopeError::SystemMessageNeedsUser
                | ScopeError::RecallWithoutSession
                | ScopeError::WorkspaceNeedsAgent
                | ScopeError::WorkspaceNeedsUser => ("missing_identity", UNAUTHORIZED),
            },
            Self::UnsupportedMediaType => ("unsupported_media_type", StatusCode::UNSUPPORTED_MEDIA_TYPE),
            Self::PayloadTooLarge => ("payload_too_large", StatusCode::PAYLOAD_TOO_LARGE),
            Self::RequestTimeout => ("request_timeout", StatusCode::REQUEST_TIMEOUT),
            Self::RateLimited(_) => ("rate_limited", StatusCode::TOO_MANY_REQUESTS),
            Self::MissingToken => ("missing_token", UNAUTHORIZED),
            Self::InvalidToken(_) => ("invalid_token", UNAUTHORIZED),
            Self::TokenExpired => ("token_expired", UNAUTHORIZED),
            Self::NotFound => ("not_found", StatusCode::NOT_FOUND),
            Self::MethodNotAllowed(_) => ("method_not_allowed", StatusCode::METHOD_NOT_ALLOWED),
            Self::SourceRefConflict => ("source_ref_conflict", StatusCode::CONFLICT),
            Self::MemoryDeleted => ("memory_deleted", StatusCode::CONFLICT),
            Self::RelationTargetNotFound(_) => ("relation_target_not_found", BAD_REQUEST),
            Self::BatchRejected(_) => ("batch_rejected", BAD_REQUEST),
            Self::NotWritten => ("not_written", StatusCode::CONFLICT),
            Self::FileChanged => ("file_changed", StatusCode::CONFLICT),
            Self::EditTextNotFound => ("edit_text_not_found", StatusCode::CONFLICT),
            Self::EditTextAmbiguous(_) => ("edit_text_ambiguous", StatusCode::CONFLICT),
            Self::NotReady(_) => ("not_ready", StatusCode::SERVICE_UNAVAILABLE),
            Self::StorageFull => ("storage_full", StatusCode::INSUFFICIENT_STORAGE),
            Self::Internal(_) => ("internal", StatusCode::INTERNAL_SERVER_ERROR),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::SourceRefConflict { .. } => Self::SourceRefConflict,
            StoreError::SourceRefDeleted { .. } => Self::MemoryDeleted,
            StoreError::RelationTargetMissing { target } => Self::RelationTargetNotFound(target),
            StoreError::TooManyRelations { relations } => {
                Self::Invalid(InvalidInput::TooMany { field: "relations", max: MAX_RELATIONS, actual: relations })
            }
            StoreError::RolledBack => Self::NotWritten,
            StoreError::FileChanged { .. } => Self::FileChanged,
            // The detail (an I/O error, a pool timeout) is the operator's, in the log.
            other if other.is_unavailable() => {
                tracing::warn!(error = %other, "database unavailable");
                Self::NotReady("the database is unavailable".into())
            }
            other if other.is_cancelled() => {
                tracing::warn!(error = %other, "a database statement was cancelled");
                Self::NotReady("a database statement ran past MNEMO_STATEMENT_TIMEOUT_S".into())
            }
            other if other.is_storage_full() => {
                tracing::error!(error = %other, "database out of disk space");
                Self::StorageFull
            }
            other => Self::Internal(other.to_string()),
        }
    }
}

impl From<mnemo_recall::RecallError> for ApiError {
    fn from(e: mnemo_recall::RecallError) -> Self {
        match e {
            mnemo_recall::RecallError::Scope(scope) => Self::Scope(scope),
            mnemo_recall::RecallError::Store(store) => store.into(),
        }
    }
}

impl ApiError {
    /// The body every error is answered with: `{error: {code, message}}`.
    pub fn body(&self) -> serde_json::Value {
        json!({ "error": { "code": self.code(), "message": self.to_string() } })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if let Self::Internal(detail) = &self {
            tracing::error!(error = %detail, "request failed");
        }
        let mut response = (status, Json(self.body())).into_response();
        if let Self::MethodNotAllowed(Some(allow)) = self {
            response.headers_mut().insert(axum::http::header::ALLOW, axum::http::HeaderValue::from_static(allow));
        }
        if let Self::RateLimited(wait) = self {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, retry_after_secs(&wait).into());
        }
        // RFC 6750 §3: a 401 names the scheme to authenticate with (MCP clients look for it).
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(axum::http::header::WWW_AUTHENTICATE, axum::http::HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// Whole seconds to wait, rounded up, at least one.
fn retry_after_secs(wait: &std::time::Duration) -> u64 {
    (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1)
}

#[cfg(test)]
mod tests {
    use mnemo_core::{FactScope, SourceKind};

    use super::*;

    /// One error of every variant, and of every `InvalidInput` and `ScopeError` variant wrapped
    /// (twice where the field decides the code). A new variant belongs here too.
    fn one_of_each() -> Vec<ApiError> {
        let field = "source_ref";
        vec![
            ApiError::MalformedJson("x".into()),
            ApiError::InvalidUtf8,
            ApiError::NotAnObject,
            ApiError::UnknownField("x".into()),
            ApiError::MissingField("content"),
            ApiError::InvalidField { field: "metadata", expected: "an object" },
            ApiError::TenantInBody("tenant_id".into()),
            ApiError::Invalid(InvalidInput::Empty { field: "content" }),
            ApiError::Invalid(InvalidInput::Empty { field }),
            ApiError::Invalid(InvalidInput::TooLong { field: "content", max: 1, actual: 2 }),
            ApiError::Invalid(InvalidInput::TooLong { field, max: 1, actual: 2 }),
            ApiError::Invalid(InvalidInput::NulByte { field }),
            ApiError::Invalid(InvalidInput::ControlChar { field }),
            ApiError::Invalid(InvalidInput::OutOfRange { field: "top_k", min: 1, max: 100 }),
            ApiError::Invalid(InvalidInput::UnknownValue { field: "scope", value: "x".into(), expected: "session" }),
            ApiError::Scope(ScopeError::MissingSession(SourceKind::ChatMessage)),
            ApiError::Scope(ScopeError::SessionMismatch),
            ApiError::Scope(ScopeError::SessionNotAllowed),
            ApiError::Scope(ScopeError::MissingIdentity(FactScope::User)),
            ApiError::Scope(ScopeError::AgentFactNeedsUser),
            ApiError::Scope(ScopeError::SystemMessageNeedsUser),
            ApiError::Scope(ScopeError::RecallWithoutSession),
            ApiError::Scope(ScopeError::WorkspaceNeedsAgent),
            ApiError::Scope(ScopeError::WorkspaceNeedsUser),
            ApiError::Scope(ScopeError::AgentMismatch),
            ApiError::Scope(ScopeError::AgentFileReadOnly),
            ApiError::Scope(ScopeError::RolesNotHeld),
            ApiError::Scope(ScopeError::DocumentChunkNeedsService),
            ApiError::Invalid(InvalidInput::BadPath { reason: "x" }),
            ApiError::Invalid(InvalidInput::TooMany { field: "tags", max: 16, actual: 17 }),
            ApiError::RelationTargetNotFound(uuid::Uuid::nil()),
            ApiError::BatchRejected(3),
            ApiError::NotWritten,
            ApiError::FileChanged,
            ApiError::EditTextNotFound,
            ApiError::EditTextAmbiguous(2),
            ApiError::UnsupportedMediaType,
            ApiError::PayloadTooLarge,
            ApiError::RequestTimeout,
            ApiError::RateLimited(std::time::Duration::from_millis(1500)),
            ApiError::MissingToken,
            ApiError::InvalidToken("x".into()),
            ApiError::TokenExpired,
            ApiError::NotFound,
            ApiError::MethodNotAllowed(None),
            ApiError::SourceRefConflict,
            ApiError::MemoryDeleted,
            ApiError::NotReady("x".into()),
            ApiError::StorageFull,
            ApiError::Internal("x".into()),
        ]
    }

    #[test]
    fn every_error_is_a_row_of_the_table_and_every_row_is_used() {
        let rows: Vec<(&str, u16)> = ERROR_CODES.iter().map(|(code, status, _)| (*code, *status)).collect();
        let mut codes: Vec<&str> = rows.iter().map(|(code, _)| *code).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), rows.len(), "duplicate codes in ERROR_CODES");
        let produced: Vec<(&str, u16)> = one_of_each().iter().map(|e| (e.code(), e.status().as_u16())).collect();
        for (error, pair) in one_of_each().iter().zip(&produced) {
            assert!(rows.contains(pair), "{error:?} answers {pair:?}, which is not a row of ERROR_CODES");
        }
        for row in &rows {
            assert!(produced.contains(row), "no error answers {row:?}");
        }
        assert_eq!(ApiError::Internal("secret detail".into()).to_string(), "internal error");
    }

    #[test]
    fn the_readme_lists_exactly_the_table() {
        let readme = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"));
        let listed: Vec<(String, u16, String)> = readme
            .lines()
            .skip_while(|line| line.trim() != "| code | status | meaning |")
            .skip(2)
            .take_while(|line| line.starts_with('|'))
            .map(|line| {
                let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
                let [code, status, meaning] = cells[..] else { panic!("not a row of three cells: {line}") };
                let status = status.parse().unwrap_or_else(|_| panic!("not a status: {line}"));
                (code.trim_matches('`').to_owned(), status, meaning.to_owned())
            })
            .collect();
        let table: Vec<(String, u16, String)> = ERROR_CODES
            .iter()
            .map(|(code, status, meaning)| ((*code).to_owned(), *status, (*meaning).to_owned()))
            .collect();
        for (readme, row) in listed.iter().zip(&table) {
            assert_eq!(readme, row, "README.md's error table differs from ERROR_CODES");
        }
        assert_eq!(listed.len(), table.len(), "README.md's error table and ERROR_CODES have different lengths");
    }

    /// The database out of reach is a 503 with its code, so a client retries; a query the
    /// database refused stays a 500.
    #[test]
    fn an_unreachable_database_is_not_ready() {
        for unavailable in [
            StoreError::Database(sqlx::Error::PoolTimedOut),
            StoreError::Database(sqlx::Error::Io(std::io::ErrorKind::ConnectionReset.into())),
            StoreError::Unavailable("connection reset".into()),
        ] {
            let e = ApiError::from(unavailable);
            assert_eq!((e.status(), e.code()), (StatusCode::SERVICE_UNAVAILABLE, "not_ready"), "{e}");
        }
        let refused = ApiError::from(StoreError::Database(sqlx::Error::RowNotFound));
        assert_eq!(refused.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }

    /// PostgreSQL's answer when it cannot extend a file, as sqlx hands it over.
    #[derive(Debug)]
    struct Refused(&'static str);

    impl std::fmt::Display for Refused {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "SQLSTATE {}", self.0)
        }
    }

    impl std::error::Error for Refused {}

    impl sqlx::error::DatabaseError for Refused {
        fn message(&self) -> &str {
            "could not extend file: No space left on device"
        }
        fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
            Some(self.0.into())
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    /// A database out of disk space is a 507 with its code, whether the write committed alone
    /// or with others; another refusal of class 53 is not.
    #[test]
    fn a_full_disk_is_storage_full() {
        for full in [
            StoreError::Database(sqlx::Error::Database(Box::new(Refused("53100")))),
            StoreError::StorageFull("could not extend file".into()),
        ] {
            let e = ApiError::from(full);
            assert_eq!((e.status(), e.code()), (StatusCode::INSUFFICIENT_STORAGE, "storage_full"), "{e}");
        }
        let out_of_memory = ApiError::from(StoreError::Database(sqlx::Error::Database(Box::new(Refused("53200")))));
        assert_eq!(out_of_memory.code(), "internal");
    }
}
