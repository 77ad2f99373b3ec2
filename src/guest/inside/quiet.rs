//! The kernel's RCU stall check, quieted across a save (`Saving` in the
//! protocol).
//!
//! A saved guest runs again with its clock moved on by all the time it
//! was saved: a grace period that was in flight at the save then looks
//! stalled that long, and the kernel prints a report of it, kilobytes with
//! stack dumps, to the console. On a serial console each byte is a VM exit
//! (57-84 us a byte measured on a nested host), so a clone or a woken VM
//! spent a tenth of a second or more printing a stall that never was
//! before its guest agent could answer. The check is turned off just before the
//! save and back on once the guest has run again long enough for such a
//! grace period to end.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::pb::guest::Quieted;

/// The kernel's switch (`rcupdate.rcu_cpu_stall_suppress`).
pub(super) const SUPPRESS: &str = "/sys/module/rcupdate/parameters/rcu_cpu_stall_suppress";

/// When the check comes back.
#[derive(Clone, Copy, Debug)]
pub(super) struct Timing {
    /// How long the guest runs again first: a grace period in flight at
    /// the save ends well within it, once the guest's CPUs run.
    pub settle: Duration,
    /// How long it stays off when no save came (the host failed between).
    pub give_up: Duration,
    /// How often the watch looks at the clock.
    pub look_every: Duration,
    /// How much longer than `look_every` a look may come before the guest
    /// is taken to have been paused and run again (its clock jumps by the
    /// time it was saved).
    pub jump: Duration,
}

impl Timing {
    pub(super) const GUEST: Timing = Timing {
        settle: Duration::from_secs(1),
        give_up: Duration::from_secs(60),
        look_every: Duration::from_millis(250),
        jump: Duration::from_secs(2),
    };
}

/// The check's switch, and what quieted it.
pub(super) struct Quiet {
    switch: PathBuf,
    timing: Timing,
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    /// Whether this agent turned the check off and owes turning it on.
    owed: bool,
    /// When the last `Saving` came.
    asked: Option<Instant>,
    /// When the guest was first seen running again after it.
    ran_again: Option<Instant>,
}

