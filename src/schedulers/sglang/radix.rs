//! The page pool and radix prefix cache, with per-class accounting.
//!
//! One node per page, keyed by its chained page hash (the hash covers the parent, so a hash names
//! a whole prefix); a node also records its parent and child count, which is all eviction needs.
//! Edges are not compressed: with pages of 64 tokens a node per page is cheap and keeps locking
//! and eviction exact at page granularity.
//!
//! ## Ownership and classes
//! A *holder* (a request, a reservation or a pinned source) owns a root path of tree nodes plus
//! some *private* pages that are in no tree (the prompt's partial last page, decode growth, or a
//! reservation's unpublished delta pages). A holder locks every node on its path, by kind, so an
//! unlocked node never has a locked descendant and every unlocked node is evictable (leaves
//! first, least recently used first).
//!
//! A node shared by several holders is counted in exactly one class, by precedence
//! **active > reserved_destination > pinned_source > cached_free**: a page a running request
//! reads is in use for compute whatever else holds it; a reservation's page becomes active on
//! activation anyway; a pin only keeps a page from eviction, the weakest claim. When a lock or
//! unlock changes a node's class, the move is recorded in the pending delta (`acc`), which the
//! core attaches to the fact that caused it.
//!
//! ## Hash index
//! hash → node is intrusive: a fixed bucket array (twice the page count) holds each chain's first
//! node and nodes link to their chain neighbours, so evicting a node (the most frequent index
//! operation in a replay) unlinks it with writes only. Never iterated into output.

use crate::events::{BlockHash, Fact, KvDelta};
use crate::schedulers::prefetch::prefetch;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

pub(crate) type NodeId = u32;

/// No node (an empty bucket, a chain's end).
const NIL: u32 = u32::MAX;

/// Physical class of a page; exactly one per page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    Active = 0,
    Pinned = 1,
    Reserved = 2,
    CachedFree = 3,
    Free = 4,
}

/// What a holder is; the class its exclusive pages count in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Active = 0,
    Reserved = 1,
    Pinned = 2,
}

impl Kind {
    pub(crate) fn class(self) -> Class {
        match self {
            Kind::Active => Class::Active,
            Kind::Reserved => Class::Reserved,
            Kind::Pinned => Class::Pinned,
        }
    }
}

/// Class of a node with these lock counts (indexed by `Kind`), by the precedence above.
fn class_of(locks: &[u32; 3]) -> Class {
    if locks[Kind::Active as usize] > 0 {
        Class::Active
    } else if locks[Kind::Reserved as usize] > 0 {
        Class::Reserved
    } else if locks[Kind::Pinned as usize] > 0 {
        Class::Pinned
    } else {
        Class::CachedFree
    }
}

#[derive(Clone, Debug)]
struct Node {
    hash: BlockHash,
    parent: Option<NodeId>,
    children: u32,
    locks: [u32; 3],
    /// Last touch, for LRU eviction.
    tick: u64,
    live: bool,
    /// Hash-chain links (valid while live): `hprev` is `NIL` for the first node of its bucket.
    hprev: u32,
    hnext: u32,
}

impl Node {
    fn unlocked(&self) -> bool {
        self.locks == [0, 0, 0]
    }
}

/// Pages one owner holds: a locked root path in the tree, plus private pages.
#[derive(Clone, Debug)]
pub(crate) struct Holder {
    pub nodes: Vec<NodeId>,
    pub private: u32,
    pub kind: Kind,
}

impl Holder {
    pub(crate) fn new(kind: Kind) -> Self {
        Holder { nodes: Vec::new(), private: 0, kind }
    }
    pub(crate) fn pages(&self) -> u32 {
        self.nodes.len() as u32 + self.private
    }
}

pub(crate) struct KvPool {
    total: u32,
    nodes: Vec<Node>,
    spare_ids: Vec<NodeId>,
    /// Hash index (module docs): bucket → first live node of its chain, or `NIL`.
    heads: Vec<u32>,
    /// `64 − log2(heads.len())`.
    bucket_shift: u32,
    /// Live nodes (= index entries).
    indexed: usize,
    /// Unlocked leaves by (last touch, id), smallest first: the eviction order. A min-heap
    /// with lazy deletion: locking a leaf leaves its entry behind, and an entry counts only
    /// while its node is live, an unlocked leaf, and still has that tick (ticks are unique and
    /// every lock or unlock renews a node's tick, so a stale entry never matches again). So
    /// the smallest valid entry is exactly what an ordered set of the evictable leaves would
    /// give, without a tree insertion per unlock. Compacted when stale entries pile up, so its
    /// size stays bounded by the node count.
    evictable: BinaryHeap<Reverse<(u64, NodeId)>>,
    tick: u64,
    free_pages: u32,
    counts: [u64; 5],
    /// Class moves not yet attached to a fact.
    pub acc: KvDelta,
    /// Hashes evicted and not yet reported in a `KvRemoved` fact.
    pub removed: Vec<BlockHash>,
    /// Rises whenever a page becomes available (freed or cached-free) from a held class.
    pub freed_epoch: u64,
}

