//! mnemo's domain: the types every other crate speaks in, each with a `parse()` constructor
//! that makes invalid values unrepresentable, and the deterministic `source_ref` rules that make
//! every write idempotent. No I/O lives here, and nothing here knows JSON or SQL.

mod embed;
mod error;
mod ids;
mod kinds;
mod memory;
mod principal;
mod source_ref;
mod text;

pub use embed::{EmbedError, EmbedFuture, Embedder, FailureClass};
pub use error::InvalidInput;
pub use ids::{AgentId, SessionId, TenantId, UserId};
pub use kinds::{FactScope, Scope, SourceKind};
pub use memory::{Extras, FactKey, Metadata, NewMemory, ScopeError};
pub use principal::Principal;
pub use source_ref::{SourceRef, fact_source_ref};
pub use text::{MAX_CONTENT_BYTES, MemoryText, StoredToolOutput, ToolOutputKey, ToolOutputText};
