//! Parameter sweeps: a base configuration and grids of values for some of its keys, expanded
//! into one replay configuration per point of their cartesian product.
//!
//! A grid names a key and its values (`decode=1,2,4`). Runs are numbered from 0 in a stable
//! order: grids in the order given, values in the order given, the last grid varying fastest.
//! A key is either one of the replay's flags ([`FLAG_KEYS`]: `prefill`, `router`, `speedup`,
//! ...), which sets what the flag sets, or a dotted path into the configuration's JSON
//! (`lease_ms`, `vllm.num_gpu_blocks`, `transfer.bandwidth_gbps`). A value is applied to the
//! JSON of the base configuration, which is then read back as a [`ReplayConfig`]: an unknown
//! key or a value of the wrong type is an error naming the key and the value, never a silently
//! ignored setting.

use crate::adapters::replay::config::ReplayConfig;
use crate::ids::{Backend, HandoffPolicy, Role};
use crate::router::RouterMode;
use serde_json::{Map, Value};

/// The most runs a sweep may expand to, so that a typo in a grid cannot make the planner
/// allocate configurations without bound.
pub const MAX_RUNS: usize = 10_000;

/// Grid keys that set what the replay flag of the same name sets, rather than naming a
/// configuration key.
pub const FLAG_KEYS: [&str; 11] = [
    "backend",
    "policy",
    "prefill",
    "decode",
    "workers",
    "router",
    "prefill_router",
    "decode_router",
    "seed",
    "speedup",
    "concurrency",
];

/// A grid is unusable, or a point of the sweep is not a valid configuration.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SweepError(pub String);

fn err<T>(message: String) -> Result<T, SweepError> {
    Err(SweepError(message))
}

/// One `--grid KEY=V1,V2,...`: a key and its values, as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grid {
    pub key: String,
    pub values: Vec<String>,
}

impl std::str::FromStr for Grid {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let Some((key, values)) = s.split_once('=') else {
            return Err(format!("`{s}`: expected KEY=V1,V2,... (e.g. decode=1,2)"));
        };
        let key = key.trim();
        if key.is_empty() || key.split('.').any(str::is_empty) {
            return Err(format!("`{s}`: the key is empty or has an empty part"));
        }
        let values: Vec<String> = values.split(',').map(|v| v.trim().to_string()).collect();
        if values.iter().any(String::is_empty) {
            return Err(format!("`{s}`: a value is empty"));
        }
        for (i, v) in values.iter().enumerate() {
            if values[..i].contains(v) {
                return Err(format!("`{s}`: the value `{v}` is given twice"));
            }
        }
        Ok(Grid { key: key.to_string(), values })
    }
}

/// Which runs of a sweep this invocation does: those whose index % `count` is `index` - 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// 1-based, as batch systems number their array tasks.
    pub index: u32,
    pub count: u32,
}

impl Shard {
    pub const WHOLE: Shard = Shard { index: 1, count: 1 };

    pub fn includes(&self, run: usize) -> bool {
        run % self.count as usize == (self.index - 1) as usize
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl std::str::FromStr for Shard {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let parsed =
            s.split_once('/').and_then(|(i, n)| Some((i.parse::<u32>().ok()?, n.parse::<u32>().ok()?)));
        match parsed {
            Some((index, count)) if count >= 1 && (1..=count).contains(&index) => Ok(Shard { index, count }),
            _ => Err(format!("shard `{s}`: expected I/N with 1 <= I <= N (e.g. 2/4)")),
        }
    }
}

/// One point of a sweep.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedRun {
    /// Position in the sweep's order, from 0.
    pub index: usize,
    /// The directory name: the index, zero-padded so that names sort in run order, then the
    /// grid values (`003-backend=sglang,decode=2`), made safe for any filesystem.
    pub label: String,
    /// `(key, value)` per grid, as written.
    pub assignments: Vec<(String, String)>,
    pub config: ReplayConfig,
}

