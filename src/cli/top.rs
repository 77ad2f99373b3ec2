//! `eitri-agent top [--once] [--json] [--every D]`: what each running VM
//! uses, from the figures the agent sampled into `report.json` (see
//! [`crate::usage`]); read without the state dir's lock. The CLI asks no
//! VMM anything.

use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use super::fail;
use crate::status::ReportFile;
use crate::usage::Usage;

pub(super) fn run(state_dir: &Path, once: bool, json: bool, every: Duration) -> ExitCode {
    loop {
        let file = match ReportFile::read(state_dir) {
            Ok(file) => file,
            Err(e) => return fail(&e),
        };
        if json {
            return match serde_json::to_string_pretty(&running(&file)) {
                Ok(text) => {
                    println!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            };
        }
        let text = render(&file, SystemTime::now());
        if once {
            print!("{text}");
            return ExitCode::SUCCESS;
        }
        if let Err(e) = super::redraw(&text) {
            return match e.kind() {
                std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
                _ => fail(&e),
            };
        }
        std::thread::sleep(every);
    }
}

/// One running VM in `top`: what the agent sampled of it (`None`: not
/// sampled yet) and what its guest says of its own memory.
#[derive(serde::Serialize)]
struct Row<'a> {
    #[serde(flatten)]
    usage: Option<&'a Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    guest_memory: Option<GuestMemory>,
}

/// A guest's memory in bytes, as its guest agent said it.
#[derive(serde::Serialize, Clone, Copy)]
struct GuestMemory {
    total_bytes: u64,
    available_bytes: u64,
}

impl GuestMemory {
    fn of(row: &crate::pb::VmStatus) -> Option<GuestMemory> {
        (row.guest_memory_total_kib > 0).then(|| GuestMemory {
            total_bytes: row.guest_memory_total_kib.saturating_mul(1024),
            available_bytes: row
                .guest_memory_available_kib
                .min(row.guest_memory_total_kib)
                .saturating_mul(1024),
        })
    }

    /// "used/total" in MiB, as `free -m` would count them.
    fn cell(self) -> String {
        let mib = |bytes: u64| bytes >> 20;
        format!(
            "{}/{} MiB",
            mib(self.total_bytes.saturating_sub(self.available_bytes)),
            mib(self.total_bytes)
        )
    }
}

/// The running VMs by id.
fn running(file: &ReportFile) -> std::collections::BTreeMap<&str, Row<'_>> {
    file.report
        .vms
        .iter()
        .filter(|row| row.power_state == "running")
        .map(|row| {
            let usage = file.details.get(&row.vm_id).and_then(|d| d.usage.as_ref());
            let guest_memory = GuestMemory::of(row);
            (
                row.vm_id.as_str(),
                Row {
                    usage,
                    guest_memory,
                },
            )
        })
        .collect()
}

/// The page: a line about the samples, then a row per running VM, the
/// busiest CPU first.
fn render(file: &ReportFile, now: SystemTime) -> String {
    let mut rows: Vec<(&str, Row)> = running(file).into_iter().collect();
    rows.sort_by_key(|(vm, r)| {
        (
            std::cmp::Reverse(r.usage.and_then(|u| u.cpu_millis).unwrap_or(0)),
            *vm,
        )
    });
    let mut out = String::new();
    let newest = rows
        .iter()
        .filter_map(|(_, r)| r.usage.map(|u| u.sampled_at_ms))
        .max();
    let over = rows
        .iter()
        .filter_map(|(_, r)| r.usage.map(|u| u.over_ms))
        .find(|ms| *ms > 0);
    let _ = write!(out, "{} running", rows.len());
    match (newest, over) {
        (Some(at), Some(over)) => {
            let _ = write!(
                out,
                ", each a rate over {}; sampled {} ago",
                crate::human::duration(Duration::from_millis(over)),
                crate::human::duration(
                    now.duration_since(std::time::UNIX_EPOCH + Duration::from_millis(at))
                        .unwrap_or_default()
                )
            );
        }
        (Some(_), None) => out.push_str("; sampled once so far: rates come with the second sample"),
        (None, _) if !rows.is_empty() => out.push_str(
            "; no figures: the agent samples none yet (it samples every --usage-interval; 0 turns it off)",
        ),
        (None, _) => {}
    }
    if file.is_stale(now) {
        out.push_str(" (the report is stale: is the agent running?)");
    }
    out.push('\n');
    if rows.is_empty() {
        return out;
    }
    let width = rows
        .iter()
        .map(|(vm, _)| crate::quote::inline(vm).len())
        .fold(2, usize::max);
    let _ = writeln!(
        out,
        "{:<width$}  {:>6}  {:>10}  {:>14}  {:>10}  {:>10}  {:>7}  {:>7}  {:>10}  {:>10}",
        "VM",
        "CPU%",
        "MEM",
        "GUEST-MEM",
        "READ/s",
        "WRITE/s",
        "R-IOPS",
        "W-IOPS",
        "NET-IN/s",
        "NET-OUT/s"
    );
    let mut tapped = false;
    for (vm, row) in rows {
        let u = row.usage.cloned().unwrap_or_default();
        tapped |= u.net_from == "taps" && u.net_rx_bps.is_some();
        let cpu = u
            .cpu_millis
            .map_or("-".to_owned(), |m| format!("{:.1}", m as f64 / 10.0));
        let count = |n: Option<u64>| n.map_or("-".to_owned(), |n| n.to_string());
        let net = |n: Option<u64>| match (n, u.net_from.as_str()) {
            (Some(n), "taps") => format!("{}*", rate(Some(n))),
            _ => rate(n),
        };
        let _ = writeln!(
            out,
            "{:<width$}  {cpu:>6}  {:>10}  {:>14}  {:>10}  {:>10}  {:>7}  {:>7}  {:>10}  {:>10}",
            crate::quote::inline(vm),
            u.resident_bytes.map_or("-".to_owned(), crate::human::bytes),
            row.guest_memory.map_or("-".to_owned(), GuestMemory::cell),
            rate(u.disk_read_bps),
            rate(u.disk_write_bps),
            count(u.disk_read_iops),
            count(u.disk_write_iops),
            net(u.net_rx_bps),
            net(u.net_tx_bps),
        );
    }
    if tapped {
        out.push_str("* counted on the VM's taps: its hypervisor did not answer vm.counters\n");
    }
    out
}

/// Bytes a second, in the unit they read best in.
fn rate(n: Option<u64>) -> String {
    n.map_or("-".to_owned(), crate::human::bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_saying_more_available_than_it_has_shows_none_used() {
        let row = crate::pb::VmStatus {
            guest_memory_total_kib: 512 << 10,
            guest_memory_available_kib: u64::MAX,
            ..Default::default()
        };

        let memory = GuestMemory::of(&row).map(GuestMemory::cell);

        assert_eq!(memory.as_deref(), Some("0/512 MiB"));
    }

    #[test]
    fn a_guest_that_said_nothing_of_its_memory_has_no_figure() {
        let row = crate::pb::VmStatus::default();

        assert!(GuestMemory::of(&row).is_none());
    }
}
