//! Recall, as the server, the runbook and the benchmarks all run it. For each class the caller
//! may search, full-text and vector candidates are fused by Reciprocal Rank Fusion; classes are
//! merged by weighted RRF with class priors; the best candidates may go to a cross-encoder, and
//! any failure there falls back to merge order. Recall never fails because a model did:
//! without a query vector it answers from full text and says it is degraded. With a read replica
//! (`Reads`), searches go there, and a replica still behind the primary makes recall degraded.
//! A question that names a period ("on 13 October 2023") adds a third list: that period's rows
//! ranked by the query vector (`period`). A question that names one participant of the session
//! ranks the session's vector half within that participant's messages, after the session's
//! nearest message (`participant`). Among the first ten, two statements from the same source
//! that disagree come newer first (`restated`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use mnemo_config::{ClassWeights, RecallSettings};
use mnemo_core::{
    Embedder, Layer, MAX_TOP_K, Principal, RecallClass, RecallRequest, RecallScope, Reranker, Scope, ScopeError,
    SignalWeights, Signals, SourceKind, signal_factor,
};
use mnemo_store::{CommonLexemes, ReadFrom, Reads, Search, SearchScope, Store, StoreError};
use uuid::Uuid;

mod access;
mod fusion;
mod pack;
mod participant;
mod period;
mod query_vectors;
mod restated;

use access::AccessTracker;
pub use fusion::{CLASS_RRF_K, LIST_RRF_K, fuse};
pub use pack::{LayerUsage, MemoryPack, PackItem, PackLayer, PackRequest, PackTopK, PlacedNotes, build_pack};
use participant::named_participants;
use period::{named_period, names_a_period};
use query_vectors::QueryVectors;

/// Candidates each half (full text, vectors) brings per class.
pub const CANDIDATES_PER_CLASS: i64 = 50;

/// A lexeme in more rows than this is not searched by full text, whatever its fraction: RUM's
/// cost grows with the rows a query matches (about 1 µs each here).
const MAX_LEXEME_ROWS: f64 = 5000.0;

/// Rows read past those recall could return, to stand in for any retired since the search.
const RETIRED_SPARE: usize = 10;

/// How long the common-lexeme list is reused before it is read again.
const COMMON_LEXEMES_TTL: Duration = Duration::from_secs(60);

/// One recalled row.
#[derive(Debug, Clone, PartialEq)]
pub struct RecalledItem {
    pub id: Uuid,
    pub source_kind: SourceKind,
    pub source_ref: String,
    pub content: String,
    pub event_time: DateTime<Utc>,
    /// The row's scope (its owner's class; a shared row is found in another): `session` rows
    /// are a conversation's own.
    pub scope: Scope,
    pub layer: Layer,
    /// Its decay fell below the floor: recalled, but no longer packed.
    pub faded: bool,
    /// The reranker's score when it ranked the items; otherwise the fused RRF score times the
    /// signals' factor, except that a statement put above an older one it disagrees with
    /// (`restated`) takes the score of the place it moved to: scores always follow the order.
    pub score: f64,
}

/// What to search: the query, the classes and the kinds.
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    pub text: &'a str,
    pub scope: RecallScope,
    /// Empty means every kind.
    pub kinds: &'a [SourceKind],
    /// How many of the first rows the caller shows as ranked: a newer statement moves up only
    /// among them, so what is shown is what fusion chose (a recall of 5 that asked for 20 for a
    /// reranker that then failed shows the same 5 rows as one without a reranker).
    pub shown: usize,
}

/// Rows in final order, and whether they may be incomplete (see [`Recalled::degraded`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Ranked {
    pub items: Vec<RecalledItem>,
    pub degraded: bool,
}

/// What a recall found.
#[derive(Debug, Clone, PartialEq)]
pub struct Recalled {
    pub items: Vec<RecalledItem>,
    /// Rows in the searched classes still wait for vectors, or the query could not be embedded:
    /// the vector half may be incomplete; the full-text half is complete. Or one half's
    /// statement failed, and the other answered alone; or an extra list (a named period's, a
    /// participant's) could not be ranked. Or the replica searched had not yet replayed every
    /// acknowledged write: both halves may miss the newest rows.
    pub degraded: bool,
    pub rerank_used: bool,
}

