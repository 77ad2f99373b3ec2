//! The VMM's jail: its view of the host's files, its limits, its user, its cgroups, its environment.

use super::*;

/// The pid of the process the stand-in started (`STANDIN_FORK_CHILD`).
pub(crate) fn vmm_child(h: &Host, vm: &str) -> i32 {
    standin_said(h, vm, "standin-child pid=")
        .split("standin-child pid=")
        .nth(1)
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("the stand-in named no child"))
}

/// The line the stand-in logged for `tag` (`standin-look`, …), once it has.
pub(crate) fn standin_said(h: &Host, vm: &str, tag: &str) -> String {
    let log = h.store.layout().hypervisor_log(&id(vm));
    let mut said = String::new();
    wait_until(&format!("the VMM to log {tag}"), || {
        said = std::fs::read_to_string(&log).unwrap_or_default();
        said.contains(tag)
    });
    said.lines()
        .filter(|l| l.contains(tag))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn a_vmm_sees_its_own_files_and_nothing_else_of_the_host() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, b"the host's").expect("secret");
    let other_disk = dir.path().join("state/vms/vm-2/disk.raw");
    let own_disk = dir.path().join("state/vms/vm-1/disk.raw");
    let look = format!(
        "{},{},{},/etc/passwd,/proc/1",
        secret.display(),
        other_disk.display(),
        own_disk.display()
    );
    let h = Host::in_dir(dir, &[("STANDIN_LOOK", look.as_str())]);
    h.backend
        .boot(&h.spec("vm-2"), Deadline::NONE)
        .expect("boot vm-2");

    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot vm-1");

    let said = standin_said(&h, "vm-1", "standin-look");
    assert!(
        said.contains(&format!("{} there", own_disk.display())),
        "{said}"
    );
    for hidden in [
        secret.display().to_string(),
        other_disk.display().to_string(),
    ] {
        assert!(said.contains(&format!("{hidden} absent")), "{said}");
    }
    assert!(said.contains("/etc/passwd absent"), "{said}");
    assert!(said.contains("/proc/1 absent"), "{said}");
}

#[test]
fn a_vmm_cannot_grow_its_seed() {
    // The seed is the VMM's to read, not to write: grown to 1 TiB, it
    // would fill the state dir's filesystem for every tenant.
    let dir = tempfile::tempdir().expect("tempdir");
    let seed = dir.path().join("state/vms/vm-1/seed.iso");
    let grow = seed.display().to_string();
    let h = Host::in_dir(dir, &[("STANDIN_GROW", grow.as_str())]);

    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");

    let said = standin_said(&h, "vm-1", "standin-grow");
    assert!(said.contains("refused: Read-only file system"), "{said}");
    assert!(std::fs::metadata(&seed).expect("seed").len() < 1 << 30);
}

#[test]
fn a_vmm_cannot_write_its_snapshot_directory_outside_a_suspend() {
    // Its own from its start, it was storage the VMM could fill, file
    // after file, for its whole life.
    let dir = tempfile::tempdir().expect("tempdir");
    let work = dir.path().join("state/vms/vm-1/snapshot.tmp");
    let into = work.display().to_string();
    let h = Host::in_dir(dir, &[("STANDIN_WRITE_INTO", into.as_str())]);

    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");

    let said = standin_said(&h, "vm-1", "standin-write");
    assert!(said.contains("refused: Permission denied"), "{said}");
    assert_eq!(std::fs::read_dir(&work).expect("the directory").count(), 0);
}

#[test]
fn an_adopted_vmms_snapshot_directory_is_closed_to_it_and_emptied() {
    // As an older agent left it: the VMM's, holding what it kept there.
    let h = Host::new(&[]);
    h.tick(&h.vm("vm-1"));
    let work = h.store.layout().snapshot_work(&id("vm-1"));
    let uid = std::os::unix::fs::MetadataExt::uid(
        &std::fs::metadata(h.store.layout().root_disk(&id("vm-1"))).expect("disk"),
    );
    assert_ne!(uid, 0, "the disk is its VMM user's");
    std::os::unix::fs::chown(&work, Some(uid), Some(uid)).expect("chown");
    std::fs::write(work.join("kept"), b"kept").expect("kept");

    let h = h.restart();

    let meta = std::fs::metadata(&work).expect("the directory");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), 0);
    assert_eq!(std::fs::read_dir(&work).expect("read").count(), 0);
    assert!(h.backend.running(&id("vm-1")), "adopted, not stopped");
}

