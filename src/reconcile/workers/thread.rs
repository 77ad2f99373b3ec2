//! A worker's thread: `vm-<id>`, one pass per ring on the newest
//! assignment, each pass's panic caught and failing only its VM (see the
//! protocol in [`super`], steps 2 and 5).

use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, bounded};

use super::router::Doorbell;
use super::shared::{PassPublisher, Signals, WorkerShared};
use crate::model::Id;
use crate::reconcile::pass::{PassOutcome, Publisher, VmResult};
use crate::reconcile::step::Spine;
use crate::stages;

pub(super) struct WorkerHandle {
    pub(super) shared: Arc<WorkerShared>,
    pub(super) doorbell: Sender<()>,
    pub(super) thread: Option<JoinHandle<()>>,
}

impl WorkerHandle {
    /// Its thread never started, or its loop is over.
    /// Its doorbell, as the router rings it.
    pub(super) fn doorbell_of(&self) -> Doorbell {
        Doorbell {
            bell: self.doorbell.clone(),
            shared: Arc::clone(&self.shared),
        }
    }

    pub(super) fn is_dead(&self) -> bool {
        self.thread.is_none() || self.shared.mailbox.lock().ended
    }
}

pub(super) fn spawn(
    vm_id: &Id,
    spine: &Arc<Spine>,
    stack_bytes: usize,
    signals: Arc<Signals>,
    initial: Option<VmResult>,
    predecessor: Option<JoinHandle<()>>,
) -> WorkerHandle {
    let (doorbell, rings) = bounded(1);
    let shared = Arc::new(WorkerShared::new(signals, initial));
    let thread = {
        let (vm_id, spine, shared) = (vm_id.clone(), Arc::clone(spine), Arc::clone(&shared));
        std::thread::Builder::new()
            .name(format!("vm-{vm_id}"))
            .stack_size(stack_bytes)
            .spawn(move || {
                // One pass per VM: the retired worker ends its pass first.
                // Said however the loop ends, a panic included.
                let _ended = Ended(&shared);
                if let Some(predecessor) = predecessor {
                    let _ = predecessor.join();
                }
                run(&vm_id, &spine, &shared, &rings);
            })
    };
    let thread = match thread {
        Ok(t) => Some(t),
        Err(e) => {
            // The next delivery finds no thread and tries again.
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

/// Marks the worker's mailbox ended, and counts it, when dropped.
pub(super) struct Ended<'a>(pub(super) &'a WorkerShared);

impl Drop for Ended<'_> {
    fn drop(&mut self) {
        self.0.mailbox.lock().ended = true;
        self.0.signals.ended.fetch_add(1, Ordering::Release);
    }
}

/// The worker's loop: one pass per ring, on the newest assignment.
fn run(vm_id: &Id, spine: &Spine, shared: &Arc<WorkerShared>, rings: &Receiver<()>) {
    // A VM skipped every tick for the same reason is logged once, not once a
    // tick; a new reason, or recovery, is logged again.
    let mut skipping: Option<String> = None;
    // A create goes deep, a tick's pass does not: what a pass left below
    // this loop is given back after it (see `StackTrim`).
    let stack = crate::threads::StackTrim::of_this_thread();
    while rings.recv().is_ok() {
        // Taken and begun under the mailbox's lock: never a moment where
        // the mailbox is empty and no pass is live while one is about to
        // run (`wait_idle` would call that idle).
        let (assignment, generation, waited) = {
            let mut mailbox = shared.mailbox.lock();
            let Some(assignment) = mailbox.take() else {
                continue;
            };
            (assignment, shared.begin_pass(), mailbox.waited())
        };
        let mut recording = stages::record();
        recording.add_before("dispatch", waited);
        let publisher: Publisher = Arc::new(PassPublisher {
            shared: Arc::clone(shared),
            generation,
        });
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
            spine.run(vm_id, &assignment, Some(&publisher))
        }))
        .unwrap_or_else(|payload| {
            let what = crate::threads::panic_message(payload.as_ref());
            log::error!("VM {vm_id}: reconcile pass panicked: {what}");
            PassOutcome::Done(VmResult::failed_unobserved(
                vm_id,
                format!("internal error: the reconcile pass panicked ({what}); retried next tick"),
            ))
        });
        match &outcome {
            PassOutcome::Skipped { why, .. } if skipping.as_ref() != Some(why) => {
                log::warn!("VM {vm_id}: not reconciling it: {why}");
                skipping = Some(why.clone());
            }
            PassOutcome::Done(_) if skipping.take().is_some() => {
                log::info!("VM {vm_id}: its record is readable again");
            }
            _ => {}
        }
        shared.end_pass(generation, outcome);
        // Most passes time nothing: only one that did is looked at. Those
        // (a create, a suspend, a resume) are the deep ones, whose stack
        // is given back; a tick's pass leaves little, and faulting it in
        // again at every tick would cost more than it holds.
        if recording.saw_any() {
            spine.timed(vm_id, recording.finish());
            stack.trim();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::workers::shared::tests::shared;

    #[test]
    fn a_worker_whose_loop_ended_is_dead_even_by_a_panic() {
        let shared = Arc::new(shared());
        let inside = Arc::clone(&shared);

        let ended = std::thread::spawn(move || {
            let _ended = Ended(&inside);
            panic!("test: the loop itself failed");
        })
        .join();

        assert!(ended.is_err());
        assert!(shared.mailbox.lock().ended);
        assert_eq!(shared.signals.ended.load(Ordering::Acquire), 1);
    }
}
