//! A sled index of a run, so `show --handoff`, `show --worker` and `at` can seek instead of
//! reading the whole log.
//!
//! The index lives beside the run: `RUN/.index` for a run directory, `FILE.index` for a merged
//! run file or a lone stream file. It holds
//!
//! - the run's **layout**: workers in canonical order, the files read ("segments": one per stream
//!   file of a directory, or the one merged / stream file), where each file's records start, and
//!   whether each stream's `at_ns` never decreases (the precondition for seeking by time);
//! - **postings**: HandoffId → (file, byte offset) of every record about that
//!   handoff, and the same for request ids;
//! - **time marks**: every [`TIME_MARK_EVERY`] records of a stream, (worker, at_ns, seq) → offset;
//! - **checkpoints**: every [`CHECKPOINT_EVERY`] records of a segment, the per-stream fold states
//!   of a [`CheckpointFold`] (for `at`, the per-worker fold: capacity, queues, router bookings) and
//!   the byte offset and sequence numbers at which to resume reading;
//! - a **fingerprint** of what it indexed: per file its length, mtime, where its last record
//!   starts, and a crc32 of its header bytes plus its last record.
//!
//! An index is never trusted blindly: [`RunIndex::open_or_rebuild`] rebuilds it when sled cannot
//! open it, when a key is missing, when the index format differs, or when any file's fingerprint
//! no longer matches (a stream appended to, rewritten, or touched). The marker key
//! `meta:complete` is written last, so an index build that was interrupted is rebuilt too.

use super::codec;
use super::error::LogError;
use super::layout::fixed8;
use super::layout::{RunLayout, Segment};
use super::segment::{read_records_at, SegmentReader};
use super::{Record, StreamHeader};
use crate::ids::{HandoffId, RequestId, WorkerId};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Bumped whenever what the index stores changes; an index of another version is rebuilt.
pub const INDEX_FORMAT: u32 = 5;
/// Records of a segment between two checkpoints: `at` reads at most this many records per
/// segment after loading a checkpoint.
pub const CHECKPOINT_EVERY: u64 = 16_384;
/// Records of a stream between two time marks.
pub const TIME_MARK_EVERY: u64 = 4_096;
/// Postings are gathered per id in memory and written to sled after this many, one key per id
/// and flush (`tag id flush_no → packed list`): memory stays bounded while building and sled
/// holds about one key per id instead of one per record.
const FLUSH_POSTINGS: usize = 1_000_000;

/// Errors of the index layer.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error(transparent)]
    Log(#[from] LogError),
    /// Another process (or another open handle) holds the index's lock. The index is left
    /// alone; readers fall back to a scan.
    #[error("{}: the index is in use by another process", path.display())]
    Busy { path: PathBuf },
    /// sled refused an operation on an index that was just (re)built: nothing to fall back to.
    #[error("{}: index database error: {reason}", path.display())]
    Db { path: PathBuf, reason: String },
}

fn db_err(path: &Path, e: impl std::fmt::Display) -> IndexError {
    IndexError::Db { path: path.to_path_buf(), reason: e.to_string() }
}

/// A per-stream fold the index checkpoints, defined here and implemented by the projection
/// that needs it (as a log defines its replay machine and the state machine implements it), so
/// the log layer knows nothing of what is folded.
///
/// A fold starts from its stream's header and folds that stream's records in order; its state is
/// serialized into checkpoints every [`CHECKPOINT_EVERY`] records of a file.
pub trait CheckpointFold: Clone + Serialize + DeserializeOwned {
    /// Names the fold and the version of its state: an index built for another is rebuilt.
    const NAME: &'static str;
    /// The state before the stream's first record.
    fn start(header: &StreamHeader) -> Self;
    /// Folds one record of the stream.
    fn apply(&mut self, record: &Record);
}

/// What the index remembers of one file, to tell whether it changed since.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileFingerprint {
    pub path: PathBuf,
    pub len: u64,
    pub mtime_ns: u128,
    /// Where the last sound record starts (`data_start` when there is none).
    pub last_record_offset: u64,
    /// crc32 of bytes `[0, data_start)` (the headers) and `[last_record_offset, len)`.
    pub crc: u32,
}

