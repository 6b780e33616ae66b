//! `Frontend`: arrivals, prefill and decode selection and booking on both routers, HandoffId
//! minting, the request guards, `max_in_flight`, SGLang's bootstrap timer, and the terminal
//! outcome that frees bookings once and cancels whatever a role still holds.
//!
//! Sans IO like the nodes: it learns what workers did only from their messages
//! ([`ToFrontend`]) and acts on them only by messages ([`ToWorker`]); its own facts go to the
//! router stream. Every input names its instant and returns a [`FrontendReady`].

use super::protocol::{HandoffRole, Peer, ToFrontend, ToWorker};
use super::RuntimeError;
use crate::events::{Fact, KvDelta, TerminalStatus};
use crate::ids::{CancelReason, Generation, HandoffId, HandoffPolicy, IdMint, RequestId, Role, WorkerId};
use crate::model::Request;
use crate::router::{Router, WorkerLoad};
use std::collections::{BTreeMap, BTreeSet};

/// How long a prompt's KV takes to reach decode when nothing reserves it (the Disabled
/// policy's modeled transfer); the driver's transfer model.
pub trait PromptTransferTime {
    fn prompt_transfer_ns(&self, input_tokens: u32) -> u64;
}

#[derive(Clone, Copy, Debug)]
pub struct FrontendConfig {
    pub policy: HandoffPolicy,
    /// Prefill and decode run on separate workers.
    pub disaggregated: bool,
    pub bootstrap_timeout_ns: u64,
    /// Requests in flight at most; arrivals wait beyond it.
    pub max_in_flight: usize,
    pub block_size: u32,
    /// Note each request's first token for latency samples (an autoscaler reads them).
    pub latency_samples: bool,
}

/// A request's first-token and per-token latency, for an autoscaler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatencySample {
    pub ttft_ns: u64,
    /// For more than one output token.
    pub tpot_ns: Option<u64>,
}

/// A request reached its terminal outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestEnded {
    pub request: RequestId,
    pub status: TerminalStatus,
    pub at_ns: u64,
    /// Completed requests that had a first token, when samples are on.
    pub sample: Option<LatencySample>,
}

/// What one frontend input produced.
#[derive(Debug, Default)]
pub struct FrontendReady {
    /// For the router stream, in order.
    pub facts: Vec<Fact>,
    /// Messages to workers, in order.
    pub sends: Vec<(WorkerId, ToWorker)>,
    /// Bootstrap timers to arm: (instant, request).
    pub timers: Vec<(u64, RequestId)>,
    pub ended: Vec<RequestEnded>,
}

/// Where a request in flight is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub handoff: Option<HandoffId>,
    pub prefill: Option<WorkerId>,
    pub decode: Option<WorkerId>,
}

/// The frontend's request guard.
struct Guard {
    request: Request,
    placement: Placement,
    activated: bool,
    /// The outcome to report if the handoff ends without activation (a core refusal reads as
    /// `rejected`, not `failed`).
    fail_status: Option<TerminalStatus>,
    arrival_ns: u64,
    first_token_ns: Option<u64>,
}

/// What the frontend knows of one handoff from its workers' messages.
#[derive(Clone, Copy, Debug)]
struct HandoffTrack {
    request: RequestId,
    source_held: bool,
    destination_held: bool,
    /// Dispatched to the source's core and neither pinned nor ended there.
    computing: bool,
    /// The source pin is held.
    pinned: bool,
}

pub struct Frontend {
    config: FrontendConfig,
    prefill_router: Router,
    /// `None` when aggregated: the prefill router books decode too.
    decode_router: Option<Router>,
    guards: BTreeMap<RequestId, Guard>,
    handoffs: BTreeMap<HandoffId, HandoffTrack>,
    /// Each request's handoffs still tracked: a pin released after its request ended finds
    /// them here instead of scanning every handoff.
    request_handoffs: BTreeMap<RequestId, BTreeSet<HandoffId>>,
    generations: BTreeMap<WorkerId, Generation>,
    mint: IdMint,
    transfer: Box<dyn PromptTransferTime>,
    /// Handoffs whose destination was asked to withdraw: the decode worker each is to move to,
    /// and whether it has moved. Kept until the handoff is forgotten, so none moves twice
    /// (two workers joining at one instant would otherwise pass it between them).
    reroutes: BTreeMap<HandoffId, (WorkerId, bool)>,
}

