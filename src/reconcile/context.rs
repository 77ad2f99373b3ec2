//! What every step of every pass shares, and the protocol each of them
//! follows before a side effect.
//!
//! The context holds only what no one verb or concern owns: the record
//! store, the backend, the host's facts, the engine's configuration, the
//! compute ledger, the log memory and the counters. A verb's own state
//! (the creates' slots, the probes' answers, the sleepers) lives with the
//! verb or concern, in its own file, never here.
//!
//! The intent protocol, in its three forms. Each exists because a crash
//! may land between any two instructions, and the next agent must read
//! what was under way from the record alone:
//! 1. **Intend, then act** ([`Context::intend`]): the intent is saved,
//!    the crash point marks the moment, and only then is the side effect
//!    made and narrated. A stop, a suspend: a crash after the save reads
//!    as that intent, never as a guest that crashed.
//! 2. **Saved beside a reservation** ([`Context::save_beside`]): a
//!    create's counted attempt is saved while the backend takes its
//!    bookkeeping (the VM's address, its VMM's id). Two durable writes at
//!    once wait for one journal commit; the reservation touches neither
//!    guest nor device, so it is no side effect the count must precede.
//! 3. **Saved before the spend** ([`Context::save_before_spend`]): a
//!    resume's intent is saved while the backend restores the guest, held
//!    paused. The restore spends nothing; running the guest does, so it
//!    waits for the save to land, and a save that fails undoes the
//!    restore with the saved guest kept whole.

use std::sync::Arc;
use std::time::Duration;

use super::EngineConfig;
use super::admission::Ledger;
use super::counts::Counts;
use super::lifecycle::{self, Budget};
use super::pass::{Narrator, Pass, VmResult, quarantined_entry};
use super::seams::HostFacts;
use crate::error::{BoxFailure, Outcome, Simple, chain};
use crate::logonce::LogOnce;
use crate::model::{Id, Phase, PowerState};
use crate::provision::Lifecycle;
use crate::state::{Record, RecordSlot, Store, Unsynced};

/// What every pass shares. Owned by the engine, and by each worker
/// through the engine's [`Spine`](super::step::Spine).
pub(crate) struct Context {
    pub store: Arc<Store>,
    pub backend: Arc<dyn Lifecycle>,
    pub host: Arc<dyn HostFacts>,
    pub config: EngineConfig,
    pub ledger: Ledger,
    /// Per-VM log memory (subjects `<vm_id>/<what>`): a VM failing the same
    /// way every pass is one line, not one a tick.
    pub logs: LogOnce,
    pub counts: Counts,
}

impl Context {
    /// How creates are paced.
    pub(crate) fn budget(&self) -> Budget {
        Budget {
            max_attempts: self.config.max_create_attempts,
            rearm: self.config.create_rearm,
        }
    }

    /// Sets `res` to what the record says: its quarantined entry, or its
    /// row with the lifecycle's phase, its error and how long a create waits
    /// (the same derivation for every report, made with a pass or without).
    pub(crate) fn report_recorded(&self, res: &mut VmResult, rec: &Record, power: PowerState) {
        let budget = self.budget();
        match lifecycle::phase(rec, budget) {
            None => res.quarantined = Some(quarantined_entry(rec, self.grace_for(rec))),
            Some(phase) => {
                res.report(
                    rec,
                    Some(power),
                    phase,
                    rec.lifecycle.last_error().to_owned(),
                );
                // Only a create waits for anything the row should time.
                if rec.lifecycle.boot_id().is_empty()
                    && let Some(row) = &mut res.row
                {
                    row.status_detail = lifecycle::detail(rec, budget, self.host.now());
                }
            }
        }
    }

    /// What the host has for a VM, from its record and the backend's
    /// liveness, changing nothing: its quarantined entry, or its row.
    pub(crate) fn observed(&self, vm_id: &Id, slot: &RecordSlot) -> VmResult {
        let rec = match slot {
            RecordSlot::Readable(rec) => rec,
            RecordSlot::Unreadable(problem) => {
                return VmResult::failed_unobserved(vm_id, format!("record unreadable: {problem}"));
            }
        };
        let mut res = VmResult {
            host_pubkey: rec.host_pubkey.clone(),
            ..VmResult::default()
        };
        let power = if rec.lifecycle.quarantined_at().is_some() {
            PowerState::Stopped
        } else if rec.lifecycle.suspension().saved().is_some() {
            PowerState::Suspended
        } else {
            PowerState::observed(self.backend.running(vm_id))
        };
        self.report_recorded(&mut res, rec, power);
        res
    }

    /// How long a quarantined VM is kept before it is destroyed.
    pub(crate) fn grace_for(&self, rec: &Record) -> Duration {
        if rec.lifecycle.quarantine_tombstoned() {
            self.config.tombstone_grace
        } else {
            self.config.vanish_grace
        }
    }

    /// Logs a VM's failure once per change (see [`LogOnce`]).
    pub(crate) fn log_failure(&self, vm_id: &Id, what: &str, error: &str) {
        self.logs.warn(
            &format!("{vm_id}/{what}"),
            &format!("VM {vm_id}: {what}: {error}"),
        );
    }

    /// Forgets what was logged about a VM: it recovered, or is gone, so the
    /// same failure later is news again.
    pub(crate) fn forget_logs(&self, vm_id: &Id) {
        self.logs.clear_prefix(&format!("{vm_id}/"));
    }

