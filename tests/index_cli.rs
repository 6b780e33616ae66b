//! The run index: same answers as a full scan (`show --handoff`, `show --worker`, `at`), and a
//! stale or damaged index is detected and rebuilt.

mod support;

use handoff_ledger::events::index::{IndexStatus, RunIndex};
use handoff_ledger::events::{write_merged, Fact, RunReader, StreamWriter};
use handoff_ledger::ids::{HandoffId, RequestId};
use handoff_ledger::projections::worker::WorkerFold;
use serde_json::Value;
use std::path::{Path, PathBuf};
use support::cli;
use support::generator::{generate, GenConfig};

fn stdout(args: &[&str], run: &Path) -> String {
    let out = cli().args(args).arg(run).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn show(run: &Path, extra: &[&str]) -> String {
    let out = cli().arg("show").arg(run).args(extra).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn at_json(run: &Path, t: &str) -> String {
    let out = cli().arg("at").arg(run).args(["--time", t, "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn copy_run(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
        }
    }
}

/// Two copies of one generated run: `plain` never indexed, `indexed` indexed with `index`.
fn pair(t: &Path) -> (PathBuf, PathBuf) {
    let plain = t.join("plain");
    generate(&plain, &GenConfig { requests: 120, ..GenConfig::default() });
    let indexed = t.join("indexed");
    copy_run(&plain, &indexed);
    let v: Value = serde_json::from_str(&stdout(&["index", "--json"], &indexed)).unwrap();
    assert_eq!(v["status"], "built");
    assert!(indexed.join(".index").is_dir());
    assert!(!plain.join(".index").exists());
    (plain, indexed)
}

fn some_handoffs(run: &Path) -> Vec<HandoffId> {
    let mut r = RunReader::open(run).unwrap();
    let mut out = Vec::new();
    while let Some((_, rec)) = r.next().unwrap() {
        if let Fact::HandoffStarted { handoff, .. } = rec.fact {
            if !out.contains(&handoff) {
                out.push(handoff);
            }
        }
    }
    out.into_iter().step_by(17).collect()
}

#[test]
fn show_with_index_equals_show_without() {
    let t = tempfile::tempdir().unwrap();
    let (plain, indexed) = pair(t.path());
    let hs = some_handoffs(&plain);
    assert!(hs.len() >= 5);
    for h in hs {
        let h = h.to_string();
        for extra in [
            vec!["--handoff", h.as_str()],
            vec!["--handoff", h.as_str(), "--json"],
            vec!["--handoff", h.as_str(), "--worker", "router"],
            vec!["--handoff", h.as_str(), "--limit", "3"],
        ] {
            let a = show(&plain, &extra);
            let b = show(&indexed, &extra);
            let header = usize::from(!extra.contains(&"--json"));
            assert!(a.lines().count() > header, "{extra:?}: the filter matched nothing");
            assert_eq!(a, b, "{extra:?}");
        }
    }
    for w in ["prefill-0", "decode-1", "router"] {
        assert_eq!(show(&plain, &["--worker", w]), show(&indexed, &["--worker", w]));
    }
    // The merged layout (FILE.index).
    let merged = t.path().join("run.hrun");
    write_merged(&plain, &merged).unwrap();
    let before = show(&merged, &["--worker", "decode-0", "--json"]);
    stdout(&["index"], &merged);
    assert!(t.path().join("run.hrun.index").is_dir());
    assert_eq!(before, show(&merged, &["--worker", "decode-0", "--json"]));
    let h = some_handoffs(&plain)[2].to_string();
    assert_eq!(show(&plain, &["--handoff", &h]), show(&merged, &["--handoff", &h]));
}

#[test]
fn at_with_index_equals_at_without() {
    let t = tempfile::tempdir().unwrap();
    let (plain, indexed) = pair(t.path());
    for time in ["0", "5", "17.25", "40ms", "0.09s", "100000"] {
        assert_eq!(at_json(&plain, time), at_json(&indexed, time), "t={time}");
    }
    // The table form too.
    let a = stdout(&["at", "--time", "30"], &plain);
    assert!(a.contains("decode-0") && a.contains("pinned"), "{a}");
    assert_eq!(a, stdout(&["at", "--time", "30"], &indexed));
}

#[test]
fn library_postings_match_a_scan() {
    let t = tempfile::tempdir().unwrap();
    let (plain, indexed) = pair(t.path());
    let (idx, status) = RunIndex::open_or_rebuild::<WorkerFold>(&indexed).unwrap();
    assert_eq!(status, IndexStatus::Fresh);
    let req = RequestId(9);
    let got: Vec<(usize, u64)> = idx
        .read_postings(&idx.offsets_for_request(req).unwrap())
        .unwrap()
        .into_iter()
        .map(|(i, r)| (i, r.seq))
        .collect();
    let mut want = Vec::new();
    let mut r = RunReader::open(&plain).unwrap();
    while let Some((i, rec)) = r.next().unwrap() {
        if rec.fact.request() == Some(req) {
            want.push((i, rec.seq));
        }
    }
    assert!(want.len() > 5);
    assert_eq!(got, want);
}

#[test]
fn appending_to_a_stream_makes_the_index_stale_and_it_is_rebuilt() {
    let t = tempfile::tempdir().unwrap();
    let (plain, indexed) = pair(t.path());
    let late = 10_000_000_000u64; // 10 s, after everything
    for run in [&plain, &indexed] {
        let (mut w, torn) = StreamWriter::open_append(run.join("decode-0.hlog")).unwrap();
        assert!(torn.is_none());
        w.append(late, &Fact::RequestQueued { request: RequestId(999_999) }).unwrap();
        w.finish().unwrap();
    }
    let out = cli().arg("at").arg(&indexed).args(["--time", "20s", "--json"]).output().unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("stale") && stderr.contains("rebuilt"), "{stderr}");
    let with: Value = serde_json::from_slice(&out.stdout).unwrap();
    let without: Value = serde_json::from_str(&at_json(&plain, "20s")).unwrap();
    assert_eq!(with, without);
    let d0 = with["workers"].as_array().unwrap().iter().find(|w| w["worker"] == "decode-0").unwrap();
    assert_eq!(d0["queues"]["waiting"], 1, "the appended record is seen");
    let v: Value = serde_json::from_str(&stdout(&["index", "--json"], &indexed)).unwrap();
    assert_eq!(v["status"], "fresh", "rebuilt once, then trusted");
}

#[test]
fn a_damaged_index_is_rebuilt_not_trusted() {
    let t = tempfile::tempdir().unwrap();
    let (plain, indexed) = pair(t.path());
    // Overwrite every file of the database with garbage.
    fn scribble(dir: &Path) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                scribble(&p);
            } else {
                std::fs::write(&p, vec![0xA5u8; 4096]).unwrap();
            }
        }
    }
    scribble(&indexed.join(".index"));
    let v: Value = serde_json::from_str(&stdout(&["index", "--json"], &indexed)).unwrap();
    assert_eq!(v["status"], "rebuilt", "{v}");
    assert_eq!(at_json(&plain, "25"), at_json(&indexed, "25"));
    // An index directory that is not a database at all.
    std::fs::remove_dir_all(indexed.join(".index")).unwrap();
    std::fs::create_dir_all(indexed.join(".index")).unwrap();
    let v: Value = serde_json::from_str(&stdout(&["index", "--json"], &indexed)).unwrap();
    assert_eq!(v["status"], "rebuilt", "{v}");
    let h = some_handoffs(&plain)[1].to_string();
    assert_eq!(show(&plain, &["--handoff", &h]), show(&indexed, &["--handoff", &h]));
    // Only the postings database damaged: `at` does not need it; `show --handoff` notices,
    // rebuilds and answers as a scan does.
    scribble(&indexed.join(".index").join("postings"));
    assert_eq!(at_json(&plain, "25"), at_json(&indexed, "25"));
    let out = cli().arg("show").arg(&indexed).args(["--handoff", &h]).output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), show(&plain, &["--handoff", &h]));
    // Rewriting a stream with the same length but other bytes is caught by the checksum.
    let (idx, _) = RunIndex::open_or_rebuild::<WorkerFold>(&indexed).unwrap();
    drop(idx);
    let f = indexed.join("router.hlog");
    let mut bytes = std::fs::read(&f).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 1;
    std::fs::write(&f, &bytes).unwrap();
    let out = cli().arg("index").arg(&indexed).output().unwrap();
    // The flipped byte makes the stream itself unreadable: an error naming it, not a stale answer.
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("router.hlog"));
}

#[test]
fn an_index_in_use_elsewhere_is_left_alone_and_readers_scan() {
    let t = tempfile::tempdir().unwrap();
    let (plain, indexed) = pair(t.path());
    let (held, _) = RunIndex::open_or_rebuild::<WorkerFold>(&indexed).unwrap();
    let out = cli().arg("at").arg(&indexed).args(["--time", "33", "--json"]).output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("in use"));
    assert_eq!(String::from_utf8(out.stdout).unwrap(), at_json(&plain, "33"));
    let h = some_handoffs(&plain)[0].to_string();
    assert_eq!(show(&plain, &["--handoff", &h]), show(&indexed, &["--handoff", &h]));
    drop(held);
    // Still intact: reused, not rebuilt.
    let v: Value = serde_json::from_str(&stdout(&["index", "--json"], &indexed)).unwrap();
    assert_eq!(v["status"], "fresh");
}
