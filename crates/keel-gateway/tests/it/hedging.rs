//! Hedged first tokens: a late first token races a duplicate on the next variant; the first
//! token wins, the loser's connection is closed, and hedges stay within their budget.

use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::*;

#[tokio::test]
async fn a_hedge_beats_a_slow_first_token_and_the_loser_is_cancelled() {
    let h = Harness::openai(2, 1, "allow_force_variant = true", "hedge = 100").await;
    add_fault(
        h.server(0),
        json!({"kind": "stall", "after_tokens": 0, "count": 1}),
    )
    .await;
    let resp = forced_sim0(&h, &stream_body("hedge me")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(resp.headers(), "x-keel-route"), "hedged");
    assert_eq!(header(resp.headers(), "x-keel-variant"), "sim-1");
    assert_eq!(header(resp.headers(), "x-keel-attempts"), "2");
    let events = read_stream(resp).await;
    assert_eq!(events.last().unwrap().data, "[DONE]");
    // The losing upstream saw its client go away (keel closed the connection).
    let sim0 = &h.server(0).state;
    for _ in 0..100 {
        if sim0.stats().cancelled == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(sim0.stats().cancelled, 1);
    assert_eq!(sim0.stats().running, 0);
    assert_eq!(
        h.metric("keel_hedges_total", &[("pool", "p"), ("outcome", "won")])
            .await,
        1.0
    );
}

#[tokio::test]
async fn non_streaming_requests_are_hedged_too() {
    let h = Harness::openai(2, 1, "allow_force_variant = true", "hedge = 100").await;
    add_fault(
        h.server(0),
        json!({"kind": "delay", "ms": 3000, "count": 1}),
    )
    .await;
    let resp = forced_sim0(&h, &chat_body("hedge me")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(resp.headers(), "x-keel-route"), "hedged");
    assert_eq!(header(resp.headers(), "x-keel-variant"), "sim-1");
    let v: Value = resp.json().await.unwrap();
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .len()
            > 10
    );
}

#[tokio::test]
async fn a_fast_primary_is_not_hedged() {
    let h = Harness::openai(2, 1, "allow_force_variant = true", "hedge = 2000").await;
    for _ in 0..5 {
        let resp = forced_sim0(&h, &stream_body("x")).await;
        assert_eq!(header(resp.headers(), "x-keel-route"), "direct");
        read_stream(resp).await;
    }
    assert_eq!(h.server(1).state.stats().requests, 0);
}

#[tokio::test]
async fn hedges_stay_within_their_budget_under_sustained_slowness() {
    let h = Harness::openai(
        2,
        1,
        "allow_force_variant = true",
        "hedge = 20\nhedge_budget = 0.05",
    )
    .await;
    add_fault(h.server(0), json!({"kind": "delay", "ms": 100})).await;
    let n = 40;
    for _ in 0..n {
        let resp = forced_sim0(&h, &chat_body("x")).await;
        assert_eq!(resp.status(), 200);
    }
    let hedges = h.server(1).state.stats().requests;
    assert!(
        hedges as f64 <= (0.05 * n as f64).ceil(),
        "{hedges} hedges for {n} requests"
    );
    assert!(hedges >= 1, "the budget allows some hedges");
}

#[tokio::test]
async fn hedging_can_be_turned_off() {
    let h = Harness::openai(2, 1, "allow_force_variant = true", "hedge = \"off\"").await;
    add_fault(h.server(0), json!({"kind": "delay", "ms": 300, "count": 1})).await;
    let resp = forced_sim0(&h, &chat_body("x")).await;
    assert_eq!(header(resp.headers(), "x-keel-route"), "direct");
    assert_eq!(header(resp.headers(), "x-keel-variant"), "sim-0");
}

#[tokio::test]
async fn an_auto_hedge_races_a_slow_primary_once_the_target_would_usually_have_answered() {
    // hedge = auto: the delay is the hedge target's recent TTFT quantile, so a primary that is
    // slow by nature (here 800 ms of network delay, no samples of its own yet) is raced after
    // the fast variants' usual first token (clamped to 50 ms), not after 2 s.
    let h = Harness::openai(3, 1, "allow_force_variant = true", "hedge = \"auto\"").await;
    for i in 0..12 {
        let v = ["sim-1", "sim-2"][i % 2];
        let resp = h
            .post_with(
                "/v1/chat/completions",
                &[("x-keel-force-variant", v)],
                &stream_body("warm"),
            )
            .await;
        assert_eq!(resp.status(), 200);
        read_stream(resp).await;
    }
    add_fault(h.server(0), json!({"kind": "delay", "ms": 800})).await;
    let resp = forced_sim0(&h, &stream_body("far zone")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(resp.headers(), "x-keel-route"), "hedged");
    assert_ne!(header(resp.headers(), "x-keel-variant"), "sim-0");
    let events = read_stream(resp).await;
    assert_eq!(events.last().unwrap().data, "[DONE]");
}

