//! The on-disk layout, in one place: every format constant, how a record body is laid out under
//! each framing, where each file's records start, and which files make up a run.
//!
//! Readers ([`super::segment`], [`super::reader`], [`super::run`], [`super::index`]) and writers
//! ([`super::writer`], [`super::run::write_merged`]) take their numbers from here, so the two
//! sides cannot drift apart. The formats themselves are described in [`crate::events`] (streams)
//! and [`crate::events::run`] (runs and merged files).

use super::error::LogError;
use super::frame;
use super::StreamHeader;
use crate::ids::WorkerId;
use serde::{Deserialize, Serialize};
use std::fs::{self, File};
use std::io::BufReader;
use std::path::{Path, PathBuf};

/// The first eight bytes of every stream file.
pub const MAGIC: [u8; 8] = *b"HOFFLOG\0";
/// The stream format this build writes by default; it reads every version of [`LogFormat`].
pub const FORMAT_VERSION: u16 = LogFormat::V2.version();
/// The first eight bytes of a merged run file.
pub const RUN_MAGIC: [u8; 8] = *b"HOFFRUN\0";
/// The merged-run format this build writes and reads.
pub const RUN_FORMAT_VERSION: u16 = 1;
/// The extension of per-worker stream files in a run directory.
pub const STREAM_EXTENSION: &str = "hlog";

/// The largest record body (bytes after the checksum) a reader accepts and a writer produces.
/// A length field above this is damage, not a record: no fact comes near it (the biggest, a
/// `KvStored` with its block hashes, is about 9 bytes per block), and refusing it keeps a damaged
/// length from making the reader allocate gigabytes.
pub const MAX_RECORD_BYTES: usize = 16 * 1024 * 1024;
/// The largest encoded [`StreamHeader`] accepted (it carries the engine configuration as JSON).
pub const MAX_HEADER_BYTES: usize = 16 * 1024 * 1024;
/// Bytes of a prelude: magic(8) + version(u16) + codec id(u16).
pub(crate) const PRELUDE_BYTES: usize = 12;
/// Bytes of the record frame before the body: `len` (u32 LE) and `crc` (u32 LE).
pub(crate) const FRAME_PREFIX_BYTES: usize = 8;
/// Bytes of a stream record body before the fact: seq(u64) + at_ns(u64).
pub(crate) const STREAM_RECORD_FIXED_BYTES: usize = 16;
/// Bytes of a merged record body before the fact: stream(u16) + seq(u64) + at_ns(u64).
pub(crate) const MERGED_RECORD_FIXED_BYTES: usize = 2 + STREAM_RECORD_FIXED_BYTES;

/// Buffer size for file-backed writers and readers: large enough that a syscall carries
/// thousands of small records.
pub(crate) const FILE_BUFFER_BYTES: usize = 1 << 20;
/// Per-stream buffer when a run holds many streams open at once (memory = streams x this).
pub(crate) const RUN_STREAM_BUFFER_BYTES: usize = 128 << 10;

/// A stream file's format version.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LogFormat {
    /// One checksummed frame per record (`len | crc | seq | at_ns | fact`).
    V1,
    /// Records packed into compressed, checksummed blocks ([`super::block`]).
    #[default]
    V2,
}

/// Bits of a v2 position that hold the record's place in its block.
const PLACE_BITS: u32 = 16;

impl LogFormat {
    /// The version number in the prelude.
    pub const fn version(self) -> u16 {
        match self {
            LogFormat::V1 => 1,
            LogFormat::V2 => 2,
        }
    }

    pub fn from_version(version: u16) -> Option<Self> {
        match version {
            1 => Some(LogFormat::V1),
            2 => Some(LogFormat::V2),
            _ => None,
        }
    }

    /// A record's position: its byte offset in v1; in v2 its block's byte offset shifted left
    /// 16 bits, plus its place in the block. Positions of one file rise with the records.
    pub fn position(self, frame_offset: u64, place: u32) -> u64 {
        match self {
            LogFormat::V1 => frame_offset,
            LogFormat::V2 => (frame_offset << PLACE_BITS) | place as u64,
        }
    }

    /// The byte offset of the frame (record or block) holding the record at `position`, and the
    /// record's place in it.
    pub fn frame_of(self, position: u64) -> (u64, u32) {
        match self {
            LogFormat::V1 => (position, 0),
            LogFormat::V2 => (position >> PLACE_BITS, (position & ((1 << PLACE_BITS) - 1)) as u32),
        }
    }
}

/// How a file's records are framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SegmentKind {
    /// A per-worker stream file: every record belongs to one stream.
    Stream,
    /// A merged run file: each record names its stream.
    Merged,
}

/// The fixed fields of a record body, and where its fact's bytes start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecordFields {
    /// The stream index a merged record names (`None` in a stream file).
    pub stream: Option<usize>,
    pub seq: u64,
    pub at_ns: u64,
    /// Offset of the encoded fact within the body.
    pub fact_start: usize,
}

