//! `keel bench overhead --sequential`: one client, one connection, each request sent as soon as
//! the previous answer has been read (a closed loop), straight to the upstream and through each
//! gateway in alternating rounds. This is how a single caller — a script, a test suite, an
//! agent's tool loop — sees a gateway: the machine stays awake between requests (unlike an open
//! loop at 10 req/s, where every request wakes sleeping cores and nginx itself adds about a
//! millisecond), so what is left is the gateway's own path. Reports the added P50/P90/P99 of
//! the whole request and the requests per second one client completes.

use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpStream;

use super::{
    cpu_plan, median, mode_name, pin, pinning, prepare, start_target, stop_target, write_rows,
    zero_latency_upstream, Options, Target,
};

/// One round's latencies (µs) and how many requests it completed per second.
struct Round {
    p50_us: f64,
    p90_us: f64,
    p99_us: f64,
    rps: f64,
    errors: u64,
    /// Connections opened (1 unless the target closed one).
    connections: u64,
}

/// One HTTP/1.1 connection to a target, kept for every request of a round: a pooled client
/// (reqwest's) opens a second connection when the next request is sent before the pool has
/// taken the first one back, which here is every request or two, and the rounds would measure
/// connection set-ups. A connection the target closes is opened again (and counted).
struct OneConnection {
    authority: String,
    path: String,
    send: Option<http1::SendRequest<Full<Bytes>>>,
    opened: u64,
}

impl OneConnection {
    fn to(t: &Target) -> Result<OneConnection, String> {
        let url: http::Uri = format!("{}/chat/completions", t.base)
            .parse()
            .map_err(|e| format!("{}: {e}", t.base))?;
        let authority = url
            .authority()
            .ok_or_else(|| format!("{} has no host", t.base))?
            .to_string();
        let path = url.path().to_owned();
        Ok(OneConnection {
            authority,
            path,
            send: None,
            opened: 0,
        })
    }

    /// Sends one POST of `body` and reads the whole answer: whether it succeeded. A request the
    /// connection could not take (the target closed it: nginx does after `keepalive_requests`)
    /// goes once more on a new connection, as an HTTP client's pool does.
    async fn post(&mut self, t: &Target, body: &Bytes) -> bool {
        for _ in 0..2 {
            match self.try_post(t, body).await {
                Some(ok) => return ok,
                None => self.send = None,
            }
        }
        false
    }

    /// `None` when the request could not be sent on the connection.
    async fn try_post(&mut self, t: &Target, body: &Bytes) -> Option<bool> {
        if self.send.as_ref().is_none_or(|s| s.is_closed()) {
            let tcp = TcpStream::connect(&self.authority).await.ok()?;
            let _ = tcp.set_nodelay(true);
            let (send, conn) = http1::handshake(TokioIo::new(tcp)).await.ok()?;
            tokio::spawn(conn);
            self.send = Some(send);
            self.opened += 1;
        }
        let send = self.send.as_mut()?;
        // Waits for the connection to have finished the last answer, instead of opening another.
        send.ready().await.ok()?;
        let mut req = http::Request::post(&self.path)
            .header(http::header::HOST, &self.authority)
            .header(http::header::CONTENT_TYPE, "application/json");
        for (k, v) in &t.headers {
            req = req.header(k, v);
        }
        let req = req.body(Full::new(body.clone())).ok()?;
        let r = send.send_request(req).await.ok()?;
        let ok = r.status().is_success();
        Some(r.into_body().collect().await.is_ok() && ok)
    }
}

/// Requests back to back on one connection for `secs`.
async fn round(t: &Target, stream: bool, secs: f64) -> Result<Round, String> {
    let body = json!({"model": t.model, "max_tokens": 16, "stream": stream,
        "messages": [{"role": "user", "content": "say hi"}]});
    let body = Bytes::from(body.to_string());
    let mut conn = OneConnection::to(t)?;
    let mut hist = Histogram::<u64>::new(3).expect("a histogram");
    let (mut done, mut errors) = (0u64, 0u64);
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(secs);
    while Instant::now() < until {
        let t0 = Instant::now();
        if conn.post(t, &body).await {
            let _ = hist.record(t0.elapsed().as_micros() as u64);
            done += 1;
        } else {
            errors += 1;
        }
    }
    let q = |p: f64| hist.value_at_quantile(p) as f64;
    Ok(Round {
        p50_us: q(0.50),
        p90_us: q(0.90),
        p99_us: q(0.99),
        rps: done as f64 / start.elapsed().as_secs_f64(),
        errors,
        connections: conn.opened,
    })
}

