use super::*;
use keel_core::health::HealthConfig;
use keel_core::protocol::Protocol;

fn env() -> HashMap<String, String> {
    HashMap::from([("KEY".to_owned(), "sk-secret".to_owned())])
}

/// (line, column, field, message) of every issue, in file order.
fn issues(text: &str) -> Vec<(usize, usize, String, String)> {
    let e = Config::parse(text, "k.toml", &env()).expect_err("the config should be rejected");
    e.issues
        .into_iter()
        .map(|i| {
            assert_eq!(i.file, "k.toml");
            let at = i.at.expect("a position");
            (at.line, at.column, i.field, i.message)
        })
        .collect()
}

fn one_issue(text: &str) -> (usize, usize, String, String) {
    let mut all = issues(text);
    assert_eq!(all.len(), 1, "{all:?}");
    all.remove(0)
}

fn issue(line: usize, column: usize, field: &str, message: &str) -> (usize, usize, String, String) {
    (line, column, field.to_owned(), message.to_owned())
}

const GOOD: &str = r#"listen = "127.0.0.1:9000"
[[pools]]
name = "gpt"
aliases = ["gpt-4o"]
first_token_ms = 2000
[[pools.variants]]
name = "a"
url = "http://127.0.0.1:8000/v1/"
protocol = "openai"
upstream_model = "m"
api_key = "${KEY}"
params = { max_tokens = 100 }
"#;

#[test]
fn parses_and_applies_defaults() {
    let c = Config::parse(GOOD, "keel.toml", &env()).unwrap();
    assert_eq!(c.listen.port(), 9000);
    let p = &c.pools[0];
    assert_eq!(p.aliases, ["gpt-4o"]);
    assert_eq!(p.timeouts.first_token_ms, 2000);
    assert_eq!(p.timeouts.connect_ms, 1000);
    assert_eq!(p.max_attempts, 3);
    let v = &p.variants[0];
    assert_eq!(v.url, "http://127.0.0.1:8000/v1");
    assert_eq!(v.protocol, Protocol::OpenAi);
    assert_eq!(v.api_key.as_deref(), Some("sk-secret"));
    assert_eq!(v.params["max_tokens"], 100);
    assert!(
        !format!("{v:?}").contains("sk-secret"),
        "Debug must redact the key"
    );
}

/// The defaults the book's configuration chapter (docs/src/configuration.md) documents.
#[test]
fn defaults_are_the_documented_ones() {
    let minimal = "[[pools]]\nname = \"m\"\n[[pools.variants]]\nname = \"a\"\nurl = \"http://x\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n";
    let c = Config::parse(minimal, "k.toml", &HashMap::new()).unwrap();
    assert_eq!(c.listen, SocketAddr::from(([127, 0, 0, 1], 8080)));
    assert_eq!(c.listen_backlog, 4096);
    assert_eq!(c.max_body_bytes, 10_485_760);
    assert_eq!(c.header_read_timeout_ms, 10_000);
    assert_eq!(c.idle_timeout_ms, 300_000);
    assert_eq!(c.body_read_timeout_ms, 30_000);
    assert_eq!(c.client_write_timeout_ms, 30_000);
    assert_eq!(c.max_connections, 10_000);
    assert_eq!(c.max_upstream_body_bytes, 64 * 1024 * 1024);
    assert_eq!(c.max_sse_event_bytes, 4 * 1024 * 1024);
    assert_eq!(c.drain_ms, 30_000);
    assert!(!c.reload_watch);
    assert_eq!(c.decisions_kept, 10_000);
    assert!(!c.allow_force_variant);
    assert_eq!(c.worker_threads, None);
    let b = RetryBudgetConfig::default();
    assert_eq!(
        (
            c.retry_budget.ratio,
            c.retry_budget.window_ms,
            c.retry_budget.min_retries_per_sec
        ),
        (b.ratio, b.window_ms, b.min_retries_per_sec)
    );
    assert!(c.warnings.is_empty());
    let p = &c.pools[0];
    assert_eq!(p.max_attempts, 3);
    assert_eq!(p.timeouts, Timeouts::default());
    assert_eq!(
        Timeouts::default(),
        Timeouts {
            connect_ms: 1000,
            first_token_ms: 15_000,
            stall_ms: 10_000,
            total_ms: 600_000
        }
    );
    assert_eq!(p.policy, PolicyKind::P2c);
    assert_eq!(p.affinity, Affinity::None);
    assert_eq!(p.slo_ttft_p95_ms, None);
    assert_eq!(p.hedge, Hedge::Auto);
    assert_eq!(p.hedge_budget, 0.1);
    assert_eq!(p.max_migrations, 2);
    assert_eq!(p.queue_ms, 2000);
    assert_eq!(p.queue_max, 256);
    assert!(p.adaptive_stall && p.hold_tool_calls && p.assemble_non_streaming);
    assert_eq!(
        format!("{:?}", p.health),
        format!("{:?}", HealthConfig::default())
    );
    assert_eq!(p.scrape_interval_ms, 1000);
    let v = &p.variants[0];
    assert_eq!((v.tier, v.weight, v.price), (1, 1, 1.0));
    assert_eq!(v.resume, ResumeMode::Prefill);
    assert!(v.params.is_empty() && v.api_key.is_none() && v.metrics_url.is_none());
    assert_eq!(
        v.continuation_fields,
        keel_core::continuation::default_prefill_fields()
    );
}

