//! `inspect` on real replay runs of the committed cascade fixture (`fixtures/traces/
//! cascade.jsonl`: 240 requests every 100 ms, 4096-token unique prompts, 1024-token outputs;
//! `fixtures/configs/cascade.json`: 2 prefill + 2 decode workers of 1024 blocks). Under vLLM
//! (source-first) decode fills and prefill KV strands: `inspect` must report a cascade set off
//! by decode exhaustion. Under SGLang (destination-first) the same load waits in the decode
//! reservation FIFOs ahead of prefill: gating, and no cascade. Text and JSON are snapshotted.

use assert_cmd::Command;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn replay(backend: &str, out: &Path) {
    Command::cargo_bin("handoff-log")
        .unwrap()
        .arg("replay")
        .arg(root().join("fixtures/traces/cascade.jsonl"))
        .args(["--backend", backend, "--prefill", "2", "--decode", "2", "--config"])
        .arg(root().join("fixtures/configs/cascade.json"))
        .arg("--out")
        .arg(out)
        .assert()
        .success();
}

fn inspect(run: &Path, extra: &[&str]) -> String {
    let out =
        Command::cargo_bin("handoff-log").unwrap().arg("inspect").arg(run).args(extra).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn vllm_cascade_replay_reports_a_cascade_set_off_by_decode_exhaustion() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("cascade-vllm");
    replay("vllm", &run);
    let text = inspect(&run, &["--top", "3"]);
    let json = inspect(&run, &["--json", "--top", "3"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let c = &v["cascade"];
    assert!(c.is_object(), "vLLM on 2P+2D must strand prefill KV");
    assert_eq!(c["workers"], serde_json::json!(["prefill-0", "prefill-1"]));
    let t = &c["trigger"];
    assert_eq!(t["kind"], "decode_exhaustion");
    assert!(t["at_ms"].as_f64().unwrap() < c["started_at_ms"].as_f64().unwrap());
    for d in t["decode_workers"].as_array().unwrap() {
        assert!(d["peak_kv_used_pct"].as_f64().unwrap() >= 95.0, "{d}");
    }
    for r in t["pin_rise"].as_array().unwrap() {
        assert!(r["pinned_at_stall_pct"].as_f64().unwrap() > r["pinned_at_trigger_pct"].as_f64().unwrap());
    }
    assert!(v["gating"].is_null());
    assert!(text.contains("STRANDING CASCADE: yes"));
    insta::assert_snapshot!("inspect_text_replay_cascade_vllm", text);
    insta::assert_snapshot!("inspect_json_replay_cascade_vllm", json);
}

#[test]
fn sglang_cascade_replay_reports_gating_not_a_cascade() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("cascade-sglang");
    replay("sglang", &run);
    let text = inspect(&run, &["--top", "3"]);
    let json = inspect(&run, &["--json", "--top", "3"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(v["cascade"].is_null(), "destination-first must not strand: {}", v["cascade"]);
    let g = &v["gating"];
    assert!(g["handoffs"].as_u64().unwrap() > 0);
    // Prefill pins stay small: waiting happened before prefill.
    for p in v["peaks"].as_array().unwrap() {
        if p["worker"].as_str().unwrap().starts_with("prefill") {
            assert!(p["pinned_source"]["value"].as_u64().unwrap() * 2 < p["total_blocks"].as_u64().unwrap());
        }
    }
    assert!(text.contains("DESTINATION GATING: 2"));
    insta::assert_snapshot!("inspect_text_replay_cascade_sglang", text);
    insta::assert_snapshot!("inspect_json_replay_cascade_sglang", json);
}
