//! The `model` an event names, rewritten as the event is decoded: a same-protocol stream's
//! events name the variant's model, and the client is answered with the name it asked for
//! (`response_model = "public"`). Rewriting in the decoder, on the line as it is parsed, builds
//! each event's data and raw bytes once, already renamed, instead of decoding them and then
//! building both again.

use std::ops::Range;

/// A name for the `model` member of the events a decoder reads.
#[derive(Debug, Clone)]
pub struct ModelName {
    /// The name JSON-encoded, quotes included.
    encoded: String,
    /// Only events of this name carry the model (an Anthropic stream's `message_start`), with
    /// the name as a JSON string (for an unnamed event, whose data names its type); `None`:
    /// every event does (an OpenAI stream's chunks).
    only: Option<(&'static str, String)>,
    /// The last event's data up to its model string (the member's name included), when it
    /// had one. A stream's events repeat it (they differ in their text, which comes after):
    /// where the next event starts with the same bytes, its model string starts at the same
    /// place, and no search is needed (the search is half of what renaming an event costs).
    before: Vec<u8>,
}

impl ModelName {
    /// `encoded`: the name as a JSON string, quotes included.
    pub fn in_every_event(encoded: String) -> ModelName {
        ModelName {
            encoded,
            only: None,
            before: Vec::new(),
        }
    }

    /// Only in events named `event` (or unnamed ones whose data names it as a string).
    pub fn in_events_named(encoded: String, event: &'static str) -> ModelName {
        ModelName {
            encoded,
            only: Some((event, format!("\"{event}\""))),
            before: Vec::new(),
        }
    }

    pub fn encoded(&self) -> &str {
        &self.encoded
    }

    /// Where in a `data` line's value the member to rewrite lies, for an event named `event`
    /// (so far: SSE fields may come in any order).
    pub(super) fn span(&mut self, event: Option<&str>, value: &str) -> Option<Range<usize>> {
        if let Some((name, quoted)) = &self.only {
            let named = match event {
                Some(e) => e == *name,
                None => value.contains(quoted.as_str()),
            };
            if !named {
                return None;
            }
        }
        let json = value.as_bytes();
        let at = self.before.len();
        let found = if at > 0 && json.get(..at) == Some(&self.before[..]) {
            // The same bytes before it: the first `"model":` member is where it was.
            string_at(json, at)
        } else {
            let found = model_string(json);
            self.before.clear();
            if let Some(r) = &found {
                self.before.extend_from_slice(&json[..r.start]);
            }
            found
        };
        found.filter(|r| json[r.clone()] != *self.encoded.as_bytes())
    }
}

/// `"model"`, searched for with a searcher built once: every chunk of every renamed stream
/// passes through here, and a window-by-window compare was 2% of keel's CPU.
static MODEL_KEY: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"model\""));

/// Where the string of the first `"model": "<string>"` member of a JSON text lies (quotes
/// included), for replacing it with `encoded` (a JSON string, quotes included); `None` when
/// there is none or it already holds that string. A literal `"` inside a JSON string is always
/// escaped, so the bytes `"model"` followed by `:` can only be an object key.
pub fn model_member(json: &[u8], encoded: &str) -> Option<Range<usize>> {
    model_string(json).filter(|r| json[r.clone()] != *encoded.as_bytes())
}

/// Where the string of the first `"model": "<string>"` member lies, quotes included; `None`
/// when there is none, or the first `"model":` member's value is not a string.
fn model_string(json: &[u8]) -> Option<Range<usize>> {
    const KEY: &[u8] = b"\"model\"";
    let is_ws = |b: u8| b == b' ' || b == b'\t';
    let mut from = 0;
    while let Some(at) = MODEL_KEY.find(&json[from..]) {
        let key_end = from + at + KEY.len();
        from = key_end;
        let mut i = key_end;
        while i < json.len() && is_ws(json[i]) {
            i += 1;
        }
        if json.get(i) != Some(&b':') {
            continue;
        }
        i += 1;
        while i < json.len() && is_ws(json[i]) {
            i += 1;
        }
        return string_at(json, i);
    }
    None
}

