//! Identity, role and policy types shared by every layer.
//!
//! Everything here is plain data: serializable, ordered where order is observed, and free of
//! clocks. A [`HandoffId`] is minted from the run's seeded RNG ([`IdMint`]) so that a replay with
//! the same trace and seed writes byte-identical logs.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::fmt;
use uuid::Uuid;

/// One handoff *attempt*. Never reused: a retry or a restart gets a new id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct HandoffId(pub Uuid);

impl fmt::Display for HandoffId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::str::FromStr for HandoffId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s).map(HandoffId)
    }
}

/// One incarnation of a worker process. A restarted worker gets a higher generation, and every
/// message it sends carries it, so messages from an older incarnation can be told apart and
/// rejected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Generation(pub u32);

/// A source pin, minted by the prefill core when terminal prefill ownership becomes held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SourceLeaseId(pub u64);

/// A destination reservation, minted by the decode core when it reserves for a handoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DestinationReservationId(pub u64);

/// A request as the trace and the router know it (the trace line index in replay).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}", self.0)
    }
}

/// What a worker does in a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Role {
    /// Prefill worker: the source of handoffs.
    Prefill,
    /// Decode worker: the destination of handoffs.
    Decode,
    /// Aggregated worker: prefill and decode on one engine, no handoff.
    Aggregated,
    /// The frontend / router: bookings and request arrivals.
    Router,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Aggregated => "agg",
            Role::Router => "router",
        }
    }
}

/// A worker and its data-parallel rank (`WorkerWithDpRank` in the proposal). Ordered by role,
/// then index, then rank: this is the order in which streams are merged at equal timestamps.
///
/// Serialized as its text form (`decode-1`) in human-readable formats (JSON output) and as a
/// compact struct in the binary log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerId {
    pub role: Role,
    pub index: u32,
    pub dp_rank: u32,
}

/// The binary shape of [`WorkerId`] (part of the log format).
#[derive(Serialize, Deserialize)]
#[serde(rename = "WorkerId")]
struct WorkerIdWire {
    role: Role,
    index: u32,
    dp_rank: u32,
}

impl Serialize for WorkerId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(self)
        } else {
            WorkerIdWire { role: self.role, index: self.index, dp_rank: self.dp_rank }.serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for WorkerId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let text = String::deserialize(d)?;
            text.parse().map_err(serde::de::Error::custom)
        } else {
            let w = WorkerIdWire::deserialize(d)?;
            Ok(WorkerId { role: w.role, index: w.index, dp_rank: w.dp_rank })
        }
    }
}

impl WorkerId {
    pub const ROUTER: WorkerId = WorkerId { role: Role::Router, index: 0, dp_rank: 0 };

    pub fn prefill(index: u32) -> Self {
        WorkerId { role: Role::Prefill, index, dp_rank: 0 }
    }
    pub fn decode(index: u32) -> Self {
        WorkerId { role: Role::Decode, index, dp_rank: 0 }
    }
    pub fn aggregated(index: u32) -> Self {
        WorkerId { role: Role::Aggregated, index, dp_rank: 0 }
    }
}

impl fmt::Display for WorkerId {
    /// `prefill-0`, `decode-3`, `agg-1.2` (rank shown only when non-zero), `router`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.role == Role::Router {
            return write!(f, "router");
        }
        write!(f, "{}-{}", self.role.as_str(), self.index)?;
        if self.dp_rank != 0 {
            write!(f, ".{}", self.dp_rank)?;
        }
        Ok(())
    }
}

impl std::str::FromStr for WorkerId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "router" {
            return Ok(WorkerId::ROUTER);
        }
        let (role, rest) = s
            .split_once('-')
            .ok_or_else(|| format!("worker `{s}`: expected ROLE-INDEX[.RANK], e.g. prefill-0"))?;
        let role = match role {
            "prefill" => Role::Prefill,
            "decode" => Role::Decode,
            "agg" => Role::Aggregated,
            other => return Err(format!("worker `{s}`: unknown role `{other}`")),
        };
        let (index, rank) = match rest.split_once('.') {
            Some((i, r)) => (i, r),
            None => (rest, "0"),
        };
        let index = index.parse().map_err(|_| format!("worker `{s}`: bad index `{index}`"))?;
        let dp_rank = rank.parse().map_err(|_| format!("worker `{s}`: bad rank `{rank}`"))?;
        Ok(WorkerId { role, index, dp_rank })
    }
}

/// The engine a worker models.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Backend {
    // Aliases: a config file takes the command line's spellings too (the on-disk log encodes
    // the variant's index, which aliases do not touch).
    #[serde(alias = "vllm")]
    Vllm,
    #[serde(alias = "sglang")]
    Sglang,
    /// Modeled only far enough to refuse destination reservation (the proposal defers it).
    #[serde(alias = "trtllm", alias = "trt-llm")]
    TrtLlm,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Vllm => "vllm",
            Backend::Sglang => "sglang",
            Backend::TrtLlm => "trtllm",
        }
    }
    /// The policy the real engine follows.
    pub fn native_policy(self) -> HandoffPolicy {
        match self {
            Backend::Vllm | Backend::TrtLlm => HandoffPolicy::SourceFirst,
            Backend::Sglang => HandoffPolicy::DestinationFirst,
        }
    }
}

