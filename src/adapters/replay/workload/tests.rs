//! The workload's unit tests: open loop, session turns, closed loop, reading ahead.

use super::*;
use crate::adapters::replay::trace::{TraceFormat, TraceOptions};
use std::io::Cursor;

const MS: u64 = 1_000_000;

fn reader(text: &str) -> TraceReader<Box<dyn BufRead>> {
    let input: Box<dyn BufRead> = Box::new(Cursor::new(text.as_bytes().to_vec()));
    TraceReader::new(input, "t.jsonl", TraceOptions { format: Some(TraceFormat::Mooncake), speedup: 1.0 })
        .expect("options are valid")
}

fn workload(text: &str, mode: LoadMode, max_buffered: usize) -> Workload {
    Workload::new(reader(text), mode, max_buffered).expect("the trace starts well")
}

/// One trace line.
fn line(timestamp_ms: f64, session: Option<&str>, delay_ms: Option<f64>) -> String {
    let mut s = format!("{{\"timestamp\":{timestamp_ms},\"input_length\":10,\"output_length\":2");
    if let Some(id) = session {
        s += &format!(",\"session_id\":\"{id}\"");
    }
    if let Some(d) = delay_ms {
        s += &format!(",\"delay\":{d}");
    }
    s + "}\n"
}

fn trace(lines: &[String]) -> String {
    lines.concat()
}

/// Drives the workload as a replay would: each request ends `service_ns(index)` after it is
/// issued, with `outcome(index)`; at one instant, ends are reported before arrivals are
/// taken. Returns (index, issued at ns) in issue order and checks each request's
/// `arrival_ns()` is its due time.
fn drive(
    w: &mut Workload,
    service_ns: impl Fn(u64) -> u64,
    outcome: impl Fn(u64) -> TurnOutcome,
) -> Result<Vec<(u64, u64)>, TraceError> {
    let mut ends: BTreeMap<(u64, u64), TurnOutcome> = BTreeMap::new();
    let mut issued = Vec::new();
    for _ in 0..10_000 {
        let next_end = ends.keys().next().copied();
        let next_due = w.next_due_ns();
        if let Some((at_ns, index)) = next_end.filter(|&(at_ns, _)| next_due.map_or(true, |d| at_ns <= d)) {
            let o = ends.remove(&(at_ns, index)).unwrap_or(TurnOutcome::Completed);
            w.on_terminal(index, o, at_ns)?;
        } else if let Some(due_ns) = next_due {
            let r = w.pop_due(due_ns)?.expect("a request is due");
            assert_eq!(r.arrival_ns(), due_ns, "request {} carries its due time", r.index);
            issued.push((r.index, due_ns));
            ends.insert((due_ns + service_ns(r.index), r.index), outcome(r.index));
        } else {
            break;
        }
    }
    assert!(w.is_exhausted(), "everything issued or dropped");
    Ok(issued)
}

fn completed(_: u64) -> TurnOutcome {
    TurnOutcome::Completed
}

#[test]
fn open_loop_without_sessions_is_the_timestamps_in_file_order() {
    let text = trace(&[line(0.0, None, None), line(5.0, None, None), "\n".into(), line(5.0, None, None)])
        + &line(12.5, None, None)
        + &line(40.0, None, None);
    let expected: Vec<TraceRequest> = reader(&text).map(|r| r.expect("valid line")).collect();
    let mut w = workload(&text, LoadMode::Open, 8);
    let mut got = Vec::new();
    while let Some(due_ns) = w.next_due_ns() {
        if let Some(before_ns) = due_ns.checked_sub(1) {
            assert!(w.pop_due(before_ns).expect("no error").is_none(), "nothing before its due time");
        }
        let r = w.pop_due(due_ns).expect("no error").expect("due");
        assert_eq!(r.arrival_ns(), due_ns);
        // Ends reported or not, nothing changes for independent requests.
        w.on_terminal(r.index, TurnOutcome::Completed, due_ns).expect("no error");
        got.push(r);
    }
    assert_eq!(got, expected, "the reader's requests, unchanged, in order");
    let dues: Vec<u64> = got.iter().map(|r| r.arrival_ns()).collect();
    assert_eq!(dues, vec![0, 5 * MS, 5 * MS, 12_500_000, 40 * MS]);
    assert!(w.is_exhausted());
    assert_eq!(w.stats().peak_buffered, 1, "one request read ahead, as before");
    assert!(w.in_flight.is_empty() && w.sessions.is_empty(), "memory stays flat");
    assert_eq!(w.stats().turns_issued, 5);
}

