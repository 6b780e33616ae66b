//! Facts, record framing, the per-worker stream format, and runs of several streams.
//!
//! ## Stream format, version 1 (still read; `replay --log-format 1` writes it)
//! ```text
//! stream  := header record*
//! header  := MAGIC(8) format_version(u16 LE) codec_id(u16 LE) header_len(u32 LE)
//!            header_crc(u32 LE, crc32 of header bytes) header_bytes(StreamHeader, codec)
//! record  := len(u32 LE, bytes after the crc) crc(u32 LE, crc32 of the bytes after it)
//!            seq(u64 LE) at_ns(u64 LE) fact(codec)
//! ```
//! A record's `seq` starts at 0 and rises by one per record in its stream. `len` counts
//! `seq`, `at_ns` and the fact, so it is at least 16 and at most [`MAX_RECORD_BYTES`] (16 MiB);
//! a header's length is at most [`MAX_HEADER_BYTES`]. The record checksum does not cover `len`
//! itself: a damaged `len` shows as a checksum mismatch over the wrong byte range.
//!
//! **Torn tail.** Only a record cut off by the end of the file (fewer than 8 bytes for
//! `len`/`crc`, or fewer than `len` bytes after them) is a torn tail: readers stop there
//! cleanly and report it, and [`recover`] / [`StreamWriter::open_append`] truncate it. One
//! exception keeps recovery from destroying data: if the bytes that are present already hold a
//! record matching the stored checksum, the record was written whole and its `len` is damaged,
//! which is an error. Any other damage (checksum mismatch, undecodable fact, a `seq` that is
//! not the previous plus one, an impossible `len`) is an error naming the file and the byte
//! offset of the record's `len` field. A damaged or truncated header is always an error.
//!
//! ## Stream format, version 2 (what this build writes)
//! ```text
//! stream  := header block*          (the header exactly as in v1, version 2 in the prelude)
//! block   := len(u32 LE) crc(u32 LE) body       (framed like a v1 record)
//! ```
//! A block packs up to 64 KiB of records (lz4, or stored when that is not smaller) with one
//! checksum; a record's `seq` follows from the block's first, its `at_ns` is a varint delta, and
//! the block hashes of `KvStored` / `KvRemoved` go through a stream-local table that resets at
//! epochs (at most [`codec::HASH_TABLE_ENTRIES`] hashes or 8 MiB unpacked), so a reader that
//! seeks reads at most one epoch first. The body layout is in the `block` module. A record's
//! position (what the index stores, what readers resume at) is its block's byte offset shifted
//! left 16 bits plus its place in the block ([`LogFormat::position`]); in v1 it is the record's
//! byte offset.
//!
//! **Torn tail in v2.** The same rule on blocks: only a block cut off by the end of the file is a
//! torn tail, and cutting it loses the records it held (a writer hands a block over when it is
//! full or at [`StreamWriter::flush`]; live workers flush every 50 ms and at every terminal fact).
//! Anything else — a checksum mismatch, impossible block fields, a payload that does not unpack
//! to its stated length, an undecodable record, a reference outside the table, a `seq` gap — is
//! an error naming the file and the byte offset of the block's `len` field.
//!
//! Every reader takes both versions; writers take a [`LogFormat`] (v2 by default, `replay
//! --log-format 1` for v1). Merged files stay version 1.
//!
//! Runs (a directory of `{worker}.hlog` streams, or one merged `HOFFRUN` file) are described in
//! [`run`].

mod block;
pub mod codec;
pub mod error;
pub mod fact;
mod frame;
pub mod index;
pub mod layout;
pub mod reader;
pub mod run;
pub mod segment;
pub mod writer;

pub use error::LogError;
pub use fact::{BlockHash, Fact, KvDelta, MessageKind, MessageRejection, RejectReason, TerminalStatus};
pub use frame::TornTail;
pub use layout::{
    LogFormat, RunKind, RunLayout, Segment, SegmentKind, FORMAT_VERSION, MAGIC, MAX_HEADER_BYTES,
    MAX_RECORD_BYTES, RUN_FORMAT_VERSION, RUN_MAGIC,
};
pub use reader::{recover, verify_stream, StreamReader, StreamSummary};
pub use run::{
    recover_run, stream_file_name, verify_run, verify_run_with, write_merged, MergeSummary, RunReader,
    RunStreamSummary, RunSummary, RunWriter,
};
pub use segment::SegmentReader;
pub use writer::StreamWriter;

use crate::ids::{Backend, ClockDomain, HandoffPolicy, WorkerId};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// What a fold needs to know about the engine behind a stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineShape {
    /// Physical KV blocks (pages) on the worker.
    pub total_blocks: u32,
    /// Tokens per block (page).
    pub block_size: u32,
    /// Request slots (SGLang) or running-sequence limit (vLLM `max_num_seqs`).
    pub max_request_slots: u32,
    /// The full engine configuration as JSON, for reports and diff context.
    pub config_json: String,
}

impl EngineShape {
    /// The router stream has no engine.
    pub fn none() -> Self {
        EngineShape { total_blocks: 0, block_size: 0, max_request_slots: 0, config_json: String::new() }
    }
}

/// Everything a reader must know before the first record of a stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamHeader {
    /// The run this stream belongs to; all streams of one run share it.
    pub run_id: Uuid,
    /// The worker (its role included) that wrote the stream.
    pub worker: WorkerId,
    pub backend: Backend,
    pub policy: HandoffPolicy,
    pub clock: ClockDomain,
    /// The run's one seed (0 for live workers seeded from entropy).
    pub seed: u64,
    pub engine: EngineShape,
}

/// One framed fact.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Position in its stream, from 0.
    pub seq: u64,
    /// When it happened, on the stream's clock.
    pub at_ns: u64,
    pub fact: Fact,
}
