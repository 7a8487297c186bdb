//! Rewrite rules: a vague format instruction ("don't use markdown", "be brief") becomes a precise
//! one, so that differently worded prompts asking for the same output read the same.
//!
//! **Where a rule applies.** Only to a whole *clause* of an *instruction sentence*
//! ([`super::prose`]): the sentence is cut into clauses at `,`, `;` and `:`, and a rule fires
//! when its pattern matches one clause from its first to its last character, case-insensitively
//! (an optional `please` before or after is allowed). Matching whole clauses is what makes rules
//! word-boundary aware and safe: "Don't use markdown tables" or "Be brief about the history"
//! match nothing, because the rule's phrase is only part of their clause.
//!
//! **What replaces it.** The replacement text, with its first letter upper-cased when the clause
//! starts the sentence and lower-cased otherwise (unless the first word is an acronym such as
//! `JSON`). The sentence keeps its own terminator and the rest of its clauses.
//!
//! **Why a second pass changes nothing.** A rule set is refused (see [`compile`]) when a
//! replacement would itself be rewritten by a rule, or contains characters that change how text
//! is cut (quotes, brackets, backticks, newlines, clause or sentence punctuation other than a
//! comma) or that `syntax` mode would change.

use regex::{RegexBuilder, RegexSet, RegexSetBuilder};

use super::prose::{clauses, sentences};
use super::{normalize_text, Fixes};

/// A rule as configured: a name (used in the fix code `rule_rewritten:<name>`), a regular
/// expression (Rust `regex` syntax) and the text that replaces a matching clause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSpec {
    pub name: String,
    pub pattern: String,
    pub replacement: String,
}

impl RuleSpec {
    pub fn new(name: &str, pattern: &str, replacement: &str) -> RuleSpec {
        RuleSpec {
            name: name.to_owned(),
            pattern: pattern.to_owned(),
            replacement: replacement.to_owned(),
        }
    }
}

/// A compiled rule.
#[derive(Debug, Clone, PartialEq)]
struct Rule {
    /// `rule_rewritten:<name>`, built once.
    code: String,
    replacement: String,
}

/// A compiled rule set: the rules in order and one [`RegexSet`] of their anchored patterns, so
/// that a clause is tested against every rule in one pass.
#[derive(Debug, Clone)]
pub(super) struct Rules {
    list: Vec<Rule>,
    set: RegexSet,
}

/// Two rule sets are equal when they hold the same rules, patterns and all, in the same order
/// (a config reload keeps a pool whose rules did not change).
impl PartialEq for Rules {
    fn eq(&self, other: &Rules) -> bool {
        self.list == other.list && self.set.patterns() == other.set.patterns()
    }
}

