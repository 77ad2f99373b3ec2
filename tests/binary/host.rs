//! One agent on its host: the state dir's lock and claim, the epoch a
//! stopped agent holds, signals and readiness, and what nobody else may
//! read of its state.

use super::*;

#[test]
fn status_lists_the_hosts_claims_and_whose_they_are() {
    let host = tempfile::tempdir().expect("tempdir");
    let registry = host.path().join("agents").display().to_string();
    let start = |name: &str| {
        let dir = host.path().join(name);
        std::fs::create_dir_all(&dir).expect("dir");
        desired(&dir, ONE_VOLUME);
        let agent = Agent::start(&dir, &["--agents-dir", &registry]);
        agent.wait_report(name, |_| true);
        agent
    };
    let mine = start("mine");
    let mut stopped = start("stopped");
    assert!(stopped.stop(Signal::SIGTERM).success());
    let mut gone = start("gone");
    assert!(gone.stop(Signal::SIGTERM).success());
    std::fs::remove_dir_all(host.path().join("gone")).expect("its state dir gone");

    let out = eitri(&["status", "--state-dir", &mine.state.display().to_string()]);

    let text = String::from_utf8_lossy(&out.stdout);
    let line_of = |name: &str| {
        text.lines()
            .find(|l| l.contains(&format!("/{name}/state ")))
            .unwrap_or_default()
            .to_owned()
    };
    let pid = mine.child.as_ref().map(Child::id).expect("its pid");
    assert!(
        line_of("mine").contains(&format!("this one, running, pid {pid} (eitri-agent)")),
        "{text}"
    );
    assert!(line_of("stopped").contains("not running"), "{text}");
    assert!(line_of("gone").contains("state dir gone"), "{text}");
}

#[test]
fn epoch_moves_a_stopped_agents_fence() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);
    let mut agent = Agent::start(dir.path(), &[]);
    agent.wait_report("first report", |_| true);
    assert!(agent.stop(Signal::SIGTERM).success());
    let state = agent.state.display().to_string();

    let set = eitri(&["epoch", "--state-dir", &state, "--set", "4294967296"]);
    let shown = eitri(&["epoch", "--state-dir", &state]);

    assert!(
        set.status.success(),
        "{}",
        String::from_utf8_lossy(&set.stderr)
    );
    let said = String::from_utf8_lossy(&shown.stdout);
    assert!(said.contains("the fence is at epoch 4294967296"), "{said}");
    let epoch = std::fs::read_to_string(agent.state.join("epoch")).expect("epoch");
    assert_eq!(epoch.trim(), "4294967296");
}

#[test]
fn epoch_is_refused_while_the_agent_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_report("first report", |_| true);

    let out = eitri(&[
        "epoch",
        "--state-dir",
        &agent.state.display().to_string(),
        "--set",
        "1",
    ]);

    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("in use by another eitri-agent"), "{stderr}");
}

/// A second agent started on `state` while the first runs, to its end
/// (it waits for the lock a while, then gives up).
fn second_agent_on(state: &Path) -> std::process::Output {
    Command::new(BIN)
        .args(["run", "--desired", "/dev/null", "--state-dir"])
        .arg(state)
        .env_clear()
        .output()
        .expect("second agent")
}

#[test]
fn a_second_agent_on_the_same_state_dir_fails_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);
    let first = Agent::start(dir.path(), &[]);
    first.wait_report("first report", |_| true);

    let second = second_agent_on(&first.state);

    let stderr = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(1));
    assert!(
        stderr.contains(&first.state.display().to_string()),
        "{stderr}"
    );
    assert!(stderr.contains("in use by another eitri-agent"), "{stderr}");
}

#[test]
fn a_second_agent_names_the_process_that_holds_the_lock() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);
    let first = Agent::start(dir.path(), &[]);
    first.wait_report("first report", |_| true);
    let first_pid = first.child.as_ref().map(Child::id).expect("first pid");

    let second = second_agent_on(&first.state);

    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(
        stderr.contains(&format!("held by pid {first_pid} (eitri-agent)")),
        "{stderr}"
    );
}

#[test]
fn each_signal_is_logged_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);
    let mut agent = Agent::start(dir.path(), &[]);
    agent.wait_report("first report", |_| true);
    nix::sys::signal::kill(agent.pid(), Signal::SIGHUP).expect("hup");
    wait_for("the reload", || agent.log_text().contains("reloading"));

    agent.stop(Signal::SIGTERM);

    let log = agent.log_text();
    let lines = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    assert_eq!(lines("signal 1: Reload"), 1, "{log}");
    assert_eq!(lines("signal 15: Shutdown"), 1, "{log}");
}

