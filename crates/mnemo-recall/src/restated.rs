//! Recency for updates, without a model. Two rows from the same source (the same kind, role,
//! name, session and user: one participant's messages in a conversation, one tool's outputs
//! there) that say nearly the same thing (their vectors' cosine is at least `SAME_THING`) but
//! state different numbers disagree, and the newer by event time goes just above the older: "my
//! library has 45 sources", then "I've added 52 sources to my library". Only the first `PLACES`
//! are reordered, among themselves, so which rows are returned, and which are in the first ten,
//! never changes. Statements without numbers are never reordered: a later mention of an event is
//! not an update of it.

use std::collections::{BTreeSet, HashMap};

use chrono::{DateTime, Utc};
use mnemo_core::TenantId;
use mnemo_store::{RecalledRow, Search, StoreError};
use uuid::Uuid;

use crate::RecalledItem;

/// The places reordered: recall's usual top 10.
const PLACES: usize = 10;

/// The cosine above which two rows are taken to say the same thing. BEAM's updates ranked above
/// their originals as often from 0.3 to 0.6; the updates' own ranks were best at 0.6, where the
/// fewest other pairs moved (docs/benchmarks.md).
const SAME_THING: f32 = 0.6;

/// Who or what wrote a row, and where: its kind, role, name, session and user.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Source {
    kind: String,
    role: Option<String>,
    name: Option<String>,
    session: Option<String>,
    user: Option<String>,
}

impl Source {
    /// A message's or a tool output's source. Facts have none (they have the judge), nor have
    /// document chunks (they are not statements over time).
    pub(crate) fn of(row: &RecalledRow) -> Option<Source> {
        (row.role.is_some() || row.tool_name.is_some()).then(|| Source {
            kind: row.source_kind.clone(),
            role: row.role.clone(),
            name: row.tool_name.clone(),
            session: row.session_id.clone(),
            user: row.user_id.clone(),
        })
    }
}

/// Puts the newer of each disagreeing pair among `items`' first `PLACES` just above the older.
/// `sources` holds the items that have a source; vectors are read only when a pair could
/// disagree.
pub(crate) async fn newer_first(
    search: &Search,
    tenant: &TenantId,
    items: &mut [RecalledItem],
    sources: &HashMap<Uuid, Source>,
) -> Result<(), StoreError> {
    let places = items.len().min(PLACES);
    let rows: Vec<Row> = items[..places]
        .iter()
        .map(|item| {
            let source = sources.get(&item.id);
            // A row without a source never disagrees: its text is not scanned.
            let numbers = if source.is_some() { numbers(&item.content) } else { BTreeSet::new() };
            Row { source, event_time: item.event_time, numbers, vector: None }
        })
        .collect();
    let could_disagree = |i: usize| (0..places).any(|j| j != i && may_disagree(&rows[i], &rows[j]));
    let ids: Vec<Uuid> = (0..places).filter(|&i| could_disagree(i)).map(|i| items[i].id).collect();
    if ids.is_empty() {
        return Ok(());
    }
    let mut vectors = search.vectors(tenant, &ids).await?;
    let rows: Vec<Row> =
        rows.into_iter().zip(items.iter()).map(|(row, item)| Row { vector: vectors.remove(&item.id), ..row }).collect();
    let reordered: Vec<RecalledItem> = newer_above_older(&rows).into_iter().map(|i| items[i].clone()).collect();
    // A place keeps its score, so that ordering by score (as a pack and clients do) keeps this order.
    for (slot, item) in items.iter_mut().zip(reordered) {
        *slot = RecalledItem { score: slot.score, ..item };
    }
    Ok(())
}

struct Row<'a> {
    source: Option<&'a Source>,
    event_time: DateTime<Utc>,
    numbers: BTreeSet<&'a str>,
    vector: Option<Vec<f32>>,
}

/// Same source, different times, and numbers on both sides that differ: all but the vectors.
fn may_disagree(a: &Row, b: &Row) -> bool {
    a.source.is_some()
        && a.source == b.source
        && a.event_time != b.event_time
        && !a.numbers.is_empty()
        && !b.numbers.is_empty()
        && a.numbers != b.numbers
}

fn disagree(a: &Row, b: &Row) -> bool {
    may_disagree(a, b)
        && match (&a.vector, &b.vector) {
            (Some(x), Some(y)) => cosine(x, y) >= SAME_THING,
            _ => false,
        }
}

