//! Query vectors for concurrent recalls. Embedding one query at a time leaves most of a local
//! model's throughput unused (it does several times more texts per second in batches), so the
//! queries of concurrent recalls are embedded together: one task embeds whatever queries are
//! waiting, up to `MNEMO_RECALL_QUERY_BATCH` (32), while the next ones queue. A lone query is
//! embedded at once; it never waits for company. The vectors of the last `MNEMO_RECALL_QUERY_CACHE`
//! (1,024) distinct queries are kept, per tenant, user, agent and session, for at most
//! [`QUERY_CACHE_TTL`] (a query names what its asker asked, which a user's erasure must not
//! leave in memory for long): a hit is faster (and counted on `/metrics`), and must not tell one
//! tenant, user, session or service what another asked. A recall waits for its vector at most
//! `MNEMO_RECALL_QUERY_WAIT_MS` (a provider that hangs holds up the queries behind it), then
//! answers from full text; a query whose recall stopped waiting is not embedded.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mnemo_core::{AgentId, EmbedError, Embedder, Principal, SessionId};
use tokio::sync::{mpsc, oneshot};
use tracing::{Instrument, Span};

type Reply = oneshot::Sender<Result<Vec<f32>, EmbedError>>;

/// A query handed to the embedding task, with the span of the recall that waits for it.
type Handed = (String, Reply, Span);

/// How long a query's vector is served from the cache; older ones are dropped at the next
/// recall.
pub(crate) const QUERY_CACHE_TTL: Duration = Duration::from_secs(600);

#[derive(Debug)]
pub(crate) struct QueryVectors {
    embedder: Arc<dyn Embedder>,
    max_batch: usize,
    cache_entries: usize,
    ttl: Duration,
    wait: Duration,
    /// The embedding task's queue: started on first use (inside the runtime), and again if the
    /// task ever stopped.
    queue: Mutex<Option<mpsc::UnboundedSender<Handed>>>,
    cache: Mutex<Cache>,
}

/// Who asked what: the tenant, the user, the agent and the session (a service account has no
/// user and no session; a session's token without a user must not pass for it) and the query
/// text.
type Asked = (mnemo_core::TenantId, Option<mnemo_core::UserId>, Option<AgentId>, Option<SessionId>, String);

/// Vectors by who asked what, with when they were kept; the oldest dropped first.
#[derive(Debug, Default)]
struct Cache {
    vectors: HashMap<Asked, (Vec<f32>, Instant)>,
    /// The keys in the order they were kept: the expired ones are at the front.
    order: VecDeque<Asked>,
}

impl Cache {
    /// Drops the vectors kept longer than `ttl` ago.
    fn expire(&mut self, ttl: Duration) {
        while let Some(oldest) = self.order.front()
            && self.vectors.get(oldest).is_none_or(|(_, kept)| kept.elapsed() > ttl)
        {
            let oldest = self.order.pop_front().expect("just seen");
            self.vectors.remove(&oldest);
        }
    }
}

impl QueryVectors {
    pub(crate) fn new(embedder: Arc<dyn Embedder>, max_batch: usize, cache_entries: usize, wait: Duration) -> Self {
        let max_batch = max_batch.max(1);
        let ttl = QUERY_CACHE_TTL;
        Self { embedder, max_batch, cache_entries, ttl, wait, queue: Mutex::default(), cache: Mutex::default() }
    }

