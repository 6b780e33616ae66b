//! Any bytes as a frame from a live peer: decodes to an envelope or fails as malformed or
//! another version; what decodes re-encodes to itself.
#![no_main]
use handoff_ledger::runtime::Envelope;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(e) = Envelope::decode(data) {
        let mut again = Vec::new();
        e.encode(&mut again).expect("a decoded envelope encodes");
        assert_eq!(Envelope::decode(&again).expect("re-encoded bytes decode"), e);
    }
});
