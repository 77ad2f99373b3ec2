//! The hypervisor's process: namespaces, fds, pidfiles, sockets, adoption and interruption.

use super::*;

/// Which namespace of `kind` (`net`, `mnt`) process `pid` is in.
pub(crate) fn namespace(pid: &str, kind: &str) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}"))
        .map(|t| t.display().to_string())
        .unwrap_or_else(|e| panic!("/proc/{pid}/ns/{kind}: {e}"))
}

pub(crate) fn the_hypervisor_runs_in_network_and_mount_namespaces_of_its_own_on(h: Host) {
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid").to_string();

    let theirs = (namespace(&pid, "net"), namespace(&pid, "mnt"));
    let ours = (
        namespace("thread-self", "net"),
        namespace("thread-self", "mnt"),
    );
    assert!(h.backend.running(&id("vm-1")), "it runs in it");
    h.backend
        .shutdown(&id("vm-1"), Deadline::NONE, &|_| {})
        .expect("stopped in it");
    h.backend
        .destroy(&id("vm-1"), Deadline::NONE)
        .expect("destroyed");

    assert_ne!(
        theirs.0, ours.0,
        "the VMM's network namespace is the agent's"
    );
    assert_ne!(theirs.1, ours.1, "the VMM's mount namespace is the agent's");
}

pub(crate) fn the_hypervisor_holds_only_its_own_fds_on(h: Host) {
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid");

    // An fd closed between the listing and its link (a VMM's own API
    // connection, say) is not held: left out.
    let fds: Vec<(String, String)> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fds")
        .flatten()
        .filter_map(|e| {
            let target = std::fs::read_link(e.path()).ok()?;
            Some((
                e.file_name().to_string_lossy().into_owned(),
                target.display().to_string(),
            ))
        })
        .collect();

    let target = |fd: &str| fds.iter().find(|(n, _)| n == fd).map(|(_, t)| t.as_str());
    let log = h
        .store
        .layout()
        .hypervisor_log(&id("vm-1"))
        .display()
        .to_string();
    assert_eq!(target("0"), Some("/dev/null"));
    assert_eq!(target("1"), Some(log.as_str()));
    assert_eq!(target("2"), Some(log.as_str()));
    assert!(
        target("3").is_some_and(|t| t.starts_with("socket:")),
        "the API socket: {fds:?}"
    );
    assert_eq!(target("4"), Some("/dev/net/tun"), "its tap: {fds:?}");
    // Anything else it opened itself: its own files, API connections, and
    // what a real VMM opens for its guest (the KVM device and its VM and
    // vCPU fds, event fds and epolls, a second tun queue, entropy).
    let own_dir = h.store.layout().vm_dir(&id("vm-1")).display().to_string();
    let a_vmms_own = |t: &str| {
        t.starts_with(&own_dir)
            || t.starts_with("socket:")
            || t.starts_with("anon_inode:kvm-")
            // Its guest's memory (shared, so it snapshots sparse).
            || t.starts_with("/memfd:ch_ram")
            || [
                "anon_inode:[eventfd]",
                "anon_inode:[eventpoll]",
                "/dev/kvm",
                "/dev/net/tun",
                "/dev/urandom",
            ]
            .contains(&t)
    };
    let others: Vec<&(String, String)> = fds
        .iter()
        .filter(|(n, _)| n.parse::<u32>().is_ok_and(|n| n > 4))
        .filter(|(_, t)| !a_vmms_own(t))
        .collect();
    assert!(others.is_empty(), "fds that are not its own: {others:?}");
}

