use std::future::Future;
use std::pin::Pin;

/// Whether retrying can help.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureClass {
    /// Timeouts, refused connections, 429 and 5xx answers: try again later.
    Transient,
    /// The provider refused this input or answered something unusable (4xx, a wrong dimension,
    /// a malformed body): retrying the same input will not help.
    Permanent,
}

/// Why an embedding call failed. `kind` is a short stable label for metrics and the row's
/// `embed_error` ("timeout", "http_500", "dimension_mismatch", …); `detail` never holds content.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {detail}")]
pub struct EmbedError {
    pub class: FailureClass,
    pub kind: &'static str,
    pub detail: String,
}

impl EmbedError {
    pub fn transient(kind: &'static str, detail: impl Into<String>) -> Self {
        Self { class: FailureClass::Transient, kind, detail: detail.into() }
    }

    pub fn permanent(kind: &'static str, detail: impl Into<String>) -> Self {
        Self { class: FailureClass::Permanent, kind, detail: detail.into() }
    }
}

pub type EmbedFuture<'a> = Pin<Box<dyn Future<Output = Result<Vec<Vec<f32>>, EmbedError>> + Send + 'a>>;

/// Turns texts into unit vectors, one per text, in order. Implementations batch internally as
/// their provider allows.
pub trait Embedder: Send + Sync + std::fmt::Debug {
    /// The model's name as stored beside each vector; switching it re-embeds in the background.
    fn model(&self) -> &str;

    /// The length of every vector this embedder returns.
    fn dimensions(&self) -> usize;

    fn embed<'a>(&'a self, texts: &'a [String]) -> EmbedFuture<'a>;
}
