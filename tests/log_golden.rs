//! Golden files, v1 and v2: committed bytes that this build must read unchanged and write
//! identically.
//! A change to `Fact`, `StreamHeader`, the codec or the framing that alters the encoding fails
//! here; such a change needs a new format version, not a regenerated golden file.
//!
//! The golden files are also consistent runs, on which every command works
//! (`cli_log::every_command_works_on_every_committed_run`).
//!
//! Regenerate (`REGENERATE_GOLDEN=1 cargo test --test log_golden`) only when deliberately
//! starting a new format version, or when the facts the files hold must change with the encoding
//! unchanged, i.e. after these tests passed on the committed files.

mod support;

use handoff_ledger::events::{
    write_merged, EngineShape, Fact, KvDelta, LogFormat, Record, RunKind, RunReader, RunWriter, StreamHeader,
    StreamReader, StreamWriter, TerminalStatus,
};
use handoff_ledger::ids::{
    Backend, ClockDomain, DestinationReservationId, EndReason, Generation, HandoffPolicy, KvHandoffDemand,
    RequestId, SourceLeaseId, WallClockSync, WorkerId,
};
use std::path::PathBuf;
use support::log::{golden_appended_facts, golden_facts, golden_header, ordinal, FACT_VARIANTS};
use uuid::Uuid;

fn golden_dir() -> PathBuf {
    support::fixture("golden/v1")
}

fn regenerate() -> bool {
    std::env::var("REGENERATE_GOLDEN").map(|v| v == "1").unwrap_or(false)
}

/// `facts` as one stream under the golden header, in `format`.
fn encode(facts: &[(u64, Fact)], format: LogFormat) -> Vec<u8> {
    let mut w = StreamWriter::with_format(Vec::new(), &golden_header(), format).unwrap();
    for (at, f) in facts {
        w.append(*at, f).unwrap();
    }
    w.finish().unwrap()
}

fn encode_golden_stream() -> Vec<u8> {
    encode(&golden_facts(), LogFormat::V1)
}

/// The golden run's streams written into `dir` (a run directory); the writer is returned to be
/// closed or finished.
fn write_golden_run(dir: &std::path::Path) -> RunWriter {
    let streams = run_streams();
    let mut rw = RunWriter::create(dir, streams.iter().map(|(h, _)| h.clone())).unwrap();
    for (h, recs) in &streams {
        for (at, f) in recs {
            rw.append(h.worker, *at, f).unwrap();
        }
    }
    rw
}

#[test]
fn golden_v1_log_decodes_unchanged() {
    let path = golden_dir().join("golden.hlog");
    let encoded = encode_golden_stream();
    if regenerate() {
        std::fs::create_dir_all(golden_dir()).unwrap();
        std::fs::write(&path, &encoded).unwrap();
        eprintln!("regenerated {}", path.display());
    }

    // The two lists cover every variant, so no variant's encoding can drift unseen.
    let facts = golden_facts();
    let mut seen = [false; FACT_VARIANTS];
    for (_, f) in facts.iter().chain(&golden_appended_facts()) {
        seen[ordinal(f)] = true;
    }
    assert!(seen.iter().all(|s| *s), "golden lists miss a Fact variant");

    // (a) The committed file decodes to the list built in code.
    let mut r = StreamReader::open(&path).unwrap_or_else(|e| {
        panic!("{e} (regenerate with REGENERATE_GOLDEN=1 only for a new format version)")
    });
    assert_eq!(r.header(), &golden_header());
    let mut got = Vec::new();
    while let Some(rec) = r.next_record().unwrap() {
        got.push(rec);
    }
    assert_eq!(r.torn_tail(), None);
    let want: Vec<Record> = facts
        .into_iter()
        .enumerate()
        .map(|(i, (at_ns, fact))| Record { seq: i as u64, at_ns, fact })
        .collect();
    assert_eq!(got, want);

    // (b) Encoding the list today gives the committed bytes.
    let committed = std::fs::read(&path).unwrap();
    assert_eq!(encoded.len(), committed.len(), "encoded length changed");
    let first_diff = encoded.iter().zip(&committed).position(|(a, b)| a != b);
    assert_eq!(first_diff, None, "encoding differs from the golden file at this byte offset");
}

