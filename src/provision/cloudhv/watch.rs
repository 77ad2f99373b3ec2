//! Knowing the moment a hypervisor exits.
//!
//! A VMM this agent forked is its child: a reaper thread blocked in
//! waitpid sees it exit (see `spawn.rs`). A VMM adopted after an agent
//! restart is not, and waitpid cannot wait for it. For those, one `vmm-exits`
//! thread polls a pidfd per VMM (pidfd_open(2), Linux 5.3: readable once the
//! process has exited), plus a wake-up pipe for new VMMs and for stopping.
//! On a kernel without pidfds it falls back to checking each adopted VMM's
//! liveness once a second, which still beats waiting for the tick.
//!
//! Either way the exit goes to the registered [`ExitListener`](crate::provision::ExitListener); whether it
//! needs anything done is the engine's decision (a stop it asked for is an
//! exit too).

use std::collections::HashMap;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use parking_lot::Mutex;

use super::process::Tracked;
use crate::model::Id;
use crate::provision::supervise::Listener;
use crate::threads::{OwnedThread, StopFlag, Wakeup};

/// How often VMMs without a pidfd are checked.
const FALLBACK_POLL_MS: u16 = 1000;

struct Watched {
    vm_id: Id,
    tracked: Tracked,
    /// `None` where pidfds are not available: checked by polling.
    pidfd: Option<Arc<OwnedFd>>,
}

struct Shared {
    watched: Mutex<HashMap<i32, Watched>>,
    wakeup: Arc<Wakeup>,
    listener: Listener,
}

/// The `vmm-exits` thread; stopped and joined on drop.
pub(super) struct ExitWatch {
    shared: Arc<Shared>,
    _thread: OwnedThread,
}

impl ExitWatch {
    pub(super) fn start(listener: Listener) -> std::io::Result<ExitWatch> {
        let shared = Arc::new(Shared {
            watched: Mutex::new(HashMap::new()),
            wakeup: Arc::new(Wakeup::new()?),
            listener,
        });
        let thread = {
            let shared = Arc::clone(&shared);
            OwnedThread::spawn(
                "vmm-exits".into(),
                64 * 1024,
                Some(Arc::clone(&shared.wakeup)),
                move |stop| run(&shared, &stop),
            )?
        };
        Ok(ExitWatch {
            shared,
            _thread: thread,
        })
    }

    /// Watches an adopted VMM until it exits.
    pub(super) fn watch(&self, vm_id: &Id, tracked: Tracked) {
        let pidfd = pidfd_open(tracked.pid);
        // Checked after the pidfd is open: a pid reused since `tracked` was
        // read would otherwise be watched in the VM's name. Once open, the
        // pidfd names that one process whatever happens to the pid.
        if !tracked.alive() {
            self.shared.listener.exited(vm_id);
            return;
        }
        self.shared.watched.lock().insert(
            tracked.pid,
            Watched {
                vm_id: vm_id.clone(),
                tracked,
                pidfd: pidfd.map(Arc::new),
            },
        );
        self.shared.wakeup.wake();
    }
}

fn run(shared: &Shared, stop: &StopFlag) {
    while !stop.stopped() {
        let (fds, polled): (Vec<(i32, Arc<OwnedFd>)>, bool) = {
            let watched = shared.watched.lock();
            let fds = watched
                .iter()
                .filter_map(|(pid, w)| w.pidfd.clone().map(|fd| (*pid, fd)))
                .collect();
            (fds, watched.values().any(|w| w.pidfd.is_none()))
        };
        let mut set = Vec::with_capacity(fds.len() + 1);
        set.push(PollFd::new(shared.wakeup.fd(), PollFlags::POLLIN));
        set.extend(
            fds.iter()
                .map(|(_, fd)| PollFd::new(fd.as_fd(), PollFlags::POLLIN)),
        );
        let timeout = if polled {
            PollTimeout::from(FALLBACK_POLL_MS)
        } else {
            PollTimeout::NONE
        };
        if let Err(e) = poll(&mut set, timeout) {
            if e != nix::errno::Errno::EINTR {
                log::error!(
                    "watching adopted hypervisors: poll failed: {e}; exits are seen at the tick"
                );
                return;
            }
            continue;
        }
        if set[0].revents().is_some_and(|r| !r.is_empty()) {
            shared.wakeup.drain();
        }
        let mut gone: Vec<i32> = fds
            .iter()
            .zip(&set[1..])
            .filter(|(_, p)| p.revents().is_some_and(|r| !r.is_empty()))
            .map(|((pid, _), _)| *pid)
            .collect();
        if polled {
            let watched = shared.watched.lock();
            gone.extend(
                watched
                    .iter()
                    .filter(|(_, w)| w.pidfd.is_none() && !w.tracked.alive())
                    .map(|(pid, _)| *pid),
            );
        }
        for pid in gone {
            let removed = shared.watched.lock().remove(&pid);
            if let Some(w) = removed {
                log::info!("VM {}: adopted hypervisor {pid} exited", w.vm_id);
                shared.listener.exited(&w.vm_id);
            }
        }
    }
}

/// A pidfd for `pid`, or `None` where the kernel has none (before 5.3) or
/// the process is already gone.
fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags by value and returns a new
    // file descriptor or -1; nothing is read from or written to memory.
    let fd = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the syscall returned a new descriptor that nothing else owns.
    Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn an_adopted_process_that_exits_is_reported() {
        let (tx, rx) = crossbeam_channel::unbounded();
        let listener = Listener::default();
        listener.set(Arc::new(move |id: &Id| {
            let _ = tx.send(id.clone());
        }));
        let watch = ExitWatch::start(listener).expect("watch");
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let pid = child.id() as i32;
        let tracked = Tracked::of(pid).expect("tracked");
        let vm = Id::parse("vm-1").expect("id");
        watch.watch(&vm, tracked);

        child.kill().expect("kill");
        child.wait().expect("reap");

        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(vm));
    }
}
