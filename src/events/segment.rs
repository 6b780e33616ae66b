//! The one record reader: the records of one file (a stream file or a merged run file) from a
//! record boundary on, with their byte offsets.
//!
//! Every other reader is built on it: [`super::StreamReader`] (one stream file after its
//! header), [`super::RunReader`] (a k-way merge of a run's files), the index build and `at`
//! (a file from a checkpoint), and diff's context reads. So framing, the torn-tail rule,
//! sequence checks and fact decoding exist once.

use super::block::{BlockCursor, BlockHead, BLOCK_FIXED_BYTES};
use super::codec;
use super::error::LogError;
use super::frame::{self, FrameReader, TornTail};
use super::layout::{LogFormat, Segment, SegmentKind, FILE_BUFFER_BYTES, FRAME_PREFIX_BYTES};
use super::{Fact, Record};
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Reads one file's records in file order, checking checksums and (unless told not to)
/// sequence numbers, and yields each record with the index of its stream.
pub struct SegmentReader<R: Read = BufReader<File>> {
    frames: FrameReader<R>,
    kind: SegmentKind,
    format: LogFormat,
    /// v2: the block being read.
    block: BlockCursor,
    /// v2, after a seek into an epoch: records before this position only rebuild the table.
    skip_before: Option<u64>,
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
        let (frame_offset, place) = seg.format.frame_of(offset);
        // A v2 record past an epoch's first block needs the epoch's table: start there.
        let start = match seg.format {
            LogFormat::V2 => epoch_offset_of(&mut f, path, frame_offset)?,
            LogFormat::V1 => frame_offset,
        };
        f.seek(SeekFrom::Start(start)).map_err(|e| LogError::io(path, e))?;
        let stream = seg.streams.first().copied().unwrap_or(0);
        let inner = BufReader::with_capacity(buffer_bytes, f);
        let mut reader = Self::new(inner, path.clone(), seg.kind, seg.format, stream, start, next_seq);
        if seg.format == LogFormat::V2 && (start != frame_offset || place != 0) {
            reader.skip_before = Some(offset);
        }
        Ok(reader)
    }
}