impl SegmentKind {
    /// Bytes of a record body before its fact.
    pub(crate) fn fixed_bytes(self) -> usize {
        match self {
            SegmentKind::Stream => STREAM_RECORD_FIXED_BYTES,
            SegmentKind::Merged => MERGED_RECORD_FIXED_BYTES,
        }
    }

    /// Reads the fixed fields of `body`, which the frame reader guarantees holds at least
    /// [`SegmentKind::fixed_bytes`] bytes.
    pub(crate) fn fields(self, body: &[u8]) -> RecordFields {
        let (stream, rest) = match self {
            SegmentKind::Stream => (None, 0),
            SegmentKind::Merged => (Some(u16::from_le_bytes([body[0], body[1]]) as usize), 2),
        };
        RecordFields {
            stream,
            seq: u64::from_le_bytes(fixed8(&body[rest..rest + 8])),
            at_ns: u64::from_le_bytes(fixed8(&body[rest + 8..rest + 16])),
            fact_start: rest + 16,
        }
    }

    /// Appends a record body's fixed fields (the fact follows).
    pub(crate) fn put_fields(self, out: &mut Vec<u8>, stream: usize, seq: u64, at_ns: u64) {
        if self == SegmentKind::Merged {
            out.extend_from_slice(&(stream as u16).to_le_bytes());
        }
        out.extend_from_slice(&seq.to_le_bytes());
        out.extend_from_slice(&at_ns.to_le_bytes());
    }
}

pub(crate) fn fixed8(b: &[u8]) -> [u8; 8] {
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    a
}

/// The file name of `worker`'s stream in a run directory, e.g. `prefill-0.hlog`.
pub fn stream_file_name(worker: WorkerId) -> String {
    format!("{worker}.{STREAM_EXTENSION}")
}

/// Which layout a run was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunKind {
    /// A directory of `{worker}.hlog` files.
    Directory,
    /// One merged `HOFFRUN` file.
    Merged,
    /// One stream file, read as a run of one stream.
    Stream,
}

/// One file of a run and the streams whose records it holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    pub path: PathBuf,
    pub kind: SegmentKind,
    /// Indexes into [`RunLayout::headers`]; for a stream file, exactly one.
    pub streams: Vec<usize>,
    /// Byte offset of the first record (after the header(s)).
    pub data_start: u64,
    /// The file's format (merged files are v1).
    pub format: LogFormat,
}

impl Segment {
    /// The position of the file's first record.
    pub fn start_position(&self) -> u64 {
        self.format.position(self.data_start, 0)
    }
}

/// The files and streams of a run, found by reading headers only.
#[derive(Clone, Debug)]
pub struct RunLayout {
    pub run: PathBuf,
    pub kind: RunKind,
    /// The stream headers in canonical order (by worker); stream indexes point into this.
    pub headers: Vec<StreamHeader>,
    /// For a directory, one per stream in the order of `headers`; otherwise the one file.
    pub segments: Vec<Segment>,
}

impl RunLayout {
    /// Opens a run directory, a merged run file, or a single stream file, and reads every
    /// stream header, checking that they share one run id and that a directory's file names
    /// match the workers their headers name.
    pub fn open(run: impl AsRef<Path>) -> Result<Self, LogError> {
        let path = run.as_ref();
        let meta = fs::metadata(path).map_err(|e| LogError::io(path, e))?;
        if meta.is_dir() {
            return Self::open_dir(path);
        }
        let mut magic = [0u8; 8];
        let n = {
            let mut f = File::open(path).map_err(|e| LogError::io(path, e))?;
            frame::read_full(&mut f, &mut magic).map_err(|e| LogError::io(path, e))?
        };
        if n == 8 && magic == RUN_MAGIC {
            Self::open_merged(path)
        } else if n == 8 && magic == MAGIC {
            let (header, data_start, format) = read_stream_header(path)?;
            Ok(RunLayout {
                run: path.to_path_buf(),
                kind: RunKind::Stream,
                headers: vec![header],
                segments: vec![Segment {
                    path: path.to_path_buf(),
                    kind: SegmentKind::Stream,
                    streams: vec![0],
                    data_start,
                    format,
                }],
            })
        } else if n < 8 && (MAGIC.starts_with(&magic[..n]) || RUN_MAGIC.starts_with(&magic[..n])) {
            Err(LogError::CorruptHeader {
                path: path.into(),
                offset: n as u64,
                reason: format!("file ends after {n} bytes, inside the magic"),
            })
        } else {
            Err(LogError::BadMagic {
                path: path.into(),
                expected: format!("\"{}\" or \"{}\"", MAGIC.escape_ascii(), RUN_MAGIC.escape_ascii()),
                found: magic[..n].escape_ascii().to_string(),
            })
        }
    }

    /// The run's workers in canonical order.
    pub fn workers(&self) -> Vec<WorkerId> {
        self.headers.iter().map(|h| h.worker).collect()
    }

    /// The file holding `stream`'s records.
    pub fn segment_of(&self, stream: usize) -> Option<&Segment> {
        self.segments.iter().find(|s| s.streams.contains(&stream))
    }