#[test]
fn timeouts_layer_flat_over_pool_table_over_top_level() {
    let text = GOOD.replace(
        "[[pools]]\n",
        "[timeouts]\nconnect_ms = 7\nstall_ms = 8\ntotal_ms = 9\n[[pools]]\ntimeouts = { stall_ms = 80, first_token_ms = 1 }\n",
    );
    let c = Config::parse(&text, "k.toml", &env()).unwrap();
    assert_eq!(
        c.pools[0].timeouts,
        Timeouts {
            connect_ms: 7,
            first_token_ms: 2000,
            stall_ms: 80,
            total_ms: 9
        }
    );
}

#[test]
fn settings_are_read() {
    let text = GOOD
        .replace(
            "first_token_ms = 2000\n",
            "policy = \"round_robin\"\naffinity = \"prefix\"\nhedge = 300\nhedge_budget = 1\n[pools.health]\nttft_ratio_warn = 3\nttft_ratio_severe = 4.5\n",
        )
        .replace(
            "params =",
            "tier = 2\nweight = 0\nresume = \"instruction\"\nprice = 0.5\nparams =",
        );
    let text = format!("max_attempts = 5\nworker_threads = 2\n{text}[[pools.variants]]\nname = \"b\"\nurl = \"http://b\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n");
    let c = Config::parse(&text, "k.toml", &env()).unwrap();
    assert_eq!(c.worker_threads, Some(2));
    let p = &c.pools[0];
    assert_eq!(p.max_attempts, 5);
    assert_eq!(p.policy, PolicyKind::RoundRobin);
    assert_eq!(p.affinity, Affinity::Prefix);
    assert_eq!(p.hedge, Hedge::AfterMs(300));
    assert_eq!(p.hedge_budget, 1.0);
    assert_eq!(
        (p.health.ttft_ratio.warn, p.health.ttft_ratio.severe),
        (3.0, 4.5)
    );
    let v = &p.variants[0];
    assert_eq!((v.tier, v.weight, v.price), (2, 0, 0.5));
    assert_eq!(v.resume, ResumeMode::Instruction);
    assert_eq!(p.variants[1].weight, 1);
}

#[test]
fn missing_env_var_names_line_column_and_field() {
    let e = Config::parse(GOOD, "keel.toml", &HashMap::new()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "keel.toml:11:11: pools[0].variants[0].api_key: environment variable `KEY` is not set"
    );
}

#[test]
fn a_type_error_names_the_field_and_its_line() {
    let text = GOOD.replace("first_token_ms = 2000", "first_token_ms = \"2000\"");
    assert_eq!(
        one_issue(&text),
        issue(
            5,
            18,
            "pools[0].first_token_ms",
            "expected a non-negative integer, got string \"2000\""
        )
    );
    let text = GOOD.replace("name = \"a\"", "name = \"a\"\ntier = 300");
    assert_eq!(
        one_issue(&text),
        issue(
            8,
            8,
            "pools[0].variants[0].tier",
            "expected an integer from 0 to 255, got integer 300"
        )
    );
}

#[test]
fn a_range_error_has_a_line() {
    let text = GOOD.replace("first_token_ms = 2000", "hedge_budget = 1.5");
    assert_eq!(
        one_issue(&text),
        issue(
            5,
            16,
            "pools[0].hedge_budget",
            "expected a share between 0 and 1, got 1.5"
        )
    );
    let text = format!("{GOOD}[retry_budget]\nratio = 11\n");
    assert_eq!(
        one_issue(&text),
        issue(
            14,
            9,
            "retry_budget.ratio",
            "expected a number between 0 and 10, got 11"
        )
    );
}

#[test]
fn top_level_max_attempts_is_reported_at_the_top_level() {
    let text = format!("max_attempts = 0\n{GOOD}");
    assert_eq!(
        one_issue(&text),
        issue(1, 16, "max_attempts", "must be at least 1")
    );
    let text = GOOD.replace("first_token_ms = 2000", "max_attempts = 0");
    assert_eq!(
        one_issue(&text),
        issue(5, 16, "pools[0].max_attempts", "must be at least 1")
    );
}

