//! `handoff-log inspect` on committed scripted fixture runs: the cascade is found on the
//! cascade run (with its trigger) and not on the healthy one; destination gating is reported
//! as its own finding; text and JSON are pinned by snapshots.

mod inspect_support;

use assert_cmd::Command;
use inspect_support::{fixtures_dir, scripted};
use std::path::Path;

fn inspect(run: &Path, extra: &[&str]) -> String {
    let out = Command::cargo_bin("handoff-log")
        .unwrap()
        .arg("inspect")
        .arg(run)
        .args(extra)
        .output()
        .unwrap();
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
        let mut files: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        files.sort();
        assert!(!files.is_empty());
        for f in files {
            let fresh = std::fs::read(tmp.path().join(&f)).unwrap();
            let kept = std::fs::read(committed.join(&f)).unwrap_or_else(|e| {
                panic!("{name}/{f:?}: {e} (run with INSPECT_UPDATE_FIXTURES=1)")
            });
            assert!(fresh == kept, "{name}/{f:?} differs from its script");
        }
    }
}
