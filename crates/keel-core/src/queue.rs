//! The wait line of a full pool, as pure data: who is served next when a slot frees, who is
//! refused or displaced when the line is full, and how long a place in it is expected to wait.
//!
//! **Order.** By [`Priority`] first (`High`, then `Normal`, then `Low`), then by deadline (the
//! earliest first: it has the least time left to be served), then by arrival (first come,
//! first served among equals).
//!
//! **Capacity and displacement.** The line holds at most `capacity` requests. A request that
//! finds it full takes the place of the last one in the order when it ranks before it; that
//! one is handed back to be refused with a retry-after (never dropped in silence). Otherwise
//! the newcomer is refused: the line is full for its priority.
//!
//! **Expected wait.** [`DrainRate`] measures how fast slots free up (frees in a sliding
//! window); a place with `ahead` requests before it waits about `(ahead + 1) / rate`.

use std::collections::{BTreeMap, VecDeque};

/// How a request ranks in the wait line. `Default` is `Normal`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    High,
    #[default]
    Normal,
    Low,
}

impl Priority {
    /// Every priority, highest first.
    pub const ALL: [Priority; 3] = [Priority::High, Priority::Normal, Priority::Low];

    /// `high`, `normal` or `low` (case-insensitive).
    pub fn parse(s: &str) -> Option<Priority> {
        match s.trim().to_ascii_lowercase().as_str() {
            "high" => Some(Priority::High),
            "normal" => Some(Priority::Normal),
            "low" => Some(Priority::Low),
            _ => None,
        }
    }

    /// The label in headers, metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }
}

/// A place in the line; places compare in serving order (smaller is served first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Place {
    pub priority: Priority,
    /// When the request must be answered by, in the caller's milliseconds.
    pub deadline_ms: u64,
    /// Arrival order: ties between equal priority and deadline go to the earlier.
    seq: u64,
}

/// What joining a full or open line did.
#[derive(Debug, PartialEq, Eq)]
pub enum Joined<T> {
    /// In line.
    Queued,
    /// In line, in place of this one (the last in the order), which the caller must refuse.
    Displaced(Place, T),
    /// Not in line: it is full of requests that rank before this one.
    Full,
}

/// The wait line: places in serving order, each with the caller's waiter `T`.
#[derive(Debug)]
pub struct Line<T> {
    entries: BTreeMap<Place, T>,
    capacity: usize,
    next_seq: u64,
    /// Entries at each priority (as [`Priority::ALL`]), kept as they join and leave: the
    /// gauges read them on every change, and a burst can put tens of thousands in line.
    depths: [usize; 3],
}

impl<T> Line<T> {
    /// A line of at most `capacity` requests (0: none may wait).
    pub fn new(capacity: usize) -> Self {
        Line {
            entries: BTreeMap::new(),
            capacity,
            next_seq: 0,
            depths: [0; 3],
        }
    }

    /// A new place for a request arriving now (it is not in the line until [`Line::join`]).
    pub fn place(&mut self, priority: Priority, deadline_ms: u64) -> Place {
        self.next_seq += 1;
        Place {
            priority,
            deadline_ms,
            seq: self.next_seq,
        }
    }

    /// Puts `item` at `place`, displacing the last request when the line is full and it ranks
    /// after `place`. A place may leave and rejoin (it keeps its rank: its sequence number).
    pub fn join(&mut self, place: Place, item: T) -> Joined<T> {
        if self.entries.len() < self.capacity {
            if self.entries.insert(place, item).is_none() {
                self.depths[place.priority as usize] += 1;
            }
            return Joined::Queued;
        }
        match self.entries.last_key_value() {
            Some((last, _)) if *last > place => {
                let (last, victim) = self.entries.pop_last().expect("the line is not empty");
                self.depths[last.priority as usize] -= 1;
                self.entries.insert(place, item);
                self.depths[place.priority as usize] += 1;
                Joined::Displaced(last, victim)
            }
            _ => Joined::Full,
        }
    }

    /// Whether `place` could join now (there is room, or someone after it to displace).
    pub fn has_room_for(&self, place: &Place) -> bool {
        self.entries.len() < self.capacity
            || self
                .entries
                .last_key_value()
                .is_some_and(|(l, _)| l > place)
    }

