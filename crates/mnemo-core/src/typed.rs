//! Typed long-term memory: a row's layer, category, importance, confidence, tags, origin,
//! relations and who beyond its owner may read it. Every field is optional on input and
//! validated here; defaults follow the row's scope and kind.

use sha2::{Digest, Sha256};

use crate::{InvalidInput, Scope, SourceKind};

string_enum!(
    /// golemcore's layers: what happened (episodic), what holds (semantic), how to do things
    /// (procedural).
    Layer, "layer" {
        Episodic => "episodic",
        Semantic => "semantic",
        Procedural => "procedural",
    }
);

string_enum!(
    /// What kind of thing a memory says.
    Category, "category" {
        Preference => "preference",
        Fact => "fact",
        Goal => "goal",
        Skill => "skill",
        Event => "event",
        Constraint => "constraint",
    }
);

string_enum!(
    /// Who made a memory: the user said it, a model extracted or consolidated it, or a service
    /// wrote it through the API.
    Origin, "source" {
        User => "user",
        Extraction => "extraction",
        Consolidation => "consolidation",
        Api => "api",
    }
);

string_enum!(
    /// Who may read a memory besides its owner: nobody else (`private`), every user of its agent
    /// (`agent`), or the whole tenant.
    Visibility, "visibility" {
        Private => "private",
        Agent => "agent",
        Tenant => "tenant",
    }
);

string_enum!(
    /// How one memory points at another. Supersession has its own columns.
    RelationType, "relation type" {
        RelatedTo => "related_to",
        DerivedFrom => "derived_from",
    }
);

impl Layer {
    /// The layer of a row written without one: daily notes are what happened; everything else
    /// is taken to hold. (A conversation's own rows are working memory in packs, whatever their
    /// layer.)
    pub fn default_for(kind: SourceKind, path: Option<&str>) -> Self {
        match kind {
            SourceKind::WorkspaceNote if path.is_some_and(|p| p != "MEMORY.md") => Self::Episodic,
            _ => Self::Semantic,
        }
    }
}

impl Visibility {
    /// What a row of `scope` gets when the writer says nothing: what its class already allowed
    /// before visibility existed.
    pub fn default_for(scope: Scope) -> Self {
        match scope {
            Scope::Session | Scope::User => Self::Private,
            Scope::Agent => Self::Agent,
            Scope::Tenant => Self::Tenant,
        }
    }

    /// Whether a row of `scope` may have this visibility. Visibility only widens: an agent's
    /// memories are already seen by all its users, and a tenant's by everyone.
    pub fn allowed_for(self, scope: Scope) -> bool {
        match scope {
            Scope::Session => self == Self::Private,
            Scope::User => true,
            Scope::Agent => self != Self::Private,
            Scope::Tenant => self == Self::Tenant,
        }
    }
}

/// A score in [0, 1]: importance or confidence.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Unit(f32);

impl Unit {
    pub fn parse(field: &'static str, value: f64) -> Result<Self, InvalidInput> {
        if !(0.0..=1.0).contains(&value) {
            return Err(InvalidInput::OutOfRange { field, min: 0, max: 1 });
        }
        Ok(Self(value as f32))
    }

    pub fn get(self) -> f32 {
        self.0
    }
}

/// The most tags, roles or relations one memory carries.
pub const MAX_TAGS: usize = 16;
pub const MAX_ALLOWED_ROLES: usize = 8;
pub const MAX_RELATIONS: usize = 16;
/// The longest tag or role name.
pub const MAX_LABEL_BYTES: usize = 64;

/// A short label (a tag, a role): 1–64 bytes of letters, digits and `_ - . :`. Roles compare
/// exactly, as identity providers write them; tags are lowercased by [`Label::tags`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Label(String);

