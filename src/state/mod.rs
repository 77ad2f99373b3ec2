//! The agent's persistent state: one directory, one agent.
//!
//! What lives where is [`Layout`]'s header: the state dir's tree, and the
//! run dir's sockets.
//!
//! Every write goes through [`atomic::write_atomic`]. The agent holding the
//! lock is the only writer, so the store keeps an in-memory copy of every
//! record, written through on save: the heartbeat reads records without
//! touching the disk.

pub mod atomic;
pub mod claim;
mod error;
mod fence;
pub mod holders;
mod layout;
pub mod leases;
pub mod lifecycle;
pub mod perms;
mod record;
mod store;

pub use error::StoreError;
pub use layout::{Layout, RECORD_FILE};
pub use lifecycle::Lifecycle;
pub use record::{RECORD_FORMAT, Record};
pub use store::{RecordSlot, Store, Swept, Unsynced, read_records};

/// What room is left for the agent on the filesystem holding a path:
/// shown as an operator reads it, "the filesystem of PATH has 0.5 MiB free
/// of 4.0 MiB".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Room {
    pub path: std::path::PathBuf,
    /// What an unprivileged writer may still use, in bytes (root has the
    /// filesystem's reserve on top).
    pub free: u64,
    pub size: u64,
}

impl Room {
    /// The room at `path` now; `None` when its filesystem cannot be asked.
    // The counts are u64 on Linux, narrower on macOS.
    #[allow(clippy::useless_conversion)]
    pub fn at(path: &std::path::Path) -> Option<Room> {
        let fs = nix::sys::statvfs::statvfs(path).ok()?;
        let block = u64::from(fs.fragment_size());
        Some(Room {
            path: path.to_path_buf(),
            free: u64::from(fs.blocks_available()).saturating_mul(block),
            size: u64::from(fs.blocks()).saturating_mul(block),
        })
    }
}

impl std::fmt::Display for Room {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const MIB: f64 = (1u64 << 20) as f64;
        write!(
            f,
            "the filesystem of {} has {:.1} MiB free of {:.1} MiB",
            self.path.display(),
            self.free as f64 / MIB,
            self.size as f64 / MIB
        )
    }
}
