//! NIC bandwidth shared between concurrent KV transfers (processor sharing), off by default.
//!
//! `BandwidthTransfer` gives every transfer the whole link, so handoffs never slow one another.
//! Here each worker owns a NIC; a transfer waits for a concurrency slot on both its NICs, pays a
//! fixed latency, then moves its bytes at the bottleneck fair share
//! `min(bw(source) / moving(source), bw(destination) / moving(destination))`. Rates change only at
//! events (start, finish, cancel, latency end), so bytes drain linearly in between and only the
//! transfers on the two NICs an event touches need new rates. Off by default so replay figures
//! stay comparable with the reference, which has no contention.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::adapters::replay::transfer::{BandwidthTransfer, MIN_BANDWIDTH_GBPS};

/// Transfers the model holds at once (in flight plus finished but not yet handed back), so a
/// runaway caller gets an error instead of unbounded memory.
pub const MAX_TRANSFERS: usize = 1_000_000;

/// Contention settings as configured, e.g. in JSON:
/// `{"enabled": true, "nic_bandwidth_gbps": 25, "workers": {"decode-1": {"bandwidth_gbps": 50}}}`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ContentionConfig {
    /// Share NIC bandwidth between concurrent transfers; false keeps the fixed per-transfer delay.
    pub enabled: bool,
    /// Every worker's NIC bandwidth in GB/s (1 GB/s = 1 byte/ns); None = the link's `bandwidth_gbps`.
    pub nic_bandwidth_gbps: Option<f64>,
    /// Every worker's fixed per-transfer latency; None = the link's `latency_ns`.
    pub latency_ns: Option<u64>,
    /// Transfers a NIC admits at once (queued ones wait in arrival order); None = unbounded.
    pub max_concurrent_per_worker: Option<u32>,
    /// Per-worker NIC overrides, keyed by worker name such as "prefill-0" or "decode-1".
    pub workers: BTreeMap<String, NicOverride>,
}

/// One worker's NIC, where it differs from the shared settings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NicOverride {
    /// This NIC's bandwidth in GB/s; None = `nic_bandwidth_gbps`.
    pub bandwidth_gbps: Option<f64>,
    /// This NIC's latency; None = the shared `latency_ns`.
    pub latency_ns: Option<u64>,
}

fn check_bandwidth(field: &str, bandwidth_gbps: Option<f64>) -> Result<(), String> {
    match bandwidth_gbps {
        Some(bw) if !(bw.is_finite() && bw >= MIN_BANDWIDTH_GBPS) => Err(format!(
            "contention: {field} must be a finite number >= {MIN_BANDWIDTH_GBPS} (1 MB/s), got {bw}"
        )),
        _ => Ok(()),
    }
}

impl ContentionConfig {
    /// Checks values even when disabled, so a typo does not wait until someone turns it on.
    pub fn validate(&self, worker_names: &[String]) -> Result<(), String> {
        check_bandwidth("nic_bandwidth_gbps", self.nic_bandwidth_gbps)?;
        if self.max_concurrent_per_worker == Some(0) {
            return Err("contention: max_concurrent_per_worker must be >= 1".into());
        }
        for (name, nic) in &self.workers {
            if !worker_names.contains(name) {
                return Err(format!(
                    "contention: workers.{name} names no worker; workers are: {}",
                    worker_names.join(", ")
                ));
            }
            check_bandwidth(&format!("workers.{name}.bandwidth_gbps"), nic.bandwidth_gbps)?;
        }
        Ok(())
    }
}

/// A finished transfer and where its time went; the four spans add up to finish - start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completed {
    pub key: u64,
    pub finished_at_ns: u64,
    /// Waiting for a concurrency slot on both NICs.
    pub queued_ns: u64,
    /// The fixed latency paid after admission.
    pub latency_ns: u64,
    /// Moving bytes, at whatever share the NICs gave.
    pub moving_ns: u64,
    pub bytes: u64,
}

