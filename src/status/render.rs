//! `report.json` for a person: the host's table (`status`), its one-line
//! header, and one VM in detail (`status VM`). Every value from the report
//! goes through [`inline`]: ids, names and errors can come from the wire
//! or a guest, and must not move a terminal's cursor or start a line of
//! their own.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{ReportFile, VmDetail};
use crate::pb;
use crate::quote::inline;

/// The host table's columns, one row per VM.
const VM_COLUMNS: [&str; 9] = [
    "VM",
    "POWER",
    "PHASE",
    "READY",
    "RESTARTS",
    "AGE",
    "IP",
    "NETWORK IP",
    "DETAIL / ERROR",
];

impl ReportFile {
    /// The report as a table for a person. Every value from the report
    /// goes through [`inline`]: ids, names and errors can come from the
    /// wire or a guest, and must not move a terminal's cursor or start a
    /// line of their own.
    pub fn render(&self, now: SystemTime) -> String {
        let now_ms = now
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let mut out = String::new();
        self.write_title(&mut out, now, now_ms);
        out.push('\n');
        table(&mut out, VM_COLUMNS, &self.vm_rows(now_ms));
        self.write_quarantined(&mut out, now);
        self.write_volumes(&mut out);
        out
    }

    /// The lines above the table: the host and its agent, the report's age
    /// and epoch, the header, the desired state's source and the notes.
    fn write_title(&self, out: &mut String, now: SystemTime, now_ms: u64) {
        let written = UNIX_EPOCH + Duration::from_millis(self.written_at_unix_ms);
        let age = now.duration_since(written).unwrap_or_default();
        let r = &self.report;
        let agent = match self.agent_pid {
            0 => String::new(),
            pid => format!(
                ", pid {pid}, up {}",
                Ago(now_ms).of(self.agent_started_at_ms)
            ),
        };
        let _ = writeln!(
            out,
            "host {} (agent {}{agent}), report written {} ago{}, epoch {}{}",
            inline(&self.host.host_id),
            inline(&self.host.agent_version),
            crate::human::duration(age),
            if self.is_stale(now) {
                " (STALE: the agent writes one every tick; is it running, and can it write its state dir?)"
            } else {
                ""
            },
            r.last_seen_epoch,
            if r.fence_violation {
                " (FENCED: a stale snapshot was refused)"
            } else {
                ""
            }
        );
        let _ = writeln!(out, "{}", self.header());
        let _ = writeln!(out, "desired state: {}", inline(&self.source));
        for note in &self.notes {
            let _ = writeln!(out, "note: {}", inline(note));
        }
    }

    /// One row of [`VM_COLUMNS`] per VM.
    fn vm_rows(&self, now_ms: u64) -> Vec<[String; 9]> {
        self.report
            .vms
            .iter()
            .map(|v| {
                let rejected = (!v.spec_rejected.is_empty())
                    .then(|| format!("spec rejected: {}", v.spec_rejected));
                let note = [v.status_detail.as_str(), v.last_error.as_str()]
                    .into_iter()
                    .chain(rejected.as_deref())
                    .filter(|s| !s.is_empty())
                    .collect::<Vec<_>>()
                    .join("; ");
                let detail = self.details.get(&v.vm_id);
                let age = detail
                    .map(|d| d.created_at_ms)
                    .filter(|at| *at > 0)
                    .map_or_else(|| "-".to_owned(), |at| Ago(now_ms).of(at));
                [
                    inline(&v.vm_id),
                    dash(&v.power_state),
                    dash(shown_phase(v)),
                    ready_cell(v).to_owned(),
                    detail.map_or(0, |d| d.restarts).to_string(),
                    age,
                    dash(&v.ip),
                    dash(&v.network_ip),
                    inline(&note),
                ]
            })
            .collect()
    }

    /// The quarantined VMs and when each is destroyed, if any.
    fn write_quarantined(&self, out: &mut String, now: SystemTime) {
        let quarantined = &self.report.quarantined;
        if quarantined.is_empty() {
            return;
        }
        out.push_str("\nquarantined:\n");
        for q in quarantined {
            let at = UNIX_EPOCH + Duration::from_secs(q.destroy_at_unix.max(0) as u64);
            let _ = writeln!(
                out,
                "  {} ({}), destroyed {}",
                inline(&q.vm_id),
                inline(&q.name),
                crate::human::when(at, now)
            );
        }
    }

