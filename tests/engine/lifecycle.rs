//! Existing VMs: converge (lost detection, power), reap (quarantine, grace,
//! destroy), the compute ledger, unreadable records, and the worker threads
//! themselves.

use std::time::{Duration, UNIX_EPOCH};

use crate::common::{Harness, SETTLE, TOMBSTONE_GRACE, VANISH_GRACE, config, thread_count};
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
    assert_eq!(h.record("vm-1").lifecycle.last_error(), "");
}

#[test]
fn host_reboot_with_desired_stopped_records_boot_id_and_stop_intent() {
    let h = created("vm-1");
    h.fakes.set_boot_id("boot-2");
    h.fakes.set_running(&id("vm-1"), false);

    h.tick(&stopped("vm-1"));

    let rec = h.record("vm-1");
    assert_eq!(rec.lifecycle.boot_id(), "boot-2");
    assert!(rec.lifecycle.stop_requested());
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
    assert_eq!(h.record("vm-1").lifecycle.boot_id(), "boot-2");
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
    assert!(!h.record("vm-1").lifecycle.stop_requested());
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
        rec.lifecycle.stop_requested(),
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
    let before = h.tick(&running("vm-1")).vms[0].phase;
    let mut wire = convert::snapshot_to_wire(&running("vm-1"));
    wire.vms[0].vcpus = 0;

    let report = h.tick(&convert::snapshot_from_wire(&wire));
    let report_again = h.tick(&convert::snapshot_from_wire(&wire));

    let row = &report_again.vms[0];
    assert_eq!(report.vms.len(), 1);
    // It runs on as it was: its phase is what it was, not failed.
    assert_eq!((row.power, row.phase), (Some(PowerState::Running), before));
    assert_ne!(row.phase, Some(Phase::Failed));
    assert!(
        row.spec_rejected.contains("invalid vcpus"),
        "{}",
        row.spec_rejected
    );
    assert!(
        h.fakes.actions().is_empty(),
        "neither stopped nor reaped: {:?}",
        h.fakes.actions()
    );
    assert!(h.record("vm-1").lifecycle.quarantined_at().is_none());
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

    assert!(rec.lifecycle.quarantined_at().is_some());
    assert!(rec.lifecycle.stop_requested());
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
    assert!(h.record("vm-1").lifecycle.quarantine_tombstoned());
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

    assert!(h.record("vm-a").lifecycle.quarantined_at().is_none());
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

/// A snapshot of `vm`, and an entry refused for `claimed`: the refused
/// entry claims its id, so no pass runs for that VM at all. What the ledger
/// holds for it can then only come from the rebuild at start, with no pass
/// of its own racing `vm`'s admission.
fn with_claimed(epoch: u64, vm: &str, claimed: &str) -> Snapshot {
    let mut snap = snapshot(epoch, vec![present(desired(vm))]);
    snap.rejected_vms.push(eitri_agent::model::Rejected {
        id: Some(id(claimed)),
        raw_id: claimed.into(),
        error: eitri_agent::model::SpecError::new("vcpus", "test: refused"),
    });
    snap
}

#[test]
fn ledger_is_rebuilt_from_records_at_startup() {
    let h = Harness::with_config(one_vcpu_host());
    h.tick(&running("vm-a"));
    let h = h.restart();

    h.tick(&with_claimed(2, "vm-b", "vm-a"));

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

    h.tick(&with_claimed(3, "vm-b", "vm-q"));

    assert_eq!(h.row("vm-b").phase, Some(Phase::Ready));
}

// ── unreadable records ──────────────────────────────────────────────────

fn with_unreadable(vm: &str, other: &str) -> Harness {
    let h = Harness::new();
    h.tick(&snapshot(
        1,
        vec![present(desired(vm)), present(desired(other))],
    ));
    std::fs::write(h.store.layout().record(&id(vm)), b"{\"format\":1,").expect("corrupt");
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
    assert!(h.store.layout().record(&id("vm-bad")).exists());
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
fn two_steps_with_no_row_changed_hand_out_one_list() {
    let h = created("vm-1");
    let snap = running("vm-1");
    h.tick(&snap);

    let first = h.tick(&snap);
    let second = h.tick(&snap);

    assert!(first.vms.same_list(&second.vms));
}

#[test]
fn a_row_a_recheck_changed_is_in_the_next_steps_report() {
    let h = created("vm-1");
    let snap = running("vm-1");
    h.tick(&snap);
    h.tick(&snap);
    h.fakes.set_addresses(&id("vm-1"), "10.0.0.9", "192.0.2.9");
    h.tick(&snap);

    let report = h.engine.step(&snap);

    let row = report
        .vms
        .iter()
        .find(|r| r.vm_id == "vm-1")
        .expect("a row");
    assert_eq!(
        (row.ip.as_str(), row.network_ip.as_str()),
        ("10.0.0.9", "192.0.2.9")
    );
}

/// Threads of this process named `name`.
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("tasks")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|n| n.trim() == name)
        .count()
}

