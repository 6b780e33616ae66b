//! Framing shared by per-worker streams and merged runs: the prelude (magic, version, codec id),
//! length-and-checksum header blocks, and length-and-checksum record frames, with the torn-tail
//! rule applied in exactly one place.

use super::codec;
use super::error::LogError;
use super::layout::{FRAME_PREFIX_BYTES, MAX_HEADER_BYTES, MAX_RECORD_BYTES, PRELUDE_BYTES};
use super::StreamHeader;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// A record cut off by the end of the file: everything before `offset` is sound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TornTail {
    /// Where the partial record starts; the clean length of the file.
    pub offset: u64,
    /// How many bytes of the partial record are present (what truncation removes).
    pub bytes: u64,
}

/// Reads until `buf` is full or the reader reports end of file; returns the bytes read.
pub(crate) fn read_full<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

fn printable(bytes: &[u8]) -> String {
    bytes.escape_ascii().to_string()
}

/// Reads and checks magic, version (one of `supported`) and codec id. Returns the version,
/// after byte 12.
pub(crate) fn read_prelude<R: Read>(
    r: &mut R,
    path: &Path,
    magic: &[u8; 8],
    supported: &[u16],
) -> Result<u16, LogError> {
    let mut pre = [0u8; PRELUDE_BYTES];
    let n = read_full(r, &mut pre).map_err(|e| LogError::io(path, e))?;
    if n == 0 {
        return Err(LogError::CorruptHeader {
            path: path.into(),
            offset: 0,
            reason: "empty file: no header".into(),
        });
    }
    let have_magic = n.min(8);
    if pre[..have_magic] != magic[..have_magic] {
        return Err(LogError::BadMagic {
            path: path.into(),
            expected: format!("\"{}\"", printable(magic)),
            found: printable(&pre[..have_magic]),
        });
    }
    if n < PRELUDE_BYTES {
        return Err(LogError::CorruptHeader {
            path: path.into(),
            offset: n as u64,
            reason: format!("file ends after {n} bytes, inside the {PRELUDE_BYTES}-byte prelude"),
        });
    }
    let version = u16::from_le_bytes([pre[8], pre[9]]);
    if !supported.contains(&version) {
        return Err(LogError::UnsupportedVersion {
            path: path.into(),
            found: version,
            supported: supported.iter().max().copied().unwrap_or(0),
        });
    }
    let codec_id = u16::from_le_bytes([pre[10], pre[11]]);
    if codec_id != codec::CODEC_ID {
        return Err(LogError::UnknownCodec {
            path: path.into(),
            found: codec_id,
            supported: codec::CODEC_ID,
        });
    }
    Ok(version)
}

/// Appends the prelude to `out`.
pub(crate) fn write_prelude(out: &mut Vec<u8>, magic: &[u8; 8], version: u16) {
    out.extend_from_slice(magic);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&codec::CODEC_ID.to_le_bytes());
}

