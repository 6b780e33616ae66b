//! End-to-end tests of `handoff-log verify | show | project` on a scripted source-first handoff
//! written with the library's own writer; and every read command on every run committed under
//! `fixtures/`.

mod support;

use handoff_ledger::events::{EngineShape, Fact, KvDelta, RunWriter, StreamHeader, TerminalStatus};
use handoff_ledger::ids::*;
use predicates::prelude::*;
use std::path::Path;
use support::{cli, ms};

const HANDOFF: u128 = 0x1234_5678_9abc_4def_8123_4567_89ab_cdef;

fn header(worker: WorkerId, total_blocks: u32) -> StreamHeader {
    StreamHeader {
        run_id: uuid::Uuid::from_u128(7),
        worker,
        backend: Backend::Vllm,
        policy: HandoffPolicy::SourceFirst,
        clock: ClockDomain::Virtual,
        seed: 1,
        engine: EngineShape {
            total_blocks,
            block_size: 64,
            max_request_slots: 4,
            config_json: String::new(),
        },
    }
}

/// A 4-block prompt: prefilled and pinned on prefill-0, reserved and activated on decode-0,
/// then the source is released and the request completes.
fn write_scenario(dir: &Path) {
    let p = WorkerId::prefill(0);
    let d = WorkerId::decode(0);
    let r = WorkerId::ROUTER;
    let h = HandoffId(uuid::Uuid::from_u128(HANDOFF));
    let req = RequestId(0);
    let demand = KvHandoffDemand { context_tokens: 256, max_output_tokens: 8 };
    let lease = SourceLeaseId(1);
    let res = DestinationReservationId(1);
    let mut w = RunWriter::create(dir, [header(p, 16), header(d, 16), header(r, 0)]).unwrap();
    let z = KvDelta::ZERO;
    w.append(r, 0, &Fact::RequestArrived { request: req, input_tokens: 256, output_tokens: 8 }).unwrap();
    w.append(r, 0, &Fact::PrefillBooked { request: req, worker: p, prefill_tokens: 256, blocks: 4 }).unwrap();
    w.append(
        p,
        0,
        &Fact::HandoffStarted { handoff: h, request: req, policy: HandoffPolicy::SourceFirst, demand },
    )
    .unwrap();
    w.append(p, 0, &Fact::PrefillDispatched { handoff: h }).unwrap();
    w.append(p, 0, &Fact::RequestQueued { request: req }).unwrap();
    w.append(
        p,
        ms(1),
        &Fact::RequestScheduled {
            request: req,
            cached_tokens: 0,
            kv: KvDelta { free: -4, active: 4, slots: 1, ..z },
        },
    )
    .unwrap();
    w.append(p, ms(20), &Fact::FirstTokenEmitted { request: req }).unwrap();
    w.append(
        p,
        ms(20),
        &Fact::SourcePinned {
            handoff: h,
            request: req,
            lease,
            blocks: 4,
            deadline_ns: ms(480_020),
            kv: KvDelta { active: -4, pinned_source: 4, slots: -1, ..z },
        },
    )
    .unwrap();
    w.append(r, ms(20), &Fact::PrefillComputeDone { request: req, worker: p }).unwrap();
    w.append(r, ms(20), &Fact::DecodeBooked { request: req, worker: d, blocks: 5 }).unwrap();
    w.append(
        d,
        ms(20),
        &Fact::HandoffStarted { handoff: h, request: req, policy: HandoffPolicy::SourceFirst, demand },
    )
    .unwrap();
    w.append(d, ms(20), &Fact::DestinationRouted { handoff: h, worker: d }).unwrap();
    w.append(
        d,
        ms(20),
        &Fact::DestinationReserved {
            handoff: h,
            request: req,
            reservation: res,
            pages: 4,
            prefix_blocks: 0,
            prefix_tokens: 0,
            deadline_ns: ms(300_020),
            kv: KvDelta { free: -4, reserved_destination: 4, ..z },
        },
    )
    .unwrap();
    w.append(d, ms(20), &Fact::ReceiveStarted { handoff: h, from: p, bytes: 256 * 131_072 }).unwrap();
    w.append(d, ms(21), &Fact::ReceiveCompleted { handoff: h }).unwrap();
    w.append(
        d,
        ms(21),
        &Fact::DestinationActivated {
            handoff: h,
            reservation: res,
            kv: KvDelta { reserved_destination: -4, active: 4, ..z },
        },
    )
    .unwrap();
    w.append(d, ms(21), &Fact::KvStored { parent: None, blocks: vec![11, 12, 13, 14] }).unwrap();
    w.append(p, ms(21), &Fact::ReaderCompleted { handoff: h }).unwrap();
    w.append(
        p,
        ms(21),
        &Fact::SourceReleased {
            handoff: h,
            lease,
            reason: EndReason::Success,
            kv: KvDelta { pinned_source: -4, cached_free: 4, ..z },
        },
    )
    .unwrap();
    w.append(r, ms(21), &Fact::PrefillBookingFreed { request: req, worker: p }).unwrap();
    w.append(
        d,
        ms(30),
        &Fact::RequestFinished {
            request: req,
            status: TerminalStatus::Completed,
            output_tokens: 8,
            kv: KvDelta { active: -4, cached_free: 4, ..z },
        },
    )
    .unwrap();
    w.append(
        r,
        ms(30),
        &Fact::DecodeBookingFreed { request: req, worker: d, status: TerminalStatus::Completed },
    )
    .unwrap();
    w.finish().unwrap();
}

