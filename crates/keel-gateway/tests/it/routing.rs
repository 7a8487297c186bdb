//! Live selection on the simulator: degraded variants lose traffic and come back, cold starts
//! are absorbed by warm-up, affinity keeps sessions and prefixes where they belong.

use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::*;

async fn requests(h: &Harness, i: usize) -> u64 {
    h.server(i).state.stats().requests
}

/// Client attempts keel sent to a variant (not its probes and warm-ups).
async fn client_attempts(h: &Harness, variant: &str) -> u64 {
    let m = h.metrics().await;
    ["first", "fallback", "hedge", "continuation"]
        .iter()
        .map(|kind| {
            let labels = [("pool", "p"), ("variant", variant), ("kind", *kind)];
            parse_metric(&m, "keel_attempts_total", &labels) as u64
        })
        .sum()
}

async fn health(h: &Harness) -> Value {
    h.get_json("/keel/health").await
}

#[tokio::test]
async fn a_degraded_variant_stops_getting_traffic_and_returns_after_the_fault_clears() {
    // Refresh probes on (the default): once the degraded variant gets no client traffic, they
    // keep its evidence fresh, so its error window stays severe until it is ejected.
    let extra =
        "[pools.health]\nprewarm_requests = 0\nslow_start_ms = 300\nprobe_interval_ms = 200";
    let h = Harness::openai(3, 1, "", extra).await;
    // Mostly failing (a GPU out of memory): two good probes in a row, which would bring it back
    // for a while by design, are then rare enough not to blur what this test looks at.
    add_fault(
        h.server(0),
        json!({"kind": "degraded", "error_rate": 0.9, "factor": 4}),
    )
    .await;
    // 2 s of traffic at 50 req/s: keel learns.
    for _ in 0..100 {
        let (status, _, _) = h.chat(&chat_body("x")).await;
        assert_eq!(status, 200, "failover hides the degraded variant's errors");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The next second: no client request reaches it (probes of an ejected variant may).
    let before = client_attempts(&h, "sim-0").await;
    for _ in 0..50 {
        h.chat(&chat_body("x")).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let during = client_attempts(&h, "sim-0").await - before;
    assert!(
        during <= 2,
        "the degraded variant got {during} client requests after 2 s"
    );
    // Sustained errors eject it (3 s of severity): it is probed (a degraded instance may pass
    // two probes in a row and come back for a while; that is what slow start is for).
    let mut probed = false;
    for _ in 0..80 {
        let probes = [("pool", "p"), ("variant", "sim-0"), ("kind", "probe")];
        if h.metric("keel_maintenance_requests_total", &probes).await > 0.0 {
            probed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        probed,
        "the degraded variant was ejected and probed: {}",
        health(&h).await
    );
    keel_sim::http_client()
        .delete(format!("http://{}/sim/faults", h.server(0).addr))
        .send()
        .await
        .unwrap();
    let mut back = false;
    for _ in 0..150 {
        let before = requests(&h, 0).await;
        h.chat(&chat_body("x")).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        let st = health(&h).await["pools"][0]["variants"][0]["state"]
            .as_str()
            .unwrap()
            .to_owned();
        if st == "healthy" && requests(&h, 0).await > before {
            back = true;
            break;
        }
    }
    assert!(
        back,
        "the variant returned to rotation after the fault cleared: {}",
        health(&h).await
    );
}

#[tokio::test]
async fn a_cold_start_is_paid_by_warm_up_not_by_clients() {
    let cold = keel_sim::ServerConfig {
        cold_start_requests: 2,
        cold_start_extra_ms: 300,
        ..keel_sim::ServerConfig::fast("cold")
    };
    let fleet = keel_sim::Fleet::start_n(2, cold).await.unwrap();
    let cfg = pool_over(
        &fleet,
        "p",
        "openai",
        1,
        // Exact upstream counts: no hedge on a first token made late by a loaded machine, no
        // refresh probe.
        "hedge = \"off\"\n[pools.health]\nprewarm_requests = 2\nslow_start_ms = 0\nrefresh_after_ms = 0",
    );
    let h = Harness::start(fleet, &cfg).await;
    // Until warm-up finishes, client traffic waits for nothing: but we let the monitor work first.
    for _ in 0..200 {
        let v = health(&h).await;
        if v["pools"][0]["variants"]
            .as_array()
            .unwrap()
            .iter()
            .all(|x| x["state"] == "healthy")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for i in 0..2 {
        assert_eq!(
            h.server(i).state.stats().cold_served,
            2,
            "warm-up requests absorbed the cold start"
        );
        assert_eq!(h.server(i).state.stats().requests, 2);
    }
    for _ in 0..10 {
        let (status, _, _) = h.chat(&chat_body("x")).await;
        assert_eq!(status, 200);
    }
    let client_requests: u64 = (0..2).map(|i| h.server(i).state.stats().requests - 2).sum();
    assert_eq!(client_requests, 10);
    for i in 0..2 {
        assert_eq!(
            h.server(i).state.stats().cold_served,
            2,
            "no client request paid a cold start"
        );
    }
}

/// KV-cache hit rate of a workload of shared system prompts under a pool setting.
async fn hit_rate(pool_extra: &str) -> f64 {
    let cfg = keel_sim::ServerConfig {
        prefill_us_per_token: 0.0,
        ..keel_sim::ServerConfig::fast("s")
    };
    let fleet = keel_sim::Fleet::start_n(4, cfg).await.unwrap();
    let toml = pool_over(&fleet, "p", "openai", 1, pool_extra);
    let h = Harness::start(fleet, &toml).await;
    let systems: Vec<String> = (0..4)
        .map(|i| {
            format!("System prompt number {i}. ")
                + &"Follow the house style guide carefully. ".repeat(30)
        })
        .collect();
    let (mut cached, mut prompt) = (0u64, 0u64);
    for n in 0..40 {
        let body = json!({"model": "p", "max_tokens": 1, "messages": [
            {"role": "system", "content": systems[(n * 7 + n / 3) % 4]}, {"role": "user", "content": format!("question {n}")}]});
        let (status, _, v) = h.chat(&body).await;
        assert_eq!(status, 200);
        cached += v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        prompt += v["usage"]["prompt_tokens"].as_u64().unwrap();
    }
    cached as f64 / prompt as f64
}

#[tokio::test]
async fn prefix_affinity_beats_round_robin_on_cache_hits() {
    let affinity = hit_rate("affinity = \"prefix\"").await;
    let rr = hit_rate("policy = \"round_robin\"").await;
    eprintln!(
        "simulated KV-cache hit rate: prefix affinity {:.1}%, round robin {:.1}%",
        affinity * 100.0,
        rr * 100.0
    );
    assert!(
        affinity > rr + 0.1,
        "prefix affinity {affinity:.3} vs round robin {rr:.3}"
    );
}

#[tokio::test]
async fn sessions_stick_to_one_variant() {
    let h = Harness::openai(4, 1, "", "affinity = \"session\"").await;
    for s in 0..8 {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..5 {
            let r = h
                .post_with(
                    "/v1/chat/completions",
                    &[("x-keel-session", &format!("conv-{s}"))],
                    &chat_body("x"),
                )
                .await;
            seen.insert(header(r.headers(), "x-keel-variant").to_owned());
        }
        assert_eq!(seen.len(), 1, "session conv-{s} moved: {seen:?}");
    }
    // The OpenAI `user` field keys the session too.
    let mut body = chat_body("x");
    body["user"] = json!("alice");
    let first = header(&h.chat(&body).await.1, "x-keel-variant").to_owned();
    for _ in 0..5 {
        assert_eq!(header(&h.chat(&body).await.1, "x-keel-variant"), first);
    }
}

#[tokio::test]
async fn decisions_and_gauges_explain_routing() {
    let h = Harness::openai(3, 1, "", "").await;
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-preference", "low-cost")],
            &chat_body("x"),
        )
        .await;
    let id = header(r.headers(), "x-keel-request-id").to_owned();
    let decisions: Value = h.get_json("/keel/decisions").await;
    let d = decisions
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["request_id"] == id.as_str())
        .expect("decision recorded");
    assert_eq!(d["policy"], "p2c");
    assert_eq!(d["candidates"].as_array().unwrap().len(), 3);
    assert!(d["duration_us"].as_f64().unwrap() > 0.0);
    wait_for!(
        "the monitor to publish the variant gauges",
        h.metrics().await.contains("keel_variant_state{")
    );
    let m = h.metrics().await;
    for g in [
        "keel_variant_weight{",
        "keel_variant_ttft_seconds{",
        "keel_variant_state{",
        "keel_variant_inflight{",
        "keel_decision_duration_seconds_bucket{",
    ] {
        assert!(m.contains(g), "missing {g}");
    }
    let bad = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-preference", "fastest")],
            &chat_body("x"),
        )
        .await;
    assert_eq!(bad.status(), 400);
    let bad = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-min-tier", "0")],
            &chat_body("x"),
        )
        .await;
    assert_eq!(bad.status(), 400);
}

