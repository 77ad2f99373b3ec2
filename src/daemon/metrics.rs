//! `--metrics-file`: the host's numbers in the Prometheus text format,
//! written atomically once a tick for node_exporter's textfile collector
//! (no port is opened). Families:
//!
//! | family | type | what |
//! |---|---|---|
//! | `eitri_agent_info{version,host_id}` | gauge | always 1 |
//! | `eitri_agent_start_time_seconds` | gauge | when the agent started (Unix) |
//! | `eitri_tick_duration_seconds` | histogram | one tick of the main loop: step, report, this file |
//! | `eitri_step_duration_seconds` | histogram | `Engine::step` |
//! | `eitri_snapshot_epoch` | gauge | the accepted epoch |
//! | `eitri_contact_failures_total{kind}` | counter | failed contacts with the source, by kind |
//! | `eitri_vms{power,phase}` | gauge | VMs in the last report |
//! | `eitri_vms_quarantined` | gauge | VMs waiting out their grace |
//! | `eitri_create_attempts_total` | counter | create attempts counted against a budget |
//! | `eitri_create_failures_total{permanence}` | counter | failed creates: `permanent`, `transient`, or `host` (the host must change; no attempt spent) |
//! | `eitri_create_refunds_total` | counter | attempts given back (out of time, not the VM's fault) |
//! | `eitri_vm_lost_total{vm_id}` | counter | booted again after its hypervisor died unasked (series gone at destroy) |
//! | `eitri_vm_unhealthy_probes_total{vm_id}` | counter | readiness probes failed past the grace or after ready |
//! | `eitri_vm_probe_restarts_total{vm_id}` | counter | boots again by a probe's `restart_after` |
//! | `eitri_vm_limit{vm_id,limit}` | gauge | the limits a VM runs with: `cpu_max_millis`, `cpu_burst_ms`, `disk_mbps`, `disk_iops`, `net_mbps` (0: none) |
//! | `eitri_vm_egress_ranges{vm_id,list}` | gauge | ranges in its own `deny` and `allow` lists held on the host |
//! | `eitri_vm_probe_answering{vm_id}` | gauge | 1 while its readiness probe answers, 0 while it fails |
//! | `eitri_boot_duration_seconds` | histogram | boot asked → hypervisor running |
//! | `eitri_suspend_duration_seconds` | histogram | suspend asked → snapshot committed and VMM gone (its `_count`: suspends) |
//! | `eitri_resume_duration_seconds` | histogram | resume asked → restored guest running (its `_count`: resumes) |
//! | `eitri_resume_cold_boots_total{why}` | counter | suspended VMs booted from their disks instead: `gone`, `unusable`, `failed`, `interrupted` |
//! | `eitri_destroys_total` | counter | VMs destroyed (then acknowledged in reports) |
//! | `eitri_image_cache_bytes` | gauge | disk the image cache holds |
//! | `eitri_image_cache_hits_total`, `eitri_image_downloads_total`, `eitri_image_download_bytes_total` | counter | the cache at work |
//! | `eitri_quota_committed{resource}`, `eitri_quota_cap{resource}` | gauge | vcpus, memory_bytes, disk_bytes (cap 0 = none) |
//! | `eitri_workers` | gauge | VM worker threads alive |

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::image::ImageCache;
use crate::metrics::{Exposition, FAST_BUCKETS, Histogram};
use crate::model::Report;
use crate::pb;
use crate::reconcile::Engine;

/// The file and what only the daemon knows.
pub struct MetricsFile {
    pub path: PathBuf,
    pub images: Arc<ImageCache>,
    started_unix: f64,
    ticks: Histogram,
}

impl MetricsFile {
    pub fn new(path: PathBuf, images: Arc<ImageCache>) -> MetricsFile {
        MetricsFile {
            path,
            images,
            started_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            ticks: Histogram::new(FAST_BUCKETS),
        }
    }

    pub fn tick_took(&self, took: Duration) {
        self.ticks.observe(took);
    }