#[test]
fn verify_reports_counts_on_a_sound_run() {
    let dir = tempfile::tempdir().unwrap();
    write_scenario(dir.path());
    cli()
        .arg("verify")
        .arg(dir.path())
        .assert()
        .success()
        .stdout(predicate::str::contains("ok: 3 streams, 22 records, 1 handoffs"));
}

#[test]
fn verify_names_file_and_offset_of_a_flipped_byte() {
    let dir = tempfile::tempdir().unwrap();
    write_scenario(dir.path());
    let path = dir.path().join("decode-0.hlog");
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(&path, &bytes).unwrap();
    cli()
        .arg("verify")
        .arg(dir.path())
        .assert()
        .code(1)
        .stderr(predicate::str::contains("decode-0.hlog").and(predicate::str::contains("byte offset")));
}

/// Cuts `bytes` off the end of one stream of the 22-record scenario; returns how `verify` then
/// counts the run's records (`"N records"`).
fn cut_tail(path: &Path, bytes: u64) -> String {
    let len = std::fs::metadata(path).unwrap().len();
    let whole = records_of(path);
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(len - bytes).unwrap();
    format!("{} records", 22 - whole + records_of(path))
}

/// Sound records in a stream file (a reader stops at a torn tail).
fn records_of(path: &Path) -> u64 {
    let mut r = handoff_ledger::events::StreamReader::open(path).unwrap();
    while r.next_record().unwrap().is_some() {}
    r.next_seq()
}

#[test]
fn verify_accepts_and_reports_a_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    write_scenario(dir.path());
    // The cut takes the stream's last block (v2: the router's records are one block).
    let left = cut_tail(&dir.path().join("router.hlog"), 3);
    cli()
        .arg("verify")
        .arg(dir.path())
        .assert()
        .success()
        .stdout(predicate::str::contains("torn tail at byte offset").and(predicate::str::contains(left)));
}

#[test]
fn verify_refuses_a_file_that_is_not_a_log() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("junk.hlog");
    std::fs::write(&path, b"definitely not a log file").unwrap();
    cli().arg("verify").arg(&path).assert().code(1).stderr(predicate::str::contains("bad magic"));
}

