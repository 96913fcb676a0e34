//! Who may talk to the server. A local server is a target for every web page its
//! user visits, so:
//! - the `Host` header must name this server (an IP address, `localhost`, the
//!   `--host` name or an `--allowed-host`): a DNS-rebinding page, whose own name
//!   resolves to 127.0.0.1, sends its own name and is refused;
//! - a browser's cross-site request (an `Origin` header) is refused unless its
//!   origin is on the `--cors-origin` allow-list; CORS is off by default;
//! - request bodies must be JSON (`content-type: application/json`, checked where
//!   bodies are read, `App::body`): a cross-site `text/plain` POST
//!   needs no CORS preflight, so it must not reach the engine;
//! - with an API key (`--api-key`, `VOOM_API_KEY`), every request must carry it
//!   (`Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY`), and a server
//!   listening beyond loopback must have one unless told otherwise.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::{ApiError, Dialect, Kind};

/// The access rules of one server.
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// The key every request must carry, if any.
    pub api_key: Option<String>,
    /// Host names (lowercase, no port) answered besides IP addresses and
    /// `localhost`; `*` answers any.
    pub allowed_hosts: Vec<String>,
    /// Origins (`scheme://host[:port]`) whose browser requests are allowed, with
    /// CORS headers; `*` allows any.
    pub cors_origins: Vec<String>,
}

impl Access {
    /// Why `host` (a `Host` header's value) is refused, if it is.
    fn check_host(&self, host: Option<&str>) -> Result<(), String> {
        let Some(host) = host else {
            return Err("the request has no Host header".into());
        };
        let name = host_name(host).to_ascii_lowercase();
        let name = name.as_str();
        let ok = name.parse::<IpAddr>().is_ok()
            || name == "localhost"
            || name.ends_with(".localhost")
            || self
                .allowed_hosts
                .iter()
                .any(|h| h == "*" || h.eq_ignore_ascii_case(name));
        if ok {
            Ok(())
        } else {
            Err(format!(
                "the Host '{host}' is not a name this server answers to (an IP address, localhost, or --allowed-host NAME)"
            ))
        }
    }

    /// Whether a browser page of `origin` may call this server (CORS allow-list).
    fn origin_allowed(&self, origin: &str) -> bool {
        self.cors_origins
            .iter()
            .any(|o| o == "*" || o.eq_ignore_ascii_case(origin.trim_end_matches('/')))
    }

    /// Whether the request carries the API key (always, without one).
    fn authorized(&self, headers: &HeaderMap) -> bool {
        let Some(key) = &self.api_key else {
            return true;
        };
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
        [bearer, x_api_key]
            .into_iter()
            .flatten()
            .any(|given| constant_time_eq(given.as_bytes(), key.as_bytes()))
    }
}

/// The host part of a `Host` header (`name`, `name:port`, `[v6]:port`).
fn host_name(host: &str) -> &str {
    let host = host.trim();
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// Compares without an early exit, so the time taken does not tell how much of a
/// guessed key was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= (x ^ y) as usize;
    }
    diff == 0
}

/// The error dialect of a path: Anthropic's for `.../messages`, else OpenAI's.
pub fn dialect_of(path: &str) -> Dialect {
    if path.ends_with("/messages") {
        Dialect::Anthropic
    } else {
        Dialect::OpenAi
    }
}

/// The middleware: Host, Origin and API key, before any handler runs; CORS
/// preflights answered here; CORS headers added for allowed origins.
pub async fn guard(State(access): State<Arc<Access>>, req: Request, next: Next) -> Response {
    let dialect = dialect_of(req.uri().path());
    let refuse = |kind: Kind, message: String| {
        ApiError::new(kind, message)
            .in_dialect(dialect)
            .into_response()
    };
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.to_string()));
    if let Err(why) = access.check_host(host.as_deref()) {
        return refuse(Kind::Forbidden, why);
    }
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if let Some(o) = &origin {
        if !access.origin_allowed(o) {
            return refuse(
                Kind::Forbidden,
                format!(
                    "requests from web pages of {o} are not allowed (CORS is off; --cors-origin ORIGIN allows one)"
                ),
            );
        }
    }
    if req.method() == Method::OPTIONS && origin.is_some() {
        // A CORS preflight of an allowed origin: no key is sent with one.
        let mut resp = StatusCode::NO_CONTENT.into_response();
        let asked = req
            .headers()
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .cloned();
        let h = resp.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        if let Some(a) = asked {
            h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, a);
        }
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        cors_headers(&mut resp, origin.as_deref());
        return resp;
    }
    if !access.authorized(req.headers()) {
        return refuse(
            Kind::Unauthorized,
            "this server needs its API key: 'Authorization: Bearer KEY' or 'x-api-key: KEY'".into(),
        );
    }
    let mut resp = next.run(req).await;
    cors_headers(&mut resp, origin.as_deref());
    resp
}

