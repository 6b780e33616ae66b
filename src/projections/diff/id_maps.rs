//! Lookup-only maps of ids: a fast hasher and a bounded memory of recently finished ids.

use std::collections::{HashMap, HashSet, VecDeque};

/// A bounded memory of recently finished ids, so that a straggling fact about one (a duplicate
/// message, a late acknowledgement) is not taken for a new entry.
pub(super) struct RecentIds<K: std::hash::Hash + Eq + Copy> {
    set: HashSet<K, IdBuildHasher>,
    order: VecDeque<K>,
    cap: usize,
}

impl<K: std::hash::Hash + Eq + Copy> RecentIds<K> {
    pub(super) fn new(cap: usize) -> Self {
        RecentIds { set: HashSet::default(), order: VecDeque::new(), cap }
    }
    pub(super) fn insert(&mut self, k: K) {
        if self.set.insert(k) {
            self.order.push_back(k);
            if self.order.len() > self.cap {
                if let Some(old) = self.order.pop_front() {
                    self.set.remove(&old);
                }
            }
        }
    }
    pub(super) fn contains(&self, k: &K) -> bool {
        self.set.contains(k)
    }
}

/// A fast hasher for the lookup-only maps of ids (never iterated into output): request ids
/// and UUIDs are already well spread, so a multiply-rotate mix is enough, and SipHash's cost
/// showed in profiles of 10-million-record diffs.
#[derive(Default, Clone, Copy)]
pub(super) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

pub(super) type IdBuildHasher = std::hash::BuildHasherDefault<IdHasher>;
pub(super) type IdMap<K, V> = HashMap<K, V, IdBuildHasher>;

/// How many recently finished ids each side remembers.
pub(super) const RECENT_IDS: usize = 65_536;
