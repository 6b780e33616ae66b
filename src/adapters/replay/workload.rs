//! When each trace request arrives: open loop, sessions and closed loop, on the virtual clock.
//!
//! The reader ([`TraceReader`]) gives requests in file order with their timestamps; this module
//! decides when each becomes *due*, with the rules of the reference replay (NVIDIA Dynamo's
//! mocker):
//! * A line without `session_id` is an independent request, due at its timestamp (open loop).
//! * Lines sharing a `session_id` are the turns of one session, in file order. The first turn is
//!   due at its timestamp. A later turn is due at (the previous turn's terminal time) + its
//!   delay: the line's `delay` when given, else its timestamp minus the previous turn's (both in
//!   ns, so with zero service time a turn is due exactly at its timestamp). A rejected turn still
//!   schedules the next; a failed or canceled turn ends the session, and its remaining turns are
//!   dropped (counted, never issued).
//! * [`LoadMode::Closed`] with concurrency N: at most N sessions are active (a request without
//!   `session_id` is a one-turn session). Sessions start in the file order of their first turns,
//!   each first turn due the instant its session starts (its timestamp is ignored); a session
//!   holds its slot through all its turns and think times, and when it ends the next pending
//!   session starts at that instant.
//!
//! The owner drives it: [`Workload::next_due_ns`] says when to wake, [`Workload::pop_due`] hands
//! out what is due, [`Workload::on_terminal`] reports each request's end. After every
//! `pop_due` or `on_terminal` the owner must ask `next_due_ns` again: an ending turn can make its
//! successor due at once.
//!
//! ## Streaming
//! The trace is read lazily. Independent requests and first turns are due at their timestamps,
//! which are non-decreasing in file order, so in open loop one request read ahead of the clock
//! is enough: with no `session_id` in the trace this is exactly the replay's old behaviour, one
//! request buffered, each due at [`TraceRequest::arrival_ns`] in file order.
//!
//! A stream cannot tell that a session is over without reading to the end of the file. When a
//! turn ends and its session's next turn has not been read, the workload reads ahead for it up
//! to the **session horizon** (by default `max_buffered / 2` requests past that turn's line; the
//! other half leaves room for lines that are read but not due yet), buffering the lines passed
//! over. No further turn within the horizon, or the end of the trace, ends the session:
//! * Closed loop: the slot goes to the next session. A turn of that session found later is an
//!   error naming its line and the limit, because the replay already acted on the session's end.
//! * Open loop: no slot depends on it, so a turn found later is still taken when it is not late
//!   (due no earlier than the clock when it is read). With delays implied by timestamps it never
//!   is (such a turn is due no earlier than its own timestamp, and lines are read before the
//!   clock reaches their timestamps); an explicit `delay` can make it late, which is an error
//!   naming the line and the limit.
//!
//! Everything read and not yet issued (requests not yet due, turns waiting for the turn before
//! them, sessions waiting for a slot) counts toward `max_buffered`; holding more is an error
//! naming the limit and the line. Known sessions stay in a map for the whole run (so a late turn
//! of an ended session is recognised), which grows with the number of sessions, not requests.
//!
//! ## Decisions where the reference is silent or differs
//! * `delay` 0 on a first turn (or on a request without `session_id`) is accepted, as the
//!   reference accepts it; any other value is an error naming the line.
//! * A returned request's `arrival_ms` is its due time, so [`TraceRequest::to_request`] carries
//!   the arrival the replay should measure from. It is unchanged wherever the due time is the
//!   timestamp (open-loop requests and first turns).
//! * A terminal report for a request that is not a tracked turn (an open-loop request without
//!   `session_id`, or one already reported) changes nothing.
//! * The first error ends the workload: every later call returns it again.

use crate::adapters::replay::trace::{TraceError, TraceReader, TraceRequest};
use crate::events::fact::TerminalStatus;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::BufRead;
use std::path::PathBuf;

/// How requests are offered to the replay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LoadMode {
    /// Independent requests and first turns at their timestamps.
    #[default]
    Open,
    /// At most `concurrency` sessions active at once, each started when a slot frees.
    Closed { concurrency: u32 },
}