#[test]
fn later_turns_are_due_at_the_previous_turns_end_plus_delay() {
    let text = trace(&[
        line(0.0, Some("s"), None),
        line(100.0, Some("s"), None),
        line(150.0, Some("s"), Some(30.0)),
    ]);
    let mut w = workload(&text, LoadMode::Open, 8);
    assert_eq!(w.next_due_ns(), Some(0));
    assert_eq!(w.pop_due(0).expect("ok").map(|r| r.index), Some(0));
    assert_eq!(w.next_due_ns(), None, "turn 2 waits for turn 1 to end");
    assert!(w.pop_due(1_000 * MS).expect("ok").is_none());
    w.on_terminal(0, TurnOutcome::Completed, 40 * MS).expect("ok");
    // No delay field: the timestamp difference, 100 ms.
    assert_eq!(w.next_due_ns(), Some(140 * MS));
    assert!(w.pop_due(140 * MS - 1).expect("ok").is_none());
    let turn2 = w.pop_due(140 * MS).expect("ok").expect("due");
    assert_eq!((turn2.index, turn2.arrival_ns()), (1, 140 * MS));
    assert_eq!(w.next_due_ns(), None);
    w.on_terminal(1, TurnOutcome::Completed, 200 * MS).expect("ok");
    // The explicit delay wins over the 50 ms between timestamps.
    assert_eq!(w.next_due_ns(), Some(230 * MS));
    let turn3 = w.pop_due(230 * MS).expect("ok").expect("due");
    assert_eq!(turn3.index, 2);
    assert!(w.is_exhausted(), "turn 3 is still running, but nothing is left to issue");
    w.on_terminal(2, TurnOutcome::Completed, 300 * MS).expect("ok");
    assert!(w.is_exhausted());
    let stats = w.stats();
    assert_eq!((stats.sessions_seen, stats.turns_issued, stats.turns_dropped), (1, 3, 0));
}

#[test]
fn a_failed_or_canceled_turn_ends_its_session() {
    let text = trace(&[
        line(0.0, Some("s"), None),
        line(10.0, None, None),
        line(20.0, Some("s"), None),
        line(30.0, Some("s"), Some(1.0)),
    ]);
    for ending in [TurnOutcome::Failed, TurnOutcome::Canceled] {
        let mut w = workload(&text, LoadMode::Open, 8);
        let issued =
            drive(&mut w, |_| 5 * MS, |i| if i == 0 { ending } else { TurnOutcome::Completed }).expect("ok");
        assert_eq!(issued, vec![(0, 0), (1, 10 * MS)], "{ending:?}: later turns never come");
        let stats = w.stats();
        assert_eq!((stats.turns_dropped, stats.sessions_cut_short, stats.turns_issued), (2, 1, 2));
    }
}

#[test]
fn a_rejected_turn_still_schedules_the_next() {
    let text = trace(&[line(0.0, Some("s"), None), line(50.0, Some("s"), None)]);
    let mut w = workload(&text, LoadMode::Open, 8);
    let issued = drive(&mut w, |_| 10 * MS, |_| TurnOutcome::Rejected).expect("ok");
    assert_eq!(issued, vec![(0, 0), (1, 60 * MS)]);
    assert_eq!(w.stats().turns_dropped, 0);
}

#[test]
fn closed_loop_starts_a_request_when_a_slot_frees() {
    let text = trace(&[line(0.0, None, None), line(1000.0, None, None), line(2000.0, None, None)])
        + &line(3000.0, None, None);
    let mut w = workload(&text, LoadMode::Closed { concurrency: 2 }, 8);
    let service = |i: u64| [50 * MS, 70 * MS, 100 * MS, 10 * MS][i as usize];
    let issued = drive(&mut w, service, completed).expect("ok");
    // Timestamps are ignored: two at once from 0, then one per freed slot.
    assert_eq!(issued, vec![(0, 0), (1, 0), (2, 50 * MS), (3, 70 * MS)]);
}

