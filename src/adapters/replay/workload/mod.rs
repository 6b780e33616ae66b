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
//!
//! This file holds the API, open loop, the closed loop's slots and reading ahead; session turns
//! (states, the horizon, a turn after an ended one) are in `sessions`.

use crate::adapters::replay::trace::{TraceError, TraceReader, TraceRequest};
use crate::events::fact::TerminalStatus;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::BufRead;
use std::path::PathBuf;

mod sessions;
#[cfg(test)]
mod tests;

use sessions::{Session, SessionState};

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

    /// A session (or one-turn request) let go of its closed-loop slot.
    fn release_slot(&mut self) {
        if matches!(self.mode, LoadMode::Closed { .. }) {
            self.active_sessions = self.active_sessions.saturating_sub(1);
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

    /// A request just read: a one-turn request waits for its timestamp (open loop) or for a
    /// slot (closed loop); a turn of a session goes to its session (`sessions`).
    fn take_in(&mut self, request: TraceRequest) -> Result<(), TraceError> {
        self.read_count = request.index.saturating_add(1);
        self.read_frontier_ns = request.arrival_ns();
        let Some(id) = request.session_id.clone() else {
            self.refuse_first_turn_delay(&request, "a request without session_id (a one-turn session)")?;
            return self.take_first_turn(request);
        };
        self.take_session_turn(id, request)
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
