//! Both roles composed by a tiny in-test harness: `Send` actions become deliveries of the same
//! messages to the peer, and two fake engine cores (one per role) acknowledge the engine
//! commands the way `EngineCore` does (pins and reservations are reported as later outputs, a
//! cleanup of something already ended is a no-op). The harness checks the normalized milestone
//! order per policy, and, under random delivery orders, duplicates and injected faults, that
//! both roles end exactly once and the fake cores are left holding nothing.

mod support;

use handoff_ledger::events::{Fact, KvDelta};
use handoff_ledger::ids::{
    CancelReason, DestinationReservationId, EndReason, Generation, HandoffPolicy, RequestId, SourceLeaseId,
};
use handoff_ledger::lifecycle::policy::{expected_order, follows_expected_order, observed_order};
use handoff_ledger::lifecycle::{
    DestinationAction, DestinationEvent, DestinationHandoff, DestinationState, HandoffMessage, MessageBody,
    SourceAction, SourceEvent, SourceHandoff, SourceState,
};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use support::lifecycle::*;

const LEASE: SourceLeaseId = SourceLeaseId(7);
const RES: DestinationReservationId = DestinationReservationId(9);
const BLOCKS: u32 = 256;
const PREFIX_TOKENS: u32 = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Source,
    Destination,
}

