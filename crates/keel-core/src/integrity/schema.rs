//! A small JSON Schema check for structured answers: the keywords response schemas use in
//! practice (`type` (one or a list), `properties`, `required`, `additionalProperties: false`,
//! `items`, `minItems` / `maxItems`, `enum`, `const`, `minimum` / `maximum`, `minLength` /
//! `maxLength`, `anyOf` / `oneOf` (one alternative must hold), `allOf`, local `$ref`s). Other
//! keywords are not checked (the answer passes them). Nesting is bounded by [`MAX_DEPTH`].

use serde_json::Value;

/// Nesting followed before the check stops descending (a recursive schema must not recurse
/// without end).
const MAX_DEPTH: usize = 32;

/// `Ok` when `v` is valid against `schema`; otherwise the first violation, with its JSON
/// pointer (`/items/0/name: expected a string`).
pub fn validate(schema: &Value, v: &Value) -> Result<(), String> {
    Checker { root: schema }.check(schema, v, "", 0)
}

struct Checker<'a> {
    root: &'a Value,
}

fn type_matches(t: &str, v: &Value) -> bool {
    match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "number" => v.is_number(),
        "integer" => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        _ => true,
    }
}

impl Checker<'_> {
    fn resolve<'s>(&'s self, schema: &'s Value) -> &'s Value {
        let Some(r) = schema.get("$ref").and_then(Value::as_str) else {
            return schema;
        };
        r.strip_prefix('#')
            .and_then(|p| self.root.pointer(p))
            .unwrap_or(&Value::Bool(true))
    }

    fn check(&self, schema: &Value, v: &Value, at: &str, depth: usize) -> Result<(), String> {
        if depth > MAX_DEPTH {
            return Ok(());
        }
        let schema = self.resolve(schema);
        let Some(s) = schema.as_object() else {
            return match schema {
                Value::Bool(false) => Err(format!("{at}: no value is allowed here")),
                _ => Ok(()),
            };
        };
        let fail = |what: String| Err(format!("{}: {what}", if at.is_empty() { "/" } else { at }));
        match s.get("type") {
            Some(Value::String(t)) if !type_matches(t, v) => return fail(format!("expected {t}")),
            Some(Value::Array(ts))
                if !ts
                    .iter()
                    .filter_map(Value::as_str)
                    .any(|t| type_matches(t, v)) =>
            {
                return fail(format!("expected one of {}", Value::Array(ts.clone())))
            }
            _ => {}
        }
        if let Some(c) = s.get("const") {
            if c != v {
                return fail(format!("expected {c}"));
            }
        }
        if let Some(Value::Array(options)) = s.get("enum") {
            if !options.contains(v) {
                return fail(format!(
                    "{v} is not one of {}",
                    Value::Array(options.clone())
                ));
            }
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(Value::Array(alts)) = s.get(key) {
                if !alts.iter().any(|a| self.check(a, v, at, depth + 1).is_ok()) {
                    return fail(format!("matches none of `{key}`"));
                }
            }
        }
        if let Some(Value::Array(all)) = s.get("allOf") {
            for a in all {
                self.check(a, v, at, depth + 1)?;
            }
        }
        match v {
            Value::Object(o) => {
                if let Some(Value::Array(req)) = s.get("required") {
                    if let Some(missing) = req
                        .iter()
                        .filter_map(Value::as_str)
                        .find(|k| !o.contains_key(*k))
                    {
                        return fail(format!("required field `{missing}` is missing"));
                    }
                }
                let props = s.get("properties").and_then(Value::as_object);
                for (k, child) in o {
                    let path = format!("{at}/{k}");
                    match props.and_then(|p| p.get(k)) {
                        Some(ps) => self.check(ps, child, &path, depth + 1)?,
                        None if s.get("additionalProperties") == Some(&Value::Bool(false)) => {
                            return fail(format!("field `{k}` is not allowed"))
                        }
                        None => {
                            if let Some(extra @ Value::Object(_)) = s.get("additionalProperties") {
                                self.check(extra, child, &path, depth + 1)?;
                            }
                        }
                    }
                }
            }
            Value::Array(items) => {
                let n = items.len() as u64;
                if s.get("minItems")
                    .and_then(Value::as_u64)
                    .is_some_and(|m| n < m)
                {
                    return fail(format!("fewer than minItems items ({n})"));
                }
                if s.get("maxItems")
                    .and_then(Value::as_u64)
                    .is_some_and(|m| n > m)
                {
                    return fail(format!("more than maxItems items ({n})"));
                }
                if let Some(item) = s.get("items") {
                    for (i, x) in items.iter().enumerate() {
                        self.check(item, x, &format!("{at}/{i}"), depth + 1)?;
                    }
                }
            }
            Value::String(text) => {
                let n = text.chars().count() as u64;
                if s.get("minLength")
                    .and_then(Value::as_u64)
                    .is_some_and(|m| n < m)
                {
                    return fail(format!("shorter than minLength ({n} characters)"));
                }
                if s.get("maxLength")
                    .and_then(Value::as_u64)
                    .is_some_and(|m| n > m)
                {
                    return fail(format!("longer than maxLength ({n} characters)"));
                }
            }
            Value::Number(x) => {
                let x = x.as_f64().unwrap_or(0.0);
                if s.get("minimum")
                    .and_then(Value::as_f64)
                    .is_some_and(|m| x < m)
                {
                    return fail(format!("{x} is below the minimum"));
                }
                if s.get("maximum")
                    .and_then(Value::as_f64)
                    .is_some_and(|m| x > m)
                {
                    return fail(format!("{x} is above the maximum"));
                }
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn checks_the_common_keywords() {
        let s = json!({
            "type": "object",
            "additionalProperties": false,
            "required": ["name", "tags"],
            "properties": {
                "name": {"type": "string", "minLength": 2},
                "age": {"type": ["integer", "null"], "minimum": 0},
                "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 2},
                "kind": {"enum": ["a", "b"]}
            },
            "$defs": {"tag": {"type": "string"}}
        });
        assert!(validate(
            &s,
            &json!({"name": "ab", "tags": ["x"], "age": null, "kind": "a"})
        )
        .is_ok());
        let err = |v| validate(&s, &v).unwrap_err();
        assert!(err(json!({"name": "ab"})).contains("`tags`"));
        assert!(err(json!({"name": "a", "tags": []})).starts_with("/name"));
        assert!(err(json!({"name": "ab", "tags": [1]})).starts_with("/tags/0"));
        assert!(err(json!({"name": "ab", "tags": [], "x": 1})).contains("`x` is not allowed"));
        assert!(err(json!({"name": "ab", "tags": [], "age": -1})).contains("minimum"));
        assert!(err(json!({"name": "ab", "tags": [], "kind": "c"})).contains("not one of"));
        assert!(err(json!({"name": "ab", "tags": ["a", "b", "c"]})).contains("maxItems"));
    }

    #[test]
    fn recursive_schemas_end() {
        let s = json!({"$ref": "#"});
        assert!(validate(&s, &json!({"a": 1})).is_ok());
    }
}
