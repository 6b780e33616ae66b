//! Engine core step throughput, in simulated tokens per wall-clock second.
//!
//! Each iteration clones a prepared core and runs a fixed number of steps; the throughput unit
//! is the simulated tokens those steps compute (prefill chunk tokens + one per decode).
//! `decode_heavy/*_blocks` runs the same workload on pools of very different sizes: per-step
//! work must depend on the running requests, not on the number of blocks.

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use handoff_ledger::events::Fact;
use handoff_ledger::ids::{Backend, RequestId, WorkerId};
use handoff_ledger::schedulers::vllm::{VllmConfig, VllmCore};
use handoff_ledger::schedulers::{EngineCore, Request};
use std::hint::black_box;

// ---------------------------------------------------------------- vLLM-like core

/// 256 running requests with short prompts and outputs longer than the measured window.
fn vllm_decode_core(blocks: u32) -> VllmCore {
    let cfg = VllmConfig { num_gpu_blocks: blocks, ..VllmConfig::default() };
    let mut core = VllmCore::new(WorkerId::decode(0), Backend::Vllm, cfg).expect("config");
    for i in 0..256u64 {
        let r = core.submit(Request::unique(RequestId(i), 128, 1_000_000, 0), 0);
        assert!(r.outcome.is_ok());
    }
    let mut now = 0;
    while core.view().running < 256 || core.view().waiting > 0 {
        now += core.step(now).duration_ns.max(1);
    }
    core
}

/// 64 unique 8192-token prompts, one output token each: every step is a full prefill budget.
fn vllm_prefill_core() -> VllmCore {
    let mut core = VllmCore::new(WorkerId::prefill(0), Backend::Vllm, VllmConfig::default()).expect("config");
    for i in 0..64u64 {
        let r = core.submit(Request::unique(RequestId(i), 8192, 1, 0), 0);
        assert!(r.outcome.is_ok());
    }
    core
}

/// Runs `steps` steps; returns the simulated tokens computed.
fn run_steps(core: &mut VllmCore, steps: usize) -> u64 {
    let mut now = 0u64;
    let mut tokens = 0u64;
    for _ in 0..steps {
        let out = core.step(now);
        now += out.duration_ns.max(1);
        for f in &out.effects.facts {
            if let Fact::StepExecuted { prefill_tokens, decode_tokens, .. } = f {
                tokens += *prefill_tokens as u64 + *decode_tokens as u64;
            }
        }
    }
    tokens
}

fn bench_vllm(c: &mut Criterion) {
    const DECODE_STEPS: usize = 512;
    let mut g = c.benchmark_group("vllm/decode_heavy");
    for blocks in [16_384u32, 1_048_576] {
        let base = vllm_decode_core(blocks);
        let tokens = run_steps(&mut base.clone(), DECODE_STEPS);
        assert_eq!(tokens, 256 * DECODE_STEPS as u64);
        g.throughput(Throughput::Elements(tokens));
        g.bench_with_input(BenchmarkId::new("256_running", format!("{blocks}_blocks")), &base, |b, base| {
            b.iter_batched(
                || base.clone(),
                |mut core| {
                    black_box(run_steps(&mut core, DECODE_STEPS));
                    core // dropped outside the timed region
                },
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();

    let mut g = c.benchmark_group("vllm/prefill_heavy");
    let base = vllm_prefill_core();
    let tokens = run_steps(&mut base.clone(), 64);
    assert_eq!(tokens, 64 * 8192);
    g.throughput(Throughput::Elements(tokens));
    g.bench_function("64x8192_prompts", |b| {
        b.iter_batched(
            || base.clone(),
            |mut core| {
                black_box(run_steps(&mut core, 64));
                core
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(name = benches; config = Criterion::default().sample_size(20); targets = bench_vllm);
criterion_main!(benches);
