//! Readiness, said once, after the first report is written: to s6's
//! notification-fd (one newline, then the fd is closed), or to systemd's
//! `$NOTIFY_SOCKET` (`READY=1`, for `Type=notify`).

use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};

use nix::fcntl::{FcntlArg, FdFlag, fcntl};

/// Where readiness is said, held by the agent from start to first report.
pub enum Readiness {
    /// s6's notification-fd.
    Fd(OwnedFd),
    /// systemd's notify socket: a datagram socket, and its address.
    #[cfg(target_os = "linux")]
    Systemd(
        std::os::unix::net::UnixDatagram,
        std::os::unix::net::SocketAddr,
    ),
}

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
        Ok(Readiness::Fd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// systemd's notify socket named by `path` (the value of
    /// `$NOTIFY_SOCKET`: a path, or `@name` in the abstract namespace).
    #[cfg(target_os = "linux")]
    pub fn systemd(path: &std::ffi::OsStr) -> std::io::Result<Readiness> {
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::net::{SocketAddr, UnixDatagram};
        let bytes = path.as_bytes();
        let addr = match bytes.strip_prefix(b"@") {
            Some(name) => SocketAddr::from_abstract_name(name)?,
            None => SocketAddr::from_pathname(std::path::Path::new(path))?,
        };
        Ok(Readiness::Systemd(UnixDatagram::unbound()?, addr))
    }

    /// Says the agent is ready, once: the newline (and the fd closed), or
    /// `READY=1` with the agent's pid.
    pub fn signal(self) {
        let said = match self {
            Readiness::Fd(fd) => std::fs::File::from(fd).write_all(b"\n"),
            #[cfg(target_os = "linux")]
            Readiness::Systemd(socket, addr) => {
                let message = format!("READY=1\nMAINPID={}\n", std::process::id());
                socket.send_to_addr(message.as_bytes(), &addr).map(drop)
            }
        };
        if let Err(e) = said {
            log::warn!("cannot signal readiness: {e}");
        }
    }
}
