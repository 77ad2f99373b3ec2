//! Suspending and resuming a created VM, and finishing either when a crash
//! cut it short. The states and their rules are the lifecycle's
//! (`state::lifecycle`); this is the order of their side effects. Each
//! function here is handed the backend's [`Suspend`] by the spine, which
//! asked for it once: a backend that cannot suspend never reaches them
//! (see [`cannot`] and [`cannot_continue`]).
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
//!    under another VM's restore); the context's third form of the
//!    intent protocol. A save that fails ends the restored
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

use super::context::Context;
use super::guests;
use super::pass::{Began, Next, Pass, RESUME_STAGE, SUSPEND_STAGE};
use crate::error::{Simple, chain};
use crate::model::{DesiredVm, Id, Phase, PowerState, Saved};
use crate::provision::{SavedGuest, Suspend};
use crate::stages::timed;
use crate::state::{Record, lifecycle};

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

    fn said(self) -> &'static str {
        match self {
            ColdBoot::Gone => "its saved state is gone",
            ColdBoot::Unusable => "its saved state cannot be restored",
            ColdBoot::Failed => "its resume did not end with it running",
            ColdBoot::Interrupted => "a crash cut its suspend or resume short",
        }
    }
}

/// The suspension verb of one pass: the context, the backend's
/// [`Suspend`] (asked for once, by the spine), and what is desired of the
/// VM.
#[derive(Clone, Copy)]
pub(crate) struct Suspension<'a> {
    pub ctx: &'a Context,
    pub backend: &'a dyn Suspend,
    pub desired: &'a DesiredVm,
}

