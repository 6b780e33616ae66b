//! Trace readers: both formats, aliases, speedup, conversion to engine requests, and the exact
//! `FILE:LINE: reason` of every kind of bad input.

use handoff_ledger::adapters::replay::trace::{
    TraceError, TraceFormat, TraceOptions, TraceReader, TraceRequest,
};
use handoff_ledger::ids::RequestId;
use handoff_ledger::schedulers::request::{Request, TRACE_BLOCK_SIZE};
use std::io::{Cursor, Read};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/traces").join(name)
}

fn read_all(path: &Path, options: TraceOptions) -> Result<Vec<TraceRequest>, TraceError> {
    TraceReader::open(path, options)?.collect()
}

/// Reads inline text as `inline.jsonl` (or `.csv`) and returns the first error's Display.
fn inline_error(text: &str, format: TraceFormat) -> String {
    let name = if format == TraceFormat::Mooncake { "inline.jsonl" } else { "inline.csv" };
    let reader = TraceReader::new(
        Cursor::new(text.to_owned()),
        name,
        TraceOptions { format: Some(format), speedup: 1.0 },
    )
    .expect("valid options");
    match reader.collect::<Result<Vec<_>, _>>() {
        Ok(v) => panic!("expected an error, read {} requests", v.len()),
        Err(e) => e.to_string(),
    }
}

fn mooncake_error(text: &str) -> String {
    inline_error(text, TraceFormat::Mooncake)
}

#[test]
fn mooncake_fixture_reads_like_the_source_lines() {
    let path = fixture("mooncake-200.jsonl");
    let reqs = read_all(&path, TraceOptions::default()).unwrap();
    assert_eq!(reqs.len(), 200);
    // Cross-check every request against an independent parse of the same line.
    let text = std::fs::read_to_string(&path).unwrap();
    for (i, (line, r)) in text.lines().zip(&reqs).enumerate() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(r.index, i as u64);
        assert_eq!(r.line, i + 1);
        assert_eq!(r.arrival_ms, v["timestamp"].as_f64().unwrap());
        assert_eq!(r.input_tokens as u64, v["input_length"].as_u64().unwrap());
        assert_eq!(r.output_tokens as u64, v["output_length"].as_u64().unwrap());
        let ids: Vec<u64> = v["hash_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        assert_eq!(r.hash_ids.as_deref(), Some(ids.as_slice()));
        assert_eq!(r.session_id, None);
        assert_eq!(r.delay_ms, None);
    }
    assert!(reqs.windows(2).all(|p| p[0].arrival_ms <= p[1].arrival_ms));
}

#[test]
fn aliases_sessions_extra_fields_and_blank_lines() {
    let reqs = read_all(&fixture("aliases.jsonl"), TraceOptions::default()).unwrap();
    assert_eq!(reqs.len(), 3);
    // Arrivals are relative to the first request (created_time 1000).
    assert_eq!(reqs[0].arrival_ms, 0.0);
    assert_eq!((reqs[0].input_tokens, reqs[0].output_tokens), (600, 20));
    assert_eq!(reqs[0].hash_ids, Some(vec![5, 6]));
    assert_eq!(reqs[0].session_id.as_deref(), Some("chat-a"));
    assert_eq!(reqs[0].line, 1);
    // Line 2 is blank: the second request is on line 3.
    assert_eq!(reqs[1].line, 3);
    assert_eq!(reqs[1].index, 1);
    assert_eq!(reqs[1].arrival_ms, 500.5);
    assert_eq!(reqs[1].session_id.as_deref(), Some("17"));
    assert_eq!(reqs[1].delay_ms, Some(250.0));
    assert_eq!(reqs[2].arrival_ms, 3000.0);
    assert_eq!((reqs[2].input_tokens, reqs[2].output_tokens), (100, 9));
    assert_eq!(reqs[2].hash_ids, None);
}

#[test]
fn speedup_divides_arrivals_and_delays() {
    let opts = TraceOptions { format: None, speedup: 4.0 };
    let reqs = read_all(&fixture("aliases.jsonl"), opts).unwrap();
    assert_eq!(reqs[1].arrival_ms, 500.5 / 4.0);
    assert_eq!(reqs[1].delay_ms, Some(62.5));
    assert_eq!(reqs[2].arrival_ms, 750.0);
    assert_eq!(reqs[2].arrival_ns(), 750_000_000);
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let e = TraceReader::open(fixture("aliases.jsonl"), TraceOptions { format: None, speedup: bad })
            .err()
            .unwrap();
        assert!(e.to_string().contains("speedup ratio must be a finite number > 0"), "{e}");
        assert_eq!(e.line, 0);
    }
}

