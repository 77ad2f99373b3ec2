//! Clones through the cloud-hypervisor backend and the stand-in: a clone
//! restores a copy of its template's snapshot in a VMM of its own, is made
//! its own by its guest agent, and its template's files are never written.

use super::*;

use eitri_agent::model::{DesiredVm, Id, Mac};

const TEMPLATE: &str = "base";

/// The template wanted suspended (and marked so), or running before it is.
fn template(h: &Host, power: PowerState) -> DesiredVm {
    let mut d = h.desired(TEMPLATE);
    d.power = power;
    d.template = power == PowerState::Suspended;
    d
}

fn clone_of(h: &Host, vm: &str) -> DesiredVm {
    let mut d = h.desired(vm);
    d.spec.clone_of = Some(Id::parse(TEMPLATE).expect("id"));
    d.spec.image_url = String::new();
    d.spec.image_sha256 = String::new();
    d
}

/// The template and `clones` wanted.
fn wanted(h: &Host, clones: &[&str]) -> Snapshot {
    let mut vms = vec![present(template(h, PowerState::Suspended))];
    vms.extend(clones.iter().map(|c| present(clone_of(h, c))));
    snapshot(1, vms)
}

/// `h` with its template booted and suspended.
fn with_template(h: &Host) {
    h.tick(&snapshot(
        1,
        vec![present(template(h, PowerState::Running))],
    ));
    h.tick(&wanted(h, &[]));
    assert_eq!(h.row(TEMPLATE).power, Some(PowerState::Suspended));
}

/// The sha256 of each file of the template's snapshot and of its disk.
fn template_files(h: &Host) -> Vec<(String, String)> {
    let layout = h.store.layout();
    let snapshot = layout.snapshot(&id(TEMPLATE));
    let mut files: Vec<PathBuf> = std::fs::read_dir(&snapshot)
        .expect("the template's snapshot")
        .map(|e| e.expect("entry").path())
        .collect();
    files.push(layout.root_disk(&id(TEMPLATE)));
    files.sort();
    files
        .iter()
        .map(|f| {
            (
                f.display().to_string(),
                sha256_file(f).expect("hash a template file"),
            )
        })
        .collect()
}

fn vmm_log(h: &Host, vm: &str) -> String {
    std::fs::read_to_string(h.store.layout().hypervisor_log(&id(vm))).unwrap_or_default()
}

#[test]
fn a_clone_is_restored_from_a_copy_of_its_templates_snapshot_in_a_vmm_of_its_own() {
    let h = Host::new(&[]);
    with_template(&h);

    h.tick(&wanted(&h, &["web-1"]));

    let row = h.row("web-1");
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Running), Some(Phase::Ready)),
        "{row:?}"
    );
    assert_eq!(vmms_of(&h, "web-1"), 1);
    assert_eq!(vmms_of(&h, TEMPLATE), 0, "the template stays asleep");
    let log = vmm_log(&h, "web-1");
    assert!(
        log.contains("standin-restored"),
        "restored, not booted: {log}"
    );
    assert!(
        log.contains("standin-guest identity hostname=web-1"),
        "{log}"
    );
    assert!(log.contains("standin-guest reseeded bytes=64"), "{log}");
}

#[test]
fn a_clone_reads_its_memory_whole_on_a_host_that_resumes_on_demand() {
    let h = Host::new(&[]);
    with_template(&h);

    h.tick(&wanted(&h, &["web-1"]));
    let mut template_up = wanted(&h, &["web-1"]);
    template_up.vms[0] = present(template(&h, PowerState::Running));
    h.tick(&template_up);

    let clone = super::limits::vmm_args(&h, "web-1").join(" ");
    let resumed = super::limits::vmm_args(&h, TEMPLATE).join(" ");
    assert!(clone.contains("memory_restore_mode=copy"), "{clone}");
    assert!(
        resumed.contains("memory_restore_mode=ondemand"),
        "{resumed}"
    );
}

