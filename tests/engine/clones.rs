//! Clones through the engine, against the fake backend: a clone is made
//! from its template's saved guest and never booted, waits for a template
//! on its way without spending its budget, fails for good when its
//! template is gone, and is never ready while it is still its template's
//! copy.

use std::time::Instant;

use crate::common::{Harness, SETTLE};
use eitri_agent::model::{DesiredVm, Id, Phase, PowerState, Snapshot, VmStatus};
use eitri_agent::provision::Suspend;
use eitri_agent::testkit::{Call, Op, desired, id, present, snapshot};

const TEMPLATE: &str = "base";
const CLONE: &str = "web-1";

fn template(power: PowerState) -> DesiredVm {
    let mut d = desired(TEMPLATE);
    d.power = power;
    d.template = power == PowerState::Suspended;
    d
}

/// The template wanted running: its clones are made from its save.
fn running_template() -> DesiredVm {
    let mut d = desired(TEMPLATE);
    d.template = true;
    d
}

/// A harness whose running template is ready and saved.
fn with_running_template() -> Harness {
    let h = Harness::new();
    let alone = wanted(vec![running_template()]);
    h.tick_until(&alone, TEMPLATE, |r| r.phase == Some(Phase::Ready));
    h.tick(&alone);
    h
}

fn clone_of(template: &str) -> DesiredVm {
    let mut d = desired(CLONE);
    d.spec.clone_of = Some(Id::parse(template).expect("id"));
    d.spec.image_url = String::new();
    d.spec.image_sha256 = String::new();
    d
}

fn wanted(vms: Vec<DesiredVm>) -> Snapshot {
    snapshot(1, vms.into_iter().map(present).collect())
}

/// A harness whose template is created and suspended.
fn with_template() -> Harness {
    let h = Harness::new();
    h.tick(&wanted(vec![template(PowerState::Running)]));
    h.tick(&wanted(vec![template(PowerState::Suspended)]));
    h
}

#[test]
fn a_clone_is_made_from_its_templates_saved_guest_and_never_booted_from_an_image() {
    let h = with_template();

    h.tick(&wanted(vec![
        template(PowerState::Suspended),
        clone_of(TEMPLATE),
    ]));

    assert_eq!(
        h.fakes
            .count(|c| *c == Call::CloneSaved(id(CLONE), id(TEMPLATE))),
        1
    );
    assert_eq!(h.fakes.count(|c| *c == Call::Resume(id(CLONE))), 1);
    assert_eq!(h.fakes.count(|c| *c == Call::Boot(id(CLONE))), 0);
    assert_eq!(
        h.fakes
            .count(|c| matches!(c, Call::Resolve { url } if url.is_empty())),
        0,
        "a clone fetches no image"
    );
}

#[test]
fn a_clone_whose_template_is_not_yet_saved_waits_without_spending_an_attempt() {
    let h = Harness::new();
    h.tick(&wanted(vec![template(PowerState::Running)]));

    h.tick(&wanted(vec![
        template(PowerState::Running),
        clone_of(TEMPLATE),
    ]));

    let row = h.row(CLONE);
    assert_eq!(row.phase, Some(Phase::Creating));
    assert!(
        row.last_error
            .contains("waiting for its template base to be saved"),
        "{row:?}"
    );
    assert!(!h.has_record(CLONE) || h.record(CLONE).lifecycle.create_attempts() == 0);
    assert_eq!(h.fakes.count(|c| matches!(c, Call::CloneSaved(..))), 0);
}