/// How a request ended, as far as its session is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TurnOutcome {
    Completed,
    /// Refused by the engine: the session goes on (the reference treats it as an answer).
    Rejected,
    /// Ends the session: its remaining turns are dropped.
    Failed,
    /// Ends the session: its remaining turns are dropped.
    Canceled,
}

impl TurnOutcome {
    /// Whether this outcome ends the session (its remaining turns never arrive).
    pub fn ends_session(self) -> bool {
        matches!(self, TurnOutcome::Failed | TurnOutcome::Canceled)
    }
}

impl From<TerminalStatus> for TurnOutcome {
    fn from(status: TerminalStatus) -> Self {
        match status {
            TerminalStatus::Completed => TurnOutcome::Completed,
            TerminalStatus::Rejected => TurnOutcome::Rejected,
            TerminalStatus::Failed => TurnOutcome::Failed,
            TerminalStatus::Canceled => TurnOutcome::Canceled,
        }
    }
}

/// Counts for the run report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct WorkloadStats {
    /// Distinct `session_id`s read (requests without one are not counted).
    pub sessions_seen: u64,
    /// Sessions ended by a failed or canceled turn.
    pub sessions_cut_short: u64,
    /// Requests handed out by `pop_due`, independent requests included.
    pub turns_issued: u64,
    /// Turns never issued because their session was cut short.
    pub turns_dropped: u64,
    /// Most requests held read-ahead at once.
    pub peak_buffered: usize,
}

/// Where a known session stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SessionState {
    /// Closed loop: its first turn waits for a slot.
    Pending,
    /// A turn of it is due, issued, or waiting for the turn before it to end.
    Busy,
    /// Its latest turn ended at `ended_at_ns` and the next has not been read yet: the workload
    /// reads ahead for it until request `until_index` (see `searching`).
    Searching { ended_at_ns: u64, until_index: u64 },
    /// No further turn within the horizon or before the end of the trace. `ended_at_ns` is when
    /// its last turn ended (open loop may still take a turn that is not late).
    Ended { ended_at_ns: u64 },
    /// A turn failed or was canceled: later turns are dropped as they are read.
    CutShort,
}

struct Session {
    /// The latest turn read: its index (for the horizon), line (for messages) and timestamp (for
    /// the next turn's implied delay).
    last_index: u64,
    last_line: usize,
    last_arrival_ns: u64,
    /// Turns read whose previous turn has not ended yet, each with its delay in ns.
    waiting: VecDeque<(TraceRequest, u64)>,
    state: SessionState,
}

/// Decides when each trace request arrives. See the module docs.
pub struct Workload {
    trace: TraceReader<Box<dyn BufRead>>,
    path: PathBuf,
    mode: LoadMode,
    max_buffered: usize,
    session_horizon: u64,
    /// The reader returned its last request.
    trace_done: bool,
    /// Requests read so far (the next one's index).
    read_count: u64,
    /// Timestamp of the latest request read, in ns: no unread request has an earlier one.
    read_frontier_ns: u64,
    /// The latest `now_ns` any call was given.
    clock_ns: u64,
    /// Open loop: independent requests and first turns read and not yet issued, in file order
    /// (which is due order, as timestamps are non-decreasing).
    timed: VecDeque<TraceRequest>,
    /// Closed loop: first turns (and independent requests) waiting for a slot, in file order.
    pending: VecDeque<TraceRequest>,
    /// Requests whose due time is known apart from their timestamp (later turns, closed-loop
    /// starts), by (due ns, index).
    scheduled: BTreeMap<(u64, u64), TraceRequest>,
    sessions: BTreeMap<String, Session>,
    /// Sessions reading ahead for their next turn, by (last index to read, session id).
    searching: BTreeSet<(u64, String)>,
    /// Issued requests whose end matters: session turns (`Some(id)`) and, in closed loop,
    /// independent requests (`None`), which hold a slot.
    in_flight: BTreeMap<u64, Option<String>>,
    /// Closed loop: sessions holding a slot.
    active_sessions: u32,
    /// Requests read and neither issued nor dropped.
    buffered: usize,
    stats: WorkloadStats,
    failure: Option<TraceError>,
}

/// ms (as the trace gives them) to ns on the virtual clock: rounded, saturating, never wrapping
/// (`as` saturates and maps NaN to 0).
fn ms_to_ns(ms: f64) -> u64 {
    (ms * 1e6).round() as u64
}

