//! Step throughput of the SGLang core in simulated tokens per second of wall time.
//!
//! * `decode_heavy`: 256 running requests (512-token prompts, 2,000 output tokens) decoding; each iteration times
//!   `STEPS` decode steps (256 tokens each).
//! * `prefill_heavy`: 64 prompts of 4096 tokens with one output token each, run to completion;
//!   the throughput counts prompt tokens computed.
//! * `decode_step_vs_total_pages`: the same 64-request decode batch on workers of 4,096 and
//!   262,144 pages. Per-step work must follow the running requests, not the pool size, so the two
//!   figures should match.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use handoff_ledger::ids::{RequestId, WorkerId};
use handoff_ledger::schedulers::sglang::{SglangConfig, SglangCore};
use handoff_ledger::schedulers::{EngineCore, Request};
use std::hint::black_box;
use std::time::{Duration, Instant};

const STEPS: u64 = 64;

/// A core with `n` requests admitted, prefilled and decoding.
fn decoding_core(total_pages: u32, n: u64) -> SglangCore {
    let cfg = SglangConfig { total_pages, ..SglangConfig::default() };
    let mut core = SglangCore::new(WorkerId::decode(0), cfg).expect("valid config");
    for i in 0..n {
        core.submit(Request::unique(RequestId(i), 512, 2_000, 0), 0);
    }
    let mut now = 0;
    for _ in 0..1_000 {
        if core.view().running == n {
            return core;
        }
        now += core.step(now).duration_ns;
    }
    panic!("the batch never filled: {:?}", core.view());
}

fn decode_heavy(c: &mut Criterion) {
    let mut g = c.benchmark_group("sglang");
    g.throughput(Throughput::Elements(256 * STEPS));
    g.bench_function("decode_heavy_256x64_steps", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut core = decoding_core(16384, 256);
                let start = Instant::now();
                for s in 0..STEPS {
                    black_box(core.step(s));
                }
                total += start.elapsed();
            }
            total
        })
    });
    g.finish();
}

fn prefill_heavy(c: &mut Criterion) {
    let mut g = c.benchmark_group("sglang");
    g.throughput(Throughput::Elements(64 * 4096));
    g.bench_function("prefill_heavy_64x4096", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut core = SglangCore::new(WorkerId::prefill(0), SglangConfig::default()).expect("valid");
                for i in 0..64 {
                    core.submit(Request::unique(RequestId(i), 4096, 1, 0), 0);
                }
                let start = Instant::now();
                let mut now = 0;
                while !core.is_empty() {
                    now += black_box(core.step(now)).duration_ns;
                }
                total += start.elapsed();
            }
            total
        })
    });
    g.finish();
}

fn decode_vs_pages(c: &mut Criterion) {
    let mut g = c.benchmark_group("sglang_decode_step_vs_total_pages");
    g.throughput(Throughput::Elements(64 * STEPS));
    for pages in [4096u32, 262_144] {
        g.bench_with_input(BenchmarkId::from_parameter(pages), &pages, |b, &pages| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let mut core = decoding_core(pages, 64);
                    let start = Instant::now();
                    for s in 0..STEPS {
                        black_box(core.step(s));
                    }
                    total += start.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = decode_heavy, prefill_heavy, decode_vs_pages
}
criterion_main!(benches);
