//! Any bytes as one stream file: the header and every record read or fail with an error that
//! names the stream; no panic, no hang, memory bounded by the input.
#![no_main]
use handoff_ledger::events::StreamReader;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(mut reader) = StreamReader::new(std::io::Cursor::new(data), "fuzz.hlog") else { return };
    loop {
        match reader.next_record() {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(e) => {
                assert!(e.to_string().contains("fuzz.hlog"), "{e}");
                break;
            }
        }
    }
});
