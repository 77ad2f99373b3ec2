//! Suspend and resume: the guest and its console kept, the snapshot checked before it is trusted.

use super::*;

/// `vm` wanted at `power`.
pub(crate) fn wanting(h: &Host, vm: &str, power: PowerState) -> Snapshot {
    let mut d = h.desired(vm);
    d.power = power;
    snapshot(1, vec![present(d)])
}

/// The VM's console as `eitri-agent logs` prints it: what its resumes
/// moved aside, then what its VMM writes now.
pub(crate) fn console(h: &Host, vm: &str) -> Vec<String> {
    super::logs::logs_of(h, vm, &[])
}

/// What the VM's VMM's API says its state is.
pub(crate) fn vm_state(h: &Host, vm: &str) -> Option<String> {
    let (status, body) = eitri_agent::provision::unix_http::request(
        &h.backend.socket_path(&id(vm)),
        "GET",
        "/api/v1/vm.info",
        None,
        Duration::from_secs(2),
    )
    .ok()?;
    let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
    (status == 200).then(|| v.get("state")?.as_str().map(str::to_owned))?
}

/// Live processes whose command line names `vm` as theirs: its root disk
/// (a boot) or its snapshot (a restore).
pub(crate) fn vmms_of(h: &Host, vm: &str) -> usize {
    let layout = h.store.layout();
    let disk = format!("path={}", layout.root_disk(&id(vm)).display());
    let snapshot = format!("source_url=file://{}", layout.snapshot(&id(vm)).display());
    std::fs::read_dir("/proc")
        .expect("proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| alive(*pid))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                c.split(|b| *b == 0).any(|a| {
                    [disk.as_bytes(), snapshot.as_bytes()].iter().any(|n| {
                        a.strip_prefix(*n)
                            .is_some_and(|rest| rest.is_empty() || rest.starts_with(b","))
                    })
                })
            })
        })
        .count()
}

pub(crate) fn suspend_and_resume_twice_keep_the_guest_and_its_console_on(h: Host) {
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    wait_until("the guest's marker", || {
        console(&h, "vm-1")
            .iter()
            .any(|l| l.contains(&h.serial_marker))
    });
    let booted = h.pid("vm-1").expect("pid");

    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));
    let asleep = (
        h.row("vm-1").power,
        vmms_of(&h, "vm-1"),
        h.store.layout().snapshot_manifest(&id("vm-1")).is_file(),
    );
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    let resumed = (h.row("vm-1").power, vmms_of(&h, "vm-1"));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));
    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    assert_eq!(asleep, (Some(PowerState::Suspended), 0, true));
    assert!(!alive(booted), "the suspended VM's VMM is gone");
    assert_eq!(resumed, (Some(PowerState::Running), 1));
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(vmms_of(&h, "vm-1"), 1);
    assert!(h.backend.running(&id("vm-1")));
    assert!(
        !h.store.layout().snapshot(&id("vm-1")).exists(),
        "a snapshot is spent once its guest runs"
    );
    let lines = console(&h, "vm-1");
    let markers = lines
        .iter()
        .filter(|l| l.contains(&h.serial_marker))
        .count();
    assert_eq!(markers, 1, "resumed, never booted again: {lines:?}");
}

pub(crate) fn a_suspended_vm_resumes_after_an_agent_restart_on(h: Host) {
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    let h = h.restart();
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));
    let still = (h.row("vm-1").power, vmms_of(&h, "vm-1"));
    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    assert_eq!(still, (Some(PowerState::Suspended), 0));
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(vmms_of(&h, "vm-1"), 1);
    assert_eq!(h.engine().counts().cold_boots.get("interrupted"), 0);
}

/// `vm` booted (its guest's marker seen once), then suspended; its spec,
/// as its record holds it.
fn booted_once_then_suspended(h: &Host, vm: &str) -> eitri_agent::model::VmSpec {
    h.tick(&wanting(h, vm, PowerState::Running));
    wait_until("the guest's marker", || boots_of(h, vm) == 1);
    h.tick(&wanting(h, vm, PowerState::Suspended));
    h.store
        .get(&id(vm))
        .expect("read the record")
        .expect("a record")
        .spec
        .clone()
}

/// How many times the VM's guest booted, by its console's marker.
fn boots_of(h: &Host, vm: &str) -> usize {
    console(h, vm)
        .iter()
        .filter(|l| l.contains(&h.serial_marker))
        .count()
}

