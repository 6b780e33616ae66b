//! The messages that cross between the two roles of one handoff.
//!
//! Replay carries them in-process and live workers carry them over TCP; the types are the same
//! in both, so they are plain serializable data. Every message names its handoff attempt and the
//! sender's worker and session generation, which is what lets a receiver reject a message from an
//! older incarnation of its peer and treat a newer incarnation as the loss of the old one.

use crate::events::{Fact, MessageKind, MessageRejection};
use crate::ids::{CancelReason, DestinationReservationId, Generation, HandoffId, WorkerId};
use serde::{Deserialize, Serialize};

/// One handoff message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandoffMessage {
    pub handoff: HandoffId,
    /// The sending worker.
    pub from: WorkerId,
    /// The sender's session generation when it sent this.
    pub generation: Generation,
    pub body: MessageBody,
}

/// What a message says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MessageBody {
    /// Source → destination: the prefill is done and its KV is pinned; the destination may read
    /// it once it holds a reservation.
    SourceReady { source: WorkerId, blocks: u32, prompt_tokens: u32 },
    /// Destination → source: physical destination capacity is reserved for this handoff
    /// (destination-first: the source may now dispatch its prefill).
    DestinationReserved {
        destination: WorkerId,
        reservation: DestinationReservationId,
        prefix_tokens: u32,
        missing_tokens: u32,
    },
    /// Destination → source: destination KV is valid (decode activated); the source may release.
    ReceiveCompleted,
    /// Sender/transport → source: every reader acknowledged; the source may release.
    ReaderCompleted,
    /// Either way: the sender gave the handoff up; the receiver frees what it holds.
    Abort { reason: CancelReason },
    /// Destination → source: the destination is alive and still intends to read; extend the lease.
    LeaseRenewal,
}

impl MessageBody {
    pub fn kind(&self) -> MessageKind {
        match self {
            MessageBody::SourceReady { .. } => MessageKind::SourceReady,
            MessageBody::DestinationReserved { .. } => MessageKind::DestinationReserved,
            MessageBody::ReceiveCompleted => MessageKind::ReceiveCompleted,
            MessageBody::ReaderCompleted => MessageKind::ReaderCompleted,
            MessageBody::Abort { .. } => MessageKind::Abort,
            MessageBody::LeaseRenewal => MessageKind::LeaseRenewal,
        }
    }
}

impl HandoffMessage {
    pub fn kind(&self) -> MessageKind {
        self.body.kind()
    }

    /// The `MessageReceived` fact for this message (it was applied).
    pub fn received_fact(&self) -> Fact {
        Fact::MessageReceived {
            handoff: self.handoff,
            kind: self.kind(),
            from: self.from,
            generation: self.generation,
        }
    }

    /// The `MessageRejected` fact for this message. The machines emit it themselves for stale,
    /// duplicate and late messages; an adapter uses it with [`MessageRejection::InvalidTransition`]
    /// when `handle` returned an error for the message, or with
    /// [`MessageRejection::UnknownHandoff`] when no machine has the message's id.
    pub fn rejected_fact(&self, why: MessageRejection) -> Fact {
        Fact::MessageRejected {
            handoff: self.handoff,
            kind: self.kind(),
            from: self.from,
            generation: self.generation,
            why,
        }
    }
}

/// The event name a message has in a [`TransitionError`](super::TransitionError).
pub(crate) fn event_name(kind: MessageKind) -> &'static str {
    match kind {
        MessageKind::SourceReady => "Message(SourceReady)",
        MessageKind::DestinationReserved => "Message(DestinationReserved)",
        MessageKind::ReceiveCompleted => "Message(ReceiveCompleted)",
        MessageKind::ReaderCompleted => "Message(ReaderCompleted)",
        MessageKind::Abort => "Message(Abort)",
        MessageKind::LeaseRenewal => "Message(LeaseRenewal)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::codec;

    #[test]
    fn kinds_match_bodies() {
        let bodies = [
            (
                MessageBody::SourceReady { source: WorkerId::prefill(0), blocks: 1, prompt_tokens: 2 },
                MessageKind::SourceReady,
            ),
            (
                MessageBody::DestinationReserved {
                    destination: WorkerId::decode(0),
                    reservation: DestinationReservationId(3),
                    prefix_tokens: 0,
                    missing_tokens: 16,
                },
                MessageKind::DestinationReserved,
            ),
            (MessageBody::ReceiveCompleted, MessageKind::ReceiveCompleted),
            (MessageBody::ReaderCompleted, MessageKind::ReaderCompleted),
            (MessageBody::Abort { reason: CancelReason::PeerLost }, MessageKind::Abort),
            (MessageBody::LeaseRenewal, MessageKind::LeaseRenewal),
        ];
        for (b, k) in bodies {
            assert_eq!(b.kind(), k);
        }
    }

    #[test]
    fn messages_round_trip_through_json_and_codec() {
        let m = HandoffMessage {
            handoff: crate::ids::IdMint::from_seed(1).handoff_id(),
            from: WorkerId::decode(2),
            generation: Generation(5),
            body: MessageBody::DestinationReserved {
                destination: WorkerId::decode(2),
                reservation: DestinationReservationId(9),
                prefix_tokens: 64,
                missing_tokens: 128,
            },
        };
        let text = serde_json::to_string(&m).unwrap();
        let back: HandoffMessage = serde_json::from_str(&text).unwrap();
        assert_eq!(back, m);
        // The binary codec the log and the live transport use.
        let mut bytes = Vec::new();
        codec::encode_into(&m, &mut bytes).unwrap();
        assert_eq!(codec::decode_exact::<HandoffMessage>(&bytes).unwrap(), m);
    }
}
