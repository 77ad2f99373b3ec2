//! What supervising a VMM can fail at, the same on every backend; each
//! backend's error wraps it. Every variant names the VM.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::Failure;
use crate::model::Id;

#[derive(Debug)]
pub enum SuperviseError {
    /// Its directory under the state dir could not be made.
    VmDir {
        vm_id: Id,
        path: PathBuf,
        source: io::Error,
    },
    /// A create retried after its record save failed must not clone over
    /// the disk of a guest running on it.
    DiskInUse { vm_id: Id },
    /// No thread could be started to reap its new VMM (which was killed).
    Reaper { vm_id: Id, source: io::Error },
    /// The new VMM exited before its API said Running.
    ExitedDuringBoot {
        vm_id: Id,
        noun: &'static str,
        reason: String,
    },
    /// The new VMM's API did not say what was awaited (Running, or
    /// Paused for a restore) in time; it was killed.
    BootTimeout {
        vm_id: Id,
        noun: &'static str,
        waited: Duration,
        awaited: &'static str,
        reason: String,
    },
    /// SIGKILL could not be sent.
    Kill {
        vm_id: Id,
        noun: &'static str,
        pid: u32,
        source: io::Error,
    },
    /// The VMM is still there after SIGKILL and its wait.
    SurvivedKill {
        vm_id: Id,
        noun: &'static str,
        pid: u32,
    },
    RemoveFile {
        vm_id: Id,
        path: PathBuf,
        source: io::Error,
    },
}

impl fmt::Display for SuperviseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use SuperviseError as E;
        match self {
            E::VmDir { vm_id, path, .. } => {
                write!(
                    f,
                    "VM {vm_id}: cannot create its directory {}",
                    path.display()
                )
            }
            E::DiskInUse { vm_id } => write!(
                f,
                "VM {vm_id}: refusing to replace the root disk of a running VMM; stop it first"
            ),
            E::Reaper { vm_id, .. } => write!(
                f,
                "VM {vm_id}: cannot start the thread that reaps its VMM (it was killed)"
            ),
            E::ExitedDuringBoot {
                vm_id,
                noun,
                reason,
            } => write!(f, "VM {vm_id}: {noun} exited during boot: {reason}"),
            E::BootTimeout {
                vm_id,
                noun,
                waited,
                awaited,
                reason,
            } => write!(
                f,
                "VM {vm_id}: {noun} did not say {awaited} within {} s; killed it: {reason}",
                waited.as_secs()
            ),
            E::Kill {
                vm_id, noun, pid, ..
            } => write!(f, "VM {vm_id}: cannot kill {noun} (pid {pid})"),
            E::SurvivedKill { vm_id, noun, pid } => {
                write!(f, "VM {vm_id}: {noun} (pid {pid}) survived SIGKILL")
            }
            E::RemoveFile { vm_id, path, .. } => {
                write!(f, "VM {vm_id}: cannot remove {}", path.display())
            }
        }
    }
}

impl std::error::Error for SuperviseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        use SuperviseError as E;
        match self {
            E::VmDir { source, .. }
            | E::Reaper { source, .. }
            | E::Kill { source, .. }
            | E::RemoveFile { source, .. } => Some(source),
            E::DiskInUse { .. }
            | E::ExitedDuringBoot { .. }
            | E::BootTimeout { .. }
            | E::SurvivedKill { .. } => None,
        }
    }
}

/// Every one of these is about a moment (a VMM that crashed, a busy disk,
/// a thread the host could not start): a retry may pass.
impl Failure for SuperviseError {}
