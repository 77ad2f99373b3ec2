//! Pokes: a VMM that exited on its own runs its VM's pass at once, without
//! a step (see the protocol in [`super`], step 6).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Sender;
use parking_lot::Mutex;

use super::POKE_SPACING;
use super::shared::WorkerShared;
use super::thread::WorkerHandle;
use crate::model::Id;

/// Every live worker's shared half and doorbell, by VM: what a poke needs.
/// Kept apart from the worker table, under a lock held only for a lookup,
/// so a poke (from a reaper thread) never waits on a step, nor on a
/// shutdown that holds the table while passes finish.
#[derive(Default)]
pub(crate) struct Pokes(Mutex<HashMap<Id, Pokeable>>);

/// What a poke of one VM needs: its worker's shared half and doorbell.
#[derive(Clone)]
struct Pokeable {
    shared: Arc<WorkerShared>,
    doorbell: Sender<()>,
}

impl Pokes {
    /// Runs a pass for `vm_id` at once, on its newest assignment (see the
    /// module's step 6). Returns whether a pass was asked for: a VM with no
    /// worker, or whose worker never got an assignment, has nothing to run.
    pub(crate) fn poke(&self, vm_id: &Id) -> bool {
        self.ring(vm_id, true)
    }

    /// As [`Pokes::poke`], without its spacing: traffic for a sleeping VM,
    /// or its NICs quiet for its idle time. Each is bounded by its own rule
    /// (a wake is one per sleep; an idle VM is told once per quiet spell).
    pub(crate) fn wake(&self, vm_id: &Id) -> bool {
        self.ring(vm_id, false)
    }

    fn ring(&self, vm_id: &Id, spaced: bool) -> bool {
        let Some(Pokeable { shared, doorbell }) = self.0.lock().get(vm_id).cloned() else {
            return false;
        };
        if spaced {
            let mut poked = shared.poked.lock();
            if poked.is_some_and(|at| at.elapsed() < POKE_SPACING) {
                log::debug!("VM {vm_id}: poked again within {POKE_SPACING:?}; left to the tick");
                return false;
            }
            *poked = Some(Instant::now());
        }
        if !shared.mailbox.lock().again(Instant::now()) {
            return false;
        }
        // Full: a pass is already due, and it takes the mailbox.
        let _ = doorbell.try_send(());
        true
    }

    pub(super) fn insert(&self, vm_id: &Id, handle: &WorkerHandle) {
        let pokeable = Pokeable {
            shared: Arc::clone(&handle.shared),
            doorbell: handle.doorbell.clone(),
        };
        self.0.lock().insert(vm_id.clone(), pokeable);
    }

    pub(super) fn remove(&self, vm_id: &Id) {
        self.0.lock().remove(vm_id);
    }

    pub(super) fn clear(&self) {
        self.0.lock().clear();
    }
}
