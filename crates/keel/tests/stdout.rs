//! `keel serve` whose stdout nobody reads (a log shipper paused, a container runtime's reader
//! fallen behind) keeps answering: log lines wait in the log writer's queue, never in a
//! request. Before the log writer, the access-log write that filled the pipe blocked the runtime
//! worker it ran on, and every request behind it.

use std::process::Stdio;
use std::time::Duration;

use serde_json::json;

mod support;
use support::{free_port, keel_serve};

#[tokio::test]
async fn a_stdout_nobody_reads_never_stalls_requests() {
    let fleet = keel_sim::Fleet::start_n(1, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let port = free_port();
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("stdout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("keel.toml");
    std::fs::write(
        &cfg,
        format!(
            "listen = \"127.0.0.1:{port}\"\n[log]\naccess = \"stdout\"\n[[pools]]\nname = \"p\"\n\
             [[pools.variants]]\nname = \"v\"\nurl = \"{}\"\nprotocol = \"openai\"\nupstream_model = \"sim\"\n",
            fleet.get(0).openai_base()
        ),
    )
    .unwrap();
    // stdout is a pipe whose reading end this test holds and never reads: it fills at 64 KiB.
    let keel = keel_serve(&cfg, port, "info", Stdio::piped());
    let client = keel_sim::http_client();
    let body = json!({"model": "p", "max_tokens": 8,
                      "messages": [{"role": "user", "content": "a line in the log"}]});
    // About 400 bytes of access line each: 400 requests write three times the pipe's capacity.
    for i in 0..400 {
        let sent = client
            .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
            .json(&body)
            .send();
        let resp = tokio::time::timeout(Duration::from_secs(30), sent)
            .await
            .unwrap_or_else(|_| panic!("request {i} got no answer: keel stalled on its stdout"))
            .expect("keel reachable");
        assert_eq!(resp.status(), 200, "request {i}");
    }
    let metrics = client
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("keel_log_lines_dropped_total 0"),
        "the queue took every line: {metrics}"
    );
    drop(keel);
}
