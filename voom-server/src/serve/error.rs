//! Errors as each API dialect writes them.
//!
//! OpenAI: `{"error": {"message", "type", "param", "code"}}`.
//! Anthropic: `{"type": "error", "error": {"type", "message"}}`.
//! The HTTP status is the same in both; only the body differs.
//!
//! This is also the one place where the engine's errors become statuses
//! ([`ApiError::engine`], [`ApiError::model_unavailable`]): a caller's mistake is a
//! 4xx, a model that cannot be served a 503, and only the server's own failures 500.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Which API's error shape a response uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    OpenAi,
    Anthropic,
}

/// What went wrong, independent of dialect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// 400: malformed or unsupported request.
    Invalid,
    /// 404: no such model (or route).
    NotFound,
    /// 405: the route exists, not with this method.
    MethodNotAllowed,
    /// 413: body over the limit.
    TooLarge,
    /// 408: the body did not arrive in time.
    Timeout,
    /// 415: the body is not JSON (`content-type` other than `application/json`).
    UnsupportedMediaType,
    /// 401: no API key, or the wrong one.
    Unauthorized,
    /// 403: a `Host` or `Origin` this server does not answer (DNS rebinding,
    /// cross-site requests).
    Forbidden,
    /// 429: the queue is full; retry after the `Retry-After` seconds.
    Overloaded,
    /// 503: the model cannot be served (it does not load, its pages cannot be read).
    Unavailable,
    /// 500: a failure of the server itself.
    Internal,
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub kind: Kind,
    pub message: String,
    /// The request field at fault (OpenAI's `param`).
    pub param: Option<String>,
    pub dialect: Dialect,
    /// Seconds after which a retry may succeed (`Retry-After`, with 429 and 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(kind: Kind, message: impl Into<String>) -> Self {
        ApiError {
            kind,
            message: message.into(),
            param: None,
            dialect: Dialect::OpenAi,
            retry_after: None,
        }
    }

    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.to_string()),
            ..ApiError::new(Kind::Invalid, message)
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError::new(Kind::Internal, message)
    }

    /// A model that cannot be loaded: 503 naming the model and why.
    pub fn model_unavailable(model: &str, e: &dyn std::fmt::Display) -> Self {
        ApiError::new(
            Kind::Unavailable,
            format!("model '{model}' cannot be served: {e:#}"),
        )
    }

    /// An engine error during a request for `model`. `grammar_param` names the
    /// request field whose grammar constrained the output (`response_format`,
    /// `tools`), if one did.
    pub fn engine(model: &str, e: &libvoom::VoomError, grammar_param: Option<&str>) -> Self {
        use libvoom::constrain::ConstrainError as C;
        use libvoom::VoomError as V;
        match e {
            // What the request asked for is at fault: its grammar failed or admits
            // nothing, or the engine refused the request itself.
            V::Constrain(
                c @ (C::Matcher { .. }
                | C::NothingAllowed { .. }
                | C::CannotStart { .. }
                | C::Grammar { .. }
                | C::Schema { .. }),
            ) => ApiError::invalid(
                grammar_param.unwrap_or("response_format"),
                format!("the output's grammar failed: {c}"),
            ),
            V::Request(m) => ApiError::invalid("messages", m.clone()),
            // The model's files: a page that cannot be read or verified, a
            // checkpoint or config that does not describe a model vOOM can run.
            V::Store(_) | V::Format(_) | V::Config { .. } | V::Weight { .. } => {
                ApiError::model_unavailable(model, e)
            }
            V::Kernel(_) | V::Text(_) | V::Constrain(_) => {
                ApiError::internal(format!("generation failed: {e}"))
            }
        }
    }

    pub fn in_dialect(mut self, d: Dialect) -> Self {
        self.dialect = d;
        self
    }

    pub fn status(&self) -> StatusCode {
        match self.kind {
            Kind::Invalid => StatusCode::BAD_REQUEST,
            Kind::NotFound => StatusCode::NOT_FOUND,
            Kind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Kind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Kind::Timeout => StatusCode::REQUEST_TIMEOUT,
            Kind::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Kind::Unauthorized => StatusCode::UNAUTHORIZED,
            Kind::Forbidden => StatusCode::FORBIDDEN,
            Kind::Overloaded => StatusCode::TOO_MANY_REQUESTS,
            Kind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Kind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The error body in this error's dialect.
    pub fn body(&self) -> serde_json::Value {
        match self.dialect {
            Dialect::OpenAi => {
                let (ty, code) = match self.kind {
                    Kind::Invalid => ("invalid_request_error", None),
                    Kind::NotFound => ("invalid_request_error", Some("model_not_found")),
                    Kind::MethodNotAllowed => ("invalid_request_error", Some("method_not_allowed")),
                    Kind::TooLarge => ("invalid_request_error", Some("request_too_large")),
                    Kind::Timeout => ("invalid_request_error", Some("request_timeout")),
                    Kind::UnsupportedMediaType => {
                        ("invalid_request_error", Some("unsupported_media_type"))
                    }
                    Kind::Unauthorized => ("invalid_request_error", Some("invalid_api_key")),
                    Kind::Forbidden => ("invalid_request_error", Some("forbidden")),
                    Kind::Overloaded => ("requests", Some("rate_limit_exceeded")),
                    Kind::Unavailable => ("server_error", Some("model_unavailable")),
                    Kind::Internal => ("server_error", None),
                };
                json!({"error": {
                    "message": self.message,
                    "type": ty,
                    "param": self.param,
                    "code": code,
                }})
            }
            Dialect::Anthropic => {
                let ty = match self.kind {
                    Kind::Invalid
                    | Kind::Timeout
                    | Kind::MethodNotAllowed
                    | Kind::UnsupportedMediaType => "invalid_request_error",
                    Kind::NotFound => "not_found_error",
                    Kind::TooLarge => "request_too_large",
                    Kind::Unauthorized => "authentication_error",
                    Kind::Forbidden => "permission_error",
                    Kind::Overloaded => "rate_limit_error",
                    Kind::Unavailable => "overloaded_error",
                    Kind::Internal => "api_error",
                };
                let message = match &self.param {
                    Some(p) if !self.message.contains(p.as_str()) => {
                        format!("{p}: {}", self.message)
                    }
                    _ => self.message.clone(),
                };
                json!({"type": "error", "error": {"type": ty, "message": message}})
            }
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_dialect_has_its_shape() {
        let e = ApiError::invalid("temperature", "temperature must be between 0 and 2");
        let o = e.body();
        assert_eq!(o["error"]["type"], "invalid_request_error");
        assert_eq!(o["error"]["param"], "temperature");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        let a = e.in_dialect(Dialect::Anthropic).body();
        assert_eq!(a["type"], "error");
        assert_eq!(a["error"]["type"], "invalid_request_error");
        assert!(a["error"]["message"]
            .as_str()
            .unwrap()
            .contains("temperature"));
        let n = ApiError::new(Kind::NotFound, "no model 'x'").in_dialect(Dialect::Anthropic);
        assert_eq!(n.status(), StatusCode::NOT_FOUND);
        assert_eq!(n.body()["error"]["type"], "not_found_error");
    }
}