#[tokio::test]
async fn min_tier_filters_variants() {
    let fleet = keel_sim::Fleet::start_n(2, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let cfg = format!(
        "[[pools]]\nname = \"p\"\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n{}tier = 1\n{}tier = 2\n",
        variant("best", &fleet.get(0).openai_base(), "openai", 1),
        variant("small", &fleet.get(1).openai_base(), "openai", 100)
    );
    let h = Harness::start(fleet, &cfg).await;
    for _ in 0..10 {
        let r = h
            .post_with(
                "/v1/chat/completions",
                &[("x-keel-min-tier", "1")],
                &chat_body("x"),
            )
            .await;
        assert_eq!(header(r.headers(), "x-keel-variant"), "best");
    }
}

#[tokio::test]
async fn scraped_queue_depth_steers_traffic_away() {
    let fleet = keel_sim::Fleet::start_n(
        2,
        keel_sim::ServerConfig {
            capacity: 1,
            ..keel_sim::ServerConfig::fast("s")
        },
    )
    .await
    .unwrap();
    let cfg = format!(
        "[[pools]]\nname = \"p\"\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\nscrape_interval_ms = 100\nwaiting_warn = 0.5\nwaiting_severe = 2\n{}metrics_url = \"http://{}/metrics\"\n{}metrics_url = \"http://{}/metrics\"\n",
        variant("busy", &fleet.get(0).openai_base(), "openai", 1),
        fleet.get(0).addr,
        variant("idle", &fleet.get(1).openai_base(), "openai", 1),
        fleet.get(1).addr
    );
    let h = Harness::start(fleet, &cfg).await;
    // Fill the busy server directly (not through keel): one running, two waiting.
    add_fault(
        h.server(0),
        json!({"kind": "stall", "after_tokens": 1, "ms": 3000, "count": 3}),
    )
    .await;
    let url = format!("{}/chat/completions", h.server(0).openai_base());
    let mut hogs = Vec::new();
    for _ in 0..3 {
        let u = url.clone();
        hogs.push(tokio::spawn(async move {
            keel_sim::http_client()
                .post(u)
                .json(&json!({"model": "sim", "messages": [{"role": "user", "content": "hog"}]}))
                .send()
                .await
                .map(|r| r.status())
        }));
    }
    // Let the monitor scrape the queue.
    let mut seen_waiting = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if health(&h).await["pools"][0]["variants"][0]["waiting"]
            .as_f64()
            .unwrap_or(0.0)
            >= 2.0
        {
            seen_waiting = true;
            break;
        }
    }
    assert!(seen_waiting, "scraped vllm:num_requests_waiting");
    let mut to_busy = 0;
    for _ in 0..20 {
        let r = keel_sim::http_client().post(h.url("/v1/chat/completions")).json(&json!({"model": "p", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})).send().await.unwrap();
        if header(r.headers(), "x-keel-variant") == "busy" {
            to_busy += 1;
        }
    }
    assert_eq!(
        to_busy, 0,
        "a server with a queue gets no traffic while an idle one exists"
    );
    for hog in hogs {
        hog.abort();
    }
}

