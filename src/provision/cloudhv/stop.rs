//! Stopping a VMM: the shared ladder (see [`supervise::ladder`]) on this
//! backend's [`Vmm`](super::vmm::Vmm); done only once the agent's own child
//! is reaped.

use std::time::Duration;

use super::CloudHypervisor;
use crate::deadline::Deadline;
use crate::error::BoxFailure;
use crate::model::Id;
use crate::provision::Say;
use crate::provision::supervise::{self, ladder};

/// How long a VMM found dead is given for its reaper to finish.
const REAP_WAIT: Duration = Duration::from_secs(2);

impl CloudHypervisor {
    /// Stops the VM's VMM, telling `say` each rung of the ladder.
    pub(super) fn stop(
        &self,
        vm_id: &Id,
        deadline: Deadline,
        say: Say<'_>,
    ) -> Result<(), BoxFailure> {
        let Some(tracked) = self.find(vm_id) else {
            // Already dead; if it was this agent's child, let its reaper
            // finish, so no zombie outlives the stop.
            if let Some(dead) = self.tracked(vm_id) {
                ladder::wait_gone(&self.vmm(vm_id, dead), Deadline::after(REAP_WAIT));
            }
            return Ok(());
        };
        supervise::stop(
            vm_id,
            &self.vmm(vm_id, tracked),
            self.cfg.stop,
            deadline,
            say,
        )
        .map_err(Into::into)
    }
}
