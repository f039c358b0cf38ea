//! The names mnemo writes into its own tables: job queues and audit events. Each is spelled
//! once, here; the store, the worker, the config and the runbook all read these enums, so a new
//! queue or event is one variant and a forgotten use is a compile error (every `match` on them
//! is exhaustive).

use crate::InvalidInput;

string_enum!(
    /// A job queue. Adding one means a variant here, its job arguments in the store, its handler
    /// in the worker (an exhaustive match) and its default concurrency in the config.
    Queue, "queue" {
        Embed => "embed",
        Judge => "judge",
        Retention => "retention",
        Compact => "compact",
        Extract => "extract",
        Consolidate => "consolidate",
        Access => "access",
    }
);

string_enum!(
    /// What an audit row records. The judge's older names have no prefix; the log is
    /// append-only, so they keep the names they were first written with.
    AuditEvent, "event" {
        Supersede => "supersede",
        Revive => "revive",
        JudgeFailOpen => "judge_fail_open",
        JudgeClear => "judge_clear",
        Delete => "memory.delete",
        Anonymize => "memory.anonymize",
        AnonymizeRefused => "memory.anonymize.refused",
        AnonymizeAllowed => "memory.anonymize.allowed",
        EraseBegun => "memory.erase.begun",
        Erase => "memory.erase",
        WorkspaceChange => "workspace.change",
        Promote => "memory.promote",
        RetentionPolicy => "tenant.retention_policy",
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for q in Queue::ALL {
            assert_eq!(Queue::parse(q.as_str()), Ok(*q));
        }
        for e in AuditEvent::ALL {
            assert_eq!(AuditEvent::parse(e.as_str()), Ok(*e));
        }
        assert!(Queue::parse("compaction").is_err());
    }
}
