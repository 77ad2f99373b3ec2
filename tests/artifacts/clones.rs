//! Templates and clones on the wire: what a template may be, what a clone
//! must keep of its template, each refusal naming its field and the fix.

use eitri_agent::model::{Id, WantedVm};
use eitri_agent::pb::{self, convert};

/// A template as an entry asks for one: suspended, 2 vCPUs, 1 GiB, 10 GiB.
fn template(id: &str) -> pb::VmSpec {
    pb::VmSpec {
        vm_id: id.into(),
        image_url: "http://mirror.test/base.raw".into(),
        image_sha256: "ab".repeat(32),
        vcpus: 2,
        mem_mb: 1024,
        disk_gb: 10,
        power_state: "suspended".into(),
        template: true,
        ..pb::VmSpec::default()
    }
}

/// A clone of `of`, of the template's shape, running.
fn clone(id: &str, of: &str) -> pb::VmSpec {
    pb::VmSpec {
        vm_id: id.into(),
        name: id.into(),
        vcpus: 2,
        mem_mb: 1024,
        disk_gb: 10,
        power_state: "running".into(),
        clone_of: of.into(),
        ..pb::VmSpec::default()
    }
}

fn snapshot(vms: Vec<pb::VmSpec>) -> eitri_agent::model::Snapshot {
    convert::snapshot_from_wire(&pb::Snapshot {
        vms,
        ..Default::default()
    })
}

/// What refused `id` in `vms`.
fn refusal(vms: Vec<pb::VmSpec>, id: &str) -> String {
    let snap = snapshot(vms);
    let refused = snap
        .rejected_vms
        .iter()
        .find(|r| r.raw_id == id)
        .unwrap_or_else(|| panic!("{id} was not refused: {:?}", snap.vms));
    refused.error.to_string()
}

#[test]
fn a_template_and_its_clone_pass_and_survive_the_round_trip() {
    let snap = snapshot(vec![template("base"), clone("web-1", "base")]);

    assert!(snap.rejected_vms.is_empty(), "{:?}", snap.rejected_vms);
    let wire = convert::snapshot_to_wire(&snap);
    assert!(wire.vms[0].template);
    assert_eq!(wire.vms[1].clone_of, "base");
    let WantedVm::Present(d) = &snap.vms[1] else {
        panic!("{:?}", snap.vms[1])
    };
    assert_eq!(d.spec.clone_of, Some(Id::parse("base").expect("id")));
    assert_eq!(d.spec.image_url, "", "a clone names no image");
}

#[test]
fn a_clone_of_a_vm_that_is_no_template_is_refused_saying_how_to_make_it_one() {
    let mut base = template("base");
    base.template = false;

    let why = refusal(vec![base, clone("web-1", "base")], "web-1");

    assert!(
        why.contains("invalid clone_of: base is not a template"),
        "{why}"
    );
    assert!(why.contains("template: true"), "{why}");
}

#[test]
fn a_clone_of_another_size_is_refused_naming_the_templates() {
    let mut web = clone("web-1", "base");
    web.mem_mb = 2048;

    let why = refusal(vec![template("base"), web], "web-1");

    assert!(
        why.contains("invalid mem_mb: 2048, where its template base has 1024"),
        "{why}"
    );
    assert!(why.contains("ask for 1024"), "{why}");
}

#[test]
fn a_clone_with_a_second_nic_its_template_lacks_is_refused() {
    let mut web = clone("web-1", "base");
    web.network = "lan".into();

    let why = refusal(vec![template("base"), web], "web-1");

    assert!(why.contains("invalid network"), "{why}");
    assert!(why.contains("leave network empty"), "{why}");
}

#[test]
fn a_clone_of_a_tombstoned_template_is_left_to_the_engine() {
    let gone = pb::VmSpec {
        vm_id: "base".into(),
        tombstoned: true,
        ..pb::VmSpec::default()
    };

    let snap = snapshot(vec![gone, clone("web-1", "base")]);

    assert!(snap.rejected_vms.is_empty(), "{:?}", snap.rejected_vms);
}

#[test]
fn a_clone_naming_an_image_or_volumes_is_refused_saying_its_disk_is_its_templates() {
    let mut web = clone("web-1", "base");
    web.image_url = "http://mirror.test/other.raw".into();

    let why = refusal(vec![template("base"), web], "web-1");

    assert!(why.contains("invalid image_url"), "{why}");
    assert!(
        why.contains("takes its disk from its template base"),
        "{why}"
    );
}

#[test]
fn a_clone_of_itself_is_refused() {
    let why = refusal(vec![clone("web-1", "web-1")], "web-1");

    assert!(why.contains("a VM cannot be a clone of itself"), "{why}");
}

#[test]
fn a_clone_wanted_stopped_is_refused() {
    let mut web = clone("web-1", "base");
    web.power_state = "stopped".into();

    let why = refusal(vec![template("base"), web], "web-1");

    assert!(why.contains("invalid power_state"), "{why}");
}

#[test]
fn a_template_wanted_stopped_is_refused_saying_what_it_may_be() {
    let mut base = template("base");
    base.power_state = "stopped".into();

    let why = refusal(vec![base], "base");

    assert!(
        why.contains("invalid template: a template is wanted \"suspended\" or \"running\""),
        "{why}"
    );
}

#[test]
fn a_template_wanted_running_and_its_clone_pass() {
    let mut base = template("base");
    base.power_state = "running".into();

    let snap = snapshot(vec![base, clone("web-1", "base")]);

    assert!(snap.rejected_vms.is_empty(), "{:?}", snap.rejected_vms);
    assert_eq!(snap.vms.len(), 2);
}

#[test]
fn a_template_woken_by_traffic_is_refused() {
    let mut base = template("base");
    base.wake_on_traffic = true;

    let why = refusal(vec![base], "base");

    assert!(why.contains("never woken"), "{why}");
}

#[test]
fn a_template_with_volumes_is_refused() {
    let mut base = template("base");
    base.volume_ids = vec!["vol-a".into()];

    let why = refusal(vec![base], "base");

    assert!(why.contains("carries no volumes"), "{why}");
}

#[test]
fn a_clone_whose_template_is_not_in_the_snapshot_is_left_to_the_engine() {
    let snap = snapshot(vec![clone("web-1", "base")]);

    assert!(snap.rejected_vms.is_empty(), "{:?}", snap.rejected_vms);
}
