//! What a running VM uses, as the backend's meters read it (the rates and
//! their rendering are the `usage` and `status` modules' own tests).

use super::*;
use eitri_agent::provision::{Meters, NetSource, Reading};

fn meters(h: &Host) -> &dyn Meters {
    h.backend
        .meters()
        .expect("cloud-hypervisor reads what its VMs use")
}

fn read(h: &Host, vm: &str) -> Option<Reading> {
    meters(h).read(&id(vm))
}

/// Its VMM's own counts, of its own process: its disks and NIC as the
/// VMM counts them (`vm.counters`), its CPU time and resident memory.
pub(crate) fn a_running_vms_reading_is_of_its_own_vmm_and_its_counts_on(h: Host) {
    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");

    let reading = read(&h, "vm-1").expect("a reading of a running VM");

    assert_eq!(
        Some(reading.pid),
        h.pid("vm-1").and_then(|p| u32::try_from(p).ok())
    );
    assert!(reading.disk.is_some(), "no disk counts: {reading:?}");
    assert!(reading.net.is_some(), "no NIC counts: {reading:?}");
    assert_eq!(reading.net_from, NetSource::Vmm);
    assert!(reading.cpu_ns.is_some(), "{reading:?}");
    assert!(reading.resident_bytes.is_some_and(|b| b > 0), "{reading:?}");
}

#[test]
fn a_guest_reading_its_disk_shows_in_the_bytes_its_vmm_counts() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[("STANDIN_DISK_READ", "4194304")]);
    h.connect();
    let disk = h.store.layout().root_disk(&id("vm-1"));
    std::fs::create_dir_all(disk.parent().expect("its VM's dir")).expect("VM dir");
    std::fs::write(&disk, vec![0x5a; 1 << 20]).expect("a root disk to read");
    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");
    let first = read(&h, "vm-1").and_then(|r| r.disk).expect("disk counts");

    std::thread::sleep(Duration::from_millis(500));
    let then = read(&h, "vm-1").and_then(|r| r.disk).expect("disk counts");

    assert!(
        then.read_bytes > first.read_bytes && then.read_ops > first.read_ops,
        "{first:?} then {then:?}"
    );
}

#[test]
fn a_vmm_that_does_not_answer_its_counters_is_counted_on_its_taps() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[("STANDIN_COUNTERS_SILENT", "1")]);
    h.connect();
    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");

    let reading = read(&h, "vm-1").expect("a reading all the same");

    assert_eq!(reading.net_from, NetSource::Taps);
    assert!(reading.net.is_some(), "{reading:?}");
    assert_eq!(reading.disk, None);
}

#[test]
fn a_stopped_vm_has_no_reading() {
    let h = Host::new(&[]);
    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");
    h.backend
        .shutdown(&id("vm-1"), Deadline::NONE, &|_| {})
        .expect("shutdown");

    assert_eq!(read(&h, "vm-1"), None);
}
