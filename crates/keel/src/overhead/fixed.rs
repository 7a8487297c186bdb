//! The fixed-rate half of `keel bench overhead`'s default mode: each contender at each rate it
//! sustains, in rounds that alternate the upstream called directly and the same load through
//! the gateway, so that both see the same machine state; and from those runs, each peer's CPU
//! per request over keel's.

use serde_json::{json, Value};

use super::{
    load, measure, median_or_null, mode_name, peak_rss_mib, prepare, row, say, start_target,
    stop_target, sustained_over_rounds, Bench, Options, Ramp, Target, SATURATED,
};

/// One contender's fixed-rate runs on a fresh start of its gateway (the ramp ends in overload,
/// which leaves any process holding more memory than it needs), in both modes, skipping the
/// rates over what its ramps sustained (`rounds`; none: `--max-rate` was off). Its entry in
/// the report, or `None` where it did not run (it could not start, in the ramps or now).
pub(super) async fn contender(
    o: &Options,
    b: &Bench<'_>,
    name: &str,
    rounds: Option<&[Ramp]>,
    lines: &mut String,
) -> Result<Option<Value>, String> {
    if rounds.is_some_and(|r| r.is_empty()) {
        return Ok(None);
    }
    // Its own directory: a peer's pid file must not be removed by the ramp's instance as it
    // exits.
    let dir = b.peers_dir.join("fixed");
    let Some(mut target) = start_target(name, b.fleet, o, &dir, lines).await? else {
        return Ok(None);
    };
    prepare(b.client, b.direct, &target, b.gw_cpu).await;
    let mut by_rate = Vec::new();
    let mut sustainable = Vec::new();
    for (i, stream) in [false, true].into_iter().enumerate() {
        let mode = mode_name(stream);
        sustainable.push(match rounds {
            Some(r) => sustained_over_rounds(mode, r, i),
            None => json!({"mode": mode, "max_sustainable_rps": null}),
        });
        let max = sustainable[i]["max_sustainable_rps"].as_f64();
        for &rps in &o.rates {
            if let Some(m) = max.filter(|m| rps > *m) {
                say(
                    lines,
                    &format!(
                        "{name:<8} {rps:>6} {mode:<7} over its sustainable rate ({m} req/s): not run\n"
                    ),
                );
                continue;
            }
            by_rate.push(at_rate(o, b, &target, rps, stream, lines).await);
        }
    }
    let peak = target.pid.and_then(peak_rss_mib);
    say(
        lines,
        &format!(
            "{name:<8} highest sustainable rate: whole {}, stream {}; peak memory {}\n",
            sustainable_text(&sustainable[0]),
            sustainable_text(&sustainable[1]),
            peak.map_or("unknown".into(), |m| format!("{m:.1} MiB"))
        ),
    );
    stop_target(&mut target);
    Ok(Some(
        json!({"contender": name, "sustainable": sustainable, "peak_rss_mib": peak, "rates": by_rate}),
    ))
}

/// `o.rounds` runs at `rps`, each direct and then through `target`: the medians of both, the
/// latency the gateway added (µs) and its CPU per request; its line goes to the report.
async fn at_rate(
    o: &Options,
    b: &Bench<'_>,
    target: &Target,
    rps: f64,
    stream: bool,
    lines: &mut String,
) -> Value {
    let (mut d, mut g, mut cpu) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..o.rounds {
        d.push(load(b.client, b.direct, rps, o.duration, stream).await);
        let run = measure(b.client, target, rps, o.duration, stream).await;
        cpu.extend(run.cpu_us_per_request());
        g.push(run.report);
    }
    let (d, mut g) = (row(&d), row(&g));
    g["cpu_us_per_request"] = median_or_null(cpu);
    let added = |k: &str| (g[k].as_f64().unwrap_or(0.0) - d[k].as_f64().unwrap_or(0.0)) * 1000.0;
    let (name, mode) = (&target.name, mode_name(stream));
    say(
        lines,
        &format!(
            "{name:<8} {rps:>6} {mode:<7} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>8} {:>8} {:>8}\n",
            added("ttfb_p50_ms"),
            added("ttfb_p99_ms"),
            added("total_p50_ms"),
            added("total_p99_ms"),
            g["errors"],
            g["requests"],
            g["cpu_us_per_request"]
                .as_f64()
                .map_or("—".into(), |c| format!("{c:.0}"))
        ),
    );
    json!({"rps": rps, "mode": mode, "direct": d, "gateway": g,
        "added_us": {"ttfb_p50": added("ttfb_p50_ms"), "ttfb_p99": added("ttfb_p99_ms"),
                     "total_p50": added("total_p50_ms"), "total_p99": added("total_p99_ms")}})
}

