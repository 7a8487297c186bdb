use super::lifecycle::warm_up_backoff_ms;
use super::views::{HealthNow, Views};
use super::*;
use keel_core::health::{HealthConfig, State};
use std::collections::HashMap;

fn pool(max_concurrency: u32) -> Arc<Pool> {
    pool_of(1, max_concurrency)
}

/// A pool of `variants` variants (`v0`, `v1`, …), each with `max_concurrency`.
fn pool_of(variants: usize, max_concurrency: u32) -> Arc<Pool> {
    pool_since(variants, max_concurrency, Instant::now())
}

/// [`pool_of`] whose clock began at `origin` (its `now_ms` is the time since).
fn pool_since(variants: usize, max_concurrency: u32, origin: Instant) -> Arc<Pool> {
    let mut text = String::from("[[pools]]\nname = \"p\"\n");
    for i in 0..variants {
        text.push_str(&format!(
            "[[pools.variants]]\nname = \"v{i}\"\nurl = \"http://127.0.0.1:9/v1\"\nprotocol = \"openai\"\nupstream_model = \"m\"\nmax_concurrency = {max_concurrency}\n"
        ));
    }
    let cfg = crate::Config::parse(&text, "t.toml", &HashMap::new()).unwrap();
    crate::config::install_crypto();
    Arc::new(Pool::new(
        cfg.pools[0].clone(),
        crate::upstream::client(
            1_000,
            metrics::Counter::noop(),
            &|_| metrics::Counter::noop(),
            &|_| None,
            &cfg.pools[0].variants,
        ),
        origin,
        Metrics::new(),
        UpstreamLimits {
            max_body_bytes: 1 << 20,
            max_event_bytes: 1 << 16,
        },
    ))
}

/// Many threads racing for the slots of a variant: never more held at once than its limit,
/// and every slot comes back when its guard drops.
#[test]
fn taking_a_slot_is_one_atomic_step() {
    let p = pool(3);
    let peak = AtomicU32::new(0);
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                for _ in 0..2_000 {
                    if let Some(slot) = p.try_enter(0, Priority::Normal) {
                        let now = p.variants[0].in_flight.load(Ordering::Relaxed);
                        peak.fetch_max(now, Ordering::Relaxed);
                        drop(slot);
                    }
                }
            });
        }
    });
    assert!(peak.load(Ordering::Relaxed) <= 3, "peak {peak:?}");
    assert_eq!(p.variants[0].in_flight.load(Ordering::Relaxed), 0);
    let held: Vec<_> = (0..5)
        .filter_map(|_| p.try_enter(0, Priority::High))
        .collect();
    assert_eq!(held.len(), 3);
}

/// The variant's published view is what its state says.
fn assert_published(p: &Pool, i: usize) {
    let st = p.variant_state(i).clone();
    let live = p.live(i);
    assert_eq!(live.est, st.health.est);
    assert_eq!(live.availability, st.availability);
    assert_eq!(live.restarting, st.restarting_since.is_some());
    assert_eq!(live.p50_ttft_ms, st.health.ttft_quantile_ms(0.5));
    assert_eq!(live.p95_ttft_ms, st.health.p95_ttft_ms());
}

/// A view published during slow start reads, at every later moment, exactly the figures
/// computed afresh from its estimates then (the ramp is the only figure that moves).
#[test]
fn a_slow_start_view_reads_the_figures_computed_afresh() {
    let p = pool(4);
    let hc = HealthConfig {
        slow_start_ms: 10_000,
        ..p.cfg.health
    };
    let mut st = p.variant_state(0).clone();
    for t in 0..20 {
        st.health.record_ttft(t * 50, 100.0 + t as f64, &hc);
        st.health.record_outcome(t * 50, t % 7 != 0, &hc);
    }
    st.health.est.state = State::SlowStart { since_ms: 1_000 };
    let live = Published::of(&st, 0.9, &hc, 1_000);
    assert!(
        live.steady.is_some(),
        "fresh estimates publish steady figures"
    );
    let mut weights = Vec::new();
    for now in (1_000..=12_000).step_by(500) {
        let afresh = HealthNow::of(&live.est, now, &hc);
        assert_eq!(live.health_at(now, &hc), afresh, "at {now} ms");
        weights.push(afresh.weight);
    }
    assert!(
        weights.first() < weights.last(),
        "the ramp moved: {weights:?}"
    );
}

