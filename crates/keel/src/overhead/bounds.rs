//! `keel bench overhead --tail-bounds`: throughput at tail-latency bounds, the method published
//! gateway benchmarks use. For each gateway and mode, the offered rate climbs the ramp; at each
//! rate a run straight to the upstream and a run through the gateway (alternating, `--rounds`
//! times, medians of each round's P99) give the added P99 of the whole request. The answer is
//! the highest rate whose added P99 stays under 1, 5 and 10 ms with no errors and at least 95%
//! of the offered rate achieved; the ramp stops once the gateway breaks the widest bound or
//! fails. A plot of added P99 against offered rate, one line per gateway and mode, is written
//! beside the table (`bounds.svg`).

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{
    cpu_plan, http_client, load, median, mode_name, pin, pinning, prepare, start_target,
    stop_target, write_rows, zero_latency_upstream, Options, Target, RAMP,
};

/// The tail bounds reported, ms of added P99.
const BOUNDS_MS: [f64; 3] = [1.0, 5.0, 10.0];

/// One point of a curve: offered rate, added P99 (ms), whether the gateway kept up. Written
/// into `bounds.json` as it is here and read back from it by [`replot`].
#[derive(Clone, Copy, Serialize, Deserialize)]
struct Point {
    rps: f64,
    added_p99_ms: f64,
    kept_up: bool,
}

/// Climbs the ramp for `t` in one mode.
async fn curve(
    client: &reqwest::Client,
    direct: &Target,
    t: &Target,
    stream: bool,
    o: &Options,
) -> Vec<Point> {
    let mut points = Vec::new();
    for rps in RAMP {
        let (mut d, mut g, mut kept_up) = (Vec::new(), Vec::new(), true);
        for _ in 0..o.rounds {
            let rd = load(client, direct, rps, o.duration, stream).await;
            let rg = load(client, t, rps, o.duration, stream).await;
            kept_up &= rg.errors == 0 && rg.achieved_rps >= 0.95 * rps;
            d.push(rd.total.p99_ms);
            g.push(rg.total.p99_ms);
        }
        let added = median(g) - median(d);
        eprintln!(
            "  {:<8} {:<6} {rps:>6} req/s: added P99 {added:.2} ms{}",
            t.name,
            mode_name(stream),
            if kept_up { "" } else { " (did not keep up)" }
        );
        points.push(Point {
            rps,
            added_p99_ms: added,
            kept_up,
        });
        if !kept_up || added >= BOUNDS_MS[BOUNDS_MS.len() - 1] {
            break;
        }
    }
    points
}

/// The highest rate of the curve under `bound` ms, every lower rate under it too.
fn rate_under(points: &[Point], bound: f64) -> f64 {
    points
        .iter()
        .take_while(|p| p.kept_up && p.added_p99_ms < bound)
        .last()
        .map_or(0.0, |p| p.rps)
}

const HEADER: &str = "contender mode    req/s at +P99 < 1 ms   < 5 ms   < 10 ms\n";

pub async fn run(o: Options) -> Result<(), String> {
    let fleet = zero_latency_upstream().await?;
    let peers_dir = o
        .out
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("keel-bench-bounds"));
    let (pinned, gw_cpu, bench_cpus) = cpu_plan(o.pin);
    if pinned {
        pin(std::process::id(), &bench_cpus);
    }
    let client = http_client()?;
    let direct = Target::direct(&fleet);
    let intro = format!(
        "keel bench overhead --tail-bounds: one zero-latency simulated upstream; {}; {} s × {} rounds per rate\n",
        pinning(pinned, &gw_cpu, "load generator and upstream", &bench_cpus),
        o.duration,
        o.rounds,
    );
    print!("{intro}{HEADER}");
    let mut lines = String::new();
    let mut curves: Vec<Curve> = Vec::new();
    let mut rows = Vec::new();
    for name in &o.contenders {
        let Some(mut target) = start_target(name, &fleet, &o, &peers_dir, &mut lines).await? else {
            continue;
        };
        prepare(&client, &direct, &target, pinned.then_some(gw_cpu.as_str())).await;
        for stream in [false, true] {
            let mode = mode_name(stream);
            let points = curve(&client, &direct, &target, stream, &o).await;
            let under: Vec<f64> = BOUNDS_MS.iter().map(|b| rate_under(&points, *b)).collect();
            let line = format!(
                "{name:<9} {mode:<7} {:>18} {:>8} {:>9}\n",
                under[0], under[1], under[2]
            );
            print!("{line}");
            lines.push_str(&line);
            rows.push(json!({
                "contender": name, "mode": mode,
                "rps_under_ms": BOUNDS_MS.iter().zip(&under).map(|(b, r)| json!({"bound_ms": b, "rps": r})).collect::<Vec<_>>(),
                "curve": points,
            }));
            curves.push(Curve {
                contender: name.clone(),
                mode: mode.to_owned(),
                curve: points,
            });
        }
        stop_target(&mut target);
    }
    if let Some(dir) = &o.out {
        let text = format!("{intro}{HEADER}{lines}");
        let path = write_rows(dir, "bounds", &o, pinned, rows, &text)?;
        std::fs::write(dir.join("bounds.svg"), plot(&curves)).map_err(|e| e.to_string())?;
        println!("written {}, bounds.txt and bounds.svg", path.display());
    }
    Ok(())
}

/// One gateway's curve in one mode, as `bounds.json` keeps it (its rows carry more fields,
/// which the plot does not read).
#[derive(Deserialize)]
struct Curve {
    contender: String,
    mode: String,
    curve: Vec<Point>,
}

