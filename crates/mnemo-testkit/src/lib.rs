//! Test support, used only as a dev-dependency: a fresh PostgreSQL database per test with the
//! whole schema applied ([`TestDb`]), the API served in-process ([`TestApp`]) or as the real
//! binary ([`ServerProcess`]), and signed tokens. The database comes from `MNEMO_DATABASE_URL`
//! (or `DATABASE_URL`), which `scripts/test.sh` sets to the local server.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod chat;
mod lazy;
mod otlp;
mod provider;
mod reranker;

pub use chat::{ChatAnswer, ScriptedChat};
pub use lazy::LazyEmbedder;
pub use otlp::{OtlpReceiver, ReceivedSpan};
pub use provider::{Answer, ScriptedEmbeddings, bag_of_words, embed_like_the_provider, unit_bag_of_words};
pub use reranker::{RerankAnswer, ScriptedReranker};

use anyhow::{Context, bail};
use mnemo_api::{AppState, app};
use mnemo_config::{Env, ServerSettings, vars};
use mnemo_core::{AgentId, Principal, SessionId, TenantId, UserId};
use mnemo_store::{Store, create_database, with_database};
use serde_json::Value;
use sqlx::PgPool;

/// The secret every test server signs and verifies tokens with.
pub const TEST_JWT_SECRET: &str = "mnemo-test-secret-0123456789abcdef0123";

/// The URL of the server tests run against.
pub fn admin_url() -> String {
    std::env::var(vars::DATABASE_URL)
        .or_else(|_| std::env::var(vars::DATABASE_URL_FALLBACK))
        .expect("set MNEMO_DATABASE_URL (scripts/test.sh does) to run the database tests")
}

/// Grants the API's role (`MNEMO_APP_DATABASE_URL`'s user: not the tables' owner, so
/// row-level security holds it) on the database `name`, which `owner` reaches; returns the URL
/// that connects to it as that role.
pub async fn grant_app_role(owner: &PgPool, name: &str) -> anyhow::Result<String> {
    let app = std::env::var("MNEMO_APP_DATABASE_URL")
        .context("set MNEMO_APP_DATABASE_URL (scripts/env.sh does) to run the database tests")?;
    let app_url = with_database(&app, name);
    let role: sqlx::postgres::PgConnectOptions = app_url.parse()?;
    Store::new(owner.clone()).grant_app_role(role.get_username()).await?;
    Ok(app_url)
}

/// A database of its own, with the whole schema applied. It is dropped when its test passes and
/// left behind when it panics, so a failure can be inspected; `scripts/test.sh` drops those
/// before each run.
#[derive(Debug)]
pub struct TestDb {
    pub name: String,
    /// As the tables' owner, as workers and the runbook connect.
    pub url: String,
    /// As the API's role, as the API connects (granted on this database).
    pub app_url: String,
    pub pool: PgPool,
}

impl TestDb {
    pub async fn new() -> Self {
        Self::create().await.expect("cannot create a test database")
    }

    async fn create() -> anyhow::Result<Self> {
        let db = create_database(&admin_url(), "mnemo_test", 20).await?;
        let app_url = grant_app_role(&db.pool, &db.name).await?;
        Ok(Self { name: db.name, url: db.url, app_url, pool: db.pool })
    }

    pub fn store(&self) -> Store {
        Store::new(self.pool.clone())
    }

    /// This database on the streaming replica of the tests' server (`scripts/setup-replica.sh`).
    pub fn replica_url(&self) -> String {
        let replica = std::env::var("MNEMO_REPLICA_DATABASE_URL")
            .expect("set MNEMO_REPLICA_DATABASE_URL (scripts/env.sh does) to run the replica tests");
        with_database(&replica, &self.name)
    }

    /// A count from any `SELECT count(*) …`, for assertions.
    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned())).fetch_one(&self.pool).await.expect("count query")
    }
}

/// A run of the whole suite kept every test's database, on the primary and its replica, until
/// the next run: gigabytes on a machine with little disk to spare.
impl Drop for TestDb {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let (admin, name) = (admin_url(), self.name.clone());
        // Its own runtime on its own thread: this may run inside the test's runtime, which
        // cannot be blocked on. FORCE ends the sessions on it, the API role's too
        // (setup-postgres.sh makes the owner a member of it), but not an autovacuum worker's:
        // a refusal is tried again for a while, then left to the next run's sweep.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            runtime.block_on(async {
                for _ in 0..50 {
                    if mnemo_store::drop_database(&admin, &name).await.is_ok() {
                        return Some(());
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                None
            })
        })
        .join();
        if !matches!(dropped, Ok(Some(()))) {
            eprintln!("test database {} not dropped; scripts/test.sh drops it next run", self.name);
        }
    }
}

