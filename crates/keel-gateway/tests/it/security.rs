//! keel read as an attacker would: the operations plane behind its keys (and on its own
//! address), client headers that cannot reach an upstream unless the operator lets them, upstream
//! refusals that one client could cause not taken as evidence against a variant, admin changes a
//! web page cannot make, and upstream error text that never reaches a client.

use std::sync::Arc;

use keel_gateway::state::keys::{hash_secret, hash_text};
use keel_gateway::wire::routes::{Access, Plane, ROUTES};
use keel_gateway::{Config, Gateway};
use keel_sim::{Fleet, ServerConfig};
use serde_json::{json, Value};
use tokio::sync::oneshot;

use crate::harness::*;

const TENANT: &str = "sk-keel-security-tenant-0123456789";
const OPS: &str = "sk-keel-security-ops-reader-012345";
const ADMIN: &str = "sk-keel-security-admin-0123456789";

fn hash(k: &str) -> String {
    hash_text(&hash_secret(k))
}

fn keys() -> String {
    format!(
        "[admin]\nkey_hash = \"{}\"\n\n[[keys]]\nid = \"tenant\"\nhash = \"{}\"\n\n[[keys]]\nid = \"ops\"\nhash = \"{}\"\nroles = [\"ops\"]\n",
        hash(ADMIN),
        hash(TENANT),
        hash(OPS),
    )
}

/// Every route's path with its parameters filled in.
fn concrete(path: &str) -> String {
    path.replace("{model_id}", "p")
        .replace("{key_id}", "tenant")
        .replace("{request_id}", "some-id")
        .replace("{pool}", "p")
}

async fn call(h_url: &str, verb: &str, path: &str, key: Option<&str>) -> u16 {
    let client = keel_sim::http_client();
    let url = format!("{h_url}{}", concrete(path));
    let mut req = match verb {
        "GET" => client.get(url),
        _ => client
            .post(url)
            .json(&json!({"pool": null, "mode": "auto"})),
    };
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    // Streams (the events feed) are not read to their end.
    drop(resp);
    status
}

