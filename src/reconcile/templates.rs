//! Running templates: a VM wanted running and marked a template has its
//! guest saved (paused, saved, resumed: [`Suspend::save_template`]) once
//! its row is ready, and clones are made from that save while it runs
//! on. It is saved once; a VM that is no longer a running template has
//! its save removed (a suspended template's clones are made from its
//! suspension instead).
//!
//! The save's intent is recorded first (`Record::templating`): a crash
//! while its guest is paused leaves a VMM whose guest does not run, and
//! the VM's next pass resumes it before anything else looks at it. A save
//! that failed is tried again after [`RETRY_AFTER`], not at every pass:
//! each try pauses the guest.
//!
//! [`Suspend::save_template`]: crate::provision::Suspend::save_template

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::context::Context;
use super::pass::Pass;
use crate::deadline::Deadline;
use crate::error::chain;
use crate::model::{DesiredVm, Id, Phase, PowerState};
use crate::provision::SavedGuest;
use crate::state::Record;

/// How long after a failed save the next is tried.
const RETRY_AFTER: Duration = Duration::from_secs(60);

/// What the running templates keep across passes: when each last failed
/// to be saved, and the VMs known to hold no save (looked at once in this
/// agent's life, or emptied since), whose passes need not look again.
#[derive(Default)]
pub(crate) struct Templates {
    failed: Mutex<HashMap<Id, Instant>>,
    unsaved: Mutex<HashSet<Id>>,
}

impl Templates {
    /// Forgets a destroyed VM.
    pub(super) fn forget(&self, vm_id: &Id) {
        self.failed.lock().remove(vm_id);
        self.unsaved.lock().remove(vm_id);
    }

    /// A guest left paused by a save cut short (its record says one was
    /// under way) resumed: `rec` as it is then.
    pub(super) fn unpause_left(
        &self,
        ctx: &Context,
        rec: Option<Record>,
        deadline: Deadline,
    ) -> Option<Record> {
        let mut rec = rec?;
        if !rec.templating {
            return Some(rec);
        }
        let vm_id = rec.spec.vm_id.clone();
        let Some(suspender) = ctx.backend.suspender() else {
            return Some(rec);
        };
        match suspender.unpause(&vm_id, deadline) {
            Ok(()) => {
                rec.templating = false;
                ctx.save_best_effort(&rec);
            }
            Err(e) => ctx.log_failure(
                &vm_id,
                "its guest, left paused, cannot be resumed",
                &chain(&*e),
            ),
        }
        Some(rec)
    }

    /// Saves `d`'s guest as its template where it is a running template,
    /// ready, with no usable save yet; removes its save where it is no
    /// longer one.
    pub(super) fn keep(&self, ctx: &Context, d: &DesiredVm, pass: &Pass<'_>) {
        let vm_id = &d.spec.vm_id;
        let Some(suspender) = ctx.backend.suspender() else {
            return;
        };
        if !(d.template && d.power == PowerState::Running) {
            self.failed.lock().remove(vm_id);
            if self.unsaved.lock().contains(vm_id) {
                return;
            }
            // Removed whole or not, once in this agent's life: a save cut
            // short by a crash after its disk copy and before its commit
            // leaves the copy and no saved template that names it.
            let saved = suspender.template_saved(vm_id).is_some();
            if let Err(e) = suspender.discard_template(vm_id) {
                ctx.log_failure(vm_id, "its saved template cannot be removed", &chain(&*e));
                return;
            }
            if saved {
                log::info!("VM {vm_id}: no longer a running template: its saved template removed");
            }
            self.unsaved.lock().insert(vm_id.clone());
            return;
        }
        self.unsaved.lock().remove(vm_id);
        let ready = pass
            .res
            .row
            .as_ref()
            .is_some_and(|row| row.phase == Some(Phase::Ready));
        if !ready || !ctx.backend.running(vm_id) {
            return;
        }
        if let Some(SavedGuest::Usable(_)) = suspender.template_saved(vm_id) {
            return;
        }
        if self
            .failed
            .lock()
            .get(vm_id)
            .is_some_and(|at| at.elapsed() < RETRY_AFTER)
        {
            return;
        }
        // Read now: this pass's steps before may have saved it since.
        let Ok(Some(rec)) = ctx.store.get(vm_id) else {
            return;
        };
        let mut rec = (*rec).clone();
        rec.templating = true;
        if let Err(e) = ctx.store.save(&rec) {
            ctx.log_failure(vm_id, "its template's save cannot be recorded", &chain(&e));
            return;
        }
        crate::crash::point("template.intent-saved");
        super::guests::warn_of_save(&*ctx.backend, vm_id, pass.deadline);
        match suspender.save_template(vm_id, pass.deadline) {
            Ok(paused) => {
                self.failed.lock().remove(vm_id);
                log::info!(
                    "VM {vm_id}: saved as a template: its guest paused {:.1} ms",
                    paused.as_secs_f64() * 1000.0
                );
                // It runs on: told so, as after any resume, its guest
                // agent turns back on what it quieted for the save.
                let whole =
                    super::guests::make_whole(&*ctx.backend, vm_id, Instant::now(), pass.deadline);
                super::guests::say(vm_id, &whole);
            }
            Err(e) => {
                self.failed.lock().insert(vm_id.clone(), Instant::now());
                ctx.log_failure(
                    vm_id,
                    "its template could not be saved (tried again in a minute)",
                    &chain(&*e),
                );
            }
        }
        rec.templating = false;
        ctx.save_best_effort(&rec);
    }
}
