//! JSON-schema validation of values (the `jsonschema` crate): a server checks the
//! arguments a model generated before it returns them, whatever produced them.

use serde_json::Value;

use super::ConstrainError;

/// At most this many violations are reported; the rest are counted.
const MAX_REPORTED: usize = 16;

/// Checks `schema` against its meta-schema (the draft named by `$schema`, 2020-12
/// when absent). The error names the location in the schema and what is wrong.
pub(crate) fn check_schema(schema: &Value) -> Result<(), ConstrainError> {
    if !schema.is_object() && !schema.is_boolean() {
        return Err(ConstrainError::Schema {
            at: Some(String::new()),
            message: format!("a schema must be an object or a boolean, found {schema}"),
        });
    }
    jsonschema::meta::validate(schema).map_err(|e| ConstrainError::Schema {
        at: Some(e.instance_path().as_str().to_string()),
        message: e.to_string(),
    })
}

/// A JSON schema compiled for validation: built once (a schema the validator cannot
/// compile, such as a `pattern` beyond the regex engine's size limit, is an error
/// here, before any generation), used for every value.
pub struct JsonValidator {
    validator: jsonschema::Validator,
}

impl std::fmt::Debug for JsonValidator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonValidator").finish_non_exhaustive()
    }
}

impl JsonValidator {
    /// Checks `schema` against its meta-schema and compiles it. Errors are
    /// [`ConstrainError::Schema`] naming the place in the schema.
    ///
    /// Remote `$ref`s (http, files) are not fetched: only references inside `schema`
    /// resolve.
    pub fn new(schema: &Value) -> Result<JsonValidator, ConstrainError> {
        check_schema(schema)?;
        let validator = jsonschema::validator_for(schema).map_err(|e| ConstrainError::Schema {
            at: Some(e.schema_path().as_str().to_string()),
            message: e.to_string(),
        })?;
        Ok(JsonValidator { validator })
    }

    /// Validates `value`: a [`ConstrainError::Invalid`] lists each violation with its
    /// location in the value (a JSON pointer; `(root)` for the root).
    pub fn validate(&self, value: &Value) -> Result<(), ConstrainError> {
        let mut errors = Vec::new();
        let mut more = 0usize;
        for e in self.validator.iter_errors(value) {
            if errors.len() == MAX_REPORTED {
                more += 1;
                continue;
            }
            let at = e.instance_path().as_str();
            let at = if at.is_empty() { "(root)" } else { at };
            errors.push(format!("{at}: {e}"));
        }
        if more > 0 {
            errors.push(format!("and {more} more"));
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ConstrainError::Invalid { errors })
        }
    }
}

/// Validates `value` against `schema` ([`JsonValidator::new`], then
/// [`JsonValidator::validate`]).
pub fn validate_json(schema: &Value, value: &Value) -> Result<(), ConstrainError> {
    JsonValidator::new(schema)?.validate(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Value {
        json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7}
            },
            "required": ["city", "unit"],
            "additionalProperties": false
        })
    }

    #[test]
    fn accepts_a_valid_value() {
        validate_json(
            &schema(),
            &json!({"city": "Paris", "unit": "celsius", "days": 3}),
        )
        .unwrap();
    }

    #[test]
    fn names_each_violation_and_its_location() {
        let e = validate_json(&schema(), &json!({"unit": "kelvin", "days": 9})).unwrap_err();
        let ConstrainError::Invalid { errors } = &e else {
            panic!("{e}")
        };
        assert_eq!(errors.len(), 3, "{errors:?}");
        let all = errors.join("\n");
        assert!(all.contains("/unit"), "{all}");
        assert!(all.contains("/days"), "{all}");
        assert!(all.contains("city"), "{all}");
    }

    #[test]
    fn a_bad_schema_is_a_schema_error_naming_where() {
        let e = validate_json(
            &json!({"type": "object", "properties": {"a": {"type": "integr"}}}),
            &json!({}),
        )
        .unwrap_err();
        let ConstrainError::Schema { at, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!(at.as_deref(), Some("/properties/a/type"), "{e}");
        assert!(matches!(
            validate_json(&json!(3), &json!({})),
            Err(ConstrainError::Schema { .. })
        ));
    }

    #[test]
    fn many_violations_are_capped() {
        let s = json!({"type": "array", "items": {"type": "string"}});
        let v = Value::Array((0..40).map(|i| json!(i)).collect());
        let ConstrainError::Invalid { errors } = validate_json(&s, &v).unwrap_err() else {
            panic!()
        };
        assert_eq!(errors.len(), MAX_REPORTED + 1);
        assert_eq!(errors.last().unwrap(), "and 24 more");
    }
}
