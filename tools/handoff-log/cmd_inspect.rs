//! `handoff-log inspect`: the post-mortem of a run, for a person who was paged.

use crate::out::Out;
use crate::CliError;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use handoff_ledger::ids::WorkerId;
use handoff_ledger::projections::inspect::{
    inspect_run, InspectOptions, InspectReport, PeakAt, MAX_INTERVALS_PER_WORKER,
};
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::Path;

#[derive(clap::Args)]
pub struct InspectArgs {
    /// A run directory, stream file or merged run file.
    pub run: std::path::PathBuf,
    /// Machine-readable output (one JSON object).
    #[arg(long)]
    pub json: bool,
    /// How many longest-pinned handoffs to show with their full timelines.
    #[arg(long, default_value_t = 5)]
    pub top: usize,
    /// Pinned share (%) of a prefill worker's blocks at which its pins count toward a cascade.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub pin_threshold_pct: u32,
    /// How long (ms) queued prefill work must wait unscheduled to count as a stall.
    #[arg(long, default_value_t = 1000)]
    pub stall_ms: u64,
    /// Decode kv_used share (%) at which a decode worker counts as full.
    #[arg(long, default_value_t = 95, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub decode_full_pct: u32,
    /// Preemptions on one worker within `--storm-window-ms` that make a preemption storm.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub storm_preemptions: u32,
    /// The sliding window (ms) of a preemption storm.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    pub storm_window_ms: u64,
}

pub fn run(args: &InspectArgs) -> Result<u8, CliError> {
    let opts = InspectOptions {
        top_n: args.top,
        pin_threshold_pct: args.pin_threshold_pct,
        stall_ms: args.stall_ms,
        decode_full_pct: args.decode_full_pct,
        storm_preemptions: args.storm_preemptions,
        storm_window_ms: args.storm_window_ms,
    };
    let bar = if std::io::stderr().is_terminal() {
        let b = ProgressBar::new_spinner();
        b.set_style(
            ProgressStyle::with_template("{spinner} inspecting: {pos} records read ({per_sec})")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        Some(b)
    } else {
        None
    };
    let mut progress = |n: u64| {
        if let Some(b) = &bar {
            b.set_position(n);
        }
    };
    let report = inspect_run(&args.run, opts, &mut progress);
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let report = report?;
    let mut out = Out::new();
    if args.json {
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| CliError::new(2, format!("encoding the report: {e}")))?;
        out.line(&text)?;
    } else {
        out.line(&text(&report, &args.run))?;
    }
    out.flush()?;
    if !report.unended.is_empty() {
        eprintln!("handoff-log: warning: {}", crate::cmd_verify::incomplete_text(&report.unended));
    }
    Ok(0)
}

/// Columns the text report fits into: tables shrink (wrapping cells) and prose lines wrap.
const TEXT_WIDTH: usize = 120;

fn table() -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_content_arrangement(comfy_table::ContentArrangement::Dynamic);
    t.set_width(TEXT_WIDTH as u16);
    t
}

/// Breaks a prose line longer than `TEXT_WIDTH` at spaces; continuation lines are indented two
/// columns past the line's own indentation.
fn wrap_prose(l: &str) -> String {
    if l.chars().count() <= TEXT_WIDTH {
        return l.to_string();
    }
    let indent = l.chars().take_while(|c| *c == ' ').count();
    let cont = " ".repeat(indent + 2);
    let mut out = String::new();
    let mut len = 0;
    for (i, word) in l.trim_start().split(' ').enumerate() {
        let w = word.chars().count();
        if i == 0 {
            out.push_str(&" ".repeat(indent));
            len = indent;
        } else if len + 1 + w > TEXT_WIDTH {
            out.push('\n');
            out.push_str(&cont);
            len = cont.len();
        } else {
            out.push(' ');
            len += 1;
        }
        out.push_str(word);
        len += w;
    }
    out
}

fn f3(v: f64) -> String {
    format!("{v:.3}")
}

/// Rows per worker in the storm and head-of-line tables: the first ones tell how it began;
/// `--json` keeps up to [`MAX_INTERVALS_PER_WORKER`] and the headline counts them all.
const TEXT_ROWS_PER_WORKER: usize = 5;

