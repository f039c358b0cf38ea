use crate::InvalidInput;

/// Identifiers arrive from tokens and request bodies. They are opaque, but bounded in length
/// and free of control characters, so they are safe in SQL parameters, logs and source_refs.
const MAX_ID_BYTES: usize = 256;

fn parse_id(field: &'static str, raw: &str) -> Result<String, InvalidInput> {
    if raw.trim().is_empty() {
        return Err(InvalidInput::Empty { field });
    }
    if raw.len() > MAX_ID_BYTES {
        return Err(InvalidInput::TooLong { field, max: MAX_ID_BYTES, actual: raw.len() });
    }
    if raw.contains('\0') {
        return Err(InvalidInput::NulByte { field });
    }
    if raw.chars().any(char::is_control) {
        return Err(InvalidInput::ControlChar { field });
    }
    Ok(raw.to_owned())
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $field:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);

        impl $name {
            pub fn parse(raw: &str) -> Result<Self, InvalidInput> {
                parse_id($field, raw).map(Self)
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }

        /// For values read back from storage.
        impl TryFrom<String> for $name {
            type Error = InvalidInput;

            fn try_from(raw: String) -> Result<Self, InvalidInput> {
                parse_id($field, &raw)?;
                Ok(Self(raw))
            }
        }
    };
}

id_type!(
    /// The tenant every row belongs to. It comes only from the authenticated principal.
    TenantId,
    "tenant"
);
id_type!(
    /// A human user (the token's `sub`).
    UserId,
    "user"
);
impl UserId {
    /// How erasure's audit rows, compaction records and reply marks name the user: the hex
    /// sha256 of the id (SQL's `user_sha256!` in mnemo-store computes the same).
    pub fn sha256(&self) -> String {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(self.as_str().as_bytes()))
    }
}

id_type!(
    /// An agent acting for a tenant (the token's `agent`).
    AgentId,
    "agent"
);
id_type!(
    /// One chat session (the token's `sid`, or `session_id` in a write).
    SessionId,
    "session_id"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_refuse_empty_long_and_control_characters() {
        assert_eq!(TenantId::parse("  "), Err(InvalidInput::Empty { field: "tenant" }));
        assert!(matches!(UserId::parse(&"u".repeat(257)), Err(InvalidInput::TooLong { .. })));
        assert_eq!(AgentId::parse("a\0b"), Err(InvalidInput::NulByte { field: "agent" }));
        assert_eq!(SessionId::parse("a\nb"), Err(InvalidInput::ControlChar { field: "session_id" }));
        assert_eq!(TenantId::parse("acme-1").map(|t| t.to_string()), Ok("acme-1".to_owned()));
    }
}
