//! A replay whose logs cannot be written stops with an error naming the file, whichever thread
//! met it: facts are written on the log writer's thread, and its error must reach the caller.
//! (Every starting stream is created, header on disk, before the run begins; a worker that joins
//! mid-run gets its file then, which is where this test makes writing fail.)

use handoff_ledger::adapters::replay::config::ReplayConfig;
use handoff_ledger::adapters::replay::engine::{Replay, ReplayError};
use handoff_ledger::adapters::replay::trace::{TraceOptions, TraceReader};
use handoff_ledger::ids::Backend;
use std::io::{BufRead, BufReader};
use std::path::Path;

#[test]
fn a_log_that_cannot_be_written_stops_the_replay_with_the_file_named() {
    let trace_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/traces/mooncake-200.jsonl");
    for backend in [Backend::Vllm, Backend::Sglang] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        let reader: Box<dyn BufRead> = Box::new(BufReader::new(std::fs::File::open(&trace_path).unwrap()));
        let trace = TraceReader::new(reader, &trace_path, TraceOptions::default()).unwrap();
        // A decode worker joins at 1 s: its stream is created then, on the writer's thread.
        let cfg: ReplayConfig = serde_json::from_value(serde_json::json!({
            "backend": backend,
            "prefill_workers": 2,
            "decode_workers": 2,
            "scale": [{"at_ms": 1000, "decode": 1}],
        }))
        .unwrap();
        let replay = Replay::new(cfg, trace, &out, None).unwrap();
        // The starting workers' streams exist from the start (headers on disk): replace the run
        // directory by a plain file, so creating the joining worker's stream fails even for a
        // privileged user.
        std::fs::remove_dir_all(&out).unwrap();
        std::fs::write(&out, b"not a directory").unwrap();
        match replay.run() {
            Err(ReplayError::Log(e)) => {
                let msg = e.to_string();
                assert!(msg.contains(".hlog"), "{backend:?}: the error names the stream file: {msg}");
            }
            Err(other) => panic!("{backend:?}: expected a log error, got {other}"),
            Ok(_) => panic!("{backend:?}: the replay succeeded without anywhere to write"),
        }
    }
}
