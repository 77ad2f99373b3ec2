//! One long-lived OS thread per VM, and the router's side of talking to it.
//!
//! Protocol between `Engine::step` (the router) and a VM's worker:
//! 1. The router writes the VM's newest assignment into the worker's mailbox
//!    (replacing any the worker has not taken yet: latest wins) and rings the
//!    doorbell, a bounded(1) channel, so ringing never blocks and a worker
//!    woken once sees every assignment written before it looked.
//! 2. The worker takes the mailbox, starts a pass with a fresh generation,
//!    and runs it. Mid-pass it may publish narration tagged with that
//!    generation; when the pass ends it publishes the final result and
//!    closes the generation.
//! 3. A publish lands only while its generation is the live one, so a row
//!    from a pass that ended (e.g. a download progress callback firing after
//!    the pass gave up) can never overwrite a newer one.
//! 4. The router reads published results at any time without waiting; a
//!    worker busy for minutes delays nothing.
//! 5. Retiring a worker drops its doorbell; the worker ends after its current
//!    pass and the router joins it once it has finished.
//!
//! A pass that panics is caught on the worker and fails that VM's row; a
//! worker whose thread is gone (it could not be spawned) is noticed on the
//! next delivery, reported, and spawned again. Neither touches other VMs.

use std::collections::{HashMap, HashSet};
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, TrySendError, bounded};
use parking_lot::Mutex;

use super::pass::{Assignment, Core, PassOutcome, VmResult};
use crate::deadline::Deadline;
use crate::model::{Id, Phase, Report, VmStatus};

/// What a worker shares with the router.
#[derive(Default)]
pub(crate) struct WorkerShared {
    mailbox: Mutex<Option<Assignment>>,
    published: Mutex<Published>,
}

#[derive(Default)]
struct Published {
    last_generation: u64,
    /// The generation of the pass running now, if any.
    live: Option<u64>,
    result: Option<VmResult>,
}

impl WorkerShared {
    fn begin_pass(&self) -> u64 {
        let mut p = self.published.lock();
        p.last_generation += 1;
        p.live = Some(p.last_generation);
        p.last_generation
    }

    fn end_pass(&self, generation: u64, outcome: PassOutcome) {
        let mut p = self.published.lock();
        if p.live != Some(generation) {
            return;
        }
        p.live = None;
        match outcome {
            PassOutcome::Done(result) => p.result = Some(result),
            // The VM's row stays frozen at what it last said; a VM that
            // never said anything gets the reason it is not being worked on.
            PassOutcome::Skipped { fallback } => {
                if p.result.is_none() {
                    p.result = Some(fallback);
                }
            }
        }
    }

    fn publish(&self, generation: u64, result: VmResult) {
        let mut p = self.published.lock();
        if p.live == Some(generation) {
            p.result = Some(result);
        }
    }

    fn set_failed(&self, vm_id: &Id, why: String) {
        self.published.lock().result = Some(VmResult::failed_unobserved(vm_id, why));
    }

    fn is_idle(&self) -> bool {
        self.mailbox.lock().is_none() && self.published.lock().live.is_none()
    }

    fn result(&self) -> Option<VmResult> {
        self.published.lock().result.clone()
    }
}

/// A pass's handle for publishing mid-pass. Cheap to clone and `'static`,
/// so it can ride a progress callback onto another thread; the generation
/// check keeps it harmless once the pass is over.
#[derive(Clone)]
pub(crate) struct Publisher {
    shared: Arc<WorkerShared>,
    generation: u64,
}

impl Publisher {
    pub(crate) fn publish(&self, result: VmResult) {
        self.shared.publish(self.generation, result);
    }
}

struct WorkerHandle {
    shared: Arc<WorkerShared>,
    doorbell: Sender<()>,
    thread: Option<JoinHandle<()>>,
}

/// Every VM's worker, owned by the engine's router.
pub(crate) struct Workers {
    live: HashMap<Id, WorkerHandle>,
    /// Workers told to stop, joined once their thread has finished; never
    /// joined inline, since a worker may be inside a long pass.
    retiring: Vec<JoinHandle<()>>,
    stack_bytes: usize,
}

