//! Engine::step as a router: the fence, the version floor, volumes before
//! dispatch, the union of desired and records, never waiting, the ack.

use std::sync::mpsc;
use std::time::Duration;

use crate::common::{Harness, SETTLE, config, tree_fingerprint};
use eitri_agent::model::{Phase, PowerState, Snapshot, VolumeSpec, VolumeState, WantedVolume};
use eitri_agent::reconcile::EngineConfig;
use eitri_agent::testkit::{Call, Op, desired, id, present, snapshot, tombstoned};

fn with_volume(mut snap: Snapshot, volume: &str, size_gb: u64) -> Snapshot {
    snap.volumes.push(WantedVolume::Present(VolumeSpec {
        volume_id: id(volume),
        size_gb,
    }));
    snap
}

/// A host with a running VM, a VM whose create failed, a quarantined VM and
/// a volume, all accepted at epoch 5.
fn busy_host() -> Harness {
    let h = Harness::new();
    h.fakes.fail(Op::Boot, "vm-bad", "boot refused");
    let all = with_volume(
        snapshot(
            5,
            vec![
                present(desired("vm-ok")),
                present(desired("vm-bad")),
                present(desired("vm-q")),
            ],
        ),
        "vol-1",
        1,
    );
    h.tick(&all);
    let without_q = with_volume(
        snapshot(
            5,
            vec![present(desired("vm-ok")), present(desired("vm-bad"))],
        ),
        "vol-1",
        1,
    );
    h.tick(&without_q);
    h
}

#[test]
fn stale_epoch_is_fenced_with_the_host_as_it_is() {
    let h = busy_host();

    let report = h.engine.step(&snapshot(3, vec![]));

    assert!(report.fence_violation);
    assert_eq!(report.last_seen_epoch, 5);
    let rows: Vec<_> = report
        .vms
        .iter()
        .map(|r| (r.vm_id.as_str(), r.power, r.phase))
        .collect();
    // vm-bad's create failed once of three: still creating, as its own
    // pass said (one derivation of the phase for every report).
    assert_eq!(
        rows,
        vec![
            ("vm-bad", Some(PowerState::Stopped), Some(Phase::Creating)),
            ("vm-ok", Some(PowerState::Running), Some(Phase::Ready)),
        ]
    );
    let fenced_bad = report.vms.iter().find(|r| r.vm_id == "vm-bad");
    assert_eq!(
        fenced_bad.map(|r| (r.phase, r.last_error.as_str())),
        Some((h.row("vm-bad").phase, h.row("vm-bad").last_error.as_str())),
        "the fence report and the VM's own row agree"
    );
    assert_eq!(report.quarantined.len(), 1);
    assert_eq!(report.quarantined[0].vm_id, id("vm-q"));
    assert_eq!(report.volumes.len(), 1);
    assert_eq!(report.volumes[0].state, VolumeState::Ready);
}

#[test]
fn stale_epoch_changes_nothing() {
    let h = busy_host();
    let before = tree_fingerprint(h.dir.path());
    h.fakes.forget_calls();

    h.engine
        .step(&snapshot(3, vec![present(desired("vm-new"))]));
    h.idle();

    assert_eq!(tree_fingerprint(h.dir.path()), before, "no file written");
    assert_eq!(h.store.epoch(), 5);
    let calls = h.fakes.calls();
    assert!(
        calls.iter().all(|c| matches!(c, Call::Running(_))),
        "{calls:?}"
    );
    assert!(h.try_row("vm-new").is_none(), "nothing dispatched");
}

#[test]
fn fence_does_not_stop_a_pass_already_running() {
    let h = Harness::new();
    let gate = h.fakes.block(Op::Boot, "vm-1");
    h.engine.step(&snapshot(5, vec![present(desired("vm-1"))]));
    assert!(gate.wait_entered(1, SETTLE));

    h.engine.step(&snapshot(3, vec![]));
    gate.release();
    h.idle();

    assert_eq!(h.row("vm-1").phase, Some(Phase::Ready));
}