pub(crate) fn a_hundred_boot_destroy_cycles_leave_no_zombie_and_no_fd_on(h: Host) {
    let spec = h.spec("vm-1");
    let fds_before = std::fs::read_dir("/proc/self/fd").expect("fds").count();

    for _ in 0..100 {
        h.backend.boot(&spec, Deadline::NONE).expect("boot");
        h.backend
            .destroy(&id("vm-1"), Deadline::NONE)
            .expect("destroy");
    }

    let me = std::process::id().to_string();
    let zombies = std::fs::read_dir("/proc")
        .expect("proc")
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter(|s| {
            let rest: Vec<&str> = s
                .rsplit(')')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .collect();
            rest.first() == Some(&"Z") && rest.get(1) == Some(&me.as_str())
        })
        .count();
    wait_until("fds to settle", || {
        std::fs::read_dir("/proc/self/fd").expect("fds").count() <= fds_before
    });
    assert_eq!(zombies, 0);
}

#[test]
fn a_pidfile_naming_an_unrelated_process_reads_not_running() {
    let h = Host::new(&[]);
    let mut sleeper = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("sleep");
    let pid = sleeper.id();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let start = stat
        .rsplit(')')
        .next()
        .and_then(|r| r.split_whitespace().nth(19))
        .expect("start time");
    std::fs::create_dir_all(h.store.layout().vm_dir(&id("vm-1"))).expect("dir");
    std::fs::write(
        h.store.layout().pidfile(&id("vm-1")),
        format!("{pid} {start}\n"),
    )
    .expect("pidfile");

    let running = h.backend.running(&id("vm-1"));

    let _ = sleeper.kill();
    let _ = sleeper.wait();
    assert!(!running);
}

#[test]
fn a_hypervisor_that_never_opens_its_socket_is_killed_and_explained() {
    let mut h = Host::new(&[("STANDIN_NO_SOCKET", "1")]);
    h.cfg.boot_wait = Duration::from_millis(500);
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    let spec = h.spec("vm-1");

    let err = h
        .backend
        .boot(&spec, Deadline::NONE)
        .expect_err("never came up");

    assert!(err.to_string().contains("did not say Running"), "{err}");
    let pid = h.pid("vm-1").expect("pid");
    assert!(!alive(pid));
}

#[test]
fn a_hypervisor_that_fails_at_start_says_why() {
    let h = Host::new(&[("STANDIN_FAIL_START", "cannot open /dev/kvm: busy")]);
    let spec = h.spec("vm-1");

    let err = h.backend.boot(&spec, Deadline::NONE).expect_err("failed");

    assert!(
        err.to_string().contains("cannot open /dev/kvm: busy"),
        "{err}"
    );
}

#[test]
fn a_hypervisors_log_cannot_put_a_terminal_escape_in_the_error() {
    let h = Host::new(&[("STANDIN_FAIL_START", "bad \u{1b}[2J guest \r")]);
    let spec = h.spec("vm-1");

    let err = h.backend.boot(&spec, Deadline::NONE).expect_err("failed");

    let text = err.to_string();
    assert!(!text.chars().any(char::is_control), "{text:?}");
    assert!(text.contains("bad \\u{1b}[2J guest"), "{text}");
}

#[test]
fn a_long_state_dir_still_gets_a_short_socket() {
    let outer = tempfile::tempdir().expect("tempdir");
    let deep = outer.path().join("d".repeat(100)).join("e".repeat(100));
    std::fs::create_dir_all(&deep).expect("deep dir");
    let dir = tempfile::tempdir_in(&deep).expect("deep tempdir");
    let mut h = Host::in_dir(dir, &[]);
    // Sockets live apart from the state dir (/run/eitri in production).
    let run = tempfile::tempdir().expect("run dir");
    Arc::make_mut(&mut h.cfg.hypervisor).run_dir = run.path().to_path_buf();
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    assert!(
        h.store.layout().vm_dir(&id("vm-1")).as_os_str().len() > 200,
        "the state dir is long"
    );
    let spec = h.spec("vm-1");

    h.backend.boot(&spec, Deadline::NONE).expect("boot");

    assert!(h.backend.socket_path(&id("vm-1")).as_os_str().len() < 108);
    assert!(h.backend.running(&id("vm-1")));
}