/// The ms value whose [`ms_to_ns`] is `ns`, so a rewritten `arrival_ms` gives the due time back
/// exactly through `arrival_ns()`. The division rounds; a few steps to a neighbouring float fix
/// the round trip wherever floats can represent it (below 2^53 ns, about 104 days).
fn ns_to_ms(ns: u64) -> f64 {
    let mut ms = ns as f64 / 1e6;
    for _ in 0..4 {
        let back = ms_to_ns(ms);
        if back == ns {
            break;
        }
        if back < ns {
            ms = f64::from_bits(ms.to_bits() + 1);
        } else if ms > 0.0 {
            ms = f64::from_bits(ms.to_bits() - 1);
        }
    }
    ms
}

impl Workload {
    /// Reads the trace lazily. `max_buffered` (at least 1) bounds the requests held read-ahead.
    /// Reads as much as the first due time needs (one request in open loop; in closed loop, the
    /// first `concurrency` sessions' first turns and any turns between them).
    pub fn new(
        trace: TraceReader<Box<dyn BufRead>>,
        mode: LoadMode,
        max_buffered: usize,
    ) -> Result<Self, TraceError> {
        let path = trace.path().to_path_buf();
        let whole = |reason: String| TraceError { path: path.clone(), line: 0, reason };
        if max_buffered == 0 {
            return Err(whole("max_buffered must be at least 1 (one request is read ahead)".into()));
        }
        if mode == (LoadMode::Closed { concurrency: 0 }) {
            return Err(whole("closed-loop concurrency must be at least 1".into()));
        }
        let mut workload = Workload {
            trace,
            path,
            mode,
            max_buffered,
            session_horizon: (max_buffered / 2).max(1) as u64,
            trace_done: false,
            read_count: 0,
            read_frontier_ns: 0,
            clock_ns: 0,
            timed: VecDeque::new(),
            pending: VecDeque::new(),
            scheduled: BTreeMap::new(),
            sessions: BTreeMap::new(),
            searching: BTreeSet::new(),
            in_flight: BTreeMap::new(),
            active_sessions: 0,
            buffered: 0,
            stats: WorkloadStats::default(),
            failure: None,
        };
        let settled = workload.settle(0);
        workload.record(settled)?;
        Ok(workload)
    }

    /// Sets how many requests past a session's latest turn are read when looking for its next
    /// turn (see the module docs). Takes effect for turns that end from now on. A horizon of
    /// `max_buffered` or more can only end in the read-ahead limit's error.
    pub fn with_session_horizon(mut self, requests: u64) -> Self {
        self.session_horizon = requests;
        self
    }

    pub fn mode(&self) -> LoadMode {
        self.mode
    }

    pub fn session_horizon(&self) -> u64 {
        self.session_horizon
    }

    /// The earliest instant a request is due (ns on the virtual clock), or None when nothing is
    /// due until some request ends (or everything has been issued).
    pub fn next_due_ns(&self) -> Option<u64> {
        if self.failure.is_some() {
            return None;
        }
        self.next_key().map(|(due_ns, _)| due_ns)
    }

    /// Takes the next request due at or before `now_ns` (deterministic order: due time, then
    /// trace index), reading the trace ahead as needed. The request's `arrival_ms` is its due
    /// time (see the module docs).
    pub fn pop_due(&mut self, now_ns: u64) -> Result<Option<TraceRequest>, TraceError> {
        self.check()?;
        self.clock_ns = self.clock_ns.max(now_ns);
        let Some((due_ns, index)) = self.next_key() else {
            return Ok(None);
        };
        if due_ns > now_ns {
            return Ok(None);
        }
        let from_timed = self.timed.front().is_some_and(|r| r.index == index);
        let taken = if from_timed { self.timed.pop_front() } else { self.scheduled.remove(&(due_ns, index)) };
        let Some(mut request) = taken else {
            // next_key named it a moment ago; nothing to hand out if it vanished.
            return Ok(None);
        };
        self.buffered = self.buffered.saturating_sub(1);
        self.stats.turns_issued += 1;
        match (&request.session_id, self.mode) {
            (Some(id), _) => {
                self.in_flight.insert(request.index, Some(id.clone()));
            }
            // A closed-loop one-turn session frees its slot when it ends.
            (None, LoadMode::Closed { .. }) => {
                self.in_flight.insert(request.index, None);
            }
            // Open loop: nothing waits on an independent request, so it is not tracked (and
            // memory stays flat for traces without sessions).
            (None, LoadMode::Open) => {}
        }
        if request.arrival_ns() != due_ns {
            request.arrival_ms = ns_to_ms(due_ns);
        }
        let settled = self.settle(now_ns);
        self.record(settled)?;
        Ok(Some(request))
    }

