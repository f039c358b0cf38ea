use crate::{AgentId, Label, SessionId, TenantId, UserId};

/// Who is calling, as proven by a verified token. The tenant of every read and write comes from
/// here and from nowhere else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub tenant: TenantId,
    /// A human user; absent for service accounts.
    pub user: Option<UserId>,
    pub agent: Option<AgentId>,
    pub session: Option<SessionId>,
    /// The token's `roles` claim: a memory with `allowed_roles` is read only by a token holding
    /// one of them.
    pub roles: Vec<Label>,
}

impl Principal {
    /// A service token: no user and no session. A session's token without a user carries no
    /// user either, but is not the service: it must not write what only the service may (an
    /// agent's facts, system messages, the agent's shared files).
    pub fn is_service(&self) -> bool {
        self.user.is_none() && self.session.is_none()
    }
}