/// `interval` for 1, `intervals` for any other count.
fn noun(n: u64, word: &str) -> String {
    if n == 1 {
        word.to_string()
    } else {
        format!("{word}s")
    }
}

/// `1 interval`, `3 intervals`.
fn plural(n: u64, word: &str) -> String {
    format!("{n} {}", noun(n, word))
}

/// Workers named in a headline: a long cluster is summarized so the line stays readable.
fn worker_list(workers: &[WorkerId]) -> String {
    if workers.len() > 2 {
        format!("{} workers", workers.len())
    } else {
        workers.iter().map(|w| w.to_string()).collect::<Vec<_>>().join(", ")
    }
}

/// The first `TEXT_ROWS_PER_WORKER` items of each worker, in the list's order, and how many
/// were left out.
fn first_per_worker<T>(items: &[T], worker: impl Fn(&T) -> WorkerId) -> (Vec<&T>, usize) {
    let mut seen: BTreeMap<WorkerId, usize> = BTreeMap::new();
    let shown: Vec<&T> = items
        .iter()
        .filter(|it| {
            let n = seen.entry(worker(it)).or_insert(0);
            *n += 1;
            *n <= TEXT_ROWS_PER_WORKER
        })
        .collect();
    let hidden = items.len() - shown.len();
    (shown, hidden)
}

fn peak(p: &PeakAt) -> String {
    if p.value == 0 {
        "0".into()
    } else {
        format!("{} @ {:.3}", p.value, p.at_ms)
    }
}

fn peak_pct(p: &PeakAt, total: u64) -> String {
    if p.value == 0 || total == 0 {
        return peak(p);
    }
    format!("{} ({:.0}%) @ {:.3}", p.value, p.value as f64 * 100.0 / total as f64, p.at_ms)
}

