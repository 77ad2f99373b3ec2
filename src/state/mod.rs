//! The agent's persistent state: one directory, one agent.
//!
//! ```text
//! STATE_DIR/
//!   lock                      exclusive lock: one agent per state dir
//!   epoch                     highest accepted snapshot epoch
//!   vms/<vm_id>/record.json   the VM's record
//!   vms/<vm_id>/…             root disk, seed image, host key, pidfile, API socket, serial log
//!   images/<sha256>           verified base images
//!   volumes/<volume_id>       sparse volume files
//! ```
//!
//! Every write goes through [`atomic::write_atomic`]. The agent holding the
//! lock is the only writer, so the store keeps an in-memory copy of every
//! record, written through on save: the heartbeat reads records without
//! touching the disk.

pub mod atomic;
mod error;
pub mod leases;
pub mod perms;
mod record;
mod store;

pub use error::StoreError;
pub use record::{RECORD_FORMAT, Record};
pub use store::{HYPERVISOR_LOG, RecordSlot, SERIAL_LOG, Store, Swept, vm_dir_in};
