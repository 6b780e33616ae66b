//! The vLLM-like block pool: a fixed number of KV blocks, prefix caching by chained hash, per-owner
//! reference counts, and an LRU of cached-free blocks.
//!
//! ## Ownership classes and precedence
//! A block may be referenced by several owners at once (two requests sharing a prefix, a pinned
//! source whose published prefix another request reuses, a reservation that locked a cached
//! prefix). The capacity snapshot counts every block in exactly ONE class, by precedence:
//!
//! `active > reserved_destination > pinned_source > cached_free > free`
//!
//! * any active reference (running / waiting-with-KV request, activated destination) → active;
//! * else any reservation reference → reserved_destination;
//! * else any held-prefill reference → pinned_source;
//! * else a block with a hash → cached_free (evictable, LRU);
//! * else → free.
//!
//! Every reference change recomputes the block's class; a class change is added to the pool's
//! delta accumulator, which the core drains into the fact that caused it. So a request finishing
//! on a block that a pin also holds moves it active → pinned inside that request's
//! `RequestFinished` delta.
//!
//! ## Cost
//! Every operation is O(1), amortized for the LRU queue's compaction (hash lookup, stack pop,
//! queue push/pop); only [`BlockPool::audit`] walks all blocks.
//!
//! The hash index is intrusive: a fixed bucket array (eight times the block count, so chains stay short)
//! holds the first block of each chain, and each block links to its chain neighbours. Evicting a
//! cached block is by far the most frequent index operation in a replay; with the links in the
//! block it only writes (no lookup whose cache miss the CPU must wait for). The index is never
//! iterated into output.

use crate::events::{BlockHash, KvDelta};
use crate::model::capacity::KvCapacitySnapshot;
use std::collections::VecDeque;

/// A hasher for keys that are single integers (block hashes, request ids). SipHash's DoS
/// resistance buys nothing in a simulator and costs most of a decode step's time; a multiply-
/// xorshift finalizer spreads sequential ids as well. Deterministic (no random state), and only
/// used for lookups that are never iterated into output.
#[derive(Clone, Copy, Debug, Default)]
pub struct IntegerHasher(u64);

impl std::hash::Hasher for IntegerHasher {
    fn finish(&self) -> u64 {
        let z = self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        z ^ (z >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = self.0.rotate_left(32) ^ n;
    }
}

/// `BuildHasher` for [`IntegerHasher`].
pub type BuildIntegerHasher = std::hash::BuildHasherDefault<IntegerHasher>;

pub use crate::schedulers::prefetch::prefetch;

/// Index of a physical block.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;
/// How many blocks ahead [`BlockPool::release_all_rev`] and [`BlockPool::rekind_all`] prefetch.
const RELEASE_AHEAD: usize = 8;
/// `Block::hprev` of a block that has no hash (and so is in no chain).
const UNHASHED: u32 = u32::MAX - 1;

/// Who holds a reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// A waiting-with-KV or running request (incl. an activated destination).
    Active = 0,
    /// A finished handoff prefill holding its KV for a reader.
    Pinned = 1,
    /// A destination reservation not yet activated.
    Reserved = 2,
}

/// A block's class; the discriminant indexes the pool's counters and delta accumulator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Class {
    Active = 0,
    Pinned = 1,
    Reserved = 2,
    Cached = 3,
    Free = 4,
}

#[derive(Clone, Debug)]
struct Block {
    /// Valid only when `hprev != UNHASHED` (kept as a bare u64 so a block is 32 bytes).
    hash: BlockHash,
    refs: [u32; 3],
    /// Bumped each time the block enters the LRU queue; only the queue entry carrying the
    /// current stamp (while the block is cached-free) is live.
    lru_stamp: u32,
    /// Intrusive hash-chain links: `hprev` is `UNHASHED` for a block without a hash, `NIL` for
    /// the first block of its bucket's chain.
    hprev: u32,
    hnext: u32,
}

impl Block {
    const EMPTY: Block = Block { hash: 0, refs: [0; 3], lru_stamp: 0, hprev: UNHASHED, hnext: NIL };

    fn hash(&self) -> Option<BlockHash> {
        (self.hprev != UNHASHED).then_some(self.hash)
    }

    fn class(&self) -> Class {
        if self.refs[Owner::Active as usize] > 0 {
            Class::Active
        } else if self.refs[Owner::Reserved as usize] > 0 {
            Class::Reserved
        } else if self.refs[Owner::Pinned as usize] > 0 {
            Class::Pinned
        } else if self.hprev != UNHASHED {
            Class::Cached
        } else {
            Class::Free
        }
    }
}

