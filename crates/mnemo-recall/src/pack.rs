//! Memory packs (golemcore's MemoryPack): the rows most relevant to a query, grouped by layer,
//! each layer cut to its top k, then fitted into token budgets and rendered as markdown under
//! `# Memory`.
//!
//! Budgets: by score across layers, each item that still fits the soft budget is taken, and the
//! whole text is counted and trimmed to it. Past it, only the best item of a layer not yet in
//! the pack may still go in, each while the whole text stays within the max budget. So the pack
//! never passes the max budget, and passes the soft one only by those items. Working memory is the caller's own session; the other layers are long-term rows
//! by their `layer`. Faded rows (decay below the floor) are not packed.

use chrono::NaiveDate;
use mnemo_core::{NewMemory, Principal, RecallScope, Scope, SourceKind, TokenCounter};
use uuid::Uuid;

use crate::{Query, Recall, RecallError, RecallOptions, RecalledItem};

/// A pack's sections, in the order they are rendered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PackLayer {
    Working,
    Episodic,
    Semantic,
    Procedural,
}

impl PackLayer {
    pub const ALL: [Self; 4] = [Self::Working, Self::Episodic, Self::Semantic, Self::Procedural];

    fn index(self) -> usize {
        self as usize
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Working => "working",
            Self::Episodic => "episodic",
            Self::Semantic => "semantic",
            Self::Procedural => "procedural",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Self::Working => "Working Memory",
            Self::Episodic => "Episodic Memory",
            Self::Semantic => "Semantic Memory",
            Self::Procedural => "Procedural Memory",
        }
    }

    fn of(item: &RecalledItem) -> Self {
        if item.scope == Scope::Session {
            return Self::Working;
        }
        match item.layer {
            mnemo_core::Layer::Episodic => Self::Episodic,
            mnemo_core::Layer::Semantic => Self::Semantic,
            mnemo_core::Layer::Procedural => Self::Procedural,
        }
    }
}

/// The most items each layer may bring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackTopK {
    pub working: usize,
    pub episodic: usize,
    pub semantic: usize,
    pub procedural: usize,
}

impl Default for PackTopK {
    /// golemcore's defaults.
    fn default() -> Self {
        Self { working: 6, episodic: 8, semantic: 6, procedural: 4 }
    }
}

impl PackTopK {
    /// The most any layer may ask for.
    pub const MAX: usize = 50;

    fn get(&self, layer: PackLayer) -> usize {
        match layer {
            PackLayer::Working => self.working,
            PackLayer::Episodic => self.episodic,
            PackLayer::Semantic => self.semantic,
            PackLayer::Procedural => self.procedural,
        }
    }
}

/// What a pack is built for. Validated by the caller (the API).
#[derive(Debug, Clone, PartialEq)]
pub struct PackRequest {
    pub query: String,
    pub soft_budget_tokens: u32,
    pub max_budget_tokens: u32,
    pub top_k: PackTopK,
    /// In a context window, the notes its memory part already places: not packed again.
    pub placed_notes: Option<PlacedNotes>,
}

/// The user's workspace notes a context window's memory part places by rule: `MEMORY.md` (kept
/// out of every prompt when disabled) and the daily notes from `since` through `until`, `whole`
/// when none of them was cut to fit (then the pack would only repeat them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacedNotes {
    pub since: NaiveDate,
    pub until: NaiveDate,
    pub whole: bool,
    pub memory_md_disabled: bool,
}

impl PlacedNotes {
    /// Whether `item` is a recall piece the pack leaves out: of a note placed whole, or of a
    /// disabled `MEMORY.md`.
    fn hold(&self, item: &RecalledItem) -> bool {
        item.source_kind == SourceKind::WorkspaceNote
            && NewMemory::workspace_note_path(&item.source_ref).is_some_and(|path| match path.note_day() {
                _ if path.as_str() == "MEMORY.md" => self.whole || self.memory_md_disabled,
                Some(day) => self.whole && (self.since..=self.until).contains(&day),
                None => false,
            })
    }
}

impl PackRequest {
    pub const DEFAULT_SOFT_BUDGET: u32 = 1800;
    pub const DEFAULT_MAX_BUDGET: u32 = 3500;
    /// The largest max budget accepted.
    pub const MAX_BUDGET: u32 = 32_000;
}

/// One packed item.
#[derive(Debug, Clone, PartialEq)]
pub struct PackItem {
    pub id: Uuid,
    pub layer: PackLayer,
    pub item: RecalledItem,
    /// Tokens of its rendered line.
    pub tokens: u32,
    /// Packed past the soft budget: the best item of a layer that was otherwise missing.
    pub past_soft_budget: bool,
}

/// What one layer brought and what the budgets left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerUsage {
    pub layer: PackLayer,
    /// Candidates of this layer within its top k.
    pub candidates: usize,
    pub items: usize,
    /// Tokens of its section's header and lines, each counted apart.
    pub tokens: u32,
    pub dropped_by_budget: usize,
    /// Recalled rows of this layer past its top k.
    pub dropped_by_top_k: usize,
}

/// A built pack.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPack {
    /// Markdown under `# Memory`; empty when nothing was packed.
    pub rendered: String,
    /// Tokens of `rendered`, counted whole.
    pub tokens: u32,
    /// Tokens of the pack before items were added past the soft budget (at most the soft budget).
    pub soft_tokens: u32,
    pub items: Vec<PackItem>,
    pub layers: Vec<LayerUsage>,
    /// The vector half may be incomplete (see recall's `degraded`).
    pub degraded: bool,
}

const HEADER: &str = "# Memory\n";