/// A principal from plain strings, for tests.
pub fn principal(tenant: &str, user: Option<&str>, agent: Option<&str>, session: Option<&str>) -> Principal {
    Principal {
        tenant: TenantId::parse(tenant).expect("valid tenant"),
        user: user.map(|u| UserId::parse(u).expect("valid user")),
        agent: agent.map(|a| AgentId::parse(a).expect("valid agent")),
        session: session.map(|s| SessionId::parse(s).expect("valid session")),
        roles: Vec::new(),
    }
}

/// Housekeeping as a test runs it by hand (`mnemo_jobs::run_housekeeping`): a 1 s tick over
/// vectors of `model`, no consolidation schedule, maintenance every 6 h with no note or session
/// retention, the default signals. A test sets what it exercises with `..`.
pub fn housekeeping_policy(model: &str) -> mnemo_jobs::HousekeepingPolicy {
    mnemo_jobs::HousekeepingPolicy {
        interval: Duration::from_secs(1),
        model: model.to_owned(),
        embed_grace: Duration::from_secs(60),
        judge_grace: Duration::from_secs(60),
        job_retention: Duration::from_secs(3600),
        dead_worker_after: Duration::from_secs(60),
        retention_interval: Duration::from_secs(3600),
        consolidate_cron: None,
        consolidate_day_range: 7,
        maintenance: mnemo_config::MaintenanceSettings {
            interval: Duration::from_secs(6 * 3600),
            note_retention_days: 0,
            session_retention_days: 0,
            max_file_bytes: 256 * 1024,
        },
        signals: mnemo_config::SignalSettings::default(),
    }
}

/// A token signed with [`TEST_JWT_SECRET`], valid for an hour.
pub fn token(principal: &Principal) -> String {
    mnemo_api::auth::sign_hs256(TEST_JWT_SECRET.as_bytes(), principal, Duration::from_secs(3600)).expect("sign")
}

/// The settings a test server runs with, plus any overrides.
pub fn server_env<V: AsRef<str>>(database_url: &str, extra: &[(&str, V)]) -> Env {
    let mut pairs = vec![
        (vars::DATABASE_URL.to_owned(), database_url.to_owned()),
        (vars::JWT_SECRET.to_owned(), TEST_JWT_SECRET.to_owned()),
        (vars::LISTEN.to_owned(), "127.0.0.1:0".to_owned()),
    ];
    if let Ok(dir) = std::env::var(vars::LOCAL_MODEL_DIR) {
        pairs.push((vars::LOCAL_MODEL_DIR.to_owned(), dir));
    }
    pairs.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), v.as_ref().to_owned())));
    Env::from_pairs(pairs)
}

/// An HTTP response, read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
}

impl Reply {
    /// The error code of an error reply.
    pub fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("<no error code>")
    }
}

/// A small HTTP client for a mnemo base URL.
#[derive(Debug, Clone)]
pub struct Client {
    pub base: String,
    http: reqwest::Client,
}

impl Client {
    pub fn new(base: String) -> Self {
        mnemo_models::install_tls_provider();
        Self { base, http: reqwest::Client::new() }
    }

    pub async fn post(&self, path: &str, token: Option<&str>, body: &Value) -> Reply {
        self.post_raw(path, token, "application/json", serde_json::to_vec(body).expect("json")).await
    }

    pub async fn post_raw(&self, path: &str, token: Option<&str>, content_type: &str, body: Vec<u8>) -> Reply {
        let mut request =
            self.http.post(format!("{}{path}", self.base)).header("content-type", content_type).body(body);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        Self::read(request.send().await.expect("request sent")).await
    }

    pub async fn get(&self, path: &str, token: Option<&str>) -> Reply {
        self.send(self.http.get(format!("{}{path}", self.base)), token).await
    }

    pub async fn delete(&self, path: &str, token: Option<&str>) -> Reply {
        self.send(self.http.delete(format!("{}{path}", self.base)), token).await
    }

    pub async fn put(&self, path: &str, token: Option<&str>, body: &Value) -> Reply {
        self.send(self.http.put(format!("{}{path}", self.base)).json(body), token).await
    }

    pub async fn patch(&self, path: &str, token: Option<&str>, body: &Value) -> Reply {
        self.send(self.http.patch(format!("{}{path}", self.base)).json(body), token).await
    }

