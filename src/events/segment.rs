//! The one record reader: the records of one file (a stream file or a merged run file) from a
//! record boundary on, with their byte offsets.
//!
//! Every other reader is built on it: [`super::StreamReader`] (one stream file after its
//! header), [`super::RunReader`] (a k-way merge of a run's files), the index build and `at`
//! (a file from a checkpoint), and diff's context reads. So framing, the torn-tail rule,
//! sequence checks and fact decoding exist once.

use super::codec;
use super::error::LogError;
use super::frame::{FrameReader, TornTail};
use super::layout::{Segment, SegmentKind, FILE_BUFFER_BYTES};
use super::{Fact, Record};
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Reads one file's records in file order, checking checksums and (unless told not to)
/// sequence numbers, and yields each record with the index of its stream.
pub struct SegmentReader<R: Read = BufReader<File>> {
    frames: FrameReader<R>,
    kind: SegmentKind,
    /// For a stream file: its one stream.
    stream: usize,
    /// Expected next seq per run stream index (only the file's streams are used).
    next_seq: Vec<u64>,
    /// Per stream: its last record read was the end marker.
    ended: Vec<bool>,
    check_seq: bool,
    last_offset: Option<u64>,
    /// When set, records of other streams are checked (checksum, seq) but not decoded or
    /// returned: a merged file read one stream at a time.
    only: Option<usize>,
    frames_read: u64,
    /// Reading stops (as at an end) after this many frames.
    frame_limit: u64,
}

impl SegmentReader<BufReader<File>> {
    /// Starts at `offset` (a record boundary: `data_start` or a checkpoint's offset) with the
    /// sequence numbers the streams' next records must carry (indexed by run stream index).
    pub fn open_at(seg: &Segment, offset: u64, next_seq: Vec<u64>) -> Result<Self, LogError> {
        Self::open_buffered(seg, offset, next_seq, FILE_BUFFER_BYTES)
    }

    /// [`SegmentReader::open_at`] with a chosen buffer size (a run reads many files at once).
    pub(crate) fn open_buffered(
        seg: &Segment,
        offset: u64,
        next_seq: Vec<u64>,
        buffer_bytes: usize,
    ) -> Result<Self, LogError> {
        let path = &seg.path;
        let mut f = File::open(path).map_err(|e| LogError::io(path, e))?;
        f.seek(SeekFrom::Start(offset)).map_err(|e| LogError::io(path, e))?;
        let stream = seg.streams.first().copied().unwrap_or(0);
        let inner = BufReader::with_capacity(buffer_bytes, f);
        Ok(Self::new(inner, path.clone(), seg.kind, stream, offset, next_seq))
    }
}

impl<R: Read> SegmentReader<R> {
    /// Reads `inner`, positioned at byte `offset` of the file `path` names. `stream` is the
    /// stream of a stream file (ignored for a merged file).
    pub(crate) fn new(
        inner: R,
        path: PathBuf,
        kind: SegmentKind,
        stream: usize,
        offset: u64,
        next_seq: Vec<u64>,
    ) -> Self {
        SegmentReader {
            frames: FrameReader::new(inner, path, offset),
            kind,
            stream,
            ended: vec![false; next_seq.len()],
            next_seq,
            check_seq: true,
            last_offset: None,
            only: None,
            frames_read: 0,
            frame_limit: u64::MAX,
        }
    }

    /// Returns only `stream`'s records from now on.
    pub fn only_stream(mut self, stream: usize) -> Self {
        self.only = Some(stream);
        self
    }

    /// Does not check sequence numbers (a read that starts at an arbitrary record has no
    /// predecessor to check against).
    pub fn without_sequence_check(mut self) -> Self {
        self.check_seq = false;
        self
    }

    /// Stops after `frames` frames of any stream (a bounded read of a merged file, where
    /// other streams' records lie between the ones wanted).
    pub fn with_frame_limit(mut self, frames: u64) -> Self {
        self.frame_limit = frames;
        self
    }

    /// The next record and its stream index, `None` at the end (or a torn tail). After an
    /// error the reader is stopped and returns `None`.
    pub fn next_record(&mut self) -> Result<Option<(usize, Record)>, LogError> {
        loop {
            let result = self.read_one();
            match result {
                Ok(Some(None)) => continue,
                Ok(Some(Some(r))) => return Ok(Some(r)),
                Ok(None) => return Ok(None),
                Err(e) => {
                    self.frames.stop();
                    return Err(e);
                }
            }
        }
    }

