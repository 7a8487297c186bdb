//! Capacity: how many requests each variant can take at once, and the pool's wait line for
//! when every variant is full.
//!
//! **Learned limits (AIMD).** A model server that is full answers 429 (vLLM behind a queue
//! limit, llama.cpp with `--parallel`, hosted APIs). A 429 while other requests of ours are
//! running on that variant says "full at this concurrency": the variant's limit drops to what
//! it was running minus one, and nothing else changes. Cooling the whole variant down for the
//! advertised retry-after instead (what a generic proxy does) leaves a saturated fleet idle
//! while every variant waits out its cooldown, which is how admitted throughput falls below
//! capacity under overload. A 429 to a lone request, or one asking to wait more than 2 s, is a
//! quota, not a capacity, and is honoured as a cooldown (see `execution`). After `limit` successes in a row the limit grows by one
//! (additive increase), so a transient never caps a variant for good.
//!
//! **The wait line.** When every variant is at its limit, a request waits for a slot to be
//! freed, up to the pool's `queue_ms` and its own deadline, in the order of
//! `keel_core::queue`: priority (`x-keel-priority`), then deadline, then arrival. Each freed
//! slot goes to the first in line. A request is refused at once, never after a useless wait,
//! with `retry-after` from the measured drain rate (how fast slots free up): with 429 when the
//! line (`queue_max`) is full of requests that rank before it, with 503 when its wait is longer
//! than it may wait even at the fastest drain rate the measurement leaves plausible (a few
//! frees, or a stall that just began, measure a rate too thin to turn a request away on; it
//! waits, up to what it may). A request waiting at the back is displaced by a higher-ranked
//! newcomer when the line is full, and refused with 429 and retry-after.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use keel_core::queue::{DrainRate, Joined, Line, Place, Priority};

use crate::per_thread::PerThread;

/// A variant's learned concurrency limit (`u32::MAX`: none learned yet).
#[derive(Debug)]
pub struct Limit {
    limit: AtomicU32,
    /// Successes since the limit last changed.
    streak: AtomicU32,
    /// A cap another replica learned (see `signals`; `u32::MAX`: none). Kept apart from this
    /// replica's own limit: it expires with its signal and never feeds additive increase.
    shared: AtomicU32,
}

impl Default for Limit {
    fn default() -> Self {
        Limit {
            limit: AtomicU32::new(u32::MAX),
            streak: AtomicU32::new(0),
            shared: AtomicU32::new(u32::MAX),
        }
    }
}

impl Limit {
    /// The limit in force: this replica's own, or another replica's lower one.
    pub fn get(&self) -> u32 {
        self.learned().min(self.shared.load(Ordering::Relaxed))
    }

    /// What this replica learned from its own 429s.
    pub fn learned(&self) -> u32 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Sets (`Some`) or lifts (`None`) the cap learned by another replica.
    pub fn set_shared(&self, cap: Option<u32>) {
        self.shared
            .store(cap.unwrap_or(u32::MAX).max(1), Ordering::Relaxed);
    }

    /// A 429 arrived while `running` requests (this one included) were on the variant.
    pub fn full_at(&self, running: u32) {
        let new = running.saturating_sub(1).max(1);
        self.limit.fetch_min(new, Ordering::Relaxed);
        self.streak.store(0, Ordering::Relaxed);
    }

    /// One success: after `limit` of them in a row, the limit grows by one.
    pub fn success(&self) {
        let limit = self.learned();
        if limit == u32::MAX {
            return;
        }
        if self.streak.fetch_add(1, Ordering::Relaxed) + 1 >= limit {
            self.streak.store(0, Ordering::Relaxed);
            let _ =
                self.limit
                    .compare_exchange(limit, limit + 1, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
}

/// Why the wait line refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThrottleReason {
    /// The line is full of requests that rank before it (429).
    Full,
    /// A higher-ranked request took its place in a full line (429).
    Displaced,
    /// Its expected wait is longer than it may wait (503).
    Deadline,
    /// It waited as long as it may without getting a slot (503).
    Timeout,
}

impl ThrottleReason {
    /// The `reason` label of `keel_queue_refused_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            ThrottleReason::Full => "full",
            ThrottleReason::Displaced => "displaced",
            ThrottleReason::Deadline => "deadline",
            ThrottleReason::Timeout => "timeout",
        }
    }

