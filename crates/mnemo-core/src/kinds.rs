use crate::InvalidInput;

macro_rules! string_enum {
    ($(#[$doc:meta])* $name:ident, $field:literal { $($variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($variant),+
        }

        impl $name {
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];
            const EXPECTED: &'static str = concat!($($text, " "),+);

            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text),+
                }
            }

            pub fn parse(raw: &str) -> Result<Self, InvalidInput> {
                match raw {
                    $($text => Ok(Self::$variant),)+
                    _ => Err(InvalidInput::UnknownValue {
                        field: $field,
                        value: raw.chars().take(64).collect(),
                        expected: Self::EXPECTED.trim_ascii_end(),
                    }),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        /// For values read back from storage.
        impl TryFrom<String> for $name {
            type Error = InvalidInput;

            fn try_from(raw: String) -> Result<Self, InvalidInput> {
                Self::parse(&raw)
            }
        }
    };
}

string_enum!(
    /// What a memory row was made from. Its `source_ref` is unique per (tenant, kind).
    SourceKind, "source_kind" {
        ChatMessage => "chat_message",
        ToolOutput => "tool_output",
        DocumentChunk => "document_chunk",
        Fact => "fact",
        SessionSummary => "session_summary",
        WorkspaceNote => "workspace_note",
    }
);

string_enum!(
    /// Who may recall a row: one session, the whole tenant, one user, or one agent.
    Scope, "scope" {
        Session => "session",
        Tenant => "tenant",
        User => "user",
        Agent => "agent",
    }
);

string_enum!(
    /// The scopes a fact can be remembered in.
    FactScope, "scope" {
        User => "user",
        Agent => "agent",
    }
);

string_enum!(
    /// Which rows a recall searches: one class, or all four fused.
    RecallScope, "scope" {
        Session => "session",
        Tenant => "tenant",
        User => "user",
        Agent => "agent",
        Any => "any",
    }
);

impl SourceKind {
    /// The scope a row of this kind lives in. Facts choose theirs (user or agent).
    pub fn scope(self) -> Option<Scope> {
        match self {
            Self::ChatMessage | Self::ToolOutput | Self::SessionSummary => Some(Scope::Session),
            Self::DocumentChunk => Some(Scope::Tenant),
            Self::WorkspaceNote => Some(Scope::User),
            Self::Fact => None,
        }
    }
}

impl From<FactScope> for Scope {
    fn from(scope: FactScope) -> Self {
        match scope {
            FactScope::User => Scope::User,
            FactScope::Agent => Scope::Agent,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_and_unknown_values_name_the_choices() {
        for kind in SourceKind::ALL {
            assert_eq!(SourceKind::parse(kind.as_str()), Ok(*kind));
        }
        let err = Scope::parse("galaxy").unwrap_err();
        assert_eq!(err.to_string(), "scope has an unknown value \"galaxy\"; expected one of session tenant user agent");
        assert!(FactScope::parse("session").is_err());
    }
}