    /// How many requests in line rank before `place`: at once for a place after everyone (the
    /// common case, an arrival at the back), else by counting.
    pub fn ahead(&self, place: &Place) -> usize {
        match self.entries.last_key_value() {
            Some((last, _)) if last < place => self.entries.len(),
            _ => self.entries.range(..*place).count(),
        }
    }

    /// The item waiting at `place`, if it is in line.
    pub fn get(&self, place: &Place) -> Option<&T> {
        self.entries.get(place)
    }

    /// The first request in line leaves it (a slot freed for it).
    pub fn pop(&mut self) -> Option<(Place, T)> {
        let first = self.entries.pop_first()?;
        self.depths[first.0.priority as usize] -= 1;
        Some(first)
    }

    /// `place` leaves the line (served, refused or gone); its item if it was there.
    pub fn remove(&mut self, place: &Place) -> Option<T> {
        let item = self.entries.remove(place)?;
        self.depths[place.priority as usize] -= 1;
        Some(item)
    }

    pub fn contains(&self, place: &Place) -> bool {
        self.entries.contains_key(place)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Requests waiting at each priority, highest first (as [`Priority::ALL`]).
    pub fn depths(&self) -> [usize; 3] {
        self.depths
    }
}

/// How fast slots free up: frees recorded within a sliding window.
#[derive(Debug, Clone)]
pub struct DrainRate {
    frees: VecDeque<u64>,
    window_ms: u64,
}

/// Frees kept at most (a window at several hundred requests a second keeps the newest).
const MAX_FREES: usize = 512;

impl DrainRate {
    pub fn new(window_ms: u64) -> Self {
        DrainRate {
            frees: VecDeque::new(),
            window_ms: window_ms.max(1),
        }
    }

    /// A slot freed at `now_ms` (after serving a request).
    pub fn record(&mut self, now_ms: u64) {
        if self.frees.len() == MAX_FREES {
            self.frees.pop_front();
        }
        self.frees.push_back(now_ms);
        self.expire(now_ms);
    }

    /// Drops the frees older than the window.
    pub fn expire(&mut self, now_ms: u64) {
        while self
            .frees
            .front()
            .is_some_and(|t| now_ms.saturating_sub(*t) > self.window_ms)
        {
            self.frees.pop_front();
        }
    }

    /// Slots freed per second: the frees after the oldest one in the window, over the time
    /// from it to now (a silence since the last free lowers the rate). `None` with fewer than
    /// two frees in the window.
    pub fn per_sec(&mut self, now_ms: u64) -> Option<f64> {
        Self::combined_per_sec(&mut [self], now_ms)
    }

    /// The rate of several counts of one line's frees taken together (counted apart, e.g. per
    /// thread): as [`DrainRate::per_sec`] over all their frees.
    pub fn combined_per_sec<D: std::ops::DerefMut<Target = DrainRate>>(
        parts: &mut [D],
        now_ms: u64,
    ) -> Option<f64> {
        Self::combined(parts, now_ms).map(|m| m.per_sec())
    }

    /// What the window holds, over several counts of one line's frees taken together. `None`
    /// with fewer than two frees in the window.
    pub fn combined<D: std::ops::DerefMut<Target = DrainRate>>(
        parts: &mut [D],
        now_ms: u64,
    ) -> Option<Measured> {
        let (mut frees, mut oldest) = (0usize, u64::MAX);
        for d in parts.iter_mut() {
            d.expire(now_ms);
            frees += d.frees.len();
            oldest = oldest.min(d.frees.front().copied().unwrap_or(u64::MAX));
        }
        let span_ms = now_ms.saturating_sub(oldest);
        // Two frees or more: `oldest` is one of them, and the rate counts those after it.
        if frees < 2 || span_ms == 0 {
            return None;
        }
        Some(Measured {
            counted: frees - 1,
            span_ms,
        })
    }