#[test]
fn sigterm_exits_0() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);
    let mut agent = Agent::start(dir.path(), &[]);
    agent.wait_report("first report", |_| true);

    let status = agent.stop(Signal::SIGTERM);

    assert_eq!(status.code(), Some(0), "{}", agent.log_text());
    assert!(agent.log_text().contains("stopped"));
}

#[test]
fn notify_fd_gets_exactly_one_newline_after_the_first_report() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);
    // Inheritable on purpose: the agent must make it close-on-exec itself.
    let (read_end, write_end) = nix::unistd::pipe().expect("pipe");
    let fd = write_end.as_raw_fd().to_string();
    let agent = Agent::start(dir.path(), &["--notify-fd", &fd]);
    drop(write_end);

    let mut got = Vec::new();
    std::fs::File::from(read_end)
        .read_to_end(&mut got)
        .expect("read until the agent closes it");

    assert_eq!(got, b"\n");
    assert!(agent.report().is_some(), "written before readiness");
}

#[test]
fn systemds_notify_socket_is_told_ready_once_after_the_first_report() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);
    let path = dir.path().join("notify");
    let socket = std::os::unix::net::UnixDatagram::bind(&path).expect("notify socket");
    socket.set_read_timeout(Some(PATIENCE)).expect("timeout");
    let notify = path.display().to_string();

    let agent = Agent::start_with_env(dir.path(), "100ms", &[], &[("NOTIFY_SOCKET", &notify)]);
    let mut got = [0u8; 256];
    let n = socket.recv(&mut got).expect("READY=1 within the patience");
    let report_first = agent.report().is_some();
    socket
        .set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    let again = socket.recv(&mut [0u8; 256]);

    let said = String::from_utf8_lossy(&got[..n]);
    assert!(said.starts_with("READY=1\n"), "{said:?}");
    assert!(
        said.contains(&format!("MAINPID={}", agent.pid())),
        "{said:?}"
    );
    assert!(report_first, "written before readiness");
    assert!(again.is_err(), "said once");
}

/// A SIGTERM that arrives before the agent's handlers exist, made
/// deterministic: the child blocks it and raises it before exec, so the
/// agent starts with it pending, as if a supervisor had sent it in the
/// agent's first instants. It must be an orderly stop (exit 0), not death
/// by the signal, and not a signal left blocked for ever.
#[test]
fn a_sigterm_pending_at_start_is_an_orderly_stop() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);
    let mut cmd = Command::new(BIN);
    cmd.args(["run", "--desired"])
        .arg(dir.path().join("desired.json"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args(["--underlay-bridge=", "--userfaultfd-device="])
        .args(["--tap-prefix", "etbin", "--run-dir"])
        .arg(dir.path().join("run"))
        .arg("--agents-dir")
        .arg(dir.path().join("agents"))
        .env_clear()
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: runs in the forked child before exec, calling only
    // async-signal-safe functions (sigprocmask, kill).
    unsafe {
        cmd.pre_exec(|| {
            let mut set = nix::sys::signal::SigSet::empty();
            set.add(Signal::SIGTERM);
            set.thread_block()?;
            kill(nix::unistd::getpid(), Signal::SIGTERM)?;
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("agent");

    let until = Instant::now() + PATIENCE;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("the agent never acted on the pending SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(10));
    };

    assert_eq!((status.code(), status.signal()), (Some(0), None));
}

#[test]
fn a_token_file_others_can_read_stops_the_start_naming_the_fix() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").expect("token");
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).expect("chmod");

    let out = Command::new(BIN)
        .args([
            "run",
            "--control-plane",
            "http://127.0.0.1:9",
            "--state-dir",
        ])
        .arg(dir.path().join("state"))
        .arg("--token-file")
        .arg(&token)
        .env_clear()
        .output()
        .expect("agent");

    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("chmod 600 {}", token.display())),
        "{stderr}"
    );
}

/// Runs `program args` as nobody (uid and gid 65534, no other groups).
fn as_nobody(program: &str, args: &[&str]) -> Output {
    use std::os::unix::process::CommandExt;
    Command::new(program)
        .args(args)
        .uid(65534)
        .gid(65534)
        .env_clear()
        .output()
        .expect("run as nobody")
}

/// Every file and directory under `root`, as root sees them.
fn tree(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("list").flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path.clone());
            }
            out.push(path);
        }
    }
    out
}

/// A temp dir others may enter, so only the state dir's own modes stand
/// between a local user and its contents.
fn open_tempdir() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    dir
}

