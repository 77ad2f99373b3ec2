//! The VMMs this agent forked, until each is reaped.
//!
//! 1. [`Children::reap`] records the child (VM → pid) and starts its
//!    reaper, a thread `reap-<vm>` blocked until the child exits.
//! 2. On exit the reaper keeps the status (the failure reason says how the
//!    VMM ended), forgets the child, and only then tells the [`Listener`]:
//!    a stop waiting for the child to be reaped is free to return before
//!    the engine hears of the exit.
//! 3. The status stays until the VM boots again or is destroyed.
//!
//! Reapers are detached on purpose ([`Outlives::TheChild`]): each ends when
//! its child does, which may be long after the agent stopped asking (a VMM
//! outlives a stop of the agent's engine), and joining one would wait for
//! a guest.

use std::collections::HashMap;
use std::process::ExitStatus;
use std::sync::Arc;

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use parking_lot::Mutex;

use super::{SuperviseError, describe};
use crate::model::Id;
use crate::provision::ExitListener;
use crate::threads::{Outlives, detached};

/// A reaper waits on nothing deeper than waitpid.
const REAPER_STACK: usize = 64 * 1024;

/// Who is told of exits: set once by the engine, read by every reaper (and
/// by a backend's watch on VMMs it adopted) at the moment of an exit.
#[derive(Clone, Default)]
pub struct Listener(Arc<Mutex<Option<ExitListener>>>);

impl Listener {
    pub fn set(&self, listener: ExitListener) {
        *self.0.lock() = Some(listener);
    }

    pub fn exited(&self, vm_id: &Id) {
        let listener = self.0.lock().clone();
        if let Some(listener) = listener {
            listener(vm_id);
        }
    }
}

/// The children of this agent, their reapers, and how each ended.
pub struct Children {
    /// What the VMM is called in log lines ("hypervisor", "vfkit").
    program: &'static str,
    /// VM → pid of its child not reaped yet.
    unreaped: Arc<Mutex<HashMap<Id, u32>>>,
    /// How each VM's last child ended, until it boots again.
    exits: Arc<Mutex<HashMap<Id, ExitStatus>>>,
    listener: Listener,
}

impl Children {
    pub fn new(program: &'static str) -> Children {
        Children {
            program,
            unreaped: Arc::default(),
            exits: Arc::default(),
            listener: Listener::default(),
        }
    }

    /// Who is told of exits, for a backend's own watch on adopted VMMs.
    pub fn listener(&self) -> &Listener {
        &self.listener
    }

    /// Starts reaping `pid`, the VM's newly forked child: `wait` blocks
    /// until it exits and returns its status (`None` if it could not be
    /// had). A child whose reaper cannot start is killed and reaped here:
    /// unwatched, it would be a zombie the engine never hears of.
    pub fn reap(
        &self,
        vm_id: &Id,
        pid: u32,
        wait: impl FnOnce() -> Option<ExitStatus> + Send + 'static,
    ) -> Result<(), SuperviseError> {
        self.exits.lock().remove(vm_id);
        self.unreaped.lock().insert(vm_id.clone(), pid);
        let (unreaped, exits, listener, id, program) = (
            Arc::clone(&self.unreaped),
            Arc::clone(&self.exits),
            self.listener.clone(),
            vm_id.clone(),
            self.program,
        );
        let reaper = detached(
            format!("reap-{vm_id}"),
            REAPER_STACK,
            Outlives::TheChild,
            move || {
                if let Some(status) = wait() {
                    log::info!("VM {id}: {program} {pid} exited ({})", describe(status));
                    exits.lock().insert(id.clone(), status);
                }
                forget_child(&unreaped, &id, pid);
                listener.exited(&id);
            },
        );
        if let Err(source) = reaper {
            forget_child(&self.unreaped, vm_id, pid);
            let raw = Pid::from_raw(pid as i32);
            // Still unreaped, so the pid is still this child's.
            let _ = nix::sys::signal::kill(raw, Signal::SIGKILL);
            let _ = nix::sys::wait::waitpid(raw, None);
            return Err(SuperviseError::Reaper {
                vm_id: vm_id.clone(),
                source,
            });
        }
        Ok(())
    }

    /// The VM's child not reaped yet, if any.
    pub fn unreaped(&self, vm_id: &Id) -> Option<u32> {
        self.unreaped.lock().get(vm_id).copied()
    }

    /// Whether `pid` is a child of this agent not reaped yet.
    pub fn is_unreaped(&self, pid: u32) -> bool {
        self.unreaped.lock().values().any(|p| *p == pid)
    }

    /// How the VM's last child ended, if it did since it last booted.
    pub fn exit(&self, vm_id: &Id) -> Option<ExitStatus> {
        self.exits.lock().get(vm_id).copied()
    }

    /// Forgets how the VM's last child ended (it was destroyed).
    pub fn forget(&self, vm_id: &Id) {
        self.exits.lock().remove(vm_id);
    }

    /// `said` (the VMM's own words, maybe empty) with how it ended, if it
    /// did: "hypervisor exit status 1: Error booting VM: …".
    pub fn failure_reason(&self, vm_id: &Id, said: String) -> String {
        match self.exit(vm_id) {
            Some(status) if said.is_empty() => format!("{} {}", self.program, describe(status)),
            Some(status) => format!("{} {}: {said}", self.program, describe(status)),
            None => said,
        }
    }
}

/// Forgets the VM's child `pid`, unless a newer child took its place.
fn forget_child(unreaped: &Mutex<HashMap<Id, u32>>, vm_id: &Id, pid: u32) {
    let mut unreaped = unreaped.lock();
    if unreaped.get(vm_id) == Some(&pid) {
        unreaped.remove(vm_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    fn vm() -> Id {
        Id::parse("vm-1").expect("id")
    }

    fn until(done: impl Fn() -> bool) {
        let by = Instant::now() + Duration::from_secs(10);
        while !done() && Instant::now() < by {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_reaped_child_keeps_its_status_and_is_told_once() {
        let children = Children::new("hypervisor");
        let told = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&told);
        children.listener().set(Arc::new(move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        let (exit, exited) = crossbeam_channel::bounded::<()>(0);

        children
            .reap(&vm(), 4242, move || {
                let _ = exited.recv();
                Some(ExitStatus::from_raw(1 << 8))
            })
            .expect("reaper");
        let while_running = children.unreaped(&vm());
        drop(exit);
        until(|| told.load(Ordering::SeqCst) == 1);

        assert_eq!(while_running, Some(4242));
        assert_eq!(children.unreaped(&vm()), None);
        assert_eq!(told.load(Ordering::SeqCst), 1);
        assert_eq!(
            children.failure_reason(&vm(), "boom".into()),
            "hypervisor exit status 1: boom"
        );
    }

    #[test]
    fn a_late_reaper_does_not_forget_the_newer_child() {
        let unreaped = Mutex::new(HashMap::from([(vm(), 2)]));

        forget_child(&unreaped, &vm(), 1);

        assert_eq!(unreaped.lock().get(&vm()), Some(&2));
    }
}
