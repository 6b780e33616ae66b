//! Runs: the streams of all workers of one run, read as one deterministic sequence.
//!
//! A run is stored in one of two layouts, and every reader accepts both (plus a lone stream file,
//! read as a run of one stream):
//!
//! - **a directory** of per-worker stream files named `{worker}.hlog`, where `{worker}` is the
//!   worker id's display form (`prefill-0.hlog`, `decode-1.hlog`, `agg-2.1.hlog`, `router.hlog`).
//!   Other files are ignored. This is what live workers and replay write.
//! - **one merged file** (`.hrun` by convention), format version 1:
//!
//! ```text
//! run      := RUN_MAGIC(8 = "HOFFRUN\0") run_format_version(u16 LE) codec_id(u16 LE)
//!             stream_count(u16 LE, >= 1) stream_header{stream_count} mrecord*
//! stream_header := header_len(u32 LE) header_crc(u32 LE, crc32 of header_bytes)
//!                  header_bytes(StreamHeader, codec)       -- exactly as in a stream file
//! mrecord  := len(u32 LE, bytes after the crc) crc(u32 LE, crc32 of the bytes after it)
//!             stream(u16 LE, index into the stream headers) seq(u64 LE) at_ns(u64 LE) fact(codec)
//! ```
//!
//! The stream headers appear in canonical order, and the records in merge order (below), so
//! reading a merged file yields exactly the sequence the directory it was made from yields. Each
//! stream's `seq` still starts at 0 and rises by one, and the merged reader checks that; the
//! torn-tail rule is the same as for a stream.
//!
//! **Canonical order** of streams: by [`WorkerId`] (role Prefill < Decode < Aggregated < Router,
//! then index, then data-parallel rank). **Merge order** of records: a k-way merge that always
//! takes, among the streams' next unread records, the one with the smallest `(at_ns, stream index
//! in canonical order)`; within a stream records keep their `seq` order. When every stream's
//! `at_ns` never decreases (as writers that follow the time rules produce), this is the total
//! order by `(at_ns, stream index, seq)`. The merge holds one record per stream, so memory does
//! not grow with the length of the log.
//!
//! All streams of a run share one `run_id`; a stream of another run is an error.

use super::codec;
use super::error::LogError;
use super::frame::{self, TornTail};
use super::layout::{
    LogFormat, RunLayout, SegmentKind, FILE_BUFFER_BYTES, FRAME_PREFIX_BYTES, RUN_FORMAT_VERSION, RUN_MAGIC,
    RUN_STREAM_BUFFER_BYTES, STREAM_EXTENSION,
};
use super::reader::truncate;
use super::segment::SegmentReader;
use super::writer::StreamWriter;
use super::{Fact, Record, StreamHeader};
use crate::ids::{HandoffId, WorkerId, WorkerSlots};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

pub use super::layout::{stream_file_name, RunKind};

/// The other worker a fact names, if any (a peer of a message or transfer, a routed worker).
fn named_worker(fact: &Fact) -> Option<WorkerId> {
    match fact {
        Fact::PrefillBooked { worker, .. }
        | Fact::PrefillComputeDone { worker, .. }
        | Fact::PrefillBookingFreed { worker, .. }
        | Fact::DecodeBooked { worker, .. }
        | Fact::DecodeBookingFreed { worker, .. }
        | Fact::DestinationRouted { worker, .. } => Some(*worker),
        Fact::MessageSent { to, .. } => Some(*to),
        Fact::MessageReceived { from, .. }
        | Fact::MessageRejected { from, .. }
        | Fact::ReceiveStarted { from, .. } => Some(*from),
        _ => None,
    }
}