/// An internal inconsistency (a release without a matching acquire). Never caused by command
/// input: the core only releases what it acquired; surfaced instead of panicking.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("block pool: {0}")]
pub struct PoolError(pub String);

#[derive(Clone, Debug)]
#[repr(C)]
pub struct BlockPool {
    // What every step reads or writes first, in one cache line: counters and the delta.
    counts: Counts,
    /// Class changes not yet attached to a fact, indexed by `Class as usize`.
    acc: [i32; 5],
    /// Hashes evicted and not yet reported by a `KvRemoved` fact.
    removed: Vec<BlockHash>,
    blocks: Vec<Block>,
    /// Hash index (see the module docs): bucket → first block of its chain, or `NIL`. Every
    /// block with a hash is in it, and is its hash's canonical block.
    heads: Vec<u32>,
    /// `64 − log2(heads.len())`: a bucket is the top bits of the hash times an odd constant.
    bucket_shift: u32,
    /// Plain free blocks (no hash), used as a stack.
    free: Vec<BlockId>,
    /// Cached-free blocks in the order they became cached (the eviction order), with lazy
    /// deletion: an entry `(block, stamp)` is live only while the block is cached-free with that
    /// stamp, so a block leaving the cache needs no unlink. Victims are read from a contiguous
    /// queue, so the next ones can be prefetched (a linked list would be a chain of cache
    /// misses). Compacted when dead entries pile up: at most about twice the block count.
    lru: VecDeque<(BlockId, u32)>,
    /// Bumped whenever a block becomes unreferenced (capacity grew).
    epoch: u64,
}

/// Blocks per class, indexed by `Class as usize` (a table, not a match, on every transition).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counts([u64; 5]);

impl Counts {
    #[inline]
    fn bump(&mut self, c: Class, up: bool) {
        let slot = &mut self.0[c as usize];
        if up {
            *slot += 1;
        } else {
            *slot = slot.saturating_sub(1);
        }
    }
    fn get(&self, c: Class) -> u64 {
        self.0[c as usize]
    }
}

#[inline]
fn delta_bump(d: &mut [i32; 5], c: Class, by: i32) {
    d[c as usize] += by;
}

impl BlockPool {
    pub fn new(total: u32) -> Self {
        let blocks = vec![Block::EMPTY; total as usize];
        // Pop order: lowest id first (deterministic).
        let free: Vec<BlockId> = (0..total).rev().collect();
        // At most one hash per block. Eight buckets per block keep the load at or under 1/8: a
        // lookup for a new hash rarely walks a chain, and linking or unlinking rarely writes to
        // a neighbour, each of which is a cache miss in a pool of megabytes. Measured on the full
        // Mooncake replay: 2x -> 4x -> 8x buckets, 0.626 -> 0.606 -> 0.583 s; 16x is slower again
        // (the bucket array itself stops fitting the cache).
        let buckets = (8 * total as u64).next_power_of_two().max(2);
        BlockPool {
            blocks,
            heads: vec![NIL; buckets as usize],
            bucket_shift: 64 - buckets.trailing_zeros(),
            free,
            lru: VecDeque::new(),
            counts: Counts([0, 0, 0, 0, total as u64]),
            acc: [0; 5],
            removed: Vec::new(),
            epoch: 0,
        }
    }

    pub fn total(&self) -> u64 {
        self.blocks.len() as u64
    }

    /// Blocks an allocation could obtain now: plain free plus evictable cached-free.
    pub fn available(&self) -> u64 {
        self.counts.get(Class::Free) + self.counts.get(Class::Cached)
    }

    pub fn active_blocks(&self) -> u64 {
        self.counts.get(Class::Active)
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The canonical block holding `hash`, if any (referenced or cached-free).
    pub fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        let mut b = self.heads[self.bucket(hash)];
        while b != NIL {
            let blk = &self.blocks[b as usize];
            if blk.hash == hash {
                return Some(b);
            }
            b = blk.hnext;
        }
        None
    }

    /// Prefetches what [`BlockPool::set_hash`] or [`BlockPool::lookup`] of `hash` on block `b`
    /// will read first: `b` and the bucket. Call a few blocks ahead.
    pub fn prefetch_bucket(&self, b: BlockId, hash: BlockHash) {
        if let Some(blk) = self.blocks.get(b as usize) {
            prefetch(blk);
        }
        prefetch(&self.heads[self.bucket(hash)]);
    }

