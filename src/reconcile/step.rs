//! The spine of a pass: one VM's whole pass as numbered steps, and the one
//! match on its lifecycle state that says which verb drives it.
//!
//! A pass of a VM in desired state, in order:
//! 1. **Holds before.** Its egress rules are recorded (before they are
//!    held: an agent's start holds the recorded ones again), then held.
//! 2. **Sleep rules.** What the VM is driven to, its sleep taken into
//!    account (`sleepers`): asleep, woken, or as its entry says.
//! 3. **Fenced or not.** Egress rules this host cannot hold keep a VM that
//!    does not run from starting; its row says why, and the pass ends.
//! 4. **Dispatch.** The lifecycle: the record's state picks the verb
//!    ([`Spine::dispatch`]), and each verb returns what should happen next
//!    ([`Next`]) instead of calling another; the loop ends at
//!    [`Next::Done`], within [`MAX_STEPS`].
//! 5. **After sleep.** A VM that sleeps now listens for its first frame;
//!    one a frame woke says how soon it ran.
//! 6. **Holds published.** Its published ports held as its entry says,
//!    once it has a record.
//! 7. **Probes after.** Its readiness probe asked, when one is due; a
//!    guest failing past its `restart_after` is booted again. A running
//!    template, ready, has its guest saved for its clones (`templates`;
//!    a guest such a save left paused is resumed at step 1).
//! 8. **Say.** Its row says what it is held to, what is served, and what
//!    is published.
//!
//! A VM gone from desired state (vanished or tombstoned) takes step 4
//! alone: its record's state picks a reap verb the same way.
//!
//! What a pass shares with every other is the [`Context`]; what a verb or
//! concern keeps across passes is its own (the creates, the probes, the
//! sleepers), owned here, side by side, and handed to the steps that use
//! it. Verbs never import one another; only this file knows them all.

use std::sync::Arc;

use super::context::Context;
use super::create::Create;
use super::holds::{self, Holding};
use super::lifecycle::{self, State};
use super::panics::Panics;
use super::pass::{
    Assignment, Began, CREATE_STAGE, Next, Pass, PassOutcome, Publisher, RESUME_STAGE,
    SUSPEND_STAGE, VmResult,
};
use super::probes::Probes;
use super::sleepers::Sleepers;
use super::suspension::{self, Suspension};
use super::templates::Templates;
use super::{converge, reap};
use crate::deadline::Deadline;
use crate::model::{DesiredVm, Id, PowerState};
use crate::stages::Stages;
use crate::state::Record;

/// The most steps one pass's lifecycle may take. The longest chain a
/// record can make is a VM back from quarantine whose resume fails and
/// is booted from its disks, then suspended: five.
const MAX_STEPS: usize = 8;

/// What the desired state wants of the VM this pass.
#[derive(Clone, Copy)]
enum Wanted<'a> {
    Vm(&'a DesiredVm),
    /// Gone from desired state: reaped.
    Gone {
        tombstoned: bool,
    },
}

/// Told the stages of every timed pass (see
/// [`Engine::watch_stages`](super::Engine::watch_stages)).
pub type StageWatch = Arc<dyn Fn(&Id, &Stages) + Send + Sync>;

/// Every pass's parts: the shared context, and each verb's and concern's
/// own state. Owned by the engine and each worker through an `Arc`.
pub(crate) struct Spine {
    pub ctx: Context,
    pub create: Create,
    pub probes: Probes,
    pub panics: Panics,
    pub sleepers: Sleepers,
    pub templates: Templates,
    pub watch: parking_lot::RwLock<Option<StageWatch>>,
}

impl Spine {
    /// One pass of `vm_id` for `assignment`: its record loaded (a record
    /// that cannot be read skips the pass), then the steps of the module's
    /// header. Never inlined: its frames are the worker's to give back
    /// between passes (see `StackTrim`), not part of the worker's loop.
    #[inline(never)]
    pub(crate) fn run(
        &self,
        vm_id: &Id,
        assignment: &Assignment,
        publisher: Option<&Publisher>,
    ) -> PassOutcome {
        let deadline = Deadline::from_timeout(self.ctx.config.vm_timeout);
        let rec = match self.ctx.store.get(vm_id) {
            Ok(rec) => rec,
            Err(e) => {
                // While this lasts the VM's row is frozen, so the log is the
                // operator's signal; the worker logs it once per change.
                let why = crate::error::chain(&e);
                return PassOutcome::Skipped {
                    fallback: VmResult::failed_unobserved(vm_id, why.clone()),
                    why,
                };
            }
        };
        let mut res = VmResult {
            host_pubkey: rec
                .as_ref()
                .map(|r| r.host_pubkey.clone())
                .unwrap_or_default(),
            ..VmResult::default()
        };
        let template_wanted = matches!(
            assignment,
            Assignment::Desired {
                template_wanted: true,
                ..
            }
        );
        let mut pass = Pass {
            deadline,
            res: &mut res,
            publisher,
            template_wanted,
        };
        let rec = rec.map(|r| (*r).clone());
        match (assignment, rec) {
            (Assignment::Desired { vm, .. }, rec) => self.drive(vm, rec, &mut pass),
            (Assignment::Reap { tombstoned }, Some(rec)) => {
                let gone = Wanted::Gone {
                    tombstoned: *tombstoned,
                };
                self.lifecycle(gone, Next::Drive(rec), &mut pass);
            }
            (Assignment::Reap { .. }, None) => {}
        }
        PassOutcome::Done(res)
    }