    /// The whole file's text.
    pub fn render(
        &self,
        host: &pb::HostInfo,
        engine: &Engine,
        report: &Report,
        epoch: u64,
        contact_failures: &crate::metrics::CounterVec,
    ) -> String {
        let mut e = Exposition::new();
        e.gauge(
            "eitri_agent_info",
            "The agent's version and host id (always 1).",
            &[(
                &[
                    ("version", host.agent_version.as_str()),
                    ("host_id", host.host_id.as_str()),
                ],
                1.0,
            )],
        );
        e.gauge(
            "eitri_agent_start_time_seconds",
            "When the agent started, in Unix seconds.",
            &[(&[], self.started_unix)],
        );
        e.histogram(
            "eitri_tick_duration_seconds",
            "One tick of the main loop: the step, the report and this file.",
            &self.ticks,
        );
        let counts = engine.counts();
        e.histogram(
            "eitri_step_duration_seconds",
            "One engine step: dispatch of a snapshot to the VM workers.",
            &counts.steps,
        );
        e.gauge(
            "eitri_snapshot_epoch",
            "The epoch of the accepted desired state.",
            &[(&[], epoch as f64)],
        );
        e.counter_vec(
            "eitri_contact_failures_total",
            "Failed contacts with the desired-state source, by kind.",
            "kind",
            contact_failures,
        );
        let mut by_state: std::collections::BTreeMap<(String, String), u64> = Default::default();
        for row in &report.vms {
            let power = row.power.map_or("unknown", |p| p.as_wire());
            let phase = row.phase.map_or("unknown", |p| p.as_wire());
            *by_state
                .entry((power.to_owned(), phase.to_owned()))
                .or_default() += 1;
        }
        let series: Vec<([(&str, &str); 2], f64)> = by_state
            .iter()
            .map(|((power, phase), n)| {
                (
                    [("power", power.as_str()), ("phase", phase.as_str())],
                    *n as f64,
                )
            })
            .collect();
        let series: Vec<(&[(&str, &str)], f64)> =
            series.iter().map(|(l, n)| (&l[..], *n)).collect();
        e.gauge(
            "eitri_vms",
            "VMs in the last report, by power and phase.",
            &series,
        );
        e.gauge(
            "eitri_vms_quarantined",
            "VMs out of the desired state, waiting out their grace before destruction.",
            &[(&[], report.quarantined.len() as f64)],
        );
        e.counter(
            "eitri_create_attempts_total",
            "Create attempts counted against a VM's budget.",
            counts.create_attempts.get(),
        );
        e.counter_vec(
            "eitri_create_failures_total",
            "Failed creates, by whether the error can pass.",
            "permanence",
            &counts.create_failures,
        );
        e.counter(
            "eitri_create_refunds_total",
            "Create attempts given back: the pass ran out of time, not the VM.",
            counts.refunds.get(),
        );
        e.counter_vec(
            "eitri_vm_lost_total",
            "Times a VM was booted again after its hypervisor died unasked.",
            "vm_id",
            &counts.lost,
        );
        e.counter_vec(
            "eitri_vm_unhealthy_probes_total",
            "Readiness probes a VM failed past its grace or after it was ready.",
            "vm_id",
            &counts.unhealthy,
        );
        e.counter_vec(
            "eitri_vm_probe_restarts_total",
            "Times a VM was booted again because its readiness probe failed for its restart_after.",
            "vm_id",
            &counts.probe_restarts,
        );
        let held = counts.held.lock().clone();
        let limit_series: Vec<(Vec<(&str, &str)>, f64)> = held
            .iter()
            .filter_map(|(vm, h)| Some((vm, h.limits?)))
            .flat_map(|(vm, l)| {
                [
                    ("cpu_max_millis", l.cpu_max_millis),
                    ("cpu_burst_ms", l.cpu_burst_ms),
                    ("disk_mbps", l.disk_mbps),
                    ("disk_iops", l.disk_iops),
                    ("net_mbps", l.net_mbps),
                ]
                .map(|(name, v)| (vec![("vm_id", vm.as_str()), ("limit", name)], f64::from(v)))
            })
            .collect();
        e.gauge(
            "eitri_vm_limit",
            "The limits a VM runs with (0: none), where the backend holds them.",
            &as_series(&limit_series),
        );
        let egress_series: Vec<(Vec<(&str, &str)>, f64)> = held
            .iter()
            .flat_map(|(vm, h)| {
                [("deny", h.deny), ("allow", h.allow)]
                    .map(|(list, n)| (vec![("vm_id", vm.as_str()), ("list", list)], n as f64))
            })
            .collect();
        e.gauge(
            "eitri_vm_egress_ranges",
            "Ranges in a VM's own egress lists held on the host.",
            &as_series(&egress_series),
        );
        let probe_series: Vec<(Vec<(&str, &str)>, f64)> = held
            .iter()
            .filter_map(|(vm, h)| {
                Some((
                    vec![("vm_id", vm.as_str())],
                    f64::from(u8::from(h.answering?)),
                ))
            })
            .collect();
        e.gauge(
            "eitri_vm_probe_answering",
            "1 while a VM's readiness probe answers, 0 while it fails; absent without a probe.",
            &as_series(&probe_series),
        );
        e.histogram(
            "eitri_boot_duration_seconds",
            "Boots: asking the hypervisor to boot until it says running.",
            &counts.boots,
        );
        e.histogram(
            "eitri_suspend_duration_seconds",
            "Suspends: asking the backend until the snapshot is committed and the hypervisor gone.",
            &counts.suspends,
        );
        e.histogram(
            "eitri_resume_duration_seconds",
            "Resumes: asking the backend until the restored guest runs.",
            &counts.resumes,
        );
        e.counter_vec(
            "eitri_resume_cold_boots_total",
            "Suspended VMs booted from their disks instead of resumed, by why.",
            "why",
            &counts.cold_boots,
        );
        e.counter(
            "eitri_destroys_total",
            "VMs destroyed (then acknowledged in reports).",
            counts.destroyed.get(),
        );
        let stats = self.images.stats();
        e.gauge(
            "eitri_image_cache_bytes",
            "Disk the image cache holds.",
            &[(&[], self.images.bytes() as f64)],
        );
        e.counter(
            "eitri_image_cache_hits_total",
            "Base images found in the cache.",
            stats.hits.get(),
        );
        e.counter(
            "eitri_image_downloads_total",
            "Base images downloaded and verified.",
            stats.downloads.get(),
        );
        e.counter(
            "eitri_image_download_bytes_total",
            "Bytes of the base images downloaded and verified.",
            stats.download_bytes.get(),
        );
        let quota = engine.quota();
        let resources = [
            ("vcpus", quota.vcpus, 1.0),
            ("memory_bytes", quota.mem_mb, (1u64 << 20) as f64),
            ("disk_bytes", quota.disk_gb, (1u64 << 30) as f64),
        ];
        let committed: Vec<([(&str, &str); 1], f64)> = resources
            .iter()
            .map(|(r, q, unit)| ([("resource", *r)], q.used as f64 * unit))
            .collect();
        let capped: Vec<([(&str, &str); 1], f64)> = resources
            .iter()
            .map(|(r, q, unit)| ([("resource", *r)], q.cap as f64 * unit))
            .collect();
        let committed: Vec<(&[(&str, &str)], f64)> =
            committed.iter().map(|(l, n)| (&l[..], *n)).collect();
        let capped: Vec<(&[(&str, &str)], f64)> =
            capped.iter().map(|(l, n)| (&l[..], *n)).collect();
        e.gauge(
            "eitri_quota_committed",
            "Compute committed to this host's VMs.",
            &committed,
        );
        e.gauge(
            "eitri_quota_cap",
            "The host's cap on each resource (0 = none).",
            &capped,
        );
        e.gauge(
            "eitri_workers",
            "VM worker threads alive.",
            &[(&[], engine.workers_alive() as f64)],
        );
        e.finish()
    }

    /// Writes the file atomically for its readers (temp, rename), readable
    /// by others: the collector runs as another user.
    pub fn write(&self, text: &str) -> std::io::Result<()> {
        crate::state::atomic::replace_unsynced_public(&self.path, text.as_bytes())
    }
}

/// Labelled samples as [`crate::metrics`]'s gauge takes them.
fn as_series<'a>(
    owned: &'a [(Vec<(&'a str, &'a str)>, f64)],
) -> Vec<(&'a [(&'a str, &'a str)], f64)> {
    owned.iter().map(|(l, v)| (l.as_slice(), *v)).collect()
}
