//! What the benchmarks share in their figures: milliseconds, percentiles,
//! and a pass's stages as medians.

#![allow(
    dead_code,
    reason = "shared by the benchmarks, each of which uses only a part"
)]

use std::time::Duration;

use eitri_agent::stages::Stages;

/// The median of every stage the passes of `traces` went through, in the
/// order of the first, and of their totals; `what` names the passes.
pub fn print_stages(what: &str, traces: &[Stages]) {
    let mut order: Vec<&'static str> = Vec::new();
    for trace in traces {
        for mark in &trace.marks {
            if !order.contains(&mark.stage) {
                order.push(mark.stage);
            }
        }
    }
    println!(
        "stage medians over {} {what} (ms; nested stages are inside their parents):",
        traces.len()
    );
    for stage in order {
        let values: Vec<f64> = traces.iter().map(|t| ms(t.of(stage))).collect();
        let count = traces
            .first()
            .map_or(0, |t| t.marks.iter().filter(|m| m.stage == stage).count());
        println!("  {stage:<16} {:>8.3}  (×{count})", percentile(values, 0.5));
    }
    println!(
        "  {:<16} {:>8.3}",
        "total",
        percentile(traces.iter().map(|t| ms(t.total)).collect(), 0.5)
    );
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub fn percentile(mut values: Vec<f64>, p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    values
        .get(((values.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or(f64::NAN)
}
