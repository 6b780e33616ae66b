//! What a replay was run on, and the run id derived from it.
//!
//! * **Config digest**: FNV-1a (64-bit) of the canonical JSON of the effective configuration
//!   (flags applied, the policy resolved to the one in force, keys sorted) with the seed left
//!   out, printed as 16 hex digits. Runs that differ only in their seed share it. So do runs
//!   that differ only in `coalesce_quiet_steps`, which changes how the loop runs, not a byte
//!   of what it writes.
//! * **Trace fingerprint**: FNV-1a of the trace file's first [`TRACE_PREFIX_BYTES`] bytes and its
//!   length in bytes. Only the prefix is hashed so that a trace of any size is not read twice
//!   (the replay must write its stream headers, run id included, before it reads the trace): two
//!   traces of the same length that differ only after the first MiB get the same run id. The
//!   path is not part of it, so a copy of a trace is the same trace.
//! * **Run id**: a version-8 UUID from the trace fingerprint, the config digest and the seed,
//!   mixed with the same fixed mixer the replay uses for everything else: identical inputs give
//!   the same run id, and a different trace, config or seed a different one.

use crate::adapters::replay::config::ReplayConfig;
use crate::projections::compare::RunDescription;
use crate::schedulers::request::mix;
use std::io::Read;
use std::path::Path;

/// How much of the trace the fingerprint hashes.
pub const TRACE_PREFIX_BYTES: usize = 1 << 20;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a over `bytes`, continuing from `state` (start from `FNV_OFFSET`). Chosen for being
/// tiny, byte-order free and defined by its spec, so digests are stable across builds.
fn fnv1a(mut state: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        state ^= *b as u64;
        state = state.wrapping_mul(FNV_PRIME);
    }
    state
}

/// The trace a replay reads, as far as the run id and the report need it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceIdentity {
    /// The path as given (shown in reports; not part of the run id).
    pub path: String,
    pub bytes: u64,
    /// FNV-1a of the first [`TRACE_PREFIX_BYTES`] bytes.
    pub prefix_hash: u64,
    /// Lines in the file, when it fits in the hashed prefix (blank lines counted, as the trace
    /// reader counts them); `None` for a larger file, whose lines are only counted as it is read.
    pub lines: Option<u64>,
}

impl TraceIdentity {
    /// Fingerprints a trace from its first [`TRACE_PREFIX_BYTES`]; `file_bytes` is its length
    /// when known (a regular file), `None` for a pipe, whose length is then what was read if
    /// it ended within the prefix, else unknown and taken as 0. Returns the prefix read too, so
    /// the caller can hand it to the trace reader (chained before the rest of `input`) instead
    /// of reading it again; `input` is left just after the prefix.
    pub fn read<R: Read>(
        path: &Path,
        input: &mut R,
        file_bytes: Option<u64>,
    ) -> std::io::Result<(Self, Vec<u8>)> {
        let mut prefix = Vec::with_capacity(TRACE_PREFIX_BYTES.min(file_bytes.unwrap_or(0) as usize));
        input.by_ref().take(TRACE_PREFIX_BYTES as u64).read_to_end(&mut prefix)?;
        let whole = prefix.len() < TRACE_PREFIX_BYTES || file_bytes == Some(prefix.len() as u64);
        let lines = whole.then(|| {
            let newlines = prefix.iter().filter(|b| **b == b'\n').count() as u64;
            // A last line without a newline is still a line.
            newlines + u64::from(prefix.last().is_some_and(|b| *b != b'\n'))
        });
        let bytes = file_bytes.unwrap_or(if whole { prefix.len() as u64 } else { 0 });
        let identity = TraceIdentity {
            path: path.display().to_string(),
            bytes,
            prefix_hash: fnv1a(FNV_OFFSET, &prefix),
            lines,
        };
        Ok((identity, prefix))
    }
}

/// The digest of the effective configuration (see the module docs).
pub fn config_digest(cfg: &ReplayConfig) -> u64 {
    let mut canonical = cfg.clone();
    canonical.seed = 0;
    canonical.policy = Some(cfg.effective_policy());
    // A parity switch: logs are byte-for-byte the same either way, run id included.
    canonical.coalesce_quiet_steps = true;
    // serde_json's map is sorted by key (no `preserve_order`), so this text is canonical.
    let text = serde_json::to_value(&canonical).map(|v| v.to_string()).unwrap_or_default();
    fnv1a(FNV_OFFSET, text.as_bytes())
}

