//! The one test-support tree: every test binary (and `benches/fold.rs`) declares `mod support;`
//! and takes what it needs from the submodules.
//!
//! * [`log`] — a proptest strategy for every `Fact` variant, fixed headers, the golden facts;
//! * [`lifecycle`] — builders for the source and destination role machines;
//! * [`vllm`], [`sglang`] — harnesses that fold an engine core's facts and check them against
//!   the core after every call, and request builders;
//! * [`scripted`] — the scripted fixture runs under `fixtures/runs/scripted-*`;
//! * [`generator`] — a generator of self-consistent disaggregated runs, and a rewriter that
//!   copies a run with records changed or dropped;
//! * [`e2e`] — replaying a trace through the built binary.
//!
//! Every binary compiles the whole tree and uses only part of it, hence the `allow`.
#![allow(dead_code, unused_imports)]

pub mod e2e;
pub mod generator;
pub mod lifecycle;
pub mod log;
pub mod scripted;
pub mod sglang;
pub mod vllm;

use handoff_ledger::events::Fact;
use std::path::{Path, PathBuf};

/// Nanoseconds per millisecond: instants in the logs are ns, scripts write ms.
pub const NS_PER_MS: u64 = 1_000_000;

/// `t` milliseconds in nanoseconds.
pub const fn ms(t: u64) -> u64 {
    t * NS_PER_MS
}

/// A path under `fixtures/` (`fixture("runs/sf-12")`, `fixture("traces/cascade.jsonl")`).
pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(rel)
}

/// The built `handoff-log` binary, ready for arguments.
pub fn cli() -> assert_cmd::Command {
    assert_cmd::Command::cargo_bin("handoff-log").unwrap()
}

/// How many of `facts` are of the variant `name` (`Fact::name`).
pub fn count(facts: &[Fact], name: &str) -> usize {
    facts.iter().filter(|f| f.name() == name).count()
}
