//! Retention: how long retired rows keep their content before they are anonymized, per tenant.
//! A tenant's policy lives in `tenant_config.settings.memory_retention`; a field that is missing
//! falls back to the deployment's default, and one that is invalid falls back too, with a
//! warning naming the tenant and the field (a bad policy must not stop retention for everyone).
//! The safety floor is the rule that refuses a sweep too large to run unasked.

use serde_json::Value;

/// The policy of one tenant, or the deployment's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Soft-deleted rows are anonymized this many days after their deletion.
    pub soft_ttl_days: u32,
    /// Superseded facts are anonymized this many days after they were superseded.
    pub superseded_ttl_days: u32,
    /// Rows anonymized per transaction.
    pub batch_size: u32,
    /// Report what a sweep would do, and change nothing.
    pub dry_run: bool,
}

impl Default for RetentionPolicy {
    fn default() -> Self {
        Self { soft_ttl_days: 30, superseded_ttl_days: 90, batch_size: 100, dry_run: false }
    }
}

/// The longest TTL accepted: a hundred years.
pub const MAX_TTL_DAYS: u32 = 36_500;
/// The largest batch accepted: one transaction should stay short.
pub const MAX_BATCH_SIZE: u32 = 10_000;

/// The keys of `memory_retention`.
pub const POLICY_FIELDS: [&str; 4] = ["soft_ttl_days", "superseded_ttl_days", "batch_size", "dry_run"];

impl RetentionPolicy {
    /// The tenant's policy from its `memory_retention` settings (`None` when it has none), each
    /// missing or invalid field taken from `defaults`. The warnings say what was ignored.
    pub fn for_tenant(tenant: &str, settings: Option<&Value>, defaults: Self) -> (Self, Vec<String>) {
        let mut policy = defaults;
        let mut warnings = Vec::new();
        let Some(settings) = settings else { return (policy, warnings) };
        let Some(fields) = settings.as_object() else {
            warnings
                .push(format!("tenant {tenant:?}: memory_retention is {settings}, not an object; using the defaults"));
            return (policy, warnings);
        };
        let mut whole = |field: &str, range: std::ops::RangeInclusive<u32>, default: u32| -> u32 {
            match fields.get(field) {
                None => default,
                Some(value) => match value.as_u64().and_then(|n| u32::try_from(n).ok()).filter(|n| range.contains(n)) {
                    Some(n) => n,
                    None => {
                        warnings.push(format!(
                            "tenant {tenant:?}: memory_retention.{field} is {value}, not a whole number from {} to {}; using the default {default}",
                            range.start(),
                            range.end()
                        ));
                        default
                    }
                },
            }
        };
        policy.soft_ttl_days = whole("soft_ttl_days", 0..=MAX_TTL_DAYS, defaults.soft_ttl_days);
        policy.superseded_ttl_days = whole("superseded_ttl_days", 0..=MAX_TTL_DAYS, defaults.superseded_ttl_days);
        policy.batch_size = whole("batch_size", 1..=MAX_BATCH_SIZE, defaults.batch_size);
        match fields.get("dry_run") {
            None => {}
            // A tenant may ask for a dry run, never lift the deployment's.
            Some(Value::Bool(dry_run)) => policy.dry_run = defaults.dry_run || *dry_run,
            Some(other) => warnings.push(format!(
                "tenant {tenant:?}: memory_retention.dry_run is {other}, not true or false; using the default {}",
                defaults.dry_run
            )),
        }
        for unknown in fields.keys().filter(|k| !POLICY_FIELDS.contains(&k.as_str())) {
            warnings.push(format!(
                "tenant {tenant:?}: memory_retention.{unknown} is not a retention setting (known: {}); ignored",
                POLICY_FIELDS.join(", ")
            ));
        }
        (policy, warnings)
    }
}

/// The safety floor: a sweep that would anonymize more than `max_fraction` of a tenant's rows
/// *and* more than `floor_rows` rows is refused unless an operator allows it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SafetyFloor {
    pub max_fraction: f64,
    pub floor_rows: u64,
}

impl SafetyFloor {
    /// Whether anonymizing `rows` of a tenant holding `tenant_rows` is too large to do unasked.
    pub fn refuses(&self, rows: u64, tenant_rows: u64) -> bool {
        rows > self.floor_rows && rows as f64 > self.max_fraction * tenant_rows as f64
    }
}

