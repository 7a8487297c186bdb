//! `keel analyze ACCESS_LOG… [--pool P] [--since T] [--out DIR] [--config FILE]`: reads keel's
//! JSON access logs as a stream (one line at a time, bounded memory: see
//! `keel_core::analyze::report`) and writes `DIR/report.html` (self-contained),
//! `DIR/report.json` (the same figures) and a summary on stdout; a progress bar on stderr when
//! it is a terminal.
//!
//! With `--config`, each pool is replayed with its own cache settings (`[pools.cache]` TTL,
//! `max_temperature`, `allow_tools`, `normalize`) and the store's byte budget
//! (`[cache] max_bytes`); without it, with keel's defaults.

mod html;
pub mod logs;
pub mod truth;

use std::io::{BufRead, BufReader, IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;

use keel_core::analyze::report::{self, Analyzer, Options, Report};

#[derive(Args, Debug, Clone)]
pub struct AnalyzeArgs {
    /// Access logs as keel writes them (`[log] access`, JSON lines); `-` reads stdin. Pools
    /// with `fingerprint = true` give the full analysis; other lines count as requests only.
    #[arg(required = true, value_name = "ACCESS_LOG")]
    pub logs: Vec<PathBuf>,
    /// Only these pools (repeat the flag for several).
    #[arg(long, value_name = "P")]
    pub pool: Vec<String>,
    /// Only requests that ended at or after this time (RFC 3339, `2026-12-04T09:00:00Z`, or a
    /// date).
    #[arg(long, value_name = "T")]
    pub since: Option<String>,
    /// Where `report.html` and `report.json` are written (created if needed).
    #[arg(long, value_name = "DIR", default_value = "keel-analyze")]
    pub out: PathBuf,
    /// The gateway's config: each pool's cache TTL, policy and normalization, and the cache's
    /// byte budget, for the replay (keel's defaults without it).
    #[arg(long, value_name = "FILE")]
    pub config: Option<String>,
}

/// What reading the logs took.
#[derive(Debug, Clone, Copy, Default)]
pub struct Reading {
    pub bytes: u64,
    pub lines: u64,
    /// Lines that are not access lines (not JSON objects with a pool).
    pub skipped: u64,
    pub seconds: f64,
}

/// The replay's settings from a gateway config file.
pub fn options_from_config(path: &str) -> Result<Options, String> {
    let cfg = keel_gateway::Config::load(path).map_err(|e| e.to_string())?;
    Ok(keel_gateway::state::analysis::options(&cfg))
}

/// Reads every log into `analyzer`, with a progress bar when stderr is a terminal.
pub fn read_logs(
    paths: &[PathBuf],
    filter: &logs::Filter,
    analyzer: &mut Analyzer,
) -> Result<Reading, String> {
    let started = Instant::now();
    let total: u64 = paths
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
    let bar = if std::io::stderr().is_terminal() {
        let b = indicatif::ProgressBar::new(total);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{spinner} reading {bytes}/{total_bytes} [{bar:40}] {bytes_per_sec}, {eta} left",
        ) {
            b.set_style(style.progress_chars("=> "));
        }
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut reading = Reading::default();
    for path in paths {
        let input: Box<dyn Read> = if path == Path::new("-") {
            Box::new(std::io::stdin().lock())
        } else {
            Box::new(std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?)
        };
        let mut r = BufReader::with_capacity(1 << 20, input);
        let mut line = Vec::with_capacity(4096);
        let mut since_tick = 0u64;
        loop {
            line.clear();
            let n = r
                .read_until(b'\n', &mut line)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            if n == 0 {
                break;
            }
            reading.bytes += n as u64;
            reading.lines += 1;
            since_tick += n as u64;
            if since_tick >= 1 << 20 {
                bar.inc(since_tick);
                since_tick = 0;
            }
            match logs::record(&line) {
                Some(rec) if filter.keeps(&rec) => analyzer.add(&rec),
                Some(_) => {}
                None => reading.skipped += u64::from(!line.trim_ascii().is_empty()),
            }
        }
        bar.inc(since_tick);
    }
    bar.finish_and_clear();
    reading.seconds = started.elapsed().as_secs_f64();
    Ok(reading)
}

/// `keel analyze`.
pub fn run(args: AnalyzeArgs) -> Result<(), String> {
    let opts = match &args.config {
        Some(c) => options_from_config(c)?,
        None => Options::default(),
    };
    let since_ms = match &args.since {
        Some(s) => Some(report::parse_time_ms(s.trim()).ok_or_else(|| {
            format!("--since: expected an RFC 3339 time (2026-12-04T09:00:00Z) or a date (2026-12-04), got `{s}`")
        })?),
        None => None,
    };
    let filter = logs::Filter {
        pools: args.pool.clone(),
        since_ms,
    };
    let mut analyzer = Analyzer::new(opts);
    let reading = read_logs(&args.logs, &filter, &mut analyzer)?;
    let report = analyzer.finish();
    let sources: Vec<String> = args.logs.iter().map(|p| p.display().to_string()).collect();
    write_outputs(&args.out, &report, &reading, &sources)?;
    print!("{}", summary(&report, &reading));
    println!(
        "\nreport: {}  figures: {}",
        args.out.join("report.html").display(),
        args.out.join("report.json").display()
    );
    Ok(())
}

/// Writes `report.json` and `report.html` into `dir`.
pub fn write_outputs(
    dir: &Path,
    report: &Report,
    reading: &Reading,
    sources: &[String],
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let doc = serde_json::json!({
        "sources": sources,
        "reading": {"bytes": reading.bytes, "lines": reading.lines, "skipped": reading.skipped,
            "seconds": reading.seconds},
        "report": report,
    });
    let json = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))
    };
    write("report.json", &json)?;
    write("report.html", &html::render(report, reading, sources))
}

/// The terminal summary.
pub fn summary(r: &Report, reading: &Reading) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let mb = reading.bytes as f64 / 1e6;
    let _ = writeln!(
        s,
        "keel analyze: {} lines, {mb:.1} MB in {:.1} s ({:.0} MB/s){}",
        reading.lines,
        reading.seconds,
        mb / reading.seconds.max(1e-9),
        if reading.skipped > 0 {
            format!(", {} lines were not access lines", reading.skipped)
        } else {
            String::new()
        }
    );
    let _ = writeln!(
        s,
        "\n{:<16} {:>9} {:>8} {:>8} {:>9} {:>8} {:>8} {:>10}",
        "pool", "requests", "repeats", "normal.", "templates", "entropy", "hit rate", "saved $"
    );
    for p in &r.pools {
        let f = &p.figures;
        let pct = |n: u64| format!("{:.1}%", report::share(n, f.requests) * 100.0);
        let _ = writeln!(
            s,
            "{:<16} {:>9} {:>8} {:>8} {:>9} {:>8.2} {:>8} {:>10.2}",
            p.pool,
            f.requests,
            pct(f.repeats_raw),
            pct(f.repeats_normalized),
            f.templates,
            f.template_entropy_bits,
            format!("{:.1}%", f.simulated_hit_rate * 100.0),
            f.simulated.spend_usd
        );
    }
    if r.recommendations.is_empty() {
        let _ = writeln!(
            s,
            "\nno recommendation: nothing here would be saved by the cache or normalization"
        );
    } else {
        let _ = writeln!(s, "\nrecommendations:");
        for (i, x) in r.recommendations.iter().enumerate() {
            let _ = writeln!(s, "{:>3}. {}", i + 1, x.text);
        }
    }
    if r.approximate {
        let _ = writeln!(
            s,
            "\n(some counts passed their memory bounds and are approximate)"
        );
    }
    s
}
