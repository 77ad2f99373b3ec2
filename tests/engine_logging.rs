//! A VM failing the same way every tick is one warning, not one a tick.

mod common;

use std::sync::OnceLock;

use common::Harness;
use eitri_agent::model::{PowerState, Snapshot};
use eitri_agent::testkit::{Op, desired, id, present, snapshot};
use parking_lot::Mutex;

/// Captures every log record of this test process.
struct Capture(Mutex<Vec<(log::Level, String)>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        self.0
            .lock()
            .push((record.level(), record.args().to_string()));
    }
    fn flush(&self) {}
}

fn capture() -> &'static Capture {
    static CAPTURE: OnceLock<&'static Capture> = OnceLock::new();
    CAPTURE.get_or_init(|| {
        let c: &'static Capture = Box::leak(Box::new(Capture(Mutex::new(Vec::new()))));
        log::set_logger(c).expect("one logger per test process");
        log::set_max_level(log::LevelFilter::Debug);
        c
    })
}

fn warnings_about(text: &str) -> usize {
    capture()
        .0
        .lock()
        .iter()
        .filter(|(level, msg)| *level == log::Level::Warn && msg.contains(text))
        .count()
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
