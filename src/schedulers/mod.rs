//! Sans-IO engine cores. A core owns a worker's physical KV; it takes a command or a `step` with
//! the time as an input and returns the facts it caused plus the outputs an adapter must act on.
//! It never reads a clock, sleeps, or sends anything.
//!
//! ## Timing convention
//! Facts returned by a command happened at the command's `at_ns`. Facts returned by
//! `step(at_ns)` are observed when the step completes, at `at_ns + duration_ns`; adapters stamp
//! them so. A core with no runnable work returns a zero duration.
//!
//! ## Ownership facts
//! Every change of physical ownership is a fact carrying its [`KvDelta`](crate::events::KvDelta),
//! so the capacity fold of a core's facts equals [`EngineCore::snapshot`] after every call, and
//! [`EngineCore::audit`] recounts the same figures from the core's own structures.

pub mod handoffs;
pub mod perf;
pub mod prefetch;
pub use crate::model::request;
pub mod sglang;
pub mod vllm;

pub use perf::{PolynomialTiming, StepShape, TimingModel};
pub use request::Request;

use crate::events::{EngineShape, Fact, RejectReason, TerminalStatus};
use crate::ids::{
    CancelReason, DestinationReservationId, EndReason, HandoffId, RequestId, SourceLeaseId, WorkerId,
};
use crate::model::capacity::KvCapacitySnapshot;
pub use crate::model::view::SchedulerView;

/// What a core needs the adapter to act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineOutput {
    /// The request produced its first output token.
    FirstToken { request: RequestId },
    /// The request ended on this engine.
    Finished { request: RequestId, status: TerminalStatus, output_tokens: u32 },
    /// The engine refused the request without running it.
    Rejected { request: RequestId, reason: RejectReason },
    /// A handoff prefill finished and its KV is pinned for the handoff (one atomic transition:
    /// this output and the `SourcePinned` fact come from the same step).
    SourcePinned {
        handoff: HandoffId,
        request: RequestId,
        lease: SourceLeaseId,
        blocks: u32,
        deadline_ns: u64,
    },
    /// A reservation succeeded (immediately, or later from the pending FIFO).
    DestinationReserved {
        handoff: HandoffId,
        reservation: DestinationReservationId,
        summary: ReservationSummary,
    },
    /// A pending reservation can never succeed here; the handoff must fail.
    ReservationFailed { handoff: HandoffId, reason: RejectReason },
}

/// What a destination reservation holds, and what the transfer must carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReservationSummary {
    /// Fresh pages for the missing prompt.
    pub pages: u32,
    /// Locally cached prefix blocks locked for the handoff.
    pub prefix_blocks: u32,
    /// Prompt tokens covered by that prefix.
    pub prefix_tokens: u32,
    /// Prompt tokens the source must send (`input − prefix_tokens`, block-rounded up to whole
    /// blocks of the destination).
    pub missing_tokens: u32,
}

/// Facts and outputs of one call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Effects {
    pub facts: Vec<Fact>,
    pub outputs: Vec<EngineOutput>,
}

impl Effects {
    pub fn extend(&mut self, other: Effects) {
        self.facts.extend(other.facts);
        self.outputs.extend(other.outputs);
    }
}

/// What a command did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommandOutcome {
    /// It changed the core's state.
    Applied,
    /// It was already done, or names a handoff this core already finished with: nothing changed.
    NoOp,
    /// A reservation could not be made now; it waits in the pending FIFO and is retried (head
    /// only) when capacity changes. Success arrives later as an `EngineOutput`.
    Unavailable,
}

/// A command that cannot be applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    #[error("{backend} does not support {what}")]
    Unsupported { backend: &'static str, what: &'static str },
    #[error("request {request} needs {needed_blocks} blocks but the worker has {total_blocks}")]
    NeverFits { request: RequestId, needed_blocks: u64, total_blocks: u64 },
    #[error("handoff {0} is already registered on this core")]
    DuplicateHandoff(HandoffId),
    #[error("handoff {0} is not known to this core")]
    UnknownHandoff(HandoffId),
    #[error("handoff {handoff}: cannot {command} while {state}")]
    InvalidState { handoff: HandoffId, command: &'static str, state: &'static str },
}

/// A command's outcome plus what it caused (facts are emitted even when it fails, e.g. a
/// rejection fact).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommandResult {
    pub outcome: Result<CommandOutcome, CommandError>,
    pub effects: Effects,
}

/// One step's results.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepOutput {
    pub effects: Effects,
    /// Modeled duration; the step's facts are observed at `at_ns + duration_ns`.
    pub duration_ns: u64,
}

/// A run of decode steps that each only advance every running request by one token: the same
/// batch, no prefill, no block or page allocated or published, no token that ends or starts
/// anything. Only their durations may differ (a timing model may charge for the KV growing
/// token by token). See [`EngineCore::quiet_steps`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuietSteps {
    /// How many such steps follow, at most (at least 1).
    pub steps: u64,
    pub batch: u32,
    pub durations: QuietDurations,
}

