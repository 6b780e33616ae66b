//! `inspect` on real replay runs of the committed cascade fixture (`fixtures/traces/
//! cascade.jsonl`: 240 requests every 100 ms, 4096-token unique prompts, 1024-token outputs;
//! `fixtures/configs/cascade.json`: 2 prefill + 2 decode workers of 1024 blocks). Under vLLM
//! (source-first) decode fills and prefill KV strands: `inspect` must report a cascade set off
//! by decode exhaustion. Under SGLang (destination-first) the same load waits in the decode
//! reservation FIFOs ahead of prefill: gating, and no cascade. Text and JSON are snapshotted.
//!
//! The decode-side findings are checked here too: head-of-line blocking on both cascade
//! replays, a preemption storm on a replay built to thrash (checked against a scan of its
//! preemptions), and hand-built decode streams fed to the fold whose storms and blocked
//! stretches are known to the millisecond.

mod support;

use handoff_ledger::events::{EngineShape, Fact, KvDelta, Record, RunReader, StreamHeader, TerminalStatus};
use handoff_ledger::ids::*;
use handoff_ledger::projections::inspect::{InspectFold, InspectOptions, InspectReport};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use support::NS_PER_MS as MS;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn replay(backend: &str, out: &Path) {
    support::cli()
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
    let out = support::cli().arg("inspect").arg(run).args(extra).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn vllm_cascade_replay_reports_a_cascade_set_off_by_decode_exhaustion() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("cascade-vllm");
    replay("vllm", &run);
    let raw = inspect(&run, &["--top", "3"]);
    let text = flat(&raw);
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
    // Decode: r28 is preempted at 9330.629 ms and goes to the front of the waiting queue; it
    // needs the 67 blocks it gave back, 66 are free or cached, and nothing is scheduled on
    // decode-0 until 37036.693 ms while its running requests keep stepping.
    let hol = &v["decode_hol_blocking"];
    let first = &hol["intervals"][0];
    assert_eq!(first["worker"], "decode-0");
    assert_eq!(first["started_at_ms"], 9330.628744);
    assert_eq!(first["ended_at_ms"], 37036.693161);
    assert_eq!(first["head_request"], 28);
    assert_eq!(first["head_need_blocks"], 67);
    assert_eq!(first["free_blocks_at_start"], 66);
    let workers: Vec<&str> =
        hol["per_worker"].as_array().unwrap().iter().map(|w| w["worker"].as_str().unwrap()).collect();
    assert_eq!(workers, ["decode-0", "decode-1"]);
    // 12 preemptions over the whole run, never 10 within a second.
    assert_eq!(v["preemption_storms"]["storms"], serde_json::json!([]));
    assert!(text.contains("PREEMPTION STORMS: none"));
    assert!(text.contains(
        "DECODE HEAD-OF-LINE BLOCKING: 162 intervals on decode-0, decode-1 (first at 9330.629 ms on decode-0; \
         longest 34676.333 ms)"
    ));
    insta::assert_snapshot!("inspect_text_replay_cascade_vllm", raw);
    insta::assert_snapshot!("inspect_json_replay_cascade_vllm", json);
}

#[test]
fn sglang_cascade_replay_reports_gating_not_a_cascade() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("cascade-sglang");
    replay("sglang", &run);
    let raw = inspect(&run, &["--top", "3"]);
    let text = flat(&raw);
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
    // A retracted request waits about 2 s at the head of decode's queue before it fits again.
    let hol = &v["decode_hol_blocking"];
    assert_eq!(hol["intervals"][0]["started_at_ms"], 66241.877399);
    assert_eq!(hol["intervals"][0]["head_request"], 50);
    assert_eq!(v["preemption_storms"]["storms"], serde_json::json!([]));
    insta::assert_snapshot!("inspect_text_replay_cascade_sglang", raw);
    insta::assert_snapshot!("inspect_json_replay_cascade_sglang", json);
}

// ------------------------------------------------------------------------------------------
// Preemption storms and decode head-of-line blocking
// ------------------------------------------------------------------------------------------

