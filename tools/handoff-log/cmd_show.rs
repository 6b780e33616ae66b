//! `handoff-log show`: one line per record, in merge order.

use crate::out::Out;
use crate::CliError;
use handoff_ledger::events::{Fact, Record, RunReader};
use handoff_ledger::ids::{HandoffId, RequestId, WorkerId};
use handoff_ledger::units::ms;
use serde_json::{Map, Value};
use std::collections::BTreeSet;
use std::path::Path;

/// What `show` selects.
pub struct Filter<'a> {
    /// A HandoffId or a prefix of one (as `show` and `inspect` print them).
    pub handoff: Option<&'a str>,
    pub request: Option<u64>,
    pub worker: Option<&'a str>,
    pub limit: Option<u64>,
}

/// The one handoff whose id starts with `prefix`: a full id is taken as is; otherwise the run is
/// scanned for the ids it names. None matching is a finding (exit 1), several a usage error.
fn resolve_handoff(log: &Path, prefix: &str) -> Result<HandoffId, CliError> {
    if let Ok(h) = prefix.parse::<HandoffId>() {
        return Ok(h);
    }
    let wanted = prefix.to_ascii_lowercase();
    if wanted.is_empty() || !wanted.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
        return Err(CliError::new(
            2,
            format!("--handoff {prefix}: not a HandoffId or a prefix of one (hex digits)"),
        ));
    }
    let mut run = RunReader::open(log)?;
    let mut found = BTreeSet::new();
    while let Some((_, rec)) = run.next()? {
        if let Some(h) = rec.fact.handoff().filter(|h| h.to_string().starts_with(&wanted)) {
            found.insert(h);
        }
    }
    let mut found = found.into_iter();
    match (found.next(), found.next()) {
        (Some(h), None) => Ok(h),
        (None, _) => Err(CliError::new(
            1,
            format!("--handoff {prefix}: no handoff in {} starts with it", log.display()),
        )),
        (Some(a), Some(b)) => Err(CliError::new(
            2,
            format!("--handoff {prefix}: ambiguous in {} ({a}, {b}, ...); give more digits", log.display()),
        )),
    }
}

pub fn run(log: &Path, filter: Filter<'_>, json_out: bool) -> Result<u8, CliError> {
    if let Some(kind) = trace_kind(log) {
        return Err(CliError::new(
            2,
            format!(
                "{}: this is a {kind} trace, not a log; replay it first (handoff-log replay {} --out DIR), then show DIR",
                log.display(),
                log.display()
            ),
        ));
    }
    let Filter { handoff, request, worker, limit } = filter;
    let handoff: Option<HandoffId> = handoff.map(|h| resolve_handoff(log, h)).transpose()?;
    let request = request.map(RequestId);
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
    if request.is_none() && crate::cmd_index::indexed_show(log, handoff, worker, &mut emit)? {
        out.flush()?;
        return Ok(0);
    }
    // A request's records: those naming it, and those of its handoffs (known from the
    // `HandoffStarted` that precedes every other fact of a handoff on each stream).
    let mut handoffs_of_request: BTreeSet<HandoffId> = BTreeSet::new();
    while let Some((i, rec)) = run.next()? {
        let w = workers[i];
        if let (Some(r), Fact::HandoffStarted { handoff: h, request: of, .. }) = (request, &rec.fact) {
            if *of == r {
                handoffs_of_request.insert(*h);
            }
        }
        let about_request = request.is_none_or_matches(&rec.fact, &handoffs_of_request);
        if worker.is_some_and(|x| x != w)
            || handoff.is_some_and(|h| rec.fact.handoff() != Some(h))
            || !about_request
        {
            continue;
        }
        if limit.is_some_and(|l| shown >= l) {
            break;
        }
        shown += 1;
        out.line(&if json_out { json_line(w, &rec) } else { text_line(w, &rec) })?;
    }
    out.flush()?;
    if shown == 0 && (handoff.is_some() || request.is_some()) {
        let what = match (handoff, request) {
            (Some(h), _) => format!("handoff {h}"),
            (None, Some(r)) => format!("request {}", r.0),
            _ => unreachable!("checked above"),
        };
        return Err(CliError::new(1, format!("no records about {what} in {}", log.display())));
    }
    Ok(0)
}

/// Whether a record is about the selected request (always, without `--request`).
trait RequestMatch {
    fn is_none_or_matches(&self, fact: &Fact, handoffs: &BTreeSet<HandoffId>) -> bool;
}

impl RequestMatch for Option<RequestId> {
    fn is_none_or_matches(&self, fact: &Fact, handoffs: &BTreeSet<HandoffId>) -> bool {
        match self {
            None => true,
            Some(r) => fact.request() == Some(*r) || fact.handoff().is_some_and(|h| handoffs.contains(&h)),
        }
    }
}

/// A trace file given where a log belongs: its kind, when its start says so.
fn trace_kind(path: &Path) -> Option<&'static str> {
    use std::io::Read;
    let mut head = [0u8; 256];
    let n = std::fs::File::open(path).ok()?.read(&mut head).ok()?;
    let text = String::from_utf8_lossy(&head[..n]);
    let text = text.trim_start_matches('\u{feff}').trim_start();
    if text.starts_with('{') {
        Some("Mooncake JSONL")
    } else if text.to_ascii_uppercase().starts_with("TIMESTAMP")
        || text.to_ascii_uppercase().contains(",TIMESTAMP")
    {
        Some("Azure CSV")
    } else {
        None
    }
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
        ms(rec.at_ns),
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