#[test]
fn every_error_is_reported_at_once() {
    let text = r#"max_attempts = 0
listen = "nope"
[timeouts]
stall_ms = 0
[[pools]]
name = "gpt"
policy = "roundrobin"
first_token_ms = -5
[pools.health]
ttft_ratio_warn = 5
ttft_ratio_severe = 2
[[pools.variants]]
name = "a"
url = "ftp://x"
protocol = "openai"
upstream_model = "m"
wieght = 2
[[pools.variants]]
name = "a"
url = "http://x"
protocol = "anthropic"
upstream_model = "m"
[[pools]]
name = "gpt"
"#;
    assert_eq!(
        issues(text),
        vec![
            issue(1, 16, "max_attempts", "must be at least 1"),
            issue(
                2,
                10,
                "listen",
                "expected an address such as \"127.0.0.1:8080\", got \"nope\""
            ),
            issue(4, 12, "timeouts.stall_ms", "must be greater than 0"),
            issue(
                7,
                10,
                "pools[0].policy",
                "expected `p2c` or `round_robin`, got `roundrobin`; did you mean `round_robin`?"
            ),
            issue(
                8,
                18,
                "pools[0].first_token_ms",
                "expected a non-negative integer, got integer -5"
            ),
            issue(
                11,
                21,
                "pools[0].health.ttft_ratio_severe",
                "must be greater than ttft_ratio_warn, itself at least 0 (got warn 5, severe 2)"
            ),
            issue(
                14,
                7,
                "pools[0].variants[0].url",
                "expected an http:// or https:// base URL, got \"ftp://x\""
            ),
            issue(
                17,
                1,
                "pools[0].variants[0].wieght",
                "unknown field `wieght`, did you mean `weight`?"
            ),
            issue(
                19,
                8,
                "pools[0].variants[1].name",
                "variant name `a` is used twice in this pool"
            ),
            issue(
                23,
                1,
                "pools[1].variants",
                "at least one [[pools.variants]] table is required"
            ),
            issue(
                24,
                8,
                "pools[1].name",
                "model name `gpt` is already used by pools[0]"
            ),
        ]
    );
}

#[test]
fn an_unknown_field_gets_a_suggestion_in_every_section() {
    let text = r#"lisen = "127.0.0.1:1"
[timeouts]
stal_ms = 1
[retry_budget]
ratoi = 1
[[pools]]
name = "gpt"
polcy = "p2c"
timeouts = { conect_ms = 5 }
[pools.health]
decay_m = 1
[[pools.variants]]
name = "a"
url = "http://x"
protocol = "openai"
upstream_model = "m"
zzz = 1
"#;
    let got: Vec<(usize, String, String)> = issues(text)
        .into_iter()
        .map(|(line, _, field, message)| (line, field, message))
        .collect();
    let hint = |line, field: &str, key: &str, known: &str| {
        (
            line,
            field.to_owned(),
            format!("unknown field `{key}`, did you mean `{known}`?"),
        )
    };
    assert_eq!(got.len(), 7, "{got:?}");
    assert_eq!(got[0], hint(1, "lisen", "lisen", "listen"));
    assert_eq!(got[1], hint(3, "timeouts.stal_ms", "stal_ms", "stall_ms"));
    assert_eq!(got[2], hint(5, "retry_budget.ratoi", "ratoi", "ratio"));
    assert_eq!(got[3], hint(8, "pools[0].polcy", "polcy", "policy"));
    assert_eq!(
        got[4],
        hint(9, "pools[0].timeouts.conect_ms", "conect_ms", "connect_ms")
    );
    assert_eq!(
        got[5],
        hint(11, "pools[0].health.decay_m", "decay_m", "decay_ms")
    );
    // Nothing close: the known fields are listed instead.
    assert_eq!(got[6].0, 17);
    assert_eq!(got[6].1, "pools[0].variants[0].zzz");
    let (head, known) = got[6].2.split_once("; expected one of ").unwrap();
    assert_eq!(head, "unknown field `zzz`");
    let known: Vec<&str> = known
        .split([',', ' '])
        .filter(|w| !w.is_empty() && *w != "or")
        .map(|w| w.trim_matches('`'))
        .collect();
    assert!(
        known.contains(&"weight") && known.contains(&"upstream_model"),
        "{known:?}"
    );
    assert_eq!(known.len(), 37, "{known:?}");
}

#[test]
fn an_unknown_policy_is_an_error_not_round_robin() {
    let text = GOOD.replace("first_token_ms = 2000", "policy = \"least_loaded\"");
    assert_eq!(
        one_issue(&text),
        issue(
            5,
            10,
            "pools[0].policy",
            "expected `p2c` or `round_robin`, got `least_loaded`"
        )
    );
    let text = GOOD.replace("first_token_ms = 2000", "policy = \"P2C\"");
    assert_eq!(
        one_issue(&text).3,
        "expected `p2c` or `round_robin`, got `P2C`; did you mean `p2c`?"
    );
    let text = GOOD.replace("first_token_ms = 2000", "policy = 2");
    assert_eq!(
        one_issue(&text).3,
        "expected `p2c` or `round_robin`, got integer 2"
    );
}