impl<R: Read> SegmentReader<R> {
    /// Reads `inner`, positioned at byte `offset` of the file `path` names. `stream` is the
    /// stream of a stream file (ignored for a merged file).
    pub(crate) fn new(
        inner: R,
        path: PathBuf,
        kind: SegmentKind,
        format: LogFormat,
        stream: usize,
        offset: u64,
        next_seq: Vec<u64>,
    ) -> Self {
        SegmentReader {
            frames: FrameReader::new(inner, path, offset),
            kind,
            format,
            block: BlockCursor::default(),
            skip_before: None,
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
        let Some((offset, stream, seq, at_ns, fact)) = self.next_raw()? else {
            return Ok(None);
        };
        self.frames_read += 1;
        if self.check_seq {
            let Some(expected) = self.next_seq.get_mut(stream) else {
                let streams = self.next_seq.len();
                return Err(self.frames.corrupt(
                    offset,
                    format!("stream index {stream} out of range (the run has {streams} streams)"),
                ));
            };
            if seq != *expected {
                return Err(LogError::SequenceGap {
                    path: self.frames.path().to_path_buf(),
                    offset,
                    expected: *expected,
                    found: seq,
                });
            }
            *expected += 1;
        }
        let Some(fact) = fact else { return Ok(Some(None)) };
        self.last_offset = Some(self.format.position(offset, self.last_place()));
        if let Some(e) = self.ended.get_mut(stream) {
            *e = matches!(fact, Fact::StreamEnded);
        }
        Ok(Some(Some((stream, Record { seq, at_ns, fact }))))
    }

    /// The place in its block of the record last read (0 in v1).
    fn last_place(&self) -> u32 {
        match self.format {
            LogFormat::V1 => 0,
            LogFormat::V2 => self.block.place - 1,
        }
    }

    /// The next record's frame offset, stream, seq, at_ns, and fact (`None` for a record of a
    /// stream filtered out). v2 records before a seek's target are read and dropped here.
    #[allow(clippy::type_complexity)]
    fn next_raw(&mut self) -> Result<Option<(u64, usize, u64, u64, Option<Fact>)>, LogError> {
        if self.format == LogFormat::V1 {
            return self.next_v1();
        }
        loop {
            if !self.block.has_next() {
                let Some(offset) = self.frames.next_frame(BLOCK_FIXED_BYTES)? else {
                    return Ok(None);
                };
                self.block.load(&self.frames.body, offset).map_err(|e| self.frames.corrupt(offset, e))?;
            }
            let offset = self.block.block_offset;
            let (place, seq, at_ns, fact) = self.block.next().map_err(|e| self.frames.corrupt(offset, e))?;
            if let Some(target) = self.skip_before {
                if self.format.position(offset, place) < target {
                    continue;
                }
                self.skip_before = None;
            }
            let stream = self.stream;
            return Ok(Some((
                offset,
                stream,
                seq,
                at_ns,
                (!self.only.is_some_and(|o| o != stream)).then_some(fact),
            )));
        }
    }

    #[allow(clippy::type_complexity)]
    fn next_v1(&mut self) -> Result<Option<(u64, usize, u64, u64, Option<Fact>)>, LogError> {
        let Some(offset) = self.frames.next_frame(self.kind.fixed_bytes())? else {
            return Ok(None);
        };
        let fields = self.kind.fields(&self.frames.body);
        let stream = fields.stream.unwrap_or(self.stream);
        if self.only.is_some_and(|o| o != stream) {
            return Ok(Some((offset, stream, fields.seq, fields.at_ns, None)));
        }
        let fact: Fact = codec::decode_exact(&self.frames.body[fields.fact_start..])
            .map_err(|e| self.frames.corrupt(offset, format!("undecodable fact: {e}")))?;
        Ok(Some((offset, stream, fields.seq, fields.at_ns, Some(fact))))
    }

    /// Byte offset of the record last returned (`None` before the first).
    pub fn last_record_offset(&self) -> Option<u64> {
        self.last_offset
    }

    /// Position of the next record (in v1 its byte offset; see [`LogFormat::position`]).
    pub fn offset(&self) -> u64 {
        if self.format == LogFormat::V2 && self.block.has_next() {
            return self.format.position(self.block.block_offset, self.block.place);
        }
        self.format.position(self.frames.offset(), 0)
    }

    /// Bytes of whole frames read so far: after the end, the file's sound length.
    pub fn sound_length(&self) -> u64 {
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

    /// The file's format.
    pub fn format(&self) -> LogFormat {
        self.format
    }
}

/// Reads the one record at position `offset` in `seg`'s file (used to fetch postings and diff
/// context). The record's checksum is checked; its sequence number is not
/// (there is no predecessor to check it against). Returns the stream a merged record names.
pub fn read_record_at(seg: &Segment, offset: u64) -> Result<(Option<usize>, Record), LogError> {
    let (path, kind) = (&seg.path, seg.kind);
    let seg = Segment { streams: vec![0], ..seg.clone() };
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

/// Reads the records at `positions` (ascending) of `seg`'s file, each with the stream a merged
/// record names (else the file's stream). v1 reads each record where it lies; v2 reads forward
/// from the first, so the epoch's table is rebuilt once rather than once per record.
pub fn read_records_at(seg: &Segment, positions: &[u64]) -> Result<Vec<(usize, Record)>, LogError> {
    let own = seg.streams.first().copied().unwrap_or(0);
    if seg.format == LogFormat::V1 {
        return positions
            .iter()
            .map(|&p| read_record_at(seg, p).map(|(s, r)| (s.unwrap_or(own), r)))
            .collect();
    }
    let Some(&first) = positions.first() else { return Ok(Vec::new()) };
    let mut reader = SegmentReader::open_buffered(seg, first, Vec::new(), 64 << 10)?.without_sequence_check();
    let mut out = Vec::with_capacity(positions.len());
    for &p in positions {
        reader.skip_before = Some(p);
        match reader.next_record()? {
            Some((_, record)) if reader.last_record_offset() == Some(p) => out.push((own, record)),
            _ => {
                return Err(LogError::Corrupt {
                    path: seg.path.clone(),
                    offset: seg.format.frame_of(p).0,
                    reason: format!("no record at position {p} (index or context past the end)"),
                })
            }
        }
    }
    Ok(out)
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

/// The byte offset of the block that began the epoch of the v2 block at `block_offset`.
fn epoch_offset_of(f: &mut File, path: &Path, block_offset: u64) -> Result<u64, LogError> {
    let io = |e| LogError::io(path, e);
    let corrupt = |reason: String| LogError::Corrupt { path: path.into(), offset: block_offset, reason };
    f.seek(SeekFrom::Start(block_offset)).map_err(io)?;
    let mut head = [0u8; FRAME_PREFIX_BYTES + BLOCK_FIXED_BYTES];
    let n = frame::read_full(f, &mut head).map_err(io)?;
    if n == 0 {
        // At the end of the file: nothing to read, and no epoch to find.
        return Ok(block_offset);
    }
    if n < head.len() {
        return Err(corrupt("no block starts here (index or context offset past the end)".into()));
    }
    let head = BlockHead::parse(&head[FRAME_PREFIX_BYTES..], block_offset).map_err(corrupt)?;
    Ok(head.epoch_offset)
}