    /// `Some(None)`: a record of a stream filtered out.
    #[allow(clippy::type_complexity)]
    fn read_one(&mut self) -> Result<Option<Option<(usize, Record)>>, LogError> {
        if self.frames_read >= self.frame_limit {
            return Ok(None);
        }
        let Some(offset) = self.frames.next_frame(self.kind.fixed_bytes())? else {
            return Ok(None);
        };
        self.frames_read += 1;
        let fields = self.kind.fields(&self.frames.body);
        let stream = fields.stream.unwrap_or(self.stream);
        if self.check_seq {
            let Some(expected) = self.next_seq.get_mut(stream) else {
                let streams = self.next_seq.len();
                return Err(self.frames.corrupt(
                    offset,
                    format!("stream index {stream} out of range (the run has {streams} streams)"),
                ));
            };
            if fields.seq != *expected {
                return Err(LogError::SequenceGap {
                    path: self.frames.path().to_path_buf(),
                    offset,
                    expected: *expected,
                    found: fields.seq,
                });
            }
            *expected += 1;
        }
        if self.only.is_some_and(|o| o != stream) {
            return Ok(Some(None));
        }
        let fact: Fact = codec::decode_exact(&self.frames.body[fields.fact_start..])
            .map_err(|e| self.frames.corrupt(offset, format!("undecodable fact: {e}")))?;
        self.last_offset = Some(offset);
        if let Some(e) = self.ended.get_mut(stream) {
            *e = matches!(fact, Fact::StreamEnded);
        }
        Ok(Some(Some((stream, Record { seq: fields.seq, at_ns: fields.at_ns, fact }))))
    }

    /// Byte offset of the record last returned (`None` before the first).
    pub fn last_record_offset(&self) -> Option<u64> {
        self.last_offset
    }

    /// Byte offset of the next record (after the end: the file's sound length).
    pub fn offset(&self) -> u64 {
        self.frames.offset()
    }

    /// The sequence number each stream's next record must carry.
    pub fn next_seqs(&self) -> &[u64] {
        &self.next_seq
    }

    /// Whether `stream`'s last record read is the end marker ([`Fact::StreamEnded`]).
    pub fn ended(&self, stream: usize) -> bool {
        self.ended.get(stream).copied().unwrap_or(false)
    }

    /// Frames read so far, of every stream (a bound for reads that filter).
    pub fn frames_read(&self) -> u64 {
        self.frames_read
    }

    /// The torn tail found at the end, once reading has reached it.
    pub fn torn_tail(&self) -> Option<TornTail> {
        self.frames.torn_tail()
    }

    /// The name errors use.
    pub fn path(&self) -> &Path {
        self.frames.path()
    }
}

/// Reads the one record that starts at `offset` in a file of the given kind (used to fetch
/// postings and diff context). The record's checksum is checked; its sequence number is not
/// (there is no predecessor to check it against). Returns the stream a merged record names.
pub fn read_record_at(
    path: &Path,
    kind: SegmentKind,
    offset: u64,
) -> Result<(Option<usize>, Record), LogError> {
    let seg = Segment { path: path.to_path_buf(), kind, streams: vec![0], data_start: offset };
    let mut reader =
        SegmentReader::open_buffered(&seg, offset, Vec::new(), 64 << 10)?.without_sequence_check();
    match reader.next_record()? {
        Some((stream, record)) => Ok(((kind == SegmentKind::Merged).then_some(stream), record)),
        None => Err(LogError::Corrupt {
            path: path.to_path_buf(),
            offset,
            reason: "no record starts here (index or context offset past the end)".into(),
        }),
    }
}

/// Reads the records of `stream` in `seg` from byte offset `start` (a record boundary) until
/// `after` records past the one at `div` have been read, checking checksums but not sequence
/// numbers. At most `max_frames` frames are read. For printing context around a record.
pub fn records_around(
    seg: &Segment,
    stream: usize,
    start: u64,
    div: u64,
    after: usize,
    max_frames: usize,
) -> Result<Vec<(u64, Record)>, LogError> {
    let mut reader = SegmentReader::open_buffered(seg, start, Vec::new(), 64 << 10)?
        .without_sequence_check()
        .only_stream(stream)
        .with_frame_limit(max_frames as u64);
    let mut out = Vec::new();
    let mut past = 0usize;
    while let Some((_, record)) = reader.next_record()? {
        let offset = reader.last_record_offset().unwrap_or(start);
        if offset > div {
            if past == after {
                break;
            }
            past += 1;
        }
        out.push((offset, record));
    }
    Ok(out)
}
