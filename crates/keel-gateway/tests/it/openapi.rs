//! The OpenAPI document keel serves at `/keel/openapi.json` is the one committed at
//! `docs/openapi.json`. To regenerate the committed copy after changing the document:
//! `KEEL_UPDATE_OPENAPI=1 cargo test -p keel-gateway openapi`.

use std::path::PathBuf;

use crate::harness::*;

fn committed_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json")
}

#[tokio::test]
async fn served_openapi_document_is_the_committed_one() {
    let h = Harness::openai(1, 1, "", "").await;
    let r = keel_sim::http_client()
        .get(h.url("/keel/openapi.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/json");
    let served = r.text().await.unwrap();
    let doc: serde_json::Value = serde_json::from_str(&served).expect("the document is JSON");
    assert_eq!(doc["openapi"], "3.1.0");
    let path = committed_path();
    if std::env::var_os("KEEL_UPDATE_OPENAPI").is_some() {
        std::fs::write(&path, &served).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == served,
        "{} differs from the document served at /keel/openapi.json; regenerate it with \
         `KEEL_UPDATE_OPENAPI=1 cargo test -p keel-gateway openapi` and commit it",
        path.display()
    );
}

#[tokio::test]
async fn openapi_document_is_get_only() {
    let h = Harness::openai(1, 1, "", "").await;
    let r = keel_sim::http_client()
        .post(h.url("/keel/openapi.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not allowed"));
}
