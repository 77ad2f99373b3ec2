//! What `status VM` shows beyond a report's row, kept by the daemon across
//! reports: since when a VM has had its power, phase and hypervisor, when
//! its error was first and last seen, and its spec and attempts from its
//! record. Updated at every report write; the hypervisor's pid is asked of
//! the backend once a tick (it reads files), not at every change-driven
//! write. A VM gone from the report is gone from here.

use std::collections::{BTreeMap, HashMap};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::model::Id;
use crate::pb;
use crate::reconcile::Engine;
use crate::state::{RecordSlot, Store};
use crate::status::VmDetail;

#[derive(Default)]
struct Seen {
    power: String,
    phase: String,
    error: String,
    detail: VmDetail,
}

#[derive(Default)]
pub struct Details {
    seen: HashMap<String, Seen>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Details {
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
            if power != old.power || d.power_since_ms == 0 {
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
                let saved = rec.lifecycle.suspension().saved().unwrap_or_default();
                d.suspended_at_ms = saved.taken_at_ms;
                d.snapshot_bytes = saved.bytes;
            }
            d.max_attempts = max_attempts;
            if tick && let Some(id) = &id {
                let pid = engine.hypervisor_pid(id);
                if pid != d.pid {
                    d.pid = pid;
                    d.pid_since_ms = now;
                }
            }
            seen.insert(
                vm_id.to_owned(),
                Seen {
                    power,
                    phase,
                    error,
                    detail: d,
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
