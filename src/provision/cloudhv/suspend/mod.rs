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
//!    in its view; its memory stays root's, read through an ACL entry for
//!    that user, taken back once the VMM below has restored it, or at the
//!    next agent's start after a crash: see `lend`); a new VMM is started
//!    in the VM's jail and cgroups, on
//!    its own taps, told to restore it (its memory faulted in on demand
//!    where the host's userfaultfd device is given, else read whole first;
//!    a clone's copy always read whole: see `restore`) with its guest
//!    paused, and awaited until its API says Paused; its
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
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::error::CloudHvError;
use super::{CloudHypervisor, window};
use crate::deadline::Deadline;
use crate::error::{BoxFailure, Outcome};
use crate::model::{Id, Saved};
use crate::provision::SavedGuest;

mod clone;
mod restore;
mod save;
mod template;

pub(super) use save::Taken;

/// The manifest's format.
const FORMAT: u32 = 1;
/// What cloud-hypervisor writes into a snapshot, and nothing else may be
/// there: `memory-ranges` only when the guest has memory to save.
const FILES: [&str; 3] = ["config.json", "state.json", MEMORY];
/// The guest's memory, the one large file of a snapshot.
const MEMORY: &str = "memory-ranges";
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
    /// The template a clone's copy was taken from (see [`clone`]): its
    /// restore reads the memory whole ([`CloudHypervisor::resume_vm`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    clone_of: Option<String>,
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

impl CloudHypervisor {
    /// The VM's committed snapshot, as found now (see the module's why).
    pub(super) fn saved_guest(&self, vm_id: &Id) -> Option<SavedGuest> {
        let layout = self.store.layout();
        found(&layout.snapshot(vm_id), &layout.snapshot_manifest(vm_id))
    }

    /// The running template's committed snapshot, as found now.
    pub(super) fn template_guest(&self, vm_id: &Id) -> Option<SavedGuest> {
        let layout = self.store.layout();
        found(&layout.template(vm_id), &layout.template_manifest(vm_id))
    }

    /// Removes the VM's snapshot, whole or not: renamed aside first, so a
    /// crash never leaves part of one under the committed name.
    pub(super) fn discard_saved(&self, vm_id: &Id) -> Outcome {
        let layout = self.store.layout();
        discard(&layout.snapshot(vm_id), &layout.snapshot_discarded(vm_id))
            .map_err(|e| failed(vm_id, "discard its snapshot", e))
    }
}

/// The snapshot committed at `snapshot`, as its `manifest` finds it.
fn found(snapshot: &Path, manifest: &Path) -> Option<SavedGuest> {
    if !snapshot.exists() {
        return None;
    }
    Some(match check(manifest, snapshot) {
        Ok(saved) => SavedGuest::Usable(saved),
        Err(why) => SavedGuest::Unusable(crate::error::chain(&why)),
    })
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
    checked(manifest, snapshot).map(|(saved, _)| saved)
}