impl State {
    /// Whether the check is due back at `now`.
    fn due(&self, now: Instant, timing: Timing) -> bool {
        match (self.ran_again, self.asked) {
            (Some(ran), _) => now.saturating_duration_since(ran) >= timing.settle,
            (None, Some(asked)) => now.saturating_duration_since(asked) >= timing.give_up,
            (None, None) => true,
        }
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether a look that came `slept` after the one before found the guest
/// paused (and saved) meanwhile.
fn jumped(slept: Duration, timing: Timing) -> bool {
    slept > timing.look_every + timing.jump
}

impl Quiet {
    pub(super) fn new(switch: &Path, timing: Timing) -> Quiet {
        Quiet {
            switch: switch.to_owned(),
            timing,
            state: Arc::default(),
        }
    }

    /// Turns the check off for a save; a check already off by someone
    /// else's hand is left so, and never turned on by this agent.
    pub(super) fn saving(&self) -> Result<Quieted, String> {
        let Ok(now) = std::fs::read_to_string(&self.switch) else {
            // A kernel without the switch (or without RCU's stall check).
            return Ok(Quieted::default());
        };
        let mut state = lock(&self.state);
        if now.trim() != "0" && !state.owed {
            return Ok(Quieted {
                stall_check_quiet: true,
                was_quiet: true,
            });
        }
        std::fs::write(&self.switch, "1")
            .map_err(|e| format!("cannot quiet {}: {e}", self.switch.display()))?;
        state.asked = Some(Instant::now());
        state.ran_again = None;
        if !state.owed {
            state.owed = true;
            self.watch();
        }
        Ok(Quieted {
            stall_check_quiet: true,
            was_quiet: false,
        })
    }

    /// The host says the guest runs again (a `Resumed`).
    pub(super) fn resumed(&self) {
        let mut state = lock(&self.state);
        if state.owed && state.ran_again.is_none() {
            state.ran_again = Some(Instant::now());
        }
    }

    /// Turns the check back on once it is due, in a thread of its own.
    fn watch(&self) {
        let (switch, timing, shared) = (self.switch.clone(), self.timing, Arc::clone(&self.state));
        std::thread::spawn(move || {
            let mut looked = Instant::now();
            loop {
                std::thread::sleep(timing.look_every);
                let now = Instant::now();
                let mut state = lock(&shared);
                if jumped(now.saturating_duration_since(looked), timing)
                    && state.ran_again.is_none()
                {
                    state.ran_again = Some(now);
                }
                looked = now;
                if state.due(now, timing) {
                    if let Err(e) = std::fs::write(&switch, "0") {
                        eprintln!(
                            "eitri-guest: cannot turn the RCU stall check back on ({}): {e}",
                            switch.display()
                        );
                    }
                    state.owed = false;
                    return;
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QUICK: Timing = Timing {
        settle: Duration::from_millis(50),
        give_up: Duration::from_millis(300),
        look_every: Duration::from_millis(10),
        jump: Duration::from_secs(2),
    };

    fn switch(value: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("rcu_cpu_stall_suppress");
        std::fs::write(&path, value).expect("write the switch");
        (dir, path)
    }

    fn read(path: &Path) -> String {
        std::fs::read_to_string(path).expect("read the switch")
    }

    /// Waits up to 5 s for the switch to read `value`.
    fn settles_to(path: &Path, value: &str) -> bool {
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if read(path).trim() == value {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }

    #[test]
    fn a_save_quiets_the_check() {
        let (_dir, path) = switch("0\n");
        let quiet = Quiet::new(&path, QUICK);

        let said = quiet.saving().expect("quieted");

        assert_eq!((said.stall_check_quiet, said.was_quiet), (true, false));
        assert_eq!(read(&path), "1");
    }

    #[test]
    fn the_check_comes_back_a_settle_after_the_guest_runs_again() {
        let (_dir, path) = switch("0\n");
        let quiet = Quiet::new(
            &path,
            Timing {
                give_up: Duration::from_secs(3600),
                ..QUICK
            },
        );
        quiet.saving().expect("quieted");

        quiet.resumed();

        assert!(settles_to(&path, "0"), "{}", read(&path));
    }

    #[test]
    fn the_check_comes_back_when_no_save_came() {
        let (_dir, path) = switch("0\n");
        let quiet = Quiet::new(&path, QUICK);

        quiet.saving().expect("quieted");

        assert!(settles_to(&path, "0"), "{}", read(&path));
    }

    #[test]
    fn a_check_someone_else_quieted_is_left_quiet() {
        let (_dir, path) = switch("1\n");
        let quiet = Quiet::new(&path, QUICK);

        let said = quiet.saving().expect("answered");
        quiet.resumed();
        std::thread::sleep(QUICK.give_up * 2);

        assert_eq!((said.stall_check_quiet, said.was_quiet), (true, true));
        assert_eq!(read(&path), "1\n");
    }

    #[test]
    fn a_second_save_before_the_check_came_back_keeps_it_quiet_and_owed() {
        let (_dir, path) = switch("0\n");
        let quiet = Quiet::new(&path, QUICK);
        quiet.saving().expect("quieted");

        let said = quiet.saving().expect("quieted again");
        quiet.resumed();

        assert!(!said.was_quiet, "its own quiet is not someone else's");
        assert!(settles_to(&path, "0"), "{}", read(&path));
    }

    #[test]
    fn a_kernel_without_the_switch_has_nothing_quieted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let quiet = Quiet::new(&dir.path().join("absent"), QUICK);

        let said = quiet.saving().expect("answered");

        assert!(!said.stall_check_quiet);
    }

    #[test]
    fn a_look_that_comes_seconds_late_is_a_guest_that_was_paused() {
        let timing = Timing::GUEST;

        assert!(!jumped(timing.look_every * 3, timing));
        assert!(jumped(Duration::from_secs(33), timing));
    }
}
