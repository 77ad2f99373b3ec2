//! A suspend's half (see the protocol in [`super`]): the guest paused,
//! its snapshot written through the window, sealed, committed, and its
//! VMM stopped.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::{
    API_TIMEOUT, DiskIdentity, FILES, FORMAT, FileEntry, MEMORY, Manifest, REQUIRED,
    RESTORE_IN_PROGRESS, SMALL_FILE_MAX, commit, empty_dir, failed, fresh_incoming, open_beneath,
    put, vetted_config,
};
use crate::deadline::Deadline;
use crate::error::Outcome;
use crate::human::unix_ms;
use crate::model::{Id, Saved};
use crate::provision::Say;
use crate::provision::cloudhv::error::CloudHvError;
use crate::provision::cloudhv::{CloudHypervisor, window};
use crate::provision::supervise::{self, Guest};
use crate::stages::timed;

/// Asks the VMM at `socket` to save its paused guest into `work`, within
/// `bound`. A guest resumed moments ago whose VMM still reads the rest of
/// its last snapshot in cannot be saved until that is done (seconds for
/// GiBs): the ask is repeated, saying so, until then.
fn snapshot_to(socket: &Path, work: &Path, bound: Deadline, say: Say<'_>) -> io::Result<()> {
    let body =
        serde_json::json!({ "destination_url": format!("file://{}", work.display()) }).to_string();
    loop {
        match put(socket, "/api/v1/vm.snapshot", Some(body.as_bytes()), bound) {
            Err(e) if e.to_string().contains(RESTORE_IN_PROGRESS) && !bound.expired() => {
                say("suspending: waiting for its last resume to finish reading its memory in");
                std::thread::sleep(Duration::from_millis(20));
            }
            done => return done,
        }
    }
}

/// What a snapshot is taken with (its disks) and held to (its guest's
/// memory: the memory file is no larger).
pub(in crate::provision::cloudhv) struct Taken {
    pub disks: Vec<PathBuf>,
    pub memory_bytes: u64,
    /// What its hypervisor was started with, which the snapshot's
    /// configuration must say too (see `vet`).
    pub expected: crate::provision::cloudhv::vet::Expected,
}

impl CloudHypervisor {
    /// Suspends the VM (see the steps in [`super`]).
    pub(in crate::provision::cloudhv) fn suspend_vm(
        &self,
        taken: &Taken,
        vm_id: &Id,
        deadline: Deadline,
        say: Say<'_>,
    ) -> Outcome<Saved> {
        let Some(tracked) = self.find(vm_id) else {
            return Err(CloudHvError::NotRunning {
                vm_id: vm_id.clone(),
            }
            .into());
        };
        let socket = self.socket_path(vm_id);
        say("suspending: pausing the guest");
        let saved = self.pause_and_save(taken, vm_id, deadline, say);
        let saved = match saved {
            Ok(saved) => saved,
            Err(e) => {
                // Left as it was: running.
                let _ = put(
                    &socket,
                    "/api/v1/vm.resume",
                    None,
                    Deadline::after(API_TIMEOUT),
                );
                return Err(e);
            }
        };
        crate::crash::point("suspend.committed");
        say("suspending: stopping its hypervisor");
        timed("stop", || {
            let vmm = self.vmm(vm_id, tracked);
            let bounds = (self.cfg.hypervisor.stop, deadline);
            supervise::stop(vm_id, &vmm, bounds, Guest::Paused, say)
        })?;
        timed("leftovers", || self.end_leftovers(vm_id, say))?;
        crate::crash::point("suspend.vmm-stopped");
        Ok(saved)
    }

    /// Pauses the guest and saves it, committed where a resume finds it;
    /// on an error the guest is left paused, for the caller to resume.
    fn pause_and_save(
        &self,
        taken: &Taken,
        vm_id: &Id,
        deadline: Deadline,
        say: Say<'_>,
    ) -> Outcome<Saved> {
        let layout = self.store.layout();
        self.pause_guest(vm_id, deadline)?;
        let work = self.write_snapshot(taken, vm_id, deadline, say)?;
        crate::crash::point("suspend.snapshot-written");
        let paths = SnapshotPaths {
            incoming: layout.snapshot_incoming(vm_id),
            committed: layout.snapshot(vm_id),
            discarded: layout.snapshot_discarded(vm_id),
        };
        let taken_at_ms = unix_ms(SystemTime::now());
        timed("commit", || {
            seal_and_commit(&work, &paths, &layout.vm_dir(vm_id), taken, taken_at_ms)
        })
        .map_err(|e| failed(vm_id, "commit its snapshot", e))
    }

    /// Pauses the VM's guest (`vm.pause`).
    pub(super) fn pause_guest(&self, vm_id: &Id, deadline: Deadline) -> Outcome {
        let socket = self.socket_path(vm_id);
        timed("pause", || {
            put(
                &socket,
                "/api/v1/vm.pause",
                None,
                deadline.capped(API_TIMEOUT),
            )
        })
        .map_err(|e| failed(vm_id, "pause its guest", e))
    }

