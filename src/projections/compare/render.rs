//! The comparison's SVG: latency CDFs per run and a strip per run of its peak pinned and
//! reserved blocks over time.

use super::RunSummary;
use crate::projections::svg::{esc, fmt_tick, layer_path, nice_step};
use crate::units::NS_PER_MS_F64;
use std::fmt::Write as _;

const WIDTH: f64 = 1000.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 24.0;
const PANEL_GAP: f64 = 70.0;
const CDF_TOP: f64 = 86.0;
const CDF_H: f64 = 240.0;
const STRIP_H: f64 = 80.0;
/// Vertical room per strip besides its chart: title above, axis labels below.
const STRIP_EXTRA: f64 = 62.0;

/// One color per run, in order (cycled past eight runs).
const RUN_COLORS: [&str; 8] =
    ["#3b6fb6", "#e0542c", "#1d9e8f", "#8e5cc2", "#d62f8f", "#6b8e23", "#b8860b", "#555555"];
/// The timeline's colors for the two block classes.
const PINNED_COLOR: &str = "#e0542c";
const RESERVED_COLOR: &str = "#8e5cc2";

/// Milliseconds shown in seconds from 10,000 ms on, as the tables do.
fn time_unit(max_ms: f64) -> (&'static str, f64) {
    if max_ms >= 10_000.0 {
        ("s", 1e3)
    } else {
        ("ms", 1.0)
    }
}

