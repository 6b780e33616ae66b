//! `handoff-log timeline` writes a valid SVG whose drawn series match the folds: at sampled
//! instants, each stacked block class's thickness, the router-booked line and the queue lines,
//! read back off the path geometry, equal the capacity / scheduler fold at that instant
//! (computed here directly from the records). With forced downsampling, a drawn value is the
//! fold's value at some instant of the bucket holding the sampled instant.

mod support;

use handoff_ledger::events::{Fact, RunReader};
use handoff_ledger::ids::{Role, WorkerId};
use handoff_ledger::projections::{KvCapacitySnapshot, SchedulerFold};
use std::collections::BTreeMap;
use std::path::Path;
use support::scripted::{fixtures_dir, scripted};

/// Every engine worker's folded state at each settled instant: (at_ns, [5 classes, booked],
/// [5 queues]).
type States = BTreeMap<WorkerId, Vec<(u64, [u64; 6], [u64; 5])>>;

fn fold_states(run: &Path) -> States {
    let mut r = RunReader::open(run).unwrap();
    let headers = r.headers().to_vec();
    let mut caps: BTreeMap<WorkerId, KvCapacitySnapshot> = BTreeMap::new();
    let mut scheds: BTreeMap<WorkerId, SchedulerFold> = BTreeMap::new();
    let mut booked: BTreeMap<WorkerId, i64> = BTreeMap::new();
    let mut bookings: BTreeMap<(bool, u64, WorkerId), u32> = BTreeMap::new();
    for h in &headers {
        if h.worker.role != Role::Router {
            caps.insert(h.worker, KvCapacitySnapshot::empty(h.engine.total_blocks as u64));
            scheds.insert(h.worker, SchedulerFold::new());
        }
    }
    let mut out: States = BTreeMap::new();
    let mut now: Option<u64> = None;
    let snap = |out: &mut States,
                t: u64,
                caps: &BTreeMap<WorkerId, KvCapacitySnapshot>,
                scheds: &BTreeMap<WorkerId, SchedulerFold>,
                booked: &BTreeMap<WorkerId, i64>| {
        for (w, c) in caps {
            let v = scheds[w].view();
            out.entry(*w).or_default().push((
                t,
                [
                    c.active_blocks,
                    c.pinned_source_blocks,
                    c.reserved_destination_blocks,
                    c.cached_free_blocks,
                    c.free_blocks,
                    booked.get(w).copied().unwrap_or(0) as u64,
                ],
                [v.waiting, v.running, v.waiting_for_remote_kv, v.held_prefills, v.pending_reservations],
            ));
        }
    };
    while let Some((i, rec)) = r.next().unwrap() {
        if let Some(t) = now {
            if rec.at_ns > t {
                snap(&mut out, t, &caps, &scheds, &booked);
            }
        }
        now = Some(rec.at_ns);
        let w = headers[i].worker;
        if let Some(c) = caps.get_mut(&w) {
            c.apply_fact(&rec.fact).unwrap();
            scheds.get_mut(&w).unwrap().apply(&rec.fact).unwrap();
        }
        let (target, d) = match rec.fact {
            Fact::PrefillBooked { request, worker, blocks, .. } => {
                bookings.insert((false, request.0, worker), blocks);
                (worker, blocks as i64)
            }
            Fact::DecodeBooked { request, worker, blocks } => {
                bookings.insert((true, request.0, worker), blocks);
                (worker, blocks as i64)
            }
            Fact::PrefillBookingFreed { request, worker } => {
                (worker, -(bookings.remove(&(false, request.0, worker)).unwrap_or(0) as i64))
            }
            Fact::DecodeBookingFreed { request, worker, .. } => {
                (worker, -(bookings.remove(&(true, request.0, worker)).unwrap_or(0) as i64))
            }
            _ => continue,
        };
        *booked.entry(target).or_insert(0) += d;
    }
    if let Some(t) = now {
        snap(&mut out, t, &caps, &scheds, &booked);
    }
    out
}

/// The state in force at `t`: the last settled instant at or before it.
fn state_at(states: &[(u64, [u64; 6], [u64; 5])], t: u64) -> Option<([u64; 6], [u64; 5])> {
    states.iter().rev().find(|s| s.0 <= t).map(|s| (s.1, s.2))
}

