//! End-to-end replay tests: the binary on committed fixture traces, checked through the logs it
//! writes (folded with the library's own projections).

mod support;

use handoff_ledger::events::{Fact, MessageKind, RunReader, TerminalStatus};
use handoff_ledger::ids::{CancelReason, EndReason, HandoffId, RequestId, Role, WorkerId};
use handoff_ledger::lifecycle::policy::Milestone;
use handoff_ledger::projections::run::{project_capacity, project_handoffs, project_handoffs_streaming};
use predicates::prelude::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use support::e2e::{cli, fixture, replay};

/// Every record of a run as (worker, at_ns, fact), in merge order.
fn records(run: &Path) -> Vec<(WorkerId, u64, Fact)> {
    let mut r = RunReader::open(run).unwrap();
    std::iter::from_fn(|| r.next_record().unwrap()).map(|(w, rec)| (w, rec.at_ns, rec.fact)).collect()
}

/// `replay TRACE ARGS --out OUT`, which must refuse (exit 2); the caller checks what it said.
fn replay_refused(trace: &str, args: &[&str], out: &Path) -> assert_cmd::assert::Assert {
    cli().arg("replay").arg(fixture(trace)).args(args).arg("--out").arg(out).assert().code(2)
}

fn dir_bytes(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "hlog"))
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect()
}

const SMALL: &[&str] = &["--prefill", "2", "--decode", "2"];

#[test]
fn same_trace_config_and_seed_give_byte_identical_logs() {
    let t = tempfile::tempdir().unwrap();
    for backend in ["vllm", "sglang"] {
        let a = t.path().join(format!("{backend}-a"));
        let b = t.path().join(format!("{backend}-b"));
        let c = t.path().join(format!("{backend}-c"));
        let args = [SMALL, &["--backend", backend, "--seed", "7", "--router", "kv"]].concat();
        replay("traces/mooncake-200.jsonl", &args, &a);
        replay("traces/mooncake-200.jsonl", &args, &b);
        let (ba, bb) = (dir_bytes(&a), dir_bytes(&b));
        assert_eq!(ba.len(), 5);
        assert!(ba == bb, "{backend}: logs differ between two identical replays");
        let other = [SMALL, &["--backend", backend, "--seed", "8", "--router", "kv"]].concat();
        replay("traces/mooncake-200.jsonl", &other, &c);
        assert!(dir_bytes(&c) != ba, "{backend}: the seed must matter (HandoffIds come from it)");
    }
}

/// `--log-format 1` writes v1 streams (read by older tools) with the same records as the v2
/// default: `diff` of the two runs exits 0, the v2 files are at least 1.5x smaller, and the printed
/// reports are the same.
#[test]
fn a_v1_run_and_a_v2_run_of_one_replay_are_equivalent() {
    let t = tempfile::tempdir().unwrap();
    for backend in ["vllm", "sglang"] {
        let (v1, v2) = (t.path().join(format!("{backend}-v1")), t.path().join(format!("{backend}-v2")));
        let args = [SMALL, &["--backend", backend, "--router", "kv"]].concat();
        let mut r1 = replay("traces/mooncake-200.jsonl", &[&args[..], &["--log-format", "1"]].concat(), &v1);
        let mut r2 = replay("traces/mooncake-200.jsonl", &args, &v2);
        for r in [&mut r1, &mut r2] {
            let o = r.as_object_mut().unwrap();
            o.remove("wall_time_ms");
            o.remove("log_dir");
        }
        assert_eq!(r1, r2, "{backend}: reports differ");
        for (dir, version) in [(&v1, 1u16), (&v2, 2)] {
            for (name, bytes) in dir_bytes(dir) {
                assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), version, "{backend} {name}");
            }
        }
        let size = |d: &Path| dir_bytes(d).values().map(|b| b.len()).sum::<usize>();
        assert!(size(&v2) * 3 < size(&v1) * 2, "{backend}: v2 {} bytes, v1 {}", size(&v2), size(&v1));
        cli().arg("diff").arg(&v1).arg(&v2).assert().code(0);
        cli().arg("diff").arg(&v2).arg(&v1).assert().code(0);
    }
    replay_refused("traces/mooncake-200.jsonl", &["--log-format", "3"], &t.path().join("x"))
        .stderr(predicate::str::contains("--log-format"));
}

/// The streamed handoff projection (what `project handoffs` prints, in bounded memory) hands
/// out every handoff once with the entry the whole-log ledger has, also for runs with faults,
/// expired leases and reservations, and more handoffs than it keeps finished.
#[test]
fn the_streamed_handoff_projection_equals_the_whole_ledger() {
    let t = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut runs: Vec<PathBuf> = Vec::new();
    for (i, (trace, args)) in [
        ("traces/cascade.jsonl", vec!["--config", "configs/cascade-faults.json"]),
        ("traces/cascade.jsonl", vec!["--config", "configs/cascade-short-lease.json"]),
        (
            "traces/cascade.jsonl",
            vec!["--config", "configs/cascade-short-reservation.json", "--backend", "sglang"],
        ),
        ("traces/mooncake-200.jsonl", vec!["--prefill", "1", "--decode", "1"]),
    ]
    .into_iter()
    .enumerate()
    {
        let out = t.path().join(format!("run-{i}"));
        let args: Vec<String> = args
            .iter()
            .map(|a| {
                if a.starts_with("configs/") {
                    root.join("fixtures").join(a).display().to_string()
                } else {
                    a.to_string()
                }
            })
            .collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        replay(trace, &args, &out);
        runs.push(out);
    }
    // 12,000 handoffs: the Mooncake sample 60 times over, each copy after the last.
    let sample = std::fs::read_to_string(fixture("traces/mooncake-200.jsonl")).unwrap();
    let mut long = String::new();
    for copy in 0..60u64 {
        for line in sample.lines().filter(|l| !l.trim().is_empty()) {
            let mut v: Value = serde_json::from_str(line).unwrap();
            let ts = v["timestamp"].as_u64().unwrap() + copy * 100_000;
            v["timestamp"] = ts.into();
            long.push_str(&format!("{v}\n"));
        }
    }
    let long_trace = t.path().join("long.jsonl");
    std::fs::write(&long_trace, long).unwrap();
    let out = t.path().join("long");
    cli().arg("replay").arg(&long_trace).args(SMALL).arg("--out").arg(&out).assert().success();
    runs.push(out);
    runs.push(fixture("runs/sf-12-failed-r4"));
    runs.push(fixture("runs/scripted-failures"));
    for run in &runs {
        let whole = project_handoffs(&mut RunReader::open(run).unwrap()).unwrap();
        let mut streamed = BTreeMap::new();
        let n = project_handoffs_streaming(&mut RunReader::open(run).unwrap(), |id, entry, _| {
            assert!(streamed.insert(id, entry).is_none(), "{}: {id} handed out twice", run.display());
            Ok::<(), Box<handoff_ledger::projections::run::ProjectError>>(())
        })
        .unwrap();
        assert_eq!(n, whole.entries().len(), "{}", run.display());
        if run.ends_with("long") {
            assert!(n > 2 * handoff_ledger::projections::handoffs::HandoffStream::KEEP_FINISHED, "{n}");
        }
        assert!(&streamed == whole.entries(), "{}: streamed entries differ", run.display());
    }
}

#[test]
fn folding_the_logs_reproduces_the_printed_report() {
    let t = tempfile::tempdir().unwrap();
    for backend in ["vllm", "sglang"] {
        let out = t.path().join(backend);
        let report = replay("traces/mooncake-200.jsonl", &[SMALL, &["--backend", backend]].concat(), &out);
        let o = cli().arg("project").arg(&out).args(["metrics", "--json"]).output().unwrap();
        assert!(o.status.success());
        let projected: Value = serde_json::from_slice(&o.stdout).unwrap();
        let mut report = report.as_object().unwrap().clone();
        for k in [
            "wall_time_ms",
            "drained",
            "events",
            "log_dir",
            "sessions",
            "session_turns_dropped",
            "gpus_per_worker",
            "gpu_hours",
        ] {
            assert!(report.remove(k).is_some(), "report lacks {k}");
        }
        // What was run: from the replay's own inputs, not folded from the facts.
        for k in [
            "run_id",
            "backend",
            "policy",
            "shape",
            "prefill_router",
            "decode_router",
            "seed",
            "trace",
            "trace_lines",
            "config_digest",
        ] {
            assert!(report.remove(k).is_some(), "report lacks {k}");
        }
        assert_eq!(Value::Object(report), projected, "{backend}");
        assert_eq!(projected["completed_requests"], 200);
        assert!(projected["mean_ttft_ms"].as_f64().unwrap() > 0.0);
        assert!(projected["mean_itl_ms"].as_f64().unwrap() > 0.0);
    }
}

/// Per handoff: the time of each fact kind (first occurrence).
fn milestones(recs: &[(WorkerId, u64, Fact)]) -> BTreeMap<HandoffId, BTreeMap<&'static str, (usize, u64)>> {
    let mut m: BTreeMap<HandoffId, BTreeMap<&'static str, (usize, u64)>> = BTreeMap::new();
    for (i, (_, at, f)) in recs.iter().enumerate() {
        if let Some(h) = f.handoff() {
            m.entry(h).or_default().entry(f.name()).or_insert((i, *at));
        }
    }
    m
}

#[test]
fn sglang_never_dispatches_a_prefill_before_its_destination_is_reserved() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    replay(
        "traces/cascade.jsonl",
        &["--config", fixture("configs/cascade.json").to_str().unwrap(), "--backend", "sglang"],
        &out,
    );
    let recs = records(&out);
    let m = milestones(&recs);
    assert_eq!(m.len(), 240);
    let mut waited = 0;
    for (h, ms) in &m {
        let reserved = ms.get("DestinationReserved").unwrap_or_else(|| panic!("{h} never reserved"));
        let dispatched = ms.get("PrefillDispatched").unwrap_or_else(|| panic!("{h} never dispatched"));
        assert!(reserved.1 <= dispatched.1, "{h}: prefill dispatched before reservation");
        // Streams merge by time, so causality at one instant is checked inside the prefill
        // stream: the reservation message arrived before the dispatch.
        let heard = recs.iter().position(|(w, _, f)| {
            w.role == Role::Prefill
                && matches!(f, Fact::MessageReceived { handoff, kind: MessageKind::DestinationReserved, .. } if handoff == h)
        });
        assert!(
            heard.is_some_and(|i| i < dispatched.0),
            "{h}: dispatched before the source heard of the reservation"
        );
        if ms.contains_key("ReservationQueued") {
            waited += 1;
        }
    }
    assert!(waited > 100, "decode capacity must gate prefill for most requests (waited: {waited})");
}

#[test]
fn vllm_pins_first_then_reserves_activates_and_releases_in_that_order() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    replay("traces/mooncake-200.jsonl", &[SMALL, &["--backend", "vllm"]].concat(), &out);
    let mut run = RunReader::open(&out).unwrap();
    let ledger = project_handoffs(&mut run).unwrap();
    assert_eq!(ledger.entries().len(), 200);
    for (h, e) in ledger.entries() {
        assert_eq!(
            e.normalized(),
            [
                Milestone::SourceHeld,
                Milestone::DestinationAccepted,
                Milestone::DestinationReserved,
                Milestone::DestinationActivated,
                Milestone::SourceReleased,
                Milestone::Completed
            ],
            "{h}"
        );
        assert_eq!(e.source_end, Some(EndReason::Success));
    }
}

