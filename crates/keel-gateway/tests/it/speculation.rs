//! Speculative continuation: a stream that goes quiet for longer than its variant's gaps
//! explain gets a continuation raced against it; the first to produce the next token keeps the
//! stream, byte for byte.

use serde_json::{json, Value};

use keel_core::sse::SseEvent;

use crate::harness::*;

/// Servers with 8 ms gaps and replies of 80+ tokens (long enough for slowness checks), one per
/// weight, in a pool with `extra` settings (its policy among them; P2C by default).
async fn long_reply_fleet(weights: &[u32], extra: &str) -> Harness {
    let server = |i: usize| keel_sim::ServerConfig {
        name: format!("sim-{i}"),
        seed: Some(i as u64 + 1),
        gap_ms: 8.0,
        ..keel_sim::ServerConfig::fast("s")
    };
    let fleet = keel_sim::Fleet::start(&keel_sim::FleetConfig {
        generation: keel_sim::GenerationConfig {
            min_reply_tokens: 80,
            mean_reply_tokens: 100,
        },
        servers: (0..weights.len()).map(server).collect(),
    })
    .await
    .unwrap();
    let mut cfg = format!(
        "allow_force_variant = true\n[[pools]]\nname = \"p\"\nhedge = \"off\"\n{extra}\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n"
    );
    for (i, w) in weights.iter().enumerate() {
        let s = fleet.get(i);
        cfg.push_str(&variant(&s.name, &s.openai_base(), "openai", *w));
    }
    Harness::start(fleet, &cfg).await
}

/// Two simulated servers with 8 ms inter-token gaps; sim-0 has served three complete streams,
/// so keel knows its gaps.
async fn fleet_with_known_gaps() -> Harness {
    let cfg = keel_sim::ServerConfig {
        gap_ms: 8.0,
        ..keel_sim::ServerConfig::fast("s")
    };
    let fleet = keel_sim::Fleet::start_n(2, cfg).await.unwrap();
    let pool = pool_over(&fleet, "p", "openai", 1, "hedge = \"off\"");
    let h = Harness::start(fleet, &format!("allow_force_variant = true\n{pool}")).await;
    warm_sim0(&h).await;
    h
}

/// Three complete streams from sim-0, so that keel knows its gaps.
async fn warm_sim0(h: &Harness) {
    for _ in 0..3 {
        let r = forced_sim0(h, &stream_body("warm up")).await;
        assert_eq!(read_stream(r).await.last().unwrap().data, "[DONE]");
    }
}

/// Three complete streams on each of the `n` variants: gap statistics and first-token times
/// for every one of them.
async fn warm_all(h: &Harness, n: usize) {
    for i in 0..n {
        for k in 0..3 {
            let body = stream_body(&format!("warm up {k}"));
            let resp = h
                .post_with(
                    "/v1/chat/completions",
                    &[("x-keel-force-variant", &format!("sim-{i}"))],
                    &body,
                )
                .await;
            read_stream(resp).await;
        }
    }
}

/// Three warmed variants: sim-0 stalls after 6 tokens, sim-1 (by far the cheapest, so a stream
/// forced onto sim-0 continues there first) has `fault`, sim-2 is healthy. The pool, a stream
/// request about `topic`, and the text sim-2 answers it with.
async fn stalled_with_cheapest_failing(fault: Value, topic: &str) -> (Harness, Value, String) {
    let h = long_reply_fleet(&[1, 10, 1], "").await;
    warm_all(&h, 3).await;
    add_fault(h.server(0), json!({"kind": "stall", "after_tokens": 6})).await;
    add_fault(h.server(1), fault).await;
    let body = stream_body(&format!("tell me a long story about the {topic}"));
    let want = want_text(&reference(&h, 2, "/v1/chat/completions", &body).await);
    (h, body, want)
}

fn migration_note(events: &[SseEvent]) -> Option<String> {
    events
        .iter()
        .filter(|e| e.comment_only)
        .map(|e| String::from_utf8_lossy(&e.raw).trim().to_owned())
        .find(|c| c.contains("keel migrated"))
}

/// The silence (ms) before a stall's continuation took over, from the seam note; printed, so
/// `--no-capture` shows the figure.
fn silent_ms(note: &str) -> u64 {
    let ms = note
        .rsplit("silent_ms=")
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no silent_ms in {note}"));
    eprintln!("continued after {ms} ms of silence ({note})");
    ms
}