#[test]
fn show_filters_by_handoff_and_worker_and_speaks_json() {
    let dir = tempfile::tempdir().unwrap();
    write_scenario(dir.path());
    let h = uuid::Uuid::from_u128(HANDOFF).to_string();
    let out = cli().args(["show"]).arg(dir.path()).args(["--handoff", &h, "--json"]).output().unwrap();
    assert!(out.status.success());
    let lines: Vec<serde_json::Value> =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 11, "every handoff-keyed fact on both roles");
    assert!(lines.iter().all(|l| l["handoff"] == h));
    let at: Vec<u64> = lines.iter().map(|l| l["at_ns"].as_u64().unwrap()).collect();
    assert!(at.windows(2).all(|w| w[0] <= w[1]), "merge order is by time");
    let text = cli().args(["show"]).arg(dir.path()).args(["--worker", "prefill-0"]).output().unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.starts_with("         AT_MS WORKER"));
    assert_eq!(text.lines().count(), 1 + 8);
    assert!(text.contains("SourcePinned") && text.contains("kv=active-4,pinned_source+4,slots-1"));
    cli()
        .args(["show"])
        .arg(dir.path())
        .args(["--worker", "decode-9"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("no such stream"));
    cli().args(["show"]).arg(dir.path()).args(["--handoff", "nope"]).assert().code(2);
}

#[test]
fn project_capacity_uses_the_proposals_names() {
    let dir = tempfile::tempdir().unwrap();
    write_scenario(dir.path());
    let out = cli().args(["project"]).arg(dir.path()).args(["capacity", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ws = v["workers"].as_array().unwrap();
    assert_eq!(ws.len(), 2);
    let p = &ws[0];
    assert_eq!(p["worker"], "prefill-0");
    assert_eq!(p["active_blocks"], 0);
    assert_eq!(p["pinned_source_blocks"], 0);
    assert_eq!(p["peak_pinned_source_blocks"], 4);
    assert_eq!(p["cached_free_blocks"], 4);
    assert_eq!(p["free_blocks"], 12);
    assert_eq!(p["kv_used_blocks"], 0);
    assert_eq!(p["total_blocks"], 16);
    let d = &ws[1];
    assert_eq!(d["worker"], "decode-0");
    assert_eq!(d["reserved_destination_blocks"], 0);
    assert_eq!(d["peak_reserved_destination_blocks"], 4);
}

#[test]
fn project_handoffs_gives_the_normalized_source_first_order() {
    let dir = tempfile::tempdir().unwrap();
    write_scenario(dir.path());
    let out = cli().args(["project"]).arg(dir.path()).args(["handoffs", "--json"]).output().unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let h = &v["handoffs"][0];
    assert_eq!(h["outcome"], "completed");
    assert_eq!(h["source"], "prefill-0");
    assert_eq!(h["destination"], "decode-0");
    let order: Vec<&str> = h["normalized"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    assert_eq!(
        order,
        [
            "SourceHeld",
            "DestinationAccepted",
            "DestinationReserved",
            "DestinationActivated",
            "SourceReleased",
            "Completed"
        ]
    );
    assert_eq!(h["pinned_ms"], 1.0);
}

#[test]
fn project_refuses_a_run_whose_deltas_break_conservation() {
    let dir = tempfile::tempdir().unwrap();
    let p = WorkerId::prefill(0);
    let mut w = RunWriter::create(dir.path(), [header(p, 4)]).unwrap();
    let kv = KvDelta { free: -5, active: 5, ..KvDelta::ZERO };
    w.append(p, 7, &Fact::RequestScheduled { request: RequestId(3), cached_tokens: 0, kv }).unwrap();
    w.finish().unwrap();
    cli()
        .args(["project"])
        .arg(dir.path())
        .arg("capacity")
        .assert()
        .code(2)
        .stderr(predicate::str::contains("prefill-0 record seq 0"));
}

/// A contradiction is told in words (what the delta moves, the state it met), not as Rust
/// `Debug` of the structs.
#[test]
fn contradictions_are_told_in_words() {
    let dir = tempfile::tempdir().unwrap();
    let p = WorkerId::prefill(0);
    let mut w = RunWriter::create(dir.path(), [header(p, 4)]).unwrap();
    let kv = KvDelta { free: -5, active: 5, slots: 1, ..KvDelta::ZERO };
    w.append(p, 7, &Fact::RequestScheduled { request: RequestId(3), cached_tokens: 0, kv }).unwrap();
    w.finish().unwrap();
    let o = cli().arg("project").arg(dir.path()).arg("capacity").output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(
            "prefill-0 record seq 0 (t=0.000 ms): capacity delta active+5,free-5,slots+1 applied to \
             active=0 pinned=0 reserved=0 cached_free=0 free=4 total=4 slots=0 headroom=0"
        ),
        "{err}"
    );
    assert!(!err.contains("KvDelta") && !err.contains('{'), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let mut w = RunWriter::create(dir.path(), [header(p, 4)]).unwrap();
    w.append(p, 7, &Fact::RequestPreempted { request: RequestId(3), kv: KvDelta::ZERO }).unwrap();
    w.finish().unwrap();
    let o = cli().arg("project").arg(dir.path()).arg("scheduler").output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("r3 preempted while not queued"), "{err}");
    assert!(!err.contains("None") && !err.contains("Some("), "{err}");
}

/// One rule for a log whose checksums hold but whose facts contradict each other: verify calls
/// it unsound (exit 1, as for damage), every command that folds it refuses it (exit 2, as for
/// a damaged log) with the same located message, and show lists its records as written.
#[test]
fn a_self_contradicting_log_gets_one_exit_code_rule() {
    let dir = tempfile::tempdir().unwrap();
    let p = WorkerId::prefill(0);
    let mut w = RunWriter::create(dir.path(), [header(p, 4)]).unwrap();
    let kv = KvDelta { free: -2, active: 2, slots: 1, ..KvDelta::ZERO };
    w.append(p, 1_000_000, &Fact::RequestQueued { request: RequestId(1) }).unwrap();
    w.append(p, 2_000_000, &Fact::RequestScheduled { request: RequestId(1), cached_tokens: 0, kv }).unwrap();
    // Released although nothing was pinned: the scheduler view and the capacity both refuse it.
    let back = KvDelta { pinned_source: -2, free: 2, ..KvDelta::ZERO };
    w.append(
        p,
        3_000_000,
        &Fact::SourceReleased {
            handoff: HandoffId(uuid::Uuid::from_u128(7)),
            lease: SourceLeaseId(1),
            reason: EndReason::Success,
            kv: back,
        },
    )
    .unwrap();
    w.finish().unwrap();
    let run = dir.path();
    let message = "the log contradicts itself: prefill-0 record seq 2 (t=3.000 ms)";
    let o = cli().arg("verify").arg(run).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "verify");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains(message),
        "verify: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let svg = dir.path().join("t.svg");
    let folding: Vec<Vec<String>> = vec![
        vec!["project".into(), "capacity".into()],
        vec!["project".into(), "scheduler".into()],
        vec!["project".into(), "series".into()],
        vec!["project".into(), "handoffs".into()],
        vec!["project".into(), "metrics".into()],
        vec!["project".into(), "requests".into()],
        vec!["inspect".into()],
        vec!["timeline".into(), "--svg".into(), svg.display().to_string()],
        vec!["at".into(), "--time".into(), "5".into()],
    ];
    for args in folding {
        let mut c = cli();
        c.arg(&args[0]).arg(run).args(&args[1..]);
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(message), "{args:?}: {err}");
    }
    cli().arg("show").arg(run).assert().success();
}

