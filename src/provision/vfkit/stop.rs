//! Stopping a vfkit: the shared ladder (see [`supervise::ladder`]) on this
//! backend's [`Vmm`](super::vmm::Vmm): the power button (`Stop`), then
//! `HardStop` (vfkit exits before it answers), SIGTERM, SIGKILL.

use super::Vfkit;
use crate::deadline::Deadline;
use crate::error::Outcome;
use crate::model::Id;
use crate::provision::Say;
use crate::provision::supervise::{self, Guest};

impl Vfkit {
    /// Stops the VM's vfkit, telling `say` each rung of the ladder.
    pub(super) fn stop(&self, vm_id: &Id, deadline: Deadline, say: Say<'_>) -> Outcome {
        let Some(pid) = self.alive(vm_id) else {
            return Ok(());
        };
        let vmm = self.vmm(vm_id, pid);
        let bounds = (self.cfg.hypervisor.stop, deadline);
        supervise::stop(vm_id, &vmm, bounds, Guest::Running, say).map_err(Into::into)
    }

    /// Stops the VM's vfkit whose guest is paused: from `HardStop`, since
    /// a paused guest hears no power button.
    pub(super) fn stop_paused(&self, vm_id: &Id, deadline: Deadline) -> Outcome {
        let Some(pid) = self.alive(vm_id) else {
            return Ok(());
        };
        let say = |what: &str| log::info!("VM {vm_id}: {what}");
        let vmm = self.vmm(vm_id, pid);
        let bounds = (self.cfg.hypervisor.stop, deadline);
        supervise::stop(vm_id, &vmm, bounds, Guest::Paused, &say).map_err(Into::into)
    }
}