/// The CORS headers of a response to an allowed origin.
fn cors_headers(resp: &mut Response, origin: Option<&str>) {
    let Some(v) = origin.and_then(|o| HeaderValue::from_str(o).ok()) else {
        return;
    };
    let h = resp.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
    h.append(header::VARY, HeaderValue::from_static("Origin"));
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static(
            "x-voom-checkpoint, x-voom-profile, x-voom-profile-digest, x-voom-backend, x-voom-exact, x-voom-scheme, retry-after",
        ),
    );
}

/// Whether a request's `content-type` is JSON (`application/json`, with any
/// parameters such as `charset=utf-8`).
pub fn is_json(headers: &HeaderMap) -> Result<(), String> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("(not text)"));
    match ct {
        Some(t)
            if t.split(';')
                .next()
                .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json")) =>
        {
            Ok(())
        }
        Some(t) => Err(format!(
            "the request body must be JSON with content-type application/json, not '{t}'"
        )),
        None => Err(
            "the request has no content-type: the body must be JSON with content-type application/json"
                .into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_ip_addresses_localhost_or_allowed_names() {
        let a = Access {
            allowed_hosts: vec!["voom.lan".into()],
            ..Access::default()
        };
        for ok in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "[::1]:8080",
            "localhost:8080",
            "LOCALHOST",
            "app.localhost",
            "192.168.1.5:80",
            "voom.lan:8080",
            "VOOM.LAN",
        ] {
            assert!(a.check_host(Some(ok)).is_ok(), "{ok}");
        }
        for bad in [
            "evil.example:8080",
            "localhost.evil.example",
            "voom.lan.evil",
        ] {
            let e = a.check_host(Some(bad)).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
        assert!(a.check_host(None).is_err());
        let any = Access {
            allowed_hosts: vec!["*".into()],
            ..Access::default()
        };
        assert!(any.check_host(Some("whatever.example")).is_ok());
    }

    #[test]
    fn the_api_key_is_a_bearer_token_or_x_api_key() {
        let a = Access {
            api_key: Some("s3cret".into()),
            ..Access::default()
        };
        let with = |k: &str, v: &str| {
            let mut h = HeaderMap::new();
            h.insert(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
            h
        };
        assert!(a.authorized(&with("authorization", "Bearer s3cret")));
        assert!(a.authorized(&with("x-api-key", "s3cret")));
        assert!(!a.authorized(&with("authorization", "Bearer s3cre")));
        assert!(!a.authorized(&with("authorization", "s3cret")));
        assert!(!a.authorized(&with("x-api-key", "s3cret2")));
        assert!(!a.authorized(&HeaderMap::new()));
        assert!(Access::default().authorized(&HeaderMap::new()));
    }

    #[test]
    fn only_json_bodies() {
        let ct = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, v.parse().unwrap());
            h
        };
        assert!(is_json(&ct("application/json")).is_ok());
        assert!(is_json(&ct("Application/JSON; charset=utf-8")).is_ok());
        assert!(is_json(&ct("text/plain"))
            .unwrap_err()
            .contains("text/plain"));
        assert!(is_json(&ct("application/x-www-form-urlencoded")).is_err());
        assert!(is_json(&ct("application/jsonx")).is_err());
        assert!(is_json(&HeaderMap::new()).is_err());
    }

    #[test]
    fn origins_on_the_allow_list_only() {
        let a = Access {
            cors_origins: vec!["http://localhost:3000".into()],
            ..Access::default()
        };
        assert!(a.origin_allowed("http://localhost:3000"));
        assert!(!a.origin_allowed("http://localhost:3001"));
        assert!(!Access::default().origin_allowed("http://localhost:3000"));
    }
}
