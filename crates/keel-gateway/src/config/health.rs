//! `[pools.health]`: live health settings of one pool. Every key is optional; the defaults are
//! [`HealthConfig::default`]'s, the scrape interval's is 1000 ms and the restart grace's
//! [`DEFAULT_RESTART_GRACE_MS`].

use keel_core::health::{Band, HealthConfig};

use super::read::{Issues, Table, Val};

/// How long a variant that refuses connections counts as restarting (warming: requests wait
/// for it while nothing else is ready) before it counts as dead (ejected, probed).
pub const DEFAULT_RESTART_GRACE_MS: u64 = 60_000;

/// The health settings, the scrape interval (ms) and the restart grace (ms).
pub(super) fn read(t: Option<Table>, issues: &mut Issues) -> (HealthConfig, u64, u64) {
    let d = HealthConfig::default();
    let Some(mut t) = t else {
        return (d, 1000, DEFAULT_RESTART_GRACE_MS);
    };
    let cfg = HealthConfig {
        decay_ms: t
            .value::<f64>("decay_ms", issues)
            .unwrap_or(d.decay_ms)
            .max(1.0),
        error_decay_ms: t
            .value::<f64>("error_decay_ms", issues)
            .unwrap_or(d.error_decay_ms)
            .max(1.0),
        baseline_decay_ms: d.baseline_decay_ms,
        ttft_ratio: band(
            &mut t,
            ("ttft_ratio_warn", "ttft_ratio_severe"),
            d.ttft_ratio,
            issues,
        ),
        tgsv_ratio: band(
            &mut t,
            ("tgsv_ratio_warn", "tgsv_ratio_severe"),
            d.tgsv_ratio,
            issues,
        ),
        error_rate: band(
            &mut t,
            ("error_rate_warn", "error_rate_severe"),
            d.error_rate,
            issues,
        ),
        break_rate: band(
            &mut t,
            ("break_rate_warn", "break_rate_severe"),
            d.break_rate,
            issues,
        ),
        kv_usage: band(
            &mut t,
            ("kv_usage_warn", "kv_usage_severe"),
            d.kv_usage,
            issues,
        ),
        waiting: band(
            &mut t,
            ("waiting_warn", "waiting_severe"),
            d.waiting,
            issues,
        ),
        eject_after_ms: t
            .value::<u64>("eject_after_ms", issues)
            .unwrap_or(d.eject_after_ms),
        probe_interval_ms: t
            .value::<u64>("probe_interval_ms", issues)
            .unwrap_or(d.probe_interval_ms)
            .max(50),
        refresh_after_ms: t
            .value::<u64>("refresh_after_ms", issues)
            .unwrap_or(d.refresh_after_ms),
        slow_start_ms: t
            .value::<u64>("slow_start_ms", issues)
            .unwrap_or(d.slow_start_ms),
        prewarm_requests: t
            .value::<u32>("prewarm_requests", issues)
            .unwrap_or(d.prewarm_requests),
    };
    let scrape_interval_ms = t
        .value::<u64>("scrape_interval_ms", issues)
        .unwrap_or(1000)
        .max(100);
    let restart_grace_ms = t
        .value::<u64>("restart_grace_ms", issues)
        .unwrap_or(DEFAULT_RESTART_GRACE_MS);
    t.finish(issues);
    (cfg, scrape_interval_ms, restart_grace_ms)
}

/// A `…_warn` / `…_severe` pair: 0 ≤ warn < severe, both finite. A bad pair is reported at
/// the severe key (where it is written, else where the warn key is, else at the table).
fn band(
    t: &mut Table,
    (warn_key, severe_key): (&'static str, &'static str),
    default: Band,
    issues: &mut Issues,
) -> Band {
    let warn: Option<Val<f64>> = t.get(warn_key, issues);
    let severe: Option<Val<f64>> = t.get(severe_key, issues);
    let at = severe
        .as_ref()
        .or(warn.as_ref())
        .map(|v| v.at)
        .unwrap_or(t.at());
    let band = Band {
        warn: warn.map(|v| v.value).unwrap_or(default.warn),
        severe: severe.map(|v| v.value).unwrap_or(default.severe),
    };
    if !(band.warn.is_finite()
        && band.severe.is_finite()
        && band.warn >= 0.0
        && band.severe > band.warn)
    {
        issues.report(
            at,
            &t.field_path(severe_key),
            format!(
                "must be greater than {warn_key}, itself at least 0 (got warn {}, severe {})",
                band.warn, band.severe
            ),
        );
    }
    band
}
