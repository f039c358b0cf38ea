//! House rules that a reviewer would otherwise have to remember, checked over the source text.
//! Each rule is a test over the same walk of the crates' sources; a rule looks at the string
//! literals or the code of each file, never at comments, so prose may name what code may not.

use std::path::{Path, PathBuf};

use mnemo_core::{AuditEvent, Queue};

/// A piece of a source file: code, or the contents of one string literal.
#[derive(Debug, PartialEq)]
enum Piece {
    Code,
    Str,
}

/// A source file cut into code and string literals, comments dropped.
struct Source {
    /// Relative to the workspace root, with `/` separators.
    path: String,
    /// (kind, first line, text).
    pieces: Vec<(Piece, usize, String)>,
}

impl Source {
    /// `file:line` of every piece of `kind` for which `matches` finds something, with what it found.
    fn find(&self, kind: Piece, matches: impl Fn(&str) -> Option<usize>) -> Vec<String> {
        let mut found = Vec::new();
        for (piece, line, text) in &self.pieces {
            if *piece != kind {
                continue;
            }
            if let Some(at) = matches(text) {
                let line = line + text[..at].matches('\n').count();
                let snippet: String = text[at..].chars().take(40).collect();
                found.push(format!("{}:{line}: {}", self.path, snippet.lines().next().unwrap_or("")));
            }
        }
        found
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ sits in the workspace").to_owned()
}

/// Every `.rs` file under `crates/*/src`, except the crates named in `except`.
fn crate_sources(except: &[&str]) -> Vec<Source> {
    let root = workspace_root();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(root.join("crates")).expect("crates/") {
        let dir = entry.expect("a crates/ entry").path();
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        if !except.contains(&name.as_str()) {
            rust_files(&dir.join("src"), &mut files);
        }
    }
    files.sort();
    assert!(!files.is_empty(), "no sources found under {}", root.display());
    files
        .into_iter()
        .map(|file| {
            let text = std::fs::read_to_string(&file).expect("a readable source file");
            let path = file.strip_prefix(&root).unwrap_or(&file).to_string_lossy().replace('\\', "/");
            Source { path, pieces: lex(&text) }
        })
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Cuts Rust source into code and string literals (plain, byte, C and raw ones), dropping line
/// and block comments. Enough of Rust's lexer for these checks: char literals are told from
/// lifetimes by their closing quote.
fn lex(text: &str) -> Vec<(Piece, usize, String)> {
    let chars: Vec<char> = text.chars().collect();
    let mut pieces = Vec::new();
    let (mut i, mut line) = (0, 1);
    let mut code = (line, String::new());
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        // Comments.
        if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            continue;
        }
        if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if chars[i] == '\n' {
                        // Kept in the code, so lines found in code count right.
                        line += 1;
                        code.1.push('\n');
                    }
                    i += 1;
                }
            }
            continue;
        }
        // String literals: an optional b or c prefix, then "…" or r#*"…"#*. A prefix letter is
        // only a prefix when it does not end an identifier.
        let ident_before = i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
        let mut j = i;
        if !ident_before && matches!(c, 'b' | 'c') {
            j += 1;
        }
        let raw = !ident_before && at(j) == 'r' && (at(j + 1) == '"' || at(j + 1) == '#');
        if raw {
            let mut k = j + 1;
            while at(k) == '#' {
                k += 1;
            }
            if at(k) == '"' {
                let hashes = k - j - 1;
                let start = k + 1;
                let mut end = start;
                while end < chars.len() && !(chars[end] == '"' && (0..hashes).all(|h| at(end + 1 + h) == '#')) {
                    end += 1;
                }
                let content: String = chars[start..end.min(chars.len())].iter().collect();
                pieces.push((Piece::Code, code.0, std::mem::take(&mut code.1)));
                pieces.push((Piece::Str, line, content.clone()));
                line += content.matches('\n').count();
                i = end + 1 + hashes;
                code.0 = line;
                continue;
            }
        }
        if at(j) == '"' && (j == i || !ident_before) {
            let mut end = j + 1;
            let mut content = String::new();
            while end < chars.len() && chars[end] != '"' {
                if chars[end] == '\\' {
                    content.push(chars[end]);
                    end += 1;
                }
                if end < chars.len() {
                    content.push(chars[end]);
                }
                end += 1;
            }
            pieces.push((Piece::Code, code.0, std::mem::take(&mut code.1)));
            pieces.push((Piece::Str, line, content.clone()));
            line += content.matches('\n').count();
            i = end + 1;
            code.0 = line;
            continue;
        }
        // A char literal ('x', '\n', '"'), not a lifetime ('a): skip it whole.
        if c == '\'' && (at(i + 1) == '\\' || at(i + 2) == '\'') {
            let mut end = i + 1;
            if at(end) == '\\' {
                end += 1;
            }
            end += 1;
            while end < chars.len() && chars[end] != '\'' {
                end += 1;
            }
            i = end + 1;
            code.1.push_str("' '");
            continue;
        }
        line += usize::from(c == '\n');
        code.1.push(c);
        i += 1;
    }
    pieces.push((Piece::Code, code.0, code.1));
    pieces
}

