//! Offline replay speed: the committed 200-request Mooncake sample on 2 prefill + 2 decode
//! workers, both backends, logs written to a fresh temporary directory each iteration (the
//! log writing is part of what a replay costs). Throughput is in trace requests per second.
//! `vllm_stepwise` turns off the coalescing of quiet decode steps (one event per step), to show
//! what that saves.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use handoff_ledger::adapters::replay::config::ReplayConfig;
use handoff_ledger::adapters::replay::engine::Replay;
use handoff_ledger::adapters::replay::trace::{TraceOptions, TraceReader};
use handoff_ledger::ids::Backend;
use std::hint::black_box;
use std::io::{BufRead, Cursor};
use std::path::{Path, PathBuf};

const TRACE: &str = "fixtures/traces/mooncake-200.jsonl";
const REQUESTS: u64 = 200;

fn trace_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(TRACE)
}

fn config(backend: Backend, coalesce: bool) -> ReplayConfig {
    ReplayConfig {
        backend,
        prefill_workers: 2,
        decode_workers: 2,
        coalesce_quiet_steps: coalesce,
        ..ReplayConfig::default()
    }
}

/// One full replay of the in-memory trace into `out`; returns the events handled.
fn replay(trace: &[u8], backend: Backend, coalesce: bool, out: &Path) -> u64 {
    let reader: Box<dyn BufRead> = Box::new(Cursor::new(trace.to_vec()));
    let trace = TraceReader::new(reader, trace_path(), TraceOptions::default()).expect("trace");
    let outcome = Replay::new(config(backend, coalesce), trace, out, None)
        .expect("replay setup")
        .run()
        .expect("replay run");
    assert!(outcome.drained, "replay did not drain: {:?}", outcome.stuck);
    outcome.events
}

fn bench_replay(c: &mut Criterion) {
    let trace = std::fs::read(trace_path()).expect("fixture trace");
    let mut g = c.benchmark_group("replay_mooncake200_2p2d");
    g.sample_size(10);
    g.throughput(Throughput::Elements(REQUESTS));
    let cases = [
        ("vllm", Backend::Vllm, true),
        ("vllm_stepwise", Backend::Vllm, false),
        ("sglang", Backend::Sglang, true),
    ];
    for (name, backend, coalesce) in cases {
        g.bench_function(name, |b| {
            b.iter_batched(
                || tempfile::tempdir().expect("temp dir"),
                |dir| {
                    let events = replay(&trace, backend, coalesce, dir.path());
                    black_box(events);
                    dir
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench_replay);
criterion_main!(benches);
