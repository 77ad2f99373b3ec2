//! The VM lifecycle as a table: for every state a VM can be in and every
//! event that can happen to it, the state it ends in and what the report
//! says of it. Then a property over random records: whatever a pass does,
//! the row it publishes and the row read back from the record it left
//! (`observe`, the fence and a refusal read it so) agree.

use eitri_agent::state::lifecycle::{Lifecycle, LifecycleParts};
use std::time::Duration;

use crate::common::{Harness, config};
use eitri_agent::daemon::XorShift;
use eitri_agent::model::{Phase, PowerState, Saved, Snapshot};
use eitri_agent::provision::SavedGuest;
use eitri_agent::reconcile::lifecycle::{self, Attempts, Budget, State};
use eitri_agent::reconcile::seams::HostFacts;
use eitri_agent::state::Record;
use eitri_agent::state::lifecycle::Suspension;
use eitri_agent::testkit::{Op, desired, id, present, snapshot, tombstoned};

const VM: &str = "vm-1";

/// Where a VM is before the event.
#[derive(Clone, Copy, Debug)]
enum Start {
    NoRecord,
    /// A create failed once on an error that may pass: retried after 10 s.
    Retrying,
    /// Three attempts failed on errors that may pass: re-armed after 1 h.
    Spent,
    /// A create failed on an error no retry fixes.
    Permanent,
    /// A create was stopped by what the host lacks (no hypervisor); the
    /// host is fixed before the event.
    WaitingForHost,
    Up,
    /// Up, and its hypervisor died, not yet noticed.
    Crashed,
    Down,
    Quarantined,
    Suspended,
    /// A suspend cut short by a crash, its VMM alive (paused).
    SuspendCut,
    /// A resume cut short by a crash before its VMM ran: the saved state is
    /// there, and spent.
    ResumeCut,
}

/// What happens next, followed by a tick.
#[derive(Clone, Copy, Debug)]
enum Event {
    /// Desired running.
    Run,
    /// Desired stopped.
    Stop,
    /// The host rebooted (a new boot id); desired running.
    Reboot,
    /// Gone from desired state.
    Vanish,
    Tombstone,
    /// Two hours pass, desired state as it was.
    Wait,
    /// Desired running with another spec (more memory).
    Respec,
    /// Desired suspended.
    Suspend,
}

/// What the report says of the VM after the event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Said {
    Row(PowerState, Phase),
    Quarantined,
    Nothing,
}

fn running() -> Snapshot {
    snapshot(1, vec![present(desired(VM))])
}

fn stopped() -> Snapshot {
    let mut d = desired(VM);
    d.power = PowerState::Stopped;
    snapshot(1, vec![present(d)])
}

fn absent() -> Snapshot {
    snapshot(1, vec![])
}

fn suspended() -> Snapshot {
    let mut d = desired(VM);
    d.power = PowerState::Suspended;
    snapshot(1, vec![present(d)])
}

/// Rewrites the VM's record with `suspension`, as a crash would leave it
/// (the engine made again over the same store).
fn cut_short(h: Harness, suspension: Suspension) -> Harness {
    let mut rec = h.record(VM);
    let mut parts = rec.lifecycle.parts();
    parts.suspension = suspension;
    rec.lifecycle = Lifecycle::from_parts(parts);
    h.store.save(&rec).expect("save");
    h.restart()
}

fn budget() -> Budget {
    let c = config();
    Budget {
        max_attempts: c.max_create_attempts,
        rearm: c.create_rearm,
    }
}

/// Brings a VM to `from`, and returns the harness and the snapshot it
/// lives under.
fn arrange(h: Harness, from: Start) -> (Harness, Snapshot) {
    match from {
        Start::SuspendCut => {
            h.tick(&running());
            (cut_short(h, Suspension::Suspending), suspended())
        }
        Start::ResumeCut => {
            h.tick(&running());
            h.tick(&suspended());
            let saved = h.fakes.saved(&id(VM));
            let h = cut_short(h, Suspension::Resuming);
            h.fakes.set_saved(&id(VM), saved);
            (h, running())
        }
        _ => {
            let steady = arrange_in(&h, from);
            (h, steady)
        }
    }
}