pub(crate) fn a_restore_whose_resume_cannot_be_recorded_is_ended_before_its_guest_runs_on(h: Host) {
    let spec = booted_once_then_suspended(&h, "vm-1");

    let refused = Suspend::resume(&*h.backend, &spec, Deadline::after(PATIENCE), &|| {
        Err(eitri_agent::error::Simple::transient("the disk is full").into())
    });

    let e = refused.expect_err("refused");
    assert!(e.to_string().contains("the disk is full"), "{e}");
    assert_eq!(vmms_of(&h, "vm-1"), 0, "the restored VMM is ended");
    assert!(matches!(
        Suspend::suspension(&*h.backend, &id("vm-1")),
        Some(SavedGuest::Usable(_))
    ));
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(
        boots_of(&h, "vm-1"),
        1,
        "resumed, never booted again: {:?}",
        console(&h, "vm-1")
    );
    assert_eq!(h.engine().counts().cold_boots.get("failed"), 0);
}

pub(crate) fn a_restore_cut_short_before_its_resume_was_recorded_is_stopped_at_start_on(h: Host) {
    let spec = booted_once_then_suspended(&h, "vm-1");
    // The agent dies while the restored guest waits for its record: the
    // VMM lives on, paused, and the record still says suspended.
    let died = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Suspend::resume(&*h.backend, &spec, Deadline::after(PATIENCE), &|| {
            panic!("the agent dies here")
        })
    }));
    let left = (died.is_err(), vm_state(&h, "vm-1"));

    let h = h.restart();
    let after_start = vmms_of(&h, "vm-1");
    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    assert_eq!(left, (true, Some("Paused".into())));
    assert_eq!(after_start, 0, "stopped at the agent's start");
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(vmms_of(&h, "vm-1"), 1);
    assert_eq!(
        boots_of(&h, "vm-1"),
        1,
        "resumed, never booted again: {:?}",
        console(&h, "vm-1")
    );
    assert_eq!(h.engine().counts().cold_boots.get("interrupted"), 0);
}

pub(crate) fn a_restored_hypervisor_is_jailed_in_namespaces_of_its_own_on(h: Host) {
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    let pid = h.pid("vm-1").expect("pid").to_string();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");

    assert_ne!(namespace(&pid, "net"), namespace("thread-self", "net"));
    assert_ne!(namespace(&pid, "mnt"), namespace("thread-self", "mnt"));
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|u| u.parse::<u32>().ok())
        .expect("uid");
    assert_ne!(uid, 0, "runs as its VM's own user, not root");
    assert!(status.contains("NoNewPrivs:\t1"), "{status}");
}

pub(crate) fn a_disk_changed_while_suspended_boots_the_vm_from_its_disks_on(h: Host) {
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));
    {
        use std::io::Write;
        let mut disk = std::fs::OpenOptions::new()
            .write(true)
            .open(h.store.layout().root_disk(&id("vm-1")))
            .expect("the root disk");
        disk.write_all(b"written while it slept").expect("write");
    }

    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(h.engine().counts().cold_boots.get("unusable"), 1);
    assert!(
        !h.store.layout().snapshot(&id("vm-1")).exists(),
        "discarded"
    );
    let pid = h.pid("vm-1").expect("pid");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    let cmdline = String::from_utf8_lossy(&cmdline);
    assert!(
        cmdline.contains("--kernel") && !cmdline.contains("--restore"),
        "booted, not restored: {cmdline}"
    );
}

pub(crate) fn stopping_a_suspended_vm_discards_its_snapshot_on(h: Host) {
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    h.tick(&wanting(&h, "vm-1", PowerState::Stopped));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Stopped));
    assert!(!h.store.layout().snapshot(&id("vm-1")).exists());
    assert_eq!(vmms_of(&h, "vm-1"), 0);
}

pub(crate) fn destroying_a_suspended_vm_leaves_nothing_of_it_on(h: Host) {
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    h.tick(&snapshot(2, vec![tombstoned("vm-1")]));

    assert!(!h.store.layout().vm_dir(&id("vm-1")).exists());
    assert_eq!(vmms_of(&h, "vm-1"), 0);
}

