//! The contradiction judge's vocabulary: what a judge decides about each candidate, how a fact's
//! judgement ends, and the trait model providers implement.

use std::future::Future;
use std::pin::Pin;

use crate::ModelFailure;

/// The judge's decision about one older fact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The new fact makes the older one no longer true: retire it.
    Supersede,
    /// The new fact says what the older one says, in other words: retire the older copy, so one
    /// statement of it stays (seed 004 deduplicates what it keeps).
    Duplicate,
    /// Both can be true at once.
    Keep,
}

/// How a pending fact's judgement ended. Every judged row gets exactly one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JudgeOutcome {
    /// No live, older fact of its bucket was close enough (or shared its key).
    NoCandidates,
    /// Candidates were judged and every one kept.
    Kept,
    /// At least one older fact was retired.
    Superseded,
    /// The judge failed; nothing was retired.
    FailOpen,
    /// The model step is off (`MNEMO_JUDGE_MODEL` is empty); nothing was retired.
    Disabled,
}

impl JudgeOutcome {
    pub const ALL: [Self; 5] = [Self::NoCandidates, Self::Kept, Self::Superseded, Self::FailOpen, Self::Disabled];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoCandidates => "no_candidates",
            Self::Kept => "kept",
            Self::Superseded => "superseded",
            Self::FailOpen => "fail_open",
            Self::Disabled => "disabled",
        }
    }

    pub fn parse(raw: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|o| o.as_str() == raw)
    }
}

impl std::fmt::Display for JudgeOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

pub type JudgeFuture<'a> = Pin<Box<dyn Future<Output = Result<Vec<Verdict>, ModelFailure>> + Send + 'a>>;

/// Decides, for each older fact, whether a new fact supersedes it: one verdict per candidate, in
/// the candidates' order. A candidate the model said nothing about is kept; an answer that
/// cannot be read, or that only names candidates it was not given, is an error.
pub trait Judge: Send + Sync + std::fmt::Debug {
    /// The model's name, as recorded in audit rows.
    fn model(&self) -> &str;

    fn judge<'a>(&'a self, fact: &'a str, candidates: &'a [String]) -> JudgeFuture<'a>;
}
