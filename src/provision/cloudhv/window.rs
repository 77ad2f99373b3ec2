//! The one place a jailed VMM may create files: its snapshot directory,
//! and only for the length of one `vm.snapshot` call.
//!
//! Outside that call `snapshot.tmp/` is the agent's, 0700: bound into the
//! VMM's view and named by its Landlock rules, but closed to its user, so
//! a VMM its guest took over cannot use it as storage of its own (it could
//! fill the state dir's filesystem for every tenant, one file at a time,
//! each under its file-size limit).
//!
//! For the call, the directory is the VMM's, and what the VMM holds there
//! is measured every [`POLL`]: the blocks of every file in it, and of every
//! file of that filesystem its processes hold open for writing that no
//! name points to any more (written, then unlinked, to hide it). More than
//! the guest's memory and [`MARGIN`] kills the VMM at once: cloud-hypervisor
//! writes its guest's memory and two files of kilobytes, nothing else.
//! Past the budget it can have written only what it writes in one poll
//! (and each file is bounded by its file-size limit besides).
//!
//! When the call returns, the directory is the agent's again, and a VMM
//! that still holds one of its files open for writing is killed too: it
//! could go on filling a file it no longer needs a name to reach.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// How often the directory is measured while the VMM may write it.
pub(super) const POLL: Duration = Duration::from_millis(10);

/// What a snapshot may hold besides the guest's memory: its configuration
/// and device state, kilobytes for cloud-hypervisor.
pub(super) const MARGIN: u64 = 64 << 20;

/// How a VMM broke the window's rules (then it was killed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Overrun {
    /// It held `held` bytes there, over `budget`.
    Wrote { held: u64, budget: u64 },
    /// It kept `files` of the directory's files open past the call.
    KeptOpen { files: usize },
}

impl std::fmt::Display for Overrun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const MIB: u64 = 1 << 20;
        match self {
            Overrun::Wrote { held, budget } => write!(
                f,
                "its hypervisor wrote {} MiB into its snapshot directory, more than its guest's memory and {} MiB ({} MiB): killed, as a hypervisor its guest took over",
                held / MIB,
                MARGIN / MIB,
                budget / MIB
            ),
            Overrun::KeptOpen { files } => write!(
                f,
                "its hypervisor kept {files} file(s) of its snapshot directory open for writing after the snapshot: killed, as a hypervisor its guest took over"
            ),
        }
    }
}

/// What came of a window: the call's own result, or the rule it broke.
pub(super) type Outcome<T> = Result<T, Overrun>;

/// Runs `call` with `dir` open to the VMM user `uid` (the agent's again
/// once it returns, whatever happened), measuring it as the module says;
/// `kill` ends every process of the VM. `Err` is an io error of the
/// window itself (the directory could not be handed over or back).
pub(super) fn during<T>(
    dir: &Path,
    uid: u32,
    budget: u64,
    kill: &(dyn Fn() + Sync),
    call: impl FnOnce() -> T,
) -> io::Result<Outcome<T>> {
    let handle = open_dir(dir)?;
    std::os::unix::fs::fchown(&handle, Some(uid), Some(uid))?;
    let done = AtomicBool::new(false);
    let (result, over) = std::thread::scope(|s| {
        let watch = s.spawn(|| watch(dir, uid, budget, &done, kill));
        let result = call();
        done.store(true, Ordering::Relaxed);
        (result, watch.join().ok().flatten())
    });
    let closed = close(&handle);
    if let Some(over) = over {
        return Ok(Err(over));
    }
    closed?;
    let held = measure(dir, uid)?;
    if held.kept_open > 0 {
        kill();
        return Ok(Err(Overrun::KeptOpen {
            files: held.kept_open,
        }));
    }
    if held.bytes > budget {
        kill();
        return Ok(Err(Overrun::Wrote {
            held: held.bytes,
            budget,
        }));
    }
    Ok(Ok(result))
}

/// The directory at `handle` made the agent's, 0700: closed to every VMM.
pub(super) fn close(handle: &File) -> io::Result<()> {
    let me = nix::unistd::geteuid().as_raw();
    let group = nix::unistd::getegid().as_raw();
    std::os::unix::fs::fchown(handle, Some(me), Some(group))?;
    handle.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
}

/// Measures until `done`, killing the VMM (once) when it holds more than
/// `budget`.
fn watch(
    dir: &Path,
    uid: u32,
    budget: u64,
    done: &AtomicBool,
    kill: &(dyn Fn() + Sync),
) -> Option<Overrun> {
    while !done.load(Ordering::Relaxed) {
        // A measure that fails (a file gone between the listing and its
        // look) is taken again at the next poll.
        if let Ok(held) = measure(dir, uid)
            && held.bytes > budget
        {
            kill();
            return Some(Overrun::Wrote {
                held: held.bytes,
                budget,
            });
        }
        std::thread::sleep(POLL);
    }
    None
}