const HEADER: &str =
    "contender mode    +p50 µs  +p90 µs  +p99 µs   req/s one client (direct)   errors\n";

pub async fn run(o: Options) -> Result<(), String> {
    let fleet = zero_latency_upstream().await?;
    let peers_dir = o
        .out
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("keel-bench-sequential"));
    let (pinned, gw_cpu, bench_cpus) = cpu_plan(o.pin);
    if pinned {
        pin(std::process::id(), &bench_cpus);
    }
    // For the warm-up only; the rounds use one connection each (`OneConnection`).
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .map_err(|e| e.to_string())?;
    let direct = Target::direct(&fleet);
    let intro = format!(
        "keel bench overhead --sequential: one client, one connection, closed loop; one zero-latency simulated upstream; {}; {} s × {} rounds, alternating direct and gateway\n",
        pinning(pinned, &gw_cpu, "client and upstream", &bench_cpus),
        o.duration,
        o.rounds,
    );
    print!("{intro}{HEADER}");
    let (mut lines, mut rows) = (String::new(), Vec::new());
    for name in &o.contenders {
        let Some(mut target) = start_target(name, &fleet, &o, &peers_dir, &mut lines).await? else {
            continue;
        };
        prepare(&client, &direct, &target, pinned.then_some(gw_cpu.as_str())).await;
        for stream in [false, true] {
            let (mut d, mut g) = (Vec::new(), Vec::new());
            for _ in 0..o.rounds {
                d.push(round(&direct, stream, o.duration).await?);
                g.push(round(&target, stream, o.duration).await?);
            }
            let m = |rs: &[Round], f: fn(&Round) -> f64| median(rs.iter().map(f).collect());
            let added = |f: fn(&Round) -> f64| m(&g, f) - m(&d, f);
            let errors: u64 = g.iter().map(|r| r.errors).sum();
            // A connection opened again in a round is a connection set-up measured: said so.
            let reopened: u64 = g
                .iter()
                .chain(&d)
                .map(|r| r.connections.saturating_sub(1))
                .sum();
            if reopened > 0 {
                eprintln!(
                    "{name}: {reopened} connection(s) reopened in the rounds (the target closed them)"
                );
            }
            let mode = mode_name(stream);
            let line = format!(
                "{name:<9} {mode:<7} {:>7.0} {:>8.0} {:>8.0} {:>10.0} ({:>6.0}) {:>12}\n",
                added(|r| r.p50_us),
                added(|r| r.p90_us),
                added(|r| r.p99_us),
                m(&g, |r| r.rps),
                m(&d, |r| r.rps),
                errors
            );
            print!("{line}");
            lines.push_str(&line);
            let side = |rs: &[Round]| -> Value {
                json!({"p50_us": m(rs, |r| r.p50_us), "p90_us": m(rs, |r| r.p90_us),
                    "p99_us": m(rs, |r| r.p99_us), "rps": m(rs, |r| r.rps)})
            };
            rows.push(json!({"contender": name, "mode": mode, "direct": side(&d),
                "gateway": side(&g), "errors": errors, "reopened_connections": reopened,
                "added_us": {"p50": added(|r| r.p50_us), "p90": added(|r| r.p90_us), "p99": added(|r| r.p99_us)}}));
        }
        stop_target(&mut target);
    }
    if let Some(dir) = &o.out {
        let text = format!("{intro}{HEADER}{lines}");
        let path = write_rows(dir, "sequential", &o, pinned, rows, &text)?;
        println!("written {} and sequential.txt", path.display());
    }
    Ok(())
}
