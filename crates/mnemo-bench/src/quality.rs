//! Recall quality on public data: LoCoMo (evidence recall@k per question category) and BEAM
//! (knowledge updates and contradictions). Each conversation becomes one tenant with one
//! session; its turns are written as chat messages through the store's write path, embedded by
//! the worker pool running in this process with the local model, and questions are asked
//! through `mnemo-recall`, the code the server runs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, NaiveDate, Utc};
use mnemo_config::{Env, RecallSettings};
use mnemo_core::{
    Embedder, Extras, MemoryText, NewMemory, Principal, RecallRequest, RecallScope, Role, SessionId, SignalWeights,
    SourceRef, TenantId, TokenCounter, Turn,
};
use mnemo_recall::{Halves, Recall, RecallOptions};
use mnemo_store::Store;
use serde_json::{Value, json};

use crate::embedding::{JudgeQueue, fresh, local_embedder, start_worker, wait_embedded};
use crate::locomo;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Keyword,
    Vector,
    Hybrid,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::Keyword => "keyword",
            Self::Vector => "vector",
            Self::Hybrid => "hybrid",
        }
    }

    fn halves(self) -> Halves {
        match self {
            Self::Keyword => Halves::KeywordOnly,
            Self::Vector => Halves::VectorOnly,
            Self::Hybrid => Halves::Both,
        }
    }
}

/// Whether recall's ranking signals (importance, confidence, decay) scale the fused scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SignalSwitch {
    Off,
    On,
}

/// How questions are asked and reported, in both scenarios.
#[derive(Debug, clap::Args)]
pub struct Asking {
    /// Each setting is asked in turn over the same rows: `off` is fusion alone, `on` the
    /// weights of the environment (or their defaults). Decay is measured to each conversation's
    /// last turn.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "off,on")]
    signals: Vec<SignalSwitch>,
    #[arg(long, value_delimiter = ',', default_value = "1,5,10,20")]
    k: Vec<usize>,
    #[arg(long, value_enum, default_value = "hybrid")]
    mode: Mode,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
    /// Also append one JSON line per question to this file: the question, its gold and what
    /// recall returned, best first (for studying misses).
    #[arg(long)]
    dump: Option<PathBuf>,
    /// Ask over the database an earlier run of the same data loaded (its name is printed)
    /// instead of a fresh one: the writes are no-ops and nothing waits for vectors.
    #[arg(long)]
    database_url: Option<String>,
}

impl Asking {
    /// Appends `line` to the dump file, if one was asked for.
    fn dump(&self, line: Value) -> anyhow::Result<()> {
        use std::io::Write;
        let Some(path) = &self.dump else { return Ok(()) };
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        writeln!(file, "{line}").with_context(|| format!("writing {}", path.display()))
    }
}

#[derive(Debug, clap::Args)]
pub struct LocomoArgs {
    /// A LoCoMo-format JSON file.
    #[arg(long, default_value = "../shared/bench/locomo/locomo-dev5.json")]
    data: PathBuf,
    #[command(flatten)]
    asking: Asking,
}

#[derive(Debug, clap::Args)]
pub struct BeamArgs {
    /// A BEAM folder: one sub-folder per chat with chat.json and probing_questions.json.
    #[arg(long, default_value = "../shared/bench/beam-100k")]
    data: PathBuf,
    #[command(flatten)]
    asking: Asking,
}

/// One conversation: its tenant and session, and its turns.
struct Conversation {
    name: String,
    turns: Vec<ChatTurn>,
}

/// A turn written as a chat message: the participant who said it is its `name`, as an agent
/// writes a multi-party chat (LoCoMo's speakers; BEAM's turns have none).
struct ChatTurn {
    source_ref: String,
    text: String,
    time: Option<DateTime<Utc>>,
    role: Role,
    speaker: Option<String>,
}

/// Counts the tokens of what is written and of what recall returns (o200k).
static TOKENS: std::sync::LazyLock<mnemo_models::Tokenizer> =
    std::sync::LazyLock::new(|| mnemo_models::Tokenizer::new(mnemo_config::TokenizerName::O200kBase));

impl Conversation {
    fn principal(&self) -> anyhow::Result<Principal> {
        Ok(Principal {
            tenant: TenantId::parse(&self.name)?,
            user: None,
            agent: None,
            session: Some(SessionId::parse(&self.name)?),
            roles: Vec::new(),
        })
    }

