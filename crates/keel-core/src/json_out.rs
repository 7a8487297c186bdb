//! JSON written byte for byte as `serde_json::to_vec` writes it (compact, an object's members in
//! their order), with a string checked sixteen bytes at a time for what it must escape.
//!
//! serde_json looks every byte of a string up in a table before copying a run of it: about nine
//! instructions a byte, which would make re-encoding a long prompt for the upstream the largest
//! part of admitting it (a 2,000-word prompt: 98,000 instructions). Here a prompt costs under
//! two instructions a byte without escapes and about three with a newline every 70 bytes. The
//! property tests below hold every value, string and escape to serde_json's bytes.

use serde_json::{Map, Value};

/// `object` as JSON.
pub fn object_to_vec(object: &Map<String, Value>) -> Vec<u8> {
    let mut out = Vec::new();
    write_object(&mut out, object);
    out
}

fn write_object(out: &mut Vec<u8>, members: &Map<String, Value>) {
    let mut o = Object::begin(out);
    for (k, v) in members {
        o.member(k, v);
    }
    o.end();
}

/// Appends `value` as JSON.
pub fn write_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        // A number is short, and serde_json's own writing of it is the one to match (into a
        // Vec, which cannot fail).
        Value::Number(n) => {
            let _ = serde_json::to_writer(&mut *out, n);
        }
        Value::String(s) => write_str(out, s),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(out, item);
            }
            out.push(b']');
        }
        Value::Object(members) => write_object(out, members),
    }
}

/// An object being written, member by member.
pub struct Object<'a> {
    out: &'a mut Vec<u8>,
    empty: bool,
}

impl<'a> Object<'a> {
    /// Opens an object on `out`.
    pub fn begin(out: &'a mut Vec<u8>) -> Self {
        out.push(b'{');
        Object { out, empty: true }
    }

    /// Appends the member `key`: `value`.
    pub fn member(&mut self, key: &str, value: &Value) {
        self.key(key);
        write_value(self.out, value);
    }

    /// Appends the member `key`: the string `value`.
    pub fn member_str(&mut self, key: &str, value: &str) {
        self.key(key);
        write_str(self.out, value);
    }

    fn key(&mut self, key: &str) {
        if !self.empty {
            self.out.push(b',');
        }
        self.empty = false;
        write_str(self.out, key);
        self.out.push(b':');
    }

    /// Closes the object.
    pub fn end(self) {
        self.out.push(b'}');
    }
}

/// Bytes checked at once for anything to escape, in a form the compiler turns into vector
/// instructions; a block holding something is searched eight bytes at a time.
const BLOCK: usize = 16;

/// Appends `s` as a JSON string.
pub fn write_str(out: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    out.reserve(bytes.len() + 2);
    out.push(b'"');
    // The start of the bytes read but not yet written.
    let mut run = 0;
    let mut escape_at = |out: &mut Vec<u8>, i: usize| {
        out.extend_from_slice(&bytes[run..i]);
        write_escape(out, bytes[i]);
        run = i + 1;
    };
    let mut blocks = bytes.chunks_exact(BLOCK);
    let mut at = 0;
    for block in &mut blocks {
        let any = block
            .iter()
            .fold(0u8, |any, &b| any | u8::from(to_escape(b)));
        if any != 0 {
            for (w, word) in block.chunks_exact(8).enumerate() {
                let Ok(word) = <[u8; 8]>::try_from(word) else {
                    continue;
                };
                let mut flagged = candidates(u64::from_le_bytes(word));
                while flagged != 0 {
                    let i = at + w * 8 + flagged.trailing_zeros() as usize / 8;
                    flagged &= flagged - 1;
                    if to_escape(bytes[i]) {
                        escape_at(out, i);
                    }
                }
            }
        }
        at += BLOCK;
    }
    for (k, &b) in blocks.remainder().iter().enumerate() {
        if to_escape(b) {
            escape_at(out, at + k);
        }
    }
    out.extend_from_slice(&bytes[run..]);
    out.push(b'"');
}

