//! The append-only writer of one per-worker stream (format v2 by default, v1 on request; see
//! the module docs of [`crate::events`] and [`super::block`]).
//!
//! In v1 appending encodes the record into a reused scratch buffer, checksums it, and hands it
//! to the inner writer in one `write_all`. In v2 records gather in a block that is compressed,
//! checksummed and handed over when it is full or at [`StreamWriter::flush`]. Either way no
//! allocation per record once the buffers have grown, and a crash leaves a readable prefix plus
//! at most one torn record or block, which [`StreamWriter::open_append`] (or
//! [`crate::events::recover`]) cuts off.

use super::block::BlockWriter;
use super::codec;
use super::error::LogError;
use super::frame::{self, TornTail};
use super::layout::{LogFormat, SegmentKind, FILE_BUFFER_BYTES, FRAME_PREFIX_BYTES, MAGIC};
use super::reader::StreamReader;
use super::{Fact, Record, StreamHeader};
use std::fs::{File, OpenOptions};
use std::io::{BufReader, BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Appends records to one stream.
pub struct StreamWriter<W: Write> {
    inner: W,
    format: LogFormat,
    /// v2: the block being gathered.
    block: Box<BlockWriter>,
    /// Named in errors: the file, or what the caller called an in-memory stream.
    name: PathBuf,
    header: StreamHeader,
    scratch: Vec<u8>,
    next_seq: u64,
    /// `at_ns` of the last record appended (0 before the first).
    last_at_ns: u64,
    bytes_written: u64,
    poisoned: bool,
    /// A fresh checksum state, cloned per record: `crc32fast::hash` re-detects CPU features on
    /// every call.
    crc: crc32fast::Hasher,
}

impl<W: Write> StreamWriter<W> {
    /// Writes the stream header to `inner` and returns a writer positioned for record 0, in
    /// the current format (v2).
    pub fn new(inner: W, header: &StreamHeader) -> Result<Self, LogError> {
        Self::new_named(inner, header, "<stream>", LogFormat::default())
    }

    /// Like [`StreamWriter::new`], in the given format.
    pub fn with_format(inner: W, header: &StreamHeader, format: LogFormat) -> Result<Self, LogError> {
        Self::new_named(inner, header, "<stream>", format)
    }

    /// Like [`StreamWriter::with_format`], naming the stream in errors.
    pub fn new_named(
        inner: W,
        header: &StreamHeader,
        name: impl Into<PathBuf>,
        format: LogFormat,
    ) -> Result<Self, LogError> {
        let name = name.into();
        let mut scratch = Vec::with_capacity(256);
        frame::write_prelude(&mut scratch, &MAGIC, format.version());
        frame::write_header_block(&mut scratch, header, &name)?;
        let mut w = StreamWriter {
            inner,
            format,
            block: Box::default(),
            name,
            header: header.clone(),
            scratch,
            next_seq: 0,
            last_at_ns: 0,
            bytes_written: 0,
            poisoned: false,
            crc: crc32fast::Hasher::new(),
        };
        w.write_scratch()?;
        Ok(w)
    }

    /// Appends one record and returns its sequence number.
    pub fn append(&mut self, at_ns: u64, fact: &Fact) -> Result<u64, LogError> {
        if self.poisoned {
            return Err(LogError::WriterPoisoned { path: self.name.clone() });
        }
        let seq = self.next_seq;
        if self.format == LogFormat::V2 {
            return self.append_v2(seq, at_ns, fact);
        }
        let s = &mut self.scratch;
        s.clear();
        s.extend_from_slice(&[0u8; FRAME_PREFIX_BYTES]);
        SegmentKind::Stream.put_fields(s, 0, seq, at_ns);
        codec::encode_fact_into(fact, s)
            .map_err(|reason| LogError::Encode { path: self.name.clone(), reason })?;
        frame::seal_record(s, self.crc.clone(), &self.name)?;
        self.write_scratch()?;
        self.next_seq += 1;
        self.last_at_ns = at_ns;
        Ok(seq)
    }

    fn append_v2(&mut self, seq: u64, at_ns: u64, fact: &Fact) -> Result<u64, LogError> {
        let full = self.block.push(seq, at_ns, fact).map_err(|reason| {
            // The block's hash table may be ahead of its records: nothing more can be written.
            self.poisoned = true;
            LogError::Encode { path: self.name.clone(), reason }
        })?;
        self.next_seq += 1;
        self.last_at_ns = at_ns;
        if full {
            self.seal_block()?;
        }
        Ok(seq)
    }

    /// v2: compresses and hands over the records gathered so far as one block.
    fn seal_block(&mut self) -> Result<(), LogError> {
        if self.block.pending() == 0 {
            return Ok(());
        }
        self.block.seal(self.bytes_written, &mut self.scratch);
        frame::seal_record(&mut self.scratch, self.crc.clone(), &self.name)?;
        self.write_scratch()
    }

    fn write_scratch(&mut self) -> Result<(), LogError> {
        if let Err(e) = self.inner.write_all(&self.scratch) {
            // Part of the record may have reached the inner writer.
            self.poisoned = true;
            return Err(LogError::io(&self.name, e));
        }
        self.bytes_written += self.scratch.len() as u64;
        Ok(())
    }

    /// Pushes every record appended so far to the inner writer (for a file: to the OS, not to
    /// the disk). In v2 this seals the block being gathered, so where blocks end depends on when
    /// it is called: a writer that must produce the same bytes on every run calls
    /// [`StreamWriter::flush_sealed`] on its own schedule and this only at the end.
    pub fn flush(&mut self) -> Result<(), LogError> {
        if self.poisoned {
            return Err(LogError::WriterPoisoned { path: self.name.clone() });
        }
        if self.format == LogFormat::V2 {
            self.seal_block()?;
        }
        self.flush_sealed()
    }

    /// Pushes what is buffered to the inner writer without sealing the block being gathered
    /// (v2): block boundaries stay a function of the records alone.
    pub fn flush_sealed(&mut self) -> Result<(), LogError> {
        if self.poisoned {
            return Err(LogError::WriterPoisoned { path: self.name.clone() });
        }
        self.inner.flush().map_err(|e| {
            self.poisoned = true;
            LogError::io(&self.name, e)
        })
    }

    /// Flushes and returns the inner writer.
    pub fn finish(mut self) -> Result<W, LogError> {
        self.flush()?;
        Ok(self.inner)
    }

    /// The sequence number the next append will get (= records in the stream so far).
    /// `at_ns` of the last record appended by this writer (0 before the first).
    pub fn last_at_ns(&self) -> u64 {
        self.last_at_ns
    }

    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The stream's length in bytes so far, header included (and, after
    /// [`StreamWriter::open_append`], the records already on disk): the byte offset at which the
    /// next record (v1) or block (v2) will start. Records gathered in a v2 block not yet sealed
    /// are not counted.
    pub fn bytes_written(&self) -> u64 {
        self.bytes_written
    }

    pub fn format(&self) -> LogFormat {
        self.format
    }

    pub fn header(&self) -> &StreamHeader {
        &self.header
    }

    /// The name errors use.
    pub fn name(&self) -> &Path {
        &self.name
    }

    pub fn get_ref(&self) -> &W {
        &self.inner
    }
}

impl StreamWriter<BufWriter<File>> {
    /// Creates (or truncates) the file at `path` and writes the header (format v2).
    pub fn create(path: impl AsRef<Path>, header: &StreamHeader) -> Result<Self, LogError> {
        Self::create_with_buffer(path.as_ref(), header, FILE_BUFFER_BYTES, LogFormat::default())
    }

    /// Like [`StreamWriter::create`], in the given format.
    pub fn create_as(
        path: impl AsRef<Path>,
        header: &StreamHeader,
        format: LogFormat,
    ) -> Result<Self, LogError> {
        Self::create_with_buffer(path.as_ref(), header, FILE_BUFFER_BYTES, format)
    }

    /// Like [`StreamWriter::create`] with a chosen buffer size (a run writes many streams at
    /// once and keeps each buffer smaller).
    pub(crate) fn create_with_buffer(
        path: &Path,
        header: &StreamHeader,
        buffer_bytes: usize,
        format: LogFormat,
    ) -> Result<Self, LogError> {
        let file = File::create(path).map_err(|e| LogError::io(path, e))?;
        Self::new_named(BufWriter::with_capacity(buffer_bytes, file), header, path, format)
    }

    /// Reopens an existing stream to continue it (a restarted live worker), in the stream's own
    /// format. Reads and validates every record; cuts off a torn tail (returned, so the caller
    /// can report it); positions the writer after the last sound record with the sequence
    /// continuing from it (in v2 the next block starts a new epoch). Any other damage is an
    /// error and nothing is written.
    pub fn open_append(path: impl AsRef<Path>) -> Result<(Self, Option<TornTail>), LogError> {
        Self::open_append_observing(path, |_| {})
    }

    /// [`StreamWriter::open_append`], handing every sound record to `observe` on the way (a
    /// restarted live worker folds what its dead session held in the same pass).
    pub fn open_append_observing(
        path: impl AsRef<Path>,
        mut observe: impl FnMut(&Record),
    ) -> Result<(Self, Option<TornTail>), LogError> {
        let path = path.as_ref();
        let io = |e| LogError::io(path, e);
        let mut file = OpenOptions::new().read(true).write(true).open(path).map_err(io)?;
        let (header, next_seq, end, torn, last_at_ns, format) = {
            let clone = file.try_clone().map_err(io)?;
            let mut reader = StreamReader::new(BufReader::with_capacity(FILE_BUFFER_BYTES, clone), path)?;
            let mut last_at_ns = 0;
            while let Some(rec) = reader.next_record()? {
                last_at_ns = rec.at_ns;
                observe(&rec);
            }
            let format = reader.format();
            (
                reader.header().clone(),
                reader.next_seq(),
                reader.sound_length(),
                reader.torn_tail(),
                last_at_ns,
                format,
            )
        };
        if torn.is_some() {
            file.set_len(end).map_err(io)?;
            file.sync_all().map_err(io)?;
        }
        file.seek(SeekFrom::Start(end)).map_err(io)?;
        let writer = StreamWriter {
            inner: BufWriter::with_capacity(FILE_BUFFER_BYTES, file),
            format,
            block: Box::default(),
            name: path.to_path_buf(),
            header,
            scratch: Vec::with_capacity(256),
            next_seq,
            last_at_ns,
            bytes_written: end,
            poisoned: false,
            crc: crc32fast::Hasher::new(),
        };
        Ok((writer, torn))
    }

    /// Flushes and asks the OS to put the data on disk (for live workers at checkpoints).
    pub fn sync_data(&mut self) -> Result<(), LogError> {
        self.flush()?;
        self.inner.get_ref().sync_data().map_err(|e| LogError::io(&self.name, e))
    }
}

impl<W: Write> std::fmt::Debug for StreamWriter<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamWriter")
            .field("name", &self.name)
            .field("format", &self.format)
            .field("next_seq", &self.next_seq)
            .field("bytes_written", &self.bytes_written)
            .finish_non_exhaustive()
    }
}