    async fn send(&self, mut request: reqwest::RequestBuilder, token: Option<&str>) -> Reply {
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        Self::read(request.send().await.expect("request sent")).await
    }

    async fn read(response: reqwest::Response) -> Reply {
        let status = response.status().as_u16();
        let bytes = response.bytes().await.expect("body read");
        let body =
            serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
        Reply { status, body }
    }
}

/// The API served in-process on a free port, over its own test database.
#[derive(Debug)]
pub struct TestApp {
    pub db: TestDb,
    pub client: Client,
    server: tokio::task::JoinHandle<()>,
}

impl TestApp {
    pub async fn spawn() -> Self {
        Self::spawn_with::<&str>(&[]).await
    }

    pub async fn spawn_with<V: AsRef<str>>(extra_env: &[(&str, V)]) -> Self {
        Self::spawn_with_db(|_| extra_env).await
    }

    /// Like [`TestApp::spawn_with`], with settings that name the new database (a replica of it).
    pub async fn spawn_with_db<'a, V: AsRef<str>, E: AsRef<[(&'a str, V)]>>(
        extra_env: impl FnOnce(&TestDb) -> E,
    ) -> Self {
        let db = TestDb::new().await;
        let settings = ServerSettings::from_env(&server_env(&db.url, extra_env(&db).as_ref())).expect("test settings");
        // The model loads on the first recall, so tests that never recall do not pay for it.
        let embedder = Arc::new(LazyEmbedder::new(settings.embed.clone()));
        // As the API's role, so that every request runs under row-level security.
        let store = Store::connect_bounded(&db.app_url, 20, settings.statement_timeout)
            .await
            .expect("connect as the API's role");
        assert!(store.walled(), "the API's role must be held by row-level security");
        let state = AppState::new(store, &settings, embedder).expect("test state");
        // Served as `mnemo-server` serves it, with its connection timeouts.
        let timeouts = mnemo_api::ConnectionLimits::of(&settings);
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = tokio::spawn(async move {
            mnemo_api::serve(listener, app(state), timeouts, std::future::pending()).await.expect("test server");
        });
        Self { db, client: Client::new(format!("http://{addr}")), server }
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// Serves `router` on a free local port until the task is aborted or the test ends.
pub(crate) async fn serve(router: axum::Router) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    serve_on(0, router).await
}

/// Serves `router` on local port `port` (0: a free one).
pub(crate) async fn serve_on(port: u16, router: axum::Router) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(async move { axum::serve(listener, router).await.expect("test server") });
    (addr, server)
}

/// The real `mnemo-server` binary, started as a child process.
#[derive(Debug)]
pub struct ServerProcess {
    pub client: Client,
    child: tokio::process::Child,
}

/// A workspace binary, built next to the test executables (`scripts/test.sh` builds them first).
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let dir = exe.parent().and_then(|deps| deps.parent()).context("test executable has no target dir")?;
    let path = dir.join(name);
    if !path.exists() {
        bail!("{} is not built: run `cargo build --bins` first (scripts/test.sh does)", path.display());
    }
    Ok(path)
}

/// The Python of the tests' virtual environment, with the official clients they drive mnemo with
/// (`tests/python-requirements.txt`): `MNEMO_TEST_PYTHON`, which `scripts/test.sh` sets.
pub fn test_python() -> PathBuf {
    std::env::var_os("MNEMO_TEST_PYTHON").map(PathBuf::from).expect(
        "MNEMO_TEST_PYTHON names the Python with the tests' clients: run `make test`, or \
         `export MNEMO_TEST_PYTHON=$(bash scripts/setup-python.sh)`",
    )
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

impl ServerProcess {
    /// Starts the server on `port` and waits until it answers `/healthz`.
    pub async fn start(database_url: &str, port: u16) -> anyhow::Result<Self> {
        Self::start_with::<&str>(database_url, port, &[]).await
    }

    /// [`ServerProcess::start`] with these variables besides (a later pair overrides an earlier one).
    pub async fn start_with<V: AsRef<str>>(database_url: &str, port: u16, env: &[(&str, V)]) -> anyhow::Result<Self> {
        let mut command = tokio::process::Command::new(binary("mnemo-server")?);
        command
            .env_clear()
            .env(vars::DATABASE_URL, database_url)
            .env(vars::JWT_SECRET, TEST_JWT_SECRET)
            .env(vars::LOG, "warn")
            .envs(std::env::var(vars::LOCAL_MODEL_DIR).map(|dir| (vars::LOCAL_MODEL_DIR, dir)))
            .envs(env.iter().map(|(k, v)| (k, v.as_ref())))
            .stdout(Stdio::null());
        Self::spawn(command, port).await
    }

    /// Starts `command`, a `mnemo-server` the caller has set up, listening on local `port`, and
    /// waits until it answers `/healthz`.
    pub async fn spawn(mut command: tokio::process::Command, port: u16) -> anyhow::Result<Self> {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut child = command.env(vars::LISTEN, addr.to_string()).kill_on_drop(true).spawn()?;
        let client = Client::new(format!("http://{addr}"));
        answering(&mut child, &format!("{}/healthz", client.base), "mnemo-server").await?;
        Ok(Self { client, child })
    }

    pub fn id(&self) -> Option<u32> {
        self.child.id()
    }

    /// Whether the process has exited, and how.
    pub fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.child.try_wait()
    }

    /// Sends SIGKILL and waits for the process to go.
    pub async fn kill(mut self) {
        let _ = self.child.kill().await;
    }

    /// SIGTERM, then waits for a clean exit.
    pub async fn terminate(mut self) -> anyhow::Result<std::process::ExitStatus> {
        terminate(&mut self.child).await
    }
}

