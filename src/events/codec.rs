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

/// Decodes one value that must fill `bytes` exactly.
pub fn decode_exact<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    let (value, used) = bincode::serde::decode_from_slice(bytes, config()).map_err(|e| e.to_string())?;
    if used != bytes.len() {
        return Err(format!("{} trailing bytes after the value", bytes.len() - used));
    }
    Ok(value)
}
