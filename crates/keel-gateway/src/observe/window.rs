//! What the last few minutes of requests looked like, for the dashboard: the route mix over the
//! last minute and each pool's TTFT percentiles over the last five. Fed once per request from
//! the access-log path ([`crate::observe::access_log::RequestLog::finish`]), read once per second by the
//! events ticker.
//!
//! Bounded by construction: a ring of [`SLOTS`] ten-second slots; in each, one counter per
//! route label (a fixed set of `&'static str`) and one fixed-size log-spaced TTFT histogram per
//! pool (pool names come from the config, plus `none` for requests refused before one was
//! known). Each runtime thread records into a ring of its own (`per_thread`: its lock is never
//! contended), and the once-a-second view sums the rings.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::per_thread::PerThread;

/// Width of one slot.
const SLOT_MS: u64 = 10_000;
/// Slots kept: five minutes of TTFT history.
pub const SLOTS: usize = 30;
/// Slots summed for the route mix: the last minute (the newest slot is still filling).
const ROUTE_SLOTS: u64 = 6;
/// TTFT histogram buckets: bucket `k` holds values up to `1 ms × GROWTH^k`; the last one holds
/// everything above (1.25^63 ms is about 20 minutes).
const BUCKETS: usize = 64;
const GROWTH: f64 = 1.25;

/// The route labels the dashboard always shows (a label outside this list is shown too, once
/// it occurs).
pub const ROUTES: [&str; 7] = [
    "direct",
    "fallback",
    "hedged",
    "migrated",
    "throttled",
    "cached",
    "rejected",
];

type Histogram = [u32; BUCKETS];

struct Slot {
    /// Milliseconds since `Recent::epoch`, divided by `SLOT_MS`.
    index: u64,
    routes: BTreeMap<&'static str, u64>,
    ttft: HashMap<String, Box<Histogram>>,
}

/// The recent-requests window of one gateway.
pub struct Recent {
    epoch: Instant,
    /// One ring of slots per runtime thread.
    slots: PerThread<VecDeque<Slot>>,
}

impl Default for Recent {
    fn default() -> Self {
        Recent {
            epoch: Instant::now(),
            slots: PerThread::new(|| VecDeque::with_capacity(SLOTS + 1)),
        }
    }
}

/// One pool's TTFT over the window.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PoolTtft {
    /// Over the whole window (five minutes); `None` without a sample.
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub count: u64,
    /// One point per slot, oldest first, `SLOTS` long: the sparkline.
    pub series: Vec<TtftPoint>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TtftPoint {
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub count: u64,
}

/// What the window holds now.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct WindowView {
    /// Requests that ended in the last minute, by route.
    pub routes: BTreeMap<&'static str, u64>,
    pub ttft: BTreeMap<String, PoolTtft>,
    pub slot_seconds: u64,
}

fn bucket_of(ms: f64) -> usize {
    if ms <= 1.0 {
        return 0;
    }
    ((ms.ln() / GROWTH.ln()).ceil() as usize).min(BUCKETS - 1)
}

/// The upper bound of a bucket, in milliseconds: what a percentile falling in it is reported as
/// (at most 25% above the true value).
fn bucket_ms(k: usize) -> f64 {
    GROWTH.powi(k as i32)
}

fn quantile(h: &Histogram, q: f64) -> Option<f64> {
    let total: u64 = h.iter().map(|c| u64::from(*c)).sum();
    if total == 0 {
        return None;
    }
    // The smallest bucket whose cumulative count reaches q of the total.
    let rank = ((q * total as f64).ceil() as u64).max(1);
    let mut seen = 0u64;
    for (k, c) in h.iter().enumerate() {
        seen += u64::from(*c);
        if seen >= rank {
            return Some(bucket_ms(k));
        }
    }
    Some(bucket_ms(BUCKETS - 1))
}

fn point(h: &Histogram) -> TtftPoint {
    TtftPoint {
        p50_ms: quantile(h, 0.5),
        p99_ms: quantile(h, 0.99),
        count: h.iter().map(|c| u64::from(*c)).sum(),
    }
}

impl Recent {
    fn slot_index(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 / SLOT_MS
    }

    /// Counts one finished request.
    pub fn record(&self, pool: &str, route: &'static str, ttft: Option<Duration>) {
        let index = self.slot_index();
        let mut slots = self.slots.own();
        if slots.back().is_none_or(|s| s.index != index) {
            slots.push_back(Slot {
                index,
                routes: BTreeMap::new(),
                ttft: HashMap::new(),
            });
        }
        while slots
            .front()
            .is_some_and(|s| s.index + (SLOTS as u64) <= index)
        {
            slots.pop_front();
        }
        let Some(slot) = slots.back_mut() else {
            return;
        };
        *slot.routes.entry(route).or_default() += 1;
        if let Some(t) = ttft {
            let h = match slot.ttft.get_mut(pool) {
                Some(h) => h,
                None => slot
                    .ttft
                    .entry(pool.to_owned())
                    .or_insert_with(|| Box::new([0; BUCKETS])),
            };
            let k = bucket_of(t.as_secs_f64() * 1000.0);
            h[k] = h[k].saturating_add(1);
        }
    }

