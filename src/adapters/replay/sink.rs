//! Where the replay's facts go: the run's streams and the metrics fold, on a second thread.
//!
//! Encoding, checksumming and writing a record, and folding it into the report, cost about as
//! much as simulating the step that produced it. The simulation is sequential, but these are
//! not part of it: nothing the event loop decides depends on them. So the loop hands its facts,
//! in emission order, to a writer thread in batches, and the writer appends and folds them in
//! exactly that order. Logs and report are byte-for-byte what a single thread would produce.
//!
//! A worker that joins mid-run (planned scaling, the planner) gets its stream declared through
//! the same hand-over, ahead of the batch that carries its first record, so the writer creates
//! the file and the fold registers the stream before either sees a fact of it.
//!
//! The hand-over is bounded (a few batches in flight), so a slow disk slows the loop down
//! instead of buffering the run in memory. The first error the writer meets stops it; the loop
//! sees the closed channel at its next hand-over and reports that error.

use super::engine::ReplayError;
use crate::events::{Fact, LogError, Record, RunWriter, StreamHeader};
use crate::ids::WorkerId;
use crate::projections::metrics::{MetricsFold, MetricsReport};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::JoinHandle;

/// Facts per hand-over: large enough that the channel's cost per fact is negligible. Each
/// hand-over usually wakes the writer (it keeps up, so it waits in `recv`), which costs the
/// loop a syscall: on the full Mooncake replay (about 4.6 M facts), 16384 took 6% off the wall
/// time of 4096, and 32768 was slower again (the batches stop fitting the cache).
const BATCH_FACTS: usize = 16384;
/// Batches in flight between the loop and the writer (the queue's limit).
const BATCHES_IN_FLIGHT: usize = 4;
/// The writer flushes every stream at least this often (wall time): a replay killed mid-run
/// loses at most this much of its log, and what did reach the disk ends at a record boundary
/// or in one torn record.
const FLUSH_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

type Batch = Vec<(WorkerId, u64, Fact)>;

/// One hand-over: streams that joined since the last one (declared before any fact of the
/// batch is written), then the facts in emission order.
struct Handover {
    streams: Vec<StreamHeader>,
    facts: Batch,
    /// The run ended cleanly with these facts: the writer closes the run with end markers.
    /// (A run abandoned on an error hands over its rest without, so it reads as incomplete.)
    end: bool,
}

/// The loop's end of the hand-over.
pub struct FactSink {
    batch: Batch,
    /// Streams declared since the last hand-over (empty, and never allocated, in a run whose
    /// workers are all known up front).
    streams: Vec<StreamHeader>,
    to_writer: Option<SyncSender<Handover>>,
    /// Emptied batches coming back, so steady state allocates nothing.
    recycled: Receiver<Batch>,
    writer: Option<JoinHandle<Result<MetricsReport, LogError>>>,
    /// When the last hand-over left: a batch that fills slowly (a small or quiet run) is still
    /// handed over within about `FLUSH_EVERY`, so the writer can put it on disk.
    handed_over_at: std::time::Instant,
}

impl FactSink {
    /// Starts the writer thread, which owns `out` and `metrics` until [`FactSink::finish`].
    pub fn start(out: RunWriter, metrics: MetricsFold) -> std::io::Result<Self> {
        let (to_writer, from_loop) = sync_channel::<Handover>(BATCHES_IN_FLIGHT);
        // Room for every batch in flight and then some; the writer returns them with try_send, so
        // a full return channel only means the loop has spares enough and the batch is dropped.
        let (to_loop, recycled) = sync_channel::<Batch>(BATCHES_IN_FLIGHT + 2);
        let writer = std::thread::Builder::new()
            .name("handoff-log-writer".into())
            .spawn(move || write_batches(out, metrics, from_loop, to_loop))?;
        Ok(FactSink {
            batch: Vec::with_capacity(BATCH_FACTS),
            streams: Vec::new(),
            to_writer: Some(to_writer),
            recycled,
            writer: Some(writer),
            handed_over_at: std::time::Instant::now(),
        })
    }