/// A dead variant is not warmed every monitor tick: failed warm-ups back off, 100 ms
/// doubling to a second, and one that answers starts afresh.
#[test]
fn failed_warm_ups_back_off() {
    assert_eq!(
        (0..7).map(warm_up_backoff_ms).collect::<Vec<_>>(),
        [0, 100, 200, 400, 800, 1000, 1000]
    );
    let p = pool(4);
    let warm_up = |p: &Pool| {
        p.maintenance()
            .into_iter()
            .any(|m| matches!(m, Maintenance::WarmUp(0)))
    };
    assert!(warm_up(&p), "a new variant warms up");
    p.maintenance_done(Maintenance::WarmUp(0), false, None, None);
    assert_eq!(p.variant_state(0).warm_up_failures, 1);
    // Its backoff not yet over (the failure dated ahead of the clock, so the test does not
    // depend on how fast it runs): nothing due.
    p.variant_state(0).warm_up_failed_at_ms = p.now_ms() + 60_000;
    assert!(!warm_up(&p));
    p.variant_state(0).warm_up_failed_at_ms = 0;
    p.variant_state(0).warm_up_failures = 0;
    assert!(warm_up(&p), "due again once the backoff is over");
    p.maintenance_done(Maintenance::WarmUp(0), true, Some(50.0), None);
    assert_eq!(p.variant_state(0).warm_up_failures, 0);
}

/// An ejected variant that asked for time (`retry-after`) is probed when that time is over,
/// not each probe interval meanwhile: the probe would only be refused.
#[test]
fn an_ejected_variant_is_probed_once_its_retry_after_is_over() {
    // A clock a minute old: the variant's last probe (at 0) is long past its interval.
    let p = pool_since(1, 4, Instant::now() - std::time::Duration::from_secs(60));
    let probed = |p: &Pool| {
        p.maintenance()
            .into_iter()
            .filter(|m| matches!(m, Maintenance::Probe(0)))
            .inspect(|m| p.maintenance_skipped(*m))
            .count()
    };
    let now = p.now_ms();
    p.update(0, |st| {
        st.health.est.state = State::Ejected {
            since_ms: 0,
            last_probe_ms: 0,
        }
    });
    // The server's 429 said two minutes: nothing is due while they last, however long the
    // variant has gone without a probe.
    p.cool_down(0, now, 120_000);
    assert_eq!(probed(&p), 0);
    assert!(!p.available(0, p.now_ms()));
    // Its cooldown over (dated back, so the test does not depend on how fast it runs): probed.
    p.update(0, |st| st.availability.cooldown_until_ms = 0);
    assert_eq!(probed(&p), 1);
}

