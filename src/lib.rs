//! handoff-ledger: models, records and explains how LLM serving engines hand KV cache from
//! prefill workers to decode workers.
//!
//! Layers, bottom up: [`ids`] (identity and policy types), [`events`] (facts and the log),
//! [`lifecycle`] (pure role-local handoff state machines), [`schedulers`] (sans-IO engine cores),
//! [`router`], [`projections`] (folds over the log), [`adapters`] (clock, replay, live);
//! [`units`] (time units every layer shares).

pub mod adapters;
pub mod events;
pub mod ids;
pub mod lifecycle;
pub mod projections;
pub mod router;
pub mod schedulers;
pub mod units;
