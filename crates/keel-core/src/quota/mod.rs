//! Quotas: who may send what. Rate limits per key ([`gcra`]: requests and tokens per minute,
//! reserved at admission and reconciled with real usage) and budgets per key ([`budget`]:
//! tokens or spend per day or month, reserved before sending so concurrent requests cannot
//! overspend). Pure arithmetic on plain numbers with time passed in, so the same rules run in
//! memory for one replica and in a Redis script for many.

pub mod budget;
pub mod gcra;