impl Label {
    pub fn parse(field: &'static str, raw: &str) -> Result<Self, InvalidInput> {
        if raw.is_empty() {
            return Err(InvalidInput::Empty { field });
        }
        if raw.len() > MAX_LABEL_BYTES {
            return Err(InvalidInput::TooLong { field, max: MAX_LABEL_BYTES, actual: raw.len() });
        }
        if !raw.chars().all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | ':')) {
            return Err(InvalidInput::UnknownValue {
                field,
                value: raw.chars().take(64).collect(),
                expected: "letters, digits and _ - . : (no spaces)",
            });
        }
        Ok(Self(raw.to_owned()))
    }

    /// Tags: at most [`MAX_TAGS`], checked as given, then lowercased, sorted and without
    /// repeats. Checked before lowercasing: a capital's lowercase can be a letter and a combining
    /// mark (`İ`) or longer in bytes (`Ⱥ`), which the rules would refuse.
    pub fn tags(raw: &[String]) -> Result<Vec<Self>, InvalidInput> {
        let mut tags: Vec<Self> =
            Self::parse_list("tags", raw, MAX_TAGS)?.into_iter().map(|tag| Self(tag.0.to_lowercase())).collect();
        tags.sort();
        tags.dedup();
        Ok(tags)
    }

    /// At most `max` labels, sorted and without repeats.
    pub fn parse_list(field: &'static str, raw: &[String], max: usize) -> Result<Vec<Self>, InvalidInput> {
        if raw.len() > max {
            return Err(InvalidInput::TooMany { field, max, actual: raw.len() });
        }
        let mut labels = raw.iter().map(|r| Self::parse(field, r)).collect::<Result<Vec<_>, _>>()?;
        labels.sort();
        labels.dedup();
        Ok(labels)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A link from a new memory to an existing one of the same tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub kind: RelationType,
    pub target: uuid::Uuid,
}

/// The typed fields of a memory as its writer gave them; what is absent takes the defaults of
/// [`Typed::resolve`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TypedInput {
    pub layer: Option<Layer>,
    pub category: Option<Category>,
    pub importance: Option<Unit>,
    pub confidence: Option<Unit>,
    pub tags: Vec<Label>,
    pub relations: Vec<Relation>,
    pub visibility: Option<Visibility>,
    pub allowed_roles: Vec<Label>,
}

/// A memory's typed fields, resolved: what the row stores.
#[derive(Debug, Clone, PartialEq)]
pub struct Typed {
    pub layer: Layer,
    pub category: Option<Category>,
    pub importance: Option<Unit>,
    pub confidence: Option<Unit>,
    pub tags: Vec<Label>,
    pub origin: Origin,
    pub relations: Vec<Relation>,
    pub visibility: Visibility,
    pub allowed_roles: Vec<Label>,
}

impl Typed {
    /// The defaults of a row of `kind` in `scope`, made by `origin`.
    pub fn defaults(kind: SourceKind, scope: Scope, origin: Origin, path: Option<&str>) -> Self {
        Self::resolve(TypedInput::default(), kind, scope, origin, path).expect("defaults are valid")
    }

    /// `input` over the defaults of a row of `kind` in `scope`. Refuses a visibility the scope
    /// cannot have.
    pub fn resolve(
        input: TypedInput,
        kind: SourceKind,
        scope: Scope,
        origin: Origin,
        path: Option<&str>,
    ) -> Result<Self, InvalidInput> {
        let visibility = input.visibility.unwrap_or(Visibility::default_for(scope));
        if !visibility.allowed_for(scope) {
            return Err(InvalidInput::UnknownValue {
                field: "visibility",
                value: visibility.to_string(),
                expected: match scope {
                    Scope::Agent => "agent tenant (an agent's memories are seen by all its users)",
                    Scope::Tenant => "tenant (tenant memories are seen by everyone in the tenant)",
                    _ => "private (session rows stay in their session)",
                },
            });
        }
        Ok(Self {
            layer: input.layer.unwrap_or(Layer::default_for(kind, path)),
            category: input.category,
            importance: input.importance,
            confidence: input.confidence,
            tags: input.tags,
            origin,
            relations: input.relations,
            visibility,
            allowed_roles: input.allowed_roles,
        })
    }
}

