//! Request bodies are read strictly and by hand: a JSON object whose fields are taken one by one,
//! so every mistake gets its own error code and names the field, and a field nobody took is an
//! error rather than silently ignored.

use std::cell::Cell;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::header::CONTENT_TYPE;
use chrono::{DateTime, Utc};
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

use crate::ApiError;
use crate::serve::BodyTimedOut;

/// Fields that would let a caller pick a tenant. The tenant comes only from the token.
pub const TENANT_FIELDS: &[&str] = &["tenant", "tenant_id", "tenantId"];

/// The most items one page of a list returns.
pub const MAX_PAGE: usize = 1000;

/// A query as (name, raw value) pairs, as they come.
pub fn query_pairs(query: Option<&str>) -> impl Iterator<Item = (&str, &str)> {
    query.unwrap_or("").split('&').filter(|p| !p.is_empty()).map(|p| p.split_once('=').unwrap_or((p, "")))
}

/// A GET's query as (name, raw value) pairs, each name once (`?limit=5&limit=1000` would
/// otherwise be read as one or the other); the endpoint takes the names it knows, refuses the
/// rest, and decodes the values it needs.
pub fn query_params(query: Option<&str>) -> Result<Vec<(&str, &str)>, ApiError> {
    let pairs: Vec<(&str, &str)> = query_pairs(query).collect();
    let mut seen = std::collections::HashSet::new();
    if !pairs.iter().all(|(name, _)| seen.insert(*name)) {
        return Err(ApiError::InvalidField { field: "query", expected: "each parameter at most once" });
    }
    Ok(pairs)
}

/// A whole number from a query, within `range`; `expected` says what is taken.
pub fn query_number<T: std::str::FromStr + PartialOrd>(
    field: &'static str,
    raw: &str,
    range: std::ops::RangeInclusive<T>,
    expected: &'static str,
) -> Result<T, ApiError> {
    // Digits only: Rust's parse also takes a leading `+`.
    let digits = !raw.is_empty() && raw.bytes().all(|b| b.is_ascii_digit());
    digits
        .then(|| raw.parse::<T>().ok())
        .flatten()
        .filter(|n| range.contains(n))
        .ok_or(ApiError::InvalidField { field, expected })
}

/// A UUID in the one spelling the schema's `format: uuid` names (`8-4-4-4-12` hex digits), not
/// the simple, braced or URN forms the parser also reads.
pub fn uuid(raw: &str) -> Option<uuid::Uuid> {
    let id = uuid::Uuid::try_parse(raw).ok()?;
    (raw.len() == uuid::fmt::Hyphenated::LENGTH).then_some(id)
}

/// A list's `limit` from a query: a whole number from 1 to [`MAX_PAGE`].
pub fn page_limit(raw: &str) -> Result<usize, ApiError> {
    query_number("limit", raw, 1..=MAX_PAGE, "a whole number from 1 to 1000")
}

/// The body of a request: a JSON object, taken apart with [`JsonObject::take_str`] and friends,
/// then closed with [`JsonObject::finish`].
#[derive(Debug)]
pub struct JsonObject(Map<String, Value>);

impl<S: Send + Sync> FromRequest<S> for JsonObject {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let json_type = req.headers().get(CONTENT_TYPE).is_none_or(|value| {
            value.to_str().is_ok_and(|v| {
                let mime = v.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
                mime == "application/json" || mime.ends_with("+json")
            })
        });
        if !json_type {
            return Err(ApiError::UnsupportedMediaType);
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|e: BytesRejection| {
            if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge
            } else if caused_by::<BodyTimedOut>(&e) {
                ApiError::RequestTimeout
            } else {
                ApiError::MalformedJson(e.body_text())
            }
        })?;
        Self::parse(&bytes)
    }
}

/// A body read whole, up to `limit` bytes, outside an extractor (a middleware's), with the
/// extractor's answers: too large, too slow, or cut off.
pub(crate) async fn read_body(body: axum::body::Body, limit: usize) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        if caused_by::<http_body_util::LengthLimitError>(&e) {
            ApiError::PayloadTooLarge
        } else if caused_by::<BodyTimedOut>(&e) {
            ApiError::RequestTimeout
        } else {
            ApiError::MalformedJson(e.to_string())
        }
    })
}

