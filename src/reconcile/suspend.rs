//! Suspending and resuming a created VM, and finishing either when a crash
//! cut it short. The states and their rules are the lifecycle's
//! (`state::lifecycle`); this is the order of their side effects.
//!
//! Suspend, in order:
//! 1. `suspend_intended` saved: from here a crash is finished by the next
//!    pass, never taken for a lost VM.
//! 2. The backend pauses the guest, saves and commits its state and stops
//!    its VMM (its crash points: snapshot written, committed, VMM stopped).
//! 3. `suspended` saved, with what the backend saved. The ledger keeps the
//!    VM's disk and its saved state's, not its vCPUs or memory.
//!
//! Resume, in order:
//! 1. Admitted like a create: on a full host it waits, narrated, and
//!    nothing is spent.
//! 2. The saved state is looked at: gone, torn or taken with other disks,
//!    it is never guessed at, and the VM is booted from its disks,
//!    narrated and counted.
//! 3. `resume_intended` saved, on a thread of its own beside step 4:
//!    the saved state is spent from here.
//! 4. The backend restores it into a new VMM, its guest held paused, and
//!    runs the guest only once the save in 3 has landed (its `spend`);
//!    then it discards the saved state (its memory is stale the moment
//!    the guest runs). A restore spends nothing, so it does not wait for
//!    the disk (`make bench-wake`: a wake's record save took 12–15 ms
//!    under another VM's restore). A save that fails ends the restored
//!    VMM before its guest ran: the VM stays suspended, its saved state
//!    whole, and the next pass tries again.
//! 5. `resumed` saved. A resume that does not end running is not tried
//!    again: the VM is booted from its disks.
//!
//! Cut short (as the agent's start and the next pass find it):
//! - suspending, its VMM alive: the suspend is done again from the start,
//!   or, if the VM is wanted running now, its VMM is resumed;
//! - suspending, no VMM, a committed save: the suspend happened; recorded;
//! - suspending, no VMM, nothing saved: its memory is gone (only a host
//!   that died can do this: a VMM outlives the agent); booted from its
//!   disks;
//! - suspended, a VMM alive (a backend that saves to disk): a restore
//!   whose save never landed, so its guest never ran; the backend stops
//!   it at the agent's start (`recover`), and the VM, still suspended,
//!   is resumed again from its whole saved state;
//! - resuming, its VMM alive: the resume is finished (a guest restored
//!   but still paused is run);
//! - resuming, no VMM: the saved state may have run; booted from its
//!   disks, never restored twice.
//!
//! So after a crash anywhere a VM wanted suspended ends with a whole
//! snapshot and no VMM, one wanted running with exactly one VMM; never
//! both, never neither (`make chaos` holds it).

use std::time::Instant;

use super::lifecycle::{self, State};
use super::pass::{Core, Pass, RESUME_STAGE, SUSPEND_STAGE};
use crate::error::{BoxFailure, Simple, chain};
use crate::model::{DesiredVm, Phase, PowerState, Saved};
use crate::provision::SavedGuest;
use crate::stages::timed;
use crate::state::Record;

/// Why a suspended VM is booted from its disks instead of resumed; the
/// `cold_boots` counter's label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ColdBoot {
    /// Its saved state is not on the host any more.
    Gone,
    /// Its saved state is there but cannot be restored (torn, or taken
    /// with other disks).
    Unusable,
    /// A resume was tried and did not end with its guest running.
    Failed,
    /// A crash mid-suspend or mid-resume left nothing to continue.
    Interrupted,
}

impl ColdBoot {
    fn label(self) -> &'static str {
        match self {
            ColdBoot::Gone => "gone",
            ColdBoot::Unusable => "unusable",
            ColdBoot::Failed => "failed",
            ColdBoot::Interrupted => "interrupted",
        }
    }
}