/// Something in flight: an event for one role, or a fake core finishing its work.
#[derive(Clone, Copy, Debug)]
enum Item {
    Src(SourceEvent),
    Dst(DestinationEvent),
    /// The prefill core finishes the prompt and pins it (if still computing).
    PrefillCompletes,
    /// The decode core finds capacity and reserves (if still pending).
    DecodeReserves,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Prefill {
    Idle,
    Computing,
    Pinned,
    Ended,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Decode {
    Idle,
    Pending,
    Reserved,
    Active,
    Ended,
}

struct Harness {
    now: u64,
    src: SourceHandoff,
    dst: DestinationHandoff,
    queue: Vec<Item>,
    /// Every fact of both roles and both fake cores, in the order they happened.
    log: Vec<(Side, Fact)>,
    prefill: Prefill,
    decode: Decode,
    /// The router routes the decode side when the prefill returns (vLLM's flow).
    route_on_pin: bool,
    rng: Option<ChaCha8Rng>,
    duplicates_left: u32,
    lease_deadline: Option<u64>,
    reservation_deadline: Option<u64>,
    // Machine-level exactly-once counters.
    release_source: u32,
    cancel_prefill: u32,
    release_pending: u32,
    reservation_ends: u32,
    core_noops: u32,
}

impl Harness {
    fn new(policy: HandoffPolicy, seed: Option<u64>) -> Self {
        let id = handoff_id(seed.unwrap_or(1));
        // Destination-first: the router picks both workers before anything runs, so each role
        // knows its peer. Source-first: the prefill does not know where decode will run.
        let src_peer = (policy == HandoffPolicy::DestinationFirst).then_some(dest_worker());
        let src = source(id, policy, src_peer, None);
        let dst = destination(id, policy, Some(source_worker()), None);
        let mut log = Vec::new();
        log.extend(src.start_facts().into_iter().map(|f| (Side::Source, f)));
        log.extend(dst.start_facts().into_iter().map(|f| (Side::Destination, f)));
        let mut h = Harness {
            now: 1_000,
            src,
            dst,
            queue: Vec::new(),
            log,
            prefill: Prefill::Idle,
            decode: Decode::Idle,
            route_on_pin: policy == HandoffPolicy::SourceFirst,
            rng: seed.map(ChaCha8Rng::seed_from_u64),
            duplicates_left: 8,
            lease_deadline: None,
            reservation_deadline: None,
            release_source: 0,
            cancel_prefill: 0,
            release_pending: 0,
            reservation_ends: 0,
            core_noops: 0,
        };
        h.queue.push(Item::Src(SourceEvent::Start));
        if policy == HandoffPolicy::DestinationFirst {
            h.queue.push(Item::Dst(DestinationEvent::Routed { worker: dest_worker() }));
        }
        h
    }

    fn enqueue(&mut self, item: Item) {
        self.queue.push(item);
        // Transports and cores may deliver twice; the machines must not care.
        let dup = match &mut self.rng {
            Some(r) => self.duplicates_left > 0 && r.random_bool(0.25),
            None => false,
        };
        if dup {
            self.duplicates_left -= 1;
            self.queue.push(item);
        }
    }

    fn pop(&mut self) -> Option<Item> {
        if self.queue.is_empty() {
            return None;
        }
        let i = match &mut self.rng {
            Some(r) => r.random_range(0..self.queue.len()),
            None => 0,
        };
        Some(self.queue.remove(i))
    }

    fn run(&mut self) {
        let mut steps = 0;
        while let Some(item) = self.pop() {
            steps += 1;
            assert!(steps < 1_000, "no convergence");
            self.now += 1;
            self.apply(item);
        }
    }

    fn apply(&mut self, item: Item) {
        match item {
            Item::Src(ev) => self.src_event(ev),
            Item::Dst(ev) => self.dst_event(ev),
            Item::PrefillCompletes => {
                if self.prefill == Prefill::Computing {
                    self.prefill = Prefill::Pinned;
                    let deadline_ns = self.now + LEASE_NS;
                    self.log.push((
                        Side::Source,
                        Fact::SourcePinned {
                            handoff: self.src.id(),
                            request: RequestId(1),
                            lease: LEASE,
                            blocks: BLOCKS,
                            deadline_ns,
                            kv: KvDelta::ZERO,
                        },
                    ));
                    self.enqueue(Item::Src(SourceEvent::PrefillPinned {
                        lease: LEASE,
                        blocks: BLOCKS,
                        deadline_ns,
                    }));
                    if self.route_on_pin {
                        self.enqueue(Item::Dst(DestinationEvent::Routed { worker: dest_worker() }));
                    }
                }
            }
            Item::DecodeReserves => {
                if self.decode == Decode::Pending {
                    self.decode = Decode::Reserved;
                    self.log.push((
                        Side::Destination,
                        Fact::DestinationReserved {
                            handoff: self.dst.id(),
                            request: RequestId(1),
                            reservation: RES,
                            pages: (PROMPT_TOKENS - PREFIX_TOKENS) / 16,
                            prefix_blocks: PREFIX_TOKENS / 16,
                            prefix_tokens: PREFIX_TOKENS,
                            deadline_ns: self.now + RESERVATION_NS,
                            kv: KvDelta::ZERO,
                        },
                    ));
                    self.enqueue(Item::Dst(DestinationEvent::Reserved {
                        reservation: RES,
                        prefix_tokens: PREFIX_TOKENS,
                        missing_tokens: PROMPT_TOKENS - PREFIX_TOKENS,
                    }));
                }
            }
        }
    }

    fn src_event(&mut self, ev: SourceEvent) {
        let before = self.src.clone();
        let t = match self.src.handle(ev, self.now) {
            Ok(t) => t,
            Err(e) => {
                assert_eq!(before, self.src, "error changed the source");
                panic!("source refused a delivery the harness considers valid: {e} ({ev:?})");
            }
        };
        self.log.extend(t.facts.into_iter().map(|f| (Side::Source, f)));
        let id = self.src.id();
        for a in t.actions {
            match a {
                SourceAction::DispatchPrefill { .. } => {
                    assert_eq!(self.prefill, Prefill::Idle, "dispatched twice");
                    self.prefill = Prefill::Computing;
                    self.enqueue(Item::PrefillCompletes);
                }
                SourceAction::ReleaseSource { lease, reason } => {
                    assert_eq!(lease, LEASE);
                    self.release_source += 1;
                    if self.prefill == Prefill::Pinned {
                        self.prefill = Prefill::Ended;
                        self.log.push((
                            Side::Source,
                            Fact::SourceReleased { handoff: id, lease, reason, kv: KvDelta::ZERO },
                        ));
                    } else {
                        self.core_noops += 1;
                    }
                }
                SourceAction::CancelPrefill { reason } => {
                    self.cancel_prefill += 1;
                    match self.prefill {
                        Prefill::Computing => self.prefill = Prefill::Ended,
                        Prefill::Pinned => {
                            // The core had pinned before the cancel arrived: it frees the pin.
                            self.prefill = Prefill::Ended;
                            self.log.push((
                                Side::Source,
                                Fact::SourceReleased {
                                    handoff: id,
                                    lease: LEASE,
                                    reason: EndReason::Canceled(reason),
                                    kv: KvDelta::ZERO,
                                },
                            ));
                        }
                        _ => self.core_noops += 1,
                    }
                }
                SourceAction::Send { to, message } => {
                    assert_eq!(to, dest_worker());
                    self.enqueue(Item::Dst(DestinationEvent::Message(message)));
                }
                SourceAction::ScheduleLeaseTimer { deadline_ns } => self.lease_deadline = Some(deadline_ns),
            }
        }
    }

    fn dst_event(&mut self, ev: DestinationEvent) {
        let before = self.dst.clone();
        let t = match self.dst.handle(ev, self.now) {
            Ok(t) => t,
            Err(e) => {
                assert_eq!(before, self.dst, "error changed the destination");
                panic!("destination refused a delivery the harness considers valid: {e} ({ev:?})");
            }
        };
        self.log.extend(t.facts.into_iter().map(|f| (Side::Destination, f)));
        let id = self.dst.id();
        for a in t.actions {
            match a {
                DestinationAction::ReserveDestination { .. } => {
                    assert_eq!(self.decode, Decode::Idle, "reserved twice");
                    self.decode = Decode::Pending;
                    self.enqueue(Item::DecodeReserves);
                }
                DestinationAction::StartReceive { from, .. } => {
                    assert_eq!(from, source_worker());
                    // Invariant 1: a transfer only into a reservation the core holds.
                    assert_eq!(self.decode, Decode::Reserved, "transfer without a reservation");
                    // The transfer reads pinned source KV.
                    assert!(matches!(self.prefill, Prefill::Pinned | Prefill::Ended));
                    self.enqueue(Item::Dst(DestinationEvent::ReceiveCompleted));
                }
                DestinationAction::ActivateDestination { reservation } => {
                    assert_eq!(reservation, RES);
                    self.reservation_ends += 1;
                    assert_eq!(self.decode, Decode::Reserved, "activated without a reservation");
                    self.decode = Decode::Active;
                    self.log.push((
                        Side::Destination,
                        Fact::DestinationActivated { handoff: id, reservation, kv: KvDelta::ZERO },
                    ));
                }
                DestinationAction::ReleaseDestination { reservation, reason } => {
                    match reservation {
                        None => self.release_pending += 1,
                        Some(r) => {
                            assert_eq!(r, RES);
                            self.reservation_ends += 1;
                        }
                    }
                    match self.decode {
                        Decode::Pending => self.decode = Decode::Ended,
                        Decode::Reserved => {
                            self.decode = Decode::Ended;
                            self.log.push((
                                Side::Destination,
                                Fact::ReservationReleased {
                                    handoff: id,
                                    reservation: RES,
                                    reason,
                                    kv: KvDelta::ZERO,
                                },
                            ));
                        }
                        _ => self.core_noops += 1,
                    }
                }
                DestinationAction::AbortRequest { .. } => {
                    if self.decode == Decode::Active {
                        self.decode = Decode::Ended;
                    }
                }
                DestinationAction::Send { to, message } => {
                    assert_eq!(to, source_worker());
                    self.enqueue(Item::Src(SourceEvent::Message(message)));
                }
                DestinationAction::ScheduleReservationTimer { deadline_ns } => {
                    self.reservation_deadline = Some(deadline_ns)
                }
            }
        }
    }

    fn position(&self, pred: impl Fn(&Fact) -> bool) -> Option<usize> {
        self.log.iter().position(|(_, f)| pred(f))
    }

    fn facts(&self) -> impl Iterator<Item = &Fact> {
        self.log.iter().map(|(_, f)| f)
    }

    /// Exactly-once at the level of the machines' own actions.
    fn assert_exactly_once(&self) {
        assert!(self.release_source <= 1, "ReleaseSource issued {} times", self.release_source);
        assert!(self.cancel_prefill <= 1);
        assert!(self.release_source + self.cancel_prefill >= u32::from(self.prefill != Prefill::Idle));
        assert!(self.release_pending <= 1);
        assert!(self.reservation_ends <= 1, "reservation ended {} times", self.reservation_ends);
        let n = |name: &str| self.facts().filter(|f| f.name() == name).count();
        assert!(
            n("SourcePinned") <= 1 && n("SourceReleased") == n("SourcePinned"),
            "pin not ended exactly once"
        );
        assert_eq!(
            n("DestinationActivated") + n("ReservationReleased"),
            n("DestinationReserved"),
            "reservation not ended exactly once"
        );
    }
}

fn happy_path(policy: HandoffPolicy) -> Harness {
    let mut h = Harness::new(policy, None);
    h.run();
    assert_eq!(h.dst.state_name(), "Active");
    h.queue.push(Item::Dst(DestinationEvent::RequestFinished));
    h.run();
    h
}

#[test]
fn source_first_composed_order_is_pin_reserve_activate_release() {
    let h = happy_path(HandoffPolicy::SourceFirst);
    assert_eq!(h.src.state(), &SourceState::Released { how: EndReason::Success });
    assert_eq!(h.dst.state(), &DestinationState::Released { how: EndReason::Success });
    let order = observed_order(h.facts());
    assert!(follows_expected_order(HandoffPolicy::SourceFirst, h.facts()), "order {order:?}");
    assert_eq!(order, expected_order(HandoffPolicy::SourceFirst));
    h.assert_exactly_once();
    assert_eq!(h.core_noops, 0);
    // The destination's reservation made the source (pinned, not knowing its reader) send
    // SourceReady; the reservation message itself came before.
    let reserved_msg = h
        .position(|f| {
            matches!(
                f,
                Fact::MessageReceived { kind: handoff_ledger::events::MessageKind::DestinationReserved, .. }
            )
        })
        .unwrap();
    let pinned = h.position(|f| matches!(f, Fact::SourcePinned { .. })).unwrap();
    assert!(pinned < reserved_msg);
}

#[test]
fn destination_first_composed_reserves_before_dispatch() {
    let h = happy_path(HandoffPolicy::DestinationFirst);
    assert_eq!(h.src.state(), &SourceState::Released { how: EndReason::Success });
    assert_eq!(h.dst.state(), &DestinationState::Released { how: EndReason::Success });
    let order = observed_order(h.facts());
    assert_eq!(order, expected_order(HandoffPolicy::DestinationFirst));
    let reserved = h.position(|f| matches!(f, Fact::DestinationReserved { .. })).unwrap();
    let dispatched = h.position(|f| matches!(f, Fact::PrefillDispatched { .. })).unwrap();
    assert!(reserved < dispatched, "SGLang gate: the prefill ran before the destination was reserved");
    h.assert_exactly_once();
    assert_eq!(h.core_noops, 0);
}

#[test]
fn source_first_stranded_source_stays_pinned_until_decode_reserves() {
    // Decode has no capacity: the reservation stays pending while the source holds its pin.
    let mut h = Harness::new(HandoffPolicy::SourceFirst, None);
    h.queue.retain(|_| true);
    let mut held = Vec::new();
    while let Some(item) = h.pop() {
        h.now += 1;
        if matches!(item, Item::DecodeReserves) {
            held.push(item); // capacity is not there yet
            continue;
        }
        h.apply(item);
    }
    assert_eq!(h.src.state_name(), "Pinned", "stranded prefill KV stays pinned");
    assert_eq!(h.dst.state_name(), "Reserving");
    assert_eq!(h.prefill, Prefill::Pinned);
    // The lease timer, earlier than the deadline, does nothing.
    let deadline = h.src.deadline_ns().unwrap();
    h.queue.push(Item::Src(SourceEvent::LeaseExpired));
    h.run();
    assert_eq!(h.src.state_name(), "Pinned");
    // Capacity frees up; the handoff completes.
    h.queue.extend(held);
    h.run();
    h.queue.push(Item::Dst(DestinationEvent::RequestFinished));
    h.run();
    assert!(h.now < deadline);
    assert_eq!(h.src.state(), &SourceState::Released { how: EndReason::Success });
    assert_eq!(h.dst.state(), &DestinationState::Released { how: EndReason::Success });
    h.assert_exactly_once();
}

#[test]
fn source_first_lease_expiry_while_decode_waits_aborts_the_pending_reservation() {
    let mut h = Harness::new(HandoffPolicy::SourceFirst, None);
    let mut held = Vec::new();
    while let Some(item) = h.pop() {
        h.now += 1;
        if matches!(item, Item::DecodeReserves) {
            held.push(item);
            continue;
        }
        h.apply(item);
    }
    // The pin expires (source-first, no destination known to the source yet).
    h.now = h.src.deadline_ns().unwrap();
    h.queue.push(Item::Src(SourceEvent::LeaseExpired));
    h.run();
    assert_eq!(h.src.state(), &SourceState::Released { how: EndReason::Expired });
    // Decode gets capacity later and tells the source, which answers with an Abort.
    h.queue.extend(held);
    h.run();
    assert_eq!(
        h.dst.state(),
        &DestinationState::Released { how: EndReason::Canceled(CancelReason::TransferFailed) }
    );
    assert_eq!(h.decode, Decode::Ended);
    h.assert_exactly_once();
}

/// One randomized composed run: random delivery order, duplicates, and optionally one injected
/// fault. Returns an error naming the seed on any failed expectation (panics also name it:
/// proptest prints the failing seed).
fn randomized(policy: HandoffPolicy, seed: u64, fault: Option<u8>) {
    let mut h = Harness::new(policy, Some(seed));
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    // Under source-first the decode router may also route early, before the prefill returns.
    if policy == HandoffPolicy::SourceFirst && rng.random_bool(0.3) {
        h.route_on_pin = false;
        h.queue.push(Item::Dst(DestinationEvent::Routed { worker: dest_worker() }));
    }
    let fault_at = rng.random_range(0..12u32);
    let mut steps = 0u32;
    while let Some(item) = h.pop() {
        h.now += 1;
        h.apply(item);
        steps += 1;
        if let (Some(kind), true) = (fault, steps == fault_at) {
            inject(&mut h, kind);
        }
    }
    // If the fault came after the end, inject it now (it must be harmless).
    if let (Some(kind), true) = (fault, steps < fault_at) {
        inject(&mut h, kind);
        h.run();
    }
    if fault.is_none() {
        assert_eq!(h.dst.state_name(), "Active", "seed {seed}: destination did not activate");
    }
    // Guards, as the adapters have them: the router's request guard finishes or cancels the
    // decode request; the source's lease timer ends a pin nobody reads.
    for _ in 0..4 {
        if !h.dst.is_released() {
            let ev = if h.dst.state_name() == "Active" {
                DestinationEvent::RequestFinished
            } else {
                DestinationEvent::Cancelled { reason: CancelReason::RequestAborted }
            };
            h.queue.push(Item::Dst(ev));
            h.run();
        }
        if !h.src.is_released() {
            match h.src.deadline_ns() {
                Some(d) => {
                    h.now = h.now.max(d);
                    h.queue.push(Item::Src(SourceEvent::LeaseExpired));
                }
                None => {
                    h.queue.push(Item::Src(SourceEvent::Cancelled { reason: CancelReason::RequestAborted }))
                }
            }
            h.run();
        }
    }
    assert!(h.src.is_released() && h.dst.is_released(), "seed {seed}: not both released");
    h.assert_exactly_once();
    assert_ne!(h.prefill, Prefill::Pinned, "seed {seed}: pin leaked");
    assert!(!matches!(h.decode, Decode::Pending | Decode::Reserved), "seed {seed}: reservation leaked");
    let rel = h.position(|f| matches!(f, Fact::SourceReleased { reason: EndReason::Success, .. }));
    let act = h.position(|f| matches!(f, Fact::DestinationActivated { .. }));
    if let Some(r) = rel {
        assert!(matches!(act, Some(a) if a < r), "seed {seed}: source released on success before activation");
    }
    if fault.is_none() {
        assert_eq!(h.src.state(), &SourceState::Released { how: EndReason::Success }, "seed {seed}");
        assert_eq!(h.dst.state(), &DestinationState::Released { how: EndReason::Success }, "seed {seed}");
        assert_eq!(h.core_noops, 0, "seed {seed}: redundant cleanup on the happy path");
        if policy == HandoffPolicy::DestinationFirst {
            assert_eq!(observed_order(h.facts()), expected_order(policy), "seed {seed}");
        }
    }
}

/// Faults: 0 cancel source, 1 cancel destination, 2 lease expiry, 3 reservation expiry,
/// 4 destination restarts (newer generation), 5 source restarts, 6 transfer failure abort.
fn inject(h: &mut Harness, kind: u8) {
    let id = h.src.id();
    match kind {
        0 => h.queue.push(Item::Src(SourceEvent::Cancelled { reason: CancelReason::RequestAborted })),
        1 => h.queue.push(Item::Dst(DestinationEvent::Cancelled { reason: CancelReason::RequestAborted })),
        2 => {
            if let Some(d) = h.lease_deadline {
                h.now = h.now.max(d);
                h.queue.push(Item::Src(SourceEvent::LeaseExpired));
            }
        }
        3 => {
            if let Some(d) = h.reservation_deadline {
                h.now = h.now.max(d);
                h.queue.push(Item::Dst(DestinationEvent::ReservationExpired));
            }
        }
        4 => {
            // The new incarnation does not know the handoff; its first word is a heartbeat.
            let msg = HandoffMessage {
                handoff: id,
                from: dest_worker(),
                generation: Generation(6),
                body: MessageBody::LeaseRenewal,
            };
            h.queue.push(Item::Src(SourceEvent::Message(msg)));
        }
        5 => {
            let msg = HandoffMessage {
                handoff: id,
                from: source_worker(),
                generation: Generation(4),
                body: MessageBody::Abort { reason: CancelReason::OwnerLost },
            };
            h.queue.push(Item::Dst(DestinationEvent::Message(msg)));
        }
        _ => {
            let msg = HandoffMessage {
                handoff: id,
                from: dest_worker(),
                generation: Generation(5),
                body: MessageBody::Abort { reason: CancelReason::TransferFailed },
            };
            h.queue.push(Item::Src(SourceEvent::Message(msg)));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn randomized_source_first_converges(seed in any::<u64>()) {
        randomized(HandoffPolicy::SourceFirst, seed, None);
    }

    #[test]
    fn randomized_destination_first_converges(seed in any::<u64>()) {
        randomized(HandoffPolicy::DestinationFirst, seed, None);
    }

    #[test]
    fn randomized_faults_release_everything_exactly_once(seed in any::<u64>(), fault in 0u8..7, dest_first in any::<bool>()) {
        let policy = if dest_first { HandoffPolicy::DestinationFirst } else { HandoffPolicy::SourceFirst };
        randomized(policy, seed, Some(fault));
    }
}

/// Throughput of the two machines alone (no harness): one clean handoff is 9 `handle` calls.
/// Run with `cargo test --test lifecycle_composed machine_throughput -- --ignored --nocapture`.
#[test]
#[ignore]
fn machine_throughput() {
    let n = 200_000u64;
    let start = std::time::Instant::now();
    let mut calls = 0u64;
    for i in 0..n {
        let id = handoff_ledger::ids::HandoffId(uuid::Uuid::from_u64_pair(i, i));
        let mut s = source(id, HandoffPolicy::SourceFirst, None, None);
        let mut d = destination(id, HandoffPolicy::SourceFirst, Some(source_worker()), None);
        let mut sent = Vec::new();
        let t = s.handle(SourceEvent::Start, 1).unwrap();
        let t2 = s
            .handle(SourceEvent::PrefillPinned { lease: LEASE, blocks: BLOCKS, deadline_ns: 10 }, 2)
            .unwrap();
        d.handle(DestinationEvent::Routed { worker: dest_worker() }, 3).unwrap();
        let t3 = d
            .handle(DestinationEvent::Reserved { reservation: RES, prefix_tokens: 0, missing_tokens: 16 }, 4)
            .unwrap();
        for a in t3.actions {
            if let DestinationAction::Send { message, .. } = a {
                sent.push(message);
            }
        }
        let t4 = s.handle(SourceEvent::Message(sent.pop().unwrap()), 5).unwrap();
        for a in t4.actions {
            if let SourceAction::Send { message, .. } = a {
                d.handle(DestinationEvent::Message(message), 6).unwrap();
            }
        }
        let t5 = d.handle(DestinationEvent::ReceiveCompleted, 7).unwrap();
        for a in t5.actions {
            if let DestinationAction::Send { message, .. } = a {
                s.handle(SourceEvent::Message(message), 8).unwrap();
            }
        }
        d.handle(DestinationEvent::RequestFinished, 9).unwrap();
        assert!(s.is_released() && d.is_released());
        calls += 9;
        std::hint::black_box((t, t2));
    }
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "{n} handoffs, {calls} handle calls in {secs:.3} s: {:.0} handoffs/s, {:.0} calls/s",
        n as f64 / secs,
        calls as f64 / secs
    );
}

// ---- The same composition through the real runtime ----
//
// Two `WorkerNode`s with real engine cores, driven without the simulator: a scripted loop
// carries their outputs by hand (peer messages to the other node, commands back to their node,
// transfers finished at once, frontend messages recorded and answered as the frontend would).

mod runtime_nodes {
    use handoff_ledger::events::{Fact, TerminalStatus};
    use handoff_ledger::ids::{
        Backend, CancelReason, Generation, HandoffId, HandoffPolicy, RequestId, WorkerId,
    };
    use handoff_ledger::runtime::{
        HandoffRole, NodeConfig, Output, Peer, Ready, StepPlan, ToFrontend, ToWorker, WorkerNode,
    };
    use handoff_ledger::schedulers::sglang::{SglangConfig, SglangCore};
    use handoff_ledger::schedulers::vllm::{VllmConfig, VllmCore};
    use handoff_ledger::schedulers::{EngineCore, Request};
    use std::collections::VecDeque;

    const LEASE_NS: u64 = 30_000_000_000;

    fn config(policy: HandoffPolicy) -> NodeConfig {
        NodeConfig {
            policy,
            lease_ns: LEASE_NS,
            reservation_ns: LEASE_NS,
            renew_ns: None,
            kv_bytes_per_token: 1024,
        }
    }

    fn core(worker: WorkerId, backend: Backend) -> Box<dyn EngineCore> {
        match backend {
            Backend::Sglang => Box::new(SglangCore::new(worker, SglangConfig::default()).unwrap()),
            _ => Box::new(VllmCore::new(worker, backend, VllmConfig::default()).unwrap()),
        }
    }

    fn handoff() -> HandoffId {
        super::support::lifecycle::handoff_id(42)
    }

    /// Two nodes and what went between them.
    struct Pair {
        nodes: [WorkerNode; 2],
        now_ns: u64,
        /// (node index, instant, input): commands handed back, peer messages, transfer ends.
        queue: VecDeque<(usize, Input)>,
        /// Every fact, with its node.
        facts: Vec<(usize, Fact)>,
        /// Every message to the frontend, with its sender.
        to_frontend: Vec<(usize, ToFrontend)>,
        /// A node wants to step.
        wants_step: [bool; 2],
        /// When each node's step in flight ends.
        stepping_until: [Option<u64>; 2],
    }

    enum Input {
        Command(handoff_ledger::runtime::DeferredCommand),
        Peer(handoff_ledger::lifecycle::HandoffMessage),
        TransferDone(HandoffId),
    }

    impl Pair {
        fn new(backend: Backend, policy: HandoffPolicy) -> Self {
            let (p, d) = (WorkerId::prefill(0), WorkerId::decode(0));
            let mut pair = Pair {
                nodes: [
                    WorkerNode::new(p, core(p, backend), config(policy)),
                    WorkerNode::new(d, core(d, backend), config(policy)),
                ],
                now_ns: 0,
                queue: VecDeque::new(),
                facts: Vec::new(),
                to_frontend: Vec::new(),
                wants_step: [false; 2],
                stepping_until: [None; 2],
            };
            for i in 0..2 {
                let mut r = Ready::default();
                pair.nodes[i].start(&mut r);
                pair.carry(i, r);
            }
            pair
        }

        fn index(&self, w: WorkerId) -> usize {
            usize::from(self.nodes[1].id() == w)
        }

        fn carry(&mut self, i: usize, ready: Ready) {
            self.facts.extend(ready.facts.into_iter().map(|f| (i, f)));
            for o in ready.outputs {
                match o {
                    Output::ToFrontend(m) => self.to_frontend.push((i, m)),
                    Output::ToWorker { to, message } => {
                        let j = self.index(to);
                        self.queue.push_back((j, Input::Peer(message)));
                    }
                    Output::Command { command, .. } => self.queue.push_back((i, Input::Command(command))),
                    // Lease and reservation timers never fire in these scripts: everything
                    // finishes well inside them.
                    Output::Timer { .. } => {}
                    Output::StartTransfer { handoff, .. } => {
                        self.queue.push_back((i, Input::TransferDone(handoff)))
                    }
                    Output::CancelTransfer { .. } => {}
                    Output::StepSoon => self.wants_step[i] = true,
                }
            }
        }

        fn frontend(&mut self, i: usize, m: ToWorker) {
            let mut r = Ready::default();
            self.nodes[i].on_frontend(self.now_ns, m, &mut r).unwrap();
            self.carry(i, r);
        }

        /// Runs inputs, steps and step ends until nothing is left.
        fn run(&mut self) {
            for _ in 0..100_000 {
                if let Some((i, input)) = self.queue.pop_front() {
                    let mut r = Ready::default();
                    match input {
                        Input::Command(c) => self.nodes[i].apply_command(self.now_ns, c, &mut r).unwrap(),
                        Input::Peer(m) => self.nodes[i].on_peer(self.now_ns, m, &mut r),
                        Input::TransferDone(h) => {
                            self.nodes[i].on_transfer_done(self.now_ns, h, None, &mut r)
                        }
                    }
                    self.carry(i, r);
                    continue;
                }
                if let Some(i) = (0..2).find(|i| self.wants_step[*i]) {
                    self.wants_step[i] = false;
                    self.step(i);
                    continue;
                }
                // Nothing at this instant: the earliest step in flight ends.
                let Some((i, at)) =
                    (0..2).filter_map(|i| self.stepping_until[i].map(|t| (i, t))).min_by_key(|x| x.1)
                else {
                    return;
                };
                self.now_ns = at;
                self.stepping_until[i] = None;
                let mut r = Ready::default();
                self.nodes[i].finish_step(at, &mut r);
                while self.nodes[i].apply_next_waiting(at, &mut r) {}
                self.carry(i, r);
                self.wants_step[i] = true;
            }
            panic!("the script did not settle");
        }

        fn step(&mut self, i: usize) {
            loop {
                let mut r = Ready::default();
                let plan = self.nodes[i].start_step(self.now_ns, false, &mut r).unwrap();
                self.carry(i, r);
                match plan {
                    StepPlan::Again => continue,
                    StepPlan::Until { until_ns } => self.stepping_until[i] = Some(until_ns),
                    StepPlan::Idle | StepPlan::Quiet { .. } => {}
                }
                return;
            }
        }

        fn said(&self, i: usize, pred: impl Fn(&ToFrontend) -> bool) -> bool {
            self.to_frontend.iter().any(|(j, m)| *j == i && pred(m))
        }
    }

    fn request() -> Request {
        Request::unique(RequestId(0), 700, 4, 0)
    }

    /// One handoff across a prefill and a decode node: both roles end well, each says so to
    /// the frontend, the request finishes on decode and neither node holds anything after.
    fn compose(backend: Backend, policy: HandoffPolicy) -> Pair {
        let mut pair = Pair::new(backend, policy);
        let (p, d) = (pair.nodes[0].id(), pair.nodes[1].id());
        let source = Peer { worker: p, generation: Generation(1) };
        let destination = Peer { worker: d, generation: Generation(1) };
        let h = handoff();
        if policy == HandoffPolicy::DestinationFirst {
            pair.frontend(1, ToWorker::StartDestination { handoff: h, request: request(), source });
            let start =
                ToWorker::StartSource { handoff: h, request: request(), destination: Some(destination) };
            pair.frontend(0, start);
        } else {
            pair.frontend(0, ToWorker::StartSource { handoff: h, request: request(), destination: None });
        }
        pair.run();
        // Source-first: the frontend routes the decode once the prefill is pinned.
        if policy == HandoffPolicy::SourceFirst {
            assert!(pair.said(0, |m| matches!(m, ToFrontend::PrefillPinned { handoff, .. } if *handoff == h)));
            pair.frontend(1, ToWorker::StartDestination { handoff: h, request: request(), source });
            pair.run();
        }
        assert!(pair.said(0, |m| matches!(m, ToFrontend::PrefillDispatched { .. })));
        assert!(pair.said(0, |m| matches!(m, ToFrontend::SourceReleased { .. })));
        assert!(pair.said(1, |m| matches!(m, ToFrontend::DecodeActivated { .. })));
        let ended_well = |role| move |m: &ToFrontend| matches!(m, ToFrontend::RoleEnded { role: r, success: true, .. } if *r == role);
        assert!(pair.said(0, ended_well(HandoffRole::Source)), "{:?}", pair.to_frontend);
        assert!(pair.said(1, ended_well(HandoffRole::Destination)), "{:?}", pair.to_frontend);
        assert!(pair.said(1, |m| matches!(
            m,
            ToFrontend::Finished { status: TerminalStatus::Completed, output_tokens: 4, .. }
        )));
        for n in &pair.nodes {
            assert!(n.holds_nothing(), "{} still holds something", n.id());
        }
        pair
    }

    #[test]
    fn a_vllm_prefill_node_and_decode_node_complete_a_source_first_handoff_by_messages_alone() {
        let pair = compose(Backend::Vllm, HandoffPolicy::SourceFirst);
        // The source pinned before the destination reserved (nothing else could have told it).
        let at = |pred: &dyn Fn(&Fact) -> bool| pair.facts.iter().position(|(_, f)| pred(f)).unwrap();
        assert!(
            at(&|f| matches!(f, Fact::SourcePinned { .. }))
                < at(&|f| matches!(f, Fact::DestinationReserved { .. }))
        );
    }

    #[test]
    fn an_sglang_pair_completes_a_destination_first_handoff_by_messages_alone() {
        let pair = compose(Backend::Sglang, HandoffPolicy::DestinationFirst);
        let at = |pred: &dyn Fn(&Fact) -> bool| pair.facts.iter().position(|(_, f)| pred(f)).unwrap();
        assert!(
            at(&|f| matches!(f, Fact::DestinationReserved { .. }))
                < at(&|f| matches!(f, Fact::SourcePinned { .. }))
        );
    }

    #[test]
    fn one_node_alone_answers_each_input_with_the_facts_and_messages_it_owes() {
        let p = WorkerId::prefill(0);
        let mut node = WorkerNode::new(p, core(p, Backend::Vllm), config(HandoffPolicy::SourceFirst));
        let h = handoff();
        // A message for a handoff it never heard of is refused with a fact, nothing else.
        let stray = handoff_ledger::lifecycle::HandoffMessage {
            handoff: h,
            from: WorkerId::decode(0),
            generation: Generation(1),
            body: handoff_ledger::lifecycle::MessageBody::LeaseRenewal,
        };
        let mut r = Ready::default();
        node.on_peer(0, stray, &mut r);
        assert!(
            matches!(r.facts.as_slice(), [Fact::MessageRejected { .. }]) && r.outputs.is_empty(),
            "{r:?}"
        );
        // Starting a source: its start facts, the frontend told of the dispatch, and the core
        // command handed back for its turn rather than applied inside the input.
        let mut r = Ready::default();
        node.on_frontend(
            5,
            ToWorker::StartSource { handoff: h, request: request(), destination: None },
            &mut r,
        )
        .unwrap();
        assert!(r.facts.iter().any(|f| matches!(f, Fact::HandoffStarted { .. })), "{:?}", r.facts);
        assert!(r
            .outputs
            .iter()
            .any(|o| matches!(o, Output::ToFrontend(ToFrontend::PrefillDispatched { .. }))));
        let command = r.outputs.into_iter().find_map(|o| match o {
            Output::Command { at_ns: 5, command } => Some(command),
            _ => None,
        });
        assert!(node.core().is_empty(), "the core got the prefill before its turn");
        let mut r = Ready::default();
        node.apply_command(5, command.expect("a deferred dispatch"), &mut r).unwrap();
        assert!(matches!(r.outputs.last(), Some(Output::StepSoon)), "{:?}", r.outputs);
        assert!(!node.core().is_empty());
        // Canceling it: the machine ends (once), the frontend hears the role ended.
        let mut r = Ready::default();
        let cancel = ToWorker::CancelHandoff { handoff: h, reason: CancelReason::RequestAborted };
        node.on_frontend(6, cancel.clone(), &mut r).unwrap();
        assert!(r.outputs.iter().any(|o| matches!(
            o,
            Output::ToFrontend(ToFrontend::RoleEnded { role: HandoffRole::Source, success: false, .. })
        )));
        let mut again = Ready::default();
        node.on_frontend(7, cancel, &mut again).unwrap();
        assert!(again.is_empty(), "a second cancel did something: {again:?}");
    }

    #[test]
    fn a_restart_cancels_every_role_and_names_the_handoffs_for_their_peers() {
        let mut pair = Pair::new(Backend::Vllm, HandoffPolicy::SourceFirst);
        let h = handoff();
        pair.frontend(0, ToWorker::StartSource { handoff: h, request: request(), destination: None });
        pair.run();
        let mut r = Ready::default();
        let held = pair.nodes[0].restart(pair.now_ns, &mut r);
        assert_eq!(held, vec![h]);
        assert_eq!(pair.nodes[0].generation(), Generation(2));
        assert!(matches!(r.facts.first(), Some(Fact::SessionStarted { generation: Generation(2) })));
        pair.carry(0, r);
        pair.run();
        assert!(pair.nodes[0].holds_nothing(), "the restarted node kept its pin");
    }
}
