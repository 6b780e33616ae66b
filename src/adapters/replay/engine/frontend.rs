//! The frontend: arrivals from the workload, prefill and decode selection and booking on both
//! routers, HandoffId minting, the request guards, `max_in_flight`, SGLang's bootstrap timer,
//! and the terminal outcome that frees bookings once and cancels whatever a role still holds.

use super::simulator::{arm, Event};
use super::worker::Command;
use super::{Replay, ReplayError, NS_PER_MS};
use crate::adapters::replay::transfer::TransferModel;
use crate::events::{Fact, TerminalStatus};
use crate::ids::{CancelReason, HandoffId, HandoffPolicy, KvHandoffDemand, RequestId, WorkerId};
use crate::lifecycle::destination::{
    DestinationConfig, DestinationEvent, DestinationHandoff, DestinationInit,
};
use crate::lifecycle::source::{SourceConfig, SourceEvent, SourceHandoff, SourceInit};
use crate::schedulers::Request;

/// The frontend's request guard.
pub(super) struct Guard {
    pub(super) request: Request,
    pub(super) handoff: Option<HandoffId>,
    pub(super) prefill: Option<usize>,
    pub(super) decode: Option<usize>,
    pub(super) activated: bool,
    /// The outcome to report if the handoff ends without activation (set before the role
    /// machine is told why, so a refusal reads as `rejected`, not `failed`).
    pub(super) fail_status: Option<TerminalStatus>,
    /// For the planner's samples: arrival, and the user's first token (from a decode or
    /// aggregated worker; only noted while a planner runs).
    arrival_ns: u64,
    pub(super) first_token_ns: Option<u64>,
}

impl Guard {
    /// A request that arrived at `arrival_ns` and was booked on prefill slot `prefill`.
    fn new(request: Request, handoff: Option<HandoffId>, prefill: usize, arrival_ns: u64) -> Self {
        Guard {
            request,
            handoff,
            prefill: Some(prefill),
            decode: None,
            activated: false,
            fail_status: None,
            arrival_ns,
            first_token_ns: None,
        }
    }
}