#[test]
fn bookings_free_exactly_once_at_the_proposals_milestones() {
    let t = tempfile::tempdir().unwrap();
    for backend in ["vllm", "sglang"] {
        let out = t.path().join(backend);
        replay("traces/mooncake-200.jsonl", &[SMALL, &["--backend", backend]].concat(), &out);
        let recs = records(&out);
        let mut booked: BTreeMap<(RequestId, &str), i32> = BTreeMap::new();
        let mut compute_done: BTreeMap<RequestId, u64> = BTreeMap::new();
        let mut prefill_freed: BTreeMap<RequestId, u64> = BTreeMap::new();
        let mut released: BTreeMap<RequestId, u64> = BTreeMap::new();
        let mut handoff_req: BTreeMap<HandoffId, RequestId> = BTreeMap::new();
        for (w, at, f) in &recs {
            match f {
                Fact::PrefillBooked { request, .. } => *booked.entry((*request, "p")).or_default() += 1,
                Fact::PrefillBookingFreed { request, .. } => {
                    *booked.entry((*request, "p")).or_default() -= 1;
                    prefill_freed.insert(*request, *at);
                }
                Fact::DecodeBooked { request, .. } => *booked.entry((*request, "d")).or_default() += 1,
                Fact::DecodeBookingFreed { request, .. } => *booked.entry((*request, "d")).or_default() -= 1,
                Fact::PrefillComputeDone { request, .. } => {
                    compute_done.insert(*request, *at);
                }
                Fact::HandoffStarted { handoff, request, .. } => {
                    handoff_req.insert(*handoff, *request);
                }
                Fact::SourceReleased { handoff, .. } if w.role == Role::Prefill => {
                    released.insert(handoff_req[handoff], *at);
                }
                _ => {}
            }
        }
        assert_eq!(booked.len(), 400, "{backend}: one prefill and one decode booking per request");
        assert!(booked.values().all(|v| *v == 0), "{backend}: every booking freed exactly once");
        for (r, freed) in &prefill_freed {
            // Compute load drops at prefill completion; the booking stays until the source is released.
            assert!(compute_done[r] <= *freed, "{backend} {r}");
            assert_eq!(released[r], *freed, "{backend} {r}: prefill booking freed at source release");
        }
    }
}

#[test]
fn capacity_is_conserved_and_everything_drains() {
    let t = tempfile::tempdir().unwrap();
    for backend in ["vllm", "sglang"] {
        let out = t.path().join(backend);
        replay(
            "traces/mooncake-200.jsonl",
            &[SMALL, &["--backend", backend, "--router", "kv"]].concat(),
            &out,
        );
        let mut run = RunReader::open(&out).unwrap();
        let rows = project_capacity(&mut run).expect("conservation and non-negativity hold in every stream");
        assert_eq!(rows.len(), 4);
        for r in rows {
            assert_eq!(r.last.kv_used_blocks(), 0, "{backend} {}: drained", r.worker);
            assert_eq!(r.last.request_slots_used, 0);
            assert_eq!(r.last.decode_headroom_tokens, 0);
            assert!(r.peak_kv_used.blocks > 0);
        }
    }
}

#[test]
fn a_malformed_trace_line_is_named() {
    let t = tempfile::tempdir().unwrap();
    replay_refused("traces/malformed-json.jsonl", SMALL, &t.path().join("x")).stderr(
        predicate::str::contains("malformed-json.jsonl:")
            .and(predicate::str::is_match(r"\.jsonl:\d+: ").unwrap()),
    );
}

#[test]
fn an_invalid_configuration_is_refused_with_its_reason() {
    let t = tempfile::tempdir().unwrap();
    let cfg = t.path().join("bad.json");
    std::fs::write(&cfg, r#"{ "prefill_workers": 2, "decode_workers": 2, "lease_msec": 5 }"#).unwrap();
    replay_refused("traces/mooncake-200.jsonl", &["--config", cfg.to_str().unwrap()], &t.path().join("x"))
        .stderr(predicate::str::contains("bad.json").and(predicate::str::contains("lease_msec")));
    replay_refused("traces/mooncake-200.jsonl", &["--prefill", "2", "--decode", "0"], &t.path().join("y"))
        .stderr(predicate::str::contains("prefill and decode workers"));
}

#[test]
fn aggregated_serving_has_no_handoffs() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("agg");
    let report = replay("traces/mooncake-200.jsonl", &["--workers", "2"], &out);
    assert_eq!(report["completed_requests"], 200);
    assert_eq!(report["handoffs_started"], 0);
    assert!(records(&out).iter().all(|(_, _, f)| f.handoff().is_none()));
    assert!(report["mean_ttft_ms"].as_f64().unwrap() > 0.0);
}

/// Per prefill worker: the longest time a request waited between being queued and scheduled,
/// and the pinned share of the worker's blocks at that moment's start.
fn prefill_admission(run: &Path) -> (BTreeMap<WorkerId, f64>, BTreeMap<WorkerId, u64>, u64) {
    let mut r = RunReader::open(run).unwrap();
    let headers = r.headers().to_vec();
    let mut queued: BTreeMap<RequestId, u64> = BTreeMap::new();
    let mut pinned: BTreeMap<WorkerId, i64> = BTreeMap::new();
    let mut peak_share: BTreeMap<WorkerId, f64> = BTreeMap::new();
    let mut longest_wait: BTreeMap<WorkerId, u64> = BTreeMap::new();
    let mut total = 0;
    while let Some((i, rec)) = r.next().unwrap() {
        let h = &headers[i];
        if h.worker.role != Role::Prefill {
            continue;
        }
        total = h.engine.total_blocks as u64;
        let p = pinned.entry(h.worker).or_default();
        *p += rec.fact.kv_delta().pinned_source as i64;
        let share = *p as f64 / total as f64;
        let peak = peak_share.entry(h.worker).or_default();
        *peak = peak.max(share);
        match rec.fact {
            Fact::RequestQueued { request } => {
                queued.insert(request, rec.at_ns);
            }
            Fact::RequestScheduled { request, .. } => {
                if let Some(q) = queued.remove(&request) {
                    let w = longest_wait.entry(h.worker).or_default();
                    *w = (*w).max(rec.at_ns - q);
                }
            }
            _ => {}
        }
    }
    (peak_share, longest_wait, total)
}

fn ttft_by_arrival(per_request: &Path) -> Vec<f64> {
    let mut rows: Vec<(u64, f64)> = std::fs::read_to_string(per_request)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter_map(|v| Some((v["request_id"].as_u64()?, v["ttft_ms"].as_f64()?)))
        .collect();
    rows.sort_by_key(|r| r.0);
    rows.into_iter().map(|r| r.1).collect()
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[test]
fn the_cascade_fixture_strands_vllm_prefill_and_gates_sglang_ahead_of_prefill() {
    let t = tempfile::tempdir().unwrap();
    let cfg = fixture("configs/cascade.json");
    let cfg = cfg.to_str().unwrap();
    let mut out = BTreeMap::new();
    for backend in ["vllm", "sglang"] {
        let run = t.path().join(backend);
        let pr = t.path().join(format!("{backend}.jsonl"));
        let report = replay(
            "traces/cascade.jsonl",
            &["--config", cfg, "--backend", backend, "--per-request", pr.to_str().unwrap()],
            &run,
        );
        let (peak_share, longest_wait, _) = prefill_admission(&run);
        let ttft = ttft_by_arrival(&pr);
        out.insert(backend, (report, peak_share, longest_wait, ttft));
    }
    // vLLM: pinned sources fill both prefill workers, prefill admission stalls behind them,
    // and TTFT climbs as the backlog grows.
    let (_, peak, wait, ttft) = &out["vllm"];
    for (w, share) in peak {
        assert!(*share >= 0.9, "vllm {w}: pinned source blocks peaked at {:.0}%", share * 100.0);
        assert!(
            wait[w] > 10_000_000_000,
            "vllm {w}: prefill admission never stalled (longest wait {} ms)",
            wait[w] / 1_000_000
        );
    }
    let early = median(&ttft[..20]);
    let late = median(&ttft[ttft.len() - 40..]);
    assert!(late > 20.0 * early, "vllm TTFT must climb: early {early:.0} ms, late {late:.0} ms");
    // SGLang: the same overload waits in the decode reservation FIFO, ahead of prefill; the
    // prefill workers never fill with pins and admit promptly.
    let (report, peak, wait, _) = &out["sglang"];
    for (w, share) in peak {
        assert!(*share <= 0.3, "sglang {w}: pinned share {:.0}%", share * 100.0);
        assert!(wait[w] < 1_000_000_000, "sglang {w}: prefill admission waited {} ms", wait[w] / 1_000_000);
    }
    assert!(report["reservation_wait_ms"].is_null());
    assert!(report["mean_reservation_wait_ms"].as_f64().unwrap() > 10_000.0, "gating ahead of prefill");
    assert_eq!(report["completed_requests"], 240);
}

/// Ends of pins and reservations per handoff, counted from the facts.
fn ends(
    recs: &[(WorkerId, u64, Fact)],
) -> (BTreeMap<HandoffId, Vec<EndReason>>, BTreeMap<HandoffId, Vec<EndReason>>) {
    let mut pins: BTreeMap<HandoffId, Vec<EndReason>> = BTreeMap::new();
    let mut res: BTreeMap<HandoffId, Vec<EndReason>> = BTreeMap::new();
    for (_, _, f) in recs {
        match f {
            Fact::SourceReleased { handoff, reason, .. } => pins.entry(*handoff).or_default().push(*reason),
            Fact::ReservationReleased { handoff, reason, .. } => {
                res.entry(*handoff).or_default().push(*reason)
            }
            Fact::DestinationActivated { handoff, .. } => {
                res.entry(*handoff).or_default().push(EndReason::Success)
            }
            _ => {}
        }
    }
    (pins, res)
}

#[test]
fn a_destination_that_never_frees_unwinds_by_lease_expiry_without_stalling() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    let cfg = fixture("configs/cascade-short-lease.json");
    let report =
        replay("traces/cascade.jsonl", &["--config", cfg.to_str().unwrap(), "--backend", "vllm"], &out);
    let expired = report["leases_expired"].as_u64().unwrap();
    assert!(expired > 50, "decode stays full far longer than the 2 s lease ({expired} expired)");
    assert_eq!(report["failed_requests"].as_u64().unwrap(), expired, "each expiry fails its request");
    assert_eq!(report["completed_requests"].as_u64().unwrap() + expired, 240);
    assert_eq!(report["drained"], true);
    let recs = records(&out);
    let (pins, res) = ends(&recs);
    assert_eq!(pins.len(), 240);
    for (h, e) in &pins {
        assert_eq!(e.len(), 1, "{h}: a pin ends exactly once");
    }
    assert_eq!(pins.values().filter(|e| e[0] == EndReason::Expired).count() as u64, expired);
    for (h, e) in &res {
        assert_eq!(e.len(), 1, "{h}: a reservation ends exactly once");
    }
    // An expired handoff's destination, still waiting in the FIFO, leaves it without reserving.
    let dequeued = recs.iter().filter(|(_, _, f)| matches!(f, Fact::ReservationDequeued { .. })).count();
    assert!(dequeued > 0);
    let mut run = RunReader::open(&out).unwrap();
    for r in project_capacity(&mut run).unwrap() {
        assert_eq!(r.last.kv_used_blocks(), 0, "{}", r.worker);
    }
}

