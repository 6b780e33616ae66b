//! Session turns: each known session's state, a turn waiting for the one before it, the next
//! turn scheduled when a turn ends, and reading ahead for it up to the session horizon (see
//! the parent module's docs for the rules).

use super::{ms_to_ns, LoadMode, TurnOutcome, Workload};
use crate::adapters::replay::trace::{TraceError, TraceRequest};
use std::collections::VecDeque;

/// Where a known session stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SessionState {
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

pub(super) struct Session {
    /// The latest turn read: its index (for the horizon), line (for messages) and timestamp (for
    /// the next turn's implied delay).
    last_index: u64,
    pub(super) last_line: usize,
    last_arrival_ns: u64,
    /// Turns read whose previous turn has not ended yet, each with its delay in ns.
    waiting: VecDeque<(TraceRequest, u64)>,
    pub(super) state: SessionState,
}

impl Workload {
    /// A turn of session `id`, just read. The first opens the session and waits as any first
    /// turn does; a later one is dropped (the session was cut short), waits for the turn before
    /// it, or is scheduled after the ended turn it follows, by its delay.
    pub(super) fn take_session_turn(&mut self, id: String, request: TraceRequest) -> Result<(), TraceError> {
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
                self.take_turn_after_end(id, request, ended_at_ns, delay_ns, (previous_index, previous_line))
            }
        }
    }

    /// A turn of a session taken as ended (no turn within the horizon): an error in closed
    /// loop, whose slot went to the next session, and in open loop when it is already late;
    /// else it is due `delay_ns` after the previous turn ended. `previous`: that turn's index
    /// and line.
    fn take_turn_after_end(
        &mut self,
        id: String,
        request: TraceRequest,
        ended_at_ns: u64,
        delay_ns: u64,
        previous: (u64, usize),
    ) -> Result<(), TraceError> {
        let (previous_index, previous_line) = previous;
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

    pub(super) fn turn_ended(&mut self, id: String, outcome: TurnOutcome, now_ns: u64) {
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

    /// Ends the sessions whose horizon the reader has passed, or all of them at the end of the
    /// trace.
    pub(super) fn end_passed_searches(&mut self, now_ns: u64) {
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
}
