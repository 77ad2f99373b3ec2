//! Readiness for s6's notification-fd: one newline, once, then the fd is
//! closed.

use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};

use nix::fcntl::{FcntlArg, FdFlag, fcntl};

/// The readiness fd, owned by the agent from start to first report.
pub struct Readiness(OwnedFd);

impl Readiness {
    /// Takes ownership of `fd` and marks it close-on-exec at once: the
    /// supervisor hands it over inheritable, and a hypervisor forked with it
    /// open would hold the pipe after the agent closed its end, so s6 would
    /// never see the agent's readiness line followed by EOF.
    pub fn adopt(fd: i32) -> nix::Result<Readiness> {
        // SAFETY: the borrow lives only for these two calls, during which
        // nothing in the agent closes `fd`: F_GETFD only reads the
        // descriptor's flags (an fd that is not open fails with EBADF
        // instead of being touched), and F_SETFD runs only once it is shown
        // to be open.
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let flags = fcntl(borrowed, FcntlArg::F_GETFD)?;
        let flags = FdFlag::from_bits_truncate(flags) | FdFlag::FD_CLOEXEC;
        fcntl(borrowed, FcntlArg::F_SETFD(flags))?;
        // SAFETY: the fd is open (checked above) and was handed to this
        // process by its supervisor for it alone; nothing else in the agent
        // refers to it, so owning (and later closing) it is sound.
        Ok(Readiness(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Writes the newline and closes the fd.
    pub fn signal(self) {
        let mut file = std::fs::File::from(self.0);
        if let Err(e) = file.write_all(b"\n") {
            log::warn!("cannot signal readiness: {e}");
        }
    }
}
