//! Runs: a directory of streams and the merged file made from it read as the same sequence, in
//! the documented merge order; streams of different runs are refused.

mod support;

use handoff_ledger::events::{
    recover_run, stream_file_name, verify_run, write_merged, Fact, LogError, Record, RunKind, RunReader,
    RunWriter, StreamHeader, StreamWriter, TornTail,
};
use handoff_ledger::ids::{RequestId, Role, WorkerId};
use proptest::prelude::*;
use std::path::Path;
use support::log::{fact, header};

fn read_run(path: &Path) -> (Vec<StreamHeader>, Vec<(usize, Record)>) {
    // Arbitrary facts name arbitrary workers: this reads the framing, not a consistent run.
    let mut r = RunReader::open(path).unwrap_or_else(|e| panic!("{e}")).allow_missing_peers();
    let headers = r.headers().to_vec();
    let mut out = Vec::new();
    while let Some(x) = r.next().unwrap_or_else(|e| panic!("{e}")) {
        out.push(x);
    }
    (headers, out)
}

fn workers() -> impl Strategy<Value = Vec<WorkerId>> {
    let pool = vec![
        WorkerId::ROUTER,
        WorkerId::prefill(0),
        WorkerId::prefill(1),
        WorkerId { role: Role::Prefill, index: 1, dp_rank: 2 },
        WorkerId::decode(0),
        WorkerId::decode(10),
        WorkerId::aggregated(3),
    ];
    // A random non-empty subset in a random order (the writer must not depend on it).
    proptest::sample::subsequence(pool, 1..=5).prop_shuffle()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Per-stream timestamps that never decrease (with many ties across streams): the run
    /// yields every record exactly once, sorted by (at_ns, canonical stream index, seq); the
    /// merged file yields the identical sequence.
    #[test]
    fn dir_and_merged_yield_the_same_sorted_sequence(
        ws in workers(),
        streams in prop::collection::vec(prop::collection::vec((0u64..4, fact()), 0..25), 5),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        let headers: Vec<StreamHeader> = ws.iter().map(|w| header(77, *w)).collect();
        let mut rw = RunWriter::create(&dir, headers.clone()).unwrap();
        // What each worker wrote, by worker.
        let mut written: Vec<(WorkerId, Vec<Record>)> = Vec::new();
        for (w, recs) in ws.iter().zip(&streams) {
            let mut at = 0u64;
            let mut mine = Vec::new();
            for (step, f) in recs {
                at += step; // steps of 0 give ties within and across streams
                let seq = rw.append(*w, at, f).unwrap();
                mine.push(Record { seq, at_ns: at, fact: f.clone() });
            }
            written.push((*w, mine));
        }
        let files = rw.finish().unwrap();
        prop_assert_eq!(files.len(), ws.len());

        let (hs, got) = read_run(&dir);
        // Canonical header order: sorted by WorkerId.
        let mut canon: Vec<WorkerId> = ws.clone();
        canon.sort();
        prop_assert_eq!(hs.iter().map(|h| h.worker).collect::<Vec<_>>(), canon.clone());

        // Expected: all records, sorted by (at_ns, canonical index, seq), computed directly.
        let mut want: Vec<(usize, Record)> = Vec::new();
        for (w, recs) in &written {
            let idx = canon.iter().position(|c| c == w).unwrap();
            want.extend(recs.iter().map(|r| (idx, r.clone())));
        }
        want.sort_by_key(|(i, r)| (r.at_ns, *i, r.seq));
        prop_assert_eq!(&got, &want);

        let merged = tmp.path().join("run.hrun");
        let summary = write_merged(&dir, &merged).unwrap();
        prop_assert_eq!(summary.records, want.len() as u64);
        prop_assert_eq!(summary.bytes, std::fs::metadata(&merged).unwrap().len());
        let (mhs, mgot) = read_run(&merged);
        prop_assert_eq!(mhs, hs);
        prop_assert_eq!(&mgot, &want);
        prop_assert_eq!(RunReader::open(&merged).unwrap().kind(), RunKind::Merged);

        // Merging a merged file reproduces it byte for byte.
        let again = tmp.path().join("again.hrun");
        write_merged(&merged, &again).unwrap();
        prop_assert_eq!(std::fs::read(&again).unwrap(), std::fs::read(&merged).unwrap());
    }

    /// Even with timestamps going backwards inside streams, the two layouts agree and each
    /// stream's records keep their order.
    #[test]
    fn unordered_timestamps_still_merge_deterministically(
        streams in prop::collection::vec(prop::collection::vec(0u64..50, 0..30), 3),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        let ws = [WorkerId::decode(0), WorkerId::prefill(0), WorkerId::ROUTER];
        let mut rw = RunWriter::create(&dir, ws.iter().map(|w| header(1, *w))).unwrap();
        for (w, ats) in ws.iter().zip(&streams) {
            for (i, at) in ats.iter().enumerate() {
                rw.append(*w, *at, &Fact::RequestQueued { request: RequestId(i as u64) }).unwrap();
            }
        }
        rw.finish().unwrap();
        let (_, a) = read_run(&dir);
        let (_, b) = read_run(&dir);
        prop_assert_eq!(&a, &b);
        let merged = tmp.path().join("m.hrun");
        write_merged(&dir, &merged).unwrap();
        let (_, c) = read_run(&merged);
        prop_assert_eq!(&a, &c);
        for s in 0..3 {
            let seqs: Vec<u64> = a.iter().filter(|(i, _)| *i == s).map(|(_, r)| r.seq).collect();
            let n = seqs.len() as u64;
            prop_assert_eq!(seqs, (0..n).collect::<Vec<_>>());
        }
    }
}

