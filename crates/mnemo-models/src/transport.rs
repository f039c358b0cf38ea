//! The HTTP transport under every OpenAI-compatible client. Each answer is read up to a size
//! bound, so a misbehaving endpoint or proxy cannot fill the worker's memory within its timeout
//! (an answer over the bound becomes a 502). An error answer not in OpenAI's
//! `{"error": {"message": …}}` shape is rewritten into it, keeping its HTTP status: TEI, older
//! vLLM and many proxies answer errors in shapes of their own, which async-openai would report
//! as a malformed answer without a status, and the status is what classes a failure. An error
//! answer's `Retry-After` (or OpenAI's `retry-after-ms`) is carried in its message, which is
//! all of the answer async-openai keeps, and read back by [`retry_after`].

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use async_openai::error::OpenAIError;
use async_openai::middleware::HttpRequestFactory;
use reqwest::StatusCode;
use serde_json::{Value, json};

/// What the 502 that stands for an answer over the bound says, so that a chat client tells it
/// from the endpoint's own 5xx: the same request would draw the same answer.
pub(crate) const ANSWER_TOO_LARGE: &str = "the answer is larger than";

/// The longest error message kept from an endpoint's error answer, in characters.
const ERROR_MESSAGE_CHARS: usize = 200;

/// The longest wait honoured from an endpoint's `Retry-After`: the workers' longest backoff.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);

/// How an error message carries the answer's `Retry-After`, in milliseconds, before its text.
const RETRY_AFTER_TAG: &str = "[retry-after-ms ";

#[derive(Clone, Debug)]
pub(crate) struct BoundedTransport {
    pub(crate) http: reqwest::Client,
    pub(crate) max_bytes: usize,
}

impl tower::Service<HttpRequestFactory> for BoundedTransport {
    type Response = reqwest::Response;
    type Error = OpenAIError;
    type Future = Pin<Box<dyn Future<Output = Result<reqwest::Response, OpenAIError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), OpenAIError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: HttpRequestFactory) -> Self::Future {
        let (http, max_bytes) = (self.http.clone(), self.max_bytes);
        Box::pin(async move {
            let response = http.execute(request.build().await?).await.map_err(OpenAIError::Reqwest)?;
            let status = response.status();
            let wait = asked_wait(response.headers());
            let (status, body) = match read_bounded(response, max_bytes).await.map_err(OpenAIError::Reqwest)? {
                Some(body) if status.is_success() => (status, body),
                Some(body) => (status, openai_error(&body, wait)),
                None => {
                    let message = format!("{ANSWER_TOO_LARGE} {max_bytes} bytes");
                    (StatusCode::BAD_GATEWAY, json!({ "error": { "message": message } }).to_string().into_bytes())
                }
            };
            let rebuilt = http::Response::builder()
                .status(status)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body)
                .map_err(|e| OpenAIError::InvalidArgument(e.to_string()))?;
            Ok(reqwest::Response::from(rebuilt))
        })
    }
}

