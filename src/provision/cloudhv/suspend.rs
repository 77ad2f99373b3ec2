//! Suspend and resume on cloud-hypervisor: the guest's snapshot beside its
//! disks, and no VMM while it sleeps.
//!
//! Where (see [`Layout`](crate::state::Layout)): `snapshot.tmp/` is where
//! the VMM writes (made empty before every start, bound into its view,
//! allowed by its Landlock rules, but the agent's and closed to the VMM
//! except while it writes a snapshot: see `window`); `snapshot/` is a committed
//! snapshot, whole by construction; `.snapshot-discarded/` one on its way
//! out.
//!
//! Suspend, in order:
//! 1. The guest is paused (`vm.pause`).
//! 2. `snapshot.tmp/` is emptied (never replaced: the VMM's view holds that
//!    directory), lent to the VMM, and `vm.snapshot` writes its files
//!    there, measured as it writes; once it answers, the directory is the
//!    agent's again (a VMM that wrote past its guest's memory, or holds on
//!    to what it wrote, is killed: `window`).
//! 3. Sealed, each file: a regular file of one link and an expected name,
//!    opened without following a link, made root's, its size bounded (the
//!    memory file by the guest's memory, the rest by 64 MiB),
//!    synced, and moved to `.snapshot-new/` (root's, out of the VMM's
//!    sight), checked to be the file that was sealed. The VM's disks are
//!    synced (its guest, paused, writes nothing more to them), then the
//!    manifest (its files' sizes, the disks' identities) is written beside
//!    them and the directory synced.
//! 4. Committed: an older snapshot discarded, `.snapshot-new/` renamed to
//!    `snapshot/`, the VM's directory synced. A crash before leaves a
//!    paused VMM and no snapshot; after, a whole snapshot. `snapshot.tmp/`
//!    stays, empty: a suspend cut short is done again in it.
//! 5. The VMM stopped: asked to shut down, then signalled (a paused guest
//!    hears no power button), and whatever it forked ended.
//!
//! An error before the commit resumes the guest: a failed suspend leaves
//! the VM running.
//!
//! Resume, in order:
//! 1. A live VMM of the VM (a suspend or a resume cut short) is resumed
//!    where it stands once the engine's `spend` agrees, and any snapshot
//!    discarded.
//! 2. Else the console is moved aside (a restoring VMM truncates the
//!    serial file its snapshot names, and the operator keeps what the
//!    guest said before); the snapshot is lent to the VM's user (read-only
//!    in its view); a new VMM is started in the VM's jail and cgroups, on
//!    its own taps, told to restore it (its memory faulted in on demand
//!    where the host's userfaultfd device is given, else read whole first)
//!    with its guest paused, and awaited until its API says Paused; its
//!    account of the VM is checked (`vet`).
//! 3. `spend` is asked: the engine saves the resume's intent while the
//!    steps above run, and this is where it waits for that save. Refused,
//!    the VMM is killed before its guest ran a single instruction, and
//!    the snapshot stays whole. A crash before it leaves a paused VMM that
//!    the next agent ends at its start, the record still saying suspended
//!    (`identity`).
//! 4. `vm.resume`; once its API says Running, the snapshot is discarded:
//!    renamed aside, then removed. A VMM faulting pages in on demand keeps
//!    reading the memory file it holds open; the disk is freed when it
//!    closes it.
//!
//! Why a snapshot is believed: its manifest is the agent's own, written
//! after the seal, and checked at every look. A file of another size, a
//! missing one, or a disk that is not the one it was taken with (device,
//! inode, size, mtime, ctime: a write to a disk moves its mtime, and only
//! the kernel moves ctime) makes it unusable, never guessed at: the VM is
//! booted from its disks. What is inside the files is the VMM's: a VMM its
//! guest took over could have written anything there, and restoring it
//! gives it nothing its own jail did not.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::argv::{Launch, MemoryRestore};
use super::error::CloudHvError;
use super::process::Tracked;
use super::{CloudHypervisor, api, window};
use crate::deadline::Deadline;
use crate::error::BoxFailure;
use crate::human::unix_ms;
use crate::model::{Id, Saved, VmSpec};
use crate::provision::supervise::{self, Awaited};
use crate::provision::{SavedGuest, Say, Spend};
use crate::stages::timed;
use crate::state::atomic::{sync_dir, write_atomic};

