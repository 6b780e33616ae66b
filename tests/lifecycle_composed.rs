//! The runtime composed without the simulator: a real `Frontend`, a prefill `WorkerNode` and a
//! decode `WorkerNode` with real engine cores, connected by a small network written here.
//!
//! The network keeps each channel in order (frontend → node, node → frontend, node → node, and
//! each node's own commands and steps), as TCP and an engine's control queue do, and serves the
//! channels in a seeded random order; it may deliver a handoff message twice, and one fault may
//! be injected: the client cancels, the handoff's channel is lost, either worker restarts, or a
//! message arrives again after the end. Steps take their modeled time on a virtual clock and
//! the nodes' timers fire when due. Whatever happens, the request must end, both roles must end
//! exactly once, every booking must be freed and neither core may hold anything; without a
//! fault the handoff follows its policy's milestone order.

mod support;

use handoff_ledger::events::{Fact, MessageRejection, TerminalStatus};
use handoff_ledger::ids::{
    Backend, CancelReason, EndReason, HandoffId, HandoffPolicy, IdMint, RequestId, WorkerId,
};
use handoff_ledger::lifecycle::policy::{expected_order, observed_order};
use handoff_ledger::lifecycle::{
    DestinationAction, DestinationEvent, HandoffMessage, SourceAction, SourceEvent,
};
use handoff_ledger::lifecycle::{DestinationState, SourceState};
use handoff_ledger::router::{Router, RouterMode};
use handoff_ledger::runtime::{
    DeferredCommand, Frontend, FrontendConfig, FrontendReady, HandoffRole, NodeConfig, NodeTimer, Output,
    PromptTransferTime, Ready, RequestEnded, StepPlan, ToFrontend, ToWorker, WorkerNode,
};
use handoff_ledger::schedulers::sglang::{SglangConfig, SglangCore};
use handoff_ledger::schedulers::vllm::{VllmConfig, VllmCore};
use handoff_ledger::schedulers::{EngineCore, Request};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, VecDeque};
use support::lifecycle::*;

const LEASE_NS: u64 = 2_000_000_000;
// For the machines' throughput measurement.
const LEASE: handoff_ledger::ids::SourceLeaseId = handoff_ledger::ids::SourceLeaseId(7);
const RES: handoff_ledger::ids::DestinationReservationId = handoff_ledger::ids::DestinationReservationId(9);
const BLOCKS: u32 = 256;
const RESERVATION_NS: u64 = 3_000_000_000;
const BOOTSTRAP_NS: u64 = 5_000_000_000;

/// A channel of the network: its items are delivered in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Channel {
    FrontendTo(usize),
    ToFrontend(usize),
    Peer {
        from: usize,
        to: usize,
    },
    /// A node's own commands and step starts.
    Local(usize),
}

#[derive(Debug)]
enum Item {
    Frontend(ToWorker),
    Report(ToFrontend),
    Peer(HandoffMessage),
    Command(DeferredCommand),
    TransferDone(HandoffId),
    Step,
}

/// Something due later on the virtual clock.
#[derive(Debug)]
enum Timed {
    StepDone(usize),
    Timer(usize, NodeTimer),
    Bootstrap(RequestId),
}

/// A fault to inject after some deliveries.
#[derive(Clone, Copy, Debug)]
enum Fault {
    ClientCancel,
    ChannelLoss,
    RestartSource,
    RestartDestination,
    LateCopy,
}

const FAULTS: [Fault; 5] = [
    Fault::ClientCancel,
    Fault::ChannelLoss,
    Fault::RestartSource,
    Fault::RestartDestination,
    Fault::LateCopy,
];

struct NoTransfer;

impl PromptTransferTime for NoTransfer {
    fn prompt_transfer_ns(&self, _: u32) -> u64 {
        0
    }
}

fn core(worker: WorkerId, backend: Backend) -> Box<dyn EngineCore> {
    match backend {
        Backend::Sglang => Box::new(SglangCore::new(worker, SglangConfig::default()).unwrap()),
        _ => Box::new(VllmCore::new(worker, backend, VllmConfig::default()).unwrap()),
    }
}

