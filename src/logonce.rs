//! Logging a condition once per change, not once per tick.
//!
//! The agent re-checks everything every tick, so a condition that lasts (a
//! full disk, a control plane that is down, a VM whose boot keeps failing)
//! would otherwise write the same line every few seconds until the log is
//! useless. Each subject (`report`, `contact`, `vm-7/boot`, …) remembers the
//! last message it logged: the same message again is logged at debug, and
//! once a minute at its own level, so a long outage still shows in the log
//! and a changed message shows at once.
//!
//! Subjects are independent: two conditions alternating (the report write
//! failing between two contact failures) cannot defeat each other's memory,
//! which a single "last message" would.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use log::Level;
use parking_lot::Mutex;

/// How often a lasting condition is repeated at its own level.
const REPEAT: Duration = Duration::from_secs(60);

#[derive(Default)]
pub struct LogOnce {
    last: Mutex<HashMap<String, (String, Instant)>>,
}

impl LogOnce {
    pub fn new() -> LogOnce {
        LogOnce::default()
    }

    /// Logs `message` about `subject` at `level` when it differs from what
    /// was last logged about `subject`, or a minute has passed; at debug
    /// otherwise. Returns whether it was logged at `level`.
    pub fn log(&self, level: Level, subject: &str, message: &str) -> bool {
        let fresh = {
            let mut last = self.last.lock();
            let fresh = match last.get(subject) {
                Some((m, at)) => m != message || at.elapsed() >= REPEAT,
                None => true,
            };
            if fresh {
                last.insert(subject.to_owned(), (message.to_owned(), Instant::now()));
            }
            fresh
        };
        if fresh {
            log::log!(level, "{message}");
        } else {
            log::debug!("(again) {message}");
        }
        fresh
    }

    pub fn warn(&self, subject: &str, message: &str) -> bool {
        self.log(Level::Warn, subject, message)
    }

    pub fn error(&self, subject: &str, message: &str) -> bool {
        self.log(Level::Error, subject, message)
    }

    /// Forgets `subject`: the condition ended, so its return is news.
    /// Returns whether anything was remembered about it.
    pub fn clear(&self, subject: &str) -> bool {
        self.last.lock().remove(subject).is_some()
    }

    /// Forgets every subject starting with `prefix` (a VM that was
    /// destroyed), so memory does not grow with VMs that come and go.
    pub fn clear_prefix(&self, prefix: &str) {
        self.last.lock().retain(|k, _| !k.starts_with(prefix));
    }

    /// How many subjects are remembered now.
    pub fn len(&self) -> usize {
        self.last.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_message_is_logged_once() {
        let once = LogOnce::new();

        let first = once.warn("disk", "full");
        let second = once.warn("disk", "full");

        assert!(first);
        assert!(!second);
    }

    #[test]
    fn a_changed_message_is_logged_again() {
        let once = LogOnce::new();
        once.warn("disk", "full");

        let changed = once.warn("disk", "read-only");

        assert!(changed);
    }

    #[test]
    fn subjects_do_not_reset_each_other() {
        let once = LogOnce::new();
        once.warn("report", "cannot write report.json");
        once.warn("contact", "control plane down");

        let again = once.warn("report", "cannot write report.json");

        assert!(!again);
    }

    #[test]
    fn clearing_makes_the_next_occurrence_news() {
        let once = LogOnce::new();
        once.warn("vm-1/boot", "tap busy");

        once.clear_prefix("vm-1/");

        assert!(once.warn("vm-1/boot", "tap busy"));
    }
}
