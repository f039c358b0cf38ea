//! The contradiction judge: throughput against a model endpoint that answers after a fixed delay,
//! and fact consolidation on MemoryAgentBench's Conflict_Resolution sets (is the newest fact
//! found, above the facts it overrides, and are those superseded).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use mnemo_config::{Env, JudgeSettings, RecallSettings};
use mnemo_core::{Extras, FactScope, Judge, MemoryText, NewMemory, Principal, RecallRequest, RecallScope};
use mnemo_jobs::{JudgePolicy, judge_pending};
use mnemo_models::OpenAiJudge;
use mnemo_recall::Recall;
use mnemo_store::Store;
use mnemo_testkit::{ScriptedChat, embed_like_the_provider};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::embedding::{JudgeQueue, fresh, local_embedder, start_worker, wait_embedded};

#[derive(Debug, clap::Args)]
pub struct ThroughputArgs {
    /// How long the scripted model takes to answer each call.
    #[arg(long, default_value_t = 200)]
    delay_ms: u64,
    #[arg(long, value_delimiter = ',', default_value = "1,5,20,50")]
    batch_sizes: Vec<usize>,
    /// Facts judged per batch size: this many batches' worth, at least 50.
    #[arg(long, default_value_t = 20)]
    batches: usize,
}

/// A user of a tenant, as a token would name them.
fn user(tenant: &str, user: &str) -> Principal {
    mnemo_testkit::principal(tenant, Some(user), None, None)
}

fn fact(who: &Principal, text: &str) -> anyhow::Result<NewMemory> {
    Ok(NewMemory::fact(who, FactScope::User, MemoryText::parse(text)?, None, Extras::default())?)
}

/// Writes one old fact per user and judges it (no candidates), then one contradicting fact per
/// user, embedded and pending: every pending fact has exactly one candidate and one model call.
async fn seed(store: &Store, tenant: &str, users: usize) -> anyhow::Result<()> {
    for (text, settle) in [("I live in Rome", true), ("I live in Paris", false)] {
        let rows =
            (0..users).map(|u| fact(&user(tenant, &format!("u{u}")), text)).collect::<anyhow::Result<Vec<_>>>()?;
        for chunk in rows.chunks(500) {
            for result in store.remember_many(chunk).await? {
                result?;
            }
        }
        embed_like_the_provider(store, "scripted", 64).await;
        if settle {
            judge_pending(store, None, policy(100), "seed").await?;
        }
    }
    Ok(())
}

fn policy(batch_size: usize) -> JudgePolicy {
    JudgePolicy { batch_size, max_wait: Duration::from_millis(5), topk: 5, threshold: 0.7 }
}

