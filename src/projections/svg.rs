//! SVG primitives shared by the pictures (`timeline`, `compare`): escaping, tick steps and
//! labels, step-shaped paths.

use std::fmt::Write as _;

/// Escapes text for SVG text content and attribute values.
pub(crate) fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A "nice" tick step (1, 2 or 5 × 10^k) giving about `target` ticks over `span`.
pub(crate) fn nice_step(span: f64, target: f64) -> f64 {
    if span <= 0.0 || !span.is_finite() {
        return 1.0;
    }
    let raw = span / target;
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let m = if norm <= 1.0 {
        1.0
    } else if norm <= 2.0 {
        2.0
    } else if norm <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

pub(crate) fn fmt_tick(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 { 0 } else { (-step.log10().floor()) as usize };
    format!("{v:.decimals$}")
}

/// Step path of one stacked layer: the top boundary left to right, the bottom right to left.
pub(crate) fn layer_path(xs: &[f64], tops: &[f64], bottoms: &[f64], x_end: f64) -> String {
    let mut d = String::new();
    let n = xs.len();
    let _ = write!(d, "M{:.2},{:.2}", xs[0], tops[0]);
    for i in 1..n {
        let _ = write!(d, "H{:.2}V{:.2}", xs[i], tops[i]);
    }
    let _ = write!(d, "H{:.2}V{:.2}", x_end, bottoms[n - 1]);
    for i in (0..n).rev() {
        let _ = write!(d, "H{:.2}", xs[i]);
        if i > 0 {
            let _ = write!(d, "V{:.2}", bottoms[i - 1]);
        }
    }
    d.push('Z');
    d
}

/// Step line through `(x, y)` points, held to `x_end`.
pub(crate) fn step_line(xs: &[f64], ys: &[f64], x_end: f64) -> String {
    let mut d = String::new();
    let _ = write!(d, "M{:.2},{:.2}", xs[0], ys[0]);
    for i in 1..xs.len() {
        let _ = write!(d, "H{:.2}V{:.2}", xs[i], ys[i]);
    }
    let _ = write!(d, "H{x_end:.2}");
    d
}