/// Reads a run (directory, merged file, or lone stream) in merge order, yielding each record
/// with its stream's index and, through [`RunReader::last_record_offset`], where it starts in
/// its file.
///
/// A merged file or a lone stream is one file, read straight through. A directory is a k-way
/// merge of its stream files: the heap holds only `(at_ns, stream)` keys, and each stream's
/// next record waits in `heads`, so memory is one record per stream.
pub struct RunReader {
    layout: RunLayout,
    files: Vec<SegmentReader>,
    heads: Vec<Option<Record>>,
    heap: BinaryHeap<Reverse<(u64, usize)>>,
    /// Files whose head was taken and must be read again before the next pop. Refilling
    /// lazily makes a stream's error surface when its next record is actually needed.
    refill: Vec<usize>,
    last_record_offset: Option<u64>,
    done: bool,
    /// The run's workers, sorted (filled on first use by `check_peers`).
    workers: Vec<WorkerId>,
    /// Whether records naming a worker without a stream are an error (see `check_peers`).
    peers_checked: bool,
}

impl RunReader {
    /// Opens a run directory, a merged run file, or a single stream file, and reads every
    /// stream header (checking that they share one run id).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, LogError> {
        Self::from_layout(RunLayout::open(path)?)
    }

    /// Reads the run `layout` describes from its first records.
    pub fn from_layout(layout: RunLayout) -> Result<Self, LogError> {
        let streams = layout.headers.len();
        let buffer = if layout.segments.len() > 1 { RUN_STREAM_BUFFER_BYTES } else { FILE_BUFFER_BYTES };
        let files = layout
            .segments
            .iter()
            .map(|seg| SegmentReader::open_buffered(seg, seg.start_position(), vec![0; streams], buffer))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(RunReader {
            heads: (0..files.len()).map(|_| None).collect(),
            refill: (0..files.len()).collect(),
            files,
            layout,
            heap: BinaryHeap::new(),
            last_record_offset: None,
            done: false,
            workers: Vec::new(),
            peers_checked: true,
        })
    }

    /// Reads records that name workers without a stream of their own (framing-level tools and
    /// tests of arbitrary facts); a whole run read this way may be missing a stream unnoticed.
    pub fn allow_missing_peers(mut self) -> Self {
        self.peers_checked = false;
        self
    }

    /// The stream headers in canonical order; record tuples index into this.
    pub fn headers(&self) -> &[StreamHeader] {
        &self.layout.headers
    }

    /// The files and streams being read.
    pub fn layout(&self) -> &RunLayout {
        &self.layout
    }

    pub fn kind(&self) -> RunKind {
        self.layout.kind
    }

    pub fn path(&self) -> &Path {
        &self.layout.run
    }

    /// The files read: one per stream for a directory, the one file otherwise.
    pub fn stream_paths(&self) -> Vec<PathBuf> {
        self.layout.paths()
    }

    /// Like [`RunReader::next`], naming the record's worker rather than its stream's index.
    pub fn next_record(&mut self) -> Result<Option<(WorkerId, Record)>, LogError> {
        Ok(self.next()?.map(|(i, rec)| (self.headers()[i].worker, rec)))
    }

    /// The next record in merge order, with the index of its stream in [`RunReader::headers`].
    /// `None` at the end. After an error the reader is stopped and returns `None`.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Option<(usize, Record)>, LogError> {
        if self.done {
            return Ok(None);
        }
        let result = self.read_next().and_then(|r| self.check_peers(r));
        match &result {
            Ok(None) | Err(_) => self.done = true,
            Ok(Some(_)) => {}
        }
        result
    }

    /// A record naming a worker that has no stream in a whole run (directory or merged file)
    /// means a stream was lost: folding the rest would give figures that look complete. A
    /// single stream file is read alone on purpose, so its peers are not checked.
    fn check_peers(&mut self, record: Option<(usize, Record)>) -> Result<Option<(usize, Record)>, LogError> {
        let Some((i, rec)) = record else { return Ok(None) };
        if self.layout.kind != RunKind::Stream && self.peers_checked {
            if let Some(peer) = named_worker(&rec.fact) {
                if self.workers.is_empty() {
                    self.workers = self.layout.workers();
                    self.workers.sort();
                }
                if self.workers.binary_search(&peer).is_err() {
                    return Err(LogError::MissingStream {
                        path: self.layout.run.clone(),
                        worker: peer,
                        named_by: self.layout.headers[i].worker,
                        seq: rec.seq,
                    });
                }
            }
        }
        Ok(Some((i, rec)))
    }

    fn read_next(&mut self) -> Result<Option<(usize, Record)>, LogError> {
        if let [only] = self.files.as_mut_slice() {
            let next = only.next_record()?;
            self.last_record_offset = only.last_record_offset();
            return Ok(next);
        }
        for file in std::mem::take(&mut self.refill) {
            if let Some((stream, record)) = self.files[file].next_record()? {
                self.heap.push(Reverse((record.at_ns, stream)));
                self.heads[file] = Some(record);
            }
        }
        // In a directory, file `i` holds stream `i`.
        let Some(Reverse((_, stream))) = self.heap.pop() else { return Ok(None) };
        let Some(record) = self.heads[stream].take() else { return Ok(None) };
        self.refill.push(stream);
        self.last_record_offset = self.files[stream].last_record_offset();
        Ok(Some((stream, record)))
    }

    /// The byte offset of the record last returned, in its stream file (directory) or in the
    /// merged file.
    pub fn last_record_offset(&self) -> Option<u64> {
        self.last_record_offset
    }

    /// Torn tails found so far, with the file each is in (complete once `next` returned `None`).
    pub fn torn_tails(&self) -> Vec<(PathBuf, TornTail)> {
        self.files.iter().filter_map(|r| r.torn_tail().map(|t| (r.path().to_path_buf(), t))).collect()
    }

    /// The workers whose stream, as read so far, does not end with [`Fact::StreamEnded`]: once
    /// `next` returned `None`, the streams that were cut short (empty when the run is complete).
    pub fn unended(&self) -> Vec<WorkerId> {
        let single = self.files.len() == 1;
        (0..self.layout.headers.len())
            .filter(|&i| !self.files[if single { 0 } else { i }].ended(i))
            .map(|i| self.layout.headers[i].worker)
            .collect()
    }

    /// Iterates the remaining records (stops after the first error).
    pub fn records(&mut self) -> impl Iterator<Item = Result<(usize, Record), LogError>> + '_ {
        std::iter::from_fn(move || self.next().transpose())
    }
}