#[test]
fn azure_csv_is_relative_to_the_first_row_with_unique_prompts() {
    let reqs = read_all(&fixture("azure-sample.csv"), TraceOptions::default()).unwrap();
    assert_eq!(reqs.len(), 8);
    let ms: Vec<f64> = reqs.iter().map(|r| r.arrival_ms).collect();
    // 18:15:46.6805900 is the origin.
    let expect = [0.0, 4314.579, 4319.41, 4569.41, 6442.8667, 6442.8667, 11319.4101, 14819.41];
    for (got, want) in ms.iter().zip(expect) {
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }
    assert_eq!((reqs[0].input_tokens, reqs[0].output_tokens), (374, 44));
    assert_eq!(reqs[5].line, 8, "the blank line 7 is counted");
    assert!(reqs.iter().all(|r| r.hash_ids.is_none()));
    // No two requests share a prompt block.
    let mut seen = std::collections::BTreeSet::new();
    for r in &reqs {
        for h in r.to_request().prompt_block_hashes(16) {
            assert!(seen.insert(h), "request {} reuses a block", r.index);
        }
    }
}

#[test]
fn formats_detected_from_extension_and_content() {
    let j = TraceReader::open(fixture("mooncake-200.jsonl"), TraceOptions::default()).unwrap();
    assert_eq!(j.format(), TraceFormat::Mooncake);
    let c = TraceReader::open(fixture("azure-sample.csv"), TraceOptions::default()).unwrap();
    assert_eq!(c.format(), TraceFormat::AzureCsv);
    // No extension: sniffed from the first line.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("trace");
    std::fs::copy(fixture("azure-sample.csv"), &p).unwrap();
    assert_eq!(TraceReader::open(&p, TraceOptions::default()).unwrap().format(), TraceFormat::AzureCsv);
    std::fs::copy(fixture("aliases.jsonl"), &p).unwrap();
    let r = TraceReader::open(&p, TraceOptions::default()).unwrap();
    assert_eq!(r.format(), TraceFormat::Mooncake);
    assert_eq!(r.count(), 3, "sniffing must not consume the first line");
    std::fs::write(&p, "hello,world\n").unwrap();
    let e = TraceReader::open(&p, TraceOptions::default()).err().unwrap();
    assert!(e.to_string().starts_with(&format!("{}: cannot tell the trace format", p.display())), "{e}");
    // An explicit format wins over the extension.
    let e = TraceReader::open(
        fixture("aliases.jsonl"),
        TraceOptions { format: Some(TraceFormat::AzureCsv), speedup: 1.0 },
    )
    .unwrap()
    .next()
    .unwrap()
    .unwrap_err();
    assert_eq!(e.line, 1);
    assert!(e.reason.contains("CSV header lacks column `TIMESTAMP`"), "{e}");
    assert_eq!("mooncake".parse::<TraceFormat>(), Ok(TraceFormat::Mooncake));
    assert_eq!("azure-csv".parse::<TraceFormat>(), Ok(TraceFormat::AzureCsv));
    assert!("parquet".parse::<TraceFormat>().is_err());
}

#[test]
fn missing_file_names_the_file() {
    let e = TraceReader::open("/nonexistent/t.jsonl", TraceOptions::default()).err().unwrap();
    assert!(e.to_string().starts_with("/nonexistent/t.jsonl: cannot open:"), "{e}");
}

#[test]
fn malformed_fixtures_name_file_and_line() {
    let cases = [
        ("malformed-json.jsonl", 4, "bad JSON: "),
        ("unsorted.jsonl", 3, "timestamp 2999 ms is earlier than the previous request's 3000 ms; the trace must be sorted by timestamp"),
        ("hash-mismatch.jsonl", 2, "hash_ids has 2 ids but input length 1025 needs ceil(1025/512) = 3"),
        ("azure-bad-timestamp.csv", 3, "TIMESTAMP `2023-11-16T18:15:47` is not a datetime like 2023-11-16 18:15:46.6805900"),
    ];
    for (name, line, reason) in cases {
        let path = fixture(name);
        let e = read_all(&path, TraceOptions::default()).unwrap_err();
        let shown = e.to_string();
        let prefix = format!("{}:{line}: {reason}", path.display());
        assert!(shown.starts_with(&prefix), "{name}:\n got  {shown}\n want {prefix}…");
        assert_eq!((e.line, e.path.as_path()), (line, path.as_path()));
    }
}

