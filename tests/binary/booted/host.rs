//! What booted VMs take of the host, and give back: room on a full state
//! dir, the KVM device's ACL and cgroups, a claim whose state dir is
//! gone, and the image cache beside a running agent.

use super::*;

/// A state dir of 4 MiB with room for the 1 MiB image and the agent's
/// files, but not for the VM's copy of it, whose `filler` holds the
/// room the VM lacks; `full-1` desired. Mounted first, so unmounted
/// last: after the VMMs of the `Booting` end.
fn full_state_dir(dir: &Path) -> (eitri_agent::testkit::tmpfs::Tmpfs, Booting, PathBuf) {
    let disk = eitri_agent::testkit::tmpfs::Tmpfs::mount(&dir.join("state"), "4m");
    let boot = Booting::new(dir);
    let filler = disk.path().join("filler");
    std::fs::write(&filler, vec![0x5a; 5 << 19]).expect("filler");
    desired(
        dir,
        &format!(r#"{{"vms":[{}]}}"#, boot.vm_json("full-1", "")),
    );
    (disk, boot, filler)
}

/// Waits for `full-1`'s create to be stopped by the full disk.
fn wait_until_full(agent: &Agent) -> serde_json::Value {
    agent.wait_report("the create stopped by the full disk", |r| {
        row_of(r, "full-1")["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("No space left"))
    })
}

#[test]
fn a_full_state_dir_spends_no_create_attempt_and_the_vm_boots_once_there_is_room() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_disk, boot, filler) = full_state_dir(dir.path());

    let agent = boot.start(dir.path(), &[]);
    let waiting = wait_until_full(&agent);
    std::thread::sleep(Duration::from_secs(1));
    let record = std::fs::read(agent.state.join("vms/full-1/record.json")).expect("record");
    let record: serde_json::Value = serde_json::from_slice(&record).expect("json");
    std::fs::remove_file(&filler).expect("room made");
    let ready = agent.wait_report("full-1 ready", |r| row_of(r, "full-1")["phase"] == "ready");

    let error = row_of(&waiting, "full-1")["last_error"].to_string();
    assert!(error.contains("MiB free"), "{error}");
    assert!(!error.contains("attempt"), "{error}");
    let notes = waiting["notes"].to_string();
    assert!(
        notes.contains("VM full-1 cannot be created") && notes.contains("MiB free"),
        "the host's condition: {notes}"
    );
    assert_eq!(record["record"]["create_attempts"], 0, "{record}");
    assert_eq!(record["record"]["waiting_for_host"], true, "{record}");
    assert_eq!(row_of(&ready, "full-1")["power_state"], "running");
    let log = agent.log_text();
    assert_eq!(log.matches("No space left").count(), 1, "{log}");
}

#[test]
fn a_create_that_met_a_full_state_dir_is_not_tried_again_before_there_is_more_room() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_disk, boot, _filler) = full_state_dir(dir.path());
    let metrics = dir.path().join("eitri.prom");
    let metric = |name: &str| -> u64 {
        std::fs::read_to_string(&metrics)
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0)
    };

    let agent = boot.start(
        dir.path(),
        &["--metrics-file", &metrics.display().to_string()],
    );
    wait_until_full(&agent);
    let ticks = metric("eitri_tick_duration_seconds_count");
    wait_for("five more ticks", || {
        metric("eitri_tick_duration_seconds_count") > ticks + 5
    });

    assert_eq!(metric("eitri_create_attempts_total"), 1);
    let log = agent.log_text();
    assert_eq!(log.matches("No space left").count(), 1, "{log}");
}

/// The groups named on the ACL of `boot`'s KVM device.
fn kvm_groups(dir: &Path) -> Vec<u32> {
    eitri_agent::provision::jail::acl::named_groups(&dir.join("kvm")).expect("the ACL")
}

