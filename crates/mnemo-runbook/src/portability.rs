//! `export` and `import`: a tenant's data as gzip-compressed JSON Lines. Line 1 is a header (the
//! format, its version, the database's schema, the tenant), then one `{"table", "row"}` per row, then `{"end": {"rows"}}`,
//! so a cut file is told from a whole one. Export streams (constant memory); import checks every
//! line and every reference before it writes anything, in one transaction.

use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use mnemo_core::TenantId;
use mnemo_store::{ERASURES, EXPORT_TABLES, Store};
use serde_json::{Value, json};

const FORMAT: &str = "mnemo-export";
const VERSION: u64 = 1;
/// Rows staged per statement on import, and the most bytes of them (a tool output's payload may
/// be megabytes, and one statement's parameters must stay well under PostgreSQL's 1 GB).
const STAGE_BATCH: usize = 1000;
const STAGE_BYTES: usize = 32 << 20;
/// The longest line an import reads: no field PostgreSQL stores is over 1 GB, and a longer line
/// would be held whole in memory before it could be refused.
const MAX_LINE_BYTES: u64 = 1 << 30;
/// Progress on stderr every this many rows.
const PROGRESS_EVERY: u64 = 100_000;

#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    #[arg(long, value_parser = TenantId::parse)]
    tenant: TenantId,
    /// Only rows written or changed (retired, superseded, anonymized…) at or after this RFC 3339
    /// time. Imported over an earlier copy, the changed rows replace their older selves.
    #[arg(long, value_parser = parse_time)]
    since: Option<DateTime<Utc>>,
    /// Include the embedding vectors (large); without them the importing workers embed again.
    #[arg(long)]
    with_vectors: bool,
}

#[derive(Debug, clap::Args)]
pub struct ImportArgs {
    /// The tenant to import into; the file's tenant unless `--retarget`.
    #[arg(long, value_parser = TenantId::parse)]
    tenant: TenantId,
    /// Import a file exported from another tenant into `--tenant`. The target keeps its own
    /// settings (time zone, retention policy) unless `--with-settings`.
    #[arg(long)]
    retarget: bool,
    /// With `--retarget`: take the file's tenant settings too, replacing the target's.
    #[arg(long, requires = "retarget")]
    with_settings: bool,
    /// With `--retarget`, for a file that carries erasures (users named by a hash of their id):
    /// `apply` when the two tenants' user ids name the same people (a tenant moved or renamed,
    /// a copy kept up to date), so the target deletes what it holds of them; `skip` when they do
    /// not, and then the target's own erasures leave out nothing of the file's users either.
    /// Asked for, not guessed: either way round a wrong guess deletes someone's files or keeps an
    /// erased user's.
    #[arg(long, requires = "retarget", value_parser = ["apply", "skip"])]
    erasures: Option<String>,
    /// Check the whole file and report what the import would write, update and delete, then
    /// roll back: nothing is written.
    #[arg(long)]
    dry_run: bool,
    file: PathBuf,
}

/// Line `n` of the file as JSON, and its length; `None` at the end of the file. A line over
/// `max` bytes is refused once `max + 1` are read.
fn read_line(file: &mut impl BufRead, n: i64, max: u64) -> anyhow::Result<Option<(Value, usize)>> {
    let mut line = Vec::new();
    let read = file
        .by_ref()
        .take(max + 1)
        .read_until(b'\n', &mut line)
        .with_context(|| format!("line {n}: the file is truncated or not a mnemo export"))?;
    if read == 0 {
        return Ok(None);
    }
    if line.last() == Some(&b'\n') {
        line.pop();
    } else if line.len() as u64 > max {
        bail!("line {n}: longer than {max} bytes: not a line of a mnemo export");
    }
    let value = serde_json::from_slice(&line).with_context(|| format!("line {n}: not JSON"))?;
    Ok(Some((value, line.len())))
}

fn parse_time(raw: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(raw).map(|t| t.with_timezone(&Utc)).map_err(|e| format!("not RFC 3339: {e}"))
}

