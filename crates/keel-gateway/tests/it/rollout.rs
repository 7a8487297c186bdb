//! Shadow traffic and canary rollouts on the simulator: a shadow copy never delays or changes
//! the served answer and its comparison figures are the ones computed from the two servers'
//! own answers; a canary keeps each user on one side, advances only with healthy evidence,
//! rolls back by itself on an injected error rate, and obeys an operator's promote/rollback.

use keel_core::canary::bucket;
use keel_core::compare::similarity;
use keel_gateway::state::keys::{hash_secret, hash_text};
use keel_sim::config::{FleetConfig, GenerationConfig};
use keel_sim::{Fleet, ServerConfig};
use serde_json::{json, Value};

use crate::harness::*;

/// Servers named `names`, fast, with `family` deciding their text: one family, one answer.
async fn fleet(servers: &[(&str, &str)]) -> Fleet {
    let cfg = FleetConfig {
        generation: GenerationConfig::default(),
        servers: servers
            .iter()
            .enumerate()
            .map(|(i, (name, family))| ServerConfig {
                name: (*name).into(),
                family: (*family).into(),
                seed: Some(i as u64 + 1),
                ..ServerConfig::fast(name)
            })
            .collect(),
    };
    Fleet::start(&cfg).await.unwrap()
}

fn shadow_variant(name: &str, url: &str) -> String {
    format!("[[pools.shadow.variants]]\nname = \"{name}\"\nurl = \"{url}\"\nprotocol = \"openai\"\nupstream_model = \"sim\"\n")
}

fn text_of(answer: &Value) -> String {
    answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned()
}

async fn shadow_doc(h: &Harness) -> Value {
    h.get_json("/keel/shadow/p").await
}

fn shadow_of<'a>(doc: &'a Value, name: &str) -> &'a Value {
    doc["variants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["variant"] == name)
        .unwrap()
}

#[tokio::test]
async fn shadow_copies_never_delay_or_change_the_answer_and_compare_exactly() {
    // sim-0 serves; `same` is another server of its family (identical answers), `other` a
    // server of another family (different answers).
    let f = fleet(&[("sim-0", "a"), ("same", "a"), ("other", "b")]).await;
    let mut cfg = format!(
        "[[pools]]\nname = \"p\"\ntotal_ms = 3000\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n{}",
        variant("sim-0", &f.get(0).openai_base(), "openai", 1)
    );
    cfg.push_str("[pools.shadow]\nsample = 1.0\nmax_in_flight = 8\nmax_per_minute = 1000\n");
    cfg.push_str(&shadow_variant("same", &f.get(1).openai_base()));
    cfg.push_str(&shadow_variant("other", &f.get(2).openai_base()));
    let h = Harness::start(f, &cfg).await;

    // The shadow `other` hangs on its first request: the client's answer still comes, while
    // that copy is still in flight.
    add_fault(h.server(2), json!({"kind": "hang", "count": 1})).await;
    let body = chat_body("first question, answered while the shadow hangs");
    let (status, headers, answer) = h.chat(&body).await;
    assert_eq!(status, 200);
    assert_eq!(header(&headers, "x-keel-variant"), "sim-0");
    let mine = text_of(&reference(&h, 0, "/v1/chat/completions", &body).await);
    assert_eq!(text_of(&answer), mine);
    assert!(
        shadow_doc(&h).await["in_flight"].as_u64().unwrap() >= 1,
        "the answer came while a shadow copy was still running"
    );
    // The hung copy fails at the pool's deadline: counted, and invisible to the client.
    wait_for!(
        "the hung copy to fail",
        shadow_of(&shadow_doc(&h).await, "other")["failed"] == 1
    );

    // Now five prompts, streamed and not: every answer is sim-0's, and the figures match
    // what the servers' own answers say.
    let prompts: Vec<String> = (0..5)
        .map(|i| format!("prompt number {i} about fleets"))
        .collect();
    let mut sims = Vec::new();
    let mut token_deltas = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let served = if i % 2 == 0 {
            let (status, _, answer) = h.chat(&chat_body(p)).await;
            assert_eq!(status, 200);
            text_of(&answer)
        } else {
            let resp = h.post("/v1/chat/completions", &stream_body(p)).await;
            assert_eq!(resp.status(), 200);
            openai_stream_text(&read_stream(resp).await)
        };
        let mine = text_of(&reference(&h, 0, "/v1/chat/completions", &chat_body(p)).await);
        assert_eq!(served, mine, "the served answer is sim-0's, unchanged");
        let theirs = text_of(&reference(&h, 2, "/v1/chat/completions", &chat_body(p)).await);
        assert_ne!(mine, theirs, "the families answer differently");
        sims.push(similarity(&mine, &theirs));
        token_deltas.push(
            keel_core::tokens::count(&theirs) as f64 - keel_core::tokens::count(&mine) as f64,
        );
    }
    wait_for!("six comparisons for `same`", {
        let d = shadow_doc(&h).await;
        shadow_of(&d, "same")["compared"] == 6 && shadow_of(&d, "other")["compared"] == 5
    });
    let doc = shadow_doc(&h).await;
    let same = shadow_of(&doc, "same");
    assert_eq!(same["exact_match_rate"], 1.0);
    assert_eq!(same["mean_similarity"], 1.0);
    assert_eq!(same["mean_token_delta"], 0.0);
    let other = shadow_of(&doc, "other");
    assert_eq!(other["exact_match_rate"], 0.0);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let got = other["mean_similarity"].as_f64().unwrap();
    assert!((got - mean(&sims)).abs() < 1e-9, "{got} vs {sims:?}");
    let got = other["mean_token_delta"].as_f64().unwrap();
    assert!(
        (got - mean(&token_deltas)).abs() < 1e-9,
        "{got} vs {token_deltas:?}"
    );
    assert!(other["mean_latency_delta_ms"].is_number());
    // Metrics agree; the shadow copies never appear among the pool's attempts.
    assert_eq!(
        h.metric(
            "keel_shadow_requests_total",
            &[("variant", "other"), ("outcome", "compared")]
        )
        .await,
        5.0
    );
    assert_eq!(
        h.metric(
            "keel_shadow_requests_total",
            &[("variant", "other"), ("outcome", "failed")]
        )
        .await,
        1.0
    );
    assert_eq!(
        h.metric("keel_attempts_total", &[("variant", "other")])
            .await,
        0.0
    );
}