#[test]
fn a_clones_hypervisor_is_told_its_own_disks_serial_and_vsock_socket() {
    let h = Host::new(&[]);
    with_template(&h);

    h.tick(&wanted(&h, &["web-1"]));

    let layout = h.store.layout();
    let config = super::limits::vm_config(&h, "web-1");
    let own = |p: PathBuf| serde_json::Value::from(p.display().to_string());
    assert_eq!(
        config["disks"][0]["path"],
        own(layout.root_disk(&id("web-1")))
    );
    assert_eq!(
        config["serial"]["file"],
        own(layout.serial_log(&id("web-1")))
    );
    assert_eq!(
        config["vsock"]["socket"],
        own(h.backend.guest_socket(&id("web-1")))
    );
}

#[test]
fn the_templates_snapshot_and_disk_are_byte_identical_after_two_clones() {
    let h = Host::new(&[]);
    with_template(&h);
    let before = template_files(&h);

    h.tick(&wanted(&h, &["web-1", "web-2"]));

    assert_eq!(h.row("web-2").phase, Some(Phase::Ready));
    assert_eq!(template_files(&h), before);
}

#[test]
fn each_clone_is_sent_entropy_of_its_own() {
    let h = Host::new(&[]);
    with_template(&h);

    h.tick(&wanted(&h, &["web-1", "web-2"]));

    let sent = |vm: &str| -> Vec<String> {
        vmm_log(&h, vm)
            .lines()
            .filter_map(|l| l.split("standin-guest reseeded bytes=64 sha256=").nth(1))
            .map(str::to_owned)
            .collect()
    };
    let (one, two) = (sent("web-1"), sent("web-2"));
    assert_eq!((one.len(), two.len()), (1, 1));
    assert_ne!(one, two);
}

#[test]
fn a_clone_whose_guest_has_no_agent_is_never_ready_and_its_hypervisor_is_stopped() {
    let h = Host::new(&[("STANDIN_GUEST_AGENT", "none")]);
    with_template(&h);

    h.tick(&wanted(&h, &["web-1"]));

    let row = h.row("web-1");
    assert_ne!(row.phase, Some(Phase::Ready), "{row:?}");
    assert!(
        row.last_error.contains("was not made a machine of its own"),
        "{row:?}"
    );
    assert_eq!(vmms_of(&h, "web-1"), 0);
}

#[test]
fn a_clone_destroyed_leaves_its_template_and_its_sibling_as_they_were() {
    let h = Host::new(&[]);
    with_template(&h);
    h.tick(&wanted(&h, &["web-1", "web-2"]));
    let before = template_files(&h);
    let sibling = h.pid("web-2").expect("web-2 runs");

    h.tick(&snapshot(
        1,
        vec![
            present(template(&h, PowerState::Suspended)),
            tombstoned("web-1"),
            present(clone_of(&h, "web-2")),
        ],
    ));
    h.tick(&snapshot(
        1,
        vec![
            present(template(&h, PowerState::Suspended)),
            present(clone_of(&h, "web-2")),
        ],
    ));

    assert!(!h.store.layout().vm_dir(&id("web-1")).exists());
    assert_eq!(template_files(&h), before);
    assert_eq!(h.pid("web-2"), Some(sibling));
    assert_eq!(h.row("web-2").phase, Some(Phase::Ready));
}

#[test]
fn a_clone_on_a_network_is_given_its_own_mac_by_its_guest_agent() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    with_template(&h);

    h.tick(&wanted(&h, &["web-1"]));

    let log = vmm_log(&h, "web-1");
    let own = Mac::underlay(&id("web-1")).to_string();
    assert!(
        log.contains(&format!("standin-guest identity hostname=web-1 macs={own}")),
        "{log}"
    );
    assert_eq!(h.row("web-1").phase, Some(Phase::Ready));
}

#[test]
fn a_clone_runs_on_when_its_template_is_removed() {
    let h = Host::new(&[]);
    with_template(&h);
    h.tick(&wanted(&h, &["web-1"]));
    let running = h.pid("web-1").expect("web-1 runs");

    let removed = snapshot(
        1,
        vec![tombstoned(TEMPLATE), present(clone_of(&h, "web-1"))],
    );
    h.tick(&removed);
    h.tick(&removed);

    assert!(
        !h.store.layout().vm_dir(&id(TEMPLATE)).exists(),
        "the template is destroyed"
    );
    assert_eq!(h.pid("web-1"), Some(running));
    assert_eq!(h.row("web-1").phase, Some(Phase::Ready));
}