    /// Steps 1 to 8 for a VM in desired state.
    fn drive(&self, desired: &DesiredVm, rec: Option<Record>, pass: &mut Pass<'_>) {
        let ctx = &self.ctx;
        let vm_id = &desired.spec.vm_id;
        let holding = Holding::of(ctx);
        // 1. (recorded), and a guest a template's save left paused resumed.
        let rec = rec.map(|rec| holds::note_egress(ctx, desired, rec));
        let mut rec = self.templates.unpause_left(ctx, rec, pass.deadline);
        // 2.
        let answered = self.probes.answered(desired);
        let wanted = self
            .sleepers
            .rules(ctx, desired, rec.as_mut(), answered, pass);
        // 1. (held) and 3.
        let held = holding.set_egress(vm_id, &desired.egress);
        if let Err(e) = &held
            && e.is_host_condition()
            && !ctx.backend.running(vm_id)
        {
            return holds::refuse_unfenced(ctx, vm_id, &**e, rec.as_ref(), pass.res);
        }
        // 4.
        let first = match rec {
            Some(rec) => Next::Drive(rec),
            None => self.create.run(ctx, &wanted, None, pass),
        };
        self.lifecycle(Wanted::Vm(&wanted), first, pass);
        // 5. and 6. read the record as the lifecycle left it.
        let saved = ctx.store.get(vm_id).ok().flatten();
        let state = saved.as_ref().map(|r| lifecycle::state(r, ctx.budget()));
        self.sleepers
            .after(ctx, desired, saved.as_deref(), state, answered, pass);
        // 6.
        let published = holding.publish(desired, saved.as_deref());
        // 7. (A VM with no record has nothing to boot again.) What its
        // guest answers a probe over the network is not its own traffic.
        let own = desired
            .readiness
            .as_ref()
            .is_some_and(|r| r.check.is_network())
            .then(|| self.sleepers.own_exchange(vm_id));
        let restart = self
            .probes
            .probe(ctx, pass.deadline, desired, saved.as_deref(), pass.res);
        drop(own);
        let restart = restart.or_else(|| self.panics.look(ctx, desired, pass.res));
        // 7. (templates) A running template, ready, saved: not in a pass
        // that boots it again.
        match restart {
            Some(why) => converge::restart(ctx, desired, &why, pass),
            None => self.templates.keep(ctx, desired, pass),
        }
        // 8.
        holding.say_unserved(vm_id, pass.res);
        let answering = self.probes.answering(vm_id);
        holding.say_what_it_is_held_to(desired, held, answering, pass.res);
        holding.say_published(vm_id, published, pass.res);
    }

    /// Step 4: the verbs, one after the other as each says, from `first`.
    fn lifecycle(&self, wanted: Wanted<'_>, first: Next, pass: &mut Pass<'_>) {
        let ctx = &self.ctx;
        let mut next = first;
        for _ in 0..MAX_STEPS {
            next = match next {
                Next::Done => return,
                Next::Drive(rec) => self.dispatch(wanted, rec, pass),
                Next::Suspend(rec) => match self.suspension(wanted) {
                    Some(verb) => verb.suspend(rec, pass),
                    None => suspension::cannot(ctx, rec, pass),
                },
                Next::Announce(rec, began) => self.announce(wanted, rec, began, pass),
                Next::Destroyed(vm_id) => {
                    self.probes.forget(&vm_id);
                    self.panics.forget(&vm_id);
                    self.sleepers.forget(&vm_id);
                    self.create.forget(&vm_id);
                    self.templates.forget(&vm_id);
                    Next::Done
                }
            };
        }
        if !matches!(next, Next::Done) {
            log::error!("a VM's pass did not settle in {MAX_STEPS} steps; its next pass goes on");
        }
    }