#[test]
fn a_snapshot_holding_a_file_cloud_hypervisor_never_writes_is_refused_and_the_vm_runs_on() {
    let h = Host::new(&[("STANDIN_SNAPSHOT_EXTRA", "planted.json")]);
    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    let row = h.row("vm-1");
    assert_eq!(row.power, Some(PowerState::Running), "{row:?}");
    assert!(row.last_error.contains("planted.json"), "{row:?}");
    assert!(!h.store.layout().snapshot(&id("vm-1")).exists());
    assert_eq!(
        vm_state(&h, "vm-1").as_deref(),
        Some("Running"),
        "the paused guest was resumed"
    );
}

/// Suspends a VM whose VMM writes its snapshot's `config.json` as `forge`
/// says (a VMM its guest took over); the refusal its row says, asserting
/// the VM runs on and no snapshot was committed.
fn suspend_forged(forge: &str) -> String {
    let h = Host::new(&[("STANDIN_SNAPSHOT_FORGE", forge)]);
    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    let row = h.row("vm-1");
    assert_eq!(row.power, Some(PowerState::Running), "{row:?}");
    assert!(!h.store.layout().snapshot(&id("vm-1")).exists());
    row.last_error
}

#[test]
fn a_snapshot_whose_config_turns_landlock_off_is_refused_and_the_vm_runs_on() {
    let said = suspend_forged("landlock-off");

    assert!(said.contains("landlock_enable is false"), "{said}");
}

#[test]
fn a_snapshot_whose_config_widens_landlock_is_refused() {
    let said = suspend_forged("rule");

    assert!(said.contains("landlock_rules[0].path is"), "{said}");
}

#[test]
fn a_snapshot_whose_config_gives_the_vm_a_host_disk_is_refused() {
    let said = suspend_forged("disk");

    assert!(said.contains("/dev/sda"), "{said}");
}

#[test]
fn a_snapshot_whose_config_gives_the_vm_more_vcpus_is_refused() {
    let said = suspend_forged("vcpus");

    assert!(said.contains("cpus.boot_vcpus is 64"), "{said}");
}

#[test]
fn a_restored_hypervisor_that_runs_another_vm_is_killed_and_the_vm_booted_from_its_disks() {
    let h = Host::new(&[("STANDIN_INFO_FORGE", "disk")]);
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(h.engine().counts().cold_boots.get("failed"), 1);
    assert!(!h.store.layout().snapshot(&id("vm-1")).exists());
    assert_eq!(vmms_of(&h, "vm-1"), 1);
}

/// The groups the test's userfaultfd device's ACL names.
fn userfaultfd_groups(h: &Host) -> Vec<u32> {
    let device = h.cfg.confinement.userfaultfd.clone().expect("a device");
    eitri_agent::provision::jail::acl::named_groups(&device).expect("acl")
}

#[test]
fn an_agents_start_gives_no_group_the_userfaultfd_device() {
    let h = Host::new(&[]);

    h.backend.recover(&[]);
    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    assert!(
        !userfaultfd_groups(&h).contains(&h.cfg.confinement.first_id),
        "{:?}",
        userfaultfd_groups(&h)
    );
}

#[test]
fn the_first_resume_gives_the_hypervisors_group_the_userfaultfd_device() {
    let h = Host::new(&[]);
    h.backend.recover(&[]);
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert!(
        userfaultfd_groups(&h).contains(&h.cfg.confinement.first_id),
        "{:?}",
        userfaultfd_groups(&h)
    );
}

/// Suspends a VM with disk and NIC limits whose VMM sets one field of its
/// snapshot's `config.json` (`/POINTER=JSON`); the refusal its row says.
fn suspend_limited_forged(forge: &str) -> String {
    let mut h = Host::new(&[("STANDIN_SNAPSHOT_FORGE", forge)]);
    h.connect();
    let mut d = h.desired("vm-1");
    d.spec.limits = eitri_agent::model::VmLimits {
        disk_mbps: 100,
        disk_iops: 500,
        net_mbps: 80,
        ..Default::default()
    };
    let want = |power| {
        let mut d = d.clone();
        d.power = power;
        snapshot(1, vec![present(d)])
    };
    h.tick(&want(PowerState::Running));

    h.tick(&want(PowerState::Suspended));

    let row = h.row("vm-1");
    assert_eq!(row.power, Some(PowerState::Running), "{forge}: {row:?}");
    assert!(!h.store.layout().snapshot(&id("vm-1")).exists(), "{forge}");
    row.last_error
}