#[tokio::test]
async fn an_ejected_variant_still_serves_when_nothing_else_can() {
    // One variant, far slower than its own baseline: ejected for its TTFT, yet clients are
    // served by it (slowly) instead of waiting for their deadline. (Found by `keel bench
    // overhead` on a loaded machine: 5,000 requests parked behind the only, ejected, variant.)
    let extra =
        "hedge = \"off\"\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\neject_after_ms = 100\nprobe_interval_ms = 600000";
    let h = Harness::openai(1, 1, "", extra).await;
    for _ in 0..20 {
        assert_eq!(h.chat(&chat_body("x")).await.0, 200);
    }
    // Its whole answers (a pool of one passes them through) take about 50 ms: 400 ms more is
    // past the severe band of 5× its baseline.
    add_fault(h.server(0), json!({"kind": "delay", "ms": 400})).await;
    wait_for!("the slow variant to be ejected", {
        h.chat(&chat_body("x")).await;
        health(&h).await["pools"][0]["variants"][0]["state"] == "ejected"
    });
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-timeout-ms", "5000")],
            &chat_body("x"),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(r.headers(), "x-keel-variant"), "sim-0");
}

#[tokio::test]
async fn refresh_probes_remeasure_an_idle_slow_variant_without_any_client_request_reaching_it() {
    let extra = "allow_force_variant = true";
    let pool = "hedge = \"off\"\nprobe_budget = 1\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 100\ndecay_ms = 300";
    let h = Harness::openai(3, 1, extra, pool).await;
    add_fault(h.server(0), json!({"kind": "delay", "ms": 400})).await;
    // Setup: one client request measures sim-0 as slow; the others are measured as fast.
    let resp = forced_sim0(&h, &chat_body("measure")).await;
    assert_eq!(resp.status(), 200);
    for _ in 0..6 {
        assert_eq!(h.chat(&chat_body("x")).await.0, 200);
    }
    let clients_before = client_attempts(&h, "sim-0").await;
    let upstream_before = requests(&h, 0).await;
    let refresh = [("pool", "p"), ("variant", "sim-0"), ("kind", "refresh")];
    let probes_before = h.metric("keel_maintenance_requests_total", &refresh).await;
    // 1.5 s of traffic: sim-0 stays slow, and only refresh probes go there.
    for _ in 0..75 {
        let (status, headers, _) = h.chat(&chat_body("x")).await;
        assert_eq!(status, 200);
        assert_ne!(header(&headers, "x-keel-variant"), "sim-0");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        client_attempts(&h, "sim-0").await,
        clients_before,
        "no client request reached the slow variant"
    );
    let probes = h.metric("keel_maintenance_requests_total", &refresh).await;
    assert!(
        probes - probes_before >= 2.0,
        "the idle slow variant was re-measured"
    );
    // Every upstream request sim-0 got was a refresh probe (give or take the one that may be in
    // flight at either end: the simulator counts it when it arrives, keel when it ends).
    let got = (requests(&h, 0).await - upstream_before) as f64;
    assert!(
        (got - (probes - probes_before)).abs() <= 1.0,
        "{got} upstream requests, {} probes",
        probes - probes_before
    );
    // Recovered: the probes see it, and client traffic comes back on that evidence.
    keel_sim::http_client()
        .delete(format!("http://{}/sim/faults", h.server(0).addr))
        .send()
        .await
        .unwrap();
    wait_for!("client traffic back on sim-0", {
        h.chat(&chat_body("x")).await;
        client_attempts(&h, "sim-0").await > clients_before
    });
    assert!(h.metric("keel_maintenance_requests_total", &refresh).await > probes);
}