pub async fn export(store: &Store, args: ExportArgs) -> anyhow::Result<()> {
    let stdout = std::io::stdout();
    if stdout.is_terminal() {
        bail!("the export is compressed: redirect it to a file (mnemo-runbook export --tenant T > T.jsonl.gz)");
    }
    let started = Instant::now();
    let mut export = store.begin_export().await?;
    // The erasures since, so that a copy kept up to date by exports `--since` drops what it still
    // holds of those users (their files are deleted here, which no row can carry).
    let erasures = export.erasures(&args.tenant, args.since).await?;
    // An empty file would pass for the backup of a tenant whose name was mistyped (with --since
    // too, unless erasures since must reach the copy: a tenant whose only files were erased).
    if !export.holds(&args.tenant).await? && (args.since.is_none() || erasures.is_empty()) {
        bail!("tenant {} holds no memories, workspace files or settings: nothing to export", args.tenant);
    }
    // Buffered in front of the encoder: each of a line's many small writes would otherwise be a
    // compression call of its own (flate2 clears its whole output buffer on each one).
    let encoder = flate2::write::GzEncoder::new(stdout.lock(), flate2::Compression::fast());
    let mut out = std::io::BufWriter::with_capacity(1 << 16, encoder);
    let header = json!({
        "format": FORMAT, "version": VERSION, "schema": export.schema, "tenant": args.tenant.as_str(),
        "exported_at": export.started_at, "since": args.since, "with_vectors": args.with_vectors,
    });
    writeln!(out, "{header}")?;
    let mut rows = 0u64;
    for &(table, time) in EXPORT_TABLES {
        if table == "memory_embeddings" && !args.with_vectors {
            continue;
        }
        let mut stream = export.rows(&args.tenant, (table, time), args.since);
        let mut count = 0u64;
        while let Some(row) = stream.next().await {
            writeln!(out, "{}", json!({ "table": table, "row": row? }))?;
            count += 1;
            rows += 1;
            if rows.is_multiple_of(PROGRESS_EVERY) {
                eprintln!(
                    "exported {rows} rows ({table}), {:.0} rows/s",
                    rows as f64 / started.elapsed().as_secs_f64()
                );
            }
        }
        eprintln!("{table}: {count}");
    }
    for row in &erasures {
        writeln!(out, "{}", json!({ "table": ERASURES, "row": row }))?;
    }
    rows += erasures.len() as u64;
    eprintln!("{ERASURES}: {}", erasures.len());
    writeln!(out, "{}", json!({ "end": { "rows": rows } }))?;
    out.into_inner().map_err(std::io::IntoInnerError::into_error)?.finish()?.flush()?;
    let seconds = started.elapsed().as_secs_f64();
    eprintln!("exported {rows} rows in {seconds:.1} s ({:.0} rows/s)", rows as f64 / seconds.max(1e-9));
    Ok(())
}

