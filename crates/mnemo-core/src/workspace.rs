//! An agent's workspace: markdown files kept per tenant and agent, and per user where the
//! content is about a user. The ownership rule: `PROFILE.md`, `MEMORY.md` and everything under
//! `memory/` (daily notes, their archive) belong to the (agent, user) pair, so one user's
//! profile never reaches another user; every other file (`AGENTS.md`, `SOUL.md`, files an agent
//! adds) belongs to the agent and is shared by its users.
//!
//! Paths are relative, `.md`, without `..`, backslashes or control characters, bounded in
//! length and depth. Rendering for a prompt is pure: the enabled files in sort order, in the
//! seeds' `--- FILENAME ---` format, within a token budget.

use chrono::NaiveDate;

use crate::{AgentId, InvalidInput, Principal, ScopeError, TenantId, TokenCounter, UserId, cut_to};

/// The longest path accepted, in bytes, and the most segments.
pub const MAX_PATH_BYTES: usize = 200;
pub const MAX_PATH_DEPTH: usize = 4;

/// The files every workspace starts with, enabled, in this order, with their sort orders.
pub const CORE_FILES: [(&str, i32); 4] = [("AGENTS.md", 0), ("SOUL.md", 1), ("PROFILE.md", 2), ("MEMORY.md", 3)];

/// A checked workspace path such as `MEMORY.md` or `memory/2026-04-01.md`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkspacePath(String);

/// Who the file at `path` belongs to. Case variants (`profile.md`, `Memory/…`) are a user's
/// too, so they never become shared.
fn owner_of(path: &str) -> FileOwner {
    if path.eq_ignore_ascii_case("profile.md") || path.eq_ignore_ascii_case("memory.md") || is_under_memory(path) {
        FileOwner::User
    } else {
        FileOwner::Agent
    }
}

/// Whether `path` is under `memory/`, in any case (`Memory/x.md` too): a user's file there goes
/// into no prompt as a file, and a new one named for a day must be a daily note of a real day.
pub fn is_under_memory(path: &str) -> bool {
    path.get(..7).is_some_and(|prefix| prefix.eq_ignore_ascii_case("memory/"))
}

/// A note as a model is shown it: whole, or its last `max_chars` characters after a marker saying
/// how many came before (a note is added to at its end, so its newest part is the tail).
pub fn newest_part(note: &str, max_chars: usize) -> String {
    let total = note.chars().count();
    if total <= max_chars {
        return note.to_owned();
    }
    let tail: String = note.chars().skip(total - max_chars).collect();
    format!("…[{} earlier characters of this note left out]…\n{tail}", total - max_chars)
}

/// Who a workspace file belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileOwner {
    /// The agent: shared by all its users.
    Agent,
    /// The (agent, user) pair.
    User,
}

impl WorkspacePath {
    pub fn parse(raw: &str) -> Result<Self, InvalidInput> {
        let bad = |reason| Err(InvalidInput::BadPath { reason });
        if raw.is_empty() {
            return bad("the path is empty");
        }
        if raw.len() > MAX_PATH_BYTES {
            return bad("the path is over 200 bytes");
        }
        // Control, format (zero-width, bidi) and line/paragraph separator characters would hide
        // in a listing or break a prompt's `--- NAME ---` line.
        if raw.chars().any(|c| {
            c.is_control()
                || matches!(c, '\u{200B}'..='\u{200F}' | '\u{2028}'..='\u{202E}' | '\u{2060}'..='\u{206F}' | '\u{FEFF}')
        }) {
            return bad("the path has a control or invisible character");
        }
        if raw.contains('\\') {
            return bad("the path has a backslash");
        }
        if raw.starts_with('/') {
            return bad("the path is absolute");
        }
        if !raw.ends_with(".md") {
            return bad("only .md files");
        }
        let segments: Vec<&str> = raw.split('/').collect();
        if segments.len() > MAX_PATH_DEPTH {
            return bad("the path is more than 4 levels deep");
        }
        if segments.iter().any(|s| s.is_empty() || *s == "." || *s == "..") {
            return bad("the path has an empty, . or .. segment");
        }
        if segments.last().is_some_and(|name| name.len() <= 3) {
            return bad("the file name is empty");
        }
        Ok(Self(raw.to_owned()))
    }

