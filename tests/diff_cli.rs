//! `handoff-log diff` on generated runs: equivalence, perturbations located at the record,
//! different policies, unusable input, both layouts.

mod support;

use handoff_ledger::events::{write_merged, Fact, KvDelta, TerminalStatus};
use handoff_ledger::ids::{HandoffPolicy, RequestId, Role, WorkerId};
use predicates::prelude::*;
use serde_json::Value;
use std::path::Path;
use support::cli;
use support::generator::{generate, rewrite, Edit, GenConfig};

fn diff_json(a: &Path, b: &Path, extra: &[&str]) -> (i32, Value) {
    let out = cli().arg("diff").arg(a).arg(b).arg("--json").args(extra).output().unwrap();
    let code = out.status.code().unwrap_or(-1);
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)));
    (code, v)
}

fn count(v: &Value, kind: &str) -> u64 {
    v["counts"][kind].as_u64().unwrap_or(u64::MAX)
}

#[test]
fn identical_runs_are_equivalent() {
    let t = tempfile::tempdir().unwrap();
    let cfg = GenConfig::default();
    generate(&t.path().join("a"), &cfg);
    generate(&t.path().join("b"), &cfg);
    cli()
        .arg("diff")
        .arg(t.path().join("a"))
        .arg(t.path().join("b"))
        .assert()
        .code(0)
        .stdout(predicate::str::starts_with("EQUIVALENT"));
    let (code, v) = diff_json(&t.path().join("a"), &t.path().join("b"), &[]);
    assert_eq!(code, 0);
    assert_eq!(v["equivalent"], true);
    assert_eq!(v["compared"]["requests"], 40);
    assert_eq!(v["compared"]["handoffs"], 40);
    assert!(v["compared"]["capacity_transitions"].as_u64().unwrap() > 100);
}

#[test]
fn other_seed_and_small_time_drift_are_equivalent_large_drift_is_timing_only() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a");
    generate(&a, &GenConfig::default());
    // Another seed: every HandoffId differs; handoffs match by request.
    let b = t.path().join("b");
    generate(&b, &GenConfig { id_seed: 1234, time_scale: 1.03, ..GenConfig::default() });
    let (code, v) = diff_json(&a, &b, &[]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(count(&v, "timing"), 0);
    assert!(v["timing"]["max_diff_pct"].as_f64().unwrap() > 2.0);
    // 20% slower: reported as timing, still equivalent unless strict.
    let c = t.path().join("c");
    generate(&c, &GenConfig { time_scale: 1.2, ..GenConfig::default() });
    let (code, v) = diff_json(&a, &c, &[]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(count(&v, "timing"), 120, "40 pins + 40 TTFT + 40 E2E");
    let (code, _) = diff_json(&a, &c, &["--strict-timing"]);
    assert_eq!(code, 1);
    let (code, v) = diff_json(&a, &c, &["--timing-tolerance", "25"]);
    assert_eq!((code, count(&v, "timing")), (0, 0));
}

/// Copies `a` to `b` with one record edited; returns the original (worker, seq) of the record.
fn perturb(a: &Path, b: &Path, pick: impl Fn(WorkerId, &Fact) -> Option<Edit>) -> (WorkerId, u64) {
    let mut hit = None;
    rewrite(a, b, |w, rec| {
        if hit.is_none() {
            if let Some(e) = pick(w, &rec.fact) {
                hit = Some((w, rec.seq));
                return e;
            }
        }
        Edit::Keep
    });
    hit.expect("the record to perturb exists")
}

fn first_divergence(stdout: &str) -> (String, String, String) {
    let lines: Vec<&str> = stdout.lines().collect();
    let i = lines
        .iter()
        .position(|l| l.starts_with("first divergence:"))
        .unwrap_or_else(|| panic!("no first divergence in:\n{stdout}"));
    (lines[i].to_string(), lines[i + 1].to_string(), lines[i + 2].to_string())
}

#[test]
fn changed_capacity_delta_is_reported_at_that_record() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a");
    let b = t.path().join("b");
    generate(&a, &GenConfig::default());
    let (w, seq) = perturb(&a, &b, |w, f| match f {
        Fact::RequestFinished { request, status, output_tokens, kv }
            if w.role == Role::Decode && *request == RequestId(5) =>
        {
            Some(Edit::Replace(Fact::RequestFinished {
                request: *request,
                status: *status,
                output_tokens: *output_tokens,
                kv: KvDelta { active: kv.active + 1, free: kv.free - 1, ..*kv },
            }))
        }
        _ => None,
    });
    let out = cli().arg("diff").arg(&a).arg(&b).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let (head, la, lb) = first_divergence(&stdout);
    assert_eq!(head, format!("first divergence: capacity-sequence on worker {w}"));
    assert!(la.starts_with(&format!("  A: {w} seq {seq} (RequestFinished")), "{la}");
    assert!(lb.starts_with(&format!("  B: {w} seq {seq} (RequestFinished")), "{lb}");
    assert!(stdout.contains("  A:>> "), "{stdout}");
    let (_, v) = diff_json(&a, &b, &[]);
    assert_eq!(count(&v, "capacity-sequence"), 1, "{v}");
    assert_eq!(count(&v, "final-state"), 1, "one block never returned");
    assert_eq!(count(&v, "handoff-sequence"), 0);
    assert_eq!(count(&v, "request-outcome"), 0);
}

