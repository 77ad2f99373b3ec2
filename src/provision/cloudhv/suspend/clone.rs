//! A clone's half: a new VM's root disk and saved guest made copies of its
//! template's, so that the VM's resume ([`super::restore`]) starts it where
//! the template was saved, as a VM of its own.
//!
//! In order:
//! 1. The template's snapshot is checked as any resume checks it (its
//!    manifest, its files' sizes, the identity of the disks it was taken
//!    with), and its `config.json` held to the template's own VM (`vet`).
//! 2. The root disk: the template's, as it was at its snapshot (a
//!    suspended template's own, which does not run while it is one; a
//!    running template's copy taken with its snapshot: see `template`),
//!    copied to the clone's by reflink where the filesystem shares
//!    extents, else by a sparse copy.
//! 3. Beside it, in the clone's `.snapshot-new/` (root's, 0600): the
//!    template's `config.json` made the clone's (`vet::conform`: its disks,
//!    serial file, MACs, limiters, vsock socket and Landlock rule) and
//!    vetted as the clone's; `state.json` copied the same way as the disk;
//!    `memory-ranges` a hard link to the template's own. One inode, so one
//!    page cache: a burst of clones reads the template's memory from the
//!    disk once, not once a clone (a reflinked copy is a new inode, read
//!    from the disk again), and the host caches it once. It stays root's
//!    and 0600, written by no one: a clone's VMM is let read it by an ACL
//!    entry for its own user while its restore opens it, taken back once
//!    it has (`lend`, `take_back`). A template's memory that is not root's
//!    (lent whole to its VMM by an agent before this one) is copied instead.
//! 4. The template checked again: a snapshot taken again, discarded, or a
//!    disk written while it was copied (the template resumed meanwhile)
//!    refuses the copy rather than hand the clone a torn one.
//! 5. Every file synced, the clone's manifest written (its own disk's
//!    identity), and the snapshot committed as a suspend commits one.
//!
//! So the template's files are needed only while a clone is being made:
//! with the copies and the link taken, a clone's VMM reads its own, whole,
//! before its guest runs (the manifest names the template, and `restore`
//! reads a clone's memory whole: see why there), and the template may be
//! removed whatever its clones do (the link keeps the memory's inode until
//! the clone's snapshot is discarded, after its restore).

use std::fs;
use std::io;
use std::path::Path;

use super::{
    DiskIdentity, FILES, FORMAT, FileEntry, MEMORY, Manifest, check, commit, failed,
    fresh_incoming, vetted_config,
};
use crate::deadline::Deadline;
use crate::disk::Method;
use crate::error::Outcome;
use crate::model::{Id, VmSpec};
use crate::provision::cloudhv::{CloudHypervisor, vet};
use crate::stages::timed;
use crate::state::atomic::write_then_rename;