/// Draws `bounds.svg` again from a saved `bounds.json` (`keel bench plot-bounds`): a result
/// kept in the repository can be re-drawn without measuring it again.
pub fn replot(json: &str) -> Result<String, String> {
    #[derive(Deserialize)]
    struct Saved {
        rows: Vec<Curve>,
    }
    let saved: Saved = serde_json::from_str(json).map_err(|e| format!("not a bounds.json: {e}"))?;
    Ok(plot(&saved.rows))
}

/// An SVG line chart: offered rate (log scale) against added P99 (ms, clipped at 20), one
/// polyline per curve (a colour per gateway, streams dashed), the bounds as dashed grey lines.
fn plot(curves: &[Curve]) -> String {
    let (w, h, left, bottom, top, right) = (720.0, 420.0, 60.0, 40.0, 20.0, 180.0);
    let (x0, x1) = (RAMP[0].log10(), RAMP[RAMP.len() - 1].log10());
    let y_max = 20.0;
    let x = |rps: f64| left + (rps.log10() - x0) / (x1 - x0) * (w - left - right);
    let y = |ms: f64| top + (1.0 - ms.clamp(0.0, y_max) / y_max) * (h - top - bottom);
    let colours = [
        "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    ];
    // One colour per gateway (in the order they first appear), its streams dashed: a plot of
    // five gateways in two modes must not give two of them the same line.
    let mut gateways: Vec<&str> = Vec::new();
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for rps in RAMP {
        s += &format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{rps}</text>\n",
            x(rps),
            h - bottom + 15.0
        );
    }
    s += &format!(
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">offered req/s</text>\n",
        (left + w - right) / 2.0,
        h - 5.0
    );
    for ms in [0.0, 1.0, 5.0, 10.0, 20.0] {
        let dash = if BOUNDS_MS.contains(&ms) {
            " stroke-dasharray=\"4 3\""
        } else {
            ""
        };
        s += &format!(
            "<line x1=\"{left}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ccc\"{dash}/>\n<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{ms} ms</text>\n",
            w - right,
            y(ms),
            y(ms),
            left - 5.0,
            y(ms) + 4.0
        );
    }
    for (i, c) in curves.iter().enumerate() {
        let g = gateways
            .iter()
            .position(|n| *n == c.contender)
            .unwrap_or_else(|| {
                gateways.push(&c.contender);
                gateways.len() - 1
            });
        let colour = colours[g % colours.len()];
        let dash = if c.mode == "stream" {
            " stroke-dasharray=\"6 3\""
        } else {
            ""
        };
        let pts: Vec<String> = c
            .curve
            .iter()
            .map(|p| format!("{:.1},{:.1}", x(p.rps), y(p.added_p99_ms)))
            .collect();
        s += &format!(
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\"{dash} points=\"{}\"/>\n<text x=\"{:.1}\" y=\"{:.1}\" fill=\"{colour}\">{} {}</text>\n",
            pts.join(" "),
            w - right + 10.0,
            top + 15.0 * (i as f64 + 1.0),
            c.contender,
            c.mode
        );
    }
    s + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(rps: f64, ms: f64) -> Point {
        Point {
            rps,
            added_p99_ms: ms,
            kept_up: true,
        }
    }

    fn curve(contender: &str, mode: &str, curve: Vec<Point>) -> Curve {
        Curve {
            contender: contender.into(),
            mode: mode.into(),
            curve,
        }
    }

    /// Each polyline's stroke and dash, in order.
    fn styles(svg: &str) -> Vec<(String, bool)> {
        svg.lines()
            .filter(|l| l.starts_with("<polyline"))
            .map(|l| {
                let stroke = l.split("stroke=\"").nth(1).unwrap();
                (stroke[..7].to_owned(), l.contains("stroke-dasharray"))
            })
            .collect()
    }

    #[test]
    fn every_curve_of_many_gateways_has_a_line_of_its_own() {
        let names = ["keel", "hyper", "nginx", "litellm", "portkey"];
        let curves: Vec<_> = names
            .iter()
            .flat_map(|n| ["whole", "stream"].map(|m| curve(n, m, vec![point(10.0, 0.5)])))
            .collect();
        let s = styles(&plot(&curves));
        assert_eq!(s.len(), 10);
        for (i, a) in s.iter().enumerate() {
            assert_eq!(a.1, i % 2 == 1, "streams dashed, whole answers not");
            for b in &s[i + 1..] {
                assert_ne!(a, b, "two curves drawn alike");
            }
        }
        // A gateway's two modes share its colour.
        assert_eq!(s[0].0, s[1].0);
    }

    #[test]
    fn a_saved_result_is_drawn_as_the_run_drew_it() {
        let curves = vec![
            curve("keel", "whole", vec![point(10.0, 0.4), point(25.0, 0.6)]),
            curve(
                "nginx",
                "stream",
                vec![
                    point(10.0, 0.2),
                    Point {
                        rps: 25.0,
                        added_p99_ms: 30.0,
                        kept_up: false,
                    },
                ],
            ),
        ];
        // As `run` writes a row: more fields than the plot reads.
        let saved = serde_json::json!({"rows": curves.iter().map(|c| serde_json::json!({
            "contender": c.contender, "mode": c.mode, "rps_under_ms": [], "curve": c.curve,
        })).collect::<Vec<_>>()});
        assert_eq!(replot(&saved.to_string()).unwrap(), plot(&curves));
        assert!(replot("{}").unwrap_err().contains("bounds.json"));
        assert!(
            replot(r#"{"rows":[{"contender":"keel","mode":"whole","curve":[{"rps":10}]}]}"#)
                .is_err()
        );
    }
}
