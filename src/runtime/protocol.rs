//! Every message between the frontend and the workers, and between the two workers of a
//! handoff, as one serializable type.
//!
//! Replay carries an [`Envelope`] through its in-process network; live mode carries the same
//! envelope over TCP, encoded by the log's codec module ([`Envelope::encode`]). Each envelope
//! names its sender and the sender's session generation, so a receiver can tell a message from
//! an older incarnation of its peer, and the protocol version, so a peer speaking another
//! version is refused by name instead of misread.

use crate::events::{codec, Fact, TerminalStatus};
use crate::ids::{CancelReason, Generation, HandoffId, RequestId, WorkerId};
use crate::lifecycle::messages::HandoffMessage;
use crate::model::Request;
use serde::{Deserialize, Serialize};

/// The protocol version every envelope carries.
pub const PROTOCOL_VERSION: u16 = 2;

/// Who sent an envelope.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Endpoint {
    Frontend,
    Worker(WorkerId),
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Frontend => f.write_str("frontend"),
            Endpoint::Worker(w) => write!(f, "{w}"),
        }
    }
}

/// A worker and the session generation it is known by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peer {
    pub worker: WorkerId,
    pub generation: Generation,
}

/// Frontend → worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToWorker {
    /// A request with no handoff (aggregated serving, or a Disabled-policy prefill).
    Submit { request: Request },
    /// Disabled policy's decode: the prompt's KV arrives with the request at `kv_ready_at_ns`;
    /// the core takes it then.
    SubmitPrefilled { request: Request, kv_ready_at_ns: u64 },
    /// Be the source of `handoff` for `request`; `destination` is known when the decode was
    /// routed with the prefill (destination-first).
    StartSource { handoff: HandoffId, request: Request, destination: Option<Peer> },
    /// Be the destination of `handoff`, reading from `source`.
    StartDestination { handoff: HandoffId, request: Request, source: Peer },
    /// The request ended without this worker's part succeeding: let go of the handoff.
    CancelHandoff { handoff: HandoffId, reason: CancelReason },
    /// SGLang's bootstrap timeout: a source still waiting for its destination gives up.
    BootstrapExpired { handoff: HandoffId },
    /// A decode worker joined with room: a destination still waiting for its reservation lets
    /// go of its place (the core drops it from its pending queue) so the handoff can be routed
    /// there. One already reserved ignores this.
    WithdrawDestination { handoff: HandoffId },
}

/// Which role of a handoff a worker played.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HandoffRole {
    Source,
    Destination,
}

/// Worker → frontend.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ToFrontend {
    /// The worker's session began (at start, and again after a restart).
    SessionStarted { generation: Generation },
    /// A KV event for the routers' indexes: a `KvStored`, `KvRemoved` or `KvCleared` fact.
    KvChanged { fact: Fact },
    /// The source's prefill was handed to the core: its prefill booking stays until the core
    /// lets go ([`ToFrontend::PrefillLeftCore`] or, once pinned, [`ToFrontend::SourceReleased`]).
    PrefillDispatched { handoff: HandoffId },
    /// The prefill is done and its KV pinned (source-first routes the decode now).
    PrefillPinned { handoff: HandoffId, request: RequestId },
    /// A dispatched prefill the core no longer computes and never pinned (ended or refused).
    PrefillLeftCore { handoff: HandoffId },
    /// The core released the source pin: the prefill booking goes with it.
    SourceReleased { handoff: HandoffId },
    /// A request made its first token on this worker.
    FirstToken { request: RequestId },
    /// Disabled policy: a prefill finished and freed its KV; the decode follows.
    PrefillFinished { request: RequestId },
    /// The destination activated: the request is ordinary decode work from here on.
    DecodeActivated { handoff: HandoffId },
    /// The worker's role of `handoff` ended; `refused` when a core refusal ended it.
    RoleEnded { handoff: HandoffId, role: HandoffRole, success: bool, refused: bool },
    /// The request finished on this worker.
    Finished { request: RequestId, status: TerminalStatus, output_tokens: u32 },
    /// The core refused the request (or its handoff) for good.
    Rejected { request: RequestId },
    /// The destination let its waiting reservation go on [`ToWorker::WithdrawDestination`]:
    /// its role ended without touching the source, which waits for the next destination.
    DestinationWithdrawn { handoff: HandoffId },
}