fn want_text(reference: &Value) -> String {
    reference["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn a_stall_on_a_variant_without_gap_statistics_is_raced_on_its_siblings_figures() {
    // Only sim-0 has served streams; sim-1 has no gap statistics of its own yet. A stall on
    // sim-1 is still raced after a few gaps (sim-0's figures), not after the hard threshold.
    let h = fleet_with_known_gaps().await;
    add_fault(h.server(1), json!({"kind": "stall", "after_tokens": 6})).await;
    let body = stream_body("a story told by a variant keel has not measured");
    let want = want_text(&reference(&h, 0, "/v1/chat/completions", &body).await);
    let resp = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-force-variant", "sim-1")],
            &body,
        )
        .await;
    let events = read_stream(resp).await;
    assert_eq!(openai_stream_text(&events), want, "byte for byte");
    let note = migration_note(&events).expect("a migration");
    assert!(note.contains("from=sim-1 to=sim-0 reason=stall"), "{note}");
    let silent = silent_ms(&note);
    assert!(
        silent < 250,
        "continued after {silent} ms of silence: {note}"
    );
}

#[tokio::test]
async fn a_stalled_stream_is_continued_after_a_few_gaps_not_the_stall_threshold() {
    let h = fleet_with_known_gaps().await;
    add_fault(h.server(0), json!({"kind": "stall", "after_tokens": 6})).await;
    let body = stream_body("tell me a long story about the sea");
    let want = want_text(&reference(&h, 1, "/v1/chat/completions", &body).await);
    let events = read_stream(forced_sim0(&h, &body).await).await;
    assert_eq!(openai_stream_text(&events), want, "byte for byte");
    assert_eq!(events.iter().filter(|e| e.data == "[DONE]").count(), 1);
    let note = migration_note(&events).expect("a migration");
    assert!(note.contains("from=sim-0 to=sim-1 reason=stall"), "{note}");
    let silent = silent_ms(&note);
    // The hard stall threshold is at least 500 ms; the race starts after 4 × the gaps' P99
    // (at least 40 ms). Half the hard threshold leaves room for a loaded machine.
    assert!(
        silent < 250,
        "continued after {silent} ms of silence: {note}"
    );
    let stalled = [
        ("variant", "sim-0"),
        ("kind", "first"),
        ("outcome", "stall"),
    ];
    assert_eq!(h.metric("keel_attempts_total", &stalled).await, 1.0);
    let won = [
        ("variant", "sim-1"),
        ("kind", "continuation"),
        ("outcome", "ok"),
    ];
    assert_eq!(h.metric("keel_attempts_total", &won).await, 1.0);
}

#[tokio::test]
async fn a_pause_that_ends_first_keeps_the_stream_and_cancels_the_race() {
    let h = fleet_with_known_gaps().await;
    // sim-0 pauses 150 ms after 6 tokens and then goes on; sim-1 is slow to a first token, so
    // the original resumes before the continuation could answer.
    add_fault(
        h.server(0),
        json!({"kind": "stall", "after_tokens": 6, "ms": 150}),
    )
    .await;
    add_fault(h.server(1), json!({"kind": "delay", "ms": 2000})).await;
    let body = stream_body("tell me a long story about the sea");
    let want = want_text(&reference(&h, 0, "/v1/chat/completions", &body).await);
    let events = read_stream(forced_sim0(&h, &body).await).await;
    assert_eq!(openai_stream_text(&events), want);
    assert_eq!(migration_note(&events), None, "no migration");
    let cancelled = [
        ("variant", "sim-1"),
        ("kind", "continuation"),
        ("outcome", "race_cancelled"),
    ];
    // At least the race the pause started; a loaded machine's scheduling hiccup later in the
    // stream may start (and lose) another one.
    let races = h.metric("keel_attempts_total", &cancelled).await;
    assert!(races >= 1.0, "the pause started no race ({races})");
    let ok = [("variant", "sim-0"), ("kind", "first"), ("outcome", "ok")];
    assert_eq!(h.metric("keel_attempts_total", &ok).await, 4.0);
}