/// A test cgroup root `name` with a VM's cgroup `vm-1` in each hierarchy,
/// as a gone run leaves it, and those cgroups. This process's own
/// once-per-process sweep is done first, so only the test's own call can
/// see it.
fn gone_runs_root(name: &str) -> (eitri_agent::provision::jail::cgroup::Cgroups, Vec<PathBuf>) {
    let scratch = tempfile::tempdir().expect("tempdir");
    eitri_agent::testkit::confinement(scratch.path());
    let cgroups = eitri_agent::provision::jail::cgroup::Cgroups::probe(name).expect("cgroups");
    let dirs: Vec<PathBuf> = cgroups.roots().iter().map(|r| r.join("vm-1")).collect();
    for dir in &dirs {
        std::fs::create_dir_all(dir).expect("cgroup");
    }
    (cgroups, dirs)
}

#[test]
fn a_gone_runs_cgroup_root_is_ended_with_its_processes_by_the_next_run() {
    // No process has a pid past the kernel's largest pid_max (2^22).
    let name = format!("eitri-test-{}", (1u32 << 22) + 7);
    let mut left = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .expect("sleep");
    // Another test process's sweep may take the root away between its
    // making and the move (it is a gone run's to every sweep): made again.
    let mut made = None;
    for _ in 0..10 {
        let (cgroups, dirs) = gone_runs_root(&name);
        if std::fs::write(dirs[0].join("cgroup.procs"), left.id().to_string()).is_ok() {
            made = Some(cgroups);
            break;
        }
    }
    let cgroups = made.expect("the sleeper moved into the gone run's root");

    eitri_agent::testkit::sweep_stale_test_roots();

    let ended = left.wait().expect("wait");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&ended),
        Some(9)
    );
    assert!(
        cgroups.roots().iter().all(|r| !r.exists()),
        "{:?}",
        cgroups.roots()
    );
}

#[test]
fn a_named_root_of_a_gone_run_is_swept_too() {
    // A bench's second root (`eitri-test-PID-bare`), of a pid no process has.
    let (cgroups, _) = gone_runs_root(&format!("eitri-test-{}-bare", (1u32 << 22) + 8));

    eitri_agent::testkit::sweep_stale_test_roots();

    assert!(
        cgroups.roots().iter().all(|r| !r.exists()),
        "{:?}",
        cgroups.roots()
    );
}

/// Set in the environment of the process the interrupt test starts.
pub(crate) const INTERRUPTED_CHILD: &str = "EITRI_TEST_INTERRUPTED_CHILD";

#[test]
#[ignore = "run by a_test_interrupted_with_ctrl_c_leaves_no_hypervisor_no_cgroups_and_no_temp_dir"]
fn a_test_process_that_waits_for_its_interrupt() {
    if std::env::var_os(INTERRUPTED_CHILD).is_none() {
        return;
    }
    let h = Host::new(&[]);
    h.backend
        .boot(&h.spec("vm-1"), Deadline::NONE)
        .expect("boot");
    println!("vmm {}", h.pid("vm-1").expect("pid"));
    println!("dir {}", h.dir.path().display());
    // Nothing past here: this process ends by the signal.
    std::thread::sleep(PATIENCE * 3);
}