/// A byte JSON does not take as itself in a string: a quote, a backslash, a control character.
/// (Without branches, `|` not `||`, so that a block's check is vectorized.)
fn to_escape(b: u8) -> bool {
    (b < 0x20) | (b == b'"') | (b == b'\\')
}

/// The high bit of every byte of `word` that may be [`to_escape`]: every such byte and
/// possibly some after it. `(x - n·ones) & !x` has a byte's high bit set when that byte of `x`
/// is below `n` (for `n` ≤ 128; a borrow from a lower byte can set it for a byte that is not,
/// never clear it for one that is), and a byte equal to `c` is a zero byte of `x ^ c·ones`.
fn candidates(word: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    let below = |x: u64, n: u64| x.wrapping_sub(n * ONES) & !x;
    let quote = word ^ (u64::from(b'"') * ONES);
    let backslash = word ^ (u64::from(b'\\') * ONES);
    (below(word, 0x20) | below(quote, 1) | below(backslash, 1)) & HIGHS
}

/// Appends the escape of a byte that [`to_escape`] names, as serde_json writes it.
fn write_escape(out: &mut Vec<u8>, b: u8) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let short = match b {
        b'"' => b'"',
        b'\\' => b'\\',
        0x08 => b'b',
        0x0c => b'f',
        b'\n' => b'n',
        b'\r' => b'r',
        b'\t' => b't',
        _ => {
            let hex = [HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]];
            out.extend_from_slice(b"\\u00");
            out.extend_from_slice(&hex);
            return;
        }
    };
    out.extend_from_slice(&[b'\\', short]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    /// Strings weighted toward what must be escaped, beside ASCII and wider characters.
    fn text() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            "[a-z ]{0,12}",
            Just("\"".to_owned()),
            Just("\\".to_owned()),
            (0u8..0x20).prop_map(|b| char::from(b).to_string()),
            Just("\u{7f}é€😀/".to_owned()),
        ];
        prop::collection::vec(piece, 0..24).prop_map(|p| p.concat())
    }

    fn value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            text().prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((text(), inner), 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn a_string_is_written_as_serde_json_writes_it(s in text()) {
            let mut out = Vec::new();
            write_str(&mut out, &s);
            prop_assert_eq!(out, serde_json::to_vec(&s).unwrap());
        }

        #[test]
        fn a_value_is_written_as_serde_json_writes_it(v in value()) {
            let mut out = Vec::new();
            write_value(&mut out, &v);
            prop_assert_eq!(out, serde_json::to_vec(&v).unwrap());
        }
    }

    #[test]
    fn every_byte_to_escape_is_found_at_every_place_in_a_block() {
        for b in 0u8..=0x7f {
            for at in 0..BLOCK {
                let mut block = *b"abcdefghijklmnop";
                block[at] = b;
                let word = <[u8; 8]>::try_from(&block[at / 8 * 8..][..8]).unwrap();
                let flag = 0x80u64 << (8 * (at % 8));
                let expected = if to_escape(b) { flag } else { 0 };
                assert_eq!(
                    candidates(u64::from_le_bytes(word)),
                    expected,
                    "{b:#x} at {at}"
                );
                let s = std::str::from_utf8(&block).unwrap();
                let mut out = Vec::new();
                write_str(&mut out, s);
                assert_eq!(out, serde_json::to_vec(s).unwrap(), "{b:#x} at {at}");
            }
        }
    }

    #[test]
    fn an_object_keeps_its_members_in_order() {
        let v = json!({"z": 1, "a": [true, null, 1.5, -2], "m": {"\n": "\u{1}"}});
        let Value::Object(o) = &v else { unreachable!() };
        assert_eq!(object_to_vec(o), serde_json::to_vec(&v).unwrap());
    }
}
