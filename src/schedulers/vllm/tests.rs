//! Unit tests of ownership precedence on shared blocks, at core level.

use super::{VllmConfig, VllmCore};
use crate::events::{Fact, KvDelta};
use crate::ids::{Backend, CancelReason, EndReason, HandoffId, RequestId, WorkerId};
use crate::model::capacity::KvCapacitySnapshot;
use crate::projections::SchedulerFold;
use crate::schedulers::request::TRACE_BLOCK_SIZE;
use crate::schedulers::{CommandOutcome, Effects, EngineCore, Request};

struct Folded {
    core: VllmCore,
    cap: KvCapacitySnapshot,
    view: SchedulerFold,
    log: Vec<Fact>,
}

impl Folded {
    fn new(blocks: u32, bs: u32) -> Self {
        let cfg = VllmConfig { num_gpu_blocks: blocks, block_size: bs, ..VllmConfig::default() };
        let core = VllmCore::new(WorkerId::aggregated(0), Backend::Vllm, cfg).unwrap();
        Folded {
            core,
            cap: KvCapacitySnapshot::empty(blocks as u64),
            view: SchedulerFold::new(),
            log: vec![],
        }
    }
    fn take(&mut self, fx: Effects) -> Vec<Fact> {
        for f in &fx.facts {
            self.cap.apply_fact(f).unwrap();
            self.view.apply(f).unwrap();
        }
        assert_eq!(self.cap, self.core.snapshot());
        assert_eq!(self.core.try_audit().unwrap(), self.cap);
        assert_eq!(self.view.view(), self.core.view());
        self.log.extend(fx.facts.iter().cloned());
        fx.facts
    }
    fn step(&mut self) -> Vec<Fact> {
        let out = self.core.step(0);
        self.take(out.effects)
    }
}

fn req(id: u64, input: u32, output: u32, trace: &[u64]) -> Request {
    Request {
        id: RequestId(id),
        input_tokens: input,
        output_tokens: output,
        trace_blocks: trace.to_vec().into(),
        trace_block_size: TRACE_BLOCK_SIZE,
        arrival_ns: 0,
        hash_cache: Default::default(),
    }
}

fn kv_of(facts: &[Fact], name: &str) -> KvDelta {
    facts.iter().find(|f| f.name() == name).map(|f| f.kv_delta()).unwrap()
}

#[test]
fn active_outranks_pinned_and_release_moves_nothing_while_shared() {
    let mut c = Folded::new(64, 16);
    let h = HandoffId(uuid::Uuid::from_u128(1));
    let r = c.core.submit_handoff_prefill(h, req(1, 256, 1, &[9]), 1_000, 0);
    c.take(r.effects);
    c.step();
    assert_eq!(c.core.snapshot().pinned_source_blocks, 16);

    // A plain request reusing the pinned prefix: those 16 blocks become active (precedence).
    let r = c.core.submit(req(2, 300, 40, &[9]), 0);
    c.take(r.effects);
    let facts = c.step();
    let kv = kv_of(&facts, "RequestScheduled");
    assert_eq!((kv.pinned_source, kv.active, kv.free, kv.slots), (-16, 19, -3, 1));

    // Releasing the source while the request still uses the blocks changes no class.
    let r = c.core.release_source(h, EndReason::Success, 0);
    assert_eq!(r.outcome, Ok(CommandOutcome::Applied));
    let facts = c.take(r.effects);
    assert_eq!(kv_of(&facts, "SourceReleased"), KvDelta::ZERO);
    while !c.core.is_drained() {
        c.step();
    }
    let s = c.core.snapshot();
    assert_eq!(s.active_blocks + s.pinned_source_blocks, 0);
}

#[test]
fn reserved_outranks_pinned_and_cancel_hands_blocks_back_to_the_pin() {
    let mut c = Folded::new(64, 16);
    let src = HandoffId(uuid::Uuid::from_u128(1));
    let dst = HandoffId(uuid::Uuid::from_u128(2));
    let r = c.core.submit_handoff_prefill(src, req(1, 256, 1, &[9]), 1_000, 0);
    c.take(r.effects);
    c.step();
    // The destination on the same worker locks the pinned prefix: reserved wins over pinned.
    let r = c.core.reserve_destination(dst, req(2, 320, 5, &[9]), 0, 0);
    assert_eq!(r.outcome, Ok(CommandOutcome::Applied));
    let facts = c.take(r.effects);
    let kv = kv_of(&facts, "DestinationReserved");
    assert_eq!((kv.pinned_source, kv.reserved_destination, kv.free), (-16, 20, -4));
    // Canceling the reservation returns the prefix to the pin, not to the cache.
    let r = c.core.cancel_destination(dst, CancelReason::PeerLost, 0);
    let facts = c.take(r.effects);
    let kv = kv_of(&facts, "ReservationReleased");
    assert_eq!((kv.pinned_source, kv.reserved_destination, kv.free), (16, -20, 4));
    let r = c.core.release_source(src, EndReason::Expired, 0);
    c.take(r.effects);
    assert!(c.core.is_drained());
    assert_eq!(c.core.snapshot().cached_free_blocks, 16);
}

#[test]
fn new_rejects_bad_configs_and_backends() {
    let bad = VllmConfig { block_size: 0, ..VllmConfig::default() };
    assert!(VllmCore::new(WorkerId::decode(0), Backend::Vllm, bad).is_err());
    assert!(VllmCore::new(WorkerId::decode(0), Backend::Sglang, VllmConfig::default()).is_err());
    let c = VllmCore::new(WorkerId::decode(0), Backend::TrtLlm, VllmConfig::default()).unwrap();
    assert_eq!(c.shape().total_blocks, 16384);
    assert_eq!(c.shape().max_request_slots, 256);
}
