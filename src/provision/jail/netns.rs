//! Network namespaces made ahead, one for each VMM.
//!
//! Every VMM runs in a network namespace of its own (see
//! [`fork`](super::fork)). The kernel takes about 0.7 ms to make one, and
//! a child that made its own would spend that on the create's path,
//! between its fork and its exec (`make bench-create`, the `start` stage).
//! A thread keeps a few made ahead instead, each held by an fd; a child
//! enters one with `setns`, which costs microseconds.
//!
//! - A namespace made ahead is what the child would make: fresh, holding
//!   only a loopback that is down. Each is handed out once (its fd moves
//!   to the start that takes it) and lives as long as its VMM.
//! - The thread makes each with `unshare(CLONE_NEWNET)`, which moves only
//!   itself (a thread's network namespace is its own), and keeps it by
//!   opening `/proc/thread-self/ns/net`; the next `unshare` moves the
//!   thread on, and the namespace it left lives on in its fd. The thread
//!   touches no network of any namespace.
//! - With none ready (a burst of creates, or a host where the thread
//!   cannot make them), the child makes its own, as it always could.

use std::io;
use std::os::fd::OwnedFd;
use std::time::Duration;

use crossbeam_channel::{Receiver, SendTimeoutError, Sender, bounded};
use nix::libc;

use crate::threads::{OwnedThread, StopFlag};

/// Namespaces kept ready: a create takes one, a burst more, and the
/// thread makes the next meanwhile.
const SPARES: usize = 2;

/// How often the thread, waiting to hand one over, looks at its stop flag.
const STOP_CHECK: Duration = Duration::from_secs(1);

/// The spares and the thread that makes them (the module's steps).
pub struct SpareNetns {
    /// Dropped first: the thread's waiting hand-over then fails at once.
    spares: Receiver<OwnedFd>,
    _thread: OwnedThread,
}

impl SpareNetns {
    /// Starts the thread; `None` (said) if it cannot start.
    pub fn start() -> Option<SpareNetns> {
        let (tx, spares) = bounded(SPARES);
        match OwnedThread::spawn("netns-spare".into(), 64 * 1024, None, move |stop| {
            keep_ready(&tx, &stop)
        }) {
            Ok(thread) => Some(SpareNetns {
                spares,
                _thread: thread,
            }),
            Err(e) => {
                log::warn!(
                    "cannot start the thread that makes network namespaces ahead ({e}); each hypervisor makes its own"
                );
                None
            }
        }
    }

    /// A fresh namespace, if one is ready.
    pub fn take(&self) -> Option<OwnedFd> {
        self.spares.try_recv().ok()
    }
}

/// The thread's body: makes namespaces while there is room for them.
fn keep_ready(tx: &Sender<OwnedFd>, stop: &StopFlag) {
    while !stop.stopped() {
        let mut spare = match make() {
            Ok(fd) => fd,
            Err(e) => {
                log::warn!(
                    "cannot make a network namespace ahead ({e}); each hypervisor makes its own"
                );
                return;
            }
        };
        loop {
            match tx.send_timeout(spare, STOP_CHECK) {
                Ok(()) => break,
                Err(SendTimeoutError::Timeout(back)) if !stop.stopped() => spare = back,
                Err(SendTimeoutError::Timeout(_) | SendTimeoutError::Disconnected(_)) => return,
            }
        }
    }
}

/// A new network namespace, held by an fd (see the module's steps).
pub fn make() -> io::Result<OwnedFd> {
    // SAFETY: unshare takes flags and touches no memory; it moves only
    // this thread into the new namespace.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    std::fs::File::open("/proc/thread-self/ns/net").map(OwnedFd::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The namespace an fd or a path names, as `/proc` spells it.
    fn ns_of(path: &str) -> String {
        std::fs::read_link(path)
            .expect("a namespace link")
            .display()
            .to_string()
    }

    fn fd_path(fd: &OwnedFd) -> String {
        use std::os::fd::AsRawFd;
        format!("/proc/self/fd/{}", fd.as_raw_fd())
    }

    #[test]
    fn each_spare_is_a_namespace_of_its_own_and_none_is_the_agents() {
        let spares = SpareNetns::start().expect("the thread starts");
        let wait = crate::deadline::Deadline::after(Duration::from_secs(5));

        let mut taken = Vec::new();
        while taken.len() < 3 && !wait.expired() {
            match spares.take() {
                Some(fd) => taken.push(ns_of(&fd_path(&fd))),
                None => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        let agents = ns_of("/proc/thread-self/ns/net");

        assert_eq!(taken.len(), 3, "three spares within 5 s");
        assert!(taken.iter().all(|ns| *ns != agents), "{taken:?} {agents}");
        let distinct: std::collections::HashSet<&String> = taken.iter().collect();
        assert_eq!(distinct.len(), 3, "{taken:?}");
    }

    #[test]
    fn the_thread_making_spares_leaves_the_callers_namespace_alone() {
        let before = ns_of("/proc/thread-self/ns/net");

        let spares = SpareNetns::start().expect("the thread starts");
        let wait = crate::deadline::Deadline::after(Duration::from_secs(5));
        while spares.take().is_none() && !wait.expired() {
            std::thread::sleep(Duration::from_millis(1));
        }

        assert_eq!(ns_of("/proc/thread-self/ns/net"), before);
    }
}