/// Storms of one worker found by scanning its preemption times with the definition (module
/// docs of `inspect`): windows `(τ − w, τ]` holding at least `n` preemptions, maximal stretches
/// of them, a stretch that starts before the previous storm's last preemption + `w` continuing
/// it. Returns (start, end or `None` past the run's end, preemptions, distinct requests), ns.
fn scan_storms(
    preemptions: &[(u64, RequestId)],
    n: usize,
    w: u64,
    run_end: u64,
) -> Vec<(u64, Option<u64>, u64, u64)> {
    let count = |t: u64| preemptions.iter().filter(|(p, _)| *p <= t && p + w > t).count();
    let mut instants: Vec<u64> = preemptions.iter().flat_map(|(p, _)| [*p, p + w]).collect();
    instants.sort();
    instants.dedup();
    // Maximal stretches [a, b) during which a window qualifies.
    let mut stretches: Vec<(u64, Option<u64>)> = Vec::new();
    let mut open: Option<u64> = None;
    for &t in &instants {
        match (open, count(t) >= n) {
            (None, true) => open = Some(t),
            (Some(a), false) => {
                stretches.push((a, Some(t)));
                open = None;
            }
            _ => {}
        }
    }
    if let Some(a) = open {
        stretches.push((a, None));
    }
    let mut storms: Vec<(u64, Option<u64>)> = Vec::new();
    for (a, b) in stretches {
        if let Some(last) = storms.last_mut() {
            let end = last.1.unwrap_or(u64::MAX);
            let last_preemption = preemptions.iter().map(|(p, _)| *p).filter(|p| *p < end).max().unwrap();
            if a < last_preemption + w {
                last.1 = b;
                continue;
            }
        }
        storms.push((a, b));
    }
    storms
        .into_iter()
        .map(|(a, b)| {
            let inside: Vec<RequestId> = preemptions
                .iter()
                .filter(|(p, _)| p + w > a && b.map_or(true, |b| *p < b))
                .map(|(_, r)| *r)
                .collect();
            let distinct: BTreeSet<RequestId> = inside.iter().copied().collect();
            (a, b.filter(|b| *b <= run_end), inside.len() as u64, distinct.len() as u64)
        })
        .collect()
}

