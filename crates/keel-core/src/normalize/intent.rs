//! Intent completion: a prompt that asks for an extraction, a list, a summary, a label or a
//! translation but says nothing about the shape of the answer gets one output constraint
//! appended (fix code `intent_constraint_added:<intent>`).
//!
//! **Which prompts.** Chat Completions and Messages bodies whose last message is the user's, at
//! least [`MIN_PROMPT_TOKENS`] tokens long (keel's token rule, [`crate::tokens`], over the system,
//! developer and user texts).
//!
//! **The classifier** (rules + lexicon, deterministic). The last user message's prose (outside
//! code) is cut into sentences ([`super::prose`]). A sentence's *leading verb* is its first word
//! after any of the fillers `please`, `kindly`, `now`, `then`, `also`, `and`, `can you`,
//! `could you`, `would you`, `will you`, lower-cased. The lexicon maps leading verbs to intents:
//!
//! | intent | leading verbs |
//! |---|---|
//! | `extract_json` | extract |
//! | `list` | list, enumerate |
//! | `summarize` | summarize, summarise, condense, tldr; `sum up`; `give`/`write` + `a summary` |
//! | `classify` | classify, categorize, categorise, label |
//! | `translate` | translate |
//!
//! The prompt's intent is the one intent found when exactly one is (two different ones, as in
//! "Translate it. Then summarize it.", is no intent: nothing is appended).
//!
//! **"Has a constraint".** Nothing is appended when the prompt (system, developer and user
//! texts) already says something about the output's shape: one of the words `json`, `yaml`,
//! `xml`, `csv`, `markdown`, `table`, `bullet(s)`, `bulleted`, `numbered`, `format(ted/ting)`,
//! `only`, `brief(ly)`, `concise(ly)`, `short`, `sentence(s)`, `paragraph(s)`, `word(s)`,
//! `line(s)`, `characters`, `explanation(s)`; or one of the configured constraints appears in it
//! verbatim (so a second pass never appends twice).
//!
//! **Where it goes.** After the last text of the last user message, as its own paragraph
//! (`\n\n` + the constraint), unless that text is JSON as a whole or the constraint would land
//! inside an unterminated code fence.

use serde_json::{Map, Value};

use super::prose::sentences;
use super::text::{is_json, split_code, Segment};
use super::{is_prompt_role, messages, texts_mut, Edits, Fixes, FullConfig};
use crate::members::Members;
use crate::protocol::Endpoint;

/// Prompts shorter than this are left as they are: too little to classify reliably.
pub const MIN_PROMPT_TOKENS: usize = 20;

/// What a prompt asks for, as far as the output's shape goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Intent {
    ExtractJson,
    List,
    Summarize,
    Classify,
    Translate,
}

impl Intent {
    pub const ALL: [Intent; 5] = [
        Intent::ExtractJson,
        Intent::List,
        Intent::Summarize,
        Intent::Classify,
        Intent::Translate,
    ];

    /// The config and fix-code spelling.
    pub fn name(self) -> &'static str {
        match self {
            Intent::ExtractJson => "extract_json",
            Intent::List => "list",
            Intent::Summarize => "summarize",
            Intent::Classify => "classify",
            Intent::Translate => "translate",
        }
    }

    pub fn parse(s: &str) -> Option<Intent> {
        Intent::ALL.into_iter().find(|i| i.name() == s)
    }

    /// The constraint appended when nothing else is configured.
    pub fn default_constraint(self) -> &'static str {
        match self {
            Intent::ExtractJson => {
                "Respond with a single valid JSON object holding the extracted fields and nothing else."
            }
            Intent::List => "Format the answer as a list, one item per line, each starting with a hyphen.",
            Intent::Summarize => "Answer with the summary only, in at most five sentences.",
            Intent::Classify => "Answer with the label only.",
            Intent::Translate => "Output only the translation, with no notes or explanations.",
        }
    }

    fn code(self) -> &'static str {
        match self {
            Intent::ExtractJson => "intent_constraint_added:extract_json",
            Intent::List => "intent_constraint_added:list",
            Intent::Summarize => "intent_constraint_added:summarize",
            Intent::Classify => "intent_constraint_added:classify",
            Intent::Translate => "intent_constraint_added:translate",
        }
    }
}