/// In which order the two roles acquire their resources.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum HandoffPolicy {
    /// Plain behaviour: no source pin, no destination reservation.
    #[serde(alias = "disabled")]
    Disabled,
    /// vLLM: prefill finishes and pins; decode reserves later.
    #[serde(alias = "source-first")]
    SourceFirst,
    /// SGLang: decode reserves slot + pages + headroom before prefill is dispatched.
    #[serde(alias = "destination-first")]
    DestinationFirst,
}

impl HandoffPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            HandoffPolicy::Disabled => "disabled",
            HandoffPolicy::SourceFirst => "source-first",
            HandoffPolicy::DestinationFirst => "destination-first",
        }
    }
}

/// What a handoff will need at the destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvHandoffDemand {
    pub context_tokens: u32,
    pub max_output_tokens: u32,
}

/// Whether a stream's timestamps come from a virtual (replay) or wall (live) clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ClockDomain {
    Virtual,
    /// A live process's wall clock (streams written before [`ClockDomain::WallSynced`]).
    Wall,
    /// A live process's wall clock, with where its model clock's origin lies and how that was
    /// set from the frontend's (appended: older streams keep reading as `Wall`).
    WallSynced(WallClockSync),
}

impl ClockDomain {
    /// Whether the stream's instants were read off a wall clock (a live run).
    pub fn is_wall(self) -> bool {
        !matches!(self, ClockDomain::Virtual)
    }
}

/// How a live process's model clock relates to its system clock and to the frontend's. Kept
/// for the post-mortem reader (how far apart two hosts' clocks were); no fold compares two
/// processes' instants, so skew cannot make a run look different.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WallClockSync {
    /// Model instant 0 on this process's system clock, Unix nanoseconds.
    pub origin_unix_ns: i64,
    /// This process's system clock minus the frontend's, as its best clock probe estimated it
    /// (the frontend's own stream: 0), ns.
    pub offset_ns: i64,
    /// Half that probe's round trip, the estimate's uncertainty (the frontend's own: 0), ns.
    pub uncertainty_ns: u64,
}

/// Why a handoff, lease or reservation ended other than by success.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum CancelReason {
    /// The client or frontend aborted the request.
    RequestAborted,
    /// The destination could never be reserved (e.g. the prompt can never fit there).
    DestinationRejected,
    /// The backend does not support this operation (TRT-LLM destination reservation).
    Unsupported,
    /// The transfer failed.
    TransferFailed,
    /// The peer's session ended (restart, disconnect).
    PeerLost,
    /// This worker's own session ended.
    OwnerLost,
    /// The run ended with the handoff unresolved (replay teardown).
    Teardown,
    /// A deadline passed (a destination reservation's waiting timeout).
    Expired,
    /// Destination-first: the prefill still waited for its destination's reservation when
    /// SGLang's bootstrap timeout passed (appended after format version 1: variants go last).
    BootstrapTimeout,
    /// Source-first: a destination still waiting for capacity gave its place up to a decode
    /// worker that joined with room (the handoff goes on there; appended after format v1).
    Rerouted,
}

impl CancelReason {
    pub fn as_str(self) -> &'static str {
        match self {
            CancelReason::RequestAborted => "request-aborted",
            CancelReason::DestinationRejected => "destination-rejected",
            CancelReason::Unsupported => "unsupported",
            CancelReason::TransferFailed => "transfer-failed",
            CancelReason::PeerLost => "peer-lost",
            CancelReason::OwnerLost => "owner-lost",
            CancelReason::Teardown => "teardown",
            CancelReason::Expired => "expired",
            CancelReason::BootstrapTimeout => "bootstrap-timeout",
            CancelReason::Rerouted => "rerouted",
        }
    }
}

/// How a source pin or destination reservation ended. Every one ends exactly once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum EndReason {
    /// Source: all readers acknowledged. Destination: activated into a running request.
    Success,
    /// The lease or reservation deadline passed.
    Expired,
    /// Canceled for the given reason.
    Canceled(CancelReason),
}

impl fmt::Display for EndReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EndReason::Success => write!(f, "success"),
            EndReason::Expired => write!(f, "expired"),
            EndReason::Canceled(r) => write!(f, "canceled:{}", r.as_str()),
        }
    }
}

/// Mints ids from the run's one seed. Replay uses one mint per run; live workers seed theirs
/// from entropy (ids only need to be unique there).
#[derive(Clone, Debug)]
pub struct IdMint {
    rng: ChaCha8Rng,
}

impl IdMint {
    pub fn from_seed(seed: u64) -> Self {
        IdMint { rng: ChaCha8Rng::seed_from_u64(seed) }
    }

