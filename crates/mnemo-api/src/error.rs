use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use mnemo_core::{InvalidInput, ScopeError};
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
    #[error("the request body is over the server's limit (see MNEMO_MAX_TOOL_OUTPUT_BYTES)")]
    PayloadTooLarge,
    #[error("missing bearer token: send Authorization: Bearer <JWT>")]
    MissingToken,
    #[error("invalid token: {0}")]
    InvalidToken(String),
    #[error("the token has expired")]
    TokenExpired,
    #[error("not found")]
    NotFound,
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("source_ref already names a row with different content")]
    SourceRefConflict,
    #[error("source_ref names a memory that was deleted; it is anonymized after the retention period")]
    MemoryDeleted,
    #[error("not ready: {0}")]
    NotReady(String),
    /// The detail is logged, never sent.
    #[error("internal error")]
    Internal(String),
}

/// The error-code table: code, HTTP status, meaning. Documented in the README.
pub const ERROR_CODES: &[(&str, u16, &str)] = &[
    ("malformed_json", 400, "the body is not JSON"),
    ("invalid_utf8", 400, "the body is not UTF-8"),
    ("not_an_object", 400, "the body is JSON but not an object"),
    ("unknown_field", 400, "the body has a field this endpoint does not take"),
    ("missing_field", 400, "a required field is absent"),
    ("invalid_field", 400, "a field has the wrong type, or an id is empty, too long or has control characters"),
    ("invalid_value", 400, "a field has a value outside its allowed set (source_kind, scope)"),
    ("tenant_in_body", 400, "the body names a tenant; the tenant comes only from the token"),
    ("empty_content", 400, "content is empty or only white space"),
    ("content_too_long", 400, "content is over its limit (16 KiB; tool outputs: MNEMO_MAX_TOOL_OUTPUT_BYTES)"),
    ("nul_byte", 400, "a string contains a NUL character"),
    ("missing_session", 400, "a session-scoped write has no session_id and the token no sid"),
    ("session_not_allowed", 400, "a tenant-scoped write names a session"),
    ("missing_token", 401, "no bearer token"),
    ("invalid_token", 401, "the token is malformed, forged, lacks a required claim, or an id in it is invalid"),
    ("token_expired", 401, "the token's exp has passed"),
    ("missing_identity", 401, "the scope needs a user (sub), agent or session (sid) claim the token lacks"),
    ("session_mismatch", 403, "the token is bound to another session"),
    ("not_found", 404, "no such route or resource for this tenant"),
    ("method_not_allowed", 405, "the route exists with another method"),
    ("source_ref_conflict", 409, "the source_ref already holds different content"),
    ("memory_deleted", 409, "the source_ref names a deleted row (facts are revived instead)"),
    ("payload_too_large", 413, "the request body is over the server's limit"),
    ("unsupported_media_type", 415, "Content-Type is not application/json"),
    ("internal", 500, "something failed inside mnemo; details are in its log"),
    ("not_ready", 503, "the database is unreachable or its schema is not current"),
];

impl ApiError {
    pub fn code(&self) -> &'static str {
        match self {
            Self::MalformedJson(_) => "malformed_json",
            Self::InvalidUtf8 => "invalid_utf8",
            Self::NotAnObject => "not_an_object",
            Self::UnknownField(_) => "unknown_field",
            Self::MissingField(_) => "missing_field",
            Self::InvalidField { .. } => "invalid_field",
            Self::TenantInBody(_) => "tenant_in_body",
            Self::Invalid(invalid) => match invalid {
                InvalidInput::NulByte { .. } => "nul_byte",
                InvalidInput::Empty { field: "content" } => "empty_content",
                InvalidInput::TooLong { field: "content", .. } => "content_too_long",
                InvalidInput::UnknownValue { .. } => "invalid_value",
                InvalidInput::Empty { .. }
                | InvalidInput::TooLong { .. }
                | InvalidInput::ControlChar { .. }
                | InvalidInput::OutOfRange { .. } => "invalid_field",
            },
            Self::Scope(scope) => match scope {
                ScopeError::MissingSession(_) => "missing_session",
                ScopeError::SessionMismatch => "session_mismatch",
                ScopeError::SessionNotAllowed => "session_not_allowed",
                ScopeError::MissingIdentity(_) | ScopeError::RecallWithoutSession => "missing_identity",
            },
            Self::UnsupportedMediaType => "unsupported_media_type",
            Self::PayloadTooLarge => "payload_too_large",
            Self::MissingToken => "missing_token",
            Self::InvalidToken(_) => "invalid_token",
            Self::TokenExpired => "token_expired",
            Self::NotFound => "not_found",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::SourceRefConflict => "source_ref_conflict",
            Self::MemoryDeleted => "memory_deleted",
            Self::NotReady(_) => "not_ready",
            Self::Internal(_) => "internal",
        }
    }

    pub fn status(&self) -> StatusCode {
        let code = self.code();
        let status = ERROR_CODES.iter().find(|(c, _, _)| *c == code).map_or(500, |(_, status, _)| *status);
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::SourceRefConflict { .. } => Self::SourceRefConflict,
            StoreError::SourceRefDeleted { .. } => Self::MemoryDeleted,
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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if let Self::Internal(detail) = &self {
            tracing::error!(error = %detail, "request failed");
        }
        let body = json!({ "error": { "code": self.code(), "message": self.to_string() } });
        (status, Json(body)).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_exactly_one_row_in_the_table() {
        let mut codes: Vec<&str> = ERROR_CODES.iter().map(|(c, _, _)| *c).collect();
        codes.sort_unstable();
        let before = codes.len();
        codes.dedup();
        assert_eq!(before, codes.len(), "duplicate codes in ERROR_CODES");
        let samples = [
            ApiError::InvalidUtf8,
            ApiError::Invalid(InvalidInput::NulByte { field: "source_ref" }),
            ApiError::Scope(ScopeError::SessionMismatch),
            ApiError::Internal("x".into()),
        ];
        for e in samples {
            assert!(codes.contains(&e.code()), "{} has no row", e.code());
        }
        assert_eq!(ApiError::Scope(ScopeError::SessionMismatch).status(), StatusCode::FORBIDDEN);
        assert_eq!(ApiError::Internal("secret detail".into()).to_string(), "internal error");
    }
}