fn policy_of(backend: Backend) -> HandoffPolicy {
    if backend == Backend::Sglang {
        HandoffPolicy::DestinationFirst
    } else {
        HandoffPolicy::SourceFirst
    }
}

/// A frontend, a prefill node (index 0) and a decode node (index 1) on a scripted network.
struct Net {
    frontend: Frontend,
    nodes: [WorkerNode; 2],
    now_ns: u64,
    channels: BTreeMap<Channel, VecDeque<Item>>,
    timed: BTreeMap<(u64, u64), Timed>,
    timed_seq: u64,
    rng: Option<ChaCha8Rng>,
    /// Probability that a handoff message is delivered twice.
    duplicate: f64,
    /// A node whose own channel is stalled (its engine makes no progress).
    stalled: Option<usize>,
    /// Handoffs whose channel was lost: their messages are dropped.
    lost: Vec<HandoffId>,
    /// Every fact, with its node (2: the router stream), in the order written.
    facts: Vec<(usize, Fact)>,
    reports: Vec<(usize, ToFrontend)>,
    ended: Vec<RequestEnded>,
    delivered: Vec<(usize, HandoffMessage)>,
    deliveries: u64,
    /// The handoff the frontend started.
    started: Option<HandoffId>,
}

impl Net {
    fn new(backend: Backend, seed: Option<u64>) -> Self {
        let policy = policy_of(backend);
        let (p, d) = (WorkerId::prefill(0), WorkerId::decode(0));
        let config = NodeConfig {
            policy,
            lease_ns: LEASE_NS,
            reservation_ns: RESERVATION_NS,
            renew_ns: None,
            kv_bytes_per_token: 1024,
            publish_kv_events: true,
        };
        let nodes =
            [WorkerNode::new(p, core(p, backend), config), WorkerNode::new(d, core(d, backend), config)];
        let block_size = nodes[0].core().shape().block_size;
        let router = |w| Router::new(vec![w], RouterMode::RoundRobin, block_size, 7).unwrap();
        let frontend_config = FrontendConfig {
            policy,
            disaggregated: true,
            bootstrap_timeout_ns: BOOTSTRAP_NS,
            max_in_flight: 16,
            block_size,
            latency_samples: false,
        };
        let frontend = Frontend::new(
            frontend_config,
            router(p),
            Some(router(d)),
            IdMint::from_seed(3),
            Box::new(NoTransfer),
        );
        let mut net = Net {
            frontend,
            nodes,
            now_ns: 0,
            channels: BTreeMap::new(),
            timed: BTreeMap::new(),
            timed_seq: 0,
            rng: seed.map(ChaCha8Rng::seed_from_u64),
            duplicate: 0.0,
            stalled: None,
            lost: Vec::new(),
            facts: Vec::new(),
            reports: Vec::new(),
            ended: Vec::new(),
            delivered: Vec::new(),
            deliveries: 0,
            started: None,
        };
        let mut out = FrontendReady::default();
        net.frontend.start(&mut out);
        net.carry_frontend(out);
        for i in 0..2 {
            let mut r = Ready::default();
            net.nodes[i].start(&mut r);
            net.carry(i, r);
        }
        net
    }

    /// The request arrives at the frontend.
    fn arrive(&mut self, request: Request) {
        let mut out = FrontendReady::default();
        self.frontend.on_arrival(self.now_ns, request, &mut out).unwrap();
        self.carry_frontend(out);
    }

    fn index(&self, w: WorkerId) -> usize {
        usize::from(self.nodes[1].id() == w)
    }

    fn send(&mut self, channel: Channel, item: Item) {
        self.channels.entry(channel).or_default().push_back(item);
    }

    fn later(&mut self, at_ns: u64, t: Timed) {
        self.timed_seq += 1;
        self.timed.insert((at_ns.max(self.now_ns), self.timed_seq), t);
    }