/// The manifest's format.
const FORMAT: u32 = 1;
/// What cloud-hypervisor writes into a snapshot, and nothing else may be
/// there: `memory-ranges` only when the guest has memory to save.
const FILES: [&str; 3] = ["config.json", "state.json", "memory-ranges"];
const REQUIRED: [&str; 2] = ["config.json", "state.json"];
const MANIFEST: &str = "manifest.json";
/// A snapshot's configuration and device state are kilobytes; a VMM its
/// guest took over must not make the agent hold more.
const SMALL_FILE_MAX: u64 = 64 << 20;
/// A manifest is a few hundred bytes.
const MANIFEST_MAX: u64 = 1 << 20;
/// What cloud-hypervisor answers a snapshot of a guest whose memory it is
/// still faulting in from its last restore.
const RESTORE_IN_PROGRESS: &str = "on-demand memory restore is still in progress";
/// How long a pause or a resume may take; a snapshot gets what is left of
/// the pass.
const API_TIMEOUT: Duration = Duration::from_secs(10);

/// The agent's account of a committed snapshot (see the module's why).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Manifest {
    format: u32,
    taken_at_ms: u64,
    files: Vec<FileEntry>,
    disks: Vec<DiskIdentity>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct FileEntry {
    name: String,
    bytes: u64,
}

/// What tells a disk apart from any other and from itself changed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct DiskIdentity {
    path: PathBuf,
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl DiskIdentity {
    fn of(path: &Path) -> io::Result<DiskIdentity> {
        let m = fs::symlink_metadata(path)?;
        let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
        Ok(DiskIdentity {
            path: path.to_path_buf(),
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: ns(m.mtime(), m.mtime_nsec()),
            ctime_ns: ns(m.ctime(), m.ctime_nsec()),
        })
    }

    /// How this disk differs from `now`, in words; `None` if it does not.
    fn differs(&self, now: &DiskIdentity) -> Option<String> {
        let name = self.path.display();
        if (self.dev, self.ino) != (now.dev, now.ino) {
            return Some(format!(
                "{name} is another file than the one it was taken with"
            ));
        }
        if self.size != now.size {
            return Some(format!(
                "{name} is {} bytes, and was {} when it was taken",
                now.size, self.size
            ));
        }
        if (self.mtime_ns, self.ctime_ns) != (now.mtime_ns, now.ctime_ns) {
            return Some(format!("{name} was changed after it was taken"));
        }
        None
    }
}

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
pub(super) struct Taken {
    pub disks: Vec<PathBuf>,
    pub memory_bytes: u64,
    /// What its hypervisor was started with, which the snapshot's
    /// configuration must say too (see `vet`).
    pub expected: super::vet::Expected,
}

