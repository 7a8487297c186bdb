//! Health colours and safe mode on the simulator: a pool whose variants mostly fail turns red
//! with reasons and enters safe mode by itself (no migration, no hedging), returns to green
//! when the faults clear, and leaves safe mode only after the hysteresis; an operator can force
//! it through `POST /keel/admin/safe-mode`, behind the admin key when keys are configured.

use keel_gateway::state::keys::{hash_secret, hash_text};
use keel_sim::{Fleet, ServerConfig};
use serde_json::{json, Value};

use crate::harness::*;

/// Small windows so that a test sees the colour move in a few seconds: a 1 s window, ratios
/// judged from 4 requests, safe mode left after 3 s of green; every late first token may be
/// hedged (the hedge budget would otherwise refuse the second hedge of a quiet test); the
/// decision-latency thresholds are far out of reach, so that a busy test machine cannot move
/// the colour. Ejected variants are probed
/// every 100 ms, so they come back soon after their faults clear.
const SAFE: &str = "hedge = 50\nhedge_budget = 1.0\n[pools.safe_mode]\nwindow_ms = 1000\nmin_requests = 4\nexit_after_ms = 3000\ndecision_ms_yellow = 500\ndecision_ms_red = 1000\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\nprobe_interval_ms = 100\neject_after_ms = 200\n";

async fn safe_harness() -> Harness {
    Harness::openai(3, 1, "allow_force_variant = true", SAFE).await
}

/// Pool `p`'s entry in `/keel/health` (evaluated by the request itself).
async fn pool_health(h: &Harness) -> Value {
    let doc = h.get_json("/keel/health").await;
    doc["pools"][0].clone()
}

async fn clear_faults(h: &Harness, i: usize) {
    let r = keel_sim::http_client()
        .delete(format!("http://{}/sim/faults", h.server(i).addr))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

async fn set_safe_mode(h: &Harness, auth: Option<&str>, body: Value) -> reqwest::Response {
    let mut req = keel_sim::http_client()
        .post(h.url("/keel/admin/safe-mode"))
        .json(&body);
    if let Some(key) = auth {
        req = req.header("authorization", format!("Bearer {key}"));
    }
    req.send().await.expect("gateway reachable")
}

/// A stream on `variant` whose upstream drops the connection after 3 tokens: the events the
/// client got.
async fn cut_stream(h: &Harness, variant: &str) -> Vec<keel_core::sse::SseEvent> {
    let i = h
        .fleet
        .servers
        .iter()
        .position(|s| s.name == variant)
        .unwrap();
    add_fault(
        h.server(i),
        json!({"kind": "close", "after_tokens": 3, "count": 1}),
    )
    .await;
    let resp = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-force-variant", variant)],
            &stream_body("a long story about seams"),
        )
        .await;
    assert_eq!(resp.status(), 200);
    read_stream(resp).await
}

fn migrated(events: &[keel_core::sse::SseEvent]) -> bool {
    events
        .iter()
        .any(|e| e.comment_only && String::from_utf8_lossy(&e.raw).contains("keel migrated"))
}

/// The error event that ends a stream keel could not complete, if any.
fn error_event(events: &[keel_core::sse::SseEvent]) -> Option<String> {
    events
        .iter()
        .filter(|e| !e.comment_only && e.data != "[DONE]")
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .find_map(|v| v["error"]["message"].as_str().map(str::to_owned))
}

/// A request forced to sim-0 whose first token is 400 ms late (a hedge fires after 50 ms):
/// its `x-keel-route`, and whether another variant saw a request.
async fn slow_first_token(h: &Harness) -> (String, bool) {
    let others = |h: &Harness| {
        (1..3)
            .map(|i| h.server(i).state.stats().requests)
            .sum::<u64>()
    };
    let before = others(h);
    add_fault(
        h.server(0),
        json!({"kind": "cold_start", "extra_ms": 400, "count": 1}),
    )
    .await;
    let resp = forced_sim0(h, &stream_body("hedge me")).await;
    assert_eq!(resp.status(), 200);
    let route = header(resp.headers(), "x-keel-route").to_owned();
    read_stream(resp).await;
    (route, others(h) > before)
}