#[test]
fn other_values_are_precise() {
    let text = GOOD.replace("\"openai\"", "\"grpc\"");
    assert_eq!(
        one_issue(&text),
        issue(
            9,
            12,
            "pools[0].variants[0].protocol",
            "expected `openai`, `anthropic`, `azure`, `gemini`, `vertex`, `bedrock` or `openai-responses`, got `grpc`"
        )
    );
    let text = GOOD.replace("protocol = \"openai\"\n", "");
    assert_eq!(
        one_issue(&text),
        issue(
            6,
            1,
            "pools[0].variants[0].protocol",
            "missing; expected `openai`, `anthropic`, `azure`, `gemini`, `vertex`, `bedrock` or `openai-responses`"
        )
    );
    let text = GOOD.replace("first_token_ms = 2000", "hedge = \"of\"");
    assert_eq!(
        one_issue(&text).3,
        "expected \"auto\", \"off\" or a delay in ms (> 0), got string \"of\"; did you mean `off`?"
    );
    let text = GOOD.replace("listen = \"127.0.0.1:9000\"", "worker_threads = 0");
    assert_eq!(
        one_issue(&text),
        issue(1, 18, "worker_threads", "must be at least 1")
    );
    let text = GOOD.replace("listen = \"127.0.0.1:9000\"", "listen_backlog = 0");
    assert_eq!(
        one_issue(&text),
        issue(1, 18, "listen_backlog", "must be at least 1")
    );
    let text = GOOD.replace("params = { max_tokens = 100 }", "params = 5");
    assert_eq!(
        one_issue(&text),
        issue(
            12,
            10,
            "pools[0].variants[0].params",
            "expected a table of request fields, got integer 5"
        )
    );
    assert_eq!(
        one_issue("listen = \"127.0.0.1:1\"\n"),
        issue(1, 1, "pools", "at least one [[pools]] table is required")
    );
}

#[test]
fn a_syntax_error_stops_at_the_first() {
    // The type error on line 1 is not reached: past a syntax error the document has no shape.
    let e = Config::parse(
        "listen = 5\n[[pools]]\nx = = 1\ny = = 2\n",
        "k.toml",
        &env(),
    )
    .unwrap_err();
    assert_eq!(e.issues.len(), 1, "{e}");
    assert_eq!(e.issues[0].at, Some(Position { line: 3, column: 5 }));
    assert_eq!(e.issues[0].field, "");
    let shown = e.to_string();
    assert_eq!(shown.split_once(": ").unwrap().0, "k.toml:3:5", "{shown}");
}

#[test]
fn duplicate_model_names_are_rejected() {
    let twice = format!("{GOOD}[[pools]]\nname = \"x\"\naliases = [\"gpt-4o\"]\n[[pools.variants]]\nname=\"b\"\nurl=\"http://x\"\nprotocol=\"openai\"\nupstream_model=\"m\"\n");
    assert_eq!(
        one_issue(&twice),
        issue(
            15,
            12,
            "pools[1].aliases[0]",
            "model name `gpt-4o` is already used by pools[0]"
        )
    );
}

#[test]
fn anthropic_v1_urls_are_trimmed_with_a_warning() {
    let text = GOOD.replace("\"openai\"", "\"anthropic\"");
    let c = Config::parse(&text, "k.toml", &env()).unwrap();
    assert_eq!(c.pools[0].variants[0].url, "http://127.0.0.1:8000");
    assert_eq!(
        c.warnings,
        ["pools[0].variants[0].url: Anthropic base URLs do not end in /v1; using http://127.0.0.1:8000"]
    );
}

#[test]
fn health_path_is_joined_to_the_origin_and_health_url_taken_whole() {
    let c = Config::parse(&format!("{GOOD}health_path = \"/health\"\n"), "k", &env()).unwrap();
    assert_eq!(
        c.pools[0].variants[0].health_url.as_deref(),
        Some("http://127.0.0.1:8000/health")
    );
    let text = format!("{GOOD}health_url = \"http://127.0.0.1:8001/ready\"\n");
    let c = Config::parse(&text, "k", &env()).unwrap();
    assert_eq!(
        c.pools[0].variants[0].health_url.as_deref(),
        Some("http://127.0.0.1:8001/ready")
    );
    assert!(
        Config::parse(GOOD, "k", &env()).unwrap().pools[0].variants[0]
            .health_url
            .is_none()
    );
}

#[test]
fn health_endpoint_mistakes_are_named() {
    let (_, _, field, message) = one_issue(&format!("{GOOD}health_path = \"health\"\n"));
    assert_eq!(field, "pools[0].variants[0].health_path");
    assert!(message.contains("starting with `/`"), "{message}");
    let text = format!("{GOOD}health_path = \"/health\"\nhealth_url = \"http://x/health\"\n");
    let (_, _, field, message) = one_issue(&text);
    assert_eq!(field, "pools[0].variants[0].health_url");
    assert!(message.contains("not both"), "{message}");
    let (_, _, field, message) = one_issue(&format!("{GOOD}health_pth = \"/health\"\n"));
    assert_eq!(field, "pools[0].variants[0].health_pth");
    assert!(message.contains("did you mean `health_path`"), "{message}");
}

