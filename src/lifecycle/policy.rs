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

/// The milestones of a successful handoff, across both roles' streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Milestone {
    PrefillDispatched,
    SourcePinned,
    DestinationReserved,
    ReceiveStarted,
    DestinationActivated,
    /// The source pin ended on reader completion (a released-for-any-other-reason pin is not a
    /// milestone of a successful handoff).
    SourceReleased,
}

/// The milestone a fact marks, if any.
pub fn milestone(fact: &Fact) -> Option<Milestone> {
    match fact {
        Fact::PrefillDispatched { .. } => Some(Milestone::PrefillDispatched),
        Fact::SourcePinned { .. } => Some(Milestone::SourcePinned),
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
            SourcePinned,
            DestinationReserved,
            ReceiveStarted,
            DestinationActivated,
            SourceReleased,
        ],
        HandoffPolicy::DestinationFirst => &[
            DestinationReserved,
            PrefillDispatched,
            SourcePinned,
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
        assert!(pos(s, Milestone::SourcePinned) < pos(s, Milestone::DestinationReserved));
        for p in [s, d] {
            assert!(pos(p, Milestone::DestinationActivated) < pos(p, Milestone::SourceReleased));
        }
    }
}