#[test]
fn as_nobody_nothing_under_the_state_dir_can_be_read_listed_or_locked() {
    let dir = open_tempdir();
    desired(
        dir.path(),
        r##"{"vms":[{"vm_id":"web-1","name":"web-1","image_url":"http://127.0.0.1:9/a.raw","image_sha256":"00000000000000000000000000000000000000000000000000000000000000aa","vcpus":1,"mem_mb":128,"disk_gb":1,"power_state":"running","cloud_init":"#cloud-config\npassword: hunter2\n"}],"volumes":[{"volume_id":"data-1","size_gb":1}]}"##,
    );
    let mut agent = Agent::start(dir.path(), &[]);
    agent.wait_report("the VM and the volume", |r| {
        !r["report"]["vms"].as_array().is_none_or(Vec::is_empty) && volumes(r) == ["data-1"]
    });
    agent.stop(Signal::SIGTERM);
    let state = agent.state.clone();
    let entries = tree(&state);

    let readable: Vec<&PathBuf> = entries
        .iter()
        .filter(|p| p.is_file())
        .filter(|p| {
            as_nobody("cat", &[&p.display().to_string()])
                .status
                .success()
        })
        .collect();
    let listable: Vec<&PathBuf> = std::iter::once(&state)
        .chain(entries.iter().filter(|p| p.is_dir()))
        .filter(|p| {
            as_nobody("ls", &[&p.display().to_string()])
                .status
                .success()
        })
        .collect();
    let lock = state.join("lock").display().to_string();
    let locked = as_nobody("flock", &["--shared", "--nonblock", &lock, "true"]);

    assert!(entries.len() >= 6, "a populated state dir: {entries:?}");
    assert!(readable.is_empty(), "nobody read {readable:?}");
    assert!(listable.is_empty(), "nobody listed {listable:?}");
    assert!(!locked.status.success(), "nobody took the lock");
}

#[test]
fn a_state_dir_an_older_agent_left_open_is_made_private_at_start() {
    use std::os::unix::fs::PermissionsExt;
    let dir = open_tempdir();
    let state = dir.path().join("state");
    std::fs::create_dir_all(state.join("vms")).expect("dirs");
    std::fs::write(state.join("epoch"), b"3").expect("epoch");
    for (path, mode) in [
        (&state, 0o755),
        (&state.join("vms"), 0o755),
        (&state.join("epoch"), 0o644),
    ] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
    desired(dir.path(), ONE_VOLUME);
    let mut agent = Agent::start(dir.path(), &[]);
    agent.wait_report("the volume", |r| volumes(r) == ["data-1"]);
    agent.stop(Signal::SIGTERM);

    let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
    assert_eq!(mode(&state), 0o711);
    assert_eq!(mode(&state.join("vms")), 0o711);
    assert_eq!(mode(&state.join("epoch")), 0o600);
    assert_eq!(mode(&state.join("volumes/data-1")), 0o600);
    assert_eq!(mode(&state.join("report.json")), 0o600);
}

#[test]
fn two_agents_on_one_host_claim_disjoint_vmm_ids_and_cgroup_roots() {
    let host = tempfile::tempdir().expect("tempdir");
    let (one, two) = (host.path().join("one"), host.path().join("two"));
    for dir in [&one, &two] {
        std::fs::create_dir_all(dir).expect("dir");
        desired(dir, ONE_VOLUME);
    }
    let registry = host.path().join("agents").display().to_string();

    let a = Agent::start(&one, &["--agents-dir", &registry]);
    let b = Agent::start(&two, &["--agents-dir", &registry]);
    a.wait_report("the first agent", |r| volumes(r).len() == 1);
    b.wait_report("the second agent", |r| volumes(r).len() == 1);

    let (a_first, a_count, a_root) = claim_of(&a.state);
    let (b_first, b_count, b_root) = claim_of(&b.state);
    assert!(
        a_first + a_count <= b_first || b_first + b_count <= a_first,
        "{a_first}:{a_count} and {b_first}:{b_count}"
    );
    assert_ne!(a_root, b_root);
}

#[test]
fn a_second_agent_given_the_first_agents_ids_stops_naming_the_first() {
    let host = tempfile::tempdir().expect("tempdir");
    let (one, two) = (host.path().join("one"), host.path().join("two"));
    for dir in [&one, &two] {
        std::fs::create_dir_all(dir).expect("dir");
        desired(dir, ONE_VOLUME);
    }
    let registry = host.path().join("agents").display().to_string();
    let a = Agent::start(&one, &["--agents-dir", &registry]);
    a.wait_report("the first agent", |r| volumes(r).len() == 1);
    let (first, count, _) = claim_of(&a.state);

    let mut b = Agent::start(
        &two,
        &[
            "--agents-dir",
            &registry,
            "--vmm-ids",
            &format!("{first}:{count}"),
        ],
    );

    let status = b.child.take().expect("child").wait().expect("exit");
    assert_eq!(status.code(), Some(1));
    let log = b.log_text();
    assert!(
        log.contains("overlap") && log.contains(&a.state.display().to_string()),
        "{log}"
    );
}