impl CloudHypervisor {
    /// Makes the clone `spec`'s root disk and saved guest copies of
    /// `template`'s (the steps of the module): how they were copied.
    pub(in crate::provision::cloudhv) fn clone_vm(
        &self,
        template: &Id,
        spec: &VmSpec,
        deadline: Deadline,
    ) -> Outcome<Method> {
        let vm_id = &spec.vm_id;
        let fail = |why: String| failed(vm_id, "copy its template's snapshot", why);
        let layout = self.store.layout();
        // Suspended, its snapshot; running, the one it was saved as.
        let (source, manifest, root) = if layout.snapshot(template).exists() {
            let manifest = layout.snapshot_manifest(template);
            (
                layout.snapshot(template),
                manifest,
                layout.root_disk(template),
            )
        } else {
            let manifest = layout.template_manifest(template);
            (
                layout.template(template),
                manifest,
                layout.template_disk(template),
            )
        };
        let unusable = |why: super::Unusable| {
            fail(format!(
                "the snapshot of its template {template} cannot be used: {}",
                crate::error::chain(&why)
            ))
        };
        let before = check(&manifest, &source).map_err(unusable)?;
        // Its guest runs from its memory: the payload is not compared.
        let theirs = vet::Expected {
            payload: None,
            ..self.snapshot_of(template).expected
        };
        let config = vetted_config(&source.join("config.json"), &theirs)
            .map_err(|e| fail(format!("its template's: {e}")))?;
        let taken = self.snapshot_of(vm_id);
        let ours = vet::Expected {
            payload: None,
            ..taken.expected.clone()
        };
        let config = vet::conform(&config, &ours);
        if let Some(why) = vet::difference(&config, &ours) {
            return Err(fail(format!(
                "its config.json made from its template's: {why}"
            )));
        }
        crate::provision::supervise::vm_dir(&self.store, vm_id)?;
        let disk = timed("clone disk", || {
            crate::disk::prepare(&root, &layout.root_disk(vm_id), spec.disk_gb, deadline)
        })?;
        let incoming = layout.snapshot_incoming(vm_id);
        let (copied, memory) = timed("clone memory", || {
            copy_snapshot(&source, &incoming, &config, deadline)
        })?;
        match check(&manifest, &source) {
            Ok(after) if after.taken_at_ms == before.taken_at_ms => {}
            Ok(_) => {
                return Err(fail(format!(
                    "its template {template} was saved again while it was copied"
                )));
            }
            Err(why) => return Err(unusable(why)),
        }
        timed("sync clone", || -> io::Result<()> {
            fs::File::open(layout.root_disk(vm_id))?.sync_all()?;
            let manifest = Manifest {
                format: FORMAT,
                taken_at_ms: before.taken_at_ms,
                files: copied,
                disks: taken
                    .disks
                    .iter()
                    .map(|d| DiskIdentity::of(d))
                    .collect::<io::Result<_>>()?,
                clone_of: Some(template.to_string()),
            };
            commit(
                &manifest,
                &incoming,
                &layout.snapshot(vm_id),
                &layout.snapshot_discarded(vm_id),
                &layout.vm_dir(vm_id),
            )
        })
        .map_err(|e| fail(format!("cannot commit its copy: {e}")))?;
        Ok(if disk == Method::Reflink && memory == Method::Reflink {
            Method::Reflink
        } else {
            Method::SparseCopy
        })
    }
}

/// `source`'s files into a fresh `incoming`: `config` as its
/// configuration, the memory linked (see the module), the rest copied,
/// each synced: what it holds, for the manifest, and whether every copy
/// was a reflink.
fn copy_snapshot(
    source: &Path,
    incoming: &Path,
    config: &serde_json::Value,
    deadline: Deadline,
) -> Outcome<(Vec<FileEntry>, Method)> {
    let io = |e: io::Error| -> crate::error::BoxFailure {
        crate::error::Simple::transient(format!("cannot copy a snapshot: {e}")).into()
    };
    fresh_incoming(incoming).map_err(io)?;
    let text = serde_json::to_vec(config).map_err(|e| io(io::Error::other(e)))?;
    // Each file's bytes synced here; `incoming`'s names once, by the
    // manifest's durable write beside them (`commit`).
    write_then_rename(&incoming.join("config.json"), &text).map_err(io)?;
    let mut files = vec![FileEntry {
        name: "config.json".into(),
        bytes: text.len() as u64,
    }];
    let mut method = Method::Reflink;
    for name in FILES.iter().filter(|n| **n != "config.json") {
        let from = source.join(name);
        if !from.exists() {
            continue;
        }
        let to = incoming.join(name);
        let linked = *name == MEMORY && link_root_owned(&from, &to).map_err(io)?;
        if !linked && crate::disk::copy(&from, &to, deadline)? == Method::SparseCopy {
            method = Method::SparseCopy;
        }
        let file = fs::File::open(&to).map_err(io)?;
        file.sync_all().map_err(io)?;
        files.push(FileEntry {
            name: (*name).to_owned(),
            bytes: file.metadata().map_err(io)?.len(),
        });
    }
    files.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((files, method))
}

/// `to` made a hard link to `from` if `from` is root's, a regular file
/// no one but root may write (sealed: see `save`): whether it was.
fn link_root_owned(from: &Path, to: &Path) -> io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::symlink_metadata(from)?;
    if !meta.is_file() || meta.uid() != 0 || meta.mode() & 0o022 != 0 {
        return Ok(false);
    }
    fs::hard_link(from, to)?;
    Ok(true)
}