#[test]
fn keys_are_validated_precisely() {
    let pool = "[[pools]]\nname = \"p\"\naliases = [\"pa\"]\n[[pools.variants]]\nname = \"v\"\nurl = \"http://x\"\nprotocol = \"openai\"\nupstream_model = \"u\"\n";
    let h = format!("sha256:{}", "ab".repeat(32));
    let ok = format!("[[keys]]\nid = \"k\"\nhash = \"{h}\"\npools = [\"pa\"]\nrpm = 5\ndaily_spend_usd = 1.5\npriority = \"high\"\nmin_tier = 2\n{pool}");
    let cfg = Config::parse(&ok, "k.toml", &Default::default()).unwrap();
    let k = &cfg.keys[0];
    assert_eq!(
        (k.pools.as_slice(), k.rpm, k.daily_spend_micros),
        (&["p".to_owned()][..], Some(5), Some(1_500_000))
    );
    assert_eq!(k.priority, crate::pipeline::context::Priority::High);
    assert_eq!(k.tenant, "k");
    let bad = format!(
        "[[keys]]\nid = \"k\"\nhash = \"md5:12\"\n[[keys]]\nid = \"k2\"\nhash = \"{h}\"\npools = [\"nope\"]\nrpm = 0\n[[keys]]\nid = \"k2\"\nhash = \"sha256:{}\"\n[[keys]]\nid = \"k3\"\nhash = \"{h}\"\n[quota]\nfail_mode = \"ajar\"\n{pool}",
        "cd".repeat(32)
    );
    let e = Config::parse(&bad, "k.toml", &Default::default())
        .unwrap_err()
        .to_string();
    for expected in [
        "keys[0].hash: expected \"sha256:<64 hex digits>\"",
        "keys[1].pools[0]: unknown pool `nope`",
        "keys[1].rpm: expected a positive number, got 0",
        "keys[2].id: duplicate key id `k2`",
        "keys[3].hash: the same hash as keys[1]",
        "quota.fail_mode: expected",
    ] {
        assert!(e.contains(expected), "missing `{expected}` in:\n{e}");
    }
}

#[test]
fn redis_table_is_optional_and_keeps_its_password_out_of_debug_output() {
    assert!(Config::parse(GOOD, "k", &env()).unwrap().redis.is_none());
    let text = format!("{GOOD}[redis]\nurl = \"redis://:${{KEY}}@10.0.0.5:6380/2\"\n");
    let r = Config::parse(&text, "k", &env()).unwrap().redis.unwrap();
    assert_eq!(r.url, "redis://:sk-secret@10.0.0.5:6380/2");
    assert_eq!(r.key_prefix, "keel:");
    let shown = format!("{r:?}");
    assert!(!shown.contains("sk-secret"), "{shown}");
    assert!(shown.contains("redis://***@10.0.0.5:6380/2"), "{shown}");
    let text = format!("{GOOD}[redis]\nurl = \"redis://127.0.0.1\"\nkey_prefix = \"t1:\"\n");
    let r = Config::parse(&text, "k", &env()).unwrap().redis.unwrap();
    assert_eq!(
        (r.url.as_str(), r.key_prefix.as_str()),
        ("redis://127.0.0.1", "t1:")
    );
}

#[test]
fn redis_mistakes_are_named() {
    let line = GOOD.lines().count() + 2;
    assert_eq!(
        one_issue(&format!("{GOOD}[redis]\nurl = \"http://127.0.0.1:6379\"\n")),
        issue(
            line,
            7,
            "redis.url",
            "expected a URL such as \"redis://127.0.0.1:6379\" or \"rediss://redis.internal:6380\", got \"http://127.0.0.1:6379\""
        )
    );
    let (l, _, field, message) = one_issue(&format!("{GOOD}[redis]\nkey_prefix = \"k:\"\n"));
    assert_eq!((l, field.as_str()), (line - 1, "redis.url"));
    assert!(message.starts_with("missing; expected a URL"), "{message}");
    let text = format!("{GOOD}[redis]\nurl = \"redis://h\"\nkey_prefx = \"k:\"\n");
    let (_, _, field, message) = one_issue(&text);
    assert_eq!(field, "redis.key_prefx");
    assert!(message.contains("did you mean `key_prefix`"), "{message}");
    let text = format!("{GOOD}[redis]\nurl = \"redis://${{NOPE}}@h\"\n");
    let (_, _, field, message) = one_issue(&text);
    assert_eq!(field, "redis.url");
    assert!(message.contains("`NOPE` is not set"), "{message}");
}

#[test]
fn redis_signal_sharing_defaults_on_and_its_ttl_is_bounded() {
    let text = format!("{GOOD}[redis]\nurl = \"redis://127.0.0.1\"\n");
    let r = Config::parse(&text, "k", &env()).unwrap().redis.unwrap();
    assert_eq!((r.share_signals, r.signal_ttl_ms), (true, 5_000));
    let text = format!(
        "{GOOD}[redis]\nurl = \"redis://127.0.0.1\"\nshare_signals = false\nsignal_ttl_ms = 800\n"
    );
    let r = Config::parse(&text, "k", &env()).unwrap().redis.unwrap();
    assert_eq!((r.share_signals, r.signal_ttl_ms), (false, 800));
    let text = format!("{GOOD}[redis]\nurl = \"redis://h\"\nsignal_ttl_ms = 50\n");
    let (_, _, field, message) = one_issue(&text);
    assert_eq!(field, "redis.signal_ttl_ms");
    assert_eq!(message, "expected 300..=600000 (ms), got 50");
    let text = format!("{GOOD}[redis]\nurl = \"redis://h\"\nshare_signals = \"yes\"\n");
    let (_, _, field, _) = one_issue(&text);
    assert_eq!(field, "redis.share_signals");
}