#[test]
fn closed_loop_session_keeps_its_slot_through_think_time() {
    let text = trace(&[line(0.0, Some("a"), None), line(1.0, None, None), line(10.0, Some("a"), Some(5.0))]);
    let mut w = workload(&text, LoadMode::Closed { concurrency: 1 }, 16);
    assert_eq!(w.pop_due(0).expect("ok").map(|r| r.index), Some(0));
    assert_eq!(w.next_due_ns(), None, "the independent request waits for the slot");
    w.on_terminal(0, TurnOutcome::Completed, 20 * MS).expect("ok");
    assert_eq!(w.next_due_ns(), Some(25 * MS), "the session's next turn, not the waiting request");
    let mut w = workload(&text, LoadMode::Closed { concurrency: 1 }, 16);
    let issued = drive(&mut w, |_| 20 * MS, completed).expect("ok");
    assert_eq!(issued, vec![(0, 0), (2, 25 * MS), (1, 45 * MS)]);
}

#[test]
fn closed_loop_failed_session_frees_its_slot() {
    let text = trace(&[line(0.0, Some("a"), None), line(1.0, Some("b"), None), line(2.0, Some("a"), None)])
        + &line(3.0, Some("b"), None);
    let mut w = workload(&text, LoadMode::Closed { concurrency: 1 }, 16);
    let issued =
        drive(&mut w, |_| 10 * MS, |i| if i == 0 { TurnOutcome::Failed } else { TurnOutcome::Completed })
            .expect("ok");
    // b starts when a fails; b's second turn follows its first by the 2 ms between timestamps.
    assert_eq!(issued, vec![(0, 0), (1, 10 * MS), (3, 22 * MS)]);
    assert_eq!(w.stats().turns_dropped, 1);
}

/// A session's second turn six requests on, with five independent requests in between.
fn far_turn(delay_ms: Option<f64>) -> String {
    let mut lines = vec![line(0.0, Some("a"), None)];
    for k in 1..=5 {
        lines.push(line(100.0 * k as f64, None, None));
    }
    lines.push(line(600.0, Some("a"), delay_ms));
    trace(&lines)
}

#[test]
fn a_turn_far_ahead_in_the_file_is_found_by_reading_ahead() {
    let mut w = workload(&far_turn(Some(10.0)), LoadMode::Open, 16);
    let issued = drive(&mut w, |_| MS, completed).expect("ok");
    let mut expected = vec![(0, 0), (6, 11 * MS)];
    expected.extend((1..=5).map(|k| (k, k * 100 * MS)));
    assert_eq!(
        issued, expected,
        "the turn comes 10 ms after its predecessor ends; the rest at their timestamps"
    );
    assert_eq!(w.stats().peak_buffered, 6, "the five passed over and the turn");
}

#[test]
fn reading_ahead_past_max_buffered_is_an_error_naming_the_limit() {
    let mut w = workload(&far_turn(Some(10.0)), LoadMode::Open, 4).with_session_horizon(8);
    let e = drive(&mut w, |_| MS, completed).expect_err("the turn is beyond the limit");
    assert_eq!(e.line, 6, "the request that did not fit");
    let text = e.to_string();
    assert!(text.starts_with("t.jsonl:6: "), "{text}");
    assert!(text.contains("max_buffered = 4") && text.contains("session `a`"), "{text}");
    assert_eq!(w.pop_due(u64::MAX), Err(e.clone()), "the first error ends the workload");
    assert_eq!(w.on_terminal(0, TurnOutcome::Completed, u64::MAX), Err(e));
}

#[test]
fn open_loop_turn_beyond_the_horizon_is_late_with_an_explicit_delay() {
    // max_buffered 4: horizon 2, so the session is taken as ended before its turn is read.
    let mut w = workload(&far_turn(Some(10.0)), LoadMode::Open, 4);
    let e = drive(&mut w, |_| MS, completed).expect_err("due at 11 ms, read near 400 ms");
    assert_eq!(e.line, 7);
    let text = e.to_string();
    assert!(text.contains("session horizon of 2") && text.contains("max_buffered = 4"), "{text}");
}

#[test]
fn open_loop_turn_beyond_the_horizon_is_on_time_with_an_implied_delay() {
    let mut w = workload(&far_turn(None), LoadMode::Open, 4);
    let issued = drive(&mut w, |_| MS, completed).expect("never late");
    assert_eq!(issued.last(), Some(&(6, 601 * MS)), "1 ms of service + the 600 ms between timestamps");
    assert!(w.stats().peak_buffered <= 4);
}