#[test]
fn equal_timestamps_follow_canonical_worker_order() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = [WorkerId::ROUTER, WorkerId::decode(0), WorkerId::prefill(1), WorkerId::prefill(0)];
    let mut rw = RunWriter::create(tmp.path(), ws.iter().map(|w| header(1, *w))).unwrap();
    for w in ws {
        rw.append(w, 5, &Fact::KvCleared).unwrap();
        rw.append(w, 5, &Fact::KvRemoved { blocks: vec![] }).unwrap();
    }
    rw.finish().unwrap();
    let (hs, got) = read_run(tmp.path());
    let order: Vec<(String, u64)> = got.iter().map(|(i, r)| (hs[*i].worker.to_string(), r.seq)).collect();
    let want = [
        ("prefill-0", 0),
        ("prefill-0", 1),
        ("prefill-1", 0),
        ("prefill-1", 1),
        ("decode-0", 0),
        ("decode-0", 1),
        ("router", 0),
        ("router", 1),
    ];
    assert_eq!(order, want.map(|(w, s)| (w.to_string(), s)));
}

#[test]
fn a_stream_of_another_run_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    StreamWriter::create(tmp.path().join("prefill-0.hlog"), &header(1, WorkerId::prefill(0)))
        .unwrap()
        .finish()
        .unwrap();
    StreamWriter::create(tmp.path().join("decode-0.hlog"), &header(2, WorkerId::decode(0)))
        .unwrap()
        .finish()
        .unwrap();
    let e = RunReader::open(tmp.path()).err().expect("mismatch must fail");
    match &e {
        LogError::RunIdMismatch { path, worker, .. } => {
            assert_eq!(*worker, WorkerId::decode(0));
            assert!(path.ends_with("decode-0.hlog"));
        }
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("decode-0.hlog"), "{e}");

    // The writer refuses to start such a run.
    let e = RunWriter::create(
        tmp.path().join("w"),
        [header(1, WorkerId::prefill(0)), header(2, WorkerId::decode(0))],
    )
    .err()
    .unwrap();
    assert!(matches!(e, LogError::RunIdMismatch { .. }), "{e}");
    let e = RunWriter::create(
        tmp.path().join("w2"),
        [header(1, WorkerId::prefill(0)), header(1, WorkerId::prefill(0))],
    )
    .err()
    .unwrap();
    assert!(matches!(e, LogError::DuplicateWorker { .. }), "{e}");
}

