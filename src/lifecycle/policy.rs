//! What a [`HandoffPolicy`] means for the order of a handoff's milestones.
//!
//! The machines share one lifecycle; the policy only decides who moves first. These helpers name
//! that choice and the normalized milestone order a clean handoff shows under each policy, so
//! tests, the ledger projection and the live/replay diff can check it from facts alone.

use crate::events::Fact;
use crate::ids::{EndReason, HandoffPolicy, Role};

/// Whether there is a handoff lifecycle at all (Disabled keeps the plain request path).
pub fn is_enabled(policy: HandoffPolicy) -> bool {
    policy != HandoffPolicy::Disabled
}

/// Destination-first (SGLang): the source may not dispatch its prefill before the destination's
/// reservation arrives.
pub fn source_waits_for_destination(policy: HandoffPolicy) -> bool {
    policy == HandoffPolicy::DestinationFirst
}

/// Source-first (vLLM): the prefill runs and pins with no destination yet, so its KV can be
/// stranded while decode waits for capacity.
pub fn source_may_strand(policy: HandoffPolicy) -> bool {
    policy == HandoffPolicy::SourceFirst
}

/// The role whose step opens the handoff: the prefill worker under source-first, the decode
/// worker under destination-first; none when disabled.
pub fn initiating_role(policy: HandoffPolicy) -> Option<Role> {
    match policy {
        HandoffPolicy::Disabled => None,
        HandoffPolicy::SourceFirst => Some(Role::Prefill),
        HandoffPolicy::DestinationFirst => Some(Role::Decode),
    }
}

/// The one vocabulary of handoff milestones, across both roles' streams: the policy's expected
/// order ([`expected_order`]), the ledger's normalized sequence
/// ([`crate::projections::handoffs::HandoffEntry::normalized`]), diff and the tests all use it.
/// Names follow the reference's transition names (`SourceHeld` is the `SourcePinned` fact).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub enum Milestone {
    PrefillDispatched,
    /// The source pinned its KV for readers.
    SourceHeld,
    /// The router chose the destination.
    DestinationAccepted,
    DestinationReserved,
    ReceiveStarted,
    DestinationActivated,
    /// The source pin ended on reader completion (a released-for-any-other-reason pin is not a
    /// milestone of a successful handoff).
    SourceReleased,
    /// Both sides ended on success.
    Completed,
}

impl Milestone {
    pub fn name(self) -> &'static str {
        match self {
            Milestone::PrefillDispatched => "PrefillDispatched",
            Milestone::SourceHeld => "SourceHeld",
            Milestone::DestinationAccepted => "DestinationAccepted",
            Milestone::DestinationReserved => "DestinationReserved",
            Milestone::ReceiveStarted => "ReceiveStarted",
            Milestone::DestinationActivated => "DestinationActivated",
            Milestone::SourceReleased => "SourceReleased",
            Milestone::Completed => "Completed",
        }
    }

    /// `a, b, c` (or with another separator).
    pub fn join(milestones: &[Milestone], separator: &str) -> String {
        milestones.iter().map(|m| m.name()).collect::<Vec<_>>().join(separator)
    }
}

impl std::fmt::Display for Milestone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The milestone a fact marks in the policy's order, if any (routing and completion are not
/// facts of one role; the ledger adds them).
pub fn milestone(fact: &Fact) -> Option<Milestone> {
    match fact {
        Fact::PrefillDispatched { .. } => Some(Milestone::PrefillDispatched),
        Fact::SourcePinned { .. } => Some(Milestone::SourceHeld),
        Fact::DestinationReserved { .. } => Some(Milestone::DestinationReserved),
        Fact::ReceiveStarted { .. } => Some(Milestone::ReceiveStarted),
        Fact::DestinationActivated { .. } => Some(Milestone::DestinationActivated),
        Fact::SourceReleased { reason: EndReason::Success, .. } => Some(Milestone::SourceReleased),
        _ => None,
    }
}

/// The normalized order of a clean handoff. Source-first assumes vLLM's flow, where the decode
/// request is routed after the prefill returns; destination-first is SGLang's gate.
/// Both end with activation before source release: activation is the readiness barrier.
pub fn expected_order(policy: HandoffPolicy) -> &'static [Milestone] {
    use Milestone::*;
    match policy {
        HandoffPolicy::Disabled => &[],
        HandoffPolicy::SourceFirst => &[
            PrefillDispatched,
            SourceHeld,
            DestinationReserved,
            ReceiveStarted,
            DestinationActivated,
            SourceReleased,
        ],
        HandoffPolicy::DestinationFirst => &[
            DestinationReserved,
            PrefillDispatched,
            SourceHeld,
            ReceiveStarted,
            DestinationActivated,
            SourceReleased,
        ],
    }
}

/// The first occurrence of each milestone in `facts`, in order (facts of one handoff, merged
/// across roles in the order they happened).
pub fn observed_order<'a>(facts: impl IntoIterator<Item = &'a Fact>) -> Vec<Milestone> {
    let mut seen = Vec::new();
    for f in facts {
        if let Some(m) = milestone(f) {
            if !seen.contains(&m) {
                seen.push(m);
            }
        }
    }
    seen
}

/// Whether `facts` show exactly the policy's normalized order.
pub fn follows_expected_order<'a>(policy: HandoffPolicy, facts: impl IntoIterator<Item = &'a Fact>) -> bool {
    observed_order(facts) == expected_order(policy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_say_who_moves_first() {
        assert!(source_waits_for_destination(HandoffPolicy::DestinationFirst));
        assert!(!source_waits_for_destination(HandoffPolicy::SourceFirst));
        assert!(source_may_strand(HandoffPolicy::SourceFirst));
        assert_eq!(initiating_role(HandoffPolicy::SourceFirst), Some(Role::Prefill));
        assert_eq!(initiating_role(HandoffPolicy::DestinationFirst), Some(Role::Decode));
        assert_eq!(initiating_role(HandoffPolicy::Disabled), None);
        assert!(!is_enabled(HandoffPolicy::Disabled));
    }

    #[test]
    fn destination_first_reserves_before_dispatch_and_source_first_the_reverse() {
        let pos = |p, m| expected_order(p).iter().position(|x| *x == m).unwrap();
        let d = HandoffPolicy::DestinationFirst;
        let s = HandoffPolicy::SourceFirst;
        assert!(pos(d, Milestone::DestinationReserved) < pos(d, Milestone::PrefillDispatched));
        assert!(pos(s, Milestone::SourceHeld) < pos(s, Milestone::DestinationReserved));
        for p in [s, d] {
            assert!(pos(p, Milestone::DestinationActivated) < pos(p, Milestone::SourceReleased));
        }
    }
}
