use std::fmt;
use std::io;
use std::path::PathBuf;

use super::holders::Holder;
use crate::model::Id;

/// What went wrong in the state store. Every variant names the file or
/// directory it is about; messages do not repeat their source, which the
/// top level prints as a chain.
#[derive(Debug)]
pub enum StoreError {
    /// Another agent holds the state dir: the processes found with its
    /// lock open (none where they cannot be read).
    Locked {
        dir: PathBuf,
        holders: Vec<Holder>,
    },
    OpenLock {
        path: PathBuf,
        source: io::Error,
    },
    CreateDir {
        path: PathBuf,
        source: io::Error,
    },
    /// The state dir's permissions could not be made private.
    Tighten {
        path: PathBuf,
        source: io::Error,
    },
    ScanDir {
        path: PathBuf,
        source: io::Error,
    },
    WriteEpoch {
        path: PathBuf,
        source: io::Error,
    },
    WriteRecord {
        vm_id: Id,
        path: PathBuf,
        source: io::Error,
    },
    EncodeRecord {
        vm_id: Id,
        source: serde_json::Error,
    },
    /// The record exists but cannot be used. Not the same as absent: the
    /// engine must leave such a VM alone, never recreate or reap it.
    UnreadableRecord {
        vm_id: Id,
        path: PathBuf,
        problem: String,
    },
    DeleteVm {
        vm_id: Id,
        path: PathBuf,
        source: io::Error,
    },
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Locked { dir, holders } => {
                write!(
                    f,
                    "state dir {} is in use by another eitri-agent",
                    dir.display()
                )?;
                if !holders.is_empty() {
                    write!(f, " (its lock is {})", super::holders::describe(holders))?;
                }
                write!(f, "; stop that agent or choose another --state-dir")
            }
            StoreError::OpenLock { path, .. } => {
                write!(f, "cannot open the lock file {}", path.display())
            }
            StoreError::CreateDir { path, .. } => {
                write!(f, "cannot create directory {}", path.display())
            }
            StoreError::Tighten { path, .. } => write!(
                f,
                "cannot make {} private to root (files 0600, dirs 0700/0711); refusing to keep tenants' data where others may read it",
                path.display()
            ),
            StoreError::ScanDir { path, .. } => write!(f, "cannot list {}", path.display()),
            StoreError::WriteEpoch { path, .. } => {
                write!(f, "cannot save the epoch to {}", path.display())
            }
            StoreError::WriteRecord { vm_id, path, .. } => {
                write!(
                    f,
                    "cannot save the record of VM {vm_id} to {}",
                    path.display()
                )
            }
            StoreError::EncodeRecord { vm_id, .. } => {
                write!(f, "cannot encode the record of VM {vm_id}")
            }
            StoreError::UnreadableRecord {
                vm_id,
                path,
                problem,
            } => write!(
                f,
                "the record of VM {vm_id} at {} is unreadable ({problem}); the VM is left alone until it is repaired or removed",
                path.display()
            ),
            StoreError::DeleteVm { vm_id, path, .. } => {
                write!(f, "cannot delete VM {vm_id} at {}", path.display())
            }
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::OpenLock { source, .. }
            | StoreError::CreateDir { source, .. }
            | StoreError::Tighten { source, .. }
            | StoreError::ScanDir { source, .. }
            | StoreError::WriteEpoch { source, .. }
            | StoreError::WriteRecord { source, .. }
            | StoreError::DeleteVm { source, .. } => Some(source),
            StoreError::EncodeRecord { source, .. } => Some(source),
            StoreError::Locked { .. } | StoreError::UnreadableRecord { .. } => None,
        }
    }
}

/// A store failure is never permanent: a disk that is full or read-only
/// now may not be on the next tick.
impl crate::error::Failure for StoreError {}