/// The runs of a sweep of `base` over `grids`, every configuration read back and validated.
pub fn plan(base: &ReplayConfig, grids: &[Grid]) -> Result<Vec<PlannedRun>, SweepError> {
    check_keys(grids)?;
    let mut total = 1usize;
    for g in grids {
        total = match total.checked_mul(g.values.len()) {
            Some(n) if n <= MAX_RUNS => n,
            _ => return err(format!("the grids expand to more than {MAX_RUNS} runs; split the sweep")),
        };
    }
    let base_json = serde_json::to_value(base)
        .map_err(|e| SweepError(format!("encoding the base configuration: {e}")))?;
    // Each value on its own first, so a bad key or value is named as such rather than as the
    // first run it happens to be part of.
    for g in grids {
        for v in &g.values {
            let mut json = base_json.clone();
            apply(&mut json, &g.key, v)?;
            read_back(json, &[(g.key.as_str(), v.as_str())])
                .map_err(|e| SweepError(format!("--grid {}={v}: {e}", g.key)))?;
        }
    }
    let width = total.saturating_sub(1).to_string().len().max(3);
    let mut runs = Vec::with_capacity(total);
    for index in 0..total {
        // The mixed-radix digits of the index, the last grid the fastest.
        let mut rest = index;
        let mut picks = vec![0usize; grids.len()];
        for (i, g) in grids.iter().enumerate().rev() {
            picks[i] = rest % g.values.len();
            rest /= g.values.len();
        }
        let assignments: Vec<(String, String)> =
            grids.iter().zip(&picks).map(|(g, p)| (g.key.clone(), g.values[*p].clone())).collect();
        let label = label(index, width, &assignments);
        let mut json = base_json.clone();
        for (k, v) in &assignments {
            apply(&mut json, k, v)?;
        }
        let pairs: Vec<(&str, &str)> = assignments.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let config = read_back(json, &pairs).map_err(|e| SweepError(format!("run {label}: {e}")))?;
        validate(&config).map_err(|e| SweepError(format!("run {label}: {e}")))?;
        runs.push(PlannedRun { index, label, assignments, config });
    }
    Ok(runs)
}

/// `003-backend=sglang,decode=2`: characters other than letters, digits and `._=,+-` become
/// `_`, and the name is kept well under the usual 255-byte limit (the index keeps names
/// unique whatever is cut).
pub fn label(index: usize, width: usize, assignments: &[(String, String)]) -> String {
    let values: Vec<String> = assignments.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut name = format!("{index:0width$}");
    if !values.is_empty() {
        name.push('-');
        name.push_str(&values.join(","));
    }
    let mut safe: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || "._=,+-".contains(c) { c } else { '_' })
        .collect();
    safe.truncate(200);
    safe
}

/// The configuration paths a key writes.
fn paths_of(key: &str) -> Vec<String> {
    let own = |p: &[&str]| p.iter().map(|s| s.to_string()).collect();
    match key {
        "prefill" => own(&["prefill_workers"]),
        "decode" => own(&["decode_workers"]),
        // As `--workers`: aggregated serving, so the disaggregated counts are zeroed.
        "workers" => own(&["workers", "prefill_workers", "decode_workers"]),
        "router" => own(&["prefill_router", "decode_router"]),
        "speedup" => own(&["arrival_speedup"]),
        "concurrency" => own(&["load"]),
        other => vec![other.to_string()],
    }
}

/// Two grids may not set the same setting: which one would win would depend on their order.
fn check_keys(grids: &[Grid]) -> Result<(), SweepError> {
    let overlaps =
        |a: &str, b: &str| a == b || a.starts_with(&format!("{b}.")) || b.starts_with(&format!("{a}."));
    for (i, g) in grids.iter().enumerate() {
        for earlier in &grids[..i] {
            for p in paths_of(&g.key) {
                if let Some(q) = paths_of(&earlier.key).into_iter().find(|q| overlaps(&p, q)) {
                    return err(if g.key == earlier.key {
                        format!("--grid {}: the key is given twice; give its values in one grid", g.key)
                    } else {
                        format!(
                            "--grid {} and --grid {} both set {}",
                            earlier.key,
                            g.key,
                            if q.len() <= p.len() { q } else { p }
                        )
                    });
                }
            }
        }
    }
    Ok(())
}

/// A value as JSON: a number, `true`, `false` or `null` when it reads as one, else a string.
fn scalar(text: &str) -> Value {
    match serde_json::from_str::<Value>(text) {
        Ok(v @ (Value::Number(_) | Value::Bool(_) | Value::Null)) => v,
        _ => Value::String(text.to_string()),
    }
}

