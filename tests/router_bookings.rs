//! Router bookings per the proposal's accounting table, and the router-stream fold.

use handoff_ledger::events::{Fact, TerminalStatus};
use handoff_ledger::ids::{RequestId, WorkerId};
use handoff_ledger::projections::bookings::BookingFold;
use handoff_ledger::router::{BookingError, Router, RouterMode, WorkerLoad};
use proptest::prelude::*;
use std::collections::BTreeMap;

fn p(i: u32) -> WorkerId {
    WorkerId::prefill(i)
}
fn d(i: u32) -> WorkerId {
    WorkerId::decode(i)
}
fn r(i: u64) -> RequestId {
    RequestId(i)
}

fn load(active_prefill_tokens: u64, prefill_blocks: u64, decode_blocks: u64) -> WorkerLoad {
    WorkerLoad { active_prefill_tokens, prefill_blocks, decode_blocks }
}

#[test]
fn prefill_compute_load_drops_at_compute_done_while_the_booking_stays() {
    let mut rt = Router::new(vec![p(0), p(1)], RouterMode::LeastLoaded, 64, 0).unwrap();
    let f = rt.book_prefill(r(1), p(0), 1000, 16).unwrap();
    assert_eq!(f, Fact::PrefillBooked { request: r(1), worker: p(0), prefill_tokens: 1000, blocks: 16 });
    rt.book_prefill(r(2), p(0), 300, 5).unwrap();
    assert_eq!(rt.load(p(0)), load(1300, 21, 0));

    assert_eq!(rt.prefill_compute_done(r(1)), Some(Fact::PrefillComputeDone { request: r(1), worker: p(0) }));
    assert_eq!(rt.load(p(0)), load(300, 21, 0), "compute load drops, blocks stay booked (source pinned)");
    assert_eq!(rt.prefill_compute_done(r(1)), None, "second compute-done is a no-op");
    // The pinned booking still steers selection away from p0.
    assert_eq!(rt.select_with_hashes(64, &[]).worker, p(1));

    assert_eq!(rt.free_prefill(r(1)), Some(Fact::PrefillBookingFreed { request: r(1), worker: p(0) }));
    assert_eq!(rt.load(p(0)), load(300, 5, 0));
    assert_eq!(rt.free_prefill(r(1)), None, "double free is a no-op");
    assert_eq!(rt.prefill_compute_done(r(1)), None, "compute-done after free is a no-op");

    // A request that ends before its compute finished (failed handoff) frees both at once.
    assert!(rt.free_prefill(r(2)).is_some());
    assert_eq!(rt.load(p(0)), WorkerLoad::default());
    assert!(rt.loads().is_empty(), "nothing booked once nothing is in flight");
    assert_eq!(rt.bookings().in_flight(), (0, 0));
}

#[test]
fn decode_booking_lives_from_selection_to_terminal_outcome() {
    let mut rt = Router::new(vec![d(0), d(1)], RouterMode::kv(), 16, 0).unwrap();
    let sel = rt.select_with_hashes(160, &[]);
    assert_eq!(sel.worker, d(0));
    assert_eq!(
        rt.book_decode(r(7), sel.worker, 10),
        Ok(Fact::DecodeBooked { request: r(7), worker: d(0), blocks: 10 })
    );
    assert_eq!(rt.load(d(0)), load(0, 0, 10));
    // The booking counts in the next KV selection: d1 is cheaper now.
    assert_eq!(rt.select_with_hashes(160, &[]).worker, d(1));
    assert_eq!(
        rt.free_decode(r(7), TerminalStatus::Failed),
        Some(Fact::DecodeBookingFreed { request: r(7), worker: d(0), status: TerminalStatus::Failed })
    );
    assert_eq!(rt.free_decode(r(7), TerminalStatus::Completed), None);
    assert!(rt.loads().is_empty());
}

#[test]
fn double_booking_and_foreign_workers_are_errors() {
    let mut rt = Router::new(vec![d(0), d(1)], RouterMode::RoundRobin, 16, 0).unwrap();
    rt.book_decode(r(1), d(0), 3).unwrap();
    assert_eq!(
        rt.book_decode(r(1), d(1), 3),
        Err(BookingError::DecodeAlreadyBooked { request: r(1), worker: d(0) })
    );
    assert_eq!(rt.book_decode(r(2), d(9), 3), Err(BookingError::UnknownWorker { worker: d(9) }));
    rt.book_prefill(r(1), d(1), 5, 1).unwrap();
    assert_eq!(
        rt.book_prefill(r(1), d(1), 5, 1),
        Err(BookingError::PrefillAlreadyBooked { request: r(1), worker: d(1) })
    );
    assert_eq!(rt.load(d(0)), load(0, 0, 3), "a refused booking changes nothing");
    assert_eq!(rt.load(d(1)), load(5, 1, 0));
}

