//! Snapshot tests of `diff` output on committed fixture runs under `fixtures/runs/`.
//!
//! The fixtures were written by the generator in `tests/support/generator.rs`; to rewrite them (only when
//! the log format or the generator changes on purpose):
//! `cargo test --test diff_snapshots -- --ignored regenerate_fixture_runs`.

mod support;

use handoff_ledger::events::{Fact, TerminalStatus};
use handoff_ledger::ids::{HandoffPolicy, RequestId, WorkerId};
use std::path::Path;
use support::generator::{generate, rewrite, Edit, GenConfig};

const SOURCE_FIRST: &str = "fixtures/runs/sf-12";
const RESEEDED: &str = "fixtures/runs/sf-12-reseeded";
const FAILED_R4: &str = "fixtures/runs/sf-12-failed-r4";
const DESTINATION_FIRST: &str = "fixtures/runs/df-12";

fn cfg() -> GenConfig {
    GenConfig { requests: 12, ..GenConfig::default() }
}

#[test]
#[ignore]
fn regenerate_fixture_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for d in [SOURCE_FIRST, RESEEDED, FAILED_R4, DESTINATION_FIRST] {
        let _ = std::fs::remove_dir_all(root.join(d));
    }
    generate(&root.join(SOURCE_FIRST), &cfg());
    generate(&root.join(RESEEDED), &GenConfig { id_seed: 4242, time_scale: 1.04, ..cfg() });
    generate(&root.join(DESTINATION_FIRST), &GenConfig { policy: HandoffPolicy::DestinationFirst, ..cfg() });
    rewrite(&root.join(SOURCE_FIRST), &root.join(FAILED_R4), |w, rec| match &rec.fact {
        Fact::RequestFinished { request, output_tokens, kv, .. }
            if w == WorkerId::ROUTER && *request == RequestId(4) =>
        {
            Edit::Replace(Fact::RequestFinished {
                request: *request,
                status: TerminalStatus::Failed,
                output_tokens: *output_tokens,
                kv: *kv,
            })
        }
        _ => Edit::Keep,
    });
}

fn diff(a: &str, b: &str, extra: &[&str]) -> (i32, String) {
    let out = support::cli()
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["diff", a, b])
        .args(extra)
        .output()
        .unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8(out.stdout).unwrap())
}

#[test]
fn snapshot_equivalent_across_seeds() {
    let (code, out) = diff(SOURCE_FIRST, RESEEDED, &[]);
    assert_eq!(code, 0);
    insta::assert_snapshot!(out);
}

#[test]
fn snapshot_changed_status() {
    let (code, out) = diff(SOURCE_FIRST, FAILED_R4, &[]);
    assert_eq!(code, 1);
    insta::assert_snapshot!(out);
}

#[test]
fn snapshot_vllm_order_vs_sglang_order() {
    let (code, out) = diff(SOURCE_FIRST, DESTINATION_FIRST, &[]);
    assert_eq!(code, 1);
    insta::assert_snapshot!(out);
}

#[test]
fn snapshot_changed_status_json() {
    let (code, out) = diff(SOURCE_FIRST, FAILED_R4, &["--json"]);
    assert_eq!(code, 1);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    insta::assert_json_snapshot!(v);
}
