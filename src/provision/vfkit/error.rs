//! The vfkit backend's errors: each names the VM or the program it is
//! about and keeps its cause as a source. Permanence is asked through
//! [`Failure`].

use std::fmt;
use std::path::PathBuf;

use super::argv::ArgvError;
use crate::error::Failure;
use crate::model::Id;
use crate::provision::supervise::SuperviseError;

#[derive(Debug)]
pub enum VfkitError {
    /// The configured vfkit is missing or not executable.
    NotInstalled { program: PathBuf, why: String },
    /// The VM's command line cannot be built (a path vfkit cannot take).
    Argv { vm_id: Id, source: ArgvError },
    /// A second NIC, which vfkit cannot bridge without Apple's
    /// entitlement.
    HostNetwork { vm_id: Id, network: String },
    /// One of the VM's files could not be made, opened or removed.
    Files {
        vm_id: Id,
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    Start {
        vm_id: Id,
        program: PathBuf,
        source: std::io::Error,
    },
    /// No vfkit of the VM runs (to pause or resume).
    NotRunning { vm_id: Id },
    /// A pause or resume of the guest in place failed: what it was
    /// `doing`, and vfkit's answer.
    State {
        vm_id: Id,
        doing: &'static str,
        source: super::api::RestError,
    },
    /// What every backend's supervision can fail at.
    Supervise(SuperviseError),
}

impl From<SuperviseError> for VfkitError {
    fn from(e: SuperviseError) -> VfkitError {
        VfkitError::Supervise(e)
    }
}

impl fmt::Display for VfkitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VfkitError::NotInstalled { program, why } => write!(
                f,
                "vfkit ({}) cannot run: {why}; install it (brew install vfkit) or point --hypervisor at it",
                program.display()
            ),
            VfkitError::Argv { vm_id, source } => write!(f, "VM {vm_id}: {source}"),
            VfkitError::HostNetwork { vm_id, network } => write!(
                f,
                "VM {vm_id}: host network {network:?} cannot be served on macOS: vfkit bridges a NIC only with Apple's com.apple.vm.networking entitlement; remove the VM's network"
            ),
            VfkitError::Files {
                vm_id, what, path, ..
            } => {
                write!(f, "VM {vm_id}: cannot {what} {}", path.display())
            }
            VfkitError::Start { vm_id, program, .. } => {
                write!(f, "VM {vm_id}: cannot start {}", program.display())
            }
            VfkitError::NotRunning { vm_id } => write!(f, "VM {vm_id}: its vfkit is not running"),
            VfkitError::State { vm_id, doing, .. } => write!(f, "VM {vm_id}: cannot {doing}"),
            VfkitError::Supervise(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for VfkitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            VfkitError::Argv { source, .. } => Some(source),
            VfkitError::Files { source, .. } | VfkitError::Start { source, .. } => Some(source),
            VfkitError::State { source, .. } => Some(source),
            // Transparent: the wrapped error's own message is this one's.
            VfkitError::Supervise(e) => e.source(),
            VfkitError::NotInstalled { .. }
            | VfkitError::HostNetwork { .. }
            | VfkitError::NotRunning { .. } => None,
        }
    }
}

impl Failure for VfkitError {
    /// Permanent: a command line vfkit cannot take and a NIC it cannot
    /// bridge; no retry of the same spec can pass. A missing vfkit is the
    /// host's to fix, and passes once it is installed.
    fn is_permanent(&self) -> bool {
        match self {
            VfkitError::Argv { .. } | VfkitError::HostNetwork { .. } => true,
            VfkitError::NotInstalled { .. }
            | VfkitError::Files { .. }
            | VfkitError::Start { .. }
            | VfkitError::NotRunning { .. }
            | VfkitError::State { .. } => false,
            VfkitError::Supervise(e) => e.is_permanent(),
        }
    }

    /// A vfkit that is not installed is the host's to fix.
    fn is_host_condition(&self) -> bool {
        match self {
            VfkitError::NotInstalled { .. } => true,
            VfkitError::Argv { .. }
            | VfkitError::HostNetwork { .. }
            | VfkitError::Files { .. }
            | VfkitError::Start { .. }
            | VfkitError::NotRunning { .. }
            | VfkitError::State { .. } => false,
            VfkitError::Supervise(e) => e.is_host_condition(),
        }
    }
}