#[test]
fn file_named_for_another_worker_is_refused_and_other_files_ignored() {
    let tmp = tempfile::tempdir().unwrap();
    StreamWriter::create(tmp.path().join("prefill-0.hlog"), &header(1, WorkerId::prefill(0)))
        .unwrap()
        .finish()
        .unwrap();
    std::fs::write(tmp.path().join("notes.txt"), "hello").unwrap();
    std::fs::write(tmp.path().join("summary.hlog"), "not a worker name").unwrap();
    std::fs::write(tmp.path().join("decode-0.hlog.bak"), "stale").unwrap();
    let (hs, recs) = read_run(tmp.path());
    assert_eq!(hs.len(), 1);
    assert!(recs.is_empty());

    std::fs::copy(tmp.path().join("prefill-0.hlog"), tmp.path().join("decode-4.hlog")).unwrap();
    match RunReader::open(tmp.path()).err().unwrap() {
        LogError::WorkerMismatch { named, found, .. } => {
            assert_eq!((named, found), (WorkerId::decode(4), WorkerId::prefill(0)));
        }
        other => panic!("{other}"),
    }

    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(RunReader::open(empty.path()), Err(LogError::EmptyRun { .. })));
}

#[test]
fn run_writer_refuses_a_directory_that_holds_a_run_and_unknown_workers() {
    let tmp = tempfile::tempdir().unwrap();
    let mut rw = RunWriter::create(tmp.path(), [header(1, WorkerId::prefill(0))]).unwrap();
    assert!(matches!(
        rw.append(WorkerId::decode(0), 1, &Fact::KvCleared),
        Err(LogError::UnknownWorker { .. })
    ));
    rw.finish().unwrap();
    assert!(tmp.path().join(stream_file_name(WorkerId::prefill(0))).is_file());
    assert!(matches!(
        RunWriter::create(tmp.path(), [header(1, WorkerId::decode(0))]),
        Err(LogError::RunExists { .. })
    ));
}

#[test]
fn a_torn_stream_in_a_run_is_reported_and_recovered() {
    let tmp = tempfile::tempdir().unwrap();
    let ws = [WorkerId::prefill(0), WorkerId::decode(0)];
    let mut rw = RunWriter::create(tmp.path(), ws.iter().map(|w| header(1, *w))).unwrap();
    for t in 0..10u64 {
        let w = ws[(t % 2) as usize];
        rw.append(w, t, &Fact::RequestQueued { request: RequestId(t) }).unwrap();
        // Flushed after each record, as a live worker flushes: each v2 block holds one record,
        // so the cut below takes only the last.
        rw.stream(w).unwrap().flush().unwrap();
    }
    let files = rw.finish().unwrap();
    let decode = files.iter().find(|p| p.ends_with("decode-0.hlog")).unwrap().clone();
    let len = std::fs::metadata(&decode).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&decode).unwrap();
    f.set_len(len - 5).unwrap();
    drop(f);

    let summary = verify_run(tmp.path()).unwrap();
    assert_eq!(summary.records, 9);
    assert_eq!(summary.streams[1].records, 4);
    assert_eq!(summary.torn_tails.len(), 1);
    assert_eq!(summary.torn_tails[0].0, decode);
    let TornTail { offset, bytes } = summary.torn_tails[0].1;
    assert_eq!(offset + bytes, len - 5);

    let cut = recover_run(tmp.path()).unwrap();
    assert_eq!(cut, summary.torn_tails);
    assert_eq!(std::fs::metadata(&decode).unwrap().len(), offset);
    assert!(verify_run(tmp.path()).unwrap().torn_tails.is_empty());
}