    /// The one match on the lifecycle state: which verb drives the record
    /// now, for what is wanted of it.
    fn dispatch(&self, wanted: Wanted<'_>, rec: Record, pass: &mut Pass<'_>) -> Next {
        let ctx = &self.ctx;
        let suspension = self.suspension(wanted);
        match (wanted, lifecycle::state(&rec, ctx.budget()), suspension) {
            (Wanted::Gone { tombstoned }, State::Quarantined { tombstoned: was }, _) => {
                reap::when_due(ctx, rec, tombstoned && !was, pass)
            }
            (Wanted::Gone { tombstoned }, _, _) => reap::quarantine(ctx, rec, tombstoned, pass),
            (Wanted::Vm(_), State::Quarantined { .. }, _) => reap::bring_back(ctx, rec),
            (Wanted::Vm(d), State::Creating(_), _) => self.create.run(ctx, d, Some(&rec), pass),
            (Wanted::Vm(d), State::Up, _) => converge::run(ctx, d, rec, true, pass),
            (Wanted::Vm(d), State::Down, _) => converge::run(ctx, d, rec, false, pass),
            // This backend cannot suspend, yet the record says a suspend
            // or resume was made: its saved guest is none it can find.
            (Wanted::Vm(_), State::Suspending | State::Suspended | State::Resuming, None) => {
                suspension::cannot_continue(ctx, rec)
            }
            (Wanted::Vm(_), State::Suspending, Some(verb)) => verb.finish_suspend(rec, pass),
            (Wanted::Vm(_), State::Suspended, Some(verb)) => verb.suspended(rec, pass),
            (Wanted::Vm(_), State::Resuming, Some(verb)) => verb.finish_resume(rec, pass),
        }
    }

    /// The suspension verb for a VM wanted in desired state, with the
    /// backend's [`Suspend`](crate::provision::Suspend), asked for here
    /// only; `None` when this backend cannot suspend.
    fn suspension<'a>(&'a self, wanted: Wanted<'a>) -> Option<Suspension<'a>> {
        let Wanted::Vm(desired) = wanted else {
            return None;
        };
        let ctx = &self.ctx;
        ctx.backend.suspender().map(|backend| Suspension {
            ctx,
            backend,
            desired,
        })
    }

    /// [`Next::Announce`]: the row published as the pass will end it (with
    /// a probe in its spec it is not ready before its guest answers, a
    /// resumed guest's agent asked first, and what it is held to is in
    /// it), then the record saved, then a create's crash point; a VM
    /// wanted suspended is suspended next.
    fn announce(&self, wanted: Wanted<'_>, rec: Record, began: Began, pass: &mut Pass<'_>) -> Next {
        let ctx = &self.ctx;
        let Wanted::Vm(desired) = wanted else {
            ctx.save_best_effort(&rec);
            return Next::Done;
        };
        if let Some(publisher) = pass.publisher.filter(|_| !pass.deadline.expired()) {
            let mut said = pass.res.clone();
            let booted = rec.lifecycle.boot_started();
            self.probes
                .before_first_look(ctx, desired, (booted, began), pass.deadline, &mut said);
            let answering = self.probes.answering(&desired.spec.vm_id);
            Holding::of(ctx).say_what_it_is_held_to(desired, Ok(()), answering, &mut said);
            publisher.publish(said);
        }
        ctx.save_best_effort(&rec);
        if let Began::Created(point) = began {
            point.hit();
        }
        ctx.forget_logs(&rec.spec.vm_id);
        match desired.power {
            PowerState::Suspended => Next::Suspend(rec),
            PowerState::Running | PowerState::Stopped => Next::Done,
        }
    }

    /// After each pass: a pass that made a create attempt (or a suspend,
    /// a resume) logs how long it took, and at debug where the time went,
    /// and tells the watcher.
    pub(crate) fn timed(&self, vm_id: &Id, stages: Stages) {
        let Some(what) = [
            (CREATE_STAGE, "create attempt"),
            (SUSPEND_STAGE, "suspend"),
            (RESUME_STAGE, "resume"),
        ]
        .into_iter()
        .find(|(stage, _)| stages.marks.iter().any(|m| m.stage == *stage))
        .map(|(_, what)| what) else {
            return;
        };
        let total = stages.total.as_secs_f64() * 1e3;
        if what == "create attempt" {
            log::info!("VM {vm_id}: {what} took {total:.1} ms");
        } else {
            // A suspend and a resume say their own time ("suspended in
            // 309 ms"): this one, the whole pass with its records' saves,
            // beside it read as a second figure for the same thing.
            log::debug!("VM {vm_id}: the {what}'s whole pass took {total:.1} ms");
        }
        log::debug!("VM {vm_id}: {what} stages: {stages}");
        if let Some(watch) = self.watch.read().as_ref() {
            watch(vm_id, &stages);
        }
    }
}