#[tokio::test]
async fn a_late_hedge_is_followed_by_another() {
    // sim-0 (the primary), sim-1 and sim-2 are each slow for one request; sim-3 always answers
    // 30 ms later than they usually do, so hedges go to sim-1 and sim-2 first. Both are late
    // too: the third hedge, on sim-3, wins.
    let h = Harness::openai(
        4,
        1,
        "allow_force_variant = true",
        "hedge = 50\nmax_hedges = 3\nhedge_budget = 1",
    )
    .await;
    add_fault(h.server(3), json!({"kind": "delay", "ms": 30})).await;
    for v in ["sim-1", "sim-2", "sim-3"] {
        for _ in 0..2 {
            let resp = h
                .post_with(
                    "/v1/chat/completions",
                    &[("x-keel-force-variant", v)],
                    &chat_body("warm"),
                )
                .await;
            assert_eq!(resp.status(), 200);
        }
    }
    for i in 0..3 {
        add_fault(
            h.server(i),
            json!({"kind": "delay", "ms": 3000, "count": 1}),
        )
        .await;
    }
    let before: Vec<u64> = (0..4).map(|i| h.server(i).state.stats().requests).collect();
    let resp = forced_sim0(&h, &stream_body("hedge twice")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(resp.headers(), "x-keel-route"), "hedged");
    assert_eq!(header(resp.headers(), "x-keel-variant"), "sim-3");
    read_stream(resp).await;
    for (i, b) in before.iter().enumerate() {
        assert_eq!(
            h.server(i).state.stats().requests - b,
            1,
            "sim-{i} raced once"
        );
    }
    let won = [("pool", "p"), ("outcome", "won")];
    assert_eq!(h.metric("keel_hedges_total", &won).await, 1.0);
    let hedges = h.metric("keel_attempts_total", &[("kind", "hedge")]).await;
    assert_eq!(hedges, 3.0);
}

#[tokio::test]
async fn max_hedges_bounds_the_race() {
    let h = Harness::openai(
        4,
        1,
        "allow_force_variant = true",
        "hedge = 50\nmax_hedges = 1\nhedge_budget = 1",
    )
    .await;
    for i in 0..3 {
        add_fault(h.server(i), json!({"kind": "delay", "ms": 300, "count": 1})).await;
    }
    let resp = forced_sim0(&h, &stream_body("hedge once")).await;
    assert_eq!(resp.status(), 200);
    read_stream(resp).await;
    let raced: u64 = (0..4).map(|i| h.server(i).state.stats().requests).sum();
    assert_eq!(raced, 2, "the primary and one hedge");
}

/// Sends `n` forced-to-sim-0 streams at once; each must answer 200. Returns their routes.
async fn forced_batch(h: &Harness, n: usize) -> Vec<String> {
    let sends = (0..n).map(|i| async move {
        let resp = forced_sim0(h, &stream_body(&format!("late {i}"))).await;
        assert_eq!(resp.status(), 200);
        let route = header(resp.headers(), "x-keel-route").to_owned();
        read_stream(resp).await;
        route
    });
    futures_util::future::join_all(sends).await
}

/// Two variants with an auto hedge and the whole hedge budget: sim-1, the hedge target, answers
/// in about 300 ms and has eight answers measured, so an auto hedge is due once the primary is
/// about 300 ms late, and would answer some 300 ms after that. (Safe mode, which turns hedging
/// off, stays off: every request here is slow on purpose.)
async fn slow_hedge_target() -> Harness {
    let h = Harness::openai(
        2,
        1,
        "allow_force_variant = true",
        "hedge = \"auto\"\nhedge_budget = 1\n[pools.safe_mode]\nauto = false",
    )
    .await;
    add_fault(h.server(1), json!({"kind": "delay", "ms": 300})).await;
    for _ in 0..8 {
        let resp = h
            .post_with(
                "/v1/chat/completions",
                &[("x-keel-force-variant", "sim-1")],
                &stream_body("warm"),
            )
            .await;
        read_stream(resp).await;
    }
    h
}

