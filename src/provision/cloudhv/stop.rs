//! Stopping a VMM, politely first: power button, `vmm.shutdown`, SIGTERM,
//! SIGKILL, each stage bounded; done only once the agent's own child is
//! reaped.

use std::time::Duration;

use nix::sys::signal::Signal;

use super::error::CloudHvError;
use super::process::Tracked;
use super::{CloudHypervisor, api};
use crate::deadline::Deadline;
use crate::error::BoxFailure;
use crate::model::Id;
use crate::provision::Say;

impl CloudHypervisor {
    /// Waits until the process is gone and, if it was this agent's child,
    /// reaped (a zombie reads as not alive, but is still a process).
    pub(super) fn wait_gone(&self, tracked: Tracked, bound: Deadline) -> bool {
        while tracked.alive() || self.unreaped.lock().contains(&tracked.pid) {
            if bound.expired() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    pub(super) fn kill(&self, tracked: Tracked) {
        let _ = tracked.signal(Signal::SIGKILL);
        self.wait_gone(tracked, Deadline::after(Duration::from_secs(5)));
    }

    /// Stops the VM's VMM (see the module header), telling `say` each stage
    /// and, while the guest is given the power button, how long it has had.
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
                self.wait_gone(dead, Deadline::after(Duration::from_secs(2)));
            }
            return Ok(());
        };
        let socket = self.socket_path(vm_id);
        let call = |path: &str| {
            let _ = api::call(&socket, "PUT", path, Duration::from_secs(2));
        };
        if !deadline.expired() {
            call("/api/v1/vm.power-button");
            let allowed = self.cfg.stop.power_button;
            let bound = deadline.capped(allowed);
            let pressed = std::time::Instant::now();
            let mut said = None;
            loop {
                // Once a second: how long the guest has had, of how long.
                let waited = pressed.elapsed().as_secs();
                if said != Some(waited) {
                    say(&format!(
                        "stopping: waiting for the guest to power off, {waited} s of {}",
                        allowed.as_millis().div_ceil(1000)
                    ));
                    said = Some(waited);
                }
                let state = api::vm_state(&socket, Duration::from_millis(500));
                if !tracked.alive()
                    || matches!(state.as_deref(), Some("Shutdown" | "Created"))
                    || bound.expired()
                {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            say("stopping: asking the hypervisor to shut down");
            call("/api/v1/vmm.shutdown");
            if self.wait_gone(tracked, deadline.capped(self.cfg.stop.vmm_shutdown)) {
                return Ok(());
            }
            log::warn!("VM {vm_id}: hypervisor ignored shutdown; sending SIGTERM");
            say("stopping: the hypervisor ignored shutdown; sending SIGTERM");
            let _ = tracked.signal(Signal::SIGTERM);
            if self.wait_gone(tracked, deadline.capped(self.cfg.stop.terminate)) {
                return Ok(());
            }
        }
        log::warn!("VM {vm_id}: killing hypervisor {}", tracked.pid);
        say("stopping: killing the hypervisor");
        tracked
            .signal(Signal::SIGKILL)
            .map_err(|source| CloudHvError::Kill {
                vm_id: vm_id.clone(),
                pid: tracked.pid,
                source,
            })?;
        if self.wait_gone(tracked, Deadline::after(Duration::from_secs(5))) {
            Ok(())
        } else {
            Err(CloudHvError::SurvivedKill {
                vm_id: vm_id.clone(),
                pid: tracked.pid,
            }
            .into())
        }
    }
}