#[test]
fn dropped_fact_is_reported_at_that_record() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a");
    let b = t.path().join("b");
    generate(&a, &GenConfig::default());
    let (w, seq) = perturb(&a, &b, |_, f| match f {
        Fact::SourcePinned { request, .. } if *request == RequestId(3) => Some(Edit::Drop),
        _ => None,
    });
    let out = cli().arg("diff").arg(&a).arg(&b).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let (head, la, _) = first_divergence(&stdout);
    assert_eq!(head, format!("first divergence: capacity-sequence on worker {w}"));
    assert!(la.starts_with(&format!("  A: {w} seq {seq} (SourcePinned")), "{la}");
    let (_, v) = diff_json(&a, &b, &[]);
    assert_eq!(count(&v, "capacity-sequence"), 1, "{v}");
    assert_eq!(count(&v, "handoff-sequence"), 1, "r3 lost its SourceHeld: {v}");
    let ex = v["examples"].as_array().unwrap().iter().find(|d| d["kind"] == "handoff-sequence").unwrap();
    assert_eq!(ex["subject"], "handoff of r3 (attempt 0)");
}

#[test]
fn changed_status_is_reported_at_that_record() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a");
    let b = t.path().join("b");
    generate(&a, &GenConfig::default());
    let (w, seq) = perturb(&a, &b, |w, f| match f {
        Fact::RequestFinished { request, output_tokens, kv, .. }
            if w == WorkerId::ROUTER && *request == RequestId(4) =>
        {
            Some(Edit::Replace(Fact::RequestFinished {
                request: *request,
                status: TerminalStatus::Failed,
                output_tokens: *output_tokens,
                kv: *kv,
            }))
        }
        _ => None,
    });
    let out = cli().arg("diff").arg(&a).arg(&b).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let (head, la, lb) = first_divergence(&stdout);
    assert_eq!(head, "first divergence: request-outcome on request r4");
    assert!(la.starts_with(&format!("  A: {w} seq {seq} (RequestFinished")), "{la}");
    assert!(lb.starts_with(&format!("  B: {w} seq {seq} (RequestFinished")), "{lb}");
    assert!(stdout.contains("status A Some(Completed) vs B Some(Failed)"), "{stdout}");
    let (_, v) = diff_json(&a, &b, &[]);
    for (k, n) in [
        ("request-outcome", 1),
        ("capacity-sequence", 0),
        ("booking-sequence", 0),
        ("handoff-sequence", 0),
        ("final-state", 0),
    ] {
        assert_eq!(count(&v, k), n, "{k}: {v}");
    }
}

#[test]
fn different_policies_are_different_with_the_right_kinds() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a");
    let b = t.path().join("b");
    generate(&a, &GenConfig::default());
    generate(&b, &GenConfig { policy: HandoffPolicy::DestinationFirst, ..GenConfig::default() });
    let (code, v) = diff_json(&a, &b, &[]);
    assert_eq!(code, 1);
    assert_eq!(count(&v, "handoff-sequence"), 40, "every handoff reorders: {v}");
    assert_eq!(count(&v, "booking-sequence"), 1);
    assert!(count(&v, "capacity-sequence") >= 1);
    // Same requests, same workers, same outcomes; both drain.
    assert_eq!(count(&v, "request-outcome"), 0);
    assert_eq!(count(&v, "final-state"), 0);
    let ex = v["examples"].as_array().unwrap().iter().find(|d| d["kind"] == "handoff-sequence").unwrap();
    assert!(ex["detail"]
        .as_str()
        .unwrap()
        .contains("B [DestinationAccepted, DestinationReserved, SourceHeld"));
}

#[test]
fn merged_file_and_directory_compare_alike() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a");
    let b = t.path().join("b");
    generate(&a, &GenConfig::default());
    generate(&b, &GenConfig { id_seed: 5, ..GenConfig::default() });
    let merged = t.path().join("a.hrun");
    write_merged(&a, &merged).unwrap();
    let (code, v) = diff_json(&merged, &b, &[]);
    assert_eq!(code, 0, "{v}");
    let c = t.path().join("c");
    let (w, seq) = perturb(&a, &c, |w, f| match f {
        Fact::SourcePinned { request, .. } if *request == RequestId(7) => {
            let _ = w;
            Some(Edit::Drop)
        }
        _ => None,
    });
    let merged_c = t.path().join("c.hrun");
    write_merged(&c, &merged_c).unwrap();
    let out = cli().arg("diff").arg(&merged).arg(&merged_c).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let (_, la, _) = first_divergence(&stdout);
    assert!(la.starts_with(&format!("  A: {w} seq {seq} (SourcePinned")), "{la}");
}

#[test]
fn unusable_input_exits_2_naming_the_file() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a");
    generate(&a, &GenConfig::default());
    let missing = t.path().join("nope");
    cli()
        .arg("diff")
        .arg(&a)
        .arg(&missing)
        .assert()
        .code(2)
        .stderr(predicate::str::contains(missing.display().to_string()));
    // A flipped byte in the middle of a stream: named with its byte offset.
    let b = t.path().join("b");
    generate(&b, &GenConfig::default());
    let victim = b.join("decode-0.hlog");
    let mut bytes = std::fs::read(&victim).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    std::fs::write(&victim, &bytes).unwrap();
    cli()
        .arg("diff")
        .arg(&a)
        .arg(&b)
        .assert()
        .code(2)
        .stderr(predicate::str::contains(victim.display().to_string()))
        .stderr(predicate::str::contains("byte offset"));
    // Not a log at all.
    let junk = t.path().join("junk.hrun");
    std::fs::write(&junk, b"definitely not a log").unwrap();
    cli().arg("diff").arg(&junk).arg(&a).assert().code(2).stderr(predicate::str::contains("junk.hrun"));
}