/// Requests read the published views, never the state: every kind of update must publish.
#[test]
fn every_update_publishes_the_variants_view() {
    let p = pool(4);
    assert_published(&p, 0);
    type Step = Box<dyn Fn(&Pool)>;
    let steps: Vec<(&str, Step)> = vec![
        (
            "attempt",
            Box::new(|p| p.record_attempt(0, true, Some(120.0), None)),
        ),
        (
            "failure",
            Box::new(|p| p.record_attempt(0, false, None, None)),
        ),
        (
            "stream",
            Box::new(|p| p.record_stream(0, &[10.0, 30.0, 12.0].into_iter().collect())),
        ),
        ("late ttft", Box::new(|p| p.record_late_ttft(0, 400.0))),
        (
            "scrape",
            Box::new(|p| p.record_scrape(0, Some(0.5), Some(3.0))),
        ),
        ("cooldown", Box::new(|p| p.cool_down(0, p.now_ms(), 5_000))),
        (
            "credential",
            Box::new(|p| p.mark_credential_broken(0, p.now_ms())),
        ),
        ("success", Box::new(|p| p.record_success(0))),
        ("loading", Box::new(|p| p.mark_loading(0))),
        (
            "restarting",
            Box::new(|p| {
                p.mark_restarting(0);
            }),
        ),
        ("ready", Box::new(|p| p.mark_ready(0))),
        (
            "maintenance",
            Box::new(|p| {
                for m in p.maintenance() {
                    p.maintenance_done(m, true, Some(90.0), None);
                }
            }),
        ),
    ];
    for (what, step) in steps {
        let before = p.live(0);
        step(&p);
        assert_published(&p, 0);
        assert!(
            format!("{before:?}") != format!("{:?}", p.live(0)) || what == "maintenance",
            "{what} changed nothing: the step does not test its publication"
        );
    }
}

/// A request for pool `p`.
/// The plan `p` makes for `req` now (panics when selection makes none).
fn plan_of(p: &Pool, req: &CanonicalRequest) -> Vec<usize> {
    use crate::pipeline::selection::{select, Controls, Selection};
    match select(p, req, Controls::default(), "t").0 {
        Selection::Plan(order) => order,
        other => panic!("no plan: {other:?}"),
    }
}

fn request() -> CanonicalRequest {
    keel_core::request::parse(
        keel_core::protocol::Endpoint::ChatCompletions,
        br#"{"model":"p","messages":[{"role":"user","content":"hi"}]}"#,
    )
    .unwrap()
}

/// Decisions and updates from many threads at once: the views end as the states say (an
/// update publishes before it lets go of its variant, so the last one published wins).
#[test]
fn concurrent_updates_leave_every_view_current() {
    let p = pool_of(4, 1_000);
    let req = request();
    std::thread::scope(|s| {
        for t in 0..4u32 {
            let (p, req) = (&p, &req);
            s.spawn(move || {
                for n in 0..500u32 {
                    let controls = crate::pipeline::selection::Controls {
                        force_variant: None,
                        preference: Default::default(),
                        min_tier: None,
                        priority: Priority::Normal,
                    };
                    let (sel, _) = crate::pipeline::selection::select(p, req, controls, "t");
                    let crate::pipeline::selection::Selection::Plan(order) = sel else {
                        panic!("no plan: {sel:?}");
                    };
                    let ttft = 50.0 + f64::from((t * 500 + n) % 97);
                    p.record_attempt(order[0], n % 50 != 0, Some(ttft), None);
                    p.record_stream(order[0], &[10.0, 11.0].into_iter().collect());
                }
            });
        }
    });
    for i in 0..4 {
        assert_published(&p, i);
    }
}

/// A thread's cached views are brought up to date by its next decision: a variant cooled
/// down by another thread after this one last decided is out of this one's next plan, and
/// back in it once the cooldown is lifted.
#[test]
fn a_decision_reads_views_published_since_its_thread_last_decided() {
    let p = pool_of(3, 1_000);
    let req = request();
    let plan = || plan_of(&p, &req);
    assert_eq!(
        plan().len(),
        3,
        "this thread's cache filled with every variant"
    );
    std::thread::scope(|s| {
        s.spawn(|| p.cool_down(1, p.now_ms(), 60_000));
    });
    for _ in 0..20 {
        let order = plan();
        assert!(!order.contains(&1), "a stale view of variant 1: {order:?}");
    }
    std::thread::scope(|s| {
        s.spawn(|| p.variant_state(1).availability = Availability::default());
    });
    // Lifting a cooldown by hand publishes nothing; an update of the variant does.
    std::thread::scope(|s| {
        s.spawn(|| p.record_success(1));
    });
    assert_eq!(plan().len(), 3, "variant 1 back after its view changed");

    // While another holder has this thread's shard of the cache, a decision loads the
    // views instead of waiting (here the holder is this thread itself: waiting would never
    // end), and reads them as current.
    let shard = p.views.own();
    p.cool_down(2, p.now_ms(), 60_000);
    let sorted = |mut order: Vec<usize>| {
        order.sort_unstable();
        order
    };
    assert!(matches!(p.views(), Views::Loaded(_)));
    assert_eq!(sorted(plan()), [0, 1]);
    drop(shard);
    assert!(matches!(p.views(), Views::Cached(_)));
    assert_eq!(sorted(plan()), [0, 1]);
}

