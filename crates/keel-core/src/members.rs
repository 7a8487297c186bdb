//! Reading a JSON object's members by name.
//!
//! serde_json keeps an object's members in the order they came (`preserve_order`: keel forwards
//! bodies whose key order matters to the model, such as a JSON schema's properties) in a map
//! that hashes every key it is asked for with SipHash. The objects of a request are small (a
//! message holds two to four members, a body about ten) and read a dozen times a request, so
//! comparing the few keys where they lie costs a fraction of hashing one; a large object is
//! still looked up through its hash.

use serde_json::{Map, Value};

/// Up to this many members an object is searched in order.
const SCANNED: usize = 16;

/// Member lookups by name, for an object (`Map`) and for a value that may be one.
pub trait Members {
    /// The member named `key`; `None` when there is none or `self` is not an object.
    fn member(&self, key: &str) -> Option<&Value>;
    /// [`Members::member`], to change it.
    fn member_mut(&mut self, key: &str) -> Option<&mut Value>;
}

impl Members for Map<String, Value> {
    fn member(&self, key: &str) -> Option<&Value> {
        if self.len() > SCANNED {
            return self.get(key);
        }
        self.iter().find(|(k, _)| k.as_str() == key).map(|(_, v)| v)
    }

    fn member_mut(&mut self, key: &str) -> Option<&mut Value> {
        if self.len() > SCANNED {
            return self.get_mut(key);
        }
        self.iter_mut()
            .find(|(k, _)| k.as_str() == key)
            .map(|(_, v)| v)
    }
}

impl Members for Value {
    fn member(&self, key: &str) -> Option<&Value> {
        self.as_object()?.member(key)
    }

    fn member_mut(&mut self, key: &str) -> Option<&mut Value> {
        self.as_object_mut()?.member_mut(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_member_is_found_by_name_in_small_and_large_objects() {
        let small = json!({"role": "user", "content": "hi"});
        assert_eq!(small.member("content"), Some(&json!("hi")));
        assert_eq!(small.member("name"), None);
        assert_eq!(json!(["content"]).member("content"), None);
        let large: Map<String, Value> = (0..40).map(|i| (format!("k{i}"), json!(i))).collect();
        for i in [0, 16, 17, 39] {
            assert_eq!(large.member(&format!("k{i}")), Some(&json!(i)));
        }
        assert_eq!(large.member("k40"), None);
    }

    #[test]
    fn a_member_found_to_change_is_changed_in_place() {
        let mut small = json!({"role": "user", "content": "hi"});
        *small.member_mut("content").unwrap() = json!("bye");
        assert_eq!(small, json!({"role": "user", "content": "bye"}));
        let mut large: Map<String, Value> = (0..40).map(|i| (format!("k{i}"), json!(i))).collect();
        *large.member_mut("k30").unwrap() = json!("x");
        assert_eq!(large["k30"], json!("x"));
        assert!(large.member_mut("absent").is_none());
    }
}
