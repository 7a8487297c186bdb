//! `keel analyze` and `keel bench analyze` as a user runs them: the real binary. The bench's
//! ground truth (three workloads through keel twice) must hold its goals; the command must read
//! the log it made, filter it and refuse bad arguments clearly.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn keel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .env_remove("KEEL_LOG")
        .output()
        .expect("run keel")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn ground_truth_holds_and_the_command_reads_what_keel_logged() {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("analyze-{}", std::process::id()));
    let out = dir.display().to_string();
    let o = keel(&[
        "bench",
        "analyze",
        "--requests",
        "200",
        "--log-mb",
        "2",
        "--out",
        &out,
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    for shape in ["templated", "chat", "mixed"] {
        let row = t
            .lines()
            .find(|l| l.starts_with(&format!("| {shape} |")))
            .unwrap_or_else(|| panic!("no {shape} row: {t}"));
        assert!(row.ends_with("| yes |"), "{row}");
    }
    assert!(t.contains("MB/s"), "{t}");
    // The access log of the first run holds no prompt text.
    let log = dir.join("truth/access.log");
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(logged.lines().count() >= 600, "{}", logged.lines().count());
    for word in ["Summarize", "Alice", "Question", "glacier"] {
        assert!(!logged.contains(word), "`{word}` in the log");
    }

    // A TTL that expires during the run (both runs paced alike): still within the goals.
    let ttl_out = dir.join("ttl");
    let o = keel(&[
        "bench",
        "analyze",
        "--requests",
        "100",
        "--log-mb",
        "0",
        "--ttl-ms",
        "1000",
        "--out",
        ttl_out.to_str().unwrap(),
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let row = t.lines().find(|l| l.starts_with("| templated |")).unwrap();
    assert!(
        row.contains("ttl_ms = 1000") && row.ends_with("| yes |"),
        "{row}"
    );

    // The command on that log, one pool only.
    let report_dir = dir.join("one-pool");
    let o = keel(&[
        "analyze",
        log.to_str().unwrap(),
        "--pool",
        "templated",
        "--since",
        "2020-01-01",
        "--out",
        report_dir.to_str().unwrap(),
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("recommendations:") && t.contains("`[pools.cache]`"),
        "{t}"
    );
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(report_dir.join("report.json")).unwrap())
            .unwrap();
    let pools = doc["report"]["pools"].as_array().unwrap();
    assert_eq!(pools.len(), 1);
    assert_eq!(pools[0]["pool"], "templated");
    assert_eq!(pools[0]["requests"], 200);
    assert!(
        pools[0]["simulated_hit_rate"].as_f64().unwrap() > 0.5,
        "{}",
        pools[0]
    );
    assert!(pools[0]["repeats_normalized"].as_u64() > pools[0]["repeats_raw"].as_u64());
    let html = std::fs::read_to_string(report_dir.join("report.html")).unwrap();
    assert!(html.contains("id=\"heatmap\""));

    // With the gateway's config: the pool's own TTL and normalization.
    let cfg = dir.join("keel.toml");
    std::fs::write(
        &cfg,
        "[cache]\nmax_bytes = 1000000\n[[pools]]\nname = \"templated\"\nnormalize = \"syntax\"\n[pools.cache]\nttl_ms = 60000\n[[pools.variants]]\nname = \"a\"\nurl = \"http://127.0.0.1:9/v1\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n",
    )
    .unwrap();
    let o = keel(&[
        "analyze",
        log.to_str().unwrap(),
        "--pool",
        "templated",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        report_dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(report_dir.join("report.json")).unwrap())
            .unwrap();
    let p = &doc["report"]["pools"][0];
    assert_eq!(p["policy"]["ttl_ms"], 60000, "{p}");
    assert_eq!(p["policy"]["normalizes"], true, "{p}");
    assert_eq!(p["policy"]["cache_on"], true, "{p}");
    // As configured = normalized keys at 1 min (scenario 2).
    assert_eq!(p["simulated"]["hits"], p["by_scenario"][2]["hits"], "{p}");
    let o = keel(&[
        "analyze",
        log.to_str().unwrap(),
        "--config",
        dir.join("none.toml").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("none.toml"), "{}", text(&o));

    // A time after every line: nothing is kept.
    let o = keel(&[
        "analyze",
        log.to_str().unwrap(),
        "--since",
        "2999-01-01T00:00:00Z",
        "--out",
        report_dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("no recommendation"), "{}", text(&o));

    // Bad arguments: clear errors, exit 1.
    let o = keel(&["analyze", log.to_str().unwrap(), "--since", "yesterday"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--since"), "{}", text(&o));
    let o = keel(&[
        "analyze",
        dir.join("missing.log").to_str().unwrap(),
        "--out",
        report_dir.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("missing.log"), "{}", text(&o));
    let _ = std::fs::remove_dir_all(&dir);
}