#[tokio::test]
async fn slowness_never_spends_the_migration_a_stall_needs() {
    // Found by the soak: with max_migrations = 1, a migration for slowness used to leave none
    // for a stall that followed, and the stream ended with an error although sim-2 was fine.
    // Smooth weighted round robin picks sim-1 (weight 100) for its first 34 requests and
    // orders fallbacks by weight, ties by index: after the forced sim-0, sim-1 then sim-2.
    let h = long_reply_fleet(&[1, 100, 1], "policy = \"round_robin\"\nmax_migrations = 1").await;
    for v in ["sim-0", "sim-1"] {
        for _ in 0..3 {
            let r = h
                .post_with(
                    "/v1/chat/completions",
                    &[("x-keel-force-variant", v)],
                    &stream_body("warm up"),
                )
                .await;
            assert_eq!(read_stream(r).await.last().unwrap().data, "[DONE]");
        }
    }
    add_fault(h.server(0), json!({"kind": "slowdown", "factor": 4})).await;
    add_fault(h.server(1), json!({"kind": "stall", "after_tokens": 5})).await;
    let body = stream_body("tell me a long story about the sea");
    let want = want_text(&reference(&h, 2, "/v1/chat/completions", &body).await);
    let events = read_stream(forced_sim0(&h, &body).await).await;
    let notes: Vec<String> = events
        .iter()
        .filter(|e| e.comment_only)
        .map(|e| String::from_utf8_lossy(&e.raw).trim().to_owned())
        .filter(|c| c.contains("keel migrated"))
        .collect();
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert!(
        notes[0].contains("from=sim-0 to=sim-1 reason=slow"),
        "{notes:?}"
    );
    assert!(
        notes[1].contains("from=sim-1 to=sim-2 reason=stall"),
        "{notes:?}"
    );
    assert_eq!(openai_stream_text(&events), want);
    assert_eq!(events.last().unwrap().data, "[DONE]");
}

#[tokio::test]
async fn a_slow_stream_with_nowhere_to_go_goes_on_where_it_is() {
    // Found by the soak: a migration for slowness that could not start ended the stream with
    // an error although the slow stream was still producing.
    let h = long_reply_fleet(&[1, 1], "policy = \"round_robin\"").await;
    warm_sim0(&h).await;
    add_fault(h.server(0), json!({"kind": "slowdown", "factor": 4})).await;
    add_fault(h.server(1), json!({"kind": "error", "status": 503})).await;
    let body = stream_body("tell me a long story about the sea");
    let want = want_text(&reference(&h, 0, "/v1/chat/completions", &body).await);
    let events = read_stream(forced_sim0(&h, &body).await).await;
    assert_eq!(
        openai_stream_text(&events),
        want,
        "the whole answer, from sim-0"
    );
    assert_eq!(events.last().unwrap().data, "[DONE]");
    assert_eq!(migration_note(&events), None);
    let tried = [
        ("variant", "sim-1"),
        ("kind", "continuation"),
        ("outcome", "status_503"),
    ];
    assert_eq!(h.metric("keel_attempts_total", &tried).await, 1.0);
    let failed = [("reason", "slow"), ("outcome", "failed")];
    assert_eq!(h.metric("keel_migrations_total", &failed).await, 1.0);
}

/// A pause longer than the variant's gaps explain (its adaptive stall threshold, 500 ms here)
/// but shorter than `stall_ms` is a stall only if the stream can go on elsewhere: with nowhere
/// to go, the stream waits where it is, and the client gets the whole answer, not an error.
/// (An overloaded fleet pauses every stream so; ending them for want of a migration would turn
/// slowness into errors.)
#[tokio::test]
async fn a_pause_with_nowhere_to_go_waits_where_it_is() {
    let h = long_reply_fleet(&[1, 1], "policy = \"round_robin\"").await;
    warm_sim0(&h).await;
    add_fault(
        h.server(0),
        json!({"kind": "stall", "after_tokens": 6, "ms": 2500, "count": 1}),
    )
    .await;
    add_fault(h.server(1), json!({"kind": "error", "status": 503})).await;
    let body = stream_body("tell me a long story about the sea");
    let events = read_stream(forced_sim0(&h, &body).await).await;
    assert_eq!(events.last().unwrap().data, "[DONE]", "{events:?}");
    assert_eq!(migration_note(&events), None);
    // sim-0 serves the same answer again without the pause: the one the client got.
    let want = want_text(&reference(&h, 0, "/v1/chat/completions", &body).await);
    assert_eq!(openai_stream_text(&events), want);
    let failed = [("reason", "stall"), ("outcome", "failed")];
    assert!(h.metric("keel_migrations_total", &failed).await >= 1.0);
    let stalled = [("variant", "sim-0"), ("outcome", "stall")];
    assert_eq!(h.metric("keel_attempts_total", &stalled).await, 0.0);
}

