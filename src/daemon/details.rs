//! What `status VM` shows beyond a report's row, kept by the daemon across
//! reports: since when a VM has had its power, phase and hypervisor, when
//! its error was first and last seen, how often it was booted again
//! unasked, and its spec and attempts from its record. Updated at every
//! report write. The hypervisor's pid is asked of the backend (it reads
//! files) once a tick, and whenever the row's power changes, so a row
//! that says running never stands beside "not running". A hypervisor's
//! "up" is its own start, read from /proc, and a running VM has run since
//! then. An agent started again goes on from its state dir's last
//! report.json: what has not changed keeps its since, restarts count on.
//! A VM gone from the report is gone from here.

use std::collections::{BTreeMap, HashMap};
use std::time::SystemTime;

use crate::model::Id;
use crate::pb;
use crate::reconcile::Engine;
use crate::state::{RecordSlot, Store};
use crate::status::{ReportFile, VmDetail};

#[derive(Default)]
struct Seen {
    power: String,
    phase: String,
    error: String,
    detail: VmDetail,
    /// Its restarts under the agents before this one.
    restarts_before: u64,
}

#[derive(Default)]
pub struct Details {
    seen: HashMap<String, Seen>,
}

fn now_ms() -> u64 {
    unix_ms(SystemTime::now())
}

pub(super) use crate::human::unix_ms;

/// When process `pid` started (Unix ms), from its own /proc entry: the
/// same whoever asks, across agent restarts. `None` where there is no
/// /proc (macOS: the first look stands in).
fn started_ms(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22, counted after the command's closing parenthesis (the
    // command may hold spaces and parentheses of its own).
    let after = &stat[stat.rfind(')')? + 1..];
    let ticks: u64 = after.split_whitespace().nth(19)?.parse().ok()?;
    let btime: u64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .and_then(|hz| u64::try_from(hz).ok())
        .filter(|hz| *hz > 0)?;
    Some(btime * 1000 + ticks * 1000 / hz)
}

impl Details {
    /// Details that go on from `last`, the state dir's report.json as the
    /// agent before this one left it.
    pub fn going_on_from(last: Option<ReportFile>) -> Details {
        let Some(last) = last else {
            return Details::default();
        };
        let seen = last
            .report
            .vms
            .iter()
            .map(|row| {
                let detail = last.details.get(&row.vm_id).cloned().unwrap_or_default();
                let seen = Seen {
                    power: row.power_state.clone(),
                    phase: row.phase.clone(),
                    error: row.last_error.clone(),
                    restarts_before: detail.restarts,
                    detail,
                };
                (row.vm_id.clone(), seen)
            })
            .collect();
        Details { seen }
    }

    /// The details for `report`; `tick` asks the backend for pids.
    pub fn update(
        &mut self,
        report: &pb::Report,
        store: &Store,
        engine: &Engine,
        tick: bool,
    ) -> BTreeMap<String, VmDetail> {
        let now = now_ms();
        let records = store.load_all();
        let max_attempts = engine.max_attempts();
        let mut seen = HashMap::with_capacity(report.vms.len());
        let ids = report
            .vms
            .iter()
            .map(|v| (v.vm_id.as_str(), Some(v)))
            .chain(report.quarantined.iter().map(|q| (q.vm_id.as_str(), None)));
        for (vm_id, row) in ids {
            if seen.contains_key(vm_id) {
                continue;
            }
            let old = self.seen.remove(vm_id).unwrap_or_default();
            let (power, phase, error) = row.map_or_else(Default::default, |r| {
                (r.power_state.clone(), r.phase.clone(), r.last_error.clone())
            });
            let mut d = old.detail;
            let power_changed = power != old.power;
            if power_changed || d.power_since_ms == 0 {
                d.power_since_ms = now;
            }
            if phase != old.phase || d.phase_since_ms == 0 {
                d.phase_since_ms = now;
            }
            (d.error_first_ms, d.error_last_ms) = match (error.is_empty(), error == old.error) {
                (true, _) => (0, 0),
                (false, true) if d.error_first_ms > 0 => (d.error_first_ms, now),
                (false, _) => (now, now),
            };
            let id = Id::parse(vm_id).ok();
            if let Some(RecordSlot::Readable(rec)) = id.as_ref().and_then(|id| records.get(id)) {
                d.attempts = rec.lifecycle.create_attempts();
                d.booted_as.clear();
                d.booted_as.push_str(rec.lifecycle.boot_id());
                d.vcpus = rec.spec.vcpus;
                d.mem_mb = rec.spec.mem_mb;
                d.disk_gb = rec.spec.disk_gb;
                let shown = crate::quote::url(&rec.spec.image_url);
                if d.image_url != shown {
                    d.image_url = shown.into_owned();
                }
                d.network.clone_from(&rec.spec.network);
                d.volume_ids = rec.spec.volume_ids.iter().map(|v| v.to_string()).collect();
                d.created_at_ms = rec.lifecycle.created_at().map_or(0, unix_ms);
                let saved = rec.lifecycle.suspension().saved().unwrap_or_default();
                d.suspended_at_ms = saved.taken_at_ms;
                d.snapshot_bytes = saved.bytes;
            }
            d.max_attempts = max_attempts;
            if (tick || power_changed)
                && let Some(id) = &id
            {
                let pid = engine.hypervisor_pid(id);
                if pid != d.pid {
                    d.pid = pid;
                    d.pid_since_ms = pid.and_then(started_ms).unwrap_or(now);
                }
            }
            // Running since its hypervisor started (a boot, or a resume).
            if power == "running" && d.pid.is_some() {
                d.power_since_ms = d.pid_since_ms;
            }
            let counts = engine.counts();
            d.restarts =
                old.restarts_before + counts.lost.get(vm_id) + counts.probe_restarts.get(vm_id);
            seen.insert(
                vm_id.to_owned(),
                Seen {
                    power,
                    phase,
                    error,
                    detail: d,
                    restarts_before: old.restarts_before,
                },
            );
        }
        self.seen = seen;
        self.seen
            .iter()
            .map(|(k, s)| (k.clone(), s.detail.clone()))
            .collect()
    }
}