struct Nic {
    bandwidth_gbps: f64,
    latency_ns: u64,
    /// Transfers holding a slot (in latency or moving).
    admitted: u64,
    /// Queued transfers that need this NIC; each reserves a slot against later arrivals.
    waiting: u64,
    /// Keys of transfers moving bytes here; its length divides the bandwidth.
    moving: BTreeSet<u64>,
}

impl Nic {
    /// `name`'s NIC: its own override, else the shared settings, else the link's.
    fn configured(config: &ContentionConfig, name: &str, link: &BandwidthTransfer) -> Self {
        let nic = config.workers.get(name).copied().unwrap_or_default();
        Nic {
            bandwidth_gbps: nic.bandwidth_gbps.or(config.nic_bandwidth_gbps).unwrap_or(link.bandwidth_gbps),
            latency_ns: nic.latency_ns.or(config.latency_ns).unwrap_or(link.latency_ns),
            admitted: 0,
            waiting: 0,
            moving: BTreeSet::new(),
        }
    }

    fn share_bytes_per_ns(&self) -> f64 {
        self.bandwidth_gbps / self.moving.len().max(1) as f64
    }
}

enum Phase {
    Queued,
    Latency,
    Moving {
        since_ns: u64,
        remaining_bytes: f64,
        rate_bytes_per_ns: f64,
        updated_at_ns: u64,
        solo_finish_ns: u64,
    },
}

struct Transfer {
    /// Arrival order: breaks ties between events at one instant and orders the queue.
    sequence: u64,
    source: usize,
    destination: usize,
    bytes: u64,
    started_at_ns: u64,
    admitted_at_ns: u64,
    latency_ns: u64,
    phase: Phase,
    /// The instant of this transfer's entry in `ContentionModel::due`, if any.
    due_ns: Option<u64>,
}

/// Processor-sharing transfer timing over one NIC per worker.
pub struct ContentionModel {
    nics: Vec<Nic>,
    slots_per_nic: u64,
    transfers: BTreeMap<u64, Transfer>,
    /// Queued transfers by arrival: sequence → key.
    waiting: BTreeMap<u64, u64>,
    /// Pending latency ends and finishes: (instant, sequence, key).
    due: BTreeSet<(u64, u64, u64)>,
    /// Finished while handling a start or cancel; handed back by the next `advance`.
    outbox: Vec<Completed>,
    now_ns: u64,
    next_sequence: u64,
}

/// `at_ns` + `bytes` / `rate`, rounded up to whole ns and saturating (a zero rate never finishes
/// before the end of time).
fn instant_after(at_ns: u64, bytes: f64, rate_bytes_per_ns: f64) -> u64 {
    if bytes <= 0.0 {
        return at_ns;
    }
    let wire_ns = (bytes / rate_bytes_per_ns).ceil();
    // NaN, infinity and anything past u64 all saturate.
    if wire_ns.is_nan() || wire_ns >= u64::MAX as f64 {
        return u64::MAX;
    }
    at_ns.saturating_add(wire_ns as u64)
}

impl ContentionModel {
    /// One NIC per index of `nic_names`; unset values fall back to `link`.
    pub fn new(
        config: &ContentionConfig,
        nic_names: Vec<String>,
        link: &BandwidthTransfer,
    ) -> Result<Self, String> {
        link.validate().map_err(|e| e.to_string())?;
        config.validate(&nic_names)?;
        let mut seen = BTreeSet::new();
        if let Some(name) = nic_names.iter().find(|name| !seen.insert(name.as_str())) {
            return Err(format!("contention: worker name {name} appears twice"));
        }
        let nics = nic_names.iter().map(|name| Nic::configured(config, name, link)).collect();
        Ok(ContentionModel {
            nics,
            slots_per_nic: config.max_concurrent_per_worker.map_or(u64::MAX, u64::from),
            transfers: BTreeMap::new(),
            waiting: BTreeMap::new(),
            due: BTreeSet::new(),
            outbox: Vec::new(),
            now_ns: 0,
            next_sequence: 0,
        })
    }

