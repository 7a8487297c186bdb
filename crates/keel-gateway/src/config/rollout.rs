//! `[pools.shadow]` and `[pools.canary]`: changing a pool's models safely.
//!
//! ```toml
//! [pools.shadow]
//! sample = 0.1            # share of completed requests copied to the shadow variants
//! max_in_flight = 4       # shadow requests running at once (more are skipped)
//! max_per_minute = 60     # shadow requests per minute (more are skipped)
//! [[pools.shadow.variants]]   # defined like any variant; never serves a client
//! name = "next"
//! url = "http://10.0.0.9:8000/v1"
//! protocol = "openai"
//! upstream_model = "next-model"
//!
//! [pools.canary]
//! candidates = ["next"]   # the pool's variants on the candidate side; the others are stable
//! identity = "user"       # key | tenant | user | "header:<name>"
//! steps = [1, 5, 20, 100] # candidate weight in percent, step by step
//! dwell_ms = 300000       # least time at a step
//! min_requests = 50       # candidate attempts a step needs before it is judged
//! max_error_rate = 0.05
//! max_ttft_p99_ms = 2000  # optional
//! min_agreement = 0.8     # optional: mean shadow similarity over the step
//! ```

use keel_core::canary::CanaryConfig;

use super::pool::Inherited;
use super::read::{Issues, Kind, Table};
use super::variant::{self, VariantConfig};

/// `[pools.shadow]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ShadowConfig {
    /// Share of completed requests sent to every shadow variant too.
    pub sample: f64,
    pub max_in_flight: u32,
    pub max_per_minute: u32,
    pub variants: Vec<VariantConfig>,
}

/// What puts a request on one side of a canary split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// The virtual key's id.
    Key,
    /// The virtual key's tenant.
    Tenant,
    /// The OpenAI `user` field, or Anthropic `metadata.user_id`.
    User,
    /// A request header (lowercase name).
    Header(String),
}

/// `[pools.canary]`.
#[derive(Debug, Clone, PartialEq)]
pub struct CanaryPoolConfig {
    /// Indexes of the candidate variants in the pool's `variants`.
    pub candidates: Vec<usize>,
    pub identity: Identity,
    pub rule: CanaryConfig,
}

pub(super) fn read_shadow(
    t: Option<Table>,
    up: &Inherited,
    warnings: &mut Vec<String>,
    issues: &mut Issues,
) -> Option<ShadowConfig> {
    let mut t = t?;
    let sample = match t.get::<f64>("sample", issues) {
        Some(v) if !(0.0..=1.0).contains(&v.value) => {
            issues.report(v.at, &v.path, "expected a share between 0 and 1");
            0.0
        }
        Some(v) => v.value,
        None => 0.1,
    };
    let max_in_flight = t.value::<u32>("max_in_flight", issues).unwrap_or(4);
    let max_per_minute = t.value::<u32>("max_per_minute", issues).unwrap_or(60);
    let tables = t.tables("variants", issues);
    if tables.is_empty() {
        issues.report(
            t.at(),
            &t.field_path("variants"),
            "at least one [[pools.shadow.variants]] table is required",
        );
    }
    let mut taken = Vec::new();
    let variants = tables
        .into_iter()
        .filter_map(|vt| variant::read(vt, &mut taken, up.env, warnings, issues))
        .map(|v| v.cfg)
        .collect();
    t.finish(issues);
    Some(ShadowConfig {
        sample,
        max_in_flight,
        max_per_minute,
        variants,
    })
}

pub(super) fn read_canary(
    t: Option<Table>,
    variants: &[VariantConfig],
    issues: &mut Issues,
) -> Option<CanaryPoolConfig> {
    let mut t = t?;
    let mut candidates = Vec::new();
    let names = t.strings("candidates", issues);
    let named = !names.is_empty();
    for name in names {
        match variants.iter().position(|v| v.name == name.value) {
            Some(i) if !candidates.contains(&i) => candidates.push(i),
            Some(_) => issues.report(name.at, &name.path, "listed twice"),
            None => issues.report(
                name.at,
                &name.path,
                format!("`{}` is not a variant of this pool", name.value),
            ),
        }
    }
    if !named {
        issues.report(
            t.at(),
            &t.field_path("candidates"),
            "expected the names of one or more of the pool's variants",
        );
    } else if candidates.len() >= variants.len() {
        issues.report(
            t.at(),
            &t.field_path("candidates"),
            "every variant is a candidate; at least one must stay stable",
        );
    }
    let identity = read_identity(&mut t, issues);
    let steps = read_steps(&mut t, issues);
    let rule = CanaryConfig {
        steps,
        dwell_ms: t.value::<u64>("dwell_ms", issues).unwrap_or(300_000),
        min_requests: t.value::<u64>("min_requests", issues).unwrap_or(50).max(1),
        max_error_rate: share(&mut t, "max_error_rate", issues).unwrap_or(0.05),
        max_ttft_p99_ms: t.value::<f64>("max_ttft_p99_ms", issues),
        min_agreement: share(&mut t, "min_agreement", issues),
    };
    t.finish(issues);
    Some(CanaryPoolConfig {
        candidates,
        identity,
        rule,
    })
}

/// An optional share between 0 and 1 (one out of range is reported).
fn share(t: &mut Table, key: &'static str, issues: &mut Issues) -> Option<f64> {
    match t.get::<f64>(key, issues) {
        Some(v) if !(0.0..=1.0).contains(&v.value) => {
            issues.report(v.at, &v.path, "expected a share between 0 and 1");
            None
        }
        v => v.map(|v| v.value),
    }
}

