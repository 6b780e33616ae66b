//! Writes two large equivalent runs (and one perturbed copy is not needed: the figures are for
//! the equivalent case, which reads everything) for measuring the CLI at scale:
//!
//! ```text
//! DIFF_SCALE_DIR=/tmp/big DIFF_SCALE_REQUESTS=357143 \
//!   cargo test --release --test diff_scale -- --ignored --nocapture
//! /usr/bin/time -v target/release/handoff-log diff /tmp/big/a /tmp/big/b
//! target/release/handoff-log index /tmp/big/a
//! /usr/bin/time -v target/release/handoff-log at /tmp/big/a --time 60s
//! ```
//! 357 143 requests × 28 records ≈ 10 million facts per run.

mod support;

use support::generator::{generate, GenConfig};

#[test]
#[ignore]
fn write_large_runs() {
    let Ok(dir) = std::env::var("DIFF_SCALE_DIR") else {
        eprintln!("set DIFF_SCALE_DIR");
        return;
    };
    let requests: u64 =
        std::env::var("DIFF_SCALE_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(357_143);
    let dir = std::path::Path::new(&dir);
    let cfg = GenConfig {
        requests,
        prefill_workers: 4,
        decode_workers: 4,
        total_blocks: 1 << 20,
        ..GenConfig::default()
    };
    let t = std::time::Instant::now();
    let n = generate(&dir.join("a"), &cfg);
    let m =
        generate(&dir.join("b"), &GenConfig { id_seed: cfg.id_seed + 1, time_scale: 1.01, ..cfg.clone() });
    eprintln!("wrote {n} + {m} records in {:?}", t.elapsed());
}
