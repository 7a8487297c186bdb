use super::*;

fn rec(pool: &str, end_ms: i64, key: u64, norm: u64, template: u64) -> Record {
    Record {
        pool: pool.into(),
        end_ms,
        total_ms: 100.0,
        ok: true,
        key_raw: Some(key),
        key_norm: Some(norm),
        template: Some(template),
        deterministic: true,
        temperature: Some(0.0),
        tools: false,
        tokens_in: 10,
        tokens_out: 20,
        spend_usd: 0.001,
    }
}

#[test]
fn times_parse_and_print() {
    assert_eq!(parse_time_ms("1970-01-01T00:00:00Z"), Some(0));
    assert_eq!(parse_time_ms("1970-01-01T01:00:00.5Z"), Some(3_600_500));
    assert_eq!(
        parse_time_ms("2026-12-04T19:00:00.123Z"),
        Some(1_796_410_800_123)
    );
    assert_eq!(
        parse_time_ms("2026-12-04T21:00:00+02:00"),
        Some(1_796_410_800_000)
    );
    assert_eq!(parse_time_ms("2026-12-04"), Some(1_796_342_400_000));
    for bad in [
        "",
        "yesterday",
        "2026-13-01",
        "2026-12-04T25:00:00Z",
        "2026-12-04T19:00:00Q",
    ] {
        assert_eq!(parse_time_ms(bad), None, "{bad}");
    }
    for d in [-1000, 0, 59, 11_016, 20_089, 30_000] {
        let (y, m, dd) = civil_from_days(d);
        assert_eq!(days_from_civil(y, m, dd), d);
    }
    assert_eq!(hour_label(1_796_410_800_123 / 3_600_000), "2026-12-04T19");
}

#[test]
fn repeats_templates_and_the_replay_add_up() {
    let mut a = Analyzer::new(Options::default());
    // Key 1 four times (two differ only raw), key 2 once, in one hour, 10 s apart.
    let keys = [(1, 1), (1, 1), (5, 1), (6, 1), (2, 2)];
    for (i, (raw, norm)) in keys.iter().enumerate() {
        a.add(&rec("p", 1_000_000 + i as i64 * 10_000, *raw, *norm, 7));
    }
    // Another pool: the same keys are not the same entries.
    a.add(&rec("q", 1_050_000, 1, 1, 8));
    let r = a.finish();
    let p = r.pools.iter().find(|p| p.pool == "p").unwrap();
    assert_eq!(p.figures.requests, 5);
    assert_eq!(p.figures.repeats_raw, 1);
    assert_eq!(p.figures.repeats_normalized, 3);
    assert_eq!(p.figures.templates, 1);
    assert_eq!(p.figures.template_entropy_bits, 0.0);
    // As configured (raw keys, 5 min): one hit; normalized at 5 min: three.
    assert_eq!(p.figures.simulated.hits, 1);
    // Scenario 4: the second TTL candidate (5 min), normalized.
    assert_eq!(p.by_scenario[4].hits, 3);
    assert!((p.figures.simulated.spend_usd - 0.001).abs() < 1e-9);
    assert_eq!(p.hours.len(), 1);
    assert_eq!(p.hours[0].figures.simulated.hits, 1);
    let q = r.pools.iter().find(|p| p.pool == "q").unwrap();
    assert_eq!(q.figures.simulated.hits, 0);
    // The normalization recommendation names the gain.
    let n = r
        .recommendations
        .iter()
        .find(|x| x.kind == "normalize")
        .unwrap();
    assert_eq!((n.pool.as_str(), n.requests), ("p", 2));
}

#[test]
fn entropy_cv_and_sampling() {
    let mut a = Analyzer::new(Options::default());
    for i in 0..40u64 {
        let mut r = rec("p", i as i64 * 1000, 100 + i % 20, 100 + i % 20, i % 2);
        r.temperature = Some(0.7);
        r.deterministic = false;
        r.tokens_out = if i % 2 == 0 { 50 } else { 10 + i };
        a.add(&r);
    }
    let r = a.finish();
    let p = &r.pools[0];
    assert!((p.figures.template_entropy_bits - 1.0).abs() < 1e-9);
    assert_eq!(p.figures.sampled, 40);
    // Sampled requests are not cacheable by the default policy.
    assert_eq!(p.figures.simulated.hits, 0);
    let even = p
        .top_templates
        .iter()
        .find(|t| t.id == super::super::template_hex(0))
        .unwrap();
    assert_eq!(even.output_cv, Some(0.0));
    let kinds: Vec<&str> = r.recommendations.iter().map(|x| x.kind).collect();
    assert!(
        kinds.contains(&"temperature") && kinds.contains(&"stable_template"),
        "{kinds:?}"
    );
    assert!(!kinds.contains(&"cache"));
    // With a policy that caches at 0.7, the repeats hit.
    let mut opts = Options::default();
    opts.pools.insert(
        "p".into(),
        PoolPolicy {
            max_temperature: 1.0,
            ..Default::default()
        },
    );
    let mut b = Analyzer::new(opts);
    for i in 0..40u64 {
        let mut r = rec("p", i as i64 * 1000, 100 + i % 20, 100 + i % 20, 0);
        r.temperature = Some(0.7);
        r.deterministic = false;
        b.add(&r);
    }
    assert_eq!(b.finish().pools[0].figures.simulated.hits, 20);
}

#[test]
fn requests_replay_in_start_order() {
    // A long request ends after a short identical one that started later: the long one
    // started first, so it is the miss and the short one coalesces on it.
    let mut a = Analyzer::new(Options::default());
    let mut short = rec("p", 2_000, 1, 1, 0);
    short.total_ms = 100.0;
    let mut long = rec("p", 5_000, 1, 1, 0);
    long.total_ms = 4_500.0;
    long.tokens_in = 99;
    a.add(&short);
    a.add(&long);
    let r = a.finish();
    assert_eq!(r.pools[0].figures.simulated.hits, 1);
    assert_eq!(r.pools[0].figures.simulated.tokens_in, 10);
}

#[test]
fn unfingerprinted_lines_only_count() {
    let mut a = Analyzer::new(Options::default());
    let mut r = rec("p", 0, 1, 1, 0);
    r.key_raw = None;
    r.key_norm = None;
    r.template = None;
    a.add(&r);
    a.add(&r);
    let rep = a.finish();
    assert_eq!(rep.pools[0].figures.requests, 2);
    assert_eq!(rep.pools[0].figures.fingerprinted, 0);
    assert!(rep.recommendations.is_empty());
}
