//! What every handler shares: the catalog, the worker, the metrics, the limits and
//! the profile.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::HeaderValue;
use axum::response::Response;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::access::{self, Access};
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
    /// The backend every engine computes on ("cpu-avx512", "mlx-gpu"), and what is
    /// turned off on it to keep ids exact (none where it is batch invariant).
    pub backend: String,
    pub exactness_note: Option<String>,
    pub started: Instant,
    pub access: Arc<Access>,
    /// KiB of request bodies that may be held at once, from reading through
    /// preparation: bodies and what is made from them (rendered prompts, tokens)
    /// are bounded in memory however many clients send at once.
    pub body_budget: Arc<Semaphore>,
    /// Requests being prepared (rendered, tokenized, grammars compiled) at once.
    pub prepare_slots: Arc<Semaphore>,
}

/// A request body, and its share of [`App::body_budget`], held until the request
/// has been prepared.
pub struct Received {
    pub bytes: Bytes,
    _budget: OwnedSemaphorePermit,
}

impl std::ops::Deref for Received {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

/// KiB of bodies in flight at once, for bodies of at most `max_body_bytes`: four
/// of the largest, at least 256 MiB.
pub fn body_budget_kib(max_body_bytes: usize) -> usize {
    (max_body_bytes.saturating_mul(4).max(256 << 20) >> 10).min(Semaphore::MAX_PERMITS)
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
    /// The request body: JSON (415 otherwise), within the size limit, the receive
    /// deadline and the budget of bodies in flight (429 when the budget stays spent
    /// for the whole deadline).
    pub async fn body(&self, req: Request, dialect: Dialect) -> Result<Received, ApiError> {
        access::is_json(req.headers())
            .map_err(|m| ApiError::new(Kind::UnsupportedMediaType, m).in_dialect(dialect))?;
        let limit = self.max_body_bytes;
        let declared = req
            .headers()
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        if declared.is_some_and(|n| n > limit) {
            return Err(ApiError::new(
                Kind::TooLarge,
                format!("the request body is larger than {limit} bytes"),
            )
            .in_dialect(dialect));
        }
        // Chunked bodies (no length) are charged the limit.
        let kib = declared
            .unwrap_or(limit)
            .div_ceil(1024)
            .clamp(1, body_budget_kib(limit)) as u32;
        let budget = Arc::clone(&self.body_budget).acquire_many_owned(kib);
        let budget = match tokio::time::timeout(self.receive_timeout, budget).await {
            Ok(Ok(p)) => p,
            _ => {
                let mut e = ApiError::new(
                    Kind::Overloaded,
                    "too many request bodies are in flight; retry shortly",
                )
                .in_dialect(dialect);
                e.retry_after = Some(1);
                return Err(e);
            }
        };
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
            Ok(Ok(bytes)) => Ok(Received {
                bytes,
                _budget: budget,
            }),
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
        if let Ok(v) = HeaderValue::from_str(&self.backend) {
            h.insert("x-voom-backend", v);
        }
        let exact = self.profile.exact && meta.scheme.is_none();
        h.insert(
            "x-voom-exact",
            HeaderValue::from_static(if exact { "true" } else { "false" }),
        );
        if let Some(v) = meta
            .scheme
            .as_deref()
            .and_then(|s| HeaderValue::from_str(s).ok())
        {
            h.insert("x-voom-scheme", v);
        }
    }

    /// The `voom` object added to response bodies.
    pub fn provenance_json(&self, meta: &ModelMeta) -> serde_json::Value {
        serde_json::json!({
            "checkpoint": meta.checkpoint(),
            "profile": self.profile.name,
            "profile_digest": self.profile.digest,
            // Lossy weights are never exact, whatever the profile.
            "exact": self.profile.exact && meta.scheme.is_none(),
            "scheme": meta.scheme,
            "backend": self.backend,
            "exactness_note": self.exactness_note,
        })
    }
}