#[test]
fn closed_loop_turn_beyond_the_horizon_is_an_error() {
    let text = trace(&[
        line(0.0, Some("a"), None),
        line(1.0, None, None),
        line(2.0, None, None),
        line(3.0, None, None),
        line(4.0, Some("a"), None),
    ]);
    let mut w = workload(&text, LoadMode::Closed { concurrency: 1 }, 4);
    let e = drive(&mut w, |_| MS, completed).expect_err("the slot was already given away");
    assert_eq!(e.line, 5);
    assert!(e.to_string().contains("taken as ended") && e.to_string().contains("max_buffered = 4"), "{e}");
    // With room to look, the same trace runs.
    let mut w = workload(&text, LoadMode::Closed { concurrency: 1 }, 16);
    let issued = drive(&mut w, |_| MS, completed).expect("ok");
    assert_eq!(issued, vec![(0, 0), (4, 5 * MS), (1, 6 * MS), (2, 7 * MS), (3, 8 * MS)]);
}

#[test]
fn a_delay_on_a_first_turn_is_an_error_naming_the_line() {
    let text = line(0.0, None, None) + "\n" + &line(1.0, Some("a"), Some(5.0));
    let mut w = workload(&text, LoadMode::Open, 8);
    let e = drive(&mut w, |_| MS, completed).expect_err("delay on a first turn");
    assert_eq!(e.line, 3, "blank lines count, like an editor's");
    assert!(e.to_string().starts_with("t.jsonl:3: `delay` 5 ms on the first turn of session `a`"), "{e}");
    // A request without a session is a one-turn session: same rule, here at construction.
    let e = Workload::new(reader(&line(0.0, None, Some(2.0))), LoadMode::Open, 8)
        .err()
        .expect("delay on a one-turn session");
    assert_eq!(e.line, 1);
    // Zero, as the reference writes on first turns, is no delay.
    let mut w = workload(&(line(0.0, Some("a"), Some(0.0)) + &line(1.0, None, Some(0.0))), LoadMode::Open, 8);
    assert_eq!(drive(&mut w, |_| MS, completed).expect("ok"), vec![(0, 0), (1, MS)]);
}

#[test]
fn same_instant_goes_by_trace_index() {
    // The independent request (index 1) and the session's second turn (index 2, due at
    // 0 + 100 ms) are both due at 100 ms.
    let text = trace(&[line(0.0, Some("a"), None), line(100.0, None, None), line(100.0, Some("a"), None)]);
    let mut w = workload(&text, LoadMode::Open, 8);
    let issued = drive(&mut w, |_| 0, completed).expect("ok");
    assert_eq!(issued, vec![(0, 0), (1, 100 * MS), (2, 100 * MS)]);
}

#[test]
fn bad_settings_are_refused() {
    let e = Workload::new(reader(&line(0.0, None, None)), LoadMode::Open, 0).err().expect("zero buffer");
    assert_eq!((e.line, e.path.to_str()), (0, Some("t.jsonl")));
    let e = Workload::new(reader(&line(0.0, None, None)), LoadMode::Closed { concurrency: 0 }, 4)
        .err()
        .expect("zero concurrency");
    assert!(e.to_string().contains("concurrency"), "{e}");
}

#[test]
fn time_conversions_round_trip_and_saturate() {
    for ns in [0, 1, 999_999, 1_000_001, 123_456_789_012, 1 << 52] {
        assert_eq!(ms_to_ns(ns_to_ms(ns)), ns);
    }
    assert_eq!(ms_to_ns(1e300), u64::MAX);
    assert_eq!(ms_to_ns(f64::NAN), 0);
    assert_eq!(ms_to_ns(0.0000004), 0);
    assert_eq!(ms_to_ns(0.0000005), 1);
}

#[test]
fn load_mode_reads_from_config_json() {
    let closed: LoadMode = serde_json::from_str(r#"{"closed":{"concurrency":3}}"#).expect("valid");
    assert_eq!(closed, LoadMode::Closed { concurrency: 3 });
    let open: LoadMode = serde_json::from_str(r#""open""#).expect("valid");
    assert_eq!(open, LoadMode::Open);
}