/// Appends one header block, `len(u32) crc(u32) bytes`, to `out`.
pub(crate) fn write_header_block(
    out: &mut Vec<u8>,
    header: &StreamHeader,
    path: &Path,
) -> Result<(), LogError> {
    let start = out.len();
    out.extend_from_slice(&[0u8; 8]);
    codec::encode_into(header, out).map_err(|reason| LogError::Encode { path: path.into(), reason })?;
    let len = out.len() - start - 8;
    if len > MAX_HEADER_BYTES {
        return Err(LogError::RecordTooLarge { path: path.into(), bytes: len, max: MAX_HEADER_BYTES });
    }
    let crc = crc32fast::hash(&out[start + 8..]);
    out[start..start + 4].copy_from_slice(&(len as u32).to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// Fills in the `len` and `crc` of the record frame in `frame` (prefix placeholder, then the
/// body), refusing a body over [`MAX_RECORD_BYTES`]. `crc` is a fresh hasher (cloning one is
/// cheaper than `crc32fast::hash`, which detects CPU features on every call).
pub(crate) fn seal_record(frame: &mut [u8], mut crc: crc32fast::Hasher, path: &Path) -> Result<(), LogError> {
    let len = frame.len() - FRAME_PREFIX_BYTES;
    if len > MAX_RECORD_BYTES {
        return Err(LogError::RecordTooLarge { path: path.into(), bytes: len, max: MAX_RECORD_BYTES });
    }
    crc.update(&frame[FRAME_PREFIX_BYTES..]);
    let crc = crc.finalize();
    frame[0..4].copy_from_slice(&(len as u32).to_le_bytes());
    frame[4..8].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// Reads one header block starting at byte `offset`; returns the header and the bytes consumed.
pub(crate) fn read_header_block<R: Read>(
    r: &mut R,
    path: &Path,
    offset: u64,
) -> Result<(StreamHeader, u64), LogError> {
    let corrupt = |reason: String| LogError::CorruptHeader { path: path.into(), offset, reason };
    let mut pre = [0u8; 8];
    let n = read_full(r, &mut pre).map_err(|e| LogError::io(path, e))?;
    if n < 8 {
        return Err(corrupt(format!("file ends inside the header's length and checksum ({n} of 8 bytes)")));
    }
    let len = u32::from_le_bytes([pre[0], pre[1], pre[2], pre[3]]) as usize;
    let crc = u32::from_le_bytes([pre[4], pre[5], pre[6], pre[7]]);
    if len > MAX_HEADER_BYTES {
        return Err(corrupt(format!("impossible header length {len} (maximum {MAX_HEADER_BYTES})")));
    }
    let mut bytes = vec![0u8; len];
    let got = read_full(r, &mut bytes).map_err(|e| LogError::io(path, e))?;
    if got < len {
        return Err(corrupt(format!("file ends inside the header ({got} of {len} bytes)")));
    }
    let actual = crc32fast::hash(&bytes);
    if actual != crc {
        return Err(corrupt(format!(
            "header checksum mismatch: stored {crc:#010x}, computed {actual:#010x}"
        )));
    }
    let header: StreamHeader =
        codec::decode_exact(&bytes).map_err(|e| corrupt(format!("undecodable header: {e}")))?;
    Ok((header, 8 + len as u64))
}

/// Reads `len crc body` frames one at a time into a reused buffer, applying the torn-tail rule.
pub(crate) struct FrameReader<R> {
    inner: R,
    path: PathBuf,
    /// Offset of the next frame.
    offset: u64,
    /// The last frame's body (the bytes the checksum covers).
    pub(crate) body: Vec<u8>,
    torn: Option<TornTail>,
    /// Set at end of stream and after any error, so a caller that ignores an error cannot loop.
    ended: bool,
}

impl<R: Read> FrameReader<R> {
    pub(crate) fn new(inner: R, path: PathBuf, offset: u64) -> Self {
        FrameReader { inner, path, offset, body: Vec::new(), torn: None, ended: false }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    pub(crate) fn torn_tail(&self) -> Option<TornTail> {
        self.torn
    }

    /// Stops the reader (after an error found by the caller in a frame's body).
    pub(crate) fn stop(&mut self) {
        self.ended = true;
    }

    pub(crate) fn corrupt(&self, offset: u64, reason: String) -> LogError {
        LogError::Corrupt { path: self.path.clone(), offset, reason }
    }

    /// Reads the next frame whose body must be at least `min_body` bytes. Returns the frame's
    /// start offset (its body is in `self.body`), or `None` at a clean end or a torn tail.
    pub(crate) fn next_frame(&mut self, min_body: usize) -> Result<Option<u64>, LogError> {
        if self.ended {
            return Ok(None);
        }
        let result = self.read_frame(min_body);
        if !matches!(result, Ok(Some(_))) {
            self.ended = true;
        }
        result
    }

    fn read_frame(&mut self, min_body: usize) -> Result<Option<u64>, LogError> {
        let start = self.offset;
        let mut prefix = [0u8; FRAME_PREFIX_BYTES];
        let n = read_full(&mut self.inner, &mut prefix).map_err(|e| LogError::io(&self.path, e))?;
        if n == 0 {
            return Ok(None);
        }
        if n < FRAME_PREFIX_BYTES {
            self.torn = Some(TornTail { offset: start, bytes: n as u64 });
            return Ok(None);
        }
        let len = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
        let crc = u32::from_le_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]);
        if len < min_body || len > MAX_RECORD_BYTES {
            return Err(self.corrupt(
                start,
                format!(
                    "impossible record length {len} (a record holds {min_body} to \
                     {MAX_RECORD_BYTES} bytes after its checksum)"
                ),
            ));
        }
        self.body.clear();
        self.body.resize(len, 0);
        let got = read_full(&mut self.inner, &mut self.body).map_err(|e| LogError::io(&self.path, e))?;
        if got < len {
            // Cut short by the end of the file. That is a torn tail, unless the bytes present
            // already hold a complete record under the stored checksum: then the record was
            // written whole and its length field is what is damaged, and truncating here would
            // throw away sound records behind it.
            if let Some(real) = crc_matches_prefix(&self.body[..got], crc, min_body) {
                return Err(self.corrupt(
                    start,
                    format!(
                        "damaged length field: it says {len} bytes but only {got} remain, and a \
                         record of {real} bytes there matches the stored checksum"
                    ),
                ));
            }
            self.torn = Some(TornTail { offset: start, bytes: (FRAME_PREFIX_BYTES + got) as u64 });
            return Ok(None);
        }
        let actual = crc32fast::hash(&self.body);
        if actual != crc {
            return Err(self
                .corrupt(start, format!("checksum mismatch: stored {crc:#010x}, computed {actual:#010x}")));
        }
        self.offset = start + (FRAME_PREFIX_BYTES + len) as u64;
        Ok(Some(start))
    }
}

/// The shortest length `l >= min_body` such that `crc32(bytes[..l]) == crc`, if any.
/// Incremental, so linear in `bytes` (which is at most one record, bounded by the max size).
fn crc_matches_prefix(bytes: &[u8], crc: u32, min_body: usize) -> Option<usize> {
    if bytes.len() < min_body {
        return None;
    }
    let mut h = crc32fast::Hasher::new();
    h.update(&bytes[..min_body]);
    if h.clone().finalize() == crc {
        return Some(min_body);
    }
    for (i, b) in bytes.iter().enumerate().skip(min_body) {
        h.update(std::slice::from_ref(b));
        if h.clone().finalize() == crc {
            return Some(i + 1);
        }
    }
    None
}