/// Which halves to search. Only benchmarks ask for one half alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Halves {
    #[default]
    Both,
    KeywordOnly,
    VectorOnly,
}

/// Options beyond the HTTP API's, for admin paths and benchmarks.
#[derive(Debug, Clone, Default)]
pub struct RecallOptions {
    /// Superseded facts too (never anonymized or deleted rows). Not reachable over HTTP.
    pub include_superseded: bool,
    /// The query's vector, when the caller already has it (benchmarks time the search alone).
    pub query_vector: Option<Vec<f32>>,
    pub halves: Halves,
    /// Now, for decay and for the periods a question names ("yesterday"); the clock by default.
    /// Benchmarks replay dated conversations.
    pub as_of: Option<DateTime<Utc>>,
}

#[derive(Debug, thiserror::Error)]
pub enum RecallError {
    #[error(transparent)]
    Scope(#[from] ScopeError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Recall over one store with one embedding model. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct Recall {
    /// The primary: access tracking writes there.
    store: Store,
    search: Search,
    /// Searches go to the replica when there is one (`search` on its database).
    reads: Reads,
    replica_search: Option<Search>,
    query_vectors: QueryVectors,
    reranker: Option<Arc<dyn Reranker>>,
    settings: RecallSettings,
    common_lexemes: Mutex<Option<(Instant, Arc<CommonLexemes>)>>,
    access: Option<AccessTracker>,
}

impl Recall {
    pub fn new(
        store: Store,
        embedder: Arc<dyn Embedder>,
        reranker: Option<Arc<dyn Reranker>>,
        settings: RecallSettings,
    ) -> Self {
        let search = store.search(embedder.model(), embedder.dimensions());
        let query_vectors =
            QueryVectors::new(embedder, settings.query_batch, settings.query_cache, settings.query_wait);
        Self {
            reads: Reads::primary(store.clone()),
            replica_search: None,
            store,
            search,
            query_vectors,
            reranker,
            settings,
            common_lexemes: Mutex::new(None),
            access: None,
        }
    }

    /// Searches go where `reads` sends them; on a replica still behind, recall is `degraded`.
    pub fn reading_from(mut self, reads: Reads) -> Self {
        self.replica_search = reads.replica_store().map(|replica| self.search.on(replica.clone()));
        self.reads = reads;
        self
    }

    /// Records what recalls return (last access, access count) through access jobs, batched
    /// off the request path. The server turns it on; benchmarks and the runbook do not.
    pub fn with_access_tracking(mut self) -> Self {
        self.access = Some(AccessTracker::start(self.store.clone()));
        self
    }

    pub fn settings(&self) -> &RecallSettings {
        &self.settings
    }

    pub fn search(&self) -> &Search {
        &self.search
    }

    /// Recall as the HTTP API serves it.
    pub async fn recall(&self, principal: &Principal, request: &RecallRequest) -> Result<Recalled, RecallError> {
        self.recall_with(principal, request, RecallOptions::default()).await
    }

    pub async fn recall_with(
        &self,
        principal: &Principal,
        request: &RecallRequest,
        options: RecallOptions,
    ) -> Result<Recalled, RecallError> {
        let started = Instant::now();
        let use_reranker = request.enable_rerank.then_some(self.reranker.as_ref()).flatten();
        let wanted = if use_reranker.is_some() { MAX_TOP_K.max(request.top_k) } else { request.top_k };
        let query =
            Query { text: &request.query, scope: request.scope, kinds: &request.source_kinds, shown: request.top_k };
        let Ranked { mut items, degraded } = self.ranked(principal, &query, wanted, &options).await?;

        let rerank_used = match use_reranker {
            Some(reranker) if !items.is_empty() => rerank(reranker.as_ref(), &request.query, &mut items).await,
            _ => false,
        };
        items.truncate(request.top_k);
        self.track_access(principal, items.iter().map(|i| i.id).collect());

        metrics::histogram!("mnemo_recall_duration_seconds").record(started.elapsed().as_secs_f64());
        if degraded {
            metrics::counter!("mnemo_recall_degraded_total").increment(1);
        }
        Ok(Recalled { items, degraded, rerank_used })
    }