#[tokio::test]
async fn hedges_wait_until_the_pool_shows_they_would_win() {
    let h = slow_hedge_target().await;
    let withheld = [("pool", "p"), ("outcome", "withheld")];

    // The primary is late past the hedge delay, but not very late, and always answers before
    // a hedge would have: no hedge is sent, and the record learns that none would have won.
    add_fault(h.server(0), json!({"kind": "delay", "ms": 380})).await;
    let sim1 = h.server(1).state.stats().requests;
    let before = h.metric("keel_hedges_total", &withheld).await;
    for _ in 0..5 {
        for route in forced_batch(&h, 4).await {
            assert_eq!(route, "direct");
        }
    }
    assert_eq!(
        h.metric("keel_hedges_total", &withheld).await - before,
        20.0
    );
    assert_eq!(
        h.server(1).state.stats().requests,
        sim1,
        "no hedge was sent"
    );

    // Now the primary is stuck: each is hedged once it is very late, and the hedge wins; these
    // wins show that hedges at the delay would have won, and hedging there resumes.
    h.server(0).state.clear_faults();
    add_fault(h.server(0), json!({"kind": "delay", "ms": 2000})).await;
    let mut batches = 0;
    loop {
        let before = h.metric("keel_hedges_total", &withheld).await;
        for route in forced_batch(&h, 4).await {
            assert_eq!(route, "hedged", "a stuck primary is hedged");
        }
        batches += 1;
        if h.metric("keel_hedges_total", &withheld).await == before {
            break;
        }
        assert!(batches < 5, "hedging at the delay did not resume");
    }
    assert!(batches >= 2, "the record first had to learn");
}

#[tokio::test]
async fn very_late_hedges_stop_once_the_pool_shows_they_lose() {
    // The auto delay is about 300 ms, and a very late hedge goes out at about 450 ms. The
    // primary answers at about 600 ms, before any such hedge could (about 750 ms): the record
    // of very late hedges learns that they lose, and they stop. The primary's answer is the
    // route: `direct`, not a fallback. (600 ms sits between the two with room either way on a
    // loaded machine, where the measured delay, and so the very late moment, run later.)
    let h = slow_hedge_target().await;
    add_fault(h.server(0), json!({"kind": "delay", "ms": 600})).await;
    let lost = [("pool", "p"), ("outcome", "lost")];
    let mut batches = 0;
    loop {
        let sim1 = h.server(1).state.stats().requests;
        for route in forced_batch(&h, 4).await {
            assert_eq!(route, "direct", "the primary answered first");
        }
        batches += 1;
        if h.server(1).state.stats().requests == sim1 {
            break;
        }
        assert!(batches < 6, "very late hedges did not stop");
    }
    assert!(
        h.metric("keel_hedges_total", &lost).await >= f64::from(keel_core::hedge::MIN_OBSERVATIONS),
        "hedged very late while the record learned"
    );
    // And they stay stopped.
    let sim1 = h.server(1).state.stats().requests;
    forced_batch(&h, 4).await;
    assert_eq!(h.server(1).state.stats().requests, sim1);
}

/// The budget's last eighth is kept for primaries still waiting at 1.5 delays: once hedges at
/// the delay have spent the rest, a late primary is hedged at 1.5 delays instead of not at
/// all. One request in four is slow (1 s) on sim-0, under a budget of a quarter of the
/// requests: every slow one is hedged, the eighth to the tenth at the very late moment (the
/// budget's 10 s window holds the whole test: short answers).
#[tokio::test]
async fn a_hedge_the_reserve_would_pay_for_waits_for_the_very_late_moment() {
    let h = Harness::openai(
        2,
        1,
        "allow_force_variant = true",
        "hedge = 150\nhedge_budget = 0.25",
    )
    .await;
    let body = |prompt: &str| json!({"model": "p", "max_tokens": 2, "messages": [{"role": "user", "content": prompt}]});
    let slow = 10;
    for i in 0..slow {
        for _ in 0..3 {
            let resp = forced_sim0(&h, &body("fast")).await;
            assert_eq!(resp.status(), 200);
        }
        add_fault(
            h.server(0),
            json!({"kind": "delay", "ms": 1000, "count": 1}),
        )
        .await;
        let resp = forced_sim0(&h, &body("slow")).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(
            header(resp.headers(), "x-keel-route"),
            "hedged",
            "slow request {i}"
        );
    }
    assert_eq!(
        h.server(1).state.stats().requests,
        slow,
        "every slow one hedged"
    );
    let metrics = h.metrics().await;
    let count = |outcome| {
        parse_metric(
            &metrics,
            "keel_hedges_total",
            &[("pool", "p"), ("outcome", outcome)],
        )
    };
    // By the budget: hedges at the delay may spend ⌈7/8 × ¼ × requests⌉, so the slow requests
    // after the 28th request (the 7th slow one) find that spent.
    assert_eq!(count("deferred"), 3.0);
    assert_eq!(count("over_budget"), 0.0);
    // The deferred ones went out at 1.5 delays, named as very late in their records.
    let records = h.get_json("/keel/decisions").await;
    let very_late: Vec<f64> = records
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["hedges"].as_array().cloned().unwrap_or_default())
        .filter(|x| x["reason"] == "first_token_very_late")
        .map(|x| x["at_ms"].as_f64().unwrap())
        .collect();
    assert_eq!(very_late.len(), 3);
    assert!(very_late.iter().all(|at| *at >= 225.0), "{very_late:?}");
}
