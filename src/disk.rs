//! Root disks: the verified base image cloned to the VM's disk and grown to
//! its size.
//!
//! 1. Refuse a base larger than the disk asked for: growing is safe,
//!    shrinking would cut a filesystem off mid-way (permanent error).
//! 2. Clone into a temp file beside the target: by reflink (FICLONE) where
//!    the filesystem shares extents (btrfs, XFS), which is instant and takes
//!    no space; else by a sparse copy that walks the base's data extents
//!    (SEEK_DATA/SEEK_HOLE) and moves each in the kernel (copy_file_range),
//!    so holes stay holes and no byte crosses into user space.
//! 3. Grow to the asked size (a sparse extension), fsync, rename over the
//!    target, fsync the directory: a killed create never leaves a torn disk.
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
use crate::state::atomic::sync_dir;

const GIB: u64 = 1 << 30;
/// The largest piece copied between deadline checks: big enough that the
/// syscalls cost nothing next to the copy, small enough that an expired
/// pass stops within a second or so on a slow disk.
const CHUNK: u64 = 256 << 20;

// FICLONE = _IOW(0x94, 9, int): clone all of the source fd's extents.
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
    let dir = dest.parent().unwrap_or(Path::new("."));
    let temp = dir.join(format!(
        ".{}.tmp-{}-{}",
        dest.file_name()
            .map_or_else(|| "disk".into(), |n| n.to_string_lossy()),
        std::process::id(),
        TEMPS.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        // Guest data: nobody but the agent (and the hypervisor it runs)
        // reads it.
        let out = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temp)
            .map_err(io_err("create", &temp))?;
        let method = clone_into(&src, &out, base_bytes, deadline).map_err(|e| match e {
            CopyError::Deadline => DiskError::Deadline,
            CopyError::Io(source) => DiskError::Io {
                what: "copy the base image into",
                path: temp.clone(),
                source,
            },
        })?;
        out.set_len(want).map_err(io_err("grow", &temp))?;
        // fdatasync: the data and the size, which is all the rename needs.
        out.sync_data().map_err(io_err("sync", &temp))?;
        fs::rename(&temp, dest).map_err(io_err("move the new disk to", dest))?;
        sync_dir(dir).map_err(io_err("sync", dir))?;
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

fn clone_into(src: &File, out: &File, len: u64, deadline: Deadline) -> Result<Method, CopyError> {
    use std::os::fd::AsRawFd;
    // SAFETY: FICLONE takes the source fd as its argument and only reads it;
    // both fds are open for the duration of the call (borrowed above).
    match unsafe { ficlone(out.as_raw_fd(), src.as_raw_fd() as _) } {
        Ok(_) => return Ok(Method::Reflink),
        // No shared extents here (ext4, tmpfs, across filesystems): copy.
        Err(Errno::EOPNOTSUPP | Errno::EXDEV | Errno::EINVAL | Errno::ENOTTY | Errno::EPERM) => {}
        Err(e) => return Err(e.into()),
    }
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
    Ok(Method::SparseCopy)
}

/// Copies `len` bytes at `offset` from `src` to the same offset of `out`.
fn copy_range(
    src: &File,
    out: &File,
    offset: i64,
    len: u64,
    deadline: Deadline,
) -> Result<(), CopyError> {
    let (mut off_in, mut off_out) = (offset, offset);
    let mut left = len;
    while left > 0 {
        if deadline.expired() {
            return Err(CopyError::Deadline);
        }
        let n = nix::fcntl::copy_file_range(
            src.as_fd(),
            Some(&mut off_in),
            out.as_fd(),
            Some(&mut off_out),
            left.min(CHUNK) as usize,
        )?;
        if n == 0 {
            return Err(CopyError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the base image ended early",
            )));
        }
        left -= n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