    /// A full line is the client's share being used up (429, like a rate limit); a fleet that
    /// cannot serve in time is saturated (503).
    pub fn line_full(self) -> bool {
        matches!(self, ThrottleReason::Full | ThrottleReason::Displaced)
    }
}

/// A refusal by the wait line, with the client's retry-after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Throttle {
    pub reason: ThrottleReason,
    pub priority: Priority,
    pub retry_after_ms: u64,
    /// Requests waiting that rank before it.
    pub ahead: usize,
}

/// One waiting request's signals.
#[derive(Debug, Default)]
struct Waiter {
    /// The variant it waits for a slot on; `None`: any of the pool's (a request not yet
    /// planned, waiting in selection).
    variant: Option<usize>,
    wake: Notify,
    /// A freed slot was handed to it and it has not looked yet.
    woken: AtomicBool,
    /// The variant of the slot last handed to it.
    handed_on: AtomicUsize,
    /// A higher-ranked request took its place.
    displaced: AtomicBool,
}

#[derive(Debug)]
struct Inner {
    line: Line<Arc<Waiter>>,
    /// The same places by the variant they wait for, in the line's order: a slot freed on a
    /// variant goes to the first waiting for that variant, found at once.
    by_variant: HashMap<Option<usize>, BTreeSet<Place>>,
}

impl Inner {
    /// The first place in line waiting for `variant` (`None`: for any).
    fn first_for(&self, variant: Option<usize>) -> Option<Place> {
        self.by_variant.get(&variant)?.first().copied()
    }

    /// Takes `place` out of the line (both orders); its waiter if it was there.
    fn remove(&mut self, place: &Place) -> Option<Arc<Waiter>> {
        let w = self.line.remove(place)?;
        self.forget(w.variant, place);
        Some(w)
    }

    fn forget(&mut self, variant: Option<usize>, place: &Place) {
        if let Some(set) = self.by_variant.get_mut(&variant) {
            set.remove(place);
            if set.is_empty() {
                self.by_variant.remove(&variant);
            }
        }
    }
}

/// The pool's line of requests waiting for a slot.
#[derive(Debug)]
pub struct WaitLine {
    inner: Mutex<Inner>,
    /// Slots freed, counted per thread (every request frees one: no shared lock for that).
    drain: PerThread<DrainRate>,
    epoch: Instant,
    /// EWMA of how long a request holds its slot, in µs (f64 bits; 0 before any): the wait
    /// estimate before the drain rate is measured.
    hold_us: AtomicU64,
    /// `keel_queue_depth{pool,priority}`, highest priority first.
    depth: Option<[metrics::Gauge; 3]>,
    waiting: AtomicU32,
}

/// A place's wait in line (ms): as expected from the measured drain rate, and the soonest the
/// measurement leaves plausible.
#[derive(Debug, Clone, Copy)]
struct Estimate {
    expected_ms: u64,
    soonest_ms: u64,
}

/// Weight of the newest sample in the slot-holding time average.
const HOLD_ALPHA: f64 = 0.05;

/// The drain rate counts the slots freed in this window.
const DRAIN_WINDOW_MS: u64 = 3_000;

/// A waiter looks again this often even without a freed slot: capacity also comes back without
/// one (a learned limit grows, a cooldown ends).
const RECHECK: Duration = Duration::from_millis(200);