#[test]
fn requests_before_the_bad_line_are_yielded_then_the_stream_ends() {
    let mut r = TraceReader::open(fixture("malformed-json.jsonl"), TraceOptions::default()).unwrap();
    assert_eq!(r.next().unwrap().unwrap().line, 1);
    assert_eq!(r.next().unwrap().unwrap().line, 2);
    assert_eq!(r.next().unwrap().unwrap_err().line, 4);
    assert!(r.next().is_none());
}

#[test]
fn every_bad_field_gives_an_exact_reason() {
    let cases: &[(&str, &str)] = &[
        (
            r#"{"input_length": 10, "output_length": 1}"#,
            "inline.jsonl:1: missing field `timestamp` (or `created_time`)",
        ),
        (
            r#"{"timestamp": 0, "output_length": 1}"#,
            "inline.jsonl:1: missing field `input_length` (or `input_tokens`)",
        ),
        (
            r#"{"timestamp": 0, "input_length": 5}"#,
            "inline.jsonl:1: missing field `output_length` (or `output_tokens`)",
        ),
        (
            r#"{"timestamp": 0, "input_length": 0, "output_length": 1}"#,
            "inline.jsonl:1: input length must be > 0",
        ),
        (
            r#"{"timestamp": 0, "input_length": 4, "output_length": 0}"#,
            "inline.jsonl:1: output length must be > 0",
        ),
        (
            r#"{"timestamp": 0, "input_length": -4, "output_length": 1}"#,
            "inline.jsonl:1: input_length must be a non-negative integer, got -4",
        ),
        (
            r#"{"timestamp": 0, "input_length": 4.5, "output_length": 1}"#,
            "inline.jsonl:1: input_length must be a non-negative integer, got 4.5",
        ),
        (
            r#"{"timestamp": 0, "input_length": 4, "output_length": 5000000000}"#,
            "inline.jsonl:1: output_length 5000000000 is too large (max 4294967295)",
        ),
        (
            r#"{"timestamp": -3, "input_length": 4, "output_length": 1}"#,
            "inline.jsonl:1: timestamp must be a number of ms >= 0, got -3",
        ),
        (
            r#"{"timestamp": 0, "input_length": 4, "output_length": 1, "delay": -1}"#,
            "inline.jsonl:1: delay must be a number of ms >= 0, got -1",
        ),
        (
            r#"{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": []}"#,
            "inline.jsonl:1: hash_ids has 0 ids but input length 4 needs ceil(4/512) = 1",
        ),
        (
            r#"{"timestamp": 0, "created_time": 1, "input_length": 4, "output_length": 1}"#,
            "inline.jsonl:1: bad JSON: duplicate field `timestamp`",
        ),
        (r#"[1, 2]"#, "inline.jsonl:1: bad JSON: expected one JSON object per line"),
        (r#"{"timestamp": 0,"#, "inline.jsonl:1: bad JSON: EOF while parsing"),
        (
            "\n\n{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [-1]}",
            "inline.jsonl:3: bad JSON: invalid value: integer `-1`",
        ),
    ];
    for (text, want) in cases {
        let got = mooncake_error(text);
        assert!(got.starts_with(want), "input {text}\n got  {got}\n want {want}…");
    }
}

#[test]
fn azure_bad_rows_give_exact_reasons() {
    let h = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
    let cases: &[(String, &str)] = &[
        (
            format!("{h}2023-11-16 18:15:46.1,-5,3\n"),
            "inline.csv:2: ContextTokens must be a non-negative integer, got `-5`",
        ),
        (
            format!("{h}2023-11-16 18:15:46.1,5\n"),
            "inline.csv:2: row has 2 columns, missing `GeneratedTokens`",
        ),
        (format!("{h}2023-11-16 18:15:46.1,0,3\n"), "inline.csv:2: input length must be > 0"),
        (format!("{h}2023-11-16 18:15:46.1,5,3\n2023-11-16 18:15:45.9,5,3\n"), "inline.csv:3: timestamp"),
        (
            "TIME,ContextTokens,GeneratedTokens\n".to_owned(),
            "inline.csv:1: CSV header lacks column `TIMESTAMP`",
        ),
        ("\n\n".to_owned(), "inline.csv:2: missing CSV header"),
    ];
    for (text, want) in cases {
        let got = inline_error(text, TraceFormat::AzureCsv);
        assert!(got.starts_with(want), "input {text:?}\n got  {got}\n want {want}…");
    }
    // Columns in another order, another case, with an extra column.
    let text = "id,generatedtokens,timestamp,contexttokens\n1,7,2023-11-16 18:15:46.5,300\n2,8,2023-11-16 18:15:47,301\n";
    let r: Vec<_> = TraceReader::new(
        Cursor::new(text),
        "x.csv",
        TraceOptions { format: Some(TraceFormat::AzureCsv), speedup: 2.0 },
    )
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap();
    assert_eq!((r[1].input_tokens, r[1].output_tokens), (301, 8));
    assert_eq!(r[1].arrival_ms, 250.0);
}

#[test]
fn conversion_to_engine_requests() {
    let reqs = read_all(&fixture("mooncake-200.jsonl"), TraceOptions::default()).unwrap();
    let a = reqs[0].to_request();
    assert_eq!(a.id, RequestId(0));
    assert_eq!(a.input_tokens, reqs[0].input_tokens);
    assert_eq!(a.trace_block_size, TRACE_BLOCK_SIZE);
    assert_eq!(&a.trace_blocks[..], reqs[0].hash_ids.as_deref().unwrap());
    assert_eq!(reqs[5].to_request().arrival_ns, (reqs[5].arrival_ms * 1e6) as u64);
    // Requests 0 and 1 share hash id 0 (the first 512 tokens): equal first engine blocks.
    let b = reqs[1].to_request();
    let (ha, hb) = (a.prompt_block_hashes(64), b.prompt_block_hashes(64));
    assert_eq!(ha[..8], hb[..8]);
    assert_ne!(ha[8], hb[8]);
    // Without hash ids: a unique prompt with the same id.
    let unique = TraceRequest { hash_ids: None, ..reqs[0].clone() }.to_request();
    assert_eq!(unique, Request::unique(RequestId(0), a.input_tokens, a.output_tokens, a.arrival_ns));
}

/// The full public trace, streamed. Skipped (with a note) where `../shared` is absent.
#[test]
fn full_mooncake_conversation_trace_streams() {
    let path = std::env::var_os("HANDOFF_MOONCAKE_TRACE").map(PathBuf::from).unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces/mooncake/conversation_trace.jsonl")
    });
    if !path.exists() {
        eprintln!("skipping: {} not found (set HANDOFF_MOONCAKE_TRACE)", path.display());
        return;
    }
    let started = std::time::Instant::now();
    let (mut n, mut input, mut output) = (0u64, 0u64, 0u64);
    let mut last = 0.0f64;
    for r in TraceReader::open(&path, TraceOptions::default()).unwrap() {
        let r = r.unwrap();
        assert!(r.arrival_ms >= last);
        last = r.arrival_ms;
        n += 1;
        input += u64::from(r.input_tokens);
        output += u64::from(r.output_tokens);
    }
    let elapsed = started.elapsed();
    eprintln!("full trace: {n} requests in {elapsed:?}, last arrival {last} ms");
    assert_eq!(n, 12031);
    let mean_input = input as f64 / n as f64;
    assert!((mean_input - 12035.06).abs() < 0.01, "mean input {mean_input}");
    assert!((output as f64 / n as f64 - 343.0).abs() < 1.0);
    // About 59 minutes.
    assert!((last / 60_000.0 - 59.0).abs() < 1.0, "last arrival {last} ms");
}