#[tokio::test]
async fn a_failing_pool_turns_red_enters_safe_mode_and_leaves_it_after_the_hysteresis() {
    let h = safe_harness().await;
    let start = pool_health(&h).await;
    assert_eq!(start["colour"], "green", "{start}");
    assert_eq!(start["safe_mode"]["active"], false);

    // Two of three variants answer 503: requests fall back, variants cool down and eject.
    for i in 0..2 {
        add_fault(h.server(i), json!({"kind": "error", "status": 503})).await;
    }
    let mut red: Value;
    wait_for!("the pool to turn red and enter safe mode", {
        let (status, _, _) = h.chat(&chat_body("hello")).await;
        assert!(status == 200 || status == 503, "{status}");
        red = pool_health(&h).await;
        red["colour"] == "red" && red["safe_mode"]["active"] == true
    });
    let reasons: Vec<&str> = red["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    assert!(reasons.iter().any(|r| r.contains("red threshold")), "{red}");
    // Each reason names a signal the health document shows, and that signal's value.
    for r in &reasons {
        let (signal, value) = [
            ("fallback ratio", "fallback_ratio"),
            ("migration ratio", "migration_ratio"),
            ("error rate", "error_rate"),
            ("decision latency", "decision_ms"),
            ("eligible capacity", "eligible_capacity"),
        ]
        .into_iter()
        .find(|(s, _)| r.starts_with(s))
        .unwrap_or_else(|| panic!("unknown signal in {r}"));
        // Failing variants move these three; migration and decision time stay calm.
        assert!(
            ["fallback ratio", "error rate", "eligible capacity"].contains(&signal),
            "{r}"
        );
        let shown = red["signals"][value].as_f64().unwrap();
        let said: f64 = r[signal.len() + 1..]
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!((shown - said).abs() < 0.001, "{r} vs {shown}");
    }
    let switch = &red["safe_mode"]["last_switch"];
    assert_eq!(switch["active"], true);
    assert!(
        switch["reason"]
            .as_str()
            .unwrap()
            .starts_with("colour red: "),
        "{switch}"
    );
    let overall = h.get_json("/keel/health").await;
    assert_eq!(overall["colour"], "red");
    assert!(overall["reasons"][0]
        .as_str()
        .unwrap()
        .starts_with("pool `p`: "));
    assert_eq!(h.metric("keel_safe_mode", &[("pool", "p")]).await, 1.0);
    assert_eq!(h.metric("keel_health_state", &[("pool", "p")]).await, 2.0);

    // The faults clear; the variants come back while safe mode holds (hysteresis).
    for i in 0..2 {
        clear_faults(&h, i).await;
    }
    wait_for!("every variant to serve again", {
        let p = pool_health(&h).await;
        p["variants"]
            .as_array()
            .unwrap()
            .iter()
            .all(|v| v["available"] == true && v["state"] != "ejected")
    });
    // A stream cut after its first token is not migrated: the client gets the error event.
    let events = cut_stream(&h, "sim-2").await;
    assert!(!migrated(&events), "migrated in safe mode");
    let error = error_event(&events).expect("an error event ends the stream");
    assert!(error.contains("safe mode"), "{error}");
    assert!(events.iter().all(|e| e.data != "[DONE]"));
    // A late first token is not hedged.
    let (route, elsewhere) = slow_first_token(&h).await;
    assert_eq!(route, "direct");
    assert!(!elsewhere, "a hedge went to another variant in safe mode");
    assert_eq!(h.metric("keel_hedges_total", &[("pool", "p")]).await, 0.0);

    // Green again once the failures leave the window; safe mode is left only after the colour
    // has stayed green for exit_after_ms.
    let mut first_green: Value;
    wait_for!("the colour to return to green", {
        first_green = pool_health(&h).await;
        first_green["colour"] == "green"
    });
    assert!(first_green["reasons"].as_array().unwrap().is_empty());
    let held = first_green["safe_mode"]["active"] == true;
    let green_for = first_green["safe_mode"]["green_for_ms"].as_u64().unwrap();
    assert!(
        held || green_for >= 3000,
        "left safe mode after only {green_for} ms of green: {first_green}"
    );
    let mut after: Value;
    wait_for!("safe mode to end", {
        after = pool_health(&h).await;
        after["safe_mode"]["active"] == false
    });
    let reason = after["safe_mode"]["last_switch"]["reason"]
        .as_str()
        .unwrap()
        .to_owned();
    let green_ms: u64 = reason
        .strip_prefix("colour green for ")
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{reason}"));
    assert!(green_ms >= 3000, "{reason}");
    assert_eq!(h.metric("keel_safe_mode", &[("pool", "p")]).await, 0.0);
    assert_eq!(h.metric("keel_health_state", &[("pool", "p")]).await, 0.0);
}

#[tokio::test]
async fn forced_safe_mode_stops_migration_and_hedging_until_released() {
    let h = safe_harness().await;
    // Outside safe mode both happen (the control case).
    assert!(migrated(&cut_stream(&h, "sim-0").await));
    assert_eq!(slow_first_token(&h).await.0, "hedged");

    let r = set_safe_mode(&h, None, json!({"pool": "p", "mode": "on"})).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v,
        json!({"pools": [{"name": "p", "safe_mode": true, "control": "on"}]})
    );
    // On whatever the colour (here green or yellow: the cut variant may be cooling down).
    let p = pool_health(&h).await;
    assert_eq!(p["safe_mode"]["active"], true, "{p}");
    assert_eq!(p["safe_mode"]["control"], "on");
    assert_eq!(
        p["safe_mode"]["last_switch"]["reason"],
        "forced on by an operator"
    );
    assert_eq!(h.metric("keel_safe_mode", &[("pool", "p")]).await, 1.0);

    let events = cut_stream(&h, "sim-0").await;
    assert!(!migrated(&events));
    assert!(error_event(&events).unwrap().contains("safe mode"));
    let (route, elsewhere) = slow_first_token(&h).await;
    assert_eq!(route, "direct");
    assert!(!elsewhere);
    // Failover before the first byte still works.
    add_fault(
        h.server(0),
        json!({"kind": "error", "status": 503, "count": 1}),
    )
    .await;
    let resp = forced_sim0(&h, &chat_body("fail over")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(resp.headers(), "x-keel-route"), "fallback");

    // Forced off (here: every pool), the features are back.
    let r = set_safe_mode(&h, None, json!({"pool": null, "mode": "off"})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(pool_health(&h).await["safe_mode"]["active"], false);
    assert!(migrated(&cut_stream(&h, "sim-0").await));
    let r = set_safe_mode(&h, None, json!({"mode": "auto"})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(pool_health(&h).await["safe_mode"]["control"], "auto");

    // Bad orders are refused with the reason.
    for (body, status) in [
        (json!({"pool": "nope", "mode": "on"}), 404),
        (json!({"pool": "p", "mode": "sometimes"}), 400),
        (json!({"pool": "p"}), 400),
    ] {
        let r = set_safe_mode(&h, None, body.clone()).await;
        assert_eq!(r.status(), status, "{body}");
        let e: Value = r.json().await.unwrap();
        assert!(e["error"]["message"].is_string(), "{e}");
    }
}

#[tokio::test]
async fn the_safe_mode_endpoint_needs_the_admin_key_when_keys_are_configured() {
    let admin = "sk-keel-test-admin";
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let hash = |k: &str| hash_text(&hash_secret(k));
    let cfg = format!(
        "[admin]\nkey_hash = \"{}\"\n\n[[keys]]\nid = \"a\"\nhash = \"{}\"\n\n{}",
        hash(admin),
        hash("sk-keel-test-key-a"),
        pool_over(&fleet, "p", "openai", 1, ""),
    );
    let mut h = Harness::start(fleet, &cfg).await;
    h.ops_key = Some(admin.into());
    let order = json!({"pool": "p", "mode": "on"});
    assert_eq!(set_safe_mode(&h, None, order.clone()).await.status(), 401);
    for wrong in ["sk-keel-test-key-a", "sk-wrong"] {
        assert_eq!(
            set_safe_mode(&h, Some(wrong), order.clone()).await.status(),
            403
        );
    }
    assert_eq!(pool_health(&h).await["safe_mode"]["active"], false);
    assert_eq!(set_safe_mode(&h, Some(admin), order).await.status(), 200);
    assert_eq!(pool_health(&h).await["safe_mode"]["active"], true);
}
