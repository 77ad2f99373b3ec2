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

/// The running VMs, each with its figures (`None`: not sampled yet).
fn running(file: &ReportFile) -> std::collections::BTreeMap<&str, Option<&Usage>> {
    file.report
        .vms
        .iter()
        .filter(|row| row.power_state == "running")
        .map(|row| {
            let usage = file.details.get(&row.vm_id).and_then(|d| d.usage.as_ref());
            (row.vm_id.as_str(), usage)
        })
        .collect()
}

/// The page: a line about the samples, then a row per running VM, the
/// busiest CPU first.
fn render(file: &ReportFile, now: SystemTime) -> String {
    let mut rows: Vec<(&str, Option<&Usage>)> = running(file).into_iter().collect();
    rows.sort_by_key(|(vm, u)| {
        (
            std::cmp::Reverse(u.and_then(|u| u.cpu_millis).unwrap_or(0)),
            *vm,
        )
    });
    let mut out = String::new();
    let newest = rows
        .iter()
        .filter_map(|(_, u)| u.map(|u| u.sampled_at_ms))
        .max();
    let over = rows
        .iter()
        .filter_map(|(_, u)| u.map(|u| u.over_ms))
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
        "{:<width$}  {:>6}  {:>10}  {:>10}  {:>10}  {:>7}  {:>7}  {:>10}  {:>10}",
        "VM", "CPU%", "MEM", "READ/s", "WRITE/s", "R-IOPS", "W-IOPS", "NET-IN/s", "NET-OUT/s"
    );
    let mut tapped = false;
    for (vm, u) in rows {
        let u = u.cloned().unwrap_or_default();
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
            "{:<width$}  {cpu:>6}  {:>10}  {:>10}  {:>10}  {:>7}  {:>7}  {:>10}  {:>10}",
            crate::quote::inline(vm),
            u.resident_bytes.map_or("-".to_owned(), crate::human::bytes),
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
