//! What to do with each kind of finding, per direction: `detect` (report only), `mask`
//! (reversible placeholders), `redact` (irreversible) or `block` (refuse the request).

use std::fmt;

use super::{Entity, Guard};

/// The action a policy takes on a finding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Action {
    Detect,
    Mask,
    Redact,
    Block,
}

impl Action {
    pub const ALL: [Action; 4] = [Action::Detect, Action::Mask, Action::Redact, Action::Block];

    pub fn parse(s: &str) -> Option<Action> {
        Action::ALL.into_iter().find(|a| a.name() == s)
    }

    pub fn name(self) -> &'static str {
        match self {
            Action::Detect => "detect",
            Action::Mask => "mask",
            Action::Redact => "redact",
            Action::Block => "block",
        }
    }

    /// The past tense the `x-keel-guard` header and the decision record use.
    pub fn done(self) -> &'static str {
        match self {
            Action::Detect => "detected",
            Action::Mask => "masked",
            Action::Redact => "redacted",
            Action::Block => "blocked",
        }
    }
}

/// Why a policy map was refused; names the offending key or value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyError {
    UnknownEntity(String),
    UnknownAction { entity: String, action: String },
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyError::UnknownEntity(e) => write!(
                f,
                "unknown entity {e:?} (expected default, a built-in entity or a guard pattern's name)"
            ),
            PolicyError::UnknownAction { entity, action } => write!(
                f,
                "{entity} = {action:?}: unknown action (expected detect, mask, redact or block)"
            ),
        }
    }
}

impl std::error::Error for PolicyError {}

/// One direction's policy: an action per entity, with `default` for the rest. An empty policy
/// does nothing (no detection runs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Policy {
    default: Option<Action>,
    by_entity: Vec<(Entity, Action)>,
}

impl Policy {
    /// Parses `entity-or-default -> action` pairs against `guard`'s entity names.
    pub fn parse<'a>(
        guard: &Guard,
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Policy, PolicyError> {
        let mut p = Policy::default();
        for (entity, action) in pairs {
            let a = Action::parse(action).ok_or_else(|| PolicyError::UnknownAction {
                entity: entity.to_string(),
                action: action.to_string(),
            })?;
            if entity == "default" {
                p.default = Some(a);
            } else {
                let e = guard
                    .parse_entity(entity)
                    .ok_or_else(|| PolicyError::UnknownEntity(entity.to_string()))?;
                p.set(e, a);
            }
        }
        Ok(p)
    }

    fn set(&mut self, e: Entity, a: Action) {
        match self.by_entity.iter_mut().find(|(x, _)| *x == e) {
            Some(slot) => slot.1 = a,
            None => self.by_entity.push((e, a)),
        }
    }

    /// The action for `e`, or `None` when this policy ignores it.
    pub fn action(&self, e: Entity) -> Option<Action> {
        self.by_entity
            .iter()
            .find(|(x, _)| *x == e)
            .map(|(_, a)| *a)
            .or(self.default)
    }

    /// Whether an entry names an operator pattern.
    pub fn names_custom(&self) -> bool {
        self.by_entity
            .iter()
            .any(|(e, _)| matches!(e, Entity::Custom(_)))
    }

    pub fn is_empty(&self) -> bool {
        self.default.is_none() && self.by_entity.is_empty()
    }

    /// This policy with `over`'s entries taking precedence (a key's policy over its pool's).
    pub fn overlaid(&self, over: &Policy) -> Policy {
        let mut p = self.clone();
        if over.default.is_some() {
            p.default = over.default;
        }
        for &(e, a) in &over.by_entity {
            p.set(e, a);
        }
        p
    }
}