/// The template wanted running, marked so: clones are made from the save
/// the agent makes of it.
fn running_template(h: &Host) -> DesiredVm {
    let mut d = h.desired(TEMPLATE);
    d.template = true;
    d
}

/// `h` with its running template ready and saved.
fn with_running_template(h: &Host) -> u32 {
    let alone = snapshot(1, vec![present(running_template(h))]);
    h.tick_until_row(&alone, TEMPLATE, |r| r.phase == Some(Phase::Ready));
    h.tick(&alone);
    h.engine()
        .hypervisor_pid(&id(TEMPLATE))
        .expect("the template's VMM")
}

#[test]
fn a_running_template_is_saved_with_a_copy_of_its_disk_and_runs_on_in_its_own_vmm() {
    let h = Host::new(&[]);
    let alone = snapshot(1, vec![present(running_template(&h))]);
    h.tick_until_row(&alone, TEMPLATE, |r| r.phase == Some(Phase::Ready));
    let pid = h.engine().hypervisor_pid(&id(TEMPLATE));

    h.tick(&alone);

    let layout = h.store.layout();
    assert!(layout.template_manifest(&id(TEMPLATE)).is_file());
    assert_eq!(
        sha256_file(&layout.template_disk(&id(TEMPLATE))).expect("its copy"),
        sha256_file(&layout.root_disk(&id(TEMPLATE))).expect("its disk"),
    );
    assert_eq!(
        h.engine().hypervisor_pid(&id(TEMPLATE)),
        pid,
        "never stopped"
    );
    assert_eq!(
        super::suspend::vm_state(&h, TEMPLATE).as_deref(),
        Some("Running")
    );
    assert!(
        !layout.snapshot(&id(TEMPLATE)).exists(),
        "no suspension of it"
    );
}

#[test]
fn a_disk_copy_left_by_a_template_save_cut_short_is_removed_once_it_is_no_template() {
    let h = Host::new(&[]);
    let running = snapshot(1, vec![present(h.desired(TEMPLATE))]);
    h.tick_until_row(&running, TEMPLATE, |r| r.phase == Some(Phase::Ready));
    // What a crash after a save's disk copy and before its commit leaves.
    let left = h.store.layout().template_disk(&id(TEMPLATE));
    std::fs::write(&left, b"a copy whose save was never committed").expect("leave a copy");
    let h = h.restart();

    h.tick(&running);

    assert!(!left.exists(), "{} is left", left.display());
}

#[test]
fn a_running_templates_guest_is_warned_before_its_save_and_told_it_runs_on_after() {
    let h = Host::new(&[]);
    let alone = snapshot(1, vec![present(running_template(&h))]);
    h.tick_until_row(&alone, TEMPLATE, |r| r.phase == Some(Phase::Ready));

    h.tick(&alone);

    let log = vmm_log(&h, TEMPLATE);
    let after_warning = log
        .split_once("standin-guest saving")
        .map(|(_, after)| after)
        .unwrap_or_default();
    let after_pause = after_warning
        .split_once("standin-api PUT /api/v1/vm.pause")
        .map(|(_, after)| after)
        .unwrap_or_default();
    let after_resume = after_pause
        .split_once("standin-api PUT /api/v1/vm.resume")
        .map(|(_, after)| after)
        .unwrap_or_default();
    assert!(
        after_resume.contains("standin-guest reseeded bytes=64"),
        "warned, paused, resumed, then told: {log}"
    );
}

#[test]
fn a_clone_of_a_running_template_is_restored_from_its_save_while_it_runs() {
    let h = Host::new(&[]);
    let pid = with_running_template(&h);

    h.tick(&snapshot(
        1,
        vec![
            present(running_template(&h)),
            present(clone_of(&h, "web-1")),
        ],
    ));

    let row = h.row("web-1");
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Running), Some(Phase::Ready)),
        "{row:?}"
    );
    assert!(vmm_log(&h, "web-1").contains("standin-restored"));
    assert_eq!(h.engine().hypervisor_pid(&id(TEMPLATE)), Some(pid));
    assert_eq!(
        super::suspend::vm_state(&h, TEMPLATE).as_deref(),
        Some("Running")
    );
}