    /// At most `limit` rows for `query`, best first: fused across halves and classes, then
    /// scaled by the ranking signals. No reranker, no access tracking: callers do those.
    pub async fn ranked(
        &self,
        principal: &Principal,
        query: &Query<'_>,
        limit: usize,
        options: &RecallOptions,
    ) -> Result<Ranked, RecallError> {
        let classes = self.weighted_classes(principal, query.scope)?;
        let class_list: Vec<RecallClass> = classes.iter().map(|(c, _)| c.clone()).collect();
        if class_list.is_empty() {
            // Every class the token reaches is weighted 0.
            return Ok(Ranked { items: Vec::new(), degraded: false });
        }
        let scope = SearchScope {
            tenant: &principal.tenant,
            classes: &class_list,
            kinds: query.kinds,
            include_superseded: options.include_superseded,
            roles: &principal.roles,
            user: principal.user.as_ref(),
        };

        let (search, lagging) = match (self.reads.route().await, &self.replica_search) {
            (ReadFrom::Replica { lagging }, Some(replica)) => (replica, lagging),
            _ => (&self.search, false),
        };
        let keyword = async {
            if options.halves == Halves::VectorOnly {
                return Ok(Default::default());
            }
            let common = self.common_lexemes().await;
            search.keyword(&scope, query.text, &common, CANDIDATES_PER_CLASS).await
        };
        // The vector half, and the rows of the period the question names ranked by the same
        // vector: a third list, so that what was written on the day asked about is a candidate.
        let now = options.as_of.unwrap_or_else(Utc::now);
        let vector = async {
            if options.halves == Halves::KeywordOnly {
                return Ok(Some(Default::default()));
            }
            let Some(vector) = self.query_vector(principal, query.text, options.query_vector.clone()).await else {
                return Ok(None);
            };
            let nearest = search.vector(&scope, &vector, CANDIDATES_PER_CLASS);
            let within = async {
                if !names_a_period(query.text) {
                    return Ok(Default::default());
                }
                let (zone, today) = search.tenant_day(&principal.tenant, now).await?;
                match named_period(query.text, today) {
                    Some(period) => search.vector_within(&scope, &vector, period, &zone, CANDIDATES_PER_CLASS).await,
                    None => Ok(Default::default()),
                }
            };
            let by_participant = async {
                let names = named_participants(query.text);
                let in_session = class_list.iter().any(|c| matches!(c, RecallClass::Session(_)));
                if names.is_empty() || !in_session {
                    return Ok(Default::default());
                }
                search.vector_by_participant(&scope, &vector, &names, CANDIDATES_PER_CLASS).await
            };
            // The period's and the participant's lists only add candidates: one that fails
            // leaves the answer to the others, `degraded`, rather than failing the recall.
            let (nearest, within, by_participant) = tokio::join!(nearest, within, by_participant);
            let (within, period_failed) = extra_list(within, "period");
            let (by_participant, participant_failed) = extra_list(by_participant, "participant");
            Ok::<_, StoreError>(Some((nearest?, within, by_participant, period_failed || participant_failed)))
        };
        // Whether rows may be missing only qualifies the answer: a failed check says so, and
        // does not fail the recall.
        let pending = async {
            search.pending_embeddings(&scope).await.unwrap_or_else(|error| {
                tracing::warn!(%error, "recall could not check for rows waiting for a vector; answering degraded");
                true
            })
        };
        let (keyword, vector, pending) = tokio::join!(keyword, vector, pending);
        // One half failing (a statement past its timeout, a replica's connection lost) leaves
        // the answer to the other, `degraded`. A half not asked for (`halves`), or a vector half
        // without a query vector, answers nothing: the other failing fails the recall.
        let (keyword, vector, half_failed) = match (keyword, vector) {
            (Ok(keyword), Ok(vector)) => (keyword, vector, false),
            (Err(error), Ok(Some(vector))) if options.halves != Halves::KeywordOnly => {
                tracing::warn!(%error, "recall's keyword half failed; answering from the vector half");
                (Default::default(), Some(vector), true)
            }
            (Ok(keyword), Err(error)) if options.halves != Halves::VectorOnly => {
                tracing::warn!(%error, "recall's vector half failed; answering from the keyword half");
                (keyword, Some(Default::default()), true)
            }
            (Err(error), Err(other)) => {
                tracing::warn!(error = %other, "recall's vector half failed too");
                return Err(error.into());
            }
            (Err(error), Ok(_)) | (Ok(_), Err(error)) => return Err(error.into()),
        };
        let no_vector = vector.is_none();
        let (mut nearest, within, by_participant, extra_failed) = vector.unwrap_or_default();
        let degraded = pending || no_vector || lagging || extra_failed || half_failed;
        // The participant the question names: the session's vector list becomes their messages,
        // after the session's nearest message whoever wrote it (a question can name the wrong one).
        for (class, ids) in by_participant.into_iter().filter(|(_, ids)| !ids.is_empty()) {
            let first = nearest.get(&class).and_then(|list| list.first()).copied();
            let rest = ids.into_iter().filter(|id| Some(*id) != first);
            nearest.insert(class, first.into_iter().chain(rest).take(CANDIDATES_PER_CLASS as usize).collect());
        }
        let fused = fuse(&classes, &[&keyword, &nearest, &within]);

        let signals = self.settings.signals;
        let window = rows_to_read(&fused, limit, &signals);
        let ids: Vec<Uuid> = fused.iter().take(window).map(|(id, _)| *id).collect();
        // A replica that is behind has not replayed the latest deletes, erasures and supersedes:
        // its candidates are read back from the primary, which drops those.
        let rows_from = if lagging { self.search.store() } else { search.store() };
        let mut rows = rows_from.recalled_rows(&principal.tenant, &ids, options.include_superseded).await?;
        let sources: HashMap<Uuid, restated::Source> =
            rows.iter().filter_map(|r| Some((r.id, restated::Source::of(r)?))).collect();
        // Back into fused order; a row retired since the search is simply gone.
        let mut items: Vec<RecalledItem> = fused
            .iter()
            .take(window)
            .filter_map(|(id, score)| {
                let at = rows.iter().position(|r| r.id == *id)?;
                let row = rows.swap_remove(at);
                let age_days = (now - row.last_used).num_seconds() as f64 / 86_400.0;
                let factor = signal_factor(
                    &signals,
                    &Signals { importance: row.importance, confidence: row.confidence, age_days },
                );
                // A user's fact's ref names its writer (`fact:user:{user}:…`): another reader of a
                // shared fact is answered a ref by its id. An agent's or tenant's fact's ref names
                // no user, and stays as its writes produce it.
                let writer = row.user_id.as_deref();
                let source_ref = if row.source_kind == SourceKind::Fact.as_str()
                    && row.scope == "user"
                    && writer.is_some()
                    && writer != principal.user.as_ref().map(|u| u.as_str())
                {
                    format!("fact:{}:{}", row.scope, row.id)
                } else {
                    row.source_ref
                };
                Some(RecalledItem {
                    id: row.id,
                    source_kind: SourceKind::parse(&row.source_kind).ok()?,
                    source_ref,
                    content: row.content,
                    event_time: row.event_time,
                    scope: Scope::parse(&row.scope).ok()?,
                    layer: Layer::parse(&row.layer).ok()?,
                    faded: row.faded,
                    score: score * factor,
                })
            })
            .collect();
        // Stable: equal scores keep fused order.
        items.sort_by(|a, b| b.score.total_cmp(&a.score));
        items.truncate(limit);
        let shown = items.len().min(query.shown);
        // Only an order within the first rows: when it cannot be read, the fused order stands.
        if let Err(error) = restated::newer_first(search, &principal.tenant, &mut items[..shown], &sources).await {
            tracing::warn!(%error, "recall could not put newer statements first; answering in fused order");
        }
        Ok(Ranked { items, degraded })
    }