#[test]
fn a_limited_vms_snapshot_as_its_vmm_wrote_it_is_taken() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    let mut d = h.desired("vm-1");
    d.spec.limits.disk_mbps = 100;
    d.spec.limits.net_mbps = 80;
    let mut asleep = d.clone();
    asleep.power = PowerState::Suspended;
    h.tick(&snapshot(1, vec![present(d)]));

    h.tick(&snapshot(1, vec![present(asleep)]));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Suspended));
}

/// The sealed config's fields a VMM taken over by its guest could set for
/// its successor, each refused by the allowlist, naming the field.
#[test]
fn a_sealed_config_with_any_field_the_agent_never_wrote_is_refused() {
    eitri_agent::testkit::net::private_network();
    let forged = [
        ("/rate_limit_groups=null", "rate_limit_groups holds 0"),
        (
            "/disks/0/rate_limit_group=null",
            "disks[0].rate_limit_group is",
        ),
        (
            "/net/0/rate_limiter_config=null",
            "net[0].rate_limiter_config",
        ),
        ("/rng/src=\"/\"", "rng.src is"),
        ("/debug_console/mode=\"Tty\"", "debug_console.mode is"),
        (
            "/generic_vhost_user=[{\"socket\":\"/run/x.sock\"}]",
            "it sets generic_vhost_user",
        ),
        ("/memory/hugepages=true", "memory.hugepages is"),
        (
            "/memory/hugepage_size=1073741824",
            "it sets memory.hugepage_size",
        ),
        ("/memory/mergeable=true", "memory.mergeable is"),
        (
            "/cpus/affinity=[{\"vcpu\":0,\"host_cpus\":[0]}]",
            "it sets cpus.affinity",
        ),
        ("/net/0/mac=\"02:00:00:00:00:01\"", "net[0].mac is"),
        ("/balloon={\"size\":1048576}", "it sets balloon"),
        ("/memory/prefault=true", "memory.prefault is"),
        // The agent would talk to whatever listens there as the guest.
        ("/vsock/socket=\"/run/docker.sock\"", "vsock.socket is"),
        ("/vsock/cid=2", "vsock.cid is"),
    ];
    for (forge, said) in forged {
        let why = suspend_limited_forged(forge);

        assert!(why.contains(said), "{forge}: {why}");
    }
}

/// A host whose VMMs cannot be given a userfaultfd device.
pub(crate) fn without_userfaultfd() -> Host {
    let mut h = Host::new(&[]);
    Arc::make_mut(&mut h.cfg.confinement).userfaultfd = None;
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    h.engine = Some(h.make_engine());
    h
}

#[test]
fn a_host_without_a_userfaultfd_device_says_a_resume_reads_the_whole_snapshot() {
    let h = without_userfaultfd();

    let notes = h.backend.recover(&[]);

    assert!(
        notes
            .iter()
            .any(|n| n.contains("whole snapshot") && n.contains("--userfaultfd-device is empty")),
        "{notes:?}"
    );
}

#[test]
fn a_host_without_a_userfaultfd_device_resumes_by_reading_the_snapshot_first() {
    let h = without_userfaultfd();
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    let pid = h.pid("vm-1").expect("pid");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    let cmdline = String::from_utf8_lossy(&cmdline);
    assert!(cmdline.contains("memory_restore_mode=copy"), "{cmdline}");
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
}

#[test]
fn a_snapshot_whose_memory_is_larger_than_its_guests_is_refused_and_the_vm_runs_on() {
    let h = Host::new(&[("STANDIN_SNAPSHOT_BIG", "1")]);
    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    let row = h.row("vm-1");
    assert_eq!(row.power, Some(PowerState::Running), "{row:?}");
    assert!(
        row.last_error.contains("more than its guest's could be"),
        "{row:?}"
    );
    assert!(!h.store.layout().snapshot(&id("vm-1")).exists());
}

#[test]
fn a_restore_that_fails_boots_the_vm_from_its_disks_and_never_restores_again() {
    let h = Host::new(&[("STANDIN_RESTORE_FAIL", "1")]);
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
    assert_eq!(h.engine().counts().cold_boots.get("failed"), 1);
    assert!(!h.store.layout().snapshot(&id("vm-1")).exists());
    assert_eq!(vmms_of(&h, "vm-1"), 1);
}

