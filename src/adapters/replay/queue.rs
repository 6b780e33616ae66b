//! The replay's event queue: events ordered by `(time, insertion sequence)`.
//!
//! One binary heap would do, but most events are of two kinds that a heap serves badly:
//! * a worker's next step boundary (one per busy worker, re-armed after every step: most of a
//!   run's events), and
//! * follow-ups due *now* (a command to apply, a message to deliver), pushed while handling an
//!   event at the current time.
//!
//! Steps get one lane per worker (at most one pending boundary each, kept as its key only: the
//! caller says how a lane's pop becomes an event); events due now go to a
//! FIFO, which is already in `(time, seq)` order because time never goes back and sequence
//! numbers only grow. Everything else (timers, transfers, arrivals) goes to the heap. `pop`
//! takes the smallest head of the three, so the order is exactly the one heap's order: same
//! trace and seed, same log.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// A heap entry: the order key and the event's place in the slab. Sifting moves these 24
/// bytes, not the (larger) events.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    at_ns: u64,
    seq: u64,
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
    /// Each lane's `(time, seq)`, `EMPTY` when the lane holds nothing: kept apart from the
    /// events so finding the earliest lane scans a few contiguous words.
    lane_keys: Vec<(u64, u64)>,
    lanes_used: usize,
}

const EMPTY: (u64, u64) = (u64::MAX, u64::MAX);

impl<E> EventQueue<E> {
    pub fn new(lanes: usize) -> Self {
        EventQueue {
            seq: 0,
            now_ns: 0,
            heap: BinaryHeap::new(),
            slab: Vec::new(),
            free: Vec::new(),
            now_fifo: VecDeque::new(),
            lane_keys: vec![EMPTY; lanes],
            lanes_used: 0,
        }
    }

    /// Events waiting.
    pub fn len(&self) -> usize {
        self.heap.len() + self.now_fifo.len() + self.lanes_used
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues `ev` at `at_ns` (not before the latest pop's time).
    pub fn push(&mut self, at_ns: u64, ev: E) {
        self.seq += 1;
        let at_ns = at_ns.max(self.now_ns);
        if at_ns == self.now_ns {
            self.now_fifo.push_back((at_ns, self.seq, ev));
            return;
        }
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
        self.heap.push(Reverse(Key { at_ns, seq: self.seq, index }));
    }

    /// Queues `lane`'s event at `at_ns`. A lane holds one event, so a second one (or one due
    /// now) goes to the heap as `ev`; otherwise only the key is kept and `ev` is dropped: the
    /// pop rebuilds it from the lane number.
    pub fn push_lane(&mut self, lane: usize, at_ns: u64, ev: E) {
        if self.lane_keys.get(lane) == Some(&EMPTY) && at_ns > self.now_ns {
            self.seq += 1;
            self.lane_keys[lane] = (at_ns, self.seq);
            self.lanes_used += 1;
        } else {
            self.push(at_ns, ev);
        }
    }

    /// The next event in `(time, seq)` order, with its time; a lane's event is `lane_event(lane)`.
    pub fn pop(&mut self, lane_event: impl FnOnce(usize) -> E) -> Option<(u64, E)> {
        // The earliest lane (EMPTY lanes compare last).
        let mut lane = usize::MAX;
        let mut best = EMPTY;
        if self.lanes_used > 0 {
            for (i, k) in self.lane_keys.iter().enumerate() {
                if *k < best {
                    best = *k;
                    lane = i;
                }
            }
        }
        // Then whichever of FIFO head and heap top comes before it.
        let mut from_fifo = false;
        if let Some((at, seq, _)) = self.now_fifo.front() {
            if (*at, *seq) < best {
                best = (*at, *seq);
                from_fifo = true;
            }
        }
        let from_heap = matches!(self.heap.peek(), Some(Reverse(k)) if (k.at_ns, k.seq) < best);
        let (at_ns, ev) = if from_heap {
            let Reverse(k) = self.heap.pop()?;
            let ev = self.slab.get_mut(k.index as usize)?.take()?;
            self.free.push(k.index);
            (k.at_ns, ev)
        } else if from_fifo {
            let (at, _, ev) = self.now_fifo.pop_front()?;
            (at, ev)
        } else {
            *self.lane_keys.get_mut(lane)? = EMPTY;
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

    #[derive(Clone, Debug)]
    enum Op {
        Push(u64),
        PushLane(usize, u64),
        Pop,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..4).prop_map(Op::Push),
            (0usize..3, 0u64..4).prop_map(|(l, d)| Op::PushLane(l, d)),
            Just(Op::Pop),
            Just(Op::Pop),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]
        /// The queue pops in exactly the order of one heap keyed by (time, seq).
        #[test]
        fn pops_in_time_then_insertion_order(ops in prop::collection::vec(op(), 1..200)) {
            let mut q: EventQueue<u64> = EventQueue::new(3);
            // Lane events are rebuilt from the lane number: remember which seq each lane holds.
            let mut lane_seq = [0u64; 3];
            let mut model: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
            let (mut now, mut seq) = (0u64, 0u64);
            for o in ops {
                match o {
                    Op::Push(d) => {
                        seq += 1;
                        q.push(now + d, seq);
                        model.push(Reverse((now + d, seq)));
                    }
                    Op::PushLane(l, d) => {
                        seq += 1;
                        let before = q.len();
                        let lanes_before = q.lanes_used;
                        q.push_lane(l, now + d, seq);
                        prop_assert_eq!(q.len(), before + 1);
                        if q.lanes_used > lanes_before {
                            lane_seq[l] = seq;
                        }
                        model.push(Reverse((now + d, seq)));
                    }
                    Op::Pop => {
                        let got = q.pop(|l| lane_seq[l]);
                        prop_assert_eq!(got, model.pop().map(|Reverse(k)| k));
                        if let Some((at, _)) = got {
                            now = at;
                        }
                    }
                }
                prop_assert_eq!(q.len(), model.len());
            }
            while let Some(Reverse(k)) = model.pop() {
                prop_assert_eq!(q.pop(|l| lane_seq[l]), Some(k));
            }
            prop_assert!(q.pop(|l| lane_seq[l]).is_none());
        }
    }
}
