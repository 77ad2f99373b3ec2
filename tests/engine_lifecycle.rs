//! Existing VMs: converge (lost detection, power), reap (quarantine, grace,
//! destroy), the compute ledger, unreadable records, and the worker threads
//! themselves.

mod common;

use std::time::{Duration, UNIX_EPOCH};

use common::{Harness, SETTLE, TOMBSTONE_GRACE, VANISH_GRACE, config, thread_count};
use eitri_agent::deadline::Deadline;
use eitri_agent::model::{Phase, PowerState, Snapshot, VmSpec};
use eitri_agent::pb::{self, convert};
use eitri_agent::reconcile::{EngineConfig, HostCaps};
use eitri_agent::testkit::{Call, Op, desired, id, present, snapshot, tombstoned};

fn running(vm: &str) -> Snapshot {
    snapshot(1, vec![present(desired(vm))])
}

fn stopped(vm: &str) -> Snapshot {
    let mut d = desired(vm);
    d.power = PowerState::Stopped;
    snapshot(1, vec![present(d)])
}

fn created(vm: &str) -> Harness {
    let h = Harness::new();
    h.tick(&running(vm));
    assert_eq!(h.row(vm).phase, Some(Phase::Ready));
    h.fakes.forget_calls();
    h
}

// ── converge ────────────────────────────────────────────────────────────

#[test]
fn crashed_vm_is_booted_again_and_its_error_cleared() {
    let h = created("vm-1");
    h.fakes.set_running(&id("vm-1"), false);
    h.fakes.fail(Op::Boot, "vm-1", "tap busy");
    h.tick(&running("vm-1"));
    assert_eq!(h.row("vm-1").phase, Some(Phase::Failed));
    h.fakes.clear(Op::Boot, "vm-1");

    h.tick(&running("vm-1"));

    let row = h.row("vm-1");
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Running), Some(Phase::Ready))
    );
    assert_eq!(row.last_error, "");
    assert_eq!(h.record("vm-1").last_error, "");
}

#[test]
fn host_reboot_with_desired_stopped_records_boot_id_and_stop_intent() {
    let h = created("vm-1");
    h.fakes.set_boot_id("boot-2");
    h.fakes.set_running(&id("vm-1"), false);

    h.tick(&stopped("vm-1"));

    let rec = h.record("vm-1");
    assert_eq!(rec.boot_id, "boot-2");
    assert!(rec.stop_requested);
    let row = h.row("vm-1");
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Stopped), Some(Phase::Ready))
    );
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Boot(_))), 0);
}

#[test]
fn host_reboot_with_desired_running_boots_and_restamps() {
    let h = created("vm-1");
    h.fakes.set_boot_id("boot-2");
    h.fakes.set_running(&id("vm-1"), false);

    h.tick(&running("vm-1"));

    assert_eq!(h.fakes.count(|c| *c == Call::Boot(id("vm-1"))), 1);
    assert_eq!(h.record("vm-1").boot_id, "boot-2");
}

#[test]
fn deliberately_stopped_vm_is_not_lost() {
    let h = created("vm-1");
    h.tick(&stopped("vm-1"));
    h.fakes.forget_calls();

    h.tick(&stopped("vm-1"));

    assert!(h.fakes.actions().is_empty(), "{:?}", h.fakes.actions());
    assert_eq!(h.row("vm-1").power, Some(PowerState::Stopped));
}

#[test]
fn stopped_vm_wanted_running_is_booted() {
    let h = created("vm-1");
    h.tick(&stopped("vm-1"));

    h.tick(&running("vm-1"));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert!(!h.record("vm-1").stop_requested);
}

#[test]
fn stop_intent_is_saved_before_shutdown() {
    let h = created("vm-1");
    let gate = h.fakes.block(Op::Shutdown, "vm-1");
    h.engine.step(&stopped("vm-1"));
    assert!(gate.wait_entered(1, SETTLE));

    let rec = h.record("vm-1");
    gate.release();
    h.idle();

    assert!(
        rec.stop_requested,
        "saved while shutdown was still in progress"
    );
    assert_eq!(h.row("vm-1").power, Some(PowerState::Stopped));
}

#[test]
fn failed_stop_intent_save_skips_the_shutdown() {
    let h = created("vm-1");
    h.break_record_dir("vm-1");

    h.tick(&stopped("vm-1"));

    assert_eq!(h.fakes.count(|c| matches!(c, Call::Shutdown(_))), 0);
    let row = h.row("vm-1");
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Running), Some(Phase::Failed))
    );
    assert!(
        row.last_error.contains("cannot save the record of VM vm-1"),
        "{}",
        row.last_error
    );
}