impl FileFingerprint {
    fn take(path: &Path, data_start: u64, last_record_offset: u64) -> Result<Self, LogError> {
        let io = |e| LogError::io(path, e);
        let meta = fs::metadata(path).map_err(io)?;
        let len = meta.len();
        let mtime_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let mut f = File::open(path).map_err(io)?;
        let mut h = crc32fast::Hasher::new();
        let mut buf = vec![0u8; data_start.min(len) as usize];
        f.read_exact(&mut buf).map_err(io)?;
        h.update(&buf);
        if last_record_offset < len {
            f.seek(SeekFrom::Start(last_record_offset)).map_err(io)?;
            // The last record is at most MAX_RECORD_BYTES + frame prefix; a file grown beyond
            // that is caught by its length anyway.
            let tail = (len - last_record_offset).min(1 << 20) as usize;
            buf.resize(tail, 0);
            f.read_exact(&mut buf).map_err(io)?;
            h.update(&buf);
        }
        Ok(FileFingerprint { path: path.to_path_buf(), len, mtime_ns, last_record_offset, crc: h.finalize() })
    }
}

/// What the index stores about the run as a whole.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexMeta {
    pub format: u32,
    /// [`CheckpointFold::NAME`] of the fold in the checkpoints.
    pub fold: String,
    pub workers: Vec<WorkerId>,
    pub segments: Vec<Segment>,
    pub fingerprints: Vec<FileFingerprint>,
    /// Per stream: `at_ns` never decreased. Seeking by time needs it; without it `at` reads
    /// every record after the checkpoint.
    pub monotone: Vec<bool>,
    pub records: u64,
    /// Checkpoints per segment.
    pub checkpoints: Vec<u64>,
    /// Records of a segment between two checkpoints.
    pub checkpoint_every: u64,
}

impl IndexMeta {
    pub fn all_monotone(&self) -> bool {
        self.monotone.iter().all(|m| *m)
    }
}

/// A resumable position in one segment with the fold states of its streams.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(bound = "F: CheckpointFold")]
pub struct Checkpoint<F> {
    pub segment: usize,
    /// Offset of the next record to read.
    pub offset: u64,
    /// Next seq per run stream index.
    pub next_seq: Vec<u64>,
    /// The largest `at_ns` among the records folded so far in this segment.
    pub max_at_ns: u64,
    /// Fold states of the segment's streams, in the order of [`Segment::streams`].
    pub states: Vec<F>,
}

/// Where one record is: a file of the run (index into [`IndexMeta::segments`]) and the byte
/// offset of the record in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Posting {
    pub segment: u16,
    pub offset: u64,
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(b: &[u8], i: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*i)?;
        *i += 1;
        v |= ((byte & 0x7f) as u64) << shift;
        if byte < 0x80 {
            return Some(v);
        }
    }
    None
}

/// Postings of one id being gathered: a packed list (segment varint, offset varint, the
/// offset a delta from the previous posting's when the segment is the same).
#[derive(Default)]
struct PackedPostings {
    bytes: Vec<u8>,
    last: Option<(u16, u64)>,
}

impl PackedPostings {
    fn push(&mut self, segment: u16, offset: u64) {
        put_varint(&mut self.bytes, segment as u64);
        match self.last {
            Some((s, o)) if s == segment && offset >= o => put_varint(&mut self.bytes, offset - o),
            _ => put_varint(&mut self.bytes, offset),
        }
        self.last = Some((segment, offset));
    }
}

fn unpack_postings(b: &[u8], out: &mut Vec<Posting>) -> Option<()> {
    let mut i = 0;
    let mut last: Option<(u16, u64)> = None;
    while i < b.len() {
        let segment = u16::try_from(get_varint(b, &mut i)?).ok()?;
        let v = get_varint(b, &mut i)?;
        let offset = match last {
            Some((s, o)) if s == segment => o.checked_add(v)?,
            _ => v,
        };
        out.push(Posting { segment, offset });
        last = Some((segment, offset));
    }
    Some(())
}

