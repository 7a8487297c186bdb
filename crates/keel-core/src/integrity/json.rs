//! Whether a structured answer is what the client asked for: `response_format` `json_object`
//! (any JSON object) or `json_schema` (JSON valid against the schema, see [`super::schema`]).

use serde_json::{Map, Value};

/// What a request's `response_format` asks of the answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Expected {
    /// `json_object`: a JSON object.
    Object,
    /// `json_schema`: a JSON value valid against the schema.
    Schema(Value),
}

/// What the request asks for, when it asks for JSON (`None` for text, or no `response_format`).
pub fn expected(body: &Map<String, Value>) -> Option<Expected> {
    let format = body.get("response_format")?;
    match format.get("type").and_then(Value::as_str)? {
        "json_object" => Some(Expected::Object),
        "json_schema" => Some(Expected::Schema(
            format
                .pointer("/json_schema/schema")
                .cloned()
                .unwrap_or(Value::Bool(true)),
        )),
        _ => None,
    }
}

/// The answer's text parsed, or why it is not the JSON that was asked for.
pub fn check(text: &str, expected: &Expected) -> Result<Value, String> {
    let v: Value = serde_json::from_str(text.trim())
        .map_err(|e| format!("the answer is not valid JSON: {e}"))?;
    match expected {
        Expected::Object if !v.is_object() => Err("the answer is JSON but not an object".into()),
        Expected::Object => Ok(v),
        Expected::Schema(schema) => {
            super::schema::validate(schema, &v)
                .map_err(|e| format!("the answer does not match the schema: {e}"))?;
            Ok(v)
        }
    }
}

/// The answer text of a whole OpenAI chat completion (`choices[0].message.content`, or
/// `choices[0].text` for a completion).
pub fn answer_text(body: &Value) -> Option<&str> {
    let choice = body.pointer("/choices/0")?;
    choice
        .pointer("/message/content")
        .or_else(|| choice.get("text"))
        .and_then(Value::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn reads_the_expectation() {
        assert_eq!(expected(&body(json!({}))), None);
        assert_eq!(
            expected(&body(json!({"response_format": {"type": "text"}}))),
            None
        );
        assert_eq!(
            expected(&body(json!({"response_format": {"type": "json_object"}}))),
            Some(Expected::Object)
        );
        let s = json!({"type": "object"});
        assert_eq!(
            expected(&body(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}})
            )),
            Some(Expected::Schema(json!({"type": "object"})))
        );
    }

    #[test]
    fn checks_answers() {
        assert!(check("{\"a\": 1}", &Expected::Object).is_ok());
        assert!(check("[1]", &Expected::Object)
            .unwrap_err()
            .contains("not an object"));
        assert!(check("{\"a\": ", &Expected::Object)
            .unwrap_err()
            .contains("not valid JSON"));
        let s = Expected::Schema(
            json!({"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}),
        );
        assert!(check("{\"a\": 2}", &s).is_ok());
        assert!(check("{\"a\": \"x\"}", &s).unwrap_err().contains("/a"));
        assert!(check("{}", &s).unwrap_err().contains("required"));
    }

    #[test]
    fn finds_the_answer_text() {
        let b = json!({"choices": [{"message": {"role": "assistant", "content": "{}"}}]});
        assert_eq!(answer_text(&b), Some("{}"));
        assert_eq!(answer_text(&json!({"choices": []})), None);
    }
}
