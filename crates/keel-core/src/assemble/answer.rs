//! A whole answer in its protocol's non-streaming shape: OpenAI `chat.completion` and
//! `text_completion`, Anthropic `message`. Serialized straight into the client's body, or into
//! a JSON tree where one is needed (the response cache, translation): one definition of the
//! shape, two serde serializers. Building a tree and then serializing it cost about as much as
//! reading all of an answer's events.

use serde::Serialize;
use serde_json::{Map, Value};

/// A whole answer.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Answer {
    Chat(OpenAiAnswer<ChatChoice>),
    Completion(OpenAiAnswer<CompletionChoice>),
    Message(Message),
}

impl Answer {
    /// The answer as the client's JSON body.
    pub fn to_bytes(&self) -> Vec<u8> {
        // Cannot fail: every map key is a string.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The answer as a JSON tree.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or_default()
    }
}

/// OpenAI `chat.completion` (one [`ChatChoice`]) or `text_completion` (one
/// [`CompletionChoice`]).
#[derive(Debug, Serialize)]
pub struct OpenAiAnswer<C> {
    pub(super) id: Value,
    pub(super) object: &'static str,
    pub(super) created: Value,
    pub(super) model: Value,
    pub(super) choices: [C; 1],
    pub(super) usage: Value,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub(super) index: u32,
    pub(super) message: ChatMessage,
    pub(super) logprobs: (),
    pub(super) finish_reason: Value,
}

#[derive(Debug, Serialize)]
pub(super) struct ChatMessage {
    pub(super) role: &'static str,
    /// `null` when the answer is only tool calls.
    pub(super) content: Option<String>,
    pub(super) refusal: (),
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(super) tool_calls: Vec<ToolCall>,
}

#[derive(Debug, Serialize)]
pub(super) struct ToolCall {
    pub(super) id: Value,
    #[serde(rename = "type")]
    pub(super) kind: &'static str,
    pub(super) function: Function,
}

#[derive(Debug, Serialize)]
pub(super) struct Function {
    pub(super) name: String,
    pub(super) arguments: String,
}

#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub(super) index: u32,
    pub(super) text: String,
    pub(super) logprobs: (),
    pub(super) finish_reason: Value,
}

/// Anthropic `message`.
#[derive(Debug, Serialize)]
pub struct Message {
    pub(super) id: Value,
    #[serde(rename = "type")]
    pub(super) kind: &'static str,
    pub(super) role: &'static str,
    pub(super) model: Value,
    pub(super) content: Vec<Value>,
    pub(super) stop_reason: Value,
    pub(super) stop_sequence: Value,
    pub(super) usage: Map<String, Value>,
}
