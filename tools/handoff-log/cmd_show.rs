//! `handoff-log show`: one line per record, in merge order.

use crate::out::Out;
use crate::CliError;
use handoff_ledger::events::{Fact, Record, RunReader};
use handoff_ledger::ids::{HandoffId, WorkerId};
use serde_json::{Map, Value};
use std::path::Path;

pub fn run(
    log: &Path,
    handoff: Option<&str>,
    worker: Option<&str>,
    limit: Option<u64>,
    json_out: bool,
) -> Result<u8, CliError> {
    let handoff: Option<HandoffId> = handoff
        .map(|h| {
            h.parse().map_err(|e| CliError::new(2, format!("--handoff {h}: not a HandoffId (UUID): {e}")))
        })
        .transpose()?;
    let worker: Option<WorkerId> = worker
        .map(|w| w.parse().map_err(|e: String| CliError::new(2, format!("--worker: {e}"))))
        .transpose()?;
    let mut run = RunReader::open(log)?;
    let workers: Vec<WorkerId> = run.headers().iter().map(|h| h.worker).collect();
    if let Some(w) = worker {
        if !workers.contains(&w) {
            let known: Vec<String> = workers.iter().map(|w| w.to_string()).collect();
            return Err(CliError::new(
                2,
                format!("--worker {w}: no such stream in {} (streams: {})", log.display(), known.join(", ")),
            ));
        }
    }
    let mut out = Out::new();
    if !json_out {
        out.line(&format!("{:>14} {:<10} {:>8} {:<20} DETAILS", "AT_MS", "WORKER", "SEQ", "FACT"))?;
    }
    let mut shown = 0u64;
    // With an index beside the run, the filtered records are fetched by offset.
    let mut emit = |w: WorkerId, rec: &Record| -> Result<bool, CliError> {
        if limit.is_some_and(|l| shown >= l) {
            return Ok(false);
        }
        shown += 1;
        out.line(&if json_out { json_line(w, rec) } else { text_line(w, rec) })?;
        Ok(true)
    };
    if crate::cmd_index::indexed_show(log, handoff, worker, &mut emit)? {
        out.flush()?;
        return Ok(0);
    }
    while let Some((i, rec)) = run.next()? {
        let w = workers[i];
        if worker.is_some_and(|x| x != w) || handoff.is_some_and(|h| rec.fact.handoff() != Some(h)) {
            continue;
        }
        if limit.is_some_and(|l| shown >= l) {
            break;
        }
        shown += 1;
        out.line(&if json_out { json_line(w, &rec) } else { text_line(w, &rec) })?;
    }
    out.flush()?;
    Ok(0)
}

/// The fact's variant name and its fields as a JSON object.
pub fn fact_fields(fact: &Fact) -> Map<String, Value> {
    match serde_json::to_value(fact) {
        Ok(Value::Object(mut m)) => match m.values_mut().next().map(std::mem::take) {
            Some(Value::Object(fields)) => fields,
            _ => Map::new(),
        },
        _ => Map::new(),
    }
}

pub fn json_line(w: WorkerId, rec: &Record) -> String {
    let mut m = Map::new();
    m.insert("at_ns".into(), rec.at_ns.into());
    m.insert("worker".into(), w.to_string().into());
    m.insert("seq".into(), rec.seq.into());
    m.insert("fact".into(), rec.fact.name().into());
    for (k, v) in fact_fields(&rec.fact) {
        m.insert(k, v);
    }
    Value::Object(m).to_string()
}

pub fn text_line(w: WorkerId, rec: &Record) -> String {
    let mut details = String::new();
    for (k, v) in fact_fields(&rec.fact) {
        if !details.is_empty() {
            details.push(' ');
        }
        details.push_str(&k);
        details.push('=');
        details.push_str(&compact(&k, &v));
    }
    format!(
        "{:>14.3} {:<10} {:>8} {:<20} {}",
        rec.at_ns as f64 / 1e6,
        w.to_string(),
        rec.seq,
        rec.fact.name(),
        details
    )
}

/// Values as a person reads them: strings bare, KV deltas as `active+4,free-4`.
fn compact(key: &str, v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Object(m) if key == "kv" => {
            let parts: Vec<String> = m
                .iter()
                .filter_map(|(k, v)| {
                    let n = v.as_i64().unwrap_or(0);
                    (n != 0).then(|| format!("{k}{n:+}"))
                })
                .collect();
            if parts.is_empty() {
                "0".into()
            } else {
                parts.join(",")
            }
        }
        other => other.to_string(),
    }
}