/// The rows' new order (indexes into `rows`): the order they came in, except that the newer of a
/// disagreeing pair sits just above the older. Built from the bottom: a row is placed once every
/// older row it disagrees with is below it, the lowest such row first. Each pair points from
/// newer to older, so there is no cycle and every row is placed.
fn newer_above_older(rows: &[Row]) -> Vec<usize> {
    let waits_for = |i: usize, placed: &[bool]| {
        (0..rows.len()).any(|j| !placed[j] && rows[j].event_time < rows[i].event_time && disagree(&rows[i], &rows[j]))
    };
    let mut placed = vec![false; rows.len()];
    let mut bottom_up = Vec::with_capacity(rows.len());
    while bottom_up.len() < rows.len() {
        let next = (0..rows.len())
            .rev()
            .find(|&i| !placed[i] && !waits_for(i, &placed))
            .expect("pairs point from newer to older: no cycle");
        placed[next] = true;
        bottom_up.push(next);
    }
    bottom_up.reverse();
    bottom_up
}

/// The numbers a text states: runs that begin with a digit and go on through digits and the
/// `,` `.` `:` inside them ("1,200", "5.3.0", "10:30"), without trailing punctuation.
fn numbers(text: &str) -> BTreeSet<&str> {
    let mut found = BTreeSet::new();
    let mut rest = text;
    while let Some(start) = rest.find(|c: char| c.is_ascii_digit()) {
        let tail = &rest[start..];
        let len = tail.find(|c: char| !(c.is_ascii_digit() || matches!(c, ',' | '.' | ':'))).unwrap_or(tail.len());
        found.insert(tail[..len].trim_end_matches([',', '.', ':']));
        rest = &tail[len..];
    }
    found
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (norm(a) * norm(b)).max(f32::MIN_POSITIVE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(name: &str) -> Source {
        source_in(name, "s1")
    }

    fn source_in(name: &str, session: &str) -> Source {
        Source {
            kind: "chat_message".into(),
            role: Some("user".into()),
            name: Some(name.into()),
            session: Some(session.into()),
            user: None,
        }
    }

    fn row<'a>(source: &'a Source, day: u32, text: &'a str, vector: [f32; 2]) -> Row<'a> {
        Row {
            source: Some(source),
            event_time: format!("2024-03-{day:02}T12:00:00Z").parse().unwrap(),
            numbers: numbers(text),
            vector: Some(vector.to_vec()),
        }
    }

    #[test]
    fn numbers_are_runs_of_digits_with_their_inner_punctuation() {
        let found: Vec<&str> = numbers("45 sources, then 1,200 calls at 10:30 on v5.3.0.").into_iter().collect();
        assert_eq!(found, ["1,200", "10:30", "45", "5.3.0"]);
        assert!(numbers("no digits here").is_empty());
    }

    #[test]
    fn the_newer_of_two_disagreeing_rows_goes_just_above_the_older() {
        let ann = source("ann");
        let rows = [
            row(&ann, 1, "my library has 45 sources", [1.0, 0.0]),
            row(&ann, 2, "something else, 7 times", [0.0, 1.0]),
            row(&ann, 3, "I've added 52 sources", [0.9, 0.1]),
        ];
        assert_eq!(newer_above_older(&rows), [2, 0, 1]);
    }

    #[test]
    fn rows_that_do_not_disagree_keep_their_order() {
        let (ann, bob, ann_elsewhere) = (source("ann"), source("bob"), source_in("ann", "s2"));
        let cases = [
            // the same numbers: a repetition
            [row(&ann, 1, "45 sources", [1.0, 0.0]), row(&ann, 3, "still 45 sources", [1.0, 0.0])],
            // no numbers: a later mention of an event
            [row(&ann, 1, "I painted a sunrise", [1.0, 0.0]), row(&ann, 3, "my sunrise painting", [1.0, 0.0])],
            // two writers
            [row(&ann, 1, "45 sources", [1.0, 0.0]), row(&bob, 3, "52 sources", [1.0, 0.0])],
            // two conversations
            [row(&ann, 1, "45 sources", [1.0, 0.0]), row(&ann_elsewhere, 3, "52 sources", [1.0, 0.0])],
            // not about the same thing
            [row(&ann, 1, "45 sources", [1.0, 0.0]), row(&ann, 3, "52 sources", [0.5, 0.9])],
            // already newer first
            [row(&ann, 3, "52 sources", [1.0, 0.0]), row(&ann, 1, "45 sources", [1.0, 0.0])],
        ];
        for rows in &cases {
            assert_eq!(newer_above_older(rows), [0, 1]);
        }
    }

    #[test]
    fn a_chain_of_updates_comes_newest_first() {
        let ann = source("ann");
        let rows = [
            row(&ann, 1, "45 sources", [1.0, 0.0]),
            row(&ann, 2, "48 sources", [1.0, 0.0]),
            row(&ann, 3, "52 sources", [1.0, 0.0]),
        ];
        assert_eq!(newer_above_older(&rows), [2, 1, 0]);
    }
}
