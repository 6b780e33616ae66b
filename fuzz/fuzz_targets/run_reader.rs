//! Any bytes as a merged run file: verify and read it in merge order; no panic, no hang.
#![no_main]
use handoff_ledger::events::RunReader;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(dir) = tempfile::tempdir() else { return };
    let path = dir.path().join("run.hlog");
    if std::fs::write(&path, data).is_err() {
        return;
    }
    let _ = handoff_ledger::events::verify_run_with::<handoff_ledger::events::LogError>(&path, |_, _| Ok(()));
    let Ok(mut reader) = RunReader::open(&path) else { return };
    while let Ok(Some(_)) = reader.next_record() {}
});