    /// Folds the backend's current answers for the VM's addresses into
    /// `rec`, reporting whether either changed. Polled, not returned by boot:
    /// the second NIC's address is granted by someone else's DHCP server and
    /// arrives after boot.
    pub(crate) fn note_address(&self, rec: &mut Record) -> bool {
        let mut changed = false;
        let vm_id = &rec.spec.vm_id;
        if let Some(ip) = self.backend.address(vm_id).map(|ip| ip.to_string())
            && ip != rec.ip
        {
            rec.ip = ip;
            changed = true;
        }
        if let Some(ip) = self.backend.network_address(vm_id).map(|ip| ip.to_string())
            && ip != rec.network_ip
        {
            rec.network_ip = ip;
            changed = true;
        }
        changed
    }

    /// Form 1 of the protocol: the intent `rec` now holds is saved before
    /// its side effect (see [`Context::save_intent`]), the crash point
    /// `saved` marks the moment, and the row's narrator, as `rec` at
    /// `power`, is handed back to tell what is under way. `None` when the
    /// intent could not be saved: nothing is to be done.
    pub(crate) fn intend(
        &self,
        rec: &Record,
        doing: &str,
        power: PowerState,
        saved: crate::crash::Point,
        pass: &mut Pass<'_>,
    ) -> Option<Narrator> {
        if !self.save_intent(rec, doing, power, pass) {
            return None;
        }
        saved.hit();
        Some(pass.narrator(rec, power, Phase::Ready))
    }

    /// Saves the intent `rec` now holds, before its side effect (a crash
    /// after reads as that intent, never as a crash of the guest). If it
    /// cannot be saved nothing is done: the failure is logged (once per
    /// change) as not `doing` it, the row says so with `power` (the record
    /// is unchanged, and this error cannot be saved either), and false is
    /// returned.
    pub(crate) fn save_intent(
        &self,
        rec: &Record,
        doing: &str,
        power: PowerState,
        pass: &mut Pass<'_>,
    ) -> bool {
        let Err(e) = self.store.save(rec) else {
            return true;
        };
        self.intent_failed(rec, doing, power, &chain(&e), pass);
        false
    }

    /// An intent that could not be saved, `why`: nothing was done. Logged
    /// once per change as not `doing` it; the row says so with `power`.
    pub(crate) fn intent_failed(
        &self,
        rec: &Record,
        doing: &str,
        power: PowerState,
        why: &str,
        pass: &mut Pass<'_>,
    ) {
        let vm_id = &rec.spec.vm_id;
        self.logs.error(
            &format!("{vm_id}/{doing}"),
            &format!("VM {vm_id}: not {doing} it: {why}"),
        );
        pass.res.report(rec, Some(power), Phase::Failed, why);
    }

    /// Form 2 of the protocol: `rec` saved (its bytes durable and its name
    /// in place: [`Store::save_visible`]) while `beside`, which is
    /// `doing` something, runs on a thread of its own, named `thread`. The
    /// save's result, then `beside`'s (a panic in it is its error, never
    /// the daemon's).
    pub(crate) fn save_beside<T: Send>(
        &self,
        rec: &Record,
        (thread, doing): (&str, &str),
        beside: impl FnOnce() -> Outcome<T> + Send,
    ) -> (Outcome<Unsynced>, Outcome<T>) {
        let (done, saved) =
            crate::threads::alongside(thread, beside, || self.store.save_visible(rec));
        let done = done
            .map_err(|why| panicked(doing, why))
            .and_then(|done| done);
        (saved.map_err(BoxFailure::from), done)
    }

    /// Form 3 of the protocol: `rec` saved on a thread of its own while
    /// `restore` runs here; `restore` is handed the gate it asks right
    /// before its guest would run, which waits for the save to land and
    /// refuses when it did not (the guest then never runs). The save's
    /// result, then the restore's.
    pub(crate) fn save_before_spend(
        &self,
        rec: &Record,
        restore: impl FnOnce(crate::provision::Spend<'_>) -> Outcome,
    ) -> (Outcome, Outcome) {
        let vm_id = &rec.spec.vm_id;
        let (landed, landing) = crossbeam_channel::bounded(1);
        // Moved in, so a second ask finds the channel closed and refuses.
        let save = move || {
            let saved = self.store.save(rec);
            let _ = landed.send(saved.as_ref().map(|_| ()).map_err(|e| chain(e)));
            saved
        };
        let spend = || -> Outcome {
            let landed = crate::stages::timed("record wait", || landing.recv());
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
        let (saved, restored) =
            crate::threads::alongside(&format!("intent-{vm_id}"), save, || restore(&spend));
        let saved = saved
            .map_err(|why| panicked("saving its resume's record", why))
            .and_then(|saved| saved.map_err(BoxFailure::from));
        (saved, restored)
    }

    /// Saves a record whose save failing changes nothing this pass decides.
    /// The failure is logged, and the next pass writes the record again.
    pub(crate) fn save_best_effort(&self, rec: &Record) {
        let vm_id = &rec.spec.vm_id;
        if let Err(e) = self.store.save(rec) {
            self.logs.error(
                &format!("{vm_id}/save"),
                &format!("VM {vm_id}: {}", chain(&e)),
            );
        }
    }
}

/// The error of a step run beside another that panicked: one attempt
/// (or one resume) spent, the daemon untouched.
pub(crate) fn panicked(what: &str, why: crate::threads::Panicked) -> BoxFailure {
    Simple::transient(format!("{what} panicked: {why}")).into()
}
