//! A VM failing the same way every tick is one warning, not one a tick.

use crate::common::Harness;
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
