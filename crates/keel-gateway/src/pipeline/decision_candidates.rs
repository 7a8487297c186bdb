//! Which candidates a decision record lists. A record lists every candidate of a small pool; in
//! a large one (256 variants) building an entry for each, on every request, cost more than the
//! routing decision itself, so the record lists the ones that explain the choice and counts the
//! rest by state.

use crate::observe::record::{OmittedCandidates, CANDIDATES_KEPT};

use keel_core::selection::Candidate;

/// Which candidates (positions in `candidates`) a decision record lists: all of them in a pool
/// of up to [`CANDIDATES_KEPT`] variants; otherwise the plan's head (the primary and the first
/// fallbacks, which for power-of-two choices begin with the sampled pair), then the eligible
/// ones by cost, then the rest by position, up to [`CANDIDATES_KEPT`]. Returned in position
/// order so a record reads in the pool's variant order.
pub(crate) fn kept_candidates(
    candidates: &[Candidate],
    order: &[usize],
    cost_by_index: &[Option<f64>],
) -> Vec<usize> {
    if candidates.len() <= CANDIDATES_KEPT {
        return (0..candidates.len()).collect();
    }
    // Positions by variant index: the same when built from the pool; searched for otherwise.
    let position = |index: usize| match candidates.get(index) {
        Some(c) if c.index == index => Some(index),
        _ => candidates.iter().position(|c| c.index == index),
    };
    let mut kept: Vec<usize> = Vec::with_capacity(CANDIDATES_KEPT);
    let head = CANDIDATES_KEPT / 2;
    for &i in order.iter().take(head) {
        if let Some(p) = position(i) {
            kept.push(p);
        }
    }
    // The cheapest of the rest: a partial selection, not a sort of the whole pool, over one
    // 64-bit integer per candidate that orders as (eligible first, cost, position) would.
    let position_mask = keel_core::p2c::index_mask(keel_core::p2c::index_bits(candidates.len()));
    let key = |p: usize| {
        let c = &candidates[p];
        let cost = cost_by_index
            .get(c.index)
            .copied()
            .flatten()
            .unwrap_or(f64::INFINITY);
        // The cost's lowest bits give way to the position (and its highest to eligibility):
        // costs that close order by position, which only decides which of two near-equal
        // candidates a full record lists.
        ((u64::from(!c.available)) << 63)
            | ((keel_core::p2c::total_order_bits(cost) >> 1) & !position_mask)
            | p as u64
    };
    // The head's positions as bits (a search of the head for each candidate was 2,000
    // comparisons at 256 variants).
    let mut in_head = vec![0u64; candidates.len().div_ceil(64)];
    for &p in &kept {
        in_head[p / 64] |= 1 << (p % 64);
    }
    let mut rest: Vec<u64> = Vec::with_capacity(candidates.len());
    rest.extend(
        (0..candidates.len())
            .filter(|p| in_head[p / 64] & (1 << (p % 64)) == 0)
            .map(key),
    );
    let room = CANDIDATES_KEPT - kept.len();
    if rest.len() > room {
        rest.select_nth_unstable(room);
        rest.truncate(room);
    }
    let rest = rest.into_iter().map(|k| (k & position_mask) as usize);
    kept.extend(rest);
    kept.sort_unstable();
    kept
}

