//! An OpenAI stream chunk as the assembler reads it (the answer's identity, usage, and the first
//! choice's text, tool-call pieces and finish reason), and an Anthropic `content_block_delta`
//! (its block's index, the text or tool-input JSON it adds).
//!
//! A chunk is deserialized straight into [`Chunk`] (strings borrowed where unescaped, unknown
//! fields skipped): a JSON tree for each role, finish and usage chunk was most of what assembling
//! a whole answer cost. A chunk this cannot read (a field of an unexpected type, a duplicated
//! field) is parsed into a tree and read into the same struct by [`Chunk::from_tree`], which
//! reads a field of the wrong type as absent. The two agree on every chunk the first can read
//! (a property test below checks it), so the assembler, and the translators that read the same
//! events (`translate::stream_to_anthropic`, `translate::stream_to_openai`), have one reading
//! whichever way the chunk came.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::Value;

use crate::members::Members;
use crate::protocol::{borrowed_text, read_choices, MapOnly, ReadChoices};

#[derive(Debug, Default, PartialEq, Deserialize)]
pub(crate) struct Chunk<'a> {
    /// An upstream's error, present and not `null` (its message is read from the tree).
    #[serde(default)]
    pub error: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    pub id: Option<Value>,
    #[serde(default)]
    pub created: Option<Value>,
    #[serde(default)]
    pub model: Option<Value>,
    #[serde(default)]
    pub usage: Option<Value>,
    #[serde(default, borrow, deserialize_with = "read_choices")]
    pub choices: Option<FirstChoice<'a>>,
}

#[derive(Debug, Default, PartialEq, Deserialize)]
pub(crate) struct Choice<'a> {
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    pub text: Option<Cow<'a, str>>,
    #[serde(default)]
    pub finish_reason: Option<Value>,
    #[serde(default, borrow)]
    pub delta: Option<MapOnly<Delta<'a>>>,
}

#[derive(Debug, Default, PartialEq, Deserialize)]
pub(crate) struct Delta<'a> {
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    pub content: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    pub refusal: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    pub reasoning_content: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    pub reasoning: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    pub tool_calls: Option<Vec<MapOnly<Call<'a>>>>,
}

#[derive(Debug, Default, PartialEq, Deserialize)]
pub(crate) struct Call<'a> {
    #[serde(default)]
    pub index: Option<u64>,
    #[serde(default)]
    pub id: Option<Value>,
    #[serde(default, borrow)]
    pub function: Option<MapOnly<Function<'a>>>,
}

#[derive(Debug, Default, PartialEq, Deserialize)]
pub(crate) struct Function<'a> {
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    pub name: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    pub arguments: Option<Cow<'a, str>>,
}

/// The first element of `choices` (the assembler builds one choice); the rest are skipped
/// without being read, as the tree reading skips them.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct FirstChoice<'a>(pub Option<Choice<'a>>);

impl<'de: 'a, 'a> ReadChoices<'de> for FirstChoice<'a> {
    fn read<A: serde::de::SeqAccess<'de>>(mut seq: A) -> Result<Self, A::Error> {
        let first = seq.next_element::<MapOnly<Choice<'a>>>()?.map(|c| c.0);
        while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(FirstChoice(first))
    }
}

impl<'a> Chunk<'a> {
    /// The chunk read from its data, without a tree; `Err` when it has a shape this cannot read.
    pub fn parse(data: &'a str) -> serde_json::Result<Self> {
        MapOnly::parse(data)
    }

