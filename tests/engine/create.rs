//! Creating VMs: the attempt budget, admission, refunds, host certificates,
//! narration and create slots.

use std::time::Duration;

use crate::common::{Harness, SETTLE, config};
use eitri_agent::model::{Phase, PowerState};
use eitri_agent::reconcile::{EngineConfig, HostCaps};
use eitri_agent::testkit::{Call, Op, desired, id, image_url, present, snapshot};

fn vcpu_capped(max_vcpus: u64) -> Harness {
    Harness::with_config(EngineConfig {
        caps: HostCaps {
            max_vcpus,
            ..HostCaps::default()
        },
        ..config()
    })
}

fn timing_out(vm_timeout: Duration) -> Harness {
    Harness::with_config(EngineConfig {
        vm_timeout: Some(vm_timeout),
        ..config()
    })
}

/// A pass deadline short enough to expire in a test, long enough that the
/// engine's own work never hits it.
const SHORT: Duration = Duration::from_millis(200);

#[test]
fn attempt_is_saved_before_any_side_effect() {
    let h = Harness::new();
    // The first side effect: the image download. Preflight, before it,
    // only looks at the host.
    let gate = h.fakes.block(Op::Resolve, &image_url("vm-1"));
    h.engine.step(&snapshot(1, vec![present(desired("vm-1"))]));
    assert!(gate.wait_entered(1, SETTLE));

    let rec = h.record("vm-1");

    assert_eq!(rec.lifecycle.create_attempts(), 1);
    assert!(rec.lifecycle.created_at().is_some());
    assert_eq!(
        h.fakes.actions(),
        vec![
            Call::Preflight,
            Call::Resolve {
                url: image_url("vm-1")
            }
        ],
        "nothing else happened yet"
    );
    gate.release();
}

#[test]
fn a_host_condition_is_found_before_any_attempt_is_counted() {
    let h = Harness::new();
    let gate = h.fakes.block(Op::Preflight, "");
    h.engine.step(&snapshot(1, vec![present(desired("vm-1"))]));
    assert!(gate.wait_entered(1, SETTLE));

    let counted = h.has_record("vm-1");
    gate.release();

    assert!(!counted, "preflight runs before the attempt is saved");
}

#[test]
fn quota_refusal_names_the_cap_and_spends_no_attempt() {
    let h = vcpu_capped(1);
    h.tick(&snapshot(1, vec![present(desired("vm-a"))]));

    h.tick(&snapshot(
        2,
        vec![present(desired("vm-a")), present(desired("vm-b"))],
    ));

    let row = h.row("vm-b");
    assert_eq!(row.phase, Some(Phase::Failed));
    assert_eq!(
        row.last_error,
        "host capacity limit reached: needs 2 vcpus, host cap 1"
    );
    assert!(!h.has_record("vm-b"), "no attempt recorded");
}

#[test]
fn a_host_condition_spends_no_attempt_however_many_ticks_it_lasts() {
    let h = Harness::new();
    h.fakes
        .fail_on_host(Op::Preflight, "", "the hypervisor is not installed");
    let snap = snapshot(1, vec![present(desired("vm-1"))]);

    for _ in 0..5 {
        h.tick(&snap);
    }

    let row = h.row("vm-1");
    let rec = h.record("vm-1");
    assert_eq!(rec.lifecycle.create_attempts(), 0);
    assert!(rec.lifecycle.waiting_for_host());
    assert_eq!(row.phase, Some(Phase::Creating));
    assert!(
        row.last_error.contains("the hypervisor is not installed"),
        "{row:?}"
    );
    assert!(
        row.status_detail
            .starts_with("waiting for the host to be fixed"),
        "{row:?}"
    );
    assert!(!h.fakes.calls().iter().any(|c| matches!(c, Call::Boot(_))));
}

#[test]
fn a_vm_waiting_for_the_host_converges_at_the_next_tick_once_it_is_fixed() {
    let h = Harness::new();
    h.fakes
        .fail_on_host(Op::Preflight, "", "the hypervisor is not installed");
    let snap = snapshot(1, vec![present(desired("vm-1"))]);
    h.tick(&snap);
    h.tick(&snap);

    h.fakes.clear(Op::Preflight, "");
    h.tick(&snap);

    let row = h.row("vm-1");
    assert_eq!(row.phase, Some(Phase::Ready));
    assert_eq!(row.power, Some(PowerState::Running));
    assert_eq!(h.record("vm-1").lifecycle.create_attempts(), 1);
}

