//! Booting: a VM boots and runs, once; a readiness probe; a killed or adopted hypervisor booted again.

use super::*;

pub(crate) fn a_created_vm_boots_and_runs_on(h: Host) {
    h.tick(&h.vm("vm-1"));

    let row = h.row("vm-1");
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Running), Some(Phase::Ready)),
        "{row:?}"
    );
    assert!(h.pid("vm-1").is_some_and(alive));
    let serial = std::fs::read_to_string(h.store.layout().serial_log(&id("vm-1"))).expect("serial");
    assert!(serial.contains(&h.serial_marker), "{serial}");
}

/// `vm` wanted with a readiness probe on `check` (period 1 s, grace 60 s).
pub(crate) fn probed(h: &Host, vm: &str, check: eitri_agent::model::Check) -> Snapshot {
    probed_wanting(h, vm, check, PowerState::Running)
}

/// As [`probed`], wanted at `power`.
pub(crate) fn probed_wanting(
    h: &Host,
    vm: &str,
    check: eitri_agent::model::Check,
    power: PowerState,
) -> Snapshot {
    let mut d = h.desired(vm);
    d.power = power;
    d.readiness = Some(eitri_agent::model::Readiness {
        check,
        period: Duration::from_secs(1),
        timeout: Duration::from_millis(500),
        grace: Duration::from_secs(60),
        restart_after: None,
    });
    snapshot(1, vec![present(d)])
}

pub(crate) fn a_serial_probe_makes_the_vm_ready_once_its_guest_prints_the_line_on(h: Host) {
    let snap = probed(
        &h,
        "vm-1",
        eitri_agent::model::Check::Serial(h.serial_marker.clone()),
    );

    let row = h.tick_until_row(&snap, "vm-1", |r| r.phase == Some(Phase::Ready));

    assert_eq!(row.power, Some(PowerState::Running), "{row:?}");
    assert!(row.last_error.is_empty(), "{row:?}");
}

pub(crate) fn a_serial_probe_for_a_line_the_guest_never_prints_holds_ready_back_on(h: Host) {
    let snap = probed(
        &h,
        "vm-1",
        eitri_agent::model::Check::Serial("NEVER-SAID-BY-ANY-GUEST".into()),
    );

    h.tick(&snap);
    h.tick(&snap);

    let row = h.row("vm-1");
    assert_eq!(row.power, Some(PowerState::Running), "{row:?}");
    assert_eq!(row.phase, Some(Phase::Creating), "{row:?}");
    assert!(
        row.status_detail
            .starts_with("waiting for the guest: console line \"NEVER-SAID-BY-ANY-GUEST\""),
        "{row:?}"
    );
}