/// The whole body, or `None` when it is longer than `max_bytes` (read no further).
pub(crate) async fn read_bounded(
    mut response: reqwest::Response,
    max_bytes: usize,
) -> Result<Option<Vec<u8>>, reqwest::Error> {
    if response.content_length().is_some_and(|n| n > max_bytes as u64) {
        return Ok(None);
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > max_bytes {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(body))
}

/// An error answer in OpenAI's shape, holding only its message, cut short: the message of
/// `{"error": {"message": …}}`, else that of `{"error": "…"}`, `{"message": "…"}` or `{"detail": "…"}`, else the
/// text itself.
fn openai_error(body: &[u8], wait: Option<Duration>) -> Vec<u8> {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let message = match &parsed {
        Some(v) if v["error"]["message"].is_string() => v["error"]["message"].as_str(),
        Some(v) => ["error", "message", "detail"].into_iter().find_map(|key| v[key].as_str()),
        None => None,
    };
    let message = message.map_or_else(|| String::from_utf8_lossy(body).into_owned(), str::to_owned);
    // A provider's own text never reads as the tag.
    let message = message.replace(RETRY_AFTER_TAG, "[retry after ");
    let mut message: String = message.chars().take(ERROR_MESSAGE_CHARS).collect();
    if let Some(wait) = wait {
        message = format!("{RETRY_AFTER_TAG}{}] {message}", wait.as_millis());
    }
    json!({ "error": { "message": message } }).to_string().into_bytes()
}

/// The wait an answer asks for: `retry-after-ms` (OpenAI's), else `Retry-After` in seconds (its
/// HTTP-date form is not read), at most [`MAX_RETRY_AFTER`].
fn asked_wait(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let number = |name: &str| headers.get(name)?.to_str().ok()?.trim().parse::<f64>().ok();
    let millis = number("retry-after-ms").or_else(|| Some(number("retry-after")? * 1000.0))?;
    (millis.is_finite() && millis > 0.0).then(|| Duration::from_millis(millis as u64).min(MAX_RETRY_AFTER))
}

/// An error message read back: the wait its answer asked for, and the message without it. The
/// tag opens the message, or the message of the body async-openai keeps whole for a 5xx.
pub(crate) fn retry_after(message: &str) -> (Option<Duration>, String) {
    const BODY: &str = r#"{"error":{"message":""#;
    let opening = if message.starts_with(BODY) { BODY.len() } else { 0 };
    let tagged = message[opening..].strip_prefix(RETRY_AFTER_TAG).and_then(|rest| {
        let (millis, rest) = rest.split_once("] ")?;
        Some((millis.parse::<u64>().ok()?, format!("{}{rest}", &message[..opening])))
    });
    match tagged {
        Some((millis, text)) => (Some(Duration::from_millis(millis).min(MAX_RETRY_AFTER)), text),
        None => (None, message.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(body: &str) -> Value {
        serde_json::from_slice::<Value>(&openai_error(body.as_bytes(), None)).expect("json")["error"]["message"].clone()
    }

    #[test]
    fn error_answers_of_any_shape_become_openais() {
        assert_eq!(message(r#"{"error": {"message": "bad model", "type": "invalid_request_error"}}"#), "bad model");
        assert_eq!(
            message(r#"{"error": "Input validation error", "error_type": "Validation"}"#),
            "Input validation error"
        );
        assert_eq!(message(r#"{"object": "error", "message": "too long", "code": 400}"#), "too long");
        assert_eq!(message(r#"{"detail": "Not Found"}"#), "Not Found");
        assert_eq!(message("<html>Bad Gateway</html>"), "<html>Bad Gateway</html>");
        assert_eq!(message(&"x".repeat(5_000)).as_str().map(str::len), Some(ERROR_MESSAGE_CHARS));
    }

    #[test]
    fn the_wait_an_answer_asks_for_is_carried_in_its_message_and_bounded() {
        let headers = |pairs: &[(&'static str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (reqwest::header::HeaderName::from_static(k), v.parse().expect("value")))
                .collect()
        };
        let wait = |pairs: &[(&'static str, &str)]| asked_wait(&headers(pairs));
        assert_eq!(wait(&[("retry-after", "20")]), Some(Duration::from_secs(20)));
        assert_eq!(wait(&[("retry-after", "20"), ("retry-after-ms", "1500")]), Some(Duration::from_millis(1500)));
        assert_eq!(wait(&[("retry-after", "86400")]), Some(MAX_RETRY_AFTER));
        for unread in ["Wed, 21 Oct 2015 07:28:00 GMT", "-3", "0", "NaN"] {
            assert_eq!(wait(&[("retry-after", unread)]), None, "{unread}");
        }
        let body = openai_error(br#"{"error": {"message": "slow down"}}"#, Some(Duration::from_secs(7)));
        let carried: Value = serde_json::from_slice(&body).expect("json");
        let carried = carried["error"]["message"].as_str().expect("message");
        assert_eq!(retry_after(carried), (Some(Duration::from_secs(7)), "slow down".to_owned()));
        // A 5xx answer's message is its whole body.
        let whole = String::from_utf8(body).expect("utf-8");
        assert_eq!(
            retry_after(&whole),
            (Some(Duration::from_secs(7)), r#"{"error":{"message":"slow down"}}"#.to_owned())
        );
        assert_eq!(retry_after("slow down"), (None, "slow down".to_owned()));
        assert_eq!(retry_after("[retry-after-ms 999999999] x"), (Some(MAX_RETRY_AFTER), "x".to_owned()));
        // Only where the transport puts it: not inside a message, nor from the provider's text.
        assert_eq!(retry_after("quoted: [retry-after-ms 5000] x").0, None);
        let spoofed = openai_error(br#"{"error": {"message": "[retry-after-ms 5000] x"}}"#, None);
        let spoofed: Value = serde_json::from_slice(&spoofed).expect("json");
        assert_eq!(retry_after(spoofed["error"]["message"].as_str().expect("message")).0, None);
    }
}