/// Fails with every finding, one per line.
fn assert_none(rule: &str, findings: Vec<String>) {
    assert!(findings.is_empty(), "{rule}:\n{}", findings.join("\n"));
}

/// SQL in a string literal: the statements mnemo writes, each as it starts a statement or clause.
fn sql(text: &str) -> Option<usize> {
    const KEYWORDS: &[&str] = &[
        "SELECT ",
        "INSERT INTO",
        "DELETE FROM",
        "CREATE INDEX",
        "CREATE TABLE",
        "DROP INDEX",
        "DROP TABLE",
        "ALTER TABLE",
        "ALTER DATABASE",
        "ANALYZE",
        "TRUNCATE ",
    ];
    let keyword = KEYWORDS.iter().filter_map(|k| text.find(k)).min();
    // UPDATE … SET, with anything between.
    let update = text.find("UPDATE ").filter(|&at| text[at..].split_whitespace().any(|w| w == "SET"));
    keyword.into_iter().chain(update).min()
}

/// Invariant 1 of ARCHITECTURE.md. The testkit and `tests/` read tables to assert on them and
/// are not scanned.
#[test]
fn only_the_store_writes_sql() {
    let mut findings = Vec::new();
    for source in crate_sources(&["mnemo-store", "mnemo-testkit"]) {
        findings.extend(source.find(Piece::Str, sql));
        findings
            .extend(source.find(Piece::Code, |code| code.find("sqlx::query").or_else(|| code.find("sqlx::raw_sql"))));
    }
    assert_none("SQL outside mnemo-store (move it behind a typed Store method)", findings);
}

/// Invariant 11: queue and audit event names are spelled once, in `mnemo-core`'s enums. A string
/// literal that is such a name, or SQL quoting an event (`'supersede'`), is a second spelling.
/// (SQL quoting a queue name is not checked: `'judge'` is also the judge's actor in audit rows.)
/// The testkit is not scanned: it asserts on what was stored.
#[test]
fn queue_and_event_names_are_spelled_only_in_core() {
    let events: Vec<&str> = AuditEvent::ALL.iter().map(|e| e.as_str()).collect();
    let names: Vec<&str> = Queue::ALL.iter().map(|q| q.as_str()).chain(events.iter().copied()).collect();
    let spelled = |text: &str| {
        if names.contains(&text) {
            return Some(0);
        }
        events.iter().filter_map(|event| text.find(&format!("'{event}'"))).min()
    };
    let mut findings = Vec::new();
    for source in crate_sources(&["mnemo-core", "mnemo-testkit"]) {
        findings.extend(source.find(Piece::Str, spelled));
    }
    assert_none("a queue or audit event name spelled outside mnemo-core (use Queue or AuditEvent)", findings);
}