/// Horizontal segments (x_lo, x_hi, y) of an SVG path made of M, H, V and Z commands.
fn horizontal_segments(d: &str) -> Vec<(f64, f64, f64)> {
    let mut segs = Vec::new();
    let (mut x, mut y) = (0.0f64, 0.0f64);
    let mut start = (0.0, 0.0);
    let mut i = 0;
    let b = d.as_bytes();
    let num = |i: &mut usize| -> f64 {
        let s = *i;
        while *i < b.len() && (b[*i].is_ascii_digit() || b[*i] == b'.' || b[*i] == b'-') {
            *i += 1;
        }
        d[s..*i].parse().unwrap()
    };
    while i < b.len() {
        let c = b[i];
        i += 1;
        match c {
            b'M' => {
                x = num(&mut i);
                assert_eq!(b[i], b',');
                i += 1;
                y = num(&mut i);
                start = (x, y);
            }
            b'H' => {
                let nx = num(&mut i);
                segs.push((x.min(nx), x.max(nx), y));
                x = nx;
            }
            b'V' => y = num(&mut i),
            b'Z' => {
                x = start.0;
                y = start.1;
            }
            other => panic!("unexpected path command {}", other as char),
        }
    }
    segs
}

struct Chart {
    t0: f64,
    t1: f64,
    x0: f64,
    x1: f64,
    y_bottom: f64,
    y_top: f64,
    top_value: f64,
    bucket_ns: u64,
    paths: BTreeMap<String, String>,
}

impl Chart {
    fn x(&self, t: u64) -> f64 {
        self.x0 + (t as f64 - self.t0) / (self.t1 - self.t0) * (self.x1 - self.x0)
    }
    fn per_px(&self) -> f64 {
        self.top_value / (self.y_bottom - self.y_top)
    }
    /// The covering horizontal segments' ys at x.
    fn ys_at(&self, series: &str, x: f64) -> Vec<f64> {
        let Some(d) = self.paths.get(series) else {
            return Vec::new();
        };
        horizontal_segments(d).into_iter().filter(|(lo, hi, _)| *lo < x && x < *hi).map(|s| s.2).collect()
    }
    /// A stacked layer's thickness in blocks at x.
    fn layer(&self, series: &str, x: f64) -> f64 {
        let ys = self.ys_at(series, x);
        assert_eq!(ys.len(), 2, "{series} at x={x}: {ys:?}");
        (ys[0] - ys[1]).abs() * self.per_px()
    }
    /// A line's value at x (0 when the series is not drawn: all-zero lines are omitted).
    fn line(&self, series: &str, x: f64) -> f64 {
        let ys = self.ys_at(series, x);
        if !self.paths.contains_key(series) {
            return 0.0;
        }
        assert_eq!(ys.len(), 1, "{series} at x={x}: {ys:?}");
        (self.y_bottom - ys[0]) * self.per_px()
    }
}

fn charts(svg: &str, class: &str, top_attr: &str) -> BTreeMap<String, Chart> {
    let doc = roxmltree::Document::parse(svg).expect("the SVG is well-formed XML");
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    assert_eq!(root.tag_name().namespace(), Some("http://www.w3.org/2000/svg"));
    let f = |n: &roxmltree::Node, a: &str| -> f64 { n.attribute(a).unwrap().parse().unwrap() };
    let mut out = BTreeMap::new();
    for g in doc.descendants().filter(|n| n.has_tag_name("g") && n.attribute("class") == Some(class)) {
        let paths = g
            .children()
            .filter(|c| c.has_tag_name("path"))
            .map(|p| (p.attribute("data-series").unwrap().to_string(), p.attribute("d").unwrap().to_string()))
            .collect();
        out.insert(
            g.attribute("data-worker").unwrap().to_string(),
            Chart {
                t0: f(&g, "data-t0-ns"),
                t1: f(&g, "data-t1-ns"),
                x0: f(&g, "data-x0"),
                x1: f(&g, "data-x1"),
                y_bottom: f(&g, "data-y-bottom"),
                y_top: f(&g, "data-y-top"),
                top_value: f(&g, top_attr),
                bucket_ns: g.attribute("data-bucket-ns").map(|v| v.parse().unwrap()).unwrap_or(0),
                paths,
            },
        );
    }
    out
}

fn timeline(run: &Path, extra: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("t.svg");
    support::cli().arg("timeline").arg(run).arg("--svg").arg(&svg).args(extra).assert().success();
    std::fs::read_to_string(&svg).unwrap()
}

/// Instants halfway between consecutive settled instants (and the window's edges), whose x
/// is clear of any step.
fn sample_instants(states: &States, from: u64, to: u64) -> Vec<u64> {
    let mut ts: Vec<u64> = states.values().flat_map(|v| v.iter().map(|s| s.0)).collect();
    ts.push(from);
    ts.push(to);
    ts.retain(|t| *t >= from && *t <= to);
    ts.sort();
    ts.dedup();
    ts.windows(2).filter(|w| w[1] - w[0] >= 2_000).map(|w| (w[0] + w[1]) / 2).collect()
}

