//! Figures of a run, their medians over repeats, flatness against the fault-free twin, and the
//! Markdown and SVG reports.

use hdrhistogram::Histogram;

use super::*;

/// Figures of one contender on one scenario.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Figures {
    pub contender: String,
    pub requests: usize,
    pub ttft_ms: [f64; 4],
    pub total_ms: [f64; 4],
    pub error_rate: f64,
    pub intact: f64,
    pub tgsv_ms: f64,
    pub extra_requests: f64,
    pub extra_tokens: f64,
    pub admitted_rps: f64,
    pub kv_hit_rate: f64,
    /// Prompt tokens the fleet computed (not found in its KV caches) per request.
    pub prefill_tokens: f64,
    /// The busiest variant's upstream requests ÷ the mean over variants.
    pub request_balance: f64,
    /// The highest time-averaged in-flight count (running + waiting) of a variant ÷ the mean.
    pub inflight_balance: f64,
    /// Share of retries made after waiting an advertised retry-after that succeeded.
    pub retry_after_success: Option<f64>,
    /// Figures by `x-keel-priority` (empty when the scenario sends none).
    pub by_priority: Vec<PriorityFigures>,
    /// The most requests (running + waiting) any one server held at once.
    pub upstream_peak: f64,
    /// Requests the servers refused (429 when full, and other errors they answered).
    pub upstream_refused: f64,
    /// Answers that came after the request's deadline (`deadline_ms`).
    pub late: f64,
    /// Runs the figures are medians of.
    pub runs: usize,
    /// Lowest and highest P99 TTFT and P99 total time (ms) across those runs.
    pub ttft_p99_range: [f64; 2],
    pub total_p99_range: [f64; 2],
    #[serde(skip)]
    pub ttft_cdf: Vec<(f64, f64)>,
}

/// The figures of one priority's requests.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PriorityFigures {
    pub priority: &'static str,
    pub requests: usize,
    /// TTFT from the first send of the work (retry waits included), successful work only.
    pub ttft_ms: [f64; 4],
    /// Share of the work that ended without an answer.
    pub error_rate: f64,
    /// 429/503 answers per piece of work.
    pub refusals_per_request: f64,
    /// Share of the work that was refused at least once.
    pub refused_share: f64,
}

/// Figures by priority, highest first; empty when no request had one.
pub(crate) fn by_priority(seen: &[Seen]) -> Result<Vec<PriorityFigures>, String> {
    let mut out = Vec::new();
    for p in keel_core::queue::Priority::ALL {
        let mine: Vec<&Seen> = seen.iter().filter(|x| x.priority == Some(p)).collect();
        if mine.is_empty() {
            continue;
        }
        let mut ttft =
            Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).map_err(|e| e.to_string())?;
        for x in mine.iter().filter(|x| x.ok) {
            if let Some(t) = x.ttft_us {
                let _ = ttft.record(t.max(1));
            }
        }
        let n = mine.len() as f64;
        out.push(PriorityFigures {
            priority: p.as_str(),
            requests: mine.len(),
            ttft_ms: quantiles(&ttft),
            error_rate: mine.iter().filter(|x| !x.ok).count() as f64 / n,
            refusals_per_request: mine.iter().map(|x| x.refusals as f64).sum::<f64>() / n,
            refused_share: mine.iter().filter(|x| x.refusals > 0).count() as f64 / n,
        });
    }
    Ok(out)
}