    fn carry(&mut self, i: usize, ready: Ready) {
        self.facts.extend(ready.facts.into_iter().map(|f| (i, f)));
        for o in ready.outputs {
            match o {
                Output::ToFrontend(m) => self.send(Channel::ToFrontend(i), Item::Report(m)),
                Output::ToWorker { to, message } => {
                    let to = self.index(to);
                    self.send(Channel::Peer { from: i, to }, Item::Peer(message));
                }
                Output::Command { at_ns, command } => {
                    assert_eq!(at_ns, self.now_ns, "only the Disabled policy defers a command to later");
                    self.send(Channel::Local(i), Item::Command(command));
                }
                Output::Timer { at_ns, timer } => self.later(at_ns, Timed::Timer(i, timer)),
                // Transfers finish at once: the network has infinite bandwidth.
                Output::StartTransfer { handoff, .. } => {
                    self.send(Channel::Local(i), Item::TransferDone(handoff))
                }
                Output::CancelTransfer { .. } => {}
                Output::StepSoon => self.send(Channel::Local(i), Item::Step),
            }
        }
    }

    fn carry_frontend(&mut self, out: FrontendReady) {
        self.facts.extend(out.facts.into_iter().map(|f| (2, f)));
        for (at_ns, r) in out.timers {
            self.later(at_ns, Timed::Bootstrap(r));
        }
        for (to, m) in out.sends {
            if let ToWorker::StartSource { handoff, .. } = &m {
                self.started = Some(*handoff);
            }
            let to = self.index(to);
            self.send(Channel::FrontendTo(to), Item::Frontend(m));
        }
        self.ended.extend(out.ended);
    }

    /// The channel to serve next: at random among those with something to deliver.
    fn pick(&mut self) -> Option<Channel> {
        let stalled = self.stalled;
        let open: Vec<Channel> = self
            .channels
            .iter()
            .filter(|(c, q)| !q.is_empty() && stalled.map_or(true, |s| **c != Channel::Local(s)))
            .map(|(c, _)| *c)
            .collect();
        let k = match self.rng.as_mut() {
            Some(rng) if !open.is_empty() => rng.random_range(0..open.len()),
            _ => 0,
        };
        open.get(k).copied()
    }

    /// Delivers one item, or advances the clock to the next timed one. False when nothing is
    /// left (a stalled channel's items stay).
    fn advance(&mut self) -> bool {
        if let Some(c) = self.pick() {
            let item =
                self.channels.get_mut(&c).and_then(|q| q.pop_front()).expect("a picked channel has an item");
            self.deliver(c, item);
            return true;
        }
        let Some(((at_ns, _), t)) = self.timed.pop_first() else { return false };
        self.now_ns = at_ns;
        match t {
            Timed::StepDone(i) => {
                let mut r = Ready::default();
                self.nodes[i].finish_step(at_ns, &mut r);
                while self.nodes[i].apply_next_waiting(at_ns, &mut r) {}
                self.carry(i, r);
                self.send(Channel::Local(i), Item::Step);
            }
            Timed::Timer(i, timer) => {
                let mut r = Ready::default();
                self.nodes[i].on_timer(at_ns, timer, &mut r);
                self.carry(i, r);
            }
            Timed::Bootstrap(request) => {
                let mut out = FrontendReady::default();
                self.frontend.on_bootstrap_timer(request, &mut out);
                self.carry_frontend(out);
            }
        }
        true
    }

    fn deliver(&mut self, channel: Channel, item: Item) {
        self.deliveries += 1;
        let now = self.now_ns;
        let mut r = Ready::default();
        match (channel, item) {
            (Channel::ToFrontend(i), Item::Report(m)) => {
                self.reports.push((i, m.clone()));
                let mut out = FrontendReady::default();
                let from = self.nodes[i].id();
                self.frontend.on_worker(now, from, m, &mut out).unwrap();
                self.carry_frontend(out);
                return;
            }
            (Channel::FrontendTo(i), Item::Frontend(m)) => self.nodes[i].on_frontend(now, m, &mut r).unwrap(),
            (Channel::Peer { from, to }, Item::Peer(m)) => {
                if self.lost.contains(&m.handoff) {
                    return;
                }
                if m.generation < self.nodes[from].generation() {
                    self.nodes[to].refuse(m, MessageRejection::StaleGeneration, &mut r);
                } else {
                    self.nodes[to].on_peer(now, m, &mut r);
                    self.delivered.push((to, m));
                    let twice = self.rng.as_mut().is_some_and(|g| g.random_bool(self.duplicate));
                    if twice {
                        self.send(channel, Item::Peer(m));
                    }
                }
                self.carry(to, r);
                return;
            }
            (Channel::Local(i), Item::Command(c)) => self.nodes[i].apply_command(now, c, &mut r).unwrap(),
            (Channel::Local(i), Item::TransferDone(h)) => {
                self.nodes[i].on_transfer_done(now, h, None, &mut r)
            }
            (Channel::Local(i), Item::Step) => return self.step(i),
            (c, item) => panic!("{item:?} on {c:?}"),
        }
        let i = match channel {
            Channel::FrontendTo(i) | Channel::Local(i) => i,
            _ => unreachable!(),
        };
        self.carry(i, r);
    }

