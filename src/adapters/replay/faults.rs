//! Fault injection for the offline replay: the proposal's failure matrix (scenario 5) and its
//! duplicate / stale / late events (scenario 6), injected into a real replay at a chosen
//! lifecycle phase of a chosen request.
//!
//! A fault plan is part of the replay configuration:
//! `"faults": [{"request": 3, "phase": "after-reservation", "kind": "channel-loss"}]`.
//! `request` is the trace index the replay uses as the [`RequestId`] (0-based, in file order).
//!
//! ## When a fault fires
//! A phase is a predicate on the states of the handoff's two role machines. The replay checks
//! armed faults at every event boundary (after an event and everything it caused synchronously,
//! before the next queued event) and fires a fault at the first boundary where its phase holds,
//! at that virtual time. Role machines only change state inside events, so every phase window
//! contains a boundary, including windows of zero virtual duration (e.g. between the decode
//! router's booking and the core applying the reservation command). Same plan ⇒ same boundary ⇒
//! byte-identical logs.
//!
//! A fault whose phase is never reached (the request does not exist, or ended earlier, e.g. its
//! reservation was refused) is reported in [`FaultReport`] as not fired, never silently dropped.
//!
//! See `docs/faults.md` for what each kind does and which phases exist under which policy.

use crate::ids::{HandoffId, HandoffPolicy, RequestId};
use crate::lifecycle::destination::DestinationState;
use crate::lifecycle::messages::HandoffMessage;
use crate::lifecycle::source::SourceState;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Most faults one plan may hold (every queue has a limit).
pub const MAX_FAULTS: usize = 4096;

/// Where in a handoff's lifecycle a fault fires. Each is a predicate on the role machines'
/// states (`S` = source, `D` = destination; `—` = no machine yet).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultPhase {
    /// No decode worker routed yet; the prefill is queued or computing (`S` NotStarted or
    /// Computing, `D` —). Source-first only: destination-first routes the decode at arrival.
    BeforeDecodeRouting,
    /// The decode router booked and routed a decode worker; its reservation command is issued
    /// but the core has not reported a reservation (`D` Reserving).
    AfterBookingBeforeReservation,
    /// The destination holds its physical reservation; the source has not acted on it yet (`D`
    /// Reserved, `S` not AwaitingReaderCompletion): source-first, the source is pinned and the
    /// `DestinationReserved` message is in flight; destination-first, the prefill is not yet
    /// dispatched.
    AfterReservation,
    /// The source holds its pin and has announced it to the reserved destination, which has not
    /// started reading (`S` AwaitingReaderCompletion, `D` Reserved): both resources are held,
    /// `SourceReady` is in flight. (Source-first pins earlier too: see the docs.)
    SourcePinned,
    /// The transfer is in flight (`D` Receiving).
    DuringTransfer,
    /// Destination KV is valid and decode activated; the source has not heard of it yet (`D`
    /// Active, `S` AwaitingReaderCompletion: `ReceiveCompleted` is in flight).
    AfterReceiveBeforeReaderCompletion,
}

impl FaultPhase {
    pub const ALL: [FaultPhase; 6] = [
        FaultPhase::BeforeDecodeRouting,
        FaultPhase::AfterBookingBeforeReservation,
        FaultPhase::AfterReservation,
        FaultPhase::SourcePinned,
        FaultPhase::DuringTransfer,
        FaultPhase::AfterReceiveBeforeReaderCompletion,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FaultPhase::BeforeDecodeRouting => "before-decode-routing",
            FaultPhase::AfterBookingBeforeReservation => "after-booking-before-reservation",
            FaultPhase::AfterReservation => "after-reservation",
            FaultPhase::SourcePinned => "source-pinned",
            FaultPhase::DuringTransfer => "during-transfer",
            FaultPhase::AfterReceiveBeforeReaderCompletion => "after-receive-before-reader-completion",
        }
    }

    /// Whether a handoff under `policy` ever passes through this phase.
    pub fn exists_under(self, policy: HandoffPolicy) -> bool {
        match policy {
            HandoffPolicy::Disabled => false,
            HandoffPolicy::DestinationFirst => self != FaultPhase::BeforeDecodeRouting,
            HandoffPolicy::SourceFirst => true,
        }
    }

    /// Whether the machines' states (`None` = no machine on that role) are in this phase.
    /// `decode_routed`: the frontend has picked a decode worker.
    pub fn holds(
        self,
        source: Option<&SourceState>,
        destination: Option<&DestinationState>,
        decode_routed: bool,
    ) -> bool {
        use DestinationState as D;
        use SourceState as S;
        let awaiting_reader = matches!(source, Some(S::AwaitingReaderCompletion { .. }));
        match self {
            FaultPhase::BeforeDecodeRouting => {
                !decode_routed
                    && destination.is_none()
                    && matches!(source, Some(S::NotStarted | S::Computing))
            }
            FaultPhase::AfterBookingBeforeReservation => {
                matches!(destination, Some(D::Reserving)) && source.is_some()
            }
            FaultPhase::AfterReservation => {
                matches!(destination, Some(D::Reserved { .. })) && source.is_some() && !awaiting_reader
            }
            FaultPhase::SourcePinned => matches!(destination, Some(D::Reserved { .. })) && awaiting_reader,
            FaultPhase::DuringTransfer => {
                matches!(destination, Some(D::Receiving { .. })) && source.is_some()
            }
            FaultPhase::AfterReceiveBeforeReaderCompletion => {
                matches!(destination, Some(D::Active { .. })) && awaiting_reader
            }
        }
    }
}