impl CloudHypervisor {
    /// Suspends the VM (see the module's steps).
    pub(super) fn suspend_vm(
        &self,
        taken: &Taken,
        vm_id: &Id,
        deadline: Deadline,
        say: Say<'_>,
    ) -> Result<Saved, BoxFailure> {
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
            supervise::ladder::stop_paused(
                vm_id,
                &self.vmm(vm_id, tracked),
                self.cfg.hypervisor.stop,
                deadline,
                say,
            )
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
    ) -> Result<Saved, BoxFailure> {
        let layout = self.store.layout();
        let socket = self.socket_path(vm_id);
        let work = layout.snapshot_work(vm_id);
        timed("pause", || {
            put(
                &socket,
                "/api/v1/vm.pause",
                None,
                deadline.capped(API_TIMEOUT),
            )
        })
        .map_err(|e| failed(vm_id, "pause its guest", e))?;
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

    /// Resumes the VM (see the module's steps).
    pub(super) fn resume_vm(
        &self,
        spec: &VmSpec,
        deadline: Deadline,
        spend: Spend<'_>,
    ) -> Result<(), BoxFailure> {
        let vm_id = &spec.vm_id;
        if let Some(tracked) = self.find(vm_id) {
            // One a crash left restoring may not have finished.
            self.await_state(vm_id, tracked, Awaited::PausedOrRunning, deadline)?;
            spend()?;
            if api::vm_state(&self.socket_path(vm_id), API_TIMEOUT).as_deref() == Some("Paused") {
                self.unpause(vm_id, deadline)?;
            }
            self.await_running(vm_id, tracked, deadline)?;
            return self.discard_saved(vm_id);
        }
        let layout = self.store.layout();
        let snapshot = layout.snapshot(vm_id);
        if let Err(why) = timed("check", || {
            check(&layout.snapshot_manifest(vm_id), &snapshot)
        }) {
            return Err(failed(
                vm_id,
                "restore its snapshot",
                crate::error::chain(&why),
            ));
        }
        let memory = self.memory_restore();
        let launch = Launch::Restore {
            snapshot: &snapshot,
            memory,
        };
        self.start_vmm(spec, launch, deadline, || {
            crate::crash::point("resume.restore-started");
        })?;
        self.vet_restored(vm_id)?;
        crate::crash::point("resume.restored");
        let Some(tracked) = self.find(vm_id) else {
            return Err(failed(
                vm_id,
                "run its restored guest",
                "its hypervisor is gone",
            ));
        };
        if let Err(e) = spend() {
            log::warn!(
                "VM {vm_id}: its restored guest is not run ({}); its hypervisor is stopped, its snapshot kept",
                crate::error::chain(&*e)
            );
            self.end_restored(vm_id, tracked);
            return Err(e);
        }
        let ran = self
            .unpause(vm_id, deadline)
            .and_then(|()| self.await_running(vm_id, tracked, deadline));
        if let Err(e) = ran {
            self.end_restored(vm_id, tracked);
            return Err(e);
        }
        crate::crash::point("resume.resumed");
        self.discard_saved(vm_id)?;
        crate::crash::point("resume.snapshot-discarded");
        Ok(())
    }

    /// Runs the VM's paused guest (`vm.resume`).
    fn unpause(&self, vm_id: &Id, deadline: Deadline) -> Result<(), BoxFailure> {
        timed("run", || {
            put(
                &self.socket_path(vm_id),
                "/api/v1/vm.resume",
                None,
                deadline.capped(API_TIMEOUT),
            )
        })
        .map_err(|e| failed(vm_id, "resume its paused guest", e))
    }

    /// Ends a VMM that restored the VM's snapshot, and what it forked;
    /// the snapshot is left as it is.
    pub(super) fn end_restored(&self, vm_id: &Id, tracked: Tracked) {
        supervise::ladder::kill(&self.vmm(vm_id, tracked));
        let _ = self.end_leftovers(vm_id, &|_| {});
    }

    /// A restored hypervisor's own account of its VM (`vm.info`), held to
    /// what the agent started the VM with (see `vet`); one that differs,
    /// or says nothing, is killed.
    fn vet_restored(&self, vm_id: &Id) -> Result<(), BoxFailure> {
        let expected = super::vet::Expected {
            // Its guest runs from its memory, not the file it booted.
            payload: None,
            ..self.snapshot_of(vm_id).expected
        };
        let info = api::vm_info(&self.socket_path(vm_id), API_TIMEOUT);
        let why = match info {
            Some(info) => super::vet::difference(&info["config"], &expected),
            None => Some("it does not answer vm.info".into()),
        };
        let Some(why) = why else {
            return Ok(());
        };
        log::error!("VM {vm_id}: its restored hypervisor is not the VM it was: {why}; killing it");
        match self.find(vm_id) {
            Some(tracked) => self.end_restored(vm_id, tracked),
            None => {
                let _ = self.end_leftovers(vm_id, &|_| {});
            }
        }
        Err(failed(vm_id, "check its restored hypervisor", why))
    }

    /// The VM's committed snapshot, as found now (see the module's why).
    pub(super) fn saved_guest(&self, vm_id: &Id) -> Option<SavedGuest> {
        let layout = self.store.layout();
        let snapshot = layout.snapshot(vm_id);
        if !snapshot.exists() {
            return None;
        }
        Some(match check(&layout.snapshot_manifest(vm_id), &snapshot) {
            Ok(saved) => SavedGuest::Usable(saved),
            Err(why) => SavedGuest::Unusable(crate::error::chain(&why)),
        })
    }

    /// Removes the VM's snapshot, whole or not: renamed aside first, so a
    /// crash never leaves part of one under the committed name.
    pub(super) fn discard_saved(&self, vm_id: &Id) -> Result<(), BoxFailure> {
        let layout = self.store.layout();
        discard(&layout.snapshot(vm_id), &layout.snapshot_discarded(vm_id))
            .map_err(|e| failed(vm_id, "discard its snapshot", e))
    }

    /// How a restoring VMM fills its guest's memory: on demand where the
    /// host's userfaultfd device can be given to the VMMs' group (or the
    /// VMMs are not jailed, and run as root), else by reading it whole.
    pub(super) fn memory_restore(&self) -> MemoryRestore {
        self.memory_restore_why()
            .map_or(MemoryRestore::OnDemand, |why| {
                log::warn!("resumes read the whole snapshot first: {why}");
                MemoryRestore::Copy
            })
    }

    /// Why a resume here reads the whole snapshot before its guest runs;
    /// `None` when it faults its memory in on demand. For `status` too.
    pub(super) fn memory_restore_why(&self) -> Option<String> {
        let Some(device) = &self.cfg.confinement.userfaultfd else {
            return Some("--userfaultfd-device is empty".into());
        };
        if !device.exists() {
            return Some(format!(
                "{} is missing (Linux 6.1 or later has it)",
                device.display()
            ));
        }
        let Ok(Some(ids)) = self.confined.jail() else {
            return None;
        };
        crate::provision::jail::acl::give_group_read_write(device, ids.kvm_group)
            .err()
            .map(|e| {
                format!(
                    "cannot give the hypervisors' group {} {}: {e}",
                    ids.kvm_group,
                    device.display()
                )
            })
    }
}

/// The error of a suspend or resume step `doing`.
fn failed(vm_id: &Id, doing: &'static str, why: impl std::fmt::Display) -> BoxFailure {
    CloudHvError::Suspension {
        vm_id: vm_id.clone(),
        doing,
        why: why.to_string(),
    }
    .into()
}

/// One `PUT` to the VMM's API, `body` as JSON; any 2xx is done.
fn put(socket: &Path, path: &str, body: Option<&[u8]>, deadline: Deadline) -> io::Result<()> {
    let timeout = deadline.remaining().unwrap_or(API_TIMEOUT);
    let (code, answer) = crate::provision::unix_http::request(socket, "PUT", path, body, timeout)?;
    if (200..300).contains(&code) {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "{path} answered {code}: {}",
        crate::quote::inline(&String::from_utf8_lossy(&answer))
    )))
}

