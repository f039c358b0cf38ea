//! mnemo's HTTP API: [`app`] builds the axum router, [`run`] serves it. This crate alone knows
//! JSON wire shapes and HTTP statuses; it turns requests into domain values (`mnemo-core`), calls
//! the store, and maps every failure through the error-code table in [`ERROR_CODES`].

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRequestParts, MatchedPath, OriginalUri, Request, State};
use axum::http::Method;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{delete, get, post};
use metrics_exporter_prometheus::PrometheusHandle;
use mnemo_config::{ContextSettings, ServerSettings, WorkspaceSettings};
use mnemo_core::{Embedder, Reranker, TokenCounter};
use mnemo_recall::Recall;
use mnemo_store::{GroupCommit, MIGRATOR, Reads, Store};
use tracing::Instrument;

pub mod auth;
mod body;
mod conversation;
mod error;
mod limit;
pub mod mcp;
pub mod openapi;
mod routes;
mod schema;
mod serve;
mod workspace;

pub use auth::{Authenticator, Claims};
pub use error::{ApiError, ERROR_CODES};
pub use routes::recalled_item;
pub use serve::{ConnectionLimits, serve};

/// What every handler can reach. axum clones it for every extractor of every request, so it is
/// one pointer to the parts, which are built once.
#[derive(Debug, Clone)]
pub struct AppState(Arc<AppParts>);

impl std::ops::Deref for AppState {
    type Target = AppParts;

    fn deref(&self) -> &AppParts {
        &self.0
    }
}

