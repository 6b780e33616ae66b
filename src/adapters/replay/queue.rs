//! The replay's event queue: events ordered by `(time, rank)`.
//!
//! At one instant, step boundaries come first, in worker (lane) order — the starting workers in
//! worker order, then any that joined mid-run in join order; every other event follows, in
//! insertion order; last come step *starts*, in worker order: a worker that is free at `t`
//! starts its next step only once everything else due at `t` has been delivered, so requests
//! that arrive together are batched together (as the real schedulers take everything waiting
//! when a step begins). A step boundary due at `t` was always queued before `t` (a step lasts a
//! positive time), so it would precede anything queued *at* `t` in plain insertion order too;
//! the fixed worker order matters only against another boundary or a timer due at the same
//! nanosecond, and makes a boundary's place independent of when it was queued. That is what
//! lets the replay skip queuing a quiet worker's step boundaries one by one (see
//! `engine::quiet::QuietRun`): where a skipped boundary falls in this order is known without its
//! insertion number.
//!
//! One binary heap would do, but most events are of two kinds that a heap serves badly:
//! * a worker's next step boundary (one per busy worker, re-armed after every step: most of a
//!   run's events), and
//! * follow-ups due *now* (a command to apply, a message to deliver), pushed while handling an
//!   event at the current time.
//!
//! Steps get one lane per worker (at most one pending boundary each, kept as its time only:
//! the caller says how a lane's pop becomes an event); events due now go to a FIFO, which is
//! already in order because time never goes back and insertion numbers only grow. Everything
//! else (timers, transfers, arrivals) goes to the heap. `pop` takes the smallest head of the
//! three, so the order is exactly the one heap's order: same trace and seed, same log.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// Rank of an event that is not a step boundary: after every lane's rank (a lane's rank is
/// its index), then by insertion number.
const AFTER_LANES: u64 = 1 << 62;

/// A heap entry: the order key and the event's place in the slab. Sifting moves these 24
/// bytes, not the (larger) events.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    at_ns: u64,
    rank: u64,
    index: u32,
}

/// Ordered events with lanes for per-worker step boundaries.
pub struct EventQueue<E> {
    seq: u64,
    /// The time of the latest pop: pushes at this time go to the FIFO.
    now_ns: u64,
    heap: BinaryHeap<Reverse<Key>>,
    /// Heap events by index; freed places are reused, so it grows with events in flight.
    slab: Vec<Option<E>>,
    free: Vec<u32>,
    now_fifo: VecDeque<(u64, u64, E)>,
    /// Each lane's due time, `EMPTY` when the lane holds nothing: kept apart from the events
    /// so finding the earliest lane scans a few contiguous words.
    lane_at: Vec<u64>,
    lanes_used: usize,
    /// Each lane's pending step start, `EMPTY` when none (at most one per lane).
    start_at: Vec<u64>,
    starts_used: usize,
}

const EMPTY: u64 = u64::MAX;

impl<E> EventQueue<E> {
    pub fn new(lanes: usize) -> Self {
        EventQueue {
            seq: 0,
            now_ns: 0,
            heap: BinaryHeap::new(),
            slab: Vec::new(),
            free: Vec::new(),
            now_fifo: VecDeque::new(),
            lane_at: vec![EMPTY; lanes],
            lanes_used: 0,
            start_at: vec![EMPTY; lanes],
            starts_used: 0,
        }
    }

    /// Adds a lane (a worker that joined mid-run) and returns its number: ranked after every
    /// earlier lane, so boundaries of the same instant keep the order of the workers' slots.
    pub fn add_lane(&mut self) -> usize {
        self.lane_at.push(EMPTY);
        self.start_at.push(EMPTY);
        self.lane_at.len() - 1
    }