/// A pool whose variants all joined together (a start, a reload) has hedge targets from its
/// first request: each is at the bottom of its slow-start ramp, which is no judgement of its
/// health. A variant its health floors is still no target.
#[test]
fn variants_in_slow_start_together_take_hedges() {
    let p = pool_of(3, 8);
    for i in 0..3 {
        while !matches!(p.live(i).est.state, State::SlowStart { .. }) {
            p.maintenance_done(Maintenance::WarmUp(i), true, Some(60.0), None);
        }
    }
    let hc = p.cfg.health;
    let now = p.now_ms();
    assert!(
        p.live(1).est.weight(now, &hc) <= keel_core::health::FLOOR,
        "the ramp starts at the floor"
    );
    assert!(
        p.hedge_target(&[1, 2]).is_some(),
        "a hedge target at the start"
    );
    // Variant 1's answers fail: its health floors it, and it is no target.
    p.update(1, |st| {
        for _ in 0..20 {
            st.health.record_outcome(now, false, &hc);
        }
    });
    assert_eq!(p.hedge_target(&[1]), None);
    assert_eq!(p.hedge_target(&[1, 2]), Some(2));
}

/// A hedge's winner streams the whole answer, so the target is judged by its decode pace too:
/// of two variants answering first tokens alike, the hedge goes to the one that decodes at its
/// peers' pace, not to one four times slower (which selection leaves out of the draw too).
#[test]
fn a_hedge_goes_to_a_variant_that_decodes_at_its_peers_pace() {
    let p = pool_of(3, 8);
    let hc = p.cfg.health;
    let now = p.now_ms();
    let gaps = |ms: f64| -> keel_core::stream_watch::Gaps { std::iter::repeat_n(ms, 39).collect() };
    for (i, gap) in [(0, 8.0), (1, 32.0), (2, 8.0)] {
        p.update(i, |st| {
            st.health = keel_core::health::VariantHealth::new(0);
            for _ in 0..5 {
                st.health.record_ttft(now, 20.0, &hc);
            }
        });
        p.record_stream(i, &gaps(gap));
    }
    assert_eq!(p.answer_tokens(None), 40.0);
    assert_eq!(p.answer_tokens(Some(10)), 10.0);
    // Variant 2 has a request running, variant 1 none: on first tokens alone, 1 is the target.
    p.variants[2].in_flight.fetch_add(1, Ordering::Relaxed);
    assert_eq!(p.hedge_target(&[1, 2]), Some(2));
    // Alike in pace, the idle one is.
    p.record_stream(1, &gaps(8.0));
    p.update(1, |st| st.health.record_probe_gaps(now, &gaps(8.0), &hc));
    assert_eq!(p.hedge_target(&[1, 2]), Some(1));
}