    /// Queues the accesses gathered so far (a server stopping: they would be lost with it).
    pub async fn flush_access(&self) {
        if let Some(tracker) = &self.access {
            tracker.flush().await;
        }
    }

    /// Hands the rows a recall or a pack returned to the access tracker, if there is one; never
    /// waits.
    pub fn track_access(&self, principal: &Principal, ids: Vec<Uuid>) {
        if let Some(tracker) = &self.access
            && !ids.is_empty()
        {
            tracker.record(&principal.tenant, ids);
        }
    }

    /// The classes to search with their priors. Weights apply when classes are fused (scope
    /// any), where 0 leaves a class out; a single class is searched whatever its weight.
    fn weighted_classes(
        &self,
        principal: &Principal,
        scope: RecallScope,
    ) -> Result<Vec<(RecallClass, f64)>, ScopeError> {
        let classes = scope.classes(principal)?;
        if scope != RecallScope::Any {
            return Ok(classes.into_iter().map(|c| (c, 1.0)).collect());
        }
        Ok(classes
            .into_iter()
            .map(|c| {
                let w = weight(&self.settings.weights, &c);
                (c, w)
            })
            .filter(|(_, w)| *w > 0.0)
            .collect())
    }

    /// The query's vector: given, or embedded now (with the queries of concurrent recalls, or
    /// from the recent-query cache). An embedder failure is logged and leaves recall to full text.
    async fn query_vector(&self, asker: &Principal, query: &str, given: Option<Vec<f32>>) -> Option<Vec<f32>> {
        if given.is_some() {
            return given;
        }
        match self.query_vectors.vector(asker, query).await {
            Ok(vector) => Some(vector),
            Err(e) => {
                // The detail may echo the query (a provider's error message): debug only.
                tracing::warn!(kind = e.kind, "query embedding failed; recall is keyword-only");
                tracing::debug!(error = %e.detail, "query embedding failure");
                metrics::counter!("mnemo_recall_query_embed_failures_total", "kind" => e.kind).increment(1);
                None
            }
        }
    }