/// Steps 3 and 4 of a suspend: `work`'s files sealed into `incoming`,
/// the manifest written, and committed to `committed` (an older snapshot
/// there discarded first, through `discarded`). What the snapshot holds of
/// the disk.
fn seal_and_commit(
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
    if incoming.exists() {
        fs::remove_dir_all(incoming)?;
    }
    crate::state::perms::make_dir(incoming)?;
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
        let bound = if name == "memory-ranges" {
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
    vet_config(&incoming.join("config.json"), &taken.expected)?;
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
    };
    let text = serde_json::to_vec_pretty(&manifest).map_err(io::Error::other)?;
    write_atomic(&incoming.join(MANIFEST), &text)?;
    discard(committed, discarded)?;
    fs::rename(incoming, committed)?;
    sync_dir(vm_dir)?;
    Ok(Saved {
        taken_at_ms,
        bytes: allocated,
        in_memory: false,
    })
}

/// The snapshot's `config.json`, sealed (root's now, out of the VMM's
/// sight), held to what the agent started the VM with (see `vet`).
fn vet_config(config: &Path, expected: &super::vet::Expected) -> io::Result<()> {
    let text = fs::read(config)?;
    let config: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| io::Error::other(format!("its config.json is not JSON: {e}")))?;
    match super::vet::difference(&config, expected) {
        None => Ok(()),
        Some(why) => Err(io::Error::other(format!("its config.json: {why}"))),
    }
}

/// Where a suspend moves its snapshot through (see the module's steps).
struct SnapshotPaths {
    incoming: PathBuf,
    committed: PathBuf,
    discarded: PathBuf,
}