    /// The volumes, their sizes and states, if any.
    fn write_volumes(&self, out: &mut String) {
        let volumes = &self.report.volumes;
        if volumes.is_empty() {
            return;
        }
        out.push_str("\nvolumes:\n");
        for v in volumes {
            let _ = writeln!(
                out,
                "  {} {} GiB {}{}",
                inline(&v.volume_id),
                v.size_gb,
                inline(&v.state),
                if v.last_error.is_empty() {
                    String::new()
                } else {
                    format!(": {}", inline(&v.last_error))
                }
            );
        }
    }

    /// The host in one line: epoch, contact, quota, VMs by phase.
    pub fn header(&self) -> String {
        let r = &self.report;
        let mut phases: BTreeMap<&str, usize> = BTreeMap::new();
        for v in &r.vms {
            // Running but failing its probe: not ready, whatever its phase.
            let condition = if crate::model::is_unhealthy(&v.last_error) {
                "unhealthy"
            } else if v.phase.is_empty() {
                "unknown"
            } else {
                shown_phase(v)
            };
            *phases.entry(condition).or_default() += 1;
        }
        let mut phases: Vec<String> = phases
            .iter()
            .map(|(p, n)| format!("{n} {}", inline(p)))
            .collect();
        // Counted apart: such a VM runs on as it was, and is in its phase.
        let rejected = r.vms.iter().filter(|v| !v.spec_rejected.is_empty()).count();
        if rejected > 0 {
            phases.push(format!("{rejected} spec rejected"));
        }
        let q = &self.quota;
        let quota: Vec<String> = [(q.vcpus, "vcpus"), (q.mem_mb, "MB"), (q.disk_gb, "GB")]
            .iter()
            .map(|(c, unit)| match c.cap {
                0 => format!("{} {unit}", c.used),
                cap => format!("{}/{cap} {unit}", c.used),
            })
            .collect();
        format!(
            "epoch {} · contact {} · quota {} · {} VM{}{}{}",
            r.last_seen_epoch,
            inline(&self.contact),
            quota.join(", "),
            r.vms.len(),
            if r.vms.len() == 1 { "" } else { "s" },
            if phases.is_empty() { "" } else { ": " },
            phases.join(", ")
        )
    }

    /// One VM in detail (`status VM`), with the newest `console` lines and
    /// its last `events` (see [`crate::events`]); `None` when the last
    /// report does not name it. Each group of its fields is written by one
    /// function below, in this order.
    pub fn render_vm(
        &self,
        vm_id: &str,
        console: &[String],
        events: &[String],
        now: SystemTime,
    ) -> Option<String> {
        let row = self.report.vms.iter().find(|v| v.vm_id == vm_id);
        let quarantined = self.report.quarantined.iter().find(|q| q.vm_id == vm_id);
        if row.is_none() && quarantined.is_none() {
            return None;
        }
        let detail = self.details.get(vm_id).cloned().unwrap_or_default();
        let ago = Ago(now
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64));
        let mut fields = spec_fields(&detail);
        if let Some(row) = row {
            fields.extend(state_fields(row, &detail, ago));
            fields.extend(error_fields(row, &detail, ago));
            fields.extend(process_fields(row, &detail, ago));
        }
        fields.extend(self.volume_fields(&detail));
        fields.extend(quarantined.map(|q| quarantine_field(q, now)));
        let mut out = String::new();
        let _ = writeln!(out, "VM {}", inline(vm_id));
        // Wide enough for every label and a space after it ("spec
        // rejected" ran into its value at a fixed 11).
        let width = fields.iter().map(|(k, _)| k.len() + 1).fold(11, usize::max);
        for (key, value) in fields {
            let _ = writeln!(out, "  {key:<width$}{value}");
        }
        let _ = writeln!(out, "  {:<width$}(last {} lines)", "console", console.len());
        for l in console {
            let _ = writeln!(out, "    {l}");
        }
        if !events.is_empty() {
            let _ = writeln!(out, "  {:<width$}(last {}, UTC)", "events", events.len());
            for e in events {
                let _ = writeln!(out, "    {e}");
            }
        }
        Some(out)
    }

    /// Its volumes, each with the state the report gives it.
    fn volume_fields(&self, detail: &VmDetail) -> Option<Field> {
        if detail.volume_ids.is_empty() {
            return None;
        }
        let volumes: Vec<String> = detail
            .volume_ids
            .iter()
            .map(|v| {
                let state = self
                    .report
                    .volumes
                    .iter()
                    .find(|s| s.volume_id == *v)
                    .map_or("unknown".to_owned(), |s| inline(&s.state));
                format!("{} ({state})", inline(v))
            })
            .collect();
        Some(("volumes", volumes.join(", ")))
    }
}