/// Appends the intent's constraint to the last user text when the prompt qualifies.
pub(super) fn complete(
    endpoint: Endpoint,
    body: &mut Map<String, Value>,
    cfg: &FullConfig,
    fixes: &mut Fixes,
    edits: &mut Edits,
) {
    if !matches!(
        endpoint,
        Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::CountTokens
    ) {
        return;
    }
    let (mut tokens, mut constrained) = (0, false);
    for_each_prompt_text(endpoint, body, |text| {
        tokens += crate::tokens::count(text);
        constrained = constrained || has_constraint(text, cfg);
    });
    if tokens < MIN_PROMPT_TOKENS || constrained {
        return;
    }
    let Some((index, last)) = messages(body).enumerate().last() else {
        return;
    };
    if last.member("role").and_then(Value::as_str) != Some("user") {
        return;
    }
    let Some(content) = last.member_mut("content") else {
        return;
    };
    let mut texts = texts_mut(content);
    let Some(intent) = classify(texts.iter().map(|s| s.as_str())) else {
        return;
    };
    let Some(constraint) = cfg.constraint(intent) else {
        return;
    };
    let Some(target) = texts.pop() else { return };
    if is_json(target) {
        return;
    }
    let appended = if target.is_empty() {
        constraint.to_owned()
    } else {
        format!("{target}\n\n{constraint}")
    };
    // The constraint must be prose: not swallowed by an unterminated fence.
    let lands_in_prose =
        matches!(split_code(&appended).last(), Some(Segment::Prose(p)) if p.ends_with(constraint));
    if lands_in_prose {
        edits.record(|| format!("messages[{index}]"), target, &appended);
        *target = appended;
        fixes.add(intent.code());
    }
}

/// Calls `f` with each system, developer and user text of a body.
fn for_each_prompt_text(
    endpoint: Endpoint,
    body: &mut Map<String, Value>,
    mut f: impl FnMut(&str),
) {
    if endpoint != Endpoint::ChatCompletions {
        if let Some(system) = body.member_mut("system") {
            texts_mut(system).into_iter().for_each(|s| f(s));
        }
    }
    for msg in messages(body) {
        if is_prompt_role(msg.member("role").and_then(Value::as_str)) {
            if let Some(content) = msg.member_mut("content") {
                texts_mut(content).into_iter().for_each(|s| f(s));
            }
        }
    }
}

/// Words that say something about the output's shape (see the module doc).
const CONSTRAINT_WORDS: &[&str] = &[
    "json",
    "yaml",
    "xml",
    "csv",
    "markdown",
    "table",
    "bullet",
    "bullets",
    "bulleted",
    "numbered",
    "format",
    "formatted",
    "formatting",
    "only",
    "brief",
    "briefly",
    "concise",
    "concisely",
    "short",
    "sentence",
    "sentences",
    "paragraph",
    "paragraphs",
    "word",
    "words",
    "line",
    "lines",
    "characters",
    "explanation",
    "explanations",
];

fn has_constraint(text: &str, cfg: &FullConfig) -> bool {
    words(text).any(|w| CONSTRAINT_WORDS.iter().any(|c| c.eq_ignore_ascii_case(w)))
        || cfg.constraints().any(|c| text.contains(c))
}

/// Runs of letters and digits.
fn words(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
}

/// The one intent of a user message's texts, if exactly one is found.
pub(super) fn classify<'a>(texts: impl Iterator<Item = &'a str>) -> Option<Intent> {
    let mut found = None;
    for text in texts {
        if is_json(text) {
            continue;
        }
        for seg in split_code(text) {
            let Segment::Prose(prose) = seg else { continue };
            for s in sentences(prose) {
                let Some(intent) = sentence_intent(&prose[s.range]) else {
                    continue;
                };
                match found {
                    None => found = Some(intent),
                    Some(f) if f != intent => return None,
                    Some(_) => {}
                }
            }
        }
    }
    found
}

const FILLERS: &[&[&str]] = &[
    &["please"],
    &["kindly"],
    &["now"],
    &["then"],
    &["also"],
    &["and"],
    &["can", "you"],
    &["could", "you"],
    &["would", "you"],
    &["will", "you"],
];

/// The intent of one sentence's leading verb (see the module doc's lexicon).
fn sentence_intent(sentence: &str) -> Option<Intent> {
    let all: Vec<String> = words(sentence).take(8).map(str::to_lowercase).collect();
    let mut w: &[String] = &all;
    'strip: loop {
        for filler in FILLERS {
            if w.len() > filler.len() && w.iter().zip(filler.iter()).all(|(a, b)| a == b) {
                w = &w[filler.len()..];
                continue 'strip;
            }
        }
        break;
    }
    let verb = w.first()?.as_str();
    let next = w.get(1).map(String::as_str);
    let then = w.get(2).map(String::as_str);
    Some(match (verb, next, then) {
        ("extract", ..) => Intent::ExtractJson,
        ("list" | "enumerate", ..) => Intent::List,
        ("summarize" | "summarise" | "condense" | "tldr", ..)
        | ("sum", Some("up"), _)
        | ("give" | "write", Some("a"), Some("summary")) => Intent::Summarize,
        ("classify" | "categorize" | "categorise" | "label", ..) => Intent::Classify,
        ("translate", ..) => Intent::Translate,
        _ => return None,
    })
}