    /// Events waiting.
    pub fn len(&self) -> usize {
        self.heap.len() + self.now_fifo.len() + self.lanes_used + self.starts_used
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues `ev` at `at_ns` (not before the latest pop's time).
    pub fn push(&mut self, at_ns: u64, ev: E) {
        self.seq += 1;
        let at_ns = at_ns.max(self.now_ns);
        if at_ns == self.now_ns {
            self.now_fifo.push_back((at_ns, AFTER_LANES | self.seq, ev));
            return;
        }
        self.push_heap(at_ns, AFTER_LANES | self.seq, ev);
    }

    fn push_heap(&mut self, at_ns: u64, rank: u64, ev: E) {
        let index = match self.free.pop() {
            Some(i) => {
                self.slab[i as usize] = Some(ev);
                i
            }
            None => {
                self.slab.push(Some(ev));
                (self.slab.len() - 1) as u32
            }
        };
        self.heap.push(Reverse(Key { at_ns, rank, index }));
    }

    /// Queues `lane`'s step boundary at `at_ns`. A lane holds one event, so a second one (or
    /// one due now) goes to the heap as `ev`, with the lane's rank all the same; otherwise only
    /// the time is kept and `ev` is dropped: the pop rebuilds it from the lane number.
    pub fn push_lane(&mut self, lane: usize, at_ns: u64, ev: E) {
        let at_ns = at_ns.max(self.now_ns);
        if self.lane_at.get(lane) == Some(&EMPTY) && at_ns > self.now_ns {
            self.lane_at[lane] = at_ns;
            self.lanes_used += 1;
        } else {
            self.push_heap(at_ns, lane as u64, ev);
        }
    }

    /// Queues `lane`'s step start at `at_ns` (not before the latest pop), after every other
    /// event of that instant. Returns false, changing nothing, if the lane already has one.
    pub fn push_start(&mut self, lane: usize, at_ns: u64) -> bool {
        let at_ns = at_ns.max(self.now_ns);
        match self.start_at.get_mut(lane) {
            Some(t) if *t == EMPTY => {
                *t = at_ns;
                self.starts_used += 1;
                true
            }
            _ => false,
        }
    }

    /// Takes back `lane`'s pending step boundary (a worker whose step ended where a command
    /// lands, see `engine::quiet::QuietRun`). Returns false when the lane holds none.
    pub fn cancel_lane(&mut self, lane: usize) -> bool {
        match self.lane_at.get_mut(lane) {
            Some(t) if *t != EMPTY => {
                *t = EMPTY;
                self.lanes_used -= 1;
                true
            }
            _ => false,
        }
    }

    /// Moves `lane`'s pending boundary to `at_ns` (which must lie ahead of the latest pop).
    /// Returns false, changing nothing, when the lane is empty or the time has passed.
    pub fn move_lane(&mut self, lane: usize, at_ns: u64) -> bool {
        match self.lane_at.get_mut(lane) {
            Some(t) if *t != EMPTY && at_ns > self.now_ns => {
                *t = at_ns;
                true
            }
            _ => false,
        }
    }

    /// The next event in `(time, rank)` order, with its time; a lane's boundary is
    /// `lane_event(lane)`, a lane's step start `start_event(lane)`.
    pub fn pop_with_starts(
        &mut self,
        lane_event: impl FnOnce(usize) -> E,
        start_event: impl FnOnce(usize) -> E,
    ) -> Option<(u64, E)> {
        if self.starts_used > 0 {
            let mut start = (EMPTY, usize::MAX);
            for (i, &at) in self.start_at.iter().enumerate() {
                if at < start.0 {
                    start = (at, i);
                }
            }
            // A start goes before the next other event only if that one is later in time: at
            // its own instant it ranks after everything.
            if !matches!(self.peek_time(), Some(t) if t <= start.0) {
                self.start_at[start.1] = EMPTY;
                self.starts_used -= 1;
                self.now_ns = start.0;
                return Some((start.0, start_event(start.1)));
            }
        }
        self.pop(lane_event)
    }

    /// Whether anything at all (a step start included) is due at or before `at_ns`.
    pub fn has_due(&self, at_ns: u64) -> bool {
        let start = if self.starts_used > 0 { self.start_at.iter().copied().min() } else { None };
        [self.peek_time(), start].into_iter().flatten().any(|t| t <= at_ns)
    }

    /// The time of the next event other than a step start.
    fn peek_time(&self) -> Option<u64> {
        let lane = if self.lanes_used > 0 { self.lane_at.iter().copied().min() } else { None };
        let fifo = self.now_fifo.front().map(|e| e.0);
        let heap = self.heap.peek().map(|Reverse(k)| k.at_ns);
        [lane, fifo, heap].into_iter().flatten().min()
    }

    /// The next event in `(time, rank)` order, ignoring step starts, with its time; a lane's
    /// event is `lane_event(lane)`.
    pub fn pop(&mut self, lane_event: impl FnOnce(usize) -> E) -> Option<(u64, E)> {
        // The earliest lane, the first in worker order at a tie (EMPTY lanes compare last).
        let mut lane = usize::MAX;
        let mut best = (EMPTY, u64::MAX);
        if self.lanes_used > 0 {
            for (i, &at) in self.lane_at.iter().enumerate() {
                if at < best.0 {
                    best = (at, i as u64);
                    lane = i;
                }
            }
        }
        // Then whichever of FIFO head and heap top comes before it.
        let mut from_fifo = false;
        if let Some((at, rank, _)) = self.now_fifo.front() {
            if (*at, *rank) < best {
                best = (*at, *rank);
                from_fifo = true;
            }
        }
        let from_heap = matches!(self.heap.peek(), Some(Reverse(k)) if (k.at_ns, k.rank) < best);
        let (at_ns, ev) = if from_heap {
            let Reverse(k) = self.heap.pop()?;
            let ev = self.slab.get_mut(k.index as usize)?.take()?;
            self.free.push(k.index);
            (k.at_ns, ev)
        } else if from_fifo {
            let (at, _, ev) = self.now_fifo.pop_front()?;
            (at, ev)
        } else {
            *self.lane_at.get_mut(lane)? = EMPTY;
            self.lanes_used -= 1;
            (best.0, lane_event(lane))
        };
        debug_assert!(at_ns >= self.now_ns, "time went backwards");
        self.now_ns = at_ns;
        Some((at_ns, ev))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The rank step starts have in the model: after every other event of their instant, then
    /// by lane (the queue keeps them in lanes of their own).
    const STEP_STARTS: u64 = 1 << 63;

    #[derive(Clone, Debug)]
    enum Operation {
        Push(u64),
        PushLane(usize, u64),
        MoveLane(usize, u64),
        PushStart(usize, u64),
        CancelLane(usize),
        Pop,
    }

    fn op() -> impl Strategy<Value = Operation> {
        prop_oneof![
            (0u64..4).prop_map(Operation::Push),
            (0usize..3, 0u64..4).prop_map(|(l, d)| Operation::PushLane(l, d)),
            (0usize..3, 0u64..4).prop_map(|(l, d)| Operation::MoveLane(l, d)),
            (0usize..3, 0u64..2).prop_map(|(l, d)| Operation::PushStart(l, d)),
            (0usize..3).prop_map(Operation::CancelLane),
            Just(Operation::Pop),
            Just(Operation::Pop),
        ]
    }

    /// The reference: a plain list of `(time, rank, held in its lane)`, popped by smallest
    /// `(time, rank)`, a lane-held entry first among equals (they carry the same event).
    struct Model {
        entries: Vec<(u64, u64, bool)>,
    }

    impl Model {
        fn pop(&mut self) -> Option<(u64, u64)> {
            let i = (0..self.entries.len()).min_by_key(|&i| {
                let (at, rank, held) = self.entries[i];
                (at, rank, !held)
            })?;
            let (at, rank, _) = self.entries.remove(i);
            Some((at, rank))
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]
        /// The queue pops in exactly the order of one list keyed by (time, rank): step
        /// boundaries first at an instant, by lane, then other events by insertion, then step
        /// starts by lane.
        #[test]
        fn pops_lanes_first_then_insertion_order_then_starts(ops in prop::collection::vec(op(), 1..200)) {
            let mut q: EventQueue<u64> = EventQueue::new(3);
            let mut model = Model { entries: Vec::new() };
            let (mut now, mut seq) = (0u64, 0u64);
            for o in ops {
                match o {
                    Operation::Push(d) => {
                        seq += 1;
                        q.push(now + d, AFTER_LANES | seq);
                        model.entries.push((now + d, AFTER_LANES | seq, false));
                    }
                    Operation::PushLane(l, d) => {
                        let before = q.len();
                        let lanes_before = q.lanes_used;
                        q.push_lane(l, now + d, l as u64);
                        prop_assert_eq!(q.len(), before + 1);
                        let held = q.lanes_used > lanes_before;
                        prop_assert_eq!(held, d > 0 && !model.entries.iter().any(|e| e.2 && e.1 == l as u64));
                        model.entries.push((now + d, l as u64, held));
                    }
                    Operation::MoveLane(l, d) => {
                        let held = model.entries.iter().position(|e| e.2 && e.1 == l as u64);
                        let moved = q.move_lane(l, now + d);
                        prop_assert_eq!(moved, held.is_some() && d > 0);
                        if moved {
                            model.entries[held.unwrap()].0 = now + d;
                        }
                    }
                    Operation::PushStart(l, d) => {
                        let pending = model.entries.iter().any(|e| e.1 == STEP_STARTS | l as u64);
                        prop_assert_eq!(q.push_start(l, now + d), !pending);
                        if !pending {
                            model.entries.push((now + d, STEP_STARTS | l as u64, false));
                        }
                    }
                    Operation::CancelLane(l) => {
                        let held = model.entries.iter().position(|e| e.2 && e.1 == l as u64);
                        prop_assert_eq!(q.cancel_lane(l), held.is_some());
                        if let Some(i) = held {
                            model.entries.remove(i);
                        }
                    }
                    Operation::Pop => {
                        let got = q.pop_with_starts(|l| l as u64, |l| STEP_STARTS | l as u64);
                        prop_assert_eq!(got, model.pop());
                        if let Some((at, _)) = got {
                            now = at;
                        }
                    }
                }
                prop_assert_eq!(q.len(), model.entries.len());
            }
            while let Some(k) = model.pop() {
                prop_assert_eq!(q.pop_with_starts(|l| l as u64, |l| STEP_STARTS | l as u64), Some(k));
            }
            prop_assert!(q.pop_with_starts(|l| l as u64, |l| STEP_STARTS | l as u64).is_none());
        }
    }
}
