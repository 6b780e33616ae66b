//! The request model and chained block hashes.
//!
//! Token ids are never materialized. A trace names a prompt by `hash_ids`, one per trace block of
//! `trace_block_size` (512) tokens; the tokens of a trace block are a pure function of its hash
//! id and the position inside it. So an engine block of any size is identified by the pieces of
//! trace blocks it covers, and equal hash-id prefixes give equal engine-block hashes: real prefix
//! reuse without a token vector.

use crate::ids::RequestId;

/// A chained block hash: each block's hash covers its parent's (a sequence hash).
pub type BlockHash = u64;
use std::sync::Arc;

/// The public Mooncake traces' block size.
pub const TRACE_BLOCK_SIZE: u32 = 512;

/// One request, as an engine core receives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub id: RequestId,
    /// Prompt length in tokens.
    pub input_tokens: u32,
    /// Tokens to generate (for a handoff prefill the core itself stops after the first).
    pub output_tokens: u32,
    /// One content id per trace block; `len == ceil(input_tokens / trace_block_size)`.
    pub trace_blocks: Arc<[u64]>,
    pub trace_block_size: u32,
    /// When the frontend received it.
    pub arrival_ns: u64,
    /// The prompt's block hashes once computed, shared by every clone (a handoff's prefill
    /// and decode hash the same prompt).
    pub hash_cache: PromptHashCache,
}

/// Memoized [`Request::prompt_block_hashes`] for one block size. Not part of a request's
/// identity: two requests compare equal whatever their caches hold.
#[derive(Clone, Default)]
pub struct PromptHashCache(Arc<std::sync::OnceLock<(u32, Arc<[BlockHash]>)>>);

impl PartialEq for PromptHashCache {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for PromptHashCache {}

impl std::fmt::Debug for PromptHashCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PromptHashCache")
    }
}

/// A request as it crosses a process boundary (the live protocol): its fields without the
/// hash cache, which the receiver rebuilds on first use.
#[derive(serde::Serialize, serde::Deserialize)]
struct WireRequest {
    id: RequestId,
    input_tokens: u32,
    output_tokens: u32,
    trace_blocks: Vec<u64>,
    trace_block_size: u32,
    arrival_ns: u64,
}

impl serde::Serialize for Request {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        WireRequest {
            id: self.id,
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            trace_blocks: self.trace_blocks.to_vec(),
            trace_block_size: self.trace_block_size,
            arrival_ns: self.arrival_ns,
        }
        .serialize(serializer)
    }
}

impl<'de> serde::Deserialize<'de> for Request {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let w = WireRequest::deserialize(deserializer)?;
        Ok(Request {
            id: w.id,
            input_tokens: w.input_tokens,
            output_tokens: w.output_tokens,
            trace_blocks: w.trace_blocks.into(),
            trace_block_size: w.trace_block_size,
            arrival_ns: w.arrival_ns,
            hash_cache: Default::default(),
        })
    }
}

impl Request {
    /// A request whose prompt is shared with no other (used by traces without hash ids).
    pub fn unique(id: RequestId, input_tokens: u32, output_tokens: u32, arrival_ns: u64) -> Self {
        let n = input_tokens.div_ceil(TRACE_BLOCK_SIZE).max(1) as u64;
        // Content ids in a namespace of their own (high bit set) keyed by the request id.
        let blocks: Vec<u64> = (0..n).map(|i| mix(0x8000_0000_0000_0000 | id.0, i) | (1 << 63)).collect();
        Request {
            id,
            input_tokens,
            output_tokens,
            trace_blocks: blocks.into(),
            trace_block_size: TRACE_BLOCK_SIZE,
            arrival_ns,
            hash_cache: Default::default(),
        }
    }

    /// Hashes of the prompt's *full* engine blocks of `block_size` tokens, chained. Computed
    /// once per request (and block size) and shared by its clones.
    pub fn prompt_block_hashes(&self, block_size: u32) -> Vec<BlockHash> {
        if let Some((bs, hashes)) = self.hash_cache.0.get() {
            if *bs == block_size {
                return hashes.to_vec();
            }
        }
        let hashes = self.compute_block_hashes(block_size);
        // The first block size asked for is kept (a run uses one).
        let _ = self.hash_cache.0.set((block_size, hashes.as_slice().into()));
        hashes
    }

    fn compute_block_hashes(&self, block_size: u32) -> Vec<BlockHash> {
        let full = self.input_tokens / block_size;
        let mut out = Vec::with_capacity(full as usize);
        let mut parent: BlockHash = ROOT_HASH;
        let tbs = self.trace_block_size.max(1);
        if block_size > 0 && tbs % block_size == 0 {
            // Every engine block lies inside one trace block: walk them in order instead of
            // dividing per block (the same keys as `block_content`, which tests check).
            let per_trace_block = tbs / block_size;
            'outer: for &id in self.trace_blocks.iter() {
                let head = mix(BLOCK_KEY_SEED, id);
                for k in 0..per_trace_block {
                    if out.len() as u32 == full {
                        break 'outer;
                    }
                    let offset = (k * block_size) as u64;
                    let h = chain(parent, mix(head, offset << 32 | block_size as u64));
                    out.push(h);
                    parent = h;
                }
            }
            if out.len() as u32 == full {
                return out;
            }
            // Fewer trace blocks than the prompt needs: the general path fills in missing ids.
            out.clear();
            parent = ROOT_HASH;
        }
        for b in 0..full {
            let h = chain(parent, self.block_content(b, block_size));
            out.push(h);
            parent = h;
        }
        out
    }

    /// The content key of engine block `b` (tokens `[b*bs, (b+1)*bs)` of the prompt).
    fn block_content(&self, b: u32, block_size: u32) -> u64 {
        let tbs = self.trace_block_size.max(1) as u64;
        let start = b as u64 * block_size as u64;
        let end = start + block_size as u64;
        let mut key = BLOCK_KEY_SEED;
        let mut pos = start;
        while pos < end {
            let tb = (pos / tbs) as usize;
            let id = self.trace_blocks.get(tb).copied().unwrap_or(u64::MAX);
            let piece_end = ((pos / tbs + 1) * tbs).min(end);
            key = mix(key, id);
            key = mix(key, (pos % tbs) << 32 | (piece_end - pos));
            pos = piece_end;
        }
        key
    }
}

