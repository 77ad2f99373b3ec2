//! Volumes: sparse files made on the heartbeat path, grown, never shrunk,
//! and deleted only when tombstoned and no VM record refers to them.

use std::os::unix::fs::MetadataExt;

use crate::common::Harness;
use eitri_agent::model::{Snapshot, VolumeSpec, VolumeState, WantedVm, WantedVolume};
use eitri_agent::pb::{self, convert};
use eitri_agent::testkit::{desired, id, present, snapshot};

const GIB: u64 = 1 << 30;

fn volume(vol: &str, size_gb: u64) -> WantedVolume {
    WantedVolume::Present(VolumeSpec {
        volume_id: id(vol),
        size_gb,
    })
}

fn with(vms: Vec<WantedVm>, volumes: Vec<WantedVolume>) -> Snapshot {
    Snapshot {
        volumes,
        ..snapshot(1, vms)
    }
}

fn state_of(report: &eitri_agent::model::Report, vol: &str) -> Option<(VolumeState, u64, String)> {
    report
        .volumes
        .iter()
        .find(|v| v.volume_id == vol)
        .map(|v| (v.state, v.size_gb, v.last_error.clone()))
}

#[test]
fn a_new_volume_is_a_sparse_file_of_its_size() {
    let h = Harness::new();

    let report = h.tick(&with(vec![], vec![volume("data", 4)]));

    let meta = std::fs::metadata(h.store.layout().volume(&id("data"))).expect("file");
    assert_eq!(meta.len(), 4 * GIB);
    assert!(
        meta.blocks() * 512 < 1 << 20,
        "sparse: {} bytes allocated",
        meta.blocks() * 512
    );
    assert_eq!(
        state_of(&report, "data"),
        Some((VolumeState::Ready, 4, String::new()))
    );
}

#[test]
fn a_volume_grows_when_asked() {
    let h = Harness::new();
    h.tick(&with(vec![], vec![volume("data", 1)]));

    let report = h.tick(&with(vec![], vec![volume("data", 3)]));

    assert_eq!(
        std::fs::metadata(h.store.layout().volume(&id("data")))
            .expect("file")
            .len(),
        3 * GIB
    );
    assert_eq!(state_of(&report, "data").map(|s| s.1), Some(3));
}

#[test]
fn a_volume_is_never_shrunk() {
    let h = Harness::new();
    h.tick(&with(vec![], vec![volume("data", 3)]));

    let report = h.tick(&with(vec![], vec![volume("data", 1)]));

    let (state, size, error) = state_of(&report, "data").expect("reported");
    assert_eq!((state, size), (VolumeState::Failed, 3));
    assert!(
        error.contains("never shrunk") && error.contains("at least 3 GiB"),
        "{error}"
    );
    assert_eq!(
        std::fs::metadata(h.store.layout().volume(&id("data")))
            .expect("file")
            .len(),
        3 * GIB
    );
}

#[test]
fn data_in_a_volume_survives_its_growth() {
    let h = Harness::new();
    h.tick(&with(vec![], vec![volume("data", 1)]));
    let path = h.store.layout().volume(&id("data"));
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"customer data"))
        .expect("write into the volume");

    h.tick(&with(vec![], vec![volume("data", 2)]));

    let mut head = [0u8; 13];
    std::fs::File::open(&path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
        .expect("read");
    assert_eq!(&head, b"customer data");
}

#[test]
fn a_tombstoned_volume_still_attached_to_a_vm_is_not_reclaimed() {
    let h = Harness::new();
    let mut vm = desired("vm-1");
    vm.spec.volume_ids = vec![id("data")];
    h.tick(&with(vec![present(vm.clone())], vec![volume("data", 1)]));

    let report = h.tick(&with(
        vec![present(vm)],
        vec![WantedVolume::Tombstoned(id("data"))],
    ));

    let (state, _, why) = state_of(&report, "data").expect("still reported");
    assert_eq!(state, VolumeState::Tombstoned);
    assert!(why.contains("vm-1"), "{why}");
    assert!(h.store.layout().volume(&id("data")).exists());
}

#[test]
fn a_tombstoned_volume_no_vm_uses_is_reclaimed_and_no_longer_reported() {
    let h = Harness::new();
    h.tick(&with(vec![], vec![volume("data", 1)]));

    let report = h.tick(&with(vec![], vec![WantedVolume::Tombstoned(id("data"))]));

    assert!(!h.store.layout().volume(&id("data")).exists());
    assert_eq!(state_of(&report, "data"), None, "absence is the ack");
}

#[test]
fn a_volume_left_out_of_the_snapshot_is_kept_and_reported() {
    let h = Harness::new();
    h.tick(&with(vec![], vec![volume("data", 1)]));

    let report = h.tick(&with(vec![], vec![]));

    assert!(
        h.store.layout().volume(&id("data")).exists(),
        "only a tombstone deletes"
    );
    assert_eq!(
        state_of(&report, "data").map(|s| s.0),
        Some(VolumeState::Ready)
    );
}

#[test]
fn a_refused_volume_entry_is_reported_and_its_file_untouched() {
    let h = Harness::new();
    h.tick(&with(vec![], vec![volume("data", 2)]));
    let wire = pb::Snapshot {
        epoch: 1,
        volumes: vec![pb::VolumeSpec {
            volume_id: "data".into(),
            size_gb: 0,
            tombstoned: false,
        }],
        ..Default::default()
    };

    let report = h.tick(&convert::snapshot_from_wire(&wire));

    let (state, size, why) = state_of(&report, "data").expect("reported");
    assert_eq!((state, size), (VolumeState::Failed, 2));
    assert!(why.contains("size_gb"), "{why}");
}

#[test]
fn the_fence_path_reports_volumes_without_touching_them() {
    let h = Harness::new();
    h.tick(&Snapshot {
        epoch: 5,
        ..with(vec![], vec![volume("data", 1)])
    });
    let path = h.store.layout().volume(&id("data"));
    let before = std::fs::metadata(&path)
        .expect("file")
        .modified()
        .expect("mtime");

    let fenced = h.tick(&Snapshot {
        epoch: 4,
        ..with(vec![], vec![WantedVolume::Tombstoned(id("data"))])
    });

    assert!(fenced.fence_violation);
    assert_eq!(
        state_of(&fenced, "data").map(|s| (s.0, s.1)),
        Some((VolumeState::Ready, 1))
    );
    assert_eq!(
        std::fs::metadata(&path)
            .expect("file")
            .modified()
            .expect("mtime"),
        before
    );
}

#[test]
fn a_volume_attached_to_a_running_vm_is_refused_to_a_second_one_naming_the_first() {
    let h = Harness::new();
    let mut first = desired("vm-1");
    first.spec.volume_ids = vec![id("data")];
    h.tick(&with(vec![present(first.clone())], vec![volume("data", 1)]));
    let mut second = desired("vm-2");
    second.spec.volume_ids = vec![id("data")];

    let both = with(
        vec![present(first), present(second)],
        vec![volume("data", 1)],
    );

    let refused = h.tick_until(&both, "vm-2", |r| {
        r.phase == Some(eitri_agent::model::Phase::Failed)
    });

    assert!(
        refused.last_error.contains("attached to VM vm-1"),
        "{}",
        refused.last_error
    );
    assert_eq!(
        h.row("vm-1").power,
        Some(eitri_agent::model::PowerState::Running)
    );
}
