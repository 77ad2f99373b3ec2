//! A guest's serial output, bounded. The hypervisor writes it to
//! `serial.log` as a plain file (`--serial file=`), at an offset that only
//! grows, and a guest can print forever. Once a second the agent looks at
//! each VM's file and, when the blocks it holds pass the cap, frees all but
//! the newest half of it (fallocate: punch a hole, keeping the size). The
//! hypervisor notices nothing; the file stays a plain file whose newest
//! output is at its end (`tail -c`), its older part reading as zeros and
//! holding no disk. So a guest's serial output takes at most the cap, plus
//! what it writes in a second, of the host's disk: a ring, in blocks.
//!
//! The VMM's own log (`hypervisor.log`, its stdout and stderr and
//! `--log-file`) is held the same way and to the same cap: a VMM its guest
//! took over could write it without end.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use nix::libc;

use crate::state::Store;
use crate::threads::OwnedThread;

/// How often each VM's serial file is looked at.
const EVERY: Duration = Duration::from_secs(1);
/// Holes are punched in whole blocks.
const BLOCK: u64 = 4096;

/// Frees all but the newest half of `cap` of the file at `path` when it
/// holds more than `cap` bytes of disk; returns the bytes freed.
pub fn bound(path: &Path, cap: u64) -> io::Result<u64> {
    // A stat, the common case: most files are far under the cap.
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.blocks() * 512 <= cap => return Ok(0),
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    }
    let file = match OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let meta = file.metadata()?;
    let held = meta.blocks() * 512;
    if !meta.is_file() || held <= cap {
        return Ok(0);
    }
    let end = meta.len().saturating_sub(cap / 2) / BLOCK * BLOCK;
    if end == 0 {
        return Ok(0);
    }
    // SAFETY: fallocate on an fd this function holds; no memory is passed.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            0,
            end as libc::off_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let now = file.metadata()?.blocks() * 512;
    Ok(held.saturating_sub(now))
}

/// The thread that bounds every VM's serial file, stopped on drop.
pub fn start(store: Arc<Store>, cap: u64) -> io::Result<OwnedThread> {
    OwnedThread::spawn("serial-bound".into(), 64 * 1024, None, move |stop| {
        let mut said_error = false;
        while !stop.stopped() {
            for vm_id in store.load_all().keys() {
                let layout = store.layout();
                for (what, path) in [
                    ("serial output", layout.serial_log(vm_id)),
                    ("hypervisor log", layout.hypervisor_log(vm_id)),
                ] {
                    match bound(&path, cap) {
                        Ok(0) => {}
                        Ok(freed) => {
                            log::debug!("VM {vm_id}: freed {freed} bytes of old {what}")
                        }
                        Err(e) if !said_error => {
                            log::warn!("VM {vm_id}: cannot bound its {what}: {e}");
                            said_error = true;
                        }
                        Err(_) => {}
                    }
                }
            }
            // A short sleep, so a drop is not kept waiting.
            for _ in 0..10 {
                if stop.stopped() {
                    return;
                }
                std::thread::sleep(EVERY / 10);
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_file_over_the_cap_keeps_its_newest_half_and_its_size() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("serial.log");
        let mut f = std::fs::File::create(&path).expect("create");
        for i in 0..4096u32 {
            writeln!(f, "line {i:08} {}", "x".repeat(240)).expect("write");
        }
        f.sync_all().expect("sync");
        let size = f.metadata().expect("meta").len();

        let freed = bound(&path, 256 << 10).expect("bound");

        let meta = std::fs::metadata(&path).expect("meta");
        let text = std::fs::read(&path).expect("read");
        assert!(freed > 0);
        assert_eq!(meta.len(), size, "the size is kept");
        assert!(
            meta.blocks() * 512 <= 256 << 10,
            "{} bytes held",
            meta.blocks() * 512
        );
        assert!(text.ends_with(format!("line {:08} {}\n", 4095, "x".repeat(240)).as_bytes()));
    }

    #[test]
    fn a_file_under_the_cap_is_left_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("serial.log");
        std::fs::write(&path, b"login: \n").expect("write");

        assert_eq!(bound(&path, 1 << 20).expect("bound"), 0);
        assert_eq!(std::fs::read(&path).expect("read"), b"login: \n");
    }
}
