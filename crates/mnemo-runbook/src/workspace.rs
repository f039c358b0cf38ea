//! Workspace files for operators: list, print (any version), history and restore. Restoring
//! writes the old content as a new version, audited with the actor `runbook`.

use anyhow::{Context, bail};
use clap::Subcommand;
use mnemo_config::{Env, WorkspaceSettings};
use mnemo_core::{AgentId, FileKey, TenantId, UserId, Workspace, WorkspacePath};
use mnemo_store::Store;
use serde_json::{Value, json};

#[derive(Debug, clap::Args)]
pub struct Owner {
    #[arg(long, value_parser = TenantId::parse)]
    tenant: TenantId,
    #[arg(long, value_parser = AgentId::parse)]
    agent: AgentId,
    /// The user, for their files (PROFILE.md, MEMORY.md, memory/…).
    #[arg(long, value_parser = UserId::parse)]
    user: Option<UserId>,
}

impl Owner {
    fn workspace(&self) -> Workspace {
        Workspace { tenant: self.tenant.clone(), agent: self.agent.clone(), user: self.user.clone() }
    }

    fn file(&self, path: &str) -> anyhow::Result<FileKey> {
        let path = WorkspacePath::parse(path)?;
        self.workspace().file(path).context("this file is about a user: give --user")
    }
}

#[derive(Debug, Subcommand)]
pub enum WorkspaceCommand {
    /// The live files (the agent's, and the user's with --user), by sort order.
    Ls {
        #[command(flatten)]
        owner: Owner,
        #[arg(long, default_value = "")]
        prefix: String,
        #[arg(long)]
        json: bool,
    },
    /// Print a file (prints content), or one of its versions.
    Cat {
        #[command(flatten)]
        owner: Owner,
        #[arg(long)]
        path: String,
        #[arg(long)]
        version: Option<i32>,
        #[arg(long)]
        json: bool,
    },
    /// Every version of a file: size, flags, deleted, actor, time.
    History {
        #[command(flatten)]
        owner: Owner,
        #[arg(long)]
        path: String,
        #[arg(long)]
        json: bool,
    },
    /// Index every live MEMORY.md and daily note for recall as it is now (after upgrading to the
    /// release that made them recallable); idempotent.
    Reindex {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: Option<TenantId>,
        #[arg(long)]
        json: bool,
    },
    /// Make an earlier version current again (as a new version).
    Restore {
        #[command(flatten)]
        owner: Owner,
        #[arg(long)]
        path: String,
        #[arg(long)]
        version: i32,
        #[arg(long)]
        json: bool,
    },
}

/// `env` is read by a restore alone, for the most a file may hold (`MNEMO_WORKSPACE_MAX_FILE_BYTES`).
pub async fn run(store: &Store, command: WorkspaceCommand, env: &Env) -> anyhow::Result<()> {
    match command {
        WorkspaceCommand::Reindex { tenant, json } => {
            let mut progress = |done: u64, found: u64| {
                if done.is_multiple_of(1_000) {
                    eprintln!("{done} of {found} files");
                }
            };
            let files = store.reindex_recallable_files(tenant.as_ref(), &mut progress).await?;
            if json {
                println!("{}", json!({ "files": files }));
            } else {
                println!("{files} files indexed for recall (their new pieces wait for the embed queue)");
            }
        }
        WorkspaceCommand::Ls { owner, prefix, json } => {
            let files = store.list_files(&owner.workspace(), &prefix, None, i64::MAX).await?;
            if json {
                let files: Vec<Value> = files
                    .iter()
                    .map(|f| {
                        json!({ "path": f.path.as_str(), "size_bytes": f.size_bytes, "enabled": f.enabled,
                            "sort_order": f.sort_order, "version": f.version, "updated_at": f.updated_at,
                            "owner": if f.user_id.is_empty() { "agent" } else { "user" } })
                    })
                    .collect();
                println!("{}", json!({ "files": files }));
            } else {
                for f in &files {
                    let flag = if f.enabled { "enabled " } else { "disabled" };
                    println!("{:>5} {flag} v{:<4} {:>8} B  {}", f.sort_order, f.version, f.size_bytes, f.path);
                }
            }
            if files.is_empty() {
                if !json {
                    println!("(no files)");
                }
                crate::retention::warn_if_it_holds_nothing(store, &owner.tenant).await?;
            }
        }
        WorkspaceCommand::Cat { owner, path, version, json } => {
            let key = owner.file(&path)?;
            let content = match version {
                Some(version) => store.file_version_content(&key, version).await?,
                None => store.read_file(&key).await?.map(|f| f.content),
            };
            let Some(content) = content else { bail!("no such file or version") };
            if json {
                println!("{}", json!({ "path": path, "version": version, "content": content }));
            } else {
                print!("{content}");
            }
        }
        WorkspaceCommand::History { owner, path, json } => {
            let history = store.file_history(&owner.file(&path)?).await?;
            // A file never written (a mistyped path or owner) has no history: said, not printed empty.
            if history.is_empty() {
                bail!("no such file: {path} (no version of it under that agent and user)");
            }
            if json {
                let versions: Vec<Value> = history
                    .iter()
                    .map(|v| {
                        json!({ "version": v.version, "size_bytes": v.size_bytes, "enabled": v.enabled,
                            "sort_order": v.sort_order, "deleted": v.deleted, "actor": v.actor, "at": v.created_at,
                            "redacted_at": v.redacted_at })
                    })
                    .collect();
                println!("{}", json!({ "versions": versions }));
            } else {
                for v in &history {
                    let state = if v.deleted {
                        "deleted"
                    } else if v.enabled {
                        "enabled"
                    } else {
                        "disabled"
                    };
                    let redacted = v.redacted_at.map(|at| format!("  (text redacted {at})")).unwrap_or_default();
                    println!(
                        "v{:<4} {:>8} B  {state:<8} {:<13} {}{redacted}",
                        v.version, v.size_bytes, v.actor, v.created_at
                    );
                }
            }
        }
        WorkspaceCommand::Restore { owner, path, version, json } => {
            let max_file_bytes = WorkspaceSettings::from_env(env)?.max_file_bytes;
            let new = match store.restore_file(&owner.file(&path)?, version, max_file_bytes, "runbook").await? {
                mnemo_store::Restored::As(new) => new,
                mnemo_store::Restored::NoSuchVersion => bail!("no version {version} of {path}"),
                mnemo_store::Restored::TooLarge { bytes } => bail!(
                    "version {version} of {path} is {bytes} bytes, over the {max_file_bytes} a file may hold \
                     (MNEMO_WORKSPACE_MAX_FILE_BYTES)"
                ),
            };
            if json {
                println!("{}", json!({ "path": path, "restored": version, "version": new }));
            } else {
                println!("{path}: version {version} is current again, as version {new}");
            }
        }
    }
    Ok(())
}