    /// The window as it is now.
    pub fn view(&self) -> WindowView {
        let now = self.slot_index();
        let rings = self.slots.all();
        let live = rings
            .iter()
            .flat_map(|r| r.iter())
            .filter(|s| s.index + (SLOTS as u64) > now);
        let mut routes: BTreeMap<&'static str, u64> = ROUTES.iter().map(|r| (*r, 0)).collect();
        // Per pool: the whole-window histogram and one per slot position (oldest first), each
        // the sum over the threads' rings.
        type Series = Vec<Option<Box<Histogram>>>;
        let mut per_pool: BTreeMap<String, (Box<Histogram>, Series)> = BTreeMap::new();
        for s in live {
            if s.index + ROUTE_SLOTS > now {
                for (route, n) in &s.routes {
                    *routes.entry(route).or_default() += n;
                }
            }
            let position = (SLOTS as u64 - 1 - (now - s.index)) as usize;
            for (pool, h) in &s.ttft {
                let (total, series) = per_pool
                    .entry(pool.clone())
                    .or_insert_with(|| (Box::new([0; BUCKETS]), vec![None; SLOTS]));
                let at = series[position].get_or_insert_with(|| Box::new([0; BUCKETS]));
                for ((t, a), c) in total.iter_mut().zip(at.iter_mut()).zip(h.iter()) {
                    *t = t.saturating_add(*c);
                    *a = a.saturating_add(*c);
                }
            }
        }
        let empty: Histogram = [0; BUCKETS];
        let ttft = per_pool
            .into_iter()
            .map(|(pool, (total, series))| {
                let whole = point(&total);
                let series = series
                    .into_iter()
                    .map(|h| point(h.as_deref().unwrap_or(&empty)))
                    .collect();
                let t = PoolTtft {
                    p50_ms: whole.p50_ms,
                    p99_ms: whole.p99_ms,
                    count: whole.count,
                    series,
                };
                (pool, t)
            })
            .collect();
        WindowView {
            routes,
            ttft,
            slot_seconds: SLOT_MS / 1000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Option<Duration> {
        Some(Duration::from_millis(v))
    }

    #[test]
    fn routes_are_counted_and_every_known_route_is_listed() {
        let r = Recent::default();
        r.record("p", "direct", ms(10));
        r.record("p", "direct", ms(10));
        r.record("p", "fallback", ms(30));
        r.record("none", "throttled", None);
        let v = r.view();
        assert_eq!(v.routes["direct"], 2);
        assert_eq!(v.routes["fallback"], 1);
        assert_eq!(v.routes["throttled"], 1);
        assert_eq!(v.routes["hedged"], 0);
        assert_eq!(v.routes["rejected"], 0);
        // A request without a first byte adds no TTFT sample (and no pool row).
        assert!(!v.ttft.contains_key("none"));
    }

    #[test]
    fn percentiles_come_from_the_histogram_within_one_bucket() {
        let r = Recent::default();
        for i in 1..=100 {
            r.record("p", "direct", ms(i * 10));
        }
        let t = &r.view().ttft["p"];
        assert_eq!(t.count, 100);
        let (p50, p99) = (t.p50_ms.unwrap(), t.p99_ms.unwrap());
        // True values 500 and 990 ms; reported as their bucket's upper bound (≤ 25% above).
        assert!((500.0..=625.0).contains(&p50), "{p50}");
        assert!((990.0..=1240.0).contains(&p99), "{p99}");
        assert_eq!(t.series.len(), SLOTS);
        let newest = t.series.last().unwrap();
        assert_eq!(newest.count, 100);
        assert!(t.series[..SLOTS - 1].iter().all(|p| p.count == 0));
    }

    /// Threads record into rings of their own; the view sums them, slot by slot.
    #[test]
    fn records_from_many_threads_are_summed() {
        let r = Recent::default();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..250 {
                        r.record("p", "direct", ms(10));
                    }
                });
            }
        });
        let v = r.view();
        assert_eq!(v.routes["direct"], 1_000);
        let p = &v.ttft["p"];
        assert_eq!(p.count, 1_000);
        // (Two slots when a ten-second boundary falls within the test.)
        assert_eq!(p.series.iter().map(|s| s.count).sum::<u64>(), 1_000);
    }

    #[test]
    fn buckets_cover_tiny_and_huge_values() {
        assert_eq!(bucket_of(0.0), 0);
        assert_eq!(bucket_of(1.0), 0);
        assert_eq!(bucket_of(1.2), 1);
        assert_eq!(bucket_of(1e12), BUCKETS - 1);
        let mut h = [0u32; BUCKETS];
        assert_eq!(quantile(&h, 0.5), None);
        h[3] = 1;
        assert_eq!(quantile(&h, 0.99), Some(bucket_ms(3)));
    }
}
