//! Counters, histograms and the Prometheus text format, for the metrics
//! file an operator's node_exporter reads (`--metrics-file`, the textfile
//! collector: no port is opened).
//!
//! Pieces hold their own numbers ([`Counter`], [`CounterVec`],
//! [`Histogram`], all lock-free or under a short lock) and the daemon
//! renders them once a tick with an [`Exposition`]: HELP and TYPE lines,
//! base units (seconds, bytes), `_total` counters, label values escaped.
//! A label set that could grow without bound (one per VM) is removed when
//! its VM is destroyed.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

/// A count that only rises.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }

    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Counters by the value of one label.
#[derive(Debug, Default)]
pub struct CounterVec(Mutex<BTreeMap<String, u64>>);

impl CounterVec {
    pub fn inc(&self, label: &str) {
        *self.0.lock().entry(label.to_owned()).or_default() += 1;
    }

    /// Makes the series exist at 0 (so a rate over it starts from zero).
    pub fn touch(&self, label: &str) {
        self.0.lock().entry(label.to_owned()).or_default();
    }

    /// Drops a series (its VM is gone).
    pub fn remove(&self, label: &str) {
        self.0.lock().remove(label);
    }

    pub fn get(&self, label: &str) -> u64 {
        self.0.lock().get(label).copied().unwrap_or(0)
    }

    pub fn snapshot(&self) -> Vec<(String, u64)> {
        self.0.lock().iter().map(|(k, v)| (k.clone(), *v)).collect()
    }
}

/// Bucket bounds, in seconds, for short operations (a step, a tick).
pub const FAST_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// Bucket bounds, in seconds, for boots.
pub const BOOT_BUCKETS: &[f64] = &[0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Observations in fixed buckets, with their sum and count.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative), then one for +Inf.
    counts: Vec<AtomicU64>,
    sum_ns: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, took: Duration) {
        let secs = took.as_secs_f64();
        let at = self
            .bounds
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(self.bounds.len());
        if let Some(c) = self.counts.get(at) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        self.sum_ns.fetch_add(
            u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }
}

/// The text exposition format, family by family.
#[derive(Debug, Default)]
pub struct Exposition(String);

/// A label value as the format needs it: backslash, quote and newline
/// escaped.
fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

fn labels(pairs: &[(&str, &str)]) -> String {
    if pairs.is_empty() {
        return String::new();
    }
    let inner: Vec<String> = pairs
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    format!("{{{}}}", inner.join(","))
}

fn number(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

impl Exposition {
    pub fn new() -> Exposition {
        Exposition::default()
    }

    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, pairs: &[(&str, &str)], value: f64) {
        let _ = writeln!(self.0, "{name}{} {}", labels(pairs), number(value));
    }

    /// A gauge family of one or more series.
    pub fn gauge(&mut self, name: &str, help: &str, series: &[(&[(&str, &str)], f64)]) {
        self.head(name, "gauge", help);
        for (pairs, v) in series {
            self.sample(name, pairs, *v);
        }
    }

    /// A counter family (`name` ends in `_total`) of one series.
    pub fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.head(name, "counter", help);
        self.sample(name, &[], value as f64);
    }

    /// A counter family (`name` ends in `_total`) of one or more series.
    pub fn counters(&mut self, name: &str, help: &str, series: &[(&[(&str, &str)], f64)]) {
        self.head(name, "counter", help);
        for (pairs, v) in series {
            self.sample(name, pairs, *v);
        }
    }

    /// A counter family with one label, a series per value.
    pub fn counter_vec(&mut self, name: &str, help: &str, label: &str, values: &CounterVec) {
        self.head(name, "counter", help);
        for (v, n) in values.snapshot() {
            self.sample(name, &[(label, &v)], n as f64);
        }
    }

    pub fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.head(name, "histogram", help);
        let mut cumulative = 0u64;
        for (i, bound) in h.bounds.iter().enumerate() {
            cumulative += h.counts.get(i).map_or(0, |c| c.load(Ordering::Relaxed));
            self.sample(
                &format!("{name}_bucket"),
                &[("le", &number(*bound))],
                cumulative as f64,
            );
        }
        cumulative += h
            .counts
            .get(h.bounds.len())
            .map_or(0, |c| c.load(Ordering::Relaxed));
        self.sample(
            &format!("{name}_bucket"),
            &[("le", "+Inf")],
            cumulative as f64,
        );
        let sum = h.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        self.sample(&format!("{name}_sum"), &[], sum);
        self.sample(&format!("{name}_count"), &[], cumulative as f64);
    }

    pub fn finish(self) -> String {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_is_cumulative_and_counts_its_sum() {
        let h = Histogram::new(&[0.1, 1.0]);
        h.observe(Duration::from_millis(50));
        h.observe(Duration::from_millis(500));
        h.observe(Duration::from_secs(5));
        let mut e = Exposition::new();

        e.histogram("x_seconds", "x", &h);

        let text = e.finish();
        assert!(text.contains("x_seconds_bucket{le=\"0.1\"} 1\n"), "{text}");
        assert!(text.contains("x_seconds_bucket{le=\"1\"} 2\n"), "{text}");
        assert!(text.contains("x_seconds_bucket{le=\"+Inf\"} 3\n"), "{text}");
        assert!(text.contains("x_seconds_sum 5.55\n"), "{text}");
        assert!(text.contains("x_seconds_count 3\n"), "{text}");
    }

    #[test]
    fn label_values_are_escaped() {
        let mut e = Exposition::new();

        e.gauge("g", "g", &[(&[("why", "a \"b\"\\\n")], 1.0)]);

        assert!(e.finish().contains("g{why=\"a \\\"b\\\"\\\\\\n\"} 1\n"));
    }
}
