//! A change of physical KV ownership, by class: what every block-moving fact carries.

use serde::{Deserialize, Serialize};

/// A change of physical ownership, by class. Block classes are mutually exclusive:
/// `active + pinned_source + reserved_destination + cached_free + free == total` always.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvDelta {
    /// Blocks owned by running / waiting-with-KV requests (and activated destinations).
    pub active: i32,
    /// Blocks held by a finished prefill for a handoff reader.
    pub pinned_source: i32,
    /// Blocks reserved on a decode worker for an incoming handoff, not yet valid.
    pub reserved_destination: i32,
    /// Unreferenced blocks that still hold a hash and can be reused or evicted.
    pub cached_free: i32,
    /// Unreferenced blocks with no content.
    pub free: i32,
    /// Request slots taken (+) or returned (-). Not blocks; never in the block sum.
    pub slots: i32,
    /// Decode headroom tokens promised (+) or given back (-). Admission-only, never allocated.
    pub headroom_tokens: i32,
}

/// `active+4,free-4`: the classes that move, with signs (`0` when nothing moves).
impl std::fmt::Display for KvDelta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts = [
            ("active", self.active),
            ("pinned_source", self.pinned_source),
            ("reserved_destination", self.reserved_destination),
            ("cached_free", self.cached_free),
            ("free", self.free),
            ("slots", self.slots),
            ("headroom_tokens", self.headroom_tokens),
        ];
        let mut moved = parts.iter().filter(|(_, v)| *v != 0).peekable();
        if moved.peek().is_none() {
            return f.write_str("0");
        }
        for (i, (name, v)) in moved.enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{name}{v:+}")?;
        }
        Ok(())
    }
}

impl KvDelta {
    pub const ZERO: KvDelta = KvDelta {
        active: 0,
        pinned_source: 0,
        reserved_destination: 0,
        cached_free: 0,
        free: 0,
        slots: 0,
        headroom_tokens: 0,
    };

    /// The block classes' sum, which conservation requires to be zero.
    pub fn block_sum(&self) -> i64 {
        self.active as i64
            + self.pinned_source as i64
            + self.reserved_destination as i64
            + self.cached_free as i64
            + self.free as i64
    }

    pub fn is_zero(&self) -> bool {
        *self == KvDelta::ZERO
    }

    /// Component-wise sum.
    pub fn plus(self, o: KvDelta) -> KvDelta {
        KvDelta {
            active: self.active + o.active,
            pinned_source: self.pinned_source + o.pinned_source,
            reserved_destination: self.reserved_destination + o.reserved_destination,
            cached_free: self.cached_free + o.cached_free,
            free: self.free + o.free,
            slots: self.slots + o.slots,
            headroom_tokens: self.headroom_tokens + o.headroom_tokens,
        }
    }
}
