//! The streaming reader of one per-worker stream (format v1 or v2, see [`crate::events`]).
//!
//! It holds one record's bytes at a time, never the file. The torn-tail rule: only a record cut
//! off by the end of the file (too few bytes for its `len`/`crc`, or for the length it declares)
//! is a torn tail; reading stops there cleanly and [`StreamReader::torn_tail`] reports it. A
//! full-length record with a bad checksum, an undecodable fact, an out-of-sequence number, or an
//! impossible length is an error naming the file and the record's byte offset.

use super::error::LogError;
use super::frame::TornTail;
use super::layout::{self, SegmentKind, FILE_BUFFER_BYTES};
use super::segment::SegmentReader;
use super::{Record, StreamHeader};
use crate::ids::HandoffId;
use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

/// Reads records of one stream in order.
pub struct StreamReader<R: Read> {
    records: SegmentReader<R>,
    header: StreamHeader,
}

impl StreamReader<BufReader<File>> {
    /// Opens a stream file and reads its header.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, LogError> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| LogError::io(path, e))?;
        StreamReader::new(BufReader::with_capacity(FILE_BUFFER_BYTES, file), path)
    }
}

impl<R: Read> StreamReader<R> {
    /// Reads the header from `inner`; `name` is what errors call the stream.
    pub fn new(mut inner: R, name: impl Into<PathBuf>) -> Result<Self, LogError> {
        let path = name.into();
        let (header, data_start, format) = layout::read_stream_header_from(&mut inner, &path)?;
        let records = SegmentReader::new(inner, path, SegmentKind::Stream, format, 0, data_start, vec![0]);
        Ok(StreamReader { records, header })
    }

    pub fn header(&self) -> &StreamHeader {
        &self.header
    }

    /// The name errors use (the file path for [`StreamReader::open`]).
    pub fn path(&self) -> &Path {
        self.records.path()
    }

    /// The next record, `None` at the end of the stream (or at a torn tail).
    /// After an error the reader is stopped and returns `None`.
    pub fn next_record(&mut self) -> Result<Option<Record>, LogError> {
        Ok(self.records.next_record()?.map(|(_, rec)| rec))
    }

    /// The position of the next record (see [`super::LogFormat::position`]; in v1 its byte
    /// offset).
    pub fn offset(&self) -> u64 {
        self.records.offset()
    }

    /// Bytes of whole records (v1) or blocks (v2) read so far: after the end, the stream's
    /// sound length.
    pub fn sound_length(&self) -> u64 {
        self.records.sound_length()
    }

    /// The position of the record last returned (for indexes that point into the file).
    pub fn last_record_offset(&self) -> Option<u64> {
        self.records.last_record_offset()
    }

    /// The sequence number the next record must carry (= records read so far).
    pub fn next_seq(&self) -> u64 {
        self.records.next_seqs()[0]
    }

    /// The torn tail found at the end, once reading has reached it.
    pub fn torn_tail(&self) -> Option<TornTail> {
        self.records.torn_tail()
    }

    /// The stream file's format.
    pub fn format(&self) -> super::LogFormat {
        self.records.format()
    }
}

impl<R: Read> Iterator for StreamReader<R> {
    type Item = Result<Record, LogError>;
    fn next(&mut self) -> Option<Self::Item> {
        self.next_record().transpose()
    }
}

/// Reads the whole stream at `path`, validating every record, and truncates a torn tail (the
/// only write a reader ever makes). Returns the tail that was cut, if any. If any other damage
/// is found, nothing is written and the error is returned.
pub fn recover(path: impl AsRef<Path>) -> Result<Option<TornTail>, LogError> {
    let path = path.as_ref();
    let torn = {
        let mut reader = StreamReader::open(path)?;
        while reader.next_record()?.is_some() {}
        reader.torn_tail()
    };
    if let Some(t) = torn {
        truncate(path, t.offset)?;
    }
    Ok(torn)
}

pub(crate) fn truncate(path: &Path, len: u64) -> Result<(), LogError> {
    let io = |e| LogError::io(path, e);
    let file = OpenOptions::new().write(true).open(path).map_err(io)?;
    file.set_len(len).map_err(io)?;
    file.sync_all().map_err(io)
}

/// What [`verify_stream`] found in a sound stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamSummary {
    pub header: StreamHeader,
    pub records: u64,
    /// Distinct handoffs named by the stream's facts ([`Fact::handoff`]).
    pub handoffs: usize,
    /// `at_ns` of the first and the last record (`None` for a header-only stream).
    pub first_at_ns: Option<u64>,
    pub last_at_ns: Option<u64>,
    /// The stream's sound length in bytes.
    pub bytes: u64,
    /// A torn tail found (and left in place: verifying never writes).
    pub torn_tail: Option<TornTail>,
}

/// Reads the whole stream at `path` and checks framing, checksums, sequence numbers and that
/// every fact decodes. Writes nothing.
pub fn verify_stream(path: impl AsRef<Path>) -> Result<StreamSummary, LogError> {
    let mut reader = StreamReader::open(path)?;
    let mut handoffs: BTreeSet<HandoffId> = BTreeSet::new();
    let mut records = 0u64;
    let mut first_at_ns = None;
    let mut last_at_ns = None;
    while let Some(rec) = reader.next_record()? {
        records += 1;
        first_at_ns.get_or_insert(rec.at_ns);
        last_at_ns = Some(rec.at_ns);
        if let Some(h) = rec.fact.handoff() {
            handoffs.insert(h);
        }
    }
    Ok(StreamSummary {
        header: reader.header().clone(),
        records,
        handoffs: handoffs.len(),
        first_at_ns,
        last_at_ns,
        bytes: reader.sound_length(),
        torn_tail: reader.torn_tail(),
    })
}