#[test]
fn quota_refusal_is_retried_next_tick() {
    let h = vcpu_capped(1);
    h.tick(&snapshot(1, vec![present(desired("vm-a"))]));
    h.tick(&snapshot(
        2,
        vec![present(desired("vm-a")), present(desired("vm-b"))],
    ));

    let row = h.tick_until(&snapshot(3, vec![present(desired("vm-b"))]), "vm-b", |r| {
        r.phase == Some(Phase::Ready)
    });

    assert_eq!(row.power, Some(PowerState::Running));
    assert_eq!(h.record("vm-b").lifecycle.create_attempts(), 1);
}

#[test]
fn spent_budget_is_terminal_with_the_last_error() {
    let h = Harness::new();
    h.fakes.fail(Op::Boot, "vm-1", "kvm busy");
    let snap = snapshot(1, vec![present(desired("vm-1"))]);

    // Each attempt is made once the last one's backoff has passed: a
    // budget spans minutes, not ticks.
    let phases: Vec<_> = (0..4)
        .map(|_| {
            h.tick(&snap);
            h.fakes.advance_clock(Duration::from_secs(90));
            h.row("vm-1").phase
        })
        .collect();

    assert_eq!(
        phases,
        vec![
            Some(Phase::Creating),
            Some(Phase::Creating),
            Some(Phase::Failed),
            Some(Phase::Failed)
        ]
    );
    assert_eq!(
        h.fakes.count(|c| matches!(c, Call::Boot(_))),
        3,
        "no 4th attempt"
    );
    assert_eq!(h.row("vm-1").last_error, "kvm busy");
}

#[test]
fn spec_change_resets_attempts_and_error() {
    let h = Harness::new();
    h.fakes.fail_permanently(Op::Boot, "vm-1", "bad kernel");
    h.tick(&snapshot(1, vec![present(desired("vm-1"))]));
    h.fakes.clear(Op::Boot, "vm-1");
    let mut bigger = desired("vm-1");
    bigger.spec.mem_mb = 512;

    h.tick(&snapshot(2, vec![present(bigger)]));

    let rec = h.record("vm-1");
    assert_eq!(rec.lifecycle.create_attempts(), 1);
    assert_eq!(rec.lifecycle.last_error(), "");
    assert_eq!(h.row("vm-1").phase, Some(Phase::Ready));
}

#[test]
fn permanent_error_is_terminal_at_once() {
    let h = Harness::new();
    h.fakes
        .fail_permanently(Op::PrepareRootDisk, "vm-1", "would shrink the disk");
    let snap = snapshot(1, vec![present(desired("vm-1"))]);

    h.tick(&snap);
    h.tick(&snap);

    assert_eq!(h.row("vm-1").phase, Some(Phase::Failed));
    // The one attempt it took, not the budget: no retry is made anyway.
    assert_eq!(h.record("vm-1").lifecycle.create_attempts(), 1);
    assert!(h.record("vm-1").lifecycle.failure_permanent());
    assert_eq!(h.fakes.count(|c| matches!(c, Call::PrepareRootDisk(_))), 1);
}

#[test]
fn expired_pass_refunds_its_attempt() {
    let h = timing_out(SHORT);
    h.fakes.block(Op::Resolve, &image_url("vm-1"));

    h.tick(&snapshot(1, vec![present(desired("vm-1"))]));

    let row = h.row("vm-1");
    assert_eq!(row.phase, Some(Phase::Creating));
    assert!(row.last_error.contains("deadline"), "{}", row.last_error);
    assert_eq!(h.record("vm-1").lifecycle.create_attempts(), 0);
}

#[test]
fn refund_wins_over_permanence() {
    // Every fake call takes longer than the pass may, and the image then
    // fails permanently: the failure lands after the deadline.
    let h = timing_out(SHORT);
    h.fakes.set_delay(SHORT + Duration::from_millis(50));
    h.fakes
        .fail_permanently(Op::Resolve, &image_url("vm-1"), "checksum mismatch");

    h.tick(&snapshot(1, vec![present(desired("vm-1"))]));

    let row = h.row("vm-1");
    assert_eq!(
        row.last_error, "checksum mismatch",
        "the permanent error was met"
    );
    assert_eq!(row.phase, Some(Phase::Creating));
    assert_eq!(h.record("vm-1").lifecycle.create_attempts(), 0);
}