#[test]
fn equal_epoch_repeated_converges_once() {
    let h = Harness::new();
    let snap = snapshot(5, vec![present(desired("vm-1"))]);

    for _ in 0..5 {
        h.tick(&snap);
    }

    let actions = h.fakes.actions();
    assert_eq!(actions.len(), 5, "{actions:?}");
    assert_eq!(
        actions[..2],
        [
            Call::Preflight,
            Call::Resolve {
                url: eitri_agent::testkit::image_url("vm-1")
            }
        ]
    );
    // The root disk and the seed are made at once, in either order.
    let made = &actions[2..4];
    assert!(
        made.contains(&Call::PrepareRootDisk(id("vm-1"))),
        "{made:?}"
    );
    assert!(made.iter().any(|c| matches!(c, Call::Seed(_))), "{made:?}");
    assert_eq!(actions[4], Call::Boot(id("vm-1")));
    assert_eq!(h.record("vm-1").lifecycle.create_attempts(), 1);
}

#[test]
fn agent_below_the_floor_refuses_every_vm_unobserved() {
    let h = Harness::new();
    let mut snap = snapshot(7, vec![present(desired("vm-1")), tombstoned("vm-gone")]);
    snap.min_agent_version = "1.2.0".into();

    let report = h.tick(&snap);

    assert_eq!(report.vms.len(), 1, "tombstoned VMs get no row");
    let row = &report.vms[0];
    assert_eq!(row.vm_id, "vm-1");
    assert_eq!(row.power, None);
    assert_eq!(row.phase, Some(Phase::Failed));
    assert!(
        row.last_error.contains("1.0.0") && row.last_error.contains("1.2.0"),
        "{}",
        row.last_error
    );
    assert!(
        row.last_error.contains("upgrade the agent"),
        "{}",
        row.last_error
    );
    assert_eq!(h.store.epoch(), 7, "the epoch is accepted");
    assert!(h.store.load_all().is_empty(), "no record written");
    assert!(h.fakes.calls().is_empty(), "nothing dispatched");
}

#[test]
fn a_refused_snapshot_still_reports_every_vm_the_host_runs() {
    let h = Harness::new();
    h.tick(&snapshot(1, vec![present(desired("vm-old"))]));
    // The refused snapshot no longer names vm-old: the host still runs it,
    // and the control plane must not lose sight of it.
    let mut snap = snapshot(2, vec![present(desired("vm-new"))]);
    snap.min_agent_version = "1.2.0".into();

    let report = h.tick(&snap);

    let old = report
        .vms
        .iter()
        .find(|r| r.vm_id == "vm-old")
        .expect("vm-old is still reported");
    assert_eq!(old.power, Some(PowerState::Running));
    let new = report
        .vms
        .iter()
        .find(|r| r.vm_id == "vm-new")
        .expect("vm-new is refused");
    assert_eq!((new.power, new.phase), (None, Some(Phase::Failed)));
    assert_eq!(
        h.fakes.count(|c| matches!(c, Call::Shutdown(_))),
        0,
        "nothing is reaped while refusing"
    );
}

fn unversioned_agent_creates(agent_version: &str) -> Option<Phase> {
    let h = Harness::with_config(EngineConfig {
        agent_version: agent_version.into(),
        ..config()
    });
    let mut snap = snapshot(1, vec![present(desired("vm-1"))]);
    snap.min_agent_version = "99.0".into();
    h.tick(&snap);
    h.row("vm-1").phase
}

#[test]
fn dev_agent_is_never_floored() {
    assert_eq!(unversioned_agent_creates("dev"), Some(Phase::Ready));
}

#[test]
fn unstamped_agent_is_never_floored() {
    assert_eq!(unversioned_agent_creates(""), Some(Phase::Ready));
}

