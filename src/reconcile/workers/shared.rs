//! What a worker shares with the router: its mailbox, its published
//! result under a pass generation (see the protocol in [`super`], steps 2
//! to 4), and the signals every worker gives the engine.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use crossbeam_channel::Sender;
use parking_lot::Mutex;

use super::mailbox::Mailbox;
use crate::model::{Id, VmStatus};
use crate::reconcile::pass::{PassOutcome, Publish, VmResult};

/// What a worker shares with the router.
pub(crate) struct WorkerShared {
    pub(super) mailbox: Mutex<Mailbox>,
    pub(super) published: Mutex<Published>,
    pub(super) signals: Arc<Signals>,
    /// When a poke last ran a pass for this VM.
    pub(super) poked: Mutex<Option<Instant>>,
}

/// What every worker tells the engine, one for all of them.
pub(crate) struct Signals {
    /// The engine's change doorbell, rung when a VM's result changes.
    changed: Sender<()>,
    /// How many worker loops have ended.
    pub(super) ended: AtomicUsize,
    /// How many times a published result has changed: rows collected at
    /// one count are the rows as long as it stays the same.
    pub(super) published: AtomicU64,
}

impl Signals {
    pub(crate) fn new(changed: Sender<()>) -> Arc<Signals> {
        Arc::new(Signals {
            changed,
            ended: AtomicUsize::new(0),
            published: AtomicU64::new(0),
        })
    }
}

#[derive(Default)]
pub(super) struct Published {
    pub(super) last_generation: u64,
    /// The generation of the pass running now, if any.
    pub(super) live: Option<u64>,
    pub(super) result: Option<VmResult>,
    /// The result's row as reported (its host key stamped), made once
    /// when the result changes, shared by every report until then.
    pub(super) row: Option<Arc<VmStatus>>,
}

impl WorkerShared {
    pub(super) fn new(signals: Arc<Signals>, initial: Option<VmResult>) -> WorkerShared {
        WorkerShared {
            mailbox: Mutex::new(Mailbox::default()),
            published: Mutex::new(Published {
                row: initial
                    .as_ref()
                    .and_then(VmResult::stamped_row)
                    .map(Arc::new),
                result: initial,
                ..Published::default()
            }),
            signals,
            poked: Mutex::new(None),
        }
    }

    /// Replaces the published result, ringing the change doorbell when it
    /// differs. Full means a wake is already pending; disconnected means
    /// nobody listens. Neither is this worker's business.
    pub(super) fn set_result(&self, p: &mut Published, result: VmResult) {
        if p.result.as_ref() != Some(&result) {
            p.row = result.stamped_row().map(Arc::new);
            p.result = Some(result);
            // Under the lock: a collection that read the count before this
            // reads the new row after it.
            self.signals.published.fetch_add(1, Ordering::Release);
            let _ = self.signals.changed.try_send(());
        }
    }

    pub(super) fn begin_pass(&self) -> u64 {
        let mut p = self.published.lock();
        p.last_generation += 1;
        p.live = Some(p.last_generation);
        p.last_generation
    }

    pub(super) fn end_pass(&self, generation: u64, outcome: PassOutcome) {
        let mut p = self.published.lock();
        if p.live != Some(generation) {
            return;
        }
        p.live = None;
        match outcome {
            PassOutcome::Done(result) => self.set_result(&mut p, result),
            // The VM's row stays frozen at what it last said; a VM that
            // never said anything gets the reason it is not being worked on.
            PassOutcome::Skipped { fallback, .. } => {
                if p.result.is_none() {
                    self.set_result(&mut p, fallback);
                }
            }
        }
    }

    pub(super) fn publish(&self, generation: u64, result: VmResult) {
        let mut p = self.published.lock();
        if p.live == Some(generation) {
            self.set_result(&mut p, result);
        }
    }

    pub(super) fn set_failed(&self, vm_id: &Id, why: String) {
        let mut p = self.published.lock();
        self.set_result(&mut p, VmResult::failed_unobserved(vm_id, why));
    }

    pub(super) fn is_idle(&self) -> bool {
        !self.mailbox.lock().has_work() && self.published.lock().live.is_none()
    }

    pub(super) fn result(&self) -> Option<VmResult> {
        self.published.lock().result.clone()
    }
}

/// A pass's handle for publishing mid-pass. Cheap to clone and `'static`,
/// so it can ride a progress callback onto another thread; the generation
/// check keeps it harmless once the pass is over.
#[derive(Clone)]
pub(crate) struct PassPublisher {
    pub(super) shared: Arc<WorkerShared>,
    pub(super) generation: u64,
}

impl Publish for PassPublisher {
    fn publish(&self, result: VmResult) {
        self.shared.publish(self.generation, result);
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::model::VmStatus;
    use crossbeam_channel::bounded;

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

    pub(in crate::reconcile::workers) fn shared() -> WorkerShared {
        WorkerShared::new(Signals::new(bounded(1).0), None)
    }

    fn detail(shared: &WorkerShared) -> Option<String> {
        shared.result().and_then(|r| r.row).map(|r| r.status_detail)
    }

    #[test]
    fn skipped_pass_freezes_the_previous_row() {
        let shared = shared();
        let first = shared.begin_pass();
        shared.end_pass(first, PassOutcome::Done(result("vm", "before")));
        let second = shared.begin_pass();

        shared.end_pass(
            second,
            PassOutcome::Skipped {
                fallback: result("vm", "fallback"),
                why: "unreadable".into(),
            },
        );

        assert_eq!(detail(&shared).as_deref(), Some("before"));
    }

    #[test]
    fn skipped_first_pass_uses_the_fallback() {
        let shared = shared();
        let first = shared.begin_pass();

        shared.end_pass(
            first,
            PassOutcome::Skipped {
                fallback: result("vm", "fallback"),
                why: "unreadable".into(),
            },
        );

        assert_eq!(detail(&shared).as_deref(), Some("fallback"));
    }

    #[test]
    fn publish_from_an_ended_generation_is_dropped() {
        let shared = shared();
        let old = shared.begin_pass();
        shared.end_pass(old, PassOutcome::Done(result("vm", "final")));
        let current = shared.begin_pass();

        shared.publish(old, result("vm", "late"));

        assert_eq!(detail(&shared).as_deref(), Some("final"));
        shared.publish(current, result("vm", "live"));
        assert_eq!(detail(&shared).as_deref(), Some("live"));
    }
}
