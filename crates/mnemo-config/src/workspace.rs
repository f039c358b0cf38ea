use std::path::PathBuf;

use std::time::Duration;

use mnemo_core::{CORE_FILES, CronSchedule, Gates, WorkspacePath};

use crate::{ConfigError, Env, Problems, vars};

/// Agent workspaces: how large a file may be, what the core files start as, and how much of a
/// prompt the files may take.
#[derive(Debug, Clone)]
pub struct WorkspaceSettings {
    pub max_file_bytes: usize,
    /// The content each core file is created with, in `CORE_FILES` order.
    pub templates: Vec<(WorkspacePath, String)>,
    /// The most tokens the enabled files take in a prompt.
    pub prompt_max_tokens: u64,
    /// Days of daily notes under `## Recent Context`.
    pub recent_days: u32,
    pub extraction: ExtractionSettings,
    pub consolidation: ConsolidationSettings,
    pub maintenance: MaintenanceSettings,
}

/// Background maintenance on the housekeeping schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaintenanceSettings {
    pub interval: Duration,
    /// Daily notes older than this many days move to `memory/archive/` (0: never).
    pub note_retention_days: u32,
    /// Session messages older than this many days are soft-deleted (0: never).
    pub session_retention_days: u32,
    /// No archive grows past this (`MNEMO_WORKSPACE_MAX_FILE_BYTES`): a note that would take its
    /// day's archive past it stays where it is.
    pub max_file_bytes: usize,
}

/// Consolidation of daily notes into MEMORY.md.
#[derive(Debug, Clone)]
pub struct ConsolidationSettings {
    /// Off: no run reads a note or asks a model, and nothing is scheduled.
    pub enabled: bool,
    /// Only notes of this many recent days are read.
    pub day_range: u32,
    /// MEMORY.md is replaced only by a result within this many tokens,
    pub max_memory_tokens: u64,
    /// and this many bytes (the workspace's file limit, `MNEMO_WORKSPACE_MAX_FILE_BYTES`).
    pub max_file_bytes: usize,
    /// Extraction asks for a consolidation at most this often per (agent, user).
    pub throttle: Duration,
    /// When every (agent, user) with daily notes is consolidated (UTC); `None` never.
    pub schedule: Option<CronSchedule>,
}

impl ConsolidationSettings {
    /// How often at most an extraction asks for a consolidation; never when consolidation is off.
    pub fn after_extraction(&self) -> Option<Duration> {
        self.enabled.then_some(self.throttle)
    }
}

/// The most user and assistant messages the extraction gates may ask a conversation for.
pub const MAX_EXTRACT_MIN_MESSAGES: usize = 1000;

/// The longest retention of daily notes and session messages, in days (0 keeps them for ever).
const MAX_RETENTION_DAYS: u32 = 36_500;

/// The longest cooldown or throttle, in seconds (30 days): the database adds them to times, and
/// a throttle doubles after failed runs.
const MAX_WAIT_S: u64 = 30 * 86_400;

/// Extraction after a conversation.
#[derive(Debug, Clone)]
pub struct ExtractionSettings {
    /// Off: completed conversations are not extracted (the endpoint says so).
    pub enabled: bool,
    pub gates: Gates,
    /// The least time between two extractions of one (agent, user).
    pub cooldown: Duration,
    /// Failed attempts after which a conversation is given up (and listed by the runbook).
    pub max_attempts: i32,
    /// Let extraction replace MEMORY.md too (MateClaw); by default only consolidation does.
    pub update_memory: bool,
    /// Ask for the extraction of what each compaction covers.
    pub before_compaction: bool,
}

impl ExtractionSettings {
    /// The gates a compaction's messages pass to be extracted, or `None` when compactions ask
    /// for no extraction.
    pub fn before_compaction(&self) -> Option<Gates> {
        (self.enabled && self.before_compaction).then_some(self.gates)
    }
}

