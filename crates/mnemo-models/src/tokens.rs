//! Token counting for context windows: a real BPE (tiktoken's `o200k_base` or `cl100k_base`,
//! whose tables ship inside the `tiktoken-rs` crate, so nothing is fetched at run time), or the
//! estimate by characters where no tokenizer fits the model (see [`char_estimate`]).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use mnemo_config::TokenizerName;
use mnemo_core::TokenCounter;
use sha2::{Digest, Sha256};
use tiktoken_rs::CoreBPE;

/// A token counter. Cheap to share: the BPE tables are loaded once per process, and clones share
/// the counts of long texts remembered.
#[derive(Clone)]
pub struct Tokenizer {
    name: TokenizerName,
    bpe: Option<&'static CoreBPE>,
    /// The counts of the long texts counted last, each for its asker, the latest first.
    remembered: Arc<Mutex<VecDeque<Remembered>>>,
}

/// A long text's count, by the SHA-256 of its asker and the text.
type Remembered = ([u8; 32], u32);

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("name", &self.name).finish()
    }
}

impl Tokenizer {
    pub fn new(name: TokenizerName) -> Self {
        let bpe = match name {
            TokenizerName::O200kBase => Some(tiktoken_rs::o200k_base_singleton()),
            TokenizerName::Cl100kBase => Some(tiktoken_rs::cl100k_base_singleton()),
            TokenizerName::CharEstimate => None,
        };
        Self { name, bpe, remembered: Arc::default() }
    }

    /// `text`'s count by BPE, remembered for `asker`: a text among the last [`REMEMBERED`] long
    /// ones is not counted again.
    fn remembered_count(&self, bpe: &CoreBPE, asker: &str, text: &str) -> u32 {
        let key: [u8; 32] = Sha256::new().chain_update(asker).chain_update([0]).chain_update(text).finalize().into();
        let remembered = || self.remembered.lock().unwrap_or_else(PoisonError::into_inner);
        {
            let mut counts = remembered();
            if let Some(at) = counts.iter().position(|(k, _)| *k == key) {
                let entry = counts.remove(at).expect("found");
                counts.push_front(entry);
                return entry.1;
            }
        }
        // Counted outside the lock: two callers of one new text may both count it.
        let n = count_by(bpe, text);
        let mut counts = remembered();
        counts.push_front((key, n));
        counts.truncate(REMEMBERED);
        n
    }
}

fn count_by(bpe: &CoreBPE, text: &str) -> u32 {
    u32::try_from(bpe.encode_ordinary(text).len()).unwrap_or(u32::MAX)
}

/// Texts at least this long have their counts remembered: an agent sends the same system prompt
/// at every call, and a context call counts it several times (the window, what compaction
/// keeps, the workspace's share). Hashing a text costs a small fraction of counting it.
const REMEMBERED_BYTES: usize = 16 * 1024;
/// How many long texts' counts are remembered; the one used least recently leaves first.
const REMEMBERED: usize = 64;

/// Texts at least this long are counted with the runtime told that the thread blocks: o200k
/// counts 10–20 MB a second (4 MiB took 0.2–0.4 s), and the requests queued on that thread would
/// wait as long (docs/benchmarks.md, "Short writes beside context calls with a long prompt").
const LONG_TEXT_BYTES: usize = 256 * 1024;

/// The name `MNEMO_TOKENIZER=chars` counts under, in stored counts.
const CHAR_ESTIMATE: &str = "chars-2";

/// 3.5 ASCII characters a token (English prose runs 4 and more), and a token for every two
/// bytes of any other character: a BPE spends one on most characters of Chinese or Japanese,
/// two or three on an emoji, and counting more than it does is only room left unused.
fn char_estimate(text: &str) -> u32 {
    let ascii = text.bytes().filter(u8::is_ascii).count();
    u32::try_from((ascii * 2).div_ceil(7) + (text.len() - ascii).div_ceil(2)).unwrap_or(u32::MAX)
}

impl TokenCounter for Tokenizer {
    fn count(&self, text: &str) -> u32 {
        match self.bpe {
            Some(bpe) => counting(text.len(), || count_by(bpe, text)),
            None => char_estimate(text),
        }
    }

    fn name(&self) -> &str {
        match self.bpe {
            Some(_) => self.name.as_str(),
            // Not "chars": counts stored by the estimate that took 3.5 of any characters for a
            // token (far under for Chinese or Japanese) are made again.
            None => CHAR_ESTIMATE,
        }
    }