pub async fn import(store: &Store, args: ImportArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let file = std::fs::File::open(&args.file).with_context(|| format!("cannot open {}", args.file.display()))?;
    let mut lines = BufReader::new(flate2::read::GzDecoder::new(file));
    let mut line_no = 1i64;
    let (header, _) = read_line(&mut lines, line_no, MAX_LINE_BYTES)?.context("the file is empty")?;
    if header["format"] != FORMAT {
        bail!("line 1: not a mnemo export (format {})", header["format"]);
    }
    if header["version"] != VERSION {
        bail!("line 1: export format version {} is not one this mnemo reads (it reads {VERSION})", header["version"]);
    }
    // Files exported before the header named its schema have no later columns than this one.
    let schema = header.get("schema").map_or(Some(0), Value::as_i64).context("line 1: the schema is not a number")?;
    let ours = store.schema_version().await?;
    if schema > ours {
        bail!(
            "line 1: the file was exported from a newer schema (migration {schema}; this database has {ours}): \
             upgrade mnemo and run `mnemo-runbook migrate` before importing it"
        );
    }
    let source = header["tenant"].as_str().context("line 1: the header names no tenant")?.to_owned();
    if source != args.tenant.as_str() && !args.retarget {
        bail!(
            "line 1: the file holds tenant {source:?}, not {:?}; pass --retarget to import it there",
            args.tenant.as_str()
        );
    }

    // Files exported before the header said when have no erasures either (those came later).
    let exported_at = match &header["exported_at"] {
        Value::Null => None,
        at => {
            Some(at.as_str().and_then(|t| parse_time(t).ok()).context("line 1: exported_at is not an RFC 3339 time")?)
        }
    };
    // `skip`: the file's user ids name other people than the target's, whose erasures are not
    // theirs. Memories are anonymized for an erasure only when the ids surely name the same
    // people (the tenant's own file, or `apply`): that cannot be undone.
    let own_erasures = match (args.erasures.as_deref(), args.retarget) {
        (Some("skip"), _) => mnemo_store::OwnErasures::Ignore,
        (Some("apply"), _) | (None, false) => mnemo_store::OwnErasures::Anonymize,
        _ => mnemo_store::OwnErasures::LeaveOutFiles,
    };
    let mut import = store.begin_import(&args.tenant, args.retarget && args.with_settings, own_erasures).await?;
    let mut batch: Vec<(i64, &'static str, Value)> = Vec::with_capacity(STAGE_BATCH);
    let (mut rows, mut batch_bytes) = (0u64, 0usize);
    let mut settings_left_out = false;
    let mut erasures_left_out = 0u64;
    let end = loop {
        line_no += 1;
        let Some((mut value, bytes)) = read_line(&mut lines, line_no, MAX_LINE_BYTES)? else {
            bail!("the file ends after line {} without its end line: it is truncated", line_no - 1);
        };
        if let Some(end) = value.get("end") {
            break end.clone();
        }
        let table = value["table"].as_str().unwrap_or_default();
        let known = EXPORT_TABLES.iter().map(|(t, _)| *t).chain([ERASURES]).find(|t| *t == table);
        let Some(table) = known else {
            bail!("line {line_no}: unknown table {:?}", value["table"]);
        };
        let row = value.get_mut("row").filter(|r| r.is_object()).with_context(|| format!("line {line_no}: no row"))?;
        if row["tenant_id"] != source.as_str() {
            bail!("line {line_no}: a row of tenant {}, in an export of tenant {source:?}", row["tenant_id"]);
        }
        rows += 1;
        if table == ERASURES {
            if args.retarget && args.erasures.is_none() {
                bail!(
                    "line {line_no}: the file carries erasures of tenant {source:?}'s users (by a hash of their \
                     id): with --retarget, say whether those ids name the same people in {:?} (--erasures apply) \
                     or not (--erasures skip). Nothing was imported",
                    args.tenant.as_str()
                );
            }
            if args.erasures.as_deref() == Some("skip") {
                erasures_left_out += 1;
            } else {
                import.erasure(line_no, row, exported_at)?;
            }
            continue;
        }
        // Another tenant's time zone and retention policy (its dry run, its TTLs) are not this
        // one's: a retargeted import keeps the target's unless asked.
        if table == "tenant_config" && args.retarget && !args.with_settings {
            settings_left_out = true;
            continue;
        }
        row["tenant_id"] = json!(args.tenant.as_str());
        batch.push((line_no, table, row.take()));
        batch_bytes += bytes;
        if batch.len() == STAGE_BATCH || batch_bytes >= STAGE_BYTES {
            import.stage(&batch).await?;
            batch.clear();
            batch_bytes = 0;
        }
        if rows.is_multiple_of(PROGRESS_EVERY) {
            eprintln!("read {rows} rows, {:.0} rows/s", rows as f64 / started.elapsed().as_secs_f64());
        }
    };
    if end["rows"] != rows {
        bail!("line {line_no}: the end line counts {} rows, the file holds {rows}", end["rows"]);
    }
    if read_line(&mut lines, line_no + 1, MAX_LINE_BYTES)?.is_some() {
        bail!("line {}: lines after the end line", line_no + 1);
    }
    import.stage(&batch).await?;
    eprintln!("read {rows} rows");
    let report =
        import.finish(args.dry_run, |step| eprintln!("{step} ({:.0} s)", started.elapsed().as_secs_f64())).await?;
    let seconds = started.elapsed().as_secs_f64();
    if args.dry_run {
        println!("dry run: what the import would do; nothing was written");
    }
    for (table, in_file, written, overwritten) in &report.tables {
        println!(
            "{table:<24} {in_file:>9} in the file {written:>9} written {overwritten:>9} updated {:>9} already there",
            in_file - written - overwritten
        );
    }
    println!("{} items to embed again (no vector of their model came with them)", report.to_embed);
    if erasures_left_out > 0 {
        println!(
            "{erasures_left_out} erasures of the source tenant left out (--erasures skip): they name its users, not {}'s",
            args.tenant
        );
    }
    if settings_left_out {
        println!("the file's tenant settings left out: {} keeps its own (--with-settings takes them)", args.tenant);
    }
    if report.erasures > 0 {
        println!(
            "{} erasures recorded from the file; {} stored workspace files, versions and sightings of those users deleted",
            report.erasures, report.erased_here
        );
    }
    if report.erased_anonymized > 0 {
        println!("{} memories of users erased here after they were written anonymized", report.erased_anonymized);
    }
    if report.erased_left_out > 0 {
        println!("{} workspace files, versions and sightings of users erased since left out", report.erased_left_out);
    }
    let verb = if args.dry_run { "checked (dry run, nothing written)" } else { "imported" };
    eprintln!("{verb} {rows} rows in {seconds:.1} s ({:.0} rows/s)", rows as f64 / seconds.max(1e-9));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_over_the_bound_is_refused_before_it_is_read_whole() {
        let mut file = std::io::Cursor::new(b"{\"a\": 1}\n{\"b\": \"0123456789\"}\n{}".to_vec());
        assert_eq!(
            read_line(&mut file, 1, 8).expect("at the bound").map(|(v, n)| (v["a"].clone(), n)),
            Some((json!(1), 8))
        );
        let refused = read_line(&mut file, 2, 8).expect_err("over the bound").to_string();
        assert!(refused.contains("line 2: longer than 8 bytes"), "{refused}");
        // Only the bound and one byte more were taken from the file.
        assert_eq!(file.position(), 9 + 9);
    }

    #[test]
    fn the_last_line_may_end_without_a_newline() {
        let mut file = std::io::Cursor::new(b"{}".to_vec());
        assert_eq!(read_line(&mut file, 1, 8).expect("read").map(|(v, _)| v), Some(json!({})));
        assert!(read_line(&mut file, 2, 8).expect("the end").is_none());
    }
}
