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
