use std::net::SocketAddr;
use std::time::Duration;

use mnemo_core::Queue;

use crate::{
    ConfigError, ContextSettings, DatabaseSettings, EmbedSettings, Env, JudgeSettings, LogSettings, Problems,
    RetentionSettings, SignalSettings, WorkspaceSettings, vars,
};

/// Everything `mnemo-worker` needs.
#[derive(Debug, Clone)]
pub struct WorkerSettings {
    pub database: DatabaseSettings,
    pub embed: EmbedSettings,
    pub judge: JudgeSettings,
    pub retention: RetentionSettings,
    /// What compaction keeps, and the model that summarizes (and extracts).
    pub context: ContextSettings,
    /// Workspace files and extraction.
    pub workspace: WorkspaceSettings,
    /// The decay half-life and floor fading uses, and the promotion threshold.
    pub signals: SignalSettings,
    /// Queues this process serves, with the jobs it runs at once on each.
    pub queues: Vec<(Queue, usize)>,
    /// The most rows per model call.
    pub embed_batch_size: usize,
    /// Failed attempts after which a row's embedding is given up (and recorded on the row).
    pub embed_max_attempts: i32,
    /// Chat messages are embedded with the turn before them.
    pub embed_previous_turn: bool,
    /// A worker silent this long is presumed dead and its jobs run again elsewhere.
    pub orphan_timeout: Duration,
    pub job_timeout: Duration,
    pub housekeeping_interval: Duration,
    /// Rows unembedded this long after their job was queued get a new job.
    pub embed_grace: Duration,
    /// Finished jobs are kept this long.
    pub job_retention: Duration,
    /// Where `/metrics` is served.
    pub listen: SocketAddr,
    pub log: LogSettings,
}

/// How long a worker may be silent and still be alive (`MNEMO_WORKER_ORPHAN_TIMEOUT_S`): the
/// runbook reads it as the workers do, since their heartbeat's period follows it.
pub fn orphan_timeout(env: &Env) -> Result<Duration, ConfigError> {
    Problems::read_all(env, read_orphan_timeout)
}

fn read_orphan_timeout(env: &Env, problems: &mut Problems) -> Duration {
    problems.seconds(env, vars::WORKER_ORPHAN_TIMEOUT_S, 20)
}

impl WorkerSettings {
    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        let mut problems = Problems::default();
        let database = DatabaseSettings::read(env, &mut problems);
        let embed = EmbedSettings::read(env, &mut problems);
        let judge = JudgeSettings::read(env, &mut problems);
        let retention = RetentionSettings::read(env, &mut problems);
        let context = ContextSettings::read(env, &mut problems);
        let workspace = WorkspaceSettings::read(env, &mut problems);
        let signals = SignalSettings::read(env, &mut problems);
        // A model call's inputs: OpenAI takes at most 2,048 a request.
        let embed_batch_size = problems.bounded(env, vars::EMBED_BATCH_SIZE, 32usize, 1..=2048, "a whole number");
        let default = |queue| default_concurrency(queue, embed_batch_size, &judge);
        let queues = match env.get(vars::WORKER_QUEUES) {
            None => Queue::ALL.iter().map(|&q| (q, default(q))).collect(),
            Some(raw) => parse_queues(raw, default, &mut problems),
        };
        if let Some((_, concurrency)) = queues.iter().find(|(q, _)| *q == Queue::Judge)
            && *concurrency < judge.batch_size
        {
            problems.0.push(format!(
                "{}: judge={concurrency} is below {}={}, so a batch could never fill",
                vars::WORKER_QUEUES,
                vars::JUDGE_BATCH_SIZE,
                judge.batch_size
            ));
        }
        let embed_max_attempts = problems.bounded(env, vars::EMBED_MAX_ATTEMPTS, 16i32, 1..=1000, "a whole number");
        let embed_previous_turn = problems.parsed(env, vars::EMBED_PREVIOUS_TURN, true, "true or false");
        let orphan_timeout = read_orphan_timeout(env, &mut problems);
        let job_timeout = problems.seconds(env, vars::JOB_TIMEOUT_S, 120);
        // A job's work is cut off at its timeout: model calls that may outlast three quarters of
        // it would be cut off unrecorded and paid again on every retry. A job may make two in a
        // row (a server that refuses the answer format is asked again without it).
        for (name, model) in [(vars::JUDGE_TIMEOUT_MS, &judge.model), (vars::LLM_TIMEOUT_MS, &context.model)] {
            if let Some(model) = model
                && model.timeout * 2 >= job_timeout.mul_f64(0.75)
            {
                problems.0.push(format!(
                    "{name}={}, twice over, is not below three quarters of {}={}",
                    model.timeout.as_millis(),
                    vars::JOB_TIMEOUT_S,
                    job_timeout.as_secs()
                ));
            }
        }
        let housekeeping_interval = problems.seconds(env, vars::HOUSEKEEPING_INTERVAL_S, 10);
        let embed_grace = problems.seconds(env, vars::EMBED_GRACE_S, 60);
        let job_retention = problems.seconds(env, vars::JOB_RETENTION_S, 3600);
        let listen = problems.parsed(env, vars::WORKER_LISTEN, SocketAddr::from(([127, 0, 0, 1], 9464)), "an address");
        let log = LogSettings::read(env, &mut problems);
        problems.finish(Self {
            database,
            embed,
            judge,
            retention,
            context,
            workspace,
            signals,
            queues,
            embed_batch_size,
            embed_max_attempts,
            embed_previous_turn,
            orphan_timeout,
            job_timeout,
            housekeeping_interval,
            embed_grace,
            job_retention,
            listen,
            log,
        })
    }
}

