//! What every handler shares: the catalog, the worker, the metrics, the limits and
//! the profile.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::HeaderValue;
use axum::response::Response;

use super::catalog::{Catalog, ModelMeta};
use super::error::{ApiError, Dialect, Kind};
use super::metrics::Metrics;
use super::worker::Worker;

/// What every handler shares.
pub struct App {
    pub catalog: Catalog,
    pub worker: Worker,
    pub metrics: Arc<Metrics>,
    pub max_body_bytes: usize,
    pub receive_timeout: Duration,
    pub profile: Profile,
    pub started: Instant,
}

/// The resolved runtime profile reported with every response.
#[derive(Debug, Clone)]
pub struct Profile {
    pub name: String,
    /// blake3 of the resolved settings, first 16 hex digits.
    pub digest: String,
    /// Lossy profiles change arithmetic; `exact` ones never do.
    pub exact: bool,
    /// The resolved settings (crate::profile::Settings as JSON).
    pub settings: serde_json::Value,
}

impl App {
    /// The request body, within the size limit and the receive deadline.
    pub async fn body(&self, req: Request, dialect: Dialect) -> Result<Bytes, ApiError> {
        let limit = self.max_body_bytes;
        let read = axum::body::to_bytes(req.into_body(), limit);
        match tokio::time::timeout(self.receive_timeout, read).await {
            Err(_) => Err(ApiError::new(
                Kind::Timeout,
                format!(
                    "the request body did not arrive within {:?}",
                    self.receive_timeout
                ),
            )
            .in_dialect(dialect)),
            Ok(Err(e)) => {
                let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
                let mut too_large = false;
                while let Some(s) = source {
                    too_large |= s.is::<http_body_util::LengthLimitError>();
                    source = s.source();
                }
                Err(if too_large {
                    ApiError::new(
                        Kind::TooLarge,
                        format!("the request body is larger than {limit} bytes"),
                    )
                } else {
                    ApiError::invalid("body", format!("reading the request body: {e}"))
                }
                .in_dialect(dialect))
            }
            Ok(Ok(b)) => Ok(b),
        }
    }

    /// Headers naming the checkpoint and profile that produced a response.
    pub fn provenance(&self, meta: &ModelMeta, resp: &mut Response) {
        let h = resp.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&meta.checkpoint()) {
            h.insert("x-voom-checkpoint", v);
        }
        if let Ok(v) = HeaderValue::from_str(&self.profile.name) {
            h.insert("x-voom-profile", v);
        }
        if let Ok(v) = HeaderValue::from_str(&self.profile.digest) {
            h.insert("x-voom-profile-digest", v);
        }
    }

    /// The `voom` object added to response bodies.
    pub fn provenance_json(&self, meta: &ModelMeta) -> serde_json::Value {
        serde_json::json!({
            "checkpoint": meta.checkpoint(),
            "profile": self.profile.name,
            "profile_digest": self.profile.digest,
            "exact": self.profile.exact,
        })
    }
}