/// Variants appended to format version 1 after `golden.hlog` was committed, in a golden file of
/// their own (same header). Create it once with `REGENERATE_GOLDEN_APPENDED=1` when appending.
#[test]
fn golden_v1_appended_variants_decode_unchanged() {
    let path = golden_dir().join("golden-appended.hlog");
    let encoded = encode(&golden_appended_facts(), LogFormat::V1);
    if std::env::var("REGENERATE_GOLDEN_APPENDED").map(|v| v == "1").unwrap_or(false) {
        std::fs::write(&path, &encoded).unwrap();
        eprintln!("regenerated {}", path.display());
    }
    let mut r = StreamReader::open(&path).unwrap();
    let mut got = Vec::new();
    while let Some(rec) = r.next_record().unwrap() {
        got.push((rec.at_ns, rec.fact));
    }
    assert_eq!(got, golden_appended_facts());
    let committed = std::fs::read(&path).unwrap();
    let first_diff = encoded.iter().zip(&committed).position(|(a, b)| a != b);
    assert_eq!((encoded.len(), first_diff), (committed.len(), None), "encoding differs from the golden file");
}

/// A live stream's header with its clock sync (`ClockDomain::WallSynced`, appended after the
/// headers of `golden.hlog`), in both formats. Create the files once with
/// `REGENERATE_GOLDEN_WALL=1` when appending.
#[test]
fn golden_wall_synced_headers_decode_unchanged() {
    let clock = ClockDomain::WallSynced(WallClockSync {
        origin_unix_ns: 1_796_159_372_600_913_010,
        offset_ns: -3_729,
        uncertainty_ns: 39_825,
    });
    let header = StreamHeader { clock, ..golden_header() };
    let facts = [(0, Fact::SessionStarted { generation: Generation(1) }), (5, Fact::StreamEnded)];
    for (format, dir) in [(LogFormat::V1, golden_dir()), (LogFormat::V2, golden_v2_dir())] {
        let path = dir.join("wall-synced.hlog");
        let mut w = StreamWriter::with_format(Vec::new(), &header, format).unwrap();
        for (at, f) in &facts {
            w.append(*at, f).unwrap();
        }
        let encoded = w.finish().unwrap();
        if std::env::var("REGENERATE_GOLDEN_WALL").map(|v| v == "1").unwrap_or(false) {
            std::fs::write(&path, &encoded).unwrap();
        }
        let mut r = StreamReader::open(&path).unwrap();
        assert_eq!(r.header(), &header, "{}", path.display());
        let mut got = Vec::new();
        while let Some(rec) = r.next_record().unwrap() {
            got.push((rec.at_ns, rec.fact));
        }
        assert_eq!(got, facts.to_vec());
        assert_eq!(std::fs::read(&path).unwrap(), encoded, "{}: encoding differs", path.display());
    }
}

// ----- the golden merged run -----

const RUN: u128 = 0x6f6c_6467_0000_4000_8000_0000_0000_0002;

fn run_header(worker: WorkerId, engine: EngineShape) -> StreamHeader {
    StreamHeader {
        run_id: Uuid::from_u128(RUN),
        worker,
        backend: Backend::Vllm,
        policy: HandoffPolicy::SourceFirst,
        clock: ClockDomain::Virtual,
        seed: 7,
        engine,
    }
}

fn shape(total_blocks: u32) -> EngineShape {
    EngineShape {
        total_blocks,
        block_size: 16,
        max_request_slots: 8,
        config_json: format!("{{\"num_gpu_blocks\":{total_blocks}}}"),
    }
}