#[test]
fn safe_mode_thresholds_read_with_defaults_and_bad_pairs_are_named() {
    let c = Config::parse(GOOD, "keel.toml", &env()).unwrap();
    assert_eq!(
        c.pools[0].safe_mode,
        keel_core::health_colour::Thresholds::default()
    );
    let text = GOOD.replace(
        "[[pools.variants]]",
        "[pools.safe_mode]\nwindow_ms = 2000\nerror_rate_red = 0.5\nexit_after_ms = 100\nauto = false\n[[pools.variants]]",
    );
    let t = Config::parse(&text, "keel.toml", &env()).unwrap().pools[0].safe_mode;
    assert_eq!(
        (t.window_ms, t.error_rate.red, t.exit_after_ms, t.auto),
        (2000, 0.5, 100, false)
    );
    assert_eq!(t.error_rate.yellow, 0.05);
    // Capacity is worse when lower: its red must be below its yellow.
    let text = GOOD.replace(
        "[[pools.variants]]",
        "[pools.safe_mode]\neligible_capacity_red = 0.9\n[[pools.variants]]",
    );
    let (_, _, field, message) = one_issue(&text);
    assert_eq!(field, "pools[0].safe_mode.eligible_capacity_red");
    assert_eq!(
        message,
        "must be less than eligible_capacity_yellow, both at least 0 (got yellow 0.75, red 0.9)"
    );
}

