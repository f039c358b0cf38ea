//! Consolidation: the daily notes of an (agent, user) distilled into MEMORY.md by a model, the
//! curated layer replaced only when the model says so and the result fits its budget.

use std::future::Future;
use std::pin::Pin;

use chrono::NaiveDate;

use crate::ModelFailure;

/// What the model reads: the current MEMORY.md, the notes changed since the last consolidation
/// (oldest first), and the budget it must keep to: in tokens, as the answer is checked, and in
/// the characters that many tokens hold in this text, as the model is told (it can count those).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsolidationInput {
    pub memory: String,
    pub notes: Vec<(NaiveDate, String)>,
    pub max_tokens: u64,
    pub max_chars: usize,
}

/// What the model answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consolidation {
    pub should_update: bool,
    pub reason: String,
    /// The whole new MEMORY.md when `should_update`.
    pub memory_content: Option<String>,
}

pub type ConsolidationFuture<'a> = Pin<Box<dyn Future<Output = Result<Consolidation, ModelFailure>> + Send + 'a>>;

/// Distils notes into MEMORY.md. Implementations bound the answer; one they cannot read is an
/// error.
pub trait Consolidator: Send + Sync + std::fmt::Debug {
    fn model(&self) -> &str;

    fn consolidate<'a>(&'a self, input: &'a ConsolidationInput) -> ConsolidationFuture<'a>;
}