const P: WorkerId = WorkerId { role: handoff_ledger::ids::Role::Prefill, index: 0, dp_rank: 0 };
const D: WorkerId = WorkerId { role: handoff_ledger::ids::Role::Decode, index: 0, dp_rank: 0 };
const R: WorkerId = WorkerId::ROUTER;

/// Three small streams of one source-first handoff, as each worker wrote them: r1 is booked,
/// prefilled on prefill-0 (4 blocks) and pinned; decode-0 reserves 4 blocks, receives,
/// activates and completes it; the pin is released when the transfer is done. A consistent run
/// (every command folds it, and it drains), so that the golden run is one a user may try
/// `inspect` or `project capacity` on.
fn run_streams() -> Vec<(StreamHeader, Vec<(u64, Fact)>)> {
    let h = support::log::h(0x11);
    let req = RequestId(1);
    let kv = |active, pinned, reserved, free, slots| KvDelta {
        active,
        pinned_source: pinned,
        reserved_destination: reserved,
        free,
        slots,
        ..KvDelta::ZERO
    };
    let done = TerminalStatus::Completed;
    vec![
        // Given out of canonical order on purpose: the writer and reader must sort.
        (
            run_header(R, EngineShape::none()),
            vec![
                (0, Fact::RequestArrived { request: req, input_tokens: 64, output_tokens: 8 }),
                (10, Fact::PrefillBooked { request: req, worker: P, prefill_tokens: 64, blocks: 4 }),
                (20, Fact::DecodeBooked { request: req, worker: D, blocks: 5 }),
                (30, Fact::PrefillComputeDone { request: req, worker: P }),
                (50, Fact::PrefillBookingFreed { request: req, worker: P }),
                (
                    90,
                    Fact::RequestFinished { request: req, status: done, output_tokens: 8, kv: KvDelta::ZERO },
                ),
                (90, Fact::DecodeBookingFreed { request: req, worker: D, status: done }),
            ],
        ),
        (
            run_header(D, shape(200)),
            vec![
                (20, Fact::DestinationRouted { handoff: h, worker: D }),
                (
                    30,
                    Fact::DestinationReserved {
                        handoff: h,
                        request: req,
                        reservation: DestinationReservationId(1),
                        pages: 4,
                        prefix_blocks: 0,
                        prefix_tokens: 0,
                        deadline_ns: 1_000,
                        kv: kv(0, 0, 4, -4, 0),
                    },
                ),
                (30, Fact::ReceiveStarted { handoff: h, from: P, bytes: 64 * 131_072 }),
                (40, Fact::ReceiveCompleted { handoff: h }),
                (
                    50,
                    Fact::DestinationActivated {
                        handoff: h,
                        reservation: DestinationReservationId(1),
                        kv: kv(4, 0, -4, 0, 0),
                    },
                ),
                (50, Fact::RequestScheduled { request: req, cached_tokens: 0, kv: kv(0, 0, 0, 0, 1) }),
                (
                    90,
                    Fact::RequestFinished {
                        request: req,
                        status: done,
                        output_tokens: 8,
                        kv: kv(-4, 0, 0, 4, -1),
                    },
                ),
            ],
        ),
        (
            run_header(P, shape(100)),
            vec![
                (
                    10,
                    Fact::HandoffStarted {
                        handoff: h,
                        request: req,
                        policy: HandoffPolicy::SourceFirst,
                        demand: KvHandoffDemand { context_tokens: 64, max_output_tokens: 8 },
                    },
                ),
                (20, Fact::PrefillDispatched { handoff: h }),
                (20, Fact::RequestQueued { request: req }),
                (25, Fact::RequestScheduled { request: req, cached_tokens: 0, kv: kv(4, 0, 0, -4, 1) }),
                (30, Fact::FirstTokenEmitted { request: req }),
                (
                    30,
                    Fact::SourcePinned {
                        handoff: h,
                        request: req,
                        lease: SourceLeaseId(1),
                        blocks: 4,
                        deadline_ns: 500,
                        kv: kv(-4, 4, 0, 0, -1),
                    },
                ),
                (
                    50,
                    Fact::SourceReleased {
                        handoff: h,
                        lease: SourceLeaseId(1),
                        reason: EndReason::Success,
                        kv: kv(0, -4, 0, 4, 0),
                    },
                ),
            ],
        ),
    ]
}