/// `[reload]`: `watch` turns the file watch on; any other key is an error where it is written.
#[test]
fn reload_section() {
    let pool = "[[pools]]\nname = \"m\"\n[[pools.variants]]\nname = \"a\"\nurl = \"http://x\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n";
    let c = Config::parse(
        &format!("[reload]\nwatch = true\n{pool}"),
        "k.toml",
        &HashMap::new(),
    )
    .unwrap();
    assert!(c.reload_watch);
    let e = Config::parse(
        &format!("[reload]\nwatsh = true\n{pool}"),
        "k.toml",
        &HashMap::new(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("k.toml:2:1: reload.watsh"), "{e}");
    let e = Config::parse(
        &format!("[reload]\nwatch = 1\n{pool}"),
        "k.toml",
        &HashMap::new(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("reload.watch"), "{e}");
}

#[test]
fn integrity_table_is_optional_with_defaults_and_its_mistakes_are_named() {
    use crate::config::IntegrityConfig;
    let c = Config::parse(GOOD, "keel.toml", &env()).unwrap();
    assert_eq!(c.pools[0].integrity, None, "absent: no checks");
    let text = GOOD.replace(
        "[[pools.variants]]",
        "[pools.integrity]\n[[pools.variants]]",
    );
    let c = Config::parse(&text, "keel.toml", &env()).unwrap();
    assert_eq!(c.pools[0].integrity, Some(IntegrityConfig::default()));
    let text = GOOD.replace(
        "[[pools.variants]]",
        "[pools.integrity]\nauto_continue = false\nmax_continuations = 3\n[[pools.variants]]",
    );
    let i = Config::parse(&text, "keel.toml", &env()).unwrap().pools[0]
        .integrity
        .unwrap();
    assert_eq!(
        (i.auto_continue, i.json_retry, i.max_continuations),
        (false, true, 3)
    );
    let text = GOOD.replace(
        "[[pools.variants]]",
        "[pools.integrity]\nmax_continuations = 9\n[[pools.variants]]",
    );
    let (_, _, field, message) = one_issue(&text);
    assert_eq!(field, "pools[0].integrity.max_continuations");
    assert_eq!(message, "at most 8, got 9");
    let text = GOOD.replace(
        "[[pools.variants]]",
        "[pools.integrity]\nauto_continu = true\n[[pools.variants]]",
    );
    let (_, _, field, message) = one_issue(&text);
    assert_eq!(field, "pools[0].integrity.auto_continu");
    assert!(message.contains("auto_continue"), "{message}");
}

/// A test CA's `ca.pem`, and two server certificates it signed with their keys (`a.pem`,
/// `a.key`, `b.pem`, `b.key`), in a directory of their own.
fn tls_files(name: &str) -> std::path::PathBuf {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let dir = std::env::temp_dir().join(format!("keel-config-tls-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    for stem in ["a", "b"] {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        std::fs::write(dir.join(format!("{stem}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{stem}.key")), key.serialize_pem()).unwrap();
    }
    dir
}

#[test]
fn tls_files_are_read_and_each_problem_names_its_field_and_file() {
    let dir = tls_files("listener");
    let f = |name: &str| dir.join(name).to_str().unwrap().to_owned();
    let section = |cert: &str, key: &str, extra: &str| {
        format!("{GOOD}[tls]\ncert_file = \"{cert}\"\nkey_file = \"{key}\"\n{extra}")
    };
    let c = Config::parse(&section(&f("a.pem"), &f("a.key"), ""), "k", &env()).unwrap();
    let tls = c.tls.expect("[tls]");
    assert_eq!(tls.cert_file, f("a.pem"));
    assert!(tls.client_ca_file.is_none());
    let with_ca = format!("client_ca_file = \"{}\"\n", f("ca.pem"));
    let c = Config::parse(&section(&f("a.pem"), &f("a.key"), &with_ca), "k", &env()).unwrap();
    assert_eq!(c.tls.unwrap().client_ca_file, Some(f("ca.pem")));

    let line = GOOD.lines().count() + 2;
    let (l, _, field, message) = one_issue(&section(&f("none.pem"), &f("a.key"), ""));
    assert_eq!((l, field.as_str()), (line, "tls.cert_file"));
    assert!(
        message.starts_with(&format!("cannot read {}", f("none.pem"))),
        "{message}"
    );
    let (l, _, field, message) = one_issue(&section(&f("a.pem"), &f("b.key"), ""));
    assert_eq!((l, field.as_str()), (line + 1, "tls.key_file"));
    assert!(
        message.contains(&f("b.key")) && message.contains("does not match the certificate"),
        "{message}"
    );
    // A certificate where the key should be, and a key where the CA should be.
    let (_, _, field, message) = one_issue(&section(&f("a.pem"), &f("a.pem"), ""));
    assert_eq!(field, "tls.key_file");
    assert!(
        message.starts_with(&format!("{}: no usable private key", f("a.pem"))),
        "{message}"
    );
    let bad_ca = format!("client_ca_file = \"{}\"\n", f("a.key"));
    let (_, _, field, message) = one_issue(&section(&f("a.pem"), &f("a.key"), &bad_ca));
    assert_eq!(field, "tls.client_ca_file");
    assert!(
        message.starts_with(&format!("{}: no certificate", f("a.key"))),
        "{message}"
    );
    let (_, _, field, message) = one_issue(&format!("{GOOD}[tls]\ncert_file = \"x\"\n"));
    assert_eq!(field, "tls.key_file");
    assert!(message.starts_with("missing; expected"), "{message}");
}

#[test]
fn a_variants_tls_files_are_read_and_checked() {
    let dir = tls_files("variant");
    let f = |name: &str| dir.join(name).to_str().unwrap().to_owned();
    let https = GOOD.replace("http://127.0.0.1:8000", "https://10.0.0.7:8000");
    let ca = format!("ca_file = \"{}\"\n", f("ca.pem"));
    let c = Config::parse(&format!("{https}{ca}"), "k", &env()).unwrap();
    let tls = c.pools[0].variants[0].tls.clone().expect("TLS settings");
    assert_eq!(tls.ca_file, Some(f("ca.pem")));
    assert!(tls.ca_pem.is_some() && tls.identity_pem.is_none());
    let identity = format!(
        "client_cert_file = \"{}\"\nclient_key_file = \"{}\"\n",
        f("a.pem"),
        f("a.key")
    );
    let c = Config::parse(&format!("{https}{ca}{identity}"), "k", &env()).unwrap();
    let tls = c.pools[0].variants[0].tls.clone().unwrap();
    assert!(tls.identity_pem.is_some());
    assert!(!format!("{:?}", c.pools[0].variants[0]).contains("PRIVATE KEY"));
    assert!(
        Config::parse(GOOD, "k", &env()).unwrap().pools[0].variants[0]
            .tls
            .is_none()
    );

    let (_, _, field, message) = one_issue(&format!("{GOOD}{ca}"));
    assert_eq!(field, "pools[0].variants[0].ca_file");
    assert!(message.contains("need an https:// url"), "{message}");
    let missing = format!("ca_file = \"{}\"\n", f("nope.pem"));
    let (_, _, field, message) = one_issue(&format!("{https}{missing}"));
    assert_eq!(field, "pools[0].variants[0].ca_file");
    assert!(
        message.starts_with(&format!("cannot read {}", f("nope.pem"))),
        "{message}"
    );
    let alone = format!("client_cert_file = \"{}\"\n", f("a.pem"));
    let (_, _, field, message) = one_issue(&format!("{https}{alone}"));
    assert_eq!(field, "pools[0].variants[0].client_cert_file");
    assert!(message.contains("together"), "{message}");
    let mismatched = format!(
        "client_cert_file = \"{}\"\nclient_key_file = \"{}\"\n",
        f("a.pem"),
        f("b.key")
    );
    let (_, _, field, message) = one_issue(&format!("{https}{mismatched}"));
    assert_eq!(field, "pools[0].variants[0].client_key_file");
    assert!(message.contains("does not match"), "{message}");
}

#[test]
fn rediss_urls_are_accepted_with_an_optional_ca() {
    let dir = tls_files("redis");
    let ca = dir.join("ca.pem").to_str().unwrap().to_owned();
    let text = format!("{GOOD}[redis]\nurl = \"rediss://redis.internal:6380\"\n");
    let r = Config::parse(&text, "k", &env()).unwrap().redis.unwrap();
    assert_eq!(
        (r.url.as_str(), r.ca_pem.is_none()),
        ("rediss://redis.internal:6380", true)
    );
    let text = format!("{GOOD}[redis]\nurl = \"rediss://h:6380\"\nca_file = \"{ca}\"\n");
    let r = Config::parse(&text, "k", &env()).unwrap().redis.unwrap();
    assert!(r.ca_pem.is_some());
    let text = format!("{GOOD}[redis]\nurl = \"redis://h\"\nca_file = \"{ca}\"\n");
    let (_, _, field, message) = one_issue(&text);
    assert_eq!(field, "redis.ca_file");
    assert!(message.contains("needs a rediss:// url"), "{message}");
}

#[test]
fn connection_caps_default_from_the_pool_and_zero_is_refused() {
    let two = r#"[[pools]]
name = "p"
max_connections = 8
max_pending = 2
[[pools.variants]]
name = "a"
url = "http://127.0.0.1:8000/v1"
protocol = "openai"
upstream_model = "m"
[[pools.variants]]
name = "b"
url = "http://127.0.0.1:8001/v1"
protocol = "openai"
upstream_model = "m"
max_connections = 3
"#;
    let c = Config::parse(two, "k.toml", &env()).unwrap();
    let (a, b) = (&c.pools[0].variants[0], &c.pools[0].variants[1]);
    assert_eq!(
        (a.max_connections, a.max_pending, a.slot_cap()),
        (Some(8), Some(2), Some(10))
    );
    assert_eq!(
        (b.max_connections, b.max_pending, b.slot_cap()),
        (Some(3), Some(2), Some(5))
    );
    let none = Config::parse(GOOD, "k.toml", &env()).unwrap();
    assert_eq!(none.pools[0].variants[0].slot_cap(), None);
    // Pending without a connection cap has nothing to wait for: said, not refused.
    let pending_only = GOOD.replace("api_key", "max_pending = 4\napi_key");
    let c = Config::parse(&pending_only, "k.toml", &env()).unwrap();
    assert!(
        c.warnings.iter().any(|w| w.contains("max_pending")),
        "{:?}",
        c.warnings
    );
    let zero = GOOD.replace("api_key", "max_connections = 0\napi_key");
    let (line, _, field, message) = one_issue(&zero);
    assert_eq!(
        (line, field.as_str()),
        (11, "pools[0].variants[0].max_connections")
    );
    assert!(message.contains("got 0"), "{message}");
}

/// The documentation's Markdown: README and every chapter of the book but the reference itself.
fn documentation() -> Vec<String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut paths = vec![root.join("README.md")];
    let mut stack = vec![root.join("docs/src")];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") && !path.ends_with("reference.md")
            {
                paths.push(path);
            }
        }
    }
    paths.sort();
    paths
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect()
}