#[test]
fn json_errors_give_the_column_not_a_confusing_inner_line() {
    let got =
        mooncake_error(r#"{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, "x"]}"#);
    assert_eq!(got, "inline.jsonl:1: bad JSON: invalid type: string \"x\", expected u64 (column 78)");
}

#[test]
fn crlf_line_ends_and_a_byte_order_mark_are_accepted() {
    let text = "\u{feff}{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\r\n\r\n{\"timestamp\": 2, \"input_length\": 6, \"output_length\": 1}\r\n";
    let r: Vec<_> = TraceReader::new(Cursor::new(text), "w.jsonl", TraceOptions::default())
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!((r.len(), r[1].line, r[1].input_tokens), (2, 3, 6));
    let csv = "\u{feff}TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.5,300,7\r\n";
    let r: Vec<_> = TraceReader::new(Cursor::new(csv), "w.csv", TraceOptions::default())
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!((r.len(), r[0].input_tokens, r[0].output_tokens), (1, 300, 7));
}

#[test]
fn an_overlong_line_is_an_error_not_an_allocation() {
    use handoff_ledger::adapters::replay::trace::MAX_LINE_BYTES;
    // A "line" of MAX + 10 bytes with no newline, produced lazily.
    let body = std::io::repeat(b' ').take(MAX_LINE_BYTES as u64 + 10);
    let src = std::io::BufReader::new(std::io::Read::chain(
        &b"{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\n"[..],
        body,
    ));
    let mut r = TraceReader::new(
        src,
        "big.jsonl",
        TraceOptions { format: Some(TraceFormat::Mooncake), speedup: 1.0 },
    )
    .unwrap();
    assert!(r.next().unwrap().is_ok());
    let e = r.next().unwrap().unwrap_err();
    assert_eq!(e.to_string(), format!("big.jsonl:2: line is longer than {MAX_LINE_BYTES} bytes"));
    assert!(r.next().is_none());
}

/// Hostile input, stable: byte-mutated traces and configurations (flips, insertions, deletions,
/// a cut) are read without a panic, and whatever fails names the file (and, for a trace, the
/// line; for a configuration, the line and column or the key).
mod mutated {
    use super::fixture;
    use handoff_ledger::adapters::replay::config::ReplayConfig;
    use handoff_ledger::adapters::replay::trace::{TraceOptions, TraceReader};
    use proptest::prelude::*;
    use std::io::Cursor;

    #[derive(Clone, Debug)]
    enum Mutation {
        Set(usize, u8),
        Insert(usize, u8),
        Delete(usize),
        Cut(usize),
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        // Bytes that matter to the parsers, and any byte at all.
        let byte = prop_oneof![
            Just(b'"'),
            Just(b','),
            Just(b'\n'),
            Just(b'{'),
            Just(b'}'),
            Just(b'-'),
            Just(b'9'),
            Just(0xff),
            any::<u8>()
        ];
        prop_oneof![
            (any::<usize>(), byte.clone()).prop_map(|(i, b)| Mutation::Set(i, b)),
            (any::<usize>(), byte).prop_map(|(i, b)| Mutation::Insert(i, b)),
            any::<usize>().prop_map(Mutation::Delete),
            any::<usize>().prop_map(Mutation::Cut),
        ]
    }

    fn mutate(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
        for m in mutations {
            let n = bytes.len().max(1);
            match *m {
                Mutation::Set(i, b) if !bytes.is_empty() => bytes[i % n] = b,
                Mutation::Insert(i, b) => bytes.insert(i % (bytes.len() + 1), b),
                Mutation::Delete(i) if !bytes.is_empty() => {
                    bytes.remove(i % n);
                }
                Mutation::Cut(i) => bytes.truncate(i % (bytes.len() + 1)),
                _ => {}
            }
        }
        bytes
    }

    fn lines(name: &str, keep: usize) -> Vec<u8> {
        let text = std::fs::read_to_string(fixture(name)).unwrap();
        text.lines().take(keep).flat_map(|l| format!("{l}\n").into_bytes()).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        #[test]
        fn a_mutated_trace_reads_or_fails_naming_file_and_line(
            csv in any::<bool>(),
            mutations in prop::collection::vec(mutation(), 1..8),
        ) {
            let (base, name) =
                if csv { (lines("azure-sample.csv", 30), "m.csv") } else { (lines("mooncake-200.jsonl", 30), "m.jsonl") };
            let bytes = mutate(base, &mutations);
            let options = TraceOptions { format: None, speedup: 1.0 };
            match TraceReader::new(Cursor::new(bytes), name, options) {
                Err(e) => prop_assert!(e.to_string().starts_with(name), "{e}"),
                Ok(reader) => {
                    for item in reader {
                        if let Err(e) = item {
                            let text = e.to_string();
                            prop_assert!(text.starts_with(&format!("{name}:")), "{text}");
                            break;
                        }
                    }
                }
            }
        }

        #[test]
        fn a_mutated_configuration_parses_or_fails_naming_file_or_key(
            mutations in prop::collection::vec(mutation(), 1..6),
        ) {
            let base = std::fs::read(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/configs/cascade-faults.json"),
            )
            .unwrap();
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("c.json");
            std::fs::write(&path, mutate(base, &mutations)).unwrap();
            match ReplayConfig::from_file(&path) {
                Err(e) => prop_assert!(e.to_string().contains("c.json"), "{e}"),
                Ok(cfg) => {
                    if let Err(e) = cfg.validate() {
                        prop_assert!(e.to_string().starts_with("invalid configuration: "), "{e}");
                    }
                }
            }
        }
    }
}