impl Rules {
    pub(super) fn empty() -> Rules {
        Rules {
            list: Vec::new(),
            set: RegexSet::empty(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The first rule (in configured order) matching the whole clause.
    fn find(&self, clause: &str) -> Option<&Rule> {
        self.set
            .matches(clause)
            .iter()
            .next()
            .map(|n| &self.list[n])
    }
}

/// A rule's pattern as matched: the whole clause, an optional `please` before or after.
fn anchored(pattern: &str) -> String {
    format!(r"^(?:please\s+)?(?:{pattern})(?:\s+please)?$")
}

const REGEX_SIZE_LIMIT: usize = 1 << 20;

/// The default rules: vague format instructions made precise. Each replacement is phrased so
/// that no rule matches it.
pub(super) fn default_specs() -> Vec<RuleSpec> {
    const NEG: &str = r"(?:do\s+not|don't|dont|never)";
    vec![
        RuleSpec::new(
            "no_markdown",
            &format!(
                r"{NEG}\s+use\s+(?:any\s+)?(?:markdown|md)(?:\s+formatting)?|no\s+markdown(?:\s+formatting)?"
            ),
            "Output plain text only, with no formatting characters",
        ),
        RuleSpec::new(
            "brief",
            r"be\s+(?:brief|concise|succinct)|keep\s+it\s+(?:short|brief)|keep\s+(?:your|the)\s+(?:answer|response|reply)\s+(?:short|brief)",
            "Answer in at most three sentences",
        ),
        RuleSpec::new(
            "bullets",
            r"(?:use|(?:answer|respond|reply)\s+(?:in|with))\s+(?:bullet\s+points|bullets|a\s+bulleted\s+list)",
            "Format the answer as a list, one item per line, each starting with a hyphen",
        ),
        RuleSpec::new(
            "json_only",
            r"(?:respond|reply|answer|output|return)\s+(?:only\s+)?(?:(?:in|with|as)\s+)?json(?:\s+format|\s+only)?|json\s+only",
            "Respond with a single valid JSON value and nothing else",
        ),
        RuleSpec::new(
            "no_explanation",
            &format!(
                r"{NEG}\s+explain(?:\s+(?:yourself|your\s+answer|your\s+reasoning))?|no\s+explanations?(?:\s+needed)?|without\s+(?:any\s+)?explanations?"
            ),
            "Give only the answer, with no explanation",
        ),
    ]
}

/// Compiles and checks a rule set; the error is the index of the rule at fault and a message
/// naming it.
pub(super) fn compile(specs: &[RuleSpec]) -> Result<Rules, (usize, String)> {
    let mut list = Vec::with_capacity(specs.len());
    for (n, spec) in specs.iter().enumerate() {
        let rule = compile_one(spec, &list).map_err(|e| (n, e))?;
        list.push(rule);
    }
    // Each pattern compiled alone above; together they can still exceed the size limit.
    let set = RegexSetBuilder::new(specs.iter().map(|s| anchored(&s.pattern)))
        .case_insensitive(true)
        .size_limit(REGEX_SIZE_LIMIT * specs.len().max(1))
        .build()
        .map_err(|e| (specs.len().saturating_sub(1), format!("rule set: {e}")))?;
    let rules = Rules { list, set };
    // A replacement another rule would rewrite again breaks idempotence.
    for (n, (spec, rule)) in specs.iter().zip(&rules.list).enumerate() {
        let mut probe = Fixes::default();
        if rewrite_prose(&rule.replacement, &rules, Edges::default(), &mut probe).is_some() {
            let by = probe.codes().next().unwrap_or_default();
            return Err((
                n,
                format!(
                    "rule `{}`: its replacement would be rewritten again ({by})",
                    spec.name
                ),
            ));
        }
    }
    Ok(rules)
}

fn compile_one(spec: &RuleSpec, earlier: &[Rule]) -> Result<Rule, String> {
    let name = &spec.name;
    if name.is_empty()
        || !name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
    {
        return Err(format!(
            "rule name `{name}` must be non-empty letters, digits, `_` or `-`"
        ));
    }
    if earlier
        .iter()
        .any(|r| r.code[RULE_PREFIX.len()..] == **name)
    {
        return Err(format!("rule `{name}` is defined twice"));
    }
    RegexBuilder::new(&anchored(&spec.pattern))
        .case_insensitive(true)
        .size_limit(REGEX_SIZE_LIMIT)
        .build()
        .map_err(|e| format!("rule `{name}`: bad pattern: {e}"))?;
    check_replacement(&spec.replacement).map_err(|e| format!("rule `{name}`: {e}"))?;
    Ok(Rule {
        code: format!("{RULE_PREFIX}{name}"),
        replacement: spec.replacement.clone(),
    })
}

const RULE_PREFIX: &str = "rule_rewritten:";

/// A replacement must be one plain clause: something to say, no characters that change how the
/// text is cut, already canonical for `syntax` mode.
fn check_replacement(r: &str) -> Result<(), String> {
    if !r.chars().next().is_some_and(char::is_alphanumeric) {
        return Err("replacement must start with a letter or digit".into());
    }
    if let Some(c) = r.chars().find(|c| {
        matches!(
            c,
            '"' | '`' | '{' | '}' | '[' | ']' | '\n' | '.' | '!' | '?' | ';' | ':'
        )
    }) {
        return Err(format!("replacement must not contain {c:?}"));
    }
    if normalize_text(r, &mut Fixes::default()).is_some() {
        return Err("replacement must already be normalized (ASCII quotes, single spaces, no invisible characters, NFC)".into());
    }
    Ok(())
}

/// Whether a code span touches a prose segment's start / end. A sentence on the same line as an
/// adjacent code span is not complete in the segment ("Don't use markdown `x` here"), so rules
/// skip it.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Edges {
    pub code_before: bool,
    pub code_after: bool,
}

/// Applies the rules to the instruction sentences of one prose segment; `None` when no rule
/// fired.
pub(super) fn rewrite_prose(
    prose: &str,
    rules: &Rules,
    edges: Edges,
    fixes: &mut Fixes,
) -> Option<String> {
    if rules.is_empty() {
        return None;
    }
    let first_line_end = prose.find('\n').unwrap_or(prose.len());
    let last_line_start = prose.rfind('\n').map_or(0, |n| n + 1);
    let complete = |r: &std::ops::Range<usize>| {
        let touches_code_before = edges.code_before && r.start < first_line_end;
        let touches_code_after = edges.code_after && r.end >= last_line_start;
        !touches_code_before && !touches_code_after
    };
    let mut out = String::new();
    let (mut copied, mut changed) = (0, false);
    for sentence in sentences(prose)
        .into_iter()
        .filter(|s| s.instruction && complete(&s.range))
    {
        let base = sentence.range.start;
        let text = &prose[sentence.range];
        for (i, clause) in clauses(text).into_iter().enumerate() {
            let Some(rule) = rules.find(&text[clause.clone()]) else {
                continue;
            };
            out.push_str(&prose[copied..base + clause.start]);
            push_cased(&rule.replacement, i == 0, &mut out);
            copied = base + clause.end;
            changed = true;
            fixes.add(rule.code.clone());
        }
    }
    if !changed {
        return None;
    }
    out.push_str(&prose[copied..]);
    Some(out)
}

/// Writes `r` with its first letter upper-cased (`first`: it starts the sentence) or
/// lower-cased (unless its first word is all capitals, like `JSON`).
fn push_cased(r: &str, first: bool, out: &mut String) {
    let mut chars = r.chars();
    let Some(c) = chars.next() else { return };
    let word = r.split(' ').next().unwrap_or(r);
    let acronym = word.chars().count() > 1 && !word.chars().any(char::is_lowercase);
    if first {
        out.extend(c.to_uppercase());
    } else if acronym {
        out.push(c);
    } else {
        out.extend(c.to_lowercase());
    }
    out.push_str(chars.as_str());
}