impl Core {
    /// A created VM whose record says suspended, suspending or resuming.
    pub(crate) fn converge_suspension(&self, d: &DesiredVm, rec: Record, pass: &mut Pass<'_>) {
        let vm_id = rec.spec.vm_id.clone();
        self.counts.lost.touch(vm_id.as_str());
        match lifecycle::state(&rec, self.budget()) {
            State::Suspended => self.converge_suspended(d, rec, pass),
            State::Suspending => {
                self.ledger.note(&rec.spec);
                let running = self.prov.running(&vm_id);
                match (running, self.prov.suspension(&vm_id), d.power) {
                    (_, Some(SavedGuest::Usable(saved)), _) if !running => {
                        let mut rec = rec;
                        log::info!(
                            "VM {vm_id}: its suspend was cut short after its commit; it is suspended"
                        );
                        self.record_suspended(&mut rec, saved);
                        self.converge_suspended(d, rec, pass);
                    }
                    (true, _, PowerState::Suspended) => self.suspend(rec, pass),
                    (true, _, PowerState::Running | PowerState::Stopped) => {
                        // Resumed where it stands (paused, or saving): what
                        // the suspend saved, if anything, goes with it.
                        self.resume_live(d, rec, pass);
                    }
                    (false, _, _) => self.cold_boot(d, rec, ColdBoot::Interrupted, pass),
                }
            }
            State::Resuming => {
                self.ledger.note(&rec.spec);
                if self.prov.running(&vm_id) {
                    self.resume_live(d, rec, pass);
                } else {
                    self.cold_boot(d, rec, ColdBoot::Interrupted, pass);
                }
            }
            State::Creating(_) | State::Up | State::Down | State::Quarantined { .. } => {
                self.converge(d, rec, pass);
            }
        }
    }

    /// A suspended VM: kept so, resumed, or discarded and stopped, as
    /// desired.
    fn converge_suspended(&self, d: &DesiredVm, mut rec: Record, pass: &mut Pass<'_>) {
        let vm_id = rec.spec.vm_id.clone();
        let Some(saved) = rec.lifecycle.suspension().saved() else {
            return self.converge(d, rec, pass);
        };
        self.ledger.note_suspended(&rec.spec, &saved);
        match d.power {
            PowerState::Suspended => match self.prov.suspension(&vm_id) {
                Some(SavedGuest::Usable(_)) => {
                    if !rec.lifecycle.last_error().is_empty() {
                        rec.suspended(saved);
                        self.save_best_effort(&rec);
                    }
                    self.report_recorded(pass.res, &rec, PowerState::Suspended);
                }
                Some(SavedGuest::Unusable(why)) => {
                    self.cold_boot(d, rec, ColdBoot::Unusable, pass);
                    log::warn!("VM {vm_id}: its saved state cannot be restored: {why}");
                }
                None => self.cold_boot(d, rec, ColdBoot::Gone, pass),
            },
            PowerState::Running => self.resume(d, rec, pass),
            PowerState::Stopped => {
                pass.narrator(&rec, PowerState::Suspended, Phase::Ready)
                    .say("stopping: discarding its saved state");
                // The saved state goes first: a suspended record whose state
                // is gone is driven as one that lost it, never restored.
                if let Err(e) = self.prov.discard_suspension(&vm_id, pass.deadline) {
                    // Still suspended, as the record says; the next pass
                    // tries again.
                    let why = chain(&*e);
                    self.log_failure(&vm_id, "discarding its saved state failed", &why);
                    return pass
                        .res
                        .report(&rec, Some(PowerState::Suspended), Phase::Failed, why);
                }
                crate::crash::point("stop.snapshot-discarded");
                rec.suspension_discarded();
                self.save_best_effort(&rec);
                self.ledger.note(&rec.spec);
                log::info!("VM {vm_id}: stopped; its saved state discarded");
                self.report_recorded(pass.res, &rec, PowerState::Stopped);
            }
        }
    }

    /// Suspends a running VM (see the module's steps).
    pub(crate) fn suspend(&self, mut rec: Record, pass: &mut Pass<'_>) {
        let vm_id = rec.spec.vm_id.clone();
        // Whatever saved state is on the host now is stale (a leftover of a
        // discard that failed): a suspend under way finds only its own.
        if let Err(e) = self.prov.discard_suspension(&vm_id, pass.deadline) {
            let why = chain(&*e);
            self.log_failure(&vm_id, "suspend failed", &why);
            return self.report_recorded(pass.res, &rec, PowerState::Running);
        }
        rec.suspend_intended();
        let Some(narrator) = self.intend(
            &rec,
            "suspending",
            PowerState::Running,
            crate::crash::at("suspend.intent-saved"),
            pass,
        ) else {
            return;
        };
        let say = |what: &str| narrator.say(what);
        let started = Instant::now();
        let suspended = timed(SUSPEND_STAGE, || {
            self.prov.suspend(&vm_id, pass.deadline, &say)
        });
        match suspended {
            Ok(saved) => {
                self.counts.suspends.observe(started.elapsed());
                log::info!(
                    "VM {vm_id}: suspended in {} ms ({} MB saved)",
                    started.elapsed().as_millis(),
                    saved.bytes >> 20
                );
                self.record_suspended(&mut rec, saved);
                self.forget_logs(&vm_id);
                self.report_recorded(pass.res, &rec, PowerState::Suspended);
            }
            Err(e) => {
                let why = chain(&*e);
                self.log_failure(&vm_id, "suspend failed", &why);
                rec.suspend_failed(why);
                self.save_best_effort(&rec);
                let power = PowerState::observed(self.prov.running(&vm_id));
                self.report_recorded(pass.res, &rec, power);
            }
        }
    }