impl Suspension<'_> {
    /// A suspend cut short (the record says suspending): found committed, it
    /// is recorded; with its VMM alive, done again or undone as now wanted;
    /// with neither, the VM is booted from its disks.
    pub(crate) fn finish_suspend(&self, mut rec: Record, pass: &mut Pass<'_>) -> Next {
        let (ctx, s, d) = (self.ctx, self.backend, self.desired);
        let vm_id = rec.spec.vm_id.clone();
        ctx.counts.lost.touch(vm_id.as_str());
        ctx.ledger.note(&rec.spec);
        let running = ctx.backend.running(&vm_id);
        match (running, s.suspension(&vm_id), d.power) {
            (_, Some(SavedGuest::Usable(saved)), _) if !running => {
                log::info!(
                    "VM {vm_id}: its suspend was cut short after its commit; it is suspended"
                );
                record_suspended(ctx, &mut rec, saved);
                self.suspended(rec, pass)
            }
            (true, _, PowerState::Suspended) => self.suspend(rec, pass),
            // Resumed where it stands (paused, or saving): what the suspend
            // saved, if anything, goes with it.
            (true, _, PowerState::Running | PowerState::Stopped) => self.resume_live(rec, pass),
            (false, _, _) => self.cold_boot(rec, ColdBoot::Interrupted, pass),
        }
    }

    /// A resume cut short (the record says resuming): its VMM alive, the
    /// resume is finished; gone, its saved state may have run, and the VM is
    /// booted from its disks, never restored twice.
    pub(crate) fn finish_resume(&self, rec: Record, pass: &mut Pass<'_>) -> Next {
        let ctx = self.ctx;
        ctx.counts.lost.touch(rec.spec.vm_id.as_str());
        ctx.ledger.note(&rec.spec);
        if ctx.backend.running(&rec.spec.vm_id) {
            self.resume_live(rec, pass)
        } else {
            self.cold_boot(rec, ColdBoot::Interrupted, pass)
        }
    }

    /// A suspended VM: kept so, resumed, or discarded and stopped, as
    /// desired.
    pub(crate) fn suspended(&self, mut rec: Record, pass: &mut Pass<'_>) -> Next {
        let (ctx, s, d) = (self.ctx, self.backend, self.desired);
        let vm_id = rec.spec.vm_id.clone();
        ctx.counts.lost.touch(vm_id.as_str());
        let Some(saved) = rec.lifecycle.suspension().saved() else {
            // The lifecycle calls a record suspended only with its saved state.
            ctx.report_recorded(pass.res, &rec, PowerState::Stopped);
            return Next::Done;
        };
        ctx.ledger.note_suspended(&rec.spec, &saved);
        match d.power {
            PowerState::Suspended => match s.suspension(&vm_id) {
                Some(SavedGuest::Usable(_)) => {
                    if !rec.lifecycle.last_error().is_empty() {
                        rec.suspended(saved);
                        ctx.save_best_effort(&rec);
                    }
                    ctx.report_recorded(pass.res, &rec, PowerState::Suspended);
                    Next::Done
                }
                Some(SavedGuest::Unusable(why)) => {
                    let next = self.cold_boot(rec, ColdBoot::Unusable, pass);
                    log::warn!("VM {vm_id}: its saved state cannot be restored: {why}");
                    next
                }
                None => self.cold_boot(rec, ColdBoot::Gone, pass),
            },
            PowerState::Running => self.resume(rec, pass),
            PowerState::Stopped => {
                pass.narrator(&rec, PowerState::Suspended, Phase::Ready)
                    .say("stopping: discarding its saved state");
                // The saved state goes first: a suspended record whose state
                // is gone is driven as one that lost it, never restored.
                if let Err(e) = s.discard_suspension(&vm_id, pass.deadline) {
                    // Still suspended, as the record says; the next pass
                    // tries again.
                    let why = chain(&*e);
                    ctx.log_failure(&vm_id, "discarding its saved state failed", &why);
                    pass.res
                        .report(&rec, Some(PowerState::Suspended), Phase::Failed, why);
                    return Next::Done;
                }
                crate::crash::point("stop.snapshot-discarded");
                rec.suspension_discarded();
                ctx.save_best_effort(&rec);
                ctx.ledger.note(&rec.spec);
                log::info!("VM {vm_id}: stopped; its saved state discarded");
                ctx.report_recorded(pass.res, &rec, PowerState::Stopped);
                Next::Done
            }
        }
    }

    /// Suspends a running VM (see the module's steps).
    pub(crate) fn suspend(&self, mut rec: Record, pass: &mut Pass<'_>) -> Next {
        let (ctx, s) = (self.ctx, self.backend);
        let vm_id = rec.spec.vm_id.clone();
        // Whatever saved state is on the host now is stale (a leftover of a
        // discard that failed): a suspend under way finds only its own.
        if let Err(e) = s.discard_suspension(&vm_id, pass.deadline) {
            let why = chain(&*e);
            ctx.log_failure(&vm_id, "suspend failed", &why);
            ctx.report_recorded(pass.res, &rec, PowerState::Running);
            return Next::Done;
        }
        rec.suspend_intended();
        let Some(narrator) = ctx.intend(
            &rec,
            "suspending",
            PowerState::Running,
            crate::crash::at("suspend.intent-saved"),
            pass,
        ) else {
            return Next::Done;
        };
        let say = |what: &str| narrator.say(what);
        let started = Instant::now();
        guests::warn_of_save(&*ctx.backend, &vm_id, pass.deadline);
        let suspended = timed(SUSPEND_STAGE, || s.suspend(&vm_id, pass.deadline, &say));
        match suspended {
            Ok(saved) => {
                ctx.counts.suspends.observe(started.elapsed());
                log::info!(
                    "VM {vm_id}: suspended in {} ms ({} MB saved)",
                    started.elapsed().as_millis(),
                    saved.bytes >> 20
                );
                record_suspended(ctx, &mut rec, saved);
                ctx.forget_logs(&vm_id);
                ctx.report_recorded(pass.res, &rec, PowerState::Suspended);
            }
            Err(e) => suspend_failed(ctx, rec, &*e, pass),
        }
        Next::Done
    }

    /// Resumes a suspended VM from its saved state (see the module's steps).
    fn resume(&self, mut rec: Record, pass: &mut Pass<'_>) -> Next {
        let (ctx, s) = (self.ctx, self.backend);
        let vm_id = rec.spec.vm_id.clone();
        if let Err(why) = ctx.ledger.admit(&rec.spec) {
            let waits_for = format!("for room on this host to resume it: {why}");
            return self.resume_waits(&rec, waits_for, pass);
        }
        match s.suspension(&vm_id) {
            Some(SavedGuest::Usable(_)) => {}
            Some(SavedGuest::Unusable(why)) => {
                log::warn!("VM {vm_id}: its saved state cannot be restored: {why}");
                return self.cold_boot(rec, ColdBoot::Unusable, pass);
            }
            None => return self.cold_boot(rec, ColdBoot::Gone, pass),
        }
        // Asked before the saved guest is spent: a host that cannot take
        // the resume now keeps it waiting, suspended, rather than booting
        // the VM from its disks.
        if let Err(e) = s.resumable(&rec.spec)
            && e.is_host_condition()
        {
            let why = format!("for this host to be able to resume it: {}", chain(&*e));
            return self.resume_waits(&rec, why, pass);
        }
        rec.resume_intended();
        pass.narrator(&rec, PowerState::Suspended, Phase::Ready)
            .say("resuming");
        let started = Instant::now();
        let deadline = pass.deadline;
        let (saved, resumed) = ctx.save_before_spend(&rec, |spend| {
            timed(RESUME_STAGE, || s.resume(&rec.spec, deadline, spend))
        });
        match (saved, resumed) {
            (_, Ok(())) => {
                let ran = Instant::now();
                ctx.counts.resumes.observe(started.elapsed());
                log::info!(
                    "VM {vm_id}: resumed in {} ms",
                    started.elapsed().as_millis()
                );
                self.made_whole(&vm_id, ran, pass);
                self.resumed_now(rec, pass)
            }
            // Its guest never ran (the backend runs it only once the save
            // landed): still suspended, its saved guest whole, tried again
            // next pass.
            (Err(e), Err(_)) => {
                let why = chain(&*e);
                ctx.intent_failed(&rec, "resuming", PowerState::Suspended, &why, pass);
                Next::Done
            }
            (Ok(()), Err(e)) => {
                let why = chain(&*e);
                ctx.log_failure(&vm_id, "resume failed; booting it from its disks", &why);
                self.cold_boot(rec, ColdBoot::Failed, pass)
            }
        }
    }

    /// A resume that cannot start yet: the VM stays suspended, its saved
    /// guest kept, and its row says what it waits `for`.
    fn resume_waits(&self, rec: &Record, waits_for: String, pass: &mut Pass<'_>) -> Next {
        let ctx = self.ctx;
        ctx.report_recorded(pass.res, rec, PowerState::Suspended);
        if let Some(row) = &mut pass.res.row {
            row.status_detail = format!("waiting {waits_for}");
        }
        Next::Done
    }

    /// A suspend or resume cut short with the VMM alive: it is made to
    /// run (whatever was saved is discarded by the backend), then driven
    /// to what is desired.
    fn resume_live(&self, mut rec: Record, pass: &mut Pass<'_>) -> Next {
        let (ctx, s) = (self.ctx, self.backend);
        let vm_id = rec.spec.vm_id.clone();
        if rec.lifecycle.suspension() != lifecycle::Suspension::Resuming {
            rec.resume_intended();
            if !ctx.save_intent(&rec, "resuming", PowerState::Running, pass) {
                return Next::Done;
            }
        }
        // The record says resuming already: nothing is left to wait for.
        match s.resume(&rec.spec, pass.deadline, &|| Ok(())) {
            Ok(()) => {
                log::info!("VM {vm_id}: a suspend or resume cut short is finished: it runs");
                self.made_whole(&vm_id, Instant::now(), pass);
                self.resumed_now(rec, pass)
            }
            Err(e) => {
                let why = chain(&*e);
                ctx.log_failure(&vm_id, "resuming it failed", &why);
                if ctx.backend.running(&vm_id) {
                    // Still there: the next pass tries again.
                    pass.res
                        .report(&rec, Some(PowerState::Running), Phase::Failed, why);
                    Next::Done
                } else {
                    self.cold_boot(rec, ColdBoot::Failed, pass)
                }
            }
        }
    }

    /// The resumed guest made to stop being a copy of its snapshot, by its
    /// guest agent where it has one (see [`guests`]); `ran` is when it
    /// began to run.
    fn made_whole(&self, vm_id: &Id, ran: Instant, pass: &Pass<'_>) {
        let counts = &self.ctx.counts;
        let whole = guests::make_whole(&*self.ctx.backend, vm_id, ran, pass.deadline);
        crate::crash::point("resume.guest-reseeded");
        guests::say(vm_id, &whole);
        match &whole {
            guests::Whole::NoDoor => {}
            guests::Whole::NoAgent => counts.made_whole.inc("no_agent"),
            guests::Whole::Done { after, .. } => {
                counts.made_whole.inc("done");
                counts.guest_after_resume.observe(*after);
            }
            guests::Whole::Failed(_) | guests::Whole::NoEntropy(_) => {
                counts.made_whole.inc("failed");
            }
        }
    }

    /// A guest running again: said (and recorded after) if it is wanted
    /// running, else recorded and driven on to what is wanted now (a suspend
    /// cut short while the wish changed).
    fn resumed_now(&self, mut rec: Record, pass: &mut Pass<'_>) -> Next {
        let (ctx, d) = (self.ctx, self.desired);
        rec.resumed(ctx.host.boot_id());
        ctx.note_address(&mut rec);
        ctx.ledger.note(&rec.spec);
        ctx.forget_logs(&rec.spec.vm_id);
        match d.power {
            PowerState::Running => {
                // Said once the guest runs, before the record follows: a
                // crash before the save finds its VMM alive and finishes.
                ctx.report_recorded(pass.res, &rec, PowerState::Running);
                Next::Announce(rec, Began::Resumed)
            }
            PowerState::Suspended | PowerState::Stopped => {
                ctx.save_best_effort(&rec);
                Next::Drive(rec)
            }
        }
    }

    /// The saved state cannot be continued: discarded, said, counted, and
    /// the VM driven as one that is down (booted from its disks if it is
    /// wanted running or suspended).
    fn cold_boot(&self, mut rec: Record, why: ColdBoot, pass: &mut Pass<'_>) -> Next {
        let (ctx, s, d) = (self.ctx, self.backend, self.desired);
        let vm_id = rec.spec.vm_id.clone();
        let said = why.said();
        log::warn!("VM {vm_id}: {said}; it will be booted from its disks");
        ctx.counts.cold_boots.inc(why.label());
        if let Err(e) = s.discard_suspension(&vm_id, pass.deadline) {
            log::warn!("VM {vm_id}: cannot discard its saved state: {}", chain(&*e));
        }
        rec.suspension_lost();
        ctx.save_best_effort(&rec);
        ctx.ledger.note(&rec.spec);
        if d.power != PowerState::Stopped {
            pass.narrator(&rec, PowerState::Stopped, Phase::Ready)
                .say(&format!("booting it from its disks: {said}"));
        }
        Next::Drive(rec)
    }
}

