//! Tools, tool choice and the JSON response format, both ways.

use serde_json::{json, Map, Value};

use super::{unsupported, Fixes};
use crate::members::Members;
use crate::protocol::Protocol;
use crate::request::RequestError;

/// Name of the forced tool that stands for `response_format: json_object`.
pub const JSON_OBJECT_TOOL: &str = "json_response";

/// Chat `tools` → Messages `tools`.
pub(super) fn tools_to_anthropic(tools: &Value, fixes: &mut Fixes) -> Result<Value, RequestError> {
    let tools = tools.as_array().map(Vec::as_slice).unwrap_or_default();
    let mut out = Vec::with_capacity(tools.len());
    for (j, t) in tools.iter().enumerate() {
        let path = format!("tools[{j}]");
        let kind = t.member("type").and_then(Value::as_str).unwrap_or("");
        if kind != "function" {
            return Err(unsupported(
                &format!("{path}.type"),
                &format!("`{kind}` tools"),
                Protocol::Anthropic,
            ));
        }
        let f = t.member("function").unwrap_or(&Value::Null);
        let name = f.member("name").and_then(Value::as_str).ok_or_else(|| {
            RequestError::invalid(format!("missing required field `{path}.function.name`"))
        })?;
        let mut tool = Map::new();
        tool.insert("name".into(), name.into());
        if let Some(d) = f.member("description").filter(|d| !d.is_null()) {
            tool.insert("description".into(), d.clone());
        }
        let schema = f
            .member("parameters")
            .filter(|p| !p.is_null())
            .cloned()
            .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
        tool.insert("input_schema".into(), schema);
        if f.member("strict").and_then(Value::as_bool) == Some(true) {
            fixes.dropped("strict");
        }
        out.push(Value::Object(tool));
    }
    Ok(Value::Array(out))
}

pub(super) fn tool_choice_to_anthropic(tc: &Value) -> Result<Value, RequestError> {
    match tc {
        Value::String(s) => match s.as_str() {
            "auto" => Ok(json!({"type": "auto"})),
            "none" => Ok(json!({"type": "none"})),
            "required" => Ok(json!({"type": "any"})),
            other => Err(RequestError::invalid(format!(
                "`tool_choice`: unknown value `{other}`"
            ))),
        },
        Value::Object(o) => match o.member("type").and_then(Value::as_str) {
            Some("function") => {
                let name = tc
                    .pointer("/function/name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        RequestError::invalid("missing required field `tool_choice.function.name`")
                    })?;
                Ok(json!({"type": "tool", "name": name}))
            }
            other => Err(unsupported(
                "tool_choice.type",
                &format!("`{}` tool choice", other.unwrap_or("")),
                Protocol::Anthropic,
            )),
        },
        _ => Err(RequestError::invalid(
            "`tool_choice` must be a string or an object",
        )),
    }
}

/// The forced tool for a JSON `response_format`, and its name; `None` for plain text.
pub(super) fn json_tool(rf: &Value) -> Result<Option<(Value, String)>, RequestError> {
    match rf.member("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some((
            json!({"name": JSON_OBJECT_TOOL, "description": "Respond with a JSON object.",
                "input_schema": {"type": "object"}}),
            JSON_OBJECT_TOOL.to_owned(),
        ))),
        Some("json_schema") => {
            let js = rf.member("json_schema").unwrap_or(&Value::Null);
            let name = js
                .member("name")
                .and_then(Value::as_str)
                .unwrap_or(JSON_OBJECT_TOOL)
                .to_owned();
            let schema = js
                .member("schema")
                .cloned()
                .unwrap_or(json!({"type": "object"}));
            if schema.member("type").and_then(Value::as_str) != Some("object") {
                return Err(unsupported(
                    "response_format.json_schema.schema",
                    "a schema whose root is not an object",
                    Protocol::Anthropic,
                ));
            }
            let description = js
                .member("description")
                .and_then(Value::as_str)
                .unwrap_or("Respond with JSON that matches this schema.");
            Ok(Some((
                json!({"name": name, "description": description, "input_schema": schema}),
                name,
            )))
        }
        other => Err(unsupported(
            "response_format.type",
            &format!("`{}` response format", other.unwrap_or("")),
            Protocol::Anthropic,
        )),
    }
}

/// Messages `tools` → Chat `tools`.
pub(super) fn tools_to_openai(tools: &Value, fixes: &mut Fixes) -> Result<Value, RequestError> {
    let tools = tools.as_array().map(Vec::as_slice).unwrap_or_default();
    let mut out = Vec::with_capacity(tools.len());
    for (j, t) in tools.iter().enumerate() {
        let path = format!("tools[{j}]");
        match t.member("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(other) => {
                return Err(unsupported(
                    &path,
                    &format!("the `{other}` tool"),
                    Protocol::OpenAi,
                ))
            }
        }
        if t.member("cache_control").is_some() {
            fixes.add("cache_control_dropped");
        }
        let name = t.member("name").and_then(Value::as_str).ok_or_else(|| {
            RequestError::invalid(format!("missing required field `{path}.name`"))
        })?;
        let mut f = Map::new();
        f.insert("name".into(), name.into());
        if let Some(d) = t.member("description").filter(|d| !d.is_null()) {
            f.insert("description".into(), d.clone());
        }
        if let Some(s) = t.member("input_schema") {
            f.insert("parameters".into(), s.clone());
        }
        out.push(json!({"type": "function", "function": f}));
    }
    Ok(Value::Array(out))
}

/// The Chat `tool_choice`, and whether parallel tool calls are switched off.
pub(super) fn tool_choice_to_openai(tc: &Value) -> Result<(Value, bool), RequestError> {
    let parallel_off = tc
        .member("disable_parallel_tool_use")
        .and_then(Value::as_bool)
        == Some(true);
    let choice = match tc.member("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("none") => json!("none"),
        Some("any") => json!("required"),
        Some("tool") => {
            let name = tc.member("name").and_then(Value::as_str).ok_or_else(|| {
                RequestError::invalid("missing required field `tool_choice.name`")
            })?;
            json!({"type": "function", "function": {"name": name}})
        }
        other => {
            return Err(RequestError::invalid(format!(
                "`tool_choice.type`: unknown value `{}`",
                other.unwrap_or("")
            )))
        }
    };
    Ok((choice, parallel_off))
}
