//! A JSON Schema checker for the subset the constraint tests use,
//! independent of the grammar engine.

use serde_json::{json, Value};

/// Checks `value` against `schema` (enum, anyOf, object, array, string,
/// number bounds). Returns what is wrong, if anything.
pub fn validate(value: &Value, schema: &Value, path: &str) -> Result<(), String> {
    let fail = |what: String| Err(format!("{path}: {what} (value {value})"));
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        if !options.contains(value) {
            return fail("not one of the enum".into());
        }
    }
    if let Some(any) = schema.get("anyOf").and_then(Value::as_array) {
        if !any.iter().any(|s| validate(value, s, path).is_ok()) {
            return fail("matches no anyOf branch".into());
        }
    }
    let Some(kind) = schema.get("type").and_then(Value::as_str) else {
        return Ok(());
    };
    let number = |key: &str| schema.get(key).and_then(Value::as_f64);
    match kind {
        "object" => {
            let Some(object) = value.as_object() else {
                return fail("not an object".into());
            };
            let properties = schema.get("properties").and_then(Value::as_object);
            for key in schema["required"].as_array().into_iter().flatten() {
                if !object.contains_key(key.as_str().unwrap()) {
                    return fail(format!("required key {key} missing"));
                }
            }
            for (key, v) in object {
                match properties.and_then(|p| p.get(key)) {
                    Some(s) => validate(v, s, &format!("{path}.{key}"))?,
                    None if schema.get("additionalProperties") == Some(&json!(false)) => {
                        return fail(format!("unexpected key {key}"))
                    }
                    None => {}
                }
            }
        }
        "array" => {
            let Some(items) = value.as_array() else {
                return fail("not an array".into());
            };
            if number("minItems").is_some_and(|m| (items.len() as f64) < m) {
                return fail("too few items".into());
            }
            if number("maxItems").is_some_and(|m| (items.len() as f64) > m) {
                return fail("too many items".into());
            }
            if let Some(s) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    validate(item, s, &format!("{path}[{i}]"))?;
                }
            }
        }
        "string" => {
            let Some(s) = value.as_str() else {
                return fail("not a string".into());
            };
            let chars = s.chars().count() as f64;
            if number("minLength").is_some_and(|m| chars < m)
                || number("maxLength").is_some_and(|m| chars > m)
            {
                return fail("string length out of bounds".into());
            }
        }
        "integer" | "number" => {
            let Some(x) = value.as_f64() else {
                return fail("not a number".into());
            };
            if kind == "integer" && !(value.is_i64() || value.is_u64()) {
                return fail("not an integer".into());
            }
            if number("minimum").is_some_and(|m| x < m)
                || number("maximum").is_some_and(|m| x > m)
                || number("exclusiveMinimum").is_some_and(|m| x <= m)
                || number("exclusiveMaximum").is_some_and(|m| x >= m)
            {
                return fail("number out of range".into());
            }
        }
        "boolean" if !value.is_boolean() => return fail("not a boolean".into()),
        "null" if !value.is_null() => return fail("not null".into()),
        _ => {}
    }
    Ok(())
}