#[test]
fn a_vmm_cannot_grow_a_disk_past_the_largest_of_its_disks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = dir.path().join("state/vms/vm-1/disk.raw");
    let grow = disk.display().to_string();
    let h = Host::in_dir(dir, &[("STANDIN_GROW", grow.as_str())]);
    let spec = h.spec("vm-1");
    let size = spec.disk_gb << 30;

    h.backend.boot(&spec, Deadline::NONE).expect("boot");

    let said = standin_said(&h, "vm-1", "standin-grow");
    assert!(said.contains("refused: File too large"), "{said}");
    assert!(std::fs::metadata(&disk).expect("disk").len() <= size);
    assert!(h.backend.running(&id("vm-1")), "the VMM lives on");
}

#[test]
fn a_vmm_reaches_what_it_is_given_under_the_agents_umask() {
    // `main` sets 077; the view's directories must still be the VMM's to
    // pass (a daemon's VMMs could not exec their binary before).
    let h = Host::new(&[]);
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));

    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");

    assert!(h.backend.running(&id("vm-1")));
}

#[test]
fn a_vmm_cannot_reach_a_service_on_the_hosts_loopback() {
    // The jailed uid reached a service on the host's 127.0.0.1 before.
    let service = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback service");
    let at = service.local_addr().expect("its address").to_string();
    let h = Host::new(&[("STANDIN_CONNECT", at.as_str())]);

    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");

    let line = standin_said(&h, "vm-1", "standin-connect");
    assert!(line.contains("refused:"), "{line}");
}

#[test]
fn what_a_vmm_forked_is_gone_after_its_stop() {
    let h = Host::new(&[("STANDIN_FORK_CHILD", "1")]);
    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");
    let child = vmm_child(&h, "vm-1");
    assert!(alive(child), "the VMM's child runs");

    h.backend
        .shutdown(&id("vm-1"), Deadline::NONE, &|_| {})
        .expect("stopped");

    assert!(!alive(child), "the VMM's child {child} outlived its stop");
}

#[test]
fn what_a_vmm_forked_is_gone_after_destroy_and_its_cgroups_with_it() {
    let h = Host::new(&[("STANDIN_FORK_CHILD", "1")]);
    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");
    let child = vmm_child(&h, "vm-1");
    let cgroups = Cgroups::probe(&h.cfg.confinement.cgroup_root).expect("cgroups");

    h.backend
        .destroy(&id("vm-1"), Deadline::NONE)
        .expect("destroyed");

    assert!(
        !alive(child),
        "the VMM's child {child} outlived the destroy"
    );
    assert!(cgroups.dirs(&id("vm-1")).iter().all(|d| !d.exists()));
}

/// This process's resident memory, in bytes.
pub(crate) fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb << 10
}

#[test]
fn a_vmm_flooding_its_answers_costs_no_memory_and_frees_the_worker_at_its_deadline() {
    // A VMM its guest took over answers every API call with a status line
    // that never ends. Read line by line it took the agent to 1.5 GB.
    let h = Host::new(&[("STANDIN_FLOOD_ANSWERS", "1")]);
    let spec = h.spec("vm-1");
    let before = rss();
    let started = Instant::now();

    let booted = h
        .backend
        .boot(&spec, Deadline::after(Duration::from_secs(3)));

    let (took, grew) = (started.elapsed(), rss().saturating_sub(before));
    assert!(
        booted.is_err(),
        "a VMM that never says Running did not boot"
    );
    assert!(grew < 10 << 20, "the agent grew by {grew} bytes");
    // Free at its deadline (3 s), not when the VMM stops sending.
    assert!(
        took < Duration::from_secs(8),
        "the boot held on for {took:?}"
    );
}

/// A line of `/proc/<pid>/status`, after its key.
pub(crate) fn status_of(pid: i32, key: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("status")
        .lines()
        .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_owned()))
        .unwrap_or_default()
}