    fn count_for(&self, asker: &str, text: &str) -> u32 {
        match self.bpe {
            Some(bpe) if text.len() >= REMEMBERED_BYTES => {
                counting(text.len(), || self.remembered_count(bpe, asker, text))
            }
            _ => self.count(text),
        }
    }
}

/// Runs `work`, which counts the tokens of `bytes` of text: when they are many, with the runtime
/// told that the thread blocks, so that its other tasks move to another thread meanwhile.
pub fn counting<R>(bytes: usize, work: impl FnOnce() -> R) -> R {
    if bytes >= LONG_TEXT_BYTES && on_a_thread_pool() { tokio::task::block_in_place(work) } else { work() }
}

/// Whether this runs on a multi-threaded runtime, where `block_in_place` may be called (a
/// current-thread runtime, as tests use, has no other thread to move tasks to).
fn on_a_thread_pool() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|runtime| runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_tokenizers_count_like_tiktoken_and_the_estimate_rounds_up() {
        let text = "Hello, world! mnemo remembers.";
        let o200k = Tokenizer::new(TokenizerName::O200kBase).count(text);
        let cl100k = Tokenizer::new(TokenizerName::Cl100kBase).count(text);
        assert!((5..=12).contains(&o200k), "{o200k}");
        assert!((5..=12).contains(&cl100k), "{cl100k}");
        assert_eq!(Tokenizer::new(TokenizerName::O200kBase).count(""), 0);
        assert_eq!(Tokenizer::new(TokenizerName::CharEstimate).count("abcdefg"), 2);
        assert_eq!(Tokenizer::new(TokenizerName::CharEstimate).count("abcdefgh"), 3);
        // Not under a real tokenizer's count for text of other scripts.
        let (estimate, o200k) = (Tokenizer::new(TokenizerName::CharEstimate), Tokenizer::new(TokenizerName::O200kBase));
        for text in [
            "东京今天的天气阳光明媚",
            "今日は東京で会議があります。",
            "Привет, как дела у тебя сегодня?",
            "Ann: 東京 🌸🌸",
        ] {
            assert!(
                estimate.count(text) >= o200k.count(text),
                "{text}: {} < {}",
                estimate.count(text),
                o200k.count(text)
            );
        }
    }

    #[test]
    fn a_long_texts_remembered_count_is_its_own_and_its_askers() {
        let tokenizer = Tokenizer::new(TokenizerName::O200kBase);
        let bpe = tiktoken_rs::o200k_base_singleton();
        let exact = |text: &str| u32::try_from(bpe.encode_ordinary(text).len()).expect("fits");
        // Texts of one length, with other counts.
        let words = "hello world ".repeat(REMEMBERED_BYTES / 12 + 1);
        let letters = "h e l l o w ".repeat(REMEMBERED_BYTES / 12 + 1);
        assert_eq!(words.len(), letters.len());
        assert_ne!(exact(&words), exact(&letters));
        for _ in 0..2 {
            for text in [&words, &letters] {
                assert_eq!(tokenizer.count_for("acme", text), exact(text));
            }
        }
        let remembered = |t: &Tokenizer| t.remembered.lock().expect("lock").len();
        // Each asker has its own; a clone shares them.
        assert_eq!(remembered(&tokenizer.clone()), 2);
        assert_eq!(tokenizer.count_for("globex", &words), exact(&words));
        assert_eq!(remembered(&tokenizer), 3);
        // The least recently used leaves first: `letters`, not `words` used just now.
        assert_eq!(tokenizer.count_for("acme", &words), exact(&words));
        for n in 0..REMEMBERED - 3 {
            tokenizer.count_for("acme", &format!("{n} {words}"));
        }
        assert_eq!(remembered(&tokenizer), REMEMBERED);
        let key = |asker: &str, text: &str| -> [u8; 32] {
            Sha256::new().chain_update(asker).chain_update([0]).chain_update(text).finalize().into()
        };
        let held = |k: [u8; 32]| tokenizer.remembered.lock().expect("lock").iter().any(|(x, _)| *x == k);
        tokenizer.count_for("acme", "more");
        tokenizer.count_for("acme", &format!("one more {words}"));
        assert!(!held(key("acme", &letters)) && held(key("acme", &words)));
        assert_eq!(tokenizer.count_for("acme", &letters), exact(&letters));
    }
}
