//! The KV index: which workers hold which chained block hashes, built from the workers'
//! `KvStored` / `KvRemoved` / `KvCleared` facts.
//!
//! Memory is one map entry (hash → 64-bit holder mask) per distinct hash currently stored, so it
//! is bounded by the blocks the workers hold: a hash leaves the index when its last holder
//! removes it. Lookups use hash maps (never iterated into any output); the
//! overlap result is a `BTreeMap`, so callers observe a deterministic order.

use crate::events::{BlockHash, Fact};
use crate::ids::WorkerId;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Block hashes are already well mixed 64-bit values: hashing them again is wasted work.
#[derive(Default, Clone, Copy)]
pub struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-u64 keys; fold bytes in so it stays a correct (if slow) hasher.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<PassThroughHasher>>;

/// Per-hash holders and per-worker contents.
///
/// Workers get a dense slot number on first sight. A hash's holders among slots 0..64 are one
/// `u64` bitmask (no allocation per hash, and the overlap walk is a chain of ANDs); slots from 64
/// up, for clusters that large, live in a sorted side list per hash.
#[derive(Clone, Default)]
pub struct KvIndex {
    /// Slot → worker.
    slots: Vec<WorkerId>,
    /// Worker → slot.
    slot_of: BTreeMap<WorkerId, u32>,
    /// Hash → bitmask of holder slots < 64.
    holders: FastMap<BlockHash, u64>,
    /// Hash → sorted holder slots ≥ 64 (empty map unless the index has more than 64 workers).
    overflow: FastMap<BlockHash, Vec<u32>>,
    /// Slot → how many hashes it holds. (No per-worker hash set: that would double the hash-map
    /// work of every store and remove; the rare `KvCleared` scans the index instead.)
    counts: Vec<usize>,
}

impl std::fmt::Debug for KvIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvIndex")
            .field("hashes", &self.distinct_hashes())
            .field("workers", &self.slots.len())
            .finish()
    }
}

const MASK_SLOTS: u32 = 64;