    /// Refuses a file to be written under a name shaped as a daily note that names no real day, or
    /// a day more than one after `today` (UTC; the day of slack is for writers ahead of UTC): its
    /// day decides when it is archived, and a note of a day to come would stay forever. Files
    /// stored before this rule keep their names, and can still be read and deleted.
    pub fn check_new_name(&self, today: NaiveDate) -> Result<(), InvalidInput> {
        let dated = is_under_memory(&self.0) && self.0[7..].strip_suffix(".md").is_some_and(is_dated);
        match self.note_day() {
            None if dated => Err(InvalidInput::BadPath {
                reason: "a daily note's name must be memory/YYYY-MM-DD.md, in lowercase, of a real day",
            }),
            Some(day) if day > today + chrono::Days::new(1) => {
                Err(InvalidInput::BadPath { reason: "a daily note may be dated at most one day after today (UTC)" })
            }
            _ => Ok(()),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn owner(&self) -> FileOwner {
        owner_of(&self.0)
    }

    /// The daily note of `day`: `memory/YYYY-MM-DD.md`.
    pub fn daily_note(day: NaiveDate) -> Self {
        Self(format!("memory/{}.md", day.format("%Y-%m-%d")))
    }

    /// The day of a daily note (`memory/YYYY-MM-DD.md`), if this is one.
    pub fn note_day(&self) -> Option<NaiveDate> {
        day_of(self.0.strip_prefix("memory/")?.strip_suffix(".md")?)
    }

    /// Whether the name is one mnemo gives (a core file, a daily note or its archive), which says
    /// nothing of what the file holds; other names are their writer's.
    pub fn is_standard_name(&self) -> bool {
        let archived = self.0.strip_prefix("memory/archive/").and_then(|r| r.strip_suffix(".md"));
        self.core_sort_order().is_some() || self.note_day().is_some() || archived.and_then(day_of).is_some()
    }

    /// Whether recall searches this file (when it is a user's): `MEMORY.md` and the daily notes.
    pub fn is_recallable(&self) -> bool {
        self.0 == "MEMORY.md" || self.note_day().is_some()
    }

    /// The sort order a core file starts with.
    pub fn core_sort_order(&self) -> Option<i32> {
        CORE_FILES.iter().find(|(name, _)| *name == self.0).map(|(_, order)| *order)
    }
}

impl std::fmt::Display for WorkspacePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// For values read back from storage.
impl TryFrom<String> for WorkspacePath {
    type Error = InvalidInput;

    fn try_from(raw: String) -> Result<Self, InvalidInput> {
        Self::parse(&raw)
    }
}

/// One workspace file, as the caller's token reaches it: its tenant and agent, and its user when
/// the file is about a user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileKey {
    pub tenant: TenantId,
    pub agent: AgentId,
    /// `None` for the agent's own files.
    pub user: Option<UserId>,
    pub path: WorkspacePath,
}

/// The tenant, agent and user whose workspace a token reaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workspace {
    pub tenant: TenantId,
    pub agent: AgentId,
    /// Without a user, only the agent's own files are reachable.
    pub user: Option<UserId>,
}

impl Workspace {
    /// The workspace of the token's agent (claim `agent`) and user (claim `sub`).
    pub fn of(principal: &Principal) -> Result<Self, ScopeError> {
        let agent = principal.agent.clone().ok_or(ScopeError::WorkspaceNeedsAgent)?;
        Ok(Self { tenant: principal.tenant.clone(), agent, user: principal.user.clone() })
    }

    /// The key of `path` here: a file about a user needs the token's user.
    pub fn file(&self, path: WorkspacePath) -> Result<FileKey, ScopeError> {
        let user = match path.owner() {
            FileOwner::Agent => None,
            FileOwner::User => Some(self.user.clone().ok_or(ScopeError::WorkspaceNeedsUser)?),
        };
        Ok(FileKey { tenant: self.tenant.clone(), agent: self.agent.clone(), user, path })
    }
}

/// The most bytes one recall chunk of a file holds.
pub const NOTE_CHUNK_BYTES: usize = 1500;

/// `content` in pieces of at most `max` bytes for recall, cut between paragraphs where it can,
/// else between lines, else between characters. Pieces are greedy from the start, so appending
/// to a file changes only its last pieces. Pieces with nothing but headings (an empty template,
/// a note's `# YYYY-MM-DD`) say nothing to recall and are left out.
pub fn note_chunks(content: &str, max: usize) -> Vec<&str> {
    let mut chunks = Vec::new();
    let mut rest = content;
    while !rest.trim().is_empty() {
        let mut end = rest.len();
        if end > max {
            let head = &rest[..rest.floor_char_boundary(max)];
            end = [head.rfind("\n\n").map(|i| i + 2), head.rfind('\n').map(|i| i + 1)]
                .into_iter()
                .flatten()
                .find(|&i| i > 0)
                .unwrap_or(head.len().max(rest.ceil_char_boundary(1)));
        }
        let (chunk, tail) = rest.split_at(end);
        if chunk.lines().any(|line| !line.trim().is_empty() && !line.trim_start().starts_with('#')) {
            chunks.push(chunk.trim());
        }
        rest = tail;
    }
    chunks
}

