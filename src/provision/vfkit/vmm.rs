//! A vfkit as the shared supervision asks for it (see
//! [`supervise::Vmm`]): its process by pid, its REST API on the VM's
//! socket.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::Pid;

use super::{Vfkit, api};
use crate::model::Id;
use crate::provision::Lifecycle;
use crate::provision::supervise::{self, Request};

/// How long one state change may take to be answered.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a state query may take.
const STATE_TIMEOUT: Duration = Duration::from_millis(500);

pub(super) struct Vmm<'a> {
    backend: &'a Vfkit,
    vm_id: &'a Id,
    pid: u32,
    socket: PathBuf,
}

impl Vfkit {
    /// The VM's vfkit `pid`, for the shared supervision.
    pub(super) fn vmm<'a>(&'a self, vm_id: &'a Id, pid: u32) -> Vmm<'a> {
        Vmm {
            backend: self,
            vm_id,
            pid,
            socket: self.socket_path(vm_id),
        }
    }
}

impl supervise::Vmm for Vmm<'_> {
    fn noun(&self) -> &'static str {
        "vfkit"
    }

    fn alive(&self) -> bool {
        self.backend.alive(self.vm_id) == Some(self.pid)
    }

    /// A child of this agent is gone once its reaper forgot it; one found
    /// by its pidfile, once that names no live vfkit.
    fn gone(&self) -> bool {
        !self.alive() && !self.backend.children.is_unreaped(self.pid)
    }

    fn says_running(&self) -> bool {
        api::state(&self.socket, STATE_TIMEOUT).is_ok_and(|s| s == api::RUNNING)
    }

    fn says_paused(&self) -> bool {
        api::state(&self.socket, STATE_TIMEOUT).is_ok_and(|s| s == api::PAUSED)
    }

    fn powered_off(&self) -> bool {
        api::state(&self.socket, STATE_TIMEOUT).is_ok_and(|s| s == api::STOPPED)
    }

    fn ask(&self, request: Request) {
        let to = match request {
            Request::PowerButton => "Stop",
            Request::Shutdown => "HardStop",
        };
        if let Err(e) = api::change(&self.socket, to, ASK_TIMEOUT) {
            log::info!("VM {}: {to}: {e}", self.vm_id);
        }
    }

    fn signal(&self, signal: Signal) -> io::Result<()> {
        if !self.alive() {
            return Ok(());
        }
        let pid = i32::try_from(self.pid).map_err(|_| io::Error::other("pid out of range"))?;
        match nix::sys::signal::kill(Pid::from_raw(pid), signal) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    fn pid(&self) -> u32 {
        self.pid
    }

    fn failure_reason(&self) -> String {
        self.backend.failure_reason(self.vm_id).unwrap_or_default()
    }
}