    /// The query's vector, from the cache or embedded with the queries waiting beside it.
    pub(crate) async fn vector(&self, asker: &Principal, query: &str) -> Result<Vec<f32>, EmbedError> {
        let key =
            (asker.tenant.clone(), asker.user.clone(), asker.agent.clone(), asker.session.clone(), query.to_owned());
        {
            let mut cache = self.cache.lock().expect("query cache");
            cache.expire(self.ttl);
            if let Some((vector, _)) = cache.vectors.get(&key) {
                metrics::counter!("mnemo_recall_query_cache_hits_total").increment(1);
                return Ok(vector.clone());
            }
        }
        let queue = {
            let mut queue = self.queue.lock().expect("query queue");
            if queue.as_ref().is_none_or(|tx| tx.is_closed()) {
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(embed_batches(self.embedder.clone(), self.max_batch, rx));
                *queue = Some(tx);
            }
            queue.clone().expect("just set")
        };
        let (reply, answer) = oneshot::channel();
        let gone = || EmbedError::transient("query_batcher_gone", "the query embedding task stopped");
        queue.send((query.to_owned(), reply, Span::current())).map_err(|_| gone())?;
        let late = || EmbedError::transient("query_wait", format!("no query vector within {:?}", self.wait));
        let vector = tokio::time::timeout(self.wait, answer).await.map_err(|_| late())?.map_err(|_| gone())??;
        let mut cache = self.cache.lock().expect("query cache");
        // A query two recalls embedded side by side keeps its first time, and its place in the order.
        if self.cache_entries > 0 && !cache.vectors.contains_key(&key) {
            cache.vectors.insert(key.clone(), (vector.clone(), Instant::now()));
            cache.order.push_back(key);
            if cache.order.len() > self.cache_entries
                && let Some(oldest) = cache.order.pop_front()
            {
                cache.vectors.remove(&oldest);
            }
        }
        Ok(vector)
    }
}

/// Embeds the waiting queries, a batch at a time, until every sender is gone. One call at a time
/// makes the largest batches for a local model; the cost is that a provider call hanging until
/// `MNEMO_EMBED_TIMEOUT_MS` holds up the queries queued behind it, each of which falls back to
/// full text once its recall's wait is over.
async fn embed_batches(embedder: Arc<dyn Embedder>, max_batch: usize, mut queue: mpsc::UnboundedReceiver<Handed>) {
    while let Some(first) = queue.recv().await {
        // Recalls that stopped waiting (past their wait, or their client gone) want no vector,
        // and take no place in the batch.
        let mut batch = vec![first];
        batch.retain(|(_, reply, _)| !reply.is_closed());
        while batch.len() < max_batch
            && let Ok(next) = queue.try_recv()
        {
            if !next.1.is_closed() {
                batch.push(next);
            }
        }
        if batch.is_empty() {
            continue;
        }
        metrics::histogram!("mnemo_recall_query_batch_size").record(batch.len() as f64);
        let texts: Vec<String> = batch.iter().map(|(text, _, _)| text.clone()).collect();
        let span = mnemo_config::batch_span("query embedding", batch.iter().map(|(_, _, caller)| caller));
        let model = span.in_scope(|| mnemo_config::model_span("embeddings", embedder.model(), texts.len()));
        let result = match embedder.embed(&texts).instrument(model).instrument(span).await {
            Ok(vectors) if vectors.len() == batch.len() => Ok(vectors),
            Ok(vectors) => Err(EmbedError::permanent(
                "vector_count",
                format!("{} vectors for {} queries", vectors.len(), batch.len()),
            )),
            Err(e) => Err(e),
        };
        match result {
            Ok(vectors) => {
                let dimensions = embedder.dimensions();
                batch.into_iter().zip(vectors).for_each(|((_, reply, _), v)| drop(reply.send(usable(v, dimensions))))
            }
            Err(e) => batch.into_iter().for_each(|(_, reply, _)| drop(reply.send(Err(e.clone())))),
        }
    }
}