#[test]
fn desired_stopped_is_created_but_not_booted() {
    let h = Harness::new();
    let mut vm = desired("vm-1");
    vm.power = PowerState::Stopped;

    h.tick(&snapshot(1, vec![present(vm)]));

    let row = h.row("vm-1");
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Stopped), Some(Phase::Ready))
    );
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Boot(_))), 0);
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Seed(_))), 1);
    assert!(h.record("vm-1").lifecycle.stop_requested());
}

#[test]
fn missing_volume_is_a_permanent_error() {
    let h = Harness::new();
    let mut vm = desired("vm-1");
    vm.spec.volume_ids = vec![id("vol-nowhere")];

    h.tick(&snapshot(1, vec![present(vm)]));

    let row = h.row("vm-1");
    assert_eq!(row.phase, Some(Phase::Failed));
    assert!(row.last_error.contains("vol-nowhere"), "{}", row.last_error);
    assert_eq!(h.record("vm-1").lifecycle.create_attempts(), 1);
    assert!(h.record("vm-1").lifecycle.failure_permanent());
}

fn cert_vm(cert: &str) -> eitri_agent::model::Snapshot {
    let mut vm = desired("vm-1");
    vm.host_cert_required = true;
    vm.ssh_host_cert = cert.into();
    snapshot(1, vec![present(vm)])
}

#[test]
fn host_key_is_saved_before_anything_else_and_awaits_a_certificate() {
    let h = Harness::new();

    h.tick(&cert_vm(""));

    let row = h.row("vm-1");
    assert_eq!(row.phase, Some(Phase::Creating));
    assert_eq!(row.last_error, "awaiting host certificate");
    assert!(row.ssh_host_pubkey.starts_with("ssh-ed25519 "), "{row:?}");
    assert_eq!(h.record("vm-1").host_pubkey, row.ssh_host_pubkey);
    assert_eq!(
        h.fakes.actions(),
        vec![Call::HostKey(h.store.layout().host_key(&id("vm-1")))]
    );
}

#[test]
fn host_key_rides_every_later_row() {
    let h = Harness::new();
    h.tick(&cert_vm(""));
    let key = h.row("vm-1").ssh_host_pubkey;

    h.tick(&cert_vm("ssh-ed25519-cert-v01@openssh.com AAAAcert"));
    let created = h.row("vm-1");
    h.tick(&cert_vm("ssh-ed25519-cert-v01@openssh.com AAAAcert"));
    let converged = h.row("vm-1");

    assert_eq!(created.phase, Some(Phase::Ready));
    assert_eq!(created.ssh_host_pubkey, key);
    assert_eq!(converged.ssh_host_pubkey, key);
}

#[test]
fn certificate_and_host_key_reach_the_seed() {
    let h = Harness::new();

    h.tick(&cert_vm("ssh-ed25519-cert-v01@openssh.com AAAAcert"));

    let seed = h
        .fakes
        .calls()
        .into_iter()
        .find_map(|c| match c {
            Call::Seed(p) => Some(p),
            _ => None,
        })
        .expect("seed built");
    assert_eq!(
        seed.ssh_host_cert,
        "ssh-ed25519-cert-v01@openssh.com AAAAcert"
    );
    assert!(
        seed.ssh_host_key_pem.starts_with("FAKE PRIVATE KEY"),
        "{seed:?}"
    );
    assert_eq!(seed.instance_id, "vm-1");
}

#[test]
fn a_create_with_a_certificate_records_its_host_key_even_when_it_fails() {
    let h = Harness::new();
    h.fakes.fail(Op::PrepareRootDisk, "vm-1", "disk busy");

    h.tick(&cert_vm("ssh-ed25519-cert-v01@openssh.com AAAAcert"));

    let rec = h.record("vm-1");
    assert_eq!(rec.lifecycle.create_attempts(), 1);
    assert!(rec.host_pubkey.starts_with("ssh-ed25519 "), "{rec:?}");
    assert_eq!(rec.host_pubkey, h.row("vm-1").ssh_host_pubkey);
}

#[test]
fn same_host_key_after_an_engine_restart() {
    let h = Harness::new();
    h.tick(&cert_vm(""));
    let before = h.row("vm-1").ssh_host_pubkey;
    let h = h.restart();

    h.tick(&cert_vm(""));

    assert_eq!(h.row("vm-1").ssh_host_pubkey, before);
}