    /// A version-4-shaped UUID whose 122 random bits come from the seeded stream.
    pub fn handoff_id(&mut self) -> HandoffId {
        let mut bytes = [0u8; 16];
        self.rng.fill_bytes(&mut bytes);
        HandoffId(uuid::Builder::from_random_bytes(bytes).into_uuid())
    }

    pub fn next_u64(&mut self) -> u64 {
        self.rng.next_u64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_id_round_trips_through_text() {
        for w in [
            WorkerId::prefill(0),
            WorkerId::decode(12),
            WorkerId { role: Role::Aggregated, index: 3, dp_rank: 2 },
            WorkerId::ROUTER,
        ] {
            assert_eq!(w.to_string().parse::<WorkerId>().unwrap(), w);
            let json = serde_json::to_string(&w).unwrap();
            assert_eq!(json, format!("\"{w}\""));
            assert_eq!(serde_json::from_str::<WorkerId>(&json).unwrap(), w);
            let mut bin = Vec::new();
            crate::events::codec::encode_into(&w, &mut bin).unwrap();
            assert_eq!(bin.len(), 3, "role, index and rank as varints");
            assert_eq!(crate::events::codec::decode_exact::<WorkerId>(&bin).unwrap(), w);
        }
        assert!("bogus-1".parse::<WorkerId>().is_err());
        assert!("prefill-x".parse::<WorkerId>().is_err());
    }

    #[test]
    fn seeded_mint_is_reproducible_and_distinct() {
        let mut a = IdMint::from_seed(7);
        let mut b = IdMint::from_seed(7);
        let ids: Vec<_> = (0..100).map(|_| a.handoff_id()).collect();
        let again: Vec<_> = (0..100).map(|_| b.handoff_id()).collect();
        assert_eq!(ids, again);
        let mut sorted = ids.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 100);
        assert_ne!(IdMint::from_seed(8).handoff_id(), ids[0]);
    }
}

/// Where each worker sits in a small table kept sorted by worker, found in O(1). Writers and
/// folds look the worker of every record up; a binary search over `WorkerId` (three fields,
/// branches the predictor cannot learn when streams interleave) cost more than the work it
/// led to. Rebuilt whenever the table changes (a stream added: rare).
#[derive(Clone, Debug, Default)]
pub struct WorkerSlots {
    /// Per role, per index (below [`WorkerSlots::DENSE_INDEX`], rank 0): the position + 1,
    /// 0 when absent.
    dense: [Vec<u32>; 4],
    /// Everyone else (high indices, data-parallel ranks).
    other: std::collections::BTreeMap<WorkerId, u32>,
}

impl WorkerSlots {
    /// Indices below this are found by direct lookup (bounded, so a hostile index cannot
    /// make the table large).
    pub const DENSE_INDEX: u32 = 1024;

    /// The table for `workers`, in their order.
    pub fn rebuild(&mut self, workers: impl IntoIterator<Item = WorkerId>) {
        for v in &mut self.dense {
            v.clear();
        }
        self.other.clear();
        for (i, w) in workers.into_iter().enumerate() {
            let at = i as u32 + 1;
            if w.dp_rank == 0 && w.index < Self::DENSE_INDEX {
                let v = &mut self.dense[w.role as usize];
                if v.len() <= w.index as usize {
                    v.resize(w.index as usize + 1, 0);
                }
                v[w.index as usize] = at;
            } else {
                self.other.insert(w, at);
            }
        }
    }

    /// `w`'s position, if it is in the table.
    #[inline]
    pub fn get(&self, w: WorkerId) -> Option<usize> {
        let at = if w.dp_rank == 0 && w.index < Self::DENSE_INDEX {
            self.dense[w.role as usize].get(w.index as usize).copied().unwrap_or(0)
        } else {
            self.other.get(&w).copied().unwrap_or(0)
        };
        (at as usize).checked_sub(1)
    }
}

#[cfg(test)]
mod worker_slots_tests {
    use super::*;

    #[test]
    fn slots_find_every_worker_and_nothing_else() {
        let workers = [
            WorkerId::ROUTER,
            WorkerId::prefill(0),
            WorkerId::prefill(3),
            WorkerId::decode(1),
            WorkerId { role: Role::Decode, index: 1, dp_rank: 2 },
            WorkerId::decode(5000),
        ];
        let mut s = WorkerSlots::default();
        s.rebuild(workers);
        for (i, w) in workers.iter().enumerate() {
            assert_eq!(s.get(*w), Some(i), "{w}");
        }
        for w in [WorkerId::prefill(1), WorkerId::decode(0), WorkerId::decode(4999), WorkerId::prefill(5000)]
        {
            assert_eq!(s.get(w), None, "{w}");
        }
        s.rebuild([WorkerId::decode(1)]);
        assert_eq!((s.get(WorkerId::decode(1)), s.get(WorkerId::ROUTER)), (Some(0), None));
    }
}
