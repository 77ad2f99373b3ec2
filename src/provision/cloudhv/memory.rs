//! A guest's memory kept in a file of the VM's own, for a VM that wakes on
//! traffic: its resume is on the path of a client's first packet.
//!
//! A VMM's guest memory is otherwise anonymous shared memory: its snapshot
//! writes the pages the guest touched to `memory-ranges`, and a restore
//! faults each back in from there, through userfaultfd, at the guest's
//! first touch. On the real hypervisor and a Debian guest (sshd, 512 MiB)
//! those faults were most of a wake: a client's connect took 127–152 ms,
//! of which the VMM's restore was 19–25 ms.
//!
//! A VM whose memory is kept ready boots with it mapped shared from
//! `memory.raw` in its directory (one memory zone backed by that file).
//! cloud-hypervisor leaves a zone that a file holds out of its snapshot
//! (there is no `memory-ranges`), a restore maps the same file again
//! (nothing read before the guest runs, no userfaultfd), and the guest's
//! first touches are page-cache hits: the same connect took 41 ms.
//!
//! What it costs: the kernel writes back what the guest changes while it
//! runs (a shared file mapping's dirty pages), and the file holds up to
//! the guest's memory on the state dir's filesystem for the VM's life
//! (sparse: what the guest touched). Asleep, its pages are clean page
//! cache the host takes back under pressure.
//!
//! Why it is safe:
//! - It is made afresh at every boot (removed, then made empty and sized
//!   as root, 0600, then the VM's user's), so a boot never sees what an
//!   earlier one left; a boot without it removes one left behind.
//! - A suspend syncs it, with the disks, before it commits the snapshot,
//!   and the snapshot's manifest holds it to its identity as it does a
//!   disk: a restored guest that ran has written it (its mtime moved),
//!   which makes that snapshot unusable, never restored twice.
//! - The snapshot's configuration must name this file and no other, of
//!   the guest's size, shared, without huge pages or hotplug (`vet`); the
//!   VMM sees it in its view beside its disks, and cannot grow it (its
//!   file size limit), only write the guest's own bytes.

use std::collections::HashSet;
use std::fs;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::model::Id;

/// The VMs whose next boot keeps their memory ready (told at each pass).
pub(super) type Ready = parking_lot::Mutex<HashSet<Id>>;

/// Makes the memory file at `path` afresh: `bytes` long, every byte zero
/// (sparse), 0600, the VMM's own once its jail gives it its files.
pub(super) fn make(path: &Path, bytes: u64) -> io::Result<()> {
    remove(path)?;
    let file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.set_len(bytes)
}

/// Removes the memory file at `path`, if there is one.
pub(super) fn remove(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_memory_file_is_made_afresh_zero_and_sized() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("memory.raw");
        std::fs::write(&path, b"what an earlier guest left").expect("write");

        make(&path, 1 << 20).expect("make");

        let meta = std::fs::metadata(&path).expect("metadata");
        assert_eq!(meta.len(), 1 << 20);
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(meta.blocks(), 0, "sparse: nothing of the old content kept");
    }

    #[test]
    fn removing_a_memory_file_that_is_not_there_is_no_error() {
        let dir = tempfile::tempdir().expect("tempdir");

        let removed = remove(&dir.path().join("memory.raw"));

        assert!(removed.is_ok(), "{removed:?}");
    }
}