/// What makes two statements "the same memory" for promotion, and a copy for the judge: the
/// words, case and punctuation aside, but a number's sign kept ("-18" is not "18"; the hyphen
/// of "2024-05" is not a sign). sha256 of the normalized text, first 16 bytes in hex.
pub fn fingerprint(text: &str) -> String {
    let mut words: Vec<String> = Vec::new();
    let mut start = None;
    for (at, c) in text.char_indices().chain([(text.len(), ' ')]) {
        match (c.is_alphanumeric(), start) {
            (true, None) => start = Some(at),
            (false, Some(from)) => {
                let word = text[from..at].to_lowercase();
                let mut before = text[..from].chars().rev();
                let signed = word.starts_with(|c: char| c.is_ascii_digit())
                    && matches!(before.next(), Some('-' | '\u{2212}'))
                    && !before.next().is_some_and(char::is_alphanumeric);
                words.push(if signed { format!("-{word}") } else { word });
                start = None;
            }
            _ => {}
        }
    }
    hex::encode(&Sha256::digest(words.join(" ").as_bytes())[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_ignore_case_and_punctuation_only() {
        assert_eq!(fingerprint("I moved to Lisbon."), fingerprint("i moved   to lisbon"));
        assert_ne!(fingerprint("I moved to Lisbon"), fingerprint("I moved to Porto"));
        // Stored fingerprints of texts without a sign are what they were.
        assert_eq!(fingerprint("I moved to Lisbon."), "1ddd0b3690bec6ebbe956843e1c1ef39");
    }

    #[test]
    fn fingerprints_keep_a_numbers_sign() {
        assert_ne!(fingerprint("The freezer is set to -18 C"), fingerprint("The freezer is set to 18 C"));
        assert_eq!(fingerprint("The freezer is set to -18 C"), fingerprint("the freezer is set to \u{2212}18 c."));
        assert_eq!(fingerprint("temperature:-18"), fingerprint("temperature -18"));
        assert_eq!(fingerprint("born 2024-05-01"), fingerprint("born 2024 05 01"));
        assert_eq!(fingerprint("a well-known fact"), fingerprint("a well known fact"));
    }

    #[test]
    fn visibility_only_widens() {
        let resolve = |scope, visibility| {
            let input = TypedInput { visibility: Some(visibility), ..TypedInput::default() };
            Typed::resolve(input, SourceKind::Fact, scope, Origin::Api, None)
        };
        assert!(resolve(Scope::User, Visibility::Tenant).is_ok());
        assert!(resolve(Scope::Agent, Visibility::Private).is_err());
        assert!(resolve(Scope::Tenant, Visibility::Agent).is_err());
        assert_eq!(Typed::defaults(SourceKind::Fact, Scope::Agent, Origin::Api, None).visibility, Visibility::Agent);
    }

    #[test]
    fn labels_are_bounded_and_normalized() {
        assert_eq!(
            Label::tags(&["Tone".into(), "tone".into()]).expect("ok"),
            [Label::parse("tags", "tone").expect("ok")]
        );
        assert_eq!(Label::parse("roles", "Admin").expect("ok").as_str(), "Admin");
        // Checked as written, then lowercased: İ lowers to i and a combining dot, Ⱥ to 3 bytes.
        let lowered = Label::tags(&["İstanbul".into(), "Ⱥ".repeat(32)]).expect("letters");
        assert_eq!(lowered.iter().map(Label::as_str).collect::<Vec<_>>(), ["i\u{307}stanbul", &"ⱥ".repeat(32)]);
        assert!(Label::parse("tags", "two words").is_err());
        let many: Vec<String> = (0..=MAX_TAGS).map(|i| format!("t{i}")).collect();
        assert!(matches!(Label::parse_list("tags", &many, MAX_TAGS), Err(InvalidInput::TooMany { .. })));
        assert!(Unit::parse("importance", 1.01).is_err() && Unit::parse("importance", -0.1).is_err());
    }
}
