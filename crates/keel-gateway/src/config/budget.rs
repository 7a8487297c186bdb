//! `[retry_budget]`: fleet-wide, retries ≤ ratio × requests over the window, plus a floor.

use keel_core::budget::RetryBudgetConfig;

use super::read::{Issues, Table};

/// The retry budget; keys left out keep [`RetryBudgetConfig::default`]'s values.
pub(super) fn read(t: Option<Table>, issues: &mut Issues) -> RetryBudgetConfig {
    let mut budget = RetryBudgetConfig::default();
    let Some(mut t) = t else {
        return budget;
    };
    if let Some(r) = t.get::<f64>("ratio", issues) {
        if !(0.0..=10.0).contains(&r.value) {
            issues.report(
                r.at,
                &r.path,
                format!("expected a number between 0 and 10, got {}", r.value),
            );
        }
        budget.ratio = r.value;
    }
    if let Some(w) = t.get::<u64>("window_ms", issues) {
        if w.value < 1000 {
            issues.report(
                w.at,
                &w.path,
                format!("expected at least 1000, got {}", w.value),
            );
        }
        budget.window_ms = w.value;
    }
    if let Some(m) = t.value::<u64>("min_retries_per_sec", issues) {
        budget.min_retries_per_sec = m;
    }
    t.finish(issues);
    budget
}
