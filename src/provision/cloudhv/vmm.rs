//! A cloud-hypervisor VMM as the shared supervision asks for it (see
//! [`supervise::Vmm`]): its process by pid and start time, its API on the
//! VM's socket.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use nix::sys::signal::Signal;

use super::process::Tracked;
use super::{CloudHypervisor, api};
use crate::model::Id;
use crate::provision::Lifecycle;
use crate::provision::supervise::{self, Request};

/// How long one API request may take: a VMM that does not answer in this
/// is the ladder's to wait out, not the request's.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a state query may take.
const STATE_TIMEOUT: Duration = Duration::from_millis(500);

pub(super) struct Vmm<'a> {
    backend: &'a CloudHypervisor,
    vm_id: &'a Id,
    tracked: Tracked,
    socket: PathBuf,
}

impl CloudHypervisor {
    /// The VM's VMM `tracked`, for the shared supervision.
    pub(super) fn vmm<'a>(&'a self, vm_id: &'a Id, tracked: Tracked) -> Vmm<'a> {
        Vmm {
            backend: self,
            vm_id,
            tracked,
            socket: self.socket_path(vm_id),
        }
    }
}

impl Vmm<'_> {
    fn state(&self) -> Option<String> {
        api::vm_state(&self.socket, STATE_TIMEOUT)
    }
}

impl supervise::Vmm for Vmm<'_> {
    fn noun(&self) -> &'static str {
        "the hypervisor"
    }

    fn alive(&self) -> bool {
        self.tracked.alive()
    }

    fn gone(&self) -> bool {
        // pid_t is positive for every process this type tracks.
        !self.tracked.alive() && !self.backend.children.is_unreaped(self.pid())
    }

    fn says_running(&self) -> bool {
        self.state().as_deref() == Some("Running")
    }

    fn says_paused(&self) -> bool {
        self.state().as_deref() == Some("Paused")
    }

    /// The guest powered off: cloud-hypervisor's VM is `Shutdown` (or back
    /// to `Created`) while the VMM stays up.
    fn powered_off(&self) -> bool {
        matches!(self.state().as_deref(), Some("Shutdown" | "Created"))
    }

    fn ask(&self, request: Request) {
        let path = match request {
            Request::PowerButton => "/api/v1/vm.power-button",
            Request::Shutdown => "/api/v1/vmm.shutdown",
        };
        if let Err(e) = api::call(&self.socket, "PUT", path, ASK_TIMEOUT) {
            log::debug!("VM {}: {path}: {e}", self.vm_id);
        }
    }

    fn signal(&self, signal: Signal) -> io::Result<()> {
        self.tracked.signal(signal)
    }

    fn pid(&self) -> u32 {
        self.tracked.pid.unsigned_abs()
    }

    fn failure_reason(&self) -> String {
        self.backend.failure_reason(self.vm_id).unwrap_or_default()
    }
}
