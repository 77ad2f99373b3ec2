//! A worker's mailbox: the newest assignment, written by the step and
//! taken by the worker (latest wins), and the last one, which a re-check
//! or a poke runs again (see the protocol in [`super`], steps 1, 5 and 6).

use std::time::{Duration, Instant};

use crate::reconcile::pass::Assignment;

/// What the worker is to run next, and what it last was given. One lock
/// for all of it: a tick's re-check of ten thousand VMs costs one lock per
/// VM, and never a copy of an assignment.
#[derive(Default)]
pub(super) struct Mailbox {
    /// Delivered and not yet taken; a newer delivery replaces it.
    pub(super) waiting: Option<Assignment>,
    /// The newest assignment ever delivered: what a re-check or a poke
    /// runs again.
    pub(super) last: Option<Assignment>,
    /// Run `last` again (when nothing newer is waiting).
    pub(super) again: bool,
    /// The worker's loop is over: its thread is ending or gone.
    pub(super) ended: bool,
    /// When the work waiting now was asked for: the pass's dispatch time.
    pub(super) asked_at: Option<Instant>,
}

impl Mailbox {
    pub(super) fn deliver(&mut self, assignment: Assignment) {
        self.waiting = Some(assignment.clone());
        self.last = Some(assignment);
        self.again = false;
        self.asked_at = Some(Instant::now());
    }

    /// Asks for `last` to run again, as of `now`. Returns whether there is
    /// work to wake the worker for (a worker never given anything has none).
    pub(super) fn again(&mut self, now: Instant) -> bool {
        if self.last.is_some() && !self.has_work() {
            self.again = true;
            self.asked_at = Some(now);
        }
        self.has_work()
    }

    pub(super) fn take(&mut self) -> Option<Assignment> {
        let again = std::mem::take(&mut self.again);
        match self.waiting.take() {
            Some(newest) => Some(newest),
            None if again => self.last.clone(),
            None => None,
        }
    }

    /// How long the work just taken waited for its worker.
    pub(super) fn waited(&mut self) -> Duration {
        self.asked_at
            .take()
            .map_or(Duration::ZERO, |at| at.elapsed())
    }

    pub(super) fn has_work(&self) -> bool {
        self.waiting.is_some() || self.again
    }

    /// Forgets everything: a ring still buffered finds nothing to run.
    pub(super) fn clear(&mut self) {
        self.waiting = None;
        self.last = None;
        self.again = false;
        self.asked_at = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reaps(mailbox: &mut Mailbox) -> Option<bool> {
        match mailbox.take() {
            Some(Assignment::Reap { tombstoned }) => Some(tombstoned),
            Some(Assignment::Desired { .. }) => panic!("a desired assignment was never delivered"),
            None => None,
        }
    }

    #[test]
    fn a_recheck_runs_the_last_assignment_again() {
        let mut mailbox = Mailbox::default();
        mailbox.deliver(Assignment::Reap { tombstoned: true });
        assert_eq!(reaps(&mut mailbox), Some(true));

        let woken = mailbox.again(Instant::now());

        assert!(woken);
        assert_eq!(reaps(&mut mailbox), Some(true));
        assert_eq!(reaps(&mut mailbox), None, "once per recheck");
    }

    #[test]
    fn a_newer_delivery_wins_over_a_recheck() {
        let mut mailbox = Mailbox::default();
        mailbox.deliver(Assignment::Reap { tombstoned: false });
        mailbox.take();
        mailbox.again(Instant::now());

        mailbox.deliver(Assignment::Reap { tombstoned: true });

        assert_eq!(reaps(&mut mailbox), Some(true));
        assert_eq!(reaps(&mut mailbox), None, "the recheck is covered by it");
    }

    #[test]
    fn a_worker_never_given_work_is_not_woken_by_a_recheck() {
        let mut mailbox = Mailbox::default();

        let woken = mailbox.again(Instant::now());

        assert!(!woken);
        assert!(!mailbox.has_work());
    }

    #[test]
    fn a_cleared_mailbox_runs_nothing_even_when_a_recheck_was_asked() {
        let mut mailbox = Mailbox::default();
        mailbox.deliver(Assignment::Reap { tombstoned: true });
        mailbox.again(Instant::now());

        mailbox.clear();

        assert_eq!(reaps(&mut mailbox), None);
        assert!(
            !mailbox.again(Instant::now()),
            "and a later recheck finds nothing to run"
        );
    }
}
