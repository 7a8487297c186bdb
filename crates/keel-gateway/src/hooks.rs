//! Faults injected inside keel itself, for tests only. With the `test-hooks` feature off (every
//! build but keel-gateway's own tests) each hook is an empty inline function.
//!
//! * `relay_panic_after_events`: the relay panics when it is about to send its Nth + 1
//!   event block, which is how tests prove that a producer that disappears never ends the
//!   client's body cleanly (see `body`).

#[cfg(feature = "test-hooks")]
use std::sync::atomic::{AtomicUsize, Ordering};

/// The test hooks of one gateway.
#[derive(Debug, Default)]
pub struct TestHooks {
    /// 0: off.
    #[cfg(feature = "test-hooks")]
    pub relay_panic_after_events: AtomicUsize,
}

impl TestHooks {
    /// Called by the relay before it sends its `sent`th event block.
    #[inline]
    pub fn before_send(&self, sent: usize) {
        #[cfg(feature = "test-hooks")]
        {
            let n = self.relay_panic_after_events.load(Ordering::Relaxed);
            if n != 0 && sent > n {
                panic!("test hook: the relay panics after {n} event blocks");
            }
        }
        #[cfg(not(feature = "test-hooks"))]
        let _ = sent;
    }
}
