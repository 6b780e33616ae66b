//! The KV index: which workers hold which chained block hashes, built from the workers'
//! `KvStored` / `KvRemoved` / `KvCleared` facts.
//!
//! Memory is proportional to the (hash, worker) pairs currently stored: a hash leaves the index
//! when its last holder removes it. Lookups use hash maps (never iterated into any output); the
//! overlap result is a `BTreeMap`, so callers observe a deterministic order.

use crate::events::{BlockHash, Fact};
use crate::ids::WorkerId;
use std::collections::{BTreeMap, HashMap, HashSet};
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
type FastSet<K> = HashSet<K, BuildHasherDefault<PassThroughHasher>>;

/// Per-hash holders and per-worker contents.
#[derive(Clone, Default)]
pub struct KvIndex {
    /// Hash → workers holding it, sorted ascending, no duplicates (usually one or two entries).
    holders: FastMap<BlockHash, Vec<WorkerId>>,
    /// Worker → hashes it holds, for `KvCleared`.
    contents: BTreeMap<WorkerId, FastSet<BlockHash>>,
}

impl std::fmt::Debug for KvIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvIndex")
            .field("hashes", &self.holders.len())
            .field("workers", &self.contents.len())
            .finish()
    }
}

impl KvIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Folds one fact from `worker`'s stream; facts other than the three KV facts are ignored.
    /// Storing a held hash again, or removing one not held, is a no-op (the index is a set).
    pub fn apply(&mut self, worker: WorkerId, fact: &Fact) {
        match fact {
            Fact::KvStored { blocks, .. } => {
                for &h in blocks {
                    self.store(worker, h);
                }
            }
            Fact::KvRemoved { blocks } => {
                for &h in blocks {
                    self.remove(worker, h);
                }
            }
            Fact::KvCleared => self.clear(worker),
            _ => {}
        }
    }

    fn store(&mut self, worker: WorkerId, h: BlockHash) {
        if !self.contents.entry(worker).or_default().insert(h) {
            return;
        }
        let v = self.holders.entry(h).or_default();
        if let Err(at) = v.binary_search(&worker) {
            v.insert(at, worker);
        }
    }

    fn remove(&mut self, worker: WorkerId, h: BlockHash) {
        let Some(set) = self.contents.get_mut(&worker) else {
            return;
        };
        if !set.remove(&h) {
            return;
        }
        if set.is_empty() {
            self.contents.remove(&worker);
        }
        self.drop_holder(worker, h);
    }

    fn drop_holder(&mut self, worker: WorkerId, h: BlockHash) {
        if let Some(v) = self.holders.get_mut(&h) {
            if let Ok(at) = v.binary_search(&worker) {
                v.remove(at);
            }
            if v.is_empty() {
                self.holders.remove(&h);
            }
        }
    }

    fn clear(&mut self, worker: WorkerId) {
        if let Some(set) = self.contents.remove(&worker) {
            for h in set {
                self.drop_holder(worker, h);
            }
        }
    }

    /// For each worker holding at least the first block: how many leading blocks of `hashes`
    /// it holds, stopping at its first miss. Cost: O(matched blocks × workers holding them).
    pub fn overlap(&self, hashes: &[BlockHash]) -> BTreeMap<WorkerId, u32> {
        let mut out = BTreeMap::new();
        let Some(first) = hashes.first().and_then(|h| self.holders.get(h)) else {
            return out;
        };
        let mut alive: Vec<WorkerId> = first.clone();
        let mut depth = 1u32;
        for h in &hashes[1..] {
            let holders = self.holders.get(h).map(Vec::as_slice).unwrap_or(&[]);
            alive.retain(|w| {
                let keep = holders.binary_search(w).is_ok();
                if !keep {
                    out.insert(*w, depth);
                }
                keep
            });
            if alive.is_empty() {
                return out;
            }
            depth += 1;
        }
        for w in alive {
            out.insert(w, depth);
        }
        out
    }

    /// Whether `worker` holds `hash`.
    pub fn holds(&self, worker: WorkerId, hash: BlockHash) -> bool {
        self.contents
            .get(&worker)
            .is_some_and(|s| s.contains(&hash))
    }

    /// Blocks `worker` holds.
    pub fn blocks_on(&self, worker: WorkerId) -> usize {
        self.contents.get(&worker).map_or(0, FastSet::len)
    }

    /// Distinct hashes held by anyone.
    pub fn distinct_hashes(&self) -> usize {
        self.holders.len()
    }

    /// (hash, worker) pairs stored: the index's size.
    pub fn stored_pairs(&self) -> usize {
        self.contents.values().map(FastSet::len).sum()
    }
}
