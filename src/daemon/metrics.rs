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
//! | `eitri_epoch_refusals_total{kind}` | counter | snapshots refused for their epoch: `too_far` (unsigned, past `--max-epoch-step`), `unsigned_reset`, `reset_elsewhere`, `reset_obeyed`, `reset_without_expiry` |
//! | `eitri_vms{power,phase}` | gauge | VMs in the last report |
//! | `eitri_vms_spec_rejected` | gauge | VMs the host has whose desired entry was refused (they run on) |
//! | `eitri_vms_unhealthy` | gauge | VMs running whose readiness probe fails (past its grace, or after it answered) |
//! | `eitri_vms_quarantined` | gauge | VMs waiting out their grace |
//! | `eitri_create_attempts_total` | counter | create attempts counted against a budget |
//! | `eitri_create_failures_total{permanence}` | counter | failed creates: `permanent`, `transient`, or `host` (the host must change; no attempt spent) |
//! | `eitri_create_refunds_total` | counter | attempts given back (out of time, not the VM's fault) |
//! | `eitri_vm_lost_total{vm_id}` | counter | booted again after its hypervisor died unasked (series gone at destroy) |
//! | `eitri_vm_unhealthy_probes_total{vm_id}` | counter | readiness probes failed past the grace or after ready |
//! | `eitri_vm_probe_restarts_total{vm_id}` | counter | boots again by a probe's `restart_after` |
//! | `eitri_vm_guest_panics_total{vm_id}` | counter | kernel panics seen on a VM's console (series gone at destroy) |
//! | `eitri_vm_limit{vm_id,limit}` | gauge | the limits a VM runs with: `cpu_max_millis`, `cpu_burst_ms`, `disk_mbps`, `disk_iops`, `net_mbps` (0: none) |
//! | `eitri_vm_egress_ranges{vm_id,list}` | gauge | ranges in its own `deny` and `allow` lists held on the host |
//! | `eitri_vm_probe_answering{vm_id}` | gauge | 1 while its readiness probe answers, 0 while it fails |
//! | `eitri_vm_cpu_seconds_total{vm_id}` | counter | CPU time its VMM spent (its cgroup's count, where the host keeps one) |
//! | `eitri_vm_memory_resident_bytes{vm_id}` | gauge | memory its VMM holds resident |
//! | `eitri_vm_disk_read_bytes_total{vm_id}`, `eitri_vm_disk_written_bytes_total{vm_id}`, `eitri_vm_disk_reads_total{vm_id}`, `eitri_vm_disk_writes_total{vm_id}` | counter | its disks' traffic, as its VMM counts it |
//! | `eitri_vm_network_received_bytes_total{vm_id}`, `eitri_vm_network_sent_bytes_total{vm_id}` | counter | its NICs' traffic from the guest's side, as its VMM counts it (its taps', when the VMM does not answer) |
//!
//! The usage families (`cpu`, `memory`, `disk`, `network`) hold a series
//! for each VM running at the last sample (`--usage-interval`), eight per
//! VM: as many as the host runs VMs, and none of a VM stopped. Their
//! counters start again from 0 when a VM's hypervisor does (a repair, a
//! resume), which Prometheus's `rate()` takes as a reset.
//! | `eitri_boot_duration_seconds` | histogram | boot asked → hypervisor running |
//! | `eitri_suspend_duration_seconds` | histogram | suspend asked → snapshot committed and VMM gone (its `_count`: suspends) |
//! | `eitri_resume_duration_seconds` | histogram | resume asked → restored guest running (its `_count`: resumes) |
//! | `eitri_guest_made_whole_total{how}` | counter | resumed guests sent fresh entropy and the host's clock by their guest agent: `done`, `no_agent`, `failed` |
//! | `eitri_guest_answer_after_resume_seconds` | histogram | restored guest running → its guest agent's answer to the reseed |
//! | `eitri_wake_duration_seconds` | histogram | first frame for a sleeping guest → guest running (its `_count`: wakes) |
//! | `eitri_idle_suspends_total` | counter | running VMs suspended for idleness |
//! | `eitri_wake_loops_total` | counter | wakes that ended a sleep shorter than the idle time |
//! | `eitri_resume_cold_boots_total{why}` | counter | suspended VMs booted from their disks instead: `gone`, `unusable`, `failed`, `interrupted` |
//! | `eitri_destroys_total` | counter | VMs destroyed (then acknowledged in reports) |
//! | `eitri_image_cache_bytes` | gauge | disk the image cache holds |
//! | `eitri_image_cache_hits_total`, `eitri_image_downloads_total`, `eitri_image_download_bytes_total` | counter | the cache at work |
//! | `eitri_quota_committed{resource}`, `eitri_quota_cap{resource}` | gauge | vcpus, memory_bytes, disk_bytes (cap 0 = none) |
//! | `eitri_workers` | gauge | VM worker threads alive |

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::image::ImageCache;
use crate::metrics::{Exposition, FAST_BUCKETS, Histogram};
use crate::model::Report;
use crate::pb;
use crate::reconcile::Engine;
use crate::reconcile::counts::Counts;
use crate::usage::Usage;