#[test]
fn a_guest_left_paused_by_a_templates_save_cut_short_runs_again_at_its_next_pass() {
    let h = Host::new(&[]);
    with_running_template(&h);
    // As a crash between its pause and its resume leaves it.
    let mut rec = (*h.store.get(&id(TEMPLATE)).expect("read").expect("there")).clone();
    rec.templating = true;
    h.store.save(&rec).expect("save");
    eitri_agent::provision::unix_http::request(
        &h.backend.socket_path(&id(TEMPLATE)),
        "PUT",
        "/api/v1/vm.pause",
        None,
        Duration::from_secs(2),
    )
    .expect("pause");

    h.tick(&snapshot(1, vec![present(running_template(&h))]));

    assert_eq!(
        super::suspend::vm_state(&h, TEMPLATE).as_deref(),
        Some("Running")
    );
    let rec = h.store.get(&id(TEMPLATE)).expect("read").expect("there");
    assert!(!rec.templating);
}

#[test]
fn a_template_no_longer_running_as_one_has_its_save_and_disk_copy_removed() {
    let h = Host::new(&[]);
    with_running_template(&h);

    h.tick(&snapshot(1, vec![present(h.desired(TEMPLATE))]));

    let layout = h.store.layout();
    assert!(!layout.template(&id(TEMPLATE)).exists());
    assert!(!layout.template_disk(&id(TEMPLATE)).exists());
}

/// The template's memory file, and a clone's, opened.
fn memory_of(h: &Host, vm: &str) -> std::fs::File {
    let path = h.store.layout().snapshot(&id(vm)).join("memory-ranges");
    std::fs::File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn a_clones_memory_is_its_templates_file_root_s_and_read_by_no_one_after_its_restore() {
    let h = Host::new(&[("STANDIN_RESTORE_FAIL", "1")]);
    with_template(&h);

    // Its restore fails: its copy of the snapshot stays to be looked at.
    h.tick(&wanted(&h, &["web-1"]));

    use std::os::unix::fs::MetadataExt;
    let (theirs, ours) = (memory_of(&h, TEMPLATE), memory_of(&h, "web-1"));
    let (theirs, ours_meta) = (
        theirs.metadata().expect("stat"),
        ours.metadata().expect("stat"),
    );
    assert_eq!(ours_meta.ino(), theirs.ino(), "one inode, one page cache");
    assert_eq!((ours_meta.uid(), ours_meta.mode() & 0o777), (0, 0o600));
    assert_eq!(
        eitri_agent::provision::jail::acl::named_users(&ours).expect("acl"),
        Vec::<u32>::new(),
        "the read lent for its restore is taken back"
    );
}

#[test]
fn a_read_of_a_snapshots_memory_left_by_a_crash_is_taken_back_at_start() {
    let h = Host::new(&[]);
    with_template(&h);
    let memory = memory_of(&h, TEMPLATE);
    eitri_agent::provision::jail::acl::grant_user_read(&memory, 1_900_000_123).expect("lend");

    h.backend.recover(&known(&h.store));

    assert_eq!(
        eitri_agent::provision::jail::acl::named_users(&memory).expect("acl"),
        Vec::<u32>::new()
    );
}

#[test]
fn a_clone_is_ready_by_the_status_its_identity_carried_with_no_status_asked() {
    let h = Host::new(&[]);
    with_template(&h);

    h.tick(&wanted(&h, &["web-1"]));

    let row = h.row("web-1");
    assert_eq!(row.phase, Some(Phase::Ready), "{row:?}");
    assert_eq!(
        row.readiness,
        eitri_agent::model::GUEST_AGENT_READY,
        "{row:?}"
    );
    assert!(row.guest.starts_with("system up"), "{row:?}");
    let log = vmm_log(&h, "web-1");
    assert!(!log.contains("standin-guest status"), "asked again: {log}");
}

#[test]
fn a_clone_whose_identity_says_its_system_is_starting_is_asked_again() {
    let h = Host::new(&[("STANDIN_GUEST_UP_AFTER_MS", "600000")]);
    with_template(&h);

    h.tick(&wanted(&h, &["web-1"]));

    let row = h.row("web-1");
    assert_ne!(
        row.readiness,
        eitri_agent::model::GUEST_AGENT_READY,
        "{row:?}"
    );
    let log = vmm_log(&h, "web-1");
    assert!(log.contains("standin-guest status up=false"), "{log}");
}
