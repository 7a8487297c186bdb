//! Precision and recall of the detectors against a labelled data set (bench/data/guard): the
//! same matching for keel and for a peer's findings, so the two can sit side by side.
//!
//! A finding is a true positive when it overlaps a labelled value of the same entity (each
//! labelled value is matched at most once); other findings of a labelled entity are false
//! positives, and unmatched labels are false negatives. Findings of entities the data set does
//! not label (operator kinds) are not counted.

use std::collections::BTreeMap;
use std::ops::Range;

use serde::Deserialize;

use super::Guard;

/// One labelled value, in character offsets of its text.
#[derive(Debug, Clone, Deserialize)]
pub struct Label {
    #[serde(rename = "type")]
    pub entity: String,
    pub start: usize,
    pub end: usize,
}

/// One text of the data set.
#[derive(Debug, Clone, Deserialize)]
pub struct Item {
    pub id: u64,
    #[serde(default)]
    pub lang: String,
    pub text: String,
    pub entities: Vec<Label>,
    /// Character offsets where a stream would cut the text into chunks.
    #[serde(default)]
    pub cuts: Vec<usize>,
}

/// Parses a JSON Lines data set; the error names the line.
pub fn parse_jsonl(s: &str) -> Result<Vec<Item>, String> {
    s.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| format!("line {}: {e}", i + 1)))
        .collect()
}

/// True and false positives and false negatives of one entity.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub tp: u32,
    pub fp: u32,
    pub fn_: u32,
}

impl Tally {
    pub fn precision(&self) -> f64 {
        ratio(self.tp, self.tp + self.fp)
    }

    pub fn recall(&self) -> f64 {
        ratio(self.tp, self.tp + self.fn_)
    }
}

fn ratio(a: u32, b: u32) -> f64 {
    if b == 0 {
        1.0
    } else {
        f64::from(a) / f64::from(b)
    }
}

/// Tallies per entity name.
pub type Report = BTreeMap<String, Tally>;

/// Scores `found` (entity name, character range) against `item`'s labels into `report`.
pub fn score(item: &Item, found: &[(String, Range<usize>)], report: &mut Report) {
    let mut used = vec![false; item.entities.len()];
    for l in &item.entities {
        report.entry(l.entity.clone()).or_default();
    }
    for (entity, r) in found {
        let hit = item.entities.iter().enumerate().position(|(i, l)| {
            !used[i] && &l.entity == entity && l.start < r.end && r.start < l.end
        });
        let labelled = report.contains_key(entity);
        match hit {
            Some(i) => {
                used[i] = true;
                report.entry(entity.clone()).or_default().tp += 1;
            }
            None if labelled || super::Entity::parse_builtin(entity).is_some() => {
                report.entry(entity.clone()).or_default().fp += 1;
            }
            None => {}
        }
    }
    for (i, l) in item.entities.iter().enumerate() {
        if !used[i] {
            report.entry(l.entity.clone()).or_default().fn_ += 1;
        }
    }
}

/// keel's findings in `text` as (entity name, character range).
pub fn keel_findings(guard: &Guard, text: &str) -> Vec<(String, Range<usize>)> {
    let char_at = |byte: usize| text[..byte].chars().count();
    guard
        .scan(text)
        .into_iter()
        .map(|f| {
            let name = guard.entity_name(f.entity).to_string();
            (name, char_at(f.range.start)..char_at(f.range.end))
        })
        .collect()
}

/// Scores keel's built-in detectors over a whole data set.
pub fn evaluate(guard: &Guard, items: &[Item]) -> Report {
    let mut report = Report::new();
    for item in items {
        score(item, &keel_findings(guard, &item.text), &mut report);
    }
    report
}
