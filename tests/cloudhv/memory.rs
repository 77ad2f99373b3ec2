//! A VM that wakes on traffic keeps its guest's memory in a file of its
//! own: its snapshot leaves the memory out, its resume maps the file
//! again, and a file written after the snapshot spends it.

use super::limits::vmm_args;
use super::suspend::vmms_of;
use super::*;
use eitri_agent::model::Sleep;

/// `vm` wanted at `power`, waking on traffic or not.
fn waking(h: &Host, vm: &str, power: PowerState, wake_on_traffic: bool) -> Snapshot {
    let mut d = h.desired(vm);
    d.power = power;
    d.sleep = Sleep {
        wake_on_traffic,
        idle_after: None,
    };
    snapshot(1, vec![present(d)])
}

fn memory_file(h: &Host, vm: &str) -> PathBuf {
    h.store.layout().memory(&id(vm))
}

pub(crate) fn a_vm_that_wakes_on_traffic_keeps_its_memory_in_its_file_through_a_suspend_on(
    h: Host,
) {
    h.tick(&waking(&h, "vm-1", PowerState::Running, true));
    let mem_bytes = h.desired("vm-1").spec.mem_mb << 20;
    let booted_with = vmm_args(&h, "vm-1");

    h.tick(&waking(&h, "vm-1", PowerState::Suspended, true));
    let snapshot = h.store.layout().snapshot(&id("vm-1"));
    let saved = (
        h.row("vm-1").power,
        snapshot.join("manifest.json").is_file(),
        snapshot.join("memory-ranges").exists(),
    );
    h.tick(&waking(&h, "vm-1", PowerState::Running, true));

    assert!(
        booted_with.iter().any(|a| a == "--memory-zone"),
        "{booted_with:?}"
    );
    assert_eq!(
        std::fs::metadata(memory_file(&h, "vm-1"))
            .map(|m| m.len())
            .ok(),
        Some(mem_bytes)
    );
    assert_eq!(
        saved,
        (Some(PowerState::Suspended), true, false),
        "committed, its memory left out of it"
    );
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(vmms_of(&h, "vm-1"), 1);
    let resumed_with = vmm_args(&h, "vm-1");
    assert!(
        resumed_with
            .iter()
            .any(|a| a.contains("memory_restore_mode=copy")),
        "nothing to fault in: {resumed_with:?}"
    );
    assert_eq!(h.engine().counts().cold_boots.get("unusable"), 0);
}

pub(crate) fn a_memory_file_written_while_suspended_boots_the_vm_from_its_disks_on(h: Host) {
    h.tick(&waking(&h, "vm-1", PowerState::Running, true));
    h.tick(&waking(&h, "vm-1", PowerState::Suspended, true));
    {
        use std::os::unix::fs::FileExt;
        let memory = std::fs::OpenOptions::new()
            .write(true)
            .open(memory_file(&h, "vm-1"))
            .expect("the memory file");
        // As a restored guest that ran before a crash would have.
        memory
            .write_all_at(b"written while it slept", 4096)
            .expect("write");
    }

    h.tick(&waking(&h, "vm-1", PowerState::Running, true));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(h.engine().counts().cold_boots.get("unusable"), 1);
    let args = vmm_args(&h, "vm-1");
    assert!(
        args.iter().any(|a| a == "--kernel") && !args.iter().any(|a| a == "--restore"),
        "booted, not restored: {args:?}"
    );
}

#[test]
fn a_vm_that_no_longer_wakes_on_traffic_boots_without_its_memory_file() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.tick(&waking(&h, "vm-1", PowerState::Running, true));
    h.tick(&waking(&h, "vm-1", PowerState::Stopped, true));
    assert!(memory_file(&h, "vm-1").exists());

    h.tick(&waking(&h, "vm-1", PowerState::Running, false));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert!(
        !memory_file(&h, "vm-1").exists(),
        "the memory an earlier boot kept is not left on the disk"
    );
    let args = vmm_args(&h, "vm-1");
    assert!(!args.iter().any(|a| a == "--memory-zone"), "{args:?}");
}

#[test]
fn a_boot_makes_its_memory_file_afresh() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h.tick(&waking(&h, "vm-1", PowerState::Running, true));
    h.tick(&waking(&h, "vm-1", PowerState::Stopped, true));
    let before = std::fs::metadata(memory_file(&h, "vm-1")).expect("kept");

    h.tick(&waking(&h, "vm-1", PowerState::Running, true));

    use std::os::unix::fs::MetadataExt;
    let after = std::fs::metadata(memory_file(&h, "vm-1")).expect("kept");
    assert_ne!(
        before.ino(),
        after.ino(),
        "a new file, not the last guest's"
    );
    assert_eq!(after.len(), before.len());
}
