//! Reading the environment: the variables a process sees, secrets that never print, and the
//! problems found while settings are read, reported all at once.

use std::collections::BTreeMap;
use std::str::FromStr;

use crate::vars;

/// The variables a process sees. Built from the real environment in binaries and from a map in
/// tests.
#[derive(Debug, Clone, Default)]
pub struct Env(BTreeMap<String, String>);

impl Env {
    /// The process's environment, over the variables of the file `MNEMO_CONFIG_FILE` names, if
    /// it names one: a variable set in the environment wins over the file's.
    pub fn from_process() -> Result<Self, ConfigError> {
        Self::with_config_file(std::env::vars().collect())
    }

    fn with_config_file(environment: BTreeMap<String, String>) -> Result<Self, ConfigError> {
        let Some(path) = environment.get(vars::CONFIG_FILE).filter(|p| !p.trim().is_empty()) else {
            return Ok(Self(environment));
        };
        let name = vars::CONFIG_FILE;
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(vec![format!("{name}={path:?} cannot be read: {e}")]))?;
        let mut variables = parse_config_file(&text).map_err(|e| ConfigError(vec![format!("{name}={path:?}: {e}")]))?;
        // A variable set blank (`X=` in a compose file) does not hide the file's value.
        variables.extend(environment.into_iter().filter(|(_, value)| !value.trim().is_empty()));
        Ok(Self(variables))
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

/// The variables of a configuration file, in the format of docker's and systemd's environment
/// files: one `NAME=value` a line, the value everything after the first `=` with no quoting, and
/// blank lines and lines starting with `#` ignored. An error names the line, never its value
/// (the file may hold secrets).
fn parse_config_file(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut variables = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let named = line.split_once('=').filter(|(name, _)| {
            let mut chars = name.chars();
            chars.next().is_some_and(|c| c.is_ascii_uppercase() || c == '_')
                && chars.all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        });
        let Some((name, value)) = named else {
            return Err(format!("line {} is not NAME=value (NAME in capitals, digits and _)", n + 1));
        };
        if name.starts_with("OTEL_") {
            return Err(format!(
                "line {} sets {name}: the trace exporter reads OTEL_ variables from the environment only",
                n + 1
            ));
        }
        if variables.insert(name.to_owned(), value.trim().to_owned()).is_some() {
            return Err(format!("line {} sets {name} a second time", n + 1));
        }
    }
    Ok(variables)
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