/// A variant's first answers do not set its hedge delay: seven samples, one of them a heavy
/// draw, hold their P95 at that draw, so the pool's P95 stands in until the variant's own
/// samples place its quantile.
#[test]
fn a_hedge_delay_waits_for_the_samples_that_place_it() {
    let p = pool_of(3, 8);
    let hc = p.cfg.health;
    let now = p.now_ms();
    // The pool's answers so far: 60–99 ms, 80 of them.
    for i in 0..80 {
        p.record_pool_ttft(now, 60.0 + (i % 40) as f64);
    }
    p.update(1, |st| {
        st.health = keel_core::health::VariantHealth::new(0);
        st.health.record_ttft(now, 600.0, &hc);
        for _ in 0..6 {
            st.health.record_ttft(now, 60.0, &hc);
        }
    });
    let pool_p95 = p.pool_ttft(0.95).unwrap();
    assert_eq!(pool_p95, 97.0);
    assert_eq!(p.hedge_delay_ms(1, 0), Some(97), "not its one heavy draw");
    // Forty samples of its own place its P95 below its two slowest: from now on its own.
    p.update(1, |st| {
        for _ in 0..33 {
            st.health.record_ttft(now, 120.0, &hc);
        }
    });
    assert_eq!(p.hedge_delay_ms(1, 0), Some(120));
}

/// A long prompt is raced once it is late for a prompt of its size: its hedge delay adds the
/// longer prefill the target's client samples show; a short prompt's stays the quantile's, and
/// so does any prompt's on a variant whose samples show no prefill rate.
#[test]
fn a_long_prompt_waits_for_its_prefill_before_a_hedge() {
    let p = pool_of(3, 8);
    // Client answers on variant 1: 40 ms plus 0.1 ms a prompt token, prompts of 20 and 2,000.
    for i in 0..60u64 {
        let tokens = if i % 6 == 0 { 2000 } else { 20 };
        let ttft = 40.0 + (i % 5) as f64 + 0.1 * tokens as f64;
        p.record_attempt(1, true, Some(ttft), Some(tokens));
    }
    // Variant 2: the same answers, without their prompts' sizes (as probes' are recorded).
    for i in 0..60u64 {
        let tokens = if i % 6 == 0 { 2000 } else { 20 };
        let ttft = 40.0 + (i % 5) as f64 + 0.1 * tokens as f64;
        p.record_attempt(2, true, Some(ttft), None);
    }
    let short = p.hedge_delay_ms(1, 20).unwrap();
    let long = p.hedge_delay_ms(1, 2000).unwrap();
    // The mean prompt is 350 tokens: 1,650 more at 0.1 ms, less the fit's margin.
    assert!(
        long > short + 150 && long <= short + 165,
        "{short} → {long}"
    );
    assert_eq!(
        p.hedge_delay_ms(1, 300),
        Some(short),
        "a prompt under the mean"
    );
    assert_eq!(p.hedge_delay_ms(2, 2000), p.hedge_delay_ms(2, 20));
}

/// The variants held back from the policy (warming, ejected) end the plan as fallbacks, the
/// warming before the ejected whatever their places in the pool; a settled pool's plan has
/// only the policy's variants.
#[test]
fn a_plan_ends_with_the_warming_variants_then_the_ejected() {
    let p = pool_of(4, 1_000);
    let req = request();
    let plan = || plan_of(&p, &req);
    let set = |i: usize, state: State| p.update(i, |st| st.health.est.state = state);
    let ejected = State::Ejected {
        since_ms: 0,
        last_probe_ms: 0,
    };
    set(0, State::Healthy);
    set(1, ejected);
    set(2, State::Warming { remaining: 1 });
    set(3, State::Healthy);
    let order = plan();
    assert_eq!(order.len(), 4, "{order:?}");
    assert_eq!(&order[2..], [2, 1], "{order:?}");
    set(1, State::Healthy);
    set(2, State::Healthy);
    assert_eq!(plan().len(), 4);
    set(1, ejected);
    // A variant still loading its model is not even a fallback.
    p.update(2, |st| {
        st.health.est.state = State::Warming { remaining: 1 };
        st.health.est.loading = true;
    });
    assert_eq!(&plan()[2..], [1]);
}