/// A file to render: its path and content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptFile<'a> {
    pub path: &'a str,
    pub content: &'a str,
}

/// `files` (enabled, in sort order) as `--- NAME ---` blocks within `budget` tokens: a file that
/// does not fit whole is cut in the middle to what is left, and the files after it are left out.
/// Empty files are skipped.
pub fn render_files(files: &[PromptFile<'_>], budget: u64, counter: &dyn TokenCounter) -> String {
    let mut out = String::new();
    let mut left = budget;
    for file in files.iter().filter(|f| !f.content.trim().is_empty()) {
        let header = format!("--- {} ---\n", file.path);
        let header_tokens = u64::from(counter.count(&header)) + 1;
        if left <= header_tokens + 8 {
            break;
        }
        let body = cut_to(file.content.trim_end(), left - header_tokens - 1, counter);
        let block = format!("{header}{body}\n\n");
        left = left.saturating_sub(u64::from(counter.count(&block)));
        out.push_str(&block);
        if body.len() < file.content.trim_end().len() {
            break;
        }
    }
    out.truncate(out.trim_end().len());
    out
}

/// The memory part of a prompt, as golemcore's agents lay it out: `MEMORY.md` under
/// `## Long-term Memory`, today's note under `## Today's Notes`, and the notes of the days before
/// (newest first) under `## Recent Context`, one `###` per day. Empty parts are left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryNotes<'a> {
    pub long_term: Option<&'a str>,
    pub today: Option<&'a str>,
    /// Earlier days' notes, newest first.
    pub recent: Vec<(NaiveDate, &'a str)>,
}

/// The workspace part of a prompt, in two parts a context window places apart: the agent's
/// files an operator enabled (instructions), and what models and users wrote about the user
/// (reference): their PROFILE.md, MEMORY.md and daily notes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkspacePrompt {
    /// The agent's enabled files as `--- NAME ---` blocks.
    pub files: String,
    /// The user's enabled PROFILE.md as a block, then `# Memory` with its sections; or empty.
    pub memory: String,
    /// `# Memory`'s sections (MEMORY.md, the daily notes) are all in `memory`, uncut.
    pub notes_whole: bool,
}

impl WorkspacePrompt {
    /// Both parts as one text, the files first.
    pub fn joined(&self) -> String {
        match (self.files.is_empty(), self.memory.is_empty()) {
            (_, true) => self.files.clone(),
            (true, false) => self.memory.clone(),
            (false, false) => format!("{}\n\n{}", self.files, self.memory),
        }
    }
}