#[tokio::test]
async fn shadow_bounds_skip_copies_and_unknown_pools_are_404() {
    let f = fleet(&[("sim-0", "a"), ("slow", "a")]).await;
    let mut cfg = format!(
        "[[pools]]\nname = \"p\"\ntotal_ms = 3000\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n{}",
        variant("sim-0", &f.get(0).openai_base(), "openai", 1)
    );
    cfg.push_str("[pools.shadow]\nsample = 1.0\nmax_in_flight = 1\nmax_per_minute = 2\n");
    cfg.push_str(&shadow_variant("slow", &f.get(1).openai_base()));
    let h = Harness::start(f, &cfg).await;
    // The shadow hangs until the deadline: one copy runs, the next is skipped (in flight);
    // after it fails, one more fits the minute's budget of 2, then the budget skips.
    add_fault(h.server(1), json!({"kind": "hang", "count": 1})).await;
    for _ in 0..2 {
        assert_eq!(h.chat(&chat_body("q")).await.0, 200);
    }
    let d = shadow_doc(&h).await;
    assert_eq!(shadow_of(&d, "slow")["skipped"], 1);
    wait_for!(
        "the hung copy to fail",
        shadow_of(&shadow_doc(&h).await, "slow")["failed"] == 1
    );
    assert_eq!(h.chat(&chat_body("q")).await.0, 200);
    wait_for!(
        "the second copy",
        shadow_of(&shadow_doc(&h).await, "slow")["compared"] == 1
    );
    assert_eq!(h.chat(&chat_body("q")).await.0, 200);
    assert_eq!(shadow_of(&shadow_doc(&h).await, "slow")["skipped"], 2);

    let r = keel_sim::http_client()
        .get(h.url("/keel/shadow/nope"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
}

/// A pool over sim-0 (stable) and sim-1 (candidate) with `canary` as its `[pools.canary]`
/// body; variants are never ejected (a failing candidate keeps being tried) and late first
/// tokens are not hedged (a hedge may be won by the other side, on a busy test machine).
fn canary_config(f: &Fleet, top: &str, canary: &str) -> String {
    format!(
        "{top}\n[[pools]]\nname = \"p\"\nhedge = \"off\"\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\neject_after_ms = 600000\n{}{}[pools.canary]\ncandidates = [\"sim-1\"]\n{canary}\n",
        variant("sim-0", &f.get(0).openai_base(), "openai", 1),
        variant("sim-1", &f.get(1).openai_base(), "openai", 1),
    )
}

fn user_body(user: &str) -> Value {
    json!({"model": "p", "user": user, "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]})
}

async fn canary_state(h: &Harness) -> Value {
    h.get_json("/keel/health").await["pools"][0]["canary"].clone()
}

#[tokio::test]
async fn canary_users_stay_on_their_side_by_hash() {
    let f = fleet(&[("sim-0", "a"), ("sim-1", "a")]).await;
    // The weight holds at 20 %: the step needs far more evidence than this test sends.
    let cfg = canary_config(
        &f,
        "",
        "steps = [20, 100]\nmin_requests = 100000\ndwell_ms = 0",
    );
    let h = Harness::start(f, &cfg).await;
    let mut on_candidate = 0;
    for round in 0..2 {
        for u in 0..40 {
            let user = format!("user-{u}");
            let (status, headers, _) = h.chat(&user_body(&user)).await;
            assert_eq!(status, 200);
            let expected = if bucket("p", user.as_bytes()) < 2_000 {
                "sim-1"
            } else {
                "sim-0"
            };
            assert_eq!(
                header(&headers, "x-keel-variant"),
                expected,
                "{user}, round {round}"
            );
            on_candidate += (expected == "sim-1") as u32;
        }
    }
    assert!(on_candidate > 0 && on_candidate < 80, "{on_candidate}");
    let state = canary_state(&h).await;
    assert_eq!(state["phase"], "rolling");
    assert_eq!(state["weight_percent"], 20.0);
    assert_eq!(
        state["step_stats"]["attempts"].as_u64().unwrap(),
        on_candidate as u64
    );
    assert_eq!(
        h.metric("keel_canary_requests_total", &[("side", "candidate")])
            .await,
        on_candidate as f64
    );
    // The decision record names the side.
    let d = h.get_json("/keel/decisions?limit=1").await;
    assert!(d[0]["canary"] == "stable" || d[0]["canary"] == "candidate");
}

/// Sends requests from many users until `done` holds for the canary's state.
async fn drive(h: &Harness, what: &str, done: impl Fn(&Value) -> bool) -> Vec<u16> {
    let mut statuses = Vec::new();
    let mut u = 0;
    wait_for!(what, {
        u += 1;
        let (status, _, _) = h.chat(&user_body(&format!("driver-{u}"))).await;
        statuses.push(status);
        done(&canary_state(h).await)
    });
    statuses
}

#[tokio::test]
async fn canary_advances_with_healthy_evidence_and_promotes() {
    let f = fleet(&[("sim-0", "a"), ("sim-1", "a")]).await;
    let cfg = canary_config(
        &f,
        "",
        "steps = [30, 60, 100]\nmin_requests = 5\ndwell_ms = 20\nmax_error_rate = 0.1",
    );
    let h = Harness::start(f, &cfg).await;
    // Time alone never advances it: without candidate attempts it stays at the first step.
    assert_eq!(canary_state(&h).await["weight_percent"], 30.0);
    let statuses = drive(&h, "promotion", |s| s["phase"] == "promoted").await;
    assert!(statuses.iter().all(|s| *s == 200));
    let state = canary_state(&h).await;
    let moves: Vec<(&str, f64, f64)> = state["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["to"].as_str().unwrap(),
                t["from_percent"].as_f64().unwrap(),
                t["to_percent"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        moves,
        vec![("advanced", 30.0, 60.0), ("promoted", 60.0, 100.0)]
    );
    for t in state["transitions"].as_array().unwrap() {
        assert!(t["reason"].as_str().unwrap().contains("healthy"), "{t}");
        assert_eq!(t["manual"], false);
    }
    // Promoted: everyone is on the candidate.
    for u in 0..10 {
        let (_, headers, _) = h.chat(&user_body(&format!("after-{u}"))).await;
        assert_eq!(header(&headers, "x-keel-variant"), "sim-1");
    }
    assert_eq!(
        h.metric("keel_canary_weight_percent", &[("pool", "p")])
            .await,
        100.0
    );
}

#[tokio::test]
async fn canary_rolls_back_by_itself_on_an_injected_error_rate() {
    let f = fleet(&[("sim-0", "a"), ("sim-1", "a")]).await;
    let cfg = canary_config(
        &f,
        "",
        "steps = [50, 100]\nmin_requests = 4\ndwell_ms = 600000\nmax_error_rate = 0.2",
    );
    let h = Harness::start(f, &cfg).await;
    // Every candidate answer fails: each is failed over to the stable side, so clients only
    // ever see answers, and the candidate's error rate (1.0) rolls the canary back.
    add_fault(h.server(1), json!({"kind": "error", "status": 500})).await;
    let statuses = drive(&h, "the rollback", |s| s["phase"] == "rolled_back").await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let state = canary_state(&h).await;
    assert_eq!(state["weight_percent"], 0.0);
    let t = &state["transitions"][0];
    assert_eq!(t["to"], "rolled_back");
    assert_eq!(t["manual"], false);
    assert!(
        t["reason"].as_str().unwrap().contains("error rate 1.000"),
        "{t}"
    );
    assert_eq!(
        h.metric("keel_canary_transitions_total", &[("to", "rolled_back")])
            .await,
        1.0
    );
    // Rolled back: every user is served by the stable side, and the candidate gets nothing.
    let before = h.server(1).state.stats().requests;
    for u in 0..20 {
        let (status, headers, _) = h.chat(&user_body(&format!("driver-{u}"))).await;
        assert_eq!(status, 200);
        assert_eq!(header(&headers, "x-keel-variant"), "sim-0");
    }
    assert_eq!(h.server(1).state.stats().requests, before);
}

#[tokio::test]
async fn operators_promote_and_roll_back_with_the_admin_key() {
    let admin = "sk-keel-test-admin";
    let f = fleet(&[("sim-0", "a"), ("sim-1", "a")]).await;
    let hash = |k: &str| hash_text(&hash_secret(k));
    let top = format!(
        "[admin]\nkey_hash = \"{}\"\n\n[[keys]]\nid = \"a\"\nhash = \"{}\"\n",
        hash(admin),
        hash("sk-keel-test-key-a"),
    );
    let cfg = canary_config(
        &f,
        &top,
        "identity = \"key\"\nsteps = [50, 100]\nmin_requests = 100000",
    );
    let h = Harness::start(f, &cfg).await;
    let order = |what: &'static str, key: Option<&'static str>| {
        let mut r = keel_sim::http_client().post(h.url(&format!("/keel/admin/canary/p/{what}")));
        if let Some(k) = key {
            r = r.header("authorization", format!("Bearer {k}"));
        }
        async move { r.send().await.unwrap() }
    };
    let served_by = || async {
        let resp = keel_sim::http_client()
            .post(h.url("/v1/chat/completions"))
            .header("authorization", "Bearer sk-keel-test-key-a")
            .json(&chat_body("hi"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        header(resp.headers(), "x-keel-variant").to_owned()
    };
    // Key `a`'s side follows its hash at 50 %.
    let expected = if bucket("p", b"a") < 5_000 {
        "sim-1"
    } else {
        "sim-0"
    };
    assert_eq!(served_by().await, expected);

    assert_eq!(order("promote", None).await.status(), 401);
    assert_eq!(
        order("promote", Some("sk-keel-test-key-a")).await.status(),
        403
    );
    let r = order("promote", Some(admin)).await;
    assert_eq!(r.status(), 200);
    let doc: Value = r.json().await.unwrap();
    assert_eq!(doc["canary"]["phase"], "promoted");
    assert_eq!(served_by().await, "sim-1");

    let doc: Value = order("rollback", Some(admin)).await.json().await.unwrap();
    assert_eq!(doc["canary"]["phase"], "rolled_back");
    assert_eq!(doc["canary"]["transitions"][1]["manual"], true);
    assert_eq!(served_by().await, "sim-0");
    let r = order("rollback", Some(admin)).await;
    assert_eq!(r.status(), 200, "rolling back twice changes nothing");
    assert_eq!(
        keel_sim::http_client()
            .post(h.url("/keel/admin/canary/nope/promote"))
            .header("authorization", format!("Bearer {admin}"))
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
}