    /// An OpenAI-compatible endpoint's base URL and API key: `base_url` and `api_key`, or else
    /// `OPENAI_BASE_URL` and `OPENAI_API_KEY`. The URL must be http(s) (it is kept without a
    /// trailing slash) and the key printable ASCII once trimmed (a key read from a file often
    /// ends in a newline): either would fail every call, while startup looked fine. `needed_by`
    /// names what needs them when neither is set.
    pub(crate) fn endpoint(
        &mut self,
        env: &Env,
        base_url: &str,
        api_key: &str,
        needed_by: &str,
    ) -> (Option<String>, Secret<String>) {
        let url_var = if env.get(base_url).is_some() { base_url } else { vars::OPENAI_BASE_URL };
        let key_var = if env.get(api_key).is_some() { api_key } else { vars::OPENAI_API_KEY };
        let url = env.get(url_var).map(|u| u.trim().trim_end_matches('/').to_owned());
        let key = env.get(key_var).unwrap_or("").trim();
        if url.is_none() && key.is_empty() {
            self.0.push(format!(
                "{needed_by} needs {base_url} (or {}) and/or {api_key} (or {})",
                vars::OPENAI_BASE_URL,
                vars::OPENAI_API_KEY
            ));
        }
        // Neither value is printed: a URL may carry a password, and a key is one.
        if let Some(url) = &url {
            let rest = url.strip_prefix("http://").or_else(|| url.strip_prefix("https://"));
            if !rest.is_some_and(|r| !r.is_empty() && !r.starts_with('/') && r.bytes().all(|b| b.is_ascii_graphic())) {
                self.0.push(format!("{url_var} is not an http:// or https:// URL (e.g. http://host:8000/v1)"));
            }
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            self.0.push(format!(
                "{key_var} holds a space, a control character or non-ASCII: an API key is printable ASCII"
            ));
        }
        (url, Secret::new(key.to_owned()))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn environment(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn a_config_file_is_read_under_the_environment() {
        let dir = std::env::temp_dir().join(format!("mnemo-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("mnemo.env");
        let text = "# mnemo\n\nMNEMO_LISTEN=0.0.0.0:9000\nMNEMO_JWT_SECRET= s=cr=t \nMNEMO_LOG=debug\n";
        std::fs::write(&file, text).expect("write");
        let path = file.to_str().expect("path");
        let env =
            Env::with_config_file(environment(&[(vars::CONFIG_FILE, path), (vars::LOG, "warn"), (vars::LISTEN, " ")]))
                .expect("read");
        assert_eq!(env.get(vars::LISTEN), Some("0.0.0.0:9000"), "a blank variable does not hide the file's");
        assert_eq!(env.get("MNEMO_JWT_SECRET"), Some("s=cr=t"), "everything after the first =, trimmed");
        assert_eq!(env.get(vars::LOG), Some("warn"), "the environment wins");
        // Without the variable, no file is read.
        assert_eq!(Env::with_config_file(environment(&[])).expect("empty").get(vars::LISTEN), None);

        for (bad, expected) in [
            ("MNEMO_LISTEN 0.0.0.0:9000\n", "line 1 is not NAME=value"),
            ("# ok\nmnemo_listen=x\n", "line 2 is not NAME=value"),
            ("=secret-value\n", "line 1 is not NAME=value"),
            ("MNEMO_LOG=a\nMNEMO_LOG=b\n", "line 2 sets MNEMO_LOG a second time"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT=http://c:4318\n", "line 1 sets OTEL_EXPORTER_OTLP_ENDPOINT"),
        ] {
            std::fs::write(&file, bad).expect("write");
            let err = Env::with_config_file(environment(&[(vars::CONFIG_FILE, path)])).unwrap_err().to_string();
            assert!(err.contains(expected) && err.contains(vars::CONFIG_FILE), "{bad:?}: {err}");
            assert!(!err.contains("secret-value") && !err.contains("0.0.0.0:9000"), "a value in an error: {err}");
        }
        let missing = dir.join("absent.env");
        let err = Env::with_config_file(environment(&[(vars::CONFIG_FILE, missing.to_str().expect("path"))]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot be read"), "{err}");
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn an_endpoint_that_every_call_would_fail_on_is_refused_at_startup() {
        let read = |pairs: &[(&str, &str)]| {
            let mut problems = Problems::default();
            let (url, key) = problems.endpoint(&Env::from_pairs(pairs.iter().copied()), "URL", "KEY", "the model");
            (url, key.expose().clone(), problems.0.join("; "))
        };
        // A key read from a file, newline and all, and a URL with spaces and a trailing slash.
        let (url, key, problems) = read(&[("URL", " http://llm:8000/v1/ "), (vars::OPENAI_API_KEY, "sk-1\n")]);
        assert_eq!((url.as_deref(), key.as_str(), problems.as_str()), (Some("http://llm:8000/v1"), "sk-1", ""));
        for (pairs, expected) in [
            (&[("URL", "llm:8000/v1")][..], "URL is not an http:// or https:// URL"),
            (&[(vars::OPENAI_BASE_URL, "https://")][..], "OPENAI_BASE_URL is not an http:// or https:// URL"),
            (&[("URL", "http://a b/v1")][..], "URL is not"),
            (&[("URL", "http://llm"), ("KEY", "sk-1\nsk-2")][..], "KEY holds a space, a control character"),
            (&[("URL", "http://llm"), ("KEY", "sk-é")][..], "KEY holds"),
            (&[][..], "the model needs URL (or OPENAI_BASE_URL) and/or KEY (or OPENAI_API_KEY)"),
        ] {
            let (_, _, problems) = read(pairs);
            assert!(problems.contains(expected), "{pairs:?}: {problems}");
            assert!(!problems.contains("sk-") && !problems.contains("llm"), "a value in an error: {problems}");
        }
    }
}