    /// The request with trace index `index` reached its terminal outcome at `now_ns`: schedules
    /// its session's next turn, or ends the session (failed/canceled, or no further turn) and in
    /// closed loop starts the next session at `now_ns`.
    pub fn on_terminal(&mut self, index: u64, outcome: TurnOutcome, now_ns: u64) -> Result<(), TraceError> {
        self.check()?;
        self.clock_ns = self.clock_ns.max(now_ns);
        let Some(holder) = self.in_flight.remove(&index) else {
            return Ok(());
        };
        match holder {
            None => self.release_slot(),
            Some(id) => self.turn_ended(id, outcome, now_ns),
        }
        let settled = self.settle(now_ns);
        self.record(settled)
    }

    /// Every request issued or dropped and the trace exhausted.
    pub fn is_exhausted(&self) -> bool {
        self.failure.is_none() && self.trace_done && self.buffered == 0
    }

    pub fn stats(&self) -> WorkloadStats {
        self.stats
    }

    /// Lines of the trace read so far (blank lines counted).
    pub fn trace_lines_read(&self) -> u64 {
        self.trace.lines_read() as u64
    }

    // ----- internals -----

    fn check(&self) -> Result<(), TraceError> {
        match &self.failure {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Keeps the first error, so every later call reports it.
    fn record<T>(&mut self, result: Result<T, TraceError>) -> Result<T, TraceError> {
        if let Err(e) = &result {
            if self.failure.is_none() {
                self.failure = Some(e.clone());
            }
        }
        result
    }

    fn error(&self, line: usize, reason: String) -> TraceError {
        TraceError { path: self.path.clone(), line, reason }
    }

    /// (due ns, index) of the next request to hand out.
    fn next_key(&self) -> Option<(u64, u64)> {
        let timed = self.timed.front().map(|r| (r.arrival_ns(), r.index));
        let scheduled = self.scheduled.keys().next().copied();
        match (timed, scheduled) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn release_slot(&mut self) {
        if matches!(self.mode, LoadMode::Closed { .. }) {
            self.active_sessions = self.active_sessions.saturating_sub(1);
        }
    }

    fn turn_ended(&mut self, id: String, outcome: TurnOutcome, now_ns: u64) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        if outcome.ends_session() {
            let dropped = session.waiting.len();
            session.waiting.clear();
            session.state = SessionState::CutShort;
            self.buffered = self.buffered.saturating_sub(dropped);
            self.stats.turns_dropped += dropped as u64;
            self.stats.sessions_cut_short += 1;
            self.release_slot();
        } else if let Some((next, delay_ns)) = session.waiting.pop_front() {
            // Moves from waiting to scheduled: still one buffered request.
            self.scheduled.insert((now_ns.saturating_add(delay_ns), next.index), next);
        } else if self.trace_done {
            session.state = SessionState::Ended { ended_at_ns: now_ns };
            self.release_slot();
        } else {
            let until_index = session.last_index.saturating_add(self.session_horizon);
            session.state = SessionState::Searching { ended_at_ns: now_ns, until_index };
            self.searching.insert((until_index, id));
        }
    }

    /// Reads ahead until the next due time is certain: every searching session found its next
    /// turn or ended, every free closed-loop slot has a session, and (open loop) no unread
    /// request can be due before the earliest known one.
    fn settle(&mut self, now_ns: u64) -> Result<(), TraceError> {
        loop {
            self.end_passed_searches(now_ns);
            self.start_sessions(now_ns);
            if self.trace_done || !self.needs_reading() {
                return Ok(());
            }
            match self.trace.next_request()? {
                Some(request) => self.take_in(request)?,
                None => self.trace_done = true,
            }
        }
    }

    fn needs_reading(&self) -> bool {
        if !self.searching.is_empty() {
            return true;
        }
        match self.mode {
            // Unread requests are due no earlier than the latest timestamp read (turns of ended
            // or searching sessions aside, handled above): read while that could come first.
            LoadMode::Open => {
                self.timed.is_empty()
                    && self
                        .scheduled
                        .keys()
                        .next()
                        .map_or(true, |&(due_ns, _)| due_ns > self.read_frontier_ns)
            }
            LoadMode::Closed { concurrency } => self.active_sessions < concurrency && self.pending.is_empty(),
        }
    }

    /// Ends the sessions whose horizon the reader has passed, or all of them at the end of the
    /// trace.
    fn end_passed_searches(&mut self, now_ns: u64) {
        while let Some((until_index, _)) = self.searching.first() {
            if !self.trace_done && *until_index >= self.read_count {
                break;
            }
            let Some((_, id)) = self.searching.pop_first() else { break };
            if let Some(session) = self.sessions.get_mut(&id) {
                let ended_at_ns = match session.state {
                    SessionState::Searching { ended_at_ns, .. } => ended_at_ns,
                    _ => now_ns,
                };
                session.state = SessionState::Ended { ended_at_ns };
                self.release_slot();
            }
        }
    }

    /// Closed loop: fills free slots with pending sessions, in file order, due at `now_ns`.
    fn start_sessions(&mut self, now_ns: u64) {
        let LoadMode::Closed { concurrency } = self.mode else { return };
        while self.active_sessions < concurrency {
            let Some(first) = self.pending.pop_front() else { return };
            self.active_sessions += 1;
            if let Some(session) = first.session_id.as_ref().and_then(|id| self.sessions.get_mut(id)) {
                session.state = SessionState::Busy;
            }
            self.scheduled.insert((now_ns, first.index), first);
        }
    }

    /// Counts one more request read ahead, or refuses past the limit.
    fn hold(&mut self, line: usize) -> Result<(), TraceError> {
        if self.buffered >= self.max_buffered {
            let why = match self.searching.first() {
                Some((_, id)) => {
                    let from = self.sessions.get(id).map_or(0, |s| s.last_line);
                    format!("looking for the next turn of session `{id}` (its turn at line {from} ended)")
                }
                None => match self.mode {
                    LoadMode::Open => "looking for the next request due".to_string(),
                    LoadMode::Closed { .. } => "looking for the next session to start".to_string(),
                },
            };
            return Err(self.error(
                line,
                format!(
                    "read-ahead would exceed max_buffered = {} requests while {why} (held: \
                     requests not yet due, turns waiting for their session's previous turn, \
                     sessions waiting for a slot); raise max_buffered",
                    self.max_buffered
                ),
            ));
        }
        self.buffered += 1;
        self.stats.peak_buffered = self.stats.peak_buffered.max(self.buffered);
        Ok(())
    }

    fn take_in(&mut self, request: TraceRequest) -> Result<(), TraceError> {
        self.read_count = request.index.saturating_add(1);
        self.read_frontier_ns = request.arrival_ns();
        let Some(id) = request.session_id.clone() else {
            self.refuse_first_turn_delay(&request, "a request without session_id (a one-turn session)")?;
            return self.take_first_turn(request);
        };
        let Some(session) = self.sessions.get_mut(&id) else {
            self.refuse_first_turn_delay(&request, &format!("the first turn of session `{id}`"))?;
            self.stats.sessions_seen += 1;
            let state = match self.mode {
                LoadMode::Open => SessionState::Busy,
                LoadMode::Closed { .. } => SessionState::Pending,
            };
            self.sessions.insert(
                id,
                Session {
                    last_index: request.index,
                    last_line: request.line,
                    last_arrival_ns: request.arrival_ns(),
                    waiting: VecDeque::new(),
                    state,
                },
            );
            return self.take_first_turn(request);
        };

        // A later turn.
        let delay_ns = match request.delay_ms {
            Some(ms) => ms_to_ns(ms),
            None => request.arrival_ns().saturating_sub(session.last_arrival_ns),
        };
        let previous_line = session.last_line;
        let previous_index = session.last_index;
        session.last_index = request.index;
        session.last_line = request.line;
        session.last_arrival_ns = request.arrival_ns();
        match session.state {
            SessionState::CutShort => {
                self.stats.turns_dropped += 1;
                Ok(())
            }
            SessionState::Pending | SessionState::Busy => {
                self.hold(request.line)?;
                if let Some(session) = self.sessions.get_mut(&id) {
                    session.waiting.push_back((request, delay_ns));
                }
                Ok(())
            }
            SessionState::Searching { ended_at_ns, until_index } => {
                self.hold(request.line)?;
                self.searching.remove(&(until_index, id.clone()));
                if let Some(session) = self.sessions.get_mut(&id) {
                    session.state = SessionState::Busy;
                }
                self.scheduled.insert((ended_at_ns.saturating_add(delay_ns), request.index), request);
                Ok(())
            }
            SessionState::Ended { ended_at_ns } => {
                let due_ns = ended_at_ns.saturating_add(delay_ns);
                let gap = request.index.saturating_sub(previous_index);
                if let LoadMode::Closed { .. } = self.mode {
                    return Err(self.error(
                        request.line,
                        format!(
                            "turn of session `{id}` comes {gap} requests after its previous turn (line \
                             {previous_line}), beyond the session horizon of {} requests \
                             (max_buffered = {}): the session was taken as ended and its closed-loop \
                             slot given to the next session; raise max_buffered",
                            self.session_horizon, self.max_buffered
                        ),
                    ));
                }
                if due_ns < self.clock_ns {
                    return Err(self.error(
                        request.line,
                        format!(
                            "turn of session `{id}` is due at {due_ns} ns but was read at {} ns: it \
                             comes {gap} requests after its previous turn (line {previous_line}), \
                             beyond the session horizon of {} requests (max_buffered = {}), so it \
                             was not looked for in time; raise max_buffered",
                            self.clock_ns, self.session_horizon, self.max_buffered
                        ),
                    ));
                }
                self.hold(request.line)?;
                if let Some(session) = self.sessions.get_mut(&id) {
                    session.state = SessionState::Busy;
                }
                self.scheduled.insert((due_ns, request.index), request);
                Ok(())
            }
        }
    }

    /// An independent request or a first turn: due at its timestamp (open loop) or when a slot
    /// frees (closed loop).
    fn take_first_turn(&mut self, request: TraceRequest) -> Result<(), TraceError> {
        self.hold(request.line)?;
        match self.mode {
            LoadMode::Open => self.timed.push_back(request),
            LoadMode::Closed { .. } => self.pending.push_back(request),
        }
        Ok(())
    }

    fn refuse_first_turn_delay(&self, request: &TraceRequest, what: &str) -> Result<(), TraceError> {
        match request.delay_ms {
            Some(ms) if ms != 0.0 => Err(self.error(
                request.line,
                format!(
                    "`delay` {ms} ms on {what}: a delay is the think time after the session's \
                     previous turn, and a first turn has none"
                ),
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
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
            if let Some((at_ns, index)) = next_end.filter(|&(at_ns, _)| next_due.map_or(true, |d| at_ns <= d))
            {
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
            let issued = drive(&mut w, |_| 5 * MS, |i| if i == 0 { ending } else { TurnOutcome::Completed })
                .expect("ok");
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
        let text =
            trace(&[line(0.0, Some("a"), None), line(1.0, None, None), line(10.0, Some("a"), Some(5.0))]);
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
        let text =
            trace(&[line(0.0, Some("a"), None), line(1.0, Some("b"), None), line(2.0, Some("a"), None)])
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
        assert!(
            e.to_string().contains("taken as ended") && e.to_string().contains("max_buffered = 4"),
            "{e}"
        );
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
        let mut w =
            workload(&(line(0.0, Some("a"), Some(0.0)) + &line(1.0, None, Some(0.0))), LoadMode::Open, 8);
        assert_eq!(drive(&mut w, |_| MS, completed).expect("ok"), vec![(0, 0), (1, MS)]);
    }

    #[test]
    fn same_instant_goes_by_trace_index() {
        // The independent request (index 1) and the session's second turn (index 2, due at
        // 0 + 100 ms) are both due at 100 ms.
        let text =
            trace(&[line(0.0, Some("a"), None), line(100.0, None, None), line(100.0, Some("a"), None)]);
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
}