fn router_error(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError(e.to_string())
}

impl Frontend {
    pub fn new(
        config: FrontendConfig,
        prefill_router: Router,
        decode_router: Option<Router>,
        mint: IdMint,
        transfer: Box<dyn PromptTransferTime>,
    ) -> Self {
        Frontend {
            config,
            prefill_router,
            decode_router,
            guards: BTreeMap::new(),
            handoffs: BTreeMap::new(),
            request_handoffs: BTreeMap::new(),
            reroutes: BTreeMap::new(),
            generations: BTreeMap::new(),
            mint,
            transfer,
        }
    }

    /// The router stream's session begins.
    pub fn start(&mut self, out: &mut FrontendReady) {
        out.facts.push(Fact::SessionStarted { generation: Generation(1) });
    }

    /// Whether another request may start (`max_in_flight`).
    pub fn can_admit(&self) -> bool {
        self.guards.len() < self.config.max_in_flight
    }

    pub fn in_flight(&self) -> usize {
        self.guards.len()
    }

    pub fn placement(&self, request: RequestId) -> Option<Placement> {
        self.guards.get(&request).map(|g| g.placement)
    }

    /// Every request in flight and where it is, in request order.
    pub fn placements(&self) -> impl Iterator<Item = (RequestId, Placement)> + '_ {
        self.guards.iter().map(|(r, g)| (*r, g.placement))
    }

    /// The request a tracked handoff belongs to.
    pub fn request_of(&self, handoff: HandoffId) -> Option<RequestId> {
        self.handoffs.get(&handoff).map(|t| t.request)
    }

    /// A worker's booked load on its router.
    pub fn load(&self, worker: WorkerId) -> Option<WorkerLoad> {
        self.router(worker.role).map(|r| r.load(worker))
    }

    /// A worker joins its role's router.
    pub fn add_worker(&mut self, worker: WorkerId) -> Result<(), RuntimeError> {
        self.router_mut(worker.role)?.add_worker(worker).map_err(router_error)
    }

    /// A decode worker joined with `capacity_blocks` (source-first): destinations still waiting
    /// on other decode workers (oldest request first) are asked to withdraw and move to it, as
    /// many as its capacity holds beside what is booked there already. Each that was still
    /// waiting answers [`ToFrontend::DestinationWithdrawn`] and is routed here; one already
    /// reserved ignores the request. Without this a source pinned before the join would wait for
    /// its old destination while the new worker sits idle.
    pub fn decode_joined(&mut self, worker: WorkerId, capacity_blocks: u32, out: &mut FrontendReady) {
        if self.config.policy != HandoffPolicy::SourceFirst || worker.role != Role::Decode {
            return;
        }
        let mut room =
            u64::from(capacity_blocks).saturating_sub(self.load(worker).map_or(0, |l| l.booked_blocks()));
        for g in self.guards.values() {
            let (Some(h), Some(d)) = (g.placement.handoff, g.placement.decode) else { continue };
            if d == worker || g.activated || self.reroutes.contains_key(&h) {
                continue;
            }
            if !self.handoffs.get(&h).is_some_and(|t| t.pinned && t.destination_held) {
                continue;
            }
            let demand = u64::from(self.decode_blocks(&g.request));
            if demand > room {
                break;
            }
            room -= demand;
            self.reroutes.insert(h, (worker, false));
            out.sends.push((d, ToWorker::WithdrawDestination { handoff: h }));
        }
    }

    /// Blocks a decode booking holds for `request` (prompt and output).
    fn decode_blocks(&self, request: &Request) -> u32 {
        (request.input_tokens + request.output_tokens).div_ceil(self.config.block_size)
    }

    /// The destination on `from` withdrew: the decode booking moves to the worker chosen at the
    /// join and the destination starts there, reading from the same pinned source.
    fn destination_withdrawn(
        &mut self,
        at_ns: u64,
        from: WorkerId,
        handoff: HandoffId,
        out: &mut FrontendReady,
    ) -> Result<(), RuntimeError> {
        let target = match self.reroutes.get_mut(&handoff) {
            Some((to, moved)) if !*moved => {
                *moved = true;
                Some(*to)
            }
            _ => None,
        };
        let request = self.request_of(handoff);
        let moving = request.and_then(|r| self.guards.get(&r)).filter(|g| {
            g.placement.decode == Some(from) && g.placement.handoff == Some(handoff) && !g.activated
        });
        let (Some(target), Some(g)) = (target, moving) else {
            // Nothing to move it to (the request ended meanwhile): an ordinary end of the role.
            self.role_ended(at_ns, handoff, HandoffRole::Destination, false, false, out);
            return Ok(());
        };
        let (id, req, source) = (g.request.id, g.request.clone(), g.placement.prefill);
        let Some(source) = source else {
            return Err(RuntimeError(format!(
                "{handoff}: a destination withdrew from a handoff with no source"
            )));
        };
        let blocks = self.decode_blocks(&req);
        let router = self.decode_router.as_mut().ok_or_else(|| RuntimeError("no decode router".into()))?;
        out.facts.extend(router.free_decode(id, TerminalStatus::Canceled));
        out.facts.push(router.book_decode(id, target, blocks).map_err(router_error)?);
        if let Some(g) = self.guards.get_mut(&id) {
            g.placement.decode = Some(target);
        }
        let source = Peer { worker: source, generation: self.generation_of(source) };
        out.sends.push((target, ToWorker::StartDestination { handoff, request: req, source }));
        Ok(())
    }

    /// A worker leaves routing (it finishes what it holds).
    pub fn remove_worker(&mut self, worker: WorkerId) -> Result<(), RuntimeError> {
        self.router_mut(worker.role)?.remove_worker(worker).map_err(router_error)
    }

    fn router(&self, role: Role) -> Option<&Router> {
        match role {
            Role::Decode => self.decode_router.as_ref(),
            _ => Some(&self.prefill_router),
        }
    }

    fn router_mut(&mut self, role: Role) -> Result<&mut Router, RuntimeError> {
        match role {
            Role::Decode => {
                self.decode_router.as_mut().ok_or_else(|| RuntimeError("no decode router".into()))
            }
            _ => Ok(&mut self.prefill_router),
        }
    }

    fn generation_of(&self, worker: WorkerId) -> Generation {
        self.generations.get(&worker).copied().unwrap_or(Generation(1))
    }

    // ---- arrivals ----

    /// A request arrives: the router stream records it, the prefill router picks and books a
    /// worker, and the request starts there, with a handoff or (Disabled) without.
    pub fn on_arrival(
        &mut self,
        at_ns: u64,
        request: Request,
        out: &mut FrontendReady,
    ) -> Result<(), RuntimeError> {
        let id = request.id;
        out.facts.push(Fact::RequestArrived {
            request: id,
            input_tokens: request.input_tokens,
            output_tokens: request.output_tokens,
        });
        let prompt_blocks = request.input_tokens.div_ceil(self.config.block_size);
        let p = self.prefill_router.select(&request).worker;
        let booked = self
            .prefill_router
            .book_prefill(id, p, request.input_tokens, prompt_blocks)
            .map_err(router_error)?;
        out.facts.push(booked);
        if self.config.policy == HandoffPolicy::Disabled {
            self.start_without_handoff(at_ns, request, p, out)
        } else {
            self.start_handoff(at_ns, request, p, out)
        }
    }

    /// The Disabled policy, the behaviour before the lifecycle: nothing is pinned or reserved.
    /// Disaggregated, a one-token prefill frees its KV as it finishes and decode follows (see
    /// `prefill_finished`); aggregated, the same worker prefills and decodes.
    fn start_without_handoff(
        &mut self,
        at_ns: u64,
        request: Request,
        p: WorkerId,
        out: &mut FrontendReady,
    ) -> Result<(), RuntimeError> {
        let id = request.id;
        let mut guard = Guard::new(request.clone(), None, p, at_ns);
        if self.config.disaggregated {
            self.guards.insert(id, guard);
            let prefill = Request { output_tokens: 1, ..request };
            out.sends.push((p, ToWorker::Submit { request: prefill }));
            return Ok(());
        }
        let total_blocks = (request.input_tokens + request.output_tokens).div_ceil(self.config.block_size);
        let booked = self.prefill_router.book_decode(id, p, total_blocks).map_err(router_error)?;
        out.facts.push(booked);
        guard.placement.decode = Some(p);
        self.guards.insert(id, guard);
        out.sends.push((p, ToWorker::Submit { request }));
        Ok(())
    }

    /// A handoff starts for a request booked on prefill worker `p`: a HandoffId is minted and
    /// the guard kept. Destination-first (SGLang) routes and books the decode now, starts its
    /// destination and arms the bootstrap timer; source-first routes decode once the prefill is
    /// pinned.
    fn start_handoff(
        &mut self,
        at_ns: u64,
        request: Request,
        p: WorkerId,
        out: &mut FrontendReady,
    ) -> Result<(), RuntimeError> {
        let id = request.id;
        let handoff = self.mint.handoff_id();
        let mut guard = Guard::new(request.clone(), Some(handoff), p, at_ns);
        let mut destination = None;
        if self.config.policy == HandoffPolicy::DestinationFirst {
            // SGLang: the decode is chosen (and booked) together with the prefill.
            let d = self.route_decode(id, &request, out)?;
            guard.placement.decode = Some(d);
            destination = Some(d);
            out.timers.push((at_ns.saturating_add(self.config.bootstrap_timeout_ns), id));
        }
        self.guards.insert(id, guard);
        self.track(handoff, id, destination.is_some());
        let source = Peer { worker: p, generation: self.generation_of(p) };
        let destination = destination.map(|d| Peer { worker: d, generation: self.generation_of(d) });
        if let Some(d) = destination {
            let start = ToWorker::StartDestination { handoff, request: request.clone(), source };
            out.sends.push((d.worker, start));
        }
        out.sends.push((p, ToWorker::StartSource { handoff, request, destination }));
        Ok(())
    }

    fn track(&mut self, handoff: HandoffId, request: RequestId, destination_held: bool) {
        let track =
            HandoffTrack { request, source_held: true, destination_held, computing: false, pinned: false };
        self.handoffs.insert(handoff, track);
        self.request_handoffs.entry(request).or_default().insert(handoff);
    }

    /// The decode router picks and books a decode worker.
    fn route_decode(
        &mut self,
        id: RequestId,
        request: &Request,
        out: &mut FrontendReady,
    ) -> Result<WorkerId, RuntimeError> {
        let total_blocks = (request.input_tokens + request.output_tokens).div_ceil(self.config.block_size);
        let router = self.decode_router.as_mut().ok_or_else(|| RuntimeError("no decode router".into()))?;
        let d = router.select(request).worker;
        out.facts.push(router.book_decode(id, d, total_blocks).map_err(router_error)?);
        Ok(d)
    }

    // ---- what workers say ----

    pub fn on_worker(
        &mut self,
        at_ns: u64,
        from: WorkerId,
        message: ToFrontend,
        out: &mut FrontendReady,
    ) -> Result<(), RuntimeError> {
        match message {
            ToFrontend::SessionStarted { generation } => {
                let previous = self.generations.insert(from, generation);
                if previous.is_some_and(|p| p < generation) {
                    self.session_reset(at_ns, from, CancelReason::RequestAborted, out);
                    // A worker lost (and left out of routing) is back: a new process under
                    // this session, its KV index empty until its own facts fill it.
                    if let Ok(router) = self.router_mut(from.role) {
                        if !router.workers().contains(&from) {
                            router.add_worker(from).map_err(router_error)?;
                        }
                    }
                }
            }
            ToFrontend::KvChanged { fact } => {
                self.prefill_router.observe(from, &fact);
                if let Some(d) = self.decode_router.as_mut() {
                    d.observe(from, &fact);
                }
            }
            ToFrontend::PrefillDispatched { handoff } => {
                if let Some(t) = self.handoffs.get_mut(&handoff) {
                    t.computing = true;
                }
            }
            ToFrontend::PrefillPinned { handoff, request } => {
                self.prefill_pinned(at_ns, from, handoff, request, out)?
            }
            ToFrontend::PrefillLeftCore { handoff } => self.prefill_left_core(handoff, out),
            ToFrontend::SourceReleased { handoff } => self.source_released(handoff, out),
            ToFrontend::FirstToken { request } => self.first_token(at_ns, from, request, out),
            ToFrontend::PrefillFinished { request } => self.prefill_finished(at_ns, request, out)?,
            ToFrontend::DecodeActivated { handoff } => {
                if let Some(g) = self.request_of(handoff).and_then(|r| self.guards.get_mut(&r)) {
                    g.activated = true;
                }
            }
            ToFrontend::RoleEnded { handoff, role, success, refused } => {
                self.role_ended(at_ns, handoff, role, success, refused, out)
            }
            ToFrontend::Finished { request, status, output_tokens } => {
                self.terminal(at_ns, request, status, output_tokens, out)
            }
            ToFrontend::Rejected { request } => {
                self.terminal(at_ns, request, TerminalStatus::Rejected, 0, out)
            }
            ToFrontend::DestinationWithdrawn { handoff } => {
                self.destination_withdrawn(at_ns, from, handoff, out)?
            }
        }
        Ok(())
    }

    /// The prefill is done and pinned: its compute booking ends, and source-first routes the
    /// decode now and starts its destination.
    fn prefill_pinned(
        &mut self,
        _at_ns: u64,
        from: WorkerId,
        handoff: HandoffId,
        request: RequestId,
        out: &mut FrontendReady,
    ) -> Result<(), RuntimeError> {
        if let Some(t) = self.handoffs.get_mut(&handoff) {
            t.computing = false;
            t.pinned = true;
        }
        if let Some(f) = self.prefill_router.prefill_compute_done(request) {
            out.facts.push(f);
        }
        let needs_route = self.guards.get(&request).is_some_and(|g| g.placement.decode.is_none());
        if !needs_route || self.config.policy != HandoffPolicy::SourceFirst {
            return Ok(());
        }
        let req = self.guards[&request].request.clone();
        let d = self.route_decode(request, &req, out)?;
        if let Some(g) = self.guards.get_mut(&request) {
            g.placement.decode = Some(d);
        }
        if let Some(t) = self.handoffs.get_mut(&handoff) {
            t.destination_held = true;
        }
        let source = Peer { worker: from, generation: self.generation_of(from) };
        out.sends.push((d, ToWorker::StartDestination { handoff, request: req, source }));
        Ok(())
    }

    /// A dispatched prefill the core let go of without a pin: the prefill booking of a request
    /// that already ended is freed now.
    fn prefill_left_core(&mut self, handoff: HandoffId, out: &mut FrontendReady) {
        let Some(t) = self.handoffs.get_mut(&handoff) else { return };
        t.computing = false;
        let request = t.request;
        if !self.guards.contains_key(&request) {
            if let Some(f) = self.prefill_router.free_prefill(request) {
                out.facts.push(f);
            }
        }
        self.forget(handoff);
    }

    /// The source pin's release: the prefill booking is freed (bookings follow physical pins)
    /// and the correlation dropped once nothing holds it.
    fn source_released(&mut self, handoff: HandoffId, out: &mut FrontendReady) {
        let Some(t) = self.handoffs.get_mut(&handoff) else { return };
        t.pinned = false;
        let request = t.request;
        if let Some(f) = self.prefill_router.free_prefill(request) {
            out.facts.push(f);
        }
        if let Some(h) = self.guards.get(&request).and_then(|g| g.placement.handoff) {
            self.forget(h);
        } else {
            let all: Vec<HandoffId> =
                self.request_handoffs.get(&request).map(|s| s.iter().copied().collect()).unwrap_or_default();
            for h in all {
                self.forget(h);
            }
        }
    }

    fn first_token(&mut self, at_ns: u64, from: WorkerId, request: RequestId, out: &mut FrontendReady) {
        // The user's first token comes from decode (a prefill worker's is its own).
        if self.config.latency_samples && from.role != Role::Prefill {
            if let Some(g) = self.guards.get_mut(&request) {
                g.first_token_ns.get_or_insert(at_ns);
            }
        }
        // Aggregated: prefill compute ends with the first token.
        if self.config.policy == HandoffPolicy::Disabled {
            if let Some(f) = self.prefill_router.prefill_compute_done(request) {
                out.facts.push(f);
            }
        }
    }

    /// Disabled policy: the prefill finished and freed its KV (its booking goes with it); the
    /// decode router picks and books a worker, which gets the request once the whole prompt's
    /// modeled transfer time has passed — no reservation holds capacity for it meanwhile.
    fn prefill_finished(
        &mut self,
        at_ns: u64,
        request: RequestId,
        out: &mut FrontendReady,
    ) -> Result<(), RuntimeError> {
        if let Some(f) = self.prefill_router.free_prefill(request) {
            out.facts.push(f);
        }
        let Some(req) = self.guards.get(&request).map(|g| g.request.clone()) else {
            return Ok(());
        };
        let d = self.route_decode(request, &req, out)?;
        if let Some(g) = self.guards.get_mut(&request) {
            g.placement.decode = Some(d);
        }
        let kv_ready_at_ns = at_ns.saturating_add(self.transfer.prompt_transfer_ns(req.input_tokens));
        out.sends.push((d, ToWorker::SubmitPrefilled { request: req, kv_ready_at_ns }));
        Ok(())
    }

    /// A role of a handoff ended: a failed source, or any destination, ends the request unless
    /// decode already runs (rejected when a core refused it, failed otherwise).
    fn role_ended(
        &mut self,
        at_ns: u64,
        handoff: HandoffId,
        role: HandoffRole,
        success: bool,
        refused: bool,
        out: &mut FrontendReady,
    ) {
        let Some(t) = self.handoffs.get_mut(&handoff) else { return };
        match role {
            HandoffRole::Source => t.source_held = false,
            HandoffRole::Destination => t.destination_held = false,
        }
        let request = t.request;
        if refused {
            if let Some(g) = self.guards.get_mut(&request) {
                g.fail_status = Some(TerminalStatus::Rejected);
            }
        }
        if role == HandoffRole::Destination || !success {
            self.fail_unless_activated(at_ns, request, CancelReason::RequestAborted, out);
        }
        self.forget(handoff);
    }

    /// A worker came back under a new session, or was lost: every role the frontend still
    /// believes is on it (one whose start was lost with the old session's connection) ended
    /// there, failed, and the other role of each is told `why` it lets go.
    fn session_reset(&mut self, at_ns: u64, worker: WorkerId, why: CancelReason, out: &mut FrontendReady) {
        let mut lost = Vec::new();
        for (h, t) in &self.handoffs {
            let Some(p) = self.guards.get(&t.request).map(|g| g.placement) else { continue };
            if t.source_held && p.prefill == Some(worker) {
                lost.push((*h, HandoffRole::Source));
            }
            if t.destination_held && p.decode == Some(worker) {
                lost.push((*h, HandoffRole::Destination));
            }
        }
        for (h, role) in lost {
            let Some(t) = self.handoffs.get_mut(&h) else { continue };
            // The old session's core held nothing for it any more either.
            match role {
                HandoffRole::Source => (t.source_held, t.computing) = (false, false),
                HandoffRole::Destination => t.destination_held = false,
            }
            let request = t.request;
            self.fail_unless_activated(at_ns, request, why, out);
            self.forget(h);
        }
    }

    /// A worker's process is gone without a word (it died, or its link broke off): every role
    /// the frontend believes is on it ended there, failed; every request decoding there fails;
    /// and routing leaves it out (while another worker of its role is left) until it comes
    /// back under a new session. Its peers reclaim their side themselves.
    pub fn worker_lost(&mut self, at_ns: u64, worker: WorkerId, out: &mut FrontendReady) {
        self.session_reset(at_ns, worker, CancelReason::PeerLost, out);
        let decoding: Vec<RequestId> = self
            .guards
            .iter()
            .filter(|(_, g)| {
                g.placement.decode == Some(worker)
                    || (g.placement.handoff.is_none() && g.placement.prefill == Some(worker))
            })
            .map(|(r, _)| *r)
            .collect();
        // The surviving role of each is told the cause: its peer is gone (as its own link
        // would tell it, whichever comes first).
        for request in decoding {
            self.terminal_because(at_ns, request, TerminalStatus::Failed, 0, CancelReason::PeerLost, out);
        }
        if let Ok(router) = self.router_mut(worker.role) {
            // The last worker of a role stays: requests routed to it fail at once instead.
            let _ = router.remove_worker(worker);
        }
    }

    fn fail_unless_activated(
        &mut self,
        at_ns: u64,
        request: RequestId,
        why: CancelReason,
        out: &mut FrontendReady,
    ) {
        let Some(g) = self.guards.get(&request) else { return };
        if g.activated {
            return;
        }
        let status = g.fail_status.unwrap_or(TerminalStatus::Failed);
        self.terminal_because(at_ns, request, status, 0, why, out)
    }

    /// Drops the correlation once no role holds the handoff and its request ended.
    fn forget(&mut self, handoff: HandoffId) {
        let Some(t) = self.handoffs.get(&handoff) else { return };
        if t.source_held
            || t.destination_held
            || t.pinned
            || t.computing
            || self.guards.contains_key(&t.request)
        {
            return;
        }
        let request = t.request;
        self.handoffs.remove(&handoff);
        self.reroutes.remove(&handoff);
        if let Some(set) = self.request_handoffs.get_mut(&request) {
            set.remove(&handoff);
            if set.is_empty() {
                self.request_handoffs.remove(&request);
            }
        }
    }

    // ---- timers and aborts ----

    /// SGLang's bootstrap timeout: the prefill worker gives up if its source still waits for
    /// its destination.
    pub fn on_bootstrap_timer(&mut self, request: RequestId, out: &mut FrontendReady) {
        let Some(g) = self.guards.get(&request) else { return };
        if let (Some(handoff), Some(p)) = (g.placement.handoff, g.placement.prefill) {
            out.sends.push((p, ToWorker::BootstrapExpired { handoff }));
        }
    }

    /// The client gave up: the request ends canceled and both roles cancel.
    pub fn abort(&mut self, at_ns: u64, request: RequestId, out: &mut FrontendReady) {
        self.terminal(at_ns, request, TerminalStatus::Canceled, 0, out);
    }

    /// The request's terminal outcome: the guard frees its bookings exactly once, and a role
    /// still holding the handoff is told to let go (the request was aborted).
    fn terminal(
        &mut self,
        at_ns: u64,
        request: RequestId,
        status: TerminalStatus,
        output_tokens: u32,
        out: &mut FrontendReady,
    ) {
        self.terminal_because(at_ns, request, status, output_tokens, CancelReason::RequestAborted, out)
    }

    /// [`Frontend::terminal`], telling a role that still holds the handoff `why` it lets go.
    fn terminal_because(
        &mut self,
        at_ns: u64,
        request: RequestId,
        status: TerminalStatus,
        output_tokens: u32,
        why: CancelReason,
        out: &mut FrontendReady,
    ) {
        let Some(g) = self.guards.remove(&request) else {
            return;
        };
        let sample = match (status, g.first_token_ns) {
            (TerminalStatus::Completed, Some(first)) => {
                let ttft_ns = first.saturating_sub(g.arrival_ns);
                let tpot_ns =
                    (output_tokens > 1).then(|| at_ns.saturating_sub(first) / u64::from(output_tokens - 1));
                Some(LatencySample { ttft_ns, tpot_ns })
            }
            _ => None,
        };
        if let Some(f) = self.prefill_router.prefill_compute_done(request) {
            out.facts.push(f);
        }
        // A pinned source keeps its prefill booking until it is released; a prefill the core
        // still computes keeps it until the core ends or releases it.
        let track = g.placement.handoff.and_then(|h| self.handoffs.get(&h).copied());
        if !track.is_some_and(|t| t.pinned || t.computing) {
            if let Some(f) = self.prefill_router.free_prefill(request) {
                out.facts.push(f);
            }
        }
        // Aggregated serving books decode on its one router.
        let decode_router = match self.decode_router.as_mut() {
            Some(r) => r,
            None => &mut self.prefill_router,
        };
        if let Some(f) = decode_router.free_decode(request, status) {
            out.facts.push(f);
        }
        out.facts.push(Fact::RequestFinished { request, status, output_tokens, kv: KvDelta::ZERO });
        if let (Some(h), Some(t)) = (g.placement.handoff, track) {
            if status != TerminalStatus::Completed {
                let cancel = ToWorker::CancelHandoff { handoff: h, reason: why };
                if let (true, Some(p)) = (t.source_held, g.placement.prefill) {
                    out.sends.push((p, cancel.clone()));
                }
                if let (true, Some(d)) = (t.destination_held, g.placement.decode) {
                    out.sends.push((d, cancel));
                }
            }
            self.forget(h);
        }
        out.ended.push(RequestEnded {
            request,
            status,
            at_ns,
            sample: sample.filter(|_| self.config.latency_samples),
        });
    }
}

impl Guard {
    /// A request that arrived at `arrival_ns` and was booked on prefill worker `prefill`.
    fn new(request: Request, handoff: Option<HandoffId>, prefill: WorkerId, arrival_ns: u64) -> Self {
        Guard {
            request,
            placement: Placement { handoff, prefill: Some(prefill), decode: None },
            activated: false,
            fail_status: None,
            arrival_ns,
            first_token_ns: None,
        }
    }
}
