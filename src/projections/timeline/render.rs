//! The timeline's SVG: one panel per worker, its stacked capacity chart above its queue
//! chart, with stall bands, the booked line and axes.

use super::{TimelineData, YAxis, CAPACITY_SERIES, QUEUE_SERIES};
use crate::projections::svg::{esc, fmt_tick, layer_path, nice_step, step_line};
use crate::units::NS_PER_MS_F64;
use std::fmt::Write as _;

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 24.0;
const CAPACITY_HEIGHT: f64 = 190.0;
const QUEUE_HEIGHT: f64 = 80.0;
const PANEL_GAP: f64 = 64.0;
const HEAD: f64 = 96.0;

/// Colors of the block classes (bottom to top) and of the booked line.
const CAPACITY_COLORS: [&str; 5] = ["#3b6fb6", "#e0542c", "#8e5cc2", "#9fd49a", "#eceff3"];
const CAPACITY_LABELS: [&str; 5] = ["active", "pinned source", "reserved destination", "cached-free", "free"];
const QUEUE_COLORS: [&str; 5] = ["#d62f8f", "#3b6fb6", "#8e5cc2", "#e0542c", "#1d9e8f"];
const QUEUE_LABELS: [&str; 5] =
    ["waiting", "running", "waiting for remote KV", "held prefills", "pending reservations"];

struct Scale {
    t0: f64,
    t1: f64,
    x0: f64,
    x1: f64,
}

impl Scale {
    fn x(&self, t_ns: u64) -> f64 {
        let t = t_ns as f64;
        let f = ((t - self.t0) / (self.t1 - self.t0)).clamp(0.0, 1.0);
        self.x0 + f * (self.x1 - self.x0)
    }
}

