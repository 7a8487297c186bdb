//! JSON values that validate against a JSON schema, drawn deterministically from a key: what
//! the simulated model writes for a tool call's arguments and for structured output
//! (`response_format` `json_schema`).
//!
//! Covers what tool and response schemas use in practice (pydantic, zod and hand-written
//! ones): objects with `properties` and `required`, arrays with `items` and `minItems` /
//! `maxItems`, strings (with `minLength`, and `date`, `date-time`, `email`, `uuid` formats),
//! numbers and integers within `minimum` / `maximum`, booleans, `null`, `enum`, `const`,
//! `anyOf` / `oneOf` / `allOf` (the first alternative), a list of types (the first non-null),
//! and local `$ref`s (`#/$defs/…`, `#/definitions/…`). Every property is filled in, required or
//! not, so strict schemas (`additionalProperties: false`, everything required) hold too.

use serde_json::{json, Map, Value};

use keel_core::rng::mix;

use crate::text::word_for;

/// Nesting followed before a sub-schema is answered with its simplest value (a recursive
/// schema, a tree of `$ref`s, must not recurse without end).
const MAX_DEPTH: usize = 12;

/// A value valid against `schema` (whose `$ref`s resolve against itself), drawn from `key`.
pub fn value_for(schema: &Value, key: u64) -> Value {
    Drawer { root: schema }.value(schema, key, 0)
}

struct Drawer<'a> {
    root: &'a Value,
}

impl Drawer<'_> {
    fn value(&self, schema: &Value, key: u64, depth: usize) -> Value {
        let Some(s) = schema.as_object() else {
            // `true` or an empty schema: anything goes.
            return json!(word_for(key));
        };
        if let Some(target) = s
            .get("$ref")
            .and_then(Value::as_str)
            .and_then(|r| self.resolve(r))
        {
            if depth < MAX_DEPTH {
                return self.value(target, key, depth + 1);
            }
        }
        if let Some(c) = s.get("const") {
            return c.clone();
        }
        if let Some(choices) = s
            .get("enum")
            .and_then(Value::as_array)
            .filter(|a| !a.is_empty())
        {
            return choices[(key % choices.len() as u64) as usize].clone();
        }
        for alternatives in ["anyOf", "oneOf", "allOf"] {
            if let Some(first) = s.get(alternatives).and_then(Value::as_array).and_then(|a| {
                // A nullable field is `anyOf: [{…}, {"type": "null"}]`: prefer the real value.
                a.iter()
                    .find(|alt| alt.get("type") != Some(&json!("null")))
                    .or(a.first())
            }) {
                if depth < MAX_DEPTH {
                    return self.value(first, key, depth + 1);
                }
            }
        }
        let kind = match s.get("type") {
            Some(Value::String(t)) => t.as_str(),
            Some(Value::Array(types)) => types
                .iter()
                .filter_map(Value::as_str)
                .find(|t| *t != "null")
                .unwrap_or("null"),
            _ if s.contains_key("properties") => "object",
            _ if s.contains_key("items") => "array",
            _ => "string",
        };
        match kind {
            "object" => self.object(s, key, depth),
            "array" => self.array(s, key, depth),
            "integer" => json!(integer_in(s, key)),
            "number" => {
                let i = integer_in(s, key);
                json!(i as f64 + if i < max_of(s) { 0.5 } else { 0.0 })
            }
            "boolean" => json!(key.is_multiple_of(2)),
            "null" => Value::Null,
            _ => json!(string_for(s, key)),
        }
    }

    fn object(&self, s: &Map<String, Value>, key: u64, depth: usize) -> Value {
        let mut out = Map::new();
        if depth >= MAX_DEPTH {
            return Value::Object(out);
        }
        if let Some(props) = s.get("properties").and_then(Value::as_object) {
            for (i, (name, spec)) in props.iter().enumerate() {
                let k = mix(key.wrapping_add((i as u64 + 1) * 0x9E37));
                out.insert(name.clone(), self.value(spec, k, depth + 1));
            }
        }
        Value::Object(out)
    }

    fn array(&self, s: &Map<String, Value>, key: u64, depth: usize) -> Value {
        let min = s.get("minItems").and_then(Value::as_u64).unwrap_or(1);
        let max = s
            .get("maxItems")
            .and_then(Value::as_u64)
            .unwrap_or(min.max(2));
        let n = if depth >= MAX_DEPTH {
            0
        } else {
            (min.max(1) + key % 2).min(max).max(min)
        };
        let items = s.get("items").unwrap_or(&Value::Bool(true));
        (0..n)
            .map(|i| self.value(items, mix(key ^ (i + 1)), depth + 1))
            .collect()
    }

    /// A local reference (`#/…` as a JSON pointer into the root schema).
    fn resolve(&self, reference: &str) -> Option<&Value> {
        self.root.pointer(reference.strip_prefix('#')?)
    }
}

