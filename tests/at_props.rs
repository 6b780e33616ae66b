//! `at` agrees with folding the whole log up to T, with and without an index, on both layouts.

mod support;

use handoff_ledger::events::index::RunIndex;
use handoff_ledger::events::{write_merged, RunReader};
use handoff_ledger::ids::Role;
use handoff_ledger::projections::at::{parse_time, state_at, AtReport};
use handoff_ledger::projections::capacity::KvCapacitySnapshot;
use handoff_ledger::projections::run::project_capacity;
use handoff_ledger::projections::worker::WorkerFold;
use proptest::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use support::generator::{generate, GenConfig};

struct Fixture {
    _dir: tempfile::TempDir,
    run: PathBuf,
    merged: PathBuf,
    last_at_ns: u64,
    /// Opened once and shared: sled allows one open handle per database.
    run_index: RunIndex,
    merged_index: RunIndex,
}

/// One generated run (about 12 000 records), indexed with a small checkpoint interval so that
/// checkpoints are actually used, plus its merged file, indexed likewise.
fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        generate(&run, &GenConfig { requests: 400, ..GenConfig::default() });
        let merged = dir.path().join("run.hrun");
        write_merged(&run, &merged).unwrap();
        let run_index = RunIndex::build_every::<WorkerFold>(&run, 97).unwrap();
        let merged_index = RunIndex::build_every::<WorkerFold>(&merged, 211).unwrap();
        let mut r = RunReader::open(&run).unwrap();
        let mut last = 0;
        while let Some((_, rec)) = r.next().unwrap() {
            last = last.max(rec.at_ns);
        }
        Fixture { _dir: dir, run, merged, last_at_ns: last, run_index, merged_index }
    })
}

/// The reference: every record in merge order, applied when `at_ns <= t`, plus an independent
/// capacity fold straight from the deltas.
fn naive(run: &Path, t: u64) -> (AtReport, Vec<KvCapacitySnapshot>) {
    let mut r = RunReader::open(run).unwrap();
    let headers = r.headers().to_vec();
    let mut folds: Vec<WorkerFold> = headers.iter().map(WorkerFold::new).collect();
    let mut caps: Vec<KvCapacitySnapshot> =
        headers.iter().map(|h| KvCapacitySnapshot::empty(h.engine.total_blocks as u64)).collect();
    while let Some((i, rec)) = r.next().unwrap() {
        if rec.at_ns <= t {
            let _ = folds[i].apply(&rec);
            if headers[i].worker.role != Role::Router {
                caps[i].apply(&rec.fact.kv_delta()).unwrap();
            }
        }
    }
    (AtReport::from_folds(t, &folds), caps)
}

fn check(run: &Path, t: u64) {
    let (want, caps) = naive(run, t);
    let f = fixture();
    let idx = if run == f.run { &f.run_index } else { &f.merged_index };
    assert!(idx.meta().checkpoints.iter().sum::<u64>() > 20, "checkpoints are exercised");
    let with = state_at(run, t, Some(idx), &mut |_| {}).unwrap();
    let without = state_at(run, t, None, &mut |_| {}).unwrap();
    assert_eq!(with, want, "with index, t={t}");
    assert_eq!(without, want, "without index, t={t}");
    for (w, c) in want.workers.iter().zip(&caps) {
        if let Some(view) = &w.capacity {
            assert_eq!(view.active_blocks, c.active_blocks);
            assert_eq!(view.pinned_source_blocks, c.pinned_source_blocks);
            assert_eq!(view.reserved_destination_blocks, c.reserved_destination_blocks);
            assert_eq!(view.free_blocks, c.free_blocks);
            assert_eq!(view.cached_free_blocks, c.cached_free_blocks);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn at_agrees_with_the_full_fold_directory(frac in 0.0f64..1.02) {
        let f = fixture();
        let t = (f.last_at_ns as f64 * frac) as u64;
        check(&f.run, t);
    }

    #[test]
    fn at_agrees_with_the_full_fold_merged(frac in 0.0f64..1.02) {
        let f = fixture();
        let t = (f.last_at_ns as f64 * frac) as u64;
        check(&f.merged, t);
    }
}

#[test]
fn edges_and_the_end_match_the_capacity_projection() {
    let f = fixture();
    for t in [0, 1, f.last_at_ns - 1, f.last_at_ns, u64::MAX] {
        check(&f.run, t);
        check(&f.merged, t);
    }
    // After the last record: the same as the whole-run capacity projection.
    let idx = &f.run_index;
    let end = state_at(&f.run, u64::MAX, Some(idx), &mut |_| {}).unwrap();
    let rows = project_capacity(&mut RunReader::open(&f.run).unwrap()).unwrap();
    for row in rows {
        let w = end.workers.iter().find(|w| w.worker == row.worker).unwrap();
        let c = w.capacity.unwrap();
        assert_eq!(
            (
                c.active_blocks,
                c.pinned_source_blocks,
                c.reserved_destination_blocks,
                c.free_blocks,
                c.cached_free_blocks
            ),
            (
                row.last.active_blocks,
                row.last.pinned_source_blocks,
                row.last.reserved_destination_blocks,
                row.last.free_blocks,
                row.last.cached_free_blocks
            ),
        );
    }
    // Somewhere in the middle something is held (the property is not vacuous).
    let mid = state_at(&f.run, f.last_at_ns / 2, Some(idx), &mut |_| {}).unwrap();
    let used: u64 = mid.workers.iter().filter_map(|w| w.capacity).map(|c| c.kv_used_blocks).sum();
    let booked: u64 = mid
        .workers
        .iter()
        .filter_map(|w| w.bookings)
        .map(|b| b.booked_prefill_blocks + b.booked_decode_blocks)
        .sum();
    assert!(used > 0 && booked > 0, "used {used} booked {booked}");
}

#[test]
fn time_parsing() {
    assert_eq!(parse_time("12.5"), Ok(12_500_000));
    assert_eq!(parse_time("12.5ms"), Ok(12_500_000));
    assert_eq!(parse_time("12.5s"), Ok(12_500_000_000));
    assert_eq!(parse_time("300us"), Ok(300_000));
    assert_eq!(parse_time("7ns"), Ok(7));
    assert!(parse_time("-1").is_err());
    assert!(parse_time("soon").is_err());
    assert!(parse_time("NaN").is_err());
}