/// `name` in the directory `dir`, opened read-only without following a
/// symlink.
fn open_beneath(dir: &File, name: &str) -> io::Result<File> {
    use std::os::fd::FromRawFd;
    let c = std::ffi::CString::new(name).map_err(io::Error::other)?;
    // SAFETY: openat on a directory fd this function borrows and a
    // NUL-terminated name; the fd it returns is owned by the File.
    let fd = unsafe {
        nix::libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            nix::libc::O_RDONLY
                | nix::libc::O_NOFOLLOW
                | nix::libc::O_CLOEXEC
                | nix::libc::O_NONBLOCK,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd from openat, owned by nothing else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Whether the committed snapshot at `snapshot` is usable: what it holds
/// of the disk, or why it is not.
fn check(manifest: &Path, snapshot: &Path) -> Result<Saved, Unusable> {
    let meta = fs::symlink_metadata(manifest).map_err(Unusable::NoManifest)?;
    if !meta.is_file() || meta.len() > MANIFEST_MAX {
        return Err(Unusable::NotOurs);
    }
    let text = fs::read(manifest).map_err(Unusable::Unreadable)?;
    let manifest: Manifest = serde_json::from_slice(&text).map_err(Unusable::Torn)?;
    if manifest.format != FORMAT {
        return Err(Unusable::Format(manifest.format));
    }
    let mut allocated = 0u64;
    for file in &manifest.files {
        let path = snapshot.join(&file.name);
        let meta = fs::symlink_metadata(&path).map_err(|source| Unusable::FileGone {
            name: file.name.clone(),
            source,
        })?;
        if !meta.is_file() || meta.len() != file.bytes {
            return Err(Unusable::FileTorn {
                name: file.name.clone(),
                bytes: meta.len(),
                taken: file.bytes,
            });
        }
        allocated = allocated.saturating_add(meta.blocks().saturating_mul(512));
    }
    for disk in &manifest.disks {
        let now = DiskIdentity::of(&disk.path).map_err(|source| Unusable::DiskGone {
            path: disk.path.clone(),
            source,
        })?;
        if let Some(why) = disk.differs(&now) {
            return Err(Unusable::OtherDisks(why));
        }
    }
    Ok(Saved {
        taken_at_ms: manifest.taken_at_ms,
        bytes: allocated,
        in_memory: false,
    })
}

/// Why a committed snapshot cannot be restored.
#[derive(Debug)]
enum Unusable {
    NoManifest(io::Error),
    /// Not a file, or larger than a manifest the agent writes.
    NotOurs,
    Unreadable(io::Error),
    Torn(serde_json::Error),
    Format(u32),
    FileGone {
        name: String,
        source: io::Error,
    },
    FileTorn {
        name: String,
        bytes: u64,
        taken: u64,
    },
    DiskGone {
        path: PathBuf,
        source: io::Error,
    },
    OtherDisks(String),
}

impl std::fmt::Display for Unusable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unusable::NoManifest(_) => f.write_str("it has no manifest"),
            Unusable::NotOurs => f.write_str("its manifest is not the agent's"),
            Unusable::Unreadable(_) => f.write_str("its manifest cannot be read"),
            Unusable::Torn(_) => f.write_str("its manifest is torn"),
            Unusable::Format(format) => write!(
                f,
                "its manifest is of format {format}, this agent writes {FORMAT}"
            ),
            Unusable::FileGone { name, .. } => write!(f, "its {name} is gone"),
            Unusable::FileTorn { name, bytes, taken } => write!(
                f,
                "torn: its {name} is {bytes} bytes, and was {taken} when it was taken"
            ),
            Unusable::DiskGone { path, .. } => {
                write!(f, "it was taken with {}, which is gone", path.display())
            }
            Unusable::OtherDisks(why) => write!(f, "it was taken with other disks: {why}"),
        }
    }
}

impl std::error::Error for Unusable {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Unusable::NoManifest(e)
            | Unusable::Unreadable(e)
            | Unusable::FileGone { source: e, .. }
            | Unusable::DiskGone { source: e, .. } => Some(e),
            Unusable::Torn(e) => Some(e),
            _ => None,
        }
    }
}

/// Removes every entry of the directory `dir` (never following a
/// symlink), and keeps the directory.
fn empty_dir(dir: &Path) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            fs::remove_dir_all(entry.path())?;
        } else {
            fs::remove_file(entry.path())?;
        }
    }
    Ok(())
}

/// `path` made an empty directory of the agent's, 0700, whatever was
/// there: where a VMM writes its snapshot, while the agent lets it.
pub(super) fn fresh_work_dir(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        // Kept, emptied: a directory made once per VM, not once per boot.
        Ok(m) if m.is_dir() => empty_dir(path)?,
        Ok(_) => {
            fs::remove_file(path)?;
            crate::state::perms::make_dir(path)?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => crate::state::perms::make_dir(path)?,
        Err(e) => return Err(e),
    }
    window::close(&window::open_dir(path)?)
}

/// The committed snapshot made readable by the VM's user `uid`, who
/// restores it (read-only in its view: it can change nothing of it).
pub(super) fn lend(snapshot: &Path, uid: u32) -> io::Result<()> {
    let dir = window::open_dir(snapshot)?;
    std::os::unix::fs::fchown(&dir, Some(uid), Some(uid))?;
    for entry in fs::read_dir(snapshot)? {
        let name = entry?.file_name();
        let file = open_beneath(&dir, &name.to_string_lossy())?;
        std::os::unix::fs::fchown(&file, Some(uid), Some(uid))?;
    }
    Ok(())
}

/// Removes `snapshot` by way of `discarded` (a leftover there first).
fn discard(snapshot: &Path, discarded: &Path) -> io::Result<()> {
    if discarded.exists() {
        fs::remove_dir_all(discarded)?;
    }
    match fs::rename(snapshot, discarded) {
        Ok(()) => fs::remove_dir_all(discarded),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}