    fn record_suspended(&self, rec: &mut Record, saved: Saved) {
        rec.suspended(saved);
        self.save_best_effort(rec);
        self.ledger.note_suspended(&rec.spec, &saved);
    }

    /// Resumes a suspended VM from its saved state (see the module's
    /// steps).
    fn resume(&self, d: &DesiredVm, mut rec: Record, pass: &mut Pass<'_>) {
        let vm_id = rec.spec.vm_id.clone();
        if let Err(why) = self.ledger.admit(&rec.spec) {
            return self.resume_waits(
                &rec,
                format!("for room on this host to resume it: {why}"),
                pass,
            );
        }
        match self.prov.suspension(&vm_id) {
            Some(SavedGuest::Usable(_)) => {}
            Some(SavedGuest::Unusable(why)) => {
                log::warn!("VM {vm_id}: its saved state cannot be restored: {why}");
                return self.cold_boot(d, rec, ColdBoot::Unusable, pass);
            }
            None => return self.cold_boot(d, rec, ColdBoot::Gone, pass),
        }
        // Asked before the saved guest is spent: a host that cannot take
        // the resume now keeps it waiting, suspended, rather than booting
        // the VM from its disks.
        if let Err(e) = self.prov.resumable(&rec.spec)
            && e.is_host_condition()
        {
            let why = format!("for this host to be able to resume it: {}", chain(&*e));
            return self.resume_waits(&rec, why, pass);
        }
        rec.resume_intended();
        pass.narrator(&rec, PowerState::Suspended, Phase::Ready)
            .say("resuming");
        let started = Instant::now();
        let (saved, resumed) = self.restore_while_saving(&rec, pass.deadline);
        match (saved, resumed) {
            (_, Ok(())) => {
                self.counts.resumes.observe(started.elapsed());
                log::info!(
                    "VM {vm_id}: resumed in {} ms",
                    started.elapsed().as_millis()
                );
                self.record_resumed(rec, d, pass);
            }
            // Its guest never ran (the backend runs it only once the save
            // landed): still suspended, its saved guest whole, tried again
            // next pass.
            (Err(e), Err(_)) => {
                let why = chain(&*e);
                self.intent_failed(&rec, "resuming", PowerState::Suspended, &why, pass);
            }
            (Ok(()), Err(e)) => {
                let why = chain(&*e);
                self.log_failure(&vm_id, "resume failed; booting it from its disks", &why);
                self.cold_boot(d, rec, ColdBoot::Failed, pass);
            }
        }
    }

    /// Step 3 beside step 4: the backend restores the saved guest while
    /// the resume's intent (`rec`) is saved, and runs the guest only once
    /// that save has landed (its `spend`). A restore spends nothing (the
    /// saved state is read, and the restored guest is held still), so it
    /// need not wait for the disk; a guest that runs must, and does. The
    /// save's result, then the resume's.
    fn restore_while_saving(
        &self,
        rec: &Record,
        deadline: crate::deadline::Deadline,
    ) -> (Result<(), BoxFailure>, Result<(), BoxFailure>) {
        let vm_id = &rec.spec.vm_id;
        let (landed, landing) = crossbeam_channel::bounded(1);
        // Moved in, so a second ask finds the channel closed and refuses.
        let save = move || {
            let saved = self.store.save(rec);
            let _ = landed.send(saved.as_ref().map(|_| ()).map_err(|e| chain(e)));
            saved
        };
        let spend = || -> Result<(), BoxFailure> {
            let landed = timed("record wait", || landing.recv());
            match landed {
                Ok(Ok(())) => {
                    crate::crash::point("resume.intent-saved");
                    Ok(())
                }
                Ok(Err(why)) => Err(Simple::transient(format!(
                    "VM {vm_id}: its resume cannot be recorded: {why}"
                ))
                .into()),
                Err(_) => Err(Simple::transient(format!(
                    "VM {vm_id}: its resume was not recorded (its save ended without an answer)"
                ))
                .into()),
            }
        };
        let (saved, resumed) = crate::threads::alongside(&format!("intent-{vm_id}"), save, || {
            timed(RESUME_STAGE, || {
                self.prov.resume(&rec.spec, deadline, &spend)
            })
        });
        let saved = saved
            .map_err(|why| super::create::panicked("saving its resume's record", why))
            .and_then(|saved| saved.map_err(BoxFailure::from));
        (saved, resumed)
    }

