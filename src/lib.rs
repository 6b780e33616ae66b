//! handoff-ledger: models, records and explains how LLM serving engines hand KV cache from
//! prefill workers to decode workers.
//!
//! Layers, bottom up: [`ids`] (identity and policy types), [`model`] (requests and block hashes,
//! KV deltas, capacity snapshots, scheduler views), [`events`] (facts and the log),
//! [`lifecycle`] (pure role-local handoff state machines), [`schedulers`] (sans-IO engine cores),
//! [`router`], [`runtime`] (the sans-IO worker nodes, frontend and protocol), [`projections`] (folds over the log), [`adapters`] (the offline replay);
//! [`units`] (time units every layer shares).

pub mod adapters;
pub mod events;
pub mod ids;
pub mod lifecycle;
pub mod model;
pub mod projections;
pub mod router;
pub mod runtime;
pub mod schedulers;
pub mod units;