/// Per-stream figures of a verified run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunStreamSummary {
    pub header: StreamHeader,
    pub records: u64,
    pub first_at_ns: Option<u64>,
    pub last_at_ns: Option<u64>,
}

/// What [`verify_run`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunSummary {
    pub kind: RunKind,
    /// In canonical order.
    pub streams: Vec<RunStreamSummary>,
    pub records: u64,
    /// Distinct handoffs named anywhere in the run.
    pub handoffs: usize,
    /// Left in place: verifying never writes.
    pub torn_tails: Vec<(PathBuf, TornTail)>,
    /// Workers whose stream has no end marker: the run did not end cleanly.
    pub unended: Vec<WorkerId>,
}

/// Reads a whole run (any layout) and checks every stream's framing, checksums, sequence
/// numbers and facts, and the shared run id. Writes nothing.
pub fn verify_run(path: impl AsRef<Path>) -> Result<RunSummary, LogError> {
    verify_run_with(path, |_, _| Ok(()))
}

/// [`verify_run`], handing every record (with its stream index) to `observe`, which may refuse
/// the run (a content check: the log layer itself only checks framing).
pub fn verify_run_with<E: From<LogError>>(
    path: impl AsRef<Path>,
    mut observe: impl FnMut(usize, &Record) -> Result<(), E>,
) -> Result<RunSummary, E> {
    let mut run = RunReader::open(path)?;
    let mut streams: Vec<RunStreamSummary> = run
        .headers()
        .iter()
        .map(|h| RunStreamSummary { header: h.clone(), records: 0, first_at_ns: None, last_at_ns: None })
        .collect();
    let mut handoffs = BTreeSet::<HandoffId>::new();
    let mut records = 0;
    while let Some((i, rec)) = run.next()? {
        observe(i, &rec)?;
        records += 1;
        if let Some(s) = streams.get_mut(i) {
            s.records += 1;
            s.first_at_ns.get_or_insert(rec.at_ns);
            s.last_at_ns = Some(rec.at_ns);
        }
        if let Some(h) = rec.fact.handoff() {
            handoffs.insert(h);
        }
    }
    Ok(RunSummary {
        kind: run.kind(),
        streams,
        records,
        handoffs: handoffs.len(),
        torn_tails: run.torn_tails(),
        unended: run.unended(),
    })
}