/// The JSON string starting at `start`, quotes included; `None` when none starts there or it
/// does not end.
fn string_at(json: &[u8], start: usize) -> Option<Range<usize>> {
    if json.get(start) != Some(&b'"') {
        return None;
    }
    // The string's end: the next quote not escaped.
    let mut j = start + 1;
    loop {
        match json.get(j)? {
            b'\\' => j += 2,
            b'"' => break,
            _ => j += 1,
        }
    }
    Some(start..j + 1)
}

#[cfg(test)]
mod tests {
    use super::super::{decode_all, SseDecoder, SseEvent};
    use super::*;

    fn json(s: &str) -> String {
        serde_json::Value::String(s.into()).to_string()
    }

    fn rename_member(text: &str, encoded: &str) -> Option<String> {
        let span = model_member(text.as_bytes(), encoded)?;
        let mut out = text.to_owned();
        out.replace_range(span, encoded);
        Some(out)
    }

    fn decode_renaming(name: ModelName, wire: &[u8]) -> Vec<SseEvent> {
        let mut dec = SseDecoder::new().renaming_model(name);
        let mut out = Vec::new();
        dec.feed(wire, &mut out).unwrap();
        dec.end(&mut out).unwrap();
        out
    }

    #[test]
    fn finds_the_model_member_only() {
        let enc = json("pub\"lic");
        let got = rename_member(
            r#"{"id":"x","content":"say \"model\": \"no\"","model" : "si\"m","n":1}"#,
            &enc,
        )
        .unwrap();
        assert_eq!(
            got,
            r#"{"id":"x","content":"say \"model\": \"no\"","model" : "pub\"lic","n":1}"#
        );
        assert!(rename_member(r#"{"model":"pub\"lic"}"#, &enc).is_none());
        assert!(rename_member(r#"{"model":null}"#, &enc).is_none());
        assert!(rename_member(r#"{"model":"unterminated"#, &enc).is_none());
    }

    #[test]
    fn events_are_renamed_keeping_their_framing() {
        let wire = b"data: {\"model\":\"sim\",\"x\":1}\r\n\r\ndata: [DONE]\n\n";
        let evs = decode_renaming(ModelName::in_every_event(json("gpt")), wire);
        assert_eq!(evs[0].data, r#"{"model":"gpt","x":1}"#);
        assert_eq!(evs[0].raw, b"data: {\"model\":\"gpt\",\"x\":1}\r\n\r\n");
        assert_eq!(evs[1].raw, b"data: [DONE]\n\n");
        // Split anywhere, the same events.
        for cut in 0..wire.len() {
            let mut dec = SseDecoder::new().renaming_model(ModelName::in_every_event(json("gpt")));
            let mut out = Vec::new();
            dec.feed(&wire[..cut], &mut out).unwrap();
            dec.feed(&wire[cut..], &mut out).unwrap();
            assert_eq!(out, evs, "cut at {cut}");
        }
    }

    #[test]
    fn only_the_named_events_are_renamed() {
        let start = r#"{"type":"message_start","message":{"id":"m","model":"sim","content":[]}}"#;
        let other = r#"{"type":"message_delta","model":"sim"}"#;
        let mut wire = SseEvent::new(Some("message_start"), start).raw;
        wire.extend_from_slice(&SseEvent::new(Some("message_delta"), other).raw);
        // Unnamed, its data says what it is.
        wire.extend_from_slice(&SseEvent::new(None, start).raw);
        let name = ModelName::in_events_named(json("claude"), "message_start");
        let evs = decode_renaming(name, &wire);
        assert!(evs[0].data.contains(r#""model":"claude""#));
        assert_eq!(evs[1].data, other);
        assert!(evs[2].data.contains(r#""model":"claude""#));
        for ev in &evs {
            assert_eq!(&decode_all(&ev.raw).unwrap()[0], ev);
        }
    }

    proptest::proptest! {
        /// A stream's events, decoded one after another by one decoder (which looks for each
        /// event's model where the event before had it, when the bytes before it repeat), are
        /// each renamed as it would be alone.
        #[test]
        fn events_in_a_row_are_each_renamed_as_alone(
            events in proptest::collection::vec(proptest::collection::vec(0usize..6, 1..4), 1..6),
        ) {
            const PIECES: [&str; 6] = [r#""id":"c1""#, r#""model":"sim""#, r#""model":"public""#, r#""model":7"#, r#""model":"si"m""#, r#""t":"x""#];
            let encoded = json("public");
            let datas: Vec<String> = events
                .iter()
                .map(|e| format!("{{{}}}", e.iter().map(|i| PIECES[*i]).collect::<Vec<_>>().join(",")))
                .collect();
            let wire: Vec<u8> = datas.iter().flat_map(|d| SseEvent::new(None, d).raw).collect();
            let renamed = decode_renaming(ModelName::in_every_event(encoded.clone()), &wire);
            proptest::prop_assert_eq!(renamed.len(), datas.len());
            for (d, r) in datas.iter().zip(&renamed) {
                let alone = rename_member(d, &encoded).unwrap_or_else(|| d.clone());
                proptest::prop_assert_eq!(&r.data, &alone);
            }
        }

        /// Whatever an event's lines are, it decodes renamed as it decodes plain with the first
        /// `model` member of its data renamed, and its raw bytes decode to the renamed event.
        #[test]
        fn an_event_decoded_renamed_is_the_plain_event_renamed(
            fields in proptest::collection::vec(0usize..4, 0..3),
            space in proptest::bool::ANY,
            pieces in proptest::collection::vec(0usize..7, 0..6),
            end in 0usize..3,
            public in 0usize..3,
        ) {
            const FIELDS: [&str; 4] = ["event: message_start\n", "id: \"model\":\"x\"\n", ": \"model\"\n", "data: {\"model\":\"first\"}\n"];
            const PIECES: [&str; 7] = [r#""model":"sim""#, r#""model" : "gpt""#, r#""x":1"#, r#""t":"say \"model\": \"no\"""#, r#""model":null"#, "\"m\u{e9}\":\"\u{e9}\"", r#""model":"si\"m""#];
            const ENDS: [&str; 3] = ["\n\n", "\r\n\r\n", "\n\r\n"];
            let data = format!("{{{}}}", pieces.iter().map(|i| PIECES[*i]).collect::<Vec<_>>().join(","));
            let mut raw = fields.iter().map(|i| FIELDS[*i]).collect::<String>();
            raw.push_str(if space { "data: " } else { "data:" });
            raw.push_str(&data);
            raw.push_str(ENDS[end]);
            let Ok(plain) = decode_all(raw.as_bytes()) else {
                return Ok(());
            };
            // Shorter, as long as and longer than the names in the pieces.
            let encoded = json(["p", "pub", "a-public-name-longer-than-any"][public]);
            let renamed = decode_renaming(ModelName::in_every_event(encoded.clone()), raw.as_bytes());
            proptest::prop_assert_eq!(plain.len(), renamed.len());
            for (p, r) in plain.iter().zip(&renamed) {
                // Data lines are renamed one at a time: the first line naming a model is.
                let expected = p.data.split('\n').scan(false, |done, line| {
                    Some(match (*done, rename_member(line, &encoded)) {
                        (false, Some(l)) => { *done = true; l }
                        _ => line.to_owned(),
                    })
                }).collect::<Vec<_>>().join("\n");
                proptest::prop_assert_eq!(&r.data, &expected);
                proptest::prop_assert_eq!(&r.event, &p.event);
                proptest::prop_assert_eq!(&decode_all(&r.raw).unwrap()[0], r);
                proptest::prop_assert_eq!(r.raw.len() as isize - p.raw.len() as isize, r.data.len() as isize - p.data.len() as isize);
            }
        }
    }
}
