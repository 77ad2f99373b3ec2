//! Suspend and resume through the engine, against the fake backend: the
//! order of intents and side effects, what a crash or a reboot in between
//! leaves, admission, and every way a saved state can fail to be usable.

use crate::common::{Harness, SETTLE, config};
use eitri_agent::model::{PowerState, Saved, Snapshot, VolumeSpec, WantedVolume};
use eitri_agent::provision::SavedGuest;
use eitri_agent::reconcile::{EngineConfig, HostCaps};
use eitri_agent::state::lifecycle::Suspension;
use eitri_agent::testkit::{Call, Op, desired, id, present, snapshot, tombstoned};

const VM: &str = "vm-1";

fn wanted(power: PowerState) -> Snapshot {
    let mut d = desired(VM);
    d.power = power;
    snapshot(1, vec![present(d)])
}

/// A harness with the VM suspended.
fn suspended() -> Harness {
    let h = Harness::new();
    h.tick(&wanted(PowerState::Running));
    h.tick(&wanted(PowerState::Suspended));
    h
}

fn calls_of(h: &Harness, pred: impl Fn(&Call) -> bool) -> usize {
    h.fakes.count(pred)
}

#[test]
fn a_running_vm_wanted_suspended_is_suspended_and_runs_no_vmm() {
    let h = Harness::new();
    h.tick(&wanted(PowerState::Running));

    h.tick(&wanted(PowerState::Suspended));

    assert_eq!(h.row(VM).power, Some(PowerState::Suspended));
    assert!(h.record(VM).lifecycle.suspension().saved().is_some());
    assert!(!eitri_agent::provision::Lifecycle::running(
        &*h.fakes,
        &id(VM)
    ));
    assert_eq!(calls_of(&h, |c| *c == Call::Suspend(id(VM))), 1);
}

#[test]
fn the_suspend_is_recorded_before_the_backend_is_asked() {
    let h = Harness::new();
    h.tick(&wanted(PowerState::Running));
    let gate = h.fakes.block(Op::Suspend, VM);

    h.engine.step(&wanted(PowerState::Suspended));
    let asked = gate.wait_entered(1, SETTLE);
    let saved = h.record(VM);
    gate.release();
    h.idle();

    assert!(asked);
    assert_eq!(saved.lifecycle.suspension(), Suspension::Suspending);
}

#[test]
fn a_suspend_whose_intent_cannot_be_saved_is_not_asked_for() {
    let h = Harness::new();
    h.tick(&wanted(PowerState::Running));
    h.break_record_dir(VM);

    h.tick(&wanted(PowerState::Suspended));

    assert_eq!(calls_of(&h, |c| matches!(c, Call::Suspend(_))), 0);
    assert_eq!(h.row(VM).power, Some(PowerState::Running));
}

#[test]
fn the_resume_is_recorded_before_its_guest_runs() {
    let h = suspended();
    let gate = h.fakes.block(Op::Run, VM);

    h.engine.step(&wanted(PowerState::Running));
    let asked = gate.wait_entered(1, SETTLE);
    let saved = h.record(VM);
    gate.release();
    h.idle();

    assert!(asked);
    assert_eq!(saved.lifecycle.suspension(), Suspension::Resuming);
    assert_eq!(h.row(VM).power, Some(PowerState::Running));
}

#[test]
fn a_resume_that_cannot_be_recorded_runs_no_guest_and_keeps_its_saved_state() {
    let h = suspended();
    h.break_record_dir(VM);

    h.tick(&wanted(PowerState::Running));

    assert_eq!(calls_of(&h, |c| *c == Call::ResumeRefused(id(VM))), 1);
    assert!(matches!(
        eitri_agent::provision::Suspend::suspension(&*h.fakes, &id(VM)),
        Some(SavedGuest::Usable(_))
    ));
    assert!(!eitri_agent::provision::Lifecycle::running(
        &*h.fakes,
        &id(VM)
    ));
    assert_eq!(h.row(VM).power, Some(PowerState::Suspended));
}

#[test]
fn a_suspended_vm_holds_its_disk_and_saved_state_but_no_vcpus_or_memory() {
    let h = suspended();

    let quota = h.engine.quota();

    assert_eq!(quota.vcpus.used, 0);
    assert_eq!(quota.mem_mb.used, 0);
    // Its 1 GB disk, and the fake's 64 MiB saved state rounded up to 1 GB.
    assert_eq!(quota.disk_gb.used, 2);
}

fn one_vcpu_host() -> Harness {
    Harness::with_config(EngineConfig {
        caps: HostCaps {
            max_vcpus: 1,
            ..HostCaps::default()
        },
        ..config()
    })
}

fn two(a: PowerState, b: PowerState) -> Snapshot {
    let mut first = desired("vm-a");
    first.power = a;
    let mut second = desired("vm-b");
    second.power = b;
    snapshot(1, vec![present(first), present(second)])
}

fn only_a_suspended() -> Snapshot {
    let mut first = desired("vm-a");
    first.power = PowerState::Suspended;
    snapshot(1, vec![present(first)])
}

