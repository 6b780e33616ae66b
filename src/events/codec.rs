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
fn varint(out: &mut Vec<u8>, v: u64) {
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