    /// A worker joined the cluster: its NIC gets the next index (the replay's slot for it),
    /// configured as `new` would have.
    pub fn add_nic(&mut self, config: &ContentionConfig, name: &str, link: &BandwidthTransfer) -> usize {
        self.nics.push(Nic::configured(config, name, link));
        self.nics.len() - 1
    }

    /// Transfers started and neither finished nor cancelled.
    pub fn in_flight(&self) -> usize {
        self.transfers.len()
    }

    /// Starts moving `bytes` from NIC `source` to NIC `destination`. Refused, leaving the model
    /// unchanged, for a key in flight, an unknown or shared NIC, time going backwards, or a full
    /// model. Events due at or before `at_ns` are handled first.
    pub fn start(
        &mut self,
        at_ns: u64,
        key: u64,
        source: usize,
        destination: usize,
        bytes: u64,
    ) -> Result<(), String> {
        if at_ns < self.now_ns {
            return Err(format!(
                "transfer {key}: starts at {at_ns} ns, before the model's {} ns",
                self.now_ns
            ));
        }
        if self.transfers.contains_key(&key) {
            return Err(format!("transfer {key}: key already in flight"));
        }
        if let Some(nic) = [source, destination].into_iter().find(|&nic| nic >= self.nics.len()) {
            return Err(format!("transfer {key}: NIC {nic} unknown; there are {}", self.nics.len()));
        }
        if source == destination {
            return Err(format!("transfer {key}: source and destination are both NIC {source}"));
        }
        if self.transfers.len() + self.outbox.len() >= MAX_TRANSFERS {
            return Err(format!("transfer {key}: the model already holds {MAX_TRANSFERS} transfers"));
        }
        self.settle(at_ns);
        self.now_ns = at_ns;
        let sequence = self.next_sequence;
        self.next_sequence += 1;
        let latency_ns = self.nics[source].latency_ns.max(self.nics[destination].latency_ns);
        let transfer = Transfer {
            sequence,
            source,
            destination,
            bytes,
            started_at_ns: at_ns,
            admitted_at_ns: at_ns,
            latency_ns,
            phase: Phase::Queued,
            due_ns: None,
        };
        self.transfers.insert(key, transfer);
        // Every queued transfer arrived earlier, so each one's reservation counts against this one.
        let fits = |nic: &Nic| self.slots_per_nic.saturating_sub(nic.admitted) > nic.waiting;
        if fits(&self.nics[source]) && fits(&self.nics[destination]) {
            self.admit(at_ns, key);
        } else {
            self.waiting.insert(sequence, key);
            self.nics[source].waiting += 1;
            self.nics[destination].waiting += 1;
        }
        Ok(())
    }

    /// Drops a queued or moving transfer, freeing its slot and share. False if it is not in
    /// flight, including when it finished at or before `at_ns` (its completion is still reported).
    /// An `at_ns` in the past is taken as the model's present: freeing late beats not freeing.
    pub fn cancel(&mut self, at_ns: u64, key: u64) -> bool {
        let at_ns = at_ns.max(self.now_ns);
        self.settle(at_ns);
        self.now_ns = at_ns;
        self.remove(at_ns, key).is_some()
    }

    /// The earliest instant the model needs `advance`: a latency end or a finish, or the present
    /// if a start or cancel already finished transfers that are waiting to be handed back.
    pub fn next_event_ns(&self) -> Option<u64> {
        if !self.outbox.is_empty() {
            return Some(self.now_ns);
        }
        self.due.first().map(|&(at_ns, _, _)| at_ns)
    }

    /// Handles everything due at or before `at_ns` in time order (ties by start order) and
    /// returns the transfers finished, in finish order. An `at_ns` in the past changes nothing.
    pub fn advance(&mut self, at_ns: u64) -> Vec<Completed> {
        if at_ns < self.now_ns {
            return Vec::new();
        }
        self.settle(at_ns);
        self.now_ns = at_ns;
        std::mem::take(&mut self.outbox)
    }