impl Replay<'_> {
    pub(super) fn emit_router(&mut self, at_ns: u64, fact: Fact) -> Result<(), ReplayError> {
        self.last_progress_ns = at_ns;
        self.sink.push(WorkerId::ROUTER, at_ns, fact)
    }

    /// Queues an `Arrival` for the workload's next due request, unless one is queued for that
    /// instant or earlier already.
    pub(super) fn arm_arrival(&mut self) {
        let due = self.workload.next_due_ns();
        arm(&mut self.queue, &mut self.arrival_armed_ns, self.now_ns, due, Event::Arrival);
    }

    /// The workload's next due request arrives (unless `max_in_flight` holds it back): the
    /// router stream records it, the prefill router picks and books a worker, and the request
    /// starts there, with a handoff or (the Disabled policy) without.
    pub(super) fn on_arrival(&mut self) -> Result<(), ReplayError> {
        let now = self.now_ns;
        if self.arrival_armed_ns == Some(now) {
            self.arrival_armed_ns = None;
        }
        if self.guards.len() >= self.cfg.max_in_flight {
            self.held_back = true;
            return Ok(());
        }
        let Some(t) = self.workload.pop_due(now)? else {
            self.arm_arrival();
            return Ok(());
        };
        let request = t.to_request();
        self.arrivals += 1;
        self.arm_arrival();
        let id = request.id;
        self.emit_router(
            now,
            Fact::RequestArrived {
                request: id,
                input_tokens: request.input_tokens,
                output_tokens: request.output_tokens,
            },
        )?;
        let prompt_blocks = request.input_tokens.div_ceil(self.block_size);
        let p = self.prefill_router.select(&request).worker;
        let booked = self
            .prefill_router
            .book_prefill(id, p, request.input_tokens, prompt_blocks)
            .map_err(|e| ReplayError::Engine(e.to_string()))?;
        self.emit_router(now, booked)?;
        let p_slot = self.slot_of(p);
        if self.policy == HandoffPolicy::Disabled {
            self.start_without_handoff(request, p, p_slot)
        } else {
            self.start_handoff(request, p, p_slot)
        }
    }

    /// The Disabled policy, the behaviour before the lifecycle: nothing is pinned or reserved.
    /// Disaggregated, a one-token prefill frees its KV as it finishes and decode follows (see
    /// `prefill_finished_unpinned`); aggregated, the same worker prefills and decodes.
    fn start_without_handoff(
        &mut self,
        request: Request,
        p: WorkerId,
        p_slot: usize,
    ) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let id = request.id;
        if self.cfg.is_disaggregated() {
            self.guards.insert(id, Guard::new(request.clone(), None, p_slot, now));
            let prefill = Request { output_tokens: 1, ..request };
            self.push(
                now,
                Event::Command { slot: p_slot, command: Command::Submit(prefill), then: Vec::new() },
            );
            return Ok(());
        }
        let total_blocks = (request.input_tokens + request.output_tokens).div_ceil(self.block_size);
        let booked = self
            .prefill_router
            .book_decode(id, p, total_blocks)
            .map_err(|e| ReplayError::Engine(e.to_string()))?;
        self.emit_router(now, booked)?;
        let guard = Guard { decode: Some(p_slot), ..Guard::new(request.clone(), None, p_slot, now) };
        self.guards.insert(id, guard);
        self.push(now, Event::Command { slot: p_slot, command: Command::Submit(request), then: Vec::new() });
        Ok(())
    }

    /// A handoff starts for a request booked on prefill worker `p`: a HandoffId is minted, the
    /// guard is kept, and the source machine is made on `p` and started. Destination-first
    /// (SGLang) routes and books the decode now, starts its destination machine and arms the
    /// bootstrap timer; source-first routes decode once the prefill is pinned.
    fn start_handoff(&mut self, request: Request, p: WorkerId, p_slot: usize) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let id = request.id;
        let handoff = self.mint.handoff_id();
        self.handoff_request.insert(handoff, id);
        self.request_handoffs.entry(id).or_default().insert(handoff);
        let demand = KvHandoffDemand {
            context_tokens: request.input_tokens,
            max_output_tokens: request.output_tokens,
        };
        let mut guard = Guard::new(request.clone(), Some(handoff), p_slot, now);
        let mut dest = None;
        if self.policy == HandoffPolicy::DestinationFirst {
            // SGLang: the decode is chosen (and booked) together with the prefill.
            let d_slot = self.route_decode(id, &request)?;
            guard.decode = Some(d_slot);
            dest = Some(d_slot);
            self.push(
                now.saturating_add(self.cfg.bootstrap_timeout_ms * NS_PER_MS),
                Event::BootstrapTimer { request: id },
            );
        }
        self.guards.insert(id, guard);
        let source = SourceHandoff::new(SourceInit {
            handoff,
            request: id,
            policy: self.policy,
            demand,
            worker: p,
            generation: self.slots[p_slot].generation,
            destination: dest.map(|d| self.slots[d].id),
            destination_generation: dest.map(|d| self.slots[d].generation),
            config: SourceConfig {
                lease_ns: self.cfg.lease_ms * NS_PER_MS,
                renew_ns: self.cfg.lease_ms * NS_PER_MS,
            },
        })
        .map_err(|e| ReplayError::Engine(e.to_string()))?;
        let facts = source.start_facts();
        self.emit_all(p_slot, now, facts)?;
        self.slots[p_slot].sources.insert(handoff, source);
        if let Some(d_slot) = dest {
            self.start_destination(d_slot, handoff, &request, p_slot)?;
        }
        self.source_event(p_slot, handoff, SourceEvent::Start)?;
        Ok(())
    }

    /// The decode router picks and books a decode worker.
    pub(super) fn route_decode(&mut self, id: RequestId, request: &Request) -> Result<usize, ReplayError> {
        let now = self.now_ns;
        let total_blocks = (request.input_tokens + request.output_tokens).div_ceil(self.block_size);
        let router =
            self.decode_router.as_mut().ok_or_else(|| ReplayError::Engine("no decode router".into()))?;
        let d = router.select(request).worker;
        let booked =
            router.book_decode(id, d, total_blocks).map_err(|e| ReplayError::Engine(e.to_string()))?;
        self.emit_router(now, booked)?;
        Ok(self.slot_of(d))
    }

    pub(super) fn start_destination(
        &mut self,
        d_slot: usize,
        handoff: HandoffId,
        request: &Request,
        p_slot: usize,
    ) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let d = self.slots[d_slot].id;
        let dest = DestinationHandoff::new(DestinationInit {
            handoff,
            request: request.id,
            policy: self.policy,
            demand: KvHandoffDemand {
                context_tokens: request.input_tokens,
                max_output_tokens: request.output_tokens,
            },
            worker: d,
            generation: self.slots[d_slot].generation,
            source: Some(self.slots[p_slot].id),
            source_generation: Some(self.slots[p_slot].generation),
            config: DestinationConfig {
                reservation_ns: self.cfg.reservation_timeout_ms * NS_PER_MS,
                kv_bytes_per_token: self.cfg.transfer.kv_bytes_per_token(),
            },
        })
        .map_err(|e| ReplayError::Engine(e.to_string()))?;
        let facts = dest.start_facts();
        self.emit_all(d_slot, now, facts)?;
        self.slots[d_slot].destinations.insert(handoff, dest);
        self.destination_event(d_slot, handoff, DestinationEvent::Routed { worker: d })?;
        if let Some(renew) = self.cfg.lease_renew_ms {
            self.push(now.saturating_add(renew * NS_PER_MS), Event::RenewTimer { slot: d_slot, handoff });
        }
        Ok(())
    }

    /// Disabled policy: the prefill finished and freed its KV (its booking goes with it, as
    /// the old harness freed the prefill router's ownership at once); the decode router picks
    /// and books a worker, which gets the request once the whole prompt's modeled transfer
    /// time has passed — no reservation holds capacity for it meanwhile.
    pub(super) fn prefill_finished_unpinned(&mut self, request: RequestId) -> Result<(), ReplayError> {
        let now = self.now_ns;
        if let Some(f) = self.prefill_router.free_prefill(request) {
            self.emit_router(now, f)?;
        }
        let Some(req) = self.guards.get(&request).map(|g| g.request.clone()) else {
            return Ok(());
        };
        let d_slot = self.route_decode(request, &req)?;
        if let Some(g) = self.guards.get_mut(&request) {
            g.decode = Some(d_slot);
        }
        let at = now.saturating_add(self.transfer.transfer_ns(req.input_tokens as u64));
        self.push(
            at,
            Event::Command { slot: d_slot, command: Command::SubmitPrefilled(req), then: Vec::new() },
        );
        Ok(())
    }

    /// A source pin's release, read from the prefill worker's facts: the prefill booking is
    /// freed (bookings follow physical pins) and the correlation dropped once nothing holds it.
    pub(super) fn source_released(&mut self, req: RequestId, at_ns: u64) -> Result<(), ReplayError> {
        if let Some(f) = self.prefill_router.free_prefill(req) {
            self.emit_router(at_ns, f)?;
        }
        if let Some(h) = self.guards.get(&req).and_then(|g| g.handoff) {
            self.forget_handoff(h);
        } else {
            let hs: Vec<HandoffId> =
                self.request_handoffs.get(&req).map(|s| s.iter().copied().collect()).unwrap_or_default();
            for h in hs {
                self.forget_handoff(h);
            }
        }
        Ok(())
    }

    /// A dispatched prefill the core no longer computes (ended or refused; a pin is tracked in
    /// `pinned` instead): the prefill booking of a request that already ended is freed now.
    pub(super) fn source_left_core(&mut self, h: HandoffId) -> Result<(), ReplayError> {
        if !self.computing.remove(&h) || self.pinned.contains(&h) {
            return Ok(());
        }
        if let Some(req) = self.handoff_request.get(&h).copied() {
            if !self.guards.contains_key(&req) {
                if let Some(f) = self.prefill_router.free_prefill(req) {
                    self.emit_router(self.now_ns, f)?;
                }
            }
        }
        self.forget_handoff(h);
        Ok(())
    }

    /// A role ended its part of the handoff without success: unless decode already runs, the
    /// request ends (rejected if a core refused it, failed otherwise).
    pub(super) fn fail_unless_activated(&mut self, req: RequestId) -> Result<(), ReplayError> {
        if self.faults.defer(req) {
            return Ok(()); // a fault is ending several roles; the outcome follows (fault_flush)
        }
        let Some(g) = self.guards.get(&req) else {
            return Ok(());
        };
        if g.activated {
            return Ok(());
        }
        let status = g.fail_status.unwrap_or(TerminalStatus::Failed);
        self.terminal(req, status, 0)
    }

    /// Drops the frontend's correlation once neither role holds the handoff.
    pub(super) fn forget_handoff(&mut self, handoff: HandoffId) {
        let held = self
            .slots
            .iter()
            .any(|s| s.sources.contains_key(&handoff) || s.destinations.contains_key(&handoff));
        if held || self.pinned.contains(&handoff) || self.computing.contains(&handoff) {
            return;
        }
        if let Some(req) = self.handoff_request.get(&handoff) {
            if self.guards.contains_key(req) {
                return; // the request still runs (activated decode)
            }
        }
        if let Some(req) = self.handoff_request.remove(&handoff) {
            if let Some(set) = self.request_handoffs.get_mut(&req) {
                set.remove(&handoff);
                if set.is_empty() {
                    self.request_handoffs.remove(&req);
                }
            }
        }
    }

    /// SGLang's bootstrap timeout: a prefill still waiting for its destination fails.
    pub(super) fn on_bootstrap_timeout(&mut self, request: RequestId) -> Result<(), ReplayError> {
        let Some(g) = self.guards.get(&request) else {
            return Ok(());
        };
        let (Some(h), Some(p)) = (g.handoff, g.prefill) else {
            return Ok(());
        };
        let waiting = self.slots[p].sources.get(&h).is_some_and(|m| m.state_name() == "NotStarted");
        if waiting {
            self.source_event(p, h, SourceEvent::Cancelled { reason: CancelReason::BootstrapTimeout })?;
        }
        Ok(())
    }

    /// The request's terminal outcome: the frontend's guard frees its bookings exactly once.
    pub(super) fn terminal(
        &mut self,
        request: RequestId,
        status: TerminalStatus,
        output_tokens: u32,
    ) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let Some(g) = self.guards.remove(&request) else {
            return Ok(());
        };
        if let Some(p) = self.planner.as_mut() {
            // The same figures the report folds: TTFT, and TPOT for more than one token.
            if let (TerminalStatus::Completed, Some(first)) = (status, g.first_token_ns) {
                let ttft = first.saturating_sub(g.arrival_ns);
                let tpot =
                    (output_tokens > 1).then(|| now.saturating_sub(first) / u64::from(output_tokens - 1));
                p.record(now, ttft, tpot);
            }
        }
        if let Some(f) = self.prefill_router.prefill_compute_done(request) {
            self.emit_router(now, f)?;
        }
        // A pinned source keeps its prefill booking until it is released; a prefill the core
        // still computes keeps it until the core ends or releases it.
        let source_held = g.handoff.is_some_and(|h| self.pinned.contains(&h) || self.computing.contains(&h));
        if !source_held {
            if let Some(f) = self.prefill_router.free_prefill(request) {
                self.emit_router(now, f)?;
            }
        }
        // Aggregated serving books decode on its one router.
        let decode_router = match self.decode_router.as_mut() {
            Some(r) => r,
            None => &mut self.prefill_router,
        };
        if let Some(f) = decode_router.free_decode(request, status) {
            self.emit_router(now, f)?;
        }
        let kv = crate::events::KvDelta::ZERO;
        self.emit_router(now, Fact::RequestFinished { request, status, output_tokens, kv })?;
        if let Some(h) = g.handoff {
            // Anything still held for this handoff on either role is canceled.
            if status != TerminalStatus::Completed {
                for s in 0..self.slots.len() {
                    if self.slots[s].sources.contains_key(&h) {
                        self.source_event(
                            s,
                            h,
                            SourceEvent::Cancelled { reason: CancelReason::RequestAborted },
                        )?;
                    }
                    if self.slots[s].destinations.contains_key(&h) {
                        self.destination_event(
                            s,
                            h,
                            DestinationEvent::Cancelled { reason: CancelReason::RequestAborted },
                        )?;
                    }
                }
            }
            self.forget_handoff(h);
        }
        // The workload hears of every end: a session's next turn, a closed-loop slot.
        self.workload.on_terminal(request.0, status.into(), now)?;
        if self.held_back {
            self.held_back = false;
            self.arrival_armed_ns = Some(now);
            self.push(now, Event::Arrival);
        }
        self.arm_arrival();
        Ok(())
    }
}
