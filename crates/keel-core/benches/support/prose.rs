// English prose with tables, about 46 KB: eight chapters of keel's book. Token counting and
// prompt normalization are measured on it (benches `tokens` and `normalize`) and `tokens::bpe`'s
// tests check the rule against o200k on it (they `include!` this file).

/// The chapters, one after another.
pub const PROSE: &str = concat!(
    include_str!("../../../../docs/src/request-path.md"),
    include_str!("../../../../docs/src/failover.md"),
    include_str!("../../../../docs/src/migration.md"),
    include_str!("../../../../docs/src/selection.md"),
    include_str!("../../../../docs/src/normalization.md"),
    include_str!("../../../../docs/src/keys.md"),
    include_str!("../../../../docs/src/wire-contract.md"),
    include_str!("../../../../docs/src/security.md"),
);
