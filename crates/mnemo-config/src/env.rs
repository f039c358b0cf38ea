//! Reading the environment: the variables a process sees, secrets that never print, and the
//! problems found while settings are read, reported all at once.

use std::collections::BTreeMap;
use std::str::FromStr;

/// The variables a process sees. Built from the real environment in binaries and from a map in
/// tests.
#[derive(Debug, Clone, Default)]
pub struct Env(BTreeMap<String, String>);

impl Env {
    pub fn from_process() -> Self {
        Self(std::env::vars().collect())
    }

    pub fn from_pairs<K: Into<String>, V: Into<String>>(pairs: impl IntoIterator<Item = (K, V)>) -> Self {
        Self(pairs.into_iter().map(|(k, v)| (k.into(), v.into())).collect())
    }

    /// The same variables with one set or replaced.
    pub fn with(mut self, name: &str, value: impl Into<String>) -> Self {
        self.0.insert(name.to_owned(), value.into());
        self
    }

    /// A set, non-blank value.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str).filter(|v| !v.trim().is_empty())
    }
}

/// A value that must never reach a log line or an error message.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret<T>(T);

impl<T> Secret<T> {
    pub fn new(value: T) -> Self {
        Self(value)
    }

    pub fn expose(&self) -> &T {
        &self.0
    }
}

impl<T> std::fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Every problem found in one pass over the environment.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n  - {}", .0.join("\n  - "))]
pub struct ConfigError(pub Vec<String>);

/// Collects problems while settings are read, so all of them are reported together.
#[derive(Debug, Default)]
pub(crate) struct Problems(pub(crate) Vec<String>);

impl Problems {
    pub(crate) fn parsed<T: FromStr>(&mut self, env: &Env, name: &str, default: T, what: &str) -> T
    where
        T::Err: std::fmt::Display,
    {
        match env.get(name) {
            None => default,
            Some(raw) => raw.trim().parse().unwrap_or_else(|e| {
                self.0.push(format!("{name}={raw:?} is not {what}: {e}"));
                default
            }),
        }
    }

    /// A whole number of seconds, from 1 to a week.
    pub(crate) fn seconds(&mut self, env: &Env, name: &str, default: u64) -> std::time::Duration {
        std::time::Duration::from_secs(self.bounded(env, name, default, 1..=604_800, "a number of seconds"))
    }

    /// A whole number of milliseconds, at least 1.
    pub(crate) fn milliseconds(&mut self, env: &Env, name: &str, default: u64) -> u64 {
        self.bounded(env, name, default, 1..=u64::MAX, "milliseconds")
    }

    /// A value within `range`; outside it, a problem and the default.
    pub(crate) fn bounded<T>(
        &mut self,
        env: &Env,
        name: &str,
        default: T,
        range: std::ops::RangeInclusive<T>,
        what: &str,
    ) -> T
    where
        T: FromStr + PartialOrd + std::fmt::Display + Copy,
        T::Err: std::fmt::Display,
    {
        let value = self.parsed(env, name, default, what);
        if range.contains(&value) {
            return value;
        }
        let (low, high) = range.into_inner();
        // An open-ended range (up to u64::MAX, say) reads as "at least".
        let bounds = if high.to_string().len() > 12 { format!("at least {low}") } else { format!("{low} to {high}") };
        self.0.push(format!("{name}={value} is out of range: {what}, {bounds}"));
        default
    }

    /// Reads settings with `read` and fails with every problem it found.
    pub(crate) fn read_all<T>(env: &Env, read: fn(&Env, &mut Problems) -> T) -> Result<T, ConfigError> {
        let mut problems = Self::default();
        let value = read(env, &mut problems);
        problems.finish(value)
    }

    pub(crate) fn finish<T>(self, value: T) -> Result<T, ConfigError> {
        if self.0.is_empty() { Ok(value) } else { Err(ConfigError(self.0)) }
    }
}
