//! Stopping a VMM, politest first. The rungs, in order, each told to the
//! VM's row as it starts and bounded by its own timeout and the pass's
//! deadline:
//! 1. the power button, until the guest powers off (or the VMM exits:
//!    then it is stopped);
//! 2. the VMM asked to shut down ([`Request::Shutdown`]), until it exits;
//! 3. SIGTERM, until it exits;
//! 4. SIGKILL, until it is gone, bounded by [`StopTimeouts::kill`] even
//!    past the deadline: a stop never returns with the VMM still there
//!    unless the kernel would not end it.
//!
//! The log says which it was: the guest powered off (and how soon after
//! the button), or it did not and its VMM was stopped under it, a warning,
//! since what the guest had not written is lost as on a power cut.
//!
//! Once the pass's deadline has passed, the polite rungs are skipped: a
//! pass out of time goes straight to SIGKILL. "Gone" means reaped too, so
//! a stop never leaves a zombie of the VM behind.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use super::{Request, SuperviseError, Vmm};
use crate::deadline::Deadline;
use crate::model::Id;
use crate::provision::Say;

/// How often a waiting rung looks again.
const POLL: Duration = Duration::from_millis(10);

/// How long each rung of the ladder waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StopTimeouts {
    /// For the guest to act on the power button (`--stop-grace`).
    pub power_button: Duration,
    /// For the VMM to exit after it was asked to shut down.
    pub vmm_shutdown: Duration,
    /// For the VMM to exit after SIGTERM.
    pub terminate: Duration,
    /// For the VMM to be gone after SIGKILL.
    pub kill: Duration,
}

impl Default for StopTimeouts {
    fn default() -> StopTimeouts {
        StopTimeouts {
            power_button: Duration::from_secs(30),
            vmm_shutdown: Duration::from_secs(5),
            terminate: Duration::from_secs(5),
            kill: Duration::from_secs(5),
        }
    }
}

/// What the guest of a VMM to stop is doing: where the ladder starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Guest {
    /// Running: the power button first.
    Running,
    /// Paused (a suspend's last step): from the second rung, since a
    /// paused guest hears no power button.
    Paused,
}

/// Stops `vmm` (see the module steps), its guest `guest`, telling `say`
/// each rung and, while one waits, how long it has waited, once a second.
pub fn stop(
    vm_id: &Id,
    vmm: &dyn Vmm,
    (timeouts, deadline): (StopTimeouts, Deadline),
    guest: Guest,
    say: Say<'_>,
) -> Result<(), SuperviseError> {
    let noun = vmm.noun();
    // Whether the guest shut itself down: what an operator needs to know
    // of a stop, since every later rung ends a guest that did not (its
    // unwritten data lost, as when a plug is pulled).
    let mut powered_off = false;
    if guest == Guest::Running && !deadline.expired() {
        say("stopping: pressing the power button");
        let pressed = Instant::now();
        vmm.ask(Request::PowerButton);
        powered_off = wait_narrated(
            "waiting for the guest to power off",
            timeouts.power_button,
            deadline,
            say,
            &|| vmm.gone() || vmm.powered_off(),
        );
        if powered_off {
            log::info!(
                "VM {vm_id}: the guest powered off {:.1} s after the power button",
                pressed.elapsed().as_secs_f64()
            );
        } else {
            log::warn!(
                "VM {vm_id}: the guest did not power off within {} of the power button; stopping {noun} under it",
                crate::human::duration(timeouts.power_button)
            );
        }
        if vmm.gone() {
            return Ok(());
        }
    }
    if !deadline.expired() {
        say(&format!("stopping: asking {noun} to shut down"));
        vmm.ask(Request::Shutdown);
        if wait_narrated(
            &format!("waiting for {noun} to exit"),
            timeouts.vmm_shutdown,
            deadline,
            say,
            &|| vmm.gone(),
        ) {
            if !powered_off {
                log::info!("VM {vm_id}: {noun} shut down when asked");
            }
            return Ok(());
        }
    }
    if !deadline.expired() {
        log::warn!("VM {vm_id}: {noun} ignored shutdown; sending SIGTERM");
        say(&format!(
            "stopping: {noun} ignored shutdown; sending SIGTERM"
        ));
        let _ = vmm.signal(Signal::SIGTERM);
        if wait_narrated(
            &format!("waiting for {noun} to exit"),
            timeouts.terminate,
            deadline,
            say,
            &|| vmm.gone(),
        ) {
            return Ok(());
        }
    }
    if vmm.gone() {
        return Ok(());
    }
    let pid = vmm.pid();
    log::warn!("VM {vm_id}: killing {noun} (pid {pid})");
    say(&format!("stopping: killing {noun}"));
    vmm.signal(Signal::SIGKILL)
        .map_err(|source| SuperviseError::Kill {
            vm_id: vm_id.clone(),
            noun,
            pid,
            source,
        })?;
    if wait_gone(vmm, Deadline::after(timeouts.kill)) {
        Ok(())
    } else {
        Err(SuperviseError::SurvivedKill {
            vm_id: vm_id.clone(),
            noun,
            pid,
        })
    }
}