/// `root`'s directories in each cgroup hierarchy that are there.
fn cgroup_roots(root: &str) -> Vec<PathBuf> {
    eitri_agent::provision::jail::cgroup::Cgroups::probe(root)
        .map(|c| c.roots())
        .unwrap_or_default()
        .into_iter()
        .filter(|d| d.exists())
        .collect()
}

/// Boots one VM under a new agent in `dir`, then has it destroyed and
/// stops the agent: what a state dir that ran a VM leaves on the host.
fn ran_a_vm(boot: &Booting, dir: &Path, extra: &[&str]) -> u32 {
    desired(
        dir,
        &format!(r#"{{"vms":[{}]}}"#, boot.vm_json("one-1", "")),
    );
    let mut agent = boot.start(dir, &[extra, &["--tombstone-grace", "0"]].concat());
    agent.wait_report("one-1 ready", |r| row_of(r, "one-1")["phase"] == "ready");
    let (group, _, _) = claim_of(&agent.state);
    destroy(boot, dir, &agent, "one-1");
    assert!(agent.stop(Signal::SIGTERM).success());
    u32::try_from(group).expect("a gid")
}

/// Tombstones `id` and waits until its agent reports it destroyed.
fn destroy(boot: &Booting, dir: &Path, agent: &Agent, id: &str) {
    let tombstoned = boot.vm_json(id, r#","tombstoned":true"#);
    desired(dir, &format!(r#"{{"vms":[{tombstoned}]}}"#));
    agent.wait_report("the VM destroyed", |r| {
        r["report"]["destroyed"]
            .as_array()
            .is_some_and(|d| d.iter().any(|v| v == id))
    });
}

#[test]
fn a_released_state_dir_leaves_the_kvm_acl_and_cgroups_as_they_were() {
    let dir = tempfile::tempdir().expect("tempdir");
    let boot = Booting::new(dir.path());
    let before = kvm_groups(dir.path());
    ran_a_vm(&boot, dir.path(), &[]);
    assert_eq!(kvm_groups(dir.path()).len(), before.len() + 1);
    assert!(!cgroup_roots(&boot.cgroup_root).is_empty());

    let out = eitri(&[
        "release",
        "--state-dir",
        &dir.path().join("state").display().to_string(),
        "--agents-dir",
        &dir.path().join("agents").display().to_string(),
        "--kvm-device",
        &dir.path().join("kvm").display().to_string(),
    ]);

    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(kvm_groups(dir.path()), before);
    assert_eq!(cgroup_roots(&boot.cgroup_root), Vec::<PathBuf>::new());
    assert!(said.contains("released the claim"), "{said}");
}

#[test]
fn the_claim_of_a_state_dir_that_is_gone_is_taken_back_by_the_next_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let boot = Booting::new(dir.path());
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    let registry = dir.path().join("agents").display().to_string();
    for d in [&one, &two] {
        std::fs::create_dir_all(d).expect("dir");
    }
    let shared = ["--agents-dir", registry.as_str()];
    let group = ran_a_vm(&boot, &one, &shared);
    assert!(kvm_groups(dir.path()).contains(&group));
    std::fs::remove_dir_all(&one).expect("the first state dir deleted");

    desired(&two, r#"{"vms":[]}"#);
    let second = boot.start(&two, &shared);
    second.wait_report("the second agent", |r| r["host"].is_object());

    assert!(!kvm_groups(dir.path()).contains(&group));
    assert_eq!(cgroup_roots(&boot.cgroup_root), Vec::<PathBuf>::new());
    assert!(
        second.log_text().contains("took back"),
        "{}",
        second.log_text()
    );
}

#[test]
fn images_list_works_beside_a_running_agent_and_names_each_images_vms() {
    let dir = tempfile::tempdir().expect("tempdir");
    let boot = Booting::new(dir.path());
    desired(
        dir.path(),
        &format!(
            r#"{{"vms":[{},{}]}}"#,
            boot.vm_json("img-1", ""),
            boot.vm_json("img-2", "")
        ),
    );
    let agent = boot.start(dir.path(), &[]);
    agent.wait_report("both ready", |r| {
        row_of(r, "img-1")["phase"] == "ready" && row_of(r, "img-2")["phase"] == "ready"
    });

    let out = eitri(&[
        "images",
        "list",
        "--state-dir",
        &agent.state.display().to_string(),
    ]);

    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = text
        .lines()
        .find(|l| l.starts_with(&boot.image_sha256))
        .unwrap_or_default();
    assert!(
        row.contains("1.0 MiB") && row.ends_with("img-1,img-2"),
        "{text}"
    );
}

/// `n` published ports from `first`, as a VM's entry holds them.
fn ports_json(first: u16, n: u16) -> String {
    let ports: Vec<String> = (0..n)
        .map(|i| format!(r#"{{"host_port":{},"guest_port":{}}}"#, first + i, 8000 + i))
        .collect();
    format!(r#","published_ports":[{}]"#, ports.join(","))
}

#[test]
fn five_vms_ports_under_a_low_open_file_limit_leave_a_bystander_booting() {
    use nix::sys::resource::{Resource, setrlimit};
    eitri_agent::testkit::net::private_network();
    // The agent inherits this test process's limit, hard and soft: room
    // for the agent, the bystander and a few publishers, not all five.
    const LIMIT: u64 = 192;
    setrlimit(Resource::RLIMIT_NOFILE, LIMIT, LIMIT).expect("setrlimit");
    let dir = tempfile::tempdir().expect("tempdir");
    let boot = Booting::new(dir.path());
    let mut vms: Vec<String> = (0..5u16)
        .map(|i| boot.vm_json(&format!("pub-{i}"), &ports_json(31000 + 32 * i, 32)))
        .collect();
    desired(dir.path(), &format!(r#"{{"vms":[{}]}}"#, vms.join(",")));
    let agent = boot.start(
        dir.path(),
        &[
            "--underlay-bridge",
            "etbinfd0",
            "--publish-ports",
            "31000-31999",
        ],
    );
    agent.wait_report("the publishers running", |r| {
        (0..5).all(|i| row_of(r, &format!("pub-{i}"))["power_state"] == "running")
    });

    vms.push(boot.vm_json("bystander", ""));
    desired(dir.path(), &format!(r#"{{"vms":[{}]}}"#, vms.join(",")));

    let report = agent.wait_report("the bystander running", |r| {
        row_of(r, "bystander")["power_state"] == "running"
    });
    assert_eq!(row_of(&report, "bystander")["last_error"], "", "{report}");
    let waiting = (0..5).any(|i| {
        row_of(&report, &format!("pub-{i}"))["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("wait for file descriptors"))
    });
    assert!(waiting, "no publisher's ports wait: {report}");
    assert!(
        !agent.log_text().contains("Too many open files"),
        "{}",
        agent.log_text()
    );
}

#[test]
fn a_host_that_cannot_confine_a_vmm_begins_no_create() {
    let dir = tempfile::tempdir().expect("tempdir");
    let boot = Booting::new(dir.path());
    // The VMM ids' map unreadable: no VMM can be given a user of its own.
    let jail = dir.path().join("state/jail");
    std::fs::create_dir_all(&jail).expect("jail dir");
    std::fs::write(jail.join("ids.json"), "not a map").expect("ids");
    desired(
        dir.path(),
        &format!(r#"{{"vms":[{}]}}"#, boot.vm_json("jail-1", "")),
    );

    let agent = boot.start(dir.path(), &[]);
    let waiting = agent.wait_report("jail-1 waiting for the host", |r| {
        row_of(r, "jail-1")["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("--allow-without jail"))
    });
    // Ten ticks more.
    std::thread::sleep(Duration::from_secs(1));

    assert_eq!(row_of(&waiting, "jail-1")["phase"], "creating", "{waiting}");
    assert_eq!(detail_of(&waiting, "jail-1")["attempts"], 0, "{waiting}");
    let log = agent.log_text();
    assert!(
        !log.contains("create attempt took"),
        "no create began: {log}"
    );
}
