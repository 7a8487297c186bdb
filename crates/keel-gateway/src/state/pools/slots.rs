//! Slots and in-flight requests: whether a variant can take a request now, its concurrency
//! limit for a priority (with the reserve kept for high priority), and taking and waiting for
//! a slot ([`InFlight`] gives it back when dropped).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::state::capacity::Wake;
use keel_core::health::State;
use keel_core::queue::Priority;

use super::*;

/// How long after the last high-priority request its share of capacity stays reserved.
pub(super) const HIGH_RESERVE_FOR_MS: u64 = 10_000;

/// Decrements a variant's in-flight count when dropped (also when a stream is cancelled).
pub struct InFlight {
    pub(crate) pool: Arc<Pool>,
    pub(crate) index: usize,
    since: Instant,
    /// The attempt is serving the client: its holding time feeds the wait line's estimate
    /// (refused or cancelled attempts would make slots look quicker to free than they are).
    pub(crate) serving: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.pool.variants[self.index]
            .in_flight
            .fetch_sub(1, Ordering::Relaxed);
        let held_us = self.since.elapsed().as_secs_f64() * 1e6;
        self.pool
            .line
            .freed(self.index, self.serving.then_some(held_us));
    }
}

impl Pool {
    /// Whether a variant may be tried now (re-checked before every attempt): not cooling down,
    /// credential not refused. Ejection is selection's business (an ejected variant is planned
    /// only when nothing else can serve); concurrency is a separate question
    /// ([`Pool::below_limit`]): a full variant is waited for, not skipped.
    pub fn available(&self, index: usize, now_ms: u64) -> bool {
        self.live(index).availability.available(now_ms)
    }
    /// Milliseconds until a variant cooling down after a failure may be tried again; `None`
    /// when it is not cooling down, or is ejected or warming (probes and warm-ups, not a
    /// client's retry, find out when those are back).
    pub fn cooling_for_ms(&self, index: usize, now_ms: u64) -> Option<u64> {
        let live = self.live(index);
        let ms = live.availability.available_in_ms(now_ms);
        let out = live.est.loading
            || live.availability.shared_ejected(now_ms)
            || matches!(live.est.state, State::Ejected { .. });
        (ms > 0 && !out).then_some(ms)
    }
    /// Notes a request's priority: high-priority traffic reserves its share of capacity.
    pub fn note_priority(&self, priority: Priority, now_ms: u64) {
        if priority == Priority::High {
            self.high_seen.store(now_ms + 1, Ordering::Relaxed);
        }
    }
    /// The concurrency a request of `priority` may use on a variant: its whole limit for high
    /// priority; otherwise the limit less `priority_reserve` of it (at least one slot left)
    /// while high-priority requests have been seen lately, so that they find a free slot
    /// instead of waiting behind the bulk. Unlimited variants reserve nothing.
    pub fn limit_for(&self, index: usize, priority: Priority, now_ms: u64) -> u32 {
        let limit = self.variants[index].concurrency_limit();
        let seen = self.high_seen.load(Ordering::Relaxed);
        let high_lately = seen != 0 && now_ms + 1 < seen + HIGH_RESERVE_FOR_MS;
        if priority == Priority::High || limit == u32::MAX || !high_lately {
            return limit;
        }
        let reserve = (f64::from(limit) * self.cfg.priority_reserve).ceil() as u32;
        limit.saturating_sub(reserve).max(1)
    }
    /// Whether a variant has a free slot for a request of `priority` (see [`Pool::limit_for`]).
    pub fn below_limit(&self, index: usize, priority: Priority) -> bool {
        let v = &self.variants[index];
        v.in_flight.load(Ordering::Relaxed) < self.limit_for(index, priority, self.now_ms())
    }
    /// Whether an attempt could start on a variant right now, without waiting.
    pub fn can_take(&self, index: usize, now_ms: u64) -> bool {
        self.below_limit(index, Priority::Normal) && self.available(index, now_ms)
    }
    /// Requests holding the pool's slots now.
    pub fn running(&self) -> u32 {
        self.variants
            .iter()
            .map(|v| v.in_flight.load(Ordering::Relaxed))
            .sum()
    }
    /// Expected wait (ms) for a request joining the back of the wait line now, from the
    /// measured drain rate (see `capacity`); `None` before any was measured.
    pub fn expected_wait_ms(&self) -> Option<u64> {
        self.line
            .expected_wait_ms(self.line.waiting() as usize, self.running())
    }
    /// Takes a slot on a variant for a request of `priority` in one atomic step: the check
    /// against the limit and the increment are one compare-and-swap, so a burst of requests
    /// arriving together cannot exceed the limit (a separate check and increment could both see
    /// the last free slot). `None`: the variant is at the limit.
    pub fn try_enter(self: &Arc<Self>, index: usize, priority: Priority) -> Option<InFlight> {
        let limit = self.limit_for(index, priority, self.now_ms());
        self.variants[index]
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()?;
        Some(InFlight {
            pool: self.clone(),
            index,
            since: Instant::now(),
            serving: false,
        })
    }
    /// Takes a slot on a variant, waiting in the pool's line while it is at its concurrency
    /// limit: `None` when that takes longer than `queue_ms` or the deadline allows. A retry
    /// after a "full" 429 goes through here, so it waits for a slot instead of being refused
    /// again at once.
    pub async fn wait_for_slot(
        self: &Arc<Self>,
        index: usize,
        priority: Priority,
        deadline: tokio::time::Instant,
    ) -> Option<InFlight> {
        if let Some(slot) = self.try_enter(index, priority) {
            return Some(slot);
        }
        let until = (tokio::time::Instant::now()
            + std::time::Duration::from_millis(self.cfg.queue_ms))
        .min(deadline);
        let ticket = self
            .line
            .join(Some(index), priority, deadline, until, self.running())
            .ok()?;
        loop {
            if let Some(slot) = self.try_enter(index, priority) {
                return Some(slot);
            }
            if ticket.wait(until).await != Wake::LookAgain {
                return None;
            }
        }
    }
}