impl WaitLine {
    /// A line of at most `capacity` requests; `depth` are its gauges by priority.
    pub fn new(capacity: usize, depth: Option<[metrics::Gauge; 3]>) -> Self {
        WaitLine {
            inner: Mutex::new(Inner {
                line: Line::new(capacity),
                by_variant: HashMap::new(),
            }),
            drain: PerThread::new(|| DrainRate::new(DRAIN_WINDOW_MS)),
            epoch: Instant::now(),
            hold_us: AtomicU64::new(0),
            depth,
            waiting: AtomicU32::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn ms(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_millis() as u64
    }

    /// Updates the depth gauges and the waiting count (with the lock held).
    fn changed(&self, inner: &Inner) {
        let d = inner.line.depths();
        self.waiting
            .store(inner.line.len() as u32, Ordering::Relaxed);
        // Pairs with the fence in `freed`: see there.
        fence(Ordering::SeqCst);
        if let Some(g) = &self.depth {
            for (g, n) in g.iter().zip(d) {
                g.set(n as f64);
            }
        }
    }

    /// A slot was freed on `variant`, after serving a request for `held_us` (`None`: it served
    /// none). The first in line waiting for that variant gets it.
    ///
    /// With nobody waiting it takes no shared lock. The slot itself was given back before this
    /// call (`InFlight::drop`), and a waiter looks for a free slot after joining the line
    /// (`Pool::wait_for_slot`): the fences here and in `changed` order the two sides, so either
    /// the waiter finds the slot or this call sees it waiting and wakes it.
    pub fn freed(&self, variant: usize, held_us: Option<f64>) {
        if let Some(held_us) = held_us {
            let now = self.ms(Instant::now());
            self.hold(held_us);
            self.drain.own().record(now);
        }
        fence(Ordering::SeqCst);
        if self.waiting.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut inner = self.lock();
        Self::hand_to_first(&mut inner, variant);
        self.changed(&inner);
    }

    /// Hands a slot freed on `variant` to the first in line that could take it (waiting for
    /// that variant, or for any): it leaves the line and looks.
    fn hand_to_first(inner: &mut Inner, variant: usize) {
        let first = [inner.first_for(Some(variant)), inner.first_for(None)]
            .into_iter()
            .flatten()
            .min();
        if let Some(w) = first.and_then(|p| inner.remove(&p)) {
            w.handed_on.store(variant, Ordering::Relaxed);
            w.woken.store(true, Ordering::Relaxed);
            w.wake.notify_one();
        }
    }

    fn hold(&self, held_us: f64) {
        // One compare-and-swap: slots freed at once on several threads each count.
        let _ = self
            .hold_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let old = f64::from_bits(bits);
                let new = if old == 0.0 {
                    held_us
                } else {
                    old + HOLD_ALPHA * (held_us - old)
                };
                Some(new.to_bits())
            });
    }

    pub fn waiting(&self) -> u32 {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Expected wait (ms) for a request with `ahead` others before it, when `running` requests
    /// hold the pool's slots: from the measured drain rate, or before there is one from
    /// Little's law (running ÷ mean holding time). `None` before any slot was freed.
    pub fn expected_wait_ms(&self, ahead: usize, running: u32) -> Option<u64> {
        let now = self.ms(Instant::now());
        self.expected(ahead, running, now)
    }

    fn expected(&self, ahead: usize, running: u32, now: u64) -> Option<u64> {
        self.estimate(ahead, running, now).map(|w| w.expected_ms)
    }

    /// The wait for a place with `ahead` requests before it: as expected, and the soonest the
    /// measurement leaves plausible (see [`keel_core::queue::Measured::fastest_per_sec`]).
    fn estimate(&self, ahead: usize, running: u32, now: u64) -> Option<Estimate> {
        if let Some(m) = DrainRate::combined(&mut self.drain.all(), now) {
            return Some(Estimate {
                expected_ms: DrainRate::wait_at(m.per_sec(), ahead),
                soonest_ms: DrainRate::wait_at(m.fastest_per_sec(), ahead),
            });
        }
        let hold_ms = f64::from_bits(self.hold_us.load(Ordering::Relaxed)) / 1000.0;
        (hold_ms > 0.0).then(|| {
            let ms = ((ahead as f64 + 1.0) * hold_ms / running.max(1) as f64).ceil() as u64;
            Estimate {
                expected_ms: ms,
                soonest_ms: ms,
            }
        })
    }

    /// Slots freed per second, as measured now.
    pub fn drain_per_sec(&self) -> Option<f64> {
        self.drain_rate(self.ms(Instant::now()))
    }

    /// Slots freed per second over every thread's count.
    fn drain_rate(&self, now_ms: u64) -> Option<f64> {
        DrainRate::combined_per_sec(&mut self.drain.all(), now_ms)
    }

    /// Whether a request of `priority` due at `deadline` arriving now would find others
    /// waiting before it.
    pub fn any_before(&self, priority: Priority, deadline: Instant) -> bool {
        if self.waiting() == 0 {
            return false;
        }
        let mut inner = self.lock();
        let place = inner.line.place(priority, self.ms(deadline));
        inner.line.ahead(&place) > 0
    }

    /// Joins the line at the place of a request for a slot on `variant` (`None`: on any of the
    /// pool's) of `priority` due at
    /// `deadline`, which may wait until `wait_until`; `running`: requests holding the pool's
    /// slots. Refused at once when the line is full for its priority or its expected wait ends
    /// after `wait_until`.
    pub fn join(
        &self,
        variant: Option<usize>,
        priority: Priority,
        deadline: Instant,
        wait_until: Instant,
        running: u32,
    ) -> Result<Ticket<'_>, Throttle> {
        let now = Instant::now();
        let now_ms = self.ms(now);
        let mut inner = self.lock();
        let place = inner.line.place(priority, self.ms(deadline));
        let ahead = inner.line.ahead(&place);
        let estimate = self.estimate(ahead, running, now_ms);
        let refuse = |reason, ahead| Throttle {
            reason,
            priority,
            retry_after_ms: estimate.map_or(1000, |w| w.expected_ms).max(1),
            ahead,
        };
        if !inner.line.has_room_for(&place) {
            return Err(refuse(ThrottleReason::Full, ahead));
        }
        // Refused at once only when even the soonest plausible wait is too long: a thin
        // measurement (a few frees, a stall that just began) is no reason to turn away a
        // request that a wait may serve; the wait itself is still bounded by `wait_until`.
        // Unknown rate (nothing served yet): wait and see rather than refuse blind.
        if estimate.is_some_and(|w| now + Duration::from_millis(w.soonest_ms) > wait_until) {
            return Err(refuse(ThrottleReason::Deadline, ahead));
        }
        let ticket = Ticket {
            line: self,
            place,
            waiter: Arc::new(Waiter {
                variant,
                ..Waiter::default()
            }),
        };
        self.enter(&mut inner, &ticket);
        Ok(ticket)
    }