#[test]
fn a_worker_whose_loop_ended_between_rechecks_is_started_again() {
    // A create watch runs after the pass, outside its guard: one that
    // panics ends the worker's loop. This one waits first, so the loop ends
    // once the engine has settled into steps that only ask every worker to
    // look again (the snapshot and the records unchanged).
    let h = Harness::new();
    let (release, wait) = crossbeam_channel::bounded::<()>(0);
    h.engine.watch_stages(move |_, _| {
        let _ = wait.recv();
        panic!("test: the create watch failed");
    });
    let snap = running("vm-1");
    h.tick(&snap);
    h.engine.step(&snap);
    h.engine.step(&snap);
    drop(release);
    let until = std::time::Instant::now() + SETTLE;
    while threads_named("vm-vm-1") > 0 && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(threads_named("vm-vm-1"), 0, "the worker's loop did not end");
    h.fakes.forget_calls();

    h.tick(&snap);

    assert_eq!(threads_named("vm-vm-1"), 1);
    assert!(h.fakes.count(|c| *c == Call::Running(id("vm-1"))) > 0);
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

// ── regressions: one lifecycle, no report that disagrees with itself ─────

#[test]
fn a_good_stop_clears_a_failed_stops_error_in_every_report() {
    let h = created("vm-1");
    h.fakes
        .fail(Op::Shutdown, "vm-1", "guest ignored the power button");
    h.tick(&stopped("vm-1"));
    assert_eq!(h.row("vm-1").phase, Some(Phase::Failed));
    h.fakes.clear(Op::Shutdown, "vm-1");

    h.tick(&stopped("vm-1"));

    let pass = h.row("vm-1");
    let fenced = h.engine.fenced();
    let observed = h.engine.observe();
    let of = |r: &eitri_agent::model::Report| {
        r.vms
            .iter()
            .find(|v| v.vm_id == "vm-1")
            .map(|v| (v.power, v.phase, v.last_error.clone()))
    };
    let stopped_ready = Some((Some(PowerState::Stopped), Some(Phase::Ready), String::new()));
    assert_eq!(
        Some((pass.power, pass.phase, pass.last_error)),
        stopped_ready
    );
    assert_eq!(of(&fenced), stopped_ready, "the fence report agrees");
    assert_eq!(
        of(&observed),
        stopped_ready,
        "the no-snapshot report agrees"
    );
}

#[test]
fn one_pass_per_vm_even_when_it_leaves_and_returns_mid_pass() {
    let h = Harness::new();
    let mut vm = desired("vm-1");
    vm.host_cert_required = true;
    vm.ssh_host_cert = "ssh-ed25519-cert-v01@openssh.com AAAA cert".into();
    let with_it = snapshot(1, vec![present(vm)]);
    let gate = h.fakes.block(Op::HostKey, "vm-1");
    h.engine.step(&with_it);
    assert!(gate.wait_entered(1, SETTLE));

    h.engine.step(&snapshot(1, vec![]));
    h.engine.step(&with_it);
    // While the first pass is blocked, no second one may start.
    let second = gate.wait_entered(2, Duration::from_millis(300));
    gate.release();
    h.idle();

    assert!(!second, "a second pass entered while the first ran");
    assert_eq!(h.fakes.count(|c| matches!(c, Call::PrepareRootDisk(_))), 1);
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Boot(_))), 1);
}

#[test]
fn a_repaired_record_is_read_again_within_a_tick() {
    let h = created("vm-1");
    let path = h.store.layout().record(&id("vm-1"));
    let good = std::fs::read(&path).expect("record");
    std::fs::write(&path, b"{\"format\":1,").expect("corrupt");
    let h = h.restart();
    h.tick(&running("vm-1"));
    assert!(h.row("vm-1").last_error.contains("unreadable"));

    std::fs::write(&path, good).expect("restore");
    h.tick(&running("vm-1"));

    let row = h.row("vm-1");
    assert_eq!(
        (row.phase, row.last_error.as_str()),
        (Some(Phase::Ready), "")
    );
}

#[test]
fn a_refused_entry_keeps_a_quarantined_vm_in_the_report_with_its_grace() {
    let h = created("vm-q");
    h.tick(&snapshot(2, vec![]));
    let destroy_at = h.engine.published().quarantined[0].destroy_at_unix;

    let report = h.tick(&with_claimed(3, "vm-other", "vm-q"));

    let entry = report.quarantined.iter().find(|q| q.vm_id == id("vm-q"));
    assert_eq!(
        entry.map(|q| q.destroy_at_unix),
        Some(destroy_at),
        "still quarantined, destroyed when its first quarantine said"
    );
    assert!(h.has_record("vm-q"), "and not destroyed early");
}