impl Workers {
    pub(crate) fn new(stack_bytes: usize) -> Workers {
        Workers {
            live: HashMap::new(),
            retiring: Vec::new(),
            stack_bytes,
        }
    }

    /// Hands `vm_id` its newest assignment, starting its worker if it has
    /// none and restarting it if its thread is gone.
    pub(crate) fn deliver(&mut self, vm_id: &Id, assignment: Assignment, core: &Arc<Core>) {
        let handle = match self.live.get(vm_id) {
            Some(h) => h,
            None => {
                let h = spawn(vm_id, core, self.stack_bytes);
                self.live.entry(vm_id.clone()).or_insert(h)
            }
        };
        *handle.shared.mailbox.lock() = Some(assignment);
        match handle.doorbell.try_send(()) {
            // Full: the bell is already ringing and the worker will read the
            // mailbox, which now holds this assignment.
            Ok(()) | Err(TrySendError::Full(())) => {}
            Err(TrySendError::Disconnected(())) => self.restart(vm_id, core),
        }
    }

    /// Replaces a worker whose thread is gone, moving its pending assignment
    /// to the new one. If the new thread cannot start either, the VM's row
    /// says so and the next delivery tries again.
    fn restart(&mut self, vm_id: &Id, core: &Arc<Core>) {
        let Some(old) = self.live.remove(vm_id) else {
            return;
        };
        log::error!("VM {vm_id}: its worker thread is gone; starting a new one");
        let pending = old.shared.mailbox.lock().take();
        if let Some(thread) = old.thread {
            self.retiring.push(thread);
        }
        let new = spawn(vm_id, core, self.stack_bytes);
        // A worker that did not start holds no work: nothing would ever take
        // it, and the next delivery brings a newer assignment anyway.
        if let Some(assignment) = pending
            && new.thread.is_some()
        {
            *new.shared.mailbox.lock() = Some(assignment);
            // A fresh channel has room for this one ring.
            let _ = new.doorbell.try_send(());
        }
        self.live.insert(vm_id.clone(), new);
    }

    /// Retires the workers of VMs not in `keep`.
    pub(crate) fn retire_absent(&mut self, keep: &HashSet<&Id>) {
        let gone: Vec<Id> = self
            .live
            .keys()
            .filter(|id| !keep.contains(id))
            .cloned()
            .collect();
        for id in gone {
            if let Some(handle) = self.live.remove(&id) {
                // Dropping `handle.doorbell` is the stop signal.
                self.retiring.extend(handle.thread);
            }
        }
    }

    /// Joins retired workers whose threads have finished.
    pub(crate) fn join_finished(&mut self) {
        let (done, running): (Vec<_>, Vec<_>) =
            self.retiring.drain(..).partition(JoinHandle::is_finished);
        self.retiring = running;
        for thread in done {
            // A worker catches its passes' panics; a panic here would be in
            // the loop itself, and there is nothing left of it to fail.
            let _ = thread.join();
        }
    }

    /// Folds every worker's last published result into `report`, skipping
    /// the VMs in `skip` (their rows come from elsewhere this tick).
    pub(crate) fn collect(&self, report: &mut Report, skip: &HashSet<&Id>) {
        for (id, handle) in &self.live {
            if skip.contains(id) {
                continue;
            }
            if let Some(result) = handle.shared.result() {
                result.merge_into(report);
            }
        }
    }

    pub(crate) fn is_idle(&self) -> bool {
        self.live.values().all(|h| h.shared.is_idle())
    }

