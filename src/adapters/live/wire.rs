//! What live processes say to each other over TCP: length-delimited frames (a 4-byte
//! big-endian length, then the body) whose body is a [`Frame`] encoded by the log's codec.
//!
//! Every frame starts with the protocol version, checked before anything else is read, so a
//! peer of another build is refused by name. A frame longer than [`MAX_FRAME_BYTES`] is refused
//! before its body is read: a hostile length cannot make a process allocate.

use crate::events::codec;
use crate::ids::{Generation, WorkerId};
use crate::runtime::{Envelope, ProtocolError, PROTOCOL_VERSION};
use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tokio_util::codec::{Decoder, Encoder, LengthDelimitedCodec};

/// The largest frame body accepted (a request with its block hashes is well below this).
pub const MAX_FRAME_BYTES: usize = 8 * 1024 * 1024;

/// One frame on a live link.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Frame {
    pub version: u16,
    pub body: FrameBody,
}

/// What a worker reports about itself when it leaves.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerSummary {
    pub drained: bool,
    /// When not drained: what it still held.
    pub stuck: Vec<String>,
    pub lag: super::schedule::LagStats,
    /// Half the best handshake round trip, wall microseconds (the clock offset's uncertainty).
    pub clock_uncertainty_us: u64,
    /// Steps run, and how far after its modeled end (wall time) each step's end was handled:
    /// the drift of the worker's step timing from the model, beyond the configured hold.
    pub steps: u64,
    pub step_end_lag_us_sum: u64,
    pub step_end_lag_us_max: u64,
    pub cpu_ms: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum FrameBody {
    /// Worker → frontend, first frame: who it is and where peers reach it.
    Hello { worker: WorkerId, listen: String, metrics: Option<String>, pid: u32 },
    /// Frontend → worker: accepted into the run under `generation`, with the run's
    /// configuration (JSON of the replay configuration) and timing.
    Welcome {
        run_id: uuid::Uuid,
        generation: Generation,
        config_json: String,
        timing: super::LiveTiming,
        /// The trace, for the stream header's description.
        trace_json: String,
    },
    /// Worker → frontend: a clock probe; the frontend answers with its model time.
    Probe { id: u32 },
    ProbeAnswer {
        id: u32,
        model_ns: i64,
        /// The frontend's system clock as it answered, Unix ns (for the skew estimate).
        unix_ns: i64,
    },
    /// Worker → frontend: the clock is set and the stream is open.
    Ready,
    /// Frontend → worker: the address book (sent again when a worker rejoins).
    Peers { peers: Vec<PeerAddress> },
    /// First frame on a worker → worker connection.
    PeerHello { run_id: uuid::Uuid, worker: WorkerId, generation: Generation },
    /// A protocol envelope, stamped with the model instant its sender handled it at;
    /// `cause_ns` is the instant at which the input that produced it was queued there (the
    /// frontend breaks ties of one instant by it, as the replay's queue does).
    Stamped { at_ns: u64, cause_ns: u64, envelope: Envelope },
    /// Keeps a quiet link alive (and tells a silent one from a slow one).
    Heartbeat,
    /// Frontend → worker: the run is over; finish, close the stream and leave.
    Shutdown,
    /// Worker → frontend: its stream is closed; the last frame of a worker.
    Bye { summary: WorkerSummary },
    /// Frontend → workers: a worker's session ended without a word (its process died or
    /// went silent); each side reclaims what it holds for it.
    WorkerLost { worker: WorkerId, generation: Generation },
    /// Frontend → worker, instead of a welcome: why this hello was not taken. With
    /// `retry_for_ms`, the refusal may pass (the worker's earlier session is still counted in
    /// the run until its link is found dead): the worker may say hello again for that long.
    Refused { why: String, retry_for_ms: Option<u64> },
}

/// Where a worker listens for its peers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerAddress {
    pub worker: WorkerId,
    pub generation: Generation,
    pub address: String,
}

impl Frame {
    pub fn new(body: FrameBody) -> Self {
        Frame { version: PROTOCOL_VERSION, body }
    }

    pub fn encode(&self) -> Result<Vec<u8>, ProtocolError> {
        let mut out = Vec::new();
        codec::encode_into(self, &mut out).map_err(ProtocolError::Malformed)?;
        Ok(out)
    }

    /// Decodes one frame body; another version is named as such even if the rest would not
    /// parse.
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtocolError> {
        #[derive(Deserialize)]
        struct Head {
            version: u16,
        }
        let (head, _) = codec::decode_prefix::<Head>(bytes).map_err(ProtocolError::Malformed)?;
        if head.version != PROTOCOL_VERSION {
            return Err(ProtocolError::Version { found: head.version });
        }
        let frame: Frame = codec::decode_exact(bytes).map_err(ProtocolError::Malformed)?;
        if let FrameBody::Stamped { envelope, .. } = &frame.body {
            if envelope.version != PROTOCOL_VERSION {
                return Err(ProtocolError::Version { found: envelope.version });
            }
        }
        Ok(frame)
    }
}

/// The tokio codec of a live link: length-delimited [`Frame`]s.
pub struct LinkCodec {
    inner: LengthDelimitedCodec,
}

impl Default for LinkCodec {
    fn default() -> Self {
        LinkCodec { inner: LengthDelimitedCodec::builder().max_frame_length(MAX_FRAME_BYTES).new_codec() }
    }
}

fn invalid(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
}

impl Decoder for LinkCodec {
    type Item = Frame;
    type Error = std::io::Error;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, std::io::Error> {
        match self.inner.decode(src)? {
            Some(bytes) => Frame::decode(&bytes).map(Some).map_err(invalid),
            None => Ok(None),
        }
    }
}

impl Encoder<Frame> for LinkCodec {
    type Error = std::io::Error;

    fn encode(&mut self, frame: Frame, dst: &mut BytesMut) -> Result<(), std::io::Error> {
        let bytes = frame.encode().map_err(invalid)?;
        self.inner.encode(Bytes::from(bytes), dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_other_versions_are_named() {
        let f = Frame::new(FrameBody::Probe { id: 3 });
        let bytes = f.encode().unwrap();
        assert_eq!(Frame::decode(&bytes).unwrap(), f);
        let mut other = bytes.clone();
        other[0] = 9;
        assert_eq!(Frame::decode(&other), Err(ProtocolError::Version { found: 9 }));
        assert!(matches!(Frame::decode(&bytes[..bytes.len() - 1]), Err(ProtocolError::Malformed(_))));
    }

    #[test]
    fn an_oversized_length_is_refused_before_its_body() {
        let mut codec = LinkCodec::default();
        let mut buf = BytesMut::from(&((MAX_FRAME_BYTES as u32) + 1).to_be_bytes()[..]);
        assert!(codec.decode(&mut buf).is_err());
    }
}
