//! The figures of a workload, per pool and per hour, from its requests' fingerprints
//! ([`Record`]s, in the order their access lines were written): requests; exact repeats of the
//! cache key raw and after normalization; templates (count, Shannon entropy, the top ones'
//! shares and output-length coefficient of variation); and the response cache replayed over
//! them ([`super::replay`]) with each pool's TTL and the store's byte budget, for several TTLs
//! with and without normalization, with what its hits would have saved upstream (requests,
//! tokens, spend, latency). [`super::recommend`] ranks what to do about it.
//!
//! **Bounded memory.** Requests are replayed in the order they started through a reorder
//! buffer of [`REORDER`] records (access lines are written when requests end); the keys seen
//! (for repeats) and templates are counted up to fixed bounds, past which the figures are
//! marked `approximate`.

pub use crate::quota::budget::{civil_from_days, days_from_civil};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

use serde::Serialize;

use super::replay::{Replayed, Request, SimCache};

/// Records held to replay requests in the order they started.
pub const REORDER: usize = 1 << 16;
/// Distinct keys remembered per pool, for repeats.
pub const MAX_KEYS: usize = 1 << 22;
/// Distinct templates counted per pool (and per pool and hour).
pub const MAX_TEMPLATES: usize = 1 << 17;
/// The TTLs every pool's cache is replayed with, besides its own.
pub const TTL_CANDIDATES_MS: [u64; 4] = [60_000, 300_000, 600_000, 3_600_000];
/// Templates listed per pool.
pub const TOP_TEMPLATES: usize = 10;
/// A template's output-length variation is reported from this many answers on.
pub const MIN_FOR_CV: u64 = 5;

/// One request, as its access line describes it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Record {
    pub pool: String,
    /// When it ended, and how long it took (ms).
    pub end_ms: i64,
    pub total_ms: f64,
    /// A complete answer (status 200, outcome `ok`).
    pub ok: bool,
    /// The fingerprint's parts (absent where the pool does not fingerprint).
    pub key_raw: Option<u64>,
    pub key_norm: Option<u64>,
    pub template: Option<u64>,
    pub deterministic: bool,
    pub temperature: Option<f64>,
    pub tools: bool,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub spend_usd: f64,
}

/// What the replay needs to know of a pool's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolPolicy {
    /// The cache's TTL (`[pools.cache] ttl_ms`; keel's default when the pool has no cache).
    pub ttl_ms: u64,
    pub max_temperature: f64,
    pub allow_tools: bool,
    /// The pool normalizes (its cache keys are the normalized ones).
    pub normalizes: bool,
    /// The pool's cache is on.
    pub cache_on: bool,
}

impl Default for PoolPolicy {
    fn default() -> Self {
        PoolPolicy {
            ttl_ms: 300_000,
            max_temperature: 0.0,
            allow_tools: false,
            normalizes: false,
            cache_on: false,
        }
    }
}

/// The analysis's settings.
#[derive(Debug, Clone)]
pub struct Options {
    /// The store's byte budget (`[cache] max_bytes`).
    pub max_bytes: u64,
    /// Per pool; pools not named get the default.
    pub pools: HashMap<String, PoolPolicy>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            max_bytes: 64 << 20,
            pools: HashMap::new(),
        }
    }
}

/// One replay: a TTL (`None`: each pool's own) and which key.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Scenario {
    pub ttl_ms: Option<u64>,
    /// Normalized keys (`syntax` where the pool does not normalize).
    pub normalized: bool,
}

/// What a replay saved, for one pool (or one pool and hour).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Saved {
    pub hits: u64,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub spend_usd: f64,
    /// The clients' wait the hits would not have had (their requests' whole durations).
    pub latency_ms: f64,
}

impl Saved {
    fn add(&mut self, p: &Pending) {
        self.hits += 1;
        self.tokens_in += p.tokens_in;
        self.tokens_out += p.tokens_out;
        self.spend_usd += p.spend_usd;
        self.latency_ms += p.total_ms;
    }
}

/// A record waiting in the reorder buffer.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Pending {
    start_ms: i64,
    seq: u64,
    end_ms: i64,
    pool: usize,
    hour: i64,
    key_raw: u64,
    key_norm: u64,
    ok: bool,
    total_ms: f64,
    tokens_in: u64,
    tokens_out: u64,
    spend_usd: f64,
    temperature: f64,
    tools: bool,
    deterministic: bool,
}

impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Pending {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.start_ms, self.seq).cmp(&(o.start_ms, o.seq))
    }
}

/// A template's counts.
#[derive(Debug, Clone, Copy, Default)]
struct TemplateAcc {
    requests: u64,
    answers: u64,
    out_sum: f64,
    out_sq: f64,
    deterministic: u64,
}

impl TemplateAcc {
    fn cv(&self) -> Option<f64> {
        if self.answers < MIN_FOR_CV {
            return None;
        }
        let n = self.answers as f64;
        let mean = self.out_sum / n;
        if mean <= 0.0 {
            return None;
        }
        let var = (self.out_sq / n - mean * mean).max(0.0);
        Some(var.sqrt() / mean)
    }
}

/// Counts shared by a pool and by a pool's hour.
#[derive(Debug, Clone, Default)]
struct Counts {
    requests: u64,
    fingerprinted: u64,
    repeats_raw: u64,
    repeats_norm: u64,
    deterministic: u64,
    sampled: u64,
    tools: u64,
    spend_usd: f64,
    templates: HashMap<u64, TemplateAcc>,
    other_templates: u64,
    /// Saved per scenario (indexed like [`Analyzer::scenarios`]).
    saved: Vec<Saved>,
}

impl Counts {
    fn new(scenarios: usize) -> Counts {
        Counts {
            saved: vec![Saved::default(); scenarios],
            ..Default::default()
        }
    }

    fn template(&mut self, id: u64, r: &Record) -> bool {
        let full = self.templates.len() >= MAX_TEMPLATES;
        let acc = match self.templates.get_mut(&id) {
            Some(a) => a,
            None if full => {
                self.other_templates += 1;
                return false;
            }
            None => self.templates.entry(id).or_default(),
        };
        acc.requests += 1;
        acc.deterministic += u64::from(r.deterministic);
        if r.ok {
            let out = r.tokens_out as f64;
            acc.answers += 1;
            acc.out_sum += out;
            acc.out_sq += out * out;
        }
        true
    }
}

/// A pool's state.
#[derive(Debug)]
struct PoolAcc {
    name: String,
    policy: PoolPolicy,
    all: Counts,
    hours: HashMap<i64, Counts>,
    seen_raw: HashSet<u64>,
    seen_norm: HashSet<u64>,
}

/// The analysis in progress: feed it records with [`Analyzer::add`], then [`Analyzer::finish`].
#[derive(Debug)]
pub struct Analyzer {
    opts: Options,
    pools: Vec<PoolAcc>,
    by_name: HashMap<String, usize>,
    scenarios: Vec<Scenario>,
    caches: Vec<SimCache>,
    pending: BinaryHeap<Reverse<Pending>>,
    seq: u64,
    first_ms: Option<i64>,
    last_ms: Option<i64>,
    approximate: bool,
}

const HOUR_MS: i64 = 3_600_000;

impl Analyzer {
    pub fn new(opts: Options) -> Analyzer {
        let mut scenarios = vec![Scenario {
            ttl_ms: None,
            normalized: false,
        }];
        for ttl in TTL_CANDIDATES_MS {
            for normalized in [false, true] {
                scenarios.push(Scenario {
                    ttl_ms: Some(ttl),
                    normalized,
                });
            }
        }
        let caches = scenarios
            .iter()
            .map(|_| SimCache::new(opts.max_bytes))
            .collect();
        Analyzer {
            opts,
            pools: Vec::new(),
            by_name: HashMap::new(),
            scenarios,
            caches,
            pending: BinaryHeap::new(),
            seq: 0,
            first_ms: None,
            last_ms: None,
            approximate: false,
        }
    }

    /// The replays, in the order every [`Saved`] list follows. The first is each pool as
    /// configured (its own TTL; normalized keys where it normalizes).
    pub fn scenarios(&self) -> &[Scenario] {
        &self.scenarios
    }

    fn pool(&mut self, name: &str) -> usize {
        if let Some(i) = self.by_name.get(name) {
            return *i;
        }
        let policy = self.opts.pools.get(name).cloned().unwrap_or_default();
        let n = self.scenarios.len();
        self.pools.push(PoolAcc {
            name: name.to_owned(),
            policy,
            all: Counts::new(n),
            hours: HashMap::new(),
            seen_raw: HashSet::new(),
            seen_norm: HashSet::new(),
        });
        self.by_name.insert(name.to_owned(), self.pools.len() - 1);
        self.pools.len() - 1
    }