    fn step(&mut self, i: usize) {
        loop {
            let mut r = Ready::default();
            let plan = self.nodes[i].start_step(self.now_ns, false, &mut r).unwrap();
            self.carry(i, r);
            match plan {
                StepPlan::Again => continue,
                StepPlan::Until { until_ns } => self.later(until_ns, Timed::StepDone(i)),
                StepPlan::Idle => {}
                StepPlan::Quiet { .. } => panic!("quiet runs were not asked for"),
            }
            return;
        }
    }

    fn run(&mut self) {
        for _ in 0..1_000_000 {
            if !self.advance() {
                return;
            }
        }
        panic!("the network did not settle");
    }

    fn inject(&mut self, fault: Fault, handoff: HandoffId, request: RequestId) {
        let now = self.now_ns;
        match fault {
            Fault::ClientCancel => {
                let mut out = FrontendReady::default();
                self.frontend.abort(now, request, &mut out);
                self.carry_frontend(out);
            }
            Fault::ChannelLoss => {
                self.lost.push(handoff);
                for i in 0..2 {
                    let mut r = Ready::default();
                    self.nodes[i].on_peer_lost(now, handoff, &mut r);
                    self.carry(i, r);
                }
            }
            Fault::RestartSource | Fault::RestartDestination => {
                let i = usize::from(matches!(fault, Fault::RestartDestination));
                let mut r = Ready::default();
                let held = self.nodes[i].restart(now, &mut r);
                self.carry(i, r);
                for h in held {
                    let mut r = Ready::default();
                    self.nodes[1 - i].on_peer_lost(now, h, &mut r);
                    self.carry(1 - i, r);
                }
            }
            Fault::LateCopy => {
                if let Some((to, m)) = self.delivered.first().copied() {
                    let from = 1 - to;
                    self.send(Channel::Peer { from, to }, Item::Peer(m));
                }
            }
        }
    }

    fn handoff(&self) -> HandoffId {
        self.started.expect("the frontend started a handoff")
    }

    fn node_facts(&self) -> impl Iterator<Item = &Fact> {
        self.facts.iter().filter(|(i, _)| *i < 2).map(|(_, f)| f)
    }

    fn position(&self, pred: impl Fn(&Fact) -> bool) -> Option<usize> {
        self.node_facts().position(pred)
    }

    fn count(&self, name: &str) -> usize {
        self.node_facts().filter(|f| f.name() == name).count()
    }

    /// The request ended once, both roles ended exactly once, every booking is free and
    /// neither node holds anything.
    fn assert_settled(&self, label: &str) {
        assert_eq!(self.ended.len(), 1, "{label}: the request ended {} times", self.ended.len());
        assert_eq!(self.frontend.in_flight(), 0, "{label}");
        for n in &self.nodes {
            assert!(n.holds_nothing(), "{label}: {} still holds something", n.id());
            let c = n.core().snapshot();
            assert_eq!(
                (c.pinned_source_blocks, c.reserved_destination_blocks),
                (0, 0),
                "{label}: {}",
                n.id()
            );
            assert!(
                self.frontend.load(n.id()).unwrap().is_zero(),
                "{label}: a booking on {} was never freed",
                n.id()
            );
        }
        for role in [HandoffRole::Source, HandoffRole::Destination] {
            let ends = self
                .reports
                .iter()
                .filter(|(_, m)| matches!(m, ToFrontend::RoleEnded { role: r, .. } if *r == role));
            assert!(ends.count() <= 1, "{label}: the {role:?} role ended more than once");
        }
        assert!(
            self.count("SourcePinned") <= 1 && self.count("SourceReleased") == self.count("SourcePinned"),
            "{label}: pin not ended exactly once"
        );
        assert_eq!(
            self.count("DestinationActivated") + self.count("ReservationReleased"),
            self.count("DestinationReserved"),
            "{label}: reservation not ended exactly once"
        );
        let released_well =
            self.position(|f| matches!(f, Fact::SourceReleased { reason: EndReason::Success, .. }));
        let activated = self.position(|f| matches!(f, Fact::DestinationActivated { .. }));
        if let Some(r) = released_well {
            assert!(
                matches!(activated, Some(a) if a < r),
                "{label}: source released on success before activation"
            );
        }
    }
}