impl std::fmt::Display for FaultPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What happens when a fault fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// The client aborts: the frontend ends the request `canceled` and both roles cancel
    /// (`RequestAborted`).
    Cancel,
    /// The transport between the handoff's two workers fails for this handoff: messages for it
    /// still in flight (and any sent later) are dropped, and each role that still holds the
    /// handoff gets a local `PeerLost` cancellation from its own transport. No peer message is
    /// involved.
    ChannelLoss,
    /// The handoff's prefill worker restarts (see [`FaultKind::RestartDestination`]).
    RestartSource,
    /// The handoff's decode worker restarts: its generation is bumped (`SessionStarted` with the
    /// new generation), every handoff it held is canceled locally (`OwnerLost`) and its core frees
    /// their resources; each peer learns by a transport disconnect (`PeerLost`). Messages of the
    /// old generation still in flight are rejected as `StaleGeneration` when delivered.
    RestartDestination,
    /// The next message delivered for this handoff is delivered twice.
    DuplicateMessage,
    /// The next message delivered for this handoff is delivered again once both roles have
    /// released the handoff.
    LateMessage,
}

impl FaultKind {
    pub const ALL: [FaultKind; 6] = [
        FaultKind::Cancel,
        FaultKind::ChannelLoss,
        FaultKind::RestartSource,
        FaultKind::RestartDestination,
        FaultKind::DuplicateMessage,
        FaultKind::LateMessage,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Cancel => "cancel",
            FaultKind::ChannelLoss => "channel-loss",
            FaultKind::RestartSource => "restart-source",
            FaultKind::RestartDestination => "restart-destination",
            FaultKind::DuplicateMessage => "duplicate-message",
            FaultKind::LateMessage => "late-message",
        }
    }

    /// Why this kind cannot fire at `phase`, if it cannot.
    pub fn refuses(self, phase: FaultPhase) -> Option<&'static str> {
        match (self, phase) {
            (FaultKind::ChannelLoss, FaultPhase::BeforeDecodeRouting) => {
                Some("no channel exists before the decode is routed (there is no destination yet)")
            }
            (FaultKind::RestartDestination, FaultPhase::BeforeDecodeRouting) => {
                Some("there is no destination to restart before the decode is routed")
            }
            _ => None,
        }
    }
}

impl std::fmt::Display for FaultKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One planned fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    /// The request (its 0-based trace index).
    pub request: u64,
    pub phase: FaultPhase,
    pub kind: FaultKind,
    /// Fire this long after the phase is first reached (0: at once), if the handoff is still in
    /// it then; otherwise the fault is reported as not fired. Reaches into long windows, e.g. a
    /// source-first pin waiting for a full decode worker to free capacity.
    #[serde(default)]
    pub delay_ms: u64,
}

impl FaultSpec {
    /// A fault that fires as soon as `phase` is reached.
    pub fn new(request: u64, phase: FaultPhase, kind: FaultKind) -> Self {
        FaultSpec { request, phase, kind, delay_ms: 0 }
    }

    pub fn request_id(&self) -> RequestId {
        RequestId(self.request)
    }
}

impl std::fmt::Display for FaultSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "request {} at {}", self.request, self.phase)?;
        if self.delay_ms > 0 {
            write!(f, " + {} ms", self.delay_ms)?;
        }
        write!(f, ": {}", self.kind)
    }
}

/// Checks a plan against the policy in force; the message names the offending entry.
pub fn validate(faults: &[FaultSpec], policy: HandoffPolicy) -> Result<(), String> {
    if faults.is_empty() {
        return Ok(());
    }
    if faults.len() > MAX_FAULTS {
        return Err(format!("at most {MAX_FAULTS} faults per plan, got {}", faults.len()));
    }
    if policy == HandoffPolicy::Disabled {
        return Err("faults need disaggregated serving (aggregated serving has no handoffs)".into());
    }
    for (i, f) in faults.iter().enumerate() {
        if !f.phase.exists_under(policy) {
            return Err(format!(
                "faults[{i}] ({f}): phase `{}` does not exist under {} (the decode is routed at arrival, before the prefill)",
                f.phase,
                policy_name(policy)
            ));
        }
        if let Some(why) = f.kind.refuses(f.phase) {
            return Err(format!("faults[{i}] ({f}): {why}"));
        }
    }
    Ok(())
}

fn policy_name(p: HandoffPolicy) -> &'static str {
    match p {
        HandoffPolicy::SourceFirst => "source-first",
        HandoffPolicy::DestinationFirst => "destination-first",
        HandoffPolicy::Disabled => "disabled",
    }
}

