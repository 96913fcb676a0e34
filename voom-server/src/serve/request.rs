//! Reading request bodies: JSON parsed by hand into what the engine needs, so every
//! wrong type or value is an error naming its field, and options the server does not
//! implement are refused rather than ignored.

use serde_json::{Map, Value};

use super::error::ApiError;

/// A request body's top-level object.
pub struct Body {
    pub obj: Map<String, Value>,
}

impl Body {
    /// Parses the raw body: it must be a JSON object.
    pub fn parse(bytes: &[u8]) -> Result<Body, ApiError> {
        if bytes.is_empty() {
            return Err(ApiError::invalid("body", "the request body is empty"));
        }
        let v: Value = serde_json::from_slice(bytes).map_err(|e| {
            ApiError::invalid("body", format!("the request body is not valid JSON: {e}"))
        })?;
        match v {
            Value::Object(obj) => Ok(Body { obj }),
            other => Err(ApiError::invalid(
                "body",
                format!(
                    "the request body must be a JSON object, not {}",
                    kind(&other)
                ),
            )),
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    pub fn str(&self, key: &str) -> Result<Option<&str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(wrong(key, "a string", v)),
        }
    }

    pub fn required_str(&self, key: &str) -> Result<&str, ApiError> {
        self.str(key)?
            .ok_or_else(|| ApiError::invalid(key, format!("'{key}' is required")))
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(wrong(key, "a boolean", v)),
        }
    }

    pub fn f64_in(&self, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let x = n.as_f64().unwrap_or(f64::NAN);
                if !(lo..=hi).contains(&x) {
                    return Err(ApiError::invalid(
                        key,
                        format!("'{key}' must be between {lo} and {hi}, not {x}"),
                    ));
                }
                Ok(Some(x))
            }
            Some(v) => Err(wrong(key, "a number", v)),
        }
    }

    /// A number in `(lo, hi]` (above `lo`, at most `hi`), as `top_p` is.
    pub fn f64_above(&self, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let x = n.as_f64().unwrap_or(f64::NAN);
                if !(x > lo && x <= hi) {
                    return Err(ApiError::invalid(
                        key,
                        format!("'{key}' must be above {lo} and at most {hi}, not {x}"),
                    ));
                }
                Ok(Some(x))
            }
            Some(v) => Err(wrong(key, "a number", v)),
        }
    }

    pub fn u64_in(&self, key: &str, lo: u64, hi: u64) -> Result<Option<u64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_u64() {
                Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
                _ => Err(ApiError::invalid(
                    key,
                    format!("'{key}' must be an integer from {lo} to {hi}, not {n}"),
                )),
            },
            Some(v) => Err(wrong(key, "an integer", v)),
        }
    }

    /// Fails if `key` is present with a value other than its neutral one: options the
    /// server does not implement are refused, never silently ignored.
    pub fn refuse(&self, key: &str, neutral: &[Value], why: &str) -> Result<(), ApiError> {
        match self.get(key) {
            Some(v) if !neutral.contains(v) => Err(ApiError::invalid(
                key,
                format!("'{key}' is not supported: {why}"),
            )),
            _ => Ok(()),
        }
    }

    /// Stop sequences: a string or a list of at most `max` strings.
    pub fn stop_list(&self, key: &str, max: usize) -> Result<Vec<String>, ApiError> {
        let list = match self.get(key) {
            None => return Ok(vec![]),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(wrong(key, "a list of strings", other)),
                })
                .collect::<Result<_, _>>()?,
            Some(v) => Err(wrong(key, "a string or a list of strings", v))?,
        };
        if list.len() > max {
            return Err(ApiError::invalid(
                key,
                format!(
                    "'{key}' has {} sequences; at most {max} are allowed",
                    list.len()
                ),
            ));
        }
        if list.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                key,
                format!("'{key}' has an empty sequence"),
            ));
        }
        Ok(list)
    }
}