/// `docs/src/reference.md` is what the parsers and the annotated examples draw, and every key
/// keel reads is explained by some example.
#[test]
fn config_reference_is_current_and_complete() {
    let docs = documentation();
    let texts: Vec<&str> = docs.iter().map(String::as_str).collect();
    let drawn = match super::reference::reference(&texts) {
        Ok(drawn) => drawn,
        Err(missing) => panic!(
            "keys keel reads that no annotated example in README or docs/src explains \
             (write `key = example  # meaning` in one): {missing:#?}"
        ),
    };
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/src/reference.md");
    if std::env::var_os("KEEL_UPDATE_CONFIG_REFERENCE").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &drawn).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == drawn,
        "docs/src/reference.md is out of date: KEEL_UPDATE_CONFIG_REFERENCE=1 cargo nextest run -p keel-gateway config_reference"
    );
}

#[test]
fn config_reference_reads_keys_from_annotated_examples() {
    let doc = "```toml\nlisten = \"127.0.0.1:1\"   # where clients connect\n                        # (and more)\n# worker_threads = 1    # runtime threads\n[timeouts]\nconnect_ms = 5          # dial limit\n```\n";
    let missing = super::reference::reference(&[doc]).unwrap_err();
    assert!(
        missing.contains(&"max_body_bytes".to_owned()),
        "{missing:?}"
    );
    assert!(!missing.contains(&"listen".to_owned()));
    assert!(!missing.contains(&"worker_threads".to_owned()));
    assert!(!missing.contains(&"timeouts.connect_ms".to_owned()));
    assert!(missing.contains(&"timeouts.stall_ms".to_owned()));
}

/// README's minimal config is a config keel reads, with every other key at its default.
#[test]
fn the_readme_minimal_config_parses() {
    let readme = include_str!("../../../../README.md");
    let at = readme
        .find("\n## A minimal config\n")
        .expect("README has a minimal config");
    let block = &readme[at..];
    let start = block.find("```toml\n").unwrap() + 8;
    let end = start + block[start..].find("```").unwrap();
    let env: HashMap<String, String> = [("OPENAI_API_KEY".to_string(), "x".to_string())].into();
    let c = Config::parse(&block[start..end], "README.md", &env).unwrap();
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    assert_eq!(c.pools.len(), 1);
    let pool = &c.pools[0];
    assert_eq!(
        (pool.name.as_str(), pool.aliases.clone()),
        ("chat", vec!["gpt-4o-mini".to_string()])
    );
    let names: Vec<&str> = pool.variants.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(names, ["openai", "vllm-local"]);
    // The variable is required: without it the config is refused.
    assert!(Config::parse(&block[start..end], "README.md", &HashMap::new()).is_err());
}
