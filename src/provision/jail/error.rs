//! The jail's errors: each names the VM (or the device) it is about and
//! keeps its cause as a source. A backend wraps them as its own error's
//! source; their words are the ones its rows and logs show.

use std::fmt;
use std::io;
use std::path::PathBuf;

use crate::error::Failure;
use crate::model::Id;

#[derive(Debug)]
pub enum JailError {
    /// A piece of confinement this host lacks, which the operator has not
    /// allowed VMMs to run without.
    Unconfinable { piece: &'static str, why: String },
    /// The jailed VMMs' group cannot be given the KVM device.
    KvmGroup {
        path: PathBuf,
        group: u32,
        source: io::Error,
    },
    /// The VM's VMM's own user id could not be had (the id map is
    /// unreadable or full, or cannot be saved), or released.
    VmmId { vm_id: Id, why: String },
    /// The VM's files could not be made its VMM's own.
    GiveFiles { vm_id: Id, source: io::Error },
    /// The VM's cgroups could not be made, limited, entered or removed.
    Cgroup { vm_id: Id, source: io::Error },
    /// The files the VM's VMM is to see could not be planned (one is
    /// missing, or a path of them is not plain).
    View { vm_id: Id, source: io::Error },
}

impl fmt::Display for JailError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use JailError as E;
        match self {
            E::Unconfinable { piece, why } => write!(
                f,
                "hypervisors would run without {piece}: {why}; fix the host, \
                 or let them run without it with --allow-without {piece}"
            ),
            E::KvmGroup { path, group, .. } => write!(
                f,
                "cannot give the jailed hypervisors' group {group} read-write access to {} \
                 (an ACL entry); make it so with `chgrp {group} {0} && chmod 0660 {0}` \
                 (or a udev rule: KERNEL==\"kvm\", GROUP=\"{group}\", MODE=\"0660\")",
                path.display()
            ),
            E::VmmId { vm_id, why } => {
                write!(f, "VM {vm_id}: no user id for its hypervisor: {why}")
            }
            E::GiveFiles { vm_id, .. } => {
                write!(f, "VM {vm_id}: cannot make its files its hypervisor's own")
            }
            E::Cgroup { vm_id, .. } => write!(f, "VM {vm_id}: cannot set up its cgroups"),
            E::View { vm_id, .. } => {
                write!(
                    f,
                    "VM {vm_id}: cannot build its hypervisor's view of its files (the mounts it is confined to)"
                )
            }
        }
    }
}

impl std::error::Error for JailError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        use JailError as E;
        match self {
            E::KvmGroup { source, .. }
            | E::GiveFiles { source, .. }
            | E::Cgroup { source, .. }
            | E::View { source, .. } => Some(source),
            E::Unconfinable { .. } | E::VmmId { .. } => None,
        }
    }
}

/// What the host lacks (a piece of confinement, the KVM device's ACL) is
/// a host condition: no retry helps until the host is fixed, and the VM's
/// retries are kept. The rest is about a moment (a full disk, a busy
/// cgroup) and is retried.
impl Failure for JailError {
    fn is_host_condition(&self) -> bool {
        matches!(
            self,
            JailError::Unconfinable { .. } | JailError::KvmGroup { .. }
        )
    }
}