/// Invariant 1, second rule: only `mnemo-models` talks to model endpoints, so no other library
/// crate depends on an HTTP client. The testkit (scripted servers) and the benchmarks are tools,
/// not the product.
#[test]
fn only_the_models_crate_has_an_http_client() {
    const CLIENTS: &[&str] = &["reqwest", "async-openai"];
    let root = workspace_root();
    let mut findings = Vec::new();
    for entry in std::fs::read_dir(root.join("crates")).expect("crates/") {
        let dir = entry.expect("a crates/ entry").path();
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        // mnemo-mcp's client talks only to mnemo's own API, never to a model.
        if ["mnemo-models", "mnemo-testkit", "mnemo-bench", "mnemo-mcp"].contains(&name.as_str()) {
            continue;
        }
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).expect("Cargo.toml");
        let mut section = String::new();
        for line in manifest.lines().map(str::trim) {
            if line.starts_with('[') {
                section = line.to_owned();
            } else if section == "[dependencies]" {
                let dependency = line.split(['=', '.', ' ']).next().unwrap_or_default();
                if CLIENTS.contains(&dependency) {
                    findings.push(format!("crates/{name}/Cargo.toml: {line}"));
                }
            }
        }
    }
    assert_none("an HTTP client outside mnemo-models", findings);
}

/// Every setting reaches the containers `docker-compose.yml` runs when the shell or `.env` sets
/// it, but for the host's paths and addresses, which the image or the file sets itself, and the
/// stdio MCP binary's, which runs beside a desktop agent, not in the stack.
#[test]
fn compose_passes_every_setting_through() {
    const THE_FILES_OWN: &[&str] = &[
        "MNEMO_DATABASE_URL",
        "DATABASE_URL",
        "MNEMO_JWT_SECRET",
        "MNEMO_RERANKER_URL",
        "MNEMO_LISTEN",
        "MNEMO_WORKER_LISTEN",
        "MNEMO_LOCAL_MODEL_DIR",
        "MNEMO_CONFIG_FILE",
        "MNEMO_JWT_PUBLIC_KEY_FILE",
        "MNEMO_WORKSPACE_TEMPLATES_DIR",
        "MNEMO_URL",
        "MNEMO_TOKEN",
        "MNEMO_MCP_TIMEOUT_S",
    ];
    let root = workspace_root();
    let vars = std::fs::read_to_string(root.join("crates/mnemo-config/src/vars.rs")).expect("vars.rs");
    let compose = std::fs::read_to_string(root.join("docker-compose.yml")).expect("docker-compose.yml");
    let passed: Vec<&str> = compose.lines().filter_map(|l| l.trim().strip_suffix(':')).collect();
    let mut names: Vec<&str> =
        vars.lines().filter_map(|l| l.split('"').nth(1).filter(|_| l.starts_with("pub const "))).collect();
    assert!(names.len() > 100, "{} settings read from vars.rs", names.len());
    // What the trace exporter reads itself, beside the endpoint and protocol vars.rs names.
    names.extend([
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        "OTEL_BSP_SCHEDULE_DELAY",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
    ]);
    let findings = names
        .into_iter()
        .filter(|name| !THE_FILES_OWN.contains(name) && !passed.contains(name))
        .map(|name| format!("{name} does not reach the containers"))
        .collect();
    assert_none("a setting docker-compose.yml leaves behind", findings);
}

/// The lexer the rules rely on: comments are dropped, strings of every form are found with the
/// line they start on, and char literals and lifetimes do not open strings.
#[test]
fn the_lexer_tells_strings_from_comments() {
    let text = concat!(
        "// SELECT 1\n",
        "fn f<'a>(x: &'a str) -> char { '\"' }\n",
        "/* INSERT INTO t */ let q = \"SELECT x\n FROM t\";\n",
        "let r = r#\"DROP INDEX \"i\"\"#; let b = b\"ab\"; let e = \"a\\\"b\";",
    );
    let pieces = lex(text);
    let strings: Vec<(usize, &str)> =
        pieces.iter().filter(|(p, _, _)| *p == Piece::Str).map(|(_, l, s)| (*l, s.as_str())).collect();
    assert_eq!(strings, [(3, "SELECT x\n FROM t"), (5, "DROP INDEX \"i\""), (5, "ab"), (5, "a\\\"b")]);
    let source = Source { path: "x.rs".into(), pieces: lex(text) };
    assert_eq!(source.find(Piece::Str, sql), ["x.rs:3: SELECT x", "x.rs:5: DROP INDEX \"i\""]);
    assert_eq!(sql("UPDATE memory_items\n SET x = 1"), Some(0));
    assert_eq!(sql("an UPDATE to the settings"), None);
    assert_eq!(sql("plain INSERT/s"), None);
}