/// The run id of a replay of `trace` (or of an in-memory trace, `None`) with `cfg`.
pub fn run_id(trace: Option<&TraceIdentity>, cfg: &ReplayConfig) -> uuid::Uuid {
    let (prefix_hash, bytes) = trace.map_or((0, 0), |t| (t.prefix_hash, t.bytes));
    let hi = mix(mix(mix(prefix_hash, bytes), config_digest(cfg)), cfg.seed);
    let lo = mix(hi, cfg.seed ^ 0x7275_6e5f_6964_5f31);
    let raw = ((hi as u128) << 64 | lo as u128).to_be_bytes();
    uuid::Builder::from_custom_bytes(raw).into_uuid()
}

/// What the router stream's header records about the run (its `config_json`).
pub fn describe(trace: Option<&TraceIdentity>, cfg: &ReplayConfig) -> RunDescription {
    RunDescription {
        trace: trace.map(|t| t.path.clone()),
        trace_bytes: trace.map(|t| t.bytes),
        trace_lines: trace.and_then(|t| t.lines),
        shape: Some(shape(cfg)),
        prefill_router: Some(cfg.prefill_router.clone()),
        decode_router: cfg.is_disaggregated().then(|| cfg.decode_router.clone()),
        config_digest: Some(format!("{:016x}", config_digest(cfg))),
    }
}

/// `2P+2D` for a disaggregated cluster, `4 aggregated` otherwise.
pub fn shape(cfg: &ReplayConfig) -> String {
    if cfg.is_disaggregated() {
        format!("{}P+{}D", cfg.prefill_workers, cfg.decode_workers)
    } else {
        format!("{} aggregated", cfg.workers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    #[test]
    fn fnv1a_matches_the_published_test_vectors() {
        assert_eq!(fnv1a(FNV_OFFSET, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(FNV_OFFSET, b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn a_small_trace_is_counted_and_the_prefix_handed_back() {
        let mut f = Cursor::new(b"{\"a\":1}\n\n{\"a\":2}".to_vec());
        let (t, prefix) = TraceIdentity::read(Path::new("t.jsonl"), &mut f, None).unwrap();
        assert_eq!((t.bytes, t.lines), (16, Some(3)));
        assert_eq!(prefix.len(), 16);
        let mut big = Cursor::new(vec![b'\n'; TRACE_PREFIX_BYTES + 10]);
        let (t, prefix) =
            TraceIdentity::read(Path::new("big"), &mut big, Some(TRACE_PREFIX_BYTES as u64 + 10)).unwrap();
        assert_eq!(
            (t.bytes, t.lines, prefix.len()),
            (TRACE_PREFIX_BYTES as u64 + 10, None, TRACE_PREFIX_BYTES)
        );
        assert_eq!(big.position(), TRACE_PREFIX_BYTES as u64);
    }

    #[test]
    fn the_run_id_follows_trace_config_and_seed() {
        let cfg = ReplayConfig::default();
        let t = |text: &[u8]| {
            TraceIdentity::read(Path::new("x"), &mut Cursor::new(text.to_vec()), None).unwrap().0
        };
        let a = run_id(Some(&t(b"one\n")), &cfg);
        assert_eq!(a, run_id(Some(&t(b"one\n")), &cfg));
        assert_ne!(a, run_id(Some(&t(b"two\n")), &cfg));
        let seeded = ReplayConfig { seed: 1, ..cfg.clone() };
        assert_ne!(a, run_id(Some(&t(b"one\n")), &seeded));
        assert_eq!(config_digest(&cfg), config_digest(&seeded), "the seed is not part of the digest");
        let stepwise = ReplayConfig { coalesce_quiet_steps: false, ..cfg.clone() };
        assert_eq!(config_digest(&cfg), config_digest(&stepwise), "nor is a switch that changes no byte");
        let bigger = ReplayConfig { workers: 2, ..cfg.clone() };
        assert_ne!(config_digest(&cfg), config_digest(&bigger));
        assert_ne!(a, run_id(Some(&t(b"one\n")), &bigger));
        assert_eq!(a.get_version_num(), 8);
    }
}
