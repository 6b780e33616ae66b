//! Streaming trace readers: Mooncake JSONL and the Azure 2023 CSV.
//!
//! A reader holds one line buffer and a few scalars, so its memory is flat in the trace's
//! length: a replay can pull requests as its virtual clock reaches them.
//!
//! ## Formats
//! * **Mooncake JSONL**, one request a line, with the reference's names and aliases:
//!   `timestamp` or `created_time` (ms), `input_length` or `input_tokens`, `output_length` or
//!   `output_tokens`, optional `hash_ids` (one content id per 512-token trace block), optional
//!   `session_id` (string or integer) and `delay` (ms). Unknown fields are ignored, so traces
//!   that carry extra columns (e.g. text) still load.
//! * **Azure 2023 CSV** with a header naming `TIMESTAMP`, `ContextTokens` and `GeneratedTokens`
//!   (any order, any case, extra columns ignored). `TIMESTAMP` is a datetime such as
//!   `2023-11-16 18:15:46.6805900`. These traces carry no content ids, so every prompt is unique
//!   ([`Request::unique`]).
//!
//! ## Semantics (decided here, relied on by the replay)
//! * Arrival times are relative to the trace's first request (so `created_time` given as epoch
//!   milliseconds works), then divided by the arrival speedup ratio.
//! * Timestamps must be non-decreasing in file order. A reader that streams cannot sort, and a
//!   replay that pulls the next request when its clock reaches the previous arrival needs this;
//!   an earlier timestamp is an error naming the line (sort the file, e.g. `sort -n`-style by
//!   timestamp, to fix it). The public Mooncake traces are sorted.
//! * `input_length` must be > 0 and `output_length` > 0 (a request with nothing to prefill or
//!   nothing to generate has no meaning for the engines modeled). Negative or fractional lengths
//!   are errors.
//! * When `hash_ids` is present its length must equal `ceil(input_length / 512)`; anything else
//!   is an error, because the engines derive block hashes from it and a short list would silently
//!   invent content. The public trace satisfies it on every line.
//! * **Sessions.** `session_id` and `delay` are read and carried on [`TraceRequest`], but the
//!   reader treats every line's timestamp as its arrival (open loop), so a timestamp is required
//!   on every line, session turns included. The reference's closed-loop rule — a session's next
//!   turn arrives `delay` ms after its previous turn *completes* — needs completion feedback from
//!   the replay and is not applied here: [`crate::adapters::replay::workload`] applies it.
//! * Blank lines (whitespace only) are skipped but still counted, so line numbers match an
//!   editor's. CRLF line ends and a leading UTF-8 byte-order mark are accepted. A line longer
//!   than [`MAX_LINE_BYTES`] is an error.
//! * The first error ends the stream: the iterator yields it and then `None`.

use crate::ids::RequestId;
use crate::schedulers::request::{Request, TRACE_BLOCK_SIZE};
use serde::Deserialize;
use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The latest arrival (and the longest session delay) a trace may ask for, in ms after its
/// first request: 10^12 ms, so that any instant plus any configured timeout stays well inside
/// the u64 nanosecond clock (1.8 × 10^19 ns).
pub const MAX_TRACE_MS: f64 = 1e12;

/// A bad trace, named by file and 1-based line. `line` 0 means the file as a whole (it could
/// not be opened, or its format could not be told); Display then reads `FILE: reason`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct TraceError {
    pub path: PathBuf,
    pub line: usize,
    pub reason: String,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.path.display(), self.reason)
        } else {
            write!(f, "{}:{}: {}", self.path.display(), self.line, self.reason)
        }
    }
}

/// Which trace format a file is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TraceFormat {
    /// Mooncake JSONL (`.jsonl`, `.json`, or a first line starting with `{`).
    Mooncake,
    /// Azure 2023 CSV (`.csv`, or a first line naming `TIMESTAMP`).
    AzureCsv,
}

impl std::str::FromStr for TraceFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "mooncake" | "jsonl" => Ok(TraceFormat::Mooncake),
            "azure" | "azure-csv" | "csv" => Ok(TraceFormat::AzureCsv),
            other => Err(format!("unknown trace format `{other}` (expected mooncake or azure-csv)")),
        }
    }
}

/// How to read a trace.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TraceOptions {
    /// `None`: detect from the extension, then from the first non-blank line.
    pub format: Option<TraceFormat>,
    /// Arrival speedup ratio: timestamps are divided by it. Must be finite and > 0.
    pub speedup: f64,
}

impl Default for TraceOptions {
    fn default() -> Self {
        TraceOptions { format: None, speedup: 1.0 }
    }
}

