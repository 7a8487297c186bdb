//! Consensus: several structured answers to one request merged field by field.
//!
//! Objects are compared key by key, nested objects recursively; every other value (a string, a
//! number, an array, `null`) is one **field**, compared whole. For each field the value most
//! answers gave wins (a field an answer lacks counts as the value "absent", and an absent
//! winner leaves the field out); a tie goes to the value of the earliest answer among the tied,
//! and the answers come ordered fastest first, so ties go to the fastest variant. A key whose
//! values are objects in most answers is merged recursively; otherwise it is one field.
//!
//! **Agreement** is the share of fields on which every answer gave the same value
//! (`fields_agreed / fields_total`; 1 when there are no fields). Each field without unanimity is
//! reported with every answer's value.

use serde_json::{Map, Value};

/// A field the answers did not agree on.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Disagreement {
    /// JSON pointer of the field (`/address/city`; `/` for a whole answer that is not an object).
    pub field: String,
    /// Each answer's value, in the answers' order (`None`: the answer lacks the field).
    pub values: Vec<Option<Value>>,
    /// The value returned (`None`: left out).
    pub chosen: Option<Value>,
}

/// The merged answer and how far the answers agreed.
#[derive(Debug, Clone, PartialEq)]
pub struct Consensus {
    pub merged: Value,
    pub fields_total: usize,
    pub fields_agreed: usize,
    pub disagreements: Vec<Disagreement>,
}

impl Consensus {
    /// `fields_agreed / fields_total`, 1 when there are no fields.
    pub fn agreement(&self) -> f64 {
        if self.fields_total == 0 {
            1.0
        } else {
            self.fields_agreed as f64 / self.fields_total as f64
        }
    }
}

/// Merges `answers` (fastest first; at least one).
pub fn merge(answers: &[Value]) -> Consensus {
    let mut c = Consensus {
        merged: Value::Null,
        fields_total: 0,
        fields_agreed: 0,
        disagreements: Vec::new(),
    };
    let values: Vec<Option<&Value>> = answers.iter().map(Some).collect();
    c.merged = vote(&values, "", &mut c).unwrap_or(Value::Null);
    c
}

/// The winning value among `values` (one per answer) for the field at `path`.
fn vote(values: &[Option<&Value>], path: &str, c: &mut Consensus) -> Option<Value> {
    let present = values.iter().flatten().count();
    let objects = values.iter().flatten().filter(|v| v.is_object()).count();
    if objects * 2 > values.len() && objects == present {
        return Some(Value::Object(merge_objects(values, path, c)));
    }
    // Distinct values with their counts, in order of first appearance (fastest first).
    let mut tally: Vec<(Option<&Value>, usize)> = Vec::new();
    for v in values {
        match tally.iter_mut().find(|(seen, _)| seen == v) {
            Some((_, n)) => *n += 1,
            None => tally.push((*v, 1)),
        }
    }
    let best = tally.iter().map(|(_, n)| *n).max().unwrap_or(0);
    let chosen = tally
        .iter()
        .find(|(_, n)| *n == best)
        .and_then(|(v, _)| v.cloned());
    c.fields_total += 1;
    if tally.len() == 1 {
        c.fields_agreed += 1;
    } else {
        c.disagreements.push(Disagreement {
            field: if path.is_empty() {
                "/".into()
            } else {
                path.into()
            },
            values: values.iter().map(|v| v.cloned()).collect(),
            chosen: chosen.clone(),
        });
    }
    chosen
}

/// Merges objects key by key (keys in order of first appearance, fastest answer first).
fn merge_objects(values: &[Option<&Value>], path: &str, c: &mut Consensus) -> Map<String, Value> {
    let mut keys: Vec<&String> = Vec::new();
    for o in values.iter().flatten().filter_map(|v| v.as_object()) {
        for k in o.keys() {
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
    }
    let mut out = Map::new();
    for k in keys {
        let child: Vec<Option<&Value>> = values.iter().map(|v| v.and_then(|o| o.get(k))).collect();
        let escaped = k.replace('~', "~0").replace('/', "~1");
        if let Some(v) = vote(&child, &format!("{path}/{escaped}"), c) {
            out.insert(k.clone(), v);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn majority_per_field_nested() {
        let a = json!({"name": "Ada", "age": 36, "address": {"city": "London", "zip": "N1"}});
        let b = json!({"name": "Ada", "age": 37, "address": {"city": "London", "zip": "N2"}});
        let c = json!({"name": "Bob", "age": 37, "address": {"city": "London", "zip": "N1"}});
        let r = merge(&[a, b, c]);
        assert_eq!(
            r.merged,
            json!({"name": "Ada", "age": 37, "address": {"city": "London", "zip": "N1"}})
        );
        assert_eq!((r.fields_agreed, r.fields_total), (1, 4));
        assert_eq!(r.agreement(), 0.25);
        let fields: Vec<&str> = r.disagreements.iter().map(|d| d.field.as_str()).collect();
        assert_eq!(fields, ["/name", "/age", "/address/zip"]);
    }

    #[test]
    fn ties_go_to_the_fastest_and_absent_fields_can_win() {
        let r = merge(&[json!({"a": 1}), json!({"a": 2})]);
        assert_eq!(r.merged, json!({"a": 1}));
        let r = merge(&[json!({"a": 1, "x": true}), json!({"a": 1}), json!({"a": 1})]);
        assert_eq!(r.merged, json!({"a": 1}));
        assert_eq!(
            r.disagreements[0].values,
            vec![Some(json!(true)), None, None]
        );
        assert_eq!(r.disagreements[0].chosen, None);
    }

    #[test]
    fn unanimous_answers_agree_fully_and_arrays_are_whole_fields() {
        let a = json!({"list": [1, 2], "o": {}});
        let r = merge(&[a.clone(), a.clone(), a.clone()]);
        assert_eq!(r.merged, a);
        assert_eq!(r.agreement(), 1.0);
        let r = merge(&[
            json!({"list": [1, 2]}),
            json!({"list": [2, 1]}),
            json!({"list": [2, 1]}),
        ]);
        assert_eq!(r.merged, json!({"list": [2, 1]}));
    }

    #[test]
    fn shapes_that_differ_are_voted_whole() {
        let r = merge(&[
            json!({"a": {"b": 1}}),
            json!({"a": "flat"}),
            json!({"a": "flat"}),
        ]);
        assert_eq!(r.merged, json!({"a": "flat"}));
        let r = merge(&[json!([1]), json!([1]), json!("x")]);
        assert_eq!(r.merged, json!([1]));
        assert_eq!(r.disagreements[0].field, "/");
    }
}