    /// One request.
    pub fn add(&mut self, r: &Record) {
        let pi = self.pool(&r.pool);
        let hour = r.end_ms.div_euclid(HOUR_MS);
        let n = self.scenarios.len();
        self.first_ms = Some(self.first_ms.map_or(r.end_ms, |f| f.min(r.end_ms)));
        self.last_ms = Some(self.last_ms.map_or(r.end_ms, |l| l.max(r.end_ms)));
        let p = &mut self.pools[pi];
        let (mut repeat_raw, mut repeat_norm) = (false, false);
        if let (Some(raw), Some(norm)) = (r.key_raw, r.key_norm) {
            repeat_raw = seen(&mut p.seen_raw, raw, &mut self.approximate);
            repeat_norm = seen(&mut p.seen_norm, norm, &mut self.approximate);
        }
        let hour_counts = p.hours.entry(hour).or_insert_with(|| Counts::new(n));
        for c in [&mut p.all, hour_counts] {
            c.requests += 1;
            c.spend_usd += r.spend_usd;
            if r.key_raw.is_none() {
                continue;
            }
            c.fingerprinted += 1;
            c.repeats_raw += u64::from(repeat_raw);
            c.repeats_norm += u64::from(repeat_norm);
            c.deterministic += u64::from(r.deterministic);
            c.sampled += u64::from(r.temperature.unwrap_or(1.0) > 0.0);
            c.tools += u64::from(r.tools);
            if let Some(t) = r.template {
                if !c.template(t, r) {
                    self.approximate = true;
                }
            }
        }
        if let (Some(key_raw), Some(key_norm)) = (r.key_raw, r.key_norm) {
            self.seq += 1;
            let start_ms = r.end_ms - r.total_ms.max(0.0).round() as i64;
            self.pending.push(Reverse(Pending {
                start_ms,
                seq: self.seq,
                end_ms: r.end_ms,
                pool: pi,
                hour,
                key_raw,
                key_norm,
                ok: r.ok,
                total_ms: r.total_ms,
                tokens_in: r.tokens_in,
                tokens_out: r.tokens_out,
                spend_usd: r.spend_usd,
                temperature: r
                    .temperature
                    .unwrap_or(crate::cache_key::DEFAULT_TEMPERATURE),
                tools: r.tools,
                deterministic: r.deterministic,
            }));
            while self.pending.len() > REORDER {
                self.replay_next();
            }
        }
    }

    /// Replays the earliest-started pending request through every scenario's cache.
    fn replay_next(&mut self) {
        let Some(Reverse(p)) = self.pending.pop() else {
            return;
        };
        let pool = &mut self.pools[p.pool];
        let policy = &pool.policy;
        let cacheable = p.deterministic
            || (p.temperature <= policy.max_temperature && (!p.tools || policy.allow_tools));
        for (i, s) in self.scenarios.iter().enumerate() {
            let normalized = if s.ttl_ms.is_none() {
                policy.normalizes
            } else {
                s.normalized
            };
            let req = Request {
                key: if normalized { p.key_norm } else { p.key_raw },
                start_ms: p.start_ms,
                end_ms: p.end_ms,
                ttl_ms: s.ttl_ms.unwrap_or(policy.ttl_ms),
                cacheable,
                ok: p.ok,
                tokens_out: p.tokens_out,
            };
            // Each pool's keys are its own: a pool is part of the cache key.
            let req = Request {
                key: req.key ^ crate::rng::mix(p.pool as u64 + 1),
                ..req
            };
            if self.caches[i].request(&req) == Replayed::Hit {
                pool.all.saved[i].add(&p);
                if let Some(h) = pool.hours.get_mut(&p.hour) {
                    h.saved[i].add(&p);
                }
            }
        }
    }