#[derive(Debug)]
pub struct AppParts {
    /// The primary: every write, and every read that must see the latest writes.
    pub store: Store,
    /// Where recall and tool-output reads go: the primary, or a replica checked against it.
    pub reads: Reads,
    pub writes: GroupCommit,
    pub recall: Arc<Recall>,
    pub auth: Arc<Authenticator>,
    pub max_tool_output_bytes: usize,
    /// Counts each conversation row's tokens when it is written, and what a context call adds.
    pub tokenizer: Arc<dyn TokenCounter>,
    /// The most items of one batch write.
    pub max_batch_items: usize,
    /// When a context call asks for compaction, and what overflow recovery keeps.
    pub context: ContextSettings,
    /// Workspace files: their size limit, the core files' templates, their share of a prompt.
    pub workspace: WorkspaceSettings,
    pub metrics: PrometheusHandle,
    /// The per-tenant request rate limit, when one is set.
    pub rate_limit: Option<Arc<limit::RateLimiter>>,
    /// The last readiness answer and when it was found (see `routes::readyz`).
    pub readiness: tokio::sync::Mutex<Option<(std::time::Instant, Result<&'static str, String>)>>,
}

impl AppState {
    /// `embedder` embeds queries; it must be the model the workers embed rows with.
    pub fn new(store: Store, settings: &ServerSettings, embedder: Arc<dyn Embedder>) -> Result<Self, String> {
        let reranker = match &settings.recall.reranker_url {
            Some(url) => Some(Arc::new(
                mnemo_models::TeiReranker::new(url, settings.recall.rerank_timeout).map_err(|e| e.to_string())?,
            ) as Arc<dyn Reranker>),
            None => None,
        };
        let mut reads = Reads::primary(store.clone());
        if let Some(url) = &settings.database.read_url {
            reads = reads
                .with_replica(
                    url.expose(),
                    settings.database.max_connections,
                    settings.database.replica_wait,
                    Some(settings.statement_timeout),
                )
                .map_err(|e| format!("{}: {e}", mnemo_config::vars::READ_DATABASE_URL))?;
        }
        Ok(Self(Arc::new(AppParts {
            // A batch runs a few statements, each within the statement timeout; one unanswered
            // past two of them (and a few seconds for the network) was lost on the way.
            writes: GroupCommit::start(
                store.clone(),
                settings.write_committers,
                settings.write_max_batch,
                settings.statement_timeout * 2 + Duration::from_secs(5),
            ),
            recall: Arc::new(
                Recall::new(store.clone(), embedder, reranker, settings.recall.clone())
                    .reading_from(reads.clone())
                    .with_access_tracking(),
            ),
            reads,
            store,
            auth: Arc::new(Authenticator::new(
                &settings.jwt,
                settings.jwt_audience.as_deref(),
                settings.jwt_issuer.as_deref(),
            )?),
            max_tool_output_bytes: settings.max_tool_output_bytes,
            max_batch_items: settings.max_batch_items,
            tokenizer: Arc::new(mnemo_models::Tokenizer::new(settings.context.tokenizer)),
            context: settings.context.clone(),
            workspace: settings.workspace.clone(),
            metrics: mnemo_config::metrics_handle(),
            rate_limit: limit::RateLimiter::new(settings.rate_limit_per_tenant, settings.rate_limit_burst)
                .map(Arc::new),
            readiness: tokio::sync::Mutex::new(None),
        })))
    }
}

/// The largest body of a route whose fields are all short (a query, a fact of at most 16 KiB,
/// options): 16 KiB escaped at worst (6 bytes a control character) and room for the rest.
const SMALL_BODY_BYTES: usize = 256 * 1024;

/// The whole API: `/v1`, the probes and metrics, and the MCP tools at `/mcp`.
pub fn app(state: AppState) -> Router {
    // The largest content a body may carry (a tool output's payload, a workspace file); JSON
    // escaping can triple its size (any character but ASCII as `\uXXXX`, as Python's json does by
    // default); room for the other fields. Routes that never carry such content take less.
    let largest = state.max_tool_output_bytes.max(state.workspace.max_file_bytes);
    let body_limit = largest.saturating_mul(3).saturating_add(64 * 1024);
    let small = || DefaultBodyLimit::max(SMALL_BODY_BYTES);
    // Routes whose handlers read no query refuse one: `PUT …?expected_version=3` would otherwise
    // overwrite unconditionally, its caller none the wiser.
    let v1_without_query = Router::new()
        .route("/memories", post(routes::remember))
        .route("/memories/batch", post(routes::remember_batch))
        .route("/facts/batch", post(routes::remember_fact_batch))
        .route("/memories/{id}", delete(routes::forget))
        .route("/facts", post(routes::remember_fact).layer(small()))
        .route("/recall", post(routes::recall).layer(small()))
        .route("/memory-pack", post(routes::memory_pack).layer(small()))
        .route("/sessions/{sid}/context", post(conversation::context))
        .route("/sessions/{sid}/complete", post(conversation::complete).layer(small()))
        .route("/sessions/{sid}/extract", post(conversation::extract).layer(small()))
        .route(
            "/workspace/files/{*path}",
            get(workspace::read)
                .put(workspace::write)
                .patch(workspace::patch)
                .delete(workspace::delete)
                .post(workspace::edit),
        )
        .route("/agents/{agent}/consolidate", post(workspace::consolidate).layer(small()))
        .route_layer(middleware::from_fn_with_state(state.clone(), refuse_query));
    let v1 = v1_without_query
        .route("/tool-outputs/{key}", get(routes::tool_output))
        .route("/sessions/{sid}/messages", get(conversation::messages))
        .route("/workspace/files", get(workspace::list))
        .route("/workspace/prompt", get(workspace::prompt))
        .route_layer(middleware::from_fn_with_state(state.clone(), refuse_body));
    let api = Router::new()
        .nest("/v1", v1)
        .route("/healthz", get(routes::healthz))
        .route("/readyz", get(routes::readyz))
        .route("/metrics", get(routes::metrics))
        .route("/openapi.json", get(openapi::serve))
        .fallback(|| async { ApiError::NotFound })
        // The router lists a route's methods in `Allow`, but the files' wildcard route serves
        // two resources with different methods.
        .method_not_allowed_fallback(|uri: OriginalUri| async move {
            ApiError::MethodNotAllowed(workspace::file_route_methods(uri.path()))
        })
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(middleware::from_fn(observe))
        .with_state(state.clone());
    // An MCP request is refused before rmcp reads it unless it carries a valid token, which each
    // tool call then presents to `api` as its own.
    let mcp = Router::new()
        .route_service("/mcp", mcp::http_service(api.clone(), body_limit))
        .layer(middleware::from_fn_with_state((state, body_limit), authenticate))
        .layer(middleware::from_fn(observe));
    api.merge(mcp)
}

/// Refuses a request with a query (`unknown_field`, naming its first parameter), once its token
/// verifies and is charged: a caller without a valid token learns that first, and one over its
/// rate gets 429, as on every other route.
async fn refuse_query(State(state): State<AppState>, request: Request, next: Next) -> Result<Response, ApiError> {
    let first = body::query_pairs(request.uri().query()).next().map(|(name, _)| name.to_owned());
    if let Some(name) = first {
        let (mut parts, _) = request.into_parts();
        auth::Authenticated::from_request_parts(&mut parts, &state).await?;
        return Err(ApiError::unknown_field(&name));
    }
    Ok(next.run(request).await)
}

/// A GET or DELETE reads no body: one with fields is refused as a PUT's unknown field is, before
/// anything is read or deleted (`DELETE …` with `{"expected_version": 3}` would otherwise delete
/// whatever version is there). An empty body or `{}` passes.
async fn refuse_body(State(state): State<AppState>, request: Request, next: Next) -> Result<Response, ApiError> {
    // `…/edit` takes POST alone: the handler answers any other method 405, body or not.
    let body_less = matches!(*request.method(), axum::http::Method::GET | axum::http::Method::DELETE);
    if !body_less || request.uri().path().ends_with("/edit") {
        return Ok(next.run(request).await);
    }
    let (mut parts, body) = request.into_parts();
    let bytes = body::read_body(body, SMALL_BODY_BYTES).await?;
    if !bytes.iter().all(u8::is_ascii_whitespace) {
        auth::Verified::from_request_parts(&mut parts, &state).await?;
        if let Err(refused) = body::JsonObject::parse(&bytes).and_then(body::JsonObject::finish) {
            // A refusal costs a request of the tenant's rate, as a handler's does.
            auth::Authenticated::from_request_parts(&mut parts, &state).await?;
            return Err(refused);
        }
    }
    Ok(next.run(Request::from_parts(parts, axum::body::Body::from(bytes))).await)
}

/// Lets an MCP request through only with a valid token, and charges one request of the tenant's
/// rate for every message. A message over the limit is refused with 429, except a tool call:
/// that goes on marked [`mcp::OverLimit`], so the agent gets a tool error it can read rather than
/// an HTTP error its client raises.
async fn authenticate(
    State((state, body_limit)): State<(AppState, usize)>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let (mut parts, body) = request.into_parts();
    let auth::Verified(principal) = auth::Verified::from_request_parts(&mut parts, &state).await?;
    // Charged before the body is read, so that a body refused below still counts.
    let charged = auth::charge(&state, &principal);
    let body = body::read_body(body, body_limit).await?;
    if let Err(refused) = charged {
        let ApiError::RateLimited(wait) = refused else { return Err(refused) };
        if !mcp::is_tool_call(&body) {
            return Err(refused);
        }
        parts.extensions.insert(mcp::OverLimit(wait));
    }
    // A tool call's arguments get the checks a `/v1` body gets (a repeated key, too many values).
    if !body.is_empty() {
        body::strict_json(&body)?;
    }
    Ok(next.run(Request::from_parts(parts, body.into())).await)
}

/// Counts, times and traces every request by route template (never by concrete path, which may
/// carry ids or keys). The request's span continues the caller's trace when it sends a W3C
/// `traceparent`.
async fn observe(request: Request, next: Next) -> Response {
    let route = request.extensions().get::<MatchedPath>().map_or("unmatched", |p| p.as_str()).to_owned();
    // A method is any token a client sends: one label per made-up method would grow the
    // metrics without end.
    let method: &'static str = match *request.method() {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    };
    // Probes and scrapes come every few seconds and would bury the traces worth reading.
    let probe = matches!(route.as_str(), "/healthz" | "/readyz" | "/metrics");
    let span = if probe {
        tracing::Span::none()
    } else {
        tracing::info_span!(
            "request",
            otel.name = %format_args!("{method} {route}"),
            otel.kind = "server",
            http.request.method = %method,
            http.route = %route,
            http.response.status_code = tracing::field::Empty,
        )
    };
    {
        let header = |name| request.headers().get(name).and_then(|v| v.to_str().ok());
        mnemo_config::continue_trace(&span, header("traceparent"), header("tracestate"));
    }
    let started = Instant::now();
    let response = next.run(request).instrument(span.clone()).await;
    span.record("http.response.status_code", response.status().as_u16());
    let status = response.status().as_u16().to_string();
    metrics::histogram!("mnemo_http_request_duration_seconds", "route" => route.clone(), "method" => method)
        .record(started.elapsed().as_secs_f64());
    metrics::counter!("mnemo_http_requests_total", "route" => route, "method" => method, "status" => status)
        .increment(1);
    response
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Model(#[from] mnemo_models::ModelError),
    #[error(transparent)]
    Store(#[from] mnemo_store::StoreError),
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: std::net::SocketAddr, source: std::io::Error },
    #[error("server error: {0}")]
    Io(#[from] std::io::Error),
}

/// Connects, checks the schema, and serves until `shutdown` resolves; in-flight requests finish.
pub async fn run(
    settings: ServerSettings,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let (url, max) = (settings.database.url.expose(), settings.database.max_connections);
    let store = Store::connect_bounded(url, max, settings.statement_timeout).await?;
    let schema = MIGRATOR.status(store.pool()).await?;
    if !schema.is_current() {
        tracing::warn!(
            pending = schema.pending.len(),
            unknown = schema.unknown.len(),
            "the database schema is not current; /readyz answers 503 until `mnemo-runbook migrate` runs"
        );
    }
    if !store.walled() {
        tracing::warn!(
            "the database role is the tables' owner, a superuser or BYPASSRLS: row-level security does not \
             hold it, so each statement's tenant filter is the only wall (ARCHITECTURE.md, \"Two roles\")"
        );
    } else if store.wall_hides_keyword_index().await? {
        tracing::warn!(
            "full-text matching is not marked leakproof in this database: under row-level security keyword \
             search scans the tenant's rows (scripts/setup-postgres.sh shows the one statement that fixes it)"
        );
    }
    for warning in &settings.recall.warnings {
        tracing::warn!("{warning}");
    }
    if settings.recall.reranker_url.is_none() {
        tracing::info!("MNEMO_RERANKER_URL is unset: recall answers in merge order");
    }
    let embedder = mnemo_models::embedder(&settings.embed)?;
    if !store.has_vector_index(embedder.model(), embedder.dimensions()).await? {
        tracing::warn!(
            model = embedder.model(),
            "no vector index for this model yet: the tenant class is ranked exactly (slow) until a worker builds it"
        );
    }
    let state = AppState::new(store, &settings, embedder).map_err(ServeError::Config)?;
    let listener = tokio::net::TcpListener::bind(settings.listen)
        .await
        .map_err(|source| ServeError::Bind { addr: settings.listen, source })?;
    tracing::info!(addr = %listener.local_addr()?, "mnemo-server listening");
    let recall = state.recall.clone();
    serve(listener, app(state), ConnectionLimits::of(&settings), shutdown).await?;
    // The last second's accesses, gathered but not queued yet, would go with the process.
    if tokio::time::timeout(Duration::from_secs(5), recall.flush_access()).await.is_err() {
        tracing::warn!("the last accesses recall gathered could not be queued in time");
    }
    tracing::info!("mnemo-server stopped");
    Ok(())
}