#[test]
fn the_hypervisor_runs_as_the_vms_own_user_with_no_capabilities_and_no_new_privileges() {
    let h = Host::new(&[]);
    let spec = h.spec("vm-1");

    h.backend.boot(&spec, Deadline::NONE).expect("boot");

    let pid = h.pid("vm-1").expect("pid");
    let uid: u32 = status_of(pid, "Uid:")
        .split_whitespace()
        .next()
        .and_then(|u| u.parse().ok())
        .expect("uid");
    let first = h.cfg.confinement.first_id;
    assert!(
        uid > first && uid < first + h.cfg.confinement.id_count,
        "uid {uid}"
    );
    assert_eq!(
        status_of(pid, "Uid:"),
        format!("{uid}\t{uid}\t{uid}\t{uid}")
    );
    assert_eq!(
        status_of(pid, "Gid:"),
        format!("{uid}\t{uid}\t{uid}\t{uid}")
    );
    assert_eq!(status_of(pid, "Groups:"), first.to_string());
    assert_eq!(status_of(pid, "CapEff:"), "0000000000000000");
    assert_eq!(status_of(pid, "CapBnd:"), "0000000000000000");
    assert_eq!(status_of(pid, "NoNewPrivs:"), "1");
    let owner =
        |p: &Path| std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(p).expect("stat"));
    assert_eq!(owner(&h.store.layout().root_disk(&id("vm-1"))), uid);
    assert_eq!(owner(&h.store.layout().seed(&id("vm-1"))), uid);
    assert_eq!(
        owner(&h.store.layout().vm_dir(&id("vm-1"))),
        0,
        "its directory stays root's"
    );
    assert_eq!(
        owner(&h.store.layout().pidfile(&id("vm-1"))),
        0,
        "and its pidfile"
    );
}

#[test]
fn the_hypervisor_is_in_the_vms_own_cgroups_with_its_limits_until_destroyed() {
    let h = Host::new(&[]);
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid");
    let cgroups = Cgroups::probe(&h.cfg.confinement.cgroup_root).expect("cgroups");
    let dirs = cgroups.dirs(&id("vm-1"));

    let listed = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
    let suffix = format!("/{}/vm-1", h.cfg.confinement.cgroup_root);
    let read = |name: &str| {
        dirs.iter()
            .find_map(|d| std::fs::read_to_string(d.join(name)).ok())
            .map(|v| v.trim().to_owned())
    };
    let memory = read("memory.max").or_else(|| read("memory.limit_in_bytes"));
    let pids = read("pids.max");
    h.backend
        .destroy(&id("vm-1"), Deadline::NONE)
        .expect("destroy");

    for controller in ["memory", "pids", "cpu"] {
        assert!(
            listed.lines().any(|l| {
                let mut f = l.splitn(3, ':');
                let (_, names, path) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or(""));
                (names.split(',').any(|n| n == controller) || names.is_empty())
                    && path.ends_with(&suffix)
            }),
            "{controller}: {listed}"
        );
    }
    let want = (spec.mem_mb << 20) + eitri_agent::provision::jail::VMM_OVERHEAD_BYTES;
    assert_eq!(memory, Some(want.to_string()));
    assert_eq!(
        pids,
        Some(eitri_agent::provision::jail::max_threads(spec.vcpus).to_string())
    );
    assert!(
        dirs.iter().all(|d| !d.exists()),
        "removed at destroy: {dirs:?}"
    );
}

#[test]
fn the_hypervisor_inherits_none_of_the_agents_environment() {
    // Something the agent's environment has, as a secret might be.
    // SAFETY: first thing in this test's own process, no other thread yet.
    unsafe { std::env::set_var("EITRI_TEST_SECRET", "hunter2") };
    let h = Host::new(&[]);
    // The stand-in itself, not the launcher script (a shell sets PWD).
    let backend = CloudHypervisor::new(Arc::clone(&h.store), with_binary(&h.cfg, STANDIN.into()));
    let spec = h.spec("vm-1");

    backend.boot(&spec, Deadline::NONE).expect("boot");

    let pid = h.pid("vm-1").expect("pid");
    let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("environ");
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).expect("cwd");
    let _ = backend.destroy(&id("vm-1"), Deadline::NONE);
    assert!(environ.is_empty(), "{}", String::from_utf8_lossy(&environ));
    assert_eq!(cwd, Path::new("/"), "not the agent's working directory");
}

/// A VM whose VMM writes `rate` bytes a second for 4 s (by `knob`)
/// against a 512 KiB cap; the file `of` names, and its length then.
pub(crate) fn flooded(knob: &str, rate: u64, of: fn(&Host) -> PathBuf) -> (Host, PathBuf, u64) {
    let mut h = Host::new(&[(knob, &rate.to_string())]);
    Arc::make_mut(&mut h.cfg.limits).serial_log_bytes = 512 << 10;
    let h = h.restart();
    h.tick(&h.vm("vm-1"));
    let path = of(&h);
    std::thread::sleep(Duration::from_secs(4));
    let len = std::fs::metadata(&path).expect("the flooded file").len();
    (h, path, len)
}

