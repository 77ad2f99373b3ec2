//! What every backend does the same way around its VMM process, written
//! once: a backend is a [`Vmm`] impl plus what only it does (its command
//! line, its fork, its API's words).
//!
//! A VMM's supervised life, in order:
//! 1. Its directory ([`vm_dir`]) and root disk ([`prepare_root_disk`]),
//!    never replaced under a live VMM.
//! 2. Started by the backend, then reaped by [`Children::reap`]: one
//!    thread per child, blocked until it exits, which keeps the exit
//!    status for the failure reason and tells the engine at once.
//! 3. Booted when its API says so: [`await_running`] polls it within the
//!    pass's deadline, and kills a VMM that exits or hangs first.
//! 4. Stopped by [`stop`]: the ladder of rungs in [`ladder`], politest
//!    first, each bounded, SIGKILL last.
//! 5. Its files removed at destroy ([`remove_files`]).
//!
//! Exits are worded once ([`describe`]) and every failure here is a
//! [`SuperviseError`], which each backend's error wraps.

mod boot;
mod children;
mod error;
pub mod ladder;

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

pub use self::boot::{Awaited, await_running, await_state};
pub use self::children::{Children, Listener};
pub use self::error::SuperviseError;
pub use self::ladder::{Guest, StopTimeouts, stop};
use crate::deadline::Deadline;
use crate::error::Outcome;
use crate::model::{Id, VmSpec};
use crate::state::Store;
use crate::state::atomic::Pending;

/// One VM's VMM as the shared supervision sees it: what a backend answers
/// about its process and what it asks its API.
pub trait Vmm {
    /// What the VMM is called in what people read: "the hypervisor",
    /// "vfkit".
    fn noun(&self) -> &'static str;
    /// The process runs (not a zombie).
    fn alive(&self) -> bool;
    /// The process is gone and, if it was this agent's child, reaped: a
    /// zombie is not alive but is still a process to wait for.
    fn gone(&self) -> bool;
    /// Its API says the guest is running.
    fn says_running(&self) -> bool;
    /// Its API says the guest is paused (restored, or paused in place).
    fn says_paused(&self) -> bool;
    /// Its API says the guest has powered off (the VMM may still be up).
    fn powered_off(&self) -> bool;
    /// Asks the VMM, through its API, for `request`; an answer that never
    /// comes is the ladder's business, not an error.
    fn ask(&self, request: Request);
    /// Sends the process `signal`; one already gone is success.
    fn signal(&self, signal: nix::sys::signal::Signal) -> io::Result<()>;
    /// The pid, for messages.
    fn pid(&self) -> u32;
    /// The VMM's own account of why it stopped (its log, its exit).
    fn failure_reason(&self) -> String;
}

/// What a [`Vmm`] is asked through its API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// The guest's ACPI power button: an orderly shutdown, if it listens.
    PowerButton,
    /// The VMM ends the guest and exits (cloud-hypervisor's
    /// `vmm.shutdown`, vfkit's `HardStop`).
    Shutdown,
}

/// How a process ended, in the words every log line and report uses.
pub use crate::human::exit as describe;

/// The VM's directory, made if missing: root's, searchable (a jailed VMM
/// reaches its own files in it by name) but not listable or writable by
/// anyone else.
pub fn vm_dir(store: &Store, vm_id: &Id) -> Result<PathBuf, SuperviseError> {
    let dir = store.layout().vm_dir(vm_id);
    crate::state::perms::make_dir(&dir)
        .and_then(|()| {
            fs::set_permissions(
                &dir,
                fs::Permissions::from_mode(crate::state::perms::SEARCHABLE_DIR),
            )
        })
        .map_err(|source| SuperviseError::VmDir {
            vm_id: vm_id.clone(),
            path: dir.clone(),
            source,
        })?;
    Ok(dir)
}

/// Materialises the VM's root disk from `base` (see [`crate::disk`]),
/// unless `in_use`: a create retried after its record save failed must
/// not clone over the disk of a guest running on it. In place, not yet
/// durable: see [`Pending`].
pub fn prepare_root_disk(
    store: &Store,
    spec: &VmSpec,
    base: &Path,
    in_use: bool,
    deadline: Deadline,
) -> Outcome<Pending> {
    let vm_id = &spec.vm_id;
    if in_use {
        return Err(SuperviseError::DiskInUse {
            vm_id: vm_id.clone(),
        }
        .into());
    }
    vm_dir(store, vm_id)?;
    let disk = store.layout().root_disk(vm_id);
    crate::disk::prepare(base, &disk, spec.disk_gb, deadline)?;
    Ok(Pending::file(&disk))
}

/// Removes each of `paths` that exists: what destroy leaves of a VMM.
pub fn remove_files(vm_id: &Id, paths: &[PathBuf]) -> Result<(), SuperviseError> {
    for path in paths {
        match fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(SuperviseError::RemoveFile {
                    vm_id: vm_id.clone(),
                    path: path.clone(),
                    source,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removing_files_that_are_gone_already_is_success() {
        let dir = tempfile::tempdir().expect("tempdir");
        let there = dir.path().join("there");
        std::fs::write(&there, b"x").expect("write");
        let vm_id = Id::parse("vm-1").expect("id");

        remove_files(&vm_id, &[there.clone(), dir.path().join("never")]).expect("removed");

        assert!(!there.exists());
    }
}