const CLASSES: [&str; 5] = ["active", "pinned_source", "reserved_destination", "cached_free", "free"];
const QUEUES: [&str; 5] =
    ["waiting", "running", "waiting_for_remote_kv", "held_prefills", "pending_reservations"];

fn check_exact(run: &Path, svg: &str, states: &States, only: Option<&str>) -> usize {
    let caps = charts(svg, "capacity", "data-blocks-top");
    let queues = charts(svg, "queues", "data-value-top");
    match only {
        Some(w) => assert_eq!(caps.keys().collect::<Vec<_>>(), [w]),
        None => assert_eq!(caps.len(), states.len(), "one panel per engine worker"),
    }
    let mut checked = 0;
    for (w, cap) in &caps {
        let wid: WorkerId = w.parse().unwrap();
        let q = &queues[w];
        let total = cap.top_value;
        for t in sample_instants(states, cap.t0 as u64, cap.t1 as u64) {
            let Some((c, qs)) = state_at(&states[&wid], t) else {
                continue;
            };
            let x = cap.x(t);
            for (k, name) in CLASSES.iter().enumerate() {
                let drawn = cap.layer(name, x);
                assert!(
                    (drawn - c[k] as f64).abs() < 0.05,
                    "{} {w} {name} at {} ms: drawn {drawn}, fold {}",
                    run.display(),
                    t as f64 / 1e6,
                    c[k]
                );
            }
            let booked = cap.line("booked", x);
            assert!(
                (booked - (c[5] as f64).min(total)).abs() < 0.05,
                "{w} booked at {t}: {booked} vs {}",
                c[5]
            );
            for (k, name) in QUEUES.iter().enumerate() {
                let drawn = q.line(name, x);
                assert!(
                    (drawn - qs[k] as f64).abs() < 0.05,
                    "{w} {name} at {t}: drawn {drawn}, fold {}",
                    qs[k]
                );
            }
            checked += 1;
        }
    }
    checked
}

#[test]
fn svg_series_match_the_folds_at_sampled_instants() {
    for (name, _) in scripted() {
        let run = fixtures_dir().join(name);
        let states = fold_states(&run);
        let svg = timeline(&run, &[]);
        // Text is plain SVG text: no font files, no embedded images, axes and legend present.
        assert!(!svg.contains("@font-face") && !svg.contains("<image"));
        for needle in [
            "time (ms)",
            "blocks",
            "requests",
            "pinned source",
            "reserved destination",
            "router booked",
            "prefill-0",
        ] {
            assert!(svg.contains(needle), "{name}: no `{needle}` in the SVG");
        }
        let checked = check_exact(&run, &svg, &states, None);
        assert!(checked >= 10, "{name}: only {checked} instants checked");
    }
}

#[test]
fn window_and_worker_selection_match_the_folds() {
    let run = fixtures_dir().join("scripted-cascade");
    let states = fold_states(&run);
    let svg = timeline(&run, &["--worker", "prefill-0", "--from", "450", "--to", "3100"]);
    let checked = check_exact(&run, &svg, &states, Some("prefill-0"));
    assert!(checked > 10, "only {checked}");
    // The stall (2000–3006 ms) is marked on the prefill panel.
    assert!(svg.contains("stall 2000–3006 ms"), "stall band missing");
}

#[test]
fn downsampled_values_are_fold_values_from_the_same_bucket() {
    let run = fixtures_dir().join("scripted-cascade");
    let states = fold_states(&run);
    let svg = timeline(&run, &["--buckets", "2"]);
    let caps = charts(&svg, "capacity", "data-blocks-top");
    let mut checked = 0;
    for (w, cap) in &caps {
        let st = &states[&w.parse::<WorkerId>().unwrap()];
        assert!(cap.bucket_ns > 0);
        // Few points survive: at most 2 + 2 × 6 per bucket (plus the window start).
        let vertices = cap.paths["pinned_source"].matches('V').count();
        assert!(vertices <= 2 * (2 * 14 + 2) + 2, "{w}: {vertices} vertices");
        for t in sample_instants(&states, cap.t0 as u64, cap.t1 as u64) {
            let x = cap.x(t);
            let bucket_start = cap.t0 as u64 + (t - cap.t0 as u64) / cap.bucket_ns * cap.bucket_ns;
            // The fold's states in force anywhere in [bucket_start, t].
            let candidates: Vec<[u64; 6]> = st
                .iter()
                .filter(|s| s.0 >= bucket_start && s.0 <= t)
                .map(|s| s.1)
                .chain(state_at(st, bucket_start).map(|s| s.0))
                .collect();
            let drawn: Vec<f64> = CLASSES.iter().map(|c| cap.layer(c, x)).collect();
            assert!(
                candidates.iter().any(|c| (0..5).all(|k| (drawn[k] - c[k] as f64).abs() < 0.05)),
                "{w} at {} ms: drawn {drawn:?} is no fold state of its bucket",
                t as f64 / 1e6
            );
            checked += 1;
        }
    }
    assert!(checked > 50);
}