    /// Writes the paused guest's snapshot into its `snapshot.tmp/`, made
    /// empty first and lent to its VMM while it writes: that directory.
    pub(super) fn write_snapshot(
        &self,
        taken: &Taken,
        vm_id: &Id,
        deadline: Deadline,
        say: Say<'_>,
    ) -> Outcome<PathBuf> {
        let socket = self.socket_path(vm_id);
        let work = self.store.layout().snapshot_work(vm_id);
        if !work.is_dir() {
            return Err(failed(
                vm_id,
                "save its guest",
                format!(
                    "its hypervisor was started without {} (by an older agent): stop and start it once to make it suspendable",
                    work.display()
                ),
            ));
        }
        empty_dir(&work).map_err(|e| failed(vm_id, "empty its snapshot directory", e))?;
        say("suspending: saving its memory");
        // A dense 1 GiB guest takes seconds; the pass's deadline bounds it
        // (an hour without one).
        let bound = deadline.capped(Duration::from_secs(3600));
        timed("snapshot", || {
            self.snapshot_window(vm_id, &work, taken, || {
                snapshot_to(&socket, &work, bound, say)
            })
        })
        .map_err(|e| failed(vm_id, "save its guest", e))?;
        Ok(work)
    }

    /// Runs `call` with the VM's snapshot directory `work` open to its
    /// VMM, and bounded (see `window`). A VMM that breaks the bound is
    /// killed, and what it wrote removed. An unjailed VMM runs as the
    /// agent's own user: nothing is its alone to open or close.
    fn snapshot_window(
        &self,
        vm_id: &Id,
        work: &Path,
        taken: &Taken,
        call: impl FnOnce() -> io::Result<()>,
    ) -> io::Result<()> {
        let uid = self
            .confined
            .ids
            .as_ref()
            .ok()
            .and_then(|ids| ids.get(vm_id));
        let Some(uid) = uid else {
            return call();
        };
        let budget = taken.memory_bytes.saturating_add(window::MARGIN);
        let kill = || {
            let _ = self.end_leftovers(vm_id, &|_| {});
        };
        match window::during(work, uid, budget, &kill, call)? {
            Ok(done) => done,
            Err(overrun) => {
                log::error!("VM {vm_id}: {overrun}");
                let _ = empty_dir(work);
                Err(io::Error::other(overrun.to_string()))
            }
        }
    }
}

/// Steps 3 and 4 of a suspend: `work`'s files sealed into `incoming`,
/// the manifest written, and committed to `committed` (an older snapshot
/// there discarded first, through `discarded`). What the snapshot holds of
/// the disk.
pub(super) fn seal_and_commit(
    work: &Path,
    paths: &SnapshotPaths,
    vm_dir: &Path,
    taken: &Taken,
    taken_at_ms: u64,
) -> io::Result<Saved> {
    let SnapshotPaths {
        incoming,
        committed,
        discarded,
    } = paths;
    fresh_incoming(incoming)?;
    let dir = window::open_dir(work)?;
    let mut files = Vec::new();
    let mut allocated = 0u64;
    for entry in fs::read_dir(work)? {
        let name = entry?.file_name();
        let name = name.to_str().unwrap_or("").to_owned();
        if !FILES.contains(&name.as_str()) {
            return Err(io::Error::other(format!(
                "it holds {}, which cloud-hypervisor does not write",
                crate::quote::text(&name)
            )));
        }
        let file = open_beneath(&dir, &name)?;
        let meta = file.metadata()?;
        if !meta.is_file() || meta.nlink() != 1 {
            return Err(io::Error::other(format!(
                "its {name} is not a regular file of one link"
            )));
        }
        let bound = if name == MEMORY {
            taken.memory_bytes
        } else {
            SMALL_FILE_MAX
        };
        if meta.len() > bound {
            return Err(io::Error::other(format!(
                "its {name} is {} bytes, more than its guest's could be ({bound})",
                meta.len()
            )));
        }
        std::os::unix::fs::fchown(&file, Some(0), Some(0))?;
        file.set_permissions(fs::Permissions::from_mode(0o600))?;
        file.sync_all()?;
        let moved = incoming.join(&name);
        fs::rename(work.join(&name), &moved)?;
        // The VMM could have swapped the name for another file between the
        // open and the move: what moved must be what was sealed.
        let landed = fs::symlink_metadata(&moved)?;
        if (landed.dev(), landed.ino()) != (meta.dev(), meta.ino()) {
            return Err(io::Error::other(format!(
                "its {name} was replaced while it was sealed"
            )));
        }
        allocated = allocated.saturating_add(meta.blocks().saturating_mul(512));
        files.push(FileEntry {
            name,
            bytes: meta.len(),
        });
    }
    for required in REQUIRED {
        if !files.iter().any(|f| f.name == required) {
            return Err(io::Error::other(format!("it has no {required}")));
        }
    }
    vetted_config(&incoming.join("config.json"), &taken.expected)?;
    files.sort_by(|a, b| a.name.cmp(&b.name));
    // What the paused guest wrote to its disks, on the disk before the
    // snapshot that counts on it: a power cut after the commit must not
    // leave a snapshot whose disks are older than its guest's memory.
    timed("sync disks", || {
        taken
            .disks
            .iter()
            .try_for_each(|path| File::open(path)?.sync_data())
    })?;
    let manifest = Manifest {
        format: FORMAT,
        taken_at_ms,
        files,
        disks: taken
            .disks
            .iter()
            .map(|d| DiskIdentity::of(d))
            .collect::<io::Result<_>>()?,
        clone_of: None,
    };
    commit(&manifest, incoming, committed, discarded, vm_dir)?;
    Ok(Saved {
        taken_at_ms,
        bytes: allocated,
        in_memory: false,
    })
}

/// Where a suspend moves its snapshot through (see the steps in [`super`]).
pub(super) struct SnapshotPaths {
    pub incoming: PathBuf,
    pub committed: PathBuf,
    pub discarded: PathBuf,
}