#[tokio::test]
async fn with_keys_the_operations_plane_answers_only_the_admin_and_ops_keys() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let cfg = format!("{}\n{}", keys(), pool_over(&fleet, "p", "openai", 1, ""));
    let h = Harness::start(fleet, &cfg).await;
    let base = h.url("");
    let mut checked = 0;
    for r in ROUTES {
        let verb = r.verb.as_str();
        match r.target.access() {
            Access::Ops => {
                assert_eq!(
                    call(&base, verb, r.path, None).await,
                    401,
                    "{verb} {}",
                    r.path
                );
                assert_eq!(
                    call(&base, verb, r.path, Some("sk-keel-unknown")).await,
                    401,
                    "{}",
                    r.path
                );
                assert_eq!(
                    call(&base, verb, r.path, Some(TENANT)).await,
                    403,
                    "{verb} {}",
                    r.path
                );
                for key in [OPS, ADMIN] {
                    let s = call(&base, verb, r.path, Some(key)).await;
                    assert!(
                        !matches!(s, 401 | 403),
                        "{verb} {} with a reader's key: {s}",
                        r.path
                    );
                }
                checked += 1;
            }
            Access::Admin => {
                assert_eq!(
                    call(&base, verb, r.path, None).await,
                    401,
                    "{verb} {}",
                    r.path
                );
                for key in [TENANT, OPS] {
                    assert_eq!(
                        call(&base, verb, r.path, Some(key)).await,
                        403,
                        "{verb} {}",
                        r.path
                    );
                }
                let s = call(&base, verb, r.path, Some(ADMIN)).await;
                assert!(
                    !matches!(s, 401 | 403),
                    "{verb} {} with the admin key: {s}",
                    r.path
                );
                checked += 1;
            }
            Access::Anyone => {
                assert_eq!(
                    call(&base, verb, r.path, None).await,
                    200,
                    "{verb} {}",
                    r.path
                );
            }
            Access::Tenant => {}
        }
    }
    assert!(checked >= 12, "only {checked} operations routes checked");
    // An operations key reads; it calls no model.
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("authorization", &format!("Bearer {OPS}"))],
            &chat_body("hi"),
        )
        .await;
    assert_eq!(r.status(), 403);
    // What the ops reader sees includes every tenant's traffic: the metrics name the keys.
    let r = keel_sim::http_client()
        .get(h.url("/metrics"))
        .header("authorization", format!("Bearer {OPS}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn decision_records_hold_no_prompt_text_by_default() {
    // Turned on, the record shows the text around each normalization edit (the control that
    // this prompt's edit does show it); by default it shows none.
    for (top, shown) in [("decision_prompt_edits = true", true), ("", false)] {
        let h = Harness::openai(1, 1, top, "normalize = \"syntax\"").await;
        let body = json!({"model": "p", "messages": [{"role": "user", "content": "secret-project-name   \n\n\n\nplease   "}]});
        let (status, headers, _) = h.chat(&body).await;
        assert_eq!(status, 200);
        let id = header(&headers, "x-keel-request-id").to_owned();
        let record = h.get_json(&format!("/keel/decisions/{id}")).await;
        assert_eq!(
            record.to_string().contains("project-name"),
            shown,
            "`{top}`: {record}"
        );
    }
}

/// A gateway whose operations plane listens on an address of its own.
async fn two_listeners(cfg: &str) -> (String, String, oneshot::Sender<()>) {
    let cfg = Config::parse(cfg, "test.toml", &Default::default()).unwrap();
    let gw: Arc<Gateway> = Gateway::new(cfg);
    let main = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let urls = (
        format!("http://{}", main.local_addr().unwrap()),
        format!("http://{}", admin.local_addr().unwrap()),
    );
    let (stop, stopped) = oneshot::channel::<()>();
    let live = keel_gateway::admin::live::Live::new(gw, None);
    tokio::spawn(keel_gateway::http::server::serve_live(
        live,
        keel_gateway::http::server::Listeners {
            main,
            admin: Some(admin),
        },
        async move {
            let _ = stopped.await;
        },
    ));
    (urls.0, urls.1, stop)
}

#[tokio::test]
async fn with_admin_listen_each_plane_is_served_on_its_own_address_only() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let cfg = format!(
        "admin_listen = \"127.0.0.1:0\"\n{}",
        pool_over(&fleet, "p", "openai", 1, "")
    );
    let (main, admin, _stop) = two_listeners(&cfg).await;
    let client = keel_sim::http_client();
    for r in ROUTES {
        let verb = r.verb.as_str();
        let (on_main, on_admin) = match r.target.plane() {
            Plane::Data => (true, false),
            Plane::Ops => (false, true),
            Plane::Both => (true, true),
        };
        for (base, served) in [(&main, on_main), (&admin, on_admin)] {
            let s = call(base, verb, r.path, None).await;
            if !served {
                assert_eq!(s, 404, "{verb} {} must not exist on {base}", r.path);
            } else if !r.path.contains('{') {
                // (A route with a parameter may answer 404 for the one filled in.)
                assert_ne!(s, 404, "{verb} {} must be served on {base}", r.path);
            }
        }
    }
    let chat = client
        .post(format!("{main}/v1/chat/completions"))
        .json(&chat_body("hi"))
        .send()
        .await
        .unwrap();
    assert_eq!(chat.status(), 200);
    let health = client
        .get(format!("{admin}/keel/health"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
}

#[tokio::test]
async fn without_keys_admin_changes_need_json_from_no_foreign_origin() {
    let h = Harness::openai(1, 1, "", "").await;
    let client = keel_sim::http_client();
    let url = h.url("/keel/admin/safe-mode");
    let body = r#"{"pool": null, "mode": "auto"}"#;
    // What a cross-site form can send: a simple content type.
    let form = client
        .post(&url)
        .header("content-type", "text/plain")
        .header("origin", "http://evil.example")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(form.status(), 415);
    // JSON with a foreign origin (only possible after a CORS preflight keel never grants).
    let foreign = client
        .post(&url)
        .header("content-type", "application/json")
        .header("origin", "http://evil.example")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(foreign.status(), 403);
    // A body-less POST, as a page's `fetch(url, {method: "POST", mode: "no-cors"})` sends it.
    let bare = client
        .post(h.url("/keel/admin/reload"))
        .send()
        .await
        .unwrap();
    assert_eq!(bare.status(), 415);
    // keel's own origin, and tools that send no origin, may.
    let own = client
        .post(&url)
        .header("content-type", "application/json")
        .header("origin", format!("http://{}", h.addr))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(own.status(), 200);
    let tool = client
        .post(&url)
        .json(&json!({"pool": null, "mode": "auto"}))
        .send()
        .await
        .unwrap();
    assert_eq!(tool.status(), 200);
}

#[tokio::test]
async fn only_listed_client_headers_reach_the_upstream() {
    let sent = [
        ("openai-organization", "org-someone-else"),
        ("openai-project", "proj-someone-else"),
        ("anthropic-beta", "some-beta"),
        ("x-custom", "1"),
        (
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ),
        ("x-request-id", "req-1"),
    ];
    for (pool_extra, expect) in [
        ("", vec!["traceparent", "x-request-id"]),
        (
            "forward_headers = [\"OpenAI-Organization\"]",
            vec!["openai-organization"],
        ),
    ] {
        let h = Harness::openai(1, 1, "", pool_extra).await;
        let r = h
            .post_with("/v1/chat/completions", &sent, &chat_body("hi"))
            .await;
        assert_eq!(r.status(), 200);
        let seen = h.server(0).state.last_headers();
        for (name, _) in sent {
            let arrived = seen.iter().any(|(k, _)| k.eq_ignore_ascii_case(name));
            assert_eq!(
                arrived,
                expect.contains(&name),
                "{name} with `{pool_extra}`: {seen:?}"
            );
        }
    }
    // Credentials can never be listed.
    let err = Config::parse(
        "[[pools]]\nname = \"p\"\nforward_headers = [\"authorization\"]\n[[pools.variants]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n",
        "t.toml",
        &Default::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("never forwarded"), "{err}");
}

fn health_of(health: &Value, variant: &str) -> Value {
    health["pools"][0]["variants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == variant)
        .cloned()
        .unwrap()
}

#[tokio::test]
async fn a_clients_401_fails_over_without_marking_the_credential_and_keel_confirms_it() {
    let h = Harness::openai(2, 1, "allow_force_variant = true", "").await;
    // One 401 (a bogus organisation the operator forwards, say): the next request only.
    add_fault(
        h.server(0),
        json!({"kind": "error", "status": 401, "count": 1}),
    )
    .await;
    let r = forced_sim0(&h, &chat_body("hi")).await;
    assert_eq!(r.status(), 200, "the request fails over");
    assert_eq!(header(r.headers(), "x-keel-route"), "fallback");
    wait_for!(
        "keel's own request to check the credential",
        h.metric("keel_maintenance_requests_total", &[("kind", "confirm")])
            .await
            >= 1.0
    );
    let v = health_of(&h.get_json("/keel/health").await, "sim-0");
    assert_eq!(v["credential_broken"], false, "{v}");
    assert_eq!(v["available"], true, "{v}");
    assert_eq!(
        h.metric("keel_variant_credential_broken_total", &[]).await,
        0.0
    );
    // The variant serves the next client at once.
    let r = forced_sim0(&h, &chat_body("again")).await;
    assert_eq!(header(r.headers(), "x-keel-route"), "direct");

    // A credential that is really refused: keel's own request confirms it, and marks it.
    add_fault(h.server(0), json!({"kind": "error", "status": 401})).await;
    let r = forced_sim0(&h, &chat_body("hi")).await;
    assert_eq!(r.status(), 200);
    wait_for!(
        "the credential marked broken on keel's own evidence",
        h.metric("keel_variant_credential_broken_total", &[]).await >= 1.0
    );
    let v = health_of(&h.get_json("/keel/health").await, "sim-0");
    assert_eq!(v["credential_broken"], true, "{v}");
}

#[tokio::test]
async fn a_clients_long_retry_after_holds_a_variant_out_only_briefly_unless_confirmed() {
    let h = Harness::openai(2, 1, "allow_force_variant = true", "").await;
    add_fault(
        h.server(0),
        json!({"kind": "error", "status": 429, "retry_after_s": 120, "count": 1}),
    )
    .await;
    let r = forced_sim0(&h, &chat_body("hi")).await;
    assert_eq!(r.status(), 200);
    let v = health_of(&h.get_json("/keel/health").await, "sim-0");
    assert!(
        v["cooldown_ms"].as_u64().unwrap() <= 1_000,
        "one client's 429 held the variant out for everyone: {v}"
    );
    wait_for!(
        "keel's own request, after the short cooldown",
        h.metric("keel_maintenance_requests_total", &[("kind", "confirm")])
            .await
            >= 1.0
    );
    let v = health_of(&h.get_json("/keel/health").await, "sim-0");
    assert_eq!(v["available"], true, "{v}");

    // A quota that is really spent: keel's own request gets the same answer, and the whole
    // retry-after is honoured.
    add_fault(
        h.server(0),
        json!({"kind": "error", "status": 429, "retry_after_s": 120}),
    )
    .await;
    let r = forced_sim0(&h, &chat_body("hi")).await;
    assert_eq!(r.status(), 200);
    wait_for!(
        "the confirmed cooldown",
        health_of(&h.get_json("/keel/health").await, "sim-0")["cooldown_ms"]
            .as_u64()
            .unwrap()
            > 60_000
    );
}

#[tokio::test]
async fn upstream_error_text_never_reaches_the_client() {
    let h = Harness::openai(1, 1, "", "").await;
    add_fault(
        h.server(0),
        json!({"kind": "raw", "status": 401, "body": "{\"error\":{\"message\":\"Incorrect API key provided: sk-proj-abcd****wxyz\",\"type\":\"invalid_request_error\",\"code\":\"invalid_api_key\"}}"}),
    )
    .await;
    let (status, _, body) = h.chat(&chat_body("hi")).await;
    assert_eq!(status, 502, "{body}");
    let text = body.to_string();
    assert!(!text.contains("sk-proj"), "{text}");
    assert!(
        text.contains("invalid_api_key"),
        "the summary keeps the code: {text}"
    );
}

#[tokio::test]
async fn an_unknown_model_lists_only_the_callers_models() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let cfg = format!(
        "[[keys]]\nid = \"t\"\nhash = \"{}\"\npools = [\"p\"]\n\n{}\n{}",
        hash(TENANT),
        pool_over(&fleet, "p", "openai", 1, ""),
        pool_over(&fleet, "secret-pool", "openai", 1, ""),
    );
    let h = Harness::start(fleet, &cfg).await;
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("authorization", &format!("Bearer {TENANT}"))],
            &json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status(), 404);
    let text = r.text().await.unwrap();
    assert!(text.contains("`p`") || text.contains(" p"), "{text}");
    assert!(!text.contains("secret-pool"), "{text}");
}

