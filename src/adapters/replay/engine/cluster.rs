//! The simulator's side of scaling: planned changes and planner ticks add workers (a slot, a
//! lane, a NIC, a stream, a place in their router) or take them out of routing, and a leaving
//! worker writes `WorkerLeft` once it holds nothing. The plan, the planner and their semantics
//! are in `replay::scaling`.

use super::simulator::Event;
use super::{header, make_core, node_config, Member, Membership, Replay, ReplayError};
use crate::adapters::replay::scaling::{role_name, ScaledWorker, ScalingDecision};
use crate::adapters::replay::transfer::TransferConfig;
use crate::ids::{Role, WorkerId};
use crate::runtime::WorkerNode;

impl Replay<'_> {
    pub(super) fn on_planned_scale(&mut self, i: usize) -> Result<(), ReplayError> {
        let Some(e) = self.cfg.scale.get(i).copied() else {
            return Err(ReplayError::Engine(format!("scale[{i}] vanished from the plan")));
        };
        for (role, change) in [(Role::Prefill, e.prefill), (Role::Decode, e.decode)] {
            if change != 0 {
                self.scale_role(role, change, format!("planned (scale[{i}])"))?;
            }
        }
        Ok(())
    }

    pub(super) fn on_planner_tick(&mut self) -> Result<(), ReplayError> {
        let now = self.now_ns;
        let active = (self.active_count(Role::Prefill), self.active_count(Role::Decode));
        let Some(planner) = self.planner.as_mut() else { return Ok(()) };
        let changes = planner.decide(now, active);
        let interval_ns = planner.interval_ns();
        for c in changes {
            if self.scale_role(c.role, c.change, c.reason)? != 0 {
                if let Some(p) = self.planner.as_mut() {
                    p.changed(c.role, now);
                }
            }
        }
        // Ticks never keep a run alive on their own: with nothing else queued, nothing can
        // happen any more but ticks.
        if !self.queue.is_empty() {
            self.push(now.saturating_add(interval_ns), Event::PlannerTick);
        }
        Ok(())
    }

    /// Workers of `role` that routers may select.
    fn active_count(&self, role: Role) -> u32 {
        let slots = if role == Role::Prefill { &self.prefill_slots } else { &self.decode_slots };
        slots.iter().filter(|s| self.members[**s].membership == Membership::Active).count() as u32
    }

    /// Adds `change` workers of `role` (or takes `-change` out of routing), as far as the
    /// limits allow, and records the decision. Returns the change applied.
    fn scale_role(&mut self, role: Role, change: i32, mut reason: String) -> Result<i32, ReplayError> {
        let now = self.now_ns;
        let wanted = change.unsigned_abs();
        let mut workers = Vec::new();
        let mut refused = None;
        for k in 0..wanted {
            if change > 0 {
                match self.add_worker(role)? {
                    Some(w) => workers.push(w),
                    None => {
                        refused = Some(format!(
                            "{} of {wanted} additions refused: at most {} {} workers per run",
                            wanted - k,
                            crate::adapters::replay::config::MAX_WORKERS,
                            role_name(role)
                        ));
                        break;
                    }
                }
            } else {
                if self.active_count(role) <= 1 {
                    refused = Some(format!(
                        "{} of {wanted} removals refused: a role keeps at least one worker taking work",
                        wanted - k
                    ));
                    break;
                }
                workers.push(self.start_leaving(role)?);
            }
        }
        if let Some(r) = refused {
            reason.push_str("; ");
            reason.push_str(&r);
        }
        let applied = workers.len() as i32 * change.signum();
        let names: Vec<String> = workers.iter().map(|w| w.to_string()).collect();
        tracing::info!(at_ms = now as f64 / 1e6, role = role_name(role), applied, workers = ?names, %reason, "scaled");
        self.scaling.push(ScalingDecision {
            at_ms: now as f64 / 1e6,
            role: role_name(role),
            change: applied,
            reason,
            workers: names.into_iter().map(|worker| ScaledWorker { worker, left_at_ms: None }).collect(),
        });
        Ok(applied)
    }

    /// A worker joins now with the next index of its role: a new stream starting with
    /// `SessionStarted`, a lane, a NIC, and a place in its router. `None` when the role has
    /// had as many workers as a run may create.
    fn add_worker(&mut self, role: Role) -> Result<Option<WorkerId>, ReplayError> {
        let index = if role == Role::Prefill { self.prefill_slots.len() } else { self.decode_slots.len() };
        if index >= crate::adapters::replay::config::MAX_WORKERS as usize {
            return Ok(None);
        }
        let w = WorkerId { role, index: index as u32, dp_rank: 0 };
        let core = make_core(w, &self.cfg)?;
        let shape = core.shape();
        let capacity_blocks = shape.total_blocks;
        if shape.block_size != self.block_size {
            return Err(ReplayError::Engine(format!(
                "{w}: block size {} differs from other workers' {}",
                shape.block_size, self.block_size
            )));
        }
        self.sink.add_stream(header(
            self.run_id,
            w,
            &self.cfg,
            self.policy,
            shape,
            crate::ids::ClockDomain::Virtual,
        ));
        let s = self.nodes.len();
        self.nodes.push(WorkerNode::new(w, core, node_config(&self.cfg, self.policy)));
        self.members.push(Member::default());
        self.nemesis.paused_until_ns.push(0);
        self.paused_inputs.push(std::collections::VecDeque::new());
        if let Some(f) = self.folded.as_mut() {
            f.push(self.nodes[s].core().snapshot());
        }
        if self.queue.add_lane() != s {
            return Err(ReplayError::Engine(format!("{w}: its lane and slot differ")));
        }
        self.quiet.runs.push(None);
        self.quiet.next_at.push(u64::MAX);
        if role == Role::Prefill {
            self.prefill_slots.push(s);
        } else {
            self.decode_slots.push(s);
        }
        if let (Some(m), TransferConfig::Bandwidth(link)) = (self.contention.as_mut(), &self.cfg.transfer) {
            // NICs are numbered as slots are.
            if m.add_nic(&self.cfg.contention, &w.to_string(), link) != s {
                return Err(ReplayError::Engine(format!("{w}: its NIC and slot differ")));
            }
        }
        self.on_node(s, |n, _, r| n.start(r))?;
        self.frontend
            .add_worker(w)
            .map_err(|e| ReplayError::Engine(format!("adding {w} to its router: {e}")))?;
        if role == Role::Decode {
            // Destinations waiting for room elsewhere move here (source-first).
            let mut out = self.take_front();
            self.frontend.decode_joined(w, capacity_blocks, &mut out);
            self.carry_out_frontend(out)?;
        }
        Ok(Some(w))
    }

    /// Takes the highest-indexed worker of `role` still taking work out of routing; it leaves
    /// once drained (see [`Replay::check_leaving`]).
    fn start_leaving(&mut self, role: Role) -> Result<WorkerId, ReplayError> {
        let slots = if role == Role::Prefill { &self.prefill_slots } else { &self.decode_slots };
        let Some(s) = slots.iter().rev().copied().find(|s| self.members[*s].membership == Membership::Active)
        else {
            return Err(ReplayError::Engine(format!("no {} worker left to remove", role_name(role))));
        };
        let w = self.nodes[s].id();
        self.members[s].membership = Membership::Leaving;
        self.frontend
            .remove_worker(w)
            .map_err(|e| ReplayError::Engine(format!("taking {w} out of its router: {e}")))?;
        self.leaving.push(s);
        Ok(w)
    }

    /// Every leaving worker that holds nothing any more (no step, command, request, pin,
    /// reservation or booking) leaves now: `WorkerLeft` ends its stream.
    pub(super) fn check_leaving(&mut self) -> Result<(), ReplayError> {
        let mut i = 0;
        while i < self.leaving.len() {
            let s = self.leaving[i];
            let node = &self.nodes[s];
            let drained = node.holds_nothing() && self.frontend.load(node.id()).map_or(true, |l| l.is_zero());
            if !drained {
                i += 1;
                continue;
            }
            self.leaving.remove(i);
            self.on_node(s, |n, _, r| n.leave(r))?;
            self.members[s].membership = Membership::Left { at_ns: self.now_ns };
        }
        Ok(())
    }

    /// The decisions, with when each removed worker left.
    pub(super) fn scaling_report(&mut self) -> Vec<ScalingDecision> {
        let mut out = std::mem::take(&mut self.scaling);
        for d in out.iter_mut().filter(|d| d.change < 0) {
            for w in &mut d.workers {
                let slot = w.worker.parse::<WorkerId>().ok().map(|id| self.slot_of(id));
                if let Some(Membership::Left { at_ns }) =
                    slot.and_then(|s| self.members.get(s)).map(|m| m.membership)
                {
                    w.left_at_ms = Some(at_ns as f64 / 1e6);
                }
            }
        }
        out
    }
}
