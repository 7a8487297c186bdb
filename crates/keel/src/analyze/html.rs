//! `report.html`: one self-contained page (inline CSS and SVG, no script, no external asset) —
//! the recommendations first, a heat map of hour × pool (the simulated hit rate, requests in
//! each cell's tooltip), then per pool its figures, an hourly chart of requests and simulated
//! hits, the hit rate by TTL with and without normalization, and its top templates. Every
//! string from the log is escaped.

use std::collections::BTreeSet;
use std::fmt::Write;

use keel_core::analyze::recommend::ttl_words;
use keel_core::analyze::report::{share, PoolReport, Report};

use super::Reading;

const CSS: &str = r#"
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
main{max-width:1180px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px}h3{font-size:15px;margin:16px 0 6px}
.muted{color:#667085}.card{background:#fff;border:1px solid #e4e7ec;border-radius:10px;padding:16px;margin:12px 0}
table{border-collapse:collapse;width:100%}th,td{padding:5px 8px;border-bottom:1px solid #eef0f3;text-align:right}
th:first-child,td:first-child{text-align:left}th{font-weight:600;color:#475467;font-size:12px;text-transform:uppercase;letter-spacing:.03em}
ol.recs li{margin:6px 0}.kind{display:inline-block;font-size:11px;padding:1px 6px;border-radius:8px;background:#e0f2f1;color:#00695c;margin-right:6px}
.kpis{display:flex;gap:12px;flex-wrap:wrap}.kpi{flex:1;min-width:140px}.kpi b{display:block;font-size:20px}
svg text{font:11px system-ui,sans-serif;fill:#475467}.grid{display:grid;grid-template-columns:1fr 1fr;gap:12px}
code{font-size:12px;background:#f2f4f7;padding:1px 4px;border-radius:4px}
"#;

/// Escapes text for HTML (element content and attribute values).
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// A hit rate as a colour: pale grey (none) to deep teal (all).
fn colour(rate: f64) -> String {
    let t = rate.clamp(0.0, 1.0);
    let mix = |a: f64, b: f64| (a + (b - a) * t.sqrt()).round() as u8;
    format!(
        "#{:02x}{:02x}{:02x}",
        mix(238.0, 0.0),
        mix(241.0, 105.0),
        mix(245.0, 92.0)
    )
}

/// The page.
pub fn render(r: &Report, reading: &Reading, sources: &[String]) -> String {
    let mut h = String::with_capacity(64 * 1024);
    let _ = write!(
        h,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width,initial-scale=1\"><title>keel analyze</title><style>{CSS}</style></head><body><main>"
    );
    let requests: u64 = r.pools.iter().map(|p| p.figures.requests).sum();
    let hits: u64 = r.pools.iter().map(|p| p.figures.simulated.hits).sum();
    let spend: f64 = r.pools.iter().map(|p| p.figures.simulated.spend_usd).sum();
    let span = match (r.first_ms, r.last_ms) {
        (Some(f), Some(l)) => format!(
            "{} to {}",
            keel_core::analyze::report::hour_label(f / 3_600_000),
            keel_core::analyze::report::hour_label(l / 3_600_000)
        ),
        _ => "no requests".into(),
    };
    let _ = write!(
        h,
        "<h1>What can go to zero</h1><p class=\"muted\">{} access lines ({:.1} MB) from {}; {span} (UTC hours).</p>",
        reading.lines,
        reading.bytes as f64 / 1e6,
        esc(&sources.join(", "))
    );
    let _ = write!(
        h,
        "<div class=\"kpis\"><div class=\"card kpi\"><b>{requests}</b>requests</div><div class=\"card kpi\"><b>{}</b>answered without an upstream call (simulated cache, as configured)</div><div class=\"card kpi\"><b>${:.2}/day</b>upstream spend saved</div><div class=\"card kpi\"><b>{}</b>pools</div></div>",
        pct(share(hits, requests)),
        spend / r.days,
        r.pools.len()
    );
    h.push_str("<h2>Recommendations</h2><div class=\"card\">");
    if r.recommendations.is_empty() {
        h.push_str(
            "<p class=\"muted\">Nothing here would be saved by the cache or normalization.</p>",
        );
    } else {
        h.push_str("<ol class=\"recs\">");
        for x in &r.recommendations {
            let _ = write!(
                h,
                "<li><span class=\"kind\">{}</span>{}</li>",
                esc(x.kind),
                esc(&x.text)
            );
        }
        h.push_str("</ol>");
    }
    h.push_str("</div>");
    heat_map(&mut h, r);
    for p in &r.pools {
        pool_section(&mut h, r, p);
    }
    if r.approximate {
        h.push_str(
            "<p class=\"muted\">Some counts passed their memory bounds and are approximate.</p>",
        );
    }
    h.push_str("<p class=\"muted\">The log holds cache keys and template ids (hashes), never prompt or answer text. Figures: report.json.</p></main></body></html>\n");
    h
}

/// Hours shown at most in the heat map (the latest).
const MAX_HOURS: usize = 24 * 14;

fn heat_map(h: &mut String, r: &Report) {
    let hours: BTreeSet<i64> = r
        .pools
        .iter()
        .flat_map(|p| p.hours.iter().map(|x| x.hour))
        .collect();
    let hours: Vec<i64> = hours.into_iter().rev().take(MAX_HOURS).rev().collect();
    let (cell, left, top) = (22.0, 140.0, 64.0);
    let w = (left + cell * hours.len() as f64 + 10.0).max(left + 380.0);
    let ht = top + cell * r.pools.len() as f64 + 40.0;
    let _ = write!(
        h,
        "<h2>Simulated hit rate by hour and pool</h2><div class=\"card\" style=\"overflow-x:auto\"><svg id=\"heatmap\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{ht}\" role=\"img\" aria-label=\"heat map of the simulated cache hit rate, hour by pool\">"
    );
    for (i, hour) in hours.iter().enumerate() {
        if i % 3 == 0 {
            let x = left + cell * i as f64 + cell / 2.0;
            let label = keel_core::analyze::report::hour_label(*hour);
            let _ = write!(
                h,
                "<text transform=\"translate({x},{}) rotate(-50)\">{}</text>",
                top - 6.0,
                esc(&label[5..])
            );
        }
    }
    for (row, p) in r.pools.iter().enumerate() {
        let y = top + cell * row as f64;
        let _ = write!(
            h,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>",
            left - 8.0,
            y + cell * 0.68,
            esc(&p.pool)
        );
        for hr in &p.hours {
            let Some(i) = hours.iter().position(|x| *x == hr.hour) else {
                continue;
            };
            let f = &hr.figures;
            let _ = write!(
                h,
                "<rect class=\"cell\" x=\"{}\" y=\"{y}\" width=\"{}\" height=\"{}\" rx=\"3\" fill=\"{}\"><title>{} {}: {} requests, {} hit (simulated), {} repeats</title></rect>",
                left + cell * i as f64,
                cell - 2.0,
                cell - 2.0,
                colour(f.simulated_hit_rate),
                esc(&p.pool),
                esc(&hr.label),
                f.requests,
                pct(f.simulated_hit_rate),
                pct(share(f.repeats_normalized, f.requests)),
            );
        }
    }
    let ly = top + cell * r.pools.len() as f64 + 14.0;
    for (i, rate) in [0.0, 0.1, 0.25, 0.5, 0.75, 1.0].iter().enumerate() {
        let x = left + 60.0 * i as f64;
        let _ = write!(
            h,
            "<rect x=\"{x}\" y=\"{ly}\" width=\"14\" height=\"14\" rx=\"3\" fill=\"{}\"/><text x=\"{}\" y=\"{}\">{}</text>",
            colour(*rate),
            x + 18.0,
            ly + 11.0,
            pct(*rate)
        );
    }
    h.push_str("</svg></div>");
}

fn pool_section(h: &mut String, r: &Report, p: &PoolReport) {
    let f = &p.figures;
    let n = f.requests;
    let _ = write!(
        h,
        "<h2 id=\"pool-{}\">Pool <code>{}</code></h2>",
        esc(&p.pool),
        esc(&p.pool)
    );
    let _ = write!(
        h,
        "<div class=\"card\"><table><tr><th>requests</th><th>fingerprinted</th><th>exact repeats</th><th>after normalization</th><th>deterministic</th><th>sampled</th><th>templates</th><th>entropy (bits)</th><th>output-length CV</th><th>simulated hit rate</th></tr><tr><td>{n}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.2}</td><td>{}</td><td>{}</td></tr></table>",
        f.fingerprinted,
        pct(share(f.repeats_raw, n)),
        pct(share(f.repeats_normalized, n)),
        pct(share(f.deterministic, n)),
        pct(share(f.sampled, n)),
        f.templates,
        f.template_entropy_bits,
        p.output_cv_mean.map_or("–".into(), |c| format!("{c:.2}")),
        pct(f.simulated_hit_rate),
    );
    let s = &f.simulated;
    let _ = write!(
        h,
        "<p>Replayed with ttl {} ({}), byte budget shared by all pools: <b>{}</b> upstream requests, <b>{}</b> tokens, <b>${:.2}</b> (${:.2}/day) and <b>{:.0} s</b> of client waiting saved.</p></div>",
        ttl_words(p.policy.ttl_ms),
        if p.policy.normalizes { "normalized keys" } else { "raw keys" },
        s.hits,
        s.tokens_in + s.tokens_out,
        s.spend_usd,
        s.spend_usd / r.days,
        s.latency_ms / 1000.0
    );
    h.push_str(
        "<div class=\"grid\"><div class=\"card\"><h3>Requests and simulated hits per hour</h3>",
    );
    hour_chart(h, p);
    h.push_str("</div><div class=\"card\"><h3>Hit rate by TTL</h3><table><tr><th>ttl</th><th>raw keys</th><th>normalized (syntax)</th></tr>");
    for (i, ttl) in keel_core::analyze::report::TTL_CANDIDATES_MS
        .iter()
        .enumerate()
    {
        let at = |norm: bool| {
            p.by_scenario
                .get(1 + i * 2 + usize::from(norm))
                .map_or(0, |x| x.hits)
        };
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
            ttl_words(*ttl),
            pct(share(at(false), n)),
            pct(share(at(true), n))
        );
    }
    h.push_str("</table></div></div>");
    h.push_str("<div class=\"card\"><h3>Top templates</h3><table><tr><th>template</th><th>requests</th><th>share</th><th>deterministic</th><th>mean output tokens</th><th>output-length CV</th></tr>");
    for t in &p.top_templates {
        let _ = write!(
            h,
            "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&t.id),
            t.requests,
            pct(t.share),
            pct(t.deterministic_share),
            t.tokens_out_mean.map_or("–".into(), |m| format!("{m:.0}")),
            t.output_cv.map_or("–".into(), |c| format!("{c:.2}"))
        );
    }
    h.push_str("</table></div>");
}

/// Bars per hour: requests (grey) with the simulated hits (teal) over them.
fn hour_chart(h: &mut String, p: &PoolReport) {
    let hours: Vec<_> = p.hours.iter().rev().take(MAX_HOURS).rev().collect();
    let (w, ht, pad) = (520.0, 160.0, 24.0);
    let max = hours
        .iter()
        .map(|x| x.figures.requests)
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let bw = (w - pad) / hours.len().max(1) as f64;
    let _ = write!(
        h,
        "<svg class=\"hours\" xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {w} {ht}\" width=\"100%\" role=\"img\" aria-label=\"requests and simulated hits per hour\">"
    );
    for (i, x) in hours.iter().enumerate() {
        let f = &x.figures;
        let bx = pad + bw * i as f64;
        let rh = (ht - pad) * f.requests as f64 / max;
        let hh = (ht - pad) * f.simulated.hits as f64 / max;
        let _ = write!(
            h,
            "<rect x=\"{bx:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{rh:.1}\" fill=\"#d0d5dd\"><title>{}: {} requests</title></rect><rect x=\"{bx:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{hh:.1}\" fill=\"#00695c\"><title>{}: {} simulated hits</title></rect>",
            ht - pad - rh,
            (bw - 1.0).max(0.5),
            esc(&x.label),
            f.requests,
            ht - pad - hh,
            (bw - 1.0).max(0.5),
            esc(&x.label),
            f.simulated.hits
        );
    }
    let _ = write!(
        h,
        "<text x=\"0\" y=\"10\">{max:.0}</text><text x=\"{pad}\" y=\"{}\">{}</text></svg>",
        ht - 6.0,
        hours.first().map_or(String::new(), |x| esc(&x.label))
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::analyze::report::{Analyzer, Options, Record};

    #[test]
    fn the_page_is_self_contained_and_escapes_the_log() {
        let mut a = Analyzer::new(Options::default());
        for i in 0..50 {
            a.add(&Record {
                pool: "<script>x</script>".into(),
                end_ms: 1_796_342_400_000 + i * 600_000,
                total_ms: 100.0,
                ok: true,
                key_raw: Some(i as u64 % 5),
                key_norm: Some(i as u64 % 5),
                template: Some(1),
                deterministic: true,
                temperature: Some(0.0),
                tools: false,
                tokens_in: 10,
                tokens_out: 10,
                spend_usd: 0.01,
            });
        }
        let html = render(&a.finish(), &Reading::default(), &["a.log".into()]);
        assert!(!html.contains("<script>"), "unescaped pool name");
        assert!(html.contains("&lt;script&gt;"));
        for external in ["http://", "https://", "src=", "<link", "@import", "url("] {
            let outside_svg_ns = html.replace("http://www.w3.org/2000/svg", "");
            assert!(!outside_svg_ns.contains(external), "{external} in the page");
        }
        assert!(
            html.matches("class=\"cell\"").count() >= 8,
            "one cell per hour"
        );
        assert!(html.contains("enable `[pools.cache]`"));
    }
}
