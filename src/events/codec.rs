//! The one place that knows how facts and headers become bytes.
//!
//! bincode 2.0.1 (3.0.0 is a tombstone that does not compile) with one explicit configuration:
//! little-endian, variable-length integers, no size limit beyond the record length the framing
//! already bounds. The configuration's id is written in every stream header ([`CODEC_ID`]), so a
//! reader refuses bytes written under another configuration instead of misreading them.

use serde::{de::DeserializeOwned, Serialize};

/// Codec id 1: bincode 2.0.1, serde, standard config (little-endian, varint).
pub const CODEC_ID: u16 = 1;

fn config() -> bincode::config::Configuration {
    bincode::config::standard()
}

/// Appends the encoding of `value` to `out`.
pub fn encode_into<T: Serialize>(value: &T, out: &mut Vec<u8>) -> Result<(), String> {
    bincode::serde::encode_into_std_write(value, out, config()).map(|_| ()).map_err(|e| e.to_string())
}

/// Appends the encoding of one fact to `out`: the same bytes as [`encode_into`], with the
/// most frequent fact (one per engine step, ~80% of a replay's records) written directly
/// instead of through serde. A property test holds the two byte-for-byte equal.
pub fn encode_fact_into(fact: &crate::events::Fact, out: &mut Vec<u8>) -> Result<(), String> {
    use crate::events::Fact;
    match fact {
        Fact::StepExecuted { prefill_tokens, decode_tokens, batch_size, duration_ns, kv } => {
            varint(out, STEP_EXECUTED_VARIANT);
            varint(out, *prefill_tokens as u64);
            varint(out, *decode_tokens as u64);
            varint(out, *batch_size as u64);
            varint(out, *duration_ns);
            for v in [
                kv.active,
                kv.pinned_source,
                kv.reserved_destination,
                kv.cached_free,
                kv.free,
                kv.slots,
                kv.headroom_tokens,
            ] {
                // Signed integers are zig-zag mapped, then written as unsigned.
                varint(out, ((v << 1) ^ (v >> 31)) as u32 as u64);
            }
            Ok(())
        }
        other => encode_into(other, out),
    }
}

/// `Fact::StepExecuted`'s variant index (its place in the enum).
const STEP_EXECUTED_VARIANT: u64 = 8;

