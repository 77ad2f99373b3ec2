//! Stopping and destroying: the stop ladder, and nothing left behind.

use super::*;

#[test]
fn a_hypervisor_that_ignores_shutdown_is_gone_within_the_bound() {
    let h = Host::new(&[("STANDIN_IGNORE_SHUTDOWN", "1")]);
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid");

    h.backend
        .shutdown(&id("vm-1"), Deadline::NONE, &|_| {})
        .expect("stopped");

    assert!(!alive(pid));
    assert!(!h.backend.running(&id("vm-1")));
}

#[test]
fn a_long_stop_is_narrated_stage_by_stage() {
    let h = Host::new(&[("STANDIN_IGNORE_SHUTDOWN", "1")]);
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let said = parking_lot::Mutex::new(Vec::new());

    h.backend
        .shutdown(&id("vm-1"), Deadline::NONE, &|what| {
            said.lock().push(what.to_owned())
        })
        .expect("stopped");

    let said = said.into_inner();
    assert_eq!(
        said[..2],
        [
            "stopping: pressing the power button",
            "stopping: waiting for the guest to power off, 0 s of 1"
        ],
        "{said:?}"
    );
    assert!(
        said.iter().any(|s| s == "stopping: killing the hypervisor"),
        "{said:?}"
    );
}

pub(crate) fn destroy_leaves_no_process_socket_pidfile_tap_or_directory_on(h: Host) {
    h.tick(&h.vm("vm-1"));
    let pid = h.pid("vm-1").expect("pid");
    let socket = h.backend.socket_path(&id("vm-1"));
    let tap = h.backend.taps(&id("vm-1")).expect("taps").underlay;
    assert!(link_exists(&tap), "the tap exists while the VMM runs");

    h.tick(&snapshot(2, vec![tombstoned("vm-1")]));

    assert!(!alive(pid));
    assert!(!socket.exists());
    assert!(!PathBuf::from(format!("{}.lock", socket.display())).exists());
    assert!(!link_exists(&tap));
    assert!(!h.store.layout().vm_dir(&id("vm-1")).exists());
}

pub(crate) fn the_tap_dies_with_a_killed_hypervisor_on(h: Host) {
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let tap = h.backend.taps(&id("vm-1")).expect("taps").underlay;
    let pid = h.pid("vm-1").expect("pid");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");

    wait_until("the tap to go", || !link_exists(&tap));
}