fn arrange_in(h: &Harness, from: Start) -> Snapshot {
    match from {
        Start::SuspendCut | Start::ResumeCut => unreachable!("arranged above"),
        Start::NoRecord => absent(),
        Start::Retrying => {
            h.fakes.fail(Op::Boot, VM, "kvm busy");
            h.tick(&running());
            h.fakes.clear(Op::Boot, VM);
            running()
        }
        Start::Spent => {
            h.fakes.fail(Op::Boot, VM, "kvm busy");
            for _ in 0..3 {
                h.tick(&running());
                h.fakes.advance_clock(Duration::from_secs(90));
            }
            h.fakes.clear(Op::Boot, VM);
            running()
        }
        Start::Permanent => {
            h.fakes
                .fail_permanently(Op::PrepareRootDisk, VM, "would shrink the disk");
            h.tick(&running());
            h.fakes.clear(Op::PrepareRootDisk, VM);
            running()
        }
        Start::WaitingForHost => {
            h.fakes
                .fail_on_host(Op::Preflight, "", "the hypervisor is not installed");
            h.tick(&running());
            h.fakes.clear(Op::Preflight, "");
            running()
        }
        Start::Up => {
            h.tick(&running());
            running()
        }
        Start::Crashed => {
            h.tick(&running());
            h.fakes.set_running(&id(VM), false);
            running()
        }
        Start::Down => {
            h.tick(&running());
            h.tick(&stopped());
            stopped()
        }
        Start::Quarantined => {
            h.tick(&running());
            h.tick(&absent());
            absent()
        }
        Start::Suspended => {
            h.tick(&running());
            h.tick(&suspended());
            suspended()
        }
    }
}

fn act(h: &Harness, event: Event, steady: &Snapshot) {
    match event {
        Event::Run => h.tick(&running()),
        Event::Stop => h.tick(&stopped()),
        Event::Reboot => {
            h.fakes.set_boot_id("boot-2");
            h.fakes.set_running(&id(VM), false);
            h.tick(&running())
        }
        Event::Vanish => h.tick(&absent()),
        Event::Tombstone => h.tick(&snapshot(1, vec![tombstoned(VM)])),
        Event::Wait => {
            h.fakes.advance_clock(Duration::from_secs(2 * 3600));
            h.tick(steady)
        }
        Event::Respec => {
            let mut d = desired(VM);
            d.spec.mem_mb = 512;
            h.tick(&snapshot(1, vec![present(d)]))
        }
        Event::Suspend => h.tick(&suspended()),
    };
}

/// The state's name, as the table writes it.
fn state_of(h: &Harness) -> &'static str {
    if !h.has_record(VM) {
        return "no record";
    }
    match lifecycle::state(&h.record(VM), budget()) {
        State::Creating(Attempts::Open { .. }) => "creating",
        State::Creating(Attempts::Spent { .. }) => "creating, spent",
        State::Creating(Attempts::Permanent) => "creating, permanent",
        State::Creating(Attempts::WaitingForHost) => "creating, host",
        State::Up => "up",
        State::Down => "down",
        State::Suspending => "suspending",
        State::Suspended => "suspended",
        State::Resuming => "resuming",
        State::Quarantined { .. } => "quarantined",
    }
}

fn said(h: &Harness) -> Said {
    let report = h.engine.published();
    if report.quarantined.iter().any(|q| q.vm_id == id(VM)) {
        return Said::Quarantined;
    }
    match report.vms.iter().find(|r| r.vm_id == VM) {
        Some(row) => Said::Row(
            row.power.expect("an observed power"),
            row.phase.expect("a phase"),
        ),
        None => Said::Nothing,
    }
}