/// What the core files say until someone writes them.
fn default_template(name: &str) -> &'static str {
    match name {
        "AGENTS.md" => "# AGENTS.md\n\nHow this agent works: its role, its tools and the rules it follows.\n",
        "SOUL.md" => "# SOUL.md\n\nThe agent's personality, tone and values.\n",
        "PROFILE.md" => "# PROFILE.md\n\nWhat the agent knows about this user: name, preferences, context.\n",
        _ => "# MEMORY.md\n\nLong-term memory: durable facts and decisions worth keeping across sessions.\n",
    }
}

impl WorkspaceSettings {
    pub(crate) fn read(env: &Env, problems: &mut Problems) -> Self {
        let max_file_bytes = problems.parsed(env, vars::WORKSPACE_MAX_FILE_BYTES, 256 * 1024usize, "a number of bytes");
        if !(1024..=16 * 1024 * 1024).contains(&max_file_bytes) {
            problems
                .0
                .push(format!("{}={max_file_bytes} must be between 1024 and 16777216", vars::WORKSPACE_MAX_FILE_BYTES));
        }
        let prompt_max_tokens = problems.parsed(env, vars::WORKSPACE_PROMPT_MAX_TOKENS, 4000u64, "a whole number");
        let recent_days = problems.parsed(env, vars::MEMORY_RECENT_DAYS, 7u32, "a whole number of days");
        if recent_days > 366 {
            problems.0.push(format!("{}={recent_days} must be at most 366", vars::MEMORY_RECENT_DAYS));
        }
        let dir = env.get(vars::WORKSPACE_TEMPLATES_DIR).map(PathBuf::from);
        let templates = CORE_FILES
            .iter()
            .map(|(name, _)| {
                let path = WorkspacePath::parse(name).expect("core file names are valid paths");
                let content = match &dir {
                    Some(dir) => std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| {
                        problems.0.push(format!("{}: cannot read {name}: {e}", vars::WORKSPACE_TEMPLATES_DIR));
                        String::new()
                    }),
                    None => default_template(name).to_owned(),
                };
                (path, content)
            })
            .collect();
        let bool_var =
            |problems: &mut Problems, name: &str, default: bool| problems.parsed(env, name, default, "true or false");
        let extraction = ExtractionSettings {
            enabled: bool_var(problems, vars::EXTRACT_ENABLED, true),
            gates: Gates {
                skip_cron: bool_var(problems, vars::EXTRACT_SKIP_CRON, true),
                min_messages: problems.bounded(
                    env,
                    vars::EXTRACT_MIN_MESSAGES,
                    4usize,
                    0..=MAX_EXTRACT_MIN_MESSAGES,
                    "a whole number",
                ),
                min_last_user_chars: problems.parsed(env, vars::EXTRACT_MIN_USER_CHARS, 10usize, "a whole number"),
            },
            cooldown: Duration::from_secs(problems.bounded(
                env,
                vars::EXTRACT_COOLDOWN_S,
                300u64,
                0..=MAX_WAIT_S,
                "a number of seconds",
            )),
            max_attempts: problems.bounded(env, vars::EXTRACT_MAX_ATTEMPTS, 3i32, 1..=100, "a whole number"),
            update_memory: bool_var(problems, vars::EXTRACT_UPDATE_MEMORY, false),
            before_compaction: bool_var(problems, vars::EXTRACT_BEFORE_COMPACTION, true),
        };
        let consolidate = bool_var(problems, vars::CONSOLIDATE_ENABLED, true);
        let consolidation = ConsolidationSettings {
            enabled: consolidate,
            day_range: problems.bounded(env, vars::CONSOLIDATE_DAY_RANGE, 7u32, 1..=366, "a whole number of days"),
            max_memory_tokens: problems.bounded(
                env,
                vars::CONSOLIDATE_MAX_MEMORY_TOKENS,
                4000u64,
                100..=1_000_000,
                "a whole number",
            ),
            max_file_bytes,
            throttle: Duration::from_secs(problems.bounded(
                env,
                vars::CONSOLIDATE_THROTTLE_S,
                1800u64,
                0..=MAX_WAIT_S,
                "a number of seconds",
            )),
            schedule: match env.get(vars::CONSOLIDATE_CRON).map(str::trim) {
                _ if !consolidate => None,
                Some("off") => None,
                raw => match CronSchedule::parse(raw.unwrap_or("0 2 * * *")) {
                    Ok(schedule) => Some(schedule),
                    Err(e) => {
                        problems.0.push(format!("{}: {e}", vars::CONSOLIDATE_CRON));
                        None
                    }
                },
            },
        };
        let maintenance = MaintenanceSettings {
            interval: Duration::from_secs(problems.bounded(
                env,
                vars::MAINTENANCE_INTERVAL_S,
                6 * 3600u64,
                1..=30 * 86_400,
                "a number of seconds",
            )),
            // At most a century: a cut-off further back is before the earliest day dates (and
            // PostgreSQL's timestamps) reach, and failed every maintenance run.
            note_retention_days: problems.bounded(
                env,
                vars::DAILY_NOTE_RETENTION_DAYS,
                90u32,
                0..=MAX_RETENTION_DAYS,
                "a whole number of days",
            ),
            session_retention_days: problems.bounded(
                env,
                vars::SESSION_RETENTION_DAYS,
                180u32,
                0..=MAX_RETENTION_DAYS,
                "a whole number of days",
            ),
            max_file_bytes,
        };
        let (kept, read) = (maintenance.note_retention_days, consolidation.day_range);
        if kept > 0 && kept < read {
            problems.0.push(format!(
                "{} ({kept}) is under {} ({read}): notes would be archived before consolidation reads them",
                vars::DAILY_NOTE_RETENTION_DAYS,
                vars::CONSOLIDATE_DAY_RANGE
            ));
        }
        Self { max_file_bytes, templates, prompt_max_tokens, recent_days, extraction, consolidation, maintenance }
    }

    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        Problems::read_all(env, Self::read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_come_built_in_or_from_a_directory() {
        let settings = WorkspaceSettings::from_env(&Env::default()).expect("defaults");
        assert_eq!(settings.max_file_bytes, 262_144);
        assert!(settings.templates[3].1.starts_with("# MEMORY.md"));
        assert!(settings.consolidation.schedule.is_some(), "nightly by default");
        let off = WorkspaceSettings::from_env(&Env::from_pairs([(vars::CONSOLIDATE_CRON, "off")])).expect("off");
        assert!(off.consolidation.schedule.is_none());
        let disabled = WorkspaceSettings::from_env(&Env::from_pairs([(vars::CONSOLIDATE_ENABLED, "false")]));
        let disabled = disabled.expect("disabled").consolidation;
        assert!(!disabled.enabled && disabled.schedule.is_none(), "switched off, nothing is scheduled");
        assert_eq!(settings.extraction.before_compaction(), Some(settings.extraction.gates), "on by default");
        for off in [vars::EXTRACT_BEFORE_COMPACTION, vars::EXTRACT_ENABLED] {
            let settings = WorkspaceSettings::from_env(&Env::from_pairs([(off, "false")])).expect("off");
            assert_eq!(settings.extraction.before_compaction(), None, "{off}");
        }
        let bad = WorkspaceSettings::from_env(&Env::from_pairs([(vars::CONSOLIDATE_CRON, "every night")]));
        assert!(bad.unwrap_err().to_string().contains(vars::CONSOLIDATE_CRON));
        let missing = Env::from_pairs([(vars::WORKSPACE_TEMPLATES_DIR, "/nonexistent-mnemo-templates")]);
        let err = WorkspaceSettings::from_env(&missing).unwrap_err().to_string();
        assert!(err.contains("cannot read AGENTS.md"), "{err}");
    }

    #[test]
    fn notes_are_kept_at_least_as_long_as_consolidation_reads_them() {
        let read = |range: &str, kept: &str| {
            WorkspaceSettings::from_env(&Env::from_pairs([
                (vars::CONSOLIDATE_DAY_RANGE, range),
                (vars::DAILY_NOTE_RETENTION_DAYS, kept),
            ]))
        };
        let err = read("30", "10").unwrap_err().to_string();
        assert!(err.contains(vars::DAILY_NOTE_RETENTION_DAYS) && err.contains("archived"), "{err}");
        assert!(read("30", "30").is_ok() && read("30", "0").is_ok(), "equal, or never archived");
    }
}