/// Why an index was (re)built rather than used as found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexStatus {
    /// Found, complete and matching the run.
    Fresh,
    /// There was none.
    Built,
    /// Found but not usable; rebuilt. The reason says what was wrong.
    Rebuilt(String),
}

/// An open, verified index of a run.
///
/// The index directory holds two sled databases: `state` (layout, fingerprints, checkpoints,
/// time marks: small, so `at` opens it in milliseconds) and `postings` (per-id record lists:
/// large, opened only when a posting is asked for).
pub struct RunIndex {
    db: sled::Db,
    postings: std::sync::OnceLock<Result<sled::Db, String>>,
    path: PathBuf,
    meta: IndexMeta,
}

/// sled's page cache per database: bounds the memory of building a large index.
const SLED_CACHE_BYTES: u64 = 32 << 20;

fn sled_config(path: &Path) -> sled::Config {
    sled::Config::new().path(path).cache_capacity(SLED_CACHE_BYTES)
}

const KEY_META: &[u8] = b"meta:layout";
const KEY_COMPLETE: &[u8] = b"meta:complete";

/// `tag` (`h` handoff, `r` request) and the id's bytes (16 for a UUID, 8 big-endian for a
/// request id, zero-padded).
type PostingId = (u8, [u8; 16]);

fn handoff_pid(h: HandoffId) -> PostingId {
    (b'h', *h.0.as_bytes())
}

fn request_pid(r: RequestId) -> PostingId {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&r.0.to_be_bytes());
    (b'r', b)
}

/// Postings are stored by bucket, not one key per id: sled's memory grows with its keys, and
/// a 10-million-record run has about a million ids. `BUCKETS` buckets × flushes keys in all.
const BUCKETS: u16 = 4096;

fn bucket_of(pid: &PostingId) -> u16 {
    // FNV-1a over the id: spreads sequential request ids as well as random UUIDs.
    let mut h: u32 = 0x811c_9dc5;
    for b in std::iter::once(pid.0).chain(pid.1.iter().copied()) {
        h = (h ^ b as u32).wrapping_mul(0x0100_0193);
    }
    (h % BUCKETS as u32) as u16
}

fn bucket_prefix(bucket: u16) -> [u8; 3] {
    let b = bucket.to_be_bytes();
    [b'p', b[0], b[1]]
}

/// Writes the gathered postings: per bucket one key `p bucket(u16 BE) flush_no(u32 BE)` whose
/// value is a sequence of `tag id(16) len(varint) packed-list`.
fn flush_postings(
    db: &sled::Db,
    path: &Path,
    pending: &mut std::collections::HashMap<PostingId, PackedPostings>,
    flush_no: &mut u32,
) -> Result<(), IndexError> {
    let mut buckets: BTreeMap<u16, Vec<u8>> = BTreeMap::new();
    for (pid, packed) in pending.drain() {
        let v = buckets.entry(bucket_of(&pid)).or_default();
        v.push(pid.0);
        v.extend_from_slice(&pid.1);
        put_varint(v, packed.bytes.len() as u64);
        v.extend_from_slice(&packed.bytes);
    }
    let mut batch = sled::Batch::default();
    for (bucket, v) in buckets {
        let mut k = bucket_prefix(bucket).to_vec();
        k.extend_from_slice(&flush_no.to_be_bytes());
        batch.insert(k, v);
    }
    db.apply_batch(batch).map_err(|e| db_err(path, e))?;
    db.flush().map_err(|e| db_err(path, e))?;
    *flush_no += 1;
    Ok(())
}

/// Finds `pid`'s packed lists in one bucket value.
fn postings_in_bucket(v: &[u8], pid: &PostingId, out: &mut Vec<Posting>) -> Option<()> {
    let mut i = 0;
    while i < v.len() {
        let tag = *v.get(i)?;
        let id = v.get(i + 1..i + 17)?;
        i += 17;
        let len = get_varint(v, &mut i)? as usize;
        let list = v.get(i..i.checked_add(len)?)?;
        i += len;
        if tag == pid.0 && id == pid.1 {
            unpack_postings(list, out)?;
        }
    }
    Some(())
}