/// The clone's row once its pass has said something of it, while other
/// passes may still run.
fn said(h: &Harness) -> Option<VmStatus> {
    let until = Instant::now() + SETTLE;
    while Instant::now() < until {
        if let Some(row) = h.try_row(CLONE)
            && !row.last_error.is_empty()
        {
            return Some(row);
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    None
}

#[test]
fn a_clone_wanted_with_its_template_waits_for_the_template_to_be_made() {
    let h = Harness::new();
    // The template's create held before its first record is saved.
    let gate = h.fakes.block(Op::Preflight, "");
    let both = wanted(vec![template(PowerState::Suspended), clone_of(TEMPLATE)]);

    h.engine.step(&both);
    assert!(gate.wait_entered(1, SETTLE));
    let row = said(&h);
    gate.release();

    let row = row.expect("the clone's pass said nothing");
    assert_eq!(row.phase, Some(Phase::Creating), "{row:?}");
    assert!(
        row.last_error
            .contains("waiting for its template base to be created"),
        "{row:?}"
    );
    h.idle();
    h.tick_until(&both, CLONE, |_| {
        h.fakes.count(|c| matches!(c, Call::CloneSaved(..))) == 1
    });
}

#[test]
fn a_clone_of_a_vm_this_host_does_not_have_fails_for_good_saying_so() {
    let h = Harness::new();

    h.tick(&wanted(vec![clone_of("nowhere")]));

    let row = h.row(CLONE);
    assert_eq!(row.phase, Some(Phase::Failed));
    assert!(
        row.last_error
            .contains("its template nowhere is no VM of this host"),
        "{row:?}"
    );
    assert!(h.record(CLONE).lifecycle.failure_permanent());
}

#[test]
fn a_clone_its_guest_agent_cannot_make_its_own_is_never_ready_and_is_stopped() {
    // The fake backend gives no guest agent's door.
    let h = with_template();

    h.tick(&wanted(vec![
        template(PowerState::Suspended),
        clone_of(TEMPLATE),
    ]));

    let row = h.row(CLONE);
    assert_ne!(row.phase, Some(Phase::Ready), "{row:?}");
    assert!(
        row.last_error.contains("was not made a machine of its own"),
        "{row:?}"
    );
    assert_eq!(h.fakes.count(|c| *c == Call::Shutdown(id(CLONE))), 1);
    assert!(!eitri_agent::provision::Lifecycle::running(
        &*h.fakes,
        &id(CLONE)
    ));
}

#[test]
fn the_template_keeps_its_saved_guest_when_cloned() {
    let h = with_template();

    h.tick(&wanted(vec![
        template(PowerState::Suspended),
        clone_of(TEMPLATE),
    ]));

    assert_eq!(h.row(TEMPLATE).power, Some(PowerState::Suspended));
    assert!(h.record(TEMPLATE).lifecycle.suspension().saved().is_some());
    assert_eq!(h.fakes.count(|c| *c == Call::Resume(id(TEMPLATE))), 0);
}

#[test]
fn a_clone_of_a_template_gone_from_the_desired_state_fails_for_good_saying_so() {
    let h = with_template();
    // The template gone from the desired state: quarantined.
    h.tick(&wanted(vec![]));
    assert!(h.has_record(TEMPLATE), "quarantined, not yet destroyed");

    h.tick(&wanted(vec![clone_of(TEMPLATE)]));

    let row = h.row(CLONE);
    assert_eq!(row.phase, Some(Phase::Failed), "{row:?}");
    assert!(
        row.last_error
            .contains("its template base is gone from the desired state"),
        "{row:?}"
    );
    assert_eq!(h.fakes.count(|c| matches!(c, Call::CloneSaved(..))), 0);
}

#[test]
fn a_running_template_is_saved_once_it_is_ready_and_runs_on() {
    let h = Harness::new();
    let wanted_running = wanted(vec![running_template()]);

    h.tick_until(&wanted_running, TEMPLATE, |r| r.phase == Some(Phase::Ready));
    h.tick(&wanted_running);
    h.tick(&wanted_running);

    assert_eq!(h.fakes.count(|c| *c == Call::SaveTemplate(id(TEMPLATE))), 1);
    assert_eq!(h.fakes.count(|c| *c == Call::Suspend(id(TEMPLATE))), 0);
    assert_eq!(h.row(TEMPLATE).power, Some(PowerState::Running));
    assert!(!h.record(TEMPLATE).templating, "its save is recorded done");
}

#[test]
fn a_clone_of_a_running_template_is_made_from_its_save() {
    let h = with_running_template();

    h.tick(&wanted(vec![running_template(), clone_of(TEMPLATE)]));

    assert_eq!(
        h.fakes
            .count(|c| *c == Call::CloneSaved(id(CLONE), id(TEMPLATE))),
        1
    );
    assert_eq!(h.fakes.count(|c| *c == Call::Resume(id(CLONE))), 1);
    assert_eq!(h.row(TEMPLATE).power, Some(PowerState::Running));
}

#[test]
fn a_clone_of_a_running_template_not_yet_saved_waits_for_the_save() {
    let h = Harness::new();
    h.fakes.fail(Op::SaveTemplate, TEMPLATE, "the disk is full");
    let both = wanted(vec![running_template(), clone_of(TEMPLATE)]);

    h.tick_until(&both, TEMPLATE, |r| r.phase == Some(Phase::Ready));
    h.tick(&both);

    let row = h.row(CLONE);
    assert_eq!(row.phase, Some(Phase::Creating), "{row:?}");
    assert!(
        row.last_error
            .contains("waiting for its template base to be saved"),
        "{row:?}"
    );
    assert_eq!(h.fakes.count(|c| matches!(c, Call::CloneSaved(..))), 0);
}

#[test]
fn a_failed_template_save_is_not_tried_again_at_every_pass() {
    let h = Harness::new();
    h.fakes.fail(Op::SaveTemplate, TEMPLATE, "the disk is full");
    let alone = wanted(vec![running_template()]);
    h.tick_until(&alone, TEMPLATE, |r| r.phase == Some(Phase::Ready));

    for _ in 0..3 {
        h.tick(&alone);
    }

    assert_eq!(
        h.fakes.count(|c| *c == Call::SaveTemplate(id(TEMPLATE))),
        1,
        "each try pauses its guest"
    );
    assert_eq!(h.row(TEMPLATE).phase, Some(Phase::Ready));
}

#[test]
fn a_guest_a_templates_save_left_paused_is_resumed_at_its_next_pass() {
    let h = Harness::new();
    let alone = wanted(vec![running_template()]);
    h.tick_until(&alone, TEMPLATE, |r| r.phase == Some(Phase::Ready));
    // As a crash between its pause and its resume leaves it.
    let mut rec = h.record(TEMPLATE);
    rec.templating = true;
    h.store.save(&rec).expect("saved");
    let h = h.restart();

    h.tick(&alone);

    assert_eq!(h.fakes.count(|c| *c == Call::Unpause(id(TEMPLATE))), 1);
    assert!(!h.record(TEMPLATE).templating);
}

#[test]
fn a_vm_no_longer_a_running_template_has_its_save_removed() {
    let h = with_running_template();
    assert!(h.fakes.template_saved(&id(TEMPLATE)).is_some());

    h.tick(&wanted(vec![desired(TEMPLATE)]));

    assert_eq!(
        h.fakes.count(|c| *c == Call::DiscardTemplate(id(TEMPLATE))),
        1
    );
    assert!(h.fakes.template_saved(&id(TEMPLATE)).is_none());
}