#[test]
fn fold_rejects_inconsistent_streams() {
    let mut f = BookingFold::new();
    assert!(f.apply(&Fact::PrefillBookingFreed { request: r(1), worker: p(0) }).is_err());
    f.apply(&Fact::PrefillBooked { request: r(1), worker: p(0), prefill_tokens: 0, blocks: 1 }).unwrap();
    assert!(f.apply(&Fact::PrefillComputeDone { request: r(1), worker: p(1) }).is_err(), "wrong worker");
    f.apply(&Fact::PrefillComputeDone { request: r(1), worker: p(0) }).unwrap();
    assert!(f.apply(&Fact::PrefillComputeDone { request: r(1), worker: p(0) }).is_err(), "twice");
    assert!(f
        .apply(&Fact::PrefillBooked { request: r(1), worker: p(0), prefill_tokens: 0, blocks: 1 })
        .is_err());
    f.apply(&Fact::DecodeBooked { request: r(1), worker: d(0), blocks: 2 }).unwrap();
    assert!(f
        .apply(&Fact::DecodeBookingFreed { request: r(1), worker: d(1), status: TerminalStatus::Completed })
        .is_err());
    // Non-booking facts pass through.
    f.apply(&Fact::KvCleared).unwrap();
    assert_eq!(f.loads(), BTreeMap::from([(p(0), load(0, 1, 0)), (d(0), load(0, 0, 2))]));
}

// ---------------------------------------------------------------- fold = router, randomized

#[derive(Clone, Debug)]
enum Op {
    /// Select a prefill worker and book it.
    BookPrefill {
        req: u64,
        tokens: u32,
    },
    ComputeDone {
        req: u64,
    },
    FreePrefill {
        req: u64,
    },
    /// Select a decode worker and book it.
    BookDecode {
        req: u64,
        blocks: u32,
    },
    FreeDecode {
        req: u64,
        status: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let req = 0u64..12;
    prop_oneof![
        3 => (req.clone(), 0u32..5000).prop_map(|(req, tokens)| Op::BookPrefill { req, tokens }),
        2 => req.clone().prop_map(|req| Op::ComputeDone { req }),
        2 => req.clone().prop_map(|req| Op::FreePrefill { req }),
        3 => (req.clone(), 0u32..200).prop_map(|(req, blocks)| Op::BookDecode { req, blocks }),
        2 => (req, 0u8..4).prop_map(|(req, status)| Op::FreeDecode { req, status }),
    ]
}

fn mode() -> impl Strategy<Value = RouterMode> {
    prop_oneof![
        Just(RouterMode::RoundRobin),
        Just(RouterMode::Random),
        Just(RouterMode::kv()),
        Just(RouterMode::LeastLoaded),
        Just(RouterMode::PowerOfTwo),
        Just(RouterMode::KvAware { overlap_weight: 2.0, temperature: 3.0 }),
    ]
}

const STATUSES: [TerminalStatus; 4] =
    [TerminalStatus::Completed, TerminalStatus::Rejected, TerminalStatus::Failed, TerminalStatus::Canceled];

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// One router books both stages (prefill workers and decode workers in one list, so the same
    /// worker set sees both kinds). After every operation the fold of the facts it returned
    /// equals its own loads; a no-op returns no fact; and once every request is freed, nothing
    /// is booked anywhere.
    #[test]
    fn fold_of_the_router_stream_equals_the_router(mode in mode(), seed in any::<u64>(),
                                                   ops in prop::collection::vec(op(), 0..80)) {
        let workers = vec![p(0), p(1), p(2), d(0), d(1)];
        let mut rt = Router::new(workers.clone(), mode, 64, seed).unwrap();
        let mut fold = BookingFold::new();
        let mut stream: Vec<Fact> = Vec::new();
        for op in &ops {
            let fact = match *op {
                Op::BookPrefill { req, tokens } => {
                    let w = rt.select_with_hashes(tokens, &[]).worker;
                    rt.book_prefill(r(req), w, tokens, rt.prompt_blocks(tokens)).ok()
                }
                Op::ComputeDone { req } => rt.prefill_compute_done(r(req)),
                Op::FreePrefill { req } => rt.free_prefill(r(req)),
                Op::BookDecode { req, blocks } => {
                    let w = rt.select_with_hashes(blocks * 64, &[]).worker;
                    rt.book_decode(r(req), w, blocks).ok()
                }
                Op::FreeDecode { req, status } => rt.free_decode(r(req), STATUSES[status as usize]),
            };
            if let Some(f) = fact {
                fold.apply(&f).map_err(|e| TestCaseError::fail(format!("seed {seed}: {e}")))?;
                stream.push(f);
            }
            prop_assert_eq!(fold.loads(), rt.loads(), "seed {}", seed);
            for w in &workers {
                prop_assert_eq!(fold.load(*w), rt.load(*w));
            }
            prop_assert_eq!(fold.in_flight(), rt.bookings().in_flight());
        }
        // Re-folding the whole stream from scratch gives the same answer.
        let mut again = BookingFold::new();
        for f in &stream {
            again.apply(f).unwrap();
        }
        prop_assert_eq!(again.loads(), rt.loads());
        // Terminal cleanup frees everything, exactly once per booking.
        for i in 0..12 {
            if let Some(f) = rt.free_prefill(r(i)) { fold.apply(&f).unwrap(); }
            if let Some(f) = rt.free_decode(r(i), TerminalStatus::Canceled) { fold.apply(&f).unwrap(); }
            prop_assert!(rt.free_prefill(r(i)).is_none() && rt.free_decode(r(i), TerminalStatus::Canceled).is_none());
        }
        prop_assert!(rt.loads().is_empty());
        prop_assert!(fold.loads().is_empty());
        prop_assert_eq!(rt.bookings().in_flight(), (0, 0));
    }
}