#[test]
fn create_narrates_each_stage_in_order() {
    let h = Harness::new();
    let gib = 1u64 << 30;
    let url = image_url("vm-1");
    h.fakes.set_progress(
        &url,
        vec![(gib / 2, Some(2 * gib)), (gib + gib / 5, Some(2 * gib))],
    );
    let stages = [
        (
            h.fakes.block(Op::Resolve, &url),
            "downloading image 1.2/2.0 GiB",
        ),
        (
            h.fakes.block(Op::PrepareRootDisk, "vm-1"),
            "preparing root disk and seed",
        ),
        (
            h.fakes.block(Op::Seed, "vm-1"),
            "preparing root disk and seed",
        ),
        (h.fakes.block(Op::Boot, "vm-1"), "booting"),
    ];
    h.engine.step(&snapshot(1, vec![present(desired("vm-1"))]));

    let mut seen = Vec::new();
    for (gate, _) in &stages {
        assert!(gate.wait_entered(1, SETTLE));
        let row = h.row("vm-1");
        seen.push((row.status_detail, row.phase));
        gate.release();
    }
    h.idle();

    let want: Vec<_> = stages
        .iter()
        .map(|(_, d)| (d.to_string(), Some(Phase::Creating)))
        .collect();
    assert_eq!(seen, want);
    assert_eq!(
        h.row("vm-1").status_detail,
        "",
        "a finished create narrates nothing"
    );
}

#[test]
fn the_seed_is_built_while_the_root_disk_is_still_being_made() {
    let h = Harness::new();
    let disk = h.fakes.block(Op::PrepareRootDisk, "vm-1");
    let seed = h.fakes.block(Op::Seed, "vm-1");

    h.engine.step(&snapshot(1, vec![present(desired("vm-1"))]));
    let disk_entered = disk.wait_entered(1, SETTLE);
    let seed_entered_meanwhile = seed.wait_entered(1, SETTLE);
    seed.release();
    disk.release();
    h.idle();

    assert!(disk_entered && seed_entered_meanwhile);
    assert_eq!(h.row("vm-1").phase, Some(Phase::Ready));
}

#[test]
fn a_seed_that_fails_beside_a_good_root_disk_fails_the_attempt() {
    let h = Harness::new();
    h.fakes.fail(Op::Seed, "vm-1", "seed dir full");

    h.tick(&snapshot(1, vec![present(desired("vm-1"))]));

    let rec = h.record("vm-1");
    assert_eq!(rec.lifecycle.create_attempts(), 1);
    assert!(
        rec.lifecycle.last_error().contains("seed dir full"),
        "{rec:?}"
    );
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Boot(_))), 0);
}

#[test]
fn queued_create_says_it_waits_for_a_slot() {
    let h = Harness::with_config(EngineConfig {
        max_concurrent_creates: 1,
        ..config()
    });
    let gate = h.fakes.block(Op::Resolve, &image_url("vm-a"));
    h.engine.step(&snapshot(1, vec![present(desired("vm-a"))]));
    assert!(gate.wait_entered(1, SETTLE));

    h.engine.step(&snapshot(
        1,
        vec![present(desired("vm-a")), present(desired("vm-b"))],
    ));
    let detail = wait_for_detail(&h, "vm-b");

    assert_eq!(detail, "waiting for a create slot on this host");
    gate.release();
}