/// Reads a whole run (any layout), validating it, then truncates every torn tail found. If any
/// other damage is found nothing is written. Returns what was cut.
pub fn recover_run(path: impl AsRef<Path>) -> Result<Vec<(PathBuf, TornTail)>, LogError> {
    let path = path.as_ref();
    // An empty stream file is a stream torn before its header reached the disk (a crash right
    // after the file was created): there is nothing in it to keep, so it goes, reported as a
    // cut of zero bytes at offset 0. (Readers then name the worker if other streams mention it.)
    let mut removed = Vec::new();
    if path.is_dir() {
        for entry in fs::read_dir(path).map_err(|e| LogError::io(path, e))? {
            let p = entry.map_err(|e| LogError::io(path, e))?.path();
            let empty = fs::metadata(&p).map(|m| m.is_file() && m.len() == 0).unwrap_or(false);
            if empty && p.extension().and_then(|e| e.to_str()) == Some(STREAM_EXTENSION) {
                fs::remove_file(&p).map_err(|e| LogError::io(&p, e))?;
                removed.push((p, TornTail { offset: 0, bytes: 0 }));
            }
        }
        removed.sort_by(|a, b| a.0.cmp(&b.0));
    }
    // Framing only: a run missing a stream is still recovered as far as it goes.
    let mut run = RunReader::open(path)?.allow_missing_peers();
    while run.next()?.is_some() {}
    let torn = run.torn_tails();
    drop(run);
    for (p, t) in &torn {
        truncate(p, t.offset)?;
    }
    removed.extend(torn);
    Ok(removed)
}

/// What [`write_merged`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MergeSummary {
    pub streams: usize,
    pub records: u64,
    pub bytes: u64,
    /// Torn tails in the input, whose partial records were not carried over.
    pub torn_tails: Vec<(PathBuf, TornTail)>,
}

/// Writes the run at `run_path` (any layout) as one merged file at `out_path`, in merge order.
///
/// The file is written under a temporary name beside `out_path` and renamed into place only
/// when complete, so a failed merge never leaves a cut-short file that would read as a run with
/// a torn tail (silently missing records).
pub fn write_merged(
    run_path: impl AsRef<Path>,
    out_path: impl AsRef<Path>,
) -> Result<MergeSummary, LogError> {
    let out_path = out_path.as_ref();
    let mut tmp_name = out_path.as_os_str().to_owned();
    tmp_name.push(".partial");
    let tmp_path = PathBuf::from(tmp_name);
    let result = write_merged_to(run_path.as_ref(), &tmp_path, out_path);
    match result {
        Ok(summary) => {
            fs::rename(&tmp_path, out_path).map_err(|e| LogError::io(out_path, e))?;
            Ok(summary)
        }
        Err(e) => {
            // Best effort: the error being reported matters more than a leftover temp file.
            let _ = fs::remove_file(&tmp_path);
            Err(e)
        }
    }
}

/// The merged file must not replace one of the files it is made from, nor become a stream of
/// the run directory it reads (`merge RUN RUN/router.hlog` once replaced the run's own stream).
fn refuse_overwriting_inputs(run: &RunReader, out_path: &Path) -> Result<(), LogError> {
    let canonical = |p: &Path| fs::canonicalize(p).ok();
    let out_dir = out_path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let out = canonical(out_dir).map(|d| d.join(out_path.file_name().unwrap_or_default()));
    let Some(out) = out else { return Ok(()) };
    let inputs: Vec<PathBuf> = run.stream_paths().iter().filter_map(|p| canonical(p)).collect();
    let into_run_dir = run.kind() == RunKind::Directory
        && canonical(run.path()).is_some_and(|d| out.parent() == Some(d.as_path()))
        && out.extension().is_some_and(|e| e == "hlog");
    if inputs.contains(&out) || into_run_dir {
        return Err(LogError::OverwritesInput {
            path: out_path.to_path_buf(),
            run: run.path().to_path_buf(),
        });
    }
    Ok(())
}

