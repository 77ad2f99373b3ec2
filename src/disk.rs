//! Root disks: the verified base image cloned to the VM's disk and grown to
//! its size.
//!
//! 1. Refuse a base larger than the disk asked for: growing is safe,
//!    shrinking would cut a filesystem off mid-way (permanent error).
//! 2. Clone into a temp file beside the target: by reflink where the
//!    filesystem shares extents (FICLONE on btrfs and XFS, clonefile(2) on
//!    APFS), which is instant and takes no space; else by a sparse copy
//!    that walks the base's data extents (SEEK_DATA/SEEK_HOLE) and copies
//!    each (in the kernel with copy_file_range on Linux), so holes stay
//!    holes.
//! 3. Grow to the asked size (a sparse extension) and rename over the
//!    target: a killed agent never leaves a torn disk (the rename is
//!    atomic). Its durability is the caller's to wait for
//!    ([`crate::state::atomic::Pending`]): a create syncs it while its VMM
//!    starts, and records the VM created only after. After a power cut a
//!    disk may be found torn, but only by a create that had not finished
//!    (a root disk is made only while its VM's record says it is being
//!    created), which makes it again.
//!
//! Root disks only. Volumes never pass through here: the rebuild path
//! recreates root disks, and a volume must outlive that.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::errno::Errno;
use nix::unistd::{Whence, lseek};

use crate::deadline::Deadline;
use crate::error::Failure;

const GIB: u64 = 1 << 30;
/// The largest piece copied between deadline checks: big enough that the
/// syscalls cost nothing next to the copy, small enough that an expired
/// pass stops within a second or so on a slow disk.
#[cfg(target_os = "linux")]
const CHUNK: u64 = 256 << 20;
/// Elsewhere a chunk goes through a buffer of this process's: 1 MiB.
#[cfg(not(target_os = "linux"))]
const CHUNK: u64 = 1 << 20;

// FICLONE = _IOW(0x94, 9, int): clone all of the source fd's extents.
#[cfg(target_os = "linux")]
nix::ioctl_write_int!(ficlone, 0x94, 9);

/// How a disk was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Reflink,
    SparseCopy,
}

#[derive(Debug)]
pub enum DiskError {
    WouldShrink {
        base: PathBuf,
        base_bytes: u64,
        disk_gb: u64,
    },
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    Deadline,
}

impl fmt::Display for DiskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DiskError::WouldShrink {
                base,
                base_bytes,
                disk_gb,
            } => write!(
                f,
                "the base image {} is {:.1} GiB and the disk asked for is {disk_gb} GiB; that would shrink the disk, so ask for at least {} GiB",
                base.display(),
                *base_bytes as f64 / GIB as f64,
                base_bytes.div_ceil(GIB)
            ),
            DiskError::Io { what, path, .. } => write!(f, "cannot {what} {}", path.display()),
            DiskError::Deadline => {
                f.write_str("the pass deadline passed while copying the root disk")
            }
        }
    }
}

impl std::error::Error for DiskError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DiskError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl Failure for DiskError {
    fn is_permanent(&self) -> bool {
        matches!(self, DiskError::WouldShrink { .. })
    }
}

static TEMPS: AtomicU64 = AtomicU64::new(0);

/// Makes `dest` a clone of `base` grown to `disk_gb` GiB (see the module
/// steps). Replaces `dest` atomically.
pub fn prepare(
    base: &Path,
    dest: &Path,
    disk_gb: u64,
    deadline: Deadline,
) -> Result<Method, DiskError> {
    let io_err = |what, path: &Path| {
        let path = path.to_path_buf();
        move |source| DiskError::Io { what, path, source }
    };
    let want = disk_gb.saturating_mul(GIB);
    let src = File::open(base).map_err(io_err("open the base image", base))?;
    let base_bytes = src
        .metadata()
        .map_err(io_err("stat the base image", base))?
        .len();
    if base_bytes > want {
        return Err(DiskError::WouldShrink {
            base: base.to_path_buf(),
            base_bytes,
            disk_gb,
        });
    }
    place(&src, base, dest, base_bytes, want, deadline)
}

