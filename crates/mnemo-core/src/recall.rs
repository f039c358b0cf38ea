//! What a recall asks for, validated, and the classes of rows it searches.

use std::future::Future;
use std::pin::Pin;

use crate::{
    AgentId, FactScope, InvalidInput, Principal, RecallScope, Scope, ScopeError, SessionId, SourceKind, UserId,
};

/// One class of rows a recall searches, bound to the caller's identity. The tenant is implied:
/// it is always the caller's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecallClass {
    /// Chat messages and tool outputs of the token's session.
    Session(SessionId),
    /// Document chunks of the tenant.
    Tenant,
    /// Facts remembered with scope user for the token's human user, and that user's workspace
    /// notes (MEMORY.md, daily notes) of the token's agent (none without one).
    User(UserId, Option<AgentId>),
    /// Facts remembered with scope agent by the token's agent.
    Agent(AgentId),
}

impl RecallClass {
    /// The scope of the rows in this class, which also names the class.
    pub fn scope(&self) -> Scope {
        match self {
            Self::Session(_) => Scope::Session,
            Self::Tenant => Scope::Tenant,
            Self::User(..) => Scope::User,
            Self::Agent(_) => Scope::Agent,
        }
    }
}

impl RecallScope {
    /// The classes this scope searches for `principal`. A single class whose identity the token
    /// lacks is refused; `any` searches the classes the token can reach.
    pub fn classes(self, principal: &Principal) -> Result<Vec<RecallClass>, ScopeError> {
        let session = principal.session.clone().map(RecallClass::Session);
        let user = principal.user.clone().map(|u| RecallClass::User(u, principal.agent.clone()));
        let agent = principal.agent.clone().map(RecallClass::Agent);
        Ok(match self {
            Self::Session => vec![session.ok_or(ScopeError::RecallWithoutSession)?],
            Self::Tenant => vec![RecallClass::Tenant],
            Self::User => vec![user.ok_or(ScopeError::MissingIdentity(FactScope::User))?],
            Self::Agent => vec![agent.ok_or(ScopeError::MissingIdentity(FactScope::Agent))?],
            Self::Any => [session, Some(RecallClass::Tenant), user, agent].into_iter().flatten().collect(),
        })
    }
}

/// The longest query accepted: queries are questions, not documents.
pub const MAX_QUERY_BYTES: usize = 4096;

/// The most items one recall returns, and the most candidates sent to a reranker.
pub const MAX_TOP_K: usize = 20;

/// A validated recall request. The tenant and identities are not here: they come from the token.
#[derive(Debug, Clone, PartialEq)]
pub struct RecallRequest {
    pub query: String,
    pub top_k: usize,
    /// Empty means every kind.
    pub source_kinds: Vec<SourceKind>,
    pub scope: RecallScope,
    pub enable_rerank: bool,
}

impl RecallRequest {
    /// A request with the defaults: top 5, every kind, scope any, rerank on.
    pub fn new(query: &str) -> Result<Self, InvalidInput> {
        if query.trim().is_empty() {
            return Err(InvalidInput::Empty { field: "query" });
        }
        if query.len() > MAX_QUERY_BYTES {
            return Err(InvalidInput::TooLong { field: "query", max: MAX_QUERY_BYTES, actual: query.len() });
        }
        if query.contains('\0') {
            return Err(InvalidInput::NulByte { field: "query" });
        }
        Ok(Self {
            query: query.to_owned(),
            top_k: 5,
            source_kinds: Vec::new(),
            scope: RecallScope::Any,
            enable_rerank: true,
        })
    }

    pub fn top_k(mut self, top_k: usize) -> Result<Self, InvalidInput> {
        if !(1..=MAX_TOP_K).contains(&top_k) {
            return Err(InvalidInput::OutOfRange { field: "top_k", min: 1, max: MAX_TOP_K as i64 });
        }
        self.top_k = top_k;
        Ok(self)
    }

    pub fn source_kinds(mut self, kinds: Vec<SourceKind>) -> Self {
        self.source_kinds = kinds;
        self.source_kinds.sort_by_key(|k| k.as_str());
        self.source_kinds.dedup();
        self
    }

    pub fn scope(mut self, scope: RecallScope) -> Self {
        self.scope = scope;
        self
    }

    pub fn enable_rerank(mut self, enable: bool) -> Self {
        self.enable_rerank = enable;
        self
    }
}

/// Why a rerank call failed: a short stable label ("timeout", "unreachable", "http_500",
/// "malformed") and a detail that never holds content.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {detail}")]
pub struct RerankError {
    pub kind: &'static str,
    pub detail: String,
}

pub type RerankFuture<'a> = Pin<Box<dyn Future<Output = Result<Vec<f32>, RerankError>> + Send + 'a>>;

/// Scores candidate texts against a query with a cross-encoder: one score per text, in the
/// texts' order, higher is more relevant.
pub trait Reranker: Send + Sync + std::fmt::Debug {
    fn rerank<'a>(&'a self, query: &'a str, texts: &'a [String]) -> RerankFuture<'a>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TenantId;

    fn principal(user: bool, agent: bool, session: bool) -> Principal {
        Principal {
            tenant: TenantId::parse("t").expect("tenant"),
            user: user.then(|| UserId::parse("u").expect("user")),
            agent: agent.then(|| AgentId::parse("a").expect("agent")),
            session: session.then(|| SessionId::parse("s").expect("session")),
            roles: Vec::new(),
        }
    }

    #[test]
    fn scopes_need_the_identity_they_search() {
        let service = principal(false, false, false);
        assert_eq!(RecallScope::Tenant.classes(&service), Ok(vec![RecallClass::Tenant]));
        assert_eq!(RecallScope::Any.classes(&service), Ok(vec![RecallClass::Tenant]));
        assert_eq!(RecallScope::User.classes(&service), Err(ScopeError::MissingIdentity(FactScope::User)));
        assert_eq!(RecallScope::Agent.classes(&service), Err(ScopeError::MissingIdentity(FactScope::Agent)));
        assert_eq!(RecallScope::Session.classes(&service), Err(ScopeError::RecallWithoutSession));
        let names: Vec<_> = RecallScope::Any
            .classes(&principal(true, true, true))
            .expect("any")
            .iter()
            .map(RecallClass::scope)
            .collect();
        assert_eq!(names, Scope::ALL);
    }

    #[test]
    fn requests_are_validated() {
        assert_eq!(RecallRequest::new("  ").unwrap_err(), InvalidInput::Empty { field: "query" });
        assert!(RecallRequest::new(&"x".repeat(MAX_QUERY_BYTES + 1)).is_err());
        let request = RecallRequest::new("where do I live").expect("query");
        assert_eq!((request.top_k, request.scope, request.enable_rerank), (5, RecallScope::Any, true));
        assert!(request.clone().top_k(0).is_err() && request.clone().top_k(21).is_err());
        assert_eq!(request.top_k(20).expect("20 is allowed").top_k, 20);
    }
}
