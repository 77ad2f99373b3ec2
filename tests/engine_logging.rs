//! A VM failing the same way every tick is one warning, not one a tick.

mod common;

use common::Harness;
use eitri_agent::model::{PowerState, Snapshot};
use eitri_agent::testkit::logs::capture;
use eitri_agent::testkit::{Op, desired, id, present, snapshot};

fn warnings_about(text: &str) -> usize {
    capture().count(log::Level::Warn, text)
}

fn running(vm: &str) -> Snapshot {
    snapshot(1, vec![present(desired(vm))])
}

#[test]
fn a_boot_failing_every_tick_is_warned_once_per_change() {
    capture();
    let h = Harness::new();
    h.tick(&running("vm-1"));
    h.fakes.set_running(&id("vm-1"), false);
    h.fakes.fail(Op::Boot, "vm-1", "tap busy");

    for _ in 0..5 {
        h.tick(&running("vm-1"));
    }
    h.fakes.fail(Op::Boot, "vm-1", "no space left on device");
    h.tick(&running("vm-1"));

    assert_eq!(warnings_about("boot failed: tap busy"), 1);
    assert_eq!(warnings_about("boot failed: no space left"), 1);
    assert_eq!(h.row("vm-1").power, Some(PowerState::Stopped));
}

#[test]
fn a_refused_snapshot_is_logged_once_while_it_repeats() {
    let log = capture();
    let h = Harness::new();
    let mut snap = running("vm-1");
    snap.min_agent_version = "1.2.0".into();

    for _ in 0..5 {
        h.tick(&snap);
    }

    assert_eq!(log.count(log::Level::Error, "refusing snapshot"), 1);
}

/// A VMM whose guest powers off at the power button, or does not; it
/// exits when asked to shut down.
struct Guest {
    listens: bool,
    gone: std::cell::Cell<bool>,
}

impl eitri_agent::provision::supervise::Vmm for Guest {
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
    fn powered_off(&self) -> bool {
        false
    }
    fn ask(&self, request: eitri_agent::provision::supervise::Request) {
        use eitri_agent::provision::supervise::Request;
        let exits = match request {
            Request::PowerButton => self.listens,
            Request::Shutdown => true,
        };
        if exits {
            self.gone.set(true);
        }
    }
    fn signal(&self, _: nix::sys::signal::Signal) -> std::io::Result<()> {
        Ok(())
    }
    fn pid(&self) -> u32 {
        1
    }
    fn failure_reason(&self) -> String {
        String::new()
    }
}

fn stop(listens: bool) {
    let timeouts = eitri_agent::provision::supervise::StopTimeouts {
        power_button: std::time::Duration::from_millis(50),
        ..Default::default()
    };
    let guest = Guest {
        listens,
        gone: std::cell::Cell::new(false),
    };
    eitri_agent::provision::supervise::stop(
        &id("vm-1"),
        &guest,
        timeouts,
        eitri_agent::deadline::Deadline::NONE,
        &|_| {},
    )
    .expect("stopped");
}

#[test]
fn a_guest_that_powers_off_at_the_power_button_is_said_to_have() {
    capture();

    stop(true);

    assert_eq!(
        capture().count(log::Level::Info, "VM vm-1: the guest powered off"),
        1
    );
    assert_eq!(capture().count(log::Level::Warn, "VM vm-1"), 0);
}

#[test]
fn a_guest_deaf_to_the_power_button_is_warned_of_its_vmm_stopped_under_it() {
    capture();

    stop(false);

    assert_eq!(
        capture().count(
            log::Level::Warn,
            "VM vm-1: the guest did not power off within 0 s of the power button"
        ),
        1
    );
    assert_eq!(
        capture().count(log::Level::Info, "the guest powered off"),
        0
    );
}
