//! Token counting for context windows: a real BPE (tiktoken's `o200k_base` or `cl100k_base`,
//! whose tables ship inside the `tiktoken-rs` crate, so nothing is fetched at run time), or the
//! seeds' character estimate (`characters / 3.5`, rounded up) where no tokenizer fits the model.

use mnemo_config::TokenizerName;
use mnemo_core::TokenCounter;
use tiktoken_rs::CoreBPE;

/// A token counter. Cheap to share: the BPE tables are loaded once per process.
#[derive(Clone)]
pub struct Tokenizer {
    name: TokenizerName,
    bpe: Option<&'static CoreBPE>,
}

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
        Self { name, bpe }
    }
}

/// Texts at least this long are counted with the runtime told that the thread blocks: o200k
/// counts 10–20 MB a second (4 MiB took 0.2–0.4 s), and the requests queued on that thread would
/// wait as long (docs/benchmarks.md, "Short writes beside context calls with a long prompt").
const LONG_TEXT_BYTES: usize = 256 * 1024;

impl TokenCounter for Tokenizer {
    fn count(&self, text: &str) -> u32 {
        let count = || match self.bpe {
            Some(bpe) => bpe.encode_ordinary(text).len(),
            // 3.5 characters a token: ceil(chars × 2 / 7).
            None => (text.chars().count() * 2).div_ceil(7),
        };
        let n = if self.bpe.is_some() && text.len() >= LONG_TEXT_BYTES && on_a_thread_pool() {
            // The thread's other tasks move to another thread meanwhile.
            tokio::task::block_in_place(count)
        } else {
            count()
        };
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    fn name(&self) -> &str {
        self.name.as_str()
    }
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
    }
}