/// What the main loop keeps count of itself, for the file.
pub struct Kept<'a> {
    pub contact_failures: &'a crate::metrics::CounterVec,
    pub epoch_refusals: &'a crate::metrics::CounterVec,
    /// Each running VM's last usage sample, by id.
    pub usage: &'a HashMap<String, Usage>,
}

/// One usage family: its name, help, and a VM's value.
type UsageFamily = (&'static str, &'static str, fn(&Usage) -> Option<f64>);

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

    /// The whole file's text: each family group's writer in turn.
    pub fn render(
        &self,
        host: &pb::HostInfo,
        engine: &Engine,
        report: &Report,
        epoch: u64,
        kept: &Kept<'_>,
    ) -> String {
        let from = Sources {
            file: self,
            host,
            engine,
            counts: engine.counts(),
            report,
            epoch,
            contact_failures: kept.contact_failures,
            epoch_refusals: kept.epoch_refusals,
            usage: kept.usage,
        };
        let mut e = Exposition::new();
        for write in WRITERS {
            write(&from, &mut e);
        }
        e.finish()
    }

    /// Writes the file atomically for its readers (temp, rename), readable
    /// by others: the collector runs as another user.
    pub fn write(&self, text: &str) -> std::io::Result<()> {
        crate::state::atomic::replace_unsynced_public(&self.path, text.as_bytes())
    }
}

/// What the families are read from, for one rendering.
struct Sources<'a> {
    file: &'a MetricsFile,
    host: &'a pb::HostInfo,
    engine: &'a Engine,
    counts: &'a Counts,
    report: &'a Report,
    epoch: u64,
    contact_failures: &'a crate::metrics::CounterVec,
    epoch_refusals: &'a crate::metrics::CounterVec,
    usage: &'a HashMap<String, Usage>,
}