impl KvIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Folds one fact from `worker`'s stream; facts other than the three KV facts are ignored.
    /// Storing a held hash again, or removing one not held, is a no-op (the index is a set).
    pub fn apply(&mut self, worker: WorkerId, fact: &Fact) {
        match fact {
            Fact::KvStored { blocks, .. } => {
                let slot = self.slot(worker);
                for &h in blocks {
                    self.store(slot, h);
                }
            }
            Fact::KvRemoved { blocks } => {
                if let Some(&slot) = self.slot_of.get(&worker) {
                    for &h in blocks {
                        self.remove(slot, h);
                    }
                }
            }
            Fact::KvCleared => {
                if let Some(&slot) = self.slot_of.get(&worker) {
                    self.clear(slot);
                }
            }
            _ => {}
        }
    }

    fn slot(&mut self, worker: WorkerId) -> u32 {
        if let Some(&s) = self.slot_of.get(&worker) {
            return s;
        }
        // 2^32 workers cannot exist in memory; the fallback is unreachable.
        let s = u32::try_from(self.slots.len()).unwrap_or(u32::MAX);
        self.slots.push(worker);
        self.counts.push(0);
        self.slot_of.insert(worker, s);
        s
    }

    fn store(&mut self, slot: u32, h: BlockHash) {
        let added = if slot < MASK_SLOTS {
            let m = self.holders.entry(h).or_insert(0);
            let bit = 1u64 << slot;
            let added = *m & bit == 0;
            *m |= bit;
            added
        } else {
            let v = self.overflow.entry(h).or_default();
            match v.binary_search(&slot) {
                Ok(_) => false,
                Err(at) => {
                    v.insert(at, slot);
                    true
                }
            }
        };
        if added {
            self.counts[slot as usize] += 1;
        }
    }

    fn remove(&mut self, slot: u32, h: BlockHash) {
        let removed = if slot < MASK_SLOTS {
            use std::collections::hash_map::Entry;
            match self.holders.entry(h) {
                Entry::Occupied(mut e) => {
                    let bit = 1u64 << slot;
                    let had = *e.get() & bit != 0;
                    *e.get_mut() &= !bit;
                    if *e.get() == 0 {
                        e.remove();
                    }
                    had
                }
                Entry::Vacant(_) => false,
            }
        } else {
            match self.overflow.get_mut(&h) {
                Some(v) => {
                    let had = match v.binary_search(&slot) {
                        Ok(at) => {
                            v.remove(at);
                            true
                        }
                        Err(_) => false,
                    };
                    if v.is_empty() {
                        self.overflow.remove(&h);
                    }
                    had
                }
                None => false,
            }
        };
        if removed {
            self.counts[slot as usize] -= 1;
        }
    }

    /// O(index size): a worker's cache is cleared only when it restarts.
    fn clear(&mut self, slot: u32) {
        if slot < MASK_SLOTS {
            let bit = 1u64 << slot;
            self.holders.retain(|_, m| {
                *m &= !bit;
                *m != 0
            });
        } else {
            self.overflow.retain(|_, v| {
                v.retain(|s| *s != slot);
                !v.is_empty()
            });
        }
        self.counts[slot as usize] = 0;
    }

    /// For each worker holding at least the first block: how many leading blocks of `hashes`
    /// it holds, stopping at its first miss. Cost: O(matched blocks), plus O(matched blocks ×
    /// holders) for slots beyond 64.
    pub fn overlap(&self, hashes: &[BlockHash]) -> BTreeMap<WorkerId, u32> {
        let mut out = BTreeMap::new();
        let Some(first) = hashes.first() else {
            return out;
        };
        let mut alive = self.holders.get(first).copied().unwrap_or(0);
        let mut alive_big: Vec<u32> = if self.overflow.is_empty() {
            Vec::new()
        } else {
            self.overflow.get(first).cloned().unwrap_or_default()
        };
        if alive == 0 && alive_big.is_empty() {
            return out;
        }
        let mut depth = 1u32;
        for h in &hashes[1..] {
            let now = alive & self.holders.get(h).copied().unwrap_or(0);
            let mut gone = alive & !now;
            while gone != 0 {
                let slot = gone.trailing_zeros() as usize;
                out.insert(self.slots[slot], depth);
                gone &= gone - 1;
            }
            alive = now;
            if !alive_big.is_empty() {
                let holders = self.overflow.get(h).map(Vec::as_slice).unwrap_or(&[]);
                alive_big.retain(|s| {
                    let keep = holders.binary_search(s).is_ok();
                    if !keep {
                        out.insert(self.slots[*s as usize], depth);
                    }
                    keep
                });
            }
            if alive == 0 && alive_big.is_empty() {
                return out;
            }
            depth += 1;
        }
        while alive != 0 {
            let slot = alive.trailing_zeros() as usize;
            out.insert(self.slots[slot], depth);
            alive &= alive - 1;
        }
        for s in alive_big {
            out.insert(self.slots[s as usize], depth);
        }
        out
    }

    /// Whether `worker` holds `hash`.
    pub fn holds(&self, worker: WorkerId, hash: BlockHash) -> bool {
        match self.slot_of.get(&worker) {
            Some(&s) if s < MASK_SLOTS => self.holders.get(&hash).is_some_and(|m| m & (1u64 << s) != 0),
            Some(s) => self.overflow.get(&hash).is_some_and(|v| v.binary_search(s).is_ok()),
            None => false,
        }
    }

    /// Blocks `worker` holds.
    pub fn blocks_on(&self, worker: WorkerId) -> usize {
        self.slot_of.get(&worker).map_or(0, |&s| self.counts[s as usize])
    }

    /// Distinct hashes held by anyone.
    pub fn distinct_hashes(&self) -> usize {
        self.holders.len() + self.overflow.keys().filter(|h| !self.holders.contains_key(h)).count()
    }

    /// (hash, worker) pairs stored: the index's size.
    pub fn stored_pairs(&self) -> usize {
        self.counts.iter().sum()
    }
}
