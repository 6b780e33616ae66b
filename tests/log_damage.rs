//! Damage: a torn tail is cut and reported, anything else is an error naming file and offset.

mod support;

use handoff_ledger::events::{
    codec, recover, verify_stream, Fact, LogError, LogFormat, Record, StreamReader, StreamWriter, TornTail,
};
use handoff_ledger::ids::{RequestId, WorkerId};
use std::io::Cursor;
use std::path::Path;
use support::log::{golden_facts, header};

/// A stream of the golden facts (every variant); returns the bytes and each record's offset.
fn sample() -> (Vec<u8>, Vec<u64>) {
    let mut w =
        StreamWriter::with_format(Vec::new(), &header(3, WorkerId::prefill(1)), LogFormat::V1).unwrap();
    let mut offsets = Vec::new();
    for (at, f) in golden_facts() {
        offsets.push(w.bytes_written());
        w.append(at, &f).unwrap();
    }
    (w.finish().unwrap(), offsets)
}

/// Reads everything; returns the records and the final outcome.
fn read_all(bytes: &[u8]) -> (Vec<Record>, Result<Option<TornTail>, LogError>) {
    let mut r = match StreamReader::new(Cursor::new(bytes), "mem.hlog") {
        Ok(r) => r,
        Err(e) => return (Vec::new(), Err(e)),
    };
    let mut recs = Vec::new();
    loop {
        match r.next_record() {
            Ok(Some(rec)) => recs.push(rec),
            Ok(None) => return (recs, Ok(r.torn_tail())),
            Err(e) => return (recs, Err(e)),
        }
    }
}

#[test]
fn torn_tail_at_every_byte_of_the_last_record_is_recovered() {
    let (bytes, offsets) = sample();
    let (all, end) = read_all(&bytes);
    assert_eq!(end.unwrap(), None);
    let n = all.len();
    let last = *offsets.last().unwrap() as usize;
    let dir = tempfile::tempdir().unwrap();
    for cut in last..bytes.len() {
        let torn = &bytes[..cut];
        let (recs, end) = read_all(torn);
        let end = end.unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
        assert_eq!(recs, all[..n - 1], "cut at {cut}: every earlier record recovered");
        let want = (cut > last).then_some(TornTail { offset: last as u64, bytes: (cut - last) as u64 });
        assert_eq!(end, want, "cut at {cut}");

        // On disk: verify reports without writing; recover truncates to a clean stream.
        let path = dir.path().join(format!("cut-{cut}.hlog"));
        std::fs::write(&path, torn).unwrap();
        let summary = verify_stream(&path).unwrap();
        assert_eq!(summary.records, (n - 1) as u64);
        assert_eq!(summary.torn_tail, want);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), cut as u64, "verify never writes");
        assert_eq!(recover(&path).unwrap(), want);
        assert_eq!(std::fs::read(&path).unwrap(), bytes[..last], "cut to the last sound record");
        let again = verify_stream(&path).unwrap();
        assert_eq!(again.torn_tail, None);
        assert_eq!(again.records, (n - 1) as u64);
        assert_eq!(recover(&path).unwrap(), None, "a clean stream is left alone");
    }
}

/// Every byte of a middle record, flipped three ways, is reported at that record's offset.
#[test]
fn a_flipped_byte_in_a_middle_record_names_its_offset() {
    let (bytes, offsets) = sample();
    for victim in [offsets.len() / 2, 1, offsets.len() - 1] {
        let start = offsets[victim] as usize;
        let end = offsets.get(victim + 1).map(|o| *o as usize).unwrap_or(bytes.len());
        for pos in start..end {
            for mask in [0x01u8, 0x80, 0xFF] {
                let mut bad = bytes.clone();
                bad[pos] ^= mask;
                let (recs, res) = read_all(&bad);
                let err = match res {
                    Err(e) => e,
                    Ok(t) => panic!("byte {pos} ^ {mask:#x} of record {victim}: no error ({t:?})"),
                };
                assert_eq!(err.offset(), Some(start as u64), "byte {pos} ^ {mask:#x}: {err}");
                assert!(matches!(err, LogError::Corrupt { .. } | LogError::SequenceGap { .. }), "{err}");
                let msg = err.to_string();
                assert!(msg.contains("mem.hlog"), "{msg}");
                assert!(msg.contains(&format!("byte offset {start}")), "{msg}");
                assert_eq!(recs.len(), victim, "records before the damage are still returned");
            }
        }
    }
}

