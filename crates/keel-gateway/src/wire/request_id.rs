//! Request ids: UUIDv7 (time-ordered, so ids sort by arrival in logs), made without a syscall or
//! a shared lock. `Uuid::now_v7` asks the OS for randomness twice per id and serialises every id
//! through one process-wide context (for a counter keel does not need); here the 74 random bits
//! come from a per-thread SplitMix64 seeded once from the OS, which keeps ids unique (a
//! collision needs two threads' seeds to meet within one millisecond's draws) but not
//! unguessable: an id is a label, never a credential.

use std::cell::Cell;
use std::time::{SystemTime, UNIX_EPOCH};

use keel_core::rng::{mix, GOLDEN_GAMMA};

thread_local! {
    static STATE: Cell<u64> = Cell::new(seed());
}

/// A seed from the OS; if it has none to give, the clock and this thread's stack address.
fn seed() -> u64 {
    let mut bytes = [0u8; 8];
    if getrandom::fill(&mut bytes).is_ok() {
        return u64::from_le_bytes(bytes);
    }
    let local = 0u8;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    mix(nanos ^ (&local as *const u8 as u64))
}

fn next() -> u64 {
    STATE.with(|s| {
        let v = s.get().wrapping_add(GOLDEN_GAMMA);
        s.set(v);
        mix(v)
    })
}

/// A new request id, as the hyphenated UUIDv7 text.
pub fn new() -> String {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut random = [0u8; 10];
    random[..8].copy_from_slice(&next().to_le_bytes());
    random[8..].copy_from_slice(&next().to_le_bytes()[..2]);
    uuid::Builder::from_unix_timestamp_millis(millis, &random)
        .into_uuid()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn ids_are_unique_version_7_and_ordered_by_time() {
        let ids: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| s.spawn(|| (0..5_000).map(|_| new()).collect::<Vec<_>>()))
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 40_000);
        for id in &ids {
            let u = uuid::Uuid::parse_str(id).unwrap();
            assert_eq!(u.get_version_num(), 7, "{id}");
            assert_eq!(u.get_variant(), uuid::Variant::RFC4122, "{id}");
        }
        // Ids made later carry a later (or the same) millisecond.
        let first = uuid::Uuid::parse_str(&new()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(3));
        let second = uuid::Uuid::parse_str(&new()).unwrap();
        let ms = |u: uuid::Uuid| u.get_timestamp().unwrap().to_unix();
        assert!(ms(second) > ms(first));
    }
}
