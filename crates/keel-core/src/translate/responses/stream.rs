//! A Chat Completions stream, chunk by chunk, as a Responses stream.
//!
//! Output items do not interleave: reasoning, text and each tool call become one item in the
//! order they appear, and an item is finished (its `.done` events) before the next is added.
//! Only a tool call's argument fragments that arrive before its name are held (OpenAI sends the
//! name first; other servers may not). `response.completed` goes out at `[DONE]`, because the
//! usage chunk comes after the finish reason.

use serde_json::{json, Map, Value};

use super::{
    function_call_item, message_item, reasoning_item, response_object, text_part, Ending,
    ResponseIds, ResponsesContext,
};
use crate::assemble::MAX_TOOL_CALLS;
use crate::members::Members;
use crate::sse::SseEvent;
use crate::translate::passes_untranslated;

/// One content part of a message item: `output_text` or `refusal`.
#[derive(Debug, Clone, PartialEq)]
struct Part {
    refusal: bool,
    text: String,
}

impl Part {
    fn json(&self) -> Value {
        if self.refusal {
            json!({"type": "refusal", "refusal": self.text})
        } else {
            text_part(&self.text)
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Item {
    Reasoning(String),
    Message(Vec<Part>),
    Call {
        call_id: String,
        name: String,
        arguments: String,
    },
}

/// A tool call by its Chat index: where its item is, once it has one.
#[derive(Debug, Clone, Default)]
struct Call {
    output_index: Option<usize>,
    id: Option<String>,
    name: Option<String>,
    /// Argument fragments that arrived before the name.
    pending: String,
}

/// Translates one Chat Completions stream for a Responses client.
#[derive(Debug, Clone)]
pub struct ChatToResponsesStream {
    ctx: ResponsesContext,
    ids: ResponseIds,
    seq: u64,
    started: bool,
    items: Vec<Item>,
    /// The index of the item still taking deltas.
    open: Option<usize>,
    calls: Vec<Call>,
    finish: Option<String>,
    usage: Option<Value>,
    done: bool,
}

impl ChatToResponsesStream {
    pub fn new(ctx: ResponsesContext, ids: ResponseIds) -> Self {
        ChatToResponsesStream {
            ctx,
            ids,
            seq: 0,
            started: false,
            items: Vec::new(),
            open: None,
            calls: Vec::new(),
            finish: None,
            usage: None,
            done: false,
        }
    }

    /// Whether the stream has ended (`response.completed`/`incomplete` or `error` written).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Translates one Chat event, appending the client's events to `out`. `Err`: a malformed
    /// event (not JSON, an out-of-range tool call index).
    pub fn push(&mut self, ev: &SseEvent, out: &mut Vec<SseEvent>) -> Result<(), String> {
        if passes_untranslated(self.done, ev, out) {
            return Ok(());
        }
        if ev.data.trim() == "[DONE]" {
            self.complete(out);
            return Ok(());
        }
        let chunk: Value = serde_json::from_str(&ev.data)
            .map_err(|e| format!("a chat stream event is not JSON: {e}"))?;
        if let Some(error) = chunk.member("error") {
            self.fail(error, out);
            return Ok(());
        }
        if self.ids.model.is_empty() {
            if let Some(m) = chunk.member("model").and_then(Value::as_str) {
                self.ids.model = m.to_owned();
            }
        }
        self.start(out);
        if let Some(u) = chunk.member("usage").filter(|u| u.is_object()) {
            self.usage = Some(u.clone());
        }
        let Some(choice) = chunk.pointer("/choices/0") else {
            return Ok(());
        };
        if let Some(delta) = choice.member("delta") {
            let text = |k: &str| {
                delta
                    .get(k)
                    .and_then(Value::as_str)
                    .filter(|t| !t.is_empty())
            };
            if let Some(t) = text("reasoning_content") {
                self.reasoning_delta(t, out);
            }
            if let Some(t) = text("content") {
                self.text_delta(t, false, out);
            }
            if let Some(t) = text("refusal") {
                self.text_delta(t, true, out);
            }
            if let Some(calls) = delta.member("tool_calls").and_then(Value::as_array) {
                for c in calls {
                    self.call_delta(c, out)?;
                }
            }
        }
        if let Some(f) = choice.member("finish_reason").and_then(Value::as_str) {
            self.finish = Some(f.to_owned());
            self.close(out);
        }
        Ok(())
    }

    /// The upstream ended without `[DONE]` but the relay decided the stream is complete (a
    /// terminal finish reason was seen): finish the response.
    pub fn end(&mut self, out: &mut Vec<SseEvent>) {
        if !self.done {
            self.complete(out);
        }
    }

    fn emit(&mut self, out: &mut Vec<SseEvent>, kind: &str, mut fields: Map<String, Value>) {
        fields.insert("type".into(), kind.into());
        fields.insert("sequence_number".into(), self.seq.into());
        self.seq += 1;
        out.push(SseEvent::new(
            Some(kind),
            &Value::Object(fields).to_string(),
        ));
    }

    fn emit_response(&mut self, out: &mut Vec<SseEvent>, kind: &str, ending: Option<Ending>) {
        let output = if ending.is_some() {
            (0..self.items.len())
                .map(|i| self.item_json(i, "completed"))
                .collect()
        } else {
            Vec::new()
        };
        let r = response_object(&self.ctx, &self.ids, ending, output, self.usage.as_ref());
        self.emit(out, kind, obj(json!({ "response": r })));
    }

    fn start(&mut self, out: &mut Vec<SseEvent>) {
        if !self.started {
            self.started = true;
            self.emit_response(out, "response.created", None);
            self.emit_response(out, "response.in_progress", None);
        }
    }

    fn item_id(&self, i: usize) -> String {
        let prefix = match self.items[i] {
            Item::Reasoning(_) => "rs",
            Item::Message(_) => "msg",
            Item::Call { .. } => "fc",
        };
        self.ids.item(prefix, i)
    }

    fn item_json(&self, i: usize, status: &str) -> Value {
        let id = self.item_id(i);
        match &self.items[i] {
            Item::Reasoning(t) => reasoning_item(id, status, t),
            Item::Message(parts) => {
                message_item(id, status, parts.iter().map(Part::json).collect())
            }
            Item::Call {
                call_id,
                name,
                arguments,
            } => function_call_item(id, status, call_id, name, arguments),
        }
    }

    /// Adds an item (finishing the open one) and announces it.
    fn add(&mut self, item: Item, out: &mut Vec<SseEvent>) -> usize {
        self.close(out);
        self.items.push(item);
        let i = self.items.len() - 1;
        self.open = Some(i);
        let item = self.item_json(i, "in_progress");
        self.emit(
            out,
            "response.output_item.added",
            obj(json!({"output_index": i, "item": item})),
        );
        i
    }

    /// Fields that locate a delta: item id, output index (and content index).
    fn at(&self, i: usize, content_index: Option<usize>) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("item_id".into(), self.item_id(i).into());
        m.insert("output_index".into(), i.into());
        if let Some(c) = content_index {
            m.insert("content_index".into(), c.into());
        }
        m
    }

    fn reasoning_delta(&mut self, t: &str, out: &mut Vec<SseEvent>) {
        let i = match self.open {
            Some(i) if matches!(self.items[i], Item::Reasoning(_)) => i,
            _ => self.add(Item::Reasoning(String::new()), out),
        };
        if let Item::Reasoning(text) = &mut self.items[i] {
            text.push_str(t);
        }
        let mut f = self.at(i, Some(0));
        f.insert("delta".into(), t.into());
        self.emit(out, "response.reasoning_text.delta", f);
    }

    fn text_delta(&mut self, t: &str, refusal: bool, out: &mut Vec<SseEvent>) {
        let i = match self.open {
            Some(i) if matches!(self.items[i], Item::Message(_)) => i,
            _ => self.add(Item::Message(Vec::new()), out),
        };
        let same_part = matches!(&self.items[i], Item::Message(p) if p.last().is_some_and(|p| p.refusal == refusal));
        if !same_part {
            self.close_part(i, out);
            let content_index = match &mut self.items[i] {
                Item::Message(parts) => {
                    parts.push(Part {
                        refusal,
                        text: String::new(),
                    });
                    parts.len() - 1
                }
                _ => 0,
            };
            let part = Part {
                refusal,
                text: String::new(),
            }
            .json();
            let mut f = self.at(i, Some(content_index));
            f.insert("part".into(), part);
            self.emit(out, "response.content_part.added", f);
        }
        let content_index = match &mut self.items[i] {
            Item::Message(parts) => {
                let last = parts.len() - 1;
                parts[last].text.push_str(t);
                last
            }
            _ => 0,
        };
        let mut f = self.at(i, Some(content_index));
        f.insert("delta".into(), t.into());
        if refusal {
            self.emit(out, "response.refusal.delta", f);
        } else {
            f.insert("logprobs".into(), json!([]));
            self.emit(out, "response.output_text.delta", f);
        }
    }

    fn call_delta(&mut self, c: &Value, out: &mut Vec<SseEvent>) -> Result<(), String> {
        let index = c.member("index").and_then(Value::as_u64).unwrap_or(0) as usize;
        if index >= MAX_TOOL_CALLS {
            return Err(format!("tool call index {index} is out of range"));
        }
        if self.calls.len() <= index {
            self.calls.resize(index + 1, Call::default());
        }
        let call = &mut self.calls[index];
        if let Some(id) = c.member("id").and_then(Value::as_str) {
            call.id.get_or_insert_with(|| id.to_owned());
        }
        if let Some(n) = c.pointer("/function/name").and_then(Value::as_str) {
            call.name.get_or_insert_with(|| n.to_owned());
        }
        let args = c
            .pointer("/function/arguments")
            .and_then(Value::as_str)
            .unwrap_or("");
        let i = match (call.output_index, call.name.clone()) {
            (Some(i), _) => i,
            (None, Some(name)) => {
                let item = Item::Call {
                    call_id: call.id.clone().unwrap_or_else(|| format!("call_{index}")),
                    name,
                    arguments: String::new(),
                };
                let pending = std::mem::take(&mut call.pending);
                let i = self.add(item, out);
                self.calls[index].output_index = Some(i);
                self.args_delta(i, &pending, out);
                i
            }
            (None, None) => {
                call.pending.push_str(args);
                return Ok(());
            }
        };
        self.args_delta(i, args, out);
        Ok(())
    }

    fn args_delta(&mut self, i: usize, delta: &str, out: &mut Vec<SseEvent>) {
        if delta.is_empty() {
            return;
        }
        if let Item::Call { arguments, .. } = &mut self.items[i] {
            arguments.push_str(delta);
        }
        let mut f = self.at(i, None);
        f.insert("delta".into(), delta.into());
        self.emit(out, "response.function_call_arguments.delta", f);
    }

    /// Finishes the open part of message item `i`.
    fn close_part(&mut self, i: usize, out: &mut Vec<SseEvent>) {
        let Item::Message(parts) = &self.items[i] else {
            return;
        };
        let Some(last) = parts.last().cloned() else {
            return;
        };
        let content_index = parts.len() - 1;
        let mut f = self.at(i, Some(content_index));
        if last.refusal {
            f.insert("refusal".into(), last.text.clone().into());
            self.emit(out, "response.refusal.done", f);
        } else {
            f.insert("text".into(), last.text.clone().into());
            f.insert("logprobs".into(), json!([]));
            self.emit(out, "response.output_text.done", f);
        }
        let mut f = self.at(i, Some(content_index));
        f.insert("part".into(), last.json());
        self.emit(out, "response.content_part.done", f);
    }

    /// Finishes the open item.
    fn close(&mut self, out: &mut Vec<SseEvent>) {
        let Some(i) = self.open.take() else {
            return;
        };
        match self.items[i].clone() {
            Item::Reasoning(text) => {
                let mut f = self.at(i, Some(0));
                f.insert("text".into(), text.into());
                self.emit(out, "response.reasoning_text.done", f);
            }
            Item::Message(_) => self.close_part(i, out),
            Item::Call {
                name, arguments, ..
            } => {
                let mut f = self.at(i, None);
                f.insert("name".into(), name.into());
                f.insert("arguments".into(), arguments.into());
                self.emit(out, "response.function_call_arguments.done", f);
            }
        }
        let item = self.item_json(i, "completed");
        self.emit(
            out,
            "response.output_item.done",
            obj(json!({"output_index": i, "item": item})),
        );
    }

    fn complete(&mut self, out: &mut Vec<SseEvent>) {
        self.start(out);
        self.close(out);
        let ending = Ending::of_finish(self.finish.as_deref());
        let kind = match ending {
            Ending::Completed => "response.completed",
            Ending::Incomplete(_) => "response.incomplete",
        };
        self.emit_response(out, kind, Some(ending));
        self.done = true;
    }

    /// An error event: the documented fields (`code`, `message`, `param`) and the error object
    /// itself under `error`, which is what makes the official SDKs raise instead of returning
    /// a truncated answer.
    fn fail(&mut self, error: &Value, out: &mut Vec<SseEvent>) {
        let s = |k: &str| error.get(k).cloned().unwrap_or(Value::Null);
        let code = match s("code") {
            Value::Null => s("type"),
            c => c,
        };
        let f = obj(
            json!({"code": code, "message": s("message"), "param": s("param"), "error": error}),
        );
        self.emit(out, "error", f);
        self.done = true;
    }
}

fn obj(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}