/// The median of each figure across runs (the CDF of the run with the median P99 TTFT).
pub(crate) fn median_figures(mut runs: Vec<Figures>) -> Figures {
    fn med(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }
    if runs.len() == 1 {
        return runs.remove(0);
    }
    runs.sort_by(|a, b| a.ttft_ms[2].total_cmp(&b.ttft_ms[2]));
    let m = |f: &dyn Fn(&Figures) -> f64| med(runs.iter().map(f).collect());
    let q = |f: &dyn Fn(&Figures) -> [f64; 4]| [0, 1, 2, 3].map(|i| m(&|x| f(x)[i]));
    let retry: Vec<f64> = runs.iter().filter_map(|x| x.retry_after_success).collect();
    let range = |f: &dyn Fn(&Figures) -> f64| {
        runs.iter()
            .map(f)
            .fold([f64::INFINITY, f64::NEG_INFINITY], |[lo, hi], v| {
                [lo.min(v), hi.max(v)]
            })
    };
    Figures {
        contender: runs[0].contender.clone(),
        requests: runs.iter().map(|x| x.requests).sum(),
        ttft_ms: q(&|x| x.ttft_ms),
        total_ms: q(&|x| x.total_ms),
        error_rate: m(&|x| x.error_rate),
        intact: m(&|x| x.intact),
        tgsv_ms: m(&|x| x.tgsv_ms),
        extra_requests: m(&|x| x.extra_requests),
        extra_tokens: m(&|x| x.extra_tokens),
        admitted_rps: m(&|x| x.admitted_rps),
        kv_hit_rate: m(&|x| x.kv_hit_rate),
        prefill_tokens: m(&|x| x.prefill_tokens),
        request_balance: m(&|x| x.request_balance),
        inflight_balance: m(&|x| x.inflight_balance),
        retry_after_success: (!retry.is_empty()).then(|| med(retry)),
        by_priority: runs[runs.len() / 2].by_priority.clone(),
        upstream_peak: m(&|x| x.upstream_peak),
        upstream_refused: m(&|x| x.upstream_refused),
        late: m(&|x| x.late),
        runs: runs.len(),
        ttft_p99_range: range(&|x| x.ttft_ms[2]),
        total_p99_range: range(&|x| x.total_ms[2]),
        ttft_cdf: runs[runs.len() / 2].ttft_cdf.clone(),
    }
}

/// The largest value ÷ the mean (1 = perfectly even; 1 when there is nothing to spread).
pub(crate) fn max_over_mean(xs: &[f64]) -> f64 {
    let mean = xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    if mean <= 0.0 {
        return 1.0;
    }
    xs.iter().copied().fold(0.0, f64::max) / mean
}

pub(crate) fn quantiles(h: &Histogram<u64>) -> [f64; 4] {
    if h.is_empty() {
        return [0.0; 4];
    }
    [0.5, 0.9, 0.99, 0.999].map(|q| h.value_at_quantile(q) as f64 / 1000.0)
}

/// A latency CDF as a small standalone SVG (one polyline per contender).
pub(crate) fn svg_cdf(title: &str, figures: &[Figures]) -> String {
    let (w, h, pad) = (640.0, 400.0, 50.0);
    let max = figures
        .iter()
        .flat_map(|f| f.ttft_cdf.iter().map(|p| p.1))
        .fold(1.0f64, f64::max);
    let colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
    let mut out = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{pad}\" y=\"20\">{title}: TTFT CDF (ms, log scale)</text>\n");
    let x = |ms: f64| pad + (w - 2.0 * pad) * (ms.max(1.0).ln() / max.max(2.0).ln());
    let y = |q: f64| h - pad - (h - 2.0 * pad) * q;
    out.push_str(&format!("<line x1=\"{pad}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n<line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{}\" stroke=\"black\"/>\n", h - pad, w - pad, h - pad, h - pad));
    for tick in [1.0, 10.0, 100.0, 1000.0, 10000.0]
        .into_iter()
        .filter(|t| *t <= max * 1.01)
    {
        out.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{}\">{tick}</text>\n",
            x(tick),
            h - pad + 15.0
        ));
    }
    for (i, f) in figures.iter().enumerate() {
        let pts: Vec<String> = f
            .ttft_cdf
            .iter()
            .map(|(q, ms)| format!("{:.1},{:.1}", x(*ms), y(*q)))
            .collect();
        let c = colours[i % colours.len()];
        out.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>\n",
            pts.join(" ")
        ));
        out.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" fill=\"{c}\">{}</text>\n",
            w - pad - 120.0,
            pad + 15.0 * i as f64,
            f.contender
        ));
    }
    out.push_str("</svg>\n");
    out
}