/// Counts of what [`kept_candidates`] left out; `None` when it kept everything.
pub(crate) fn omitted_summary(
    candidates: &[Candidate],
    kept: &[usize],
    plan_len: usize,
    state_of: impl Fn(usize) -> &'static str,
) -> Option<Box<OmittedCandidates>> {
    if kept.len() == candidates.len() && plan_len <= CANDIDATES_KEPT {
        return None;
    }
    let mut omitted = OmittedCandidates {
        plan_tail: plan_len.saturating_sub(CANDIDATES_KEPT) as u32,
        ..Default::default()
    };
    // `kept` is sorted: walk it alongside the positions. Neighbours mostly share a state, so
    // a run of one state is counted before it goes into the map (one map entry per run, not
    // per candidate: at 256 variants the map was a few µs of the decision).
    let mut next_kept = kept.iter().peekable();
    let mut run: Option<(&'static str, u32)> = None;
    for (p, c) in candidates.iter().enumerate() {
        if next_kept.peek() == Some(&&p) {
            next_kept.next();
            continue;
        }
        omitted.count += 1;
        omitted.eligible += u32::from(c.available);
        let state = state_of(c.index);
        match &mut run {
            // The names are static: the same name is mostly the same pointer.
            Some((s, n)) if std::ptr::eq(*s, state) || *s == state => *n += 1,
            _ => {
                if let Some((s, n)) = run.replace((state, 1)) {
                    *omitted.by_state.entry(s).or_default() += n;
                }
            }
        }
    }
    if let Some((s, n)) = run {
        *omitted.by_state.entry(s).or_default() += n;
    }
    Some(Box::new(omitted))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(index: usize, available: bool) -> Candidate {
        Candidate {
            index,
            weight: 1,
            available,
            health: 1.0,
            condition: 1.0,
            predicted_ttft_ms: 10.0,
            ttft_samples: f64::INFINITY,
            gap_ms: None,
            gap_trust: 1.0,
            in_flight: 0,
            tier: 1,
            price: 0.0,
            p95_ttft_ms: None,
            queued: false,
            name_hash: index as u64,
        }
    }

    #[test]
    fn a_small_pool_keeps_every_candidate() {
        let c: Vec<_> = (0..CANDIDATES_KEPT)
            .map(|i| candidate(i, i % 2 == 0))
            .collect();
        let kept = kept_candidates(&c, &[2, 0], &vec![None; c.len()]);
        assert_eq!(kept, (0..CANDIDATES_KEPT).collect::<Vec<_>>());
    }

    #[test]
    fn a_large_pool_keeps_the_plan_head_then_the_cheapest_eligible() {
        let n = 256;
        // Every third variant is ineligible; the eligible ones cost more the higher their index,
        // except that the plan puts 200 and 100 first (as power-of-two choices may).
        let c: Vec<_> = (0..n).map(|i| candidate(i, i % 3 != 0)).collect();
        let cost: Vec<Option<f64>> = (0..n).map(|i| c[i].available.then_some(i as f64)).collect();
        let mut order = vec![200, 100];
        order.extend((0..n).filter(|i| c[*i].available && *i != 200 && *i != 100));
        let kept = kept_candidates(&c, &order, &cost);
        assert_eq!(kept.len(), CANDIDATES_KEPT);
        assert!(
            kept.windows(2).all(|w| w[0] < w[1]),
            "in variant order: {kept:?}"
        );
        // The plan's head: 200, 100, then the six cheapest eligible as fallbacks (1, 2, 4, 5,
        // 7, 8); then the cheapest eligible of the rest (10, 11, 13, 14, 16, 17, 19, 20).
        let mut expected = vec![1, 2, 4, 5, 7, 8, 10, 11, 13, 14, 16, 17, 19, 20, 100, 200];
        expected.sort_unstable();
        assert_eq!(kept, expected);
    }

    #[test]
    fn the_summary_counts_what_was_left_out() {
        let c: Vec<_> = (0..20).map(|i| candidate(i, i >= 10)).collect();
        let kept: Vec<usize> = (4..20).collect();
        let state = |i: usize| if i < 2 { "ejected" } else { "healthy" };
        let s = omitted_summary(&c, &kept, 10, state).expect("four left out");
        assert_eq!((s.count, s.eligible, s.plan_tail), (4, 0, 0));
        assert_eq!(s.by_state.get("ejected"), Some(&2));
        assert_eq!(s.by_state.get("healthy"), Some(&2));
        let all: Vec<usize> = (0..20).collect();
        assert!(
            omitted_summary(&c, &all, 20, state).is_some(),
            "plan tail of 4"
        );
        let small: Vec<usize> = (0..10).collect();
        assert!(omitted_summary(&c[..10], &small, 10, state).is_none());
    }

    #[test]
    fn ineligible_candidates_fill_the_room_only_when_few_are_eligible() {
        let n = 40;
        let c: Vec<_> = (0..n).map(|i| candidate(i, i < 3)).collect();
        let cost: Vec<Option<f64>> = (0..n).map(|i| (i < 3).then_some(1.0)).collect();
        let kept = kept_candidates(&c, &[1, 0, 2], &cost);
        assert_eq!(kept, (0..CANDIDATES_KEPT).collect::<Vec<_>>());
    }
}
