//! What the engine does for a backend that lacks a capability (see
//! `provision::Lifecycle`): it asks for each one once where it needs it,
//! and says itself what a backend without it does.

use crate::common::Harness;
use eitri_agent::model::{Cidr, Egress, Phase, PowerState, Publish, Snapshot};
use eitri_agent::state::lifecycle::Suspension;
use eitri_agent::testkit::{Call, desired, id, present, snapshot};

const VM: &str = "vm-1";

fn wanted(power: PowerState) -> Snapshot {
    let mut d = desired(VM);
    d.power = power;
    snapshot(1, vec![present(d)])
}

#[test]
fn a_backend_that_cannot_suspend_fails_a_suspend_for_good_and_the_vm_runs_on() {
    let h = Harness::bare();
    h.tick(&wanted(PowerState::Running));

    h.tick(&wanted(PowerState::Suspended));

    let row = h.row(VM);
    assert_eq!(row.power, Some(PowerState::Running));
    assert_eq!(
        row.last_error,
        "VM vm-1: this host's hypervisor backend cannot suspend a VM"
    );
    assert_eq!(h.record(VM).lifecycle.suspension(), Suspension::None);
}

#[test]
fn a_vm_suspended_before_its_backend_could_not_suspend_is_booted_from_its_disks() {
    let h = Harness::new();
    h.tick(&wanted(PowerState::Running));
    h.tick(&wanted(PowerState::Suspended));
    let h = h.restart_bare();
    h.fakes.forget_calls();

    h.tick(&wanted(PowerState::Running));

    assert_eq!(h.row(VM).power, Some(PowerState::Running));
    assert_eq!(h.fakes.count(|c| *c == Call::Boot(id(VM))), 1);
    assert_eq!(h.record(VM).lifecycle.suspension(), Suspension::None);
}

#[test]
fn a_backend_that_holds_nothing_takes_an_open_egress() {
    let h = Harness::bare();

    h.tick(&wanted(PowerState::Running));

    let row = h.row(VM);
    assert_eq!(row.power, Some(PowerState::Running));
    assert_eq!(row.last_error, "");
}

#[test]
fn a_backend_that_holds_nothing_does_not_start_a_vm_with_its_own_egress_rules() {
    let h = Harness::bare();
    let mut d = desired(VM);
    d.egress = Egress {
        deny: vec![Cidr::parse("0.0.0.0/0").expect("cidr")],
        allow: Vec::new(),
    };

    h.tick(&snapshot(1, vec![present(d)]));

    let row = h.row(VM);
    assert_eq!(row.power, Some(PowerState::Stopped));
    assert_eq!(row.status_detail, "waiting for the host");
    assert!(
        row.last_error.starts_with(
            "its own egress rules cannot be held on this host, so it is not started: \
             this host's hypervisor backend cannot hold a VM's own egress rules"
        ),
        "{}",
        row.last_error
    );
    assert_eq!(h.fakes.count(|c| *c == Call::Boot(id(VM))), 0);
}

#[test]
fn a_backend_that_holds_nothing_runs_a_vm_that_publishes_and_says_its_ports_are_refused() {
    let h = Harness::bare();
    let mut d = desired(VM);
    d.published = vec![Publish::tcp(8022, 22)];

    h.tick(&snapshot(1, vec![present(d)]));

    let row = h.row(VM);
    assert_eq!(row.power, Some(PowerState::Running));
    assert_eq!(row.phase, Some(Phase::Ready));
    assert!(row.published.is_empty());
    assert_eq!(
        row.last_error,
        "this host's hypervisor backend cannot publish a VM's ports"
    );
}