    fn settle(&mut self, until_ns: u64) {
        while let Some(&(at_ns, _, key)) = self.due.first() {
            if at_ns > until_ns {
                break;
            }
            self.due.pop_first();
            let Some(transfer) = self.transfers.get_mut(&key) else { continue };
            transfer.due_ns = None;
            match transfer.phase {
                Phase::Latency if transfer.bytes > 0 => {
                    let (source, destination) = (transfer.source, transfer.destination);
                    let solo_bytes_per_ns =
                        self.nics[source].bandwidth_gbps.min(self.nics[destination].bandwidth_gbps);
                    transfer.phase = Phase::Moving {
                        since_ns: at_ns,
                        remaining_bytes: transfer.bytes as f64,
                        rate_bytes_per_ns: 0.0,
                        updated_at_ns: at_ns,
                        // No share beats having both NICs alone; holding to that keeps float
                        // drift from finishing a transfer early.
                        solo_finish_ns: instant_after(at_ns, transfer.bytes as f64, solo_bytes_per_ns),
                    };
                    self.nics[source].moving.insert(key);
                    self.nics[destination].moving.insert(key);
                    self.reshare(at_ns, source, destination);
                }
                Phase::Latency | Phase::Moving { .. } => self.finish(at_ns, key),
                Phase::Queued => {}
            }
        }
    }

    fn finish(&mut self, at_ns: u64, key: u64) {
        let Some(transfer) = self.remove(at_ns, key) else { return };
        let moving_since_ns = match transfer.phase {
            Phase::Moving { since_ns, .. } => since_ns,
            _ => at_ns,
        };
        self.outbox.push(Completed {
            key,
            finished_at_ns: at_ns,
            queued_ns: transfer.admitted_at_ns.saturating_sub(transfer.started_at_ns),
            latency_ns: moving_since_ns.saturating_sub(transfer.admitted_at_ns),
            moving_ns: at_ns.saturating_sub(moving_since_ns),
            bytes: transfer.bytes,
        });
    }

    /// Takes a transfer out wherever it is, handing its share and slot to the others.
    fn remove(&mut self, at_ns: u64, key: u64) -> Option<Transfer> {
        let transfer = self.transfers.remove(&key)?;
        if let Some(due_ns) = transfer.due_ns {
            self.due.remove(&(due_ns, transfer.sequence, key));
        }
        let (source, destination) = (transfer.source, transfer.destination);
        match transfer.phase {
            Phase::Queued => {
                self.waiting.remove(&transfer.sequence);
                self.nics[source].waiting -= 1;
                self.nics[destination].waiting -= 1;
            }
            Phase::Latency | Phase::Moving { .. } => {
                self.nics[source].admitted -= 1;
                self.nics[destination].admitted -= 1;
            }
        }
        if let Phase::Moving { .. } = transfer.phase {
            self.nics[source].moving.remove(&key);
            self.nics[destination].moving.remove(&key);
            self.reshare(at_ns, source, destination);
        }
        self.admit_waiting(at_ns);
        Some(transfer)
    }

    fn admit(&mut self, at_ns: u64, key: u64) {
        let Some(transfer) = self.transfers.get_mut(&key) else { return };
        transfer.admitted_at_ns = at_ns;
        transfer.phase = Phase::Latency;
        let latency_end_ns = at_ns.saturating_add(transfer.latency_ns);
        transfer.due_ns = Some(latency_end_ns);
        self.due.insert((latency_end_ns, transfer.sequence, key));
        self.nics[transfer.source].admitted += 1;
        self.nics[transfer.destination].admitted += 1;
    }

    /// Admits queued transfers in arrival order. Each one still waiting reserves a slot on both
    /// its NICs, so it blocks later arrivals on those NICs only and cannot be starved by them.
    fn admit_waiting(&mut self, at_ns: u64) {
        if self.waiting.is_empty() {
            return;
        }
        let mut claimed = vec![0u64; self.nics.len()];
        let mut admitted = Vec::new();
        for (&sequence, &key) in &self.waiting {
            let Some(transfer) = self.transfers.get(&key) else { continue };
            let (source, destination) = (transfer.source, transfer.destination);
            let fits = |nic: usize| self.slots_per_nic.saturating_sub(self.nics[nic].admitted) > claimed[nic];
            if fits(source) && fits(destination) {
                admitted.push((sequence, key, source, destination));
            }
            claimed[source] += 1;
            claimed[destination] += 1;
        }
        for (sequence, key, source, destination) in admitted {
            self.waiting.remove(&sequence);
            self.nics[source].waiting -= 1;
            self.nics[destination].waiting -= 1;
            self.admit(at_ns, key);
        }
    }

