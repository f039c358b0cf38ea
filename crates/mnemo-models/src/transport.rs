//! The HTTP transport under every OpenAI-compatible client. Each answer is read up to a size
//! bound, so a misbehaving endpoint or proxy cannot fill the worker's memory within its timeout
//! (an answer over the bound becomes a 502). An error answer not in OpenAI's
//! `{"error": {"message": …}}` shape is rewritten into it, keeping its HTTP status: TEI, older
//! vLLM and many proxies answer errors in shapes of their own, which async-openai would report
//! as a malformed answer without a status, and the status is what classes a failure.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use async_openai::error::OpenAIError;
use async_openai::middleware::HttpRequestFactory;
use reqwest::StatusCode;
use serde_json::{Value, json};

/// What the 502 that stands for an answer over the bound says, so that a chat client tells it
/// from the endpoint's own 5xx: the same request would draw the same answer.
pub(crate) const ANSWER_TOO_LARGE: &str = "the answer is larger than";

/// The longest error message kept from an endpoint's error answer, in characters.
const ERROR_MESSAGE_CHARS: usize = 200;

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
            let (status, body) = match read_bounded(response, max_bytes).await.map_err(OpenAIError::Reqwest)? {
                Some(body) if status.is_success() => (status, body),
                Some(body) => (status, openai_error(&body)),
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
fn openai_error(body: &[u8]) -> Vec<u8> {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let message = match &parsed {
        Some(v) if v["error"]["message"].is_string() => v["error"]["message"].as_str(),
        Some(v) => ["error", "message", "detail"].into_iter().find_map(|key| v[key].as_str()),
        None => None,
    };
    let message = message.map_or_else(|| String::from_utf8_lossy(body).into_owned(), str::to_owned);
    let message: String = message.chars().take(ERROR_MESSAGE_CHARS).collect();
    json!({ "error": { "message": message } }).to_string().into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(body: &str) -> Value {
        serde_json::from_slice::<Value>(&openai_error(body.as_bytes())).expect("json")["error"]["message"].clone()
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
}
