//! A Hugging Face TEI-compatible cross-encoder: `POST {url}/rerank` with `{query, texts}`,
//! answered by `[{index, score}, …]`. Every answer is checked: one finite score for each text,
//! each index exactly once. Anything else is an error, which recall turns into merge order.

use std::time::Duration;

use mnemo_core::{RerankError, RerankFuture, Reranker};
use serde_json::{Value, json};

use crate::ModelError;

#[derive(Debug)]
pub struct TeiReranker {
    http: reqwest::Client,
    url: String,
}

impl TeiReranker {
    /// `base_url` is the TEI server (`http://host:port`); `timeout` bounds the whole call.
    pub fn new(base_url: &str, timeout: Duration) -> Result<Self, ModelError> {
        crate::install_tls_provider();
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()
            .map_err(|e| ModelError::Client(e.to_string()))?;
        Ok(Self { http, url: format!("{}/rerank", base_url.trim_end_matches('/')) })
    }

    async fn call(&self, query: &str, texts: &[String]) -> Result<Vec<f32>, RerankError> {
        let response = self
            .http
            .post(&self.url)
            .json(&json!({ "query": query, "texts": texts, "truncate": true }))
            .send()
            .await
            .map_err(|e| {
                let kind = if e.is_timeout() { "timeout" } else { "unreachable" };
                RerankError { kind, detail: without_url(&e) }
            })?;
        let status = response.status();
        if !status.is_success() {
            let kind = if status.is_server_error() { "http_5xx" } else { "http_4xx" };
            return Err(RerankError { kind, detail: format!("status {}", status.as_u16()) });
        }
        // About 50 bytes a score: an answer much longer is not one.
        let max_bytes = texts.len().saturating_mul(256).saturating_add(64 << 10);
        let body = crate::transport::read_bounded(response, max_bytes).await.map_err(|e| {
            let kind = if e.is_timeout() { "timeout" } else { "unreachable" };
            RerankError { kind, detail: without_url(&e) }
        })?;
        let too_long = || RerankError { kind: "malformed", detail: format!("an answer over {max_bytes} bytes") };
        let body: Value = serde_json::from_slice(&body.ok_or_else(too_long)?)
            .map_err(|e| RerankError { kind: "malformed", detail: e.to_string() })?;
        scores(&body, texts.len()).map_err(|detail| RerankError { kind: "malformed", detail })
    }
}

impl Reranker for TeiReranker {
    fn rerank<'a>(&'a self, query: &'a str, texts: &'a [String]) -> RerankFuture<'a> {
        Box::pin(self.call(query, texts))
    }
}

/// reqwest errors name the URL; keep the message to what went wrong.
fn without_url(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    if let Some(url) = e.url() {
        text = text.replace(url.as_str(), "<reranker>");
    }
    text
}

/// The scores of a TEI answer in the texts' order.
fn scores(body: &Value, expected: usize) -> Result<Vec<f32>, String> {
    let items = body.as_array().ok_or("the answer is not a JSON array")?;
    if items.len() != expected {
        return Err(format!("{} scores for {expected} texts", items.len()));
    }
    let mut scores = vec![None; expected];
    for item in items {
        let index = item["index"].as_u64().ok_or("an item has no numeric index")? as usize;
        // Finite as the f32 it is kept as: 1e39 is a finite f64 and an infinite f32.
        let score =
            item["score"].as_f64().map(|s| s as f32).filter(|s| s.is_finite()).ok_or("an item has no finite score")?;
        let slot = scores.get_mut(index).ok_or_else(|| format!("index {index} is out of range"))?;
        if slot.replace(score).is_some() {
            return Err(format!("index {index} appears twice"));
        }
    }
    scores.into_iter().collect::<Option<Vec<_>>>().ok_or_else(|| "an index is missing".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_checked_before_use() {
        let good = json!([{"index": 1, "score": 0.9}, {"index": 0, "score": 0.1}]);
        assert_eq!(scores(&good, 2), Ok(vec![0.1, 0.9]));
        assert!(scores(&json!({"error": "x"}), 2).is_err());
        assert!(scores(&json!([{"index": 0, "score": 1e39}]), 1).is_err(), "infinite as an f32");
        assert!(scores(&json!([{"index": 0, "score": 0.9}]), 2).is_err());
        assert!(scores(&json!([{"index": 0, "score": 0.9}, {"index": 0, "score": 0.1}]), 2).is_err());
        assert!(scores(&json!([{"index": 0, "score": 0.9}, {"index": 5, "score": 0.1}]), 2).is_err());
        assert!(scores(&json!([{"index": 0, "score": "high"}, {"index": 1, "score": 0.1}]), 2).is_err());
    }
}
