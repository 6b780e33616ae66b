//! Shared helpers for the SGLang core tests: request builders and a checker that folds every
//! emitted fact and compares the folds with the core after every call.

use handoff_ledger::events::{Fact, KvDelta};
use handoff_ledger::ids::{HandoffId, RequestId, WorkerId};
use handoff_ledger::projections::{KvCapacitySnapshot, SchedulerFold};
use handoff_ledger::schedulers::sglang::{SglangConfig, SglangCore};
use handoff_ledger::schedulers::{CommandResult, Effects, EngineCore, Request, StepOutput};
use std::collections::BTreeMap;

/// Trace blocks of 32 tokens, so small prompts share prefixes at page granularity.
pub const TBS: u32 = 32;

pub fn hid(n: u64) -> HandoffId {
    HandoffId(uuid::Uuid::from_u128(n as u128 + 1))
}

/// A request whose first `shared_blocks` trace blocks come from prefix family `family`; the
/// rest are unique to the request.
pub fn req(id: u64, input: u32, output: u32, family: u64, shared_blocks: u32) -> Request {
    let n = input.div_ceil(TBS).max(1);
    let blocks: Vec<u64> = (0..n)
        .map(|i| if i < shared_blocks { family * 1000 + i as u64 } else { (id + 1) * 1_000_000 + i as u64 })
        .collect();
    Request {
        id: RequestId(id),
        input_tokens: input,
        output_tokens: output,
        trace_blocks: blocks.into(),
        trace_block_size: TBS,
        arrival_ns: 0,
        hash_cache: Default::default(),
    }
}

pub fn small_config() -> SglangConfig {
    SglangConfig {
        total_pages: 48,
        page_size: 16,
        max_running_requests: 6,
        max_prefill_tokens: 128,
        chunked_prefill_size: 64,
        clip_max_new_tokens: 40,
        new_token_ratio_decay_steps: 10,
        num_reserved_decode_tokens: 32,
        max_waiting_requests: 64,
        max_pending_reservations: 16,
        ..SglangConfig::default()
    }
}

/// Wraps a core; every call's facts are folded and checked against the core's own figures.
pub struct Checked {
    pub core: SglangCore,
    pub cap: KvCapacitySnapshot,
    pub sched: SchedulerFold,
    pub facts: Vec<Fact>,
    pub calls: u64,
}

impl Checked {
    pub fn new(cfg: SglangConfig) -> Self {
        let total = cfg.total_pages as u64;
        Checked {
            core: SglangCore::new(WorkerId::decode(0), cfg).expect("valid config"),
            cap: KvCapacitySnapshot::empty(total),
            sched: SchedulerFold::new(),
            facts: Vec::new(),
            calls: 0,
        }
    }

    pub fn absorb(&mut self, eff: &Effects) {
        self.calls += 1;
        for f in &eff.facts {
            let d = f.kv_delta();
            assert_eq!(d.block_sum(), 0, "call {}: fact {f:?} does not conserve blocks", self.calls);
            self.cap
                .apply_fact(f)
                .unwrap_or_else(|e| panic!("call {}: capacity fold refused {f:?}: {e}", self.calls));
            self.sched
                .apply(f)
                .unwrap_or_else(|e| panic!("call {}: scheduler fold refused {f:?}: {e}", self.calls));
            self.check_fact_shape(f);
            self.facts.push(f.clone());
        }
        let snap = self.core.snapshot();
        assert_eq!(self.cap, snap, "call {}: fold of facts != snapshot", self.calls);
        assert_eq!(self.core.audit(), snap, "call {}: audit != snapshot", self.calls);
        assert!(snap.is_conserved(), "call {}: not conserved {snap:?}", self.calls);
        assert_eq!(self.sched.view(), self.core.view(), "call {}: scheduler fold != view", self.calls);
    }

    /// What each lifecycle fact's delta must look like, whatever the interleaving.
    fn check_fact_shape(&self, f: &Fact) {
        let n = self.calls;
        match f {
            Fact::DestinationReserved { pages, kv, .. } => {
                assert!(kv.reserved_destination >= *pages as i32, "call {n}: delta pages not reserved {f:?}");
                assert_eq!(kv.slots, 1, "call {n}: {f:?}");
                // A locked prefix page may move pinned → reserved (precedence), never out of active.
                assert!(
                    kv.headroom_tokens >= 0 && kv.active == 0 && kv.pinned_source <= 0,
                    "call {n}: {f:?}"
                );
            }
            Fact::DestinationActivated { kv, .. } => {
                assert!(
                    kv.reserved_destination <= 0 && kv.slots == 0 && kv.headroom_tokens == 0,
                    "call {n}: {f:?}"
                );
                assert!(kv.active >= 0, "call {n}: {f:?}");
            }
            Fact::ReservationReleased { kv, .. } => {
                assert!(
                    kv.reserved_destination <= 0 && kv.slots == -1 && kv.headroom_tokens <= 0,
                    "call {n}: {f:?}"
                );
                assert_eq!(kv.active, 0, "call {n}: {f:?}");
            }
            Fact::SourcePinned { kv, blocks, .. } => {
                // Active pages move to pinned, or to reserved where a reservation shares them.
                assert_eq!(kv.active, -(kv.pinned_source + kv.reserved_destination), "call {n}: {f:?}");
                assert!(kv.pinned_source >= 0 && kv.reserved_destination >= 0, "call {n}: {f:?}");
                assert!(
                    kv.pinned_source as u32 <= *blocks && kv.slots == 0 && kv.free == 0,
                    "call {n}: {f:?}"
                );
            }
            Fact::SourceReleased { kv, .. } => {
                assert!(kv.pinned_source <= 0 && kv.slots == -1 && kv.active == 0, "call {n}: {f:?}");
            }
            Fact::RequestPreempted { kv, .. } => {
                assert!(kv.active <= 0 && kv.slots == -1, "call {n}: {f:?}");
            }
            _ => {}
        }
    }

    pub fn cmd(&mut self, f: impl FnOnce(&mut SglangCore) -> CommandResult) -> CommandResult {
        let r = f(&mut self.core);
        self.absorb(&r.effects);
        r
    }

    pub fn step(&mut self, at_ns: u64) -> StepOutput {
        let out = self.core.step(at_ns);
        self.absorb(&out.effects);
        out
    }

    /// Sum of deltas of the facts emitted so far (equals `cap − empty`).
    pub fn total_delta(&self) -> KvDelta {
        self.facts.iter().fold(KvDelta::ZERO, |a, f| a.plus(f.kv_delta()))
    }

    /// Per-handoff counts of lifecycle facts, by fact name.
    pub fn handoff_counts(&self) -> BTreeMap<HandoffId, BTreeMap<&'static str, u32>> {
        let mut m: BTreeMap<HandoffId, BTreeMap<&'static str, u32>> = BTreeMap::new();
        for f in &self.facts {
            if let Some(h) = f.handoff() {
                *m.entry(h).or_default().entry(f.name()).or_default() += 1;
            }
        }
        m
    }
}