/// The merge order, written out by hand from the rule (at_ns, canonical stream, seq); canonical
/// order is prefill-0 (0), decode-0 (1), router (2).
const MERGE_ORDER: [(WorkerId, u64); 21] = [
    (R, 0), // 0
    (P, 0), // 10
    (R, 1), // 10
    (P, 1), // 20
    (P, 2), // 20
    (D, 0), // 20
    (R, 2), // 20
    (P, 3), // 25
    (P, 4), // 30
    (P, 5), // 30
    (D, 1), // 30
    (D, 2), // 30
    (R, 3), // 30
    (D, 3), // 40
    (P, 6), // 50
    (D, 4), // 50
    (D, 5), // 50
    (R, 4), // 50
    (D, 6), // 90
    (R, 5), // 90
    (R, 6), // 90
];

#[test]
fn golden_v1_merged_run_decodes_unchanged() {
    let path = golden_dir().join("golden-run.hrun");
    let streams = run_streams();

    // Encode today: a run directory, then merged.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    write_golden_run(&dir).finish().unwrap();
    let encoded_path = tmp.path().join("run.hrun");
    write_merged(&dir, &encoded_path).unwrap();
    let encoded = std::fs::read(&encoded_path).unwrap();
    if regenerate() {
        std::fs::create_dir_all(golden_dir()).unwrap();
        std::fs::write(&path, &encoded).unwrap();
        eprintln!("regenerated {}", path.display());
    }

    // (a) The committed file: canonical headers, and the hand-written merge order.
    let mut r = RunReader::open(&path).unwrap();
    assert_eq!(r.kind(), RunKind::Merged);
    let workers: Vec<WorkerId> = r.headers().iter().map(|h| h.worker).collect();
    assert_eq!(workers, vec![P, D, R]);
    for h in r.headers() {
        let (given, _) = streams.iter().find(|(g, _)| g.worker == h.worker).unwrap();
        assert_eq!(h, given);
    }
    let mut got = Vec::new();
    while let Some((i, rec)) = r.next().unwrap() {
        got.push((workers[i], rec));
    }
    let want: Vec<(WorkerId, Record)> = MERGE_ORDER
        .iter()
        .map(|(w, seq)| {
            let (_, recs) = streams.iter().find(|(h, _)| h.worker == *w).unwrap();
            let (at_ns, fact) = recs[*seq as usize].clone();
            (*w, Record { seq: *seq, at_ns, fact })
        })
        .collect();
    assert_eq!(got, want);
    // The directory reads the same.
    let mut d = RunReader::open(&dir).unwrap();
    let mut from_dir = Vec::new();
    while let Some((i, rec)) = d.next().unwrap() {
        from_dir.push((workers[i], rec));
    }
    assert_eq!(from_dir, want);

    // (b) Byte equality with the committed file.
    let committed = std::fs::read(&path).unwrap();
    assert_eq!(encoded.len(), committed.len(), "encoded length changed");
    let first_diff = encoded.iter().zip(&committed).position(|(a, b)| a != b);
    assert_eq!(first_diff, None, "encoding differs from the golden run at this byte offset");
}

// ----- format v2 -----

fn golden_v2_dir() -> PathBuf {
    support::fixture("golden/v2")
}

