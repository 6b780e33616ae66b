//! `diff` and `at` on real replay runs (`handoff-log replay`): two replays of one configuration
//! are equivalent, another seed only renames handoffs, vLLM and SGLang orders differ in the
//! right kinds, a perturbed replay record is found, and `at` agrees with the capacity fold.

mod support;

use assert_cmd::Command;
use handoff_ledger::events::{Fact, RunReader};
use handoff_ledger::ids::Role;
use handoff_ledger::projections::at::state_at;
use handoff_ledger::projections::run::project_capacity;
use serde_json::Value;
use std::path::{Path, PathBuf};
use support::generator::{rewrite, Edit};

const TRACE: &str = "fixtures/traces/mooncake-200.jsonl";

fn bin() -> Command {
    let mut c = support::cli();
    c.current_dir(env!("CARGO_MANIFEST_DIR"));
    c
}

fn replay(out: &Path, backend: &str, seed: u64) -> PathBuf {
    bin()
        .args(["replay", TRACE, "--backend", backend, "--prefill", "2", "--decode", "2"])
        .args(["--seed", &seed.to_string()])
        .arg("--out")
        .arg(out)
        .assert()
        .success();
    out.to_path_buf()
}

fn diff_json(a: &Path, b: &Path) -> (i32, Value) {
    let out = bin().arg("diff").arg(a).arg(b).arg("--json").output().unwrap();
    (out.status.code().unwrap_or(-1), serde_json::from_slice(&out.stdout).unwrap())
}

fn count(v: &Value, k: &str) -> u64 {
    v["counts"][k].as_u64().unwrap()
}

#[test]
fn replays_of_one_configuration_are_equivalent_and_backends_differ() {
    let t = tempfile::tempdir().unwrap();
    let a = replay(&t.path().join("a"), "vllm", 3);
    let b = replay(&t.path().join("b"), "vllm", 3);
    let (code, v) = diff_json(&a, &b);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["compared"]["requests"], 200);
    assert_eq!(v["compared"]["handoffs"], 200);
    assert_eq!(v["timing"]["max_diff_pct"], 0.0, "same config, same instants");

    // Another seed: other HandoffIds (matched by request), same projections.
    let c = replay(&t.path().join("c"), "vllm", 4);
    let ids = |p: &Path| {
        let mut r = RunReader::open(p).unwrap();
        let mut v = Vec::new();
        while let Some((_, rec)) = r.next().unwrap() {
            if let Fact::HandoffStarted { handoff, .. } = rec.fact {
                v.push(handoff);
            }
        }
        v
    };
    assert_ne!(ids(&a), ids(&c), "the seed names the handoffs");
    let (code, v) = diff_json(&a, &c);
    assert_eq!(code, 0, "{v}");

    // SGLang reserves the destination before prefill: every handoff's order differs.
    let s = replay(&t.path().join("s"), "sglang", 3);
    let (code, v) = diff_json(&a, &s);
    assert_eq!(code, 1);
    assert_eq!(count(&v, "handoff-sequence"), 200, "{v}");
    assert!(count(&v, "capacity-sequence") >= 1);
    assert_eq!(count(&v, "booking-sequence"), 1);
    let ex = v["examples"].as_array().unwrap().iter().find(|d| d["kind"] == "handoff-sequence").unwrap();
    let detail = ex["detail"].as_str().unwrap();
    assert!(detail.contains("A [SourceHeld"), "{detail}");
    assert!(detail.contains("B [DestinationAccepted, DestinationReserved, SourceHeld"), "{detail}");
}

#[test]
fn a_perturbed_replay_record_is_found() {
    let t = tempfile::tempdir().unwrap();
    let a = replay(&t.path().join("a"), "vllm", 3);
    let b = t.path().join("b");
    // Drop the 50th source release of prefill-1.
    let mut n = 0;
    let mut hit = None;
    rewrite(&a, &b, |w, rec| {
        if w.role == Role::Prefill && w.index == 1 && matches!(rec.fact, Fact::SourceReleased { .. }) {
            n += 1;
            if n == 50 {
                hit = Some(rec.seq);
                return Edit::Drop;
            }
        }
        Edit::Keep
    });
    let seq = hit.unwrap();
    let out = bin().arg("diff").arg(&a).arg(&b).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        stdout.contains(&format!("A: prefill-1 seq {seq} (SourceReleased")),
        "the first divergence names the dropped record:\n{stdout}"
    );
    let (_, v) = diff_json(&a, &b);
    assert_eq!(count(&v, "capacity-sequence"), 1, "{v}");
    assert!(count(&v, "handoff-sequence") >= 1);
    assert_eq!(count(&v, "final-state"), 1, "the pin is never released");
}

#[test]
fn at_agrees_with_the_capacity_fold_on_a_replay() {
    let t = tempfile::tempdir().unwrap();
    let a = replay(&t.path().join("a"), "sglang", 3);
    let end = state_at(&a, u64::MAX, None, &mut |_| {}).unwrap();
    assert!(end.violations.is_empty(), "{:?}", end.violations);
    for row in project_capacity(&mut RunReader::open(&a).unwrap()).unwrap() {
        let w = end.workers.iter().find(|w| w.worker == row.worker).unwrap();
        assert_eq!(w.capacity.unwrap().active_blocks, row.last.active_blocks);
        assert_eq!(w.capacity.unwrap().free_blocks, row.last.free_blocks);
        assert_eq!(w.capacity.unwrap().cached_free_blocks, row.last.cached_free_blocks);
    }
    // With an index: the same answers at a few instants.
    let before: Vec<String> = ["100", "1s", "5s", "20s"]
        .iter()
        .map(|t| {
            String::from_utf8(bin().arg("at").arg(&a).args(["--time", t, "--json"]).output().unwrap().stdout)
                .unwrap()
        })
        .collect();
    bin().arg("index").arg(&a).assert().success();
    let after: Vec<String> = ["100", "1s", "5s", "20s"]
        .iter()
        .map(|t| {
            String::from_utf8(bin().arg("at").arg(&a).args(["--time", t, "--json"]).output().unwrap().stdout)
                .unwrap()
        })
        .collect();
    assert_eq!(before, after);
    assert!(before.iter().all(|s| s.starts_with("{\"time_ns\"")));
}
