//! The library diff: the lockstep fallback (taken when one run gets far ahead of the other on
//! a worker) gives the same report as the merge-order walk, on equivalent and different runs.

mod support;

use handoff_ledger::events::{Fact, KvDelta, TerminalStatus};
use handoff_ledger::ids::{HandoffPolicy, RequestId, Role};
use handoff_ledger::projections::diff::{diff_runs, DiffKind, DiffOptions, DiffReport};
use std::path::Path;
use support::generator::{generate, rewrite, Edit, GenConfig};

fn report(a: &Path, b: &Path, queue_limit: usize) -> DiffReport {
    diff_runs(a, b, &DiffOptions { queue_limit, ..DiffOptions::default() }, &mut |_| {}).unwrap()
}

fn same_either_way(a: &Path, b: &Path) -> DiffReport {
    let walk = report(a, b, DiffOptions::default().queue_limit);
    // A limit of 0 defers every worker to the lockstep comparison.
    let lockstep = report(a, b, 0);
    assert_eq!(walk.counts, lockstep.counts);
    assert_eq!(walk.equivalent, lockstep.equivalent);
    assert_eq!(walk.compared, lockstep.compared);
    assert_eq!(walk.first.as_ref().map(|f| &f.difference), lockstep.first.as_ref().map(|f| &f.difference));
    assert_eq!(
        walk.first.as_ref().map(|f| (&f.context_a, &f.context_b)),
        lockstep.first.as_ref().map(|f| (&f.context_a, &f.context_b)),
    );
    walk
}

#[test]
fn fallback_agrees_with_the_walk() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a");
    generate(&a, &GenConfig::default());
    let b = t.path().join("b");
    generate(&b, &GenConfig { id_seed: 3, time_scale: 1.5, ..GenConfig::default() });
    let r = same_either_way(&a, &b);
    assert!(r.equivalent);
    assert_eq!(r.counts[&DiffKind::Timing], 120);

    let c = t.path().join("c");
    generate(&c, &GenConfig { policy: HandoffPolicy::DestinationFirst, ..GenConfig::default() });
    let r = same_either_way(&a, &c);
    assert!(!r.equivalent);

    let d = t.path().join("d");
    rewrite(&a, &d, |w, rec| match &rec.fact {
        Fact::RequestFinished { request, output_tokens, kv, status }
            if w.role == Role::Decode && *request == RequestId(11) =>
        {
            Edit::Replace(Fact::RequestFinished {
                request: *request,
                status: if *status == TerminalStatus::Completed { TerminalStatus::Canceled } else { *status },
                output_tokens: *output_tokens,
                kv: KvDelta { slots: 0, ..*kv },
            })
        }
        _ => Edit::Keep,
    });
    let r = same_either_way(&a, &d);
    assert_eq!(r.counts[&DiffKind::CapacitySequence], 1);
    assert_eq!(r.counts[&DiffKind::FinalState], 1, "a slot never returned");
    let f = r.first.unwrap();
    assert_eq!(f.difference.kind, DiffKind::CapacitySequence);
    // The context shows the divergent record, marked, with records before and after it.
    let i = f.context_a.iter().position(|c| c.divergent).unwrap();
    assert!(i >= 1 && i + 1 < f.context_a.len(), "{i} of {}", f.context_a.len());
    assert_eq!(f.context_a[i].record.fact.name(), "RequestFinished");
}

/// The generator every diff / at / index test uses writes sound runs.
#[test]
fn generated_runs_are_sound_and_drain() {
    use handoff_ledger::events::verify_run;
    use handoff_ledger::projections::at::state_at;
    for policy in [HandoffPolicy::SourceFirst, HandoffPolicy::DestinationFirst] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = GenConfig { policy, requests: 200, ..GenConfig::default() };
        let n = generate(dir.path(), &cfg);
        let summary = verify_run(dir.path()).unwrap();
        assert_eq!(summary.records, n);
        let end = state_at(dir.path(), u64::MAX, None, &mut |_| {}).unwrap();
        assert!(end.violations.is_empty(), "{:?}", end.violations);
        for w in &end.workers {
            if let Some(c) = &w.capacity {
                assert_eq!(c.kv_used_blocks, 0, "{} not drained", w.worker);
                assert_eq!(c.request_slots_used, 0);
            }
            if let Some(q) = &w.queues {
                assert_eq!(q.waiting + q.running + q.held_prefills, 0, "{}", w.worker);
            }
        }
    }
}