/// `vm` wanted at `power` with a console probe for the guest's marker.
fn probed_at(h: &Host, vm: &str, power: PowerState) -> Snapshot {
    let marker = eitri_agent::model::Check::Serial(h.serial_marker.clone());
    super::boot::probed_wanting(h, vm, marker, power)
}

pub(crate) fn a_resumed_guest_that_printed_its_probes_line_before_is_ready_again_on(h: Host) {
    h.tick_until_row(&probed_at(&h, "vm-1", PowerState::Running), "vm-1", |r| {
        r.phase == Some(Phase::Ready)
    });
    h.tick(&probed_at(&h, "vm-1", PowerState::Suspended));

    // One tick with it running again, then one probe period (1 s).
    h.tick(&probed_at(&h, "vm-1", PowerState::Running));
    std::thread::sleep(Duration::from_secs(1));
    h.tick(&probed_at(&h, "vm-1", PowerState::Running));

    let row = h.row("vm-1");
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Running), Some(Phase::Ready)),
        "{row:?}"
    );
}

pub(crate) fn a_cold_boot_does_not_count_the_line_its_last_boot_printed_on(h: Host) {
    h.tick_until_row(&probed_at(&h, "vm-1", PowerState::Running), "vm-1", |r| {
        r.phase == Some(Phase::Ready)
    });
    let layout = h.store.layout();
    // A boot from the disks: what the last boot printed is a segment now.
    h.tick(&probed_at(&h, "vm-1", PowerState::Stopped));
    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");
    std::fs::write(layout.serial_log(&id("vm-1")), "nothing yet\n").expect("console");

    let this_boot = layout.serial_of_this_boot(&id("vm-1"));

    assert_eq!(this_boot, [layout.serial_log(&id("vm-1"))], "{this_boot:?}");
}

/// How much the files in the VM's snapshot directory hold on disk.
fn snapshot_work_bytes(h: &Host, vm: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(h.store.layout().snapshot_work(&id(vm)))
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.blocks() * 512)
                .sum()
        })
        .unwrap_or(0)
}

/// The most the stand-in said it had flooded its snapshot directory with.
fn flooded_mib(h: &Host, vm: &str) -> u64 {
    super::jail::standin_said(h, vm, "standin-flood")
        .lines()
        .filter_map(|l| l.split_whitespace().rev().nth(1)?.parse().ok())
        .max()
        .unwrap_or(0)
}

/// A VMM that writes past its guest's memory into its snapshot: killed
/// near the bound, what it wrote removed, the row saying why.
fn killed_for_flooding(how: &str) {
    let h = Host::new(&[("STANDIN_SNAPSHOT_FLOOD", how)]);
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    let memory_mib = h.spec("vm-1").mem_mb;

    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    let row = h.row("vm-1");
    assert!(
        row.last_error.contains("into its snapshot directory"),
        "{row:?}"
    );
    wait_until("the flooding VMM gone", || vmms_of(&h, "vm-1") == 0);
    // The bound: its memory and 64 MiB, plus what it writes between two
    // measures (a 16 MiB file each 10 ms here, a poll each 10 ms, and the
    // measure's and the kill's own time).
    let flooded = flooded_mib(&h, "vm-1");
    assert!(
        flooded <= memory_mib + 64 + 48,
        "{flooded} MiB written, memory {memory_mib} MiB: {row:?}"
    );
    assert_eq!(snapshot_work_bytes(&h, "vm-1"), 0);
    assert!(!h.store.layout().snapshot(&id("vm-1")).exists());
}

#[test]
fn a_vmm_filling_its_snapshot_directory_past_its_guests_memory_is_killed() {
    killed_for_flooding("named");
}

#[test]
fn a_vmm_hiding_what_it_writes_in_its_snapshot_directory_by_unlinking_it_is_killed() {
    killed_for_flooding("unnamed");
}

#[test]
fn a_vmm_that_keeps_a_snapshot_file_open_after_the_snapshot_is_killed() {
    let h = Host::new(&[
        ("STANDIN_SNAPSHOT_HOLD", "1"),
        ("STANDIN_SNAPSHOT_FAIL", ""),
    ]);
    h.tick(&wanting(&h, "vm-1", PowerState::Running));

    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));

    let row = h.row("vm-1");
    assert!(row.last_error.contains("kept 1 file(s)"), "{row:?}");
    wait_until("the VMM gone", || vmms_of(&h, "vm-1") == 0);
}
