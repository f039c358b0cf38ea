use std::time::Duration;

use mnemo_core::{MAX_BATCH_SIZE, MAX_TTL_DAYS, RetentionPolicy, SafetyFloor};

use crate::{ConfigError, Env, Problems, vars};

/// Retention: the default policy (a tenant's own policy overrides it field by field), the
/// safety floor, and how often the workers sweep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetentionSettings {
    pub defaults: RetentionPolicy,
    pub floor: SafetyFloor,
    pub interval: Duration,
}

impl RetentionSettings {
    pub(crate) fn read(env: &Env, problems: &mut Problems) -> Self {
        let d = RetentionPolicy::default();
        let mut days = |name: &str, default: u32| {
            let days = problems.parsed(env, name, default, "a whole number of days");
            if days > MAX_TTL_DAYS {
                problems.0.push(format!("{name}={days} is over {MAX_TTL_DAYS} days"));
            }
            days
        };
        let soft_ttl_days = days(vars::ANONYMIZE_SOFT_TTL_DAYS, d.soft_ttl_days);
        let superseded_ttl_days = days(vars::ANONYMIZE_SUP_TTL_DAYS, d.superseded_ttl_days);
        let batch_size = problems.parsed(env, vars::ANONYMIZE_BATCH_SIZE, d.batch_size, "a whole number");
        if !(1..=MAX_BATCH_SIZE).contains(&batch_size) {
            problems
                .0
                .push(format!("{}={batch_size} must be between 1 and {MAX_BATCH_SIZE}", vars::ANONYMIZE_BATCH_SIZE));
        }
        let dry_run = match env.get(vars::ANONYMIZE_DRY_RUN).map(|v| v.trim().to_ascii_lowercase()) {
            None => d.dry_run,
            Some(v) if ["true", "1", "yes", "on"].contains(&v.as_str()) => true,
            Some(v) if ["false", "0", "no", "off"].contains(&v.as_str()) => false,
            Some(v) => {
                problems.0.push(format!("{}={v:?} must be true or false", vars::ANONYMIZE_DRY_RUN));
                d.dry_run
            }
        };
        let max_fraction = problems.parsed(env, vars::ANONYMIZE_MAX_FRACTION, 0.2f64, "a fraction");
        if !(0.0..=1.0).contains(&max_fraction) {
            problems.0.push(format!("{} must be between 0 and 1", vars::ANONYMIZE_MAX_FRACTION));
        }
        let floor_rows = problems.parsed(env, vars::ANONYMIZE_FLOOR_ROWS, 1000u64, "a whole number of rows");
        let interval =
            problems.bounded(env, vars::ANONYMIZE_INTERVAL_S, 3600u64, 1..=30 * 86_400, "a number of seconds");
        Self {
            defaults: RetentionPolicy { soft_ttl_days, superseded_ttl_days, batch_size: batch_size.max(1), dry_run },
            floor: SafetyFloor { max_fraction, floor_rows },
            interval: Duration::from_secs(interval),
        }
    }

    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        Problems::read_all(env, Self::read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_defaults_and_refusals() {
        let settings = RetentionSettings::from_env(&Env::default()).expect("defaults");
        assert_eq!(settings.defaults, RetentionPolicy::default());
        assert_eq!(settings.floor, SafetyFloor { max_fraction: 0.2, floor_rows: 1000 });
        let env = Env::from_pairs([(vars::ANONYMIZE_DRY_RUN, "TRUE"), (vars::ANONYMIZE_SOFT_TTL_DAYS, "0")]);
        let settings = RetentionSettings::from_env(&env).expect("valid");
        assert!(settings.defaults.dry_run);
        assert_eq!(settings.defaults.soft_ttl_days, 0);
        let bad = Env::from_pairs([
            (vars::ANONYMIZE_DRY_RUN, "maybe"),
            (vars::ANONYMIZE_BATCH_SIZE, "0"),
            (vars::ANONYMIZE_MAX_FRACTION, "1.5"),
            (vars::ANONYMIZE_SUP_TTL_DAYS, "-1"),
            // 0 means "off" elsewhere: here it would sweep on every housekeeping tick.
            (vars::ANONYMIZE_INTERVAL_S, "0"),
        ]);
        assert_eq!(RetentionSettings::from_env(&bad).unwrap_err().0.len(), 5);
    }
}