#[test]
fn lease_renewal_keeps_a_waiting_source_alive() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    let cfg = fixture("configs/cascade-renewed-lease.json");
    let report =
        replay("traces/cascade.jsonl", &["--config", cfg.to_str().unwrap(), "--backend", "vllm"], &out);
    assert_eq!(report["leases_expired"], 0);
    assert_eq!(report["completed_requests"], 240);
    let recs = records(&out);
    let renewals: Vec<(u64, u64)> = recs
        .iter()
        .filter_map(|(_, at, f)| match f {
            Fact::LeaseRenewed { deadline_ns, .. } => Some((*at, *deadline_ns)),
            _ => None,
        })
        .collect();
    assert!(renewals.len() > 100, "the destinations renewed while they waited ({})", renewals.len());
    // vLLM's lease design: each renewal moves the deadline to its instant + ⅔ of the 2 s lease.
    for (at, deadline) in renewals {
        assert_eq!(deadline, at + 2_000_000_000 / 3 * 2, "renewed at {at}");
    }
}

/// The shipped lease-design configuration (30 s, renewed every 5 s) runs the cascade as the
/// default abort timeout does: no lease expires, every request completes.
#[test]
fn the_vllm_lease_design_configuration_renews_and_completes() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    // The shipped lease keys on the cascade's small pool, where sources wait for decode.
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("configs/vllm-lease.json")).unwrap()).unwrap();
    cfg["vllm"] = serde_json::json!({ "num_gpu_blocks": 1024 });
    let path = t.path().join("lease.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let args = ["--config", path.to_str().unwrap(), "--backend", "vllm", "--prefill", "2", "--decode", "2"];
    let report = replay("traces/cascade.jsonl", &args, &out);
    assert_eq!(report["leases_expired"], 0);
    assert_eq!(report["completed_requests"], 240);
    let renewed = records(&out).iter().filter(|(_, _, f)| matches!(f, Fact::LeaseRenewed { .. })).count();
    assert!(renewed > 0, "sources waited long enough to be renewed");
}

#[test]
fn an_expired_reservation_is_released_exactly_once_and_fails_its_request() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    let cfg = fixture("configs/cascade-short-reservation.json");
    let report =
        replay("traces/cascade.jsonl", &["--config", cfg.to_str().unwrap(), "--backend", "sglang"], &out);
    let expired = report["reservations_expired"].as_u64().unwrap();
    assert!(expired > 100, "a slow prefill leaves reservations waiting past their deadline");
    assert!(report["completed_requests"].as_u64().unwrap() >= 1);
    assert_eq!(report["failed_requests"].as_u64().unwrap(), expired);
    let recs = records(&out);
    let (pins, res) = ends(&recs);
    for (h, e) in &res {
        assert_eq!(e.len(), 1, "{h}: reservation ended {} times", e.len());
    }
    let expired_res: Vec<_> = res
        .iter()
        .filter(|(_, e)| e[0] == EndReason::Canceled(handoff_ledger::ids::CancelReason::Expired))
        .collect();
    assert_eq!(expired_res.len() as u64, expired);
    for (h, e) in &pins {
        assert_eq!(e.len(), 1, "{h}: pin ended {} times", e.len());
    }
}

#[test]
fn the_cli_reports_every_planned_fault_and_whether_it_fired() {
    let dir = tempfile::tempdir().unwrap();
    let config = fixture("configs/cascade-faults.json");
    let config = config.to_str().unwrap();
    for backend in ["vllm", "sglang"] {
        let out = dir.path().join(backend);
        let r = replay(
            "traces/cascade.jsonl",
            &["--backend", backend, "--prefill", "2", "--decode", "2", "--config", config],
            &out,
        );
        let faults = r["faults"].as_array().unwrap_or_else(|| panic!("{backend}: no faults in report"));
        assert_eq!(faults.len(), 3, "{backend}: one entry per planned fault");
        for f in faults {
            assert!(f["fired_at_ns"].is_u64(), "{backend}: fault did not fire: {f}");
            assert!(f["handoff"].is_string(), "{backend}: fault names no handoff: {f}");
        }
        assert_eq!(r["drained"], true, "{backend}");
        // A canceled request is counted as such, not as completed.
        assert!(r["canceled_requests"].as_u64().unwrap() >= 1, "{backend}: {r}");
    }
}

/// A worker that can only thrash (a request preempted and readmitted forever while another
/// holds its KV behind it, virtual time advancing) stops the replay with the livelock named,
/// instead of running forever; the logs written up to then are sound.
#[test]
fn a_livelocked_worker_stops_the_run_and_is_named() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    let o = cli()
        .arg("replay")
        .arg(fixture("traces/livelock.jsonl"))
        .args(["--prefill", "1", "--decode", "3", "--config"])
        .arg(fixture("configs/livelock.json"))
        .arg("--out")
        .arg(&out)
        .timeout(std::time::Duration::from_secs(60))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("the run did not drain"), "{stderr}");
    let first = stderr.lines().find(|l| l.contains("livelocked")).unwrap_or_else(|| panic!("{stderr}"));
    assert!(first.contains("decode-2 livelocked: r11 was preempted"), "{first}");
    // Every lifecycle timeout (480 s lease at most) had its chance to free something.
    let secs: f64 = first.split(" over ").nth(1).unwrap().split(" s ").next().unwrap().parse().unwrap();
    assert!(secs >= 481.0, "{first}");
    cli().arg("verify").arg(&out).assert().success();
}

// ---------------------------------------------------------------- fidelity probes
// Each probe is a trace of a few requests that once showed a defect beneath the means.

/// Writes a Mooncake JSONL trace of `(timestamp_ms, input, output, hash_ids)` lines.
fn write_trace(dir: &Path, name: &str, lines: &[(u64, u32, u32, Vec<u64>)]) -> PathBuf {
    let path = dir.join(name);
    let text: String = lines
        .iter()
        .map(|(t, i, o, h)| {
            format!("{{\"timestamp\":{t},\"input_length\":{i},\"output_length\":{o},\"hash_ids\":{h:?}}}\n")
        })
        .collect();
    std::fs::write(&path, text).unwrap();
    path
}

/// Replays with `--per-request` and returns (report, per-request lines as written).
fn replay_per_request(trace: &Path, args: &[&str], out: &Path) -> (Value, Vec<Value>) {
    let per = out.with_extension("requests.jsonl");
    let args = [args, &["--per-request", per.to_str().unwrap()]].concat();
    let report = replay(trace.to_str().unwrap(), &args, out);
    let lines =
        std::fs::read_to_string(&per).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    (report, lines)
}

/// The vLLM cascade replay (fixture trace and config) with its per-request lines.
fn cascade_vllm_per_request(dir: &Path) -> (Value, Vec<Value>) {
    let cfg = fixture("configs/cascade.json");
    let args = ["--backend", "vllm", "--config", cfg.to_str().unwrap()];
    replay_per_request(&fixture("traces/cascade.jsonl"), &args, &dir.join("vllm"))
}

fn f(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {v}"))
}

#[test]
fn requests_arriving_together_share_one_prefill_step() {
    // Two 2048-token prompts at t=0 on 1P+1D: the reference runs both in one 4096-token step
    // (TTFT 95.901 ms each on vLLM); we once ran the first alone and the second a step later.
    let t = tempfile::tempdir().unwrap();
    let trace = write_trace(
        t.path(),
        "same.jsonl",
        &[(0, 2048, 4, vec![1, 2, 3, 4]), (0, 2048, 4, vec![5, 6, 7, 8])],
    );
    for backend in ["vllm", "sglang"] {
        let out = t.path().join(backend);
        let (_, rows) =
            replay_per_request(&trace, &["--backend", backend, "--prefill", "1", "--decode", "1"], &out);
        assert_eq!(f(&rows[0], "ttft_ms"), f(&rows[1], "ttft_ms"), "{backend}: {rows:?}");
        let steps: Vec<u32> = records(&out)
            .into_iter()
            .filter(|(w, _, _)| w.role == Role::Prefill)
            .filter_map(|(_, _, fact)| match fact {
                Fact::StepExecuted { prefill_tokens, .. } if prefill_tokens > 0 => Some(prefill_tokens),
                _ => None,
            })
            .collect();
        assert_eq!(steps, vec![4096], "{backend}: one prefill step for both prompts");
        if backend == "vllm" {
            assert!((f(&rows[0], "ttft_ms") - 95.900868).abs() < 1e-3, "the reference's figure: {rows:?}");
        }
    }
}

#[test]
fn sglang_streams_the_first_token_at_activation_and_vllm_one_decode_step_later() {
    // SGLang's decode commits the token the prefill sampled when it polls the transfer as done
    // (a prebuilt batch, no forward pass); vLLM's decode samples it itself in its first step.
    let t = tempfile::tempdir().unwrap();
    let trace = write_trace(t.path(), "one.jsonl", &[(0, 2048, 4, vec![1, 2, 3, 4])]);
    let mut first = BTreeMap::new();
    for backend in ["vllm", "sglang"] {
        let out = t.path().join(backend);
        let (_, rows) =
            replay_per_request(&trace, &["--backend", backend, "--prefill", "1", "--decode", "1"], &out);
        let (activated, token) = (f(&rows[0], "destination_activated_ms"), f(&rows[0], "first_token_ms"));
        first.insert(backend, (activated, token));
        let decode_step_ms = records(&out)
            .into_iter()
            .filter(|(w, _, _)| w.role == Role::Decode)
            .find_map(|(_, _, fact)| match fact {
                Fact::StepExecuted { duration_ns, decode_tokens, .. } if decode_tokens > 0 => {
                    Some(duration_ns as f64 / 1e6)
                }
                _ => None,
            })
            .unwrap();
        let expected = if backend == "sglang" { 0.0 } else { decode_step_ms };
        assert!((token - activated - expected).abs() < 1e-6, "{backend}: {rows:?}");
    }
    assert_eq!(first["vllm"].0, first["sglang"].0, "same transfer, same activation");
}

#[test]
fn kv_routing_spreads_a_light_trace_without_shared_prefixes() {
    // Eight isolated requests with distinct content: every worker costs the same each time.
    // Ties once all went to prefill-0 / decode-0; the reference picks among them at random.
    let t = tempfile::tempdir().unwrap();
    let lines: Vec<_> = (0..8u64).map(|i| (i * 1000, 1024, 8, vec![10 * i + 1, 10 * i + 2])).collect();
    let trace = write_trace(t.path(), "light.jsonl", &lines);
    let out = t.path().join("kv");
    let (_, rows) = replay_per_request(&trace, &["--prefill", "4", "--decode", "4", "--router", "kv"], &out);
    let distinct =
        |key: &str| rows.iter().map(|r| r[key].as_u64().unwrap()).collect::<std::collections::BTreeSet<_>>();
    assert!(distinct("prefill_worker_idx").len() >= 3, "{rows:?}");
    assert!(distinct("decode_worker_idx").len() >= 3, "{rows:?}");
}

#[test]
fn itl_includes_preemption_stalls_and_reports_them_apart() {
    // The cascade fixture preempts decodes under vLLM: a request's gap between two tokens can
    // be minutes. That gap is an inter-token latency, and is also reported as a stall.
    let t = tempfile::tempdir().unwrap();
    let (report, rows) = cascade_vllm_per_request(t.path());
    assert!(f(&report, "num_stalls") > 0.0, "{report}");
    assert!(f(&report, "max_stall_ms") > 60_000.0, "{report}");
    assert!(f(&report, "max_itl_ms") >= f(&report, "max_stall_ms"), "{report}");
    assert!(f(&report, "max_itl_ms") >= f(&report, "p99_tpot_ms"), "{report}");
    let preempted: u64 = rows.iter().map(|r| r["preemptions"].as_u64().unwrap()).sum();
    assert!(preempted as f64 >= f(&report, "num_stalls"));
    let stalled: f64 = rows.iter().map(|r| f(r, "stall_ms")).sum();
    assert!((stalled - f(&report, "mean_stall_ms") * f(&report, "num_stalls")).abs() < 1.0);
}