#[test]
fn damage_in_a_merged_file_names_the_file_and_offset() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let ws = [WorkerId::prefill(0), WorkerId::decode(0)];
    let mut rw = RunWriter::create(&dir, ws.iter().map(|w| header(1, *w))).unwrap();
    for t in 0..10u64 {
        rw.append(ws[(t % 2) as usize], t, &Fact::RequestQueued { request: RequestId(t) }).unwrap();
    }
    rw.finish().unwrap();
    let merged = tmp.path().join("m.hrun");
    write_merged(&dir, &merged).unwrap();
    let bytes = std::fs::read(&merged).unwrap();

    // Find record offsets by reading.
    let mut r = RunReader::open(&merged).unwrap();
    let mut offsets = Vec::new();
    while r.next().unwrap().is_some() {
        offsets.push(r.last_record_offset().unwrap());
    }
    assert_eq!(offsets.len(), 10);
    let victim = offsets[5];
    for pos in victim..offsets[6] {
        let mut bad = bytes.clone();
        bad[pos as usize] ^= 0x10;
        std::fs::write(&merged, &bad).unwrap();
        let mut r = RunReader::open(&merged).unwrap();
        let e = loop {
            match r.next() {
                Ok(Some(_)) => {}
                Ok(None) => panic!("byte {pos}: no error"),
                Err(e) => break e,
            }
        };
        assert_eq!(e.offset(), Some(victim), "byte {pos}: {e}");
        assert!(e.to_string().contains("m.hrun"), "{e}");
    }

    // Torn merged file: every earlier record, the tail reported, recover cuts it.
    std::fs::write(&merged, &bytes[..bytes.len() - 2]).unwrap();
    let s = verify_run(&merged).unwrap();
    assert_eq!(s.records, 9);
    assert_eq!(s.torn_tails.len(), 1);
    assert_eq!(s.torn_tails[0].1.offset, *offsets.last().unwrap());
    recover_run(&merged).unwrap();
    assert_eq!(std::fs::read(&merged).unwrap(), bytes[..*offsets.last().unwrap() as usize]);

    // Wrong magic / version.
    let mut v = bytes.clone();
    v[8] = 9;
    std::fs::write(&merged, &v).unwrap();
    assert!(matches!(RunReader::open(&merged), Err(LogError::UnsupportedVersion { found: 9, .. })));
    std::fs::write(&merged, b"GARBAGE!garbage").unwrap();
    assert!(matches!(RunReader::open(&merged), Err(LogError::BadMagic { .. })));
}

#[test]
fn a_lone_stream_file_reads_as_a_run_of_one() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("x.hlog");
    let mut w = StreamWriter::create(&p, &header(1, WorkerId::decode(2))).unwrap();
    w.append(3, &Fact::KvCleared).unwrap();
    w.finish().unwrap();
    let r = RunReader::open(&p).unwrap();
    assert_eq!(r.kind(), RunKind::Stream);
    let (hs, recs) = read_run(&p);
    assert_eq!(hs[0].worker, WorkerId::decode(2));
    assert_eq!(recs, vec![(0, Record { seq: 0, at_ns: 3, fact: Fact::KvCleared })]);
}

#[test]
fn workers_can_be_declared_after_create() {
    let tmp = tempfile::tempdir().unwrap();
    let mut rw = RunWriter::create(tmp.path(), []).unwrap();
    rw.declare(header(4, WorkerId::decode(1))).unwrap();
    rw.append(WorkerId::decode(1), 10, &Fact::KvCleared).unwrap();
    rw.declare(header(4, WorkerId::prefill(0))).unwrap();
    assert!(matches!(rw.declare(header(5, WorkerId::prefill(2))), Err(LogError::RunIdMismatch { .. })));
    assert!(matches!(rw.declare(header(4, WorkerId::decode(1))), Err(LogError::DuplicateWorker { .. })));
    let router1 = WorkerId { role: Role::Router, index: 1, dp_rank: 0 };
    assert!(matches!(rw.declare(header(4, router1)), Err(LogError::WorkerMismatch { .. })));
    let files = rw.finish().unwrap();
    assert_eq!(files.len(), 2);
    let (hs, recs) = read_run(tmp.path());
    assert_eq!(hs.iter().map(|h| h.worker).collect::<Vec<_>>(), [WorkerId::prefill(0), WorkerId::decode(1)]);
    assert_eq!(recs, vec![(1, Record { seq: 0, at_ns: 10, fact: Fact::KvCleared })]);
}

#[test]
fn a_failed_merge_leaves_no_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let mut rw = RunWriter::create(&dir, [header(1, WorkerId::prefill(0))]).unwrap();
    for t in 0..5u64 {
        rw.append(WorkerId::prefill(0), t, &Fact::KvCleared).unwrap();
    }
    let files = rw.finish().unwrap();
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0xFF; // damage the last record's fact: a checksum error, not a torn tail
    std::fs::write(&files[0], &bytes).unwrap();
    let out = tmp.path().join("m.hrun");
    assert!(matches!(write_merged(&dir, &out), Err(LogError::Corrupt { .. })));
    assert!(!out.exists());
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1, "no temp file left behind");
}
