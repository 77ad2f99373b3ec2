//! Crash-safe file replacement.
//!
//! 1. Write the new content to a temp file in the same directory (same
//!    filesystem, so step 3 is atomic), named so loaders recognise and skip it.
//! 2. fsync the temp file: its bytes are on disk before its name is.
//! 3. rename over the target: readers see the old file or the new one, never
//!    a torn one.
//! 4. fsync the directory: the rename itself survives a power cut.
//!
//! A crash between 1 and 3 leaves a stray temp file and the old content;
//! [`is_temp_name`] lets loaders ignore it and [`remove_stray_temps`] sweep it.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

const TEMP_MARK: &str = ".tmp-";

/// Distinguishes temp files of concurrent writers within one process; the
/// pid distinguishes processes.
static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Replaces `path` with `bytes` durably (see the module steps). The file
/// is 0600 from its creation: state holds secrets (user-data, keys), never
/// readable by others, not even for an instant.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    replace(path, bytes, super::perms::FILE, Durability::Synced)
}

/// Steps 1 to 3 of [`write_atomic`]: the bytes durable and in place, the
/// rename itself not yet durable; the caller fsyncs the directory (step 4)
/// before anything depends on it surviving a power cut.
pub fn write_then_rename(path: &Path, bytes: &[u8]) -> io::Result<()> {
    replace(path, bytes, super::perms::FILE, Durability::Content)
}

/// Replaces `path` atomically for its readers (steps 1 and 3), 0600, for
/// a file whose torn content after a power cut is harmless because it is
/// made again before anything trusts it (a create's seed: a VM's files are
/// trusted only once its record says it was created). Its durability is
/// the returned [`Pending`]'s, for the caller to wait for where it must:
/// a create, beside its VMM's start.
pub fn write_remade(path: &Path, bytes: &[u8]) -> io::Result<Pending> {
    replace(path, bytes, super::perms::FILE, Durability::Unsynced)?;
    Ok(Pending::file(path))
}

/// Files in place whose bytes a power cut may still tear: [`Pending::sync`]
/// makes them durable (each file's data, then each of their directories).
/// For the files a create makes again at each attempt (root disk, seed),
/// which the VM's record trusts only once they are durable: made before
/// the VMM starts (it reads them from the page cache), synced while it
/// starts, and the create recorded done only after.
#[must_use = "the files are not durable until synced"]
#[derive(Debug, Default)]
pub struct Pending {
    files: Vec<std::path::PathBuf>,
    /// Files whose bytes are durable already ([`write_then_rename`]'s),
    /// only their names not yet.
    renamed: Vec<std::path::PathBuf>,
}

impl Pending {
    /// Nothing left to sync.
    pub fn none() -> Pending {
        Pending::default()
    }

    pub fn file(path: &Path) -> Pending {
        Pending {
            files: vec![path.to_path_buf()],
            renamed: Vec::new(),
        }
    }

    /// A file [`write_then_rename`] put in place: its name is what is
    /// left to make durable.
    pub fn renamed(path: &Path) -> Pending {
        Pending {
            files: Vec::new(),
            renamed: vec![path.to_path_buf()],
        }
    }

    /// Both: one sync for what two steps made.
    pub fn and(mut self, other: Pending) -> Pending {
        self.files.extend(other.files);
        self.renamed.extend(other.renamed);
        self
    }

    /// The files' data (fdatasync: their size too), then their
    /// directories, each once.
    pub fn sync(self) -> io::Result<()> {
        for file in &self.files {
            File::open(file)?.sync_data()?;
        }
        let mut dirs: Vec<&Path> = Vec::new();
        for file in self.files.iter().chain(&self.renamed) {
            let dir = file.parent().unwrap_or(Path::new("."));
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
        dirs.into_iter().try_for_each(sync_dir)
    }
}

/// Replaces `path` atomically for its readers (steps 1 and 3 only), without
/// the fsyncs that make it survive a power cut. Only for files that are not
/// state, or whose loss in a power cut is harmless: `report.json` is
/// rewritten from memory at every tick, so after a power cut a stale, empty
/// or missing one costs nothing, while two fsyncs per write would delay
/// every report a VM's change triggers (and a VMM's pidfile names a
/// process no power cut leaves alive).
pub fn replace_unsynced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    replace(path, bytes, super::perms::FILE, Durability::Unsynced)
}

/// As [`replace_unsynced`], readable by every user: for a file another
/// user's process reads (the metrics file, read by node_exporter).
pub fn replace_unsynced_public(path: &Path, bytes: &[u8]) -> io::Result<()> {
    replace(path, bytes, 0o644, Durability::Unsynced)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Durability {
    /// Content and name durable.
    Synced,
    /// Content durable, the name left to the caller.
    Content,
    Unsynced,
}

fn replace(path: &Path, bytes: &[u8], mode: u32, durability: Durability) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no directory"))?;
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let temp = dir.join(format!(
        ".{}{TEMP_MARK}{}-{n}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = write_temp(&temp, bytes, mode, durability)
        .inspect(|()| {
            if durability != Durability::Unsynced {
                crate::crash::point("record.temp-written");
            }
        })
        .and_then(|()| fs::rename(&temp, path));
    if let Err(e) = result {
        // Best effort: the temp file is garbage whether or not this works,
        // and loaders skip it either way.
        let _ = fs::remove_file(&temp);
        return Err(e);
    }
    match durability {
        Durability::Synced => sync_dir(dir),
        Durability::Content | Durability::Unsynced => Ok(()),
    }
}

fn write_temp(path: &Path, bytes: &[u8], mode: u32, durability: Durability) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)?;
    file.write_all(bytes)?;
    // Bits for others are past the process's umask (the agent's is 0077):
    // set them explicitly, and only then (no extra call per record save).
    if mode & 0o077 != 0 {
        file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))?;
    }
    match durability {
        Durability::Synced | Durability::Content => file.sync_all(),
        Durability::Unsynced => Ok(()),
    }
}

/// fsyncs a directory so the entries created, renamed or removed in it are
/// durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Whether a directory entry is a temp file of [`write_atomic`].
pub fn is_temp_name(name: &str) -> bool {
    name.starts_with('.') && name.contains(TEMP_MARK)
}

/// Removes temp files a crashed writer left in `dir`. Only safe while no
/// writer is active, i.e. at open under the state-dir lock.
pub fn remove_stray_temps(dir: &Path) -> io::Result<usize> {
    let mut removed = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name().to_str().is_some_and(is_temp_name) {
            fs::remove_file(entry.path())?;
            removed += 1;
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_content_and_leaves_no_temp() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        write_atomic(&path, b"one").expect("first write");

        write_atomic(&path, b"two").expect("second write");

        assert_eq!(fs::read(&path).expect("read"), b"two");
        let names: Vec<_> = fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f")]);
    }

    #[test]
    fn temp_names_are_recognised() {
        assert!(is_temp_name(".record.json.tmp-12-0"));
        assert!(!is_temp_name("record.json"));
        assert!(!is_temp_name(".hidden"));
    }

    #[test]
    fn sweeps_stray_temps_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join(".epoch.tmp-1-0"), b"7").expect("temp");
        fs::write(dir.path().join("epoch"), b"3").expect("real");

        let removed = remove_stray_temps(dir.path()).expect("sweep");

        assert_eq!(removed, 1);
        assert!(dir.path().join("epoch").exists());
    }
}