#[test]
fn per_request_records_are_complete_in_arrival_order_and_say_why_they_ended() {
    let t = tempfile::tempdir().unwrap();
    let (report, rows) = cascade_vllm_per_request(t.path());
    assert_eq!(rows.len() as u64, report["num_requests"].as_u64().unwrap());
    let arrivals: Vec<f64> = rows.iter().map(|r| f(r, "arrival_time_ms")).collect();
    assert!(arrivals.windows(2).all(|w| w[0] <= w[1]), "lines in arrival order");
    for r in &rows {
        let status = r["terminal_status"].as_str().unwrap();
        if !r["source_held_ms"].is_null() {
            assert!(!r["source_released_ms"].is_null(), "a released source says when: {r}");
            assert!(f(r, "prefill_admit_ms") < f(r, "source_held_ms"), "{r}");
        }
        if status == "completed" {
            assert_eq!(r["terminal_reason"], "completed");
            assert!(f(r, "decode_admit_ms") >= f(r, "destination_activated_ms"), "{r}");
            assert!(f(r, "first_token_ms") > f(r, "decode_admit_ms"), "{r}");
        } else {
            assert_eq!((status, r["terminal_reason"].as_str().unwrap()), ("failed", "lease-expired"), "{r}");
        }
    }
    // Admission is when the step that scheduled the prompt began: the first request arrives
    // at t=0 on an idle worker.
    assert_eq!(f(&rows[0], "prefill_admit_ms"), 0.0, "{}", rows[0]);
    // SGLang with a short bootstrap timeout: prefills waiting for a destination fail, and say so.
    let cfg2 = t.path().join("bootstrap.json");
    std::fs::write(
        &cfg2,
        r#"{"prefill_workers":2,"decode_workers":2,"sglang":{"total_pages":1024},"bootstrap_timeout_ms":20000}"#,
    )
    .unwrap();
    let (report, rows) = replay_per_request(
        &fixture("traces/cascade.jsonl"),
        &["--backend", "sglang", "--config", cfg2.to_str().unwrap()],
        &t.path().join("sglang"),
    );
    let timed_out = rows.iter().filter(|r| r["terminal_reason"] == "bootstrap-timeout").count() as u64;
    assert!(timed_out > 0, "{report}");
    assert_eq!(report["terminal_reasons"]["bootstrap-timeout"].as_u64(), Some(timed_out));
}

#[test]
fn disabled_policy_on_a_disaggregated_cluster_pins_and_reserves_nothing() {
    // The behaviour before the lifecycle, to compare against: the prefill frees its KV at
    // completion; decode gets the request after the whole prompt's transfer time and takes its
    // blocks only when it admits it.
    let t = tempfile::tempdir().unwrap();
    let cfg = fixture("configs/cascade.json");
    for backend in ["vllm", "sglang"] {
        let out = t.path().join(backend);
        let args = ["--backend", backend, "--policy", "disabled", "--config", cfg.to_str().unwrap()];
        let (report, rows) = replay_per_request(&fixture("traces/cascade.jsonl"), &args, &out);
        assert_eq!(report["completed_requests"], report["num_requests"], "{backend}: {report}");
        assert_eq!(report["handoffs_started"], 0, "{backend}");
        let recs = records(&out);
        let lifecycle = recs.iter().filter(|(_, _, f)| f.handoff().is_some()).count();
        assert_eq!(lifecycle, 0, "{backend}: no handoff fact at all");
        let mut run = RunReader::open(&out).unwrap();
        for row in project_capacity(&mut run).unwrap() {
            let peaks = (row.peak_pinned_source.blocks, row.peak_reserved_destination.blocks);
            assert_eq!(peaks, (0, 0), "{backend} {}", row.worker);
            assert_eq!(row.last.kv_used_blocks(), 0, "{backend} {}: drained", row.worker);
        }
        // Each prefill is a one-token request that finishes on its prefill worker; decode admits
        // the request no earlier than the prompt's transfer after that.
        let mut prefill_done = BTreeMap::new();
        for (w, at, f) in &recs {
            if let (Role::Prefill, Fact::RequestFinished { request, output_tokens, .. }) = (w.role, f) {
                assert_eq!(*output_tokens, 1, "{backend}");
                prefill_done.insert(request.0, *at as f64 / 1e6);
            }
        }
        for r in &rows {
            let id = r["request_id"].as_u64().unwrap();
            let transfer_ms = r["input_length"].as_f64().unwrap() * 131_072.0 / 64e9 * 1e3;
            assert!(f(r, "decode_admit_ms") >= prefill_done[&id] + transfer_ms - 1e-6, "{backend}: {r}");
            assert!(f(r, "first_token_ms") > f(r, "decode_admit_ms"), "{backend}: {r}");
            assert_eq!(
                r["output_length"], r["requested_output_length"],
                "{backend}: decode makes every token"
            );
        }
        cli().arg("verify").arg(&out).assert().success();
    }
}

#[test]
fn session_turns_follow_the_previous_turns_end_and_closed_loop_holds_concurrency() {
    let t = tempfile::tempdir().unwrap();
    // Two sessions of three turns; turn 2 of "a" has an explicit delay, the others take the
    // timestamp difference as their think time. Timestamps of later turns are otherwise ignored.
    let lines = [
        r#"{"timestamp":0,"input_length":600,"output_length":20,"session_id":"a"}"#,
        r#"{"timestamp":10,"input_length":700,"output_length":20,"session_id":"b"}"#,
        r#"{"timestamp":50,"input_length":900,"output_length":20,"session_id":"a","delay":250}"#,
        r#"{"timestamp":60,"input_length":800,"output_length":20,"session_id":"b"}"#,
        r#"{"timestamp":90,"input_length":1000,"output_length":20,"session_id":"a"}"#,
        r#"{"timestamp":100,"input_length":500,"output_length":20,"session_id":"b"}"#,
    ];
    let trace = t.path().join("sessions.jsonl");
    std::fs::write(&trace, lines.join("\n") + "\n").unwrap();
    let out = t.path().join("open");
    let (_, rows) = replay_per_request(&trace, &["--prefill", "1", "--decode", "1"], &out);
    let by_id: BTreeMap<u64, &Value> = rows.iter().map(|r| (r["request_id"].as_u64().unwrap(), r)).collect();
    // (turn, previous turn, think time in ms)
    for (turn, prev, think_ms) in [(2, 0, 250.0), (4, 2, 40.0), (3, 1, 50.0), (5, 3, 40.0)] {
        let expected = f(by_id[&prev], "terminal_time_ms") + think_ms;
        assert!((f(by_id[&turn], "arrival_time_ms") - expected).abs() < 1e-6, "turn {turn}: {rows:?}");
    }
    assert_eq!(f(by_id[&1], "arrival_time_ms"), 10.0, "a first turn arrives at its timestamp");

    // Closed loop, one at a time: each request arrives as the previous one ends.
    let plain: Vec<_> = (0..4u64).map(|i| (i * 1000, 600, 10, vec![i + 1, i + 100])).collect();
    let trace = write_trace(t.path(), "plain.jsonl", &plain);
    let out = t.path().join("closed");
    let (_, rows) =
        replay_per_request(&trace, &["--prefill", "1", "--decode", "1", "--concurrency", "1"], &out);
    assert_eq!(f(&rows[0], "arrival_time_ms"), 0.0);
    for w in rows.windows(2) {
        assert_eq!(f(&w[1], "arrival_time_ms"), f(&w[0], "terminal_time_ms"), "{rows:?}");
    }
}

