//! A created VM whose desired spec changes, through the engine against the
//! fake backend: its vCPUs and memory are taken at its next boot from cold
//! (admitted against the host's caps first), and what it keeps from its
//! create (image, disk, seed, NICs, volumes) is said, never silently
//! ignored. Its limits, which follow the same rule, are in engine_tenant.

use crate::common::{Harness, config};
use eitri_agent::model::{DesiredVm, PowerState, Snapshot};
use eitri_agent::reconcile::{EngineConfig, HostCaps};
use eitri_agent::testkit::{Call, desired, present, snapshot};

const VM: &str = "vm-1";

/// `VM` with `vcpus` and `mem_mb`, powered `power`.
fn sized(epoch: u64, vcpus: u32, mem_mb: u64, power: PowerState) -> Snapshot {
    snapshot(epoch, vec![present(sized_vm(vcpus, mem_mb, power))])
}

fn sized_vm(vcpus: u32, mem_mb: u64, power: PowerState) -> DesiredVm {
    let mut d = desired(VM);
    (d.spec.vcpus, d.spec.mem_mb, d.power) = (vcpus, mem_mb, power);
    d
}

fn boots(h: &Harness) -> usize {
    h.fakes.count(|c| matches!(c, Call::Boot(_)))
}

#[test]
fn a_running_vms_new_size_waits_for_its_next_boot_and_says_so() {
    let h = Harness::new();
    h.tick(&sized(1, 1, 256, PowerState::Running));
    let booted = boots(&h);

    h.tick(&sized(2, 2, 512, PowerState::Running));

    let (row, rec) = (h.row(VM), h.record(VM));
    assert_eq!((rec.spec.vcpus, rec.spec.mem_mb), (1, 256));
    assert_eq!(boots(&h), booted);
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Shutdown(_))), 0);
    assert_eq!(row.power, Some(PowerState::Running));
    assert!(
        row.status_detail
            .contains("vCPUs and memory change at the next boot"),
        "{row:?}"
    );
}

#[test]
fn a_new_size_is_taken_at_the_next_boot_from_cold_and_counted() {
    let h = Harness::new();
    h.tick(&sized(1, 1, 256, PowerState::Running));
    h.tick(&sized(2, 2, 512, PowerState::Stopped));

    h.tick(&sized(3, 2, 512, PowerState::Running));

    let (row, rec) = (h.row(VM), h.record(VM));
    assert_eq!((rec.spec.vcpus, rec.spec.mem_mb), (2, 512));
    assert_eq!(row.power, Some(PowerState::Running));
    assert!(!row.status_detail.contains("next boot"), "{row:?}");
    let quota = h.engine.quota();
    assert_eq!((quota.vcpus.used, quota.mem_mb.used), (2, 512));
}

#[test]
fn a_size_the_host_has_no_room_for_boots_as_it_was_and_says_why() {
    let h = Harness::with_config(EngineConfig {
        caps: HostCaps {
            max_vcpus: 2,
            ..HostCaps::default()
        },
        ..config()
    });
    let other = present(desired("vm-2"));
    let both = |epoch, vcpus, power| {
        snapshot(
            epoch,
            vec![present(sized_vm(vcpus, 256, power)), other.clone()],
        )
    };
    h.tick(&both(1, 1, PowerState::Running));
    h.tick(&both(2, 2, PowerState::Stopped));

    h.tick(&both(3, 2, PowerState::Running));

    let (row, rec) = (h.row(VM), h.record(VM));
    assert_eq!(rec.spec.vcpus, 1);
    assert_eq!(row.power, Some(PowerState::Running));
    assert!(
        row.status_detail.contains(
            "2 vCPUs and 256 MB wait for room: host capacity limit reached: needs 3 vcpus, host cap 2"
        ),
        "{row:?}"
    );
}

#[test]
fn a_created_vms_new_image_and_disk_are_said_to_be_kept_and_nothing_is_made_again() {
    let h = Harness::new();
    let mut d = desired(VM);
    h.tick(&snapshot(1, vec![present(d.clone())]));
    let calls = h.fakes.calls().len();
    d.spec.image_url = "http://images.test/other.raw".into();
    d.spec.disk_gb = 20;

    h.tick(&snapshot(2, vec![present(d)]));

    let (row, rec) = (h.row(VM), h.record(VM));
    assert_eq!(rec.spec.disk_gb, 1);
    assert!(
        !h.fakes.calls()[calls..].iter().any(|c| matches!(
            c,
            Call::Resolve { .. } | Call::PrepareRootDisk(_) | Call::Boot(_)
        )),
        "{:?}",
        h.fakes.calls()
    );
    assert!(
        row.status_detail.contains(
            "keeps its image and disk_gb from its create (destroy and create it to change them)"
        ),
        "{row:?}"
    );
}

#[test]
fn a_vm_desired_as_created_says_nothing_of_changes() {
    let h = Harness::new();
    h.tick(&sized(1, 1, 256, PowerState::Running));

    h.tick(&sized(2, 1, 256, PowerState::Running));

    assert_eq!(h.row(VM).status_detail, "");
}