#[test]
fn a_quarantine_is_reported_before_its_stop_ends() {
    let h = created("vm-1");
    let gate = h.fakes.block(Op::Shutdown, "vm-1");

    h.engine.step(&snapshot(2, vec![]));
    assert!(gate.wait_entered(1, SETTLE));
    let while_stopping = h.engine.published();
    gate.release();
    h.idle();

    assert_eq!(
        while_stopping
            .quarantined
            .iter()
            .map(|q| q.vm_id.as_str())
            .collect::<Vec<_>>(),
        ["vm-1"]
    );
    assert!(while_stopping.vms.iter().all(|r| r.vm_id != "vm-1"));
}

#[test]
fn a_long_stop_is_narrated_on_the_vms_row() {
    let h = created("vm-1");
    let gate = h.fakes.block(Op::Shutdown, "vm-1");

    h.engine.step(&stopped("vm-1"));
    assert!(gate.wait_entered(1, SETTLE));
    let while_stopping = h.row("vm-1");
    gate.release();
    h.idle();

    assert_eq!(
        while_stopping.status_detail,
        "stopping: pressing the power button"
    );
    assert_eq!(while_stopping.power, Some(PowerState::Running));
}

#[test]
fn transient_failures_are_paced_not_spent_tick_by_tick() {
    let h = Harness::new();
    h.fakes.fail(
        Op::Resolve,
        &eitri_agent::testkit::image_url("vm-1"),
        "connection refused",
    );

    // Twenty ticks a quarter of a second apart: five seconds.
    for _ in 0..20 {
        h.tick(&running("vm-1"));
        h.fakes.advance_clock(Duration::from_millis(250));
    }

    let row = h.row("vm-1");
    assert_eq!(
        h.record("vm-1").lifecycle.create_attempts(),
        1,
        "one attempt, then a wait"
    );
    assert_eq!(row.phase, Some(Phase::Creating));
    assert!(
        row.status_detail.starts_with("retrying in 5 s: ")
            && row.status_detail.ends_with("connection refused"),
        "{}",
        row.status_detail
    );
}

#[test]
fn an_outage_heals_without_a_spec_change() {
    let h = Harness::new();
    let url = eitri_agent::testkit::image_url("vm-1");
    let tick = Duration::from_secs(5);
    h.fakes.fail(Op::Resolve, &url, "connection refused");
    // The image server is down for ten minutes, ticking every 5 s.
    for _ in 0..(600 / 5) {
        h.tick(&running("vm-1"));
        h.fakes.advance_clock(tick);
    }
    assert_eq!(
        h.row("vm-1").phase,
        Some(Phase::Failed),
        "the budget is spent"
    );
    h.fakes.clear(Op::Resolve, &url);

    // Back: ticks go on, with the same spec, until the VM runs.
    let mut waited = Duration::ZERO;
    while h.row("vm-1").phase != Some(Phase::Ready) && waited <= crate::common::CREATE_REARM {
        h.tick(&running("vm-1"));
        h.fakes.advance_clock(tick);
        waited += tick;
    }

    assert_eq!(h.row("vm-1").phase, Some(Phase::Ready));
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert!(
        waited <= crate::common::CREATE_REARM,
        "running within the longest wait (the re-arm) of its return: {waited:?}"
    );
}

#[test]
fn after_a_restart_every_recorded_vm_has_a_row_while_its_pass_is_slow() {
    let h = created("vm-1");
    let h = h.restart();
    let gate = h.fakes.block(Op::Shutdown, "vm-1");

    let first = h.engine.step(&stopped("vm-1"));
    assert!(gate.wait_entered(1, SETTLE));
    let during = h.engine.published();
    gate.release();
    h.idle();

    for report in [&first, &during] {
        assert!(
            report.vms.iter().any(|r| r.vm_id == "vm-1"),
            "no row for vm-1: {report:?}"
        );
    }
}

#[test]
fn a_live_hypervisor_with_no_record_of_its_boot_is_adopted_not_created_again() {
    let h = Harness::new();
    // The crash: the attempt was saved, the VMM started, the record never
    // said so.
    let mut rec = eitri_agent::state::Record::new(desired("vm-1").spec);
    rec.begin_attempt(std::time::SystemTime::now());
    h.store.save(&rec).expect("save");
    let h = h.restart();
    h.fakes.set_running(&id("vm-1"), true);

    h.tick(&running("vm-1"));

    let row = h.row("vm-1");
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Running), Some(Phase::Ready))
    );
    assert!(
        h.fakes
            .actions()
            .iter()
            .all(|c| !matches!(c, Call::PrepareRootDisk(_) | Call::Boot(_) | Call::Seed(_))),
        "{:?}",
        h.fakes.actions()
    );
    assert_eq!(
        h.record("vm-1").lifecycle.create_attempts(),
        1,
        "no attempt spent"
    );
}