/// [`check`], with the manifest it read.
fn checked(manifest: &Path, snapshot: &Path) -> Result<(Saved, Manifest), Unusable> {
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
    let saved = Saved {
        taken_at_ms: manifest.taken_at_ms,
        bytes: allocated,
        in_memory: false,
    };
    Ok((saved, manifest))
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
/// restores it (read-only in its view: it can change nothing of it): its
/// small files made `uid`'s, its memory left root's and read by `uid`
/// through an ACL entry, taken back once its restore has opened it
/// ([`take_back`]). A memory file is root's from its seal to its removal,
/// whoever reads it: a clone's is a link to its template's (see `clone`),
/// so no VMM ever owns a file another VM's restore reads.
pub(super) fn lend(snapshot: &Path, uid: u32) -> io::Result<()> {
    let dir = window::open_dir(snapshot)?;
    std::os::unix::fs::fchown(&dir, Some(uid), Some(uid))?;
    for entry in fs::read_dir(snapshot)? {
        let name = entry?.file_name();
        let file = open_beneath(&dir, &name.to_string_lossy())?;
        if name == MEMORY && file.metadata()?.uid() == 0 {
            crate::provision::jail::acl::grant_user_read(&file, uid)?;
        } else {
            std::os::unix::fs::fchown(&file, Some(uid), Some(uid))?;
        }
    }
    Ok(())
}

/// Takes back the read of `snapshot`'s memory that [`lend`] gave `uid`:
/// once its VMM has restored it (or failed to), the file is open in it or
/// not needed. Whether there was an entry to take.
pub(super) fn take_back(snapshot: &Path, uid: u32) -> io::Result<bool> {
    match memory_of(snapshot)? {
        Some(file) => crate::provision::jail::acl::revoke_user(&file, uid),
        None => Ok(false),
    }
}

/// Takes back every read [`lend`] gave of a snapshot's memory (a crash
/// between a lend and its take-back leaves one): each VM's snapshot and
/// template save in `layout`, at the agent's start, once VMMs whose
/// restore a crash cut short are stopped. A VMM that restored has its
/// memory open, or read it whole. What was taken, for the log.
pub(super) fn take_back_all(layout: &crate::state::Layout) -> Vec<String> {
    let mut taken = Vec::new();
    let Ok(entries) = fs::read_dir(layout.vms()) else {
        return taken;
    };
    let vms = entries
        .flatten()
        .filter_map(|e| Id::parse(&e.file_name().to_string_lossy()).ok());
    for vm_id in vms {
        for snapshot in [layout.snapshot(&vm_id), layout.template(&vm_id)] {
            let Ok(Some(file)) = memory_of(&snapshot) else {
                continue;
            };
            let memory = snapshot.join(MEMORY);
            let users = crate::provision::jail::acl::named_users(&file).unwrap_or_default();
            for uid in users {
                match crate::provision::jail::acl::revoke_user(&file, uid) {
                    Ok(_) => taken.push(format!(
                        "took back user {uid}'s read of {}",
                        memory.display()
                    )),
                    Err(e) => log::warn!(
                        "cannot take back user {uid}'s read of {}: {e}",
                        memory.display()
                    ),
                }
            }
        }
    }
    taken
}

/// `snapshot`'s memory file, opened without following a link; `None`
/// when it has none.
fn memory_of(snapshot: &Path) -> io::Result<Option<File>> {
    let dir = window::open_dir(snapshot)?;
    match open_beneath(&dir, MEMORY) {
        Ok(file) => Ok(Some(file)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// A snapshot's sealed `config.json` (root's, out of any VMM's sight),
/// read whole (it is kilobytes; a larger one is not the agent's) and held
/// to the VM `expected` says (see `vet`).
fn vetted_config(path: &Path, expected: &super::vet::Expected) -> io::Result<serde_json::Value> {
    let meta = fs::symlink_metadata(path)?;
    if !meta.is_file() || meta.len() > SMALL_FILE_MAX {
        return Err(io::Error::other(format!(
            "{} is not a config.json the agent sealed",
            path.display()
        )));
    }
    let text = fs::read(path)?;
    let config = serde_json::from_slice(&text)
        .map_err(|e| io::Error::other(format!("its config.json is not JSON: {e}")))?;
    match super::vet::difference(&config, expected) {
        None => Ok(config),
        Some(why) => Err(io::Error::other(format!("its config.json: {why}"))),
    }
}

/// `incoming` made a new empty directory of the agent's, whatever a
/// commit cut short left there.
fn fresh_incoming(incoming: &Path) -> io::Result<()> {
    if incoming.exists() {
        fs::remove_dir_all(incoming)?;
    }
    crate::state::perms::make_dir(incoming)
}

/// Commits the snapshot whose files are in `incoming`: `manifest` written
/// beside them, an older one at `committed` discarded (by way of
/// `discarded`), `incoming` renamed to `committed`, and the VM's
/// directory `vm_dir` synced.
fn commit(
    manifest: &Manifest,
    incoming: &Path,
    committed: &Path,
    discarded: &Path,
    vm_dir: &Path,
) -> io::Result<()> {
    let text = serde_json::to_vec_pretty(manifest).map_err(io::Error::other)?;
    crate::state::atomic::write_atomic(&incoming.join(MANIFEST), &text)?;
    discard(committed, discarded)?;
    fs::rename(incoming, committed)?;
    crate::state::atomic::sync_dir(vm_dir)
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
