//! Stream round trip: whatever the writer appends, the reader returns unchanged, in order, with
//! consecutive sequence numbers and the documented byte layout.

mod support;

use handoff_ledger::events::{codec, Fact, LogFormat, Record, StreamReader, StreamWriter, MAGIC};
use handoff_ledger::ids::WorkerId;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use std::io::Cursor;
use support::log::{any_header, fact, header, ordinal, FACT_VARIANTS};

fn write_all(header: &handoff_ledger::events::StreamHeader, recs: &[(u64, Fact)]) -> Vec<u8> {
    let mut w = StreamWriter::with_format(Vec::new(), header, LogFormat::V1).expect("writer");
    for (i, (at, f)) in recs.iter().enumerate() {
        assert_eq!(w.append(*at, f).expect("append"), i as u64);
    }
    let n = w.bytes_written();
    let bytes = w.finish().expect("finish");
    assert_eq!(n, bytes.len() as u64, "bytes_written counts every byte");
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_records_round_trip(
        hdr in any_header(),
        recs in prop::collection::vec((any::<u64>(), fact()), 0..40),
    ) {
        let bytes = write_all(&hdr, &recs);
        let mut r = StreamReader::new(Cursor::new(&bytes), "mem").expect("header");
        prop_assert_eq!(r.header(), &hdr);
        let mut got = Vec::new();
        let mut offsets = Vec::new();
        loop {
            let before = r.offset();
            match r.next_record().expect("sound stream") {
                Some(rec) => {
                    prop_assert_eq!(r.last_record_offset(), Some(before));
                    offsets.push(before);
                    got.push(rec);
                }
                None => break,
            }
        }
        prop_assert_eq!(r.torn_tail(), None);
        prop_assert_eq!(r.offset(), bytes.len() as u64);
        let want: Vec<Record> = recs
            .iter()
            .enumerate()
            .map(|(i, (at_ns, f))| Record { seq: i as u64, at_ns: *at_ns, fact: f.clone() })
            .collect();
        prop_assert_eq!(got, want);
        // Offsets strictly increase and each names a record start (its len field).
        for w in offsets.windows(2) {
            prop_assert!(w[0] < w[1]);
        }
    }
}

/// The bytes follow the layout documented in `events/mod.rs`, built here by hand.
#[test]
fn writer_output_matches_the_documented_layout() {
    let hdr = header(5, WorkerId::decode(2));
    let facts = vec![
        (17u64, Fact::KvCleared),
        (u64::MAX, Fact::RequestQueued { request: handoff_ledger::ids::RequestId(300) }),
    ];
    let bytes = write_all(&hdr, &facts);

    let mut want = Vec::new();
    want.extend_from_slice(b"HOFFLOG\0");
    want.extend_from_slice(&1u16.to_le_bytes());
    want.extend_from_slice(&codec::CODEC_ID.to_le_bytes());
    let mut hb = Vec::new();
    codec::encode_into(&hdr, &mut hb).unwrap();
    want.extend_from_slice(&(hb.len() as u32).to_le_bytes());
    want.extend_from_slice(&crc32fast::hash(&hb).to_le_bytes());
    want.extend_from_slice(&hb);
    for (seq, (at, f)) in facts.iter().enumerate() {
        let mut body = Vec::new();
        body.extend_from_slice(&(seq as u64).to_le_bytes());
        body.extend_from_slice(&at.to_le_bytes());
        codec::encode_into(f, &mut body).unwrap();
        want.extend_from_slice(&(body.len() as u32).to_le_bytes());
        want.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        want.extend_from_slice(&body);
    }
    assert_eq!(MAGIC, *b"HOFFLOG\0");
    assert_eq!(LogFormat::V1.version(), 1);
    assert_eq!(bytes, want);
}

/// The Fact strategy really produces every variant (so the round trip covers them all).
#[test]
fn fact_strategy_covers_every_variant() {
    let mut runner = TestRunner::deterministic();
    let strat = fact();
    let mut seen = [false; FACT_VARIANTS];
    for _ in 0..5000 {
        let f = strat.new_tree(&mut runner).expect("tree").current();
        seen[ordinal(&f)] = true;
    }
    let missing: Vec<usize> = (0..FACT_VARIANTS).filter(|i| !seen[*i]).collect();
    assert!(missing.is_empty(), "variants never generated: {missing:?}");
}

/// The iterator form yields the same records and stops at the end.
#[test]
fn iterator_yields_records_in_order() {
    let hdr = header(1, WorkerId::prefill(0));
    let facts: Vec<(u64, Fact)> = (0..100)
        .map(|i| (i * 10, Fact::RequestQueued { request: handoff_ledger::ids::RequestId(i) }))
        .collect();
    let bytes = write_all(&hdr, &facts);
    let r = StreamReader::new(Cursor::new(bytes), "mem").unwrap();
    let got: Vec<Record> = r.collect::<Result<_, _>>().unwrap();
    assert_eq!(got.len(), 100);
    for (i, rec) in got.iter().enumerate() {
        assert_eq!(rec.seq, i as u64);
        assert_eq!(rec.fact, facts[i].1);
    }
}

/// A restarted worker continues its stream: the sequence goes on and earlier records survive.
#[test]
fn open_append_continues_the_sequence() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("decode-0.hlog");
    let hdr = header(9, WorkerId::decode(0));
    let mut w = StreamWriter::create_as(&path, &hdr, LogFormat::V1).unwrap();
    for i in 0..5u64 {
        w.append(i, &Fact::RequestQueued { request: handoff_ledger::ids::RequestId(i) }).unwrap();
    }
    drop(w.finish().unwrap());
    let (mut w, torn) = StreamWriter::open_append(&path).unwrap();
    assert_eq!(torn, None);
    assert_eq!(w.next_seq(), 5);
    assert_eq!(w.header(), &hdr);
    assert_eq!(w.bytes_written(), std::fs::metadata(&path).unwrap().len());
    assert_eq!(w.append(100, &Fact::KvCleared).unwrap(), 5);
    w.finish().unwrap();
    let recs: Vec<Record> = StreamReader::open(&path).unwrap().collect::<Result<_, _>>().unwrap();
    assert_eq!(recs.len(), 6);
    assert_eq!(recs[5], Record { seq: 5, at_ns: 100, fact: Fact::KvCleared });
    assert_eq!(recs[4].at_ns, 4);
}