    /// The chunk read from its JSON tree: a field of the wrong type, or a part that is not an
    /// object where one is expected, reads as absent.
    pub fn from_tree(v: &'a Value) -> Self {
        let text = |v: &'a Value, key: &str| v.get(key).and_then(Value::as_str).map(Cow::Borrowed);
        let some = |v: &Value, key: &str| v.get(key).filter(|x| !x.is_null()).cloned();
        let object = |v: &'a Value, key: &str| v.get(key).filter(|x| x.is_object());
        let call = |c: &'a Value| Call {
            index: c.member("index").and_then(Value::as_u64),
            id: some(c, "id"),
            function: object(c, "function").map(|f| {
                MapOnly(Function {
                    name: text(f, "name"),
                    arguments: text(f, "arguments"),
                })
            }),
        };
        let delta = |d: &'a Value| Delta {
            content: text(d, "content"),
            refusal: text(d, "refusal"),
            reasoning_content: text(d, "reasoning_content"),
            reasoning: text(d, "reasoning"),
            tool_calls: d
                .member("tool_calls")
                .and_then(Value::as_array)
                .map(|calls| calls.iter().map(|c| MapOnly(call(c))).collect()),
        };
        let first = v
            .member("choices")
            .and_then(Value::as_array)
            .map(|choices| {
                FirstChoice(choices.first().map(|c| Choice {
                    text: text(c, "text"),
                    finish_reason: some(c, "finish_reason"),
                    delta: object(c, "delta").map(|d| MapOnly(delta(d))),
                }))
            });
        Chunk {
            error: v
                .member("error")
                .filter(|e| !e.is_null())
                .map(|_| serde::de::IgnoredAny),
            id: some(v, "id"),
            created: some(v, "created"),
            model: some(v, "model"),
            usage: some(v, "usage"),
            choices: first,
        }
    }
}

impl<'a> Choice<'a> {
    /// The generated text: chat `delta.content`, else completions `text`.
    pub fn text(&self) -> Option<&str> {
        self.delta
            .as_ref()
            .and_then(|d| d.0.content.as_deref())
            .or(self.text.as_deref())
    }

    /// The delta, if the choice has one.
    pub fn delta(&self) -> Option<&Delta<'a>> {
        self.delta.as_ref().map(|d| &d.0)
    }

    pub fn calls(&self) -> &[MapOnly<Call<'a>>] {
        self.delta
            .as_ref()
            .and_then(|d| d.0.tool_calls.as_deref())
            .unwrap_or(&[])
    }
}

/// An Anthropic `content_block_delta`, read as [`Chunk`] is: without a tree where it has the
/// expected shape, else from its tree by [`BlockDelta::from_tree`].
#[derive(Debug, Default, PartialEq, Deserialize)]
pub(crate) struct BlockDelta<'a> {
    #[serde(default)]
    pub index: Option<u64>,
    #[serde(default, borrow)]
    pub delta: Option<MapOnly<DeltaPieces<'a>>>,
}

#[derive(Debug, Default, PartialEq, Deserialize)]
pub(crate) struct DeltaPieces<'a> {
    /// The delta's `type` (`text_delta`, `thinking_delta`, `input_json_delta`, …).
    #[serde(default, borrow, rename = "type", deserialize_with = "borrowed_text")]
    pub kind: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    pub text: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    pub thinking: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "borrowed_text")]
    pub partial_json: Option<Cow<'a, str>>,
}

impl<'a> BlockDelta<'a> {
    pub fn parse(data: &'a str) -> serde_json::Result<Self> {
        MapOnly::parse(data)
    }

    pub fn from_tree(v: &'a Value) -> Self {
        let text = |d: &'a Value, key: &str| d.get(key).and_then(Value::as_str).map(Cow::Borrowed);
        BlockDelta {
            index: v.member("index").and_then(Value::as_u64),
            delta: v.member("delta").filter(|d| d.is_object()).map(|d| {
                MapOnly(DeltaPieces {
                    kind: text(d, "type"),
                    text: text(d, "text"),
                    thinking: text(d, "thinking"),
                    partial_json: text(d, "partial_json"),
                })
            }),
        }
    }