/// Where every engine block's content key starts.
const BLOCK_KEY_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// The parent of a prompt's first block.
pub const ROOT_HASH: BlockHash = 0;

/// A block's hash covers its parent's.
pub fn chain(parent: BlockHash, content: u64) -> BlockHash {
    let h = mix(parent ^ 0xa076_1d64_78bd_642f, content);
    // Zero is reserved for the root.
    if h == ROOT_HASH {
        1
    } else {
        h
    }
}

/// A decode-generated block's hash: content unique to the request and position, chained on the
/// prompt so a prefix-sharing request never matches it by accident.
pub fn decode_block_hash(parent: BlockHash, request: RequestId, block_index: u32) -> BlockHash {
    chain(parent, mix(request.0 ^ 0xd6e8_feb8_6659_fd93, block_index as u64))
}

/// A fixed, platform-independent 64-bit mixer (splitmix64's finalizer over a combined word).
/// Deterministic across builds, which byte-identical replay logs require.
pub fn mix(a: u64, b: u64) -> u64 {
    let mut z = a.rotate_left(23) ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(id: u64, input: u32, blocks: &[u64]) -> Request {
        Request {
            id: RequestId(id),
            input_tokens: input,
            output_tokens: 10,
            trace_blocks: blocks.to_vec().into(),
            trace_block_size: TRACE_BLOCK_SIZE,
            arrival_ns: 0,
            hash_cache: Default::default(),
        }
    }

    #[test]
    fn shared_trace_prefix_gives_shared_block_hashes() {
        let a = req(1, 1024 + 300, &[7, 8, 9]);
        let b = req(2, 1024 + 500, &[7, 8, 10]);
        let ha = a.prompt_block_hashes(64);
        let hb = b.prompt_block_hashes(64);
        assert_eq!(ha.len(), 20);
        assert_eq!(hb.len(), 23);
        assert_eq!(ha[..16], hb[..16], "two shared trace blocks = 16 engine blocks");
        assert_ne!(ha[16], hb[16]);
    }

    /// The in-order walk (block size dividing the trace block size) gives exactly the keys of
    /// the general per-block computation.
    #[test]
    fn fast_walk_equals_general_block_keys() {
        for (input, blocks) in
            [(1024 + 300, vec![7u64, 8, 9]), (512, vec![1]), (5000, vec![3; 10]), (64, vec![2])]
        {
            let r = req(1, input, &blocks);
            for bs in [1u32, 16, 64, 128, 512] {
                let general: Vec<BlockHash> = {
                    let mut parent = ROOT_HASH;
                    (0..input / bs)
                        .map(|b| {
                            parent = chain(parent, r.block_content(b, bs));
                            parent
                        })
                        .collect()
                };
                assert_eq!(r.prompt_block_hashes(bs), general, "input {input}, block size {bs}");
            }
        }
        // Too few trace blocks for the prompt: the general path's missing-id keys.
        let short = req(1, 2048, &[4]);
        let general: Vec<BlockHash> = {
            let mut parent = ROOT_HASH;
            (0..2048 / 64)
                .map(|b| {
                    parent = chain(parent, short.block_content(b, 64));
                    parent
                })
                .collect()
        };
        assert_eq!(short.prompt_block_hashes(64), general);
    }

    #[test]
    fn clones_share_the_hash_cache_and_other_block_sizes_are_still_right() {
        let a = req(1, 5000, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        let b = a.clone();
        let first = a.prompt_block_hashes(64);
        assert_eq!(first, a.compute_block_hashes(64));
        assert!(b.hash_cache.0.get().is_some(), "the clone sees the cached hashes");
        assert_eq!(b.prompt_block_hashes(64), first);
        // A block size other than the cached one is computed, not served from the cache.
        assert_eq!(b.prompt_block_hashes(16), a.compute_block_hashes(16));
        assert_ne!(b.prompt_block_hashes(16).len(), first.len());
    }

    #[test]
    fn chaining_makes_position_matter() {
        let a = req(1, 1024, &[5, 6]);
        let b = req(2, 1024, &[6, 6]);
        let ha = a.prompt_block_hashes(512);
        let hb = b.prompt_block_hashes(512);
        assert_ne!(ha[1], hb[1], "same content under a different parent differs");
    }

    #[test]
    fn odd_block_sizes_span_trace_blocks() {
        let a = req(1, 1500, &[1, 2, 3]);
        let b = req(2, 1500, &[1, 2, 4]);
        let ha = a.prompt_block_hashes(100);
        let hb = b.prompt_block_hashes(100);
        // Tokens 0..1024 are shared: blocks 0..=9 fully inside, block 10 spans 1000..1100.
        assert_eq!(ha[..10], hb[..10]);
        assert_ne!(ha[10], hb[10]);
    }

    #[test]
    fn unique_prompts_do_not_collide() {
        let a = Request::unique(RequestId(1), 2048, 1, 0);
        let b = Request::unique(RequestId(2), 2048, 1, 0);
        assert_ne!(a.prompt_block_hashes(64)[0], b.prompt_block_hashes(64)[0]);
    }
}
