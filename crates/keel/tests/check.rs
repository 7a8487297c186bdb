//! `keel check` as a user runs it: the real binary on a file.

use std::path::PathBuf;
use std::process::{Command, Output};

fn keel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .env_remove("KEEL_LOG")
        .output()
        .expect("run keel")
}

/// A file in this test's scratch directory.
fn write(name: &str, text: &str) -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// One reported problem: `file:line:column: field: message`.
#[derive(Debug, PartialEq)]
struct Reported {
    file: String,
    line: usize,
    column: usize,
    field: String,
    message: String,
}

fn parse_line(line: &str) -> Reported {
    let (place, rest) = line.split_once(": ").unwrap_or_else(|| panic!("{line}"));
    let mut parts = place.rsplitn(3, ':');
    let column = parts
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("{line}"));
    let line_no = parts
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("{line}"));
    let file = parts.next().unwrap().to_owned();
    let (field, message) = rest.split_once(": ").unwrap_or_else(|| panic!("{line}"));
    Reported {
        file,
        line: line_no,
        column,
        field: field.to_owned(),
        message: message.to_owned(),
    }
}

const BAD: &str = r#"max_attempts = 0
[[pools]]
name = "gpt"
policy = "roundrobin"
first_token_ms = "5s"
[[pools.variants]]
name = "a"
url = "ftp://x"
protocol = "openai"
upstream_model = "m"
wieght = 2
"#;

#[test]
fn check_reports_every_error_with_its_place_and_fails() {
    let path = write("bad.toml", BAD);
    let path_str = path.to_str().unwrap();
    let out = keel(&["check", "--config", path_str]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let stderr = String::from_utf8(out.stderr).unwrap();
    let lines: Vec<&str> = stderr.lines().collect();
    let (summary, problems) = lines.split_last().expect("output");
    assert_eq!(*summary, format!("keel: {path_str}: 5 errors"));
    let got: Vec<Reported> = problems.iter().map(|l| parse_line(l)).collect();
    let want = |line, column, field: &str, message: &str| Reported {
        file: path_str.to_owned(),
        line,
        column,
        field: field.to_owned(),
        message: message.to_owned(),
    };
    assert_eq!(
        got,
        vec![
            want(1, 16, "max_attempts", "must be at least 1"),
            want(
                4,
                10,
                "pools[0].policy",
                "expected `p2c` or `round_robin`, got `roundrobin`; did you mean `round_robin`?"
            ),
            want(
                5,
                18,
                "pools[0].first_token_ms",
                "expected a non-negative integer, got string \"5s\""
            ),
            want(
                8,
                7,
                "pools[0].variants[0].url",
                "expected an http:// or https:// base URL, got \"ftp://x\""
            ),
            want(
                11,
                1,
                "pools[0].variants[0].wieght",
                "unknown field `wieght`, did you mean `weight`?"
            ),
        ]
    );
}

#[test]
fn check_accepts_the_demo_config() {
    let printed = keel(&["demo", "--print-config"]);
    assert!(printed.status.success());
    let text = String::from_utf8(printed.stdout).unwrap();
    let pools = text.lines().filter(|l| l.trim() == "[[pools]]").count();
    let variants = text
        .lines()
        .filter(|l| l.trim() == "[[pools.variants]]")
        .count();
    assert!(pools > 0 && variants > 0, "{text}");
    let path = write("demo.toml", &text);
    let path_str = path.to_str().unwrap();
    let out = keel(&["check", "--config", path_str]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let last = stdout.lines().last().unwrap_or("");
    let (file, rest) = last.split_once(": ").unwrap_or_else(|| panic!("{stdout}"));
    assert_eq!(file, path_str);
    let counts = rest
        .strip_prefix("ok (")
        .and_then(|r| r.split_once(", listen "))
        .map(|(c, _)| c)
        .unwrap_or_else(|| panic!("{stdout}"));
    assert_eq!(counts, format!("{pools} pools, {variants} variants"));
}