    /// A resume that cannot start yet: the VM stays suspended, its saved
    /// guest kept, and its row says what it waits `for`.
    fn resume_waits(&self, rec: &Record, waits_for: String, pass: &mut Pass<'_>) {
        self.report_recorded(pass.res, rec, PowerState::Suspended);
        if let Some(row) = &mut pass.res.row {
            row.status_detail = format!("waiting {waits_for}");
        }
    }

    /// A suspend or resume cut short with the VMM alive: it is made to
    /// run (whatever was saved is discarded by the backend), then driven
    /// to what is desired.
    fn resume_live(&self, d: &DesiredVm, mut rec: Record, pass: &mut Pass<'_>) {
        let vm_id = rec.spec.vm_id.clone();
        if rec.lifecycle.suspension() != lifecycle::Suspension::Resuming {
            rec.resume_intended();
            if !self.save_intent(&rec, "resuming", PowerState::Running, pass) {
                return;
            }
        }
        // The record says resuming already: nothing is left to wait for.
        match self.prov.resume(&rec.spec, pass.deadline, &|| Ok(())) {
            Ok(()) => {
                log::info!("VM {vm_id}: a suspend or resume cut short is finished: it runs");
                self.record_resumed(rec, d, pass);
            }
            Err(e) => {
                let why = chain(&*e);
                self.log_failure(&vm_id, "resuming it failed", &why);
                if self.prov.running(&vm_id) {
                    // Still there: the next pass tries again.
                    pass.res
                        .report(&rec, Some(PowerState::Running), Phase::Failed, why);
                } else {
                    self.cold_boot(d, rec, ColdBoot::Failed, pass);
                }
            }
        }
    }

    /// Records a guest running again, then drives it on if it is wanted
    /// otherwise now (a suspend cut short while the wish changed).
    fn record_resumed(&self, mut rec: Record, d: &DesiredVm, pass: &mut Pass<'_>) {
        rec.resumed(self.host.boot_id());
        self.note_address(&mut rec);
        self.ledger.note(&rec.spec);
        self.forget_logs(&rec.spec.vm_id);
        match d.power {
            PowerState::Running => {
                // Said once the guest runs, before the record follows: a
                // crash before the save finds its VMM alive and finishes.
                self.report_recorded(pass.res, &rec, PowerState::Running);
                self.say_started(d, pass);
                self.save_best_effort(&rec);
            }
            PowerState::Suspended | PowerState::Stopped => {
                self.save_best_effort(&rec);
                self.converge(d, rec, pass);
            }
        }
    }

    /// The saved state cannot be continued: discarded, said, counted, and
    /// the VM driven as one that is down (booted from its disks if it is
    /// wanted running or suspended).
    fn cold_boot(&self, d: &DesiredVm, mut rec: Record, why: ColdBoot, pass: &mut Pass<'_>) {
        let vm_id = rec.spec.vm_id.clone();
        let said = match why {
            ColdBoot::Gone => "its saved state is gone",
            ColdBoot::Unusable => "its saved state cannot be restored",
            ColdBoot::Failed => "its resume did not end with it running",
            ColdBoot::Interrupted => "a crash cut its suspend or resume short",
        };
        log::warn!("VM {vm_id}: {said}; it will be booted from its disks");
        self.counts.cold_boots.inc(why.label());
        if let Err(e) = self.prov.discard_suspension(&vm_id, pass.deadline) {
            log::warn!("VM {vm_id}: cannot discard its saved state: {}", chain(&*e));
        }
        rec.suspension_lost();
        self.save_best_effort(&rec);
        self.ledger.note(&rec.spec);
        if d.power != PowerState::Stopped {
            pass.narrator(&rec, PowerState::Stopped, Phase::Ready)
                .say(&format!("booting it from its disks: {said}"));
        }
        self.converge(d, rec, pass);
    }
}