#[test]
fn vm_and_its_new_volume_boot_on_the_first_pass() {
    let h = Harness::new();
    let mut vm = desired("vm-1");
    vm.spec.volume_ids = vec![id("vol-1")];
    let snap = with_volume(snapshot(1, vec![present(vm)]), "vol-1", 2);

    let report = h.tick(&snap);

    assert_eq!(h.row("vm-1").phase, Some(Phase::Ready));
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Boot(_))), 1);
    assert_eq!(report.volumes[0].size_gb, 2);
}

#[test]
fn desired_only_vm_is_created() {
    let h = Harness::new();

    h.tick(&snapshot(1, vec![present(desired("vm-1"))]));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(h.record("vm-1").lifecycle.create_attempts(), 1);
}

#[test]
fn record_only_vm_is_reaped_as_vanished() {
    let h = Harness::new();
    h.tick(&snapshot(1, vec![present(desired("vm-1"))]));

    let _ = h.tick(&snapshot(2, vec![]));

    let rec = h.record("vm-1");
    assert!(rec.lifecycle.quarantined_at().is_some());
    assert!(
        !rec.lifecycle.quarantine_tombstoned(),
        "vanished, not tombstoned"
    );
    assert_eq!(h.fakes.count(|c| *c == Call::Shutdown(id("vm-1"))), 1);
}

#[test]
fn vm_in_desired_and_records_converges_without_create() {
    let h = Harness::new();
    let snap = snapshot(1, vec![present(desired("vm-1"))]);
    h.tick(&snap);
    h.fakes.forget_calls();

    h.tick(&snap);

    assert!(h.fakes.actions().is_empty(), "{:?}", h.fakes.actions());
    assert!(h.fakes.calls().contains(&Call::Running(id("vm-1"))));
}

#[test]
fn news_between_ticks_wakes_only_the_vms_it_changes() {
    let h = Harness::new();
    h.tick(&snapshot(1, vec![present(desired("vm-1"))]));
    h.fakes.forget_calls();

    h.engine.step_news(&snapshot(
        2,
        vec![present(desired("vm-1")), present(desired("vm-2"))],
    ));
    h.idle();

    assert!(h.fakes.calls().contains(&Call::Boot(id("vm-2"))));
    assert!(
        !h.fakes.calls().contains(&Call::Running(id("vm-1"))),
        "vm-1's entry did not change: {:?}",
        h.fakes.calls()
    );
}

#[test]
fn the_tick_after_news_runs_the_vms_it_left_alone() {
    let h = Harness::new();
    h.tick(&snapshot(1, vec![present(desired("vm-1"))]));
    let news = snapshot(2, vec![present(desired("vm-1")), present(desired("vm-2"))]);
    h.engine.step_news(&news);
    h.idle();
    h.fakes.forget_calls();

    h.tick(&news);

    assert!(h.fakes.calls().contains(&Call::Running(id("vm-1"))));
}

#[test]
fn news_that_changes_a_vm_wakes_it() {
    let h = Harness::new();
    h.tick(&snapshot(1, vec![present(desired("vm-1"))]));
    let mut stopped = desired("vm-1");
    stopped.power = PowerState::Stopped;

    h.engine.step_news(&snapshot(2, vec![present(stopped)]));
    h.idle();

    assert_eq!(h.fakes.count(|c| *c == Call::Shutdown(id("vm-1"))), 1);
}

#[test]
fn tombstoned_vm_without_a_record_gets_no_pass_and_is_acked() {
    let h = Harness::new();

    let report = h.tick(&snapshot(1, vec![tombstoned("vm-z")]));

    assert_eq!(report.destroyed, vec![id("vm-z")]);
    assert!(h.fakes.calls().is_empty());
}

#[test]
fn step_never_waits_on_a_stuck_vm() {
    let h = Harness::with_config(EngineConfig {
        vm_timeout: None,
        ..config()
    });
    let gate = h.fakes.stall(Op::Boot, "vm-stuck");
    let snap = snapshot(
        1,
        vec![present(desired("vm-stuck")), present(desired("vm-fine"))],
    );
    h.engine.step(&snap);
    assert!(gate.wait_entered(1, SETTLE));

    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            let report = h.engine.step(&snap);
            let _ = tx.send(report);
        });
        let report = rx
            .recv_timeout(SETTLE)
            .expect("step returned while a VM is stuck");

        let stuck = report
            .vms
            .iter()
            .find(|r| r.vm_id == "vm-stuck")
            .expect("row");
        assert_eq!(stuck.status_detail, "booting", "its last published row");
        gate.release();
    });
}