/// The first thing the VM's own pass narrates: not empty, and not the
/// `queued` row every VM starts with before its pass runs.
fn wait_for_detail(h: &Harness, vm: &str) -> String {
    let until = std::time::Instant::now() + SETTLE;
    while std::time::Instant::now() < until {
        if let Some(row) = h.try_row(vm)
            && !row.status_detail.is_empty()
            && row.status_detail != "queued"
        {
            return row.status_detail;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("{vm} never narrated");
}

#[test]
fn progress_after_the_pass_ended_never_lands() {
    let h = Harness::new();
    h.tick(&snapshot(1, vec![present(desired("vm-1"))]));
    let late = h
        .fakes
        .progress_callback(&image_url("vm-1"))
        .expect("callback kept");

    late(5 << 20, Some(10 << 20));

    let row = h.row("vm-1");
    assert_eq!(row.status_detail, "");
    assert_eq!(row.phase, Some(Phase::Ready));
}

#[test]
fn progress_after_the_pass_gave_up_never_lands() {
    let h = timing_out(SHORT);
    h.fakes.block(Op::Resolve, &image_url("vm-1"));
    h.tick(&snapshot(1, vec![present(desired("vm-1"))]));
    let given_up = h.row("vm-1");
    let late = h
        .fakes
        .progress_callback(&image_url("vm-1"))
        .expect("callback kept");

    late(5 << 20, Some(10 << 20));

    assert_eq!(h.row("vm-1"), given_up);
}

#[test]
fn at_most_n_creates_hold_a_slot_at_once() {
    const SLOTS: usize = 2;
    const VMS: usize = 6;
    let h = Harness::with_config(EngineConfig {
        max_concurrent_creates: SLOTS,
        ..config()
    });
    let names: Vec<String> = (0..VMS).map(|n| format!("vm-{n}")).collect();
    let gates: Vec<_> = names
        .iter()
        .map(|n| h.fakes.block(Op::Resolve, &image_url(n)))
        .collect();
    let snap = snapshot(1, names.iter().map(|n| present(desired(n))).collect());
    h.engine.step(&snap);

    // Once the holders are inside the image call, nobody can move: the
    // holders have said "downloading", the rest are queued for a slot.
    let until = std::time::Instant::now() + SETTLE;
    while gates.iter().map(|g| g.entered()).sum::<usize>() < SLOTS
        && std::time::Instant::now() < until
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    let inside_at_peak = gates.iter().map(|g| g.entered()).sum::<usize>();
    let details: Vec<String> = names.iter().map(|n| wait_for_detail(&h, n)).collect();
    let downloading = details
        .iter()
        .filter(|d| d.starts_with("downloading"))
        .count();
    let queued = details
        .iter()
        .filter(|d| d.starts_with("waiting for a create slot"))
        .count();
    for gate in &gates {
        gate.release();
    }
    h.idle();

    assert_eq!((downloading, queued), (SLOTS, VMS - SLOTS), "{details:?}");
    assert_eq!(inside_at_peak, SLOTS);
    assert_eq!(
        h.fakes.max_concurrent(Op::Resolve),
        SLOTS,
        "never more than the slots allow"
    );
    assert!(names.iter().all(|n| h.row(n).phase == Some(Phase::Ready)));
}

#[test]
fn vm_queued_past_its_deadline_fails_with_a_refund() {
    let h = Harness::with_config(EngineConfig {
        max_concurrent_creates: 1,
        vm_timeout: Some(SHORT),
        ..config()
    });
    let stuck = h.fakes.stall(Op::Resolve, &image_url("vm-a"));
    h.engine.step(&snapshot(1, vec![present(desired("vm-a"))]));
    assert!(stuck.wait_entered(1, SETTLE));

    h.engine.step(&snapshot(
        1,
        vec![present(desired("vm-a")), present(desired("vm-b"))],
    ));
    let row = wait_for_error(&h, "vm-b");
    stuck.release();
    h.idle();

    assert!(
        row.last_error.contains("waiting for a create slot"),
        "{}",
        row.last_error
    );
    assert_eq!(row.phase, Some(Phase::Creating));
    assert_eq!(h.record("vm-b").lifecycle.create_attempts(), 0);
}

fn wait_for_error(h: &Harness, vm: &str) -> eitri_agent::model::VmStatus {
    let until = std::time::Instant::now() + SETTLE;
    while std::time::Instant::now() < until {
        if let Some(row) = h.try_row(vm)
            && !row.last_error.is_empty()
        {
            return row;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("{vm} never failed");
}

#[test]
fn a_root_disk_that_cannot_be_made_durable_fails_the_attempt_and_stops_its_vmm() {
    let h = Harness::new();
    let dir = tempfile::tempdir().expect("tempdir");
    h.fakes
        .root_disk_at(&id("vm-1"), &dir.path().join("a disk the host lost"));

    h.tick(&snapshot(1, vec![present(desired("vm-1"))]));

    let rec = h.record("vm-1");
    assert_eq!(rec.lifecycle.create_attempts(), 1);
    assert!(rec.lifecycle.boot_id().is_empty(), "never recorded created");
    assert!(
        rec.lifecycle
            .last_error()
            .contains("cannot make its root disk and seed durable"),
        "{}",
        rec.lifecycle.last_error()
    );
    assert_eq!(h.fakes.count(|c| *c == Call::Shutdown(id("vm-1"))), 1);
    assert!(!eitri_agent::provision::Lifecycle::running(
        &*h.fakes,
        &id("vm-1")
    ));
}

#[test]
fn a_root_disk_made_durable_beside_the_boot_is_recorded_created() {
    let h = Harness::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = dir.path().join("disk.raw");
    std::fs::write(&disk, b"guest").expect("disk");
    h.fakes.root_disk_at(&id("vm-1"), &disk);

    h.tick(&snapshot(1, vec![present(desired("vm-1"))]));

    assert_eq!(h.record("vm-1").lifecycle.boot_id(), "boot-1");
    assert_eq!(h.row("vm-1").phase, Some(Phase::Ready));
}