/// The steps' durations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QuietDurations {
    /// Every step takes this long.
    Same(u64),
    /// Step `i` takes the `i`th value (one per step).
    Each(Vec<u64>),
}

impl QuietSteps {
    /// How long step `i` (from 0) takes.
    pub fn duration_ns(&self, i: u64) -> u64 {
        match &self.durations {
            QuietDurations::Same(ns) => *ns,
            QuietDurations::Each(v) => v.get(i as usize).copied().unwrap_or(0),
        }
    }

    /// The fact step `i` writes.
    pub fn fact(&self, i: u64) -> crate::events::Fact {
        crate::events::Fact::StepExecuted {
            prefill_tokens: 0,
            decode_tokens: self.batch,
            batch_size: self.batch,
            duration_ns: self.duration_ns(i),
            kv: crate::events::KvDelta::ZERO,
        }
    }
}

/// The command API both cores implement.
pub trait EngineCore {
    fn worker(&self) -> WorkerId;
    fn shape(&self) -> EngineShape;

    /// An ordinary request (aggregated serving, or the Disabled policy's plain path).
    fn submit(&mut self, request: Request, at_ns: u64) -> CommandResult;

    /// The Disabled policy's decode on a disaggregated cluster (the behaviour before the
    /// handoff lifecycle): the prompt's KV was computed on a prefill worker that has already
    /// freed it, and arrives with the request after the modeled transfer delay. The request
    /// waits like any other and takes blocks for its whole prompt only when admitted (nothing
    /// is reserved ahead); the prompt costs no compute here, and the engine produces every
    /// output token itself, the first in its first step.
    fn submit_prefilled(&mut self, request: Request, at_ns: u64) -> CommandResult;

    /// A prefill whose terminal step pins its KV for `handoff` instead of freeing it. The
    /// engine computes the prompt (and its first token) only. `lease_ns` is the lease length the
    /// `SourcePinned` fact records as `deadline = pin time + lease_ns`; expiry itself is the
    /// caller's timer.
    fn submit_handoff_prefill(
        &mut self,
        handoff: HandoffId,
        request: Request,
        lease_ns: u64,
        at_ns: u64,
    ) -> CommandResult;

    /// Reserve the destination for `handoff`, retaining `request` (it is never resubmitted).
    fn reserve_destination(
        &mut self,
        handoff: HandoffId,
        request: Request,
        deadline_ns: u64,
        at_ns: u64,
    ) -> CommandResult;

    /// Destination KV is valid: publish it and queue the retained request as already computed.
    fn activate_destination(&mut self, handoff: HandoffId, at_ns: u64) -> CommandResult;

    /// End a source pin (`Success` on reader completion, `Expired` on lease expiry).
    fn release_source(&mut self, handoff: HandoffId, reason: EndReason, at_ns: u64) -> CommandResult;

    /// Cancel a handoff prefill in any phase: queued, computing, or pinned.
    fn cancel_source(&mut self, handoff: HandoffId, reason: CancelReason, at_ns: u64) -> CommandResult;

    /// Cancel a destination in any phase: pending, reserved, or activated (then the request is
    /// aborted like any running request).
    fn cancel_destination(&mut self, handoff: HandoffId, reason: CancelReason, at_ns: u64) -> CommandResult;

    /// Run one scheduling step at `at_ns`.
    fn step(&mut self, at_ns: u64) -> StepOutput;

    /// No runnable work (waiting or running requests).
    fn is_empty(&self) -> bool;
    /// Also no held source, pending or held reservation, or activated handoff still running.
    fn is_drained(&self) -> bool;

    /// Physical KV by class, as the core's counters have it.
    fn snapshot(&self) -> KvCapacitySnapshot;
    /// The same figures recounted from the core's block structures (slow; tests and audits).
    fn audit(&self) -> KvCapacitySnapshot;
    fn view(&self) -> SchedulerView;

    /// If no command reaches the core, how many of the next steps would each write exactly
    /// [`QuietSteps::fact`] and nothing else, and change the core only by advancing each
    /// running request one decode token (and whatever per-step bookkeeping `step` keeps)?
    /// `None` when the next step is not such a step (or the core does not tell). A replay
    /// uses it to apply such steps in one go, later ([`EngineCore::advance_quiet`]), instead
    /// of one event each.
    fn quiet_steps(&self) -> Option<QuietSteps> {
        None
    }

    /// Applies `steps` quiet steps at once: exactly what `steps` calls of
    /// [`EngineCore::step`] would do, given that [`EngineCore::quiet_steps`] promised at least
    /// that many and no command came in between.
    fn advance_quiet(&mut self, steps: u64) {
        let _ = steps;
    }

    /// Hands back an emptied [`Effects`] (its vectors keep their capacity) for the core to
    /// fill again: a replay runs millions of steps, and this saves their allocations. A core
    /// may ignore it.
    fn recycle(&mut self, effects: Effects) {
        let _ = effects;
    }
}