/// 60 short requests (8-token prompts, 64-token outputs) 10 ms apart on one decode worker of
/// 32 blocks of 16 tokens: every request crosses a block boundary every 16 tokens, the pool is
/// full, and vLLM preempts several running requests in one step.
#[test]
fn a_thrashing_decode_worker_has_the_preemption_storms_a_scan_finds() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("thrash.jsonl");
    let lines: Vec<String> = (0..60)
        .map(|i| {
            format!(
                r#"{{"timestamp": {}, "input_length": 8, "output_length": 64, "hash_ids": [{}]}}"#,
                i * 10,
                1000 + i
            )
        })
        .collect();
    std::fs::write(&trace, lines.join("\n") + "\n").unwrap();
    let config = dir.path().join("small.json");
    std::fs::write(&config, r#"{"vllm": {"num_gpu_blocks": 32, "block_size": 16}}"#).unwrap();
    let run = dir.path().join("thrash-vllm");
    support::cli()
        .arg("replay")
        .arg(&trace)
        .args(["--backend", "vllm", "--prefill", "1", "--decode", "1", "--config"])
        .arg(&config)
        .arg("--out")
        .arg(&run)
        .assert()
        .success();

    let mut reader = RunReader::open(&run).unwrap();
    let workers: Vec<WorkerId> = reader.headers().iter().map(|h| h.worker).collect();
    let mut preemptions: Vec<(u64, RequestId)> = Vec::new();
    let mut run_end = 0;
    while let Some((i, rec)) = reader.next().unwrap() {
        run_end = run_end.max(rec.at_ns);
        if let Fact::RequestPreempted { request, .. } = rec.fact {
            assert_eq!(workers[i], WorkerId::decode(0), "only decode preempts here");
            preemptions.push((rec.at_ns, request));
        }
    }
    for (n, window_ms) in [(10usize, 1000u64), (4, 200), (20, 3000)] {
        let expected = scan_storms(&preemptions, n, window_ms * 1_000_000, run_end);
        let json = inspect(
            &run,
            &["--json", "--storm-preemptions", &n.to_string(), "--storm-window-ms", &window_ms.to_string()],
        );
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        let ns = |x: &serde_json::Value| (x.as_f64().unwrap() * 1e6).round() as u64;
        let got: Vec<(u64, Option<u64>, u64, u64)> = v["preemption_storms"]["storms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                assert_eq!(s["worker"], "decode-0");
                (
                    ns(&s["started_at_ms"]),
                    (!s["ended_at_ms"].is_null()).then(|| ns(&s["ended_at_ms"])),
                    s["preemptions"].as_u64().unwrap(),
                    s["requests"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(got, expected, "n {n}, window {window_ms} ms");
    }
    // The default thresholds find storms here (the test would prove nothing otherwise).
    let text = flat(&inspect(&run, &[]));
    let expected = scan_storms(&preemptions, 10, 1_000_000_000, run_end);
    assert!(!expected.is_empty(), "the thrashing replay no longer storms: {preemptions:?}");
    let total: u64 = expected.iter().map(|s| s.2).sum();
    let headline = format!(
        "PREEMPTION STORMS: {} on decode-0 (first at {:.3} ms on decode-0; {total} preemptions of ",
        expected.len(),
        expected[0].0 as f64 / 1e6
    );
    assert!(text.contains(&headline), "{headline}\n{text}");
}

const Z: KvDelta = KvDelta::ZERO;

fn decode_header(total_blocks: u32) -> StreamHeader {
    StreamHeader {
        run_id: uuid::Uuid::from_u128(3),
        worker: WorkerId::decode(0),
        backend: Backend::Vllm,
        policy: HandoffPolicy::SourceFirst,
        clock: ClockDomain::Virtual,
        seed: 0,
        engine: EngineShape {
            total_blocks,
            block_size: 16,
            max_request_slots: 64,
            config_json: String::new(),
        },
    }
}

/// A hand-built decode stream: facts with their time in ms, in time order.
struct Stream {
    records: Vec<Record>,
}

impl Stream {
    fn new() -> Self {
        Stream { records: Vec::new() }
    }
    fn put(&mut self, t_ms: u64, fact: Fact) {
        self.records.push(Record { seq: self.records.len() as u64, at_ns: t_ms * MS, fact });
    }
    /// Queues and schedules `request` with `blocks` blocks.
    fn admit(&mut self, t_ms: u64, request: u64, blocks: i32) {
        self.put(t_ms, Fact::RequestQueued { request: RequestId(request) });
        self.schedule(t_ms, request, blocks);
    }
    fn schedule(&mut self, t_ms: u64, request: u64, blocks: i32) {
        self.put(
            t_ms,
            Fact::RequestScheduled {
                request: RequestId(request),
                cached_tokens: 0,
                kv: KvDelta { free: -blocks, active: blocks, slots: 1, ..Z },
            },
        );
    }
    fn preempt(&mut self, t_ms: u64, request: u64, blocks: i32) {
        self.put(
            t_ms,
            Fact::RequestPreempted {
                request: RequestId(request),
                kv: KvDelta { active: -blocks, free: blocks, slots: -1, ..Z },
            },
        );
    }
    fn step(&mut self, t_ms: u64, grown_blocks: i32) {
        self.put(
            t_ms,
            Fact::StepExecuted {
                prefill_tokens: 0,
                decode_tokens: 1,
                batch_size: 1,
                duration_ns: 20 * MS,
                kv: KvDelta { free: -grown_blocks, active: grown_blocks, ..Z },
            },
        );
    }
    fn inspect(&self, total_blocks: u32, opts: InspectOptions) -> InspectReport {
        let mut fold = InspectFold::new(&[decode_header(total_blocks)], opts);
        let mut sorted = self.records.clone();
        sorted.sort_by_key(|r| r.at_ns);
        for r in &sorted {
            fold.apply(0, r).unwrap();
        }
        fold.finish().0
    }
}

/// 12 preemptions 50 ms apart from 100 ms (r0 twice): the 10th, at 550 ms, fills a 1 s window;
/// the storm ends at 1200 ms, when the oldest of the last ten (200 ms) ages out.
fn storm_stream() -> Stream {
    let mut s = Stream::new();
    for r in 0..11 {
        s.admit(0, r, 1);
    }
    let order = [0u64, 1, 2, 0, 3, 4, 5, 6, 7, 8, 9, 10];
    for (i, r) in order.iter().enumerate() {
        let t = 100 + 50 * i as u64;
        s.preempt(t, *r, 1);
        if i == 0 {
            s.schedule(120, 0, 1);
        }
    }
    // r0 resumes before the storm is known (its stall began at 100 ms); r5 after it ended.
    s.schedule(270, 0, 1);
    s.put(290, Fact::DecodeResumed { request: RequestId(0), stalled_ns: 190 * MS });
    s.schedule(1400, 5, 1);
    s.put(1500, Fact::DecodeResumed { request: RequestId(5), stalled_ns: 1100 * MS });
    s.put(
        2000,
        Fact::RequestFinished {
            request: RequestId(5),
            status: TerminalStatus::Completed,
            output_tokens: 2,
            kv: KvDelta { active: -1, free: 1, slots: -1, ..Z },
        },
    );
    s
}

#[test]
fn a_burst_of_preemptions_is_one_storm_with_its_counts_and_longest_stall() {
    let r = storm_stream().inspect(20, InspectOptions::default());
    let storms = &r.preemption_storms.storms;
    assert_eq!(storms.len(), 1, "{storms:?}");
    let s = &storms[0];
    assert_eq!(s.worker, WorkerId::decode(0));
    assert_eq!(s.started_at_ms, 550.0);
    assert_eq!(s.ended_at_ms, Some(1200.0));
    assert_eq!(s.duration_ms, 650.0);
    assert_eq!(s.preemptions, 12);
    assert_eq!(s.requests, 11);
    assert_eq!((s.most_preempted_request, s.most_preempted_times), (RequestId(0), 2));
    assert_eq!((s.longest_stall_ms, s.longest_stall_request), (Some(1100.0), Some(RequestId(5))));
    // At 550 ms: 11 requests took 1 block each, 10 preemptions gave 10 back, r0 took 2 again.
    assert_eq!(s.kv_used_at_start_pct, 15.0);
    let w = &r.preemption_storms.per_worker[0];
    assert_eq!((w.storms, w.preemptions, w.requests), (1, 12, 11));

    // Thresholds move the verdict: 13 preemptions never fit a window; 450 ms windows hold at
    // most 9 of them.
    for opts in [
        InspectOptions { storm_preemptions: 13, ..InspectOptions::default() },
        InspectOptions { storm_window_ms: 450, ..InspectOptions::default() },
    ] {
        let r = storm_stream().inspect(20, opts);
        assert!(r.preemption_storms.storms.is_empty(), "{opts:?}: {:?}", r.preemption_storms);
    }
    // A 500 ms window: the 10th preemption (550 ms) is 450 ms after the 1st, so the storm
    // starts at 550 ms and ends at 700 ms, when the 3rd (200 ms) ages out.
    let r = storm_stream().inspect(20, InspectOptions { storm_window_ms: 500, ..InspectOptions::default() });
    let s = &r.preemption_storms.storms[0];
    assert_eq!((s.started_at_ms, s.ended_at_ms, s.preemptions), (550.0, Some(700.0), 12));
}

/// Ten preemptions 10 ms apart from 1 ms, then `late` more all at `at_ms`; the run goes on
/// to 5000 ms.
fn two_bursts(at_ms: u64, late: u64) -> InspectReport {
    let mut s = Stream::new();
    for r in 0..10 + late {
        s.admit(0, r, 1);
    }
    for r in 0..10 {
        s.preempt(1 + 10 * r, r, 1);
    }
    for i in 0..late {
        s.preempt(at_ms, 10 + i, 1);
    }
    s.step(5000, 0);
    s.inspect(64, InspectOptions::default())
}

#[test]
fn a_burst_that_refills_a_window_still_holding_the_storm_is_the_same_storm() {
    // The first burst storms from 91 ms until 1001 ms, when the preemption at 1 ms ages out.
    // Nine more at 1080 ms fill a window again while the ones at 81 and 91 ms are still in it:
    // the windows overlap, so it is one storm of 19 preemptions, ending when 91 ms ages out.
    let r = two_bursts(1080, 9);
    let storms = &r.preemption_storms.storms;
    assert_eq!(storms.len(), 1, "{storms:?}");
    let s = &storms[0];
    assert_eq!((s.started_at_ms, s.ended_at_ms, s.preemptions, s.requests), (91.0, Some(1091.0), 19, 19));
    // Ten more at 1100 ms: the first burst has left the window by then, so they are a storm
    // of their own.
    let r = two_bursts(1100, 10);
    let got: Vec<(f64, Option<f64>, u64)> =
        r.preemption_storms.storms.iter().map(|s| (s.started_at_ms, s.ended_at_ms, s.preemptions)).collect();
    assert_eq!(got, [(91.0, Some(1001.0), 10), (1100.0, Some(2100.0), 10)]);
    assert_eq!(r.preemption_storms.per_worker[0].storms, 2);
}

/// A decode worker of 10 blocks: r1 and r2 hold 4 each; at 100 ms r2 is preempted (its 4
/// blocks back) in the step that grows r1 by 3, leaving 3 free: r2 is the head and needs 4.
/// Activated at 200 ms, r3 (2 blocks) waits behind it. r1 steps every 20 ms until `until_ms`,
/// when it finishes and both are scheduled. With `idle_from_ms`, r1 stops stepping then.
fn blocked_stream(until_ms: u64, idle_from_ms: Option<u64>) -> Stream {
    let mut s = Stream::new();
    let handoff = |r: u128| HandoffId(uuid::Uuid::from_u128(0xB10C + r));
    s.admit(0, 1, 4);
    s.admit(0, 2, 4);
    s.preempt(100, 2, 4);
    s.step(100, 3);
    s.put(
        200,
        Fact::DestinationReserved {
            handoff: handoff(3),
            request: RequestId(3),
            reservation: DestinationReservationId(3),
            pages: 2,
            prefix_blocks: 0,
            prefix_tokens: 0,
            deadline_ns: 10_000 * MS,
            kv: KvDelta { free: -2, reserved_destination: 2, ..Z },
        },
    );
    s.put(
        200,
        Fact::DestinationActivated {
            handoff: handoff(3),
            reservation: DestinationReservationId(3),
            kv: KvDelta { reserved_destination: -2, active: 2, ..Z },
        },
    );
    let mut t = 120;
    while t < until_ms {
        if idle_from_ms.map_or(true, |idle| t < idle) {
            s.step(t, 0);
        }
        t += 20;
    }
    s.put(
        until_ms,
        Fact::RequestFinished {
            request: RequestId(1),
            status: TerminalStatus::Completed,
            output_tokens: 64,
            kv: KvDelta { active: -7, free: 7, slots: -1, ..Z },
        },
    );
    s.schedule(until_ms, 2, 4);
    s.put(
        until_ms,
        Fact::RequestScheduled { request: RequestId(3), cached_tokens: 0, kv: KvDelta { slots: 1, ..Z } },
    );
    s.step(until_ms + 20, 0);
    s
}

#[test]
fn waiting_requests_behind_a_head_that_cannot_fit_are_head_of_line_blocking() {
    let r = blocked_stream(3000, None).inspect(10, InspectOptions::default());
    let hol = &r.decode_hol_blocking;
    assert_eq!(hol.intervals.len(), 1, "{hol:?}");
    let i = &hol.intervals[0];
    // From the preemption (the queue became non-empty; the last scheduling was at 0 ms) to the
    // scheduling at 3000 ms.
    assert_eq!((i.started_at_ms, i.ended_at_ms, i.duration_ms), (100.0, Some(3000.0), 2900.0));
    assert_eq!(i.peak_waiting, 2);
    assert_eq!(i.head_request, Some(RequestId(2)));
    assert_eq!((i.free_blocks_at_start, i.head_need_blocks), (3, Some(4)));
    let w = &hol.per_worker[0];
    assert_eq!((w.intervals, w.blocked_ms, w.longest_ms), (1, 2900.0, 2900.0));
    assert!(r.preemption_storms.storms.is_empty());

    // Shorter than stall_ms: not blocking yet.
    let r = blocked_stream(1000, None).inspect(10, InspectOptions::default());
    assert!(r.decode_hol_blocking.intervals.is_empty(), "{:?}", r.decode_hol_blocking);
    let r = blocked_stream(3000, None)
        .inspect(10, InspectOptions { stall_ms: 3000, ..InspectOptions::default() });
    assert!(r.decode_hol_blocking.intervals.is_empty());
    // A worker that stops stepping for stall_ms is idle, not blocked behind its head.
    let r = blocked_stream(3000, Some(1500)).inspect(10, InspectOptions::default());
    assert!(r.decode_hol_blocking.intervals.is_empty(), "{:?}", r.decode_hol_blocking);
}

#[test]
fn a_healthy_run_has_no_storm_and_no_head_of_line_blocking() {
    let v: serde_json::Value =
        serde_json::from_str(&inspect(&root().join("fixtures/runs/scripted-healthy"), &["--json"])).unwrap();
    assert_eq!(v["preemption_storms"]["storms"], serde_json::json!([]));
    assert_eq!(v["decode_hol_blocking"]["intervals"], serde_json::json!([]));
    assert_eq!(v["decode_hol_blocking"]["per_worker"], serde_json::json!([]));
    let text = flat(&inspect(&root().join("fixtures/runs/scripted-healthy"), &[]));
    assert!(text.contains("PREEMPTION STORMS: none"));
    assert!(text.contains("DECODE HEAD-OF-LINE BLOCKING: none"));
}

/// The text report with every run of white space as one space: prose lines wrap at 120 columns,
/// and a finding reads the same wherever its line breaks.
fn flat(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}