/// The whole workspace part of a prompt within `budget` tokens: the agent's enabled files as
/// `--- NAME ---` blocks, then the user's: PROFILE.md as a block, and `# Memory` with its
/// sections (MEMORY.md, the daily notes). What does not fit is cut, the user's part first.
pub fn render_prompt(
    files: &[PromptFile<'_>],
    memory: &MemoryNotes<'_>,
    budget: u64,
    counter: &dyn TokenCounter,
) -> WorkspacePrompt {
    let (agent, user): (Vec<PromptFile<'_>>, Vec<PromptFile<'_>>) =
        files.iter().cloned().partition(|f| owner_of(f.path) == FileOwner::Agent);
    // MEMORY.md and the daily notes are the `# Memory` sections, not blocks.
    let profile: Vec<PromptFile<'_>> =
        user.into_iter().filter(|f| f.path != "MEMORY.md" && !is_under_memory(f.path)).collect();
    let mut sections: Vec<String> = Vec::new();
    let mut part = |title: &str, text: &str| {
        if !text.trim().is_empty() {
            sections.push(format!("{title}\n{}", text.trim()));
        }
    };
    part("## Long-term Memory", memory.long_term.unwrap_or(""));
    part("## Today's Notes", memory.today.unwrap_or(""));
    let recent: Vec<String> = memory
        .recent
        .iter()
        .filter(|(_, text)| !text.trim().is_empty())
        .map(|(day, text)| format!("### {}\n{}", day.format("%Y-%m-%d"), text.trim()))
        .collect();
    part("## Recent Context", &recent.join("\n\n"));
    let files = render_files(&agent, budget, counter);
    let left = budget.saturating_sub(u64::from(counter.count(&files)) + 2);
    let profile = render_files(&profile, left, counter);
    let left = left.saturating_sub(u64::from(counter.count(&profile)) + 2);
    let whole = format!("# Memory\n\n{}", sections.join("\n\n"));
    let notes = if sections.is_empty() || left < 16 { String::new() } else { cut_to(&whole, left, counter) };
    let notes_whole = sections.is_empty() || notes == whole;
    let memory = [profile, notes].into_iter().filter(|part| !part.is_empty()).collect::<Vec<_>>().join("\n\n");
    WorkspacePrompt { files, memory, notes_whole }
}

/// Whether `name` is shaped `YYYY-MM-DD`, digits where digits go (a real day or not).
fn is_dated(name: &str) -> bool {
    name.len() == 10
        && name.bytes().enumerate().all(|(i, b)| if i == 4 || i == 7 { b == b'-' } else { b.is_ascii_digit() })
}

/// The day `name` names as `YYYY-MM-DD`: exactly that shape, as the daily notes' SQL matches
/// them (chrono alone also reads `2026-4-1`, a name no statement would treat as a note).
fn day_of(name: &str) -> Option<NaiveDate> {
    is_dated(name).then(|| NaiveDate::parse_from_str(name, "%Y-%m-%d").ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Words;

    impl TokenCounter for Words {
        fn count(&self, text: &str) -> u32 {
            text.split_whitespace().count() as u32
        }

        fn name(&self) -> &str {
            "words"
        }
    }

    #[test]
    fn paths_are_relative_markdown_and_bounded() {
        for good in [
            "MEMORY.md",
            "memory/2026-04-01.md",
            "notes/a b.md",
            "memory/archive/2026-01-01.md",
            "memory/2024-02-29.md",
        ] {
            assert!(WorkspacePath::parse(good).is_ok(), "{good}");
        }
        let bad = [
            "",
            "/etc/passwd.md",
            "\\\\server\\share.md",
            "notes\\a.md",
            "../MEMORY.md",
            "memory/../../x.md",
            "./MEMORY.md",
            "a//b.md",
            "MEMORY.txt",
            "MEMORY",
            ".md",
            "memory/.md",
            "a\u{7}.md",
            "a/b/c/d/e.md",
            "a\u{200B}b.md",
            "a\u{2028}b.md",
            "\u{FEFF}a.md",
        ];
        for raw in bad {
            assert!(matches!(WorkspacePath::parse(raw), Err(InvalidInput::BadPath { .. })), "{raw:?}");
        }
        let long = format!("{}.md", "x".repeat(MAX_PATH_BYTES));
        assert!(WorkspacePath::parse(&long).is_err());
        // A new file named as a daily note must name a real day; a stored one still reads.
        // Nor a day more than one after today.
        let today = NaiveDate::from_ymd_opt(2024, 3, 1).expect("a day");
        for (raw, new_ok) in
            [("memory/2024-02-29.md", true), ("memory/2020-99-99.md", false), ("memory/2023-02-29.md", false)]
                .into_iter()
                .chain([("Memory/2024-02-29.md", false), ("MEMORY/2026-13-45.md", false), ("Memory/prefs.md", true)])
                .chain([
                    ("memory/2024-03-02.md", true),
                    ("memory/2024-03-03.md", false),
                    ("memory/2099-01-01.md", false),
                ])
        {
            let path = WorkspacePath::parse(raw).expect("a stored name");
            assert_eq!(path.check_new_name(today).is_ok(), new_ok, "{raw}");
        }
    }

    #[test]
    fn files_about_a_user_belong_to_the_pair() {
        let owner = |p: &str| WorkspacePath::parse(p).expect("valid").owner();
        assert_eq!(owner("PROFILE.md"), FileOwner::User);
        assert_eq!(owner("MEMORY.md"), FileOwner::User);
        assert_eq!(owner("memory/2026-04-01.md"), FileOwner::User);
        assert_eq!(owner("AGENTS.md"), FileOwner::Agent);
        assert_eq!(owner("SOUL.md"), FileOwner::Agent);
        assert_eq!(owner("tools/search.md"), FileOwner::Agent);
        assert_eq!(owner("profile.md"), FileOwner::User);
        assert_eq!(owner("Memory/notes.md"), FileOwner::User);
        let day = NaiveDate::from_ymd_opt(2026, 4, 1).expect("date");
        assert_eq!(WorkspacePath::daily_note(day).as_str(), "memory/2026-04-01.md");
        assert_eq!(WorkspacePath::daily_note(day).note_day(), Some(day));
        // Only the name the notes' SQL matches is a note: chrono alone would read these too.
        for other in ["memory/2026-4-1.md", "memory/2026-04-1.md"] {
            let path = WorkspacePath::parse(other).expect("valid");
            assert_eq!((path.note_day(), path.is_recallable()), (None, false), "{other}");
        }
        assert_eq!(WorkspacePath::parse("MEMORY.md").expect("valid").core_sort_order(), Some(3));
    }

    #[test]
    fn notes_are_cut_between_paragraphs_within_the_limit() {
        let text = "# 2026-04-01\n\n- one\n- two\n\n- three is longer\n";
        assert_eq!(note_chunks(text, 1000), vec![text.trim()]);
        assert_eq!(note_chunks(text, 20), vec!["- one\n- two", "- three is longer"]);
        // No break anywhere: characters, never inside one.
        let word = "é".repeat(10);
        let pieces = note_chunks(&word, 5);
        assert!(pieces.iter().all(|p| p.len() <= 5 && !p.is_empty()), "{pieces:?}");
        assert_eq!(pieces.concat(), word);
        assert!(note_chunks("  \n\n ", 10).is_empty());
        assert!(note_chunks("# MEMORY\n\n## People\n", 100).is_empty());
        // Appending changes only the end.
        let longer = format!("{text}\n- four\n");
        let (a, b) = (note_chunks(text, 20), note_chunks(&longer, 20));
        assert_eq!(a[..1], b[..1]);
        assert!(WorkspacePath::parse("MEMORY.md").expect("valid").is_recallable());
        assert!(WorkspacePath::parse("memory/2026-04-01.md").expect("valid").is_recallable());
        assert!(!WorkspacePath::parse("memory/archive/2026-04-01.md").expect("valid").is_recallable());
        assert!(!WorkspacePath::parse("PROFILE.md").expect("valid").is_recallable());
    }

    #[test]
    fn rendering_keeps_order_skips_empty_files_and_fits_the_budget() {
        let files = [
            PromptFile { path: "AGENTS.md", content: "Be brief." },
            PromptFile { path: "SOUL.md", content: "  " },
            PromptFile { path: "MEMORY.md", content: "Alice lives in Lyon." },
        ];
        assert_eq!(
            render_files(&files, 1000, &Words),
            "--- AGENTS.md ---\nBe brief.\n\n--- MEMORY.md ---\nAlice lives in Lyon."
        );
        let long = "word ".repeat(500);
        let files = [PromptFile { path: "MEMORY.md", content: &long }, PromptFile { path: "X.md", content: "x" }];
        let rendered = render_files(&files, 100, &Words);
        assert!(Words.count(&rendered) <= 100, "{}", Words.count(&rendered));
        assert!(rendered.starts_with("--- MEMORY.md ---") && !rendered.contains("X.md"));
        assert_eq!(render_files(&files, 3, &Words), "");
    }

    #[test]
    fn the_memory_part_follows_the_files_with_its_sections() {
        let files = [
            PromptFile { path: "AGENTS.md", content: "Be brief." },
            PromptFile { path: "PROFILE.md", content: "Name: Ann" },
            PromptFile { path: "MEMORY.md", content: "Ann takes trains." },
            PromptFile { path: "memory/2026-04-01.md", content: "ignored as a file" },
            PromptFile { path: "Memory/prefs.md", content: "ignored in any case" },
            PromptFile { path: "tools.md", content: "Use the map." },
        ];
        let day = |d| NaiveDate::from_ymd_opt(2026, 4, d).expect("date");
        let memory = MemoryNotes {
            long_term: Some("Ann takes trains."),
            today: Some("- booked Lisbon"),
            recent: vec![(day(1), "- asked about trains"), (day(2), "  ")],
        };
        let prompt = render_prompt(&files, &memory, 1000, &Words);
        // The agent's files are instructions; what was written about the user is reference.
        assert_eq!(prompt.files, "--- AGENTS.md ---\nBe brief.\n\n--- tools.md ---\nUse the map.");
        assert_eq!(
            prompt.memory,
            "--- PROFILE.md ---\nName: Ann\n\n# Memory\n\n## Long-term Memory\nAnn takes trains.\n\n\
## Today's Notes\n- booked Lisbon\n\n## Recent Context\n### 2026-04-01\n- asked about trains"
        );
        assert_eq!(prompt.joined(), format!("{}\n\n{}", prompt.files, prompt.memory));
        assert_eq!(
            render_prompt(&files, &MemoryNotes::default(), 1000, &Words).joined(),
            "--- AGENTS.md ---\nBe brief.\n\n--- tools.md ---\nUse the map.\n\n--- PROFILE.md ---\nName: Ann"
        );
        assert!(Words.count(&render_prompt(&files, &memory, 20, &Words).joined()) <= 20);
    }
}
