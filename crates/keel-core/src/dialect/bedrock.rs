//! See the parent module (`crate::dialect`).