#[test]
fn every_command_has_help() {
    for c in ["verify", "show", "project", "replay"] {
        cli().args([c, "--help"]).assert().success().stdout(predicate::str::contains("Usage"));
    }
}

#[test]
fn a_merged_file_reads_exactly_like_its_directory() {
    let dir = tempfile::tempdir().unwrap();
    write_scenario(dir.path());
    let merged = dir.path().join("run.hrun");
    cli()
        .arg("merge")
        .arg(dir.path())
        .arg(&merged)
        .assert()
        .success()
        .stdout(predicate::str::contains("22 records"));
    let a = cli().arg("show").arg(dir.path()).arg("--json").output().unwrap();
    let b = cli().arg("show").arg(&merged).arg("--json").output().unwrap();
    assert!(a.status.success() && b.status.success());
    assert_eq!(a.stdout, b.stdout);
    let pa = cli().arg("project").arg(dir.path()).args(["capacity", "--json"]).output().unwrap();
    let pb = cli().arg("project").arg(&merged).args(["capacity", "--json"]).output().unwrap();
    assert_eq!(pa.stdout, pb.stdout);
}

#[test]
fn recover_truncates_only_the_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    write_scenario(dir.path());
    let left = cut_tail(&dir.path().join("prefill-0.hlog"), 5);
    cli().arg("recover").arg(dir.path()).assert().success().stdout(predicate::str::contains("truncated"));
    cli()
        .arg("verify")
        .arg(dir.path())
        .assert()
        .success()
        .stdout(predicate::str::contains(left).and(predicate::str::contains("torn").not()));
    cli()
        .arg("recover")
        .arg(dir.path())
        .assert()
        .success()
        .stdout(predicate::str::contains("nothing written"));
}

