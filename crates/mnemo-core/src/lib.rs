//! mnemo's domain: the types every other crate speaks in, each with a `parse()` constructor
//! that makes invalid values unrepresentable, and the deterministic `source_ref` rules that make
//! every write idempotent. No I/O lives here, and nothing here knows JSON or SQL.

// First: its `string_enum!` macro is used by the modules after it.
#[macro_use]
mod kinds;

mod compaction;
mod consolidation;
mod cron;
mod embed;
mod error;
mod extraction;
mod ids;
mod judge;
mod memory;
mod names;
mod principal;
mod recall;
mod retention;
mod signals;
mod source_ref;
mod text;
mod typed;
mod window;
mod workspace;

pub use compaction::{
    CompactionOutcome, CompactionTrigger, Keep, MAX_COMPACTION_MESSAGES, SUMMARY_SECTIONS, Summarizer, SummaryFuture,
    TOOL_PREVIEW_CHARS, TranscriptLine, check_summary, compaction_cut, preview, summary_source_ref, transcript,
    units_within,
};
pub use consolidation::{Consolidation, ConsolidationFuture, ConsolidationInput, Consolidator};
pub use cron::CronSchedule;
pub use embed::{EmbedError, EmbedFuture, Embedder, FailureClass, PREVIOUS_TURN_BYTES, embedding_text};
pub use error::{InvalidInput, ModelFailure};
pub use extraction::{
    ExtractedFact, Extraction, ExtractionFuture, ExtractionInput, Extractor, Gates, MAX_DAILY_ENTRY_CHARS,
    MAX_EXTRACTED_FACTS, SHOWN_FILE_BYTES, TRANSCRIPT_MESSAGE_CHARS, TRANSCRIPT_MESSAGES, TriggerSource,
    extracted_fact, extracted_typed, extraction_transcript, shown_file, with_daily_entry,
};
pub use ids::{AgentId, SessionId, TenantId, UserId};
pub use judge::{Judge, JudgeFuture, JudgeOutcome, Verdict};
pub use kinds::{FactScope, RecallScope, Scope, SourceKind};
pub use memory::{Extras, FactKey, Metadata, NewMemory, ScopeError, Turn};
pub use names::{AuditEvent, Queue};
pub use principal::Principal;
pub use recall::{MAX_QUERY_BYTES, MAX_TOP_K, RecallClass, RecallRequest, RerankError, RerankFuture, Reranker};
pub use retention::{AnonymizeReason, MAX_BATCH_SIZE, MAX_TTL_DAYS, POLICY_FIELDS, RetentionPolicy, SafetyFloor};
pub use signals::{SignalWeights, Signals, decay, signal_factor};
pub use source_ref::{SourceRef, fact_source_ref};
pub use text::{MAX_CONTENT_BYTES, MemoryText, StoredToolOutput, ToolOutputKey, ToolOutputText, quoted};
pub use typed::{
    Category, Label, Layer, MAX_ALLOWED_ROLES, MAX_LABEL_BYTES, MAX_RELATIONS, MAX_TAGS, Origin, Relation,
    RelationType, Typed, TypedInput, Unit, Visibility, fingerprint,
};
pub use window::{
    AskerCounter, DEFAULT_TOOL_NAME, MEMORY_PREFIX, MESSAGE_OVERHEAD_TOKENS, MIN_PART_TOKENS, ORPHAN_RESULT_PREFIX,
    Placed, Role, SUMMARY_PREFIX, Section, TokenCounter, USER_SYSTEM_PREFIX, Window, WindowError, WindowInput,
    WindowMessage, assemble, cut_to, history_room, sendable_call_id, tail_suffices, units_of,
};
pub use workspace::{
    CORE_FILES, FileKey, FileOwner, MAX_PATH_BYTES, MAX_PATH_DEPTH, MemoryNotes, NOTE_CHUNK_BYTES, PromptFile,
    Workspace, WorkspacePath, WorkspacePrompt, newest_part, note_chunks, render_files, render_prompt,
};