fn write_merged_to(run_path: &Path, tmp_path: &Path, out_path: &Path) -> Result<MergeSummary, LogError> {
    // Merging copies records; a lost stream is still reported when the merged file is read.
    let mut run = RunReader::open(run_path)?.allow_missing_peers();
    refuse_overwriting_inputs(&run, out_path)?;
    if run.headers().len() > u16::MAX as usize {
        return Err(LogError::TooManyStreams {
            path: run.path().into(),
            count: run.headers().len(),
            max: u16::MAX as usize,
        });
    }
    let io = |e| LogError::io(tmp_path, e);
    let file = File::create(tmp_path).map_err(io)?;
    let mut out = BufWriter::with_capacity(FILE_BUFFER_BYTES, file);
    let mut scratch = Vec::with_capacity(1024);
    frame::write_prelude(&mut scratch, &RUN_MAGIC, RUN_FORMAT_VERSION);
    scratch.extend_from_slice(&(run.headers().len() as u16).to_le_bytes());
    for h in run.headers() {
        frame::write_header_block(&mut scratch, h, out_path)?;
    }
    out.write_all(&scratch).map_err(io)?;
    let mut bytes = scratch.len() as u64;
    let mut records = 0u64;
    while let Some((stream, rec)) = run.next()? {
        scratch.clear();
        scratch.extend_from_slice(&[0u8; FRAME_PREFIX_BYTES]);
        SegmentKind::Merged.put_fields(&mut scratch, stream, rec.seq, rec.at_ns);
        codec::encode_fact_into(&rec.fact, &mut scratch)
            .map_err(|reason| LogError::Encode { path: out_path.into(), reason })?;
        frame::seal_record(&mut scratch, crc32fast::Hasher::new(), out_path)?;
        out.write_all(&scratch).map_err(io)?;
        bytes += scratch.len() as u64;
        records += 1;
    }
    let file = out.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    Ok(MergeSummary { streams: run.headers().len(), records, bytes, torn_tails: run.torn_tails() })
}

/// Writes a run directory: one [`StreamWriter`] per worker, each created on first use from the
/// header it was given. Replay declares its starting workers up front and a worker that joins
/// mid-run when it joins ([`RunWriter::declare`]); its file then starts with records stamped
/// from the join on, which every reader merges like any other stream.
pub struct RunWriter {
    dir: PathBuf,
    headers: BTreeMap<WorkerId, StreamHeader>,
    /// Open streams, sorted by worker.
    streams: Vec<(WorkerId, StreamWriter<BufWriter<File>>)>,
    /// Where each open stream is in `streams`.
    slots: WorkerSlots,
    format: LogFormat,
}

impl RunWriter {
    /// Prepares a run in `dir` (created if missing) for the workers of `headers`, which must
    /// share one run id and name distinct workers (more can be declared later). Refuses a
    /// directory that already holds `.hlog` streams, so two runs are never mixed.
    pub fn create(
        dir: impl AsRef<Path>,
        headers: impl IntoIterator<Item = StreamHeader>,
    ) -> Result<Self, LogError> {
        Self::create_as(dir, headers, LogFormat::default())
    }

    /// [`RunWriter::create`] writing streams in `format`.
    pub fn create_as(
        dir: impl AsRef<Path>,
        headers: impl IntoIterator<Item = StreamHeader>,
        format: LogFormat,
    ) -> Result<Self, LogError> {
        let dir = dir.as_ref();
        fs::create_dir_all(dir).map_err(|e| LogError::io(dir, e))?;
        for entry in fs::read_dir(dir).map_err(|e| LogError::io(dir, e))? {
            let p = entry.map_err(|e| LogError::io(dir, e))?.path();
            if p.extension().and_then(|e| e.to_str()) == Some(STREAM_EXTENSION) {
                return Err(LogError::RunExists { path: dir.into(), existing: p.display().to_string() });
            }
        }
        let mut run = RunWriter {
            dir: dir.to_path_buf(),
            headers: BTreeMap::new(),
            streams: Vec::new(),
            slots: WorkerSlots::default(),
            format,
        };
        for h in headers {
            run.declare(h)?;
        }
        // Every stream's header reaches the disk before any record is buffered: a run killed at
        // any later instant leaves each stream readable (at most a torn tail to cut).
        let workers: Vec<WorkerId> = run.headers.keys().copied().collect();
        for w in workers {
            run.stream(w)?;
        }
        Ok(run)
    }