#[test]
fn bad_arguments_are_exit_2() {
    let run = fixtures_dir().join("scripted-cascade");
    let dir = tempfile::tempdir().unwrap();
    for extra in [
        vec!["--worker", "decode-7"],
        vec!["--worker", "router"],
        vec!["--from", "300", "--to", "200"],
        vec!["--from", "-5"],
    ] {
        let out = support::cli()
            .arg("timeline")
            .arg(&run)
            .arg("--svg")
            .arg(dir.path().join("x.svg"))
            .args(&extra)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{extra:?}");
        assert!(!dir.path().join("x.svg").exists(), "{extra:?} wrote an SVG");
    }
}

#[test]
fn json_summary_names_the_file_window_and_the_stall_inspect_finds() {
    let run = fixtures_dir().join("scripted-cascade");
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("t.svg");
    let out = support::cli()
        .arg("timeline")
        .arg(&run)
        .arg("--svg")
        .arg(&svg)
        .args(["--json", "--buckets", "2"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["bytes"].as_u64().unwrap(), std::fs::metadata(&svg).unwrap().len());
    assert_eq!(v["from_ms"], 0.0);
    assert_eq!(v["to_ms"], 3600.0);
    assert_eq!(v["stalls"], serde_json::json!([{"worker": "prefill-0", "from_ms": 2000.0, "to_ms": 3006.0}]));
    for w in v["workers"].as_array().unwrap() {
        // Two buckets keep at most 2 × (2 + 2 × 6) points plus the window's start.
        assert!(w["capacity_points"].as_u64().unwrap() <= 29, "{w}");
        assert!(w["bucket_ms"].as_f64().unwrap() > 0.0, "{w}");
    }
}

/// `--y-axis used` draws only the blocks in use, scaled to their peak; `percent` labels the pool
/// in percent; `--from`/`--to` take the axis's units (`1.5s` is `1500`).
#[test]
fn y_axis_modes_and_window_units() {
    let run = fixtures_dir().join("scripted-cascade");
    let t = tempfile::tempdir().unwrap();
    let draw = |name: &str, args: &[&str]| -> String {
        let svg = t.path().join(name);
        let o = support::cli().arg("timeline").arg(&run).arg("--svg").arg(&svg).args(args).output().unwrap();
        assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        std::fs::read_to_string(svg).unwrap()
    };
    let blocks = draw("blocks.svg", &[]);
    let used = draw("used.svg", &["--y-axis", "used"]);
    let percent = draw("percent.svg", &["--y-axis", "percent"]);
    let doc = roxmltree::Document::parse(&used).unwrap();
    let states = fold_states(&run);
    for g in doc.descendants().filter(|n| n.attribute("class") == Some("capacity")) {
        let w: WorkerId = g.attribute("data-worker").unwrap().parse().unwrap();
        let top: u64 = g.attribute("data-blocks-top").unwrap().parse().unwrap();
        let peak_used = states[&w].iter().map(|(_, c, _)| c[0] + c[1] + c[2]).max().unwrap();
        let total = RunReader::open(&run)
            .unwrap()
            .headers()
            .iter()
            .find(|h| h.worker == w)
            .unwrap()
            .engine
            .total_blocks as u64;
        assert!(
            top >= peak_used.max(1) && top <= total.max(peak_used.max(1) * 2),
            "{w}: top {top}, peak used {peak_used}"
        );
        let series: Vec<&str> = g.descendants().filter_map(|n| n.attribute("data-series")).collect();
        assert!(!series.contains(&"free") && !series.contains(&"cached_free"), "{w}: {series:?}");
    }
    assert!(used.contains("blocks in use") && percent.contains("% of blocks") && blocks.contains(">blocks<"));
    assert_eq!(
        draw("a.svg", &["--from", "1.5s", "--to", "4000ms"]),
        draw("b.svg", &["--from", "1500", "--to", "4s"])
    );
    let o =
        support::cli().arg("timeline").arg(&run).args(["--svg", "x.svg", "--from", "soon"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
}
