//! Starting a vfkit, in order:
//! 1. Its command line, from [`super::argv`] (pure; a path vfkit
//!    cannot take is refused here, permanently).
//! 2. Its run dir, and a leftover API socket and pidfile removed (vfkit's
//!    bind fails on a socket file that exists).
//! 3. The fork: its own process group (a ^C meant for the agent's terminal
//!    never reaches a guest), stdin from /dev/null, stdout and stderr
//!    appended to the VM's `hypervisor.log` (vfkit keeps no log of its
//!    own: that file is the failure reason).
//! 4. Its reaper (see [`supervise::Children`]), which tells the engine when
//!    it exits.
//! 5. The wait for its REST API to say Running (see
//!    [`supervise::await_running`]).

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use super::argv::{self, Shape};
use super::{Vfkit, VfkitError};
use crate::deadline::Deadline;
use crate::error::Outcome;
use crate::model::{Id, Mac, VmSpec};
use crate::provision::supervise;

impl Vfkit {
    /// Starts the VM's vfkit (see the module steps) and returns its pid.
    pub(super) fn spawn(&self, spec: &VmSpec) -> Outcome<u32> {
        let vm_id = &spec.vm_id;
        let files_err = |what: &'static str, path: &Path| {
            let (vm_id, path) = (vm_id.clone(), path.to_path_buf());
            move |source| VfkitError::Files {
                vm_id,
                what,
                path,
                source,
            }
        };
        let files = self.files(spec);
        let shape = Shape {
            cpus: spec.vcpus,
            mem_mib: spec.mem_mb,
            mac: Mac::underlay(vm_id),
            efi_vars_exist: files.efi_vars.exists(),
        };
        let args = argv::argv(&files, &shape).map_err(|source| VfkitError::Argv {
            vm_id: vm_id.clone(),
            source,
        })?;
        crate::state::perms::make_dir(&self.cfg.hypervisor.run_dir)
            .map_err(files_err("make the run dir", &self.cfg.hypervisor.run_dir))?;
        supervise::remove_files(vm_id, &[files.socket.clone(), files.pidfile.clone()])
            .map_err(VfkitError::from)?;
        let log_path = self.store.layout().hypervisor_log(vm_id);
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&log_path)
            .map_err(files_err("open the log", &log_path))?;
        let err_log = log
            .try_clone()
            .map_err(files_err("open the log", &log_path))?;
        let mut child = Command::new(&self.cfg.hypervisor.binary)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err_log)
            .process_group(0)
            .spawn()
            .map_err(|source| VfkitError::Start {
                vm_id: vm_id.clone(),
                program: self.cfg.hypervisor.binary.clone(),
                source,
            })?;
        let pid = child.id();
        self.children
            .reap(vm_id, pid, move || child.wait().ok())
            .map_err(VfkitError::from)?;
        log::info!("VM {vm_id}: vfkit started (pid {pid})");
        Ok(pid)
    }

    /// Waits until the new vfkit says Running (see
    /// [`supervise::await_running`]).
    pub(super) fn await_running(&self, vm_id: &Id, pid: u32, deadline: Deadline) -> Outcome {
        supervise::await_running(vm_id, &self.vmm(vm_id, pid), self.cfg.boot_wait, deadline)
    }
}