    /// Queues one fact of `worker`'s stream.
    #[inline]
    pub fn push(&mut self, worker: WorkerId, at_ns: u64, fact: Fact) -> Result<(), ReplayError> {
        self.batch.push((worker, at_ns, fact));
        // The clock is read once per 256 facts, not per fact.
        let due = self.batch.len() % 256 == 0 && self.handed_over_at.elapsed() >= FLUSH_EVERY;
        if self.batch.len() >= BATCH_FACTS || due {
            self.hand_over()?;
        }
        Ok(())
    }

    /// A worker joined: its stream is created (and folded) from `header` before the first fact
    /// pushed for it after this call.
    pub fn add_stream(&mut self, header: StreamHeader) {
        self.streams.push(header);
    }

    fn hand_over(&mut self) -> Result<(), ReplayError> {
        self.send(false)
    }

    fn send(&mut self, end: bool) -> Result<(), ReplayError> {
        self.handed_over_at = std::time::Instant::now();
        let next = self.recycled.try_recv().unwrap_or_else(|_| Vec::with_capacity(BATCH_FACTS));
        let facts = std::mem::replace(&mut self.batch, next);
        let handover = Handover { streams: std::mem::take(&mut self.streams), facts, end };
        let sent = self.to_writer.as_ref().is_some_and(|tx| tx.send(handover).is_ok());
        if !sent {
            // The writer stopped: its error says why.
            return Err(match self.join() {
                Err(e) => e,
                Ok(_) => ReplayError::Engine("the log writer stopped before the run ended".into()),
            });
        }
        Ok(())
    }

    fn join(&mut self) -> Result<MetricsReport, ReplayError> {
        self.to_writer = None;
        let Some(h) = self.writer.take() else {
            return Err(ReplayError::Engine("the log writer already finished".into()));
        };
        match h.join() {
            Ok(r) => r.map_err(ReplayError::Log),
            Err(_) => Err(ReplayError::Engine("the log writer thread panicked".into())),
        }
    }

    /// Hands over what is left, waits for the writer to flush every stream, and returns the
    /// report folded from exactly the facts written.
    pub fn finish(mut self) -> Result<MetricsReport, ReplayError> {
        self.send(true)?;
        self.join()
    }
}

impl Drop for FactSink {
    fn drop(&mut self) {
        // An abandoned run (an error in the loop) still gets what it wrote flushed, the facts
        // not yet handed over included: a run that stopped on an error keeps its log.
        if !self.batch.is_empty() || !self.streams.is_empty() {
            // Without the end flag: the writer flushes what it has and writes no end marker.
            let _ = self.send(false);
        }
        self.to_writer = None;
        if let Some(h) = self.writer.take() {
            let _ = h.join();
        }
    }
}

fn write_batches(
    mut out: RunWriter,
    mut metrics: MetricsFold,
    from_loop: Receiver<Handover>,
    to_loop: SyncSender<Batch>,
) -> Result<MetricsReport, LogError> {
    let mut flushed_at = std::time::Instant::now();
    let mut clean = false;
    while let Ok(Handover { streams, facts: mut batch, end }) = from_loop.recv() {
        for header in streams {
            metrics.add_stream(&header);
            out.declare(header)?;
        }
        for (worker, at_ns, fact) in batch.drain(..) {
            let seq = out.append(worker, at_ns, &fact)?;
            metrics.apply(worker, &Record { seq, at_ns, fact });
        }
        // The loop may have enough spares already; then this one is simply dropped.
        let _ = to_loop.try_send(batch);
        if end {
            clean = true;
            break;
        }
        if flushed_at.elapsed() >= FLUSH_EVERY {
            out.flush_all()?;
            flushed_at = std::time::Instant::now();
        }
    }
    if clean {
        out.close()?;
    } else {
        out.finish()?;
    }
    Ok(metrics.report())
}
