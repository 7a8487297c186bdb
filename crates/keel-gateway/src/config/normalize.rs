//! A pool's `full` normalization settings: `[[pools.normalize_rules]]` (replacing the built-in
//! rewrite rules when present) and `[pools.normalize_constraints]` (each intent's output
//! constraint; an empty string turns the intent off). Both are checked here, at load, by
//! building the [`FullConfig`] they describe: a bad pattern or replacement is a config error at
//! the rule that has it.
//!
//! Also `client_normalize` (on a pool and on a key): the modes a client may choose with
//! `x-keel-normalize`. `full` costs far more CPU than `syntax` (JSON-example repair parses
//! candidates, up to a budget per request), so a client may ask for it only where the operator
//! lists it; by default a client may choose `off` or `syntax`.

use std::sync::Arc;

use keel_core::normalize::{ErrorAt, FullConfig, Intent, Mode, RuleSpec};

use super::read::{did_you_mean, one_of, Issues, Table, Val};

/// The modes a client may choose with `x-keel-normalize` where neither its key nor its pool
/// says: the cheap, linear ones.
pub const DEFAULT_CLIENT_MODES: [Mode; 2] = [Mode::Off, Mode::Syntax];

/// `client_normalize = ["off", "syntax", "full"]`: the modes a client may choose with
/// `x-keel-normalize`; `None` when not written (an empty list is written: no header accepted).
pub(super) fn read_client_modes(t: &mut Table, issues: &mut Issues) -> Option<Vec<Mode>> {
    const KEY: &str = "client_normalize";
    t.raw(KEY)?;
    let names = || super::pool::NORMALIZE_MODES.iter().map(|(n, _)| *n);
    let mut modes = Vec::new();
    for v in t.strings(KEY, issues) {
        match super::pool::NORMALIZE_MODES
            .iter()
            .find(|(n, _)| *n == v.value)
        {
            Some((_, m)) if !modes.contains(m) => modes.push(*m),
            Some(_) => {}
            None => {
                let hint = did_you_mean(&v.value, names())
                    .map(|m| format!("; did you mean `{m}`?"))
                    .unwrap_or_default();
                issues.report(
                    v.at,
                    &v.path,
                    format!("expected {}, got `{}`{hint}", one_of(names()), v.value),
                );
            }
        }
    }
    Some(modes)
}

/// Reads the two keys from a pool table; the built-in config when neither is written (or when
/// they have errors, which are in `issues`).
pub(super) fn read(t: &mut Table, issues: &mut Issues) -> Arc<FullConfig> {
    let rules_at = t.raw("normalize_rules").map(|v| v.span().start);
    let mut rule_positions = Vec::new();
    let mut specs = Vec::new();
    for mut rt in t.tables("normalize_rules", issues) {
        let name = rt.required::<String>("name", "the rule's name (a string)", issues);
        let pattern = rt.required::<String>("pattern", "a regular expression (a string)", issues);
        let replacement = rt.required::<String>("replacement", "the replacing text", issues);
        rule_positions.push(rt.at());
        let path = rt.path().to_owned();
        rt.finish(issues);
        if let (Some(n), Some(p), Some(r)) = (name, pattern, replacement) {
            specs.push((
                path,
                RuleSpec {
                    name: n.value,
                    pattern: p.value,
                    replacement: r.value,
                },
            ));
        }
    }
    let constraints = read_constraints(t, issues);
    let written = rules_at.is_some() || !constraints.is_empty();
    let wanted = rule_positions.len();
    if !written || specs.len() != wanted {
        return Arc::new(FullConfig::default());
    }
    let rules: Vec<RuleSpec> = specs.iter().map(|(_, s)| s.clone()).collect();
    let values: Vec<(Intent, String)> = constraints
        .iter()
        .map(|(i, v)| (*i, v.value.clone()))
        .collect();
    match FullConfig::new(rules_at.map(|_| rules.as_slice()), &values) {
        Ok(cfg) => Arc::new(cfg),
        Err(e) => {
            let (at, path) = match e.at {
                ErrorAt::Rule(n) => (rule_positions[n], specs[n].0.clone()),
                ErrorAt::Constraint(intent) => constraints
                    .iter()
                    .find(|(i, _)| *i == intent)
                    .map(|(_, v)| (v.at, v.path.clone()))
                    .unwrap_or_else(|| (t.at(), t.field_path("normalize_constraints"))),
            };
            issues.report(at, &path, e.message);
            Arc::new(FullConfig::default())
        }
    }
}

