//! Log append and sequential read throughput for small records, in memory and through a file,
//! in both stream formats (v1: a frame per record; v2: compressed blocks).
//!
//! `cargo bench --bench log -- --warm-up-time 1 --measurement-time 3`
//! Each workload is measured twice: once reported as records/s, once as bytes/s.
//!
//! On a shared machine wall time counts the time other processes hold the core. Set
//! `LOG_BENCH_CPU_TIME=1` to measure this thread's CPU time instead (Linux,
//! `/proc/thread-self/schedstat`), i.e. the one-core cost.

use criterion::measurement::{Measurement, ValueFormatter, WallTime};
use criterion::{black_box, Criterion, Throughput};
use handoff_ledger::events::{
    EngineShape, Fact, KvDelta, LogFormat, StreamHeader, StreamReader, StreamWriter,
};
use handoff_ledger::ids::{Backend, ClockDomain, HandoffPolicy, RequestId, WorkerId};
use std::io::Cursor;

const RECORDS: u64 = 100_000;

fn header() -> StreamHeader {
    StreamHeader {
        run_id: uuid::Uuid::from_u128(1),
        worker: WorkerId::prefill(0),
        backend: Backend::Vllm,
        policy: HandoffPolicy::SourceFirst,
        clock: ClockDomain::Virtual,
        seed: 1,
        engine: EngineShape {
            total_blocks: 8192,
            block_size: 16,
            max_request_slots: 256,
            config_json: "{}".into(),
        },
    }
}

/// What an engine stream mostly holds: steps and queue events, with realistic magnitudes.
fn facts() -> Vec<(u64, Fact)> {
    (0..RECORDS)
        .map(|i| {
            let at = 1_000_000_000 + i * 25_000;
            let f = if i % 2 == 0 {
                Fact::StepExecuted {
                    prefill_tokens: (i % 2048) as u32,
                    decode_tokens: 64 + (i % 64) as u32,
                    batch_size: 64 + (i % 64) as u32,
                    duration_ns: 20_000_000 + i % 1_000_000,
                    kv: KvDelta { active: 3, free: -2, cached_free: -1, ..KvDelta::ZERO },
                }
            } else {
                Fact::RequestQueued { request: RequestId(i) }
            };
            (at, f)
        })
        .collect()
}

fn write_to_vec(facts: &[(u64, Fact)], capacity: usize, format: LogFormat) -> Vec<u8> {
    let mut w = StreamWriter::with_format(Vec::with_capacity(capacity), &header(), format).unwrap();
    for (at, f) in facts {
        w.append(*at, f).unwrap();
    }
    w.finish().unwrap()
}

fn read_all<R: std::io::Read>(r: &mut StreamReader<R>) -> u64 {
    let mut n = 0u64;
    while let Some(rec) = r.next_record().unwrap() {
        n += rec.at_ns & 1;
    }
    n
}

/// CPU time consumed by the calling thread, in nanoseconds (reported in criterion's time units).
struct ThreadCpuTime {
    wall: WallTime,
}

fn thread_cpu_ns() -> u64 {
    // First field: time spent on the CPU, in nanoseconds.
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|f| f.parse().ok()))
        .expect("/proc/thread-self/schedstat (Linux only)")
}

impl Measurement for ThreadCpuTime {
    type Intermediate = u64;
    type Value = u64;
    fn start(&self) -> u64 {
        thread_cpu_ns()
    }
    fn end(&self, start: u64) -> u64 {
        thread_cpu_ns().saturating_sub(start)
    }
    fn add(&self, a: &u64, b: &u64) -> u64 {
        a + b
    }
    fn zero(&self) -> u64 {
        0
    }
    fn to_f64(&self, v: &u64) -> f64 {
        *v as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        // Values are nanoseconds, exactly what the wall-time formatter scales.
        self.wall.formatter()
    }
}

fn bench<M: Measurement>(c: &mut Criterion<M>) {
    for format in [LogFormat::V1, LogFormat::V2] {
        bench_format(c, format);
    }
}

fn bench_format<M: Measurement>(c: &mut Criterion<M>, format: LogFormat) {
    let v = format.version();
    let facts = facts();
    let bytes = write_to_vec(&facts, 0, format);
    let total = bytes.len() as u64;
    eprintln!(
        "v{v}: {RECORDS} records, {total} bytes ({:.1} bytes/record incl. header)",
        total as f64 / RECORDS as f64
    );
    let tmp = tempfile::tempdir().unwrap();
    let read_path = tmp.path().join("read.hlog");
    std::fs::write(&read_path, &bytes).unwrap();
    let write_path = tmp.path().join("write.hlog");

    let views = [("records", Throughput::Elements(RECORDS)), ("bytes", Throughput::Bytes(total))];

    let mut g = c.benchmark_group(format!("log_append_v{v}"));
    for (name, t) in views.clone() {
        g.throughput(t);
        g.bench_function(format!("memory/{name}"), |b| {
            b.iter(|| black_box(write_to_vec(&facts, bytes.len(), format)))
        });
        g.bench_function(format!("file/{name}"), |b| {
            b.iter(|| {
                let mut w = StreamWriter::create_as(&write_path, &header(), format).unwrap();
                for (at, f) in &facts {
                    w.append(*at, f).unwrap();
                }
                black_box(w.finish().unwrap());
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group(format!("log_read_v{v}"));
    for (name, t) in views {
        g.throughput(t);
        g.bench_function(format!("memory/{name}"), |b| {
            b.iter(|| {
                let mut r = StreamReader::new(Cursor::new(bytes.as_slice()), "mem").unwrap();
                black_box(read_all(&mut r))
            })
        });
        g.bench_function(format!("file/{name}"), |b| {
            b.iter(|| {
                let mut r = StreamReader::open(&read_path).unwrap();
                black_box(read_all(&mut r))
            })
        });
    }
    g.finish();
}

fn main() {
    if std::env::var_os("LOG_BENCH_CPU_TIME").is_some() {
        eprintln!("measuring thread CPU time");
        let mut c =
            Criterion::default().with_measurement(ThreadCpuTime { wall: WallTime }).configure_from_args();
        bench(&mut c);
        c.final_summary();
    } else {
        let mut c = Criterion::default().configure_from_args();
        bench(&mut c);
        c.final_summary();
    }
}