#[test]
fn transfers_sharing_a_nic_share_its_bandwidth_when_contention_is_on() {
    // Two prompts prefilled together on 1P+1D move their KV over the same two NICs at once:
    // with processor sharing each takes twice as long as alone; with one transfer at a time
    // per worker the second waits for the first.
    let t = tempfile::tempdir().unwrap();
    let trace =
        write_trace(t.path(), "two.jsonl", &[(0, 2048, 4, vec![1, 2, 3, 4]), (0, 2048, 4, vec![5, 6, 7, 8])]);
    let alone_ms = 2048.0 * 131_072.0 / 8e9 * 1e3; // 8 GB/s
    let run = |name: &str, contention: &str| {
        let cfg = t.path().join(format!("{name}.json"));
        let text = format!(
            r#"{{"prefill_workers":1,"decode_workers":1,"transfer":{{"mode":"bandwidth","bandwidth_gbps":8}},"contention":{contention}}}"#
        );
        std::fs::write(&cfg, text).unwrap();
        replay_per_request(&trace, &["--config", cfg.to_str().unwrap()], &t.path().join(name)).1
    };
    let off = run("off", r#"{"enabled":false}"#);
    for r in &off {
        assert!((f(r, "transfer_ms") - alone_ms).abs() < 1e-3, "{r}");
        assert!(r["transfer_queued_ms"].is_null());
    }
    let shared = run("shared", r#"{"enabled":true}"#);
    for r in &shared {
        assert!((f(r, "transfer_ms") - 2.0 * alone_ms).abs() < 1e-3, "{r}");
        assert_eq!(f(r, "transfer_queued_ms"), 0.0);
    }
    let serial = run("serial", r#"{"enabled":true,"max_concurrent_per_worker":1}"#);
    let mut queued: Vec<f64> = serial.iter().map(|r| f(r, "transfer_queued_ms")).collect();
    queued.sort_by(f64::total_cmp);
    assert!(queued[0] == 0.0 && (queued[1] - alone_ms).abs() < 1e-3, "{serial:?}");
    cli().arg("verify").arg(t.path().join("serial")).assert().success();
}

#[test]
fn a_full_reservation_queue_fails_the_handoff_instead_of_renewing_its_lease_forever() {
    // vLLM, lease renewal on, a pending-reservation FIFO of one: the decode refused the second
    // reservation with an error the replay took for a race, and renewed that handoff's lease
    // every 500 ms forever (the virtual clock ran for weeks, the logs grew ~300 MB/s).
    let t = tempfile::tempdir().unwrap();
    let cfg = t.path().join("renew.json");
    std::fs::write(
        &cfg,
        r#"{"prefill_workers":1,"decode_workers":1,"vllm":{"num_gpu_blocks":1024,"max_pending_reservations":1},"lease_ms":2000,"lease_renew_ms":500}"#,
    )
    .unwrap();
    let out = t.path().join("run");
    let (report, rows) =
        replay_per_request(&fixture("traces/cascade.jsonl"), &["--config", cfg.to_str().unwrap()], &out);
    assert_eq!(report["drained"], true, "{report}");
    let rejected = report["rejected_requests"].as_u64().unwrap();
    assert!(rejected > 0, "{report}");
    assert_eq!(
        rows.iter().filter(|r| r["terminal_reason"] == "destination-rejected").count() as u64,
        rejected
    );
    assert!(f(&report, "duration_ms") < 3_600_000.0, "{report}");
}

#[test]
fn numbers_that_would_overflow_the_clock_or_the_machine_are_refused_by_name() {
    let t = tempfile::tempdir().unwrap();
    let far = t.path().join("far.jsonl");
    std::fs::write(
        &far,
        "{\"timestamp\":0,\"input_length\":10,\"output_length\":2}\n{\"timestamp\":2e13,\"input_length\":10,\"output_length\":2}\n",
    )
    .unwrap();
    let cascade = fixture("traces/cascade.jsonl").display().to_string();
    // The cascade trace under a configuration file holding `text`.
    let with_config = |name: &str, text: &str| {
        let p = t.path().join(name);
        std::fs::write(&p, text).unwrap();
        vec![cascade.clone(), "--config".into(), p.display().to_string()]
    };
    let flags =
        |extra: &[&str]| [vec![cascade.clone()], extra.iter().map(|a| a.to_string()).collect()].concat();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec![far.display().to_string()], "far.jsonl:2: timestamp"),
        (flags(&["--speedup", "1e-12"]), "cascade.jsonl:2"),
        (with_config("lease.json", r#"{"lease_ms":18446744073709551}"#), "lease_ms"),
        (with_config("blocks.json", r#"{"vllm":{"num_gpu_blocks":4294967294}}"#), "num_gpu_blocks"),
        (
            with_config("pages.json", r#"{"backend":"Sglang","sglang":{"total_pages":2147483647}}"#),
            "total_pages",
        ),
        (
            with_config("bw.json", r#"{"transfer":{"mode":"bandwidth","bandwidth_gbps":1e-300}}"#),
            "bandwidth_gbps",
        ),
        (flags(&["--prefill", "5000", "--decode", "1"]), "workers"),
    ];
    for (args, needle) in cases {
        let o = cli()
            .arg("replay")
            .args(&args)
            .arg("--out")
            .arg(t.path().join("out"))
            .arg("--force")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn a_run_that_lost_a_stream_is_reported_incomplete_by_every_command() {
    // Other streams name decode-1 (bookings, messages, routing): folding the rest would give
    // figures that look complete.
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    let cfg = fixture("configs/cascade.json");
    replay("traces/cascade.jsonl", &["--config", cfg.to_str().unwrap()], &out);
    std::fs::remove_file(out.join("decode-1.hlog")).unwrap();
    for args in [vec!["verify"], vec!["project", "metrics"], vec!["inspect"], vec!["show"]] {
        let (cmd, rest) = args.split_first().unwrap();
        let o = cli().arg(cmd).arg(&out).args(rest).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} accepted a run without decode-1");
        assert!(err.contains("decode-1") && err.contains("incomplete run"), "{args:?}: {err}");
    }
}

#[test]
fn merge_never_writes_over_its_inputs() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    replay("traces/mooncake-200.jsonl", SMALL, &out);
    let before = dir_bytes(&out);
    let merged = t.path().join("run.hrun");
    for target in [out.join("router.hlog"), out.join("extra.hlog")] {
        let o = cli().arg("merge").arg(&out).arg(&target).arg("--force").output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{}", target.display());
        assert!(String::from_utf8_lossy(&o.stderr).contains("refusing to write the merged run over"));
    }
    assert!(dir_bytes(&out) == before, "the run directory is untouched");
    cli().arg("merge").arg(&out).arg(&merged).assert().success();
    // An existing output is replaced only with --force (as replay's run directories); never
    // when it is the input itself.
    let o = cli().arg("merge").arg(&out).arg(&merged).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--force"));
    cli().arg("merge").arg(&out).arg(&merged).arg("--force").assert().success();
    let o = cli().arg("merge").arg(&merged).arg(&merged).arg("--force").output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("over one of its inputs"));
    cli().arg("verify").arg(&merged).assert().success();
}

#[test]
fn show_selects_by_request_or_handoff_prefix_and_says_when_nothing_matches() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    replay("traces/mooncake-200.jsonl", SMALL, &out);
    let lines = |args: &[&str]| {
        let o = cli().arg("show").arg(&out).args(args).arg("--json").output().unwrap();
        assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .collect::<Vec<_>>()
    };
    let of_request = lines(&["--request", "12"]);
    let handoff = of_request.iter().find_map(|v| v["handoff"].as_str().map(String::from)).unwrap();
    // Every record is about request 12 or its handoff, on the router and both roles' streams.
    assert!(of_request.iter().all(|v| v["request"] == 12 || v["handoff"] == handoff.as_str()));
    let workers: std::collections::BTreeSet<&str> =
        of_request.iter().filter_map(|v| v["worker"].as_str()).collect();
    assert!(workers.len() >= 3, "{workers:?}");
    let by_prefix = lines(&["--handoff", &handoff[..8]]);
    assert_eq!(by_prefix, lines(&["--handoff", &handoff]));
    assert!(!by_prefix.is_empty() && by_prefix.iter().all(|v| v["handoff"] == handoff.as_str()));
    for (args, code, needle) in [
        (vec!["--request", "99999"], 1, "no records about request 99999"),
        (vec!["--handoff", "ffffffff"], 1, "no handoff"),
        (vec!["--handoff", "0"], 2, "ambiguous"),
        (vec!["--handoff", "xyz"], 2, "not a HandoffId"),
    ] {
        let o = cli().arg("show").arg(&out).args(&args).output().unwrap();
        assert_eq!(o.status.code(), Some(code), "{args:?}");
        assert!(String::from_utf8_lossy(&o.stderr).contains(needle), "{args:?}");
    }
    let o = cli().arg("show").arg(fixture("traces/mooncake-200.jsonl")).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("is a Mooncake JSONL trace, not a log"));
    let o = cli().arg("inspect").arg(&out).args(["--top", "0"]).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stdout).contains("none asked for: --top 0"));
}

#[test]
fn the_config_takes_the_command_lines_spellings_and_a_byte_order_mark() {
    let t = tempfile::tempdir().unwrap();
    let spelled = t.path().join("spelled.json");
    std::fs::write(
        &spelled,
        "\u{feff}{\"backend\":\"sglang\",\"policy\":\"destination-first\",\"prefill_workers\":2,\"decode_workers\":2,\"prefill_router\":\"kv\",\"decode_router\":{\"mode\":\"kv\",\"temperature\":0.5}}",
    )
    .unwrap();
    let canonical = t.path().join("canonical.json");
    std::fs::write(
        &canonical,
        r#"{"backend":"Sglang","policy":"DestinationFirst","prefill_workers":2,"decode_workers":2,"prefill_router":{"mode":"kv"},"decode_router":{"mode":"kv","temperature":0.5}}"#,
    )
    .unwrap();
    let a = t.path().join("a");
    let b = t.path().join("b");
    replay("traces/mooncake-200.jsonl", &["--config", spelled.to_str().unwrap()], &a);
    replay("traces/mooncake-200.jsonl", &["--config", canonical.to_str().unwrap()], &b);
    assert!(dir_bytes(&a) == dir_bytes(&b), "both spellings mean the same run");
}

#[test]
fn project_exports_per_request_records_and_capacity_series() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    let per = out.with_extension("requests.jsonl");
    replay("traces/mooncake-200.jsonl", &[SMALL, &["--per-request", per.to_str().unwrap()]].concat(), &out);
    // Folded from the logs, the per-request lines are the ones the replay wrote.
    let o = cli().arg("project").arg(&out).arg("requests").output().unwrap();
    assert!(o.status.success());
    assert_eq!(String::from_utf8_lossy(&o.stdout), std::fs::read_to_string(&per).unwrap());
    let o = cli().arg("project").arg(&out).args(["requests", "--csv"]).output().unwrap();
    let csv = String::from_utf8_lossy(&o.stdout).to_string();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert!(header.contains(&"ttft_ms") && header.contains(&"terminal_reason"));
    assert_eq!(lines.filter(|l| l.split(',').count() == header.len()).count(), 200);
    // Series: every row has every column, and each worker ends drained.
    let o = cli().arg("project").arg(&out).args(["series", "--csv"]).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    let rows: Vec<Vec<&str>> = text.lines().skip(1).map(|l| l.split(',').collect()).collect();
    assert!(rows.len() > 100 && rows.iter().all(|r| r.len() == 16));
    let mut last_used: BTreeMap<&str, &str> = BTreeMap::new();
    for r in &rows {
        last_used.insert(r[1], r[5]);
    }
    assert_eq!(last_used.len(), 4);
    assert!(last_used.values().all(|v| *v == "0"), "{last_used:?}");
}

#[test]
fn the_replay_explains_itself_when_nothing_completes_or_an_output_cannot_be_written() {
    let t = tempfile::tempdir().unwrap();
    // Every prompt needs more blocks than the worker has: exit 1 saying why, not a table of zeros.
    let cfg = t.path().join("tiny.json");
    std::fs::write(&cfg, r#"{"vllm":{"num_gpu_blocks":10}}"#).unwrap();
    let o = cli()
        .arg("replay")
        .arg(fixture("traces/cascade.jsonl"))
        .args(["--config", cfg.to_str().unwrap(), "--out"])
        .arg(t.path().join("tiny"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no request completed (240 never-fits)"));
    // An unwritable report path fails before the replay runs: no streams were written.
    let out = t.path().join("never");
    let o = cli()
        .arg("replay")
        .arg(fixture("traces/cascade.jsonl"))
        .arg("--out")
        .arg(&out)
        .args(["--report-json", "/nonexistent-dir/r.json"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent-dir/r.json"));
    assert!(!out.exists());
    // No shape given: the report says it ran one aggregated worker.
    let o = cli()
        .arg("replay")
        .arg(fixture("traces/cascade.jsonl"))
        .arg("--out")
        .arg(t.path().join("agg"))
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stdout).contains("one aggregated worker"));
    // Backend names in any case; trtllm is not offered.
    let o = cli()
        .arg("replay")
        .arg(fixture("traces/cascade.jsonl"))
        .args(["--backend", "SGLang", "--out"])
        .arg(t.path().join("sg"))
        .output()
        .unwrap();
    assert!(o.status.success());
    let o = cli()
        .arg("replay")
        .arg(fixture("traces/cascade.jsonl"))
        .args(["--backend", "trtllm", "--out", "x"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not modeled"));
}

// ---------------------------------------------------------------- scaling (planned and planner)

/// Writes a replay config: the cascade fixture's shape (2P+2D, 1024 blocks) plus `extra` keys.
fn cascade_config(dir: &Path, name: &str, extra: &str) -> PathBuf {
    let path = dir.join(name);
    let base = r#""prefill_workers": 2, "decode_workers": 2, "vllm": { "num_gpu_blocks": 1024 }, "sglang": { "total_pages": 1024 }"#;
    let sep = if extra.is_empty() { "" } else { ", " };
    std::fs::write(&path, format!("{{ {base}{sep}{extra} }}")).unwrap();
    path
}

fn write_config(dir: &Path, name: &str, json: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, json).unwrap();
    path
}

const NS_PER_S: u64 = 1_000_000_000;

/// Every `DecodeBooked` as (at_ns, request, worker).
fn decode_bookings(recs: &[(WorkerId, u64, Fact)]) -> Vec<(u64, RequestId, WorkerId)> {
    recs.iter()
        .filter_map(|(_, at, f)| match f {
            Fact::DecodeBooked { request, worker, .. } => Some((*at, *request, *worker)),
            _ => None,
        })
        .collect()
}

/// Every command that reads a run accepts it (`worker`: one to `show`).
fn every_reader_accepts(run: &Path, worker: &str) {
    for args in [
        vec!["verify"],
        vec!["project", "metrics", "--json"],
        vec!["project", "capacity"],
        vec!["project", "handoffs"],
        vec!["project", "scheduler"],
        vec!["inspect", "--json"],
        vec!["at", "--time", "10s"],
        vec!["show", "--worker", worker],
    ] {
        let (cmd, rest) = args.split_first().unwrap();
        let o = cli().arg(cmd).arg(run).args(rest).output().unwrap();
        assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    }
    let o = cli().arg("diff").arg(run).arg(run).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "diff of a run with itself: {}", String::from_utf8_lossy(&o.stdout));
}

#[test]
fn decode_workers_added_mid_cascade_take_new_handoffs_and_strand_less() {
    let t = tempfile::tempdir().unwrap();
    let scaled = cascade_config(t.path(), "up.json", r#""scale": [{"at_ms": 20000, "decode": 2}]"#);
    let run = t.path().join("up");
    let report = replay("traces/cascade.jsonl", &["--config", scaled.to_str().unwrap()], &run);
    let base_run = t.path().join("base");
    let base = replay(
        "traces/cascade.jsonl",
        &["--config", fixture("configs/cascade.json").to_str().unwrap()],
        &base_run,
    );
    assert_eq!(report["drained"], true);
    assert_eq!(report["num_requests"], 240);

    // The new workers have streams of their own, starting with SessionStarted at the join.
    let recs = records(&run);
    let (d2, d3) = (WorkerId::decode(2), WorkerId::decode(3));
    for w in [d2, d3] {
        assert!(run.join(format!("{w}.hlog")).is_file(), "{w} has no stream");
        let first = recs.iter().find(|(rw, _, _)| *rw == w).unwrap();
        assert_eq!(first.1, 20 * NS_PER_S, "{w}");
        assert!(matches!(first.2, Fact::SessionStarted { .. }), "{w}: {:?}", first.2);
    }
    let scaling = report["scaling"].as_array().unwrap();
    assert_eq!(scaling.len(), 1);
    assert_eq!(scaling[0]["role"], "decode");
    assert_eq!(scaling[0]["change"], 2);
    assert_eq!(scaling[0]["reason"], "planned (scale[0])");
    assert_eq!(scaling[0]["workers"][1]["worker"], "decode-3");
    every_reader_accepts(&run, "decode-2");

    // The decode router routes new selections to them from the join on, and they reserve at
    // once: the first request routed to each was reserved at the instant it was routed.
    let bookings = decode_bookings(&recs);
    let new: Vec<&(u64, RequestId, WorkerId)> = bookings.iter().filter(|b| b.2 == d2 || b.2 == d3).collect();
    assert!(new.iter().all(|b| b.0 >= 20 * NS_PER_S));
    let after = bookings.iter().filter(|b| b.0 >= 20 * NS_PER_S).count();
    // Round-robin over four from decode-0: the new ones get half, less a partial round.
    assert!(new.len() + 2 >= after / 2, "{} of {after} went to the new workers", new.len());
    let m = milestones(&recs);
    let handoff_of: BTreeMap<RequestId, HandoffId> = recs
        .iter()
        .filter_map(|(_, _, f)| match f {
            Fact::HandoffStarted { handoff, request, .. } => Some((*request, *handoff)),
            _ => None,
        })
        .collect();
    for w in [d2, d3] {
        let (at, r, _) = new.iter().find(|b| b.2 == w).unwrap();
        let reserved = m[&handoff_of[r]]["DestinationReserved"].1;
        assert_eq!(reserved, *at, "{w}: {r} waited for its reservation");
    }
    // Nothing stuck, everything given back.
    let mut reader = RunReader::open(&run).unwrap();
    for row in project_capacity(&mut reader).unwrap() {
        assert_eq!(row.last.kv_used_blocks(), 0, "{}", row.worker);
        assert_eq!(row.last.request_slots_used, 0, "{}", row.worker);
    }
    let (mut booked, mut freed) = (0, 0);
    for (_, _, f) in &recs {
        match f {
            Fact::PrefillBooked { .. } | Fact::DecodeBooked { .. } => booked += 1,
            Fact::PrefillBookingFreed { .. } | Fact::DecodeBookingFreed { .. } => freed += 1,
            _ => {}
        }
    }
    assert_eq!(booked, freed);
    // Less stranding than the same trace on two decode workers.
    let pinned = |r: &Value| {
        r["pinned_block_seconds"].as_object().unwrap().values().map(|v| v.as_f64().unwrap()).sum::<f64>()
    };
    assert!(pinned(&report) < 0.6 * pinned(&base), "{} vs {}", pinned(&report), pinned(&base));
    assert!(report["leases_expired"].as_u64() < base["leases_expired"].as_u64());
    assert!(report["completed_requests"].as_u64() > base["completed_requests"].as_u64());
}

/// vLLM (source-first): a source pinned before decode scales up, whose destination waits for
/// room on an old decode worker, is reserved by a worker that joined: the old destination
/// withdraws (its queued reservation dequeued, the source never told), the decode booking moves,
/// and the new worker reserves at the instant it joins and completes the handoff. SGLang routes
/// the decode before dispatching the prefill, so it has nothing to move.
#[test]
fn a_source_pinned_before_decode_scales_up_is_reserved_by_the_new_worker() {
    let t = tempfile::tempdir().unwrap();
    let scaled = cascade_config(t.path(), "up.json", r#""scale": [{"at_ms": 20000, "decode": 2}]"#);
    let run = t.path().join("up");
    let report = replay("traces/cascade.jsonl", &["--config", scaled.to_str().unwrap()], &run);
    assert_eq!(report["drained"], true);
    let recs = records(&run);
    let join = 20 * NS_PER_S;
    let new = [WorkerId::decode(2), WorkerId::decode(3)];
    let rerouted: Vec<(WorkerId, u64, HandoffId)> = recs
        .iter()
        .filter_map(|(w, at, f)| match f {
            Fact::HandoffCanceled { handoff, reason: CancelReason::Rerouted } => Some((*w, *at, *handoff)),
            _ => None,
        })
        .collect();
    assert!(rerouted.len() >= 4, "{} destinations moved", rerouted.len());
    let request_of: BTreeMap<HandoffId, RequestId> = recs
        .iter()
        .filter_map(|(_, _, f)| match f {
            Fact::HandoffStarted { handoff, request, .. } => Some((*handoff, *request)),
            _ => None,
        })
        .collect();
    for (old, at, h) in &rerouted {
        assert!(!new.contains(old), "{h} moved away from a new worker");
        assert_eq!(*at, join, "{h}");
        let about = |w: WorkerId| recs.iter().filter(move |(rw, _, f)| *rw == w && f.handoff() == Some(*h));
        // Pinned before the join, routed to the old worker and never reserved there.
        let pinned =
            recs.iter().find(|(_, _, f)| matches!(f, Fact::SourcePinned { handoff, .. } if handoff == h));
        assert!(pinned.is_some_and(|p| p.1 < join), "{h}");
        assert!(about(*old)
            .all(|(_, _, f)| !matches!(f, Fact::DestinationReserved { .. } | Fact::MessageSent { .. })));
        assert!(about(*old)
            .any(|(_, _, f)| matches!(f, Fact::ReservationDequeued { reason: CancelReason::Rerouted, .. })));
        // Reserved by a new worker at the join, and completed there; the source let go on success.
        let (w, reserved_at) = recs
            .iter()
            .find_map(|(w, at, f)| {
                matches!(f, Fact::DestinationReserved { handoff, .. } if handoff == h).then_some((*w, *at))
            })
            .unwrap();
        assert!(new.contains(&w) && reserved_at == join, "{h}: reserved on {w} at {reserved_at}");
        assert!(about(w).any(|(_, _, f)| matches!(f, Fact::DestinationActivated { .. })), "{h}");
        assert!(recs.iter().any(|(_, _, f)| matches!(
            f,
            Fact::SourceReleased { handoff, reason: EndReason::Success, .. } if handoff == h
        )));
        // The decode booking moved with it.
        let r = request_of[h];
        let booked: Vec<WorkerId> =
            decode_bookings(&recs).into_iter().filter(|b| b.1 == r).map(|b| b.2).collect();
        assert_eq!(booked, vec![*old, w], "{h}");
    }
    every_reader_accepts(&run, "decode-2");

    let sglang = t.path().join("sglang");
    replay("traces/cascade.jsonl", &["--config", scaled.to_str().unwrap(), "--backend", "sglang"], &sglang);
    assert!(!records(&sglang)
        .iter()
        .any(|(_, _, f)| matches!(f, Fact::HandoffCanceled { reason: CancelReason::Rerouted, .. })));
}

#[test]
fn a_removed_decode_worker_takes_no_new_work_finishes_its_own_and_leaves() {
    let t = tempfile::tempdir().unwrap();
    let cfg = write_config(
        t.path(),
        "down.json",
        r#"{ "prefill_workers": 2, "decode_workers": 2, "scale": [{"at_ms": 30000, "decode": -1}] }"#,
    );
    let run = t.path().join("down");
    let report = replay("traces/mooncake-200.jsonl", &["--config", cfg.to_str().unwrap()], &run);
    assert_eq!(report["drained"], true);
    assert_eq!(report["completed_requests"], 200);
    let recs = records(&run);
    let d1 = WorkerId::decode(1);
    let at = 30 * NS_PER_S;
    let bookings = decode_bookings(&recs);
    assert!(bookings.iter().all(|b| b.2 != d1 || b.0 < at), "decode-1 booked after it was removed");
    assert!(bookings.iter().any(|b| b.2 != d1 && b.0 >= at), "decode-0 took the rest");
    // What decode-1 held at the instant, it completed.
    let held: Vec<RequestId> = bookings
        .iter()
        .filter(|b| b.2 == d1)
        .map(|b| b.1)
        .filter(|r| {
            recs.iter().any(|(w, t, f)| {
                *w == d1 && *t > at && matches!(f, Fact::RequestFinished { request, .. } if request == r)
            })
        })
        .collect();
    assert!(!held.is_empty(), "decode-1 held nothing at the removal: the test proves nothing");
    for r in &held {
        let done = recs.iter().any(|(w, _, f)| {
            *w == d1
                && matches!(f, Fact::RequestFinished { request, status: TerminalStatus::Completed, .. } if request == r)
        });
        assert!(done, "{r} did not complete on decode-1");
    }
    // It left once drained: WorkerLeft is its last record before the end marker, after its
    // last request finished.
    let own: Vec<&(WorkerId, u64, Fact)> = recs.iter().filter(|(w, _, _)| *w == d1).collect();
    assert!(matches!(own.last().unwrap().2, Fact::StreamEnded), "a clean end closes every stream");
    let (_, left_ns, last) = own[own.len() - 2];
    assert!(matches!(last, Fact::WorkerLeft { .. }), "{last:?}");
    assert_eq!(own.iter().filter(|(_, _, f)| matches!(f, Fact::WorkerLeft { .. })).count(), 1);
    let last_finish =
        own.iter().filter(|(_, _, f)| matches!(f, Fact::RequestFinished { .. })).map(|r| r.1).max();
    assert_eq!(last_finish, Some(*left_ns));
    let scaling = &report["scaling"][0];
    assert_eq!(scaling["change"], -1);
    assert_eq!(scaling["workers"][0]["worker"], "decode-1");
    assert_eq!(scaling["workers"][0]["left_at_ms"].as_f64().unwrap(), *left_ns as f64 / 1e6);
    every_reader_accepts(&run, "decode-1");
}

#[test]
fn worker_seconds_count_each_worker_from_its_join_to_its_leave() {
    let t = tempfile::tempdir().unwrap();
    let close = |a: f64, b: f64| (a - b).abs() < 1e-6 * b.max(1.0);
    // Two decode workers join at 20 s; 8 GPUs per worker. The cascade's first request arrives
    // at 0, so the run's duration T is its last terminal outcome.
    let up = cascade_config(
        t.path(),
        "up.json",
        r#""gpus_per_worker": 8, "scale": [{"at_ms": 20000, "decode": 2}]"#,
    );
    let r = replay("traces/cascade.jsonl", &["--config", up.to_str().unwrap()], &t.path().join("up"));
    let secs = r["duration_ms"].as_f64().unwrap() / 1e3;
    let (p, d) =
        (r["worker_seconds_prefill"].as_f64().unwrap(), r["worker_seconds_decode"].as_f64().unwrap());
    assert!(close(p, 2.0 * secs), "prefill {p} for {secs} s");
    assert!(close(d, 2.0 * secs + 2.0 * (secs - 20.0)), "decode {d} for {secs} s");
    assert!(close(r["gpu_hours"].as_f64().unwrap(), (p + d) * 8.0 / 3600.0));
    assert_eq!(r["gpus_per_worker"], 8);
    // A decode worker taken out at 30 s counts until it left; the fold over the logs agrees.
    let down = write_config(
        t.path(),
        "down.json",
        r#"{ "prefill_workers": 2, "decode_workers": 2, "scale": [{"at_ms": 30000, "decode": -1}] }"#,
    );
    let run = t.path().join("down");
    let r = replay("traces/mooncake-200.jsonl", &["--config", down.to_str().unwrap()], &run);
    let first_arrival_s = 0.0; // the trace's first timestamp
    let secs = r["duration_ms"].as_f64().unwrap() / 1e3;
    let left_s = r["scaling"][0]["workers"][0]["left_at_ms"].as_f64().unwrap() / 1e3;
    assert!(left_s >= 30.0 && left_s < secs);
    let d = r["worker_seconds_decode"].as_f64().unwrap();
    assert!(close(d, secs + (left_s - first_arrival_s)), "decode {d}: {secs} s + decode-1 until {left_s} s");
    assert!(close(r["gpu_hours"].as_f64().unwrap(), (2.0 * secs + d) / 3600.0));
    let o = cli().arg("project").arg(&run).args(["metrics", "--json"]).output().unwrap();
    let projected: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(projected["worker_seconds_decode"], r["worker_seconds_decode"]);
    assert_eq!(projected["worker_seconds_prefill"], r["worker_seconds_prefill"]);
}

#[test]
fn the_planner_adds_decode_workers_on_an_itl_breach_within_max_and_cooldown() {
    let t = tempfile::tempdir().unwrap();
    // TPOT p90 on 2P+2D is about 13 ms: an 8 ms target is breached, the TTFT target never is.
    let cfg = write_config(
        t.path(),
        "plan.json",
        r#"{ "prefill_workers": 2, "decode_workers": 2, "planner": { "ttft_ms_p90": 1000000, "itl_ms_p90": 8,
             "window_ms": 10000, "interval_ms": 2000, "cooldown_ms": 20000, "max_decode": 4 } }"#,
    );
    let run = t.path().join("plan");
    let report = replay("traces/mooncake-200.jsonl", &["--config", cfg.to_str().unwrap()], &run);
    assert_eq!(report["drained"], true);
    assert_eq!(report["completed_requests"], 200);
    let scaling = report["scaling"].as_array().unwrap();
    assert_eq!(scaling.len(), 2, "two decode workers take the cluster to max_decode 4: {scaling:?}");
    let mut last_ms: Option<f64> = None;
    for (i, d) in scaling.iter().enumerate() {
        assert_eq!(d["role"], "decode");
        assert_eq!(d["change"], 1);
        assert!(d["reason"].as_str().unwrap().starts_with("ITL (TPOT) p90"), "{d}");
        assert_eq!(d["workers"][0]["worker"], format!("decode-{}", 2 + i));
        let at = d["at_ms"].as_f64().unwrap();
        assert_eq!(at % 2000.0, 0.0, "decisions come at planner ticks");
        if let Some(prev) = last_ms {
            assert!(at - prev >= 20000.0, "cooldown: {prev} then {at}");
        }
        last_ms = Some(at);
    }
    assert!(!run.join("decode-4.hlog").exists(), "max_decode is 4");
    // The joined workers serve requests.
    let bookings = decode_bookings(&records(&run));
    assert!(bookings.iter().any(|b| b.2 == WorkerId::decode(3)));
}

#[test]
fn scaling_configuration_errors_name_the_entry_or_key() {
    let t = tempfile::tempdir().unwrap();
    let cases = [
        (
            r#""scale": [{"at_ms": 30000, "decode": 1}, {"at_ms": 20000, "prefill": 1}]"#,
            &["scale[1] (at_ms 20000)", "non-decreasing at_ms order"][..],
        ),
        (
            r#""scale": [{"at_ms": 10000, "decode": -1}, {"at_ms": 20000, "decode": -1}]"#,
            &["scale[1] (at_ms 20000)", "last decode worker"][..],
        ),
        (r#""scale": [{"at_ms": 10000, "decodes": 1}]"#, &["unknown field `decodes`"][..]),
        (r#""planner": {"itl_p90": 5}"#, &["unknown field `itl_p90`"][..]),
        (
            r#""planner": {"max_decode": 1}"#,
            &["planner: the run starts with 2 decode workers", "min_decode..=max_decode"][..],
        ),
        (r#""scale": [{"at_ms": 10000}]"#, &["scale[0] (at_ms 10000) changes nothing"][..]),
        (r#""gpus_per_worker": 0"#, &["gpus_per_worker"][..]),
    ];
    for (i, (extra, needles)) in cases.iter().enumerate() {
        let cfg = cascade_config(t.path(), &format!("bad-{i}.json"), extra);
        let o = cli()
            .arg("replay")
            .arg(fixture("traces/cascade.jsonl"))
            .arg("--config")
            .arg(&cfg)
            .arg("--out")
            .arg(t.path().join(format!("out-{i}")))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{extra}: {err}");
        for n in *needles {
            assert!(err.contains(n), "{extra}: {err}");
        }
    }
    // Scaling needs roles to scale.
    let cfg = write_config(t.path(), "agg.json", r#"{ "workers": 2, "scale": [{"at_ms": 1, "decode": 1}] }"#);
    replay_refused("traces/cascade.jsonl", &["--config", cfg.to_str().unwrap()], &t.path().join("agg"))
        .stderr(predicate::str::contains("scale: scaling changes prefill and decode workers"));
}

#[test]
fn a_scaled_run_is_deterministic_and_the_same_with_quiet_steps_applied_one_by_one() {
    let t = tempfile::tempdir().unwrap();
    let plan = r#""scale": [{"at_ms": 20000, "decode": 2}, {"at_ms": 40000, "prefill": 1}, {"at_ms": 60000, "decode": -1}],
        "planner": {"itl_ms_p90": 30, "interval_ms": 5000, "cooldown_ms": 15000, "window_ms": 20000}"#;
    for backend in ["vllm", "sglang"] {
        let cfg = cascade_config(t.path(), &format!("{backend}.json"), plan);
        let slow = cascade_config(
            t.path(),
            &format!("{backend}-slow.json"),
            &format!("{plan}, \"coalesce_quiet_steps\": false"),
        );
        let args = |c: &Path| {
            vec!["--config".to_string(), c.to_str().unwrap().to_string(), "--backend".into(), backend.into()]
        };
        let runs: Vec<(PathBuf, Value)> = [&cfg, &cfg, &slow]
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let out = t.path().join(format!("{backend}-{i}"));
                let a = args(c);
                let a: Vec<&str> = a.iter().map(String::as_str).collect();
                let report = replay("traces/cascade.jsonl", &a, &out);
                (out, report)
            })
            .collect();
        let bytes = dir_bytes(&runs[0].0);
        assert!(bytes.contains_key("decode-3.hlog") && bytes.contains_key("prefill-2.hlog"), "{backend}");
        assert!(bytes == dir_bytes(&runs[1].0), "{backend}: two identical scaled replays differ");
        assert!(bytes == dir_bytes(&runs[2].0), "{backend}: quiet-step coalescing changed a scaled run");
        assert_eq!(runs[0].1["scaling"], runs[1].1["scaling"], "{backend}");
        assert_eq!(runs[0].1["drained"], true, "{backend}");
        cli().arg("verify").arg(&runs[0].0).assert().success();
    }
}

#[test]
fn a_replay_killed_at_any_instant_leaves_streams_that_recover_and_verify() {
    // kill -9 at 20 instants drawn from a fixed seed: every stream's header is on disk from the
    // start and records reach the disk on a time bound, so each run directory passes `recover`
    // (cutting at most a torn tail) and then `verify`, and every record that was on the disk
    // just before the kill is still there, unchanged.
    use std::io::Write;
    let t = tempfile::tempdir().unwrap();
    let trace = t.path().join("long.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&trace).unwrap());
    for i in 0..30_000u64 {
        let h = 4 * i;
        writeln!(
            f,
            r#"{{"timestamp":{},"input_length":2048,"output_length":64,"hash_ids":[{},{},{},{}]}}"#,
            i * 20,
            h + 1,
            h + 2,
            h + 3,
            h + 4
        )
        .unwrap();
    }
    drop(f);
    let bin = assert_cmd::cargo::cargo_bin("handoff-log");
    let mut state = 0x5eed_u64;
    let mut kept = Vec::new();
    for k in 0..20 {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let delay_ms = 20 + (state >> 33) % 300;
        let out = t.path().join(format!("run{k}"));
        let mut child = std::process::Command::new(&bin)
            .arg("replay")
            .arg(&trace)
            .args(["--prefill", "2", "--decode", "2", "--out"])
            .arg(&out)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Wait until the run's streams exist (its start), bounded, then let it run `delay_ms`.
        let start = std::time::Instant::now();
        while std::fs::read_dir(&out).map(|d| d.count()).unwrap_or(0) < 5 && start.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        // What is on the disk now: the run only appends, so all of it must survive the kill.
        let before: Vec<(std::path::PathBuf, Vec<u8>)> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "hlog"))
            .map(|p| {
                let bytes = std::fs::read(&p).unwrap();
                (p, bytes)
            })
            .collect();
        let _ = child.kill(); // SIGKILL; the run may have finished already, which is fine
        let _ = child.wait();
        let o = cli().arg("recover").arg(&out).output().unwrap();
        assert!(
            o.status.success(),
            "kill after {delay_ms} ms: recover: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let o = cli().arg("verify").arg(&out).arg("--json").output().unwrap();
        assert!(
            o.status.success(),
            "kill after {delay_ms} ms: verify: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        kept.push((delay_ms, v["records"].as_u64().unwrap()));
        for (path, bytes) in &before {
            let seen = complete_records(std::io::Cursor::new(bytes.clone()), path);
            let after = complete_records(std::fs::File::open(path).unwrap(), path);
            assert!(
                after.len() >= seen.len() && after[..seen.len()] == seen[..],
                "kill after {delay_ms} ms: {} lost records that were on disk ({} before, {} after)",
                path.display(),
                seen.len(),
                after.len()
            );
        }
    }
    // Records that reached the disk before the kill are kept: the runs killed latest kept some.
    let latest = kept.iter().max_by_key(|(d, _)| *d).unwrap();
    assert!(latest.1 > 0, "{kept:?}");
}

/// The records of a stream up to its first incomplete or damaged one.
fn complete_records(
    input: impl std::io::Read,
    path: &std::path::Path,
) -> Vec<handoff_ledger::events::Record> {
    let Ok(mut r) = handoff_ledger::events::StreamReader::new(input, path) else { return Vec::new() };
    let mut out = Vec::new();
    while let Ok(Some(rec)) = r.next_record() {
        out.push(rec);
    }
    out
}

#[test]
fn recover_removes_an_empty_stream_and_names_it() {
    // A crash right after a stream file was created, before its header was written, leaves it
    // empty: recover takes it out (there is nothing in it), and the run reads again.
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("run");
    replay("traces/mooncake-200.jsonl", SMALL, &out);
    std::fs::write(out.join("decode-7.hlog"), b"").unwrap();
    assert_eq!(cli().arg("verify").arg(&out).output().unwrap().status.code(), Some(1));
    let o = cli().arg("recover").arg(&out).output().unwrap();
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains("decode-7.hlog: removed an empty stream"));
    assert!(!out.join("decode-7.hlog").exists());
    cli().arg("verify").arg(&out).assert().success();
}

// ---------------------------------------------------------------- pinned stream hashes

/// The committed sha256 of every stream the pinned replays write: `CASE FILE SHA256` per line.
const PINNED_HASHES: &str = "fixtures/replay-hashes.txt";
/// Set to 1 to rewrite `PINNED_HASHES` from this build instead of comparing against it.
const REGENERATE_HASHES: &str = "REGENERATE_REPLAY_HASHES";

/// One replay whose streams are pinned. The trace path is given relative to `cwd`, as the
/// router header records it (so the pin does not depend on where the checkout is).
struct PinnedReplay {
    name: String,
    cwd: PathBuf,
    trace: String,
    args: Vec<String>,
    /// The exit code the replay must end with (the livelock run stops with 1).
    exit: i32,
}

/// A deterministic session trace: 12 sessions of 5 turns, each turn's prompt extending the
/// previous one's blocks, odd turns with an explicit delay.
fn session_trace() -> String {
    let mut lines = Vec::new();
    for turn in 0..5u64 {
        for s in 0..12u64 {
            let input = 512 * (turn + 1) + 100;
            let hashes: Vec<String> = (0..turn + 2).map(|k| (s * 1000 + k).to_string()).collect();
            let delay = if turn % 2 == 1 { format!(r#","delay":{}"#, 100 + s * 10) } else { String::new() };
            lines.push(format!(
                r#"{{"timestamp":{},"input_length":{input},"output_length":{},"hash_ids":[{}],"session_id":"s{s}"{delay}}}"#,
                turn * 1000 + s * 50,
                20 + (s + turn) % 30,
                hashes.join(",")
            ));
        }
    }
    lines.join("\n") + "\n"
}

/// Every pinned replay: the cascade trace with each `fixtures/configs/cascade*.json`, the
/// Mooncake sample (2P+2D) with the default and the kv router, the livelock trace, on both
/// backends; then, beside those, the paths of the event loop they leave out: aggregated serving,
/// a closed loop, sessions (open and closed loop), planned scaling with the planner, NIC
/// contention, the Disabled policy, and each backend under the other's policy. `scratch` holds
/// the generated trace and configs.
fn pinned_replays(scratch: &Path) -> Vec<PinnedReplay> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let owned = |args: &[&str]| args.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let mut configs: Vec<PathBuf> = std::fs::read_dir(root.join("fixtures/configs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("cascade"))
        .collect();
    configs.sort();
    std::fs::write(scratch.join("sessions.jsonl"), session_trace()).unwrap();
    let scaled = cascade_config(
        scratch,
        "scaled.json",
        r#""scale": [{"at_ms": 20000, "decode": 2}, {"at_ms": 40000, "prefill": 1}, {"at_ms": 60000, "decode": -1}],
        "planner": {"itl_ms_p90": 30, "interval_ms": 5000, "cooldown_ms": 15000, "window_ms": 20000}"#,
    );
    let contention = write_config(
        scratch,
        "contention.json",
        r#"{"prefill_workers": 2, "decode_workers": 2, "transfer": {"mode": "bandwidth", "bandwidth_gbps": 8},
            "contention": {"enabled": true}}"#,
    );
    let mut cases = Vec::new();
    for backend in ["vllm", "sglang"] {
        let mut add = |name: String, cwd: &Path, trace: &str, args: Vec<String>, exit: i32| {
            let args = [owned(&["--backend", backend]), args].concat();
            cases.push(PinnedReplay { name, cwd: cwd.to_path_buf(), trace: trace.into(), args, exit });
        };
        for config in &configs {
            let stem = config.file_stem().unwrap().to_string_lossy();
            let args = owned(&["--config", config.to_str().unwrap()]);
            add(format!("{stem}/{backend}"), &root, "fixtures/traces/cascade.jsonl", args, 0);
        }
        for router in ["round-robin", "kv"] {
            let mut args = owned(SMALL);
            if router != "round-robin" {
                args.extend(owned(&["--router", router]));
            }
            add(
                format!("mooncake-200-{router}/{backend}"),
                &root,
                "fixtures/traces/mooncake-200.jsonl",
                args,
                0,
            );
        }
        // The livelock stops vLLM's run (exit 1); SGLang's pool, not set by the config, drains.
        let args = owned(&["--prefill", "1", "--decode", "3", "--config", "fixtures/configs/livelock.json"]);
        add(
            format!("livelock/{backend}"),
            &root,
            "fixtures/traces/livelock.jsonl",
            args,
            (backend == "vllm") as i32,
        );
        let mooncake = "fixtures/traces/mooncake-200.jsonl";
        add(format!("mooncake-200-aggregated/{backend}"), &root, mooncake, owned(&["--workers", "2"]), 0);
        let args = [owned(SMALL), owned(&["--concurrency", "16"])].concat();
        add(format!("mooncake-200-closed-loop/{backend}"), &root, mooncake, args, 0);
        add(format!("sessions-open-loop/{backend}"), scratch, "sessions.jsonl", owned(SMALL), 0);
        let args = [owned(SMALL), owned(&["--concurrency", "4"])].concat();
        add(format!("sessions-closed-loop/{backend}"), scratch, "sessions.jsonl", args, 0);
        let args = owned(&["--config", scaled.to_str().unwrap()]);
        add(format!("cascade-scaled-planner/{backend}"), &root, "fixtures/traces/cascade.jsonl", args, 0);
        let args = owned(&["--config", contention.to_str().unwrap()]);
        add(format!("mooncake-200-contention/{backend}"), &root, mooncake, args, 0);
        let args = [owned(SMALL), owned(&["--policy", "disabled"])].concat();
        add(format!("mooncake-200-policy-disabled/{backend}"), &root, mooncake, args, 0);
        // Each backend under the other's handoff policy.
        let other = if backend == "vllm" { "destination-first" } else { "source-first" };
        let args = [owned(SMALL), owned(&["--policy", other])].concat();
        add(format!("mooncake-200-policy-{other}/{backend}"), &root, mooncake, args, 0);
    }
    cases
}

/// `CASE FILE` → sha256 (hex) of every `.hlog` file of every pinned replay.
fn replay_stream_hashes() -> BTreeMap<(String, String), String> {
    use sha2::Digest;
    let t = tempfile::tempdir().unwrap();
    let scratch = t.path().join("inputs");
    std::fs::create_dir(&scratch).unwrap();
    let mut hashes = BTreeMap::new();
    for (i, case) in pinned_replays(&scratch).iter().enumerate() {
        let out = t.path().join(format!("run-{i}"));
        let o = cli()
            .current_dir(&case.cwd)
            .arg("replay")
            .arg(&case.trace)
            .args(&case.args)
            .arg("--out")
            .arg(&out)
            .arg("--json")
            .timeout(std::time::Duration::from_secs(120))
            .output()
            .unwrap();
        assert_eq!(
            o.status.code(),
            Some(case.exit),
            "{}: replay {} {:?}: {}",
            case.name,
            case.trace,
            case.args,
            String::from_utf8_lossy(&o.stderr)
        );
        let files = dir_bytes(&out);
        assert!(!files.is_empty(), "{}: no streams written", case.name);
        let hex = |bytes: &[u8]| -> String {
            sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
        };
        for (file, bytes) in files {
            // The v2 bytes as written, and the same records in v1: the v1 digests were pinned
            // before v2 existed, so they hold the facts unchanged and v2 lossless.
            let v1 = as_v1(&out.join(&file));
            hashes.insert((case.name.clone(), format!("{file}@v2")), hex(&bytes));
            hashes.insert((case.name.clone(), file), hex(&v1));
        }
    }
    hashes
}

/// The stream at `path` (any format) written again in format v1.
fn as_v1(path: &Path) -> Vec<u8> {
    use handoff_ledger::events::{LogFormat, StreamReader, StreamWriter};
    let mut r = StreamReader::open(path).unwrap();
    let mut w = StreamWriter::with_format(Vec::new(), r.header(), LogFormat::V1).unwrap();
    while let Some(rec) = r.next_record().unwrap() {
        assert_eq!(w.append(rec.at_ns, &rec.fact).unwrap(), rec.seq);
    }
    w.finish().unwrap()
}

/// Behaviour is pinned byte for byte: every stream of every pinned replay hashes to what
/// `fixtures/replay-hashes.txt` says. A refactor of the event loop must keep this green without
/// regenerating; a change that means to alter the logs regenerates (REGENERATE_REPLAY_HASHES=1)
/// and says in its commit which facts changed and why.
#[test]
fn replays_of_the_fixture_traces_write_the_pinned_stream_bytes() {
    let table = Path::new(env!("CARGO_MANIFEST_DIR")).join(PINNED_HASHES);
    let found = replay_stream_hashes();
    if std::env::var(REGENERATE_HASHES).is_ok_and(|v| v == "1") {
        let mut text = String::from(
            "# sha256 of every stream the pinned replays write (tests/replay_e2e.rs,\n\
             # replays_of_the_fixture_traces_write_the_pinned_stream_bytes): CASE FILE SHA256.\n\
             # Regenerate with REGENERATE_REPLAY_HASHES=1 only for a change meant to alter the logs.\n",
        );
        for ((case, file), digest) in &found {
            text.push_str(&format!("{case} {file} {digest}\n"));
        }
        std::fs::write(&table, text).unwrap();
        eprintln!("rewrote {} ({} streams)", table.display(), found.len());
        return;
    }
    let text = std::fs::read_to_string(&table)
        .unwrap_or_else(|e| panic!("{}: {e} (write it with {REGENERATE_HASHES}=1)", table.display()));
    let expected: BTreeMap<(String, String), String> = text
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let parts: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(parts.len(), 3, "{PINNED_HASHES}: bad line {l:?}");
            ((parts[0].to_string(), parts[1].to_string()), parts[2].to_string())
        })
        .collect();
    let mut mismatches = Vec::new();
    for (key @ (case, file), want) in &expected {
        match found.get(key) {
            Some(got) if got == want => {}
            Some(got) => mismatches.push(format!("{case} {file}: expected {want}, found {got}")),
            None => mismatches.push(format!("{case} {file}: expected {want}, found no such stream")),
        }
    }
    for ((case, file), got) in &found {
        if !expected.contains_key(&(case.clone(), file.clone())) {
            mismatches.push(format!("{case} {file}: expected nothing pinned, found {got}"));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} pinned streams differ from {PINNED_HASHES}:\n  {}\n\
         If the logs are meant to change, rerun with {REGENERATE_HASHES}=1, commit the table and say \
         in the commit which facts changed and why.",
        mismatches.len(),
        expected.len(),
        mismatches.join("\n  ")
    );
}