/// Whether `E` is somewhere in `error`'s chain of causes.
pub(crate) fn caused_by<E: std::error::Error + 'static>(error: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(error), |e| e.source()).any(|e| e.is::<E>())
}

/// The most JSON values (numbers, strings, arrays, objects, an object's keys) one body may hold.
/// A value takes 32 bytes or more once read, against 2 in the body (`0,`): a body of small numbers
/// at the size limit would take some 200 MB before any field is checked. A batch of 10,000 items
/// of a few dozen values each stays well under.
const MAX_VALUES: usize = 1_000_000;

/// Reads a JSON value in which no object repeats a key (serde_json keeps the last of a repeated
/// key, so `{"content":"a","content":"b"}` would be read as "b" without a word), and which holds
/// no more values than are left in the count it carries.
#[derive(Clone, Copy)]
struct Strict<'a>(&'a Cell<usize>);

impl Strict<'_> {
    fn count<E: serde::de::Error>(self) -> Result<(), E> {
        let left = self.0.get().checked_sub(1).ok_or_else(|| E::custom(format_args!("over {MAX_VALUES} values")))?;
        self.0.set(left);
        Ok(())
    }
}

impl<'de> DeserializeSeed<'de> for Strict<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Value, E> {
        self.count()?;
        Ok(Value::Null)
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Value, E> {
        self.count()?;
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Value, E> {
        self.count()?;
        Ok(Value::from(v))
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Value, E> {
        self.count()?;
        Ok(Value::from(v))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Value, E> {
        self.count()?;
        Ok(Value::from(v))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Value, E> {
        self.count()?;
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Value, E> {
        self.count()?;
        Ok(Value::String(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.count()?;
        let mut values = Vec::new();
        while let Some(value) = seq.next_element_seed(self)? {
            values.push(value);
        }
        Ok(Value::Array(values))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.count()?;
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            self.count()?;
            if object.contains_key(&key) {
                // A key may be any text: named, like an unknown field, by its start only.
                let shown: String = key.chars().take(64).collect();
                return Err(serde::de::Error::custom(format_args!("duplicate key {shown:?}")));
            }
            let value = map.next_value_seed(self)?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

/// A JSON number's integer value: `5` and, as JSON Schema's `integer` allows, `5.0` (clients that
/// hold every number as a float send that); not `5.5`, nor one past i64.
pub(crate) fn integer(n: &serde_json::Number) -> Option<i64> {
    n.as_i64().or_else(|| {
        let f = n.as_f64()?;
        (f.fract() == 0.0 && f >= i64::MIN as f64 && f < i64::MAX as f64).then_some(f as i64)
    })
}

/// The one parameter of a route's path, percent-decoded: axum's own `Path` would answer a bad
/// escape in plain text, without the error-code body.
#[derive(Debug)]
pub struct PathPart(pub String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for PathPart {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<String>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(part)| Self(part))
            .map_err(|rejection| ApiError::InvalidField {
                field: param_named(&rejection),
                expected: "percent-encoded UTF-8",
            })
    }
}

/// The route parameter a path's rejection names, for the error's `field`: the routes' own names.
fn param_named(rejection: &axum::extract::rejection::PathRejection) -> &'static str {
    use axum::extract::path::ErrorKind;
    use axum::extract::rejection::PathRejection;
    let PathRejection::FailedToDeserializePathParams(error) = rejection else { return "path" };
    let ErrorKind::InvalidUtf8InPathParam { key } = error.kind() else { return "path" };
    ["sid", "id", "key", "agent"].into_iter().find(|name| name == key).unwrap_or("path")
}

/// A body's JSON, read strictly: UTF-8, no repeated key, at most [`MAX_VALUES`] values. `/mcp`
/// reads its bodies with this first too, so that rmcp's own parse sees only what `/v1` accepts.
pub(crate) fn strict_json(bytes: &[u8]) -> Result<Value, ApiError> {
    std::str::from_utf8(bytes).map_err(|_| ApiError::InvalidUtf8)?;
    let left = Cell::new(MAX_VALUES);
    let mut json = serde_json::Deserializer::from_slice(bytes);
    Strict(&left)
        .deserialize(&mut json)
        .and_then(|value| json.end().map(|()| value))
        .map_err(|e| ApiError::MalformedJson(e.to_string()))
}

impl JsonObject {
    pub fn parse(bytes: &[u8]) -> Result<Self, ApiError> {
        let Value::Object(map) = strict_json(bytes)? else {
            return Err(ApiError::NotAnObject);
        };
        if let Some(field) = TENANT_FIELDS.iter().find(|f| map.contains_key(**f)) {
            return Err(ApiError::TenantInBody((*field).to_owned()));
        }
        Ok(Self(map))
    }

    /// A nested object (a batch's item, a pack's options): its tenant fields are refused when it
    /// is finished, as a body's are.
    pub fn from_map(map: serde_json::Map<String, Value>) -> Self {
        Self(map)
    }

    fn take(&mut self, field: &'static str) -> Option<Value> {
        self.0.remove(field).filter(|v| !v.is_null())
    }

    pub fn take_str(&mut self, field: &'static str) -> Result<String, ApiError> {
        self.take_opt_str(field)?.ok_or(ApiError::MissingField(field))
    }

    pub fn take_opt_str(&mut self, field: &'static str) -> Result<Option<String>, ApiError> {
        match self.take(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(ApiError::InvalidField { field, expected: "a string" }),
        }
    }

    pub fn take_opt_object(&mut self, field: &'static str) -> Result<Option<Value>, ApiError> {
        match self.take(field) {
            None => Ok(None),
            Some(v @ Value::Object(_)) => Ok(Some(v)),
            Some(_) => Err(ApiError::InvalidField { field, expected: "a JSON object" }),
        }
    }

    /// An RFC 3339 time of years 1–9999 in UTC, as answers write them back (a year outside
    /// would be written in a form RFC 3339 has not).
    pub fn take_opt_time(&mut self, field: &'static str) -> Result<Option<DateTime<Utc>>, ApiError> {
        let expected = "an RFC 3339 timestamp such as 2026-05-02T14:23:01Z, of the years 0001-9999 in UTC";
        self.take_opt_str(field)?
            .map(|raw| {
                DateTime::parse_from_rfc3339(&raw)
                    .map(|t| t.with_timezone(&Utc))
                    .ok()
                    .filter(|t| (1..=9999).contains(&chrono::Datelike::year(t)))
                    .ok_or(ApiError::InvalidField { field, expected })
            })
            .transpose()
    }

    pub fn take_opt_bool(&mut self, field: &'static str) -> Result<Option<bool>, ApiError> {
        match self.take(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(_) => Err(ApiError::InvalidField { field, expected: "true or false" }),
        }
    }

    pub fn take_opt_usize(&mut self, field: &'static str) -> Result<Option<usize>, ApiError> {
        match self.take(field) {
            None => Ok(None),
            Some(Value::Number(n)) => integer(&n)
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or(ApiError::InvalidField { field, expected: "a whole number" }),
            Some(_) => Err(ApiError::InvalidField { field, expected: "a whole number" }),
        }
    }

    pub fn take_opt_i64(&mut self, field: &'static str) -> Result<Option<i64>, ApiError> {
        match self.take(field) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                integer(&n).map(Some).ok_or(ApiError::InvalidField { field, expected: "an integer" })
            }
            Some(_) => Err(ApiError::InvalidField { field, expected: "an integer" }),
        }
    }

    /// Whether the object in `field` has `inner`.
    pub fn nested_has(&self, field: &str, inner: &str) -> bool {
        self.0.get(field).and_then(|v| v.get(inner)).is_some_and(|v| !v.is_null())
    }

    /// Any JSON value but null.
    pub fn take_opt_value(&mut self, field: &'static str) -> Result<Option<Value>, ApiError> {
        Ok(self.take(field))
    }

    pub fn take_opt_f64(&mut self, field: &'static str) -> Result<Option<f64>, ApiError> {
        match self.take(field) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(_) => Err(ApiError::InvalidField { field, expected: "a number" }),
        }
    }

    pub fn take_opt_list(&mut self, field: &'static str) -> Result<Option<Vec<Value>>, ApiError> {
        match self.take(field) {
            None => Ok(None),
            Some(Value::Array(items)) => Ok(Some(items)),
            Some(_) => Err(ApiError::InvalidField { field, expected: "a list" }),
        }
    }

    pub fn take_opt_str_list(&mut self, field: &'static str) -> Result<Option<Vec<String>>, ApiError> {
        let expected = "a list of strings";
        match self.take(field) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .into_iter()
                .map(|item| match item {
                    Value::String(s) => Ok(s),
                    _ => Err(ApiError::InvalidField { field, expected }),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(_) => Err(ApiError::InvalidField { field, expected }),
        }
    }

    /// Refuses any field that was not taken.
    pub fn finish(self) -> Result<(), ApiError> {
        if let Some(field) = TENANT_FIELDS.iter().find(|f| self.0.contains_key(**f)) {
            return Err(ApiError::TenantInBody((*field).to_owned()));
        }
        match self.0.into_iter().next() {
            Some((field, _)) => Err(ApiError::unknown_field(&field)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_numbers_may_come_as_floats_without_a_fraction() {
        let mut body = JsonObject::parse(br#"{"a": 5.0, "b": 5.5, "c": -3.0, "d": 1e300, "e": 7}"#).expect("object");
        assert_eq!(body.take_opt_usize("a").expect("5.0"), Some(5));
        assert_eq!(body.take_opt_usize("b").unwrap_err().code(), "invalid_field");
        assert_eq!(body.take_opt_i64("c").expect("-3.0"), Some(-3));
        assert_eq!(body.take_opt_i64("d").unwrap_err().code(), "invalid_field");
        assert_eq!(body.take_opt_usize("e").expect("7"), Some(7));
    }

    #[test]
    fn a_duplicate_key_is_named_by_its_start_only() {
        let key = "k".repeat(100_000);
        let body = format!(r#"{{"{key}": 1, "{key}": 2}}"#);
        let message = JsonObject::parse(body.as_bytes()).map(|_| ()).unwrap_err().to_string();
        assert!(message.contains("duplicate key") && message.len() < 1_000, "{} bytes", message.len());
    }

    #[test]
    fn bodies_are_refused_with_precise_codes() {
        let code = |body: &[u8]| JsonObject::parse(body).map(|_| ()).unwrap_err().code();
        assert_eq!(code(b"{\"a\": "), "malformed_json");
        assert_eq!(code(b"[1]"), "not_an_object");
        assert_eq!(code(b"{\"a\": \"\xff\"}"), "invalid_utf8");
        assert_eq!(code(br#"{"tenant_id": "other"}"#), "tenant_in_body");

        let mut body = JsonObject::parse(br#"{"content": 5, "extra": true}"#).expect("object");
        assert_eq!(body.take_str("content").unwrap_err().code(), "invalid_field");
        assert_eq!(body.take_str("source_ref").unwrap_err().code(), "missing_field");
        assert_eq!(body.finish().unwrap_err().code(), "unknown_field");
    }

    #[test]
    fn null_means_absent_and_times_must_be_rfc3339() {
        let mut body = JsonObject::parse(br#"{"session_id": null, "event_time": "yesterday"}"#).expect("object");
        assert_eq!(body.take_opt_str("session_id").expect("null is absent"), None);
        assert_eq!(body.take_opt_time("event_time").unwrap_err().code(), "invalid_field");
        body.finish().expect("all taken");
        for (raw, ok) in [
            ("9999-12-31T23:59:59Z", true),
            ("9999-12-31T23:59:59-14:00", false),
            ("0001-01-01T00:00:00Z", true),
            ("0001-01-01T00:00:00+01:00", false),
        ] {
            let mut body = JsonObject::parse(format!("{{\"event_time\": \"{raw}\"}}").as_bytes()).expect("object");
            assert_eq!(body.take_opt_time("event_time").is_ok(), ok, "{raw}");
        }
    }
}
