//! Unit tests of the page pool and radix cache (crate-private parts). The core is tested
//! through its public API under `tests/sglang_*.rs`.

use super::radix::{Holder, Kind, KvPool};
use crate::events::Fact;

fn counts(p: &KvPool) -> [u64; 5] {
    p.counts()
}

/// A holder with `n` private pages inserted under hashes `base+1..=base+n` (a root path).
fn cached_path(p: &mut KvPool, base: u64, n: u32) -> Holder {
    let mut h = Holder::new(Kind::Active);
    assert!(p.alloc(&mut h, n));
    let hashes: Vec<u64> = (1..=n as u64).map(|i| base + i).collect();
    let stored = p.insert(&mut h, &hashes, n as usize);
    assert_eq!(stored, Some(Fact::KvStored { parent: None, blocks: hashes }));
    h
}

#[test]
fn eviction_is_lru_and_leaves_first_and_skips_locked_nodes() {
    let mut p = KvPool::new(8);
    let mut a = cached_path(&mut p, 100, 3);
    let mut b = cached_path(&mut p, 200, 3);
    p.release(&mut b); // b released first: least recently used
    p.release(&mut a);
    assert_eq!(counts(&p), [0, 0, 0, 6, 2]);
    let _ = p.take_acc();
    // Lock a's first two pages again (a prefix hit), then ask for 5 pages: 2 free + 3 evicted.
    let mut hit = Holder::new(Kind::Active);
    let m = p.match_prefix(&[101, 102, 103], 2);
    assert_eq!(m.len(), 2);
    p.lock_path(&mut hit, &m);
    let mut fresh = Holder::new(Kind::Active);
    assert!(p.alloc(&mut fresh, 5));
    // b's path goes leaf first (203, 202, 201) — a's tail 103 is newer than all of b.
    assert_eq!(p.removed, vec![203, 202, 201]);
    assert_eq!(p.match_prefix(&[101, 102, 103], 3).len(), 3, "a's unlocked tail survives");
    // One more page can only come from a's unlocked leaf, never from the locked prefix.
    assert!(p.alloc(&mut fresh, 1));
    assert_eq!(p.removed.last(), Some(&103));
    assert!(!p.alloc(&mut fresh, 1), "locked pages are not evictable");
    let acc = p.take_acc();
    assert_eq!(acc.block_sum(), 0);
}

#[test]
fn shared_pages_follow_the_precedence_active_reserved_pinned() {
    let mut p = KvPool::new(4);
    let mut a = cached_path(&mut p, 0, 2);
    let _ = p.take_acc();
    let ids = p.match_prefix(&[1, 2], 2);
    let mut pin = Holder::new(Kind::Pinned);
    p.lock_path(&mut pin, &ids);
    assert_eq!(counts(&p), [2, 0, 0, 0, 2], "active wins over pinned");
    let mut res = Holder::new(Kind::Reserved);
    p.lock_path(&mut res, &ids[..1]);
    p.release(&mut a);
    assert_eq!(counts(&p), [0, 1, 1, 0, 2], "reserved wins over pinned on the shared page");
    p.set_kind(&mut res, Kind::Active);
    assert_eq!(counts(&p), [1, 1, 0, 0, 2]);
    p.release(&mut res);
    p.release(&mut pin);
    assert_eq!(counts(&p), [0, 0, 0, 2, 2]);
    let acc = p.take_acc();
    assert_eq!((acc.active, acc.cached_free, acc.free), (-2, 2, 0));
    assert_eq!(p.audit(std::iter::empty()), counts(&p));
}

#[test]
fn duplicate_insert_adopts_the_cached_page_and_frees_the_copy() {
    let mut p = KvPool::new(6);
    let mut a = cached_path(&mut p, 0, 2);
    let mut b = Holder::new(Kind::Active);
    assert!(p.alloc(&mut b, 3));
    let stored = p.insert(&mut b, &[1, 2, 3], 3);
    assert_eq!(stored, Some(Fact::KvStored { parent: Some(2), blocks: vec![3] }), "only the new page");
    assert_eq!((b.nodes.len(), b.private), (3, 0));
    assert_eq!(counts(&p), [3, 0, 0, 0, 3], "the two copies went back to free");
    assert_eq!(p.audit([&a, &b].into_iter()), counts(&p));
    p.release(&mut a);
    p.release(&mut b);
    assert_eq!(counts(&p), [0, 0, 0, 3, 3]);
}