fn request() -> Request {
    Request::unique(RequestId(0), 700, 4, 0)
}

/// One request through the composed runtime, no fault.
fn happy(backend: Backend, seed: Option<u64>) -> Net {
    let mut net = Net::new(backend, seed);
    net.arrive(request());
    net.run();
    let label = format!("{backend:?} seed {seed:?}");
    net.assert_settled(&label);
    assert_eq!(net.ended[0].status, TerminalStatus::Completed, "{label}");
    let order = observed_order(net.node_facts());
    assert_eq!(order, expected_order(policy_of(backend)), "{label}");
    // The frontend heard of every step it books on, from the worker it happened on.
    let said =
        |i: usize, pred: &dyn Fn(&ToFrontend) -> bool| net.reports.iter().any(|(j, m)| *j == i && pred(m));
    assert!(said(0, &|m| matches!(m, ToFrontend::PrefillDispatched { .. })), "{label}");
    assert!(said(0, &|m| matches!(m, ToFrontend::PrefillPinned { .. })), "{label}");
    assert!(said(0, &|m| matches!(m, ToFrontend::SourceReleased { .. })), "{label}");
    assert!(said(1, &|m| matches!(m, ToFrontend::DecodeActivated { .. })), "{label}");
    for (i, role) in [(0, HandoffRole::Source), (1, HandoffRole::Destination)] {
        let well =
            |m: &ToFrontend| matches!(m, ToFrontend::RoleEnded { role: r, success: true, .. } if *r == role);
        assert!(said(i, &well), "{label}: {role:?} did not end well");
    }
    assert!(
        said(1, &|m| matches!(m, ToFrontend::Finished { status: TerminalStatus::Completed, .. })),
        "{label}"
    );
    net
}

#[test]
fn source_first_composed_order_is_pin_reserve_activate_release() {
    let net = happy(Backend::Vllm, None);
    // The source pinned before it heard of the reservation (the decode was routed on the pin).
    let reserved_msg = net
        .position(|f| {
            matches!(
                f,
                Fact::MessageReceived { kind: handoff_ledger::events::MessageKind::DestinationReserved, .. }
            )
        })
        .unwrap();
    let pinned = net.position(|f| matches!(f, Fact::SourcePinned { .. })).unwrap();
    assert!(pinned < reserved_msg);
    assert!(net.reports.iter().any(|(i, m)| *i == 0 && matches!(m, ToFrontend::PrefillPinned { .. })));
}

#[test]
fn destination_first_composed_reserves_before_dispatch() {
    let net = happy(Backend::Sglang, None);
    let reserved = net.position(|f| matches!(f, Fact::DestinationReserved { .. })).unwrap();
    let dispatched = net.position(|f| matches!(f, Fact::PrefillDispatched { .. })).unwrap();
    assert!(reserved < dispatched, "SGLang gate: the prefill ran before the destination was reserved");
}

/// Whether `h`'s source is pinned while its destination waits to reserve.
fn stranded(net: &Net, h: HandoffId) -> bool {
    matches!(net.nodes[0].source_state(h), Some(SourceState::Pinned { .. }))
        && matches!(net.nodes[1].destination_state(h), Some(DestinationState::Reserving))
}