    /// The figures.
    pub fn finish(mut self) -> Report {
        while !self.pending.is_empty() {
            self.replay_next();
        }
        let span_ms = match (self.first_ms, self.last_ms) {
            (Some(f), Some(l)) => (l - f).max(HOUR_MS),
            _ => HOUR_MS,
        };
        let days = span_ms as f64 / (24 * HOUR_MS) as f64;
        let scenarios = self.scenarios.clone();
        let mut pools: Vec<PoolReport> = self
            .pools
            .iter()
            .map(|p| pool_report(p, &scenarios, days))
            .collect();
        pools.sort_by(|a, b| {
            b.figures
                .requests
                .cmp(&a.figures.requests)
                .then(a.pool.cmp(&b.pool))
        });
        let recommendations = super::recommend::recommend(&pools);
        Report {
            first_ms: self.first_ms,
            last_ms: self.last_ms,
            days,
            scenarios,
            approximate: self.approximate,
            pools,
            recommendations,
        }
    }
}

/// Whether `key` was seen before (and remembers it while there is room).
fn seen(set: &mut HashSet<u64>, key: u64, approximate: &mut bool) -> bool {
    if set.contains(&key) {
        return true;
    }
    if set.len() < MAX_KEYS {
        set.insert(key);
    } else {
        *approximate = true;
    }
    false
}

/// The whole analysis.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The first and last request's end (ms since the epoch).
    pub first_ms: Option<i64>,
    pub last_ms: Option<i64>,
    /// The span the log covers, in days (an hour at least): what `per_day` figures divide by.
    pub days: f64,
    pub scenarios: Vec<Scenario>,
    /// Some counts passed their bounds (see the module doc).
    pub approximate: bool,
    pub pools: Vec<PoolReport>,
    pub recommendations: Vec<super::recommend::Recommendation>,
}

/// One template's figures.
#[derive(Debug, Clone, Serialize)]
pub struct TemplateReport {
    /// 16 hex digits, as the access log writes it.
    pub id: String,
    pub requests: u64,
    pub share: f64,
    pub deterministic_share: f64,
    pub tokens_out_mean: Option<f64>,
    /// Output-length coefficient of variation (from [`MIN_FOR_CV`] answers on).
    pub output_cv: Option<f64>,
}

/// The figures of a set of requests (a pool, or one of its hours).
#[derive(Debug, Clone, Serialize)]
pub struct Figures {
    pub requests: u64,
    pub fingerprinted: u64,
    pub repeats_raw: u64,
    pub repeats_normalized: u64,
    pub deterministic: u64,
    pub sampled: u64,
    pub tools: u64,
    pub spend_usd: f64,
    pub templates: u64,
    /// Shannon entropy of the template distribution, bits.
    pub template_entropy_bits: f64,
    /// The pool as configured.
    pub simulated: Saved,
    pub simulated_hit_rate: f64,
}

/// One pool's figures.
#[derive(Debug, Clone, Serialize)]
pub struct PoolReport {
    pub pool: String,
    pub policy: PolicyReport,
    #[serde(flatten)]
    pub figures: Figures,
    /// Requests whose template has a measured output-length CV, and their request-weighted
    /// mean CV.
    pub output_cv_mean: Option<f64>,
    pub top_templates: Vec<TemplateReport>,
    /// Saved per scenario, in [`Report::scenarios`]' order.
    pub by_scenario: Vec<Saved>,
    pub hours: Vec<HourReport>,
    /// The span's days (for per-day figures).
    pub days: f64,
}

/// The policy a pool was replayed with.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyReport {
    pub ttl_ms: u64,
    pub max_temperature: f64,
    pub allow_tools: bool,
    pub normalizes: bool,
    pub cache_on: bool,
}

/// One hour of a pool.
#[derive(Debug, Clone, Serialize)]
pub struct HourReport {
    /// Hours since the epoch, and the hour as `2026-12-04T19`.
    pub hour: i64,
    pub label: String,
    #[serde(flatten)]
    pub figures: Figures,
}

fn figures(c: &Counts) -> Figures {
    let total: u64 = c.templates.values().map(|t| t.requests).sum::<u64>() + c.other_templates;
    let entropy = c
        .templates
        .values()
        .map(|t| t.requests as f64 / total.max(1) as f64)
        .filter(|p| *p > 0.0)
        .map(|p| -p * p.log2())
        .sum::<f64>()
        .max(0.0);
    let simulated = c.saved.first().copied().unwrap_or_default();
    Figures {
        requests: c.requests,
        fingerprinted: c.fingerprinted,
        repeats_raw: c.repeats_raw,
        repeats_normalized: c.repeats_norm,
        deterministic: c.deterministic,
        sampled: c.sampled,
        tools: c.tools,
        spend_usd: c.spend_usd,
        templates: c.templates.len() as u64,
        template_entropy_bits: entropy,
        simulated,
        simulated_hit_rate: share(simulated.hits, c.requests),
    }
}