/// Every state against every event: the state it ends in and what the
/// report says.
mod table {
    use super::Event::*;
    use super::Start::*;
    use super::{Event, Said, Start};
    use Said::{Nothing, Row};
    use eitri_agent::model::Phase::{Creating, Failed, Ready};
    use eitri_agent::model::PowerState::{Running as On, Stopped as Off, Suspended as Sus};
    const Q: Said = Said::Quarantined;

    #[rustfmt::skip]
    pub const TABLE: &[(Start, Event, &str, Said)] = &[
        (NoRecord,    Run,       "up",                  Row(On, Ready)),
        (NoRecord,    Stop,      "down",                Row(Off, Ready)),
        (NoRecord,    Reboot,    "up",                  Row(On, Ready)),
        (NoRecord,    Vanish,    "no record",           Nothing),
        (NoRecord,    Tombstone, "no record",           Nothing),
        (NoRecord,    Wait,      "no record",           Nothing),
        (NoRecord,    Respec,    "up",                  Row(On, Ready)),
        (NoRecord,    Suspend,   "suspended",           Row(Sus, Ready)),
        // A failed attempt waits out its backoff, whatever else is asked.
        (Retrying,    Run,       "creating",            Row(Off, Creating)),
        (Retrying,    Stop,      "creating",            Row(Off, Creating)),
        (Retrying,    Reboot,    "creating",            Row(Off, Creating)),
        (Retrying,    Vanish,    "quarantined",         Q),
        (Retrying,    Tombstone, "quarantined",         Q),
        (Retrying,    Wait,      "up",                  Row(On, Ready)),
        (Retrying,    Respec,    "up",                  Row(On, Ready)),
        (Retrying,    Suspend,   "creating",            Row(Off, Creating)),
        // A budget spent on errors that may pass heals with time...
        (Spent,       Run,       "creating, spent",     Row(Off, Failed)),
        (Spent,       Stop,      "creating, spent",     Row(Off, Failed)),
        (Spent,       Reboot,    "creating, spent",     Row(Off, Failed)),
        (Spent,       Vanish,    "quarantined",         Q),
        (Spent,       Tombstone, "quarantined",         Q),
        (Spent,       Wait,      "up",                  Row(On, Ready)),
        (Spent,       Respec,    "up",                  Row(On, Ready)),
        (Spent,       Suspend,   "creating, spent",     Row(Off, Failed)),
        // ...a permanent error only with a new spec.
        (Permanent,   Run,       "creating, permanent", Row(Off, Failed)),
        (Permanent,   Stop,      "creating, permanent", Row(Off, Failed)),
        (Permanent,   Reboot,    "creating, permanent", Row(Off, Failed)),
        (Permanent,   Vanish,    "quarantined",         Q),
        (Permanent,   Tombstone, "quarantined",         Q),
        (Permanent,   Wait,      "creating, permanent", Row(Off, Failed)),
        (Permanent,   Respec,    "up",                  Row(On, Ready)),
        (Permanent,   Suspend,   "creating, permanent", Row(Off, Failed)),
        // What the host lacked spent nothing: the next pass finds it fixed.
        (WaitingForHost, Run,    "up",                  Row(On, Ready)),
        (WaitingForHost, Stop,   "down",                Row(Off, Ready)),
        (WaitingForHost, Reboot, "up",                  Row(On, Ready)),
        (WaitingForHost, Vanish, "quarantined",         Q),
        (WaitingForHost, Tombstone, "quarantined",      Q),
        (WaitingForHost, Wait,   "up",                  Row(On, Ready)),
        (WaitingForHost, Respec, "up",                  Row(On, Ready)),
        (WaitingForHost, Suspend, "suspended",          Row(Sus, Ready)),
        (Up,          Run,       "up",                  Row(On, Ready)),
        (Up,          Stop,      "down",                Row(Off, Ready)),
        (Up,          Reboot,    "up",                  Row(On, Ready)),
        (Up,          Vanish,    "quarantined",         Q),
        (Up,          Tombstone, "quarantined",         Q),
        (Up,          Wait,      "up",                  Row(On, Ready)),
        (Up,          Respec,    "up",                  Row(On, Ready)),
        (Up,          Suspend,   "suspended",           Row(Sus, Ready)),
        // Lost: booted again if it should run, recorded stopped if not.
        (Crashed,     Run,       "up",                  Row(On, Ready)),
        (Crashed,     Stop,      "down",                Row(Off, Ready)),
        (Crashed,     Reboot,    "up",                  Row(On, Ready)),
        (Crashed,     Vanish,    "quarantined",         Q),
        (Crashed,     Tombstone, "quarantined",         Q),
        (Crashed,     Wait,      "up",                  Row(On, Ready)),
        (Crashed,     Respec,    "up",                  Row(On, Ready)),
        (Crashed,     Suspend,   "suspended",           Row(Sus, Ready)),
        (Down,        Run,       "up",                  Row(On, Ready)),
        (Down,        Stop,      "down",                Row(Off, Ready)),
        (Down,        Reboot,    "up",                  Row(On, Ready)),
        (Down,        Vanish,    "quarantined",         Q),
        (Down,        Tombstone, "quarantined",         Q),
        (Down,        Wait,      "down",                Row(Off, Ready)),
        (Down,        Respec,    "up",                  Row(On, Ready)),
        (Down,        Suspend,   "suspended",           Row(Sus, Ready)),
        // Back in desired state: out of quarantine; past its grace: gone.
        (Quarantined, Run,       "up",                  Row(On, Ready)),
        (Quarantined, Stop,      "down",                Row(Off, Ready)),
        (Quarantined, Reboot,    "up",                  Row(On, Ready)),
        (Quarantined, Vanish,    "quarantined",         Q),
        (Quarantined, Tombstone, "quarantined",         Q),
        (Quarantined, Wait,      "no record",           Nothing),
        (Quarantined, Respec,    "up",                  Row(On, Ready)),
        (Quarantined, Suspend,   "suspended",           Row(Sus, Ready)),
        // Resumed, discarded, kept; a host reboot loses nothing saved.
        (Suspended,   Run,       "up",                  Row(On, Ready)),
        (Suspended,   Stop,      "down",                Row(Off, Ready)),
        (Suspended,   Reboot,    "up",                  Row(On, Ready)),
        (Suspended,   Vanish,    "quarantined",         Q),
        (Suspended,   Tombstone, "quarantined",         Q),
        (Suspended,   Wait,      "suspended",           Row(Sus, Ready)),
        (Suspended,   Respec,    "up",                  Row(On, Ready)),
        (Suspended,   Suspend,   "suspended",           Row(Sus, Ready)),
        // Cut short with its VMM alive: resumed where it stands, or
        // suspended again; with its VMM gone (a reboot), booted from disk.
        (SuspendCut,  Run,       "up",                  Row(On, Ready)),
        (SuspendCut,  Stop,      "down",                Row(Off, Ready)),
        (SuspendCut,  Reboot,    "up",                  Row(On, Ready)),
        (SuspendCut,  Vanish,    "quarantined",         Q),
        (SuspendCut,  Tombstone, "quarantined",         Q),
        (SuspendCut,  Wait,      "suspended",           Row(Sus, Ready)),
        (SuspendCut,  Respec,    "up",                  Row(On, Ready)),
        (SuspendCut,  Suspend,   "suspended",           Row(Sus, Ready)),
        // A spent saved state is never restored again: booted from disk.
        (ResumeCut,   Run,       "up",                  Row(On, Ready)),
        (ResumeCut,   Stop,      "down",                Row(Off, Ready)),
        (ResumeCut,   Reboot,    "up",                  Row(On, Ready)),
        (ResumeCut,   Vanish,    "quarantined",         Q),
        (ResumeCut,   Tombstone, "quarantined",         Q),
        (ResumeCut,   Wait,      "up",                  Row(On, Ready)),
        (ResumeCut,   Respec,    "up",                  Row(On, Ready)),
        (ResumeCut,   Suspend,   "suspended",           Row(Sus, Ready)),
    ];
}