/// One request as the trace gives it.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRequest {
    /// 0-based index among the trace's requests (blank lines and the CSV header not counted);
    /// it becomes the [`RequestId`].
    pub index: u64,
    /// 1-based line in the file.
    pub line: usize,
    /// Milliseconds after the first request's arrival, after the speedup ratio.
    pub arrival_ms: f64,
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// One content id per 512-token trace block, when the trace has them.
    pub hash_ids: Option<Vec<u64>>,
    pub session_id: Option<String>,
    /// The session's think time before this turn, in ms (after the speedup ratio). Carried, not
    /// applied: see the module docs.
    pub delay_ms: Option<f64>,
}

impl TraceRequest {
    /// Arrival in nanoseconds on the virtual clock (rounded to the nearest ns).
    pub fn arrival_ns(&self) -> u64 {
        // arrival_ms is finite and >= 0 by construction; `as` saturates on overflow.
        (self.arrival_ms * 1e6).round() as u64
    }

    /// The engine-facing request: id = trace index, hash ids become trace blocks, a trace
    /// without hash ids gives a unique prompt.
    pub fn to_request(&self) -> Request {
        let id = RequestId(self.index);
        match &self.hash_ids {
            Some(ids) => Request {
                id,
                input_tokens: self.input_tokens,
                output_tokens: self.output_tokens,
                trace_blocks: Arc::from(ids.as_slice()),
                trace_block_size: TRACE_BLOCK_SIZE,
                arrival_ns: self.arrival_ns(),
                hash_cache: Default::default(),
            },
            None => Request::unique(id, self.input_tokens, self.output_tokens, self.arrival_ns()),
        }
    }
}

/// The longest line a trace may have. The longest line of the public conversation trace is about
/// 2 KB (247 hash ids); 16 MiB leaves room for traces that carry prompt text, while bounding what
/// one line can make the reader hold.
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// Streams [`TraceRequest`]s from any buffered reader.
pub struct TraceReader<R> {
    input: R,
    path: PathBuf,
    format: TraceFormat,
    speedup: f64,
    buf: String,
    line: usize,
    index: u64,
    /// Raw (pre-speedup) timestamp of the first request, in ms.
    origin_ms: Option<f64>,
    /// Raw timestamp of the previous request, in ms, for the monotonicity check.
    last_raw_ms: f64,
    /// Azure: column positions of TIMESTAMP, ContextTokens, GeneratedTokens once the header is read.
    csv_columns: Option<[usize; 3]>,
    /// Azure: the first row's datetime in ns since the epoch.
    csv_origin_ns: Option<i64>,
    /// Set after the first error or end of input.
    done: bool,
}

impl TraceReader<BufReader<File>> {
    /// Opens a trace file. The format is `options.format`, or detected from the extension, or
    /// from the first non-blank line.
    pub fn open(path: impl AsRef<Path>, options: TraceOptions) -> Result<Self, TraceError> {
        let path = path.as_ref();
        let whole = |reason: String| TraceError { path: path.to_path_buf(), line: 0, reason };
        let file = File::open(path).map_err(|e| whole(format!("cannot open: {e}")))?;
        let mut input = BufReader::with_capacity(64 * 1024, file);
        let format = match options.format {
            Some(f) => f,
            None => match format_from_extension(path) {
                Some(f) => f,
                None => sniff_format(&mut input).map_err(whole)?,
            },
        };
        TraceReader::new(input, path, TraceOptions { format: Some(format), ..options })
    }
}

impl<R: BufRead> TraceReader<R> {
    /// Reads from `input`; `path` is used in error messages only. `options.format` must be
    /// given (there is no extension to look at); with `None`, the first line is sniffed.
    pub fn new(mut input: R, path: impl AsRef<Path>, options: TraceOptions) -> Result<Self, TraceError> {
        let path = path.as_ref().to_path_buf();
        let whole = |reason: String| TraceError { path: path.clone(), line: 0, reason };
        if !(options.speedup.is_finite() && options.speedup > 0.0) {
            return Err(whole(format!(
                "arrival speedup ratio must be a finite number > 0, got {}",
                options.speedup
            )));
        }
        let format = match options.format {
            Some(f) => f,
            None => sniff_format(&mut input).map_err(whole)?,
        };
        Ok(TraceReader {
            input,
            path,
            format,
            speedup: options.speedup,
            buf: String::with_capacity(4096),
            line: 0,
            index: 0,
            origin_ms: None,
            last_raw_ms: f64::NEG_INFINITY,
            csv_columns: None,
            csv_origin_ns: None,
            done: false,
        })
    }