    /// Puts the ticket's place in line, displacing the last one if the line is full.
    fn enter(&self, inner: &mut Inner, t: &Ticket<'_>) -> bool {
        let joined = match inner.line.join(t.place, t.waiter.clone()) {
            Joined::Queued => true,
            Joined::Displaced(last, victim) => {
                inner.forget(victim.variant, &last);
                victim.displaced.store(true, Ordering::Relaxed);
                victim.wake.notify_one();
                true
            }
            Joined::Full => false,
        };
        if joined {
            inner
                .by_variant
                .entry(t.waiter.variant)
                .or_default()
                .insert(t.place);
        }
        self.changed(inner);
        joined
    }
}

/// A place in the wait line; it leaves the line when dropped.
pub struct Ticket<'a> {
    line: &'a WaitLine,
    place: Place,
    waiter: Arc<Waiter>,
}

/// What ended a wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// A slot may be free: look again.
    LookAgain,
    /// A higher-ranked request took this place.
    Displaced,
    /// The wait allowed is over.
    TimedOut,
}

impl Ticket<'_> {
    /// Requests in line that rank before this one.
    pub fn ahead(&self) -> usize {
        self.line.lock().line.ahead(&self.place)
    }

    /// The expected wait for this place now.
    pub fn expected_wait_ms(&self, running: u32) -> u64 {
        let ahead = self.ahead();
        self.line.expected_wait_ms(ahead, running).unwrap_or(1000)
    }

    /// Waits for a freed slot (or a periodic look), until `until`. A place that was handed a
    /// slot but found none free goes back in line first, at its old rank.
    pub async fn wait(&self, until: Instant) -> Wake {
        if self.waiter.displaced.load(Ordering::Relaxed) {
            return Wake::Displaced;
        }
        let first = {
            let mut inner = self.line.lock();
            if !inner.line.contains(&self.place) && !self.line.enter(&mut inner, self) {
                return Wake::Displaced;
            }
            inner.first_for(self.waiter.variant) == Some(self.place)
        };
        let now = Instant::now();
        if now >= until {
            return Wake::TimedOut;
        }
        // Only the first in line for its variant looks again on its own (capacity that comes
        // back there without a freed slot is its to take first); the rest wait to be woken. A
        // burst puts tens of thousands in line, and each looking every `RECHECK` would keep a
        // core busy.
        let look_at = if first {
            (now + RECHECK).min(until)
        } else {
            until
        };
        let _ = tokio::time::timeout_at(look_at, self.waiter.wake.notified()).await;
        // It looks now: a slot handed to it is its own to take (or to give back by rejoining).
        self.waiter.woken.store(false, Ordering::Relaxed);
        if self.waiter.displaced.load(Ordering::Relaxed) {
            Wake::Displaced
        } else {
            Wake::LookAgain
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut inner = self.line.lock();
        let variant = self.waiter.variant;
        let was_first = inner.first_for(variant) == Some(self.place);
        let was_in_line = inner.remove(&self.place).is_some();
        if !was_in_line && self.waiter.woken.load(Ordering::Relaxed) {
            // Handed a slot it will not use (it left, e.g. its client went away): the next one
            // gets it.
            let on = self.waiter.handed_on.load(Ordering::Relaxed);
            WaitLine::hand_to_first(&mut inner, on);
        } else if was_first || !was_in_line {
            // It was first in line for its variant (or handed a slot, and so first until then):
            // the new first looks at once, and from then on by itself (see `Ticket::wait`).
            if let Some(w) = inner.first_for(variant).and_then(|p| inner.line.get(&p)) {
                w.wake.notify_one();
            }
        }
        self.line.changed(&inner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_429_lowers_the_limit_and_successes_raise_it_again() {
        let l = Limit::default();
        l.success();
        assert_eq!(l.get(), u32::MAX);
        l.full_at(7);
        assert_eq!(l.get(), 6);
        // A later 429 at a higher count cannot raise it.
        l.full_at(9);
        assert_eq!(l.get(), 6);
        for _ in 0..5 {
            l.success();
        }
        assert_eq!(l.get(), 6);
        l.success();
        assert_eq!(l.get(), 7);
        // A lone request refused: the floor is one.
        l.full_at(1);
        assert_eq!(l.get(), 1);
    }

    #[test]
    fn a_shared_cap_lowers_the_limit_in_force_but_not_what_was_learned() {
        let l = Limit::default();
        l.set_shared(Some(4));
        assert_eq!(l.get(), 4);
        assert_eq!(l.learned(), u32::MAX);
        l.full_at(3);
        assert_eq!(l.get(), 2, "a lower own limit wins");
        // Additive increase follows the own limit only.
        l.success();
        l.success();
        assert_eq!(l.learned(), 3);
        l.set_shared(None);
        assert_eq!(l.get(), 3);
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    #[test]
    fn before_a_drain_rate_the_wait_follows_littles_law() {
        let line = WaitLine::new(8, None);
        assert_eq!(line.expected_wait_ms(0, 4), None);
        line.freed(0, None);
        assert_eq!(line.expected_wait_ms(0, 4), None);
        line.freed(0, Some(800_000.0));
        // 8 slots held 800 ms each free one every 100 ms: the 3rd in line waits 300 ms.
        assert_eq!(line.expected_wait_ms(2, 8), Some(300));
    }

    /// A slot freed on a variant goes to the first waiting for that variant or for any, not to
    /// one ahead of them waiting for another variant; handed back unused, it goes to the next
    /// that could take it.
    #[tokio::test]
    async fn a_freed_slot_goes_to_the_first_that_can_take_it() {
        let line = WaitLine::new(8, None);
        let on_a = line
            .join(Some(0), Priority::Normal, far(), far(), 1)
            .unwrap();
        let on_b = line
            .join(Some(1), Priority::Normal, far(), far(), 1)
            .unwrap();
        let any = line.join(None, Priority::Normal, far(), far(), 1).unwrap();
        let woken = |t: &Ticket<'_>| t.waiter.woken.load(Ordering::Relaxed);
        line.freed(1, None);
        assert!(woken(&on_b) && !woken(&on_a) && !woken(&any));
        // `on_b` leaves without the slot: the next that could take a slot on variant 1 is
        // `any` (`on_a` waits for variant 0).
        drop(on_b);
        assert!(woken(&any) && !woken(&on_a));
        line.freed(0, None);
        assert!(woken(&on_a));
        assert_eq!(line.waiting(), 0);
    }

    #[tokio::test]
    async fn a_freed_slot_goes_to_the_highest_priority_and_tickets_leave_when_dropped() {
        let line = WaitLine::new(8, None);
        let low = line.join(None, Priority::Low, far(), far(), 1).unwrap();
        let normal = line.join(None, Priority::Normal, far(), far(), 1).unwrap();
        let high = line.join(None, Priority::High, far(), far(), 1).unwrap();
        assert_eq!(line.waiting(), 3);
        assert_eq!((high.ahead(), normal.ahead(), low.ahead()), (0, 1, 2));
        line.freed(0, None);
        assert!(high.waiter.woken.load(Ordering::Relaxed));
        assert!(!low.waiter.woken.load(Ordering::Relaxed));
        assert_eq!(line.waiting(), 2);
        // The slot was handed to `high`, which goes away without using it: the next gets it.
        drop(high);
        assert!(normal.waiter.woken.load(Ordering::Relaxed));
        assert_eq!(line.waiting(), 1);
        // `normal` looks, finds no slot free and goes back in line at its rank.
        assert_eq!(normal.wait(Instant::now()).await, Wake::TimedOut);
        assert_eq!(line.waiting(), 2);
        assert_eq!(low.ahead(), 1);
        drop(normal);
        drop(low);
        assert_eq!(line.waiting(), 0);
    }

    #[tokio::test]
    async fn a_thin_measurement_lets_a_request_wait_that_the_expected_rate_would_refuse() {
        let mut line = WaitLine::new(32, None);
        line.epoch = Instant::now() - Duration::from_secs(10);
        let now_ms = line.ms(Instant::now());
        // Five frees 100 ms apart just now: 10 a second measured, 20 plausible.
        for i in 0..5 {
            line.drain.own().record(now_ms - 400 + 100 * i);
        }
        let ahead: Vec<_> = (0..9)
            .map(|_| line.join(None, Priority::Normal, far(), far(), 1).unwrap())
            .collect();
        // Nine ahead: ten frees, expected in about 1 s, plausibly in 0.5 s (a little later on
        // a slow machine: the span grows while the test runs, hence the margins).
        let ms = |d| Instant::now() + Duration::from_millis(d);
        let patient = line.join(None, Priority::Normal, far(), ms(900), 1);
        assert!(patient.is_ok(), "refused although it may be served in time");
        drop(patient);
        // Even at the fastest plausible rate 300 ms is too short: refused at once, with the
        // expected wait as retry-after.
        let hurried = line
            .join(None, Priority::Normal, far(), ms(300), 1)
            .err()
            .unwrap();
        assert_eq!(hurried.reason, ThrottleReason::Deadline);
        assert_eq!(hurried.ahead, 9);
        assert!(
            (1000..3000).contains(&hurried.retry_after_ms),
            "{}",
            hurried.retry_after_ms
        );
        drop(ahead);
    }

    #[tokio::test]
    async fn a_full_line_refuses_or_displaces_with_retry_after() {
        let line = WaitLine::new(1, None);
        line.freed(0, Some(500_000.0));
        let low = line.join(None, Priority::Low, far(), far(), 5).unwrap();
        let refused = line
            .join(None, Priority::Low, far(), far(), 5)
            .err()
            .unwrap();
        assert_eq!(refused.reason, ThrottleReason::Full);
        assert!(refused.reason.line_full());
        // One ahead, 5 slots held 500 ms each: two frees at one per 100 ms.
        assert_eq!((refused.ahead, refused.retry_after_ms), (1, 200));
        let high = line.join(None, Priority::High, far(), far(), 5).unwrap();
        assert_eq!(low.wait(far()).await, Wake::Displaced);
        assert_eq!(line.waiting(), 1);
        drop(low);
        drop(high);
        assert_eq!(line.waiting(), 0);
    }

    #[test]
    fn a_wait_longer_than_allowed_is_refused_at_once() {
        let line = WaitLine::new(8, None);
        line.freed(0, Some(1_000_000.0));
        // One slot, held 1 s: the first in line waits 1 s, more than the 100 ms allowed.
        let soon = Instant::now() + Duration::from_millis(100);
        let t = line
            .join(None, Priority::High, soon, soon, 1)
            .err()
            .unwrap();
        assert_eq!(t.reason, ThrottleReason::Deadline);
        assert!(!t.reason.line_full());
        assert_eq!(t.retry_after_ms, 1000);
        assert_eq!(line.waiting(), 0);
    }
}
