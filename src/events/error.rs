//! The one error type of the log layer.
//!
//! Every variant names the file (or, for in-memory streams, the name the caller gave) and, where
//! a position in the bytes is involved, the byte offset from the start of that file, so a user can
//! go straight to the damage (`xxd -s OFFSET FILE`).

use crate::ids::WorkerId;
use std::io;
use std::path::PathBuf;
use uuid::Uuid;

/// What can go wrong reading or writing a stream or a run.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// The operating system refused a read, write, open or truncate.
    #[error("{}: I/O error: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// The file does not start with the stream (or merged-run) magic.
    #[error("{}: not a handoff-ledger log: bad magic at byte offset 0 (expected {expected}, found \"{found}\")", path.display())]
    BadMagic { path: PathBuf, expected: String, found: String },

    /// The file was written by a format version this build does not read.
    #[error("{}: unsupported format version {found} at byte offset 8 (this build reads versions up to {supported})", path.display())]
    UnsupportedVersion { path: PathBuf, found: u16, supported: u16 },

    /// The file's bytes were encoded under a codec configuration this build does not know.
    #[error("{}: unknown codec id {found} at byte offset 10 (this build reads codec {supported})", path.display())]
    UnknownCodec { path: PathBuf, found: u16, supported: u16 },

    /// The header (or, in a merged run, one of the stream headers) is damaged or cut short.
    #[error("{}: corrupt header at byte offset {offset}: {reason}", path.display())]
    CorruptHeader { path: PathBuf, offset: u64, reason: String },

    /// A full-length record is damaged: bad checksum, undecodable fact, impossible length.
    #[error("{}: corrupt record at byte offset {offset}: {reason}", path.display())]
    Corrupt { path: PathBuf, offset: u64, reason: String },

    /// A record's sequence number is not its predecessor's plus one.
    #[error("{}: sequence gap at byte offset {offset}: expected seq {expected}, found {found}", path.display())]
    SequenceGap { path: PathBuf, offset: u64, expected: u64, found: u64 },

    /// A writer was asked to frame a record larger than [`crate::events::MAX_RECORD_BYTES`].
    #[error("{}: record of {bytes} bytes exceeds the maximum record size of {max} bytes", path.display())]
    RecordTooLarge { path: PathBuf, bytes: usize, max: usize },

    /// A fact or header could not be encoded (a codec bug; facts are plain data).
    #[error("{}: cannot encode: {reason}", path.display())]
    Encode { path: PathBuf, reason: String },

    /// An earlier write failed part-way, so the stream may end in a partial record; appending
    /// more would bury it mid-file. Reopen with `StreamWriter::open_append` to recover.
    #[error("{}: writer unusable after an earlier I/O error; reopen it to recover the tail", path.display())]
    WriterPoisoned { path: PathBuf },

    /// A stream belongs to another run than the run's first stream.
    #[error("{}: stream of worker {worker} belongs to run {found}, but the run is {expected}", path.display())]
    RunIdMismatch { path: PathBuf, worker: WorkerId, expected: Uuid, found: Uuid },

    /// A stream file's name and its header disagree on the worker.
    #[error("{}: file is named for worker {named} but its header says worker {found}", path.display())]
    WorkerMismatch { path: PathBuf, named: WorkerId, found: WorkerId },

    /// Two streams of one run claim the same worker.
    #[error("{}: worker {worker} has more than one stream in this run", path.display())]
    DuplicateWorker { path: PathBuf, worker: WorkerId },

    /// The worker has no stream (header) in this run.
    #[error("{}: no stream for worker {worker} in this run", path.display())]
    UnknownWorker { path: PathBuf, worker: WorkerId },

    /// A record names a worker the run has no stream for: a stream was lost.
    #[error("{}: incomplete run: {named_by}'s record seq {seq} names {worker}, which has no stream here (a lost `{worker}.hlog`?)", path.display())]
    MissingStream { path: PathBuf, worker: WorkerId, named_by: WorkerId, seq: u64 },

    /// A merged file would replace one of the run's own files, or land in its directory as a
    /// stream.
    #[error("{}: refusing to write the merged run over one of its inputs (or as a stream inside {}); choose another path", path.display(), run.display())]
    OverwritesInput { path: PathBuf, run: PathBuf },

    /// A run directory holds no `{worker}.hlog` stream, or a merged file declares none.
    #[error("{}: run has no streams", path.display())]
    EmptyRun { path: PathBuf },

    /// Refusing to write a run over an existing one.
    #[error("{}: already holds a run (found {existing}); refusing to mix runs (pass --force to replace it)", path.display())]
    RunExists { path: PathBuf, existing: String },

    /// More streams than a merged run can index (u16).
    #[error("{}: {count} streams exceed the merged-run limit of {max}", path.display())]
    TooManyStreams { path: PathBuf, count: usize, max: usize },
}

impl LogError {
    /// Wraps an I/O error with the file it concerns.
    pub fn io(path: impl Into<PathBuf>, source: io::Error) -> Self {
        LogError::Io { path: path.into(), source }
    }

    /// The byte offset the error points at, when it points at one.
    pub fn offset(&self) -> Option<u64> {
        match self {
            LogError::BadMagic { .. } => Some(0),
            LogError::UnsupportedVersion { .. } => Some(8),
            LogError::UnknownCodec { .. } => Some(10),
            LogError::CorruptHeader { offset, .. }
            | LogError::Corrupt { offset, .. }
            | LogError::SequenceGap { offset, .. } => Some(*offset),
            _ => None,
        }
    }

    /// The file (or stream name) the error concerns.
    pub fn path(&self) -> &std::path::Path {
        match self {
            LogError::Io { path, .. }
            | LogError::BadMagic { path, .. }
            | LogError::UnsupportedVersion { path, .. }
            | LogError::UnknownCodec { path, .. }
            | LogError::CorruptHeader { path, .. }
            | LogError::Corrupt { path, .. }
            | LogError::SequenceGap { path, .. }
            | LogError::RecordTooLarge { path, .. }
            | LogError::Encode { path, .. }
            | LogError::WriterPoisoned { path }
            | LogError::RunIdMismatch { path, .. }
            | LogError::WorkerMismatch { path, .. }
            | LogError::DuplicateWorker { path, .. }
            | LogError::UnknownWorker { path, .. }
            | LogError::MissingStream { path, .. }
            | LogError::OverwritesInput { path, .. }
            | LogError::EmptyRun { path }
            | LogError::RunExists { path, .. }
            | LogError::TooManyStreams { path, .. } => path,
        }
    }
}
