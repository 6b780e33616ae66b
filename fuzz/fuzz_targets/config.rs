//! Any bytes as a replay configuration: parse, then validate; never a panic.
#![no_main]
use handoff_ledger::adapters::replay::config::ReplayConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(config) = serde_json::from_slice::<ReplayConfig>(data) {
        let _ = config.validate();
    }
});
