//! Driving an existing VM to its desired power state.
//!
//! lost = the host rebooted since the VM last booted (boot id changed), or
//! its hypervisor is gone without a recorded stop request. A deliberately
//! stopped VM is stopped, not lost. A lost VM that should run is booted
//! again: every VM is persistent.

use super::pass::{Core, Narrator, VmResult};
use super::volumes;
use super::workers::Publisher;
use crate::deadline::Deadline;
use crate::error::{BoxFailure, chain};
use crate::model::{DesiredVm, Phase, PowerState};
use crate::state::Record;

impl Core {
    pub(crate) fn converge(
        &self,
        deadline: Deadline,
        d: &DesiredVm,
        mut rec: Record,
        res: &mut VmResult,
        publisher: Option<&Publisher>,
    ) {
        // Keeps the ledger true for every live VM, however it got here (an
        // un-quarantined VM's compute was released).
        self.ledger.note(&rec.spec);
        let running = self.prov.running(&rec.spec.vm_id);
        let boot_id = self.host.boot_id();
        if self.note_address(&mut rec) {
            self.save_best_effort(&rec);
        }

        let rebooted = rec.boot_id != boot_id;
        let lost = rebooted || (!running && !rec.stop_requested);
        if lost {
            let why = if rebooted {
                "the host rebooted"
            } else {
                "its hypervisor is gone without a stop request"
            };
            log::warn!("VM {}: lost ({why})", rec.spec.vm_id);
            match d.power {
                PowerState::Running => {
                    // Said before the boot: the guest is down until it ends.
                    Narrator::new(
                        publisher,
                        deadline,
                        res,
                        &rec,
                        PowerState::Stopped,
                        Phase::Ready,
                    )
                    .say(&format!("booting again: {why}"));
                    self.boot(deadline, rec, Some(boot_id), res);
                }
                PowerState::Stopped => {
                    rec.boot_id = boot_id;
                    rec.stop_requested = true;
                    self.save_best_effort(&rec);
                    res.report(&rec, Some(PowerState::Stopped), Phase::Ready, "");
                }
            }
            return;
        }

        match (d.power, running) {
            (PowerState::Running, false) => self.boot(deadline, rec, None, res),
            (PowerState::Stopped, true) => self.stop(deadline, rec, res),
            // At the desired state. A past error stays on the row as history;
            // the VM itself is fine.
            (_, running) => {
                let history = rec.last_error.clone();
                res.report(
                    &rec,
                    Some(PowerState::observed(running)),
                    Phase::Ready,
                    history,
                );
            }
        }
    }

    /// Boots a VM that should run and does not. `new_boot_id` is set when
    /// the VM was lost to a host reboot and must be re-stamped.
    fn boot(
        &self,
        deadline: Deadline,
        mut rec: Record,
        new_boot_id: Option<String>,
        res: &mut VmResult,
    ) {
        let booted = volumes::materialized(&self.store, &rec.spec)
            .and_then(|()| self.prov.boot(&rec.spec, deadline));
        if let Err(e) = booted {
            return self.fail_converge(rec, e, res);
        }
        self.note_address(&mut rec);
        if let Some(boot_id) = new_boot_id {
            rec.boot_id = boot_id;
        }
        rec.stop_requested = false;
        rec.last_error.clear();
        self.save_best_effort(&rec);
        self.forget_logs(&rec.spec.vm_id);
        log::info!("VM {}: booted", rec.spec.vm_id);
        res.report(&rec, Some(PowerState::Running), Phase::Ready, "");
    }

    /// Stops a VM that should not run. The stop intent is saved first: a
    /// stop without a durable intent would read as a crash after an agent
    /// restart, and the VM would be booted again.
    fn stop(&self, deadline: Deadline, mut rec: Record, res: &mut VmResult) {
        rec.stop_requested = true;
        if let Err(e) = self.store.save(&rec) {
            let why = chain(&e);
            let vm_id = &rec.spec.vm_id;
            self.logs.error(
                &format!("{vm_id}/stop"),
                &format!("VM {vm_id}: not stopping it: {why}"),
            );
            return res.report(&rec, Some(PowerState::Running), Phase::Failed, why);
        }
        match self.prov.shutdown(&rec.spec.vm_id, deadline) {
            Ok(()) => {
                log::info!("VM {}: stopped", rec.spec.vm_id);
                res.report(&rec, Some(PowerState::Stopped), Phase::Ready, "");
            }
            // Unlike the reference, a failed shutdown is not reported as
            // stopped: the row says what the host has, and the saved intent
            // makes the next pass try again.
            Err(e) => {
                let err: &dyn std::error::Error = &*e;
                let why = chain(err);
                self.log_failure(&rec.spec.vm_id, "shutdown failed", &why);
                if rec.last_error != why {
                    rec.last_error.clone_from(&why);
                    self.save_best_effort(&rec);
                }
                let power = PowerState::observed(self.prov.running(&rec.spec.vm_id));
                res.report(&rec, Some(power), Phase::Failed, why);
            }
        }
    }

    /// Records a failed boot with the hypervisor's own account of why.
    fn fail_converge(&self, mut rec: Record, err: BoxFailure, res: &mut VmResult) {
        let err: &dyn std::error::Error = &*err;
        let mut error = chain(err);
        let reason = self.prov.failure_reason(&rec.spec.vm_id);
        if !reason.is_empty() {
            error = format!("{error}: {reason}");
        }
        self.log_failure(&rec.spec.vm_id, "boot failed", &error);
        rec.last_error = error;
        self.save_best_effort(&rec);
        let why = rec.last_error.clone();
        res.report(&rec, Some(PowerState::Stopped), Phase::Failed, why);
    }
}