fn max_of(s: &Map<String, Value>) -> i64 {
    s.get("maximum")
        .and_then(Value::as_f64)
        .map_or(i64::MAX, |m| m.floor() as i64)
}

/// An integer within `minimum` / `maximum` (exclusive bounds honoured), else in 0..100.
fn integer_in(s: &Map<String, Value>, key: u64) -> i64 {
    let bound = |name: &str| s.get(name).and_then(Value::as_f64);
    let lo = bound("minimum")
        .map(|m| m.ceil() as i64)
        .or(bound("exclusiveMinimum").map(|m| m.floor() as i64 + 1))
        .unwrap_or(0);
    let hi = bound("maximum")
        .map(|m| m.floor() as i64)
        .or(bound("exclusiveMaximum").map(|m| m.ceil() as i64 - 1))
        .unwrap_or(lo.saturating_add(99));
    if hi <= lo {
        return lo;
    }
    let span = (hi - lo) as u64 + 1;
    lo + (key % span) as i64
}

/// A string of the schema's format, at least `minLength` long and at most `maxLength`.
fn string_for(s: &Map<String, Value>, key: u64) -> String {
    let mut text = match s.get("format").and_then(Value::as_str) {
        Some("date-time") => format!("2024-01-{:02}T12:00:00Z", key % 28 + 1),
        Some("date") => format!("2024-01-{:02}", key % 28 + 1),
        Some("email") => format!("{}@example.com", word_for(key)),
        Some("uuid") => format!("00000000-0000-4000-8000-{:012x}", key & 0xffff_ffff_ffff),
        Some("uri") => format!("https://example.com/{}", word_for(key)),
        _ => word_for(key).to_owned(),
    };
    let min = s.get("minLength").and_then(Value::as_u64).unwrap_or(0) as usize;
    let mut i = 1;
    while text.chars().count() < min {
        text.push(' ');
        text.push_str(word_for(mix(key + i)));
        i += 1;
    }
    if let Some(max) = s.get("maxLength").and_then(Value::as_u64) {
        text = text.chars().take(max as usize).collect();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_nested_objects_arrays_and_refs() {
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 18, "maximum": 20},
                "score": {"type": "number"},
                "ok": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
                "kind": {"enum": ["a", "b"]},
                "nick": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "home": {"$ref": "#/$defs/Address"}
            },
            "required": ["name", "age"],
            "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}}}
        });
        for key in 0..50 {
            let v = value_for(&schema, key);
            assert!(v["name"].is_string());
            let age = v["age"].as_i64().unwrap();
            assert!((18..=20).contains(&age), "{age}");
            assert!(v["score"].is_number());
            assert!(v["ok"].is_boolean());
            assert!(v["tags"].as_array().unwrap().len() >= 2);
            assert!(v["tags"][0].is_string());
            assert!(["a", "b"].contains(&v["kind"].as_str().unwrap()));
            assert!(v["nick"].is_string());
            assert!(v["home"]["city"].is_string());
        }
        assert_eq!(value_for(&schema, 3), value_for(&schema, 3));
    }

    #[test]
    fn recursive_schemas_end() {
        let schema = json!({"$ref": "#/$defs/Node", "$defs": {"Node": {"type": "object",
            "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}}});
        let v = value_for(&schema, 1);
        assert!(v.to_string().len() < 100_000);
    }

    #[test]
    fn strings_keep_their_length_bounds() {
        let v = value_for(
            &json!({"type": "string", "minLength": 30, "maxLength": 40}),
            9,
        );
        let n = v.as_str().unwrap().chars().count();
        assert!((30..=40).contains(&n), "{v}");
    }
}