    /// Prefetches the first block of `hash`'s chain (its bucket should be cached by now: call
    /// after [`BlockPool::prefetch_bucket`] of the same hash, a few blocks later).
    pub fn prefetch_chain(&self, hash: BlockHash) {
        let head = self.heads[self.bucket(hash)];
        if let Some(blk) = self.blocks.get(head as usize) {
            prefetch(blk);
        }
    }

    fn bucket(&self, hash: BlockHash) -> usize {
        // Fibonacci hashing: the top bits of the product spread any key, mixed or sequential.
        (hash.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.bucket_shift) as usize
    }

    /// Unlinks hashed block `b` from its chain and clears its hash: only writes to its
    /// neighbours (or the bucket), no search.
    fn index_remove(&mut self, b: BlockId) {
        let (hash, p, n) = {
            let blk = &self.blocks[b as usize];
            (blk.hash, blk.hprev, blk.hnext)
        };
        if p == NIL {
            let k = self.bucket(hash);
            self.heads[k] = n;
        } else {
            self.blocks[p as usize].hnext = n;
        }
        if n != NIL {
            self.blocks[n as usize].hprev = p;
        }
        let blk = &mut self.blocks[b as usize];
        blk.hprev = UNHASHED;
        blk.hnext = NIL;
    }

    /// True if the block is cached-free (unreferenced, evictable): acquiring it takes it out of
    /// the evictable set.
    pub fn is_cached_free(&self, b: BlockId) -> bool {
        self.blocks.get(b as usize).map(|x| x.class() == Class::Cached).unwrap_or(false)
    }

    /// Reference counts by owner (`[active, pinned, reserved]`), for audits.
    pub fn refs_of(&self, b: BlockId) -> [u32; 3] {
        self.blocks.get(b as usize).map(|x| x.refs).unwrap_or([0; 3])
    }

    pub fn hash_of(&self, b: BlockId) -> Option<BlockHash> {
        self.blocks.get(b as usize).and_then(|x| x.hash())
    }

    /// Nothing changed since the last [`BlockPool::take_delta`] and nothing was evicted since the
    /// last [`BlockPool::take_removed`]: there is nothing to attach to a fact.
    pub fn is_quiet(&self) -> bool {
        self.acc == [0; 5] && self.removed.is_empty()
    }

    /// Drains the class changes since the last call (to attach to a fact).
    pub fn take_delta(&mut self) -> KvDelta {
        let a = std::mem::take(&mut self.acc);
        KvDelta {
            active: a[Class::Active as usize],
            pinned_source: a[Class::Pinned as usize],
            reserved_destination: a[Class::Reserved as usize],
            cached_free: a[Class::Cached as usize],
            free: a[Class::Free as usize],
            ..KvDelta::ZERO
        }
    }

    /// Drains the hashes evicted since the last call.
    pub fn take_removed(&mut self) -> Vec<BlockHash> {
        // The list leaves with its fact (to another thread): start the next one at this one's
        // size, as evictions come in similar runs, rather than regrowing it from empty.
        let next = Vec::with_capacity(self.removed.len());
        std::mem::replace(&mut self.removed, next)
    }

    fn lru_live(blocks: &[Block], b: BlockId, stamp: u32) -> bool {
        blocks.get(b as usize).is_some_and(|blk| blk.lru_stamp == stamp && blk.class() == Class::Cached)
    }

    #[inline]
    fn lru_push_tail(&mut self, b: BlockId) {
        if self.lru.len() >= 2 * self.blocks.len() + 64 {
            self.compact_lru();
        }
        let blk = &mut self.blocks[b as usize];
        blk.lru_stamp = blk.lru_stamp.wrapping_add(1);
        self.lru.push_back((b, blk.lru_stamp));
    }

    #[cold]
    fn compact_lru(&mut self) {
        let blocks = &self.blocks;
        self.lru.retain(|&(x, stamp)| Self::lru_live(blocks, x, stamp));
    }

    /// Takes the least recently cached live block out of the queue.
    fn lru_pop_head(&mut self) -> Option<BlockId> {
        while let Some((b, stamp)) = self.lru.pop_front() {
            if Self::lru_live(&self.blocks, b, stamp) {
                return Some(b);
            }
        }
        None
    }

