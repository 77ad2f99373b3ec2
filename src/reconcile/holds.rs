//! What a VM is held to beyond its lifecycle, as a pass records and says
//! it: its own egress rules (recorded before they are held, and a VM never
//! started where they cannot be), its limits (a change waits for its next
//! boot, and its row says so) and its probe's answer, in its row and for
//! the metrics file.

use super::counts::Held;
use super::pass::{Core, VmResult};
use crate::error::{BoxFailure, Failure};
use crate::model::{DesiredVm, Id, PowerState};
use crate::state::Record;

impl Core {
    /// The row of a VM not started because its egress rules cannot be
    /// held here.
    pub(super) fn refuse_unfenced(
        &self,
        vm_id: &Id,
        e: &dyn Failure,
        rec: Option<&Record>,
        res: &mut VmResult,
    ) {
        let why = format!(
            "its own egress rules cannot be held on this host, so it is not started: {}",
            crate::error::chain(e)
        );
        self.logs
            .warn(&format!("{vm_id}/egress"), &format!("VM {vm_id}: {why}"));
        match rec {
            Some(rec) => self.report_recorded(res, rec, PowerState::Stopped),
            None => *res = VmResult::queued(vm_id),
        }
        if let Some(row) = res.row.as_mut() {
            row.status_detail = "waiting for the host".into();
            row.last_error = why;
        }
    }

    /// What the VM is held to, in its row and for the metrics file: its
    /// egress rules (and why a change of them is not held, when it is
    /// not), its limits (and that a change waits for the next boot), its
    /// probe's answer.
    pub(super) fn say_what_it_is_held_to(
        &self,
        desired: &DesiredVm,
        egress_held: Result<(), BoxFailure>,
        res: &mut VmResult,
    ) {
        let vm_id = &desired.spec.vm_id;
        let mut holds = Held::default();
        if let Some(egress) = self.prov.egress_in_force(vm_id) {
            (holds.deny, holds.allow) = (egress.deny.len(), egress.allow.len());
            if let Some(row) = res.row.as_mut() {
                row.egress = egress.to_string();
            }
        }
        holds.answering = self
            .probes
            .lock()
            .get(vm_id)
            .filter(|p| p.answered.is_some() || p.failing_since.is_some())
            .map(|p| p.failing_since.is_none());
        if let Some(row) = res.row.as_mut()
            && let Ok(Some(now)) = self.store.get(vm_id)
        {
            if let Some(limits) = self.prov.limits_in_force(&now.spec) {
                row.limits = limits.to_string();
                holds.limits = Some(limits);
            }
            if now.spec.limits != desired.spec.limits
                && self.prov.running(vm_id)
                && row.status_detail.is_empty()
            {
                row.status_detail =
                    "limits change at the next boot (stop and start it to apply them now)".into();
            }
        }
        self.counts.held.lock().insert(vm_id.to_string(), holds);
        if let Err(e) = egress_held {
            let why = format!(
                "its own egress rules are not held: {}",
                crate::error::chain(&*e)
            );
            self.logs
                .warn(&format!("{vm_id}/egress"), &format!("VM {vm_id}: {why}"));
            if let Some(row) = res.row.as_mut() {
                row.last_error = if row.last_error.is_empty() {
                    why
                } else {
                    format!("{}; {why}", row.last_error)
                };
            }
        }
    }

    /// Records the VM's own egress rules when they change, before they are
    /// held: an agent's start holds the recorded ones again for a running
    /// VM before any pass (a save that fails is retried next pass).
    pub(super) fn note_egress(&self, desired: &DesiredVm, mut rec: Record) -> Record {
        if rec.egress != desired.egress {
            rec.egress = desired.egress.clone();
            self.save_best_effort(&rec);
        }
        rec
    }
}