/// Every variant (both v1 lists), then block-hash facts that exercise the v2 table: a stored
/// chain, its removal in the same and in the reverse order, a re-store, and a parent found as a
/// reference.
fn golden_v2_facts() -> Vec<(u64, Fact)> {
    let mut facts = golden_facts();
    facts.extend(golden_appended_facts());
    let at = facts.last().map(|(at, _)| *at).unwrap_or(0);
    let chain: Vec<u64> = (1..=20u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
    facts.push((at + 1, Fact::KvStored { parent: None, blocks: chain[..10].to_vec() }));
    facts.push((at + 2, Fact::KvStored { parent: Some(chain[9]), blocks: chain[10..].to_vec() }));
    facts.push((at + 3, Fact::KvRemoved { blocks: chain[12..18].to_vec() }));
    facts.push((at + 3, Fact::KvRemoved { blocks: chain[..12].iter().rev().copied().collect() }));
    facts.push((at + 4, Fact::KvStored { parent: None, blocks: chain[..4].to_vec() }));
    facts.push((at, Fact::KvRemoved { blocks: vec![chain[19], chain[3], u64::MAX] }));
    facts
}

#[test]
fn golden_v2_log_decodes_unchanged() {
    let path = golden_v2_dir().join("golden.hlog");
    let encoded = encode(&golden_v2_facts(), LogFormat::V2);
    if regenerate() {
        std::fs::create_dir_all(golden_v2_dir()).unwrap();
        std::fs::write(&path, &encoded).unwrap();
        eprintln!("regenerated {}", path.display());
    }
    let mut r = StreamReader::open(&path).unwrap_or_else(|e| {
        panic!("{e} (regenerate with REGENERATE_GOLDEN=1 only for a new format version)")
    });
    assert_eq!(r.format(), LogFormat::V2);
    assert_eq!(r.header(), &golden_header());
    let mut got = Vec::new();
    while let Some(rec) = r.next_record().unwrap() {
        got.push(rec);
    }
    assert_eq!(r.torn_tail(), None);
    let want: Vec<Record> = golden_v2_facts()
        .into_iter()
        .enumerate()
        .map(|(i, (at_ns, fact))| Record { seq: i as u64, at_ns, fact })
        .collect();
    assert_eq!(got, want);
    let committed = std::fs::read(&path).unwrap();
    let first_diff = encoded.iter().zip(&committed).position(|(a, b)| a != b);
    assert_eq!((encoded.len(), first_diff), (committed.len(), None), "encoding differs from the golden file");
    // The table made the removals and the re-store references, not hashes written again.
    let v1 = encode(&golden_v2_facts(), LogFormat::V1);
    assert!(committed.len() * 2 < v1.len(), "v2 {} bytes, v1 {}", committed.len(), v1.len());
}

/// The golden run as a v2 directory: what replay writes today, committed so every command is
/// tried on it (`cli_log::every_command_works_on_every_committed_run`) and its bytes are held.
#[test]
fn golden_v2_run_directory_decodes_unchanged() {
    let dir = support::fixture("runs/v2-golden");
    let tmp = tempfile::tempdir().unwrap();
    let fresh = tmp.path().join("run");
    write_golden_run(&fresh).close().unwrap();
    if regenerate() {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for e in std::fs::read_dir(&fresh).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
        }
    }
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".hlog"))
        .collect();
    names.sort();
    assert_eq!(names, ["decode-0.hlog", "prefill-0.hlog", "router.hlog"]);
    for name in &names {
        let committed = std::fs::read(dir.join(name)).unwrap();
        let encoded = std::fs::read(fresh.join(name)).unwrap();
        assert_eq!(committed, encoded, "{name} differs from what this build writes");
        assert_eq!(StreamReader::open(dir.join(name)).unwrap().format(), LogFormat::V2);
    }
    let mut want = Vec::new();
    let mut r = RunReader::open(golden_dir().join("golden-run.hrun")).unwrap();
    while let Some((i, rec)) = r.next().unwrap() {
        want.push((i, rec));
    }
    let mut got = Vec::new();
    let mut d = RunReader::open(&dir).unwrap();
    while let Some((i, rec)) = d.next().unwrap() {
        if rec.fact != Fact::StreamEnded {
            got.push((i, rec));
        }
    }
    assert_eq!(got, want, "the v2 directory holds the v1 merged run's records");
}
