//! The dashboard's feed (`/keel/events`) and page (`/keel/dashboard`): snapshots that show the
//! fleet, the route mix and the latest decisions, and the cap on subscribers.

use serde_json::{json, Value};

use crate::harness::*;

/// Reads server-sent events from `resp` until one's data is a JSON snapshot satisfying `want`
/// (one arrives per second; the first at once).
async fn event_where(resp: &mut reqwest::Response, want: impl Fn(&Value) -> bool) -> Value {
    let mut buf = String::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let data = event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {event:?}"));
            let snap: Value = serde_json::from_str(data.trim_end()).expect("JSON snapshot");
            if want(&snap) {
                return snap;
            }
        }
        assert!(std::time::Instant::now() < deadline, "no such snapshot");
        let chunk = resp.chunk().await.unwrap().expect("stream open");
        buf.push_str(std::str::from_utf8(&chunk).unwrap());
    }
}

async fn subscribe(h: &Harness) -> reqwest::Response {
    keel_sim::http_client()
        .get(h.url("/keel/events"))
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn snapshots_show_variants_route_mix_ttft_and_decisions() {
    let h = Harness::openai(2, 1000, "", "").await;
    let mut events = subscribe(&h).await;
    assert_eq!(events.status(), 200);
    assert_eq!(
        header(events.headers(), "content-type"),
        "text/event-stream"
    );
    // The first snapshot comes at once, before any request.
    let first = event_where(&mut events, |_| true).await;
    let names: Vec<&str> = first["health"]["pools"][0]["variants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["sim-0", "sim-1"]);
    assert_eq!(first["window"]["routes"]["direct"], 0);
    assert_eq!(first["window"]["routes"]["fallback"], 0);
    // The health part is `/keel/health`'s document: the same keys for every variant.
    let health = h.get_json("/keel/health").await;
    let keys = |v: &Value| {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    assert_eq!(
        keys(&first["health"]["pools"][0]["variants"][0]),
        keys(&health["pools"][0]["variants"][0])
    );

    // sim-0 (the primary) fails: the first request falls back to sim-1.
    add_fault(h.server(0), json!({"kind": "error", "status": 503})).await;
    let r = h.post("/v1/chat/completions", &chat_body("x")).await;
    assert_eq!(header(r.headers(), "x-keel-route"), "fallback");
    let id = header(r.headers(), "x-keel-request-id").to_owned();
    r.text().await.unwrap();
    let snap = event_where(&mut events, |s| s["window"]["routes"]["fallback"] == 1).await;
    let p = &snap["window"]["ttft"]["p"];
    assert_eq!(p["count"], 1);
    assert!(p["p50_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(p["series"].as_array().unwrap().len(), 30);
    let latest = &snap["decisions"][0];
    assert_eq!(latest["request_id"], id.as_str());
    assert_eq!(latest["pool"], "p");
    assert_eq!(latest["route"], "fallback");
    assert_eq!(latest["variant"], "sim-1");
    assert_eq!(latest["attempts"], 2);
    let sim0 = &snap["health"]["pools"][0]["variants"][0];
    assert_eq!(sim0["name"], "sim-0");
    assert!(sim0["error_rate"].as_f64().unwrap() > 0.0, "{sim0}");
}

#[tokio::test]
async fn subscribers_are_capped_and_places_are_given_back() {
    let h = Harness::openai(1, 1, "", "").await;
    let max = keel_gateway::admin::events::MAX_SUBSCRIBERS;
    let mut open = Vec::new();
    for _ in 0..max {
        let r = subscribe(&h).await;
        assert_eq!(r.status(), 200);
        open.push(r);
    }
    let refused = subscribe(&h).await;
    assert_eq!(refused.status(), 503);
    assert!(refused.headers().contains_key("retry-after"));
    let body: Value = refused.json().await.unwrap();
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("subscribers"));
    // A page closed gives its place back (once the server notices the connection is gone).
    open.pop();
    wait_for!(
        "the closed subscriber's place",
        h.gw.events.subscribers() < max
    );
    assert_eq!(subscribe(&h).await.status(), 200);
}

#[tokio::test]
async fn the_dashboard_page_is_served_from_the_binary() {
    let h = Harness::openai(1, 1, "", "").await;
    let r = keel_sim::http_client()
        .get(h.url("/keel/dashboard"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(r.headers(), "content-type"),
        "text/html; charset=utf-8"
    );
    let page = r.text().await.unwrap();
    assert!(page.contains("fetch(\"/keel/events\""));
    assert!(page.contains("id=\"heatmap\""));
}