    pub fn format(&self) -> TraceFormat {
        self.format
    }

    /// Lines read so far, blank ones and a CSV header included (at the end: the file's lines).
    pub fn lines_read(&self) -> usize {
        self.line
    }

    /// The path error messages name (so code that builds on the reader can name it too).
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn error(&mut self, reason: String) -> TraceError {
        self.done = true;
        TraceError { path: self.path.clone(), line: self.line, reason }
    }

    /// The next request, `Ok(None)` at the end of the trace.
    pub fn next_request(&mut self) -> Result<Option<TraceRequest>, TraceError> {
        loop {
            if self.done {
                return Ok(None);
            }
            self.buf.clear();
            // Bounded read: a file with no newlines must not be pulled into memory whole.
            let n = match (&mut self.input).take(MAX_LINE_BYTES as u64 + 1).read_line(&mut self.buf) {
                Ok(n) => n,
                Err(e) => {
                    self.line += 1;
                    return Err(self.error(format!("read error: {e}")));
                }
            };
            if n == 0 {
                self.done = true;
                if self.format == TraceFormat::AzureCsv && self.csv_columns.is_none() {
                    return Err(
                        self.error("missing CSV header (TIMESTAMP,ContextTokens,GeneratedTokens)".into())
                    );
                }
                return Ok(None);
            }
            self.line += 1;
            if self.buf.len() > MAX_LINE_BYTES {
                return Err(self.error(format!("line is longer than {MAX_LINE_BYTES} bytes")));
            }
            // A byte-order mark (files saved by some Windows tools) is not part of the content.
            if self.line == 1 && self.buf.starts_with('\u{feff}') {
                self.buf.drain(..'\u{feff}'.len_utf8());
            }
            if self.buf.trim().is_empty() {
                continue;
            }
            let parsed = match self.format {
                TraceFormat::Mooncake => parse_mooncake(self.buf.trim()),
                TraceFormat::AzureCsv => {
                    if self.csv_columns.is_none() {
                        match parse_csv_header(self.buf.trim()) {
                            Ok(cols) => {
                                self.csv_columns = Some(cols);
                                continue;
                            }
                            Err(reason) => return Err(self.error(reason)),
                        }
                    }
                    // Set just above when absent.
                    let cols = self.csv_columns.unwrap_or([0, 1, 2]);
                    parse_azure_row(self.buf.trim(), cols).map(|(epoch_ns, input_tokens, output_tokens)| {
                        let origin = *self.csv_origin_ns.get_or_insert(epoch_ns);
                        RawRequest {
                            // Relative to the first row already; `finish` takes it as the origin.
                            timestamp_ms: epoch_ns.saturating_sub(origin) as f64 / 1e6,
                            input_tokens,
                            output_tokens,
                            hash_ids: None,
                            session_id: None,
                            delay_ms: None,
                        }
                    })
                }
            };
            let raw = match parsed {
                Ok(raw) => raw,
                Err(reason) => return Err(self.error(reason)),
            };
            return self.finish(raw).map(Some);
        }
    }

    /// Shared validation and arrival computation.
    fn finish(&mut self, raw: RawRequest) -> Result<TraceRequest, TraceError> {
        if raw.input_tokens == 0 {
            return Err(self.error("input length must be > 0".into()));
        }
        if raw.output_tokens == 0 {
            return Err(self.error("output length must be > 0".into()));
        }
        if let Some(ids) = &raw.hash_ids {
            let need = raw.input_tokens.div_ceil(TRACE_BLOCK_SIZE) as usize;
            if ids.len() != need {
                return Err(self.error(format!(
                    "hash_ids has {} ids but input length {} needs ceil({}/{}) = {}",
                    ids.len(),
                    raw.input_tokens,
                    raw.input_tokens,
                    TRACE_BLOCK_SIZE,
                    need
                )));
            }
        }
        if raw.timestamp_ms < self.last_raw_ms {
            return Err(self.error(format!(
                "timestamp {} ms is earlier than the previous request's {} ms; \
                 the trace must be sorted by timestamp",
                raw.timestamp_ms, self.last_raw_ms
            )));
        }
        self.last_raw_ms = raw.timestamp_ms;
        let origin = *self.origin_ms.get_or_insert(raw.timestamp_ms);
        let arrival_ms = (raw.timestamp_ms - origin) / self.speedup;
        if arrival_ms.is_nan() || arrival_ms > MAX_TRACE_MS {
            // Past this the nanosecond clock would saturate: requests would look as if their
            // leases expired the instant they were pinned, silently.
            return Err(self.error(format!(
                "timestamp {} ms is {arrival_ms:.0} ms after the first request (after the speedup ratio {}), past the replay clock's range of {MAX_TRACE_MS:.0} ms (about 31 years)",
                raw.timestamp_ms, self.speedup
            )));
        }
        let delay_ms = raw.delay_ms.map(|d| d / self.speedup);
        if let Some(d) = delay_ms.filter(|d| d.is_nan() || *d > MAX_TRACE_MS) {
            return Err(self.error(format!(
                "delay {d:.0} ms (after the speedup ratio {}) is past the replay clock's range of {MAX_TRACE_MS:.0} ms",
                self.speedup
            )));
        }
        let index = self.index;
        self.index += 1;
        Ok(TraceRequest {
            index,
            line: self.line,
            arrival_ms,
            input_tokens: raw.input_tokens,
            output_tokens: raw.output_tokens,
            hash_ids: raw.hash_ids,
            session_id: raw.session_id,
            delay_ms,
        })
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<TraceRequest, TraceError>;
    fn next(&mut self) -> Option<Self::Item> {
        self.next_request().transpose()
    }
}

fn format_from_extension(path: &Path) -> Option<TraceFormat> {
    match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
        "jsonl" | "json" => Some(TraceFormat::Mooncake),
        "csv" => Some(TraceFormat::AzureCsv),
        _ => None,
    }
}

