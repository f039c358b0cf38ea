use sha2::{Digest, Sha256};

use crate::{InvalidInput, SourceRef, TenantId};

/// The most a memory row holds, in bytes of UTF-8 (16 KiB).
pub const MAX_CONTENT_BYTES: usize = 16 * 1024;

fn check_text(field: &'static str, raw: &str, max: usize) -> Result<(), InvalidInput> {
    if raw.trim().is_empty() {
        return Err(InvalidInput::Empty { field });
    }
    if raw.len() > max {
        return Err(InvalidInput::TooLong { field, max, actual: raw.len() });
    }
    // PostgreSQL text cannot hold NUL, and silently dropping it would change what was said.
    if raw.contains('\0') {
        return Err(InvalidInput::NulByte { field });
    }
    Ok(())
}

/// Text a model reads as material, as one JSON string: its newlines and quotes escaped, so
/// nothing in it can open a line of the prompt's own (a forged `[user]` turn, a section's
/// heading, a candidate's label).
pub fn quoted(text: &str) -> String {
    serde_json::Value::from(text).to_string()
}

/// The content of one memory row: non-empty, at most 16 KiB, no NUL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryText(String);

impl MemoryText {
    pub fn parse(raw: &str) -> Result<Self, InvalidInput> {
        check_text("content", raw, MAX_CONTENT_BYTES).map(|()| Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

/// A tool's output, which may be far longer than a memory row. Longer outputs are kept whole
/// behind a [`ToolOutputKey`]; the row keeps a head-and-tail preview that names the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutputText(String);

/// Where a tool output ends up: the row's text, and the full payload when it had to be elided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredToolOutput {
    pub preview: MemoryText,
    pub elided: Option<(ToolOutputKey, String)>,
}

impl ToolOutputText {
    /// `max` is the deployment's limit for one payload (the request body limit bounds it too).
    pub fn parse(raw: &str, max: usize) -> Result<Self, InvalidInput> {
        check_text("content", raw, max).map(|()| Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_stored(self, tenant: &TenantId, source_ref: &SourceRef) -> StoredToolOutput {
        if self.0.len() <= MAX_CONTENT_BYTES {
            return StoredToolOutput { preview: MemoryText(self.0), elided: None };
        }
        let key = ToolOutputKey::derive(tenant, source_ref);
        let preview = elide(&self.0, &key);
        StoredToolOutput { preview: MemoryText(preview), elided: Some((key, self.0)) }
    }
}

/// Two thirds head, one third tail: the start of an output says what it is, the end how it
/// finished. Cuts fall on character boundaries.
fn elide(full: &str, key: &ToolOutputKey) -> String {
    let marker = format!("\n\n[… {} bytes elided; {FULL_OUTPUT_IS}{key} …]\n\n", full.len());
    // Leave room for the marker even if the elided count is written with more digits.
    let budget = MAX_CONTENT_BYTES - marker.len() - 8;
    let head_end = full.floor_char_boundary(budget * 2 / 3);
    let tail_start = full.ceil_char_boundary(full.len() - (budget - head_end));
    let elided = tail_start - head_end;
    let marker = format!("\n\n[… {elided} bytes elided; {FULL_OUTPUT_IS}{key} …]\n\n");
    format!("{}{marker}{}", &full[..head_end], &full[tail_start..])
}

/// What an elided tool output's marker says before its key.
const FULL_OUTPUT_IS: &str = "the full output is tool output ";

/// The key an elided tool output's preview names, if `text` holds one: a cut that takes the
/// preview's middle out must name it again, or the payload is out of the reader's reach.
pub fn elided_output_key(text: &str) -> Option<ToolOutputKey> {
    let at = text.find(FULL_OUTPUT_IS)? + FULL_OUTPUT_IS.len();
    let end = at + ToolOutputKey::PREFIX.len() + ToolOutputKey::HEX_DIGITS;
    ToolOutputKey::parse(text.get(at..end)?)
}

/// Where a cut took `removed` characters out of a text, naming the text's elided output `key`
/// (see [`elided_output_key`]) when none of the `kept` parts still shows it.
pub fn cut_note(removed: usize, why: &str, key: Option<&ToolOutputKey>, kept: &[&str]) -> String {
    match key.filter(|k| !kept.iter().any(|part| part.contains(k.as_str()))) {
        Some(key) => format!("\n…[{removed} characters {why}; {FULL_OUTPUT_IS}{key}]…\n"),
        None => format!("\n…[{removed} characters {why}]…\n"),
    }
}

/// `tout_` and 32 hex digits, derived from the tenant and the tool call, so a retried write
/// names the same payload.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ToolOutputKey(String);

impl ToolOutputKey {
    const PREFIX: &'static str = "tout_";
    const HEX_DIGITS: usize = 32;

    pub fn derive(tenant: &TenantId, source_ref: &SourceRef) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(tenant.as_str().as_bytes());
        hasher.update([0]);
        hasher.update(source_ref.as_str().as_bytes());
        let digest = hex::encode(hasher.finalize());
        Self(format!("{}{}", Self::PREFIX, &digest[..Self::HEX_DIGITS]))
    }

    /// `None` for anything that cannot be a key; callers answer "not found".
    pub fn parse(raw: &str) -> Option<Self> {
        let digits = raw.strip_prefix(Self::PREFIX)?;
        let well_formed = digits.len() == Self::HEX_DIGITS
            && digits.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        well_formed.then(|| Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for ToolOutputKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant() -> TenantId {
        TenantId::parse("t1").expect("valid tenant")
    }

    #[test]
    fn memory_text_enforces_the_cap_and_refuses_nul() {
        assert!(MemoryText::parse(&"a".repeat(MAX_CONTENT_BYTES)).is_ok());
        assert!(matches!(
            MemoryText::parse(&"a".repeat(MAX_CONTENT_BYTES + 1)),
            Err(InvalidInput::TooLong { actual: 16385, .. })
        ));
        assert!(matches!(MemoryText::parse(" \n"), Err(InvalidInput::Empty { .. })));
        assert!(matches!(MemoryText::parse("a\0"), Err(InvalidInput::NulByte { .. })));
    }

    #[test]
    fn short_tool_outputs_are_stored_as_they_are() {
        let source = SourceRef::parse("call-1").expect("valid ref");
        let stored = ToolOutputText::parse("ok", 1 << 20).expect("valid").into_stored(&tenant(), &source);
        assert_eq!(stored.preview.as_str(), "ok");
        assert_eq!(stored.elided, None);
    }

    #[test]
    fn long_tool_outputs_keep_head_and_tail_and_name_the_key() {
        let source = SourceRef::parse("call-2").expect("valid ref");
        // Multi-byte characters everywhere, so every cut has to find a boundary.
        let full = format!("HEAD{}TAIL", "é日".repeat(20_000));
        let stored = ToolOutputText::parse(&full, 1 << 20).expect("valid").into_stored(&tenant(), &source);
        let (key, payload) = stored.elided.expect("elided");
        assert_eq!(payload, full);
        let preview = stored.preview.as_str();
        assert!(preview.len() <= MAX_CONTENT_BYTES, "preview is {} bytes", preview.len());
        assert!(preview.starts_with("HEAD") && preview.ends_with("TAIL"));
        assert!(preview.contains(key.as_str()));
        assert_eq!(ToolOutputKey::parse(key.as_str()), Some(key.clone()));
        assert_eq!(key, ToolOutputKey::derive(&tenant(), &source));
        assert_ne!(key, ToolOutputKey::derive(&TenantId::parse("t2").expect("valid"), &source));
    }

    #[test]
    fn keys_parse_strictly() {
        assert!(ToolOutputKey::parse("tout_0123456789abcdef0123456789abcdef").is_some());
        assert!(ToolOutputKey::parse("tout_0123456789ABCDEF0123456789abcdef").is_none());
        assert!(ToolOutputKey::parse("tout_../etc").is_none());
        assert!(ToolOutputKey::parse("0123456789abcdef0123456789abcdef").is_none());
    }
}