/// A stream silent for all of `stall_ms` has stalled, whether or not it can go on elsewhere:
/// with nowhere to go, the client gets an error event once that silence is over.
#[tokio::test]
async fn a_silence_of_stall_ms_with_nowhere_to_go_ends_with_an_error() {
    let h = long_reply_fleet(
        &[1, 1],
        "policy = \"round_robin\"\ntimeouts = { stall_ms = 1500 }",
    )
    .await;
    warm_sim0(&h).await;
    add_fault(h.server(0), json!({"kind": "stall", "after_tokens": 6})).await;
    add_fault(h.server(1), json!({"kind": "error", "status": 503})).await;
    let started = std::time::Instant::now();
    let events = read_stream(forced_sim0(&h, &stream_body("tell me a story")).await).await;
    let waited = started.elapsed();
    assert_ne!(events.last().unwrap().data, "[DONE]");
    assert!(
        events
            .iter()
            .any(|e| e.data.contains("the response is incomplete")),
        "{events:?}"
    );
    println!("the error came after {waited:?}");
    assert!(
        waited >= std::time::Duration::from_millis(1500),
        "{waited:?}"
    );
    let stalled = [("variant", "sim-0"), ("outcome", "stall")];
    assert_eq!(h.metric("keel_attempts_total", &stalled).await, 1.0);
}

/// A continuation whose variant hangs before its first token is given up once it is later than
/// that variant's first tokens usually are, and the next candidate continues the stream: the
/// stream does not wait for `first_token_ms` (15 s) on it while the stalled original has
/// nothing more to give.
#[tokio::test]
async fn a_continuation_that_hangs_is_given_up_for_the_next_candidate() {
    let (h, body, want) = stalled_with_cheapest_failing(json!({"kind": "hang"}), "river").await;
    let resp = forced_sim0(&h, &body).await;
    let id = header(resp.headers(), "x-keel-request-id").to_owned();
    let events = read_stream(resp).await;
    assert_eq!(openai_stream_text(&events), want, "byte for byte");
    let url = h.url(&format!("/keel/decisions/{id}"));
    let mut record = None;
    wait_for!("the decision record", {
        let r = keel_sim::http_client().get(&url).send().await.unwrap();
        if r.status() == 200 {
            record = Some(r.json::<Value>().await.unwrap());
        }
        record.is_some()
    });
    let record = record.unwrap();
    let attempts: Vec<(String, String)> = record["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["variant"].as_str().unwrap().to_owned(),
                a["outcome"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    eprintln!("attempts: {attempts:?}, total {} ms", record["total_ms"]);
    let on = |v: &str| {
        attempts
            .iter()
            .find(|(name, _)| name == v)
            .map(|(_, o)| o.as_str())
    };
    assert_eq!(on("sim-1"), Some("race_cancelled"), "{attempts:?}");
    assert_eq!(on("sim-2"), Some("ok"), "{attempts:?}");
}

/// A raced continuation that fails before its first token (its variant just died: the
/// connection is reset) gives way to the next candidate at once: the stream is continued
/// after a few gaps of silence, not after the hard stall threshold.
#[tokio::test]
async fn a_continuation_that_fails_gives_way_to_the_next_candidate() {
    let (h, body, want) = stalled_with_cheapest_failing(json!({"kind": "reset"}), "mountain").await;
    let events = read_stream(forced_sim0(&h, &body).await).await;
    assert_eq!(openai_stream_text(&events), want, "byte for byte");
    let note = migration_note(&events).expect("a migration");
    assert!(note.contains("from=sim-0 to=sim-2 reason=stall"), "{note}");
    let silent = silent_ms(&note);
    // The hard stall threshold is at least 500 ms (the test waited it out before).
    assert!(
        silent < 250,
        "continued after {silent} ms of silence: {note}"
    );
    let failed = [("variant", "sim-1"), ("kind", "continuation")];
    assert_eq!(h.metric("keel_attempts_total", &failed).await, 1.0);
}
