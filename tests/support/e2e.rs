//! What the end-to-end tests of the binary share: replaying a trace (running the binary and
//! finding fixtures are [`super::cli`] and [`super::fixture`], re-exported here).

pub use super::{cli, fixture};
use serde_json::Value;
use std::path::Path;

/// Replays `trace` (relative to fixtures/, or absolute) with `args` into `out`; returns the
/// report JSON; panics with stderr and stdout on failure.
pub fn replay(trace: &str, args: &[&str], out: &Path) -> Value {
    let report = out.with_extension("report.json");
    let o = cli()
        .arg("replay")
        .arg(fixture(trace))
        .args(args)
        .arg("--out")
        .arg(out)
        .arg("--report-json")
        .arg(&report)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "replay failed: {}\n{}",
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(&o.stdout)
    );
    serde_json::from_str(&std::fs::read_to_string(report).unwrap()).unwrap()
}