    /// Gives every transfer moving on NIC `first` or `second` its new fair share from `at_ns`.
    fn reshare(&mut self, at_ns: u64, first: usize, second: usize) {
        let keys: BTreeSet<u64> =
            self.nics[first].moving.iter().chain(&self.nics[second].moving).copied().collect();
        for key in keys {
            let Some(transfer) = self.transfers.get_mut(&key) else { continue };
            let rate = self.nics[transfer.source]
                .share_bytes_per_ns()
                .min(self.nics[transfer.destination].share_bytes_per_ns());
            let Phase::Moving { remaining_bytes, rate_bytes_per_ns, updated_at_ns, solo_finish_ns, .. } =
                &mut transfer.phase
            else {
                continue;
            };
            let elapsed_ns = at_ns.saturating_sub(*updated_at_ns) as f64;
            *remaining_bytes = (*remaining_bytes - *rate_bytes_per_ns * elapsed_ns).max(0.0);
            *rate_bytes_per_ns = rate;
            *updated_at_ns = at_ns;
            let finish_ns = instant_after(at_ns, *remaining_bytes, rate).max(*solo_finish_ns);
            if let Some(old_ns) = transfer.due_ns.replace(finish_ns) {
                self.due.remove(&(old_ns, transfer.sequence, key));
            }
            self.due.insert((finish_ns, transfer.sequence, key));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::replay::transfer::TransferModel;
    use proptest::prelude::*;

    fn names(count: usize) -> Vec<String> {
        (0..count).map(|i| format!("worker-{i}")).collect()
    }

    fn link(bandwidth_gbps: f64, latency_ns: u64) -> BandwidthTransfer {
        BandwidthTransfer { bandwidth_gbps, kv_bytes_per_token: 1, latency_ns }
    }

    fn model(nics: usize, bandwidth_gbps: f64, latency_ns: u64, slots: Option<u32>) -> ContentionModel {
        let config = ContentionConfig { max_concurrent_per_worker: slots, ..Default::default() };
        ContentionModel::new(&config, names(nics), &link(bandwidth_gbps, latency_ns)).unwrap()
    }

    /// Advances to the end of time and returns (key, finished_at_ns, queued_ns) in finish order.
    fn drain(model: &mut ContentionModel) -> Vec<(u64, u64, u64)> {
        model.advance(u64::MAX).into_iter().map(|c| (c.key, c.finished_at_ns, c.queued_ns)).collect()
    }

    #[test]
    fn one_transfer_alone_matches_bandwidth_transfer() {
        for (bandwidth_gbps, latency_ns, bytes) in [(3.0, 700, 1000), (64.0, 0, 131_072_000), (7.3, 11, 1)] {
            let mut m = model(2, bandwidth_gbps, latency_ns, None);
            m.start(100, 9, 0, 1, bytes).unwrap();
            assert_eq!(m.next_event_ns(), Some(100 + latency_ns));
            let expected = link(bandwidth_gbps, latency_ns).transfer_ns(bytes);
            let done = m.advance(u64::MAX);
            assert_eq!(done.len(), 1);
            assert_eq!(done[0].finished_at_ns, 100 + expected);
            assert_eq!((done[0].queued_ns, done[0].latency_ns, done[0].bytes), (0, latency_ns, bytes));
            assert_eq!(done[0].moving_ns, expected - latency_ns);
        }
        // Zero bytes finish when the latency ends.
        let mut m = model(2, 1.0, 50, None);
        m.start(0, 1, 0, 1, 0).unwrap();
        assert_eq!(drain(&mut m), vec![(1, 50, 0)]);
    }

    #[test]
    fn one_source_shared_by_two_transfers() {
        // 1000 B at 1 GB/s takes 1000 ns alone; two at once share the source: 2000 ns each.
        let mut m = model(3, 1.0, 0, None);
        m.start(0, 1, 0, 1, 1000).unwrap();
        m.start(0, 2, 0, 2, 1000).unwrap();
        assert_eq!(drain(&mut m), vec![(1, 2000, 0), (2, 2000, 0)]);
        // The second starts at 500: the first has 500 B left at 0.5 B/ns, done at 1500; by then
        // the second moved 500 B, and its other 500 B go at the full 1 B/ns, done at 2000.
        let mut m = model(3, 1.0, 0, None);
        m.start(0, 1, 0, 1, 1000).unwrap();
        assert!(m.advance(500).is_empty());
        m.start(500, 2, 0, 2, 1000).unwrap();
        assert_eq!(m.next_event_ns(), Some(500));
        assert!(m.advance(500).is_empty());
        assert_eq!(m.next_event_ns(), Some(1500));
        assert_eq!(drain(&mut m), vec![(1, 1500, 0), (2, 2000, 0)]);
    }

    #[test]
    fn each_transfer_gets_its_tighter_nics_share() {
        // NIC 1 carries B and C, NIC 2 carries A and B: every rate is 0.5 B/ns at first. B's
        // 600 B are done at 1200; A and C then have both their NICs alone for their last 600 B.
        let mut m = model(4, 1.0, 0, None);
        m.start(0, 1, 0, 2, 1200).unwrap();
        m.start(0, 2, 1, 2, 600).unwrap();
        m.start(0, 3, 1, 3, 1200).unwrap();
        assert_eq!(drain(&mut m), vec![(2, 1200, 0), (1, 1800, 0), (3, 1800, 0)]);
    }

    #[test]
    fn one_slot_queues_in_arrival_order_without_blocking_other_nics() {
        let mut m = model(6, 1.0, 0, Some(1));
        m.start(0, 1, 0, 1, 1000).unwrap();
        m.start(0, 2, 0, 2, 1000).unwrap(); // waits for NIC 0, reserving NIC 2
        m.start(0, 3, 3, 4, 1000).unwrap(); // other NICs: not held up
        m.start(0, 4, 5, 2, 1000).unwrap(); // NIC 2 is reserved by transfer 2, so it waits
        assert_eq!(drain(&mut m), vec![(1, 1000, 0), (3, 1000, 0), (2, 2000, 1000), (4, 3000, 2000)]);
    }

    #[test]
    fn cancel_frees_bandwidth_and_slots() {
        let mut m = model(3, 1.0, 0, None);
        m.start(0, 1, 0, 1, 1000).unwrap();
        m.start(0, 2, 0, 2, 1000).unwrap();
        // At 500 each has moved 250 B; alone again, the first moves its last 750 B by 1250.
        assert!(m.cancel(500, 2));
        assert!(!m.cancel(500, 2));
        assert_eq!(drain(&mut m), vec![(1, 1250, 0)]);
        // A cancelled queued transfer gives its turn to the next one.
        let mut m = model(3, 1.0, 0, Some(1));
        m.start(0, 1, 0, 1, 1000).unwrap();
        m.start(0, 2, 0, 2, 1000).unwrap();
        m.start(0, 3, 0, 2, 1000).unwrap();
        assert!(m.cancel(10, 2));
        assert_eq!(drain(&mut m), vec![(1, 1000, 0), (3, 2000, 1000)]);
    }

    #[test]
    fn bad_input_is_refused_and_absurd_values_saturate() {
        let mut m = model(2, 1.0, 0, None);
        m.start(10, 1, 0, 1, 5).unwrap();
        assert!(m.start(10, 1, 0, 1, 5).is_err(), "duplicate key");
        assert!(m.start(10, 2, 0, 2, 5).is_err(), "unknown NIC");
        assert!(m.start(10, 2, 1, 1, 5).is_err(), "same NIC");
        assert!(m.start(9, 2, 1, 0, 5).is_err(), "time went backwards");
        assert!(m.advance(9).is_empty());
        assert_eq!(m.in_flight(), 1);
        assert_eq!(drain(&mut m), vec![(1, 15, 0)]);
        // The slowest link and longest latency the configuration allows, and a transfer of
        // u64::MAX bytes: the finish saturates at the end of time instead of wrapping.
        let mut m = model(2, MIN_BANDWIDTH_GBPS, crate::adapters::replay::transfer::MAX_TRANSFER_NS, None);
        m.start(5, 1, 0, 1, u64::MAX).unwrap();
        m.start(5, 2, 1, 0, u64::MAX).unwrap();
        let latency_ends = 5 + crate::adapters::replay::transfer::MAX_TRANSFER_NS;
        assert_eq!(m.next_event_ns(), Some(latency_ends));
        assert_eq!(drain(&mut m), vec![(1, u64::MAX, 0), (2, u64::MAX, 0)]);
        assert_eq!(m.next_event_ns(), None);
    }

    #[test]
    fn config_defaults_parse_and_validation_names_workers() {
        let c: ContentionConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(c, ContentionConfig::default());
        assert!(!c.enabled);
        assert!(serde_json::from_str::<ContentionConfig>(r#"{"enable":true}"#).is_err());
        assert!(serde_json::from_str::<ContentionConfig>(r#"{"workers":{"a":{"bw":1}}}"#).is_err());
        let c: ContentionConfig = serde_json::from_str(
            r#"{"enabled":true,"nic_bandwidth_gbps":2,"workers":{"worker-1":{"bandwidth_gbps":4,"latency_ns":9}}}"#,
        )
        .unwrap();
        // NIC 0 at 2 GB/s is the bottleneck; NIC 1's 9 ns latency is the larger.
        let mut m = ContentionModel::new(&c, names(2), &link(1.0, 3)).unwrap();
        m.start(0, 1, 0, 1, 1000).unwrap();
        assert_eq!(drain(&mut m), vec![(1, 509, 0)]);
        let e = c.validate(&["prefill-0".into(), "decode-0".into()]).unwrap_err();
        assert!(e.contains("worker-1") && e.contains("prefill-0, decode-0"), "{e}");
        for bandwidth_gbps in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let c = ContentionConfig { nic_bandwidth_gbps: Some(bandwidth_gbps), ..Default::default() };
            assert!(c.validate(&names(2)).is_err());
            let nic = NicOverride { bandwidth_gbps: Some(bandwidth_gbps), latency_ns: None };
            let c = ContentionConfig { workers: [("worker-0".into(), nic)].into(), ..Default::default() };
            assert!(c.validate(&names(2)).is_err());
        }
        let c = ContentionConfig { max_concurrent_per_worker: Some(0), ..Default::default() };
        assert!(c.validate(&names(2)).is_err());
        assert!(ContentionModel::new(
            &ContentionConfig::default(),
            vec!["a".into(), "a".into()],
            &link(1.0, 0)
        )
        .is_err());
    }

    #[derive(Clone, Debug)]
    enum Operation {
        Start { after_ns: u64, source: usize, shift: usize, bytes: u64 },
        Cancel { after_ns: u64, pick: usize },
        Advance { after_ns: u64 },
    }

    const NICS: usize = 4;

    fn op() -> impl Strategy<Value = Operation> {
        prop_oneof![
            3 => (0u64..2_000, 0..NICS, 1..NICS, 0u64..50_000)
                .prop_map(|(after_ns, source, shift, bytes)| Operation::Start { after_ns, source, shift, bytes }),
            1 => (0u64..2_000, any::<usize>()).prop_map(|(after_ns, pick)| Operation::Cancel { after_ns, pick }),
            2 => (0u64..5_000).prop_map(|after_ns| Operation::Advance { after_ns }),
        ]
    }

    fn config() -> impl Strategy<Value = ContentionConfig> {
        let nic = (prop::sample::select(vec![0.5, 1.0, 3.0, 64.0]), 0u64..1_000).prop_map(
            |(bandwidth_gbps, latency_ns)| NicOverride {
                bandwidth_gbps: Some(bandwidth_gbps),
                latency_ns: Some(latency_ns),
            },
        );
        (prop::collection::vec(nic, NICS), prop::option::of(1u32..3)).prop_map(|(nics, slots)| {
            ContentionConfig {
                enabled: true,
                max_concurrent_per_worker: slots,
                workers: names(NICS).into_iter().zip(nics).collect(),
                ..Default::default()
            }
        })
    }

    struct Run {
        /// Each advance call's instant and what it returned.
        batches: Vec<(u64, Vec<Completed>)>,
        /// key → (started_at_ns, source, destination, bytes).
        started: BTreeMap<u64, (u64, usize, usize, u64)>,
        cancelled: BTreeSet<u64>,
        in_flight_after: usize,
        next_event_after: Option<u64>,
    }

    fn run(config: &ContentionConfig, ops: &[Operation]) -> Run {
        let mut m = ContentionModel::new(config, names(NICS), &link(1.0, 0)).unwrap();
        let (mut now_ns, mut batches, mut started, mut cancelled) =
            (0, vec![], BTreeMap::new(), BTreeSet::new());
        for op in ops {
            match *op {
                Operation::Start { after_ns, source, shift, bytes } => {
                    now_ns += after_ns;
                    let (key, destination) = (started.len() as u64, (source + shift) % NICS);
                    m.start(now_ns, key, source, destination, bytes).unwrap();
                    started.insert(key, (now_ns, source, destination, bytes));
                }
                Operation::Cancel { after_ns, pick } => {
                    now_ns += after_ns;
                    let key = (pick % started.len().max(1)) as u64;
                    if m.cancel(now_ns, key) {
                        cancelled.insert(key);
                    }
                }
                Operation::Advance { after_ns } => {
                    now_ns += after_ns;
                    batches.push((now_ns, m.advance(now_ns)));
                }
            }
        }
        batches.push((u64::MAX, m.advance(u64::MAX)));
        Run {
            batches,
            started,
            cancelled,
            in_flight_after: m.in_flight(),
            next_event_after: m.next_event_ns(),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
        #[test]
        fn transfers_conserve_bytes_respect_bounds_and_replay_identically(
            config in config(),
            ops in prop::collection::vec(op(), 1..120),
        ) {
            let r = run(&config, &ops);
            let nic = |i: usize| config.workers[&names(NICS)[i]];
            let mut last_finish_ns = 0;
            let mut seen = BTreeSet::new();
            for (called_at_ns, batch) in &r.batches {
                for c in batch {
                    prop_assert!(seen.insert(c.key), "{} completed twice", c.key);
                    prop_assert!(!r.cancelled.contains(&c.key), "{} completed after cancel", c.key);
                    prop_assert!(c.finished_at_ns >= last_finish_ns && c.finished_at_ns <= *called_at_ns);
                    last_finish_ns = c.finished_at_ns;
                    let (started_at_ns, source, destination, bytes) = r.started[&c.key];
                    prop_assert_eq!(c.bytes, bytes);
                    prop_assert_eq!(c.queued_ns + c.latency_ns + c.moving_ns, c.finished_at_ns - started_at_ns);
                    let latency_ns = nic(source).latency_ns.max(nic(destination).latency_ns).unwrap();
                    prop_assert_eq!(c.latency_ns, latency_ns);
                    let solo_gbps = nic(source).bandwidth_gbps.unwrap().min(nic(destination).bandwidth_gbps.unwrap());
                    let solo = link(solo_gbps, 0).transfer_ns(bytes);
                    prop_assert!(c.moving_ns >= solo, "{:?} faster than alone ({} ns)", c, solo);
                }
            }
            let expected: BTreeSet<u64> = r.started.keys().copied().filter(|k| !r.cancelled.contains(k)).collect();
            prop_assert_eq!(seen, expected);
            prop_assert_eq!(r.in_flight_after, 0);
            prop_assert_eq!(r.next_event_after, None);
            let again = run(&config, &ops);
            prop_assert_eq!(&again.batches, &r.batches);
            prop_assert_eq!(&again.cancelled, &r.cancelled);
        }
    }
}
