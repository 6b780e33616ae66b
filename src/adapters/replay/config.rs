//! Replay configuration: cluster shape, backend engine settings, lifecycle timeouts, transfer
//! timing and routing. Read from a JSON file (`--config`), with command-line flags on top.
//! Unknown keys are errors, so a typo never silently falls back to a default.

use crate::adapters::replay::contention::ContentionConfig;
use crate::adapters::replay::faults::FaultSpec;
use crate::adapters::replay::scaling::{PlannerConfig, ScaleEntry};
use crate::adapters::replay::transfer::TransferConfig;
use crate::adapters::replay::workload::LoadMode;
use crate::ids::{Backend, HandoffPolicy};
use crate::router::RouterMode;
use crate::schedulers::sglang::SglangConfig;
use crate::schedulers::vllm::VllmConfig;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Everything a replay needs besides the trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplayConfig {
    pub backend: Backend,
    /// `None`: the backend's native policy (vLLM source-first, SGLang destination-first).
    /// `Disabled` on a disaggregated cluster is the behaviour before the handoff lifecycle: the
    /// prefill frees its KV when it finishes, decode gets the request after the modeled
    /// transfer delay and allocates only when it admits it; nothing is pinned or reserved.
    pub policy: Option<HandoffPolicy>,
    /// Disaggregated shape. Both zero means aggregated serving with `workers` workers.
    pub prefill_workers: u32,
    pub decode_workers: u32,
    /// Aggregated serving (no handoff) when the disaggregated counts are zero.
    pub workers: u32,
    pub prefill_router: RouterMode,
    pub decode_router: RouterMode,
    /// The run's one seed: HandoffIds, random routing, everything.
    pub seed: u64,
    pub vllm: VllmConfig,
    pub sglang: SglangConfig,
    /// Per-role engine settings; a role without its own uses `vllm` / `sglang`.
    pub prefill_vllm: Option<VllmConfig>,
    pub decode_vllm: Option<VllmConfig>,
    pub prefill_sglang: Option<SglangConfig>,
    pub decode_sglang: Option<SglangConfig>,
    pub transfer: TransferConfig,
    /// Transfers sharing a worker's NIC share its bandwidth (off by default, so figures stay
    /// comparable with the reference, whose transfers never contend). Needs the bandwidth
    /// transfer model.
    pub contention: ContentionConfig,
    /// When requests arrive: `"open"` (trace timestamps; sessions' later turns after the
    /// previous turn ends plus its delay) or `{"closed": {"concurrency": N}}` (N sessions at a
    /// time, the next starting when one ends). `--concurrency N` on the command line.
    pub load: LoadMode,
    /// Trace requests read ahead and not yet issued (session turns waiting for their previous
    /// turn, sessions waiting for a closed-loop slot) before the replay refuses the trace.
    pub max_buffered_requests: usize,
    /// Source lease (vLLM's abort timeout, default 480 s).
    pub lease_ms: u64,
    /// When set, the destination renews the source lease every `lease_renew_ms` while it
    /// waits, each renewal extending the deadline to now + ⅔·`lease_ms` (vLLM's lease design:
    /// `lease_ms` 30000 with a renewal every sixth of it, `fixtures/configs/vllm-lease.json`).
    pub lease_renew_ms: Option<u64>,
    /// Destination reservation deadline after it is reserved (SGLang's waiting timeout, 300 s).
    pub reservation_timeout_ms: u64,
    /// Destination-first: a prefill still waiting for its destination after this long fails
    /// (SGLang's bootstrap timeout, 300 s).
    pub bootstrap_timeout_ms: u64,
    /// Divides trace timestamps.
    pub arrival_speedup: f64,
    /// Most requests in flight before arrivals are held back (a limit on every queue).
    pub max_in_flight: usize,
    /// Faults to inject (see `faults`): empty for a fault-free run.
    pub faults: Vec<FaultSpec>,
    /// The network's and the nemesis' faults (see `nemesis`): off unless given. Left out of
    /// the serialized configuration when off, so a run's id and config digest stay what they
    /// were before the key existed.
    #[serde(skip_serializing_if = "crate::adapters::replay::nemesis::NetworkFaults::is_off")]
    pub network: crate::adapters::replay::nemesis::NetworkFaults,
    /// Apply runs of quiet decode steps in one go instead of one event each (see
    /// `engine::quiet::QuietRun`). Logs and report are the same either way; off, the full Mooncake
    /// replay takes about 1.3x as long. A parity switch for tests, and a way to rule it out.
    pub coalesce_quiet_steps: bool,
    /// Planned changes of the cluster's shape, in non-decreasing `at_ms` order:
    /// `[{"at_ms": 60000, "decode": 2}, {"at_ms": 90000, "prefill": -1}]` (see `scaling`).
    pub scale: Vec<ScaleEntry>,
    /// The SLO planner (off when absent; see `scaling`).
    pub planner: Option<PlannerConfig>,
    /// GPUs each worker occupies, for the report's GPU-hours.
    pub gpus_per_worker: u32,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            backend: Backend::Vllm,
            policy: None,
            prefill_workers: 0,
            decode_workers: 0,
            workers: 1,
            prefill_router: RouterMode::RoundRobin,
            decode_router: RouterMode::RoundRobin,
            seed: 0,
            vllm: VllmConfig::default(),
            sglang: SglangConfig::default(),
            prefill_vllm: None,
            decode_vllm: None,
            prefill_sglang: None,
            decode_sglang: None,
            transfer: TransferConfig::default(),
            contention: ContentionConfig::default(),
            load: LoadMode::Open,
            max_buffered_requests: 1_000_000,
            lease_ms: 480_000,
            lease_renew_ms: None,
            reservation_timeout_ms: 300_000,
            bootstrap_timeout_ms: 300_000,
            arrival_speedup: 1.0,
            max_in_flight: 1_000_000,
            faults: Vec::new(),
            network: Default::default(),
            coalesce_quiet_steps: true,
            scale: Vec::new(),
            planner: None,
            gpus_per_worker: 1,
        }
    }
}