fn read_identity(t: &mut Table, issues: &mut Issues) -> Identity {
    let Some(v) = t.get::<String>("identity", issues) else {
        return Identity::User;
    };
    match v.value.as_str() {
        "key" => Identity::Key,
        "tenant" => Identity::Tenant,
        "user" => Identity::User,
        s => {
            match s.strip_prefix("header:").map(str::trim) {
                Some(h) if http::HeaderName::from_bytes(h.as_bytes()).is_ok() => {
                    Identity::Header(h.to_ascii_lowercase())
                }
                _ => {
                    issues.report(
                    v.at,
                    &v.path,
                    format!("expected \"key\", \"tenant\", \"user\" or \"header:<name>\", got `{s}`"),
                );
                    Identity::User
                }
            }
        }
    }
}

/// `steps`: ascending percentages in (0, 100], the last one 100.
fn read_steps(t: &mut Table, issues: &mut Issues) -> Vec<f64> {
    let default = vec![1.0, 5.0, 20.0, 100.0];
    let Some(raw) = t.raw("steps") else {
        return default;
    };
    let path = t.field_path("steps");
    let steps: Option<Vec<f64>> = raw
        .get_ref()
        .as_array()
        .and_then(|a| a.iter().map(|x| f64::from_toml(x.get_ref())).collect());
    let valid = |s: &Vec<f64>| {
        !s.is_empty()
            && s.iter().all(|p| *p > 0.0 && *p <= 100.0)
            && s.windows(2).all(|w| w[0] < w[1])
            && s.last() == Some(&100.0)
    };
    match steps {
        Some(s) if valid(&s) => s,
        _ => {
            let got = issues.got(raw);
            issues.report(
                raw.span().start,
                &path,
                format!("expected ascending percentages in (0, 100] ending with 100, such as [1, 5, 20, 100]; got {got}"),
            );
            default
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::super::Config;
    use super::Identity;

    const POOL: &str = "[[pools]]\nname = \"p\"\n[[pools.variants]]\nname = \"a\"\nurl = \"http://127.0.0.1:1/v1\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n[[pools.variants]]\nname = \"b\"\nurl = \"http://127.0.0.1:2/v1\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n";

    fn messages(extra: &str) -> Vec<String> {
        let text = format!("{POOL}{extra}");
        match Config::parse(&text, "k.toml", &HashMap::new()) {
            Ok(_) => Vec::new(),
            Err(e) => e.issues.iter().map(|i| i.to_string()).collect(),
        }
    }

    #[test]
    fn shadow_and_canary_are_read_with_defaults() {
        let text = format!(
            "{POOL}[pools.shadow]\nsample = 0.5\n[[pools.shadow.variants]]\nname = \"s\"\nurl = \"http://127.0.0.1:3/v1\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n[pools.canary]\ncandidates = [\"b\"]\nidentity = \"header:X-User\"\n"
        );
        let c = Config::parse(&text, "k.toml", &HashMap::new()).unwrap();
        let p = &c.pools[0];
        let s = p.shadow.as_ref().unwrap();
        assert_eq!((s.sample, s.max_in_flight, s.max_per_minute), (0.5, 4, 60));
        assert_eq!(s.variants[0].name, "s");
        let k = p.canary.as_ref().unwrap();
        assert_eq!(k.candidates, vec![1]);
        assert_eq!(k.identity, Identity::Header("x-user".into()));
        assert_eq!(k.rule.steps, vec![1.0, 5.0, 20.0, 100.0]);
        assert_eq!((k.rule.dwell_ms, k.rule.min_requests), (300_000, 50));
        assert_eq!(k.rule.max_error_rate, 0.05);
        assert_eq!((k.rule.max_ttft_p99_ms, k.rule.min_agreement), (None, None));
    }

    #[test]
    fn bad_rollout_settings_are_named() {
        let m = messages("[pools.canary]\ncandidates = [\"a\", \"b\"]\n");
        assert!(
            m[0].contains("pools[0].canary.candidates: every variant is a candidate"),
            "{m:?}"
        );
        let m = messages("[pools.canary]\ncandidates = [\"zz\"]\n");
        assert!(m[0].contains("`zz` is not a variant of this pool"), "{m:?}");
        let m = messages("[pools.canary]\ncandidates = [\"b\"]\nsteps = [5, 1, 100]\n");
        assert!(
            m[0].contains("pools[0].canary.steps: expected ascending percentages"),
            "{m:?}"
        );
        let m = messages("[pools.canary]\ncandidates = [\"b\"]\nsteps = [5, 50]\n");
        assert!(m[0].contains("ending with 100"), "{m:?}");
        let m = messages("[pools.canary]\ncandidates = [\"b\"]\nidentity = \"cookie\"\n");
        assert!(m[0].contains("\"header:<name>\", got `cookie`"), "{m:?}");
        let m = messages("[pools.canary]\ncandidates = [\"b\"]\nmax_error_rate = 2\n");
        assert!(
            m[0].contains("canary.max_error_rate: expected a share"),
            "{m:?}"
        );
        let m = messages("[pools.canary]\ncandidates = [\"b\"]\ndwel_ms = 5\n");
        assert!(
            m[0].contains("dwel_ms") && m[0].contains("dwell_ms"),
            "{m:?}"
        );
        let m = messages("[pools.shadow]\nsample = 0.1\n");
        assert!(
            m[0].contains("at least one [[pools.shadow.variants]]"),
            "{m:?}"
        );
        let m = messages("[pools.shadow]\nsample = 1.5\n[[pools.shadow.variants]]\nname = \"s\"\nurl = \"http://x:1\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n");
        assert!(
            m[0].contains("pools[0].shadow.sample: expected a share"),
            "{m:?}"
        );
    }
}