/// "145" for one run, "145 (139–152)" with the spread of several.
pub(crate) fn with_spread(v: f64, range: [f64; 2], runs: usize) -> String {
    if runs > 1 {
        format!("{v:.0} ({:.0}–{:.0})", range[0], range[1])
    } else {
        format!("{v:.0}")
    }
}

pub(crate) fn markdown(s: &Scenario, figures: &[Figures]) -> String {
    let mut t = format!("### {}\n\n{}", s.name, s.description);
    let runs = figures.iter().map(|f| f.runs).max().unwrap_or(1);
    if runs > 1 {
        t.push_str(&format!(
            " Medians of {runs} runs (seeds in a row; the lowest–highest P99 in brackets), {} req/s.",
            s.rps
        ));
    } else {
        t.push_str(&format!(" One run, {} req/s.", s.rps));
    }
    t.push_str("\n\n");
    t.push_str("| contender | TTFT p50 (ms) | p90 (ms) | p99 (ms) | p99.9 (ms) | total p50 (ms) | total p99 (ms) | errors (%) | intact (%) | TGSV (ms) | extra upstream requests (%) | extra tokens (%) | admitted (req/s) | KV hits (%) |\n");
    t.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for f in figures {
        t.push_str(&format!(
            "| {} | {:.0} | {:.0} | {} | {:.0} | {:.0} | {} | {:.2} | {:.1} | {:.1} | {:+.1} | {:+.1} | {:.1} | {:.0} |\n",
            f.contender, f.ttft_ms[0], f.ttft_ms[1], with_spread(f.ttft_ms[2], f.ttft_p99_range, f.runs), f.ttft_ms[3], f.total_ms[0],
            with_spread(f.total_ms[2], f.total_p99_range, f.runs),
            f.error_rate * 100.0, f.intact * 100.0, f.tgsv_ms, f.extra_requests * 100.0, f.extra_tokens * 100.0, f.admitted_rps, f.kv_hit_rate * 100.0
        ));
    }
    if s.shared_prefixes > 0 {
        t.push_str("\nPrefix cache and balance: prefill = prompt tokens the fleet computed (not in its KV caches) per request; balance = the busiest variant ÷ the mean, by upstream requests and by time-averaged in-flight requests.\n\n");
        t.push_str("| contender | KV hits | prefill tokens/req | TTFT p50 | p99 | requests max/mean | in-flight max/mean |\n");
        t.push_str("|---|---|---|---|---|---|---|\n");
        for f in figures {
            t.push_str(&format!(
                "| {} | {:.0}% | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} |\n",
                f.contender,
                f.kv_hit_rate * 100.0,
                f.prefill_tokens,
                f.ttft_ms[0],
                f.ttft_ms[2],
                f.request_balance,
                f.inflight_balance
            ));
        }
    }
    if figures.iter().any(|f| !f.by_priority.is_empty()) {
        t.push_str(&priority_markdown(s, figures));
    }
    for f in figures {
        if let Some(p) = f.retry_after_success {
            t.push_str(&format!("\nretry-after precision ({}): {:.0}% of retries made after waiting the advertised retry-after succeeded\n", f.contender, p * 100.0));
        }
    }
    t
}

