//! Errors as each API dialect writes them.
//!
//! OpenAI: `{"error": {"message", "type", "param", "code"}}`.
//! Anthropic: `{"type": "error", "error": {"type", "message"}}`.
//! The HTTP status is the same in both; only the body differs.

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
    /// 500: a failure of the server or the model.
    Internal,
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub kind: Kind,
    pub message: String,
    /// The request field at fault (OpenAI's `param`).
    pub param: Option<String>,
    pub dialect: Dialect,
}

impl ApiError {
    pub fn new(kind: Kind, message: impl Into<String>) -> Self {
        ApiError {
            kind,
            message: message.into(),
            param: None,
            dialect: Dialect::OpenAi,
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
                    Kind::Invalid | Kind::Timeout | Kind::MethodNotAllowed => {
                        "invalid_request_error"
                    }
                    Kind::NotFound => "not_found_error",
                    Kind::TooLarge => "request_too_large",
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
        (self.status(), axum::Json(self.body())).into_response()
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
