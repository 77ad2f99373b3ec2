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
pub use store::{RecordSlot, Store, Swept, Unsynced};

/// What room is left for the agent on the filesystem holding `path`, as an
/// operator reads it: "the filesystem of PATH has 0.5 MiB free of 4.0 MiB".
/// `None` when the filesystem cannot be asked.
pub fn room_at(path: &std::path::Path) -> Option<String> {
    const MIB: f64 = (1u64 << 20) as f64;
    let fs = nix::sys::statvfs::statvfs(path).ok()?;
    let block = fs.fragment_size() as f64;
    // What an unprivileged writer may use; root has the reserve on top.
    let free = fs.blocks_available() as f64 * block / MIB;
    let size = fs.blocks() as f64 * block / MIB;
    Some(format!(
        "the filesystem of {} has {free:.1} MiB free of {size:.1} MiB",
        path.display()
    ))
}