/// A mode's highest sustainable rate in words: the median, the first rate missed with how much
/// of its core the gateway used there, and each round's figure.
fn sustainable_text(s: &Value) -> String {
    let cores = s["gateway_cores_where_missed"]
        .as_f64()
        .map_or(String::new(), |c| {
            let what = if c >= SATURATED {
                "saturated"
            } else {
                "not saturated: the limit was elsewhere"
            };
            format!(", the gateway at {c:.2} of its core there, {what}")
        });
    let failed = s["first_unsustained_rps"]
        .as_f64()
        .map_or(String::new(), |f| format!(" ({f} not{cores})"));
    let each = s["rounds_rps"]
        .as_array()
        .filter(|r| r.len() > 1)
        .map_or(String::new(), |r| {
            let r: Vec<String> = r
                .iter()
                .filter_map(Value::as_f64)
                .map(|v| format!("{v:.0}"))
                .collect();
            format!(" [rounds {}]", r.join(", "))
        });
    s["max_sustainable_rps"]
        .as_f64()
        .map_or("not measured".into(), |m| {
            format!("{m} req/s{failed}{each}")
        })
}

/// Per peer, rate and mode both ran: the peer's CPU per request over keel's at that rate (how
/// many of keel's requests a core second serves for each of the peer's). It compares the
/// gateways' cost alone, where the ramp compares whatever saturates first (on a machine whose
/// load generator shares a core with the upstream, that can be the generator). It is not a
/// capacity: CPU per request falls as the rate rises (more requests a wake-up).
pub(super) fn cpu_ratios(report: &[Value]) -> Vec<String> {
    let cpu_of = |c: &Value, rps: &Value, mode: &Value| {
        c["rates"]
            .as_array()?
            .iter()
            .find(|r| &r["rps"] == rps && &r["mode"] == mode)?["gateway"]["cpu_us_per_request"]
            .as_f64()
    };
    let Some(keel) = report.iter().find(|c| c["contender"] == "keel") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for peer in report.iter().filter(|c| c["contender"] != "keel") {
        let name = peer["contender"].as_str().unwrap_or("?");
        for r in keel["rates"].as_array().into_iter().flatten() {
            let (rps, mode) = (&r["rps"], &r["mode"]);
            if let (Some(k), Some(p)) = (cpu_of(keel, rps, mode), cpu_of(peer, rps, mode)) {
                out.push(format!(
                    "CPU per request at {rps} req/s, {name}'s over keel's, {}: {:.2}× (keel {k:.0} µs, {name} {p:.0} µs a request)\n",
                    mode.as_str().unwrap_or("?"),
                    p / k,
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sustainable_rates_read_as_the_median_the_miss_and_each_round() {
        let s = json!({"max_sustainable_rps": 6000.0, "first_unsustained_rps": 6500.0,
            "rounds_rps": [5500.0, 7500.0, 6000.0], "gateway_cores_where_missed": 0.95});
        assert_eq!(
            sustainable_text(&s),
            "6000 req/s (6500 not, the gateway at 0.95 of its core there, saturated) [rounds 5500, 7500, 6000]"
        );
        let s = json!({"max_sustainable_rps": 3000.0, "first_unsustained_rps": 3500.0,
            "rounds_rps": [3000.0], "gateway_cores_where_missed": 0.6});
        assert_eq!(
            sustainable_text(&s),
            "3000 req/s (3500 not, the gateway at 0.60 of its core there, not saturated: the limit was elsewhere)"
        );
        assert_eq!(
            sustainable_text(&json!({"max_sustainable_rps": null})),
            "not measured"
        );
    }

    #[test]
    fn cpu_ratios_compare_each_rate_and_mode_both_ran() {
        let rate = |rps: f64, mode: &str, cpu: Option<f64>| json!({"rps": rps, "mode": mode, "gateway": {"cpu_us_per_request": cpu}});
        let report = vec![
            json!({"contender": "nginx", "rates": [rate(1000.0, "whole", Some(100.0)), rate(1000.0, "stream", Some(150.0))]}),
            json!({"contender": "keel", "rates": [rate(1000.0, "whole", Some(200.0)), rate(1000.0, "stream", None), rate(10.0, "whole", Some(900.0))]}),
        ];
        let lines = cpu_ratios(&report);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].contains("nginx's over keel's, whole: 0.50×"),
            "{}",
            lines[0]
        );
        assert!(
            lines[0].contains("keel 200 µs, nginx 100 µs"),
            "{}",
            lines[0]
        );
    }
}