#[test]
fn failed_shutdown_is_not_reported_stopped() {
    let h = created("vm-1");
    h.fakes
        .fail(Op::Shutdown, "vm-1", "guest ignored the power button");

    h.tick(&stopped("vm-1"));

    let row = h.row("vm-1");
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Running), Some(Phase::Failed))
    );
}

#[test]
fn failed_boot_carries_the_hypervisors_reason() {
    let h = created("vm-1");
    h.fakes.set_running(&id("vm-1"), false);
    h.fakes
        .fail(Op::Boot, "vm-1", "hypervisor exited with status 1");
    h.fakes
        .set_failure_reason(&id("vm-1"), "KVM internal error");

    h.tick(&running("vm-1"));

    let row = h.row("vm-1");
    assert_eq!(
        row.last_error,
        "hypervisor exited with status 1: KVM internal error"
    );
    assert_eq!(row.power, Some(PowerState::Stopped));
}

#[test]
fn addresses_are_polled_and_saved_when_they_change() {
    let h = created("vm-1");
    h.fakes.set_addresses(&id("vm-1"), "10.77.0.5", "192.0.2.9");

    h.tick(&running("vm-1"));

    let rec = h.record("vm-1");
    assert_eq!(
        (rec.ip.as_str(), rec.network_ip.as_str()),
        ("10.77.0.5", "192.0.2.9")
    );
    assert_eq!(h.row("vm-1").network_ip, "192.0.2.9");
}

#[test]
fn a_spec_refused_for_an_existing_vm_leaves_it_alone() {
    let h = created("vm-1");
    let mut wire = convert::snapshot_to_wire(&running("vm-1"));
    wire.vms[0].vcpus = 0;

    let report = h.tick(&convert::snapshot_from_wire(&wire));
    let report_again = h.tick(&convert::snapshot_from_wire(&wire));

    let row = &report_again.vms[0];
    assert_eq!(report.vms.len(), 1);
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Running), Some(Phase::Failed))
    );
    assert!(
        row.last_error.contains("invalid vcpus"),
        "{}",
        row.last_error
    );
    assert!(
        h.fakes.actions().is_empty(),
        "neither stopped nor reaped: {:?}",
        h.fakes.actions()
    );
    assert!(h.record("vm-1").quarantined_at.is_none());
}

#[test]
fn an_entry_with_a_bad_id_is_reported_failed() {
    let h = Harness::new();
    let wire = pb::Snapshot {
        vms: vec![pb::VmSpec {
            vm_id: "../etc".into(),
            ..Default::default()
        }],
        ..Default::default()
    };

    let report = h.tick(&convert::snapshot_from_wire(&wire));

    assert_eq!(report.vms[0].vm_id, "../etc");
    assert_eq!(report.vms[0].phase, Some(Phase::Failed));
    assert_eq!(report.vms[0].power, None);
    assert!(h.fakes.calls().is_empty());
}

// ── reap ────────────────────────────────────────────────────────────────

fn now_unix(h: &Harness) -> i64 {
    use eitri_agent::reconcile::seams::HostFacts;
    h.fakes
        .now()
        .duration_since(UNIX_EPOCH)
        .expect("after epoch")
        .as_secs() as i64
}

#[test]
fn first_sight_quarantines_with_the_stop_intent_saved_before_shutdown() {
    let h = created("vm-1");
    let gate = h.fakes.block(Op::Shutdown, "vm-1");
    h.engine.step(&snapshot(2, vec![]));
    assert!(gate.wait_entered(1, SETTLE));

    let rec = h.record("vm-1");
    gate.release();
    h.idle();

    assert!(rec.quarantined_at.is_some());
    assert!(rec.stop_requested);
}

#[test]
fn failed_quarantine_save_skips_the_shutdown() {
    let h = created("vm-1");
    h.break_record_dir("vm-1");

    h.tick(&snapshot(2, vec![]));

    assert_eq!(h.fakes.count(|c| matches!(c, Call::Shutdown(_))), 0);
}

#[test]
fn quarantined_entry_carries_the_spec_and_destroy_time() {
    let h = created("vm-1");
    let t0 = now_unix(&h);

    h.tick(&snapshot(2, vec![]));
    let report = h.engine.published();

    let q = &report.quarantined[0];
    assert_eq!(q.vm_id, id("vm-1"));
    assert_eq!(q.destroy_at_unix, t0 + VANISH_GRACE.as_secs() as i64);
    let spec: VmSpec = serde_json::from_slice(&q.vmspec_json).expect("spec json");
    assert_eq!(spec, desired("vm-1").spec);
    assert!(report.vms.is_empty(), "a quarantined VM has no row");
}