    /// The lexemes too common to search by, refreshed once a minute. On a database error recall
    /// keeps every lexeme.
    async fn common_lexemes(&self) -> Arc<CommonLexemes> {
        if self.settings.prune_fraction <= 0.0 {
            return Arc::default(); // pruning is off
        }
        if let Some((at, lexemes)) = &*self.common_lexemes.lock().expect("lexeme cache")
            && at.elapsed() < COMMON_LEXEMES_TTL
        {
            return lexemes.clone();
        }
        let fresh = match self.store.common_lexemes(self.settings.prune_fraction, MAX_LEXEME_ROWS).await {
            Ok(lexemes) => Arc::new(lexemes),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read common lexemes; searching with all of them");
                Arc::default()
            }
        };
        *self.common_lexemes.lock().expect("lexeme cache") = Some((Instant::now(), fresh.clone()));
        fresh
    }
}

/// How many of the fused rows, best first, to read and re-score. Signals move a score by a
/// bounded factor only, so a row whose score, however lifted, stays below the `limit`-th row's
/// score however lowered can never enter the first `limit`: the rows before it are read, and
/// `RETIRED_SPARE` more, so that a row retired since the search leaves its place to the next.
fn rows_to_read(fused: &[(Uuid, f64)], limit: usize, signals: &SignalWeights) -> usize {
    let Some(&(_, cut)) = fused.get(limit.saturating_sub(1)) else { return fused.len() };
    let (low, high) = signals.bounds();
    let reach = fused.iter().position(|(_, score)| score * high < cut * low).unwrap_or(fused.len());
    (reach.max(limit) + RETIRED_SPARE).min(fused.len())
}