#[test]
fn a_recorded_vm_is_reported_from_its_record_before_its_first_pass_ends() {
    let h = Harness::with_config(EngineConfig {
        vm_timeout: None,
        ..config()
    });
    let snap = snapshot(1, vec![present(desired("vm-1"))]);
    h.tick(&snap);
    let h = h.restart();
    h.fakes.set_running(&id("vm-1"), false);
    let gate = h.fakes.stall(Op::Boot, "vm-1");

    let report = h.engine.step(&snap);
    assert!(gate.wait_entered(1, SETTLE));
    let again = h.engine.step(&snap);
    gate.release();

    // What the host has, read from the record and the backend: the VM was
    // created, and its hypervisor is not running now.
    let row = |r: &eitri_agent::model::Report| {
        r.vms
            .iter()
            .find(|v| v.vm_id == "vm-1")
            .map(|v| (v.power, v.phase))
    };
    assert_eq!(
        row(&report),
        Some((Some(PowerState::Stopped), Some(Phase::Ready)))
    );
    assert_eq!(row(&again), row(&report), "the pass has not ended yet");
}

#[test]
fn a_new_vm_is_reported_queued_in_the_step_that_first_names_it() {
    let h = Harness::new();
    let gate = h.fakes.block(Op::Preflight, "");

    let report = h.engine.step(&snapshot(1, vec![present(desired("vm-1"))]));
    gate.release();
    h.idle();

    let row = report
        .vms
        .iter()
        .find(|v| v.vm_id == "vm-1")
        .expect("a row");
    assert_eq!(
        (row.power, row.phase, row.status_detail.as_str()),
        (Some(PowerState::Stopped), Some(Phase::Creating), "queued")
    );
}

#[test]
fn destroy_ack_lands_a_step_after_the_record_is_gone() {
    let h = Harness::with_config(EngineConfig {
        tombstone_grace: Duration::ZERO,
        ..config()
    });
    h.tick(&snapshot(1, vec![present(desired("vm-1"))]));
    let gone = snapshot(2, vec![tombstoned("vm-1")]);

    let destroying = h.tick(&gone);
    let after = h.tick(&gone);

    assert!(!h.has_record("vm-1"), "destroyed during the first tick");
    assert!(destroying.destroyed.is_empty(), "not in the same step");
    assert_eq!(after.destroyed, vec![id("vm-1")]);
}

#[test]
fn report_is_sorted_by_vm_id() {
    let h = Harness::new();
    let snap = snapshot(
        1,
        vec![
            present(desired("vm-c")),
            present(desired("vm-a")),
            present(desired("vm-b")),
        ],
    );
    h.tick(&snap);

    let report = h.engine.step(&snap);

    let ids: Vec<_> = report.vms.iter().map(|r| r.vm_id.as_str()).collect();
    assert_eq!(ids, vec!["vm-a", "vm-b", "vm-c"]);
}

#[test]
fn a_refused_entry_takes_its_place_in_id_order() {
    let h = Harness::new();
    let mut snap = snapshot(1, vec![present(desired("vm-a")), present(desired("vm-c"))]);
    snap.rejected_vms.push(eitri_agent::model::Rejected {
        id: Some(id("vm-b")),
        raw_id: "vm-b".into(),
        error: eitri_agent::model::SpecError::new("vcpus", "test: refused"),
    });
    h.tick(&snap);

    let report = h.engine.step(&snap);

    let ids: Vec<_> = report.vms.iter().map(|r| r.vm_id.as_str()).collect();
    assert_eq!(ids, vec!["vm-a", "vm-b", "vm-c"]);
}