fn legend(svg: &mut String, x: &mut f64, y: f64, color: &str, label: &str, dashed: bool, line: bool) {
    if line {
        let dash = if dashed { " stroke-dasharray=\"5,3\"" } else { "" };
        let _ = write!(
            svg,
            r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="2"{dash}/>"#,
            *x,
            y - 4.0,
            *x + 18.0,
            y - 4.0
        );
    } else {
        let _ = write!(
            svg,
            r##"<rect x="{:.1}" y="{:.1}" width="14" height="10" fill="{color}" stroke="#8a9099" stroke-width="0.5"/>"##,
            *x,
            y - 9.0
        );
    }
    let _ = write!(svg, r#"<text x="{:.1}" y="{:.1}">{}</text>"#, *x + 22.0, y, esc(label));
    // Generic sans-serif at 12 px averages about 6.6 px per character.
    *x += 22.0 + label.chars().count() as f64 * 6.6 + 18.0;
}

/// Renders the timeline as a standalone SVG document.
pub fn render_svg(data: &TimelineData) -> String {
    let n = data.workers.len().max(1) as f64;
    let height = HEAD + n * (CAPACITY_HEIGHT + QUEUE_HEIGHT + PANEL_GAP + 80.0) + 10.0;
    let mut svg = String::with_capacity(64 * 1024);
    let _ = write!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH:.0}" height="{height:.0}" viewBox="0 0 {WIDTH:.0} {height:.0}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12" fill="#222">"##
    );
    let _ = write!(svg, r#"<rect x="0" y="0" width="{WIDTH:.0}" height="{height:.0}" fill="white"/>"#);
    // Title: run info from the headers.
    let h0 = data.headers.first();
    let span_ms = (data.to_ns - data.from_ns) as f64 / NS_PER_MS_F64;
    let use_s = span_ms >= 10_000.0;
    let (unit, div) = if use_s { ("s", 1e9) } else { ("ms", NS_PER_MS_F64) };
    let title = match h0 {
        Some(h) => format!(
            "KV blocks per worker · {} · {} · seed {} · run {}",
            h.backend.as_str(),
            h.policy.as_str(),
            h.seed,
            h.run_id
        ),
        None => "KV blocks per worker".to_string(),
    };
    let sub = format!(
        "{} worker{} drawn · {:.3}–{:.3} {unit} · {} records read",
        data.workers.len(),
        if data.workers.len() == 1 { "" } else { "s" },
        data.from_ns as f64 / div,
        data.to_ns as f64 / div,
        data.records
    );
    let _ = write!(
        svg,
        r##"<text x="{LEFT}" y="26" font-size="17" font-weight="bold">{}</text><text x="{LEFT}" y="46" fill="#555">{}</text>"##,
        esc(&title),
        esc(&sub)
    );
    // Legend.
    let mut lx = LEFT;
    for k in 0..5 {
        legend(&mut svg, &mut lx, 70.0, CAPACITY_COLORS[k], CAPACITY_LABELS[k], false, false);
    }
    legend(&mut svg, &mut lx, 70.0, "#111", "router booked", true, true);
    if !data.stalls.is_empty() {
        legend(&mut svg, &mut lx, 70.0, "#b00020", &data.stall_rule, false, false);
    }
    let mut lx = LEFT;
    for k in 0..5 {
        legend(&mut svg, &mut lx, 88.0, QUEUE_COLORS[k], QUEUE_LABELS[k], false, true);
    }

    let sc = Scale { t0: data.from_ns as f64, t1: data.to_ns as f64, x0: LEFT, x1: WIDTH - RIGHT };
    let t_step = nice_step((data.to_ns - data.from_ns) as f64 / div, 10.0);
    let mut top = HEAD;
    for (wi, w) in data.workers.iter().enumerate() {
        let cap_top = top + 50.0;
        let cap_bottom = cap_top + CAPACITY_HEIGHT;
        let q_top = cap_bottom + 30.0;
        let q_bottom = q_top + QUEUE_HEIGHT;
        let h = data.headers.iter().find(|h| h.worker == w.worker);
        // What happened on this worker, in one line under its name.
        let mine: Vec<_> = data.stalls.iter().filter(|s| s.0 == w.worker).collect();
        let gated = data.gating.iter().find(|g| g.0 == w.worker);
        let (note, note_color) = match (mine.first(), gated) {
            (Some((_, a, b)), _) => (
                format!(
                    "stranding stall{} ×{}, first {:.3}–{} {unit}",
                    if mine.len() > 1 { "s" } else { "" },
                    mine.len(),
                    *a as f64 / div,
                    b.map(|b| format!("{:.3}", b as f64 / div)).unwrap_or_else(|| "end".into())
                ),
                "#7a0016",
            ),
            (None, Some((_, n, peak))) => (
                format!(
                    "destination gating: {n} reservations waited here ahead of their prefill (FIFO peak {peak}); no stranded source KV"
                ),
                "#0f6e64",
            ),
            (None, None) => (String::new(), "#555"),
        };
        let _ = write!(
            svg,
            r##"<text x="{LEFT}" y="{:.1}" font-size="14" font-weight="bold">{} · {} blocks × {} tokens{}</text><text x="{LEFT}" y="{:.1}" font-size="11" fill="{note_color}">{}</text>"##,
            top + 14.0,
            w.worker,
            w.total_blocks,
            w.block_size,
            h.map(|h| format!(" · {}", h.backend.as_str())).unwrap_or_default(),
            top + 30.0,
            esc(&note),
        );
        // --- capacity chart ---
        // The value the chart's top stands for: the pool, or the peak of what is in use.
        let used_peak = w.capacity.iter().map(|s| s.values[0] + s.values[1] + s.values[2]).max().unwrap_or(0);
        let (layers, chart_top) = match data.y_axis {
            YAxis::Used => {
                let step = nice_step(used_peak.max(1) as f64, 4.0).max(1.0);
                (3, ((used_peak.max(1) as f64 / step).ceil() * step).max(1.0) as u64)
            }
            YAxis::Blocks | YAxis::Percent => (5, w.total_blocks),
        };
        let total = chart_top.max(1) as f64;
        let ypx = |v: f64| cap_bottom - (v / total).min(1.0) * CAPACITY_HEIGHT;
        let _ = write!(
            svg,
            r#"<g class="capacity" data-worker="{}" data-t0-ns="{}" data-t1-ns="{}" data-x0="{:.2}" data-x1="{:.2}" data-y-bottom="{:.2}" data-y-top="{:.2}" data-blocks-top="{}" data-bucket-ns="{}">"#,
            w.worker,
            data.from_ns,
            data.to_ns,
            sc.x0,
            sc.x1,
            cap_bottom,
            cap_top,
            chart_top,
            w.capacity_bucket_ns
        );
        let _ = write!(
            svg,
            r##"<clipPath id="clip{wi}"><rect x="{:.2}" y="{:.2}" width="{:.2}" height="{:.2}"/></clipPath>"##,
            sc.x0,
            cap_top - 1.0,
            sc.x1 - sc.x0,
            CAPACITY_HEIGHT + 2.0
        );
        if !w.capacity.is_empty() {
            let xs: Vec<f64> = w.capacity.iter().map(|s| sc.x(s.at_ns)).collect();
            let mut below = vec![0.0f64; w.capacity.len()];
            for k in 0..layers {
                let above: Vec<f64> =
                    w.capacity.iter().zip(&below).map(|(s, b)| b + s.values[k] as f64).collect();
                let tops: Vec<f64> = above.iter().map(|v| ypx(*v)).collect();
                let bottoms: Vec<f64> = below.iter().map(|v| ypx(*v)).collect();
                let _ = write!(
                    svg,
                    r#"<path data-series="{}" d="{}" fill="{}" stroke="none"/>"#,
                    CAPACITY_SERIES[k],
                    layer_path(&xs, &tops, &bottoms, sc.x1),
                    CAPACITY_COLORS[k]
                );
                below = above;
            }
            let booked: Vec<f64> = w.capacity.iter().map(|s| ypx(s.values[5] as f64)).collect();
            let _ = write!(
                svg,
                r##"<path data-series="booked" d="{}" fill="none" stroke="#111" stroke-width="1.6" stroke-dasharray="5,3" clip-path="url(#clip{wi})"/>"##,
                step_line(&xs, &booked, sc.x1)
            );
            // Where the router booked more than the worker has, say so on the top edge.
            let over: Vec<usize> =
                (0..w.capacity.len()).filter(|i| w.capacity[*i].values[5] > w.total_blocks).collect();
            if !over.is_empty() {
                let peak = over.iter().map(|i| w.capacity[*i].values[5]).max().unwrap_or(0);
                let _ = write!(
                    svg,
                    r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#111" font-size="11">router booked up to {} blocks, above the {} the worker has (dashed line clipped at the top)</text>"##,
                    sc.x1,
                    top + 14.0,
                    peak,
                    w.total_blocks
                );
            }
        }
        // Stranding stalls on this worker, as a band over the stack.
        for (sw, start, end) in &data.stalls {
            if *sw != w.worker {
                continue;
            }
            let xa = sc.x(*start);
            let xb = sc.x(end.unwrap_or(data.to_ns));
            if xb <= xa {
                continue;
            }
            let decimals = if use_s { 1 } else { 0 };
            let label = format!(
                "stall {:.decimals$}–{} {unit}",
                *start as f64 / div,
                end.map(|e| format!("{:.decimals$}", e as f64 / div)).unwrap_or_else(|| "end".into())
            );
            let text_w = label.chars().count() as f64 * 6.4 + 8.0;
            // Label a band only where it fits inside it; the panel title counts them all.
            let text = if xb - xa >= text_w {
                format!(
                    r##"<text x="{:.2}" y="{:.2}" fill="white" font-size="11" font-weight="bold">{}</text>"##,
                    xa + 4.0,
                    cap_top - 5.0,
                    esc(&label)
                )
            } else {
                String::new()
            };
            let _ = write!(
                svg,
                r##"<rect class="stall" x="{xa:.2}" y="{cap_top:.2}" width="{w:.2}" height="{CAPACITY_HEIGHT:.2}" fill="#b00020" fill-opacity="0.08" stroke="#7a0016" stroke-width="1.4" stroke-dasharray="5,3"/><rect x="{xa:.2}" y="{:.2}" width="{w:.2}" height="13" fill="#b00020" stroke="white" stroke-width="0.5"/>{text}"##,
                cap_top - 15.0,
                w = xb - xa,
            );
        }
        svg.push_str("</g>");
        // Axes of the capacity chart.
        match data.y_axis {
            YAxis::Blocks => {
                axis_y(&mut svg, cap_top, cap_bottom, w.total_blocks as f64, "blocks", sc.x0, sc.x1)
            }
            YAxis::Used => {
                axis_y(&mut svg, cap_top, cap_bottom, chart_top as f64, "blocks in use", sc.x0, sc.x1)
            }
            YAxis::Percent => axis_y(&mut svg, cap_top, cap_bottom, 100.0, "% of blocks", sc.x0, sc.x1),
        }
        axis_x(&mut svg, &sc, cap_bottom, data, t_step, div, false, unit);
        // --- queue chart ---
        let q_max = w.queues.iter().flat_map(|s| s.values.iter().copied()).max().unwrap_or(0).max(1) as f64;
        let q_step = nice_step(q_max, 3.0).max(1.0);
        let q_top_val = (q_max / q_step).ceil() * q_step;
        let qy = |v: f64| q_bottom - (v / q_top_val) * QUEUE_HEIGHT;
        let _ = write!(
            svg,
            r#"<g class="queues" data-worker="{}" data-t0-ns="{}" data-t1-ns="{}" data-x0="{:.2}" data-x1="{:.2}" data-y-bottom="{:.2}" data-y-top="{:.2}" data-value-top="{}">"#,
            w.worker, data.from_ns, data.to_ns, sc.x0, sc.x1, q_bottom, q_top, q_top_val
        );
        if !w.queues.is_empty() {
            let xs: Vec<f64> = w.queues.iter().map(|s| sc.x(s.at_ns)).collect();
            for k in 0..5 {
                if w.queues.iter().all(|s| s.values[k] == 0) {
                    continue;
                }
                let ys: Vec<f64> = w.queues.iter().map(|s| qy(s.values[k] as f64)).collect();
                // Dense lines (more than a point per 3 px) are drawn thin so they stay legible.
                let stroke = if w.queues.len() as f64 > (sc.x1 - sc.x0) / 3.0 { 0.8 } else { 1.6 };
                let _ = write!(
                    svg,
                    r#"<path data-series="{}" d="{}" fill="none" stroke="{}" stroke-width="{stroke}"/>"#,
                    QUEUE_SERIES[k],
                    step_line(&xs, &ys, sc.x1),
                    QUEUE_COLORS[k]
                );
            }
        }
        svg.push_str("</g>");
        axis_y(&mut svg, q_top, q_bottom, q_top_val, "requests", sc.x0, sc.x1);
        axis_x(&mut svg, &sc, q_bottom, data, t_step, div, true, unit);
        top = q_bottom + PANEL_GAP;
    }
    svg.push_str("</svg>\n");
    svg
}