/// A suspend that failed (or could not be tried): recorded with why, the
/// VM reported as it is.
fn suspend_failed(
    ctx: &Context,
    mut rec: Record,
    e: &dyn crate::error::Failure,
    pass: &mut Pass<'_>,
) {
    let vm_id = rec.spec.vm_id.clone();
    let why = chain(e);
    ctx.log_failure(&vm_id, "suspend failed", &why);
    rec.suspend_failed(why);
    ctx.save_best_effort(&rec);
    let power = PowerState::observed(ctx.backend.running(&vm_id));
    ctx.report_recorded(pass.res, &rec, power);
}

/// A suspend asked of a backend that cannot suspend: it fails for good,
/// recorded and said, and the VM runs on.
pub(crate) fn cannot(ctx: &Context, rec: Record, pass: &mut Pass<'_>) -> Next {
    let refused = Simple::permanent(format!(
        "VM {}: this host's hypervisor backend cannot suspend a VM",
        rec.spec.vm_id
    ));
    suspend_failed(ctx, rec, &refused, pass);
    Next::Done
}

/// A record in the middle of a suspension on a backend that cannot
/// suspend: no saved guest of it can be on this host, so it is taken as
/// gone, counted, and the VM driven as one that is down.
pub(crate) fn cannot_continue(ctx: &Context, mut rec: Record) -> Next {
    let why = ColdBoot::Gone;
    log::warn!(
        "VM {}: {}; it will be booted from its disks",
        rec.spec.vm_id,
        why.said()
    );
    ctx.counts.cold_boots.inc(why.label());
    rec.suspension_lost();
    ctx.save_best_effort(&rec);
    ctx.ledger.note(&rec.spec);
    Next::Drive(rec)
}

fn record_suspended(ctx: &Context, rec: &mut Record, saved: Saved) {
    rec.suspended(saved);
    ctx.save_best_effort(rec);
    ctx.ledger.note_suspended(&rec.spec, &saved);
}
