//! Format v2's blocks: records packed into compressed, checksummed blocks.
//!
//! A block is framed like a v1 record (`len | crc | body`, [`super::frame`]), so the torn-tail
//! rule is the same code: only a block cut off by the end of the file is a torn tail. Its body:
//!
//! ```text
//! body    := compression(u8: 0 stored, 1 lz4) flags(u8: bit 0 = epoch start)
//!            records(u32 LE) first_seq(u64 LE) first_at_ns(u64 LE)
//!            epoch_offset(u64 LE: byte offset of the block that began this block's epoch)
//!            raw_len(u32 LE) payload(raw_len bytes once decompressed)
//! payload := record{records}
//! record  := at_delta(varint, zig-zag, from the previous record's at_ns; the first's from
//!            first_at_ns) fact_len(varint) fact(codec v2)
//! ```
//! A record's `seq` is `first_seq` + its place in the block. Codec v2 is bincode except for the
//! block hashes of `KvStored` / `KvRemoved`, which go through a stream-local table that both
//! sides rebuild in order ([`super::codec::HashTableWriter`]). The table starts empty at an
//! epoch start and grows to at most [`HASH_TABLE_ENTRIES`] before the writer starts another
//! epoch, so reading any record needs at most its epoch, never the whole stream: a reader that
//! seeks goes to the block's `epoch_offset` first.
//!
//! A record's position (what the index stores and readers resume at) is
//! `block_offset << 16 | place in block` ([`super::layout::LogFormat::position`]).

use super::codec::{self, HashTableReader, HashTableWriter, HASH_TABLE_ENTRIES};
use super::layout::{FRAME_PREFIX_BYTES, MAX_RECORD_BYTES};
use super::Fact;

/// Bytes of a block body before its payload.
pub(crate) const BLOCK_FIXED_BYTES: usize = 34;
/// A block is sealed once its raw payload reaches this many bytes.
pub(crate) const BLOCK_TARGET_BYTES: usize = 64 << 10;
/// ... or holds this many records (a position has 16 bits for the place in the block).
pub(crate) const MAX_BLOCK_RECORDS: u32 = 1 << 16;
/// An epoch also ends once its blocks hold this many bytes unpacked, which bounds what a
/// reader that seeks must read first.
pub(crate) const EPOCH_RAW_BYTES: usize = 8 << 20;
/// The largest fact a v2 record carries: a block holding it and a full target's worth of other
/// records still fits a frame.
pub(crate) const MAX_V2_FACT_BYTES: usize = MAX_RECORD_BYTES - 2 * BLOCK_TARGET_BYTES;

const STORED: u8 = 0;
const LZ4: u8 = 1;
const EPOCH_START: u8 = 1;

fn zigzag(d: i64) -> u64 {
    ((d << 1) ^ (d >> 63)) as u64
}

fn unzigzag(z: u64) -> i64 {
    (z >> 1) as i64 ^ -((z & 1) as i64)
}

/// Gathers records into a block and seals it.
pub(crate) struct BlockWriter {
    raw: Vec<u8>,
    fact: Vec<u8>,
    compressed: Vec<u8>,
    records: u32,
    first_seq: u64,
    first_at_ns: u64,
    last_at_ns: u64,
    table: HashTableWriter,
    /// Byte offset of the block that began the current epoch.
    epoch_offset: u64,
    /// The block being gathered starts an epoch.
    epoch_start: bool,
    /// Unpacked bytes of the epoch's blocks sealed so far.
    epoch_raw_bytes: usize,
}

impl Default for BlockWriter {
    fn default() -> Self {
        BlockWriter {
            raw: Vec::with_capacity(BLOCK_TARGET_BYTES + 1024),
            fact: Vec::with_capacity(256),
            compressed: Vec::new(),
            records: 0,
            first_seq: 0,
            first_at_ns: 0,
            last_at_ns: 0,
            table: HashTableWriter::default(),
            epoch_offset: 0,
            epoch_start: true,
            epoch_raw_bytes: 0,
        }
    }
}

impl BlockWriter {
    /// Records gathered and not yet sealed.
    pub(crate) fn pending(&self) -> u32 {
        self.records
    }

