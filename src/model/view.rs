//! The scheduler's queues as counts: what an engine core reports and the scheduler-view fold
//! must reproduce from the core's facts.

/// The scheduler's queues, as counts. The scheduler-view fold must reproduce them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SchedulerView {
    pub waiting: u64,
    pub running: u64,
    /// Reserved destinations waiting for remote KV (`WAITING_FOR_REMOTE_KVS`).
    pub waiting_for_remote_kv: u64,
    /// Finished prefills whose KV is pinned for a reader.
    pub held_prefills: u64,
    /// Reservations waiting in the pending FIFO.
    pub pending_reservations: u64,
}