/// Why a row is anonymized; the audit row's reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AnonymizeReason {
    /// Soft-deleted longer ago than the soft TTL.
    SoftDeleted,
    /// Superseded longer ago than the superseded TTL.
    Superseded,
    /// Its user asked to be erased.
    Erasure,
}

impl AnonymizeReason {
    pub const ALL: [Self; 3] = [Self::SoftDeleted, Self::Superseded, Self::Erasure];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::SoftDeleted => "soft_deleted",
            Self::Superseded => "superseded",
            Self::Erasure => "erasure",
        }
    }

    pub fn parse(raw: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == raw)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_valid_policy_replaces_the_defaults() {
        let settings = json!({ "soft_ttl_days": 7, "superseded_ttl_days": 0, "batch_size": 500, "dry_run": true });
        let (policy, warnings) = RetentionPolicy::for_tenant("acme", Some(&settings), RetentionPolicy::default());
        assert_eq!(
            policy,
            RetentionPolicy { soft_ttl_days: 7, superseded_ttl_days: 0, batch_size: 500, dry_run: true }
        );
        assert!(warnings.is_empty(), "{warnings:?}");
    }

    #[test]
    fn a_tenant_cannot_lift_the_deployments_dry_run() {
        let defaults = RetentionPolicy { dry_run: true, ..RetentionPolicy::default() };
        let settings = json!({ "dry_run": false });
        let (policy, _) = RetentionPolicy::for_tenant("acme", Some(&settings), defaults);
        assert!(policy.dry_run);
        let (policy, _) = RetentionPolicy::for_tenant("acme", Some(&settings), RetentionPolicy::default());
        assert!(!policy.dry_run);
    }

    #[test]
    fn missing_fields_take_the_defaults_silently() {
        let defaults = RetentionPolicy { dry_run: true, ..RetentionPolicy::default() };
        let (policy, warnings) = RetentionPolicy::for_tenant("acme", Some(&json!({ "soft_ttl_days": 1 })), defaults);
        assert_eq!(policy, RetentionPolicy { soft_ttl_days: 1, ..defaults });
        assert!(warnings.is_empty());
        assert_eq!(RetentionPolicy::for_tenant("acme", None, defaults), (defaults, Vec::new()));
    }

    #[test]
    fn invalid_fields_fall_back_with_a_warning_naming_tenant_and_field() {
        let settings = json!({
            "soft_ttl_days": -3, "superseded_ttl_days": "ninety", "batch_size": 0, "dry_run": "yes", "ttl": 1
        });
        let defaults = RetentionPolicy::default();
        let (policy, warnings) = RetentionPolicy::for_tenant("acme", Some(&settings), defaults);
        assert_eq!(policy, defaults);
        assert_eq!(warnings.len(), 5, "{warnings:?}");
        for (warning, field) in warnings.iter().zip(["soft_ttl_days", "superseded_ttl_days", "batch_size", "dry_run"]) {
            assert!(warning.contains("\"acme\"") && warning.contains(field), "{warning}");
        }
        assert!(warnings[4].contains("memory_retention.ttl"), "{}", warnings[4]);
        let (policy, warnings) = RetentionPolicy::for_tenant("acme", Some(&json!([1])), defaults);
        assert_eq!((policy, warnings.len()), (defaults, 1));
        let (_, warnings) = RetentionPolicy::for_tenant("acme", Some(&json!({ "soft_ttl_days": 1.5 })), defaults);
        assert_eq!(warnings.len(), 1);
    }

    #[test]
    fn reasons_round_trip() {
        for reason in AnonymizeReason::ALL {
            assert_eq!(AnonymizeReason::parse(reason.as_str()), Some(reason));
        }
        assert_eq!(AnonymizeReason::parse("expired"), None);
    }

    #[test]
    fn the_floor_needs_both_the_share_and_the_count() {
        let floor = SafetyFloor { max_fraction: 0.2, floor_rows: 1000 };
        assert!(!floor.refuses(1000, 1000), "not more than 1000 rows");
        assert!(floor.refuses(1001, 5000));
        assert!(!floor.refuses(1001, 5005), "exactly a fifth is allowed");
        assert!(!floor.refuses(5000, 1_000_000), "a small share of a large tenant");
    }
}