/// Looks at the first non-blank bytes without consuming them.
fn sniff_format<R: BufRead>(input: &mut R) -> Result<TraceFormat, String> {
    let head = input.fill_buf().map_err(|e| format!("read error: {e}"))?;
    let text = String::from_utf8_lossy(head);
    let first = text.trim_start_matches('\u{feff}').lines().map(str::trim).find(|l| !l.is_empty());
    match first {
        Some(l) if l.starts_with('{') => Ok(TraceFormat::Mooncake),
        Some(l) if l.to_ascii_uppercase().contains("TIMESTAMP") => Ok(TraceFormat::AzureCsv),
        Some(_) => Err("cannot tell the trace format: expected Mooncake JSONL (lines starting \
                        with `{`) or an Azure CSV header naming TIMESTAMP; name the format explicitly"
            .into()),
        None => Err("cannot tell the trace format of an empty file".into()),
    }
}

/// A parsed line before shared validation.
struct RawRequest {
    timestamp_ms: f64,
    input_tokens: u32,
    output_tokens: u32,
    hash_ids: Option<Vec<u64>>,
    session_id: Option<String>,
    delay_ms: Option<f64>,
}

#[derive(Deserialize)]
struct MooncakeLine {
    #[serde(alias = "created_time")]
    timestamp: Option<serde_json::Number>,
    #[serde(alias = "input_tokens")]
    input_length: Option<serde_json::Number>,
    #[serde(alias = "output_tokens")]
    output_length: Option<serde_json::Number>,
    hash_ids: Option<Vec<u64>>,
    session_id: Option<SessionId>,
    delay: Option<serde_json::Number>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SessionId {
    Text(String),
    Number(serde_json::Number),
}

fn parse_mooncake(line: &str) -> Result<RawRequest, String> {
    if !line.starts_with('{') {
        return Err("bad JSON: expected one JSON object per line".into());
    }
    let l: MooncakeLine = serde_json::from_str(line).map_err(json_reason)?;
    let timestamp_ms = match &l.timestamp {
        Some(n) => non_negative_ms("timestamp", n)?,
        None => return Err("missing field `timestamp` (or `created_time`)".into()),
    };
    let input_tokens = match &l.input_length {
        Some(n) => token_count("input_length", n)?,
        None => return Err("missing field `input_length` (or `input_tokens`)".into()),
    };
    let output_tokens = match &l.output_length {
        Some(n) => token_count("output_length", n)?,
        None => return Err("missing field `output_length` (or `output_tokens`)".into()),
    };
    let delay_ms = match &l.delay {
        Some(n) => Some(non_negative_ms("delay", n)?),
        None => None,
    };
    let session_id = l.session_id.map(|s| match s {
        SessionId::Text(t) => t,
        SessionId::Number(n) => n.to_string(),
    });
    Ok(RawRequest { timestamp_ms, input_tokens, output_tokens, hash_ids: l.hash_ids, session_id, delay_ms })
}

/// serde_json says "at line 1 column C" about the single line it saw, which reads as if it
/// contradicted our file line number: keep only the column.
fn json_reason(e: serde_json::Error) -> String {
    let text = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    match text.strip_suffix(&suffix) {
        Some(msg) => format!("bad JSON: {msg} (column {})", e.column()),
        None => format!("bad JSON: {text}"),
    }
}

fn non_negative_ms(field: &str, n: &serde_json::Number) -> Result<f64, String> {
    match n.as_f64() {
        Some(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("{field} must be a number of ms >= 0, got {n}")),
    }
}

fn token_count(field: &str, n: &serde_json::Number) -> Result<u32, String> {
    match n.as_u64() {
        Some(v) => u32::try_from(v).map_err(|_| format!("{field} {v} is too large (max {})", u32::MAX)),
        None => Err(format!("{field} must be a non-negative integer, got {n}")),
    }
}

const AZURE_COLUMNS: [&str; 3] = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"];

fn parse_csv_header(line: &str) -> Result<[usize; 3], String> {
    let names: Vec<&str> = line.split(',').map(|c| c.trim().trim_matches('"')).collect();
    let mut cols = [0usize; 3];
    for (slot, want) in cols.iter_mut().zip(AZURE_COLUMNS) {
        *slot = names.iter().position(|n| n.eq_ignore_ascii_case(want)).ok_or_else(|| {
            format!("CSV header lacks column `{want}` (expected TIMESTAMP,ContextTokens,GeneratedTokens)")
        })?;
    }
    Ok(cols)
}

/// (epoch ns, context tokens, generated tokens)
fn parse_azure_row(line: &str, cols: [usize; 3]) -> Result<(i64, u32, u32), String> {
    let fields: Vec<&str> = line.split(',').map(|c| c.trim().trim_matches('"')).collect();
    let get = |i: usize, name: &str| {
        fields
            .get(cols[i])
            .copied()
            .ok_or_else(|| format!("row has {} columns, missing `{name}`", fields.len()))
    };
    let ts = get(0, "TIMESTAMP")?;
    let when = chrono::NaiveDateTime::parse_from_str(ts, "%Y-%m-%d %H:%M:%S%.f")
        .map_err(|e| format!("TIMESTAMP `{ts}` is not a datetime like 2023-11-16 18:15:46.6805900: {e}"))?;
    // Nanoseconds since the epoch fit i64 until 2262 (the reader subtracts the first row's in
    // integers before going to f64, so sub-microsecond offsets survive).
    let epoch_ns = when
        .and_utc()
        .timestamp_nanos_opt()
        .ok_or_else(|| format!("TIMESTAMP `{ts}` is out of range (years 1677..2262)"))?;
    let count = |i: usize, name: &str| -> Result<u32, String> {
        let s = get(i, name)?;
        s.parse::<u32>().map_err(|_| format!("{name} must be a non-negative integer, got `{s}`"))
    };
    let input_tokens = count(1, "ContextTokens")?;
    let output_tokens = count(2, "GeneratedTokens")?;
    Ok((epoch_ns, input_tokens, output_tokens))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn read(text: &str, format: TraceFormat, speedup: f64) -> Vec<Result<TraceRequest, TraceError>> {
        let r = TraceReader::new(
            Cursor::new(text.as_bytes()),
            "t",
            TraceOptions { format: Some(format), speedup },
        )
        .expect("options valid");
        r.collect()
    }

    #[test]
    fn error_display_names_file_and_line() {
        let e = TraceError { path: "a/b.jsonl".into(), line: 7, reason: "bad".into() };
        assert_eq!(e.to_string(), "a/b.jsonl:7: bad");
        let e = TraceError { path: "a/b.jsonl".into(), line: 0, reason: "bad".into() };
        assert_eq!(e.to_string(), "a/b.jsonl: bad");
    }

    #[test]
    fn first_error_ends_the_stream() {
        let out = read(
            "{\"timestamp\":0}\n{\"timestamp\":1,\"input_length\":1,\"output_length\":1}\n",
            TraceFormat::Mooncake,
            1.0,
        );
        assert_eq!(out.len(), 1);
        assert!(out[0].is_err());
    }

    #[test]
    fn sniffing_tells_the_formats_apart() {
        let mut j = Cursor::new(&b"\n  {\"timestamp\":0}"[..]);
        assert_eq!(sniff_format(&mut j), Ok(TraceFormat::Mooncake));
        let mut c = Cursor::new(&b"TIMESTAMP,ContextTokens,GeneratedTokens\n"[..]);
        assert_eq!(sniff_format(&mut c), Ok(TraceFormat::AzureCsv));
        let mut x = Cursor::new(&b"hello"[..]);
        assert!(sniff_format(&mut x).is_err());
    }
}
