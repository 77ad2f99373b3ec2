//! The suspend capability of a backend: its guest saved and restored,
//! and a template's guest saved for clones.

use crate::deadline::Deadline;
use crate::error::Outcome;
use crate::model::{Id, Saved, VmSpec};

use super::{SavedGuest, Say, Spend};

/// Suspending a VM to its saved state and resuming it: a capability of
/// some backends (see [`Lifecycle::suspender`](super::Lifecycle::suspender)).
pub trait Suspend: Send + Sync {
    /// Suspends a running VM: its guest paused, its state saved and
    /// committed where [`Suspend::resume`] finds it, and (for a backend
    /// that saves to disk) its VMM stopped. `say` is told each stage. Only a
    /// committed save is `Ok`; on an error the VM is left running where the
    /// backend can. Idempotent: a suspend cut short is done again from the
    /// start.
    fn suspend(&self, vm_id: &Id, deadline: Deadline, say: Say<'_>) -> Outcome<Saved>;

    /// Resumes a suspended VM where it left off: a live VMM of it (a
    /// suspend or resume cut short) is made to run, else its saved state is
    /// restored into a new VMM, on its own taps, in its own jail. `spend`
    /// is asked once, before the guest runs and after all a restore does
    /// that can be undone; when it refuses, the guest does not run, a VMM
    /// this call started is ended, and the saved state stays whole. Once
    /// the guest runs its saved state is discarded: it is stale from then
    /// on. The engine never asks twice for one saved state (see the
    /// lifecycle's rules).
    fn resume(&self, spec: &VmSpec, deadline: Deadline, spend: Spend<'_>) -> Outcome;

    /// Whether this host can take the VM's resume now, asked before its
    /// saved guest is spent: what the host lacks (a device, the
    /// hypervisor, room in a pool) is a host condition, and the saved
    /// guest waits for it, where a resume that failed would boot the VM
    /// from its disks. Cheap: asked before each resume, a wake's too.
    fn resumable(&self, spec: &VmSpec) -> Outcome;

    /// What holds the VM's suspended guest on this host now, as found (a
    /// committed save, checked against the disks it was taken with);
    /// `None` when nothing does.
    fn suspension(&self, vm_id: &Id) -> Option<SavedGuest>;

    /// Removes whatever holds the VM's suspended guest; nothing there is
    /// success.
    fn discard_suspension(&self, vm_id: &Id, deadline: Deadline) -> Outcome;

    /// Makes the new VM `spec`, a clone of `template` (suspended, or
    /// running and saved by [`Suspend::save_template`]), a root disk and a
    /// saved guest of its own: copies of the template's as it was saved,
    /// for [`Suspend::resume`] to start. The template's files are only
    /// read, and a template saved again while they were copied refuses
    /// the copy. How they were copied.
    fn clone_saved(
        &self,
        _template: &Id,
        spec: &VmSpec,
        _deadline: Deadline,
    ) -> Outcome<crate::disk::Method> {
        Err(crate::error::Simple::permanent(format!(
            "VM {}: this backend cannot clone a VM (it keeps a suspended guest in memory, not on disk)",
            spec.vm_id
        ))
        .into())
    }

    /// Saves a running VM's guest as a template without stopping it: its
    /// guest paused, its memory and a copy of its root disk committed
    /// where [`Suspend::clone_saved`] finds them, and resumed (an error
    /// resumes it too). How long its guest was paused.
    fn save_template(&self, vm_id: &Id, _deadline: Deadline) -> Outcome<std::time::Duration> {
        Err(crate::error::Simple::permanent(format!(
            "VM {vm_id}: this backend cannot save a running VM as a template: want it suspended"
        ))
        .into())
    }

    /// The running VM's template as found now (a committed save, checked
    /// against the disk copy it was taken with); `None` when it has none.
    fn template_saved(&self, _vm_id: &Id) -> Option<SavedGuest> {
        None
    }

    /// Removes the VM's template; nothing there is success.
    fn discard_template(&self, _vm_id: &Id) -> Outcome {
        Ok(())
    }

    /// Resumes the VM's guest where its VMM says it is paused (a
    /// template's save cut short); a guest that runs is left as it is.
    fn unpause(&self, _vm_id: &Id, _deadline: Deadline) -> Outcome {
        Ok(())
    }
}