#[test]
fn vanished_then_tombstoned_switches_to_the_tombstone_grace() {
    let h = created("vm-1");
    let t0 = now_unix(&h);
    h.tick(&snapshot(2, vec![]));

    h.tick(&snapshot(3, vec![tombstoned("vm-1")]));

    let q = &h.engine.published().quarantined[0];
    assert_eq!(q.destroy_at_unix, t0 + TOMBSTONE_GRACE.as_secs() as i64);
    assert!(h.record("vm-1").quarantine_tombstoned);
}

#[test]
fn after_its_grace_a_vm_is_destroyed_then_its_record_deleted() {
    let h = created("vm-1");
    let gone = snapshot(2, vec![tombstoned("vm-1")]);
    h.tick(&gone);
    h.fakes.advance_clock(TOMBSTONE_GRACE);

    h.tick(&gone);

    assert_eq!(h.fakes.count(|c| *c == Call::Destroy(id("vm-1"))), 1);
    assert!(!h.has_record("vm-1"));
    assert!(h.engine.published().quarantined.is_empty());
}

#[test]
fn vm_is_not_destroyed_before_its_grace() {
    let h = created("vm-1");
    let gone = snapshot(2, vec![]);
    h.tick(&gone);
    h.fakes.advance_clock(VANISH_GRACE - Duration::from_secs(1));

    h.tick(&gone);

    assert_eq!(h.fakes.count(|c| matches!(c, Call::Destroy(_))), 0);
}

#[test]
fn failed_destroy_is_retried_next_tick() {
    let h = created("vm-1");
    let gone = snapshot(2, vec![tombstoned("vm-1")]);
    h.tick(&gone);
    h.fakes.advance_clock(TOMBSTONE_GRACE);
    h.fakes.fail(Op::Destroy, "vm-1", "tap still busy");
    h.tick(&gone);
    assert!(h.has_record("vm-1"));
    assert_eq!(h.engine.published().quarantined.len(), 1, "still reported");
    h.fakes.clear(Op::Destroy, "vm-1");

    h.tick(&gone);

    assert!(!h.has_record("vm-1"));
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Destroy(_))), 2);
}

#[test]
fn returning_vm_leaves_quarantine_and_counts_again() {
    let h = Harness::with_config(one_vcpu_host());
    h.tick(&running("vm-a"));
    h.tick(&snapshot(2, vec![]));

    h.tick(&snapshot(3, vec![present(desired("vm-a"))]));
    h.tick(&snapshot(
        4,
        vec![present(desired("vm-a")), present(desired("vm-b"))],
    ));

    assert!(h.record("vm-a").quarantined_at.is_none());
    assert_eq!(h.row("vm-a").power, Some(PowerState::Running));
    assert_eq!(
        h.row("vm-b").last_error,
        "host capacity limit reached: needs 2 vcpus, host cap 1"
    );
}

#[test]
fn reaping_releases_compute() {
    let h = Harness::with_config(one_vcpu_host());
    h.tick(&running("vm-a"));

    let row = h.tick_until(&snapshot(2, vec![present(desired("vm-b"))]), "vm-b", |r| {
        r.phase == Some(Phase::Ready)
    });

    assert_eq!(row.power, Some(PowerState::Running));
}

// ── the ledger across restarts ──────────────────────────────────────────

fn one_vcpu_host() -> EngineConfig {
    EngineConfig {
        caps: HostCaps {
            max_vcpus: 1,
            ..HostCaps::default()
        },
        ..config()
    }
}

#[test]
fn ledger_is_rebuilt_from_records_at_startup() {
    let h = Harness::with_config(one_vcpu_host());
    h.tick(&running("vm-a"));
    let h = h.restart();

    h.tick(&snapshot(
        2,
        vec![present(desired("vm-a")), present(desired("vm-b"))],
    ));

    assert_eq!(
        h.row("vm-b").phase,
        Some(Phase::Failed),
        "vm-a was counted before any pass"
    );
}

#[test]
fn quarantined_vms_are_left_out_of_the_rebuilt_ledger() {
    let h = Harness::with_config(one_vcpu_host());
    h.tick(&running("vm-q"));
    h.tick(&snapshot(2, vec![]));
    let h = h.restart();

    h.tick(&snapshot(3, vec![present(desired("vm-b"))]));

    assert_eq!(h.row("vm-b").phase, Some(Phase::Ready));
}

// ── unreadable records ──────────────────────────────────────────────────