impl KvPool {
    pub(crate) fn new(total: u32) -> Self {
        let mut counts = [0u64; 5];
        counts[Class::Free as usize] = total as u64;
        // A live node holds a page: twice as many buckets keeps the load at or under a half.
        let buckets = (2 * total as u64).next_power_of_two().max(2);
        KvPool {
            total,
            nodes: Vec::new(),
            spare_ids: Vec::new(),
            heads: vec![NIL; buckets as usize],
            bucket_shift: 64 - buckets.trailing_zeros(),
            indexed: 0,
            evictable: BinaryHeap::new(),
            tick: 0,
            free_pages: total,
            counts,
            acc: KvDelta::ZERO,
            removed: Vec::new(),
            freed_epoch: 0,
        }
    }

    pub(crate) fn counts(&self) -> [u64; 5] {
        self.counts
    }

    /// Pages an allocation may use: free plus every unlocked cached page.
    pub(crate) fn available(&self) -> u64 {
        self.counts[Class::Free as usize] + self.counts[Class::CachedFree as usize]
    }

    pub(crate) fn take_acc(&mut self) -> KvDelta {
        std::mem::replace(&mut self.acc, KvDelta::ZERO)
    }

    fn move_class(&mut self, from: Class, to: Class, n: u32) {
        if n == 0 || from == to {
            return;
        }
        self.counts[from as usize] -= n as u64;
        self.counts[to as usize] += n as u64;
        let n = n as i32;
        for (c, s) in [(from, -n), (to, n)] {
            match c {
                Class::Active => self.acc.active += s,
                Class::Pinned => self.acc.pinned_source += s,
                Class::Reserved => self.acc.reserved_destination += s,
                Class::CachedFree => self.acc.cached_free += s,
                Class::Free => self.acc.free += s,
            }
        }
        let avail = |c: Class| matches!(c, Class::CachedFree | Class::Free);
        if avail(to) && !avail(from) {
            self.freed_epoch += 1;
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn bucket(&self, hash: BlockHash) -> usize {
        // Fibonacci hashing: the top bits of the product spread any key.
        (hash.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.bucket_shift) as usize
    }

    /// The live node with this hash, if any.
    fn find(&self, hash: BlockHash) -> Option<NodeId> {
        let mut id = self.heads[self.bucket(hash)];
        while id != NIL {
            let n = &self.nodes[id as usize];
            if n.hash == hash {
                return Some(id);
            }
            id = n.hnext;
        }
        None
    }

    /// Starts loading `hash`'s bucket (a few pages before it is looked up).
    fn prefetch_bucket(&self, hash: BlockHash) {
        prefetch(&self.heads[self.bucket(hash)]);
    }

    /// Starts loading the first node of `hash`'s chain (its bucket should be cached by now).
    fn prefetch_chain(&self, hash: BlockHash) {
        if let Some(n) = self.nodes.get(self.heads[self.bucket(hash)] as usize) {
            prefetch(n);
        }
    }

    /// Links live node `id` first in its hash's chain.
    fn index_insert(&mut self, id: NodeId) {
        let k = self.bucket(self.nodes[id as usize].hash);
        let head = self.heads[k];
        let n = &mut self.nodes[id as usize];
        n.hprev = NIL;
        n.hnext = head;
        if head != NIL {
            self.nodes[head as usize].hprev = id;
        }
        self.heads[k] = id;
        self.indexed += 1;
    }

    /// Unlinks node `id` from its chain: writes to its neighbours (or the bucket) only.
    fn index_remove(&mut self, id: NodeId) {
        let (hash, p, n) = {
            let x = &self.nodes[id as usize];
            (x.hash, x.hprev, x.hnext)
        };
        if p == NIL {
            let k = self.bucket(hash);
            self.heads[k] = n;
        } else {
            self.nodes[p as usize].hnext = n;
        }
        if n != NIL {
            self.nodes[n as usize].hprev = p;
        }
        self.indexed -= 1;
    }

    /// The longest cached root path along `hashes`, at most `max_pages` long.
    pub(crate) fn match_prefix(&self, hashes: &[BlockHash], max_pages: usize) -> Vec<NodeId> {
        let mut out = Vec::new();
        let mut parent = None;
        for h in hashes.iter().take(max_pages) {
            match self.find(*h) {
                Some(id) if self.nodes[id as usize].parent == parent => {
                    out.push(id);
                    parent = Some(id);
                }
                _ => break,
            }
        }
        out
    }

    /// How many of these nodes no holder locks (locking them takes them out of `available`).
    pub(crate) fn unlocked_count(&self, ids: &[NodeId]) -> u64 {
        ids.iter().filter(|&&id| self.nodes[id as usize].unlocked()).count() as u64
    }

    fn lock(&mut self, id: NodeId, kind: Kind) {
        let t = self.next_tick();
        let n = &mut self.nodes[id as usize];
        let old = class_of(&n.locks);
        // An evictable leaf's heap entry goes stale here (its tick changes below).
        n.locks[kind as usize] += 1;
        n.tick = t;
        let new = class_of(&n.locks);
        self.move_class(old, new, 1);
    }

    fn unlock(&mut self, id: NodeId, kind: Kind) {
        let t = self.next_tick();
        let n = &mut self.nodes[id as usize];
        let old = class_of(&n.locks);
        n.locks[kind as usize] = n.locks[kind as usize].saturating_sub(1);
        n.tick = t;
        let new = class_of(&n.locks);
        if n.unlocked() && n.children == 0 {
            self.push_evictable(t, id);
        }
        self.move_class(old, new, 1);
    }

    fn push_evictable(&mut self, tick: u64, id: NodeId) {
        if self.evictable.len() >= 2 * self.nodes.len() + 64 {
            let nodes = &self.nodes;
            self.evictable.retain(|&Reverse((t, i))| Self::evictable_entry(nodes, t, i));
        }
        self.evictable.push(Reverse((tick, id)));
    }

    fn evictable_entry(nodes: &[Node], tick: u64, id: NodeId) -> bool {
        nodes.get(id as usize).is_some_and(|n| n.live && n.unlocked() && n.children == 0 && n.tick == tick)
    }

    /// The least recently touched unlocked leaf, taken out of the eviction order.
    fn pop_evictable(&mut self) -> Option<NodeId> {
        while let Some(Reverse((t, id))) = self.evictable.pop() {
            if Self::evictable_entry(&self.nodes, t, id) {
                return Some(id);
            }
        }
        None
    }

    /// Locks `ids` (a root path continuing the holder's own) for the holder.
    pub(crate) fn lock_path(&mut self, h: &mut Holder, ids: &[NodeId]) {
        for &id in ids {
            self.lock(id, h.kind);
            h.nodes.push(id);
        }
    }

    /// Evicts `n` unlocked leaves, least recently used first. False if there were too few.
    fn evict(&mut self, n: u64) -> bool {
        for _ in 0..n {
            let Some(id) = self.pop_evictable() else {
                return false;
            };
            let node = &mut self.nodes[id as usize];
            node.live = false;
            let (hash, parent) = (node.hash, node.parent);
            self.index_remove(id);
            self.removed.push(hash);
            if let Some(p) = parent {
                let pn = &mut self.nodes[p as usize];
                pn.children -= 1;
                if pn.children == 0 && pn.unlocked() {
                    let t = pn.tick;
                    self.push_evictable(t, p);
                }
            }
            self.spare_ids.push(id);
            self.free_pages += 1;
            self.move_class(Class::CachedFree, Class::Free, 1);
        }
        true
    }

    /// Gives the holder `n` fresh private pages, evicting cached pages if free ones run out.
    pub(crate) fn alloc(&mut self, h: &mut Holder, n: u32) -> bool {
        if n as u64 > self.available() {
            return false;
        }
        if n > self.free_pages && !self.evict((n - self.free_pages) as u64) {
            return false;
        }
        self.free_pages -= n;
        h.private += n;
        self.move_class(Class::Free, h.kind.class(), n);
        true
    }

    /// Frees `n` of the holder's private pages without caching them.
    pub(crate) fn free_private(&mut self, h: &mut Holder, n: u32) {
        let n = n.min(h.private);
        h.private -= n;
        self.free_pages += n;
        self.move_class(h.kind.class(), Class::Free, n);
    }

    /// Turns the holder's private pages into tree nodes up to `upto` pages (hashes from
    /// `hashes`). A page whose hash is already cached is a duplicate: the holder locks the cached
    /// node and its own copy is freed. Returns the `KvStored` fact for the nodes that are new.
    pub(crate) fn insert(&mut self, h: &mut Holder, hashes: &[BlockHash], upto: usize) -> Option<Fact> {
        let mut stored = Vec::new();
        let mut stored_parent = None;
        // The hashes are known ahead: prefetch buckets, then chain heads, a few pages ahead.
        const BUCKET_AHEAD: usize = 12;
        const CHAIN_AHEAD: usize = 6;
        let end = upto.min(hashes.len());
        let first = h.nodes.len().min(end);
        for &hash in &hashes[first..(first + BUCKET_AHEAD).min(end)] {
            self.prefetch_bucket(hash);
        }
        while h.nodes.len() < end && h.private > 0 {
            let k = h.nodes.len();
            if k + BUCKET_AHEAD < end {
                self.prefetch_bucket(hashes[k + BUCKET_AHEAD]);
            }
            if k + CHAIN_AHEAD < end {
                self.prefetch_chain(hashes[k + CHAIN_AHEAD]);
            }
            let hash = hashes[h.nodes.len()];
            let parent = h.nodes.last().copied();
            match self.find(hash) {
                Some(id) => {
                    if self.nodes[id as usize].parent != parent {
                        break; // a 64-bit hash collision: keep the page private
                    }
                    self.lock(id, h.kind);
                    h.nodes.push(id);
                    self.free_private(h, 1);
                }
                None => {
                    let t = self.next_tick();
                    let mut locks = [0; 3];
                    locks[h.kind as usize] = 1;
                    let node = Node {
                        hash,
                        parent,
                        children: 0,
                        locks,
                        tick: t,
                        live: true,
                        hprev: NIL,
                        hnext: NIL,
                    };
                    let id = match self.spare_ids.pop() {
                        Some(id) => {
                            self.nodes[id as usize] = node;
                            id
                        }
                        None => {
                            self.nodes.push(node);
                            (self.nodes.len() - 1) as NodeId
                        }
                    };
                    if let Some(p) = parent {
                        // The parent is on the holder's locked path, so never in `evictable`.
                        self.nodes[p as usize].children += 1;
                    }
                    self.index_insert(id);
                    if stored.is_empty() {
                        stored_parent = parent.map(|p| self.nodes[p as usize].hash);
                    }
                    stored.push(hash);
                    // Private page of this kind → node of this kind: the class is unchanged.
                    h.private -= 1;
                    h.nodes.push(id);
                }
            }
        }
        (!stored.is_empty()).then_some(Fact::KvStored { parent: stored_parent, blocks: stored })
    }

    /// Unlocks the holder's nodes (they stay cached) and frees its private pages.
    pub(crate) fn release(&mut self, h: &mut Holder) {
        // Leaves first, so the eviction order follows the path from the tip.
        while let Some(id) = h.nodes.pop() {
            self.unlock(id, h.kind);
        }
        let p = h.private;
        self.free_private(h, p);
    }

    /// Re-labels a holder (reserved → active, active → pinned), moving shared pages' classes by
    /// the precedence rule.
    pub(crate) fn set_kind(&mut self, h: &mut Holder, kind: Kind) {
        if h.kind == kind {
            return;
        }
        for i in 0..h.nodes.len() {
            let id = h.nodes[i];
            self.lock(id, kind);
            self.unlock(id, h.kind);
        }
        self.move_class(h.kind.class(), kind.class(), h.private);
        h.kind = kind;
    }

    /// Recounts classes from scratch: lock counts are rebuilt from the holders (not read from
    /// the nodes), node classes follow from them, private pages are summed by kind, and free
    /// pages come from the allocator's own count.
    pub(crate) fn audit<'a>(&self, holders: impl Iterator<Item = &'a Holder>) -> [u64; 5] {
        let mut locks: HashMap<NodeId, [u32; 3]> = HashMap::new();
        let mut counts = [0u64; 5];
        for h in holders {
            for &id in &h.nodes {
                locks.entry(id).or_default()[h.kind as usize] += 1;
            }
            counts[h.kind.class() as usize] += h.private as u64;
        }
        for (id, n) in self.nodes.iter().enumerate() {
            if n.live {
                let l = locks.get(&(id as NodeId)).copied().unwrap_or([0; 3]);
                counts[class_of(&l) as usize] += 1;
            }
        }
        counts[Class::Free as usize] += self.free_pages as u64;
        counts
    }

    pub(crate) fn total(&self) -> u32 {
        self.total
    }

    /// Nodes currently cached (tests).
    #[allow(dead_code)]
    pub(crate) fn cached_nodes(&self) -> usize {
        self.indexed
    }
}