/// Kills `vmm` and waits (5 s at most) for it to be gone: a VMM that
/// failed its boot.
pub fn kill(vmm: &dyn Vmm) {
    let _ = vmm.signal(Signal::SIGKILL);
    wait_gone(vmm, Deadline::after(StopTimeouts::default().kill));
}

/// Waits until `vmm` is gone, or `bound`; whether it is gone.
pub fn wait_gone(vmm: &dyn Vmm, bound: Deadline) -> bool {
    while !vmm.gone() {
        if bound.expired() {
            return false;
        }
        std::thread::sleep(POLL);
    }
    true
}

/// A stop's narration in the log: each rung at info, and the count a wait
/// says once a second ("…, 3 s of 30") at debug (a stop that waited out
/// its guest's 30 s was 30 lines of the log, and of the VM's events).
pub fn log_stop(vm_id: &Id, what: &str) {
    if counts_a_wait(what) {
        log::debug!("VM {vm_id}: {what}");
    } else {
        log::info!("VM {vm_id}: {what}");
    }
}

/// Whether a stop's narration is a wait's count ("…, 3 s of 30").
fn counts_a_wait(what: &str) -> bool {
    what.rsplit_once(", ").is_some_and(|(_, count)| {
        let words: Vec<&str> = count.split(' ').collect();
        matches!(words.as_slice(), [n, "s", "of", m]
            if n.parse::<u64>().is_ok() && m.parse::<u64>().is_ok())
    })
}