    /// Adds one record. Returns whether the block is now full (seal it before the next push).
    /// An error leaves the table ahead of the block (the caller poisons its writer).
    pub(crate) fn push(&mut self, seq: u64, at_ns: u64, fact: &Fact) -> Result<bool, String> {
        if self.records == 0 {
            self.first_seq = seq;
            self.first_at_ns = at_ns;
            self.last_at_ns = at_ns;
            if self.epoch_start {
                self.table.clear();
            }
        }
        self.fact.clear();
        codec::encode_fact_v2(fact, &mut self.table, &mut self.fact)?;
        if self.fact.len() > MAX_V2_FACT_BYTES {
            return Err(format!("a fact of {} bytes (at most {MAX_V2_FACT_BYTES})", self.fact.len()));
        }
        codec::varint(&mut self.raw, zigzag(at_ns.wrapping_sub(self.last_at_ns) as i64));
        codec::varint(&mut self.raw, self.fact.len() as u64);
        self.raw.extend_from_slice(&self.fact);
        self.last_at_ns = at_ns;
        self.records += 1;
        Ok(self.raw.len() >= BLOCK_TARGET_BYTES || self.records >= MAX_BLOCK_RECORDS)
    }

    /// Writes the gathered records as one frame into `out` (cleared first), the block starting at
    /// byte `block_offset` of its file, and starts the next block. Nothing when no record waits.
    pub(crate) fn seal(&mut self, block_offset: u64, out: &mut Vec<u8>) {
        out.clear();
        if self.records == 0 {
            return;
        }
        if self.epoch_start {
            self.epoch_offset = block_offset;
            self.epoch_raw_bytes = 0;
        }
        self.epoch_raw_bytes += self.raw.len();
        self.compressed.resize(lz4_flex::block::get_maximum_output_size(self.raw.len()), 0);
        let packed = lz4_flex::block::compress_into(&self.raw, &mut self.compressed).unwrap_or(usize::MAX);
        let (compression, payload) =
            if packed < self.raw.len() { (LZ4, &self.compressed[..packed]) } else { (STORED, &self.raw[..]) };
        out.extend_from_slice(&[0u8; FRAME_PREFIX_BYTES]);
        out.push(compression);
        out.push(if self.epoch_start { EPOCH_START } else { 0 });
        out.extend_from_slice(&self.records.to_le_bytes());
        out.extend_from_slice(&self.first_seq.to_le_bytes());
        out.extend_from_slice(&self.first_at_ns.to_le_bytes());
        out.extend_from_slice(&self.epoch_offset.to_le_bytes());
        out.extend_from_slice(&(self.raw.len() as u32).to_le_bytes());
        out.extend_from_slice(payload);
        self.raw.clear();
        self.records = 0;
        self.epoch_start = self.table.len() >= HASH_TABLE_ENTRIES || self.epoch_raw_bytes >= EPOCH_RAW_BYTES;
    }
}

/// The fixed fields of a block body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockHead {
    pub compression: u8,
    pub epoch_start: bool,
    pub records: u32,
    pub first_seq: u64,
    pub first_at_ns: u64,
    pub epoch_offset: u64,
    pub raw_len: usize,
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b.try_into().expect("4 bytes"))
}

fn le_u64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().expect("8 bytes"))
}

impl BlockHead {
    /// Reads and checks the fixed fields of `body` (at least [`BLOCK_FIXED_BYTES`] long: the frame
    /// reader's minimum), the block starting at `block_offset`.
    pub(crate) fn parse(body: &[u8], block_offset: u64) -> Result<Self, String> {
        let head = BlockHead {
            compression: body[0],
            epoch_start: body[1] & EPOCH_START != 0,
            records: le_u32(&body[2..6]),
            first_seq: le_u64(&body[6..14]),
            first_at_ns: le_u64(&body[14..22]),
            epoch_offset: le_u64(&body[22..30]),
            raw_len: le_u32(&body[30..34]) as usize,
        };
        if head.compression > LZ4 {
            return Err(format!("unknown block compression {}", head.compression));
        }
        if body[1] & !EPOCH_START != 0 {
            return Err(format!("unknown block flags {:#04x}", body[1]));
        }
        if head.records == 0 || head.records > MAX_BLOCK_RECORDS {
            return Err(format!("a block of {} records (1 to {MAX_BLOCK_RECORDS})", head.records));
        }
        if head.raw_len > MAX_RECORD_BYTES {
            return Err(format!("a block of {} bytes unpacked (at most {MAX_RECORD_BYTES})", head.raw_len));
        }
        let epoch_ok = if head.epoch_start {
            head.epoch_offset == block_offset
        } else {
            head.epoch_offset < block_offset
        };
        if !epoch_ok {
            return Err(format!(
                "epoch offset {} impossible for a block at {block_offset}",
                head.epoch_offset
            ));
        }
        Ok(head)
    }
}