#[test]
fn a_resume_on_a_full_host_waits_narrated_and_spends_nothing() {
    let h = one_vcpu_host();
    h.tick(&only_a_suspended());
    // vm-b takes the only vCPU while vm-a sleeps.
    h.tick(&two(PowerState::Suspended, PowerState::Running));

    h.tick(&two(PowerState::Running, PowerState::Running));

    let row = h.row("vm-a");
    assert_eq!(row.power, Some(PowerState::Suspended));
    assert!(
        row.status_detail
            .starts_with("waiting for room on this host to resume it: host capacity limit reached"),
        "{row:?}"
    );
    assert!(
        h.fakes.saved(&id("vm-a")).is_some(),
        "its saved state is kept"
    );
    assert_eq!(calls_of(&h, |c| *c == Call::Resume(id("vm-a"))), 0);
}

#[test]
fn a_resume_the_host_cannot_take_now_waits_with_its_saved_guest_then_resumes() {
    let h = suspended();
    h.fakes
        .fail_on_host(Op::Resumable, VM, "the huge page pool has 3 pages left");

    h.tick(&wanted(PowerState::Running));
    let waiting = (h.row(VM), h.fakes.saved(&id(VM)).is_some());
    h.fakes.clear(Op::Resumable, VM);
    h.tick(&wanted(PowerState::Running));

    assert_eq!(waiting.0.power, Some(PowerState::Suspended));
    assert_eq!(
        waiting.0.status_detail,
        "waiting for this host to be able to resume it: the huge page pool has 3 pages left"
    );
    assert!(waiting.1, "its saved guest is kept, not booted over");
    assert_eq!(h.row(VM).power, Some(PowerState::Running));
    assert_eq!(calls_of(&h, |c| *c == Call::Resume(id(VM))), 1);
    assert_eq!(
        calls_of(&h, |c| *c == Call::Boot(id(VM))),
        1,
        "booted once, at create"
    );
}

#[test]
fn a_resume_refused_for_room_is_admitted_once_room_is_made() {
    let h = one_vcpu_host();
    h.tick(&only_a_suspended());
    h.tick(&two(PowerState::Suspended, PowerState::Running));
    h.tick(&two(PowerState::Running, PowerState::Running));

    // vm-b is suspended: its vCPU is free.
    h.tick(&two(PowerState::Running, PowerState::Suspended));
    h.tick(&two(PowerState::Running, PowerState::Suspended));

    assert_eq!(h.row("vm-a").power, Some(PowerState::Running));
    assert_eq!(h.row("vm-b").power, Some(PowerState::Suspended));
    assert_eq!(calls_of(&h, |c| *c == Call::Resume(id("vm-a"))), 1);
}

#[test]
fn a_vm_suspended_before_an_agent_restart_is_resumed_after_it() {
    let h = suspended().restart();
    h.fakes.forget_calls();

    h.tick(&wanted(PowerState::Running));

    assert_eq!(h.row(VM).power, Some(PowerState::Running));
    assert_eq!(calls_of(&h, |c| *c == Call::Resume(id(VM))), 1);
    assert_eq!(calls_of(&h, |c| matches!(c, Call::Boot(_))), 0);
}

#[test]
fn a_host_reboot_while_suspended_loses_nothing_and_the_vm_resumes() {
    let h = suspended();
    h.fakes.set_boot_id("boot-2");

    h.tick(&wanted(PowerState::Suspended));
    h.tick(&wanted(PowerState::Running));

    assert_eq!(h.row(VM).power, Some(PowerState::Running));
    assert_eq!(h.engine.counts().lost.get(VM), 0);
    assert_eq!(calls_of(&h, |c| *c == Call::Resume(id(VM))), 1);
    assert_eq!(h.record(VM).lifecycle.boot_id(), "boot-2");
}

#[test]
fn a_saved_state_taken_with_other_disks_is_never_restored_and_the_vm_boots_from_disk() {
    let h = suspended();
    h.fakes.set_saved(
        &id(VM),
        Some(SavedGuest::Unusable(
            "taken with another disk.raw (inode 12, now 13)".into(),
        )),
    );
    h.fakes.forget_calls();

    h.tick(&wanted(PowerState::Running));

    assert_eq!(h.row(VM).power, Some(PowerState::Running));
    assert_eq!(calls_of(&h, |c| matches!(c, Call::Resume(_))), 0);
    assert_eq!(calls_of(&h, |c| *c == Call::Boot(id(VM))), 1);
    assert_eq!(h.engine.counts().cold_boots.get("unusable"), 1);
    assert_eq!(h.fakes.saved(&id(VM)), None, "discarded");
}

#[test]
fn a_resume_that_fails_boots_from_disk_and_never_resumes_that_state_again() {
    let h = suspended();
    h.fakes
        .fail(Op::Resume, VM, "restore refused: bad state.json");

    h.tick(&wanted(PowerState::Running));
    h.fakes.clear(Op::Resume, VM);
    h.tick(&wanted(PowerState::Running));

    assert_eq!(h.row(VM).power, Some(PowerState::Running));
    assert_eq!(calls_of(&h, |c| *c == Call::Resume(id(VM))), 1);
    assert_eq!(calls_of(&h, |c| *c == Call::Boot(id(VM))), 2);
    assert_eq!(h.engine.counts().cold_boots.get("failed"), 1);
}