#[test]
fn example_keys_published_in_the_repository_are_refused() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut found = Vec::new();
    for dir in ["deploy", "docs", "bench/deploy"] {
        collect_hashes(&root.join(dir), &mut found);
    }
    collect_hashes(&root.join("README.md"), &mut found);
    assert!(
        found.len() >= 3,
        "the examples' hashes were not found: {found:?}"
    );
    for (hash_hex, file) in &found {
        let toml = format!(
            "[admin]\nkey_hash = \"sha256:{hash_hex}\"\n[[pools]]\nname = \"p\"\n[[pools.variants]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n"
        );
        let err = Config::parse(&toml, "t.toml", &Default::default())
            .expect_err(&format!("the hash in {file} must be refused"));
        assert!(err.to_string().contains("published"), "{err}");
    }
    // A guessable secret is refused too; a fresh key is not.
    let weak = format!(
        "[[keys]]\nid = \"k\"\nhash = \"{}\"\n[[pools]]\nname = \"p\"\n[[pools.variants]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n",
        hash("changeme")
    );
    assert!(Config::parse(&weak, "t.toml", &Default::default()).is_err());
    let fresh = weak.replace(
        &hash("changeme"),
        &hash(&keel_gateway::state::keys::new_secret().unwrap()),
    );
    assert!(Config::parse(&fresh, "t.toml", &Default::default()).is_ok());
}

/// Every `sha256:<64 hex>` in the files under `path`, with the file it is in.
fn collect_hashes(path: &std::path::Path, out: &mut Vec<(String, String)>) {
    if path.is_dir() {
        for entry in std::fs::read_dir(path).unwrap().flatten() {
            collect_hashes(&entry.path(), out);
        }
        return;
    }
    let Ok(text) = std::fs::read_to_string(path) else {
        return;
    };
    for (i, _) in text.match_indices("sha256:") {
        let hex: String = text[i + 7..].chars().take(64).collect();
        if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            out.push((hex, path.display().to_string()));
        }
    }
}