fn with_unreadable(vm: &str, other: &str) -> Harness {
    let h = Harness::new();
    h.tick(&snapshot(
        1,
        vec![present(desired(vm)), present(desired(other))],
    ));
    std::fs::write(h.store.record_path(&id(vm)), b"{\"format\":1,").expect("corrupt");
    let h = h.restart();
    h.fakes.forget_calls();
    h
}

#[test]
fn unreadable_record_skips_only_that_vm() {
    let h = with_unreadable("vm-bad", "vm-ok");
    h.fakes.set_running(&id("vm-ok"), false);

    h.tick(&snapshot(
        2,
        vec![present(desired("vm-bad")), present(desired("vm-ok"))],
    ));

    assert!(
        h.fakes
            .calls()
            .iter()
            .all(|c| !format!("{c:?}").contains("vm-bad")),
        "{:?}",
        h.fakes.calls()
    );
    assert_eq!(
        h.row("vm-ok").power,
        Some(PowerState::Running),
        "the other VM was booted"
    );
    let row = h.row("vm-bad");
    assert_eq!(row.phase, Some(Phase::Failed));
    assert!(row.last_error.contains("unreadable"), "{}", row.last_error);
}

#[test]
fn unreadable_record_is_never_reaped() {
    let h = with_unreadable("vm-bad", "vm-ok");

    h.tick(&snapshot(2, vec![]));

    let actions = h.fakes.actions();
    assert!(
        !actions.contains(&Call::Shutdown(id("vm-bad"))),
        "{actions:?}"
    );
    assert!(h.store.record_path(&id("vm-bad")).exists());
}

// ── the workers themselves ──────────────────────────────────────────────

#[test]
fn workers_of_departed_vms_end() {
    let h = Harness::with_config(EngineConfig {
        vanish_grace: Duration::ZERO,
        ..config()
    });
    let baseline = thread_count();
    let vms = snapshot(
        1,
        (0..200)
            .map(|n| present(desired(&format!("vm-{n}"))))
            .collect(),
    );
    h.tick(&vms);
    assert!(thread_count() >= baseline + 200, "one thread per VM");

    let empty = snapshot(2, vec![]);
    h.tick(&empty); // destroys and deletes every record
    h.tick(&empty); // no VM left in desired or records: workers retire

    let until = std::time::Instant::now() + SETTLE;
    while thread_count() > baseline && std::time::Instant::now() < until {
        h.engine.step(&empty); // joins finished workers
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(thread_count(), baseline);
}

#[test]
fn worker_threads_are_named_for_their_vm() {
    let h = Harness::new();
    let gate = h.fakes.block(Op::Boot, "vm-named");
    h.engine.step(&running("vm-named"));
    assert!(gate.wait_entered(1, SETTLE));

    let names: Vec<String> = std::fs::read_dir("/proc/self/task")
        .expect("tasks")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_owned())
        .collect();
    gate.release();

    assert!(names.iter().any(|n| n == "vm-vm-named"), "{names:?}");
}

#[test]
fn panicking_pass_fails_only_its_vm() {
    let h = Harness::new();
    h.fakes.panic_in(Op::Boot, "vm-bad");
    let snap = snapshot(
        1,
        vec![present(desired("vm-bad")), present(desired("vm-ok"))],
    );

    h.tick(&snap);

    let row = h.row("vm-bad");
    assert_eq!(row.phase, Some(Phase::Failed));
    assert!(row.last_error.contains("panicked"), "{}", row.last_error);
    assert_eq!(h.row("vm-ok").phase, Some(Phase::Ready));
}

#[test]
fn worker_survives_its_pass_panicking() {
    let h = Harness::new();
    h.fakes.panic_in(Op::Boot, "vm-1");
    h.tick(&running("vm-1"));
    h.fakes.clear(Op::Boot, "vm-1");

    h.tick(&running("vm-1"));

    assert_eq!(h.row("vm-1").phase, Some(Phase::Ready));
}

#[test]
fn worker_that_cannot_start_fails_only_its_vm() {
    // A stack no host can map: the thread cannot be spawned, its channel is
    // closed from the start, and the engine must report that and go on.
    let h = Harness::with_config(EngineConfig {
        worker_stack_bytes: 1 << 46,
        ..config()
    });

    let report = h.engine.step(&running("vm-1"));
    let again = h.engine.step(&running("vm-1"));

    assert_eq!(report.vms[0].phase, Some(Phase::Failed));
    assert!(
        again.vms[0]
            .last_error
            .contains("cannot start this VM's worker thread"),
        "{:?}",
        again.vms
    );
    assert!(h.engine.wait_idle(Deadline::after(SETTLE)));
}