fn section(layer: PackLayer) -> String {
    format!("\n## {}\n", layer.title())
}

fn line(item: &RecalledItem) -> String {
    // One line per item: the row's own line breaks would make it several list items.
    format!("- {}\n", item.content.split_whitespace().collect::<Vec<_>>().join(" "))
}

/// Builds the pack for `request` over what `principal` may recall, and records the packed rows'
/// access as a recall does. `options` are recall's (the API passes the defaults; benchmarks
/// give the query's vector).
pub async fn build_pack(
    recall: &Recall,
    counter: &dyn TokenCounter,
    principal: &Principal,
    request: &PackRequest,
    options: &RecallOptions,
) -> Result<MemoryPack, RecallError> {
    let wanted: usize = PackLayer::ALL.iter().map(|&l| request.top_k.get(l)).sum();
    // Every layer picks from the whole list.
    let query = Query { text: &request.query, scope: RecallScope::Any, kinds: &[], shown: usize::MAX };
    // Enough candidates that a layer's top k is rarely short because other layers ranked above.
    let ranked = recall.ranked(principal, &query, (4 * wanted).clamp(20, 200), options).await?;

    let mut layers: Vec<LayerUsage> = PackLayer::ALL
        .iter()
        .map(|&layer| LayerUsage {
            layer,
            candidates: 0,
            items: 0,
            tokens: 0,
            dropped_by_budget: 0,
            dropped_by_top_k: 0,
        })
        .collect();
    let mut candidates: Vec<PackItem> = Vec::new();
    let placed = |i: &RecalledItem| request.placed_notes.is_some_and(|notes| notes.hold(i));
    for item in ranked.items.into_iter().filter(|i| !i.faded && !placed(i)) {
        let layer = PackLayer::of(&item);
        let usage = &mut layers[layer.index()];
        if usage.candidates >= request.top_k.get(layer) {
            usage.dropped_by_top_k += 1;
            continue;
        }
        usage.candidates += 1;
        let tokens = counter.count(&line(&item));
        candidates.push(PackItem { id: item.id, layer, item, tokens, past_soft_budget: false });
    }

    // The soft budget: by score (candidates are best first), each item whose line and section
    // still fit; then the whole text counted, trimmed by lowest score until it fits.
    let sections: Vec<u32> = PackLayer::ALL.iter().map(|&l| counter.count(&section(l))).collect();
    let mut total = counter.count(HEADER);
    let mut chosen: Vec<PackItem> = Vec::new();
    let mut rest: Vec<PackItem> = Vec::new();
    for c in candidates {
        let opens = !chosen.iter().any(|p| p.layer == c.layer);
        let cost = c.tokens + if opens { sections[c.layer.index()] } else { 0 };
        if total + cost <= request.soft_budget_tokens {
            total += cost;
            chosen.push(c);
        } else {
            rest.push(c);
        }
    }
    let (mut rendered, mut tokens) = render(&chosen, counter);
    while tokens > request.soft_budget_tokens {
        if let Some(dropped) = drop_lowest(&mut chosen) {
            rest.push(dropped);
        }
        (rendered, tokens) = render(&chosen, counter);
    }
    // Best first again: the exceptions below take each missing layer's best.
    rest.sort_by(|a, b| b.item.score.total_cmp(&a.item.score));
    let soft_tokens = tokens;
    // Past the soft budget: the best item of each layer still missing, while the whole text
    // stays within the max budget.
    for layer in PackLayer::ALL {
        if chosen.iter().any(|p| p.layer == layer) {
            continue;
        }
        let Some(at) = rest.iter().position(|c| c.layer == layer) else { continue };
        let mut extra = rest.remove(at);
        extra.past_soft_budget = true;
        chosen.push(extra);
        let (text, count) = render(&chosen, counter);
        if count <= request.max_budget_tokens {
            (rendered, tokens) = (text, count);
        } else {
            chosen.pop();
        }
    }
    chosen.sort_by(|a, b| b.item.score.total_cmp(&a.item.score));

    for usage in &mut layers {
        let mine: Vec<&PackItem> = chosen.iter().filter(|c| c.layer == usage.layer).collect();
        usage.items = mine.len();
        usage.dropped_by_budget = usage.candidates - mine.len();
        usage.tokens = if mine.is_empty() {
            0
        } else {
            sections[usage.layer.index()] + mine.iter().map(|c| c.tokens).sum::<u32>()
        };
    }
    recall.track_access(principal, chosen.iter().map(|c| c.id).collect());
    Ok(MemoryPack { rendered, tokens, soft_tokens, items: chosen, layers, degraded: ranked.degraded })
}

/// Removes and returns the lowest-scored item.
fn drop_lowest(chosen: &mut Vec<PackItem>) -> Option<PackItem> {
    let worst = chosen.iter().enumerate().min_by(|a, b| a.1.item.score.total_cmp(&b.1.item.score)).map(|(i, _)| i)?;
    Some(chosen.remove(worst))
}

/// The pack's markdown, layers in order and items by score within each, and its tokens.
fn render(chosen: &[PackItem], counter: &dyn TokenCounter) -> (String, u32) {
    if chosen.is_empty() {
        return (String::new(), 0);
    }
    let mut text = String::from(HEADER);
    for layer in PackLayer::ALL {
        let mut mine = chosen.iter().filter(|c| c.layer == layer).peekable();
        if mine.peek().is_none() {
            continue;
        }
        text.push_str(&section(layer));
        for c in mine {
            text.push_str(&line(&c.item));
        }
    }
    let tokens = counter.count(&text);
    (text, tokens)
}