/// Waits up to `allowed` (and the deadline) for `done`, telling `say`
/// "stopping: {what}, N s of M" once a second; whether `done` came.
fn wait_narrated(
    what: &str,
    allowed: Duration,
    deadline: Deadline,
    say: Say<'_>,
    done: &dyn Fn() -> bool,
) -> bool {
    let bound = deadline.capped(allowed);
    let started = Instant::now();
    let mut said = None;
    loop {
        let waited = started.elapsed().as_secs();
        if said != Some(waited) {
            say(&format!(
                "stopping: {what}, {waited} s of {}",
                allowed.as_millis().div_ceil(1000)
            ));
            said = Some(waited);
        }
        if done() {
            return true;
        }
        if bound.expired() {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stops_count_of_its_wait_is_told_apart_from_its_rungs() {
        assert!(counts_a_wait(
            "stopping: waiting for the guest to power off, 3 s of 30"
        ));
        assert!(!counts_a_wait("stopping: pressing the power button"));
        assert!(!counts_a_wait(
            "stopping: asking its hypervisor to shut down"
        ));
    }
    use std::cell::{Cell, RefCell};
    use std::io;

    /// A VMM that exits after the first of `exits_on` it is asked or sent.
    struct Scripted {
        exits_on: &'static str,
        gone: Cell<bool>,
        seen: RefCell<Vec<String>>,
    }

    impl Scripted {
        fn new(exits_on: &'static str) -> Scripted {
            Scripted {
                exits_on,
                gone: Cell::new(false),
                seen: RefCell::new(Vec::new()),
            }
        }

        fn saw(&self, what: String) {
            if what == self.exits_on {
                self.gone.set(true);
            }
            self.seen.borrow_mut().push(what);
        }
    }

    impl Vmm for Scripted {
        fn noun(&self) -> &'static str {
            "the test VMM"
        }
        fn alive(&self) -> bool {
            !self.gone.get()
        }
        fn gone(&self) -> bool {
            self.gone.get()
        }
        fn says_running(&self) -> bool {
            !self.gone.get()
        }
        fn says_paused(&self) -> bool {
            false
        }
        fn powered_off(&self) -> bool {
            false
        }
        fn ask(&self, request: Request) {
            self.saw(format!("{request:?}"));
        }
        fn signal(&self, signal: Signal) -> io::Result<()> {
            self.saw(format!("{signal:?}"));
            Ok(())
        }
        fn pid(&self) -> u32 {
            1
        }
        fn failure_reason(&self) -> String {
            String::new()
        }
    }

    fn quick() -> StopTimeouts {
        StopTimeouts {
            power_button: Duration::from_millis(30),
            vmm_shutdown: Duration::from_millis(30),
            terminate: Duration::from_millis(30),
            kill: Duration::from_millis(30),
        }
    }

    /// Stops `vmm`, its guest running, with [`quick`] timeouts and no
    /// deadline, saying nothing.
    fn stop_running(vmm: &dyn Vmm) -> Result<(), SuperviseError> {
        stop(
            &vm(),
            vmm,
            (quick(), Deadline::NONE),
            Guest::Running,
            &|_| {},
        )
    }

    fn vm() -> Id {
        Id::parse("vm-1").expect("id")
    }

    #[test]
    fn each_rung_is_climbed_only_while_the_vmm_stays() {
        let vmm = Scripted::new("SIGTERM");

        stop_running(&vmm).expect("stopped");

        assert_eq!(*vmm.seen.borrow(), ["PowerButton", "Shutdown", "SIGTERM"]);
    }

    #[test]
    fn a_pass_out_of_time_goes_straight_to_sigkill() {
        let vmm = Scripted::new("SIGKILL");
        let expired = Deadline::after(Duration::ZERO);

        stop(&vm(), &vmm, (quick(), expired), Guest::Running, &|_| {}).expect("stopped");

        assert_eq!(*vmm.seen.borrow(), ["SIGKILL"]);
    }

    #[test]
    fn a_vmm_that_survives_sigkill_is_an_error_naming_it() {
        let vmm = Scripted::new("nothing");

        let err = stop_running(&vmm).expect_err("survived");

        assert_eq!(
            err.to_string(),
            "VM vm-1: the test VMM (pid 1) survived SIGKILL"
        );
    }

    #[cfg(feature = "testkit")]
    #[test]
    fn a_guest_that_powers_off_at_the_power_button_is_said_to_have() {
        let log = crate::testkit::logs::capture();
        let vmm = Scripted::new("PowerButton");

        stop_running(&vmm).expect("stopped");

        assert_eq!(
            log.count(log::Level::Info, "VM vm-1: the guest powered off"),
            1
        );
        assert_eq!(log.count(log::Level::Warn, "VM vm-1"), 0);
    }

    #[cfg(feature = "testkit")]
    #[test]
    fn a_guest_deaf_to_the_power_button_is_warned_of_its_vmm_stopped_under_it() {
        let log = crate::testkit::logs::capture();
        let vmm = Scripted::new("Shutdown");

        stop_running(&vmm).expect("stopped");

        let warning = "VM vm-1: the guest did not power off within 0 s of the power button; \
                       stopping the test VMM under it";
        assert_eq!(log.count(log::Level::Warn, warning), 1);
        assert_eq!(log.count(log::Level::Info, "the guest powered off"), 0);
    }

    #[test]
    fn the_row_is_told_each_rung_and_the_wait() {
        let vmm = Scripted::new("Shutdown");
        let said = RefCell::new(Vec::new());

        stop(
            &vm(),
            &vmm,
            (quick(), Deadline::NONE),
            Guest::Running,
            &|s| said.borrow_mut().push(s.to_owned()),
        )
        .expect("stopped");

        assert_eq!(
            said.borrow()[..3],
            [
                "stopping: pressing the power button",
                "stopping: waiting for the guest to power off, 0 s of 1",
                "stopping: asking the test VMM to shut down",
            ]
        );
    }
}
