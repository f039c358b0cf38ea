/// Why a value was refused by a `parse()` constructor. `field` names the input it came from, so
/// the API can say which part of a request was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidInput {
    #[error("{field} must not be empty")]
    Empty { field: &'static str },
    #[error("{field} is {actual} bytes; the limit is {max}")]
    TooLong { field: &'static str, max: usize, actual: usize },
    #[error("{field} contains a NUL byte")]
    NulByte { field: &'static str },
    #[error("{field} contains a control character")]
    ControlChar { field: &'static str },
    #[error("{field} must be between {min} and {max}")]
    OutOfRange { field: &'static str, min: i64, max: i64 },
    #[error("{field} has {actual} entries; the limit is {max}")]
    TooMany { field: &'static str, max: usize, actual: usize },
    #[error("{field} has an unknown value {value:?}; expected one of {expected}")]
    UnknownValue { field: &'static str, value: String, expected: &'static str },
    #[error("invalid workspace path: {reason}")]
    BadPath { reason: &'static str },
    #[error("{field} must not end in {suffix:?} nor hold it before a '|': mnemo keeps those for anonymized rows")]
    ReservedSuffix { field: &'static str, suffix: &'static str },
}

impl InvalidInput {
    pub fn field(&self) -> &'static str {
        match self {
            Self::Empty { field }
            | Self::TooLong { field, .. }
            | Self::NulByte { field }
            | Self::ControlChar { field }
            | Self::OutOfRange { field, .. }
            | Self::TooMany { field, .. }
            | Self::UnknownValue { field, .. }
            | Self::ReservedSuffix { field, .. } => field,
            Self::BadPath { .. } => "path",
        }
    }
}

/// Why a model call failed (the judge, the summarizer): a short stable label for metrics, audit
/// rows and compaction records ("timeout", "http_5xx", "truncated", "unparsable", …) and a
/// detail that never holds content.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {detail}")]
pub struct ModelFailure {
    pub kind: &'static str,
    pub detail: String,
    /// How long the endpoint asked to be left alone (its `Retry-After`): the least a retry waits.
    pub retry_after: Option<std::time::Duration>,
}

impl ModelFailure {
    pub fn new(kind: &'static str, detail: impl Into<String>) -> Self {
        Self { kind, detail: detail.into(), retry_after: None }
    }

    pub fn with_retry_after(self, retry_after: Option<std::time::Duration>) -> Self {
        Self { retry_after, ..self }
    }

    /// Whether the failure is the endpoint's state (unreachable, overloaded, refusing the key,
    /// missing the model, answering with something that is no chat completion at all, such as a
    /// gateway's HTML page: the model's words are inside the completion), which mending the
    /// endpoint ends, and says nothing about the input. A timeout is not: a long input can
    /// cause it.
    pub fn is_endpoint_state(&self) -> bool {
        Self::is_endpoint_state_kind(self.kind)
    }

    /// [`Self::is_endpoint_state`] of a failure recorded by its kind.
    pub fn is_endpoint_state_kind(kind: &str) -> bool {
        matches!(kind, "connection" | "http_429" | "http_5xx" | "unauthorized" | "model_missing" | "malformed_response")
    }

    /// Whether the failure may pass on its own: the endpoint unreachable, overloaded or refusing
    /// the key for now, or too slow this once. An answer that cannot be used is not: the same
    /// input would draw the same answer.
    pub fn may_pass(&self) -> bool {
        self.is_endpoint_state() || self.kind == "timeout"
    }

    /// Whether the server may have refused what was asked (a 400 or 422; some servers answer 500
    /// to an answer format they cannot follow), so that asking otherwise may be answered. A
    /// 502, 503 or 504 is a gateway's or the endpoint's state: asking again at once would pile
    /// calls onto it.
    /// An answer asking for a wait (Retry-After) says the endpoint is busy: asking otherwise at
    /// once would not help.
    pub fn may_refuse_the_request(&self) -> bool {
        self.retry_after.is_none()
            && ["HTTP 400:", "HTTP 422:", "HTTP 500:"].iter().any(|status| self.detail.starts_with(status))
    }
}