/// The longest timeout a configuration may give, in ms (10^12 ms ≈ 31.7 years; as ns it and any
/// instant of the clock sum to well under u64::MAX).
pub const MAX_DURATION_MS: u64 = 1_000_000_000_000;

/// KV blocks (or pages) over every worker of a cluster (about 80 bytes each in the pools).
pub const MAX_CLUSTER_BLOCKS: u64 = 1 << 26;

/// Workers per role: each one holds an engine core and a stream; more than this is a mistake
/// that would exhaust memory before it said so.
pub const MAX_WORKERS: u32 = 1024;

/// A configuration that cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{path}: line {line}, column {column}: {message}")]
    Parse { path: String, line: usize, column: usize, message: String },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl ReplayConfig {
    /// Reads a JSON configuration file; keys not given keep their defaults.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.display().to_string(), source })?;
        // Editors on some systems start a UTF-8 file with a byte-order mark; traces accept it too.
        let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
        serde_json::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.display().to_string(),
            line: e.line(),
            column: e.column(),
            message: e.to_string(),
        })
    }

    /// The vLLM settings for a worker of `role`.
    pub fn vllm_for(&self, role: crate::ids::Role) -> &VllmConfig {
        let own = match role {
            crate::ids::Role::Prefill => self.prefill_vllm.as_ref(),
            crate::ids::Role::Decode => self.decode_vllm.as_ref(),
            _ => None,
        };
        own.unwrap_or(&self.vllm)
    }

    /// The SGLang settings for a worker of `role`.
    pub fn sglang_for(&self, role: crate::ids::Role) -> &SglangConfig {
        let own = match role {
            crate::ids::Role::Prefill => self.prefill_sglang.as_ref(),
            crate::ids::Role::Decode => self.decode_sglang.as_ref(),
            _ => None,
        };
        own.unwrap_or(&self.sglang)
    }

    /// The policy in force.
    pub fn effective_policy(&self) -> HandoffPolicy {
        if !self.is_disaggregated() {
            return HandoffPolicy::Disabled;
        }
        self.policy.unwrap_or_else(|| self.backend.native_policy())
    }

    pub fn is_disaggregated(&self) -> bool {
        self.prefill_workers > 0 || self.decode_workers > 0
    }

    /// Upper bounds of the prefill and decode workers a run creates: the starting ones, every
    /// one the plan adds, and the planner's maximum on top (a worker that left keeps its pool
    /// until the run ends).
    fn most_workers(&self) -> (u32, u32) {
        let added = |f: fn(&ScaleEntry) -> i32| -> u32 {
            self.scale.iter().map(|e| f(e).max(0) as u32).fold(0u32, u32::saturating_add)
        };
        let (mut prefill, mut decode) = (
            self.prefill_workers.saturating_add(added(|e| e.prefill)),
            self.decode_workers.saturating_add(added(|e| e.decode)),
        );
        if let Some(p) = &self.planner {
            prefill = prefill.saturating_add(p.max_prefill);
            decode = decode.saturating_add(p.max_decode);
        }
        (prefill, decode)
    }

    /// The KV pools of every worker together must fit the machine: at most
    /// `MAX_CLUSTER_BLOCKS` blocks (vLLM) or pages (SGLang) over the whole cluster.
    fn validate_cluster_memory(&self) -> Result<(), ConfigError> {
        use crate::ids::Role;
        let roles: Vec<(Role, u32)> = if self.is_disaggregated() {
            let (prefill, decode) = self.most_workers();
            vec![(Role::Prefill, prefill), (Role::Decode, decode)]
        } else {
            vec![(Role::Aggregated, self.workers)]
        };
        let per_worker = |role| match self.backend {
            Backend::Sglang => self.sglang_for(role).total_pages as u64,
            _ => self.vllm_for(role).num_gpu_blocks as u64,
        };
        let total: u64 = roles.iter().map(|(role, n)| per_worker(*role) * *n as u64).sum();
        if total > MAX_CLUSTER_BLOCKS {
            let unit =
                if self.backend == Backend::Sglang { "pages (total_pages" } else { "blocks (num_gpu_blocks" };
            return Err(ConfigError::Invalid(format!(
                "the cluster's KV pools hold {total} {unit} × workers); at most {MAX_CLUSTER_BLOCKS} fit this tool's memory budget (about 5 GB)"
            )));
        }
        Ok(())
    }

    /// `scale`, `planner` and `gpus_per_worker`.
    fn validate_scaling(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.gpus_per_worker == 0 || self.gpus_per_worker > 1024 {
            return bad(format!("gpus_per_worker is {}; give 1..=1024", self.gpus_per_worker));
        }
        if self.scale.is_empty() && self.planner.is_none() {
            return Ok(());
        }
        let what = if self.scale.is_empty() { "planner" } else { "scale" };
        if !self.is_disaggregated() {
            return bad(format!(
                "{what}: scaling changes prefill and decode workers; give prefill_workers and decode_workers"
            ));
        }
        // Device-aware weights are one per worker in id order: they cannot follow the list.
        for (key, mode) in [("prefill_router", &self.prefill_router), ("decode_router", &self.decode_router)]
        {
            if matches!(mode, RouterMode::DeviceAware { weights } if !weights.is_empty()) {
                return bad(format!(
                    "{key}: device-aware weights are one per worker and cannot follow {what}; give no weights"
                ));
            }
        }
        crate::adapters::replay::scaling::validate(
            &self.scale,
            self.planner.as_ref(),
            (self.prefill_workers, self.decode_workers),
            MAX_DURATION_MS,
            MAX_WORKERS,
        )
        .map_err(ConfigError::Invalid)
    }

    /// Checks everything a replay relies on, naming the offending setting.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.is_disaggregated() {
            if self.prefill_workers == 0 || self.decode_workers == 0 {
                return bad(format!(
                    "disaggregated serving needs prefill and decode workers (got --prefill {} --decode {})",
                    self.prefill_workers, self.decode_workers
                ));
            }
        } else if self.workers == 0 {
            return bad("no workers: give --workers N or --prefill N --decode M".into());
        }
        if self.backend == Backend::TrtLlm && self.is_disaggregated() {
            return bad("trtllm: destination reservation is not modeled yet (the proposal defers it); use vllm or sglang".into());
        }
        if !(self.arrival_speedup > 0.0 && self.arrival_speedup.is_finite()) {
            return bad(format!("arrival_speedup must be a positive number, got {}", self.arrival_speedup));
        }
        if self.lease_ms == 0 {
            return bad("lease_ms must be > 0".into());
        }
        // Every duration becomes nanoseconds added to an instant: bounded so that neither the
        // multiplication nor the sum can wrap (a longer timeout must never fail requests sooner).
        for (key, ms) in [
            ("lease_ms", Some(self.lease_ms)),
            ("lease_renew_ms", self.lease_renew_ms),
            ("reservation_timeout_ms", Some(self.reservation_timeout_ms)),
            ("bootstrap_timeout_ms", Some(self.bootstrap_timeout_ms)),
        ] {
            if let Some(ms) = ms.filter(|ms| *ms > MAX_DURATION_MS) {
                return bad(format!("{key} is {ms} ms; at most {MAX_DURATION_MS} ms (about 31 years)"));
            }
        }
        if self.prefill_workers > MAX_WORKERS
            || self.decode_workers > MAX_WORKERS
            || self.workers > MAX_WORKERS
        {
            return bad(format!(
                "at most {MAX_WORKERS} workers per role (got --prefill {} --decode {} --workers {})",
                self.prefill_workers, self.decode_workers, self.workers
            ));
        }
        if let Some(r) = self.lease_renew_ms {
            // A renewal reaches the source a moment after it is sent: one that came only at
            // the deadline it extends would come too late.
            if r == 0 || r >= self.lease_ms / 3 * 2 {
                return bad(format!(
                    "lease_renew_ms ({r}) must be > 0 and less than the ⅔ of lease_ms ({}) each renewal extends the lease by",
                    self.lease_ms
                ));
            }
        }
        if self.reservation_timeout_ms == 0 || self.bootstrap_timeout_ms == 0 {
            return bad("reservation_timeout_ms and bootstrap_timeout_ms must be > 0".into());
        }
        if self.max_in_flight == 0 {
            return bad("max_in_flight must be > 0".into());
        }
        if self.max_buffered_requests == 0 {
            return bad("max_buffered_requests must be > 0".into());
        }
        if let LoadMode::Closed { concurrency: 0 } = self.load {
            return bad("load: closed-loop concurrency must be > 0".into());
        }
        if self.contention.enabled && !matches!(self.transfer, TransferConfig::Bandwidth(_)) {
            return bad(
                "contention needs the bandwidth transfer model (transfer.mode = \"bandwidth\")".into()
            );
        }
        self.validate_scaling()?;
        self.validate_cluster_memory()?;
        crate::adapters::replay::faults::validate(&self.faults, self.effective_policy())
            .map_err(ConfigError::Invalid)?;
        if !self.network.is_off() {
            self.network.validate(&self.known_workers(), MAX_DURATION_MS).map_err(ConfigError::Invalid)?;
        }
        Ok(())
    }

    /// Every worker name the run may have: the starting ones, and every joiner's when the
    /// cluster may scale.
    pub fn known_workers(&self) -> Vec<String> {
        use crate::ids::WorkerId;
        let (p, d, a) = if self.scale.is_empty() && self.planner.is_none() {
            (self.prefill_workers, self.decode_workers, self.workers)
        } else {
            (MAX_WORKERS, MAX_WORKERS, self.workers)
        };
        if self.is_disaggregated() {
            let prefill = (0..p).map(|i| WorkerId::prefill(i).to_string());
            prefill.chain((0..d).map(|i| WorkerId::decode(i).to_string())).collect()
        } else {
            (0..a).map(|i| WorkerId::aggregated(i).to_string()).collect()
        }
    }
}
