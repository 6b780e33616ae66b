//! Fold, diff and `at` throughput on generated runs.
//!
//! `cargo bench --bench fold -- --warm-up-time 1 --measurement-time 5`
//! The run size is `FOLD_BENCH_REQUESTS` requests (default 20 000, about 560 000 records per
//! run; each request writes 28 records). Throughput is reported in records/s: for `diff`, the
//! records of both runs.
//!
//! The 10-million-fact figures come from the CLI on runs written by the ignored test
//! `tests/diff_scale.rs` (see there), measured with `/usr/bin/time -v` for peak RSS.

#[path = "../tests/support/mod.rs"]
mod support;

use criterion::{black_box, Criterion, Throughput};
use handoff_ledger::events::index::RunIndex;
use handoff_ledger::events::RunReader;
use handoff_ledger::projections::at::state_at;
use handoff_ledger::projections::diff::{diff_runs, DiffOptions};
use handoff_ledger::projections::run::project_capacity;
use handoff_ledger::projections::worker::WorkerFold;
use support::generator::{generate, GenConfig};

fn main() {
    let requests: u64 =
        std::env::var("FOLD_BENCH_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let dir = tempfile::tempdir().expect("temp dir");
    let cfg = GenConfig {
        requests,
        prefill_workers: 4,
        decode_workers: 4,
        total_blocks: 1 << 20,
        ..GenConfig::default()
    };
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    let records = generate(&a, &cfg);
    generate(&b, &GenConfig { id_seed: cfg.id_seed + 1, ..cfg.clone() });
    eprintln!("generated two runs of {records} records each");
    let mut c = Criterion::default().configure_from_args().sample_size(10);
    {
        let mut g = c.benchmark_group("fold");
        g.throughput(Throughput::Elements(records));
        g.bench_function("capacity_fold", |bench| {
            bench.iter(|| {
                let mut run = RunReader::open(&a).expect("open");
                black_box(project_capacity(&mut run).expect("fold"))
            })
        });
        g.throughput(Throughput::Elements(records * 2));
        g.bench_function("diff_equivalent_runs", |bench| {
            bench.iter(|| {
                let r = diff_runs(&a, &b, &DiffOptions::default(), &mut |_| {}).expect("diff");
                assert!(r.equivalent);
                black_box(r)
            })
        });
        g.finish();
    }
    {
        let idx = RunIndex::build::<WorkerFold>(&a).expect("index");
        let mut last = 0;
        let mut run = RunReader::open(&a).expect("open");
        while let Ok(Some((_, rec))) = run.next() {
            last = rec.at_ns;
        }
        let mut g = c.benchmark_group("at");
        g.throughput(Throughput::Elements(1));
        g.bench_function("at_with_index_mid_run", |bench| {
            bench.iter(|| black_box(state_at(&a, last / 2, Some(&idx), &mut |_| {}).expect("at")))
        });
        g.bench_function("at_without_index_mid_run", |bench| {
            bench.iter(|| black_box(state_at(&a, last / 2, None, &mut |_| {}).expect("at")))
        });
        g.finish();
    }
    c.final_summary();
}