fn weight(weights: &ClassWeights, class: &RecallClass) -> f64 {
    match class {
        RecallClass::Session(_) => weights.session,
        RecallClass::Tenant => weights.tenant,
        RecallClass::User(..) => weights.user,
        RecallClass::Agent(_) => weights.agent,
    }
}

/// An extra candidate list, or none when its statement failed (logged; the recall is then
/// `degraded`).
fn extra_list(list: Result<mnemo_store::Ranked, StoreError>, which: &'static str) -> (mnemo_store::Ranked, bool) {
    match list {
        Ok(list) => (list, false),
        Err(error) => {
            tracing::warn!(%error, list = which, "recall could not rank an extra list; answering without it");
            (mnemo_store::Ranked::default(), true)
        }
    }
}

/// Orders `items` by the reranker's scores. On any failure the order stays as it was and one
/// warning says why (never with content). Returns whether the reranker's order was used.
async fn rerank(reranker: &dyn Reranker, query: &str, items: &mut [RecalledItem]) -> bool {
    let texts: Vec<String> = items.iter().map(|i| i.content.clone()).collect();
    let started = Instant::now();
    match reranker.rerank(query, &texts).await {
        Ok(scores) => {
            for (item, score) in items.iter_mut().zip(scores) {
                item.score = f64::from(score);
            }
            items.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.id.cmp(&b.id)));
            metrics::counter!("mnemo_recall_rerank_total", "outcome" => "used").increment(1);
            metrics::histogram!("mnemo_recall_rerank_duration_seconds").record(started.elapsed().as_secs_f64());
            true
        }
        Err(e) => {
            tracing::warn!(
                kind = e.kind,
                error = %e.detail,
                candidates = items.len(),
                elapsed_ms = started.elapsed().as_millis() as u64,
                "rerank failed; answering in merge order"
            );
            metrics::counter!("mnemo_recall_rerank_total", "outcome" => "failed", "kind" => e.kind).increment(1);
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One class's fused scores, as `fuse` gives them: 1 / (CLASS_RRF_K + rank).
    fn fused(rows: usize) -> Vec<(Uuid, f64)> {
        (0..rows).map(|r| (Uuid::from_u128(r as u128), 1.0 / (CLASS_RRF_K + r as f64 + 1.0))).collect()
    }

    #[test]
    fn with_the_signals_off_the_rows_wanted_and_a_spare_are_read() {
        assert_eq!(rows_to_read(&fused(150), 10, &SignalWeights::OFF), 10 + RETIRED_SPARE);
        assert_eq!(rows_to_read(&fused(12), 10, &SignalWeights::OFF), 12, "never past the candidates");
        assert_eq!(rows_to_read(&fused(5), 10, &SignalWeights::OFF), 5);
    }

    #[test]
    fn every_row_the_signals_could_lift_into_the_first_rows_is_read() {
        let weights = [
            SignalWeights { importance: 0.1, confidence: 0.1, decay: 0.02, half_life_days: 30.0 },
            SignalWeights { importance: 0.5, confidence: 0.5, decay: 0.3, half_life_days: 30.0 },
            SignalWeights { importance: 1.0, confidence: 1.0, decay: 0.9, half_life_days: 30.0 },
        ];
        for signals in weights {
            let (low, high) = signals.bounds();
            for limit in [1, 5, 10, 20, 50] {
                let rows = fused(150);
                let read = rows_to_read(&rows, limit, &signals);
                let lowest_kept = rows[limit - 1].1 * low;
                // A row not read, lifted as far as it can go, stays below the cut lowered as far as it can go.
                assert!(read <= rows.len());
                assert!(
                    rows[read..].iter().all(|(_, s)| s * high < lowest_kept),
                    "{signals:?}, top {limit}: {read} rows read"
                );
            }
        }
        let all = SignalWeights { importance: 0.0, confidence: 0.0, decay: 1.0, half_life_days: 30.0 };
        assert_eq!(rows_to_read(&fused(150), 10, &all), 150, "a factor that can reach 0 leaves no row out");
    }
}
