//! Router and trace-reader throughput on the public Mooncake conversation trace (skipped where
//! `../shared/traces` is absent). Run: `cargo bench --bench router`.
//!
//! * `trace/read_full`: stream and convert all 12,031 requests.
//! * `router/kv_select_and_index`: the per-request router work of a 4-worker KV-aware replay —
//!   prompt hashes at block size 64, overlap lookup, selection, booking, then the chosen worker's
//!   `KvStored` for the prompt and the booking freed — over the whole trace. Each worker keeps at
//!   most 16,384 blocks (the reference's `num_gpu_blocks`), evicting its oldest with `KvRemoved`,
//!   as a real worker's cache would; the index size stays bounded by that.

use criterion::{criterion_group, criterion_main, Criterion};
use handoff_ledger::adapters::replay::trace::{TraceOptions, TraceReader};
use handoff_ledger::events::{Fact, TerminalStatus};
use handoff_ledger::ids::WorkerId;
use handoff_ledger::router::{Router, RouterMode};
use handoff_ledger::schedulers::request::Request;
use std::path::{Path, PathBuf};

fn trace_path() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces/mooncake/conversation_trace.jsonl");
    p.exists().then_some(p)
}

fn load(path: &Path) -> Vec<Request> {
    TraceReader::open(path, TraceOptions::default())
        .expect("trace opens")
        .map(|r| r.expect("trace is valid").to_request())
        .collect()
}

fn kv_replay(requests: &[Request]) -> usize {
    let workers: Vec<WorkerId> = (0..4).map(WorkerId::decode).collect();
    let mut rt = Router::new(workers, RouterMode::kv(), 64, 1).expect("router");
    let mut hits = 0usize;
    const CAPACITY: usize = 16_384;
    let mut resident: Vec<std::collections::VecDeque<u64>> = vec![Default::default(); 4];
    for r in requests {
        let hashes = r.prompt_block_hashes(64);
        let s = rt.select_with_hashes(r.input_tokens, &hashes);
        hits += s.overlap_blocks as usize;
        let f = rt.book_decode(r.id, s.worker, rt.prompt_blocks(r.input_tokens)).expect("fresh request");
        std::hint::black_box(f);
        let fifo = &mut resident[s.worker.index as usize];
        let fresh: Vec<u64> = hashes[s.overlap_blocks as usize..].to_vec();
        fifo.extend(fresh.iter().copied());
        rt.observe(s.worker, &Fact::KvStored { parent: None, blocks: fresh });
        if fifo.len() > CAPACITY {
            let old: Vec<u64> = fifo.drain(..fifo.len() - CAPACITY).collect();
            rt.observe(s.worker, &Fact::KvRemoved { blocks: old });
        }
        rt.free_decode(r.id, TerminalStatus::Completed);
    }
    hits
}

fn benches(c: &mut Criterion) {
    let Some(path) = trace_path() else {
        eprintln!("skipping: ../shared/traces/mooncake/conversation_trace.jsonl not found");
        return;
    };
    c.bench_function("trace/read_full", |b| b.iter(|| load(&path).len()));
    let requests = load(&path);
    c.bench_function("router/kv_select_and_index", |b| b.iter(|| kv_replay(&requests)));
}

criterion_group! {
    name = group;
    config = Criterion::default().sample_size(10);
    targets = benches
}
criterion_main!(group);
