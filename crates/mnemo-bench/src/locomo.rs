//! The LoCoMo data, read once for every benchmark that uses it: its conversations' turns and
//! its questions with their evidence. Each benchmark makes its own texts from the turns.

use std::collections::HashSet;
use std::path::Path;

use anyhow::Context;
use chrono::{DateTime, NaiveDateTime, Utc};
use serde_json::Value;

/// One conversation of the file.
pub(crate) struct Sample {
    /// `sample_id`, or `locomo-{index}` when it has none.
    pub name: String,
    /// The `session_<n>` lists, in the order their keys sort as text (session_1, session_10,
    /// session_2, …): the order the recall-latency draws and the LoCoMo rows were measured with.
    pub sessions: Vec<Session>,
    pub qa: Vec<Qa>,
}

pub(crate) struct Session {
    /// The `<n>` of `session_<n>` (0 if it is not a number).
    pub number: u32,
    /// `session_<n>_date_time` ("1:56 pm on 8 May, 2023"), when it reads as a time.
    pub date: Option<DateTime<Utc>>,
    /// Its turns that have a speaker and a text.
    pub turns: Vec<Turn>,
}

pub(crate) struct Turn {
    /// `dia_id`, what evidence names, such as `D1:3`.
    pub id: Option<String>,
    pub speaker: String,
    pub text: String,
    /// The caption of an image the turn shared.
    pub caption: Option<String>,
}

impl Turn {
    /// "speaker: text", the text every benchmark starts from.
    pub fn line(&self) -> String {
        format!("{}: {}", self.speaker, self.text)
    }
}

pub(crate) struct Qa {
    pub question: Option<String>,
    pub category: u64,
    /// Evidence as written, before [`evidence_ids`].
    pub evidence: Vec<String>,
}

impl Sample {
    /// Every turn, session by session in [`Sample::sessions`]' order.
    pub fn turns(&self) -> impl Iterator<Item = &Turn> {
        self.sessions.iter().flat_map(|s| &s.turns)
    }

    /// The gold turn ids of `qa`: evidence ids read leniently, kept if they name a turn of this
    /// sample, sorted and deduplicated. Also counts the evidence strings that needed normalising
    /// and the ids that named no turn.
    pub fn gold(&self, qa: &Qa, known: &HashSet<&str>) -> (Vec<String>, usize, usize) {
        let (mut gold, mut normalised, mut dropped) = (Vec::new(), 0, 0);
        for raw in &qa.evidence {
            let (ids, changed) = evidence_ids(raw);
            normalised += usize::from(changed);
            for id in ids {
                if known.contains(id.as_str()) {
                    gold.push(id);
                } else {
                    dropped += 1;
                }
            }
        }
        gold.sort();
        gold.dedup();
        (gold, normalised, dropped)
    }
}

