use std::collections::HashSet;

use http::Method;
use serde_json::Value;

use super::*;
use crate::wire::routes::{resolve, Resolved};

/// The path a client would send for a documented path template.
fn concrete(path: &str) -> String {
    path.replace("{model_id}", "some-model")
        .replace("{key_id}", "some-key")
}

#[test]
fn every_documented_route_is_served_and_every_served_route_documented() {
    let doc = document();
    let mut in_doc = HashSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            in_doc.insert((method.to_ascii_uppercase(), path.clone()));
        }
    }
    let listed: HashSet<_> = documented_routes()
        .into_iter()
        .map(|(m, p)| (m.to_owned(), p.to_owned()))
        .collect();
    assert_eq!(in_doc, listed);
    for r in ROUTES {
        assert!(
            in_doc.contains(&(r.verb.as_str().to_owned(), r.path.to_owned())),
            "{} {} is served but not documented",
            r.verb.as_str(),
            r.path
        );
    }
    for (method, path) in &in_doc {
        let m = Method::from_bytes(method.as_bytes()).unwrap();
        let path_sent = concrete(path);
        let resolved = resolve(&m, &path_sent);
        assert!(
            matches!(resolved, Resolved::Route(..)),
            "{method} {path} is documented but not served ({resolved:?})"
        );
    }
}

/// Every `$ref` string in `v`.
fn refs<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("$ref", Value::String(r)) => out.push(r),
                    _ => refs(x, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
        _ => {}
    }
}

#[test]
fn every_reference_resolves_and_operation_ids_are_unique() {
    let doc = document();
    let mut found = Vec::new();
    refs(&doc, &mut found);
    assert!(!found.is_empty());
    for r in found {
        let pointer = r.strip_prefix('#').expect("local reference");
        assert!(doc.pointer(pointer).is_some(), "dangling reference {r}");
    }
    let mut ids = HashSet::new();
    for item in doc["paths"].as_object().unwrap().values() {
        for op in item.as_object().unwrap().values() {
            let id = op["operationId"].as_str().expect("operationId");
            assert!(ids.insert(id.to_owned()), "duplicate operationId {id}");
        }
    }
}

#[test]
fn error_statuses_match_what_keel_answers() {
    use keel_core::protocol::{error_body, ErrorKind, Protocol};
    let doc = document();
    let chat = &doc["paths"]["/v1/chat/completions"]["post"]["responses"];
    let messages = &doc["paths"]["/v1/messages"]["post"]["responses"];
    // Every kind keel answers (other than the 401/403 a model server may send, which fall
    // under 4XX) has its own documented status with the protocol's error shape.
    for kind in [
        ErrorKind::InvalidRequest,
        ErrorKind::NotFound,
        ErrorKind::TooLarge,
        ErrorKind::UnsupportedMediaType,
        ErrorKind::RequestTimeout,
        ErrorKind::Timeout,
        ErrorKind::Overloaded,
        ErrorKind::RateLimited,
        ErrorKind::BadGateway,
        ErrorKind::Internal,
    ] {
        let status = kind.status().to_string();
        for (responses, protocol, schema) in [
            (chat, Protocol::OpenAi, "OpenAIError"),
            (messages, Protocol::Anthropic, "AnthropicError"),
        ] {
            let reference = responses[&status]["$ref"].as_str().unwrap();
            let r = doc.pointer(reference.trim_start_matches('#')).unwrap();
            assert_eq!(
                r["content"]["application/json"]["schema"]["$ref"],
                format!("#/components/schemas/{schema}"),
                "{status}"
            );
            let body = error_body(protocol, kind, "m");
            let required = doc["components"]["schemas"][schema]["required"]
                .as_array()
                .unwrap();
            for f in required {
                assert!(body.get(f.as_str().unwrap()).is_some(), "{schema}: {f}");
            }
        }
    }
    let busy = chat["503"]["$ref"]
        .as_str()
        .unwrap()
        .trim_start_matches('#');
    assert!(doc.pointer(busy).unwrap()["headers"]["retry-after"].is_object());
}
