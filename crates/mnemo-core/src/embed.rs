use std::future::Future;
use std::pin::Pin;

/// The most of a previous turn that goes into what is embedded: the model reads 256 tokens,
/// and the row's own words come first.
pub const PREVIOUS_TURN_BYTES: usize = 200;

/// What the model reads for a row: its content, then (for a chat message) the turn before it,
/// cut to [`PREVIOUS_TURN_BYTES`]. A turn alone loses its referents ("that", "she", "the
/// trip"); the previous turn puts them back in its vector while the stored content stays as it
/// was written. Content first, so the row's own words are never cut for its context.
pub fn embedding_text(content: &str, previous: Option<&str>) -> String {
    let Some(previous) = previous else { return content.to_owned() };
    let mut end = previous.len().min(PREVIOUS_TURN_BYTES);
    while !previous.is_char_boundary(end) {
        end -= 1;
    }
    format!("{content}\n{}", &previous[..end])
}

/// Whether retrying can help.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureClass {
    /// Timeouts, refused connections, 429 and 5xx answers, answers that cannot be used (a
    /// malformed body, vectors of the wrong dimension): the endpoint's fault, try again later.
    Transient,
    /// The provider refused this input (4xx): retrying the same input will not help.
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
    /// How long the endpoint asked to be left alone (its `Retry-After`): the least a retry waits.
    pub retry_after: Option<std::time::Duration>,
}

impl EmbedError {
    pub fn transient(kind: &'static str, detail: impl Into<String>) -> Self {
        Self { class: FailureClass::Transient, kind, detail: detail.into(), retry_after: None }
    }

    pub fn permanent(kind: &'static str, detail: impl Into<String>) -> Self {
        Self { class: FailureClass::Permanent, kind, detail: detail.into(), retry_after: None }
    }

    pub fn with_retry_after(self, retry_after: Option<std::time::Duration>) -> Self {
        Self { retry_after, ..self }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_previous_turn_follows_the_content_cut_on_a_character_boundary() {
        assert_eq!(embedding_text("Mel: she loved it", None), "Mel: she loved it");
        assert_eq!(
            embedding_text("Mel: she loved it", Some("Caro: my daughter's trip")),
            "Mel: she loved it\nCaro: my daughter's trip"
        );
        let long = "é".repeat(PREVIOUS_TURN_BYTES); // two bytes each
        let text = embedding_text("x", Some(&long));
        assert_eq!(text, format!("x\n{}", "é".repeat(PREVIOUS_TURN_BYTES / 2)));
        let odd = format!("a{long}");
        assert_eq!(embedding_text("x", Some(&odd)).len(), 2 + PREVIOUS_TURN_BYTES - 1, "cut before a split character");
    }
}