    /// Applies `f` to block `b` and books the resulting class change (structures, counters,
    /// delta, epoch). Leaving the Free class is only done by `alloc`, which pops the stack itself.
    #[inline(always)]
    fn transition(&mut self, b: BlockId, f: impl FnOnce(&mut Block)) {
        let old = self.blocks[b as usize].class();
        f(&mut self.blocks[b as usize]);
        let new = self.blocks[b as usize].class();
        if old == new {
            return;
        }
        // Leaving the cache: the block's queue entry is dead from now on (class check).
        match new {
            Class::Cached => {
                self.lru_push_tail(b);
                self.epoch += 1;
            }
            Class::Free => {
                self.free.push(b);
                self.epoch += 1;
            }
            _ => {}
        }
        self.counts.bump(old, false);
        self.counts.bump(new, true);
        delta_bump(&mut self.acc, old, -1);
        delta_bump(&mut self.acc, new, 1);
    }

    /// Adds a reference of `owner` to an existing block (prefix reuse).
    pub fn acquire(&mut self, b: BlockId, owner: Owner) {
        self.transition(b, |blk| blk.refs[owner as usize] += 1);
    }

    /// Drops one reference of `owner`.
    #[inline]
    pub fn release(&mut self, b: BlockId, owner: Owner) -> Result<(), PoolError> {
        let Some(blk) = self.blocks.get(b as usize) else {
            return Err(PoolError(format!("release of unknown block {b}")));
        };
        if blk.refs[owner as usize] == 0 {
            return Err(PoolError(format!("release of block {b} without a {owner:?} reference")));
        }
        self.transition(b, |blk| blk.refs[owner as usize] -= 1);
        Ok(())
    }

