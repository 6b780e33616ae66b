//! Shared harness for the vLLM core tests: folds every emitted fact into a capacity snapshot and
//! a scheduler view and checks them against the core after every call.

use handoff_ledger::events::Fact;
use handoff_ledger::ids::{Backend, HandoffId, RequestId, WorkerId};
use handoff_ledger::projections::{KvCapacitySnapshot, SchedulerFold};
use handoff_ledger::schedulers::request::TRACE_BLOCK_SIZE;
use handoff_ledger::schedulers::vllm::{VllmConfig, VllmCore};
use handoff_ledger::schedulers::{
    CommandError, CommandOutcome, CommandResult, EngineCore, EngineOutput, Request, StepOutput,
};

pub struct Harness {
    pub core: VllmCore,
    pub cap: KvCapacitySnapshot,
    pub fold: SchedulerFold,
    pub log: Vec<Fact>,
    pub outputs: Vec<EngineOutput>,
    pub now_ns: u64,
    /// Where this harness is used (printed on failure).
    pub label: String,
}

impl Harness {
    pub fn new(cfg: VllmConfig) -> Self {
        Self::with_backend(cfg, Backend::Vllm, WorkerId::aggregated(0))
    }

    pub fn with_backend(cfg: VllmConfig, backend: Backend, worker: WorkerId) -> Self {
        let core = VllmCore::new(worker, backend, cfg).expect("valid config");
        let cap = KvCapacitySnapshot::empty(cfg.num_gpu_blocks as u64);
        let h = Harness {
            core,
            cap,
            fold: SchedulerFold::new(),
            log: Vec::new(),
            outputs: Vec::new(),
            now_ns: 0,
            label: worker.to_string(),
        };
        h.check("new");
        h
    }

    pub fn absorb(&mut self, facts: &[Fact], outputs: &[EngineOutput], what: &str) {
        for f in facts {
            if let Err(e) = self.cap.apply_fact(f) {
                panic!(
                    "[{}] {what}: capacity fold refused {f:?}: {e}\nlog so far: {:#?}",
                    self.label, self.log
                );
            }
            if let Err(e) = self.fold.apply(f) {
                panic!("[{}] {what}: view fold refused {f:?}: {e}", self.label);
            }
            self.log.push(f.clone());
        }
        self.outputs.extend(outputs.iter().cloned());
        self.check(what);
    }

    pub fn check(&self, what: &str) {
        let snap = self.core.snapshot();
        assert_eq!(self.cap, snap, "[{}] {what}: fold of facts != snapshot()", self.label);
        match self.core.try_audit() {
            Ok(a) => assert_eq!(a, snap, "[{}] {what}: audit() != snapshot()", self.label),
            Err(e) => panic!("[{}] {what}: audit failed: {e}", self.label),
        }
        assert_eq!(self.core.audit(), snap);
        assert_eq!(self.fold.view(), self.core.view(), "[{}] {what}: view fold != view()", self.label);
        assert!(snap.is_conserved(), "[{}] {what}: conservation broken {snap:?}", self.label);
        assert_eq!(self.core.internal_error(), None, "[{}] {what}", self.label);
    }

    pub fn cmd(&mut self, r: CommandResult, what: &str) -> Result<CommandOutcome, CommandError> {
        self.absorb(&r.effects.facts, &r.effects.outputs, what);
        r.outcome
    }

    /// Runs a command at the harness clock and absorbs its effects.
    pub fn run(
        &mut self,
        what: &str,
        f: impl FnOnce(&mut VllmCore, u64) -> CommandResult,
    ) -> Result<CommandOutcome, CommandError> {
        let now = self.now_ns;
        let r = f(&mut self.core, now);
        self.cmd(r, what)
    }

    pub fn step(&mut self) -> StepOutput {
        let out = self.core.step(self.now_ns);
        self.absorb(&out.effects.facts, &out.effects.outputs, "step");
        // Idle steps still advance time so callers' loops terminate.
        self.now_ns += out.duration_ns.max(1_000_000);
        out
    }

    /// Steps until `done` holds, at most `max` steps; returns the number of steps taken.
    pub fn step_until(&mut self, max: usize, mut done: impl FnMut(&Self) -> bool) -> usize {
        for n in 0..max {
            if done(self) {
                return n;
            }
            self.step();
        }
        assert!(done(self), "[{}] condition not reached in {max} steps", self.label);
        max
    }

    pub fn count(&self, name: &str) -> usize {
        super::count(&self.log, name)
    }

    pub fn stored_hashes(&self) -> Vec<u64> {
        self.log
            .iter()
            .filter_map(|f| match f {
                Fact::KvStored { blocks, .. } => Some(blocks.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }
}

/// A request whose prompt is made of the given trace blocks (so shared leading ids share KV).
pub fn req(id: u64, input: u32, output: u32, trace: &[u64]) -> Request {
    let n = input.div_ceil(TRACE_BLOCK_SIZE).max(1) as usize;
    let mut blocks: Vec<u64> = trace.iter().copied().take(n).collect();
    // Pad with ids unique to this request.
    while blocks.len() < n {
        blocks.push(0xdead_0000_0000 + id * 1000 + blocks.len() as u64);
    }
    Request {
        id: RequestId(id),
        input_tokens: input,
        output_tokens: output,
        trace_blocks: blocks.into(),
        trace_block_size: TRACE_BLOCK_SIZE,
        arrival_ns: 0,
        hash_cache: Default::default(),
    }
}

pub fn hid(n: u128) -> HandoffId {
    HandoffId(uuid::Uuid::from_u128(0x1000 + n))
}

pub fn small(blocks: u32, block_size: u32) -> VllmConfig {
    VllmConfig { num_gpu_blocks: blocks, block_size, ..VllmConfig::default() }
}