#[test]
fn header_damage_is_a_header_error() {
    let (bytes, offsets) = sample();
    for pos in 12..offsets[0] as usize {
        let mut bad = bytes.clone();
        bad[pos] ^= 0x40;
        match read_all(&bad).1 {
            Err(LogError::CorruptHeader { offset: 12, .. }) => {}
            other => panic!("header byte {pos}: {other:?}"),
        }
    }
    // Cut inside the header: an error, never an empty stream.
    for cut in 0..offsets[0] as usize {
        match read_all(&bytes[..cut]).1 {
            Err(LogError::CorruptHeader { .. }) => {}
            other => panic!("header cut at {cut}: {other:?}"),
        }
    }
}

#[test]
fn bad_magic_unknown_version_and_unknown_codec() {
    let (bytes, _) = sample();
    let mut bad = bytes.clone();
    bad[0] = b'X';
    let e = read_all(&bad).1.unwrap_err();
    assert!(matches!(e, LogError::BadMagic { .. }), "{e}");
    assert!(e.to_string().contains("mem.hlog") && e.to_string().contains("byte offset 0"), "{e}");

    let mut v3 = bytes.clone();
    v3[8..10].copy_from_slice(&3u16.to_le_bytes());
    match read_all(&v3).1 {
        Err(e @ LogError::UnsupportedVersion { found: 3, supported: 2, .. }) => {
            assert!(e.to_string().contains("unsupported format version 3"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    // A v1 file relabelled v2 is not read as blocks that happen to parse: its first record
    // frame fails as a block (checksum sound, fields impossible), naming its offset.
    let mut relabelled = bytes.clone();
    relabelled[8..10].copy_from_slice(&2u16.to_le_bytes());
    let e = read_all(&relabelled).1.unwrap_err();
    assert!(matches!(e, LogError::Corrupt { .. }), "{e}");

    let mut c = bytes.clone();
    c[10..12].copy_from_slice(&99u16.to_le_bytes());
    assert!(matches!(read_all(&c).1, Err(LogError::UnknownCodec { found: 99, .. })));

    // A merged run file is not a stream.
    let run = b"HOFFRUN\0\x01\x00\x01\x00".to_vec();
    assert!(matches!(read_all(&run).1, Err(LogError::BadMagic { .. })));
}

/// Hand-framed records with valid checksums, to reach the checks behind the checksum.
fn frame(seq: u64, at_ns: u64, fact_bytes: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&seq.to_le_bytes());
    body.extend_from_slice(&at_ns.to_le_bytes());
    body.extend_from_slice(fact_bytes);
    let mut out = (body.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

fn header_only() -> Vec<u8> {
    StreamWriter::with_format(Vec::new(), &header(3, WorkerId::decode(0)), LogFormat::V1)
        .unwrap()
        .finish()
        .unwrap()
}

fn enc(f: &Fact) -> Vec<u8> {
    let mut v = Vec::new();
    codec::encode_into(f, &mut v).unwrap();
    v
}

#[test]
fn sequence_gap_and_undecodable_fact_name_their_offsets() {
    let f = enc(&Fact::RequestQueued { request: RequestId(1) });
    let mut bytes = header_only();
    bytes.extend(frame(0, 1, &f));
    bytes.extend(frame(1, 2, &f));
    let gap_at = bytes.len() as u64;
    bytes.extend(frame(3, 3, &f));
    match read_all(&bytes) {
        (recs, Err(LogError::SequenceGap { offset, expected: 2, found: 3, .. })) => {
            assert_eq!(offset, gap_at);
            assert_eq!(recs.len(), 2);
        }
        other => panic!("{other:?}"),
    }

    // The first record must be seq 0.
    let mut bytes = header_only();
    bytes.extend(frame(1, 1, &f));
    assert!(matches!(read_all(&bytes).1, Err(LogError::SequenceGap { expected: 0, found: 1, .. })));

    // A checksum-valid record whose fact does not decode (variant 200; trailing bytes).
    for junk in [vec![200u8], [f.clone(), vec![0]].concat(), vec![]] {
        let mut bytes = header_only();
        bytes.extend(frame(0, 1, &f));
        let at = bytes.len() as u64;
        bytes.extend(frame(1, 2, &junk));
        match read_all(&bytes).1 {
            Err(e @ LogError::Corrupt { .. }) => {
                assert_eq!(e.offset(), Some(at));
                assert!(e.to_string().contains("undecodable fact"), "{e}");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn impossible_lengths_are_errors_even_at_the_end() {
    let f = enc(&Fact::KvCleared);
    for len in [0u32, 15, 16 * 1024 * 1024 + 1, u32::MAX] {
        let mut bytes = header_only();
        bytes.extend(frame(0, 1, &f));
        let at = bytes.len() as u64;
        bytes.extend_from_slice(&len.to_le_bytes());
        bytes.extend_from_slice(&[0u8; 20]);
        match read_all(&bytes).1 {
            Err(e @ LogError::Corrupt { .. }) => {
                assert_eq!(e.offset(), Some(at), "{e}");
                assert!(e.to_string().contains("impossible record length"), "{e}");
            }
            other => panic!("len {len}: {other:?}"),
        }
    }
}

/// The length of the LAST record damaged upward (past the end of the file) is not mistaken for
/// a torn tail: the record is whole under its checksum, so recovering would lose data.
#[test]
fn damaged_length_of_the_last_record_is_not_a_torn_tail() {
    let (bytes, offsets) = sample();
    let last = *offsets.last().unwrap() as usize;
    for (byte, mask) in [(0usize, 0x40u8), (1, 0x01), (2, 0x01)] {
        let mut bad = bytes.clone();
        bad[last + byte] ^= mask;
        match read_all(&bad).1 {
            Err(e @ LogError::Corrupt { .. }) => {
                assert_eq!(e.offset(), Some(last as u64));
                assert!(e.to_string().contains("damaged length"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.hlog");
        std::fs::write(&p, &bad).unwrap();
        assert!(recover(&p).is_err());
        assert_eq!(std::fs::read(&p).unwrap(), bad, "recover writes nothing on damage");
    }
}

#[test]
fn open_append_cuts_a_torn_tail_and_continues() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prefill-1.hlog");
    let (bytes, offsets) = sample();
    let last = *offsets.last().unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    let (mut w, torn) = StreamWriter::open_append(&path).unwrap();
    assert_eq!(torn, Some(TornTail { offset: last, bytes: bytes.len() as u64 - 3 - last }));
    let n = offsets.len() as u64;
    assert_eq!(w.next_seq(), n - 1);
    assert_eq!(w.append(999, &Fact::KvCleared).unwrap(), n - 1);
    w.finish().unwrap();
    let s = verify_stream(&path).unwrap();
    assert_eq!((s.records, s.torn_tail, s.last_at_ns), (n, None, Some(999)));

    // Damage other than a torn tail: refused, file untouched.
    let mut bad = bytes.clone();
    bad[offsets[2] as usize + 9] ^= 1;
    std::fs::write(&path, &bad).unwrap();
    let e = StreamWriter::open_append(&path).unwrap_err();
    assert_eq!(e.offset(), Some(offsets[2]));
    assert_eq!(std::fs::read(&path).unwrap(), bad);
}

#[test]
fn io_errors_name_the_file() {
    let e = StreamReader::open(Path::new("/nonexistent/dir/decode-9.hlog")).err().unwrap();
    assert!(matches!(e, LogError::Io { .. }));
    assert!(e.to_string().contains("/nonexistent/dir/decode-9.hlog"), "{e}");
}

#[test]
fn verify_counts_records_and_distinct_handoffs() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.hlog");
    let (bytes, _) = sample();
    std::fs::write(&path, &bytes).unwrap();
    let s = verify_stream(&path).unwrap();
    let facts = golden_facts();
    let mut hs: Vec<_> = facts.iter().filter_map(|(_, f)| f.handoff()).collect();
    hs.sort();
    hs.dedup();
    assert_eq!(s.records, facts.len() as u64);
    assert_eq!(s.handoffs, hs.len());
    assert_eq!(s.first_at_ns, Some(facts[0].0));
    assert_eq!(s.last_at_ns, Some(facts.last().unwrap().0));
    assert_eq!(s.bytes, bytes.len() as u64);
}

mod no_panic {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        /// Arbitrary damage (overwritten bytes, garbage appended, cuts) never panics: every
        /// outcome is records, a clean end, a torn tail, or a typed error.
        #[test]
        fn arbitrary_damage_never_panics(
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
            tail in prop::collection::vec(any::<u8>(), 0..64),
            cut in any::<prop::sample::Index>(),
        ) {
            let (mut bytes, _) = sample();
            for (i, b) in edits {
                let at = i.index(bytes.len());
                bytes[at] = b;
            }
            bytes.extend_from_slice(&tail);
            let keep = cut.index(bytes.len() + 1);
            bytes.truncate(keep);
            let (recs, end) = read_all(&bytes);
            if let Err(e) = &end {
                // Errors point inside the file.
                if let Some(off) = e.offset() {
                    prop_assert!(off <= bytes.len() as u64, "{e}");
                }
            }
            prop_assert!(recs.len() <= golden_facts().len() + tail.len());
        }
    }
}

// ----- format v2: blocks -----

/// A v2 stream of the golden facts and block-hash facts, sealed into a block every `every`
/// records (as flushes seal them); returns the bytes, the records, and where each block starts.
fn sample_v2(every: usize) -> (Vec<u8>, Vec<Record>, Vec<u64>) {
    let mut w =
        StreamWriter::with_format(Vec::new(), &header(3, WorkerId::prefill(1)), LogFormat::V2).unwrap();
    let mut facts = golden_facts();
    for i in 0..200u64 {
        let blocks: Vec<u64> = (0..8).map(|k| (i * 8 + k).wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
        facts.push((1_000 + i, Fact::KvStored { parent: None, blocks: blocks.clone() }));
        if i % 3 == 0 {
            facts.push((1_000 + i, Fact::KvRemoved { blocks: blocks.into_iter().rev().collect() }));
        }
    }
    let mut starts = vec![w.bytes_written()];
    let mut records = Vec::new();
    for (i, (at, f)) in facts.into_iter().enumerate() {
        w.append(at, &f).unwrap();
        records.push(Record { seq: i as u64, at_ns: at, fact: f });
        if (i + 1) % every == 0 {
            w.flush().unwrap();
            starts.push(w.bytes_written());
        }
    }
    w.flush().unwrap();
    if starts.last() != Some(&w.bytes_written()) {
        starts.push(w.bytes_written());
    }
    let end = starts.pop().unwrap();
    let bytes = w.finish().unwrap();
    assert_eq!(end, bytes.len() as u64);
    (bytes, records, starts)
}

#[test]
fn v2_round_trips_across_blocks() {
    let (bytes, records, starts) = sample_v2(37);
    assert!(starts.len() > 5, "{} blocks", starts.len());
    let (got, end) = read_all(&bytes);
    assert_eq!(end.unwrap(), None);
    assert_eq!(got, records);
}

/// Cut anywhere inside the last block: every earlier block's records come back, the torn tail
/// starts at the last block, and recover truncates exactly there.
#[test]
fn v2_torn_tail_at_every_byte_of_the_last_block_is_recovered() {
    let (bytes, records, starts) = sample_v2(37);
    let last = *starts.last().unwrap() as usize;
    let kept = records.len() - records.len() % 37;
    let kept = if kept == records.len() { kept - 37 } else { kept };
    let dir = tempfile::tempdir().unwrap();
    for cut in last..bytes.len() {
        let (recs, end) = read_all(&bytes[..cut]);
        let end = end.unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
        assert_eq!(recs, records[..kept], "cut at {cut}");
        let want = (cut > last).then_some(TornTail { offset: last as u64, bytes: (cut - last) as u64 });
        assert_eq!(end, want, "cut at {cut}");
        if cut % 7 == 0 {
            let path = dir.path().join(format!("cut-{cut}.hlog"));
            std::fs::write(&path, &bytes[..cut]).unwrap();
            assert_eq!(recover(&path).unwrap(), want);
            assert_eq!(std::fs::metadata(&path).unwrap().len(), last as u64);
        }
    }
}

/// Every byte of a middle block flipped: an error naming that block's offset (never a panic, a
/// torn tail, or wrong records), with every record of the blocks before it read first.
#[test]
fn v2_a_flipped_byte_in_a_middle_block_names_its_offset() {
    let (bytes, records, starts) = sample_v2(37);
    let k = starts.len() / 2;
    let (start, end) = (starts[k] as usize, starts[k + 1] as usize);
    for pos in start..end {
        let mut bad = bytes.clone();
        bad[pos] ^= 0x40;
        let (recs, outcome) = read_all(&bad);
        let e = outcome.expect_err(&format!("byte {pos}"));
        assert_eq!(e.offset(), Some(start as u64), "byte {pos}: {e}");
        assert_eq!(recs, records[..37 * k], "byte {pos}");
    }
}

/// A restarted v2 writer cuts a torn block and continues in a new epoch; readers see the
/// records before the cut, then the new ones, with the sequence unbroken.
#[test]
fn v2_open_append_cuts_a_torn_block_and_continues() {
    let (bytes, records, starts) = sample_v2(37);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prefill-1.hlog");
    std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    let (mut w, torn) = StreamWriter::open_append(&path).unwrap();
    assert_eq!(torn.unwrap().offset, *starts.last().unwrap());
    assert_eq!(w.format(), LogFormat::V2);
    let kept = w.next_seq() as usize;
    let again = Fact::KvRemoved { blocks: vec![0x9e37_79b9_7f4a_7c15, 7] };
    assert_eq!(w.append(5_000, &again).unwrap(), kept as u64);
    w.finish().unwrap();
    let got: Vec<Record> = StreamReader::open(&path).unwrap().collect::<Result<_, _>>().unwrap();
    assert_eq!(got[..kept], records[..kept]);
    assert_eq!(got[kept], Record { seq: kept as u64, at_ns: 5_000, fact: again });
}

/// One `KvStored` with more hashes than a table epoch holds (600k: 5.4 MB, a legal record) is
/// written and read back whole, followed by records that reference it.
#[test]
fn v2_one_fact_larger_than_a_table_epoch_reads_back() {
    let blocks: Vec<u64> = (1..=600_000u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
    let facts = vec![
        Fact::KvStored { parent: None, blocks: blocks.clone() },
        Fact::KvRemoved { blocks: blocks[..1000].to_vec() },
        Fact::KvStored { parent: Some(blocks[5]), blocks: blocks[10..20].to_vec() },
    ];
    let mut w =
        StreamWriter::with_format(Vec::new(), &header(3, WorkerId::decode(0)), LogFormat::V2).unwrap();
    for (i, f) in facts.iter().enumerate() {
        w.append(i as u64, f).unwrap();
    }
    let (got, end) = read_all(&w.finish().unwrap());
    assert_eq!(end.unwrap(), None);
    assert_eq!(got.into_iter().map(|r| r.fact).collect::<Vec<_>>(), facts);
}

/// Seeking: a reader opened at any record's position (as the index and `at` open them) reads
/// from that record on, also past several epochs of the block-hash table.
#[test]
fn v2_a_reader_opened_at_any_position_reads_on_from_there() {
    use handoff_ledger::events::{LogFormat, RunLayout, SegmentReader};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("decode-0.hlog");
    let mut w = StreamWriter::create(&path, &header(3, WorkerId::decode(0))).unwrap();
    let mut records = Vec::new();
    // 600k distinct hashes: over two table epochs.
    for i in 0..6_000u64 {
        let blocks: Vec<u64> =
            (0..100).map(|k| (i * 100 + k + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
        let fact = if i % 4 == 3 {
            Fact::KvRemoved { blocks: blocks[..50].to_vec() }
        } else {
            Fact::KvStored { parent: Some(i), blocks }
        };
        w.append(i, &fact).unwrap();
        records.push(fact);
    }
    w.finish().unwrap();
    let layout = RunLayout::open(&path).unwrap();
    let seg = &layout.segments[0];
    assert_eq!(seg.format, LogFormat::V2);
    let mut positions = Vec::new();
    let mut r = SegmentReader::open_at(seg, seg.start_position(), vec![0]).unwrap();
    while r.next_record().unwrap().is_some() {
        positions.push(r.last_record_offset().unwrap());
    }
    assert_eq!(positions.len(), records.len());
    for i in [0, 1, 777, 2_999, 3_000, 4_321, 5_998, 5_999] {
        let mut r = SegmentReader::open_at(seg, positions[i], vec![i as u64]).unwrap();
        let (_, rec) = r.next_record().unwrap().unwrap();
        assert_eq!((rec.seq, &rec.fact), (i as u64, &records[i]), "opened at record {i}");
        assert_eq!(r.last_record_offset(), Some(positions[i]));
        if let Some(next) = records.get(i + 1) {
            assert_eq!(&r.next_record().unwrap().unwrap().1.fact, next);
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 512, ..Default::default() })]
    /// Any damage to a v2 stream — a few bytes changed anywhere, then perhaps cut short — reads
    /// as records and then a clean end, a torn tail or an error naming the file: never a panic,
    /// and never records that were not written (a record returned is one of the originals, in
    /// order).
    #[test]
    fn v2_random_damage_never_panics_nor_invents_records(
        flips in proptest::collection::vec((proptest::prelude::any::<usize>(), 1u8..=255), 1..4),
        cut in proptest::prelude::any::<Option<usize>>(),
    ) {
        let (bytes, records, _) = sample_v2(37);
        let mut bad = bytes.clone();
        for (at, mask) in flips {
            let i = at % bad.len();
            bad[i] ^= mask;
        }
        if let Some(c) = cut {
            bad.truncate(c % (bad.len() + 1));
        }
        let (got, outcome) = read_all(&bad);
        if let Err(e) = &outcome {
            proptest::prop_assert!(e.to_string().contains("mem.hlog"), "{}", e);
        }
        proptest::prop_assert!(got.len() <= records.len());
        proptest::prop_assert_eq!(&got[..], &records[..got.len()]);
    }
}