/// The jobs a queue runs at once unless `MNEMO_WORKER_QUEUES` says otherwise, derived from the
/// batch sizes they serve so that raising a batch size raises its queue with it.
fn default_concurrency(queue: Queue, embed_batch_size: usize, judge: &JudgeSettings) -> usize {
    match queue {
        // 4× the batch, so the next batches gather while one is in the model.
        Queue::Embed => 4 * embed_batch_size,
        // 2× the batch, so the next batch is in hand when one finishes.
        Queue::Judge => 2 * judge.batch_size,
        // One tenant's sweep at a time per worker: sweeps are long and share the database with
        // everything else.
        Queue::Retention => 1,
        // Sessions compact independently; each job mostly waits on the model.
        Queue::Compact => 8,
        // Extractions of different users run side by side; one user's wait on each other in
        // the database, not here.
        Queue::Extract => 4,
        // Nightly work, mostly waiting on the model.
        Queue::Consolidate => 2,
        // One small UPDATE per recall batch.
        Queue::Access => 2,
    }
}

/// `embed=32,judge`: queue names, each with an optional concurrency (else its default).
fn parse_queues(raw: &str, default: impl Fn(Queue) -> usize, problems: &mut Problems) -> Vec<(Queue, usize)> {
    let mut queues = Vec::new();
    for part in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, concurrency) = match part.split_once('=') {
            Some((name, concurrency)) => (name, Some(concurrency)),
            None => (part, None),
        };
        let Ok(queue) = Queue::parse(name) else {
            let known: Vec<&str> = Queue::ALL.iter().map(|q| q.as_str()).collect();
            problems.0.push(format!("{}: unknown queue {name:?}; known: {}", vars::WORKER_QUEUES, known.join(", ")));
            continue;
        };
        if queues.iter().any(|(q, _)| *q == queue) {
            problems.0.push(format!("{}: queue {name:?} is named twice", vars::WORKER_QUEUES));
            continue;
        }
        match concurrency.map(str::parse::<usize>) {
            None => queues.push((queue, default(queue))),
            Some(Ok(n)) if n > 0 => queues.push((queue, n)),
            Some(_) => problems.0.push(format!("{}: {part:?} needs a positive concurrency", vars::WORKER_QUEUES)),
        }
    }
    if queues.is_empty() && problems.0.is_empty() {
        problems.0.push(format!("{} names no queue", vars::WORKER_QUEUES));
    }
    queues
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn judge_concurrency_below_its_batch_is_refused() {
        let small = Env::from_pairs([(vars::DATABASE_URL, "postgres://x"), (vars::WORKER_QUEUES, "embed,judge=4")]);
        assert!(WorkerSettings::from_env(&small).unwrap_err().to_string().contains("never fill"));
    }

    #[test]
    fn default_concurrencies_follow_the_batch_sizes() {
        let env = Env::from_pairs([(vars::DATABASE_URL, "postgres://x"), (vars::EMBED_BATCH_SIZE, "50")]);
        let settings = WorkerSettings::from_env(&env).expect("valid");
        assert_eq!(
            settings.queues,
            [
                (Queue::Embed, 200),
                (Queue::Judge, 40),
                (Queue::Retention, 1),
                (Queue::Compact, 8),
                (Queue::Extract, 4),
                (Queue::Consolidate, 2),
                (Queue::Access, 2)
            ]
        );
        let named = env.with(vars::JUDGE_BATCH_SIZE, "30").with(vars::WORKER_QUEUES, "judge,retention=3");
        let settings = WorkerSettings::from_env(&named).expect("valid");
        assert_eq!(settings.queues, [(Queue::Judge, 60), (Queue::Retention, 3)]);
    }

    #[test]
    fn values_out_of_range_are_refused_not_bent() {
        let env = Env::from_pairs([
            (vars::DATABASE_URL, "postgres://x"),
            (vars::JOB_TIMEOUT_S, "0"),
            (vars::EMBED_BATCH_SIZE, "0"),
            (vars::EMBED_MAX_ATTEMPTS, "-3"),
        ]);
        let err = WorkerSettings::from_env(&env).unwrap_err();
        assert_eq!(err.0.len(), 3, "{err}");
        assert!(
            err.0.iter().any(|p| p.contains("MNEMO_EMBED_BATCH_SIZE=0 is out of range: a whole number, 1 to 2048"))
        );
        assert!(err.0.iter().any(|p| p.contains("MNEMO_EMBED_MAX_ATTEMPTS=-3 is out of range")), "{err}");
        assert!(
            err.0.iter().any(|p| p.contains("MNEMO_JOB_TIMEOUT_S=0 is out of range: a number of seconds, 1 to 604800"))
        );
        // A memory is deleted for its decay only after it left packs.
        let db = (vars::DATABASE_URL, "postgres://x");
        let forget =
            |floor: &'static str| WorkerSettings::from_env(&Env::from_pairs([db, (vars::DECAY_DELETE_FLOOR, floor)]));
        assert_eq!(forget("0.02").expect("below the fade floor").signals.decay_delete_floor, 0.02);
        assert!(forget("0.2").unwrap_err().to_string().contains("MNEMO_DECAY_DELETE_FLOOR=0.2 must be below"));
        assert!(forget("0.05").is_err(), "not the fade floor itself: a memory is faded first");
        // Waits the database adds to times, or that could outlast a job.
        for (name, value) in [
            (vars::JUDGE_MAX_WAIT_MS, "200000"),
            (vars::EXTRACT_COOLDOWN_S, "99999999999"),
            (vars::CONSOLIDATE_THROTTLE_S, "99999999999"),
        ] {
            let err = WorkerSettings::from_env(&Env::from_pairs([db, (name, value)])).unwrap_err();
            assert!(err.to_string().contains(&format!("{name}={value} is out of range")), "{err}");
        }
        let huge = Env::from_pairs([(vars::DATABASE_URL, "postgres://x"), (vars::EMBED_BATCH_SIZE, "100000")]);
        assert!(WorkerSettings::from_env(&huge).is_err());
        // A model call that could outlast most of its job is refused.
        let slow = Env::from_pairs([
            (vars::DATABASE_URL, "postgres://x"),
            (vars::LLM_MODEL, "m"),
            (vars::LLM_BASE_URL, "http://127.0.0.1:9/v1"),
            (vars::LLM_TIMEOUT_MS, "45000"),
            (vars::JOB_TIMEOUT_S, "120"),
        ]);
        let err = WorkerSettings::from_env(&slow).unwrap_err();
        assert!(
            err.0[0].contains(
                "MNEMO_LLM_TIMEOUT_MS=45000, twice over, is not below three quarters of MNEMO_JOB_TIMEOUT_S=120"
            ),
            "{err}"
        );
        assert!(WorkerSettings::from_env(&slow.with(vars::LLM_TIMEOUT_MS, "44000")).is_ok());
    }

    #[test]
    fn unknown_queues_and_bad_concurrencies_are_reported() {
        let env = Env::from_pairs([(vars::DATABASE_URL, "postgres://x"), (vars::WORKER_QUEUES, "compaction,embed=0")]);
        let err = WorkerSettings::from_env(&env).unwrap_err();
        assert_eq!(err.0.len(), 2, "{err}");
        assert!(
            err.0[0].contains(
                "unknown queue \"compaction\"; known: embed, judge, retention, compact, extract, consolidate"
            ),
            "{err}"
        );
        assert!(err.0[1].contains("\"embed=0\" needs a positive concurrency"), "{err}");
        // Named twice would start two of its workers under one id.
        let env = Env::from_pairs([(vars::DATABASE_URL, "postgres://x"), (vars::WORKER_QUEUES, "embed,embed=8")]);
        let err = WorkerSettings::from_env(&env).unwrap_err();
        assert!(err.0[0].contains("queue \"embed\" is named twice"), "{err}");
    }
}