/// A vector the search can rank by: one pgvector would refuse (another length, a component past
/// f32's range) or that points nowhere (all zeros: every cosine distance NaN) is the model's
/// failure, and that recall answers from full text, `degraded`.
fn usable(vector: Vec<f32>, dimensions: usize) -> Result<Vec<f32>, EmbedError> {
    if vector.len() == dimensions && vector.iter().all(|x| x.is_finite()) && vector.iter().any(|x| *x != 0.0) {
        Ok(vector)
    } else {
        Err(EmbedError::permanent(
            "bad_vector",
            "a query vector of another length, with a component that is not finite, or all zeros",
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Counts the texts it embeds.
    #[derive(Debug, Default)]
    struct Counting(AtomicUsize);

    impl Embedder for Counting {
        fn model(&self) -> &str {
            "counting"
        }

        fn dimensions(&self) -> usize {
            1
        }

        fn embed<'a>(&'a self, texts: &'a [String]) -> mnemo_core::EmbedFuture<'a> {
            self.0.fetch_add(texts.len(), Ordering::SeqCst);
            Box::pin(async move { Ok(texts.iter().map(|_| vec![1.0]).collect()) })
        }
    }

    #[tokio::test]
    async fn a_query_is_cached_for_its_own_asker_only() {
        let embedder = Arc::new(Counting::default());
        let vectors = QueryVectors::new(embedder.clone(), 32, 16, Duration::from_secs(60));
        let asker = |tenant: &str, user: Option<&str>, agent: Option<&str>, session: Option<&str>| Principal {
            tenant: mnemo_core::TenantId::parse(tenant).expect("tenant"),
            user: user.map(|u| mnemo_core::UserId::parse(u).expect("user")),
            agent: agent.map(|a| AgentId::parse(a).expect("agent")),
            session: session.map(|s| SessionId::parse(s).expect("session")),
            roles: Vec::new(),
        };
        let askers = [
            asker("acme", Some("ann"), None, None),
            asker("acme", Some("bob"), None, None),
            asker("acme", None, Some("helper"), None),
            asker("acme", None, Some("coach"), None),
            asker("globex", Some("ann"), None, None),
            // A session's token without a user is not the agent's service, nor another session.
            asker("acme", None, Some("helper"), Some("s1")),
            asker("acme", None, Some("helper"), Some("s2")),
        ];
        for who in askers.iter().chain(&askers) {
            vectors.vector(who, "is Initech being acquired?").await.expect("vector");
        }
        assert_eq!(embedder.0.load(Ordering::SeqCst), 7, "once per tenant, user, agent and session");
    }

    /// Answers the text as a one-component vector: "inf", "zero" or 1.
    #[derive(Debug, Default)]
    struct Odd;

    impl Embedder for Odd {
        fn model(&self) -> &str {
            "odd"
        }

        fn dimensions(&self) -> usize {
            1
        }

        fn embed<'a>(&'a self, texts: &'a [String]) -> mnemo_core::EmbedFuture<'a> {
            let value = |t: &str| match t {
                "inf" => f32::INFINITY,
                "zero" => 0.0,
                _ => 1.0,
            };
            Box::pin(async move { Ok(texts.iter().map(|t| vec![value(t)]).collect()) })
        }
    }

    #[tokio::test]
    async fn a_vector_the_search_cannot_rank_by_is_the_models_failure() {
        let vectors = QueryVectors::new(Arc::new(Odd), 32, 16, Duration::from_secs(60));
        let ann = Principal {
            tenant: mnemo_core::TenantId::parse("acme").expect("tenant"),
            user: None,
            agent: None,
            session: None,
            roles: Vec::new(),
        };
        for text in ["inf", "zero"] {
            let failed = vectors.vector(&ann, text).await.expect_err(text);
            assert_eq!(failed.kind, "bad_vector", "{text}");
        }
        assert_eq!(vectors.vector(&ann, "fine").await.expect("a vector"), [1.0]);
    }

    /// A vector older than the cache's time to live is embedded again, and the old one is gone.
    #[tokio::test]
    async fn a_query_is_kept_no_longer_than_its_time_to_live() {
        let embedder = Arc::new(Counting::default());
        let ttl = Duration::from_millis(200);
        let vectors = QueryVectors { ttl, ..QueryVectors::new(embedder.clone(), 32, 16, Duration::from_secs(60)) };
        let ann = Principal {
            tenant: mnemo_core::TenantId::parse("acme").expect("tenant"),
            user: Some(mnemo_core::UserId::parse("ann").expect("user")),
            agent: None,
            session: None,
            roles: Vec::new(),
        };
        vectors.vector(&ann, "where do I live?").await.expect("vector");
        vectors.vector(&ann, "where do I live?").await.expect("vector");
        assert_eq!(embedder.0.load(Ordering::SeqCst), 1, "a hit within its time to live");
        tokio::time::sleep(ttl * 2).await;
        vectors.vector(&ann, "something else").await.expect("vector");
        assert_eq!(vectors.cache.lock().expect("cache").vectors.len(), 1, "the expired query is gone");
        vectors.vector(&ann, "where do I live?").await.expect("vector");
        assert_eq!(embedder.0.load(Ordering::SeqCst), 3, "embedded again once expired");
    }
}