/// vLLM with its decode engine making no progress: run until the one request's source is
/// pinned and its destination waits to reserve (a reservation never applied while the source
/// holds its pin).
fn stranded_net() -> (Net, HandoffId) {
    let mut net = Net::new(Backend::Vllm, None);
    net.stalled = Some(1);
    net.arrive(request());
    let h = net.handoff();
    while !stranded(&net, h) {
        assert!(net.advance(), "the source never pinned with decode stalled");
    }
    (net, h)
}

#[test]
fn source_first_stranded_source_stays_pinned_until_decode_reserves() {
    let (mut net, h) = stranded_net();
    // Time passes, short of the lease: the source keeps its pin.
    while net.timed.first_key_value().is_some_and(|((at, _), _)| *at < LEASE_NS / 2) {
        net.advance();
    }
    assert!(stranded(&net, h), "stranded prefill KV stays pinned");
    assert!(matches!(net.nodes[1].destination_state(h), Some(DestinationState::Reserving)));
    assert!(net.nodes[0].core().snapshot().pinned_source_blocks > 0);
    // Capacity comes back before the lease ends; the handoff completes.
    net.stalled = None;
    net.run();
    net.assert_settled("stranded then freed");
    assert_eq!(net.ended[0].status, TerminalStatus::Completed);
    assert_eq!(net.count("LeaseExpired"), 0);
}

/// A decode worker lost (a live process killed) while a source is pinned for it: the frontend
/// fails the request and tells the source why it lets go — its peer is gone — so the source
/// ends `PeerLost` whether that word or its own link's end comes first.
#[test]
fn a_lost_decode_worker_ends_its_pinned_source_as_peer_lost() {
    let (mut net, h) = stranded_net();
    let mut out = FrontendReady::default();
    let decode = net.nodes[1].id();
    net.frontend.worker_lost(net.now_ns, decode, &mut out);
    let told: Vec<_> = out.sends.iter().map(|(to, m)| (*to, m.clone())).collect();
    assert_eq!(
        told,
        vec![(net.nodes[0].id(), ToWorker::CancelHandoff { handoff: h, reason: CancelReason::PeerLost })]
    );
    net.carry_frontend(out);
    net.stalled = None;
    net.run();
    assert_eq!(net.ended[0].status, TerminalStatus::Failed);
    let source_end = net.facts.iter().find_map(|(i, f)| match f {
        Fact::HandoffCanceled { reason, .. } if *i == 0 => Some(*reason),
        _ => None,
    });
    assert_eq!(source_end, Some(CancelReason::PeerLost));
    assert_eq!(net.nodes[0].core().snapshot().pinned_source_blocks, 0, "the pin is released");
}

#[test]
fn source_first_lease_expiry_while_decode_waits_fails_the_request_and_frees_both_sides() {
    let mut net = Net::new(Backend::Vllm, None);
    net.stalled = Some(1);
    net.arrive(request());
    // Run until the lease timer is the only thing left, and let it fire.
    while net.advance() {
        if net.count("SourceReleased") > 0 {
            break;
        }
    }
    let h = net.handoff();
    assert!(net.nodes[0].source_state(h).is_none(), "the expired source is gone");
    assert!(net.position(|f| matches!(f, Fact::SourceReleased { reason: EndReason::Expired, .. })).is_some());
    // Decode gets going again: the frontend already ended the request and canceled it there.
    net.stalled = None;
    net.run();
    net.assert_settled("lease expired");
    assert_eq!(net.ended[0].status, TerminalStatus::Failed);
}

#[test]
fn a_restart_cancels_every_role_and_names_the_handoffs_for_their_peers() {
    // The source is pinned and decode stalled: the restart must end the pin on its own.
    let mut net = Net::new(Backend::Vllm, None);
    net.stalled = Some(1);
    net.arrive(request());
    let h = net.handoff();
    while !matches!(net.nodes[0].source_state(h), Some(SourceState::Pinned { .. })) {
        assert!(net.advance(), "the source never pinned");
    }
    let mut r = Ready::default();
    let held = net.nodes[0].restart(net.now_ns, &mut r);
    assert_eq!(held, vec![h]);
    assert_eq!(net.nodes[0].generation(), handoff_ledger::ids::Generation(2));
    assert!(matches!(r.facts.first(), Some(Fact::SessionStarted { .. })));
    net.carry(0, r);
    net.stalled = None;
    net.run();
    net.assert_settled("restart");
    assert_ne!(net.ended[0].status, TerminalStatus::Completed);
}