fn checkpoint_key(seg: u16, max_at_ns: u64, ordinal: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(19);
    k.push(b'c');
    k.extend_from_slice(&seg.to_be_bytes());
    k.extend_from_slice(&max_at_ns.to_be_bytes());
    k.extend_from_slice(&ordinal.to_be_bytes());
    k
}

impl RunIndex {
    /// Where the index of `run` lives: `RUN/.index` for a directory, `FILE.index` otherwise.
    pub fn index_path(run: &Path) -> PathBuf {
        if run.is_dir() {
            run.join(".index")
        } else {
            let mut s = run.as_os_str().to_owned();
            s.push(".index");
            PathBuf::from(s)
        }
    }

    /// Whether an index directory exists for `run` (fresh or not).
    pub fn exists(run: &Path) -> bool {
        Self::index_path(run).exists()
    }

    /// Opens the index of `run` if it is present, complete and matches the run; otherwise
    /// (re)builds it. Never returns an index that does not describe the run as it is now.
    pub fn open_or_rebuild<F: CheckpointFold>(
        run: impl AsRef<Path>,
    ) -> Result<(RunIndex, IndexStatus), IndexError> {
        Self::open_or_rebuild_with::<F>(run, &mut |_| {})
    }

    /// [`RunIndex::open_or_rebuild`], reporting records indexed to `progress` while building.
    pub fn open_or_rebuild_with<F: CheckpointFold>(
        run: impl AsRef<Path>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<(RunIndex, IndexStatus), IndexError> {
        let run = run.as_ref();
        let layout = RunLayout::open(run)?;
        let path = Self::index_path(run);
        if !path.exists() {
            let idx = Self::build_layout::<F>(&layout, CHECKPOINT_EVERY, progress)?;
            return Ok((idx, IndexStatus::Built));
        }
        match Self::try_open::<F>(&layout, &path)? {
            Ok(idx) => Ok((idx, IndexStatus::Fresh)),
            Err(reason) => {
                let idx = Self::build_layout::<F>(&layout, CHECKPOINT_EVERY, progress)?;
                Ok((idx, IndexStatus::Rebuilt(reason)))
            }
        }
    }

    /// Builds (or rebuilds) the index of `run` from scratch.
    pub fn build<F: CheckpointFold>(run: impl AsRef<Path>) -> Result<RunIndex, IndexError> {
        Self::build_every::<F>(run, CHECKPOINT_EVERY)
    }

    /// [`RunIndex::build`] with checkpoints every `checkpoint_every` records of a file (tests
    /// use small values to exercise checkpoints on small runs). An index keeps its interval
    /// when reopened.
    pub fn build_every<F: CheckpointFold>(
        run: impl AsRef<Path>,
        checkpoint_every: u64,
    ) -> Result<RunIndex, IndexError> {
        let layout = RunLayout::open(run.as_ref())?;
        Self::build_layout::<F>(&layout, checkpoint_every.max(1), &mut |_| {})
    }

    /// Opens an existing index; `Ok(Err(reason))` when it cannot be trusted.
    fn try_open<F: CheckpointFold>(
        layout: &RunLayout,
        path: &Path,
    ) -> Result<Result<RunIndex, String>, IndexError> {
        // sled may panic on some kinds of damage rather than return an error; a damaged index
        // must only ever lead to a rebuild.
        if !path.join("postings").is_dir() {
            return Ok(Err("missing postings database".into()));
        }
        let state = path.join("state");
        let opened = std::panic::catch_unwind(|| sled_config(&state).open());
        let db = match opened {
            Ok(Ok(db)) => db,
            Ok(Err(e)) if e.to_string().contains("could not acquire lock") => {
                return Err(IndexError::Busy { path: path.to_path_buf() })
            }
            Ok(Err(e)) => return Ok(Err(format!("cannot open: {e}"))),
            Err(_) => return Ok(Err("cannot open: the database is damaged".into())),
        };
        let complete = matches!(db.get(KEY_COMPLETE), Ok(Some(v)) if v.as_ref() == b"1");
        if !complete {
            return Ok(Err("incomplete (an earlier build did not finish)".into()));
        }
        let meta: IndexMeta = match db.get(KEY_META) {
            Ok(Some(v)) => match serde_json::from_slice(&v) {
                Ok(m) => m,
                Err(e) => return Ok(Err(format!("unreadable layout: {e}"))),
            },
            Ok(None) => return Ok(Err("missing layout key".into())),
            Err(e) => return Ok(Err(format!("cannot read layout: {e}"))),
        };
        if meta.format != INDEX_FORMAT {
            return Ok(Err(format!("index format {} (this build writes {INDEX_FORMAT})", meta.format)));
        }
        if meta.fold != F::NAME {
            return Ok(Err(format!("checkpoints of fold {:?}, wanted {:?}", meta.fold, F::NAME)));
        }
        if meta.workers != layout.workers() || meta.segments != layout.segments {
            return Ok(Err("the run's streams changed".into()));
        }
        for fp in &meta.fingerprints {
            let seg_start =
                meta.segments.iter().find(|s| s.path == fp.path).map(|s| s.data_start).unwrap_or(0);
            // `last_record_offset` is the byte offset of the last record's frame (its block in v2).
            let now = match FileFingerprint::take(&fp.path, seg_start, fp.last_record_offset) {
                Ok(now) => now,
                Err(e) => return Ok(Err(format!("cannot fingerprint: {e}"))),
            };
            if now != *fp {
                return Ok(Err(format!(
                    "{} changed since it was indexed (length {} → {}, checksum {:#010x} → {:#010x})",
                    fp.path.display(),
                    fp.len,
                    now.len,
                    fp.crc,
                    now.crc
                )));
            }
        }
        let path = path.to_path_buf();
        Ok(Ok(RunIndex { db, postings: std::sync::OnceLock::new(), path, meta }))
    }

    fn build_layout<F: CheckpointFold>(
        layout: &RunLayout,
        checkpoint_every: u64,
        progress: &mut dyn FnMut(u64),
    ) -> Result<RunIndex, IndexError> {
        let path = Self::index_path(&layout.run);
        if path.exists() {
            fs::remove_dir_all(&path)
                .or_else(|_| fs::remove_file(&path))
                .map_err(|e| LogError::io(&path, e))?;
        }
        fs::create_dir_all(&path).map_err(|e| LogError::io(&path, e))?;
        let db = sled_config(&path.join("state")).open().map_err(|e| db_err(&path, e))?;
        let pdb = sled_config(&path.join("postings")).open().map_err(|e| db_err(&path, e))?;
        let n = layout.headers.len();
        let mut monotone = vec![true; n];
        let mut last_at = vec![0u64; n];
        let mut records = 0u64;
        let mut fingerprints = Vec::new();
        let mut checkpoints = Vec::new();
        let mut batch = sled::Batch::default();
        let mut pending: std::collections::HashMap<PostingId, PackedPostings> =
            std::collections::HashMap::new();
        let mut pending_n = 0usize;
        let mut flush_no = 0u32;
        for (si, seg) in layout.segments.iter().enumerate() {
            let seg16 = si as u16;
            let mut states: Vec<F> = seg.streams.iter().map(|&s| F::start(&layout.headers[s])).collect();
            // Position of each run stream in `states`.
            let mut slot = vec![usize::MAX; n];
            for (k, &s) in seg.streams.iter().enumerate() {
                slot[s] = k;
            }
            let mut reader = SegmentReader::open_at(seg, seg.start_position(), vec![0; n])?;
            let mut in_seg = 0u64;
            let mut max_at = 0u64;
            let mut last_offset = seg.start_position();
            let mut ordinal = 0u64;
            while let Some((stream, rec)) = reader.next_record()? {
                let offset = reader.last_record_offset().unwrap_or(seg.start_position());
                last_offset = offset;
                if rec.at_ns < last_at[stream] {
                    monotone[stream] = false;
                }
                last_at[stream] = rec.at_ns;
                max_at = max_at.max(rec.at_ns);
                let k = slot[stream];
                if let Some(st) = states.get_mut(k) {
                    st.apply(&rec);
                }
                if let Some(h) = rec.fact.handoff() {
                    pending.entry(handoff_pid(h)).or_default().push(seg16, offset);
                    pending_n += 1;
                }
                if let Some(r) = rec.fact.request() {
                    pending.entry(request_pid(r)).or_default().push(seg16, offset);
                    pending_n += 1;
                }
                if rec.seq % TIME_MARK_EVERY == 0 {
                    let mut key = vec![b't'];
                    key.extend_from_slice(&(stream as u16).to_be_bytes());
                    key.extend_from_slice(&rec.at_ns.to_be_bytes());
                    key.extend_from_slice(&rec.seq.to_be_bytes());
                    let mut val = Vec::with_capacity(10);
                    val.extend_from_slice(&seg16.to_be_bytes());
                    val.extend_from_slice(&offset.to_be_bytes());
                    batch.insert(key, val);
                }
                in_seg += 1;
                records += 1;
                if in_seg % checkpoint_every == 0 {
                    let cp = Checkpoint {
                        segment: si,
                        offset: reader.offset(),
                        next_seq: reader.next_seqs().to_vec(),
                        max_at_ns: max_at,
                        states: states.clone(),
                    };
                    let mut blob = Vec::new();
                    codec::encode_into(&cp, &mut blob)
                        .map_err(|reason| LogError::Encode { path: path.clone(), reason })?;
                    batch.insert(checkpoint_key(seg16, max_at, ordinal), blob);
                    ordinal += 1;
                    progress(records);
                }
                if pending_n >= FLUSH_POSTINGS {
                    flush_postings(&pdb, &path, &mut pending, &mut flush_no)?;
                    db.apply_batch(std::mem::take(&mut batch)).map_err(|e| db_err(&path, e))?;
                    pending_n = 0;
                }
            }
            checkpoints.push(ordinal);
            let last_frame = seg.format.frame_of(last_offset).0;
            fingerprints.push(FileFingerprint::take(&seg.path, seg.data_start, last_frame)?);
        }
        flush_postings(&pdb, &path, &mut pending, &mut flush_no)?;
        pdb.flush().map_err(|e| db_err(&path, e))?;
        db.apply_batch(batch).map_err(|e| db_err(&path, e))?;
        let meta = IndexMeta {
            format: INDEX_FORMAT,
            fold: F::NAME.to_string(),
            workers: layout.workers(),
            segments: layout.segments.clone(),
            fingerprints,
            monotone,
            records,
            checkpoints,
            checkpoint_every,
        };
        let json = serde_json::to_vec(&meta).map_err(|e| db_err(&path, e))?;
        db.insert(KEY_META, json).map_err(|e| db_err(&path, e))?;
        db.flush().map_err(|e| db_err(&path, e))?;
        // Written last: an index without it is an interrupted build.
        db.insert(KEY_COMPLETE, &b"1"[..]).map_err(|e| db_err(&path, e))?;
        db.flush().map_err(|e| db_err(&path, e))?;
        progress(records);
        Ok(RunIndex { db, postings: std::sync::OnceLock::from(Ok(pdb)), path, meta })
    }

    /// The postings database, opened on first use. A postings database that will not open is
    /// an error asking for a rebuild (callers such as `show` rebuild and retry).
    fn postings_db(&self) -> Result<&sled::Db, IndexError> {
        let p = self.path.join("postings");
        let opened =
            self.postings.get_or_init(|| match std::panic::catch_unwind(|| sled_config(&p).open()) {
                Ok(Ok(db)) => Ok(db),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("the database is damaged".into()),
            });
        match opened {
            Ok(db) => Ok(db),
            Err(e) if e.contains("could not acquire lock") => {
                Err(IndexError::Busy { path: self.path.clone() })
            }
            Err(e) => Err(db_err(&self.path, format!("postings database unusable ({e}); rebuild the index"))),
        }
    }

    pub fn meta(&self) -> &IndexMeta {
        &self.meta
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn postings(&self, pid: PostingId) -> Result<Vec<Posting>, IndexError> {
        let prefix = bucket_prefix(bucket_of(&pid));
        let mut out = Vec::new();
        for kv in self.postings_db()?.scan_prefix(prefix) {
            let (k, v) = kv.map_err(|e| db_err(&self.path, e))?;
            if k.len() != prefix.len() + 4 || postings_in_bucket(&v, &pid, &mut out).is_none() {
                return Err(db_err(&self.path, "malformed posting list"));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Where every record about `handoff` is (by file and offset; [`RunIndex::read_postings`]
    /// puts them in merge order).
    pub fn offsets_for_handoff(&self, handoff: HandoffId) -> Result<Vec<Posting>, IndexError> {
        self.postings(handoff_pid(handoff))
    }

    /// Where every record naming `request` ([`Fact::request`]) is.
    pub fn offsets_for_request(&self, request: RequestId) -> Result<Vec<Posting>, IndexError> {
        self.postings(request_pid(request))
    }

    /// Reads the records the postings point at, in the run's merge order: a merged file's own
    /// order, or for a directory `(at_ns, stream, seq)` — exact when every stream is
    /// time-ordered ([`IndexMeta::all_monotone`]). Returns each record's stream index.
    pub fn read_postings(&self, postings: &[Posting]) -> Result<Vec<(usize, Record)>, IndexError> {
        let mut out = Vec::with_capacity(postings.len());
        let mut by_segment: BTreeMap<u16, Vec<u64>> = BTreeMap::new();
        for p in postings {
            by_segment.entry(p.segment).or_default().push(p.offset);
        }
        for (segment, mut offsets) in by_segment {
            let Some(seg) = self.meta.segments.get(segment as usize) else {
                return Err(db_err(&self.path, "posting names an unknown segment"));
            };
            offsets.sort_unstable();
            offsets.dedup();
            for (stream, rec) in read_records_at(seg, &offsets)? {
                out.push((segment, stream, rec));
            }
        }
        if self.meta.segments.len() > 1 {
            out.sort_by_key(|(_, stream, rec)| (rec.at_ns, *stream, rec.seq));
        }
        Ok(out.into_iter().map(|(_, s, r)| (s, r)).collect())
    }

    /// The latest checkpoint of `segment` whose records all happened at or before `t_ns`.
    pub fn checkpoint_before<F: CheckpointFold>(
        &self,
        segment: usize,
        t_ns: u64,
    ) -> Result<Option<Checkpoint<F>>, IndexError> {
        let seg16 = segment as u16;
        let lo = checkpoint_key(seg16, 0, 0);
        let hi = checkpoint_key(seg16, t_ns, u64::MAX);
        let Some(kv) = self.db.range(lo..=hi).next_back() else {
            return Ok(None);
        };
        let (_, v) = kv.map_err(|e| db_err(&self.path, e))?;
        let cp: Checkpoint<F> =
            codec::decode_exact(&v).map_err(|e| db_err(&self.path, format!("checkpoint: {e}")))?;
        if cp.segment != segment {
            return Err(db_err(&self.path, "checkpoint of another segment"));
        }
        Ok(Some(cp))
    }

    /// The time mark of `worker`'s stream at or before `t_ns`: (segment, offset, seq).
    pub fn time_mark_before(
        &self,
        stream: usize,
        t_ns: u64,
    ) -> Result<Option<(usize, u64, u64)>, IndexError> {
        let mut lo = vec![b't'];
        lo.extend_from_slice(&(stream as u16).to_be_bytes());
        let mut hi = lo.clone();
        lo.extend_from_slice(&[0u8; 16]);
        hi.extend_from_slice(&t_ns.to_be_bytes());
        hi.extend_from_slice(&u64::MAX.to_be_bytes());
        let Some(kv) = self.db.range(lo..=hi).next_back() else {
            return Ok(None);
        };
        let (k, v) = kv.map_err(|e| db_err(&self.path, e))?;
        if k.len() != 19 || v.len() != 10 {
            return Err(db_err(&self.path, "malformed time mark"));
        }
        Ok(Some((
            u16::from_be_bytes([v[0], v[1]]) as usize,
            u64::from_be_bytes(fixed8(&v[2..10])),
            u64::from_be_bytes(fixed8(&k[11..19])),
        )))
    }
}