/// The text of content parts whose `type` is one of `kinds`, joined with newlines;
/// a part of another type (an image, a file) is refused: these models take text.
/// `at` names the parts' field in errors.
pub fn text_parts(parts: &[Value], at: &str, kinds: &[&str]) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        let here = format!("{at}[{j}]");
        let ty = match p.get("type") {
            Some(Value::String(t)) => t.as_str(),
            Some(v) => return Err(wrong(&format!("{here}.type"), "a string", v)),
            None => {
                return Err(ApiError::invalid(
                    &format!("{here}.type"),
                    format!("content part needs a 'type', not {}", kind(p)),
                ))
            }
        };
        if !kinds.contains(&ty) {
            return Err(ApiError::invalid(
                &format!("{here}.type"),
                format!("content of type '{ty}' is not supported: these models take text"),
            ));
        }
        match p.get("text") {
            Some(Value::String(t)) => texts.push(t.as_str()),
            _ => {
                return Err(ApiError::invalid(
                    &format!("{here}.text"),
                    "a text part needs a string 'text'",
                ))
            }
        }
    }
    Ok(texts.join("\n"))
}

/// A Lark grammar for the output, as vLLM takes it (a vOOM extension to the APIs):
/// `structured_outputs: {"grammar": "..."}`, or the older `guided_grammar: "..."`;
/// with the field it came from. vLLM's other forms (`structured_outputs.json`,
/// `regex`, `choice`, `guided_json`, ...) are refused: `response_format` gives JSON.
pub fn user_grammar(b: &Body) -> Result<Option<(String, &'static str)>, ApiError> {
    for key in [
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_decoding_backend",
    ] {
        b.refuse(
            key,
            &[],
            "of vLLM's guided decoding only 'guided_grammar' (or 'structured_outputs.grammar') is supported; use 'response_format' for JSON",
        )?;
    }
    let from_so = match b.get("structured_outputs") {
        None | Some(Value::Null) => None,
        Some(Value::Object(o)) => {
            if let Some(k) = o.keys().find(|k| *k != "grammar") {
                return Err(ApiError::invalid(
                    &format!("structured_outputs.{k}"),
                    format!(
                        "structured_outputs.{k} is not supported: only 'grammar' (a Lark grammar); use 'response_format' for JSON"
                    ),
                ));
            }
            match o.get("grammar") {
                Some(Value::String(g)) => Some((g.clone(), "structured_outputs.grammar")),
                Some(v) => return Err(wrong("structured_outputs.grammar", "a string", v)),
                None => None,
            }
        }
        Some(v) => return Err(wrong("structured_outputs", "an object", v)),
    };
    let guided = match b.get("guided_grammar") {
        None | Some(Value::Null) => None,
        Some(Value::String(g)) => Some((g.clone(), "guided_grammar")),
        Some(v) => return Err(wrong("guided_grammar", "a string", v)),
    };
    if from_so.is_some() && guided.is_some() {
        return Err(ApiError::invalid(
            "guided_grammar",
            "give the grammar once: 'structured_outputs.grammar' or 'guided_grammar'",
        ));
    }
    match from_so.or(guided) {
        Some((g, param)) if g.trim().is_empty() => {
            Err(ApiError::invalid(param, "the grammar is empty"))
        }
        other => Ok(other),
    }
}

/// JSON type names for messages.
pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub fn wrong(key: &str, want: &str, got: &Value) -> ApiError {
    ApiError::invalid(key, format!("'{key}' must be {want}, not {}", kind(got)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wrong_field_names_itself() {
        assert!(Body::parse(b"").is_err());
        let e = Body::parse(b"{not json").err().unwrap();
        assert!(e.message.contains("not valid JSON"), "{e}");
        let e = Body::parse(b"[1]").err().unwrap();
        assert!(e.message.contains("an array"), "{e}");
        let b = Body::parse(
            br#"{"model": 3, "temperature": 9, "n": 2, "stop": ["a", 1], "max_tokens": -1}"#,
        )
        .unwrap();
        let e = b.required_str("model").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("model"));
        assert!(b.f64_in("temperature", 0.0, 2.0).is_err());
        assert!(b.refuse("n", &[1.into()], "one choice only").is_err());
        assert!(b.stop_list("stop", 4).is_err());
        assert!(b.u64_in("max_tokens", 1, 100).is_err());
        assert!(b
            .required_str("missing")
            .unwrap_err()
            .message
            .contains("required"));
        let ok = Body::parse(br#"{"n": 1, "stop": "x", "stream": true}"#).unwrap();
        assert!(ok.refuse("n", &[1.into()], "").is_ok());
        assert_eq!(ok.stop_list("stop", 4).unwrap(), vec!["x".to_string()]);
        assert_eq!(ok.bool("stream").unwrap(), Some(true));
    }
}