/// Sends `child` SIGTERM and waits up to a minute for it to exit.
async fn terminate(child: &mut tokio::process::Child) -> anyhow::Result<std::process::ExitStatus> {
    let pid = child.id().context("the process is gone already")?;
    std::process::Command::new("kill").arg("-TERM").arg(pid.to_string()).status()?;
    Ok(tokio::time::timeout(Duration::from_secs(60), child.wait()).await??)
}

/// Waits up to 60 s for a freshly started `what` to answer at `url`; fails at once if it exits.
async fn answering(child: &mut tokio::process::Child, url: &str, what: &str) -> anyhow::Result<()> {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(60) {
        if let Some(status) = child.try_wait()? {
            bail!("{what} exited during start-up: {status}");
        }
        if http.get(url).send().await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("{what} did not answer at {url} within 60 s")
}

/// The real `mnemo-worker` binary, started as a child process.
#[derive(Debug)]
pub struct WorkerProcess {
    pub metrics_url: String,
    child: tokio::process::Child,
}

impl WorkerProcess {
    /// Starts a worker on `database_url` with the local model (from `MNEMO_LOCAL_MODEL_DIR`) unless
    /// `env` says otherwise (a later pair overrides an earlier one), and waits until its metrics
    /// endpoint answers.
    pub async fn start<V: AsRef<str>>(database_url: &str, env: &[(&str, V)]) -> anyhow::Result<Self> {
        let mut command = tokio::process::Command::new(binary("mnemo-worker")?);
        command.env_clear().env(vars::DATABASE_URL, database_url).env(vars::LOG, "warn").stdout(Stdio::null());
        if let Ok(dir) = std::env::var(vars::LOCAL_MODEL_DIR) {
            command.env(vars::LOCAL_MODEL_DIR, dir);
        }
        for (k, v) in env {
            command.env(k, v.as_ref());
        }
        Self::spawn(command).await
    }

    /// Starts `command`, a `mnemo-worker` the caller has set up, with its metrics on a free local
    /// port, and waits until it serves them.
    pub async fn spawn(mut command: tokio::process::Command) -> anyhow::Result<Self> {
        mnemo_models::install_tls_provider();
        let port = free_port();
        let mut child = command.env(vars::WORKER_LISTEN, format!("127.0.0.1:{port}")).kill_on_drop(true).spawn()?;
        let metrics_url = format!("http://127.0.0.1:{port}/metrics");
        answering(&mut child, &metrics_url, "mnemo-worker").await?;
        Ok(Self { metrics_url, child })
    }

    pub fn id(&self) -> Option<u32> {
        self.child.id()
    }

    /// Whether the process has exited, and how.
    pub fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.child.try_wait()
    }

    /// The sum of a counter or gauge over all its label sets, from `/metrics`.
    pub async fn metric(&self, name: &str) -> f64 {
        let text = reqwest::get(&self.metrics_url).await.expect("metrics").text().await.expect("metrics text");
        text.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// SIGKILL: no chance to finish anything.
    pub async fn kill(mut self) {
        let _ = self.child.kill().await;
    }

    /// SIGTERM, then waits for a clean exit.
    pub async fn terminate(mut self) -> anyhow::Result<std::process::ExitStatus> {
        terminate(&mut self.child).await
    }
}

/// Polls `check` until it returns true or `limit` passes.
pub async fn wait_until<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while started.elapsed() < limit {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}