/// Walks the records of one block after another, keeping the epoch's hash table.
#[derive(Default)]
pub(crate) struct BlockCursor {
    raw: Vec<u8>,
    at: usize,
    /// Place in the block of the next record.
    pub place: u32,
    records: u32,
    first_seq: u64,
    at_ns: u64,
    /// Byte offset of the block loaded.
    pub block_offset: u64,
    table: HashTableReader,
    /// The table holds an epoch's start (a block loaded mid-epoch cannot be read).
    in_epoch: bool,
}

impl BlockCursor {
    /// Whether a loaded block still has records to return.
    pub(crate) fn has_next(&self) -> bool {
        self.place < self.records
    }

    /// Loads the block whose body (checksum verified) is `body`, found at `block_offset`.
    pub(crate) fn load(&mut self, body: &[u8], block_offset: u64) -> Result<BlockHead, String> {
        self.records = 0;
        let head = BlockHead::parse(body, block_offset)?;
        if head.epoch_start {
            self.table.clear();
            self.in_epoch = true;
        } else if !self.in_epoch {
            return Err(format!(
                "the block continues an epoch begun at byte {}, which was not read",
                head.epoch_offset
            ));
        }
        let payload = &body[BLOCK_FIXED_BYTES..];
        self.raw.clear();
        if head.compression == STORED {
            if payload.len() != head.raw_len {
                return Err(format!(
                    "stored payload of {} bytes, header says {}",
                    payload.len(),
                    head.raw_len
                ));
            }
            self.raw.extend_from_slice(payload);
        } else {
            self.raw.resize(head.raw_len, 0);
            match lz4_flex::block::decompress_into(payload, &mut self.raw) {
                Ok(n) if n == head.raw_len => {}
                Ok(n) => return Err(format!("payload unpacks to {n} bytes, header says {}", head.raw_len)),
                Err(e) => return Err(format!("payload does not unpack: {e}")),
            }
        }
        self.at = 0;
        self.place = 0;
        self.records = head.records;
        self.first_seq = head.first_seq;
        self.at_ns = head.first_at_ns;
        self.block_offset = block_offset;
        Ok(head)
    }

    /// The next record of the block: its place, seq, at_ns and fact. After the block's last
    /// record, checks that its payload is used up.
    pub(crate) fn next(&mut self) -> Result<(u32, u64, u64, Fact), String> {
        let place = self.place;
        let fail = |e: String| format!("record {place} of the block: {e}");
        let delta = codec::read_varint(&self.raw, &mut self.at).map_err(fail)?;
        let len = codec::read_varint(&self.raw, &mut self.at).map_err(fail)? as usize;
        let end = self.at.checked_add(len).filter(|&e| e <= self.raw.len()).ok_or_else(|| {
            fail(format!("a fact of {len} bytes, {} left in the block", self.raw.len() - self.at))
        })?;
        let fact = codec::decode_fact_v2(&self.raw[self.at..end], &mut self.table)
            .map_err(|e| fail(format!("undecodable fact: {e}")))?;
        self.at = end;
        self.at_ns = self.at_ns.wrapping_add(unzigzag(delta) as u64);
        self.place += 1;
        if self.place == self.records && self.at != self.raw.len() {
            let extra = self.raw.len() - self.at;
            self.records = 0;
            return Err(format!("{extra} bytes after the block's last record"));
        }
        Ok((place, self.first_seq.wrapping_add(place as u64), self.at_ns, fact))
    }
}