/// The file's family groups, in the order they are written.
const WRITERS: &[fn(&Sources<'_>, &mut Exposition)] =
    &[agent, vms, creates, per_vm, usage, lifecycle, images, quota];

/// The agent itself: who, since when, its loop and its contacts.
fn agent(from: &Sources<'_>, e: &mut Exposition) {
    e.gauge(
        "eitri_agent_info",
        "The agent's version and host id (always 1).",
        &[(
            &[
                ("version", from.host.agent_version.as_str()),
                ("host_id", from.host.host_id.as_str()),
            ],
            1.0,
        )],
    );
    e.gauge(
        "eitri_agent_start_time_seconds",
        "When the agent started, in Unix seconds.",
        &[(&[], from.file.started_unix)],
    );
    e.histogram(
        "eitri_tick_duration_seconds",
        "One tick of the main loop: the step, the report and this file.",
        &from.file.ticks,
    );
    e.histogram(
        "eitri_step_duration_seconds",
        "One engine step: dispatch of a snapshot to the VM workers.",
        &from.counts.steps,
    );
    e.gauge(
        "eitri_snapshot_epoch",
        "The epoch of the accepted desired state.",
        &[(&[], from.epoch as f64)],
    );
    e.counter_vec(
        "eitri_contact_failures_total",
        "Failed contacts with the desired-state source, by kind.",
        "kind",
        from.contact_failures,
    );
    e.counter_vec(
        "eitri_epoch_refusals_total",
        "Snapshots refused for their epoch, by why.",
        "kind",
        from.epoch_refusals,
    );
}

/// The VMs of the last report, by power and phase, and those in grace.
fn vms(from: &Sources<'_>, e: &mut Exposition) {
    let mut by_state: std::collections::BTreeMap<(&str, &str), u64> = Default::default();
    for row in &from.report.vms {
        let power = row.power.map_or("unknown", |p| p.as_wire());
        let phase = row.phase.map_or("unknown", |p| p.as_wire());
        *by_state.entry((power, phase)).or_default() += 1;
    }
    let series: Vec<(Vec<(&str, &str)>, f64)> = by_state
        .iter()
        .map(|((power, phase), n)| (vec![("power", *power), ("phase", *phase)], *n as f64))
        .collect();
    e.gauge(
        "eitri_vms",
        "VMs in the last report, by power and phase.",
        &as_series(&series),
    );
    let rejected = from
        .report
        .vms
        .iter()
        .filter(|v| !v.spec_rejected.is_empty())
        .count();
    e.gauge(
        "eitri_vms_spec_rejected",
        "VMs the host has whose entry in desired state was refused: they run on as they were (and are counted in eitri_vms by their phase).",
        &[(&[], rejected as f64)],
    );
    let unhealthy = from.report.vms.iter().filter(|v| v.unhealthy()).count();
    e.gauge(
        "eitri_vms_unhealthy",
        "VMs running whose readiness probe fails past its grace or after it answered (counted in eitri_vms by their phase too).",
        &[(&[], unhealthy as f64)],
    );
    e.gauge(
        "eitri_vms_quarantined",
        "VMs out of the desired state, waiting out their grace before destruction.",
        &[(&[], from.report.quarantined.len() as f64)],
    );
}

/// Creates: attempts, failures by kind, refunds.
fn creates(from: &Sources<'_>, e: &mut Exposition) {
    let counts = from.counts;
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
}

/// Each VM's own series: losses, probes, the limits and egress held.
fn per_vm(from: &Sources<'_>, e: &mut Exposition) {
    let counts = from.counts;
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
    e.counter_vec(
        "eitri_vm_guest_panics_total",
        "Kernel panics seen on a VM's console.",
        "vm_id",
        &counts.guest_panics,
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
}

/// What each running VM uses: the totals of its last sample.
fn usage(from: &Sources<'_>, e: &mut Exposition) {
    let mut vms: Vec<(&String, &Usage)> = from.usage.iter().collect();
    vms.sort_by(|a, b| a.0.cmp(b.0));
    let series = |value: fn(&Usage) -> Option<f64>| -> Vec<(Vec<(&str, &str)>, f64)> {
        vms.iter()
            .filter_map(|(vm, u)| Some((vec![("vm_id", vm.as_str())], value(u)?)))
            .collect()
    };
    let counters: [UsageFamily; 7] = [
        (
            "eitri_vm_cpu_seconds_total",
            "CPU time a VM's hypervisor spent, its vCPUs' included.",
            |u| u.totals.cpu_ns.map(|n| n as f64 / 1e9),
        ),
        (
            "eitri_vm_disk_read_bytes_total",
            "Bytes a VM's guest read from its disks, as its VMM counts them.",
            |u| u.totals.disk_read_bytes.map(|n| n as f64),
        ),
        (
            "eitri_vm_disk_written_bytes_total",
            "Bytes a VM's guest wrote to its disks, as its VMM counts them.",
            |u| u.totals.disk_write_bytes.map(|n| n as f64),
        ),
        (
            "eitri_vm_disk_reads_total",
            "Read requests a VM's guest made of its disks.",
            |u| u.totals.disk_read_ops.map(|n| n as f64),
        ),
        (
            "eitri_vm_disk_writes_total",
            "Write requests a VM's guest made of its disks.",
            |u| u.totals.disk_write_ops.map(|n| n as f64),
        ),
        (
            "eitri_vm_network_received_bytes_total",
            "Bytes a VM's guest took in on its NICs.",
            |u| u.totals.net_rx_bytes.map(|n| n as f64),
        ),
        (
            "eitri_vm_network_sent_bytes_total",
            "Bytes a VM's guest sent on its NICs.",
            |u| u.totals.net_tx_bytes.map(|n| n as f64),
        ),
    ];
    for (name, help, value) in counters {
        e.counters(name, help, &as_series(&series(value)));
    }
    e.gauge(
        "eitri_vm_memory_resident_bytes",
        "Memory a VM's hypervisor holds resident: the guest's touched pages and its own.",
        &as_series(&series(|u| u.resident_bytes.map(|n| n as f64))),
    );
}

/// Boots, suspends, resumes and destroys.
fn lifecycle(from: &Sources<'_>, e: &mut Exposition) {
    let counts = from.counts;
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
    e.counter_vec(
        "eitri_guest_made_whole_total",
        "Resumed guests sent fresh entropy and the host's clock by their guest agent, by how it went.",
        "how",
        &counts.made_whole,
    );
    e.histogram(
        "eitri_guest_answer_after_resume_seconds",
        "A restored guest running until its guest agent answered the reseed.",
        &counts.guest_after_resume,
    );
    e.histogram(
        "eitri_wake_duration_seconds",
        "Wakes on traffic: the first frame for a sleeping guest until it runs.",
        &counts.wakes,
    );
    e.counter(
        "eitri_idle_suspends_total",
        "Running VMs suspended because their NICs carried no frame for their idle time.",
        counts.idle_suspends.get(),
    );
    e.counter(
        "eitri_wake_loops_total",
        "Wakes that ended a sleep shorter than the VM's idle time (each doubles its next idle time, at most 64 times).",
        counts.wake_loops.get(),
    );
    e.counter(
        "eitri_destroys_total",
        "VMs destroyed (then acknowledged in reports).",
        counts.destroyed.get(),
    );
}

/// The image cache at work.
fn images(from: &Sources<'_>, e: &mut Exposition) {
    let images = &from.file.images;
    let stats = images.stats();
    e.gauge(
        "eitri_image_cache_bytes",
        "Disk the image cache holds.",
        &[(&[], images.bytes() as f64)],
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
}

/// Compute committed and capped, and the workers running it.
fn quota(from: &Sources<'_>, e: &mut Exposition) {
    let quota = from.engine.quota();
    let resources = [
        ("vcpus", quota.vcpus, 1.0),
        ("memory_bytes", quota.mem_mb, (1u64 << 20) as f64),
        ("disk_bytes", quota.disk_gb, (1u64 << 30) as f64),
    ];
    let of = |pick: fn(&crate::model::Committed) -> u64| -> Vec<(Vec<(&str, &str)>, f64)> {
        resources
            .iter()
            .map(|(r, q, unit)| (vec![("resource", *r)], pick(q) as f64 * unit))
            .collect()
    };
    e.gauge(
        "eitri_quota_committed",
        "Compute committed to this host's VMs.",
        &as_series(&of(|q| q.used)),
    );
    e.gauge(
        "eitri_quota_cap",
        "The host's cap on each resource (0 = none).",
        &as_series(&of(|q| q.cap)),
    );
    e.gauge(
        "eitri_workers",
        "VM worker threads alive.",
        &[(&[], from.engine.workers_alive() as f64)],
    );
}

fn as_series<'a>(
    owned: &'a [(Vec<(&'a str, &'a str)>, f64)],
) -> Vec<(&'a [(&'a str, &'a str)], f64)> {
    owned.iter().map(|(l, v)| (l.as_slice(), *v)).collect()
}
