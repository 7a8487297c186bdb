//! `keel bench guard`: the guard's detectors on the labelled data set (bench/data/guard):
//! precision and recall per entity and throughput, beside Presidio's analyzer on the same texts
//! when a Python with presidio-analyzer is given (bench/scripts/guard_presidio.py).

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Instant;

use keel_core::guard::eval::{self, Item, Report};
use keel_core::guard::Guard;

pub struct Options {
    pub data: PathBuf,
    pub presidio_python: Option<PathBuf>,
    pub misses: bool,
}

/// Presidio's findings per item id, its analysis time and the bytes it analyzed.
struct Peer {
    findings: BTreeMap<String, Vec<(String, Range<usize>)>>,
    seconds: f64,
    bytes: f64,
    version: String,
}

pub fn run(opts: Options) -> Result<(), String> {
    let text =
        std::fs::read_to_string(&opts.data).map_err(|e| format!("{}: {e}", opts.data.display()))?;
    let items = eval::parse_jsonl(&text).map_err(|e| format!("{}: {e}", opts.data.display()))?;
    let guard = Guard::builtin();
    let keel = eval::evaluate(&guard, &items);
    let bytes: usize = items.iter().map(|i| i.text.len()).sum();
    let keel_mbs = throughput(&guard, &items, bytes);
    let peer = match &opts.presidio_python {
        Some(py) => Some(presidio(py, &opts.data, &items)?),
        None => None,
    };
    let peer_report = peer.as_ref().map(|p| {
        let mut r = Report::new();
        for it in &items {
            let found = p
                .findings
                .get(&it.id.to_string())
                .cloned()
                .unwrap_or_default();
            eval::score(it, &found, &mut r);
        }
        r
    });
    let langs: std::collections::BTreeSet<&str> = items.iter().map(|i| i.lang.as_str()).collect();
    println!(
        "keel bench guard: {} texts ({} KB; languages {}), a finding counts when it overlaps a labelled value of its entity\n",
        items.len(),
        bytes / 1000,
        langs.into_iter().collect::<Vec<_>>().join(", ")
    );
    print_table(&keel, peer_report.as_ref());
    println!("\n| throughput | MB/s |\n|---|---|\n| keel (one thread, whole data set, repeated) | {keel_mbs:.1} |");
    if let Some(p) = &peer {
        println!(
            "| presidio-analyzer {} (pattern recognizers, blank spaCy) | {:.3} |",
            p.version,
            p.bytes / p.seconds / 1e6
        );
    }
    if opts.misses {
        print_misses(&guard, &items);
    }
    Ok(())
}

fn cell(t: Option<&eval::Tally>) -> String {
    match t {
        Some(t) => format!(
            "{:.3} | {:.3} | {}/{}/{}",
            t.precision(),
            t.recall(),
            t.tp,
            t.fp,
            t.fn_
        ),
        None => "n/a | n/a | no recognizer".to_string(),
    }
}

fn print_table(keel: &Report, peer: Option<&Report>) {
    let mut head = String::from("| entity | keel precision | keel recall | keel tp/fp/fn |");
    let mut rule = String::from("|---|---|---|---|");
    if peer.is_some() {
        head.push_str(" presidio precision | presidio recall | presidio tp/fp/fn |");
        rule.push_str("---|---|---|");
    }
    println!("{head}\n{rule}");
    for (entity, t) in keel {
        let mut row = format!("| {entity} | {} |", cell(Some(t)));
        if let Some(p) = peer {
            // An entity Presidio never reported anything for, and has no recognizer for.
            let supported = !matches!(entity.as_str(), "url_credentials" | "secret");
            row.push_str(&format!(" {} |", cell(p.get(entity).filter(|_| supported))));
        }
        println!("{row}");
    }
}

/// MB/s of `Guard::scan` over every text, repeated for at least a second.
fn throughput(guard: &Guard, items: &[Item], bytes: usize) -> f64 {
    let t = Instant::now();
    let mut rounds = 0u32;
    while rounds < 3 || t.elapsed().as_secs_f64() < 1.0 {
        for it in items {
            std::hint::black_box(guard.scan(std::hint::black_box(&it.text)));
        }
        rounds += 1;
    }
    bytes as f64 * f64::from(rounds) / t.elapsed().as_secs_f64() / 1e6
}

fn presidio(python: &Path, data: &Path, items: &[Item]) -> Result<Peer, String> {
    let script = Path::new("bench/scripts/guard_presidio.py");
    let out = std::process::Command::new(python)
        .arg(script)
        .arg(data)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("{}: {e}", python.display()))?;
    if !out.status.success() {
        return Err(format!("{} exited with {}", script.display(), out.status));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("{}: output: {e}", script.display()))?;
    let mut findings = BTreeMap::new();
    for it in items {
        let id = it.id.to_string();
        let list = v["findings"][&id].as_array().cloned().unwrap_or_default();
        let parsed = list
            .iter()
            .filter_map(|f| {
                let e = f.get(0)?.as_str()?.to_string();
                let s = usize::try_from(f.get(1)?.as_u64()?).ok()?;
                let t = usize::try_from(f.get(2)?.as_u64()?).ok()?;
                Some((e, s..t))
            })
            .collect();
        findings.insert(id, parsed);
    }
    Ok(Peer {
        findings,
        seconds: v["seconds"].as_f64().unwrap_or(f64::NAN),
        bytes: v["bytes"].as_f64().unwrap_or(f64::NAN),
        version: v["version"].as_str().unwrap_or("?").to_string(),
    })
}

/// Every text where keel's findings and the labels disagree, with both lists.
fn print_misses(guard: &Guard, items: &[Item]) {
    println!("\nmisses:");
    for it in items {
        let found = eval::keel_findings(guard, &it.text);
        let mut r = Report::new();
        eval::score(it, &found, &mut r);
        if r.values().all(|t| t.fp == 0 && t.fn_ == 0) {
            continue;
        }
        let chars: Vec<char> = it.text.chars().collect();
        let show =
            |e: &str, r: Range<usize>| format!("{e}={:?}", chars[r].iter().collect::<String>());
        let labels: Vec<String> = it
            .entities
            .iter()
            .map(|l| show(&l.entity, l.start..l.end))
            .collect();
        let got: Vec<String> = found.into_iter().map(|(e, r)| show(&e, r)).collect();
        println!("  #{}: labelled {labels:?}; found {got:?}", it.id);
    }
}
