//! Any bytes as a trace (format sniffed): every line reads or fails naming the file, no panic,
//! memory bounded by the input.
#![no_main]
use handoff_ledger::adapters::replay::trace::{TraceOptions, TraceReader};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let options = TraceOptions { format: None, speedup: 1.0 };
    let Ok(reader) = TraceReader::new(std::io::Cursor::new(data), "fuzz.trace", options) else { return };
    for item in reader {
        match item {
            Ok(request) => {
                let _ = request.to_request();
            }
            Err(e) => {
                assert!(e.to_string().starts_with("fuzz.trace"), "{e}");
                break;
            }
        }
    }
});