/// The row's phase for people. The wire's `ready` says the VM is as its
/// spec asks; of a VM stopped or suspended as asked that reads, beside its
/// power, as if its guest were ready, so the table says `settled` for it.
fn shown_phase(row: &pb::VmStatus) -> &str {
    match (row.phase.as_str(), row.power_state.as_str()) {
        ("ready", "stopped" | "suspended") => "settled",
        (phase, _) => phase,
    }
}

/// Whether the VM's guest answers its readiness probe (or, without one,
/// its guest agent): `-` with neither, `yes` once it answered and while it
/// answers, `no` before and after.
fn ready_cell(row: &pb::VmStatus) -> &'static str {
    if row.readiness.is_empty() || row.readiness.starts_with(crate::model::HYPERVISOR_ONLY) {
        "-"
    } else if row.readiness.ends_with(crate::model::ANSWERED)
        && !crate::model::is_unhealthy(&row.last_error)
    {
        "yes"
    } else {
        "no"
    }
}

/// One line of `status VM`: its key and its value.
type Field = (&'static str, String);

/// How long ago a moment was, from the rendering's now (Unix ms).
#[derive(Clone, Copy)]
struct Ago(u64);

impl Ago {
    fn of(self, ms: u64) -> String {
        crate::human::duration(Duration::from_millis(self.0.saturating_sub(ms)))
    }
}

/// What was asked for: its size and image.
fn spec_fields(detail: &VmDetail) -> Vec<Field> {
    if detail.image_url.is_empty() {
        return Vec::new();
    }
    vec![(
        "spec",
        format!(
            "{} vcpus, {} MB, {} GB disk, image {}",
            detail.vcpus,
            detail.mem_mb,
            detail.disk_gb,
            inline(&detail.image_url)
        ),
    )]
}

/// Where it stands: power and phase and since when, what it is doing, the
/// limits, egress, readiness and published ports it runs with.
fn state_fields(row: &pb::VmStatus, detail: &VmDetail, ago: Ago) -> Vec<Field> {
    let mut fields = vec![
        (
            "power",
            format!(
                "{} for {}",
                dash(&row.power_state),
                ago.of(detail.power_since_ms)
            ),
        ),
        (
            "phase",
            format!(
                "{} for {}",
                dash(shown_phase(row)),
                ago.of(detail.phase_since_ms)
            ),
        ),
    ];
    for (key, value) in [
        ("doing", &row.status_detail),
        ("limits", &row.limits),
        ("egress", &row.egress),
        ("readiness", &row.readiness),
        ("guest", &row.guest),
    ] {
        if !value.is_empty() {
            fields.push((key, inline(value)));
        }
    }
    if !row.published_ports.is_empty() {
        fields.push(("published", published(&row.published_ports)));
    }
    if row.asleep {
        fields.push(("sleep", "asleep: its next frame wakes it".to_owned()));
    }
    if !row.last_wake.is_empty() {
        fields.push(("woken", inline(&row.last_wake)));
    }
    fields
}

/// Its published ports as people read them: `30080/tcp → 80, 10.0.0.1:30053/udp → 53`.
fn published(ports: &[pb::PublishedPort]) -> String {
    let said: Vec<String> = ports
        .iter()
        .map(|p| {
            let at = if p.host_address.is_empty() {
                String::new()
            } else {
                format!("{}:", p.host_address)
            };
            format!(
                "{at}{}/{} → {}",
                p.host_port,
                inline(&p.protocol),
                p.guest_port
            )
        })
        .collect();
    said.join(", ")
}

/// Its last error and since when, and the attempts spent.
fn error_fields(row: &pb::VmStatus, detail: &VmDetail, ago: Ago) -> Vec<Field> {
    let error = if row.last_error.is_empty() {
        "-".into()
    } else {
        format!(
            "{} (first {} ago, last {} ago)",
            inline(&row.last_error),
            ago.of(detail.error_first_ms),
            ago.of(detail.error_last_ms)
        )
    };
    let mut fields = vec![
        ("error", error),
        (
            "attempts",
            format!("{} of {}", detail.attempts, detail.max_attempts),
        ),
    ];
    if !row.spec_rejected.is_empty() {
        fields.push((
            "spec rejected",
            format!("{}; it runs on as it was", inline(&row.spec_rejected)),
        ));
    }
    fields
}

/// What runs it: the boot, a snapshot on disk, the hypervisor, the
/// addresses.
fn process_fields(row: &pb::VmStatus, detail: &VmDetail, ago: Ago) -> Vec<Field> {
    let running = row.power_state == "running";
    let boot_id = if detail.booted_as.is_empty() && running {
        "not recorded yet (it was just booted)".to_owned()
    } else {
        dash(&detail.booted_as)
    };
    // The host's boot it was last booted in (a guest's own boot id is its
    // guest agent's, in the `guest` line): labelled so it is not read as
    // the guest's.
    let mut fields = vec![("host boot", boot_id)];
    if detail.suspended_at_ms > 0 {
        fields.push((
            "snapshot",
            format!(
                "{} on disk, taken {} ago",
                crate::human::bytes(detail.snapshot_bytes),
                ago.of(detail.suspended_at_ms)
            ),
        ));
    }
    fields.push((
        "hypervisor",
        match detail.pid {
            Some(pid) => format!("pid {pid}, up {}", ago.of(detail.pid_since_ms)),
            None if running => "not found yet (the next tick looks again)".into(),
            None => "not running".into(),
        },
    ));
    fields.push((
        "restarts",
        match detail.restarts {
            0 => "0".to_owned(),
            n => format!("{n} (booted again unasked: its hypervisor died, or its probe failed)"),
        },
    ));
    if detail.created_at_ms > 0 {
        fields.push((
            "age",
            format!("created {} ago", ago.of(detail.created_at_ms)),
        ));
    }
    let site = if row.network_ip.is_empty() {
        String::new()
    } else {
        format!(
            ", {} on {}",
            inline(&row.network_ip),
            inline(&detail.network)
        )
    };
    fields.push(("address", format!("{}{site}", dash(&row.ip))));
    if let Some(usage) = &detail.usage {
        fields.push(("usage", usage_line(usage, ago)));
    }
    fields
}

/// What a running VM uses, as `top` shows it, in one line.
fn usage_line(u: &crate::usage::Usage, ago: Ago) -> String {
    let rate =
        |n: Option<u64>| n.map_or("-".to_owned(), |n| format!("{}/s", crate::human::bytes(n)));
    let ops = |n: Option<u64>| n.map_or("-".to_owned(), |n| n.to_string());
    let cpu = u
        .cpu_millis
        .map_or("-".to_owned(), |m| format!("{:.1}%", m as f64 / 10.0));
    let memory = u.resident_bytes.map_or("-".to_owned(), crate::human::bytes);
    let counted = if u.net_from == "taps" {
        " (counted on its taps)"
    } else {
        ""
    };
    let when = if u.over_ms > 0 {
        format!(
            "over {} to {} ago",
            crate::human::duration(Duration::from_millis(u.over_ms)),
            ago.of(u.sampled_at_ms)
        )
    } else {
        format!(
            "sampled once, {} ago: rates come with the next",
            ago.of(u.sampled_at_ms)
        )
    };
    format!(
        "CPU {cpu} of a core, {memory} resident; disk {} read ({} req/s), {} written ({} req/s); network {} in, {} out{counted}; {when}",
        rate(u.disk_read_bps),
        ops(u.disk_read_iops),
        rate(u.disk_write_bps),
        ops(u.disk_write_iops),
        rate(u.net_rx_bps),
        rate(u.net_tx_bps),
    )
}

/// When a VM out of the desired state is destroyed.
fn quarantine_field(q: &pb::QuarantinedVm, now: SystemTime) -> Field {
    let at = UNIX_EPOCH + Duration::from_secs(q.destroy_at_unix.max(0) as u64);
    (
        "quarantine",
        format!(
            "out of the desired state; destroyed {}",
            crate::human::when(at, now)
        ),
    )
}

/// A value, or `-` for none.
pub(super) fn dash(s: &str) -> String {
    if s.is_empty() { "-".into() } else { inline(s) }
}

/// `rows` under `head`, each column as wide as its widest cell.
pub(super) fn table<const N: usize>(out: &mut String, head: [&str; N], rows: &[[String; N]]) {
    let mut width = head.map(str::len);
    for row in rows {
        for (w, cell) in width.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut l = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == N {
                l.push_str(cell);
            } else {
                let _ = write!(l, "{cell:<w$}  ", w = width[i]);
            }
        }
        l.trim_end().to_owned()
    };
    let _ = writeln!(out, "{}", line(head.to_vec()));
    if rows.is_empty() {
        out.push_str("(no VMs)\n");
    }
    for row in rows {
        let _ = writeln!(out, "{}", line(row.iter().map(String::as_str).collect()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb;
    use crate::status::VmDetail;

    /// A host whose report holds only `vms`, each in phase `ready`.
    fn ready_rows(vms: &[(&str, &str, &str)]) -> ReportFile {
        let row = |&(id, power, last_error): &(&str, &str, &str)| pb::VmStatus {
            vm_id: id.into(),
            power_state: power.into(),
            phase: "ready".into(),
            last_error: last_error.into(),
            ..Default::default()
        };
        ReportFile::new(
            pb::HostInfo::default(),
            "desired file /d.json".into(),
            "ok".into(),
            pb::Report {
                vms: vms.iter().map(row).collect(),
                ..Default::default()
            },
        )
    }

    #[test]
    fn the_header_counts_an_unhealthy_vm_as_unhealthy_not_ready() {
        let file = ready_rows(&[
            ("vm-1", "running", ""),
            (
                "vm-2",
                "running",
                "unhealthy: failing for 4 s: tcp 22 refused",
            ),
        ]);

        let header = file.header();

        assert!(
            header.contains("1 ready") && header.contains("1 unhealthy"),
            "{header}"
        );
    }

    #[test]
    fn a_vm_stopped_as_asked_reads_settled_not_ready() {
        let file = ready_rows(&[("vm-1", "running", ""), ("vm-2", "stopped", "")]);

        let header = file.header();
        let table = file.render(at_now());

        assert!(
            header.contains("1 ready") && header.contains("1 settled"),
            "{header}"
        );
        let stopped = table
            .lines()
            .find(|l| l.starts_with("vm-2 "))
            .unwrap_or_else(|| panic!("{table}"));
        assert!(
            stopped.contains(" stopped ")
                && stopped.contains(" settled ")
                && !stopped.contains("ready"),
            "{stopped}"
        );
    }

    #[test]
    fn renders_rows_and_age() {
        let file = ReportFile {
            written_at_unix_ms: 1_000_000,
            ..ReportFile::new(
                pb::HostInfo {
                    host_id: "h1".into(),
                    agent_version: "1.0.0".into(),
                    ..Default::default()
                },
                "desired file /d.json".into(),
                "ok".into(),
                pb::Report {
                    last_seen_epoch: 4,
                    vms: vec![pb::VmStatus {
                        vm_id: "vm-1".into(),
                        power_state: "running".into(),
                        phase: "ready".into(),
                        ip: "10.0.0.2".into(),
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            )
        };

        let text = file.render(UNIX_EPOCH + Duration::from_millis(1_042_000));

        assert!(text.contains("written 42 s ago"), "{text}");
        assert!(
            text.lines()
                .any(|l| l.starts_with("vm-1") && l.contains("running") && l.contains("10.0.0.2")),
            "{text}"
        );
    }

    #[test]
    fn an_id_with_a_newline_and_an_escape_stays_on_its_row() {
        let file = of_one(pb::VmStatus {
            vm_id: "evil\nvm-2 running ready\u{1b}[2J".into(),
            last_error: "vm_id: bad\r".into(),
            ..Default::default()
        });

        let text = file.render(UNIX_EPOCH);

        assert!(!text.contains('\u{1b}'), "{text:?}");
        assert!(!text.lines().any(|l| l.starts_with("vm-2")), "{text}");
        assert!(text.contains("evil\\nvm-2"), "{text}");
    }

    #[test]
    fn every_note_is_a_line_of_its_own() {
        let file = ReportFile {
            notes: vec![
                "stopped an orphan hypervisor (pid 4242, socket /run/eitri/x.sock)".into(),
                "guest networking is host-only".into(),
            ],
            ..ReportFile::new(
                pb::HostInfo::default(),
                "desired file /d.json".into(),
                "ok".into(),
                pb::Report::default(),
            )
        };

        let text = file.render(UNIX_EPOCH);

        let notes: Vec<&str> = text.lines().filter(|l| l.starts_with("note: ")).collect();
        assert_eq!(
            notes,
            [
                "note: stopped an orphan hypervisor (pid 4242, socket /run/eitri/x.sock)",
                "note: guest networking is host-only"
            ]
        );
    }

    #[test]
    fn a_report_older_than_three_ticks_is_marked_stale() {
        let file = ReportFile {
            written_at_unix_ms: 1_000_000,
            tick_ms: 5_000,
            ..ReportFile::new(
                pb::HostInfo::default(),
                "desired file /d.json".into(),
                "ok".into(),
                pb::Report::default(),
            )
        };

        let fresh = file.render(UNIX_EPOCH + Duration::from_millis(1_000_000 + 14_000));
        let stale = file.render(UNIX_EPOCH + Duration::from_millis(1_000_000 + 16_000));

        assert!(!fresh.contains("STALE"), "{fresh}");
        assert!(stale.contains("STALE"), "{stale}");
    }

    /// A host at `NOW` with web-1 running since an hour ago, db-1 failing
    /// for ten minutes, old-1 in quarantine.
    const NOW: u64 = 1_800_000_000_000;

    fn golden_host() -> ReportFile {
        let mut file = ReportFile::new(
            pb::HostInfo::default(),
            "desired file /d.json".into(),
            "ok".into(),
            pb::Report {
                last_seen_epoch: 9,
                vms: vec![
                    pb::VmStatus {
                        vm_id: "web-1".into(),
                        power_state: "running".into(),
                        phase: "ready".into(),
                        ip: "100.77.5.5".into(),
                        network_ip: "192.0.2.55".into(),
                        ..Default::default()
                    },
                    pb::VmStatus {
                        vm_id: "db-1".into(),
                        power_state: "stopped".into(),
                        phase: "failed".into(),
                        last_error: "boot: the hypervisor exited: Error: KVM \u{1b}[2J".into(),
                        ..Default::default()
                    },
                ],
                quarantined: vec![pb::QuarantinedVm {
                    vm_id: "old-1".into(),
                    name: "old-1".into(),
                    destroy_at_unix: (NOW / 1000 + 3 * 3600) as i64,
                    ..Default::default()
                }],
                volumes: vec![pb::VolumeStatus {
                    volume_id: "web-1-data".into(),
                    size_gb: 20,
                    state: "attached".into(),
                    ..Default::default()
                }],
                ..Default::default()
            },
        );
        let committed = |used, cap| crate::model::Committed { used, cap };
        file.quota = crate::model::Quota {
            vcpus: committed(3, 16),
            mem_mb: committed(3072, 0),
            disk_gb: committed(30, 500),
        };
        let hour = 3_600_000;
        file.details.insert(
            "web-1".into(),
            VmDetail {
                power_since_ms: NOW - hour,
                phase_since_ms: NOW - 2 * hour,
                attempts: 1,
                max_attempts: 3,
                booted_as: "b00t".into(),
                pid: Some(4242),
                pid_since_ms: NOW - hour,
                restarts: 1,
                created_at_ms: NOW - 2 * hour,
                vcpus: 2,
                mem_mb: 2048,
                disk_gb: 20,
                image_url: "file:///srv/images/debian.raw".into(),
                network: "site".into(),
                volume_ids: vec!["web-1-data".into()],
                ..Default::default()
            },
        );
        file.details.insert(
            "db-1".into(),
            VmDetail {
                power_since_ms: NOW - 600_000,
                phase_since_ms: NOW - 600_000,
                error_first_ms: NOW - 600_000,
                error_last_ms: NOW - 5_000,
                attempts: 3,
                max_attempts: 3,
                vcpus: 1,
                mem_mb: 1024,
                disk_gb: 10,
                image_url: "file:///srv/images/debian.raw".into(),
                ..Default::default()
            },
        );
        file
    }

    fn at_now() -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(NOW)
    }

    #[test]
    fn status_of_a_vm_with_egress_rules_of_its_own_names_them() {
        let mut file = golden_host();
        for row in &mut file.report.vms {
            if row.vm_id == "web-1" {
                row.egress = "deny 0.0.0.0/0 except 192.0.2.0/24".into();
            }
        }

        let text = file
            .render_vm("web-1", &[], &[], at_now())
            .unwrap_or_default();

        assert!(
            text.contains("\n  egress     deny 0.0.0.0/0 except 192.0.2.0/24\n"),
            "{text}"
        );
    }

    #[test]
    fn status_of_a_vm_that_publishes_ports_lists_them() {
        let mut file = golden_host();
        for row in &mut file.report.vms {
            if row.vm_id == "web-1" {
                row.published_ports = vec![
                    pb::PublishedPort {
                        protocol: "tcp".into(),
                        host_port: 30080,
                        guest_port: 80,
                        host_address: String::new(),
                    },
                    pb::PublishedPort {
                        protocol: "udp".into(),
                        host_port: 30053,
                        guest_port: 53,
                        host_address: "192.0.2.10".into(),
                    },
                ];
            }
        }

        let text = file
            .render_vm("web-1", &[], &[], at_now())
            .unwrap_or_default();

        assert!(
            text.contains("\n  published  30080/tcp → 80, 192.0.2.10:30053/udp → 53\n"),
            "{text}"
        );
    }

    #[test]
    fn status_of_a_sleeping_vm_says_it_sleeps_and_who_woke_it_last() {
        let mut file = golden_host();
        for row in &mut file.report.vms {
            if row.vm_id == "web-1" {
                row.asleep = true;
                row.last_wake =
                    "woken 40 s ago by tcp from 192.0.2.9:40312 to port 80, running in 18 ms"
                        .into();
            }
        }

        let text = file
            .render_vm("web-1", &[], &[], at_now())
            .unwrap_or_default();

        assert!(
            text.contains("\n  sleep      asleep: its next frame wakes it\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "\n  woken      woken 40 s ago by tcp from 192.0.2.9:40312 to port 80, running in 18 ms\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn status_of_a_running_vm() {
        let console = vec![
            "[  OK  ] Reached target multi-user.".to_owned(),
            "web-1 login:".to_owned(),
        ];

        let text = golden_host().render_vm("web-1", &console, &[], at_now());

        assert_eq!(
            text.as_deref(),
            Some(
                "VM web-1\n\
                 \x20 spec       2 vcpus, 2048 MB, 20 GB disk, image file:///srv/images/debian.raw\n\
                 \x20 power      running for 60 min\n\
                 \x20 phase      ready for 2 h\n\
                 \x20 error      -\n\
                 \x20 attempts   1 of 3\n\
                 \x20 host boot  b00t\n\
                 \x20 hypervisor pid 4242, up 60 min\n\
                 \x20 restarts   1 (booted again unasked: its hypervisor died, or its probe failed)\n\
                 \x20 age        created 2 h ago\n\
                 \x20 address    100.77.5.5, 192.0.2.55 on site\n\
                 \x20 volumes    web-1-data (attached)\n\
                 \x20 console    (last 2 lines)\n\
                 \x20   [  OK  ] Reached target multi-user.\n\
                 \x20   web-1 login:\n"
            )
        );
    }

    #[test]
    fn status_of_a_suspended_vm_says_how_old_and_big_its_snapshot_is() {
        let mut file = golden_host();
        file.report.vms.push(pb::VmStatus {
            vm_id: "nap-1".into(),
            power_state: "suspended".into(),
            phase: "ready".into(),
            ..Default::default()
        });
        file.details.insert(
            "nap-1".into(),
            VmDetail {
                power_since_ms: NOW - 300_000,
                phase_since_ms: NOW - 3_600_000,
                attempts: 1,
                max_attempts: 3,
                booted_as: "b00t".into(),
                vcpus: 1,
                mem_mb: 64,
                disk_gb: 1,
                image_url: "file:///srv/images/tiny.raw".into(),
                suspended_at_ms: NOW - 300_000,
                snapshot_bytes: 73_728,
                ..Default::default()
            },
        );

        let text = file.render_vm("nap-1", &[], &[], at_now());

        assert_eq!(
            text.as_deref(),
            Some(
                "VM nap-1\n\
                 \x20 spec       1 vcpus, 64 MB, 1 GB disk, image file:///srv/images/tiny.raw\n\
                 \x20 power      suspended for 5 min\n\
                 \x20 phase      settled for 60 min\n\
                 \x20 error      -\n\
                 \x20 attempts   1 of 3\n\
                 \x20 host boot  b00t\n\
                 \x20 snapshot   72 KiB on disk, taken 5 min ago\n\
                 \x20 hypervisor not running\n\
                 \x20 restarts   0\n\
                 \x20 address    -\n\
                 \x20 console    (last 0 lines)\n"
            )
        );
    }

    #[test]
    fn status_of_a_vm_just_booted_never_says_its_hypervisor_is_not_running() {
        let mut file = golden_host();
        file.report.vms.push(pb::VmStatus {
            vm_id: "new-1".into(),
            power_state: "running".into(),
            phase: "ready".into(),
            ..Default::default()
        });
        file.details.insert("new-1".into(), VmDetail::default());

        let text = file
            .render_vm("new-1", &[], &[], at_now())
            .unwrap_or_default();

        assert!(!text.contains("not running"), "{text}");
        assert!(
            text.contains("\n  hypervisor not found yet (the next tick looks again)\n"),
            "{text}"
        );
        assert!(
            text.contains("\n  host boot  not recorded yet (it was just booted)\n"),
            "{text}"
        );
    }

    #[test]
    fn the_table_says_whether_each_probed_vm_is_ready_its_restarts_and_age() {
        let mut file = golden_host();
        for row in &mut file.report.vms {
            if row.vm_id == "web-1" {
                row.readiness = "tcp 22 answered".into();
            }
        }

        let text = file.render(at_now());

        let head = text
            .lines()
            .find(|l| l.starts_with("VM "))
            .unwrap_or_default();
        let row = text
            .lines()
            .find(|l| l.starts_with("web-1"))
            .unwrap_or_default();
        let at = |name: &str| head.find(name).unwrap_or(usize::MAX);
        assert_eq!(row.get(at("READY")..at("READY") + 3), Some("yes"), "{text}");
        assert_eq!(
            row.get(at("RESTARTS")..at("RESTARTS") + 1),
            Some("1"),
            "{text}"
        );
        assert_eq!(row.get(at("AGE")..at("AGE") + 3), Some("2 h"), "{text}");
    }

    #[test]
    fn status_of_a_failed_vm_says_how_old_its_error_is() {
        let text = golden_host().render_vm("db-1", &[], &[], at_now());

        assert_eq!(
            text.as_deref(),
            Some(
                "VM db-1\n\
                 \x20 spec       1 vcpus, 1024 MB, 10 GB disk, image file:///srv/images/debian.raw\n\
                 \x20 power      stopped for 10 min\n\
                 \x20 phase      failed for 10 min\n\
                 \x20 error      boot: the hypervisor exited: Error: KVM \\u{1b}[2J (first 10 min ago, last 5 s ago)\n\
                 \x20 attempts   3 of 3\n\
                 \x20 host boot  -\n\
                 \x20 hypervisor not running\n\
                 \x20 restarts   0\n\
                 \x20 address    -\n\
                 \x20 console    (last 0 lines)\n"
            )
        );
    }

    #[test]
    fn status_of_a_quarantined_vm_says_when_it_is_destroyed() {
        let text = golden_host().render_vm("old-1", &[], &[], at_now());

        assert_eq!(
            text.as_deref(),
            Some(
                "VM old-1\n\
                 \x20 quarantine out of the desired state; destroyed in 3 h (2027-01-15T11:00Z)\n\
                 \x20 console    (last 0 lines)\n"
            )
        );
    }

    /// A report of one VM, `row`.
    fn of_one(row: pb::VmStatus) -> ReportFile {
        ReportFile::new(
            pb::HostInfo::default(),
            "desired file /d.json".into(),
            "ok".into(),
            pb::Report {
                vms: vec![row],
                ..Default::default()
            },
        )
    }

    /// A running VM whose last entry was refused.
    fn rejected_web_1() -> ReportFile {
        of_one(pb::VmStatus {
            vm_id: "web-1".into(),
            power_state: "running".into(),
            phase: "ready".into(),
            spec_rejected: "invalid entry: vcpus: 0".into(),
            ..Default::default()
        })
    }

    #[test]
    fn a_rejected_specs_label_stands_apart_from_its_value() {
        let file = rejected_web_1();

        let text = file.render_vm("web-1", &[], &[], at_now()).expect("web-1");

        assert!(
            text.contains("\n  spec rejected invalid entry: vcpus: 0; it runs on as it was\n"),
            "{text}"
        );
        assert!(text.contains("\n  power         running"), "{text}");
    }

    #[test]
    fn a_rejected_spec_is_in_its_rows_detail() {
        let file = rejected_web_1();

        let table = file.render(at_now());

        let row = table
            .lines()
            .find(|l| l.starts_with("web-1 "))
            .unwrap_or_else(|| panic!("{table}"));
        assert!(
            row.ends_with("spec rejected: invalid entry: vcpus: 0"),
            "{row}"
        );
    }

    #[test]
    fn status_of_an_unknown_vm_is_none() {
        assert_eq!(golden_host().render_vm("nope", &[], &[], at_now()), None);
    }

    #[test]
    fn the_host_header_has_epoch_contact_quota_and_phases() {
        assert_eq!(
            golden_host().header(),
            "epoch 9 · contact ok · quota 3/16 vcpus, 3072 MB, 30/500 GB · 2 VMs: 1 failed, 1 ready"
        );
    }
}