/// Sets `key` to `value` in the JSON of a configuration.
pub fn apply(json: &mut Value, key: &str, value: &str) -> Result<(), SweepError> {
    let bad = |why: String| SweepError(format!("--grid {key}={value}: {why}"));
    let count = || value.parse::<u32>().map_err(|_| bad("expected a whole number of workers".into()));
    let router = || {
        value
            .parse::<RouterMode>()
            .map_err(bad)
            .and_then(|m| serde_json::to_value(m).map_err(|e| bad(e.to_string())))
    };
    match key {
        "backend" => {
            let b = [Backend::Vllm, Backend::Sglang, Backend::TrtLlm]
                .into_iter()
                .find(|b| b.as_str() == value)
                .ok_or_else(|| bad("unknown backend (vllm, sglang, trtllm)".into()))?;
            set(json, &["backend"], serde_json::to_value(b).map_err(|e| bad(e.to_string()))?)
        }
        "policy" => {
            let p = [HandoffPolicy::SourceFirst, HandoffPolicy::DestinationFirst, HandoffPolicy::Disabled]
                .into_iter()
                .find(|p| p.as_str() == value)
                .ok_or_else(|| bad("unknown policy (source-first, destination-first, disabled)".into()))?;
            set(json, &["policy"], serde_json::to_value(p).map_err(|e| bad(e.to_string()))?)
        }
        "prefill" => set(json, &["prefill_workers"], count()?.into()),
        "decode" => set(json, &["decode_workers"], count()?.into()),
        "workers" => {
            set(json, &["workers"], count()?.into())?;
            set(json, &["prefill_workers"], 0.into())?;
            set(json, &["decode_workers"], 0.into())
        }
        "router" => {
            let m = router()?;
            set(json, &["prefill_router"], m.clone())?;
            set(json, &["decode_router"], m)
        }
        "prefill_router" => set(json, &["prefill_router"], router()?),
        "decode_router" => set(json, &["decode_router"], router()?),
        "speedup" => {
            let s = value.parse::<f64>().map_err(|_| bad("expected a number".into()))?;
            set(json, &["arrival_speedup"], serde_json::to_value(s).map_err(|e| bad(e.to_string()))?)
        }
        "concurrency" => {
            let n = value.parse::<u32>().map_err(|_| bad("expected a whole number of sessions".into()))?;
            set(json, &["load"], serde_json::json!({ "closed": { "concurrency": n } }))
        }
        path => {
            let parts: Vec<&str> = path.split('.').collect();
            set(json, &parts, scalar(value)).map_err(|e| bad(e.0))
        }
    }
}

/// Sets the value at a dotted path. A per-role engine table that is not set (`decode_vllm`
/// is `null`: decode workers use `vllm`) starts as a copy of the shared one, so that
/// `decode_vllm.num_gpu_blocks=512` changes only that setting of the decode workers.
fn set(json: &mut Value, path: &[&str], value: Value) -> Result<(), SweepError> {
    let shared = |table: &str| match table {
        "prefill_vllm" | "decode_vllm" => Some("vllm"),
        "prefill_sglang" | "decode_sglang" => Some("sglang"),
        _ => None,
    };
    let mut at = json;
    for (depth, part) in path.iter().enumerate() {
        let here = path[..depth].join(".");
        let Value::Object(map) = at else {
            return err(format!("{here} is not a table"));
        };
        if depth + 1 == path.len() {
            map.insert(part.to_string(), value);
            return Ok(());
        }
        if map.get(*part).map_or(true, Value::is_null) {
            let start = match (depth, shared(part)) {
                (0, Some(s)) => map.get(s).cloned().unwrap_or_else(|| Value::Object(Map::new())),
                _ => Value::Object(Map::new()),
            };
            map.insert(part.to_string(), start);
        }
        at = map.get_mut(*part).expect("inserted above");
    }
    Ok(())
}

/// The configuration from its JSON; every key set must still be there once read back and
/// written out again, so a key that some table ignores is an error too.
fn read_back(json: Value, set: &[(&str, &str)]) -> Result<ReplayConfig, SweepError> {
    let hint =
        format!("; grid keys are configuration keys (dotted for tables) or one of {}", FLAG_KEYS.join(", "));
    let config: ReplayConfig = serde_json::from_value(json).map_err(|e| {
        let text = e.to_string();
        SweepError(if text.contains("unknown field") { text + &hint } else { text })
    })?;
    let written = serde_json::to_value(&config).map_err(|e| SweepError(e.to_string()))?;
    for (key, value) in set {
        if FLAG_KEYS.contains(key) || scalar(value).is_null() {
            continue;
        }
        let mut at = Some(&written);
        for part in key.split('.') {
            at = at.and_then(|v| v.get(part));
        }
        if at.is_none() {
            return err(format!("no such key: {key}{hint}"));
        }
    }
    Ok(config)
}

/// What a replay checks before it starts, so that no run of a sweep starts before every one
/// is known to be able to.
pub fn validate(cfg: &ReplayConfig) -> Result<(), SweepError> {
    let fail = |e: &dyn std::fmt::Display| SweepError(e.to_string());
    cfg.validate().map_err(|e| fail(&e))?;
    cfg.transfer.validate().map_err(|e| fail(&e))?;
    let roles: &[Role] =
        if cfg.is_disaggregated() { &[Role::Prefill, Role::Decode] } else { &[Role::Aggregated] };
    for role in roles {
        match cfg.backend {
            Backend::Vllm | Backend::TrtLlm => cfg
                .vllm_for(*role)
                .validate()
                .map_err(|e| SweepError(format!("vllm ({} workers): {e}", role.as_str())))?,
            Backend::Sglang => cfg
                .sglang_for(*role)
                .validate()
                .map_err(|e| SweepError(format!("sglang ({} workers): {e}", role.as_str())))?,
        }
    }
    Ok(())
}