/// Makes `dest` a copy of `src`, of its size (by reflink where the
/// filesystem shares extents, else a sparse copy), replacing `dest`
/// atomically: how a clone takes its template's memory. Not yet durable.
pub fn copy(src: &Path, dest: &Path, deadline: Deadline) -> Result<Method, DiskError> {
    let from = File::open(src).map_err(|source| DiskError::Io {
        what: "open",
        path: src.to_path_buf(),
        source,
    })?;
    let bytes = from
        .metadata()
        .map_err(|source| DiskError::Io {
            what: "stat",
            path: src.to_path_buf(),
            source,
        })?
        .len();
    place(&from, src, dest, bytes, bytes, deadline)
}

/// `src` (at `base`, of `base_bytes`) cloned into a temp file beside
/// `dest`, grown to `want` bytes and renamed over `dest`.
fn place(
    src: &File,
    base: &Path,
    dest: &Path,
    base_bytes: u64,
    want: u64,
    deadline: Deadline,
) -> Result<Method, DiskError> {
    let io_err = |what, path: &Path| {
        let path = path.to_path_buf();
        move |source| DiskError::Io { what, path, source }
    };
    let dir = dest.parent().unwrap_or(Path::new("."));
    let temp = dir.join(format!(
        ".{}.tmp-{}-{}",
        dest.file_name()
            .map_or_else(|| "disk".into(), |n| n.to_string_lossy()),
        std::process::id(),
        TEMPS.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let (out, method) =
            clone_to(src, base, &temp, base_bytes, deadline).map_err(|e| match e {
                CopyError::Deadline => DiskError::Deadline,
                CopyError::Io(source) => DiskError::Io {
                    what: "copy the base image into",
                    path: dest.to_path_buf(),
                    source,
                },
            })?;
        // Errors name the disk, not its temp file: the name an operator
        // knows, and the same from one attempt to the next.
        out.set_len(want).map_err(io_err("grow", dest))?;
        fs::rename(&temp, dest).map_err(io_err("move the new disk to", dest))?;
        Ok(method)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result
}

enum CopyError {
    Deadline,
    Io(io::Error),
}

impl From<Errno> for CopyError {
    fn from(e: Errno) -> CopyError {
        CopyError::Io(io::Error::from(e))
    }
}

/// A new file at `temp` (absent before) holding `base`'s bytes, opened
/// for writing. Guest data: nobody but the agent (and the hypervisor it
/// runs) reads it.
fn clone_to(
    src: &File,
    base: &Path,
    temp: &Path,
    len: u64,
    deadline: Deadline,
) -> Result<(File, Method), CopyError> {
    let create = || {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(temp)
            .map_err(CopyError::Io)
    };
    #[cfg(target_os = "macos")]
    {
        if clonefile(base, temp)? {
            let out = OpenOptions::new()
                .write(true)
                .open(temp)
                .map_err(CopyError::Io)?;
            out.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))
                .map_err(CopyError::Io)?;
            return Ok((out, Method::Reflink));
        }
    }
    let out = create()?;
    #[cfg(target_os = "linux")]
    {
        let _ = base;
        if reflink(src, &out)? {
            return Ok((out, Method::Reflink));
        }
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    let _ = base;
    sparse_copy(src, &out, len, deadline)?;
    Ok((out, Method::SparseCopy))
}

/// FICLONE: `Ok(false)` where the filesystem shares no extents.
#[cfg(target_os = "linux")]
fn reflink(src: &File, out: &File) -> Result<bool, CopyError> {
    use std::os::fd::AsRawFd;
    // SAFETY: FICLONE takes the source fd as its argument and only reads it;
    // both fds are open for the duration of the call (borrowed above).
    match unsafe { ficlone(out.as_raw_fd(), src.as_raw_fd() as _) } {
        Ok(_) => Ok(true),
        // No shared extents here (ext4, tmpfs, across filesystems): copy.
        Err(Errno::EOPNOTSUPP | Errno::EXDEV | Errno::EINVAL | Errno::ENOTTY | Errno::EPERM) => {
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}

/// clonefile(2) (APFS; the destination must not exist, on the same
/// volume): `Ok(false)` where it cannot clone.
#[cfg(target_os = "macos")]
fn clonefile(base: &Path, temp: &Path) -> Result<bool, CopyError> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|_| {
            CopyError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a NUL in a path",
            ))
        })
    };
    let (from, to) = (c(base)?, c(temp)?);
    // SAFETY: both are valid NUL-terminated paths for the call.
    if unsafe { nix::libc::clonefile(from.as_ptr(), to.as_ptr(), 0) } == 0 {
        return Ok(true);
    }
    match Errno::last() {
        Errno::ENOTSUP | Errno::EXDEV => Ok(false),
        e => Err(e.into()),
    }
}