    /// Adds a worker to the run; its file is created on first use (or at `finish`).
    pub fn declare(&mut self, header: StreamHeader) -> Result<(), LogError> {
        let path = self.dir.join(stream_file_name(header.worker));
        // The file name must read back as the same worker (the router has one spelling).
        let named = header.worker.to_string().parse::<WorkerId>().unwrap_or(WorkerId::ROUTER);
        if named != header.worker {
            return Err(LogError::WorkerMismatch { path, named, found: header.worker });
        }
        if let Some(first) = self.headers.values().next() {
            if header.run_id != first.run_id {
                return Err(LogError::RunIdMismatch {
                    path,
                    worker: header.worker,
                    expected: first.run_id,
                    found: header.run_id,
                });
            }
        }
        if self.headers.contains_key(&header.worker) {
            return Err(LogError::DuplicateWorker { path, worker: header.worker });
        }
        self.headers.insert(header.worker, header);
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The headers, in canonical order.
    pub fn headers(&self) -> impl Iterator<Item = &StreamHeader> {
        self.headers.values()
    }

    /// `worker`'s stream, creating its file on first use.
    pub fn stream(&mut self, worker: WorkerId) -> Result<&mut StreamWriter<BufWriter<File>>, LogError> {
        if let Some(i) = self.slots.get(worker) {
            return Ok(&mut self.streams[i].1);
        }
        let i = match self.streams.binary_search_by_key(&worker, |(w, _)| *w) {
            Ok(i) => i,
            Err(i) => {
                let Some(header) = self.headers.get(&worker) else {
                    return Err(LogError::UnknownWorker { path: self.dir.clone(), worker });
                };
                let mut w = StreamWriter::create_with_buffer(
                    &self.dir.join(stream_file_name(worker)),
                    header,
                    RUN_STREAM_BUFFER_BYTES,
                    self.format,
                )?;
                w.flush()?;
                self.streams.insert(i, (worker, w));
                self.slots.rebuild(self.streams.iter().map(|(w, _)| *w));
                i
            }
        };
        Ok(&mut self.streams[i].1)
    }

    /// Writes every stream's buffered records to its file (the replay does this on a time bound,
    /// so a crash loses at most the last moments of the run). A v2 block still gathering stays
    /// in memory ([`StreamWriter::flush_sealed`]): blocks end where the records put them, not
    /// where the clock did, so the files are the same on every run.
    pub fn flush_all(&mut self) -> Result<(), LogError> {
        for (_, s) in &mut self.streams {
            s.flush_sealed()?;
        }
        Ok(())
    }

    /// Appends to `worker`'s stream.
    pub fn append(&mut self, worker: WorkerId, at_ns: u64, fact: &Fact) -> Result<u64, LogError> {
        self.stream(worker)?.append(at_ns, fact)
    }

    /// A clean end: appends [`Fact::StreamEnded`] to every stream (at its last record's
    /// instant), then [`RunWriter::finish`]. A run ended any other way reads as incomplete.
    pub fn close(mut self) -> Result<Vec<PathBuf>, LogError> {
        let workers: Vec<WorkerId> = self.headers.keys().copied().collect();
        for w in workers {
            let s = self.stream(w)?;
            let at = s.last_at_ns();
            s.append(at, &Fact::StreamEnded)?;
        }
        self.finish()
    }

    /// Creates the streams of workers that never appended (header only, so every worker's
    /// engine shape is on record), flushes every stream, and returns the files in canonical
    /// order. Writes no end marker: use [`RunWriter::close`] for a clean end.
    pub fn finish(mut self) -> Result<Vec<PathBuf>, LogError> {
        let workers: Vec<WorkerId> = self.headers.keys().copied().collect();
        let mut paths = Vec::with_capacity(workers.len());
        for w in workers {
            let s = self.stream(w)?;
            s.flush()?;
            paths.push(s.name().to_path_buf());
        }
        Ok(paths)
    }
}
