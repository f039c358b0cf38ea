//! `mnemo-bench`: benchmarks that need nothing but `MNEMO_DATABASE_URL`. Each scenario works in a
//! fresh database of its own and starts whatever part of mnemo it measures.

use clap::{Parser, Subcommand};

mod writes;

#[derive(Debug, Parser)]
#[command(name = "mnemo-bench", version, about = "Measure mnemo on this machine.")]
struct Cli {
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Debug, Subcommand)]
enum Scenario {
    /// Single-row writes over HTTP at increasing concurrency, against the plain-INSERT rate of
    /// the same PostgreSQL.
    Writes(writes::Args),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().scenario {
        Scenario::Writes(args) => writes::run(args).await,
    }
}