/// Copies `src`'s data extents (its holes stay holes) into `out`.
fn sparse_copy(src: &File, out: &File, len: u64, deadline: Deadline) -> Result<(), CopyError> {
    let mut pos: i64 = 0;
    let end = len as i64;
    while pos < end {
        if deadline.expired() {
            return Err(CopyError::Deadline);
        }
        let data = match lseek(src.as_fd(), pos, Whence::SeekData) {
            Ok(d) => d,
            Err(Errno::ENXIO) => break, // only a hole is left
            Err(e) => return Err(e.into()),
        };
        let hole = lseek(src.as_fd(), data, Whence::SeekHole)?.min(end);
        copy_range(src, out, data, (hole - data) as u64, deadline)?;
        pos = hole;
    }
    Ok(())
}

/// Copies `len` bytes at `offset` from `src` to the same offset of `out`,
/// a chunk at a time, giving up at `deadline`.
fn copy_range(
    src: &File,
    out: &File,
    offset: i64,
    len: u64,
    deadline: Deadline,
) -> Result<(), CopyError> {
    let (mut at, end) = (offset as u64, offset as u64 + len);
    let mut buf = Vec::new();
    while at < end {
        if deadline.expired() {
            return Err(CopyError::Deadline);
        }
        let want = (end - at).min(CHUNK) as usize;
        let n = copy_chunk(src, out, at, want, &mut buf)?;
        if n == 0 {
            return Err(CopyError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the base image ended early",
            )));
        }
        at += n as u64;
    }
    Ok(())
}

/// Copies up to `want` bytes at `at` from `src` to `out`, in the kernel
/// (copy_file_range: no byte through this process, and a reflink or a
/// server-side copy where the filesystem has one); how many it copied.
#[cfg(target_os = "linux")]
fn copy_chunk(src: &File, out: &File, at: u64, want: usize, _: &mut Vec<u8>) -> CopyResult {
    let (mut off_in, mut off_out) = (at as i64, at as i64);
    let copied = nix::fcntl::copy_file_range(
        src.as_fd(),
        Some(&mut off_in),
        out.as_fd(),
        Some(&mut off_out),
        want,
    )?;
    Ok(copied)
}

/// Copies up to `want` bytes at `at` from `src` to `out` through `buf`
/// (no copy_file_range here); how many it copied.
#[cfg(not(target_os = "linux"))]
fn copy_chunk(src: &File, out: &File, at: u64, want: usize, buf: &mut Vec<u8>) -> CopyResult {
    use std::os::unix::fs::FileExt;
    buf.resize(want, 0);
    let n = src.read_at(&mut buf[..want], at).map_err(CopyError::Io)?;
    out.write_all_at(&buf[..n], at).map_err(CopyError::Io)?;
    Ok(n)
}

/// What a chunk's copy gives: the bytes copied.
type CopyResult = Result<usize, CopyError>;

#[cfg(test)]
mod tests {
    use super::*;

    /// On a Mac (`make mac-check`): APFS clones, so a root disk costs no
    /// space until the guest writes.
    #[cfg(target_os = "macos")]
    #[test]
    fn a_root_disk_on_apfs_is_a_clone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().join("base.raw");
        std::fs::write(&base, vec![0x5a; 4 << 20]).expect("base");

        let method =
            prepare(&base, &dir.path().join("disk.raw"), 1, Deadline::NONE).expect("prepare");

        assert_eq!(method, Method::Reflink);
    }

    #[test]
    fn shrinking_is_permanent_and_says_how_big_to_ask() {
        let e = DiskError::WouldShrink {
            base: "/img".into(),
            base_bytes: 3 * GIB + 1,
            disk_gb: 2,
        };

        assert!(e.is_permanent());
        assert!(e.to_string().contains("at least 4 GiB"), "{e}");
    }
}