/// Waits until the file at `path` holds no more of the disk than `cap`
/// and what `rate` writes in a check's second (and a quarter): a check
/// that comes late on a loaded machine is waited for, not sampled once.
fn held_within(path: &Path, cap: u64, rate: u64) {
    let bound = cap + rate * 5 / 4;
    let held = || {
        let meta = std::fs::metadata(path).expect("the flooded file");
        std::os::unix::fs::MetadataExt::blocks(&meta) * 512
    };
    wait_until(&format!("{} within {bound} bytes", path.display()), || {
        held() <= bound
    });
}

#[test]
fn a_guest_printing_to_serial_forever_holds_no_more_disk_than_the_cap() {
    // 2 MiB a second against a 512 KiB cap.
    let rate: u64 = 2 << 20;

    let (_h, serial, len) = flooded("STANDIN_SERIAL_FLOOD", rate, |h| {
        h.store.layout().serial_log(&id("vm-1"))
    });

    let text = std::fs::read(&serial).expect("read");
    let last = text.rsplit(|b| *b == b'\n').nth(1).unwrap_or_default();
    assert!(len > 4 << 20, "the guest wrote {len} bytes");
    // The cap, and at most what the guest writes in a check's second.
    held_within(&serial, 512 << 10, rate);
    assert!(
        last.starts_with(b"serial line "),
        "the newest output is kept: {:?}",
        String::from_utf8_lossy(last)
    );
}

#[test]
fn a_vmm_writing_its_log_forever_holds_no_more_disk_than_the_cap() {
    let rate: u64 = 2 << 20;

    let (_h, log, len) = flooded("STANDIN_LOG_FLOOD", rate, |h| {
        h.store.layout().hypervisor_log(&id("vm-1"))
    });

    assert!(len > 4 << 20, "the VMM wrote {len} bytes");
    held_within(&log, 512 << 10, rate);
}

#[test]
fn the_hypervisor_keeps_its_cgroups_across_an_agent_restart() {
    let h = Host::new(&[]);
    h.tick(&h.vm("vm-1"));
    let pid = h.pid("vm-1").expect("pid");
    let before = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");

    let h = h.restart();

    let after = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
    let dirs = Cgroups::probe(&h.cfg.confinement.cgroup_root)
        .expect("cgroups")
        .dirs(&id("vm-1"));
    assert_eq!(h.pid("vm-1"), Some(pid), "the same VMM, adopted");
    assert_eq!(after, before);
    assert!(dirs.iter().all(|d| d.exists()), "{dirs:?}");
}

#[test]
fn a_vms_hypervisor_user_is_the_same_after_an_agent_restart() {
    let h = Host::new(&[]);
    h.tick(&h.vm("vm-1"));
    let first = status_of(h.pid("vm-1").expect("pid"), "Uid:");
    let h = h.restart();
    let spec = h.spec("vm-1");
    h.backend
        .shutdown(&id("vm-1"), Deadline::NONE, &|_| {})
        .expect("stop");

    h.backend.boot(&spec, Deadline::NONE).expect("boot again");

    assert_eq!(status_of(h.pid("vm-1").expect("pid"), "Uid:"), first);
}

#[test]
fn a_local_users_process_naming_a_vms_disk_is_not_taken_for_its_hypervisor() {
    use std::os::unix::process::CommandExt;
    let h = Host::new(&[]);
    let disk = format!("path={}", h.store.layout().root_disk(&id("vm-1")).display());
    // A process of nobody's with the VM's disk on its command line, as any
    // local user could start.
    // (A shell waiting on its stdin: it keeps the argument and runs
    // until killed.)
    let mut impostor = std::process::Command::new("sh")
        .args(["-c", "read line", "impostor", &disk])
        .stdin(std::process::Stdio::piped())
        .uid(65534)
        .gid(65534)
        .spawn()
        .expect("sh");
    // Its socket file too, so the backend looks hard (it scans).
    std::fs::create_dir_all(h.cfg.hypervisor.run_dir.clone()).expect("run dir");
    std::fs::write(h.backend.socket_path(&id("vm-1")), b"").expect("socket file");

    let taken = h.backend.adopt(&id("vm-1"));
    let still_there = alive(impostor.id() as i32);
    let _ = impostor.kill();
    let _ = impostor.wait();

    assert!(
        !taken,
        "a local user's process passed for the VM's hypervisor"
    );
    assert!(still_there, "and it was not ours to stop");
}
