//! keel's global allocator and its two settings.
//!
//! mimalloc instead of the system allocator: a request makes many small, short-lived
//! allocations (events, headers, JSON), and glibc's malloc spent a quarter of keel's CPU on them
//! (bench/history/2026-12-01-overhead-stops-1-5.md). The `system-allocator` feature keeps glibc's, for heap profilers
//! that intercept `malloc` (heaptrack) and to compare resident memory per stream.

#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `purge_delay` option, by its place in `mi_option_e` (mimalloc.h, v3: the crate
/// exports no constant for it). The test below checks the place against the option's default.
#[cfg(not(feature = "system-allocator"))]
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Sets mimalloc to return freed pages to the OS at once instead of after its default delay
/// (one second in mimalloc v3). A gateway holding thousands of live streams frees and reuses
/// memory continuously; with the delay its resident memory stayed ≈ 11 KiB a stream higher
/// (bench/history/2026-12-01-overhead-stops-1-5.md), and CPU per request did not move measurably without it.
/// `MIMALLOC_PURGE_DELAY` in the environment still wins. Call before any other thread starts
/// (mimalloc's option setters are not thread-safe).
pub fn tune() {
    #[cfg(not(feature = "system-allocator"))]
    #[allow(unsafe_code)]
    // SAFETY: an FFI call with plain integers that writes one entry of mimalloc's option table;
    // it runs at the start of `main`, before any other thread exists.
    unsafe {
        libmimalloc_sys::mi_option_set_default(PURGE_DELAY, 0);
    }
    no_transparent_huge_pages();
}

/// Turns transparent huge pages off for the process (unless `MIMALLOC_ALLOW_THP=1` asks for
/// them). mimalloc reserves its arenas in large aligned regions and advises the kernel to back
/// them with huge pages, so memory became resident 2 MiB at a time: 14 MiB of huge pages in an
/// idle keel, and ≈ 17 KiB more a live stream (bench/history/2026-12-01-overhead-stops-6-11.md), with no measurable
/// CPU gain. mimalloc's own switch for this (`allow_thp`) is read when it starts, before
/// `main`; the kernel's per-process flag applies to every later page fault, so it is set here.
fn no_transparent_huge_pages() {
    if std::env::var("MIMALLOC_ALLOW_THP").is_ok_and(|v| v == "1") {
        return;
    }
    #[cfg(target_os = "linux")]
    #[allow(unsafe_code)]
    // SAFETY: prctl with plain integer arguments; PR_SET_THP_DISABLE only sets a flag of the
    // process's memory map (an error, e.g. on a kernel without THP, leaves things as they were).
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

#[cfg(all(test, not(feature = "system-allocator")))]
mod tests {
    use super::*;

    #[allow(unsafe_code)]
    fn purge_delay() -> std::os::raw::c_long {
        // SAFETY: reads one entry of mimalloc's option table.
        unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) }
    }

    /// `PURGE_DELAY` names the purge delay (its default is mimalloc v3's 1,000 ms), and `tune`
    /// sets it to 0 unless the environment chose a value.
    #[test]
    fn tune_sets_the_purge_delay() {
        let from_env = std::env::var("MIMALLOC_PURGE_DELAY").ok();
        let before = purge_delay();
        tune();
        match from_env {
            None => {
                assert_eq!(before, 1000, "option {PURGE_DELAY} is not purge_delay");
                assert_eq!(purge_delay(), 0);
            }
            Some(v) => assert_eq!(purge_delay().to_string(), v),
        }
    }

    /// After `tune`, the kernel gives the process no transparent huge pages.
    #[cfg(target_os = "linux")]
    #[test]
    #[allow(unsafe_code)]
    fn tune_turns_transparent_huge_pages_off() {
        if std::env::var("MIMALLOC_ALLOW_THP").is_ok_and(|v| v == "1") {
            return;
        }
        tune();
        // SAFETY: reads the process's flag.
        let disabled = unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) };
        assert_eq!(disabled, 1);
    }
}