    /// Stops every worker: no new passes start, and each thread is joined if
    /// it finishes by `deadline` (one stuck in a provisioner call is left to
    /// finish on its own; the process exiting ends it).
    pub(crate) fn stop_all(&mut self, deadline: Deadline) {
        let handles: Vec<_> = self.live.drain().map(|(_, h)| h).collect();
        for handle in handles {
            drop(handle.doorbell);
            self.retiring.extend(handle.thread);
        }
        while !self.retiring.is_empty() && !deadline.expired() {
            self.join_finished();
            if !self.retiring.is_empty() {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        self.join_finished();
        if !self.retiring.is_empty() {
            log::warn!(
                "{} VM worker(s) still inside a pass at shutdown; leaving them to finish",
                self.retiring.len()
            );
        }
    }
}

fn spawn(vm_id: &Id, core: &Arc<Core>, stack_bytes: usize) -> WorkerHandle {
    let (doorbell, rings) = bounded(1);
    let shared = Arc::new(WorkerShared::default());
    let thread = {
        let (vm_id, core, shared) = (vm_id.clone(), Arc::clone(core), Arc::clone(&shared));
        std::thread::Builder::new()
            .name(format!("vm-{vm_id}"))
            .stack_size(stack_bytes)
            .spawn(move || run(&vm_id, &core, &shared, &rings))
    };
    let thread = match thread {
        Ok(t) => Some(t),
        Err(e) => {
            // The receiver went down with the closure, so the next delivery
            // finds the doorbell disconnected and tries again.
            log::error!("VM {vm_id}: cannot start its worker thread: {e}");
            shared.set_failed(
                vm_id,
                format!("cannot start this VM's worker thread ({e}); retried next tick"),
            );
            None
        }
    };
    WorkerHandle {
        shared,
        doorbell,
        thread,
    }
}

/// The worker's loop: one pass per ring, on the newest assignment.
fn run(vm_id: &Id, core: &Core, shared: &Arc<WorkerShared>, rings: &Receiver<()>) {
    while rings.recv().is_ok() {
        let Some(assignment) = shared.mailbox.lock().take() else {
            continue;
        };
        let generation = shared.begin_pass();
        let publisher = Publisher {
            shared: Arc::clone(shared),
            generation,
        };
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
            core.reconcile_one(vm_id, &assignment, Some(&publisher))
        }))
        .unwrap_or_else(|payload| {
            let what = panic_message(payload.as_ref());
            log::error!("VM {vm_id}: reconcile pass panicked: {what}");
            PassOutcome::Done(VmResult::failed_unobserved(
                vm_id,
                format!("internal error: the reconcile pass panicked ({what}); retried next tick"),
            ))
        });
        shared.end_pass(generation, outcome);
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "no message".to_owned()
    }
}

impl VmResult {
    /// A row for a VM the agent could not work on and did not look at.
    pub(crate) fn failed_unobserved(vm_id: &Id, why: String) -> VmResult {
        VmResult {
            row: Some(VmStatus {
                vm_id: vm_id.to_string(),
                power: None,
                phase: Some(Phase::Failed),
                last_error: why,
                ..VmStatus::default()
            }),
            ..VmResult::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(vm: &str, detail: &str) -> VmResult {
        VmResult {
            row: Some(VmStatus {
                vm_id: vm.into(),
                status_detail: detail.into(),
                ..VmStatus::default()
            }),
            ..VmResult::default()
        }
    }

    fn detail(shared: &WorkerShared) -> Option<String> {
        shared.result().and_then(|r| r.row).map(|r| r.status_detail)
    }

    #[test]
    fn skipped_pass_freezes_the_previous_row() {
        let shared = WorkerShared::default();
        let first = shared.begin_pass();
        shared.end_pass(first, PassOutcome::Done(result("vm", "before")));
        let second = shared.begin_pass();

        shared.end_pass(
            second,
            PassOutcome::Skipped {
                fallback: result("vm", "fallback"),
            },
        );

        assert_eq!(detail(&shared).as_deref(), Some("before"));
    }

    #[test]
    fn skipped_first_pass_uses_the_fallback() {
        let shared = WorkerShared::default();
        let first = shared.begin_pass();

        shared.end_pass(
            first,
            PassOutcome::Skipped {
                fallback: result("vm", "fallback"),
            },
        );

        assert_eq!(detail(&shared).as_deref(), Some("fallback"));
    }

    #[test]
    fn publish_from_an_ended_generation_is_dropped() {
        let shared = WorkerShared::default();
        let old = shared.begin_pass();
        shared.end_pass(old, PassOutcome::Done(result("vm", "final")));
        let current = shared.begin_pass();

        shared.publish(old, result("vm", "late"));

        assert_eq!(detail(&shared).as_deref(), Some("final"));
        shared.publish(current, result("vm", "live"));
        assert_eq!(detail(&shared).as_deref(), Some("live"));
    }
}
