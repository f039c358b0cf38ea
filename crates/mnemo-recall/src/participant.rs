//! The participants a question may name: its capitalised words ("What did Melanie paint?"), in
//! lower case. Whether one of them is a participant of the session, by the `name` its messages
//! were written with, is the store's to say (`Search::vector_by_participant`); recall then ranks
//! the session's vector half within that participant's messages, after the session's nearest
//! message. No model: a participant named in lower case, or by a name of several words, is not
//! recognised.

/// The most words of a question looked up as names.
const MAX_NAMES: usize = 16;

/// The question's capitalised words, lower-cased, each once, at most `MAX_NAMES`. A word is a
/// run of letters, digits, `_` and `-` (the characters of OpenAI's `name`), so "Melanie's" is
/// "melanie".
pub(crate) fn named_participants(question: &str) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    let words = question.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '-'));
    for word in words.filter(|w| w.chars().next().is_some_and(char::is_uppercase)) {
        let name = word.to_lowercase();
        if !names.contains(&name) {
            names.push(name);
        }
        if names.len() == MAX_NAMES {
            break;
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capitalised_words_are_the_names_looked_up() {
        assert_eq!(named_participants("What did Melanie's kids like?"), ["what", "melanie"]);
        assert_eq!(named_participants("when did jean-luc and Jean-Luc meet Mel_2?"), ["jean-luc", "mel_2"]);
        assert!(named_participants("what did she say?").is_empty());
        let many: String = (0..40).map(|i| format!("Name{i} ")).collect();
        assert_eq!(named_participants(&many).len(), MAX_NAMES);
    }
}