pub(crate) fn booting_twice_starts_one_process_on(h: Host) {
    let spec = h.spec("vm-1");

    h.backend.boot(&spec, Deadline::NONE).expect("first boot");
    let first = h.pid("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("second boot");

    assert_eq!(h.pid("vm-1"), first);
    assert_eq!(processes_on(&h.store.layout().root_disk(&id("vm-1"))), 1);
}

pub(crate) fn an_agent_restart_adopts_the_running_hypervisor_on(h: Host) {
    h.tick(&h.vm("vm-1"));
    let before = h.pid("vm-1").expect("pid");

    let h = h.restart();
    h.tick(&h.vm("vm-1"));

    assert_eq!(h.pid("vm-1"), Some(before), "no new process");
    assert!(alive(before));
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(processes_on(&h.store.layout().root_disk(&id("vm-1"))), 1);
}

/// Kills the VM's hypervisor with SIGKILL, and waits, with no step, for
/// another one to be running in its place.
pub(crate) fn kill_and_see_it_booted_again(h: &Host) -> (i32, i32) {
    let before = h.pid("vm-1").expect("pid");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(before),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");
    wait_until("a new hypervisor, with no step", || {
        h.pid("vm-1")
            .is_some_and(|p| p != before && alive(p) && h.backend.running(&id("vm-1")))
    });

    (before, h.pid("vm-1").expect("pid"))
}

pub(crate) fn a_killed_hypervisor_is_booted_again_without_a_tick_on(h: Host) {
    h.tick(&h.vm("vm-1"));

    let (before, after) = kill_and_see_it_booted_again(&h);

    assert!(!alive(before));
    assert!(alive(after));
    assert!(h.engine().wait_idle(Deadline::after(PATIENCE)));
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
}

pub(crate) fn an_adopted_hypervisor_killed_is_booted_again_without_a_tick_on(h: Host) {
    h.tick(&h.vm("vm-1"));
    // The VMM outlives this agent: the next one's backend did not fork it,
    // so no reaper waits for it; the exit watch must.
    let h = h.restart();
    h.tick(&h.vm("vm-1"));

    let (before, after) = kill_and_see_it_booted_again(&h);

    assert!(!alive(before));
    assert!(alive(after));
}

#[test]
fn a_crashed_hypervisors_last_words_reach_the_row() {
    let h = Host::new(&[("STANDIN_CRASH_AFTER_MS", "300")]);
    h.tick(&h.vm("vm-1"));
    // From now on it cannot even start: when it crashes, the boot that
    // repairs it at once fails, and the row says why the last one died.
    // (Renamed over it: the running one holds its binary busy.)
    let broken = h.dir.path().join("broken-hv");
    std::fs::write(&broken, "#!/bin/sh\nexit 1\n").expect("a broken hypervisor");
    std::fs::set_permissions(&broken, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::rename(&broken, &h.cfg.hypervisor.binary).expect("break the hypervisor");

    wait_until("the repair to fail", || {
        h.engine()
            .published()
            .vms
            .iter()
            .any(|r| r.vm_id == "vm-1" && r.phase == Some(Phase::Failed))
    });

    let row = h.row("vm-1");
    assert_eq!(row.phase, Some(Phase::Failed));
    assert!(
        row.last_error.contains("KVM internal error"),
        "{}",
        row.last_error
    );
}

#[test]
fn a_guest_whose_kernel_panicked_is_never_ready_and_its_row_says_why() {
    let h = Host::new(&[("STANDIN_SERIAL_PANIC", "1")]);

    h.tick(&h.vm("vm-1"));
    h.tick(&h.vm("vm-1"));

    let row = h.row("vm-1");
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Running), Some(Phase::Failed)),
        "{row:?}"
    );
    assert!(
        row.last_error.contains(
            "the guest panicked: Kernel panic - not syncing: VFS: Unable to mount root fs"
        ),
        "{row:?}"
    );
    assert_eq!(h.engine().counts().guest_panics.get("vm-1"), 1);
    assert!(h.pid("vm-1").is_some_and(alive), "left as it is");
}

#[test]
fn a_guest_whose_kernel_panicked_is_booted_again_when_its_spec_says_reboot() {
    let h = Host::new(&[("STANDIN_SERIAL_PANIC", "1")]);
    let mut d = h.desired("vm-1");
    d.on_panic = eitri_agent::model::OnPanic::Reboot;
    let snap = snapshot(1, vec![present(d)]);
    h.tick(&snap);
    let first = h.pid("vm-1").expect("booted");

    h.tick(&snap);

    let again = h.pid("vm-1").expect("booted again");
    assert_ne!(first, again);
    assert!(h.engine().counts().guest_panics.get("vm-1") >= 1);
}

#[test]
fn a_guest_booted_again_after_its_panic_is_recorded_as_booted_then() {
    let h = Host::new(&[("STANDIN_SERIAL_PANIC", "1")]);
    let mut d = h.desired("vm-1");
    d.on_panic = eitri_agent::model::OnPanic::Reboot;
    let snap = snapshot(1, vec![present(d)]);
    let boot_started = || {
        h.store
            .get(&id("vm-1"))
            .expect("read")
            .expect("a record")
            .lifecycle
            .boot_started()
    };
    h.tick(&snap);
    let first = boot_started();
    h.fakes.advance_clock(Duration::from_secs(60));

    h.tick(&snap);

    assert!(
        boot_started() > first,
        "{first:?} then {:?}",
        boot_started()
    );
}