/// The per-priority table, and what the servers saw.
fn priority_markdown(s: &Scenario, figures: &[Figures]) -> String {
    let mut t = String::from("\nBy priority (`x-keel-priority`; TTFT from the first send, retry waits included; refused = got at least one 429/503):\n\n");
    t.push_str("| contender | priority | requests | TTFT p50 (ms) | p99 (ms) | errors (%) | refused (%) | refusals per request |\n");
    t.push_str("|---|---|---|---|---|---|---|---|\n");
    for f in figures {
        for p in &f.by_priority {
            t.push_str(&format!(
                "| {} | {} | {} | {:.0} | {:.0} | {:.2} | {:.1} | {:.2} |\n",
                f.contender,
                p.priority,
                p.requests,
                p.ttft_ms[0],
                p.ttft_ms[2],
                p.error_rate * 100.0,
                p.refused_share * 100.0,
                p.refusals_per_request
            ));
        }
    }
    let capacity = s
        .fleet
        .servers
        .iter()
        .map(|srv| {
            format!(
                "{} running + {} waiting",
                srv.capacity,
                srv.max_waiting.map_or("any".into(), |w| w.to_string())
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    t.push_str(&format!("\nServers (capacity {capacity}): the most one held at once, the requests they refused, and answers later than the deadline ({} ms):\n\n", s.deadline_ms.map_or("none".into(), |d| d.to_string())));
    t.push_str("| contender | peak running + waiting | refused upstream | late answers |\n|---|---|---|---|\n");
    for f in figures {
        t.push_str(&format!(
            "| {} | {:.0} | {:.0} | {:.0} |\n",
            f.contender, f.upstream_peak, f.upstream_refused, f.late
        ));
    }
    t
}

/// One contender's figures under fault divided by its own fault-free figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Flatness {
    pub contender: String,
    /// P99 and P99.9 TTFT, fault ÷ fault-free.
    pub ttft_p99: f64,
    pub ttft_p999: f64,
    /// P99 and P99.9 total time, fault ÷ fault-free.
    pub total_p99: f64,
    pub total_p999: f64,
    /// Client-visible errors under fault (share of requests).
    pub error_rate: f64,
    /// Upstream requests and generated tokens beyond the fault-free run's, as a share of it.
    pub extra_requests: f64,
    pub extra_tokens: f64,
}

/// The goal: within this factor of the fault-free P99.
pub const FLATNESS_GOAL: f64 = 1.25;

pub fn flatness(fault: &Figures, free: &Figures) -> Flatness {
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    Flatness {
        contender: fault.contender.clone(),
        ttft_p99: ratio(fault.ttft_ms[2], free.ttft_ms[2]),
        ttft_p999: ratio(fault.ttft_ms[3], free.ttft_ms[3]),
        total_p99: ratio(fault.total_ms[2], free.total_ms[2]),
        total_p999: ratio(fault.total_ms[3], free.total_ms[3]),
        error_rate: fault.error_rate,
        extra_requests: ratio(1.0 + fault.extra_requests, 1.0 + free.extra_requests) - 1.0,
        extra_tokens: ratio(1.0 + fault.extra_tokens, 1.0 + free.extra_tokens) - 1.0,
    }
}

pub(crate) fn flatness_markdown(s: &Scenario, fault: &[Figures], free: &[Figures]) -> String {
    let mut t = format!(
        "\nFlatness of {} (fault ÷ fault-free twin; goal ≤ {FLATNESS_GOAL}×):\n\n",
        s.name
    );
    t.push_str("| contender | TTFT p99 fault / free (ms) | ×  | TTFT p99.9 × | total p99 fault / free (ms) | × | total p99.9 × | errors (%) | extra upstream requests vs twin (%) | extra tokens vs twin (%) |\n");
    t.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    for (f, g) in fault.iter().zip(free) {
        let x = flatness(f, g);
        t.push_str(&format!(
            "| {} | {:.0} / {:.0} | {:.2}× | {:.2}× | {:.0} / {:.0} | {:.2}× | {:.2}× | {:.2} | {:+.1} | {:+.1} |\n",
            f.contender, f.ttft_ms[2], g.ttft_ms[2], x.ttft_p99, x.ttft_p999, f.total_ms[2], g.total_ms[2],
            x.total_p99, x.total_p999, x.error_rate * 100.0, x.extra_requests * 100.0, x.extra_tokens * 100.0
        ));
    }
    t
}
