//! Memory packs (golemcore's MemoryPack): the rows most relevant to a query, grouped by layer,
//! each layer cut to its top k, then fitted into token budgets and rendered as markdown under
//! `# Memory`.
//!
//! Budgets: items are taken by score across layers while the rendered pack stays within the
//! soft budget. Past it, only the best item of a layer not yet in the pack may still go in, up
//! to the max budget. The rendered text is counted whole at the end, so neither budget is ever
//! exceeded. Working memory is the caller's own session; the other layers are long-term rows
//! by their `layer`. Faded rows (decay below the floor) are not packed.

use mnemo_core::{Principal, RecallScope, Scope, TokenCounter};
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
}

/// What one layer brought and what the budgets left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerUsage {
    pub layer: PackLayer,
    /// Candidates of this layer within its top k.
    pub candidates: usize,
    pub items: usize,
    /// Tokens of its section (header and lines).
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

/// Builds the pack for `request` over what `principal` may recall. `options` are recall's
/// (the API passes the defaults; benchmarks give the query's vector).
pub async fn build_pack(
    recall: &Recall,
    counter: &dyn TokenCounter,
    principal: &Principal,
    request: &PackRequest,
    options: &RecallOptions,
) -> Result<MemoryPack, RecallError> {
    let wanted: usize = PackLayer::ALL.iter().map(|&l| request.top_k.get(l)).sum();
    let query = Query { text: &request.query, scope: RecallScope::Any, kinds: &[] };
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
    let usage = |layers: &mut Vec<LayerUsage>, layer: PackLayer| -> usize {
        layers.iter().position(|u| u.layer == layer).expect("every layer has a row")
    };
    let mut candidates: Vec<PackItem> = Vec::new();
    for item in ranked.items.into_iter().filter(|i| !i.faded) {
        let layer = PackLayer::of(&item);
        let at = usage(&mut layers, layer);
        if layers[at].candidates >= request.top_k.get(layer) {
            layers[at].dropped_by_top_k += 1;
            continue;
        }
        layers[at].candidates += 1;
        let tokens = counter.count(&line(&item));
        candidates.push(PackItem { id: item.id, layer, item, tokens });
    }

    // Candidates are in score order already (ranked is best first).
    let header = counter.count(HEADER);
    let section_tokens: Vec<u32> = PackLayer::ALL.iter().map(|&l| counter.count(&section(l))).collect();
    let section_cost = |layer: PackLayer| section_tokens[PackLayer::ALL.iter().position(|&l| l == layer).unwrap_or(0)];
    let mut taken = vec![false; candidates.len()];
    let mut total = header;
    let mut represented: Vec<PackLayer> = Vec::new();
    for (i, c) in candidates.iter().enumerate() {
        let cost = c.tokens + if represented.contains(&c.layer) { 0 } else { section_cost(c.layer) };
        if total + cost <= request.soft_budget_tokens {
            taken[i] = true;
            total += cost;
            if !represented.contains(&c.layer) {
                represented.push(c.layer);
            }
        }
    }
    // Past the soft budget: the best item of each layer still missing, within the max budget.
    let mut limit = request.soft_budget_tokens;
    for layer in PackLayer::ALL {
        if represented.contains(&layer) {
            continue;
        }
        if let Some(i) = candidates.iter().position(|c| c.layer == layer) {
            let cost = candidates[i].tokens + section_cost(layer);
            if total + cost <= request.max_budget_tokens {
                taken[i] = true;
                total += cost;
                represented.push(layer);
                limit = request.max_budget_tokens;
            }
        }
    }

    let mut chosen: Vec<PackItem> = candidates.into_iter().zip(&taken).filter(|(_, t)| **t).map(|(c, _)| c).collect();
    // Counted whole, the text may differ from the sum of its parts: drop the lowest-scored item
    // until it fits.
    let (mut rendered, mut tokens) = render(&chosen, counter);
    while tokens > limit {
        let Some(worst) =
            chosen.iter().enumerate().min_by(|a, b| a.1.item.score.total_cmp(&b.1.item.score)).map(|(i, _)| i)
        else {
            break;
        };
        chosen.remove(worst);
        (rendered, tokens) = render(&chosen, counter);
    }

    for layer in PackLayer::ALL {
        let at = usage(&mut layers, layer);
        let mine: Vec<&PackItem> = chosen.iter().filter(|c| c.layer == layer).collect();
        layers[at].items = mine.len();
        layers[at].dropped_by_budget = layers[at].candidates - mine.len();
        layers[at].tokens =
            if mine.is_empty() { 0 } else { section_cost(layer) + mine.iter().map(|c| c.tokens).sum::<u32>() };
    }
    Ok(MemoryPack { rendered, tokens, items: chosen, layers, degraded: ranked.degraded })
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