/// The report as a person reads it.
pub fn text(r: &InspectReport, path: &Path) -> String {
    let mut s = String::new();
    let mut line = |l: String| {
        // Tables come in as one string of many lines, already fitted; prose is wrapped here.
        for part in l.split('\n') {
            s.push_str(&wrap_prose(part));
            s.push('\n');
        }
        if l.is_empty() {
            return;
        }
        s.pop();
        s.push('\n');
    };
    let names: Vec<String> = r.run.workers.iter().map(|w| w.worker.to_string()).collect();
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    line(format!(
        "Run {name} · id {} · {} · {} · seed {} · streams {} · {} records · {:.3}–{:.3} ms",
        r.run.run_id,
        r.run.backend,
        r.run.policy,
        r.run.seed,
        names.join(", "),
        r.run.records,
        r.run.first_at_ms,
        r.run.last_at_ms
    ));
    line(String::new());

    // --- cascade ---
    match &r.cascade {
        Some(c) => {
            line(format!(
                "STRANDING CASCADE: yes, from {:.3} ms on {}",
                c.started_at_ms,
                c.workers
                    .iter()
                    .map(|w| w.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            match &c.trigger {
                Some(t) => line(format!("  Trigger: {}.", t.summary)),
                None => line(
                    "  Trigger: none found (no decode pressure preceded the stall: look for slow readers or expired leases)."
                        .into(),
                ),
            }
            let mut t = table();
            t.set_header(vec![
                "worker",
                "stalled from (ms)",
                "to (ms)",
                "for (ms)",
                "pinned at start",
                "peak pinned",
                "oldest waiting",
                "peak waiting",
            ]);
            for i in &c.intervals {
                t.add_row(vec![
                    i.worker.to_string(),
                    f3(i.started_at_ms),
                    i.ended_at_ms.map(f3).unwrap_or_else(|| "run end".into()),
                    f3(i.duration_ms),
                    format!("{}%", i.pinned_at_start_pct),
                    format!("{}%", i.peak_pinned_pct),
                    match (i.oldest_waiting_request, i.oldest_waiting_since_ms) {
                        (Some(q), Some(at)) => format!("{q} since {at:.3}"),
                        _ => String::new(),
                    },
                    i.peak_waiting.to_string(),
                ]);
            }
            line(t.to_string());
            if c.intervals_not_shown > 0 {
                line(format!("  ({} more stall intervals not shown)", c.intervals_not_shown));
            }
        }
        None => line(format!(
            "STRANDING CASCADE: none (no prefill worker had pins ≥ {}% of its blocks while queued work waited ≥ {} ms)",
            r.options.pin_threshold_pct, r.options.stall_ms
        )),
    }
    line(String::new());

    // --- lost workers ---
    for l in &r.workers_lost {
        let peers: Vec<String> = l.by_peer.iter().map(|(p, n)| format!("{p} {n}")).collect();
        let aftermath = format!(
            "its peers ended {} handoff roles shared with it as peer lost{}, and {} requests placed on it failed.",
            l.peer_roles_ended,
            if peers.is_empty() { String::new() } else { format!(": {}", peers.join(", ")) },
            l.failed_requests
        );
        line(match &l.taken_over {
            Some(t) => format!(
                "WORKER LOST AND RESTARTED: {}'s session {} stops at {:.3} ms (the process died or its links broke); a restarted process took over its stream at {:.3} ms under a new session and recorded what the dead one held: {} blocks in use, {} cached, {} request slots, all returned to free. Before that, {aftermath}",
                l.worker, t.lost_generation, l.stopped_at_ms, t.at_ms, t.blocks_held, t.cached_blocks, t.slots_held
            ),
            None => format!(
                "WORKER LOST: {}'s stream stops at {:.3} ms without its end marker, while the run went on (the process died or its links broke); {aftermath}",
                l.worker, l.stopped_at_ms
            ),
        });
        line(String::new());
    }

    // --- gating ---
    match &r.gating {
        Some(g) => {
            line(format!("DESTINATION GATING: {}.", g.summary));
            let mut t = table();
            t.set_header(vec!["decode worker", "handoffs gated", "peak FIFO", "FIFO non-empty (ms)"]);
            for w in &g.per_worker {
                t.add_row(vec![
                    w.worker.to_string(),
                    w.handoffs.to_string(),
                    format!("{} @ {:.3}", w.peak_pending, w.peak_pending_at_ms),
                    f3(w.pending_ms),
                ]);
            }
            line(t.to_string());
        }
        None => line("DESTINATION GATING: none (no reservation waited ahead of prefill dispatch)".into()),
    }
    line(String::new());

    // --- preemption storms ---
    let ps = &r.preemption_storms;
    if ps.per_worker.is_empty() {
        line(format!(
            "PREEMPTION STORMS: none (no worker had {} preemptions within {} ms)",
            r.options.storm_preemptions, r.options.storm_window_ms
        ));
    } else {
        let first = ps
            .per_worker
            .iter()
            .min_by(|a, b| a.first_started_at_ms.total_cmp(&b.first_started_at_ms))
            .expect("not empty");
        let workers: Vec<WorkerId> = ps.per_worker.iter().map(|w| w.worker).collect();
        line(format!(
            "PREEMPTION STORMS: {} on {} (first at {:.3} ms on {}; {} of {})",
            ps.per_worker.iter().map(|w| w.storms).sum::<u64>(),
            worker_list(&workers),
            first.first_started_at_ms,
            first.worker,
            plural(ps.per_worker.iter().map(|w| w.preemptions).sum::<u64>(), "preemption"),
            plural(ps.per_worker.iter().map(|w| w.requests).sum::<u64>(), "request"),
        ));
        let mut t = table();
        t.set_header(vec![
            "worker",
            "from (ms)",
            "to (ms)",
            "preemptions",
            "requests",
            "most preempted",
            "longest stall (ms)",
            "kv_used at start",
        ]);
        let (shown, hidden) = first_per_worker(&ps.storms, |s| s.worker);
        for s in shown {
            t.add_row(vec![
                s.worker.to_string(),
                f3(s.started_at_ms),
                s.ended_at_ms.map(f3).unwrap_or_else(|| "run end".into()),
                s.preemptions.to_string(),
                s.requests.to_string(),
                format!("{} ×{}", s.most_preempted_request, s.most_preempted_times),
                match (s.longest_stall_ms, s.longest_stall_request) {
                    (Some(d), Some(q)) => format!("{d:.3} ({q})"),
                    _ => "not resumed".into(),
                },
                format!("{}%", s.kv_used_at_start_pct),
            ]);
        }
        line(t.to_string());
        let more = hidden as u64 + ps.storms_not_shown;
        if more > 0 {
            line(format!(
                "  ({more} more {} not shown; --json lists the first {MAX_INTERVALS_PER_WORKER} per worker)",
                noun(more, "storm")
            ));
        }
    }
    line(String::new());

    // --- decode head-of-line blocking ---
    let hb = &r.decode_hol_blocking;
    if hb.per_worker.is_empty() {
        line(format!(
            "DECODE HEAD-OF-LINE BLOCKING: none (no busy decode worker went {} ms without scheduling a waiting request)",
            r.options.stall_ms
        ));
    } else {
        let first = hb
            .per_worker
            .iter()
            .min_by(|a, b| a.first_started_at_ms.total_cmp(&b.first_started_at_ms))
            .expect("not empty");
        let workers: Vec<WorkerId> = hb.per_worker.iter().map(|w| w.worker).collect();
        line(format!(
            "DECODE HEAD-OF-LINE BLOCKING: {} on {} (first at {:.3} ms on {}; longest {:.3} ms)",
            plural(hb.per_worker.iter().map(|w| w.intervals).sum::<u64>(), "interval"),
            worker_list(&workers),
            first.first_started_at_ms,
            first.worker,
            hb.per_worker.iter().map(|w| w.longest_ms).fold(0.0, f64::max),
        ));
        let mut t = table();
        t.set_header(vec![
            "worker",
            "blocked from (ms)",
            "to (ms)",
            "for (ms)",
            "peak waiting",
            "head",
            "free blocks / head needs",
        ]);
        let (shown, hidden) = first_per_worker(&hb.intervals, |i| i.worker);
        for i in shown {
            t.add_row(vec![
                i.worker.to_string(),
                f3(i.started_at_ms),
                i.ended_at_ms.map(f3).unwrap_or_else(|| "run end".into()),
                f3(i.duration_ms),
                i.peak_waiting.to_string(),
                i.head_request.map(|q| q.to_string()).unwrap_or_default(),
                match i.head_need_blocks {
                    Some(n) => format!("{} / {n}", i.free_blocks_at_start),
                    None => i.free_blocks_at_start.to_string(),
                },
            ]);
        }
        line(t.to_string());
        let more = hidden as u64 + hb.intervals_not_shown;
        if more > 0 {
            line(format!(
                "  ({more} more {} not shown; --json lists the first {MAX_INTERVALS_PER_WORKER} per worker)",
                noun(more, "interval")
            ));
        }
    }
    line(String::new());

    // --- peaks ---
    line("PEAKS (blocks, settled instants; value @ ms)".into());
    let mut t = table();
    t.set_header(vec![
        "worker",
        "total",
        "active",
        "pinned",
        "reserved",
        "kv_used",
        "waiting",
        "running",
        "held",
        "pending res",
    ]);
    for p in &r.peaks {
        t.add_row(vec![
            p.worker.to_string(),
            p.total_blocks.to_string(),
            peak_pct(&p.active, p.total_blocks),
            peak_pct(&p.pinned_source, p.total_blocks),
            peak_pct(&p.reserved_destination, p.total_blocks),
            peak_pct(&p.kv_used, p.total_blocks),
            peak(&p.waiting),
            peak(&p.running),
            peak(&p.held_prefills),
            peak(&p.pending_reservations),
        ]);
    }
    line(t.to_string());
    line(String::new());

    // --- longest pinned ---
    line(format!("HANDOFFS PINNED LONGEST (top {})", r.longest_pinned.len()));
    if r.options.top_n == 0 {
        line("  (none asked for: --top 0)".into());
    } else if r.longest_pinned.is_empty() {
        line("  (no source pins in this run)".into());
    }
    for h in &r.longest_pinned {
        line(format!(
            "#{} {} {} {} → {} · pinned {:.3} ms{} · {} blocks · {}",
            h.rank,
            h.handoff,
            h.request.map(|q| q.to_string()).unwrap_or_default(),
            h.source.map(|w| w.to_string()).unwrap_or_else(|| "?".into()),
            h.destination.map(|w| w.to_string()).unwrap_or_else(|| "?".into()),
            h.pinned_ms,
            if h.still_pinned { " (still pinned at run end)" } else { "" },
            h.pinned_blocks,
            h.outcome
        ));
        let mut t = table();
        t.set_header(vec!["at (ms)", "+ms", "worker", "fact"]);
        for st in &h.timeline {
            t.add_row(vec![
                f3(st.at_ms),
                f3(st.delta_ms),
                st.worker.to_string(),
                match st.message {
                    Some(m) => format!("{} {:?}", st.fact, m),
                    None => st.fact.to_string(),
                },
            ]);
        }
        line(t.to_string());
    }
    line(String::new());

    // --- wait breakdown ---
    let w = &r.wait_breakdown;
    line(format!("WHERE HANDOFF TIME WENT ({} handoffs; ms)", w.handoffs));
    let mut t = table();
    t.set_header(vec!["phase", "count", "total", "mean", "p50", "p90", "p99", "max"]);
    for p in &w.phases {
        let st = &p.stats_ms;
        t.add_row(vec![
            p.phase.to_string(),
            st.count.to_string(),
            f3(p.total_ms),
            f3(st.mean),
            f3(st.p50),
            f3(st.p90),
            f3(st.p99),
            f3(st.max),
        ]);
    }
    line(t.to_string());
    for p in &w.phases {
        line(format!("  {}: {}", p.phase, p.meaning));
    }
    let o = &w.outcomes;
    let reasons: Vec<String> = o.canceled_by_reason.iter().map(|(k, v)| format!("{k} {v}")).collect();
    line(format!(
        "Outcomes: completed {}, lease expired {}, reservation expired {}, canceled {}{}, in flight at end {}",
        o.completed,
        o.lease_expired,
        o.reservation_expired,
        o.canceled,
        if reasons.is_empty() {
            String::new()
        } else {
            format!(" ({})", reasons.join(", "))
        },
        o.in_flight_at_end
    ));
    line(String::new());

    // --- bookings ---
    line("ROUTER BOOKINGS BESIDE PHYSICAL OCCUPANCY (blocks; value @ ms)".into());
    let mut t = table();
    t.set_header(vec![
        "worker",
        "total",
        "peak booked",
        "peak kv_used",
        "max booked−used",
        "max used−booked",
        "overbooked (ms)",
        "unbooked pins (ms)",
    ]);
    for b in &r.bookings.workers {
        t.add_row(vec![
            b.worker.to_string(),
            b.total_blocks.to_string(),
            peak(&b.peak_booked),
            peak(&b.peak_kv_used),
            peak(&b.max_booked_over_used),
            peak(&b.max_used_over_booked),
            f3(b.overbooked_ms),
            f3(b.unbooked_pins_ms),
        ]);
    }
    line(t.to_string());
    if r.bookings.divergences.is_empty() {
        line(
            "Divergences: none (no worker overbooked past its total, no pins without a prefill booking)"
                .into(),
        );
    } else {
        line("Divergences:".into());
        for d in &r.bookings.divergences {
            let what = match d.kind {
                "overbooked" => {
                    format!("router booked up to {} blocks, more than the worker has", d.worst_blocks)
                }
                _ => format!("up to {} pinned blocks with no prefill booking", d.worst_blocks),
            };
            line(format!(
                "  {} {} {:.3}–{} ms ({:.3} ms): {}",
                d.worker,
                d.kind,
                d.started_at_ms,
                d.ended_at_ms.map(f3).unwrap_or_else(|| "run end".into()),
                d.duration_ms,
                what
            ));
        }
        if r.bookings.divergences_not_shown > 0 {
            line(format!("  ({} more not shown)", r.bookings.divergences_not_shown));
        }
    }
    s.trim_end().to_string()
}
