//! `keel demo` as a new user runs it: the sample requests each leave one access-log line.

use std::process::Command;

use serde_json::Value;

/// Runs the demo's sample requests and exits, on free ports (the simulated fleet takes six
/// consecutive ports from a base derived from the process id: a block of six per id, so tests
/// run at once in processes with neighbouring ids never share a port; all below the kernel's
/// ephemeral range, 32768 and up).
fn demo(extra: &[&str]) -> std::process::Output {
    let base = 20_000 + (std::process::id() % 2_000) as u16 * 6;
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["demo", "--no-wait", "--listen", "127.0.0.1:0"])
        .args(["--sim-base-port", &base.to_string()])
        .args(extra)
        .env_remove("KEEL_LOG")
        .output()
        .expect("run keel demo")
}

#[test]
fn demo_prints_one_json_access_line_per_sample_request() {
    let out = demo(&[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let lines: Vec<Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(lines.len(), 10, "{stderr}");
    for l in &lines {
        let id = l["request_id"].as_str().unwrap();
        // The sample table on stdout and the log agree on each request.
        assert!(stdout.contains(l["variant"].as_str().unwrap()), "{l}");
        assert!(
            !id.is_empty() && l["status"] == 200 && l["outcome"] == "ok",
            "{l}"
        );
        assert!(
            ["direct", "fallback", "hedged", "migrated"].contains(&l["route"].as_str().unwrap()),
            "{l}"
        );
        assert!(l["tokens_out"].as_u64().unwrap() > 0, "{l}");
    }
    assert!(
        !stderr.contains('\u{1b}'),
        "colour codes in a pipe: {stderr}"
    );
}

#[test]
fn demo_rejects_an_unknown_log_format() {
    let out = demo(&["--log-format", "xml"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("expected `json` or `text`, got `xml`"),
        "{stderr}"
    );
}

#[test]
fn demo_at_rest_is_green_and_says_so() {
    let out = demo(&[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("10/10 sample requests served intact"),
        "{stdout}"
    );
    // No fault is configured at rest: no variant is ejected, no pool's capacity falls (a hedge
    // may still win a slow first token on a busy machine: that is keel at work, not a fault).
    assert!(stdout.lines().any(|l| l == "health: green"), "{stdout}");
}

#[test]
fn demo_with_faults_still_serves_every_sample_request() {
    let out = demo(&["--faults"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("--faults: gpt-flaky fails"), "{stdout}");
    assert!(stdout.contains("health: "), "{stdout}");
}