/// What an envelope says.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Body {
    ToWorker(ToWorker),
    ToFrontend(ToFrontend),
    /// Worker ↔ worker, between the two roles of one handoff.
    Handoff(HandoffMessage),
}

/// One message on the wire.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    pub version: u16,
    pub from: Endpoint,
    /// The sender's session generation when it sent this.
    pub generation: Generation,
    pub body: Body,
}

/// An envelope that could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("protocol version {found} (this build speaks {PROTOCOL_VERSION})")]
    Version { found: u16 },
    #[error("malformed envelope: {0}")]
    Malformed(String),
}

impl Envelope {
    pub fn new(from: Endpoint, generation: Generation, body: Body) -> Self {
        Envelope { version: PROTOCOL_VERSION, from, generation, body }
    }

    /// Appends the envelope's encoding (the log's codec) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), ProtocolError> {
        codec::encode_into(self, out).map_err(ProtocolError::Malformed)
    }

    /// Decodes one envelope that fills `bytes` exactly. The version is checked before the
    /// body is trusted: it is the first field, so an envelope of another version is named as
    /// such even when its body no longer parses.
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtocolError> {
        let version: u16 = leading_version(bytes)?;
        if version != PROTOCOL_VERSION {
            return Err(ProtocolError::Version { found: version });
        }
        codec::decode_exact(bytes).map_err(ProtocolError::Malformed)
    }
}

