//! Deadlines: how a pass's time bound reaches every blocking call under it.
//!
//! The reference threads a Go context; a synchronous agent threads a
//! `Deadline` instead. A pass gets one from `vm_timeout`; each blocking
//! call below it (an HTTP request, a wait on a channel or a child process)
//! derives its own timeout from [`Deadline::remaining`], so nothing under a
//! pass can outlive it by more than one call's granularity.

use std::time::{Duration, Instant};

/// A point in time after which work should give up; `Deadline::NONE` never
/// expires (a `vm_timeout` of zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadline(Option<Instant>);

impl Deadline {
    pub const NONE: Deadline = Deadline(None);

    pub fn after(timeout: Duration) -> Deadline {
        Deadline(Instant::now().checked_add(timeout))
    }

    /// A deadline `timeout` from now, or none for `None`.
    pub fn from_timeout(timeout: Option<Duration>) -> Deadline {
        timeout.map_or(Deadline::NONE, Deadline::after)
    }

    pub fn instant(self) -> Option<Instant> {
        self.0
    }

    pub fn expired(self) -> bool {
        self.0.is_some_and(|at| Instant::now() >= at)
    }

    /// Time left; `None` when there is no deadline, zero once it passed.
    pub fn remaining(self) -> Option<Duration> {
        self.0
            .map(|at| at.saturating_duration_since(Instant::now()))
    }

    /// The earlier of this deadline and `cap` from now: for a call that has
    /// its own bound as well as the pass's.
    pub fn capped(self, cap: Duration) -> Deadline {
        let mine = Deadline::after(cap);
        match (self.0, mine.0) {
            (Some(a), Some(b)) => Deadline(Some(a.min(b))),
            (a, b) => Deadline(a.or(b)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn none_never_expires() {
        assert!(!Deadline::NONE.expired());
        assert_eq!(Deadline::NONE.remaining(), None);
    }

    #[test]
    fn zero_timeout_is_already_expired() {
        let d = Deadline::after(Duration::ZERO);

        assert!(d.expired());
        assert_eq!(d.remaining(), Some(Duration::ZERO));
    }

    #[test]
    fn capped_takes_the_earlier() {
        let long = Deadline::after(Duration::from_secs(3600));

        let capped = long.capped(Duration::from_secs(1));

        assert!(
            capped
                .remaining()
                .is_some_and(|r| r <= Duration::from_secs(1))
        );
    }
}