#[test]
fn a_resume_cut_short_with_no_vmm_left_boots_from_disk_not_from_the_spent_state() {
    let h = suspended();
    let saved = h.fakes.saved(&id(VM));
    let mut rec = h.record(VM);
    rec.resume_intended();
    h.store.save(&rec).expect("save");
    let h = h.restart();
    h.fakes.set_saved(&id(VM), saved);
    h.fakes.forget_calls();

    h.tick(&wanted(PowerState::Running));

    assert_eq!(h.row(VM).power, Some(PowerState::Running));
    assert_eq!(calls_of(&h, |c| matches!(c, Call::Resume(_))), 0);
    assert_eq!(h.engine.counts().cold_boots.get("interrupted"), 1);
}

#[test]
fn a_suspend_that_fails_leaves_the_vm_running_with_the_error_and_tries_again() {
    let h = Harness::new();
    h.tick(&wanted(PowerState::Running));
    h.fakes.fail(Op::Suspend, VM, "snapshot refused: disk full");

    h.tick(&wanted(PowerState::Suspended));
    let failed = h.row(VM);
    h.fakes.clear(Op::Suspend, VM);
    h.tick(&wanted(PowerState::Suspended));

    assert_eq!(failed.power, Some(PowerState::Running));
    assert!(failed.last_error.contains("disk full"), "{failed:?}");
    assert_eq!(h.row(VM).power, Some(PowerState::Suspended));
    assert_eq!(h.row(VM).last_error, "");
}

#[test]
fn stopping_a_suspended_vm_discards_its_saved_state_and_a_later_start_boots_from_disk() {
    let h = suspended();

    h.tick(&wanted(PowerState::Stopped));
    let stopped = h.row(VM);
    let discarded = h.fakes.saved(&id(VM)).is_none();
    h.tick(&wanted(PowerState::Running));

    assert_eq!(stopped.power, Some(PowerState::Stopped));
    assert!(discarded);
    assert_eq!(calls_of(&h, |c| matches!(c, Call::Resume(_))), 0);
    assert_eq!(calls_of(&h, |c| *c == Call::Boot(id(VM))), 2);
}

#[test]
fn a_destroyed_suspended_vm_leaves_no_record() {
    let h = Harness::with_config(EngineConfig {
        tombstone_grace: std::time::Duration::ZERO,
        ..config()
    });
    h.tick(&wanted(PowerState::Running));
    h.tick(&wanted(PowerState::Suspended));

    h.tick(&snapshot(1, vec![tombstoned(VM)]));

    assert!(!h.has_record(VM));
    assert_eq!(calls_of(&h, |c| *c == Call::Destroy(id(VM))), 1);
}

#[test]
fn a_saved_state_deleted_behind_the_agents_back_is_made_again_from_a_fresh_boot() {
    let h = suspended();
    h.fakes.set_saved(&id(VM), None);

    h.tick(&wanted(PowerState::Suspended));

    assert_eq!(h.row(VM).power, Some(PowerState::Suspended));
    assert_eq!(h.engine.counts().cold_boots.get("gone"), 1);
    assert_eq!(calls_of(&h, |c| *c == Call::Boot(id(VM))), 2);
    assert_eq!(calls_of(&h, |c| *c == Call::Suspend(id(VM))), 2);
}

#[test]
fn a_volume_of_a_suspended_vm_is_refused_to_another_vm() {
    let h = Harness::new();
    let mut first = desired("vm-a");
    first.spec.volume_ids = vec![id("data-1")];
    let mut second = desired("vm-b");
    second.spec.volume_ids = vec![id("data-1")];
    let volume = WantedVolume::Present(VolumeSpec {
        volume_id: id("data-1"),
        size_gb: 1,
    });
    let mut snap = snapshot(1, vec![present(first.clone())]);
    snap.volumes = vec![volume.clone()];
    h.tick(&snap);
    first.power = PowerState::Suspended;
    let mut snap = snapshot(1, vec![present(first.clone())]);
    snap.volumes = vec![volume.clone()];
    h.tick(&snap);

    let mut snap = snapshot(1, vec![present(first), present(second)]);
    snap.volumes = vec![volume];
    h.tick(&snap);

    let row = h.row("vm-b");
    assert!(
        row.last_error
            .contains("attached to VM vm-a, which is suspended with it"),
        "{row:?}"
    );
}

#[test]
fn a_suspended_vm_stays_suspended_tick_after_tick_with_no_backend_action() {
    let h = suspended();
    h.fakes.forget_calls();

    for _ in 0..3 {
        h.tick(&wanted(PowerState::Suspended));
    }

    assert!(h.fakes.actions().is_empty(), "{:?}", h.fakes.actions());
    assert_eq!(h.row(VM).power, Some(PowerState::Suspended));
    let saved: Option<Saved> = h.record(VM).lifecycle.suspension().saved();
    assert!(saved.is_some());
}