    /// Its last turn's time: "now" for decay, as if the questions came right after it.
    fn as_of(&self) -> Option<DateTime<Utc>> {
        self.turns.iter().filter_map(|turn| turn.time).max()
    }
}

/// Writes every conversation and embeds it with the worker pool.
async fn ingest(
    env: &Env,
    asking: &Asking,
    conversations: &[Conversation],
) -> anyhow::Result<(Store, Arc<dyn Embedder>)> {
    let (_, embedder) = local_embedder(env)?;
    let (url, store) = match &asking.database_url {
        Some(url) => (url.clone(), Store::connect(url, 16).await?),
        None => fresh(env).await?,
    };
    let started = Instant::now();
    let mut rows = 0;
    for conversation in conversations {
        let who = conversation.principal()?;
        let memories = conversation
            .turns
            .iter()
            .map(|turn| {
                let text = MemoryText::parse(&turn.text)?;
                let said =
                    Turn::parse(turn.role, None, turn.speaker.as_deref(), TOKENS.count(text.as_str()), TOKENS.name())?;
                let extras = Extras { event_time: turn.time, ..Extras::default() };
                Ok(NewMemory::chat_message(&who, SourceRef::parse(&turn.source_ref)?, text, None, extras)?
                    .with_turn(said))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        for chunk in memories.chunks(500) {
            for result in store.remember_many(chunk).await? {
                result?;
            }
        }
        rows += memories.len();
    }
    eprintln!("wrote {rows} turns of {} conversations; embedding them…", conversations.len());
    let stop = start_worker(env, &url, 32, embedder.clone(), JudgeQueue::Off)?;
    wait_embedded(&store, embedder.model(), rows, Duration::from_secs(4 * 3600)).await?;
    let _ = stop.send(());
    store.analyze_memories().await?;
    eprintln!("ingested and embedded in {:.0} s", started.elapsed().as_secs_f64());
    Ok((store, embedder))
}

/// Recall over the ingested rows, with the signals on (the environment's weights) or off.
fn recall_for(env: &Env, store: &Store, embedder: &Arc<dyn Embedder>, signals: SignalSwitch) -> anyhow::Result<Recall> {
    let mut settings = RecallSettings::from_env(env)?;
    if signals == SignalSwitch::Off {
        settings.signals = SignalWeights::OFF;
    }
    Ok(Recall::new(store.clone(), embedder.clone(), None, settings))
}

fn signals_name(signals: SignalSwitch, recall: &Recall) -> String {
    let w = recall.settings().signals;
    match signals {
        SignalSwitch::Off => "off".to_owned(),
        SignalSwitch::On => format!(
            "on (importance {}, confidence {}, decay {}, half-life {} days)",
            w.importance, w.confidence, w.decay, w.half_life_days
        ),
    }
}

/// The source_refs recall returns for `question` in `conversation`, best first, and the tokens
/// (o200k) of the first ten: what an agent would be handed at top_k 10.
async fn ask(
    recall: &Recall,
    conversation: &Conversation,
    question: &str,
    k: usize,
    mode: Mode,
) -> anyhow::Result<(Vec<String>, u32)> {
    let request = RecallRequest::new(question)?.top_k(k)?.scope(RecallScope::Session).enable_rerank(false);
    let options = RecallOptions { halves: mode.halves(), as_of: conversation.as_of(), ..RecallOptions::default() };
    let recalled = recall.recall_with(&conversation.principal()?, &request, options).await?;
    let tokens = recalled.items.iter().take(10).map(|i| TOKENS.count(&i.content)).sum();
    Ok((recalled.items.into_iter().map(|i| i.source_ref).collect(), tokens))
}

fn read_json(path: &Path) -> anyhow::Result<Value> {
    let raw = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&raw).with_context(|| format!("parsing {}", path.display()))
}

/// Cuts a text to mnemo's 16 KiB row limit on a character boundary.
fn capped(text: &str) -> String {
    let mut end = text.len().min(mnemo_core::MAX_CONTENT_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// Gold turns the hybrid's top 10 missed, and how many of those either half alone found.
#[derive(Debug, Default)]
struct Gap {
    gold_total: usize,
    gold_missed: usize,
    in_a_half_top20: usize,
}

struct LocomoQuestion {
    conversation: usize,
    question: String,
    category: u64,
    gold: Vec<String>,
}

/// The LoCoMo conversations as rows to write, their questions with gold turns, and how many
/// evidence strings were normalised and evidence ids dropped.
fn locomo_data(path: &Path) -> anyhow::Result<(Vec<Conversation>, Vec<LocomoQuestion>, usize, usize)> {
    let (mut conversations, mut questions, mut normalised, mut dropped) = (Vec::new(), Vec::new(), 0, 0);
    for sample in locomo::read(path)? {
        // A turn without an id cannot be evidence: it is not written. A turn's time is its
        // session's, a minute apart in order.
        let turns: Vec<ChatTurn> = sample
            .sessions
            .iter()
            .flat_map(|session| session.turns.iter().enumerate().map(move |(i, turn)| (session.date, i, turn)))
            .filter_map(|(date, i, turn)| {
                let mut content = turn.line();
                if let Some(caption) = &turn.caption {
                    content.push_str(&format!(" [image: {caption}]"));
                }
                let time = date.map(|d| d + chrono::Duration::minutes(i as i64));
                Some(ChatTurn {
                    source_ref: turn.id.clone()?,
                    text: capped(&content),
                    time,
                    role: Role::User,
                    speaker: Some(turn.speaker.clone()),
                })
            })
            .collect();
        let known: HashSet<&str> = turns.iter().map(|turn| turn.source_ref.as_str()).collect();
        for qa in &sample.qa {
            let (gold, changed, unknown) = sample.gold(qa, &known);
            normalised += changed;
            dropped += unknown;
            questions.push(LocomoQuestion {
                conversation: conversations.len(),
                question: qa.question.clone().unwrap_or_default(),
                category: qa.category,
                gold,
            });
        }
        conversations.push(Conversation { name: sample.name, turns });
    }
    Ok((conversations, questions, normalised, dropped))
}

/// Mean of a list, 0 when empty.
fn mean(values: &[f64]) -> f64 {
    if values.is_empty() { 0.0 } else { values.iter().sum::<f64>() / values.len() as f64 }
}

pub async fn locomo(args: LocomoArgs) -> anyhow::Result<()> {
    let env = Env::from_process()?;
    let (conversations, questions, normalised, dropped) = locomo_data(&args.data)?;
    let (store, embedder) = ingest(&env, &args.asking, &conversations).await?;
    for &signals in &args.asking.signals {
        let recall = recall_for(&env, &store, &embedder, signals)?;
        locomo_report(&args, &recall, signals, &conversations, &questions, normalised, dropped).await?;
    }
    Ok(())
}

/// Asks every LoCoMo question of `recall` and prints recall@k per category.
async fn locomo_report(
    args: &LocomoArgs,
    recall: &Recall,
    signals: SignalSwitch,
    conversations: &[Conversation],
    questions: &[LocomoQuestion],
    normalised: usize,
    dropped: usize,
) -> anyhow::Result<()> {
    let max_k = args.asking.k.iter().copied().max().unwrap_or(10).clamp(1, mnemo_core::MAX_TOP_K);

    // recall@k per question, by category.
    let mut scores: BTreeMap<usize, BTreeMap<u64, Vec<f64>>> = BTreeMap::new();
    let (mut asked, mut without_gold) = (0, 0);
    let mut gap = Gap::default();
    let mut tokens_at_10 = Vec::new();
    let started = Instant::now();
    for q in questions {
        if q.gold.is_empty() || q.question.trim().is_empty() {
            without_gold += 1;
            continue;
        }
        let conversation = &conversations[q.conversation];
        let (found, tokens) = ask(recall, conversation, &q.question, max_k, args.asking.mode).await?;
        tokens_at_10.push(f64::from(tokens));
        asked += 1;
        args.asking.dump(json!({
            "signals": signals_name(signals, recall), "tenant": conversation.name, "question": q.question,
            "category": q.category, "gold": q.gold, "found": found,
        }))?;
        for &k in &args.asking.k {
            let top: HashSet<&String> = found.iter().take(k).collect();
            let hit = q.gold.iter().filter(|g| top.contains(g)).count() as f64 / q.gold.len() as f64;
            scores.entry(k).or_default().entry(q.category).or_default().push(hit);
        }
        // What the hybrid misses in its top 10 (categories 1–4): did either half alone have it in
        // its top 20 (fusion ranked it down), or neither (no half retrieves it)?
        if args.asking.mode == Mode::Hybrid && (1..=4).contains(&q.category) {
            let top10: HashSet<&String> = found.iter().take(10).collect();
            let missed: Vec<&String> = q.gold.iter().filter(|g| !top10.contains(g)).collect();
            if !missed.is_empty() {
                let limit = mnemo_core::MAX_TOP_K;
                let mut halves = ask(recall, conversation, &q.question, limit, Mode::Keyword).await?.0;
                halves.extend(ask(recall, conversation, &q.question, limit, Mode::Vector).await?.0);
                for g in missed {
                    gap.gold_missed += 1;
                    gap.in_a_half_top20 += usize::from(halves.contains(g));
                }
            }
            gap.gold_total += q.gold.len();
        }
    }
    let per_query_ms = started.elapsed().as_secs_f64() * 1000.0 / asked.max(1) as f64;

    let mut table = Vec::new();
    let mut recall_at_k = serde_json::Map::new();
    for (k, by_category) in &scores {
        let all: Vec<f64> = by_category.values().flatten().copied().collect();
        let cat1_4: Vec<f64> =
            by_category.iter().filter(|(c, _)| (1..=4).contains(*c)).flat_map(|(_, v)| v.iter().copied()).collect();
        let by: serde_json::Map<String, Value> =
            by_category.iter().map(|(c, v)| (c.to_string(), json!(mean(v)))).collect();
        let row = json!({ "all": mean(&all), "cat1_4": mean(&cat1_4), "by_category": by });
        table.push((*k, row.clone()));
        recall_at_k.insert(k.to_string(), row);
    }
    let report = json!({
        "scenario": "locomo",
        "data": args.data.display().to_string(),
        "mode": args.asking.mode.name(),
        "signals": signals_name(signals, recall),
        "questions": asked,
        "questions_without_gold": without_gold,
        "evidence": { "normalised": normalised, "dropped": dropped },
        "mean_query_ms": per_query_ms,
        "mean_tokens_top10": mean(&tokens_at_10),
        "hybrid_misses_at_10_cat1_4": (args.asking.mode == Mode::Hybrid).then(|| json!({
            "gold_turns": gap.gold_total,
            "missed": gap.gold_missed,
            "in_keyword_or_vector_top20": gap.in_a_half_top20,
            "in_neither_top20": gap.gold_missed - gap.in_a_half_top20,
        })),
        "recall_at_k": recall_at_k,
    });
    if args.asking.json {
        println!("{report}");
        return Ok(());
    }
    println!(
        "LoCoMo {}, signals {} ({} questions; evidence ids normalised: {normalised}, dropped: {dropped}; {without_gold} questions without gold skipped)",
        report["mode"].as_str().unwrap_or(""),
        report["signals"].as_str().unwrap_or(""),
        asked
    );
    let categories: Vec<u64> = scores.values().next().map(|c| c.keys().copied().collect()).unwrap_or_default();
    let header: Vec<String> = categories.iter().map(|c| format!("cat {c}")).collect();
    println!("| k | all | cat 1–4 | {} |\n|---:|---:|---:|{}", header.join(" | "), "---:|".repeat(categories.len()));
    for (k, row) in &table {
        let cells: Vec<String> = categories
            .iter()
            .map(|c| format!("{:.3}", row["by_category"][c.to_string()].as_f64().unwrap_or(0.0)))
            .collect();
        println!(
            "| {k} | {:.3} | {:.3} | {} |",
            row["all"].as_f64().unwrap_or(0.0),
            row["cat1_4"].as_f64().unwrap_or(0.0),
            cells.join(" | ")
        );
    }
    println!("mean tokens in the top 10: {:.0}; mean time per question: {per_query_ms:.1} ms", mean(&tokens_at_10));
    if args.asking.mode == Mode::Hybrid {
        println!(
            "categories 1–4: {} of {} gold turns missed from the top 10; {} of those were in the keyword or vector top 20",
            gap.gold_missed, gap.gold_total, gap.in_a_half_top20
        );
    }
    Ok(())
}

/// A BEAM question: which messages must be found, and for updates, which one is outdated.
struct BeamQuestion {
    conversation: usize,
    question: String,
    first: Vec<String>,
    second: Vec<String>,
}

/// Every message object (with `id` and `content`) anywhere under `value`.
fn messages<'a>(value: &'a Value, out: &mut Vec<&'a Value>) {
    match value {
        Value::Object(map) if map.contains_key("id") && map.contains_key("content") => out.push(value),
        Value::Object(map) => map.values().for_each(|v| messages(v, out)),
        Value::Array(items) => items.iter().for_each(|v| messages(v, out)),
        _ => {}
    }
}

fn ids(value: &Value) -> Vec<String> {
    value.as_array().into_iter().flatten().filter_map(|v| v.as_u64().map(|n| n.to_string())).collect()
}

/// A BEAM folder read: its chats, their knowledge-update and contradiction questions, and how
/// many messages had to be cut to 16 KiB.
struct BeamData {
    conversations: Vec<Conversation>,
    updates: Vec<BeamQuestion>,
    contradictions: Vec<BeamQuestion>,
    cut: usize,
}

/// BEAM's batch dates, such as "March-15-2024", as midnight UTC.
fn beam_date(raw: &str) -> Option<DateTime<Utc>> {
    NaiveDate::parse_from_str(raw, "%B-%d-%Y").ok().and_then(|d| d.and_hms_opt(0, 0, 0)).map(|t| t.and_utc())
}

fn beam_data(dir: &Path) -> anyhow::Result<BeamData> {
    let mut chats: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("chat.json").exists())
        .collect();
    chats.sort_by_key(|p| p.file_name().and_then(|n| n.to_str()).and_then(|n| n.parse::<u32>().ok()).unwrap_or(0));
    anyhow::ensure!(!chats.is_empty(), "no <n>/chat.json under {}", dir.display());
    let (mut conversations, mut updates, mut contradictions, mut cut) = (Vec::new(), Vec::new(), Vec::new(), 0);
    for chat in chats {
        let name = format!("beam-{}", chat.file_name().and_then(|n| n.to_str()).unwrap_or("chat"));
        let raw = read_json(&chat.join("chat.json"))?;
        let mut found = Vec::new();
        messages(&raw, &mut found);
        let mut seen = HashSet::new();
        let mut turns = Vec::new();
        // A batch's first message carries its date ("March-15-2024"); the messages after it
        // are a minute apart.
        let mut anchor: Option<(DateTime<Utc>, i64)> = None;
        for message in found {
            let (Some(id), Some(content)) = (message["id"].as_u64(), message["content"].as_str()) else { continue };
            if let Some(date) = message["time_anchor"].as_str().and_then(beam_date) {
                anchor = Some((date, 0));
            }
            if content.trim().is_empty() || !seen.insert(id) {
                continue;
            }
            let role = message["role"].as_str().unwrap_or("message");
            let text = capped(&format!("{role}: {content}"));
            cut += usize::from(text.len() < role.len() + 2 + content.len());
            let time = anchor.as_mut().map(|(date, n)| {
                *n += 1;
                *date + chrono::Duration::minutes(*n)
            });
            let role = Role::parse(role).unwrap_or(Role::User);
            turns.push(ChatTurn { source_ref: id.to_string(), text, time, role, speaker: None });
        }
        let probing = read_json(&chat.join("probing_questions.json"))?;
        let conversation = conversations.len();
        for q in probing["knowledge_update"].as_array().into_iter().flatten() {
            updates.push(BeamQuestion {
                conversation,
                question: q["question"].as_str().unwrap_or_default().to_owned(),
                first: ids(&q["source_chat_ids"]["original_info"]),
                second: ids(&q["source_chat_ids"]["updated_info"]),
            });
        }
        for q in probing["contradiction_resolution"].as_array().into_iter().flatten() {
            contradictions.push(BeamQuestion {
                conversation,
                question: q["question"].as_str().unwrap_or_default().to_owned(),
                first: ids(&q["source_chat_ids"]["first_statement"]),
                second: ids(&q["source_chat_ids"]["second_statement"]),
            });
        }
        conversations.push(Conversation { name, turns });
    }
    Ok(BeamData { conversations, updates, contradictions, cut })
}

pub async fn beam(args: BeamArgs) -> anyhow::Result<()> {
    let env = Env::from_process()?;
    let BeamData { conversations, updates, contradictions, cut } = beam_data(&args.data)?;
    let (store, embedder) = ingest(&env, &args.asking, &conversations).await?;
    let data = BeamData { conversations, updates, contradictions, cut };
    for &signals in &args.asking.signals {
        let recall = recall_for(&env, &store, &embedder, signals)?;
        beam_report(&args, &recall, signals, &data).await?;
    }
    Ok(())
}

/// Asks BEAM's update and contradiction questions of `recall` and prints how it did.
async fn beam_report(args: &BeamArgs, recall: &Recall, signals: SignalSwitch, data: &BeamData) -> anyhow::Result<()> {
    let BeamData { conversations, updates, contradictions, cut } = data;
    let max_k = args.asking.k.iter().copied().max().unwrap_or(10).clamp(1, mnemo_core::MAX_TOP_K);
    let rank = |found: &[String], ids: &[String]| found.iter().position(|f| ids.contains(f));

    let started = Instant::now();
    let mut hit: HashMap<usize, Vec<f64>> = HashMap::new();
    let mut above = Vec::new();
    let mut tokens_at_10 = Vec::new();
    for q in updates.iter().filter(|q| !q.second.is_empty()) {
        let (found, tokens) = ask(recall, &conversations[q.conversation], &q.question, max_k, args.asking.mode).await?;
        tokens_at_10.push(f64::from(tokens));
        args.asking.dump(json!({
            "signals": signals_name(signals, recall), "tenant": conversations[q.conversation].name,
            "question": q.question, "kind": "knowledge_update", "original": q.first, "updated": q.second, "found": found,
        }))?;
        let (updated, original) = (rank(&found, &q.second), rank(&found, &q.first));
        for &k in &args.asking.k {
            hit.entry(k).or_default().push(f64::from(u8::from(updated.is_some_and(|r| r < k))));
        }
        let is_above = match (updated, original) {
            (Some(u), Some(o)) => u < o,
            (Some(_), None) => true,
            _ => false,
        };
        above.push(f64::from(u8::from(is_above)));
    }
    let mut both: HashMap<usize, Vec<f64>> = HashMap::new();
    for q in contradictions.iter().filter(|q| !q.first.is_empty() && !q.second.is_empty()) {
        let (found, tokens) = ask(recall, &conversations[q.conversation], &q.question, max_k, args.asking.mode).await?;
        tokens_at_10.push(f64::from(tokens));
        args.asking.dump(json!({
            "signals": signals_name(signals, recall), "tenant": conversations[q.conversation].name,
            "question": q.question, "kind": "contradiction", "first": q.first, "second": q.second, "found": found,
        }))?;
        for &k in &args.asking.k {
            let top = &found[..found.len().min(k)];
            let ok = rank(top, &q.first).is_some() && rank(top, &q.second).is_some();
            both.entry(k).or_default().push(f64::from(u8::from(ok)));
        }
    }
    let by_k = |m: &HashMap<usize, Vec<f64>>| -> serde_json::Map<String, Value> {
        let mut keys: Vec<&usize> = m.keys().collect();
        keys.sort();
        keys.into_iter().map(|k| (k.to_string(), json!(mean(&m[k])))).collect()
    };
    let asked = tokens_at_10.len();
    let per_query_ms = started.elapsed().as_secs_f64() * 1000.0 / asked.max(1) as f64;
    let report = json!({
        "scenario": "beam",
        "data": args.data.display().to_string(),
        "mode": args.asking.mode.name(),
        "signals": signals_name(signals, recall),
        "chats": conversations.len(),
        "messages": conversations.iter().map(|c| c.turns.len()).sum::<usize>(),
        "messages_cut_to_16KiB": cut,
        "mean_tokens_top10": mean(&tokens_at_10),
        "mean_ms_per_question": per_query_ms,
        "knowledge_update": { "questions": above.len(), "hit_at_k": by_k(&hit), "updated_above_original": mean(&above) },
        "contradiction_resolution": {
            "questions": both.values().next().map_or(0, Vec::len),
            "recall_both_at_k": by_k(&both),
        },
    });
    if args.asking.json {
        println!("{report}");
        return Ok(());
    }
    println!(
        "BEAM {}, signals {} ({} chats, {} messages)",
        report["mode"].as_str().unwrap_or(""),
        report["signals"].as_str().unwrap_or(""),
        report["chats"],
        report["messages"]
    );
    println!("| k | updated message hit@k | both contradicting statements@k |\n|---:|---:|---:|");
    for k in &args.asking.k {
        println!(
            "| {k} | {:.3} | {:.3} |",
            report["knowledge_update"]["hit_at_k"][k.to_string()].as_f64().unwrap_or(0.0),
            report["contradiction_resolution"]["recall_both_at_k"][k.to_string()].as_f64().unwrap_or(0.0)
        );
    }
    println!(
        "updated message ranked above the original: {:.3} ({} questions)",
        report["knowledge_update"]["updated_above_original"].as_f64().unwrap_or(0.0),
        report["knowledge_update"]["questions"]
    );
    println!("mean tokens in the top 10: {:.0}; mean time per question: {per_query_ms:.1} ms", mean(&tokens_at_10));
    Ok(())
}