    /// Expected wait (ms) at `rate` frees a second for a place with `ahead` requests before
    /// it: until `ahead + 1` slots have freed.
    pub fn wait_at(rate: f64, ahead: usize) -> u64 {
        ((ahead as f64 + 1.0) * 1000.0 / rate).ceil() as u64
    }

    /// Expected wait (ms) for a place with `ahead` requests before it: until `ahead + 1`
    /// slots have freed. `None` without a measured rate.
    pub fn expected_wait_ms(&mut self, ahead: usize, now_ms: u64) -> Option<u64> {
        Some(Self::wait_at(self.per_sec(now_ms)?, ahead))
    }
}

/// A drain rate as measured: `counted` frees in the `span_ms` since the oldest one kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measured {
    pub counted: usize,
    pub span_ms: u64,
}

impl Measured {
    /// The measured rate, frees a second.
    pub fn per_sec(self) -> f64 {
        self.counted as f64 * 1000.0 / self.span_ms as f64
    }

    /// The fastest rate this measurement leaves plausible: frees arrive at random, so a count
    /// of `n` in a window is the true rate's give or take about √n; two of those above the
    /// count. A thin measurement (a few frees, a stall that just began) leaves a wide margin;
    /// a busy line's hundreds of frees leave a narrow one.
    pub fn fastest_per_sec(self) -> f64 {
        let n = self.counted as f64;
        (n + 2.0 * n.sqrt()) * 1000.0 / self.span_ms as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Priority::*;

    /// The kept depths and the quick `ahead` agree with counting the line, through joins,
    /// displacements, pops and removals in any order.
    #[test]
    fn depths_and_ahead_agree_with_counting() {
        let mut rng = crate::rng::Rng::new(3);
        let mut line = Line::new(40);
        let mut places = Vec::new();
        for step in 0..4_000u64 {
            match rng.next_u64() % 4 {
                0 | 1 => {
                    let priority = Priority::ALL[(rng.next_u64() % 3) as usize];
                    let place = line.place(priority, rng.next_u64() % 50);
                    if line.join(place, step) != Joined::Full {
                        places.push(place);
                    }
                }
                2 => {
                    line.pop();
                }
                _ => {
                    if !places.is_empty() {
                        let p = places.swap_remove((rng.next_u64() as usize) % places.len());
                        line.remove(&p);
                    }
                }
            }
            let mut counted = [0; 3];
            for p in line.entries.keys() {
                counted[p.priority as usize] += 1;
            }
            assert_eq!(line.depths(), counted, "step {step}");
            let probe = line.place(Priority::ALL[(step % 3) as usize], rng.next_u64() % 60);
            assert_eq!(line.ahead(&probe), line.entries.range(..probe).count());
        }
    }

    #[test]
    fn priority_parses_and_orders_high_first() {
        assert_eq!(Priority::parse(" HIGH "), Some(High));
        assert_eq!(Priority::parse("low"), Some(Low));
        assert_eq!(Priority::parse("urgent"), None);
        assert_eq!(Priority::default(), Normal);
        assert!(High < Normal && Normal < Low);
        assert_eq!(
            Priority::ALL.map(Priority::as_str),
            ["high", "normal", "low"]
        );
    }

    #[test]
    fn the_line_serves_by_priority_then_deadline_then_arrival() {
        let mut line = Line::new(10);
        let a = line.place(Low, 100);
        let b = line.place(Normal, 900);
        let c = line.place(Normal, 500);
        let d = line.place(High, 10_000);
        let e = line.place(Normal, 500);
        for (p, name) in [(a, "a"), (b, "b"), (c, "c"), (d, "d"), (e, "e")] {
            assert_eq!(line.join(p, name), Joined::Queued);
        }
        assert_eq!(line.depths(), [1, 3, 1]);
        assert_eq!(line.ahead(&b), 3);
        let order: Vec<_> = std::iter::from_fn(|| line.pop().map(|x| x.1)).collect();
        assert_eq!(order, ["d", "c", "e", "b", "a"]);
        assert!(line.is_empty());
    }

    #[test]
    fn a_place_that_rejoins_keeps_its_rank() {
        let mut line = Line::new(10);
        let first = line.place(Normal, 1000);
        let later = line.place(Normal, 1000);
        line.join(first, 1);
        line.join(later, 2);
        assert_eq!(line.pop(), Some((first, 1)));
        // Woken, but the slot was taken: back in line, still before `later`.
        line.join(first, 1);
        assert_eq!(line.ahead(&later), 1);
        assert_eq!(line.remove(&later), Some(2));
        assert_eq!(line.remove(&later), None);
        assert_eq!(line.len(), 1);
    }

    #[test]
    fn a_full_line_displaces_the_last_for_a_higher_rank_and_refuses_otherwise() {
        let mut line = Line::new(2);
        let low_old = line.place(Low, 100);
        let low_new = line.place(Low, 200);
        line.join(low_old, "low-old");
        line.join(low_new, "low-new");
        // Another low one ranks after both: full for its priority.
        let low3 = line.place(Low, 300);
        assert!(!line.has_room_for(&low3));
        assert_eq!(line.join(low3, "low3"), Joined::Full);
        // A low one with an earlier deadline ranks before the last: it takes its place.
        let low_urgent = line.place(Low, 150);
        assert_eq!(
            line.join(low_urgent, "low-urgent"),
            Joined::Displaced(low_new, "low-new")
        );
        let high = line.place(High, u64::MAX);
        assert!(line.has_room_for(&high));
        assert_eq!(
            line.join(high, "high"),
            Joined::Displaced(low_urgent, "low-urgent")
        );
        assert_eq!(line.len(), 2);
        assert_eq!(line.pop().map(|x| x.1), Some("high"));
        assert_eq!(line.pop().map(|x| x.1), Some("low-old"));
    }

    #[test]
    fn a_line_of_no_capacity_takes_no_one() {
        let mut line = Line::new(0);
        let p = line.place(High, 0);
        assert_eq!(line.join(p, ()), Joined::Full);
    }

    #[test]
    fn the_drain_rate_counts_frees_in_its_window() {
        let mut d = DrainRate::new(2000);
        assert_eq!(d.per_sec(0), None);
        d.record(1000);
        assert_eq!(d.per_sec(1000), None, "one free is no rate");
        // A free every 50 ms: 20 a second.
        for i in 1..=20 {
            d.record(1000 + 50 * i);
        }
        assert_eq!(d.per_sec(2000), Some(20.0));
        // The 4th in line (3 ahead) waits for 4 frees: 200 ms.
        assert_eq!(d.expected_wait_ms(3, 2000), Some(200));
        // Silence lowers the rate: 20 frees over 1.5 s.
        assert!((d.per_sec(2500).unwrap() - 20.0 / 1.5).abs() < 1e-9);
        // Beyond the window, the old frees are gone.
        assert_eq!(d.per_sec(10_000), None);
        assert_eq!(d.expected_wait_ms(0, 10_000), None);
    }

    #[test]
    fn the_fastest_plausible_rate_is_wide_for_few_frees_and_narrow_for_many() {
        // 4 frees in 400 ms: 10 a second measured, 20 plausible (4 + 2·2 over 0.4 s).
        let few = Measured {
            counted: 4,
            span_ms: 400,
        };
        assert_eq!(few.per_sec(), 10.0);
        assert_eq!(few.fastest_per_sec(), 20.0);
        // 400 frees in 40 s: the same 10 a second, but at most 11 plausible.
        let many = Measured {
            counted: 400,
            span_ms: 40_000,
        };
        assert_eq!(many.per_sec(), 10.0);
        assert_eq!(many.fastest_per_sec(), 11.0);
        let mut d = DrainRate::new(2000);
        for i in 0..=4 {
            d.record(1000 + 100 * i);
        }
        assert_eq!(DrainRate::combined(&mut [&mut d], 1400), Some(few));
    }

    #[test]
    fn the_drain_rate_keeps_a_bounded_number_of_frees() {
        let mut d = DrainRate::new(60_000);
        for i in 0..(MAX_FREES as u64 * 2) {
            d.record(i);
        }
        // One free a millisecond: the rate holds though the oldest were dropped.
        assert_eq!(d.per_sec(MAX_FREES as u64 * 2 - 1), Some(1000.0));
    }
}
