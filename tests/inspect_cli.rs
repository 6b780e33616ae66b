//! `handoff-log inspect` on committed scripted fixture runs: the cascade is found on the
//! cascade run (with its trigger) and not on the healthy one; destination gating is reported
//! as its own finding; text and JSON are pinned by snapshots.

mod support;

use std::path::Path;
use support::scripted::{fixtures_dir, scripted};

fn inspect(run: &Path, extra: &[&str]) -> String {
    let out = support::cli().arg("inspect").arg(run).args(extra).output().unwrap();
    assert!(
        out.status.success(),
        "inspect {} failed: {}",
        run.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn json(run: &Path) -> serde_json::Value {
    serde_json::from_str(&inspect(run, &["--json", "--top", "3"])).unwrap()
}

/// The committed fixtures are exactly what the scripts write (set INSPECT_UPDATE_FIXTURES=1
/// to rewrite them after changing a script).
#[test]
fn committed_fixtures_match_their_scripts() {
    for (name, write) in scripted() {
        let committed = fixtures_dir().join(name);
        if std::env::var_os("INSPECT_UPDATE_FIXTURES").is_some() {
            let _ = std::fs::remove_dir_all(&committed);
            write(&committed);
        }
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path());
        let mut files: Vec<_> =
            std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        files.sort();
        assert!(!files.is_empty());
        for f in files {
            let fresh = std::fs::read(tmp.path().join(&f)).unwrap();
            let kept = std::fs::read(committed.join(&f))
                .unwrap_or_else(|e| panic!("{name}/{f:?}: {e} (run with INSPECT_UPDATE_FIXTURES=1)"));
            assert!(fresh == kept, "{name}/{f:?} differs from its script");
        }
    }
}

fn fixture(name: &str) -> std::path::PathBuf {
    fixtures_dir().join(name)
}

#[test]
fn cascade_is_found_with_its_trigger_on_the_cascade_run() {
    let v = json(&fixture("scripted-cascade"));
    for key in ["cascade", "peaks", "longest_pinned", "wait_breakdown"] {
        assert!(v.get(key).is_some(), "missing top-level key {key}");
    }
    let c = &v["cascade"];
    assert!(c.is_object(), "no cascade reported: {c}");
    // r9 queued at 1000 ms, pins hot since 740 ms: the stall begins at 1000 + 1000 ms, and
    // ends when the pins fall at 3006 ms.
    assert_eq!(c["started_at_ms"], 2000.0);
    assert_eq!(c["workers"], serde_json::json!(["prefill-0"]));
    assert_eq!(c["intervals"][0]["ended_at_ms"], 3006.0);
    let t = &c["trigger"];
    assert_eq!(t["kind"], "decode_exhaustion");
    // Both decode workers reached 16/16 blocks at 400 ms.
    assert_eq!(t["at_ms"], 400.0);
    let decodes: Vec<&str> =
        t["decode_workers"].as_array().unwrap().iter().map(|d| d["worker"].as_str().unwrap()).collect();
    assert_eq!(decodes, ["decode-0", "decode-1"]);
    for d in t["decode_workers"].as_array().unwrap() {
        assert_eq!(d["peak_kv_used_pct"], 100.0);
    }
    assert_eq!(t["pin_rise"][0]["pinned_at_trigger_pct"], 0.0);
    assert_eq!(t["pin_rise"][0]["pinned_at_stall_pct"], 100.0);
    // The longest pin is r5's: pinned at 640 ms, released at 3206 ms.
    let top = &v["longest_pinned"][0];
    assert_eq!(top["request"], 5);
    assert_eq!(top["pinned_ms"], 2566.0);
    let facts: Vec<&str> =
        top["timeline"].as_array().unwrap().iter().map(|s| s["fact"].as_str().unwrap()).collect();
    assert_eq!(facts.first(), Some(&"HandoffStarted"));
    assert_eq!(facts.last(), Some(&"SourceReleased"));
    assert!(facts.contains(&"ReservationRefused"));
    assert!(v["gating"].is_null(), "source-first pins are not gating");
    // Router bookings ran past both decode workers' 16 blocks.
    let kinds: Vec<(&str, &str)> = v["bookings"]["divergences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["worker"].as_str().unwrap(), d["kind"].as_str().unwrap()))
        .collect();
    assert!(kinds.contains(&("decode-0", "overbooked")));
    // Over time: booked and used blocks side by side, in time order, through the overbooking.
    let row = v["bookings"]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker"] == "decode-0")
        .unwrap()
        .clone();
    let series: Vec<(f64, u64, u64)> = row["series"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (p["at_ms"].as_f64().unwrap(), p["booked"].as_u64().unwrap(), p["kv_used"].as_u64().unwrap())
        })
        .collect();
    assert!(series.windows(2).all(|w| w[0].0 < w[1].0), "{series:?}");
    assert!(series.contains(&(940.0, 40, 16)), "{series:?}");
    assert_eq!(series.last().map(|p| (p.1, p.2)), Some((0, 0)));
}

#[test]
fn healthy_run_has_no_cascade_and_no_gating() {
    let v = json(&fixture("scripted-healthy"));
    assert!(v["cascade"].is_null(), "false cascade: {}", v["cascade"]);
    assert!(v["gating"].is_null());
    assert_eq!(v["wait_breakdown"]["outcomes"]["completed"], 11);
    assert_eq!(v["longest_pinned"][0]["pinned_ms"], 6.0);
}

#[test]
fn destination_first_waiting_is_gating_not_a_cascade() {
    let v = json(&fixture("scripted-gated"));
    assert!(v["cascade"].is_null());
    let g = &v["gating"];
    assert_eq!(g["handoffs"], 4);
    assert_eq!(g["first_queued_at_ms"], 500.0);
    // r4 queued at 500 ms and reserved at 2000 ms.
    assert_eq!(g["wait_ms"]["max"], 1500.0);
    assert_eq!(g["per_worker"][0]["peak_pending"], 4);
}

#[test]
fn thresholds_move_the_verdict() {
    let run = fixture("scripted-cascade");
    // r9 waited 2006 ms unscheduled: a 3 s stall threshold sees no cascade.
    let v: serde_json::Value =
        serde_json::from_str(&inspect(&run, &["--json", "--stall-ms", "3000"])).unwrap();
    assert!(v["cascade"].is_null());
    // With a 500 ms threshold the stall starts 500 ms after r9 queued.
    let v: serde_json::Value =
        serde_json::from_str(&inspect(&run, &["--json", "--stall-ms", "500"])).unwrap();
    assert_eq!(v["cascade"]["started_at_ms"], 1500.0);
}

#[test]
fn snapshots_of_text_and_json() {
    for (name, _) in scripted() {
        let run = fixture(name);
        insta::assert_snapshot!(format!("inspect_text_{name}"), inspect(&run, &["--top", "3"]));
        insta::assert_snapshot!(format!("inspect_json_{name}"), inspect(&run, &["--json", "--top", "3"]));
    }
}

#[test]
fn failures_are_told_apart_with_the_time_each_cost() {
    let v = json(&fixture("scripted-failures"));
    let o = &v["wait_breakdown"]["outcomes"];
    assert_eq!(o["lease_expired"], 1);
    assert_eq!(o["reservation_expired"], 1);
    assert_eq!(o["canceled"], 1);
    assert_eq!(o["canceled_by_reason"]["request-aborted"], 1);
    assert_eq!(o["completed"], 0);
    let phase = |name: &str| {
        v["wait_breakdown"]["phases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["phase"] == name)
            .unwrap_or_else(|| panic!("no phase {name}"))
            .clone()
    };
    // r0 pinned 40 → lease expiry 540; r1 reserved 140 → expiry 440; r2 started 200 → 300.
    assert_eq!(phase("lease_expired")["total_ms"], 500.0);
    assert_eq!(phase("reservation_expired")["total_ms"], 300.0);
    assert_eq!(phase("canceled")["total_ms"], 100.0);
    assert_eq!(phase("canceled")["stats_ms"]["count"], 1);
    // The expired lease is the longest pin, and its timeline ends in the expiry.
    let top = &v["longest_pinned"][0];
    assert_eq!(top["request"], 0);
    assert_eq!(top["outcome"], "lease_expired");
    assert!(v["cascade"].is_null());
}

#[test]
fn a_merged_run_inspects_like_its_directory() {
    let dir = tempfile::tempdir().unwrap();
    let merged = dir.path().join("cascade.hrun");
    support::cli().arg("merge").arg(fixture("scripted-cascade")).arg(&merged).assert().success();
    let a = json(&fixture("scripted-cascade"));
    let b = json(&merged);
    assert_eq!(a, b);
}

#[test]
fn unusable_input_is_exit_2_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let out = support::cli().arg("inspect").arg(dir.path().join("missing")).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("handoff-log:"));
    // A stream whose facts contradict each other (a release with nothing pinned) is named.
    use handoff_ledger::events::{EngineShape, Fact, KvDelta, RunWriter, StreamHeader};
    use handoff_ledger::ids::*;
    let run = dir.path().join("bad");
    let h = StreamHeader {
        run_id: uuid::Uuid::from_u128(9),
        worker: WorkerId::prefill(0),
        backend: Backend::Vllm,
        policy: HandoffPolicy::SourceFirst,
        clock: ClockDomain::Virtual,
        seed: 0,
        engine: EngineShape {
            total_blocks: 4,
            block_size: 16,
            max_request_slots: 4,
            config_json: String::new(),
        },
    };
    let mut w = RunWriter::create(&run, [h]).unwrap();
    w.append(
        WorkerId::prefill(0),
        5_000_000,
        &Fact::SourceReleased {
            handoff: HandoffId(uuid::Uuid::from_u128(1)),
            lease: SourceLeaseId(1),
            reason: EndReason::Success,
            kv: KvDelta { pinned_source: -4, free: 4, ..KvDelta::ZERO },
        },
    )
    .unwrap();
    w.finish().unwrap();
    let out = support::cli().arg("inspect").arg(&run).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("prefill-0 record seq 0"), "{err}");
}