    /// The files read: one per stream for a directory, the one file otherwise.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.segments.iter().map(|s| s.path.clone()).collect()
    }

    fn open_dir(dir: &Path) -> Result<Self, LogError> {
        let mut found: Vec<(WorkerId, PathBuf)> = Vec::new();
        for entry in fs::read_dir(dir).map_err(|e| LogError::io(dir, e))? {
            let entry = entry.map_err(|e| LogError::io(dir, e))?;
            let p = entry.path();
            if p.extension().and_then(|e| e.to_str()) != Some(STREAM_EXTENSION) {
                continue;
            }
            let Some(stem) = p.file_stem().and_then(|s| s.to_str()) else { continue };
            // Only the canonical spelling names a stream (`agg-1.0.hlog` is not `agg-1`'s).
            let Ok(worker) = stem.parse::<WorkerId>() else { continue };
            if worker.to_string() != stem || !p.is_file() {
                continue;
            }
            found.push((worker, p));
        }
        if found.is_empty() {
            return Err(LogError::EmptyRun { path: dir.into() });
        }
        found.sort();
        let mut headers: Vec<StreamHeader> = Vec::with_capacity(found.len());
        let mut segments = Vec::with_capacity(found.len());
        for (named, p) in found {
            let (h, data_start, format) = read_stream_header(&p)?;
            if h.worker != named {
                return Err(LogError::WorkerMismatch { path: p, named, found: h.worker });
            }
            if let Some(first) = headers.first().map(|f| f.run_id) {
                if h.run_id != first {
                    return Err(LogError::RunIdMismatch {
                        path: p,
                        worker: h.worker,
                        expected: first,
                        found: h.run_id,
                    });
                }
            }
            segments.push(Segment {
                path: p,
                kind: SegmentKind::Stream,
                streams: vec![headers.len()],
                data_start,
                format,
            });
            headers.push(h);
        }
        Ok(RunLayout { run: dir.to_path_buf(), kind: RunKind::Directory, headers, segments })
    }

    fn open_merged(path: &Path) -> Result<Self, LogError> {
        let io = |e| LogError::io(path, e);
        let mut r = BufReader::new(File::open(path).map_err(io)?);
        frame::read_prelude(&mut r, path, &RUN_MAGIC, &[RUN_FORMAT_VERSION])?;
        let mut offset = PRELUDE_BYTES as u64;
        let mut count = [0u8; 2];
        if frame::read_full(&mut r, &mut count).map_err(io)? < 2 {
            return Err(LogError::CorruptHeader {
                path: path.into(),
                offset,
                reason: "file ends inside the stream count".into(),
            });
        }
        let count = u16::from_le_bytes(count) as usize;
        if count == 0 {
            return Err(LogError::EmptyRun { path: path.into() });
        }
        offset += 2;
        let mut headers: Vec<StreamHeader> = Vec::with_capacity(count);
        for _ in 0..count {
            let (h, used) = frame::read_header_block(&mut r, path, offset)?;
            check_merged_header(path, offset, &headers, &h)?;
            headers.push(h);
            offset += used;
        }
        let segments = vec![Segment {
            path: path.to_path_buf(),
            kind: SegmentKind::Merged,
            streams: (0..headers.len()).collect(),
            data_start: offset,
            format: LogFormat::V1,
        }];
        Ok(RunLayout { run: path.to_path_buf(), kind: RunKind::Merged, headers, segments })
    }
}

/// A merged file's stream headers come in canonical order and share one run id.
fn check_merged_header(
    path: &Path,
    offset: u64,
    before: &[StreamHeader],
    h: &StreamHeader,
) -> Result<(), LogError> {
    let Some(prev) = before.last() else { return Ok(()) };
    if h.worker <= prev.worker {
        return Err(LogError::CorruptHeader {
            path: path.into(),
            offset,
            reason: format!("stream headers out of canonical order: {} after {}", h.worker, prev.worker),
        });
    }
    if h.run_id != before[0].run_id {
        return Err(LogError::RunIdMismatch {
            path: path.into(),
            worker: h.worker,
            expected: before[0].run_id,
            found: h.run_id,
        });
    }
    Ok(())
}

/// Reads a stream file's prelude and header: the header, where its first record starts, and
/// the file's format.
pub(crate) fn read_stream_header(path: &Path) -> Result<(StreamHeader, u64, LogFormat), LogError> {
    let file = File::open(path).map_err(|e| LogError::io(path, e))?;
    read_stream_header_from(&mut BufReader::new(file), path)
}

/// [`read_stream_header`] over any reader, which is left at the first record.
pub(crate) fn read_stream_header_from(
    r: &mut impl std::io::Read,
    path: &Path,
) -> Result<(StreamHeader, u64, LogFormat), LogError> {
    let version = frame::read_prelude(r, path, &MAGIC, &[1, 2])?;
    let format = LogFormat::from_version(version).expect("read_prelude accepts only known versions");
    let (header, used) = frame::read_header_block(r, path, PRELUDE_BYTES as u64)?;
    Ok((header, PRELUDE_BYTES as u64 + used, format))
}
