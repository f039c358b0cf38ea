use sha2::{Digest, Sha256};

use crate::{FactScope, InvalidInput, MemoryText};

pub(crate) const MAX_SOURCE_REF_BYTES: usize = 512;

/// The ending of an anonymized row's source_ref (retention's statements write it).
pub const ANONYMIZED_SUFFIX: &str = "|anonymized";

/// The caller's stable id for what a row was made from (a message id, a tool_call_id, a chunk
/// id). With the tenant and the kind it is the row's unique key, so a retried write finds the
/// row it already made.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SourceRef(String);

impl SourceRef {
    pub fn parse(raw: &str) -> Result<Self, InvalidInput> {
        const FIELD: &str = "source_ref";
        if raw.trim().is_empty() {
            return Err(InvalidInput::Empty { field: FIELD });
        }
        if raw.len() > MAX_SOURCE_REF_BYTES {
            return Err(InvalidInput::TooLong { field: FIELD, max: MAX_SOURCE_REF_BYTES, actual: raw.len() });
        }
        if raw.contains('\0') {
            return Err(InvalidInput::NulByte { field: FIELD });
        }
        if raw.chars().any(char::is_control) {
            return Err(InvalidInput::ControlChar { field: FIELD });
        }
        // Anonymization frees a row's key by this suffix (and, when that is taken, the suffix,
        // the row id and the suffix again): a caller's ref holding it could collide with those
        // and block the tenant's sweeps.
        if raw.ends_with(ANONYMIZED_SUFFIX) || raw.contains(&format!("{ANONYMIZED_SUFFIX}|")) {
            return Err(InvalidInput::ReservedSuffix { field: FIELD, suffix: ANONYMIZED_SUFFIX });
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for SourceRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// `fact:{scope}:{identity}:{sha256(content)[:16]}`: the same identity asserting the same content
/// always lands on the same row.
pub fn fact_source_ref(scope: FactScope, identity: &str, content: &MemoryText) -> SourceRef {
    let digest = hex::encode(Sha256::digest(content.as_str().as_bytes()));
    SourceRef(format!("fact:{scope}:{identity}:{}", &digest[..16]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fact_refs_are_deterministic_and_follow_the_documented_shape() {
        let text = MemoryText::parse("I live in Tokyo").expect("valid text");
        let a = fact_source_ref(FactScope::User, "u-1", &text);
        assert_eq!(a, fact_source_ref(FactScope::User, "u-1", &text));
        // sha256("I live in Tokyo") starts with these 16 hex digits.
        let digest = hex::encode(Sha256::digest(b"I live in Tokyo"));
        assert_eq!(a.as_str(), format!("fact:user:u-1:{}", &digest[..16]));
        assert_ne!(a, fact_source_ref(FactScope::Agent, "u-1", &text));
    }

    #[test]
    fn source_refs_are_bounded() {
        assert!(SourceRef::parse("msg-1").is_ok());
        assert!(matches!(SourceRef::parse(""), Err(InvalidInput::Empty { .. })));
        assert!(matches!(SourceRef::parse(&"x".repeat(513)), Err(InvalidInput::TooLong { .. })));
        assert!(matches!(SourceRef::parse("a\u{0}"), Err(InvalidInput::NulByte { .. })));
    }
}
