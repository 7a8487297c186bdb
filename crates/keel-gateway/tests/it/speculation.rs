//! Speculative continuation: a stream that goes quiet for longer than its variant's gaps
//! explain gets a continuation raced against it; the first to produce the next token keeps the
//! stream, byte for byte.

use serde_json::{json, Value};

use keel_core::sse::SseEvent;

use crate::harness::*;

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
    for _ in 0..3 {
        let events = read_stream(forced_sim0(&h, &stream_body("warm up")).await).await;
        assert_eq!(events.last().unwrap().data, "[DONE]");
    }
    h
}

fn migration_note(events: &[SseEvent]) -> Option<String> {
    events
        .iter()
        .filter(|e| e.comment_only)
        .map(|e| String::from_utf8_lossy(&e.raw).trim().to_owned())
        .find(|c| c.contains("keel migrated"))
}

fn want_text(reference: &Value) -> String {
    reference["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned()
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
    let silent: u64 = note
        .rsplit("silent_ms=")
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{note}"));
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
    assert_eq!(h.metric("keel_attempts_total", &cancelled).await, 1.0);
    let ok = [("variant", "sim-0"), ("kind", "first"), ("outcome", "ok")];
    assert_eq!(h.metric("keel_attempts_total", &ok).await, 4.0);
}