/// What became of one planned fault.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FaultReport {
    pub spec: FaultSpec,
    /// Virtual time it fired; `None`: its phase was never reached.
    pub fired_at_ns: Option<u64>,
    /// The handoff it hit.
    pub handoff: Option<HandoffId>,
    /// What it did, or why it never fired.
    pub notes: Vec<String>,
}

impl FaultReport {
    pub fn fired(&self) -> bool {
        self.fired_at_ns.is_some()
    }
}

impl std::fmt::Display for FaultReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.fired_at_ns {
            Some(at) => write!(f, "fault {} fired at t={:.3} ms", self.spec, at as f64 / 1e6)?,
            None => write!(f, "fault {} NOT fired", self.spec)?,
        }
        for n in &self.notes {
            write!(f, "; {n}")?;
        }
        Ok(())
    }
}

/// A late-message fault after it fired.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Late {
    /// Waiting for the next delivery of the handoff's messages.
    Armed(usize),
    /// Holding a copy of that message (and its receiving slot) until both roles release.
    Captured { fault: usize, slot: usize, msg: HandoffMessage },
    /// The copy was re-delivered.
    Sent,
}

/// The replay's fault bookkeeping. Empty (and never consulted beyond one branch) without a plan.
#[derive(Default)]
pub(crate) struct FaultState {
    pub reports: Vec<FaultReport>,
    /// Faults not yet fired, by request.
    pub armed: BTreeMap<RequestId, Vec<usize>>,
    /// Delayed faults whose phase was reached: when they fire.
    pub due_ns: BTreeMap<usize, u64>,
    /// Handoffs whose channel was lost: deliveries for them are dropped.
    pub lost_channels: BTreeSet<HandoffId>,
    /// Handoffs whose next delivery is doubled, with the fault that asked.
    pub duplicate_next: BTreeMap<HandoffId, usize>,
    pub late: BTreeMap<HandoffId, Late>,
    /// Some worker restarted: deliveries are checked against the sender's current generation.
    pub restarted: bool,
}

impl FaultState {
    pub fn new(plan: &[FaultSpec]) -> Self {
        let mut s = FaultState::default();
        for (i, spec) in plan.iter().enumerate() {
            s.reports.push(FaultReport { spec: *spec, fired_at_ns: None, handoff: None, notes: Vec::new() });
            s.armed.entry(RequestId(spec.request)).or_default().push(i);
        }
        s
    }

    /// A plan exists: the replay consults this state.
    pub fn active(&self) -> bool {
        !self.reports.is_empty()
    }

    pub fn note(&mut self, fault: usize, text: String) {
        if let Some(r) = self.reports.get_mut(fault) {
            r.notes.push(text);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_json() {
        for p in FaultPhase::ALL {
            let j = serde_json::to_string(&p).unwrap();
            assert_eq!(j, format!("\"{}\"", p.as_str()));
            assert_eq!(serde_json::from_str::<FaultPhase>(&j).unwrap(), p);
        }
        for k in FaultKind::ALL {
            let j = serde_json::to_string(&k).unwrap();
            assert_eq!(j, format!("\"{}\"", k.as_str()));
            assert_eq!(serde_json::from_str::<FaultKind>(&j).unwrap(), k);
        }
    }

    #[test]
    fn phases_are_disjoint_predicates() {
        use crate::ids::{DestinationReservationId as R, SourceLeaseId as L};
        let pin = (L(1), 1, 0);
        let sources = [
            None,
            Some(SourceState::NotStarted),
            Some(SourceState::Computing),
            Some(SourceState::Pinned { lease: pin.0, blocks: pin.1, deadline_ns: pin.2 }),
            Some(SourceState::AwaitingReaderCompletion { lease: pin.0, blocks: pin.1, deadline_ns: pin.2 }),
        ];
        let dests = [
            None,
            Some(DestinationState::NotRouted),
            Some(DestinationState::Reserving),
            Some(DestinationState::Reserved { reservation: R(1) }),
            Some(DestinationState::Receiving { reservation: R(1) }),
            Some(DestinationState::Active { reservation: R(1) }),
        ];
        for s in &sources {
            for d in &dests {
                for routed in [false, true] {
                    let n =
                        FaultPhase::ALL.iter().filter(|p| p.holds(s.as_ref(), d.as_ref(), routed)).count();
                    assert!(n <= 1, "{s:?} {d:?} {routed}: {n} phases hold at once");
                }
            }
        }
    }

    #[test]
    fn destination_first_has_no_phase_before_decode_routing() {
        let plan = [FaultSpec::new(0, FaultPhase::BeforeDecodeRouting, FaultKind::Cancel)];
        let e = validate(&plan, HandoffPolicy::DestinationFirst).unwrap_err();
        assert!(e.contains("before-decode-routing") && e.contains("destination-first"), "{e}");
        assert!(validate(&plan, HandoffPolicy::SourceFirst).is_ok());
        assert!(validate(&plan, HandoffPolicy::Disabled).is_err());
    }
}
