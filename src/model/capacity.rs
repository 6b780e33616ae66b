//! `KvCapacitySnapshot`: physical KV ownership per worker, folded from its facts.

use crate::model::delta::KvDelta;
use serde::{Deserialize, Serialize};

/// A worker's physical KV at one instant. The five block classes are mutually exclusive and sum
/// to `total_blocks`; request slots and decode headroom sit beside them, never in the sum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvCapacitySnapshot {
    pub active_blocks: u64,
    pub pinned_source_blocks: u64,
    pub reserved_destination_blocks: u64,
    pub cached_free_blocks: u64,
    pub free_blocks: u64,
    pub total_blocks: u64,
    /// Request slots in use (running sequences, or SGLang's slot pool incl. reservations).
    pub request_slots_used: u64,
    /// Decode headroom tokens promised to reservations (admission-only).
    pub decode_headroom_tokens: u64,
}

/// A delta would take a class below zero: the facts contradict each other.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("capacity delta {delta} applied to {before} leaves a class negative or breaks conservation")]
pub struct CapacityViolation {
    pub before: KvCapacitySnapshot,
    pub delta: KvDelta,
}

/// `active=3 pinned=0 reserved=0 cached_free=1 free=6 total=10 slots=1 headroom=0`.
impl std::fmt::Display for KvCapacitySnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "active={} pinned={} reserved={} cached_free={} free={} total={} slots={} headroom={}",
            self.active_blocks,
            self.pinned_source_blocks,
            self.reserved_destination_blocks,
            self.cached_free_blocks,
            self.free_blocks,
            self.total_blocks,
            self.request_slots_used,
            self.decode_headroom_tokens
        )
    }
}

impl KvCapacitySnapshot {
    /// The delta that frees everything this holds: every block in use or cached back to free,
    /// every slot and headroom token given back (what a dead process's pool becomes in the
    /// process that succeeds it). `None` when a class does not fit a delta.
    pub fn release_all(&self) -> Option<KvDelta> {
        let count = |v: u64| i32::try_from(v).ok();
        let (active, pinned, reserved, cached) = (
            count(self.active_blocks)?,
            count(self.pinned_source_blocks)?,
            count(self.reserved_destination_blocks)?,
            count(self.cached_free_blocks)?,
        );
        Some(KvDelta {
            active: -active,
            pinned_source: -pinned,
            reserved_destination: -reserved,
            cached_free: -cached,
            free: active.checked_add(pinned)?.checked_add(reserved)?.checked_add(cached)?,
            slots: -count(self.request_slots_used)?,
            headroom_tokens: -count(self.decode_headroom_tokens)?,
        })
    }

    /// Whether every block is free or cached and no slot or headroom is held.
    pub fn is_drained(&self) -> bool {
        self.kv_used_blocks() == 0 && self.request_slots_used == 0 && self.decode_headroom_tokens == 0
    }

    /// A fresh worker: everything free.
    pub fn empty(total_blocks: u64) -> Self {
        KvCapacitySnapshot { free_blocks: total_blocks, total_blocks, ..Default::default() }
    }

    /// `active + pinned + reserved`: what the proposal calls physical unavailability.
    pub fn kv_used_blocks(&self) -> u64 {
        self.active_blocks + self.pinned_source_blocks + self.reserved_destination_blocks
    }

    /// The conservation law.
    pub fn is_conserved(&self) -> bool {
        self.kv_used_blocks() + self.cached_free_blocks + self.free_blocks == self.total_blocks
    }

    /// Applies one delta; refuses (leaving `self` unchanged) if a class would go negative or the
    /// delta does not conserve blocks.
    pub fn apply(&mut self, d: &KvDelta) -> Result<(), CapacityViolation> {
        fn add(v: u64, d: i32) -> Option<u64> {
            if d >= 0 {
                v.checked_add(d as u64)
            } else {
                v.checked_sub(d.unsigned_abs() as u64)
            }
        }
        let bad = || CapacityViolation { before: *self, delta: *d };
        if d.block_sum() != 0 {
            return Err(bad());
        }
        let next = KvCapacitySnapshot {
            active_blocks: add(self.active_blocks, d.active).ok_or_else(bad)?,
            pinned_source_blocks: add(self.pinned_source_blocks, d.pinned_source).ok_or_else(bad)?,
            reserved_destination_blocks: add(self.reserved_destination_blocks, d.reserved_destination)
                .ok_or_else(bad)?,
            cached_free_blocks: add(self.cached_free_blocks, d.cached_free).ok_or_else(bad)?,
            free_blocks: add(self.free_blocks, d.free).ok_or_else(bad)?,
            total_blocks: self.total_blocks,
            request_slots_used: add(self.request_slots_used, d.slots).ok_or_else(bad)?,
            decode_headroom_tokens: add(self.decode_headroom_tokens, d.headroom_tokens).ok_or_else(bad)?,
        };
        *self = next;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_moves_between_classes_and_refuses_overdraw() {
        let mut s = KvCapacitySnapshot::empty(10);
        s.apply(&KvDelta { free: -4, active: 4, slots: 1, ..KvDelta::ZERO }).unwrap();
        s.apply(&KvDelta { active: -4, pinned_source: 4, slots: -1, ..KvDelta::ZERO }).unwrap();
        assert_eq!(s.pinned_source_blocks, 4);
        assert_eq!(s.kv_used_blocks(), 4);
        assert!(s.is_conserved());
        let before = s;
        assert!(s.apply(&KvDelta { active: -1, free: 1, ..KvDelta::ZERO }).is_err());
        assert!(s.apply(&KvDelta { free: -1, ..KvDelta::ZERO }).is_err(), "not conserved");
        assert_eq!(s, before);
    }

    #[test]
    fn release_all_leaves_an_empty_pool() {
        let mut s = KvCapacitySnapshot::empty(10);
        s.apply(&KvDelta {
            free: -7,
            active: 3,
            pinned_source: 2,
            cached_free: 2,
            slots: 2,
            ..KvDelta::ZERO
        })
        .unwrap();
        s.apply(&KvDelta { headroom_tokens: 40, ..KvDelta::ZERO }).unwrap();
        s.apply(&s.release_all().unwrap()).unwrap();
        assert_eq!(s, KvCapacitySnapshot::empty(10));
        let huge = KvCapacitySnapshot { active_blocks: u64::MAX, ..KvCapacitySnapshot::empty(0) };
        assert_eq!(huge.release_all(), None);
    }
}