/// Renders the comparison as a standalone SVG: the TTFT and E2E CDFs of every run side by side
/// (one line per run, legend by `names`), and below them one strip per run of pinned and
/// reserved blocks over time, summed over workers. `names[i]` names `runs[i]`.
///
/// Geometry carries `data-*` attributes so tests can read values back: each CDF panel its
/// x range in ms and pixel edges, each CDF line `data-run` and `data-chart` (`ttft`, `e2e`).
pub fn render_svg(runs: &[RunSummary], names: &[String]) -> String {
    let strips_top = CDF_TOP + CDF_H + 96.0;
    let height = strips_top + runs.len() as f64 * (STRIP_H + STRIP_EXTRA) + 10.0;
    let mut svg = String::with_capacity(64 * 1024);
    let _ = write!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH:.0}" height="{height:.0}" viewBox="0 0 {WIDTH:.0} {height:.0}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12" fill="#222">"##
    );
    let _ = write!(svg, r#"<rect x="0" y="0" width="{WIDTH:.0}" height="{height:.0}" fill="white"/>"#);
    let title = format!("{} run{} compared", runs.len(), if runs.len() == 1 { "" } else { "s" });
    let _ = write!(
        svg,
        r##"<text x="{LEFT}" y="26" font-size="17" font-weight="bold">{}</text><text x="{LEFT}" y="46" fill="#555">{}</text>"##,
        esc(&title),
        esc("latency CDFs of completed requests; below, pinned source + reserved destination blocks summed over workers")
    );
    let panel_w = (WIDTH - LEFT - RIGHT - PANEL_GAP) / 2.0;
    for (k, (chart, label)) in [("ttft", "TTFT"), ("e2e", "E2E latency")].into_iter().enumerate() {
        let x0 = LEFT + k as f64 * (panel_w + PANEL_GAP);
        let cdfs: Vec<&Vec<(f64, f64)>> =
            runs.iter().map(|r| if k == 0 { &r.ttft_cdf_ms } else { &r.e2e_cdf_ms }).collect();
        cdf_panel(&mut svg, chart, label, x0, panel_w, &cdfs, names);
    }
    // Legend: one line swatch per run.
    let mut lx = LEFT;
    let ly = CDF_TOP + CDF_H + 62.0;
    for (i, name) in names.iter().enumerate() {
        let color = RUN_COLORS[i % RUN_COLORS.len()];
        let _ = write!(
            svg,
            r#"<g class="legend" data-run="{}"><line x1="{lx:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="3"/><text x="{:.1}" y="{ly:.1}">{}</text></g>"#,
            esc(name),
            ly - 4.0,
            lx + 22.0,
            ly - 4.0,
            lx + 28.0,
            esc(name)
        );
        // Generic sans-serif at 12 px averages about 6.6 px per character.
        lx += 28.0 + name.chars().count() as f64 * 6.6 + 24.0;
    }
    // Strips share one time axis (from each run's first record) and one block scale.
    let span_ns = runs.iter().map(|r| r.last_at_ns.saturating_sub(r.first_at_ns)).max().unwrap_or(0).max(1);
    let top_blocks = runs.iter().map(|r| r.peak_pinned_plus_reserved_blocks).max().unwrap_or(0).max(1);
    let (unit, div) = time_unit(span_ns as f64 / NS_PER_MS_F64);
    let span = span_ns as f64 / NS_PER_MS_F64 / div;
    let step = nice_step(span, 10.0);
    let (x0, x1) = (LEFT, WIDTH - RIGHT);
    let x_of = |t_ns: u64, origin: u64| {
        x0 + (t_ns.saturating_sub(origin) as f64 / span_ns as f64).min(1.0) * (x1 - x0)
    };
    for (i, r) in runs.iter().enumerate() {
        let top = strips_top + i as f64 * (STRIP_H + STRIP_EXTRA);
        let chart_top = top + 22.0;
        let bottom = chart_top + STRIP_H;
        let y_of = |v: f64| bottom - (v / top_blocks as f64).min(1.0) * STRIP_H;
        let _ = write!(
            svg,
            r##"<text x="{LEFT}" y="{:.1}" font-size="13" font-weight="bold">{}</text><text x="{:.1}" y="{:.1}" fill="#555" font-size="11">{} · {} · {} · peak pinned + reserved {} blocks</text>"##,
            top + 12.0,
            esc(&names[i]),
            LEFT + names[i].chars().count() as f64 * 7.4 + 14.0,
            top + 12.0,
            esc(&r.backend),
            esc(&r.policy),
            esc(&r.shape),
            r.peak_pinned_plus_reserved_blocks
        );
        let _ = write!(
            svg,
            r##"<g class="strip" data-run="{}" data-x0="{x0:.2}" data-x1="{x1:.2}" data-span-ns="{span_ns}" data-y-bottom="{bottom:.2}" data-y-top="{chart_top:.2}" data-blocks-top="{top_blocks}"><rect x="{x0:.2}" y="{chart_top:.2}" width="{:.2}" height="{STRIP_H:.2}" fill="#f6f7f9" stroke="#c9ced6" stroke-width="0.5"/>"##,
            esc(&names[i]),
            x1 - x0
        );
        let s = &r.blocks_series;
        if !s.is_empty() {
            let xs: Vec<f64> = s.iter().map(|p| x_of(p.at_ns, r.first_at_ns)).collect();
            let end = x_of(r.last_at_ns, r.first_at_ns);
            let zero: Vec<f64> = s.iter().map(|_| bottom).collect();
            let pinned: Vec<f64> = s.iter().map(|p| y_of(p.values[0] as f64)).collect();
            let both: Vec<f64> = s.iter().map(|p| y_of((p.values[0] + p.values[1]) as f64)).collect();
            let _ = write!(
                svg,
                r#"<path class="pinned" d="{}" fill="{PINNED_COLOR}" stroke="none"/><path class="reserved" d="{}" fill="{RESERVED_COLOR}" stroke="none"/>"#,
                layer_path(&xs, &pinned, &zero, end),
                layer_path(&xs, &both, &pinned, end)
            );
        }
        svg.push_str("</g>");
        // Block scale on the left, time below.
        let _ = write!(
            svg,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555" font-size="10">{top_blocks}</text><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555" font-size="10">0</text>"##,
            x0 - 6.0,
            chart_top + 9.0,
            x0 - 6.0,
            bottom
        );
        x_ticks(&mut svg, span, step, bottom, 15.0, |t| x0 + (t / span).min(1.0) * (x1 - x0));
        let _ = write!(
            svg,
            r##"<text x="{x1:.2}" y="{:.2}" text-anchor="end" fill="#555" font-size="10">time since the run's first record ({unit}) · <tspan fill="{PINNED_COLOR}">■ pinned source</tspan> <tspan fill="{RESERVED_COLOR}">■ reserved destination</tspan></text>"##,
            bottom + 30.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// One CDF panel with a line per run.
fn cdf_panel(
    svg: &mut String,
    chart: &str,
    label: &str,
    x0: f64,
    width: f64,
    cdfs: &[&Vec<(f64, f64)>],
    names: &[String],
) {
    let x1 = x0 + width;
    let (top, bottom) = (CDF_TOP, CDF_TOP + CDF_H);
    let max_ms = cdfs.iter().filter_map(|c| c.last().map(|p| p.0)).fold(0.0f64, f64::max);
    let top_ms = if max_ms > 0.0 { max_ms } else { 1.0 };
    let (unit, div) = time_unit(top_ms);
    let x_of = |ms: f64| x0 + (ms / top_ms).clamp(0.0, 1.0) * width;
    let y_of = |share: f64| bottom - share.clamp(0.0, 1.0) * CDF_H;
    let _ = write!(
        svg,
        r##"<text x="{x0:.1}" y="{:.1}" font-size="14" font-weight="bold">{} CDF</text><g class="cdf-panel" data-chart="{chart}" data-x0="{x0:.2}" data-x1="{x1:.2}" data-ms-at-x1="{top_ms}" data-y-bottom="{bottom:.2}" data-y-top="{top:.2}"><rect x="{x0:.2}" y="{top:.2}" width="{width:.2}" height="{CDF_H:.2}" fill="#f6f7f9" stroke="#c9ced6" stroke-width="0.5"/>"##,
        top - 10.0,
        esc(label)
    );
    for q in [0.0, 0.25, 0.5, 0.75, 1.0] {
        let y = y_of(q);
        let _ = write!(
            svg,
            r##"<line x1="{x0:.2}" y1="{y:.2}" x2="{x1:.2}" y2="{y:.2}" stroke="#dde1e6"/><text x="{:.2}" y="{:.2}" text-anchor="end" fill="#555" font-size="10">{q:.2}</text>"##,
            x0 - 6.0,
            y + 3.5
        );
    }
    for (i, c) in cdfs.iter().enumerate() {
        if c.is_empty() {
            continue;
        }
        // A step function: flat until the next value, then up to its share.
        let mut d = String::new();
        let _ = write!(d, "M{:.2},{:.2}V{:.2}", x_of(c[0].0), y_of(0.0), y_of(c[0].1));
        for p in &c[1..] {
            let _ = write!(d, "H{:.2}V{:.2}", x_of(p.0), y_of(p.1));
        }
        let _ = write!(
            svg,
            r#"<path class="cdf" data-chart="{chart}" data-run="{}" d="{d}" fill="none" stroke="{}" stroke-width="2"/>"#,
            esc(&names[i]),
            RUN_COLORS[i % RUN_COLORS.len()]
        );
    }
    svg.push_str("</g>");
    let span = top_ms / div;
    let step = nice_step(span, 5.0);
    x_ticks(svg, span, step, bottom, 16.0, |t| x_of(t * div));
    let _ = write!(
        svg,
        r##"<text x="{:.2}" y="{:.2}" text-anchor="middle" fill="#555">{} ({unit}) · share of completed requests at or below</text>"##,
        (x0 + x1) / 2.0,
        bottom + 34.0,
        esc(label)
    );
}

/// Tick marks and labels every `step` along an x axis spanning `span` (axis units) at `bottom`;
/// `x_of` places a value, labels sit `label_dy` below the axis.
fn x_ticks(svg: &mut String, span: f64, step: f64, bottom: f64, label_dy: f64, x_of: impl Fn(f64) -> f64) {
    let mut t = 0.0;
    while t <= span + step * 1e-9 {
        let x = x_of(t);
        let _ = write!(
            svg,
            r##"<line x1="{x:.2}" y1="{bottom:.2}" x2="{x:.2}" y2="{:.2}" stroke="#8a9099"/><text x="{x:.2}" y="{:.2}" text-anchor="middle" fill="#555" font-size="10">{}</text>"##,
            bottom + 4.0,
            bottom + label_dy,
            fmt_tick(t, step)
        );
        t += step;
    }
}
