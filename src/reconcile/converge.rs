//! Driving a created VM to its desired power state.
//!
//! lost = the host rebooted since the VM last booted (boot id changed), or
//! its hypervisor is gone without a recorded stop request. A deliberately
//! stopped VM is stopped, not lost. A lost VM that should run is booted
//! again: every VM is persistent.
//!
//! Each branch reads as its transitions: the intent saved before the side
//! effect, the outcome saved after it, and the row derived from the record
//! the way every report derives it (`lifecycle::phase`).

use super::lifecycle::{self, State};
use super::pass::{Core, Pass, VmResult};
use super::volumes;
use crate::deadline::Deadline;
use crate::error::{BoxFailure, chain};
use crate::model::{DesiredVm, Phase, PowerState};
use crate::state::Record;

impl Core {
    pub(crate) fn converge(&self, d: &DesiredVm, mut rec: Record, pass: &mut Pass<'_>) {
        match lifecycle::state(&rec, self.budget()) {
            State::Suspended | State::Suspending | State::Resuming => {
                return self.converge_suspension(d, rec, pass);
            }
            State::Creating(_) | State::Up | State::Down | State::Quarantined { .. } => {}
        }
        // Keeps the ledger true for every live VM, however it got here (an
        // un-quarantined VM's compute was released).
        self.ledger.note(&rec.spec);
        self.counts.lost.touch(rec.spec.vm_id.as_str());
        let running = self.prov.running(&rec.spec.vm_id);
        // A running VM keeps what it booted with (its row says what waits);
        // the next boot from cold takes it.
        if !running {
            self.take_next_boot_changes(d, &mut rec);
        }
        let boot_id = self.host.boot_id();
        if self.note_address(&mut rec) {
            self.save_best_effort(&rec);
        }

        let rebooted = rec.lifecycle.boot_id() != boot_id;
        let up = lifecycle::state(&rec, self.budget()) == State::Up;
        if rebooted || (!running && up) {
            let why = if rebooted {
                "the host rebooted"
            } else {
                "its hypervisor is gone without a stop request"
            };
            log::warn!("VM {}: lost ({why})", rec.spec.vm_id);
            self.counts.lost.inc(rec.spec.vm_id.as_str());
            return match d.power {
                PowerState::Running | PowerState::Suspended => {
                    // Said before the boot: the guest is down until it ends.
                    pass.narrator(&rec, PowerState::Stopped, Phase::Ready)
                        .say(&format!("booting again: {why}"));
                    if let Some(rec) = self.boot(pass.deadline, rec, boot_id, pass.res)
                        && d.power == PowerState::Suspended
                    {
                        self.suspend(rec, pass);
                    }
                }
                PowerState::Stopped => {
                    rec.lost_while_stopped(boot_id);
                    self.save_best_effort(&rec);
                    self.report_recorded(pass.res, &rec, PowerState::Stopped);
                }
            };
        }

        match (d.power, running) {
            (PowerState::Running, false) => {
                self.boot(pass.deadline, rec, boot_id, pass.res);
            }
            (PowerState::Stopped, true) => self.stop(rec, pass),
            (PowerState::Suspended, true) => self.suspend(rec, pass),
            // A stopped VM is suspended by way of a boot: what is wanted is
            // a guest's state saved, and a guest that never ran has none.
            (PowerState::Suspended, false) => {
                if let Some(rec) = self.boot(pass.deadline, rec, boot_id, pass.res) {
                    self.suspend(rec, pass);
                }
            }
            // At the desired state: whatever an earlier operation left in
            // the record is history now.
            (PowerState::Running, true) | (PowerState::Stopped, false) => {
                if rec.lifecycle.stop_requested() == running
                    || !rec.lifecycle.last_error().is_empty()
                {
                    rec.converged(running);
                    self.save_best_effort(&rec);
                }
                self.report_recorded(pass.res, &rec, PowerState::observed(running));
            }
        }
    }

    /// Boots a VM that should run and does not; `boot_id` is the host's,
    /// which re-stamps a VM lost to a reboot. The record as saved, if it
    /// booted.
    fn boot(
        &self,
        deadline: Deadline,
        mut rec: Record,
        boot_id: String,
        res: &mut VmResult,
    ) -> Option<Record> {
        let booting = std::time::Instant::now();
        let booted =
            volumes::materialized(&self.store, &rec.spec, &|other| self.prov.running(other))
                .and_then(|()| self.prov.boot(&rec.spec, deadline));
        match booted {
            Ok(()) => {
                self.counts.boots.observe(booting.elapsed());
                self.note_address(&mut rec);
                rec.booted(boot_id);
                self.save_best_effort(&rec);
                self.forget_logs(&rec.spec.vm_id);
                log::info!("VM {}: booted", rec.spec.vm_id);
                self.report_recorded(res, &rec, PowerState::Running);
                Some(rec)
            }
            Err(e) => {
                self.fail_boot(rec, e, res);
                None
            }
        }
    }

    /// Stops a VM that should not run. The stop intent is saved first: a
    /// stop without a durable intent would read as a crash after an agent
    /// restart, and the VM would be booted again. A long stop (a guest
    /// taking its time over the power button) is narrated as it goes.
    fn stop(&self, mut rec: Record, pass: &mut Pass<'_>) {
        rec.stop_intended();
        let Some(narrator) = self.intend(
            &rec,
            "stopping",
            PowerState::Running,
            crate::crash::at("stop.intent-saved"),
            pass,
        ) else {
            return;
        };
        let say = |what: &str| narrator.say(what);
        match self.prov.shutdown(&rec.spec.vm_id, pass.deadline, &say) {
            Ok(()) => {
                crate::crash::point("stop.done");
                rec.stopped();
                self.save_best_effort(&rec);
                log::info!("VM {}: stopped", rec.spec.vm_id);
                self.report_recorded(pass.res, &rec, PowerState::Stopped);
            }
            // Unlike the reference, a failed shutdown is not reported as
            // stopped: the row says what the host has, and the saved intent
            // makes the next pass try again.
            Err(e) => {
                let err: &dyn std::error::Error = &*e;
                let why = chain(err);
                self.log_failure(&rec.spec.vm_id, "shutdown failed", &why);
                rec.stop_failed(why);
                self.save_best_effort(&rec);
                let power = PowerState::observed(self.prov.running(&rec.spec.vm_id));
                self.report_recorded(pass.res, &rec, power);
            }
        }
    }

    /// Records a failed boot with the hypervisor's own account of why.
    fn fail_boot(&self, mut rec: Record, err: BoxFailure, res: &mut VmResult) {
        let err: &dyn std::error::Error = &*err;
        let mut error = chain(err);
        if let Some(reason) = self.prov.failure_reason(&rec.spec.vm_id) {
            error = format!("{error}: {reason}");
        }
        self.log_failure(&rec.spec.vm_id, "boot failed", &error);
        rec.boot_failed(error);
        self.save_best_effort(&rec);
        self.report_recorded(res, &rec, PowerState::Stopped);
    }
}