/// `[pools.normalize_constraints]`: intent name = constraint text.
fn read_constraints(t: &mut Table, issues: &mut Issues) -> Vec<(Intent, Val<String>)> {
    let Some(mut ct) = t.table("normalize_constraints", issues) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for intent in Intent::ALL {
        if let Some(v) = ct.get::<String>(intent.name(), issues) {
            out.push((intent, v));
        }
    }
    // Unknown keys (not an intent) are reported with a suggestion among the intents.
    ct.finish(issues);
    out
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use keel_core::normalize::{normalize_request, Mode};
    use keel_core::protocol::Endpoint;
    use serde_json::json;

    use super::super::Config;

    const HEAD: &str = "[[pools]]\nname = \"m\"\nnormalize = \"full\"\n";
    const VARIANT: &str = "[[pools.variants]]\nname = \"a\"\nurl = \"http://x\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n";

    /// A pool in `full` mode, then `extra` (tables written there belong to the pool).
    fn pool(extra: &str) -> String {
        format!("{HEAD}{VARIANT}{extra}")
    }

    /// `text` as the one user message through the pool's `full` config.
    fn rewrite(config: &Config, text: &str) -> String {
        let mut body = json!({"messages": [{"role": "user", "content": text}]});
        let cfg = &config.pools[0].normalize_full;
        normalize_request(
            Endpoint::ChatCompletions,
            body.as_object_mut().unwrap(),
            Mode::Full,
            cfg,
        );
        body["messages"][0]["content"].as_str().unwrap().to_owned()
    }

    /// (line, field, message) of each issue.
    fn issues(extra: &str) -> Vec<(usize, String, String)> {
        let e = Config::parse(&pool(extra), "k.toml", &HashMap::new())
            .expect_err("the config should be rejected");
        e.issues
            .into_iter()
            .map(|i| (i.at.map_or(0, |a| a.line), i.field, i.message))
            .collect()
    }

    #[test]
    fn client_normalize_on_pools_and_keys() {
        let plain = Config::parse(&pool(""), "k.toml", &HashMap::new()).unwrap();
        assert_eq!(plain.pools[0].client_normalize, super::DEFAULT_CLIENT_MODES);
        let keyed = format!(
            "{HEAD}client_normalize = [\"syntax\", \"full\"]\n{VARIANT}[[keys]]\nid = \"k\"\nhash = \"sha256:{}\"\nclient_normalize = []\n",
            "ab".repeat(32)
        );
        let c = Config::parse(&keyed, "k.toml", &HashMap::new()).unwrap();
        assert_eq!(c.pools[0].client_normalize, [Mode::Syntax, Mode::Full]);
        assert_eq!(c.keys[0].client_normalize.as_deref(), Some(&[][..]));
        let e = Config::parse(
            &format!("{HEAD}client_normalize = [\"ful\"]\n{VARIANT}"),
            "k.toml",
            &HashMap::new(),
        )
        .unwrap_err();
        let got: Vec<(String, String)> =
            e.issues.into_iter().map(|i| (i.field, i.message)).collect();
        assert_eq!(got[0].0, "pools[0].client_normalize[0]");
        assert!(got[0].1.contains("did you mean `full`"), "{}", got[0].1);
    }

    #[test]
    fn defaults_configured_rules_and_constraints() {
        let plain = Config::parse(&pool(""), "k.toml", &HashMap::new()).unwrap();
        assert_eq!(
            rewrite(&plain, "Be brief."),
            "Answer in at most three sentences."
        );

        let extra = "[[pools.normalize_rules]]\nname = \"friendly\"\npattern = 'be\\s+nice'\nreplacement = \"Use a warm tone\"\n[pools.normalize_constraints]\nsummarize = \"Answer in one paragraph.\"\n";
        let c = Config::parse(&pool(extra), "k.toml", &HashMap::new()).unwrap();
        assert_eq!(
            rewrite(&c, "Be nice. Be brief."),
            "Use a warm tone. Be brief."
        );
        let notes = "Summarize the following meeting notes for the team lead who missed the meeting yesterday: we agreed to ship the release on Friday after the last review.";
        assert!(rewrite(&c, notes).ends_with("\n\nAnswer in one paragraph."));

        let none = format!("{HEAD}normalize_rules = []\n{VARIANT}");
        let none = Config::parse(&none, "k.toml", &HashMap::new()).unwrap();
        assert_eq!(rewrite(&none, "Be brief."), "Be brief.");
    }

    #[test]
    fn bad_rules_and_constraints_are_config_errors_at_their_place() {
        let bad = "[[pools.normalize_rules]]\nname = \"broken\"\npattern = \"be (brief\"\nreplacement = \"Short\"\n";
        let got = issues(bad);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].0, 9);
        assert_eq!(got[0].1, "pools[0].normalize_rules[0]");
        assert!(
            got[0].2.starts_with("rule `broken`: bad pattern"),
            "{got:?}"
        );

        let missing = "[[pools.normalize_rules]]\nname = \"x\"\npattern = \"x\"\n";
        let got = issues(missing);
        assert_eq!(got[0].1, "pools[0].normalize_rules[0].replacement");

        let constraint = "[pools.normalize_constraints]\nlist = \"Use `-`.\"\nsumarize = \"x\"\n";
        let got = issues(constraint);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].1, "pools[0].normalize_constraints.list");
        assert_eq!(got[0].2, "constraint for `list`: must not contain '`'");
        assert_eq!(got[1].1, "pools[0].normalize_constraints.sumarize");
        assert!(got[1].2.contains("did you mean `summarize`"), "{got:?}");
    }
}