pub async fn throughput(args: ThroughputArgs) -> anyhow::Result<()> {
    let env = Env::from_process()?;
    let (_, store) = fresh(&env).await?;
    let chat = ScriptedChat::start().await;
    chat.delay_every_answer(Duration::from_millis(args.delay_ms));
    let judge: Arc<dyn Judge> =
        Arc::new(OpenAiJudge::new(Some(&chat.base_url), "bench", "scripted-judge", Duration::from_secs(30))?);
    println!(
        "{:>6} {:>7} {:>10} {:>12} {:>16} {:>18}",
        "batch", "facts", "seconds", "facts/s", "ideal facts/s", "overhead ms/fact"
    );
    let mut results = Vec::new();
    for &batch in &args.batch_sizes {
        let facts = (batch * args.batches).max(50);
        let tenant = format!("throughput-{batch}");
        seed(&store, &tenant, facts).await?;
        let started = Instant::now();
        let reports = judge_pending(&store, Some(judge.clone()), policy(batch), "bench").await?;
        let elapsed = started.elapsed().as_secs_f64();
        let judged: usize = reports.iter().map(|r| r.outcomes.len()).sum();
        anyhow::ensure!(judged == facts, "judged {judged} of {facts} facts");
        let superseded = reports.iter().flat_map(|r| &r.outcomes).filter(|o| o.as_str() == "superseded").count();
        anyhow::ensure!(superseded == facts, "only {superseded} of {facts} facts superseded their candidate");
        // Everything a batch spends beyond its slowest model call is mnemo's own work.
        let overhead: f64 = reports.iter().map(|r| (r.wall.saturating_sub(r.model_max)).as_secs_f64()).sum();
        let overhead_ms = overhead * 1000.0 / facts as f64;
        let rate = facts as f64 / elapsed;
        let ideal = batch as f64 / (args.delay_ms as f64 / 1000.0);
        println!("{batch:>6} {facts:>7} {elapsed:>10.2} {rate:>12.1} {ideal:>16.1} {overhead_ms:>18.2}");
        results.push(json!({"batch_size": batch, "facts": facts, "seconds": elapsed, "facts_per_second": rate,
            "ideal_facts_per_second": ideal, "overhead_ms_per_fact": overhead_ms}));
    }
    eprintln!("{}", json!({ "delay_ms": args.delay_ms, "results": results }));
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum JudgeChoice {
    /// MNEMO_JUDGE_MODEL empty: the model step is off.
    Disabled,
    /// A scripted endpoint that supersedes when both facts start with the same three words. Not
    /// a model: a baseline that shows the mechanism and what a crude rule costs.
    Rule,
    /// The OpenAI-compatible model that MNEMO_JUDGE_MODEL, MNEMO_JUDGE_BASE_URL and
    /// MNEMO_JUDGE_API_KEY (or OPENAI_*) name.
    Model,
}

#[derive(Debug, clap::Args)]
pub struct FactConsolidationArgs {
    /// MemoryAgentBench's Conflict_Resolution file; its sibling
    /// derived-single-hop-evidence.heuristic.json names each question's new and old facts.
    #[arg(long, default_value = "../shared/bench/factconsolidation/conflict-resolution-6k-32k.json")]
    data: PathBuf,
    #[arg(long, value_enum, default_value = "disabled")]
    judge: JudgeChoice,
    #[arg(long, default_value_t = 10)]
    k: usize,
    #[arg(long)]
    json: bool,
}

/// One single-hop question with the fact that answers it now and the facts it overrides.
struct Question {
    question: String,
    new_fact: usize,
    old_facts: Vec<usize>,
}

/// The numbered facts of a context: "Here is a list of facts:\n0. …\n1. …".
fn numbered_facts(context: &str) -> Vec<String> {
    context
        .lines()
        .filter_map(|line| {
            let (number, text) = line.split_once(". ")?;
            number.parse::<usize>().ok()?;
            Some(text.trim().to_owned())
        })
        .collect()
}

pub async fn fact_consolidation(args: FactConsolidationArgs) -> anyhow::Result<()> {
    let env = Env::from_process()?;
    let data: Value = serde_json::from_str(&std::fs::read_to_string(&args.data).context("reading --data")?)?;
    let evidence_path = args.data.with_file_name("derived-single-hop-evidence.heuristic.json");
    let evidence: Value = serde_json::from_str(
        &std::fs::read_to_string(&evidence_path).with_context(|| format!("reading {}", evidence_path.display()))?,
    )?;
    let judge: Option<Arc<dyn Judge>> = match args.judge {
        JudgeChoice::Disabled => None,
        JudgeChoice::Rule => {
            let chat = ScriptedChat::start().await;
            Some(Arc::new(OpenAiJudge::new(
                Some(&chat.base_url),
                "bench",
                "first-three-words-rule",
                Duration::from_secs(30),
            )?))
        }
        JudgeChoice::Model => match mnemo_models::judge(&JudgeSettings::from_env(&env)?)? {
            Some(judge) => Some(judge),
            None => {
                bail!("--judge model needs MNEMO_JUDGE_MODEL and an endpoint (MNEMO_JUDGE_BASE_URL or OPENAI_BASE_URL)")
            }
        },
    };
    let judge_name = judge.as_ref().map_or("disabled".to_owned(), |j| j.model().to_owned());

    let (_, embedder) = local_embedder(&env)?;
    let (url, store) = fresh(&env).await?;
    let mut sources = Vec::new();
    for entry in data.as_array().context("a list of sources")? {
        let source = entry["metadata"]["source"].as_str().context("metadata.source")?;
        // Multi-hop questions have no evidence map: single-hop sources only.
        let Some(questions) = evidence[source].as_array() else { continue };
        let facts = numbered_facts(entry["context"].as_str().context("context")?);
        let questions: Vec<Question> = questions
            .iter()
            .filter_map(|q| {
                Some(Question {
                    question: q["question"].as_str()?.to_owned(),
                    new_fact: usize::try_from(q["new_fact_id"].as_u64()?).ok()?,
                    old_facts: q["old_fact_ids"]
                        .as_array()?
                        .iter()
                        .filter_map(|i| usize::try_from(i.as_u64()?).ok())
                        .collect(),
                })
            })
            .filter(|q| !q.old_facts.is_empty())
            .collect();
        sources.push((source.to_owned(), facts, questions));
    }

    // Each source is one user's memory, written in order, one remember_fact at a time.
    let started = Instant::now();
    let mut ids: HashMap<String, Vec<Uuid>> = HashMap::new();
    let mut rows = 0;
    for (source, facts, _) in &sources {
        let who = user("factconsolidation", source);
        let mut source_ids = Vec::with_capacity(facts.len());
        for text in facts {
            source_ids.push(store.remember(&fact(&who, text)?).await?.id);
        }
        rows += source_ids.iter().collect::<std::collections::HashSet<_>>().len();
        ids.insert(source.clone(), source_ids);
    }
    eprintln!("wrote {rows} facts of {} sources; embedding and judging ({judge_name})…", sources.len());
    let stop = start_worker(&env, &url, 32, embedder.clone(), JudgeQueue::Serve(judge))?;
    wait_embedded(&store, embedder.model(), rows, Duration::from_secs(3600)).await?;
    while store.judge_status(Duration::from_secs(60)).await?.pending > 0 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop.send(());
    eprintln!("settled in {:.0} s", started.elapsed().as_secs_f64());

    let recall = Recall::new(store.clone(), embedder, None, RecallSettings::from_env(&env)?);
    let superseded = store.superseded_ids().await?;
    let mut report = Vec::new();
    // Over every source: questions, new retrieved, new above old, old facts, old superseded.
    let mut all = [0usize; 5];
    for (source, _, questions) in &sources {
        let who = user("factconsolidation", source);
        let ids = &ids[source];
        let (mut retrieved, mut above, mut old_total, mut old_superseded) = (0, 0, 0, 0);
        let mut known_old = std::collections::HashSet::new();
        for q in questions {
            let request = RecallRequest::new(&q.question)?.top_k(args.k)?.scope(RecallScope::User).enable_rerank(false);
            let found: Vec<Uuid> = recall.recall(&who, &request).await?.items.into_iter().map(|i| i.id).collect();
            let rank = |id: Uuid| found.iter().position(|f| *f == id);
            let new_id = ids[q.new_fact];
            if let Some(new_rank) = rank(new_id) {
                retrieved += 1;
                if q.old_facts.iter().all(|&o| rank(ids[o]).is_none_or(|r| r > new_rank)) {
                    above += 1;
                }
            }
            for &o in &q.old_facts {
                old_total += 1;
                known_old.insert(ids[o]);
                old_superseded += usize::from(superseded.contains(&ids[o]));
            }
        }
        let source_ids: std::collections::HashSet<&Uuid> = ids.iter().collect();
        let superseded_here = superseded.iter().filter(|id| source_ids.contains(id)).count();
        let superseded_not_known_old =
            superseded.iter().filter(|id| source_ids.contains(id) && !known_old.contains(id)).count();
        for (total, n) in all.iter_mut().zip([questions.len(), retrieved, above, old_total, old_superseded]) {
            *total += n;
        }
        let n = questions.len().max(1) as f64;
        report.push(json!({
            "source": source,
            "questions": questions.len(),
            "facts": source_ids.len(),
            "new_retrieved_at_k": retrieved as f64 / n,
            "new_above_old": above as f64 / n,
            "old_superseded": old_superseded as f64 / old_total.max(1) as f64,
            "superseded_total": superseded_here,
            "superseded_outside_the_known_old_facts": superseded_not_known_old,
        }));
    }
    let fraction = |part: usize, whole: usize| part as f64 / whole.max(1) as f64;
    let summary = json!({
        "judge_mode": judge_name,
        "k": args.k,
        "questions": all[0],
        "new_retrieved_at_k": fraction(all[1], all[0]),
        "new_above_old": fraction(all[2], all[0]),
        "old_superseded": fraction(all[4], all[3]),
        "sources": report,
    });
    if args.json {
        println!("{summary}");
        return Ok(());
    }
    println!("judge: {judge_name}, k = {}", args.k);
    println!(
        "{:<26} {:>9} {:>6} {:>12} {:>14} {:>15} {:>12} {:>15}",
        "source",
        "questions",
        "facts",
        "new in top k",
        "new above old",
        "old superseded",
        "superseded",
        "…of other facts"
    );
    for r in &report {
        println!(
            "{:<26} {:>9} {:>6} {:>12.2} {:>14.2} {:>15.2} {:>12} {:>15}",
            r["source"].as_str().unwrap_or(""),
            r["questions"].as_u64().unwrap_or(0),
            r["facts"].as_u64().unwrap_or(0),
            r["new_retrieved_at_k"].as_f64().unwrap_or(0.0),
            r["new_above_old"].as_f64().unwrap_or(0.0),
            r["old_superseded"].as_f64().unwrap_or(0.0),
            r["superseded_total"].as_u64().unwrap_or(0),
            r["superseded_outside_the_known_old_facts"].as_u64().unwrap_or(0),
        );
    }
    Ok(())
}
