//! The trace reader streams: live heap while reading 60,000 generated lines stays at what one
//! line needs, not what the trace needs. Its own test binary, because it installs a counting
//! global allocator and other tests running in parallel would disturb the count.

use handoff_ledger::adapters::replay::trace::{TraceFormat, TraceOptions, TraceReader};
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{BufReader, Read};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(now, Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Generates a Mooncake trace on the fly, never holding more than one line.
struct Generated {
    lines: u64,
    next: u64,
    pending: Vec<u8>,
    at: usize,
}

impl Read for Generated {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.at == self.pending.len() {
            if self.next == self.lines {
                return Ok(0);
            }
            let i = self.next;
            self.next += 1;
            let blocks: Vec<String> = (0..24).map(|b| (i * 31 + b).to_string()).collect();
            self.pending = format!(
                "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": 100, \"hash_ids\": [{}]}}\n",
                i * 10,
                24 * 512,
                blocks.join(", ")
            )
            .into_bytes();
            self.at = 0;
        }
        let n = out.len().min(self.pending.len() - self.at);
        out[..n].copy_from_slice(&self.pending[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

fn peak_while_reading(lines: u64) -> (u64, usize) {
    let src = BufReader::new(Generated { lines, next: 0, pending: Vec::new(), at: 0 });
    let reader = TraceReader::new(
        src,
        "generated.jsonl",
        TraceOptions { format: Some(TraceFormat::Mooncake), speedup: 1.0 },
    )
    .expect("valid options");
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let mut n = 0u64;
    for r in reader {
        let r = r.expect("generated lines are valid");
        // Convert too, as the replay will, and drop it.
        let req = r.to_request();
        assert_eq!(req.trace_blocks.len(), 24);
        n += 1;
    }
    (n, PEAK.load(Ordering::Relaxed) - base)
}

#[test]
fn memory_is_flat_in_trace_length() {
    let (n_small, peak_small) = peak_while_reading(2_000);
    let (n_large, peak_large) = peak_while_reading(60_000);
    eprintln!("peak extra heap: {peak_small} B for {n_small} lines, {peak_large} B for {n_large} lines");
    assert_eq!((n_small, n_large), (2_000, 60_000));
    // One line of this trace is ~200 B; 60k lines would be ~12 MB if retained.
    assert!(peak_large < 64 * 1024, "peak {peak_large} B");
    assert!(peak_large <= peak_small + 4096, "grew with length: {peak_small} → {peak_large}");
}
