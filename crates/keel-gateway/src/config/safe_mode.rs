//! `[pools.safe_mode]`: the thresholds of a pool's health colour and how safe mode follows it
//! (see `keel_core::health_colour`). Every key is optional; the defaults are
//! [`Thresholds::default`]'s. Each signal has a `…_yellow` and a `…_red` threshold; for
//! `eligible_capacity` (worse when lower) red must be below yellow, for the others above.

use keel_core::health_colour::{Limits, Thresholds};

use super::read::{Issues, Table, Val};

pub(super) fn read(t: Option<Table>, issues: &mut Issues) -> Thresholds {
    let d = Thresholds::default();
    let Some(mut t) = t else {
        return d;
    };
    let window_ms = t.value::<u64>("window_ms", issues).unwrap_or(d.window_ms);
    let thresholds = Thresholds {
        // One bucket per millisecond at least (see `SignalWindow`).
        window_ms: window_ms.max(keel_core::health_colour::BUCKETS),
        min_requests: t
            .value::<u64>("min_requests", issues)
            .unwrap_or(d.min_requests),
        fallback_ratio: limits(
            &mut t,
            ("fallback_ratio_yellow", "fallback_ratio_red"),
            d.fallback_ratio,
            true,
            issues,
        ),
        migration_ratio: limits(
            &mut t,
            ("migration_ratio_yellow", "migration_ratio_red"),
            d.migration_ratio,
            true,
            issues,
        ),
        decision_ms: limits(
            &mut t,
            ("decision_ms_yellow", "decision_ms_red"),
            d.decision_ms,
            true,
            issues,
        ),
        error_rate: limits(
            &mut t,
            ("error_rate_yellow", "error_rate_red"),
            d.error_rate,
            true,
            issues,
        ),
        eligible_capacity: limits(
            &mut t,
            ("eligible_capacity_yellow", "eligible_capacity_red"),
            d.eligible_capacity,
            false,
            issues,
        ),
        auto: t.value::<bool>("auto", issues).unwrap_or(d.auto),
        exit_after_ms: t
            .value::<u64>("exit_after_ms", issues)
            .unwrap_or(d.exit_after_ms),
    };
    t.finish(issues);
    thresholds
}

/// A signal's `<name>_yellow` / `<name>_red` pair: finite, at least 0, and red beyond yellow
/// in the direction the signal worsens. A bad pair is reported at the red key.
fn limits(
    t: &mut Table,
    (yellow_key, red_key): (&'static str, &'static str),
    default: Limits,
    higher_is_worse: bool,
    issues: &mut Issues,
) -> Limits {
    let yellow: Option<Val<f64>> = t.get(yellow_key, issues);
    let red: Option<Val<f64>> = t.get(red_key, issues);
    let at = red
        .as_ref()
        .or(yellow.as_ref())
        .map(|v| v.at)
        .unwrap_or(t.at());
    let l = Limits {
        yellow: yellow.map(|v| v.value).unwrap_or(default.yellow),
        red: red.map(|v| v.value).unwrap_or(default.red),
    };
    let ordered = if higher_is_worse {
        l.red > l.yellow
    } else {
        l.red < l.yellow
    };
    if !(l.yellow.is_finite() && l.red.is_finite() && l.yellow >= 0.0 && l.red >= 0.0 && ordered) {
        let relation = if higher_is_worse { "greater" } else { "less" };
        issues.report(
            at,
            &t.field_path(red_key),
            format!(
                "must be {relation} than {yellow_key}, both at least 0 (got yellow {}, red {})",
                l.yellow, l.red
            ),
        );
    }
    l
}
