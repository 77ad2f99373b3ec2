//! Waking a thread blocked in poll(2): the read end of a pipe sits in its
//! poll set, and [`Wakeup::wake`] writes a byte to the other end. Used by the
//! threads that wait on file descriptors (hypervisor exits, desired-file
//! changes) so they can be told of new work or to stop, and then joined.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::OFlag;
#[cfg(not(target_os = "linux"))]
use nix::fcntl::{FcntlArg, FdFlag, fcntl};

pub struct Wakeup {
    read: OwnedFd,
    write: OwnedFd,
}

impl Wakeup {
    /// Close-on-exec, so a hypervisor forked meanwhile never holds the
    /// pipe (atomically where pipe2 exists); non-blocking, so a wake never
    /// blocks its caller however many are pending, and a drain stops when
    /// the pipe is empty.
    pub fn new() -> io::Result<Wakeup> {
        #[cfg(target_os = "linux")]
        let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)?;
        #[cfg(not(target_os = "linux"))]
        let (read, write) = {
            let (read, write) = nix::unistd::pipe()?;
            for fd in [&read, &write] {
                fcntl(fd.as_fd(), FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
                fcntl(fd.as_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;
            }
            (read, write)
        };
        Ok(Wakeup { read, write })
    }

    /// Makes the waiting thread's poll return. A full pipe already holds a
    /// wake, so it is as good as written.
    pub fn wake(&self) {
        match nix::unistd::write(&self.write, &[1]) {
            Ok(_) | Err(Errno::EAGAIN) => {}
            Err(e) => log::debug!("wake-up pipe: {e}"),
        }
    }

    /// The end to poll for readability.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.read.as_fd()
    }

    /// Empties the pipe after a wake was seen, so the next poll blocks.
    pub fn drain(&self) {
        let mut buf = [0u8; 64];
        while matches!(nix::unistd::read(&self.read, &mut buf), Ok(n) if n > 0) {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

    fn readable(w: &Wakeup) -> bool {
        let mut fds = [PollFd::new(w.fd(), PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::ZERO).expect("poll") > 0
    }

    #[test]
    fn a_wake_makes_the_pipe_readable_until_drained() {
        let w = Wakeup::new().expect("pipe");

        w.wake();
        w.wake();
        let woken = readable(&w);
        w.drain();

        assert!(woken);
        assert!(!readable(&w));
    }
}