/// The version field at the head of an encoded envelope.
fn leading_version(bytes: &[u8]) -> Result<u16, ProtocolError> {
    #[derive(Deserialize)]
    struct Head {
        version: u16,
    }
    // A struct decodes field by field: reading only the first leaves the rest unread.
    codec::decode_prefix::<Head>(bytes).map(|(h, _)| h.version).map_err(ProtocolError::Malformed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{DestinationReservationId, IdMint};
    use crate::lifecycle::messages::MessageBody;

    fn every_body() -> Vec<Body> {
        let mut mint = IdMint::from_seed(3);
        let h = mint.handoff_id();
        let request = Request::unique(RequestId(7), 700, 20, 5);
        let peer = Peer { worker: WorkerId::decode(1), generation: Generation(2) };
        let kv = Fact::KvCleared;
        vec![
            Body::ToWorker(ToWorker::Submit { request: request.clone() }),
            Body::ToWorker(ToWorker::SubmitPrefilled { request: request.clone(), kv_ready_at_ns: 9 }),
            Body::ToWorker(ToWorker::StartSource {
                handoff: h,
                request: request.clone(),
                destination: Some(peer),
            }),
            Body::ToWorker(ToWorker::StartDestination { handoff: h, request, source: peer }),
            Body::ToWorker(ToWorker::CancelHandoff { handoff: h, reason: CancelReason::RequestAborted }),
            Body::ToWorker(ToWorker::BootstrapExpired { handoff: h }),
            Body::ToFrontend(ToFrontend::SessionStarted { generation: Generation(4) }),
            Body::ToFrontend(ToFrontend::KvChanged { fact: kv }),
            Body::ToFrontend(ToFrontend::PrefillDispatched { handoff: h }),
            Body::ToFrontend(ToFrontend::PrefillPinned { handoff: h, request: RequestId(7) }),
            Body::ToFrontend(ToFrontend::PrefillLeftCore { handoff: h }),
            Body::ToFrontend(ToFrontend::SourceReleased { handoff: h }),
            Body::ToFrontend(ToFrontend::FirstToken { request: RequestId(7) }),
            Body::ToFrontend(ToFrontend::PrefillFinished { request: RequestId(7) }),
            Body::ToFrontend(ToFrontend::DecodeActivated { handoff: h }),
            Body::ToFrontend(ToFrontend::RoleEnded {
                handoff: h,
                role: HandoffRole::Destination,
                success: false,
                refused: true,
            }),
            Body::ToFrontend(ToFrontend::Finished {
                request: RequestId(7),
                status: TerminalStatus::Completed,
                output_tokens: 20,
            }),
            Body::ToFrontend(ToFrontend::Rejected { request: RequestId(7) }),
            Body::Handoff(HandoffMessage {
                handoff: h,
                from: WorkerId::decode(1),
                generation: Generation(2),
                body: MessageBody::DestinationReserved {
                    destination: WorkerId::decode(1),
                    reservation: DestinationReservationId(3),
                    prefix_tokens: 16,
                    missing_tokens: 684,
                },
            }),
        ]
    }

    #[test]
    fn every_message_round_trips_through_the_codec() {
        for body in every_body() {
            let e = Envelope::new(Endpoint::Worker(WorkerId::prefill(0)), Generation(1), body);
            let mut bytes = Vec::new();
            e.encode(&mut bytes).unwrap();
            assert_eq!(Envelope::decode(&bytes).unwrap(), e);
        }
    }

    #[test]
    fn another_version_is_named_and_garbage_is_an_error() {
        let mut e = Envelope::new(Endpoint::Frontend, Generation(1), every_body().remove(0));
        e.version = 9;
        let mut bytes = Vec::new();
        e.encode(&mut bytes).unwrap();
        assert_eq!(Envelope::decode(&bytes), Err(ProtocolError::Version { found: 9 }));
        // A truncated envelope and trailing bytes are both refused, never panicking.
        let mut good = Vec::new();
        Envelope::new(Endpoint::Frontend, Generation(1), every_body().remove(2)).encode(&mut good).unwrap();
        for cut in 0..good.len() {
            assert!(Envelope::decode(&good[..cut]).is_err(), "a {cut}-byte prefix decoded");
        }
        good.push(0);
        assert!(matches!(Envelope::decode(&good), Err(ProtocolError::Malformed(_))));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 2000, ..Default::default() })]

        /// A hostile peer's bytes: every envelope with flips, insertions, deletions and a cut
        /// decodes to some envelope or fails as malformed or another version, never panicking;
        /// an envelope that decodes encodes back to bytes that decode to it again.
        #[test]
        fn mutated_envelopes_decode_or_fail_cleanly(
            pick in 0usize..19,
            edits in proptest::collection::vec((0usize..4, proptest::prelude::any::<usize>(), proptest::prelude::any::<u8>()), 1..8),
        ) {
            let bodies = every_body();
            let e = Envelope::new(Endpoint::Worker(WorkerId::decode(3)), Generation(2), bodies[pick % bodies.len()].clone());
            let mut bytes = Vec::new();
            e.encode(&mut bytes).unwrap();
            for (kind, at, b) in edits {
                let n = bytes.len().max(1);
                match kind {
                    0 if !bytes.is_empty() => bytes[at % n] = b,
                    1 => bytes.insert(at % (bytes.len() + 1), b),
                    2 if !bytes.is_empty() => {
                        bytes.remove(at % n);
                    }
                    _ => bytes.truncate(at % (bytes.len() + 1)),
                }
            }
            match Envelope::decode(&bytes) {
                Ok(d) => {
                    let mut again = Vec::new();
                    d.encode(&mut again).unwrap();
                    proptest::prop_assert_eq!(Envelope::decode(&again).unwrap(), d);
                }
                Err(ProtocolError::Version { found }) => proptest::prop_assert_ne!(found, PROTOCOL_VERSION),
                Err(ProtocolError::Malformed(_)) => {}
            }
        }
    }
}
