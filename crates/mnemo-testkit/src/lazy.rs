//! An embedder that loads its model on first use, so in-process test servers that never recall
//! do not load the local model.

use std::sync::Arc;

use mnemo_config::{EmbedProvider, EmbedSettings};
use mnemo_core::{EmbedError, EmbedFuture, Embedder};
use tokio::sync::OnceCell;

#[derive(Debug)]
pub struct LazyEmbedder {
    settings: EmbedSettings,
    dimensions: usize,
    loaded: OnceCell<Arc<dyn Embedder>>,
}

impl LazyEmbedder {
    pub fn new(settings: EmbedSettings) -> Self {
        let dimensions = match &settings.provider {
            EmbedProvider::Local { dimensions, .. } | EmbedProvider::OpenAi { dimensions, .. } => *dimensions,
        };
        Self { settings, dimensions, loaded: OnceCell::new() }
    }
}

impl Embedder for LazyEmbedder {
    fn model(&self) -> &str {
        &self.settings.model
    }

    fn dimensions(&self) -> usize {
        self.dimensions
    }

    fn embed<'a>(&'a self, texts: &'a [String]) -> EmbedFuture<'a> {
        Box::pin(async move {
            let embedder = self
                .loaded
                .get_or_try_init(|| async {
                    mnemo_models::embedder(&self.settings).map_err(|e| EmbedError::permanent("load", e.to_string()))
                })
                .await?;
            embedder.embed(texts).await
        })
    }
}