/// One randomized composed run: channels served in a random order, duplicates, and optionally
/// one fault after a random number of deliveries. Panics name the seed.
fn randomized(backend: Backend, seed: u64, fault: Option<Fault>) {
    let mut net = Net::new(backend, Some(seed));
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    net.duplicate = if rng.random_bool(0.5) { 0.3 } else { 0.0 };
    let fault_at = rng.random_range(0..40u64);
    net.arrive(request());
    let label = format!("{backend:?} seed {seed} fault {fault:?} after {fault_at}");
    let mut injected = fault.is_none();
    while net.advance() {
        if !injected && net.deliveries >= fault_at {
            injected = true;
            let h = net.handoff();
            net.inject(fault.unwrap(), h, RequestId(0));
        }
    }
    if !injected {
        // The fault came after the end: it must be harmless.
        let h = net.handoff();
        net.inject(fault.unwrap(), h, RequestId(0));
        net.run();
    }
    net.assert_settled(&label);
    if fault.is_none() {
        assert_eq!(net.ended[0].status, TerminalStatus::Completed, "{label}");
        assert_eq!(observed_order(net.node_facts()), expected_order(policy_of(backend)), "{label}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn randomized_source_first_converges(seed in any::<u64>()) {
        randomized(Backend::Vllm, seed, None);
    }

    #[test]
    fn randomized_destination_first_converges(seed in any::<u64>()) {
        randomized(Backend::Sglang, seed, None);
    }

    #[test]
    fn randomized_faults_release_everything_exactly_once(seed in any::<u64>(), fault in 0usize..5, sglang in any::<bool>()) {
        let backend = if sglang { Backend::Sglang } else { Backend::Vllm };
        randomized(backend, seed, Some(FAULTS[fault]));
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

// ---- One node alone ----

mod one_node {
    use handoff_ledger::events::Fact;
    use handoff_ledger::ids::{Backend, CancelReason, Generation, HandoffPolicy, WorkerId};
    use handoff_ledger::runtime::{HandoffRole, NodeConfig, Output, Ready, ToFrontend, ToWorker, WorkerNode};

    fn config(policy: HandoffPolicy) -> NodeConfig {
        NodeConfig {
            policy,
            lease_ns: super::LEASE_NS,
            reservation_ns: super::RESERVATION_NS,
            renew_ns: None,
            kv_bytes_per_token: 1024,
            publish_kv_events: true,
        }
    }

    use super::{core, request};

    fn handoff() -> handoff_ledger::ids::HandoffId {
        super::support::lifecycle::handoff_id(42)
    }

    #[test]
    fn one_node_alone_answers_each_input_with_the_facts_and_messages_it_owes() {
        let p = WorkerId::prefill(0);
        let mut node = WorkerNode::new(p, core(p, Backend::Vllm), config(HandoffPolicy::SourceFirst));
        let h = handoff();
        // A message for a handoff it has not heard of yet waits for its start (over TCP a peer
        // may answer before the frontend's start arrives), leaving no fact yet.
        let stray = handoff_ledger::lifecycle::HandoffMessage {
            handoff: super::support::lifecycle::handoff_id(43),
            from: WorkerId::decode(0),
            generation: Generation(1),
            body: handoff_ledger::lifecycle::MessageBody::LeaseRenewal,
        };
        let mut r = Ready::default();
        node.on_peer(0, stray, &mut r);
        assert!(r.is_empty() && node.early_messages() == 1, "{r:?}");
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
        // A message for the handoff that ended here is refused as late, at once.
        let late = handoff_ledger::lifecycle::HandoffMessage { handoff: h, ..stray };
        let mut r = Ready::default();
        node.on_peer(8, late, &mut r);
        assert!(matches!(r.facts.as_slice(), [Fact::MessageRejected { .. }]), "{r:?}");
    }
}