fn axis_y(svg: &mut String, y_top: f64, y_bottom: f64, top_val: f64, label: &str, x0: f64, x1: f64) {
    let step = nice_step(top_val, 4.0).max(1.0);
    let _ = write!(
        svg,
        r##"<rect x="{x0:.2}" y="{y_top:.2}" width="{:.2}" height="{:.2}" fill="none" stroke="#9aa0a8" stroke-width="1"/>"##,
        x1 - x0,
        y_bottom - y_top
    );
    let mut v = 0.0;
    while v <= top_val + 1e-9 {
        let y = y_bottom - (v / top_val.max(1e-9)) * (y_bottom - y_top);
        let _ = write!(
            svg,
            r##"<line x1="{:.2}" y1="{y:.2}" x2="{x0:.2}" y2="{y:.2}" stroke="#9aa0a8"/><line x1="{x0:.2}" y1="{y:.2}" x2="{x1:.2}" y2="{y:.2}" stroke="#000" stroke-opacity="0.07"/><text x="{:.2}" y="{:.2}" text-anchor="end" font-size="11">{}</text>"##,
            x0 - 4.0,
            x0 - 6.0,
            y + 4.0,
            fmt_tick(v, step)
        );
        v += step;
    }
    let cy = (y_top + y_bottom) / 2.0;
    let _ = write!(
        svg,
        r##"<text transform="translate({:.2},{cy:.2}) rotate(-90)" text-anchor="middle" fill="#555">{label}</text>"##,
        x0 - 52.0
    );
}

#[allow(clippy::too_many_arguments)]
fn axis_x(
    svg: &mut String,
    sc: &Scale,
    y: f64,
    data: &TimelineData,
    step: f64,
    div: f64,
    with_label: bool,
    unit: &str,
) {
    let from = data.from_ns as f64 / div;
    let to = data.to_ns as f64 / div;
    let mut v = (from / step).ceil() * step;
    while v <= to + 1e-9 {
        let x = sc.x((v * div) as u64);
        let _ = write!(
            svg,
            r##"<line x1="{x:.2}" y1="{y:.2}" x2="{x:.2}" y2="{:.2}" stroke="#9aa0a8"/><text x="{x:.2}" y="{:.2}" text-anchor="middle" font-size="11">{}</text>"##,
            y + 4.0,
            y + 16.0,
            fmt_tick(v, step)
        );
        v += step;
    }
    if with_label {
        let _ = write!(
            svg,
            r##"<text x="{:.2}" y="{:.2}" text-anchor="middle" fill="#555">time ({unit})</text>"##,
            (sc.x0 + sc.x1) / 2.0,
            y + 32.0
        );
    }
}