    /// The text and the tool-input JSON the delta adds.
    pub fn pieces(&self) -> (Option<&str>, Option<&str>) {
        let d = self.delta.as_ref().map(|d| &d.0);
        (
            d.and_then(|d| d.text.as_deref()),
            d.and_then(|d| d.partial_json.as_deref()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunk data built from random pieces, some of the expected types and some not.
    fn chunk_data() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let scalar = prop_oneof![
            Just("null".to_owned()),
            Just("7".to_owned()),
            Just("-1".to_owned()),
            Just("1.5".to_owned()),
            Just("true".to_owned()),
            Just("[]".to_owned()),
            Just("{}".to_owned()),
            "\\PC{0,5}|[\"\\\\\n]{1,2}".prop_map(|s| Value::String(s).to_string()),
        ];
        let field = |key: &'static str, v: BoxedStrategy<String>| {
            proptest::option::of(v).prop_map(move |v| v.map(|v| format!("\"{key}\":{v}")))
        };
        let object = |fields: Vec<BoxedStrategy<Option<String>>>| {
            fields.prop_map(|f| {
                format!(
                    "{{{}}}",
                    f.into_iter().flatten().collect::<Vec<_>>().join(",")
                )
            })
        };
        let s = scalar.boxed();
        // Mostly the expected type, so that many chunks are read both ways.
        let text = prop_oneof![6 => "\\PC{0,5}|[\"\\\\\n]{1,2}".prop_map(|s| Value::String(s).to_string()), 1 => s.clone()].boxed();
        let index = prop_oneof![6 => (0u64..4).prop_map(|i| i.to_string()), 1 => s.clone()].boxed();
        let function = prop_oneof![
            6 => object(vec![field("name", text.clone()).boxed(), field("arguments", text.clone()).boxed()]),
            1 => s.clone()
        ]
        .boxed();
        let call = prop_oneof![
            6 => object(vec![
                field("index", index).boxed(),
                field("id", s.clone()).boxed(),
                field("function", function).boxed(),
            ]),
            1 => s.clone()
        ]
        .boxed();
        let calls = prop_oneof![
            6 => proptest::collection::vec(call, 0..3).prop_map(|c| format!("[{}]", c.join(","))),
            1 => s.clone()
        ]
        .boxed();
        let delta = prop_oneof![
            6 => object(vec![
                field("content", text.clone()).boxed(),
                field("refusal", text.clone()).boxed(),
                field("reasoning_content", text.clone()).boxed(),
                field("tool_calls", calls).boxed(),
            ]),
            1 => s.clone()
        ]
        .boxed();
        let choice = prop_oneof![
            6 => object(vec![
                field("text", text.clone()).boxed(),
                field("finish_reason", s.clone()).boxed(),
                field("delta", delta).boxed(),
            ]),
            1 => s.clone()
        ]
        .boxed();
        let choices = prop_oneof![
            6 => proptest::collection::vec(choice, 0..3).prop_map(|c| format!("[{}]", c.join(","))),
            1 => s.clone()
        ]
        .boxed();
        object(vec![
            field("error", s.clone()).boxed(),
            field("id", s.clone()).boxed(),
            field("created", s.clone()).boxed(),
            field("model", s.clone()).boxed(),
            field("usage", s.clone()).boxed(),
            field("choices", choices).boxed(),
        ])
    }

    #[test]
    fn a_plain_chunk_is_read_without_a_tree() {
        let data = r#"{"id":"c","object":"chat.completion.chunk","created":5,"model":"m","choices":[{"index":0,"delta":{"content":"hi"},"logprobs":null,"finish_reason":"stop"},{"index":1}],"usage":null}"#;
        let c = Chunk::parse(data).unwrap();
        let choice = c.choices.as_ref().and_then(|c| c.0.as_ref()).unwrap();
        assert_eq!(choice.text(), Some("hi"));
        assert!(matches!(
            choice.delta.as_ref().unwrap().0.content,
            Some(Cow::Borrowed("hi"))
        ));
        assert_eq!(choice.finish_reason, Some(Value::from("stop")));
        assert_eq!(
            (c.id, c.created, c.usage),
            (Some("c".into()), Some(5.into()), None)
        );
        // A field of another type is not guessed at: the tree reads it.
        assert!(Chunk::parse(r#"{"choices":[{"delta":{"content":7}}]}"#).is_err());
    }

    /// Both readings of a chunk's `choices` (the assembler's and the relay's
    /// [`ChunkView`](crate::protocol::ChunkView)) go through [`read_choices`]: `null` and absent
    /// are no choices, another type than an array fails the reading, and each keeps what it
    /// needs of the elements after the first.
    #[test]
    fn choices_are_read_without_a_vector_by_both_views() {
        use crate::protocol::ChunkView;
        for data in [r#"{"choices":null}"#, "{}"] {
            assert_eq!(Chunk::parse(data).unwrap().choices, None, "{data}");
            let view = ChunkView::parse(data).unwrap();
            assert!(!view.has_output() && !view.is_plain_text(), "{data}");
        }
        for data in [
            r#"{"choices":7}"#,
            r#"{"choices":{"text":"a"}}"#,
            r#"{"choices":"a"}"#,
        ] {
            assert!(Chunk::parse(data).is_err(), "{data}");
            assert!(ChunkView::parse(data).is_none(), "{data}");
        }
        let two = r#"{"choices":[{"delta":{}},{"delta":{"content":"b"},"finish_reason":"stop"}]}"#;
        let first = Chunk::parse(two).unwrap().choices.unwrap().0.unwrap();
        assert_eq!(
            first.finish_reason, None,
            "the assembler keeps the first choice only"
        );
        let view = ChunkView::parse(two).unwrap();
        assert!(view.has_output(), "the view sees output in a later choice");
        assert!(!view.is_plain_text(), "two choices need the tree");
        assert_eq!(view.text(), None);
        // An element after the first that is not a choice: the view reads every element as a
        // choice and fails, the assembler skips it unread.
        let odd = r#"{"choices":[{"text":"a"},7]}"#;
        assert!(ChunkView::parse(odd).is_none());
        assert!(Chunk::parse(odd).unwrap().choices.unwrap().0.is_some());
        let none = Chunk::parse(r#"{"choices":[]}"#).unwrap();
        assert_eq!(none.choices, Some(FirstChoice(None)));
    }

    proptest::proptest! {
        /// Whatever a content block delta holds, reading it without a tree, where that
        /// succeeds, gives what reading its tree gives.
        #[test]
        fn a_block_delta_read_without_a_tree_agrees_with_the_tree(
            members in proptest::collection::vec((0usize..4, 0usize..9), 0..4),
        ) {
            const KEYS: [&str; 4] = ["index", "delta", "type", "other"];
            const VALUES: [&str; 9] = [
                "null", "2", "-1", r#""x""#, r#"{"type":"text_delta","text":"a\"b"}"#,
                r#"{"partial_json":"{\"k\":","text":null}"#, r#"{"text":5}"#, "[1]",
                r#"{"type":"thinking_delta","thinking":"hm"}"#,
            ];
            let mut seen = std::collections::HashSet::new();
            let data = format!(
                "{{{}}}",
                members
                    .iter()
                    .filter(|(k, _)| seen.insert(*k))
                    .map(|(k, v)| format!("\"{}\":{}", KEYS[*k], VALUES[*v]))
                    .collect::<Vec<_>>()
                    .join(",")
            );
            let tree: Value = serde_json::from_str(&data).unwrap();
            if let Ok(direct) = BlockDelta::parse(&data) {
                proptest::prop_assert_eq!(direct, BlockDelta::from_tree(&tree));
            }
        }

        /// Whatever a chunk holds, reading it without a tree, where that succeeds, gives what
        /// reading its tree gives.
        #[test]
        fn reading_without_a_tree_agrees_with_the_tree(data in chunk_data()) {
            let tree: Value = serde_json::from_str(&data).unwrap();
            if let Ok(direct) = Chunk::parse(&data) {
                proptest::prop_assert_eq!(direct, Chunk::from_tree(&tree));
            }
        }
    }
}