/// The directory at `dir`, opened without following a symlink.
pub(super) fn open_dir(dir: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_DIRECTORY | nix::libc::O_NOFOLLOW)
        .open(dir)
}

/// What the VMM user holds of a snapshot directory.
#[derive(Debug, Default, PartialEq, Eq)]
struct Held {
    /// The blocks, in bytes, of the directory's files and of the unnamed
    /// files of its filesystem the user's processes hold for writing.
    bytes: u64,
    /// How many of those files a process of the user holds for writing.
    kept_open: usize,
}

/// Measures what `uid`'s processes hold of `dir` (see [`Held`]).
fn measure(dir: &Path, uid: u32) -> io::Result<Held> {
    measure_of(dir, &super::stop::processes_of(uid))
}

/// Measures what the processes `pids` hold of `dir`.
fn measure_of(dir: &Path, pids: &[i32]) -> io::Result<Held> {
    let device = fs::symlink_metadata(dir)?.dev();
    // Each file once, by (device, inode): its allocated bytes.
    let mut named: HashMap<u64, u64> = HashMap::new();
    for entry in fs::read_dir(dir)? {
        let meta = entry?.metadata()?;
        named.insert(meta.ino(), meta.blocks().saturating_mul(512));
    }
    let mut unnamed: HashMap<u64, u64> = HashMap::new();
    let mut kept_open = 0;
    for &pid in pids {
        for meta in written_files(pid) {
            if meta.dev() != device {
                continue;
            }
            if named.contains_key(&meta.ino()) {
                kept_open += 1;
            } else if meta.nlink() == 0 {
                kept_open += 1;
                unnamed.insert(meta.ino(), meta.blocks().saturating_mul(512));
            }
        }
    }
    let bytes = named.values().chain(unnamed.values()).sum();
    Ok(Held { bytes, kept_open })
}

/// The regular files process `pid` holds open for writing. A process
/// gone, or an fd closed while looked at, is skipped.
fn written_files(pid: i32) -> Vec<fs::Metadata> {
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    fds.flatten()
        .filter_map(|fd| {
            let n: u32 = fd.file_name().to_str()?.parse().ok()?;
            // The link followed: the open file itself, named or not.
            let meta = fs::metadata(fd.path()).ok()?;
            (meta.is_file() && open_for_writing(pid, n)).then_some(meta)
        })
        .collect()
}

/// Whether `pid`'s fd `n` was opened for writing (its fdinfo's flags).
fn open_for_writing(pid: i32, n: u32) -> bool {
    let Ok(info) = fs::read_to_string(format!("/proc/{pid}/fdinfo/{n}")) else {
        return false;
    };
    info.lines()
        .find_map(|l| l.strip_prefix("flags:"))
        .and_then(|flags| u32::from_str_radix(flags.trim(), 8).ok())
        .is_some_and(|flags| flags & nix::libc::O_ACCMODE as u32 != nix::libc::O_RDONLY as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// What this test's process holds (nextest runs each test in a
    /// process of its own).
    fn measure(dir: &Path) -> io::Result<Held> {
        measure_of(dir, &[std::process::id() as i32])
    }

    #[test]
    fn a_file_in_the_directory_counts_its_blocks() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join("memory-ranges"), vec![1u8; 1 << 20]).expect("write");

        let held = measure(dir.path()).expect("measure");

        assert!(held.bytes >= 1 << 20, "{held:?}");
        assert_eq!(held.kept_open, 0);
    }

    #[test]
    fn a_file_written_then_unlinked_but_held_counts_and_is_kept_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("hidden");
        let mut file = File::create(&path).expect("create");
        fs::remove_file(&path).expect("unlink");
        file.write_all(&vec![1u8; 1 << 20]).expect("write");
        file.sync_all().expect("sync");

        let held = measure(dir.path()).expect("measure");

        assert!(held.bytes >= 1 << 20, "{held:?}");
        assert_eq!(held.kept_open, 1);
    }

    #[test]
    fn a_file_of_the_directory_held_for_reading_only_is_not_kept_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("config.json");
        fs::write(&path, b"{}").expect("write");
        let _reading = File::open(&path).expect("open");

        let held = measure(dir.path()).expect("measure");

        assert_eq!(held.kept_open, 0);
    }
}