/// `n / of`, 0 when `of` is 0.
pub fn share(n: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        n as f64 / of as f64
    }
}

fn pool_report(p: &PoolAcc, _scenarios: &[Scenario], days: f64) -> PoolReport {
    let figures_all = figures(&p.all);
    let mut top: Vec<(&u64, &TemplateAcc)> = p.all.templates.iter().collect();
    top.sort_by(|a, b| b.1.requests.cmp(&a.1.requests).then(a.0.cmp(b.0)));
    let top_templates = top
        .iter()
        .take(TOP_TEMPLATES)
        .map(|(id, t)| TemplateReport {
            id: super::template_hex(**id),
            requests: t.requests,
            share: share(t.requests, p.all.fingerprinted),
            deterministic_share: share(t.deterministic, t.requests),
            tokens_out_mean: (t.answers > 0).then(|| t.out_sum / t.answers as f64),
            output_cv: t.cv(),
        })
        .collect();
    let (mut weight, mut sum) = (0u64, 0.0);
    for t in p.all.templates.values() {
        if let Some(cv) = t.cv() {
            weight += t.requests;
            sum += cv * t.requests as f64;
        }
    }
    let mut hours: Vec<HourReport> = p
        .hours
        .iter()
        .map(|(h, c)| HourReport {
            hour: *h,
            label: hour_label(*h),
            figures: figures(c),
        })
        .collect();
    hours.sort_by_key(|h| h.hour);
    let pol = &p.policy;
    PoolReport {
        pool: p.name.clone(),
        policy: PolicyReport {
            ttl_ms: pol.ttl_ms,
            max_temperature: pol.max_temperature,
            allow_tools: pol.allow_tools,
            normalizes: pol.normalizes,
            cache_on: pol.cache_on,
        },
        figures: figures_all,
        output_cv_mean: (weight > 0).then(|| sum / weight as f64),
        top_templates,
        by_scenario: p.all.saved.clone(),
        hours,
        days,
    }
}

/// `2026-12-04T19` for an hour since the epoch.
pub fn hour_label(hour: i64) -> String {
    let (y, m, d) = civil_from_days(hour.div_euclid(24));
    format!("{y:04}-{m:02}-{d:02}T{:02}", hour.rem_euclid(24))
}

/// Milliseconds since the epoch of an RFC 3339 UTC time (`2026-12-04T19:00:00.123Z`, or a
/// date alone); `None` when it is not one.
pub fn parse_time_ms(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = s.get(r)?;
        t.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| t.parse().ok())?
    };
    let (y, m, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    if b.get(4) != Some(&b'-')
        || b.get(7) != Some(&b'-')
        || !(1..=12).contains(&m)
        || !(1..=31).contains(&d)
    {
        return None;
    }
    let days = days_from_civil(y, m as u32, d as u32);
    if b.len() == 10 {
        return Some(days * 86_400_000);
    }
    if !matches!(b.get(10), Some(b'T' | b't' | b' ')) || b.get(13) != Some(&b':') {
        return None;
    }
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let mut ms = 0;
    let mut rest = &s[19..];
    if let Some(frac) = rest.strip_prefix('.') {
        let digits = frac.bytes().take_while(u8::is_ascii_digit).count();
        let f = &frac[..digits];
        ms = f
            .get(..3.min(digits))
            .and_then(|x| x.parse::<i64>().ok())
            .unwrap_or(0)
            * 10i64.pow(3 - 3.min(digits) as u32);
        rest = &frac[digits..];
    }
    let offset_min = match rest {
        "Z" | "z" | "" => 0,
        o if o.len() == 6 && (o.starts_with('+') || o.starts_with('-')) => {
            let sign = if o.starts_with('-') { -1 } else { 1 };
            sign * (num_str(&o[1..3])? * 60 + num_str(&o[4..6])?)
        }
        _ => return None,
    };
    Some(((days * 24 + h) * 60 + mi - offset_min) * 60_000 + sec * 1000 + ms)
}

fn num_str(s: &str) -> Option<i64> {
    s.bytes()
        .all(|c| c.is_ascii_digit())
        .then(|| s.parse().ok())?
}

#[cfg(test)]
#[path = "report_tests.rs"]
mod tests;