#[test]
fn every_state_meets_every_event() {
    let table = table::TABLE;
    // Every pair, once.
    assert_eq!(table.len(), 12 * 8);

    let mut wrong = Vec::new();
    for &(from, event, state, report) in table {
        let (h, steady) = arrange(Harness::new(), from);

        act(&h, event, &steady);

        let got = (state_of(&h), said(&h));
        if got != (state, report) {
            wrong.push(format!(
                "{from:?} + {event:?}: got {got:?}, the table says {:?}",
                (state, report)
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A record as a crash, an older agent or any mix of events could leave
/// it (never quarantined: a desired VM leaves quarantine by design).
fn random_record(rng: &mut XorShift, now: std::time::SystemTime) -> Record {
    let mut pick = |n: u64| (rng.next_unit() * n as f64) as u64;
    let mut rec = Record::new(desired(VM).spec);
    rec.lifecycle = Lifecycle::from_parts(LifecycleParts {
        create_attempts: pick(5) as u32,
        last_error: ["", "kvm busy", "disk full"][pick(3) as usize].into(),
        failed_at: match pick(3) {
            0 => None,
            1 => Some(now - Duration::from_secs(pick(7200))),
            _ => Some(now),
        },
        failure_permanent: pick(4) == 0,
        boot_id: ["", "boot-1", "boot-0"][pick(3) as usize].into(),
        stop_requested: pick(2) == 0,
        suspension: match pick(5) {
            0 => Suspension::Suspending,
            1 => Suspension::Suspended(Saved::default()),
            2 => Suspension::Resuming,
            _ => Suspension::None,
        },
        ..LifecycleParts::default()
    });
    rec
}

#[test]
fn a_pass_and_the_record_it_left_agree_on_phase_and_error() {
    let mut rng = XorShift::from_seed(0x5eed_1234);
    let mut disagreements = Vec::new();
    for case in 0..200 {
        let mut h = Harness::new();
        let rec = random_record(&mut rng, HostFacts::now(&*h.fakes));
        h.store.save(&rec).expect("save");
        h = h.restart();
        let up = rng.next_unit() < 0.5;
        h.fakes.set_running(&id(VM), rng.next_unit() < 0.5);
        if rng.next_unit() < 0.5 {
            h.fakes
                .set_saved(&id(VM), Some(SavedGuest::Usable(Saved::default())));
        }
        if rng.next_unit() < 0.3 {
            h.fakes.fail(Op::Boot, VM, "boot refused");
        }
        if rng.next_unit() < 0.3 {
            h.fakes
                .fail(Op::Shutdown, VM, "guest ignored the power button");
        }
        let snap = match (up, rng.next_unit() < 0.3) {
            (_, true) => suspended(),
            (true, false) => running(),
            (false, false) => stopped(),
        };

        h.tick(&snap);

        let published = h.row(VM);
        let observed = h
            .engine
            .observe()
            .vms
            .into_iter()
            .find(|r| r.vm_id == VM)
            .expect("observed row");
        let pair = |r: &eitri_agent::model::VmStatus| (r.phase, r.last_error.clone());
        if pair(&published) != pair(&observed) {
            disagreements.push(format!(
                "case {case}: {rec:?} desired up={up}: pass {:?}, record {:?}",
                pair(&published),
                pair(&observed)
            ));
        }
    }
    assert!(disagreements.is_empty(), "{}", disagreements.join("\n"));
}