    /// Drops one `owner` reference from each block, in reverse order (a request's tail enters
    /// the LRU first, so shared prefixes stay cached longest). Continues past a bad block and
    /// reports the first.
    pub fn release_all_rev(&mut self, blocks: &[BlockId], owner: Owner) -> Result<(), PoolError> {
        let mut first = Ok(());
        for (i, &b) in blocks.iter().enumerate().rev() {
            // A request's blocks lie anywhere in the pool: start loading the one a few
            // releases ahead (measured on the full Mooncake replay with the rekind below:
            // about 2% of wall time).
            if let Some(blk) = i.checked_sub(RELEASE_AHEAD).and_then(|j| self.blocks.get(blocks[j] as usize))
            {
                prefetch(blk);
            }
            let r = self.release(b, owner);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// [`BlockPool::rekind`] for each block, in order; continues past a bad block and reports
    /// the first.
    pub fn rekind_all(&mut self, blocks: &[BlockId], from: Owner, to: Owner) -> Result<(), PoolError> {
        let mut first = Ok(());
        for (i, &b) in blocks.iter().enumerate() {
            if let Some(blk) = blocks.get(i + RELEASE_AHEAD).and_then(|&x| self.blocks.get(x as usize)) {
                prefetch(blk);
            }
            let r = self.rekind(b, from, to);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Moves one reference from `from` to `to` in one transition (pin, activation).
    #[inline]
    pub fn rekind(&mut self, b: BlockId, from: Owner, to: Owner) -> Result<(), PoolError> {
        let Some(blk) = self.blocks.get(b as usize) else {
            return Err(PoolError(format!("rekind of unknown block {b}")));
        };
        if blk.refs[from as usize] == 0 {
            return Err(PoolError(format!("rekind of block {b} without a {from:?} reference")));
        }
        self.transition(b, |blk| {
            blk.refs[from as usize] -= 1;
            blk.refs[to as usize] += 1;
        });
        Ok(())
    }

    /// A fresh block with no hash, from the free stack or by evicting the least recently freed
    /// cached block (its hash is queued for `KvRemoved`). `None` if nothing is available.
    pub fn alloc(&mut self, owner: Owner) -> Option<BlockId> {
        if let Some(b) = self.free.pop() {
            // Free → owner class; the stack pop above already removed it from its structure.
            self.counts.bump(Class::Free, false);
            delta_bump(&mut self.acc, Class::Free, -1);
            let blk = &mut self.blocks[b as usize];
            blk.refs[owner as usize] += 1;
            let new = blk.class();
            self.counts.bump(new, true);
            delta_bump(&mut self.acc, new, 1);
            return Some(b);
        }
        let b = self.lru_pop_head()?;
        // Evictions come in runs (a request's blocks). Two stages ahead: fetch a victim far
        // ahead; nearer, that victim is cached, so fetch what unlinking it will write (its
        // bucket or chain predecessor).
        const EVICT_AHEAD: usize = 16;
        const UNLINK_AHEAD: usize = 8;
        if let Some(blk) = self.lru.get(EVICT_AHEAD).and_then(|&(x, _)| self.blocks.get(x as usize)) {
            prefetch(blk);
        }
        if let Some(blk) = self.lru.get(UNLINK_AHEAD).and_then(|&(x, _)| self.blocks.get(x as usize)) {
            if blk.hprev == NIL {
                if let Some(head) = self.heads.get(self.bucket(blk.hash)) {
                    prefetch(head);
                }
            } else if let Some(p) = self.blocks.get(blk.hprev as usize) {
                prefetch(p);
            }
        }
        // Evict: cached → (no hash) → owner class. A hashed block is always its hash's
        // canonical block (set_hash never hashes a duplicate), so it is the index entry.
        if let Some(h) = self.blocks[b as usize].hash() {
            self.index_remove(b);
            self.removed.push(h);
        }
        self.counts.bump(Class::Cached, false);
        delta_bump(&mut self.acc, Class::Cached, -1);
        let blk = &mut self.blocks[b as usize];
        blk.refs[owner as usize] += 1;
        let new = blk.class();
        self.counts.bump(new, true);
        delta_bump(&mut self.acc, new, 1);
        Some(b)
    }

    /// Gives a referenced, hashless block its hash. If another block already holds that hash,
    /// nothing changes and the canonical block is returned (the caller adopts it and releases
    /// its own copy).
    #[inline]
    pub fn set_hash(&mut self, b: BlockId, hash: BlockHash) -> Result<Option<BlockId>, PoolError> {
        // One bucket computation for both the search and the insertion.
        let k = self.bucket(hash);
        let mut c = self.heads[k];
        while c != NIL {
            let blk = &self.blocks[c as usize];
            if blk.hash == hash {
                return Ok((c != b).then_some(c));
            }
            c = blk.hnext;
        }
        let Some(blk) = self.blocks.get_mut(b as usize) else {
            return Err(PoolError(format!("hash of unknown block {b}")));
        };
        if blk.hprev != UNHASHED {
            return Err(PoolError(format!("block {b} already has a hash")));
        }
        // A referenced block keeps its class when it gains a hash; it goes first in its chain.
        let head = self.heads[k];
        blk.hash = hash;
        blk.hprev = NIL;
        blk.hnext = head;
        if head != NIL {
            self.blocks[head as usize].hprev = b;
        }
        self.heads[k] = b;
        Ok(None)
    }

    /// The counters, as a snapshot (slots are the core's business).
    pub fn snapshot_blocks(&self) -> KvCapacitySnapshot {
        KvCapacitySnapshot {
            active_blocks: self.counts.get(Class::Active),
            pinned_source_blocks: self.counts.get(Class::Pinned),
            reserved_destination_blocks: self.counts.get(Class::Reserved),
            cached_free_blocks: self.counts.get(Class::Cached),
            free_blocks: self.counts.get(Class::Free),
            total_blocks: self.total(),
            request_slots_used: 0,
            decode_headroom_tokens: 0,
        }
    }

    /// Recounts every class by walking every block, and checks the free stack, the LRU and the
    /// hash index against the blocks. Slow: tests and audits only.
    pub fn audit(&self) -> Result<KvCapacitySnapshot, PoolError> {
        let mut c = Counts::default();
        for (i, blk) in self.blocks.iter().enumerate() {
            c.bump(blk.class(), true);
            if let Some(h) = blk.hash() {
                if self.lookup(h) != Some(i as u32) {
                    return Err(PoolError(format!(
                        "block {i} has hash {h:#x} but is not its canonical block"
                    )));
                }
            }
        }
        let mut chained = 0u64;
        for (k, &head) in self.heads.iter().enumerate() {
            let mut prev = NIL;
            let mut cur = head;
            while cur != NIL {
                let blk = &self.blocks[cur as usize];
                if blk.hprev != prev || self.bucket(blk.hash) != k {
                    return Err(PoolError(format!("hash chain corrupt at block {cur}")));
                }
                chained += 1;
                if chained > self.total() {
                    return Err(PoolError("hash chain has a cycle".into()));
                }
                prev = cur;
                cur = blk.hnext;
            }
        }
        if chained != self.blocks.iter().filter(|b| b.hash().is_some()).count() as u64 {
            return Err(PoolError("hash index size differs from hashed blocks".into()));
        }
        if self.free.len() as u64 != c.get(Class::Free) {
            return Err(PoolError(format!(
                "free stack {} != free blocks {}",
                self.free.len(),
                c.get(Class::Free)
            )));
        }
        if self.free.iter().any(|&b| self.blocks[b as usize].class() != Class::Free) {
            return Err(PoolError("free stack holds a non-free block".into()));
        }
        // Every cached block has exactly one live queue entry: live entries are distinct
        // (a stamp is used once per block) and as many as the cached blocks.
        let n = self.lru.iter().filter(|&&(b, stamp)| Self::lru_live(&self.blocks, b, stamp)).count() as u64;
        if n != c.get(Class::Cached) {
            return Err(PoolError(format!("LRU length {n} != cached blocks {}", c.get(Class::Cached))));
        }
        if self.lru.len() > 2 * self.blocks.len() + 64 {
            return Err(PoolError(format!("LRU queue holds {} entries", self.lru.len())));
        }
        if c != self.counts {
            return Err(PoolError(format!("counters {:?} != recount {:?}", self.counts, c)));
        }
        Ok(KvCapacitySnapshot {
            active_blocks: c.get(Class::Active),
            pinned_source_blocks: c.get(Class::Pinned),
            reserved_destination_blocks: c.get(Class::Reserved),
            cached_free_blocks: c.get(Class::Cached),
            free_blocks: c.get(Class::Free),
            total_blocks: self.total(),
            request_slots_used: 0,
            decode_headroom_tokens: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_to_cache_then_evict_in_lru_order() {
        let mut p = BlockPool::new(3);
        let a = p.alloc(Owner::Active).unwrap();
        let b = p.alloc(Owner::Active).unwrap();
        let c = p.alloc(Owner::Active).unwrap();
        assert!(p.alloc(Owner::Active).is_none());
        assert_eq!(p.set_hash(a, 10).unwrap(), None);
        assert_eq!(p.set_hash(b, 11).unwrap(), None);
        p.release(b, Owner::Active).unwrap();
        p.release(a, Owner::Active).unwrap();
        p.release(c, Owner::Active).unwrap(); // no hash: plain free
        let d = p.take_delta();
        assert_eq!(d, KvDelta { cached_free: 2, free: -2, ..KvDelta::ZERO });
        // Plain free first, then the least recently freed cached block (b, hash 11).
        assert_eq!(p.alloc(Owner::Active), Some(c));
        assert_eq!(p.alloc(Owner::Active), Some(b));
        assert_eq!(p.take_removed(), vec![11]);
        assert_eq!(p.lookup(10), Some(a));
        assert_eq!(p.lookup(11), None);
        p.audit().unwrap();
    }

    #[test]
    fn precedence_counts_shared_block_once() {
        let mut p = BlockPool::new(2);
        let a = p.alloc(Owner::Active).unwrap();
        p.set_hash(a, 5).unwrap();
        p.acquire(a, Owner::Pinned);
        p.acquire(a, Owner::Reserved);
        let s = p.audit().unwrap();
        assert_eq!((s.active_blocks, s.pinned_source_blocks, s.reserved_destination_blocks), (1, 0, 0));
        p.release(a, Owner::Active).unwrap();
        assert_eq!(p.audit().unwrap().reserved_destination_blocks, 1);
        p.release(a, Owner::Reserved).unwrap();
        assert_eq!(p.audit().unwrap().pinned_source_blocks, 1);
        p.release(a, Owner::Pinned).unwrap();
        assert_eq!(p.audit().unwrap().cached_free_blocks, 1);
        assert!(p.release(a, Owner::Pinned).is_err());
        let d = p.take_delta();
        assert_eq!(d, KvDelta { free: -1, cached_free: 1, ..KvDelta::ZERO });
    }

    #[test]
    fn duplicate_hash_returns_canonical() {
        let mut p = BlockPool::new(2);
        let a = p.alloc(Owner::Active).unwrap();
        let b = p.alloc(Owner::Active).unwrap();
        p.set_hash(a, 9).unwrap();
        assert_eq!(p.set_hash(b, 9).unwrap(), Some(a));
        assert_eq!(p.hash_of(b), None);
        p.audit().unwrap();
    }
}