#[test]
fn a_test_interrupted_with_ctrl_c_leaves_no_hypervisor_no_cgroups_and_no_temp_dir() {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "process::a_test_process_that_waits_for_its_interrupt",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(INTERRUPTED_CHILD, "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("child test");
    let out = child.stdout.take().expect("stdout");
    let mut lines = std::io::BufReader::new(out).lines().map_while(Result::ok);
    let vmm: i32 = lines
        .by_ref()
        // libtest prints the test's name on the same line first.
        .find_map(|l| {
            l.rsplit_once("vmm ")
                .and_then(|(_, p)| p.trim().parse().ok())
        })
        .expect("the child booted a VMM");
    let dir = lines
        .find_map(|l| l.strip_prefix("dir ").map(std::path::PathBuf::from))
        .expect("the child's temp dir");
    let root = format!("eitri-test-{}", child.id());
    let roots = Cgroups::probe(&root).expect("cgroups").roots();
    assert!(alive(vmm) && roots.iter().all(|r| r.exists()));

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .expect("SIGINT");
    let ended = child.wait().expect("wait");

    assert_eq!(ended.code(), Some(130));
    let until = Instant::now() + PATIENCE;
    while (alive(vmm) || roots.iter().any(|r| r.exists()) || dir.exists()) && Instant::now() < until
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!alive(vmm), "the VMM {vmm} outlived its test");
    assert!(roots.iter().all(|r| !r.exists()), "{roots:?}");
    assert!(!dir.exists(), "{} outlived its test", dir.display());
}

#[test]
fn an_orphan_hypervisor_is_stopped_at_start_and_said() {
    let h = Host::new(&[]);
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid");

    // No record and no desired state names vm-1: nothing explains it.
    let restarted = CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone());
    let notes = restarted.recover(&[]);

    wait_until("the orphan to be gone", || !alive(pid));
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0].contains("orphan") && notes[0].contains(&pid.to_string()),
        "{notes:?}"
    );
}

#[test]
fn a_garbled_pidfile_does_not_hide_a_running_hypervisor() {
    let h = Host::new(&[]);
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid");
    std::fs::write(h.store.layout().pidfile(&id("vm-1")), b"\x00garbage").expect("garble");

    let running = h.backend.running(&id("vm-1"));

    assert!(running);
    assert_eq!(h.pid("vm-1"), Some(pid), "the pidfile names it again");
}

#[test]
fn a_pidfile_naming_an_unrelated_process_does_not_hide_the_hypervisor() {
    let h = Host::new(&[]);
    let spec = h.spec("vm-1");
    h.backend.boot(&spec, Deadline::NONE).expect("boot");
    let pid = h.pid("vm-1").expect("pid");
    // This test process: alive, and no hypervisor of vm-1.
    let me = std::process::id();
    let start = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| s.rsplit(')').next().map(str::to_owned))
        .and_then(|r| r.split_whitespace().nth(19).map(str::to_owned))
        .expect("start time");
    std::fs::write(
        h.store.layout().pidfile(&id("vm-1")),
        format!("{me} {start}\n"),
    )
    .expect("wrong pid");

    let running = h.backend.running(&id("vm-1"));

    assert!(running);
    assert_eq!(h.pid("vm-1"), Some(pid));
}

#[test]
fn a_vmm_whose_record_never_said_booted_is_adopted_not_started_again() {
    let h = Host::new(&[]);
    h.tick(&h.vm("vm-1"));
    let pid = h.pid("vm-1").expect("pid");
    let disk = h.store.layout().root_disk(&id("vm-1"));
    let inode =
        |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).expect("disk"));
    let disk_before = inode(&disk);
    // The crash: the VMM runs, the record never said the create finished.
    let mut rec = (*h.store.get(&id("vm-1")).expect("readable").expect("record")).clone();
    rec.lifecycle = Lifecycle::from_parts(LifecycleParts {
        boot_id: String::new(),
        ..rec.lifecycle.parts()
    });
    h.store.save(&rec).expect("save");
    let h = h.restart();

    h.tick(&h.vm("vm-1"));

    let row = h.row("vm-1");
    assert_eq!(
        (row.power, row.phase),
        (Some(PowerState::Running), Some(Phase::Ready))
    );
    assert_eq!(h.pid("vm-1"), Some(pid), "the same VMM, no second one");
    assert_eq!(processes_on(&h.store.layout().root_disk(&id("vm-1"))), 1);
    assert_eq!(inode(&disk), disk_before, "its disk was not replaced");
    assert_eq!(
        h.store
            .get(&id("vm-1"))
            .expect("r")
            .expect("r")
            .lifecycle
            .create_attempts(),
        1
    );
}