/// bincode's variable-length unsigned integer: one byte below 251, else a marker byte (251,
/// 252, 253 for 2, 4, 8 bytes) followed by the value in little-endian.
#[inline(always)]
pub(crate) fn varint(out: &mut Vec<u8>, v: u64) {
    if v < 251 {
        out.push(v as u8);
    } else if v <= u16::MAX as u64 {
        out.push(251);
        out.extend_from_slice(&(v as u16).to_le_bytes());
    } else if v <= u32::MAX as u64 {
        out.push(252);
        out.extend_from_slice(&(v as u32).to_le_bytes());
    } else {
        out.push(253);
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// `Fact::KvStored`'s and `Fact::KvRemoved`'s variant indexes.
const KV_STORED_VARIANT: u64 = 10;
const KV_REMOVED_VARIANT: u64 = 11;

/// Entries a stream-local block-hash table holds before the writer starts a new epoch (and
/// both sides forget it). Bounds memory on both sides: about 2.3 MiB per writer, 2 MiB per reader.
pub const HASH_TABLE_ENTRIES: usize = 262_144;

/// The writer's side of a stream's block-hash table (format v2). Every hash written in full
/// gets the next entry number on both sides; a hash written again is a reference to an entry.
///
/// The writer does not look every hash up: a map holding every hash of a long run costs a
/// cache miss or two per hash (most of a replay's writer time when it was tried). Instead it
/// keeps the entries in order and a small direct-mapped cache of *anchors* (the first and last
/// hash of each stored list and every [`ANCHOR_EVERY`]th), and it tries the entries next to the
/// last one used before the cache: hashes stored together are mostly removed together, in the same or the
/// reverse order, so a removal finds an anchor once and walks its neighbours from there. A hash
/// neither finds is written in full again (a new entry): lossless, only longer.
pub(crate) struct HashTableWriter {
    /// Direct-mapped by the hash's top bits, `(hash, entry)`, (0, 0) empty: a newer anchor takes
    /// an older one's slot. Small enough to stay in a core's cache, which a map of every anchor
    /// did not (its inserts were a sixth of a replay's writer time).
    anchors: Vec<(u64, u32)>,
    /// Entry number → hash.
    order: Vec<u64>,
    /// The entry referenced or added last: references are written relative to the one after it,
    /// so a run of neighbours costs a byte per hash.
    last: i64,
}

/// The most entries a valid epoch can hold: the writer ends an epoch at a block's end once the
/// table is full, and one block can add a 9-byte entry per 9 bytes of its payload (a single
/// huge `KvStored` included). More is damage; the bound keeps a reader's table finite.
const MAX_READER_ENTRIES: usize = HASH_TABLE_ENTRIES + crate::events::MAX_RECORD_BYTES / 9;

/// Hashes one block can add (a 64 KiB block of 9-byte hashes), over the table's limit.
const ORDER_SLACK: usize = 8 << 10;

/// Anchor slots per stream: 2^this.
const ANCHOR_SLOT_BITS: u32 = 14;

/// Of a stored list's hashes, every this many is an anchor (besides its first and last).
const ANCHOR_EVERY: usize = 8;

/// The reader's side: entry number → hash, rebuilt while reading the epoch in order.
#[derive(Clone)]
pub(crate) struct HashTableReader {
    hashes: Vec<u64>,
    last: i64,
}

impl Default for HashTableWriter {
    fn default() -> Self {
        HashTableWriter { anchors: Vec::new(), order: Vec::new(), last: -1 }
    }
}

impl Default for HashTableReader {
    fn default() -> Self {
        HashTableReader { hashes: Vec::new(), last: -1 }
    }
}

impl HashTableWriter {
    /// Entries in the epoch so far.
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }

    pub(crate) fn clear(&mut self) {
        self.anchors.clear();
        self.anchors.resize(1 << ANCHOR_SLOT_BITS, (0, 0));
        self.order.clear();
        // The epoch ends at a block's end once the table is full, so it overshoots by at most a
        // block's hashes: reserved exactly, rather than doubled past the limit when it does.
        self.order.reserve_exact(HASH_TABLE_ENTRIES + ORDER_SLACK);
        self.last = -1;
    }

    fn slot(hash: u64) -> usize {
        (hash >> (64 - ANCHOR_SLOT_BITS)) as usize
    }

    fn reference(&mut self, out: &mut Vec<u8>, id: i64) {
        let d = id - (self.last + 1);
        varint(out, ((d << 1) ^ (d >> 63)) as u64 + 1);
        self.last = id;
    }

    /// The entry holding `hash` among the last one's neighbours, else among the anchors.
    fn find(&self, hash: u64, look_up: bool) -> Option<i64> {
        for guess in [self.last + 1, self.last - 1] {
            if usize::try_from(guess).ok().and_then(|g| self.order.get(g)) == Some(&hash) {
                return Some(guess);
            }
        }
        if !look_up {
            return None;
        }
        match self.anchors.get(Self::slot(hash)) {
            Some(&(h, id)) if h == hash && hash != 0 => Some(id as i64),
            _ => None,
        }
    }

    /// Writes `hash` as a reference when it can be found, else in full (`0` then 8 bytes LE) as
    /// a new entry, an anchor if `anchor`. A reference is 1 + the zig-zag distance from the
    /// entry after the last one used. Stored hashes skip the anchor map (`look_up` false): they
    /// are mostly new, and a miss there is what costs.
    fn put(&mut self, out: &mut Vec<u8>, hash: u64, look_up: bool, anchor: bool) {
        if let Some(id) = self.find(hash, look_up) {
            self.reference(out, id);
            return;
        }
        let id = self.order.len() as u32;
        self.order.push(hash);
        if anchor {
            if let Some(slot) = self.anchors.get_mut(Self::slot(hash)) {
                *slot = (hash, id);
            }
        }
        out.push(0);
        out.extend_from_slice(&hash.to_le_bytes());
        self.last = id as i64;
    }

    fn put_stored(&mut self, out: &mut Vec<u8>, blocks: &[u64]) {
        let n = blocks.len();
        for (i, b) in blocks.iter().enumerate() {
            self.put(out, *b, false, i == 0 || i + 1 == n || i % ANCHOR_EVERY == 0);
        }
    }
}

impl HashTableReader {
    pub(crate) fn clear(&mut self) {
        self.hashes.clear();
        self.last = -1;
    }

    fn get(&mut self, bytes: &[u8], at: &mut usize) -> Result<u64, String> {
        let tag = read_varint(bytes, at)?;
        if tag == 0 {
            let raw = bytes.get(*at..*at + 8).ok_or("block hash cut short")?;
            *at += 8;
            let hash = u64::from_le_bytes(raw.try_into().expect("8 bytes"));
            if self.hashes.len() >= MAX_READER_ENTRIES {
                return Err(format!("block-hash table over {MAX_READER_ENTRIES} entries in one epoch"));
            }
            self.last = self.hashes.len() as i64;
            self.hashes.push(hash);
            return Ok(hash);
        }
        let z = tag - 1;
        let d = (z >> 1) as i64 ^ -((z & 1) as i64);
        let id = (self.last + 1).checked_add(d).ok_or("block-hash reference overflows")?;
        match usize::try_from(id).ok().and_then(|i| self.hashes.get(i)) {
            Some(&hash) => {
                self.last = id;
                Ok(hash)
            }
            None => Err(format!("reference to block-hash entry {id}, the table holds {}", self.hashes.len())),
        }
    }
}

/// Appends one fact in format v2's encoding: bincode ([`encode_fact_into`]) for every fact but
/// the two that carry block hashes, whose hashes go through the stream's table.
pub(crate) fn encode_fact_v2(
    fact: &crate::events::Fact,
    table: &mut HashTableWriter,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    use crate::events::Fact;
    match fact {
        Fact::KvStored { parent, blocks } => {
            varint(out, KV_STORED_VARIANT);
            match parent {
                None => out.push(0),
                Some(p) => {
                    out.push(1);
                    table.put(out, *p, true, true);
                }
            }
            varint(out, blocks.len() as u64);
            table.put_stored(out, blocks);
            Ok(())
        }
        Fact::KvRemoved { blocks } => {
            varint(out, KV_REMOVED_VARIANT);
            varint(out, blocks.len() as u64);
            for b in blocks {
                table.put(out, *b, true, true);
            }
            Ok(())
        }
        other => encode_fact_into(other, out),
    }
}

/// Decodes one fact written by [`encode_fact_v2`]; it must fill `bytes` exactly.
pub(crate) fn decode_fact_v2(
    bytes: &[u8],
    table: &mut HashTableReader,
) -> Result<crate::events::Fact, String> {
    use crate::events::Fact;
    let mut at = 0;
    let variant = read_varint(bytes, &mut at)?;
    let fact = match variant {
        KV_STORED_VARIANT => {
            let parent = match bytes.get(at) {
                Some(0) => {
                    at += 1;
                    None
                }
                Some(1) => {
                    at += 1;
                    Some(table.get(bytes, &mut at)?)
                }
                Some(other) => return Err(format!("bad parent tag {other}")),
                None => return Err("fact cut short".into()),
            };
            let blocks = read_hashes(bytes, &mut at, table)?;
            Fact::KvStored { parent, blocks }
        }
        KV_REMOVED_VARIANT => Fact::KvRemoved { blocks: read_hashes(bytes, &mut at, table)? },
        _ => return decode_exact(bytes),
    };
    if at != bytes.len() {
        return Err(format!("{} trailing bytes after the value", bytes.len() - at));
    }
    Ok(fact)
}

fn read_hashes(bytes: &[u8], at: &mut usize, table: &mut HashTableReader) -> Result<Vec<u64>, String> {
    let n = read_varint(bytes, at)?;
    // Every hash takes at least a byte: a count beyond what is left is damage, and believing it
    // would allocate without bound.
    if n > (bytes.len() - *at) as u64 {
        return Err(format!("{n} block hashes declared, {} bytes left", bytes.len() - *at));
    }
    (0..n).map(|_| table.get(bytes, at)).collect()
}

/// Reads one bincode-style varint (see [`varint`]).
pub(crate) fn read_varint(bytes: &[u8], at: &mut usize) -> Result<u64, String> {
    let first = *bytes.get(*at).ok_or("value cut short")?;
    *at += 1;
    let width = match first {
        0..=250 => return Ok(first as u64),
        251 => 2,
        252 => 4,
        253 => 8,
        other => return Err(format!("bad integer marker {other}")),
    };
    let raw = bytes.get(*at..*at + width).ok_or("value cut short")?;
    *at += width;
    let mut b = [0u8; 8];
    b[..width].copy_from_slice(raw);
    Ok(u64::from_le_bytes(b))
}

/// Decodes one value from the head of `bytes`, returning it and the bytes it used (the rest
/// is left unread: a reader can look at a leading field before trusting the whole).
pub fn decode_prefix<T: DeserializeOwned>(bytes: &[u8]) -> Result<(T, usize), String> {
    bincode::serde::decode_from_slice(bytes, config()).map_err(|e| e.to_string())
}

/// Decodes one value that must fill `bytes` exactly.
pub fn decode_exact<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    let (value, used) = bincode::serde::decode_from_slice(bytes, config()).map_err(|e| e.to_string())?;
    if used != bytes.len() {
        return Err(format!("{} trailing bytes after the value", bytes.len() - used));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{Fact, KvDelta};
    use proptest::prelude::*;

    fn edge_u32() -> impl Strategy<Value = u32> {
        prop_oneof![Just(0u32), Just(250), Just(251), Just(65535), Just(65536), Just(u32::MAX), any::<u32>()]
    }
    fn edge_u64() -> impl Strategy<Value = u64> {
        prop_oneof![
            Just(0u64),
            Just(250),
            Just(251),
            Just(65535),
            Just(65536),
            Just(u32::MAX as u64),
            Just(u32::MAX as u64 + 1),
            Just(u64::MAX),
            any::<u64>()
        ]
    }
    fn edge_i32() -> impl Strategy<Value = i32> {
        prop_oneof![Just(0i32), Just(-1), Just(125), Just(-126), Just(i32::MIN), Just(i32::MAX), any::<i32>()]
    }

    fn hash_fact() -> impl Strategy<Value = Fact> {
        // A small pool of hashes so references, repeats and both directions of distance occur.
        let hash = prop_oneof![0u64..40, Just(u64::MAX), any::<u64>()];
        prop_oneof![
            (prop::option::of(hash.clone()), prop::collection::vec(hash.clone(), 0..20))
                .prop_map(|(parent, blocks)| Fact::KvStored { parent, blocks }),
            prop::collection::vec(hash, 0..20).prop_map(|blocks| Fact::KvRemoved { blocks }),
            Just(Fact::KvCleared),
        ]
    }

    proptest! {
        /// A stream of hash-carrying facts through the v2 table decodes back to itself, and
        /// the tables' variant numbers are the enum's (bincode decodes the rest).
        #[test]
        fn v2_hash_table_round_trips(facts in prop::collection::vec(hash_fact(), 1..30)) {
            let mut w = HashTableWriter::default();
            w.clear();
            let mut r = HashTableReader::default();
            for fact in &facts {
                let mut bytes = Vec::new();
                encode_fact_v2(fact, &mut w, &mut bytes).unwrap();
                prop_assert_eq!(&decode_fact_v2(&bytes, &mut r).unwrap(), fact);
                let mut v1 = Vec::new();
                encode_into(fact, &mut v1).unwrap();
                prop_assert_eq!(v1[0], bytes[0]);
            }
        }

        /// Damaged v2 bytes are an error, never a panic or a huge allocation.
        #[test]
        fn v2_damage_is_an_error(facts in prop::collection::vec(hash_fact(), 1..10), flip in any::<(usize, u8)>()) {
            let mut w = HashTableWriter::default();
            w.clear();
            let mut all = Vec::new();
            for fact in &facts {
                let mut bytes = Vec::new();
                encode_fact_v2(fact, &mut w, &mut bytes).unwrap();
                all.push(bytes);
            }
            let k = flip.0 % all.len();
            let i = flip.0 % all[k].len();
            all[k][i] ^= flip.1.max(1);
            let mut r = HashTableReader::default();
            for bytes in &all {
                let _ = decode_fact_v2(bytes, &mut r);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
        /// The direct encoding of a step is exactly bincode's, and decodes back to the fact.
        #[test]
        fn step_fast_path_is_bincode_byte_for_byte(
            p in edge_u32(), d in edge_u32(), b in edge_u32(), dur in edge_u64(),
            k in prop::array::uniform7(edge_i32()),
        ) {
            let fact = Fact::StepExecuted {
                prefill_tokens: p,
                decode_tokens: d,
                batch_size: b,
                duration_ns: dur,
                kv: KvDelta {
                    active: k[0],
                    pinned_source: k[1],
                    reserved_destination: k[2],
                    cached_free: k[3],
                    free: k[4],
                    slots: k[5],
                    headroom_tokens: k[6],
                },
            };
            let mut fast = Vec::new();
            encode_fact_into(&fact, &mut fast).unwrap();
            let mut slow = Vec::new();
            encode_into(&fact, &mut slow).unwrap();
            prop_assert_eq!(&fast, &slow);
            prop_assert_eq!(decode_exact::<Fact>(&fast).unwrap(), fact);
        }
    }
}