#[test]
fn completions_are_printed_for_each_shell() {
    for shell in ["bash", "zsh", "fish"] {
        let o = cli().args(["completions", shell]).output().unwrap();
        assert!(o.status.success(), "{shell}");
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            text.contains("handoff-log") && text.contains("replay") && text.contains("inspect"),
            "{shell}"
        );
    }
    let o = cli().args(["completions", "tcsh"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
}

// ----- every committed run, every read command -----

/// The runs committed under `fixtures/`, found by walking it (so a new fixture is covered
/// without naming it here): under `fixtures/golden/` every `.hlog` / `.hrun` file is a run of
/// its own; elsewhere a directory holding `.hlog` streams is a run directory, and a `.hrun`
/// file a merged run.
fn committed_runs() -> Vec<std::path::PathBuf> {
    fn walk(dir: &Path, golden: bool, out: &mut Vec<std::path::PathBuf>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        entries.sort();
        let ext = |p: &Path, e: &str| p.extension().is_some_and(|x| x == e);
        let mut is_run_dir = false;
        for p in entries {
            if p.is_dir() {
                walk(&p, golden || p.file_name().is_some_and(|n| n == "golden"), out);
            } else if ext(&p, "hrun") || (golden && ext(&p, "hlog")) {
                out.push(p);
            } else if ext(&p, "hlog") {
                is_run_dir = true;
            }
        }
        if is_run_dir {
            out.push(dir.to_path_buf());
        }
    }
    let mut out = Vec::new();
    walk(&support::fixture(""), false, &mut out);
    out.sort();
    out
}

/// The projections `handoff-log project --help` offers (its "Possible values" list).
fn offered_projections() -> Vec<String> {
    let o = cli().args(["project", "--help"]).output().unwrap();
    assert!(o.status.success());
    let text = String::from_utf8(o.stdout).unwrap();
    let start = text.find("Possible values:").expect("project --help lists its projections");
    text[start..]
        .lines()
        .skip(1)
        .map(str::trim)
        .take_while(|l| l.starts_with("- "))
        .map(|l| l[2..].split(':').next().unwrap().trim().to_string())
        .collect()
}

/// Every golden and committed run is a consistent run: `verify`, `show`, `project` of each
/// projection, `inspect`, `timeline`, `at` an instant inside it and `diff` with itself all
/// succeed on it, without the folds finding a contradiction.
#[test]
fn every_command_works_on_every_committed_run() {
    let runs = committed_runs();
    let rel = |p: &Path| p.strip_prefix(support::fixture("")).unwrap().display().to_string();
    let names: Vec<String> = runs.iter().map(|p| rel(p)).collect();
    for known in [
        "golden/v1/golden.hlog",
        "golden/v1/golden-appended.hlog",
        "golden/v1/golden-run.hrun",
        "golden/v2/golden.hlog",
        "runs/df-12",
        "runs/scripted-cascade",
        "runs/scripted-failures",
        "runs/scripted-gated",
        "runs/scripted-healthy",
        "runs/sf-12",
        "runs/sf-12-failed-r4",
        "runs/sf-12-reseeded",
        "runs/v2-golden",
    ] {
        assert!(names.iter().any(|n| n == known), "the walk missed {known}: found {names:?}");
    }
    let projections = offered_projections();
    for known in ["capacity", "handoffs", "scheduler", "metrics", "requests", "series"] {
        assert!(projections.iter().any(|p| p == known), "project --help lost {known}: {projections:?}");
    }

    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for run in &runs {
        let name = rel(run);
        // Runs one command; a failure (or a fold finding a contradiction) is noted, not fatal,
        // so that one test run lists every failing pair.
        let mut check = |what: &str, args: &[&std::ffi::OsStr]| -> Option<Vec<u8>> {
            let o = cli().args(args).output().unwrap();
            let stderr = String::from_utf8_lossy(&o.stderr);
            if !o.status.success() || stderr.contains("contradicts") {
                failures.push(format!("{name}: {what}: exit {:?}: {}", o.status.code(), stderr.trim()));
                return None;
            }
            Some(o.stdout)
        };
        let r = run.as_os_str();
        let os = std::ffi::OsStr::new;
        check("verify", &[os("verify"), r]);
        let shown = check("show --json", &[os("show"), r, os("--json")]);
        for p in &projections {
            check(&format!("project {p}"), &[os("project"), r, os(p)]);
        }
        check("inspect", &[os("inspect"), r]);
        let svg = tmp.path().join(format!("{}.svg", name.replace('/', "_")));
        let drawn = check("timeline", &[os("timeline"), r, os("--svg"), svg.as_os_str()]).is_some();
        // `at` the midpoint of the run's first and last instants.
        if let Some(shown) = shown {
            let at: Vec<u64> = String::from_utf8(shown)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["at_ns"].as_u64().unwrap())
                .collect();
            let (first, last) = (*at.iter().min().unwrap(), *at.iter().max().unwrap());
            let mid = format!("{}ns", first + (last - first) / 2);
            check(&format!("at --time {mid}"), &[os("at"), r, os("--time"), os(&mid)]);
        }
        check("diff with itself", &[os("diff"), r, r]);
        if drawn && !std::fs::read_to_string(&svg).is_ok_and(|s| s.contains("<svg")) {
            failures.push(format!("{name}: timeline wrote no svg"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} command(s) failed on committed runs:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A clean replay ends every stream with the end marker and verifies complete; the same run cut
/// short (its last record gone, as a kill leaves it) verifies incomplete, naming the stream, and
/// a projection of it warns that its figures cover only what was written.
#[test]
fn a_run_without_its_end_markers_is_called_incomplete() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    support::e2e::replay("traces/mooncake-200.jsonl", &["--prefill", "1", "--decode", "1"], &run);
    let o = cli().arg("verify").arg("--json").arg(&run).output().unwrap();
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["complete"], true, "{v}");
    // Cut the router stream's last record (the marker): what a kill just before the end leaves.
    let router = run.join("router.hlog");
    let mut reader = handoff_ledger::events::StreamReader::open(&router).unwrap();
    let mut last = None;
    while let Some(rec) = reader.next_record().unwrap() {
        last = Some((reader.last_record_offset().unwrap(), rec.fact));
    }
    let (position, fact) = last.unwrap();
    assert_eq!(fact, Fact::StreamEnded);
    // Cut at the start of the block holding it (the marker and whatever shared its block).
    let offset = reader.format().frame_of(position).0;
    std::fs::OpenOptions::new().write(true).open(&router).unwrap().set_len(offset).unwrap();
    let o = cli().arg("verify").arg(&run).output().unwrap();
    assert!(o.status.success(), "an incomplete run is not a damaged one");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("incomplete run: router has no end marker"), "{text}");
    for args in [vec!["project", "metrics"], vec!["inspect"]] {
        let o = cli().arg(args[0]).arg(&run).args(&args[1..]).output().unwrap();
        assert!(o.status.success(), "{args:?}");
        assert!(String::from_utf8_lossy(&o.stderr).contains("warning: incomplete run: router"), "{args:?}");
    }
    let o = cli().arg("compare").arg(&run).output().unwrap();
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("incomplete run: router"), "compare");
    let svg = dir.path().join("t.svg");
    let o = cli().arg("timeline").arg(&run).arg("--svg").arg(&svg).output().unwrap();
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("warning: incomplete run: router"), "timeline");
}