/// Reads a LoCoMo-format file: a list of samples, each with a `conversation` object.
pub(crate) fn read(path: &Path) -> anyhow::Result<Vec<Sample>> {
    let raw = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let samples: Value = serde_json::from_str(&raw).with_context(|| format!("parsing {}", path.display()))?;
    let samples = samples.as_array().context("LoCoMo data is a list of samples")?;
    let mut out = Vec::with_capacity(samples.len());
    for (index, sample) in samples.iter().enumerate() {
        let name = sample["sample_id"].as_str().map_or_else(|| format!("locomo-{index}"), str::to_owned);
        let conversation = sample["conversation"].as_object().context("a sample without a conversation")?;
        // serde_json's map iterates in key order: keep it (see `Sample::sessions`).
        let sessions = conversation
            .iter()
            .filter(|(key, session)| key.starts_with("session_") && session.is_array())
            .map(|(key, session)| Session {
                number: key.trim_start_matches("session_").parse().unwrap_or(0),
                date: conversation.get(&format!("{key}_date_time")).and_then(Value::as_str).and_then(session_date),
                turns: session.as_array().into_iter().flatten().filter_map(turn).collect(),
            })
            .collect();
        let qa = sample["qa"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|qa| Qa {
                question: qa["question"].as_str().map(str::to_owned),
                category: qa["category"].as_u64().unwrap_or(0),
                evidence: qa["evidence"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect(),
            })
            .collect();
        out.push(Sample { name, sessions, qa });
    }
    Ok(out)
}

/// LoCoMo's session times, such as "1:56 pm on 8 May, 2023", read as UTC.
fn session_date(raw: &str) -> Option<DateTime<Utc>> {
    NaiveDateTime::parse_from_str(&raw.replace("  ", " "), "%I:%M %p on %d %B, %Y").ok().map(|t| t.and_utc())
}

fn turn(value: &Value) -> Option<Turn> {
    Some(Turn {
        id: value["dia_id"].as_str().map(str::to_owned),
        speaker: value["speaker"].as_str()?.to_owned(),
        text: value["text"].as_str()?.to_owned(),
        caption: value["blip_caption"].as_str().map(str::to_owned),
    })
}

/// Evidence ids as LoCoMo writes them, read leniently: `D8:6; D9:17` is two ids, `D:11:26` is
/// D11:26 and `D30:05` is D30:5. Returns the ids and whether the raw form needed normalising.
pub(crate) fn evidence_ids(raw: &str) -> (Vec<String>, bool) {
    let mut ids = Vec::new();
    let mut normalised = false;
    for piece in raw.split([';', ',', ' ']).map(str::trim).filter(|p| !p.is_empty()) {
        let numbers: Vec<&str> = piece.trim_start_matches('D').split(':').filter(|n| !n.is_empty()).collect();
        let parsed: Option<Vec<u32>> = numbers.iter().map(|n| n.parse().ok()).collect();
        match parsed.as_deref() {
            Some([session, turn]) if piece.starts_with('D') => {
                let id = format!("D{session}:{turn}");
                normalised |= id != piece;
                ids.push(id);
            }
            _ => ids.push(piece.to_owned()), // unreadable: dropped as naming no turn
        }
    }
    normalised |= ids.len() > 1;
    (ids, normalised)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_evidence_ids_are_normalised() {
        assert_eq!(evidence_ids("D1:3"), (vec!["D1:3".to_owned()], false));
        assert_eq!(evidence_ids("D8:6; D9:17"), (vec!["D8:6".to_owned(), "D9:17".to_owned()], true));
        assert_eq!(evidence_ids("D:11:26"), (vec!["D11:26".to_owned()], true));
        assert_eq!(evidence_ids("D30:05"), (vec!["D30:5".to_owned()], true));
        assert_eq!(evidence_ids("session 3").0.len(), 2, "unreadable pieces are kept to be dropped as unknown");
    }

    #[test]
    fn sessions_keep_key_order_and_turns_need_a_speaker_and_text() {
        let dir = std::env::temp_dir().join(format!("mnemo-locomo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sample.json");
        let turn = |id: &str| serde_json::json!({ "dia_id": id, "speaker": "A", "text": "hi" });
        let data = serde_json::json!([{
            "conversation": {
                "session_2": [turn("D2:1")],
                "session_10": [turn("D10:1"), { "speaker": "B" }],
                "session_1_date_time": "noon",
            },
            "qa": [{ "question": "q", "category": 4, "evidence": ["D2:1; D9:9"] }],
        }]);
        std::fs::write(&path, data.to_string()).unwrap();
        let samples = read(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let sample = &samples[0];
        assert_eq!(sample.name, "locomo-0");
        assert_eq!(sample.sessions.iter().map(|s| s.number).collect::<Vec<_>>(), [10, 2]);
        assert_eq!(sample.turns().count(), 2);
        let known: HashSet<&str> = sample.turns().filter_map(|t| t.id.as_deref()).collect();
        assert_eq!(sample.gold(&sample.qa[0], &known), (vec!["D2:1".to_owned()], 1, 1));
        assert!(sample.sessions.iter().all(|s| s.date.is_none()), "noon is not a date");
        let date = session_date("1:56 pm on 8 May, 2023").expect("a LoCoMo date");
        assert_eq!(date.to_rfc3339(), "2023-05-08T13:56:00+00:00");
    }
}
