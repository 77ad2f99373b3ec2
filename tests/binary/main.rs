//! The real binary: flags, the lock, signals, readiness, standalone mode and
//! `status`. Each agent runs in standalone mode in a temp dir, pointed at a
//! hypervisor that does not exist, so VMs report why they cannot start;
//! volumes are real files. Where a test needs VMs that run, the agent boots
//! the stand-in hypervisor, jailed as on a host (`Booting`).

// The real binary's other faces, each a module of this crate: signed
// desired state against a fake control plane, and the static binary
// under s6.
mod s6;
mod signed;

use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const BIN: &str = env!("CARGO_BIN_EXE_eitri-agent");
/// A bound for a test to fail on, not a measurement.
const PATIENCE: Duration = Duration::from_secs(15);

fn eitri(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_clear()
        .output()
        .expect("run eitri-agent")
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let until = Instant::now() + PATIENCE;
    while !done() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running agent; killed if the test ends without stopping it.
struct Agent {
    child: Option<Child>,
    state: PathBuf,
    log: PathBuf,
}

impl Agent {
    fn start(dir: &Path, extra: &[&str]) -> Agent {
        Agent::start_ticking(dir, "100ms", extra)
    }

    fn start_ticking(dir: &Path, tick: &str, extra: &[&str]) -> Agent {
        Agent::start_with_env(dir, tick, extra, &[])
    }

    /// As `start_ticking`, with `env` its only environment (beside a
    /// `PATH` a networked test gives it).
    fn start_with_env(dir: &Path, tick: &str, extra: &[&str], env: &[(&str, &str)]) -> Agent {
        let state = dir.join("state");
        let log = dir.join("agent.log");
        let desired = dir.join("desired.json");
        let mut args = vec![
            "run".to_string(),
            "--state-dir".into(),
            state.display().to_string(),
            "--desired".into(),
            desired.display().to_string(),
            "--tick".into(),
            tick.into(),
            "--shutdown-grace".into(),
            "5s".into(),
            "--run-dir".into(),
            dir.join("run").display().to_string(),
        ];
        let given = |flag: &str| extra.iter().any(|a| a.starts_with(flag));
        let networkless = !given("--underlay-bridge");
        let agents = dir.join("agents").display().to_string();
        // What a test does not name: test-only tap names (the start-up tap
        // sweep must never touch a real host's links); no bridge or firewall
        // table on the test machine's host (a test that gives a bridge made
        // a network namespace of its own for it); a hypervisor that does not
        // exist (VMs report why they cannot start); the host-wide registry
        // of agents' claims kept in the test.
        let defaults = [
            ("--tap-prefix", "etbin"),
            ("--underlay-bridge=", ""),
            ("--hypervisor", "/nonexistent/cloud-hypervisor"),
            ("--agents-dir", agents.as_str()),
            // The host's /dev/userfaultfd would get an ACL entry for the
            // test's claim, which nothing takes back once its dir is gone.
            ("--userfaultfd-device=", ""),
        ];
        for (flag, value) in defaults {
            if !given(flag.trim_end_matches('=')) {
                args.push(flag.into());
                if !value.is_empty() {
                    args.push(value.into());
                }
            }
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut command = Command::new(BIN);
        command.args(&args).env_clear().envs(env.iter().copied());
        // A test that gives the agent a bridge (in its own network
        // namespace) lets it find ip and nft.
        if let Some(path) = std::env::var_os("PATH").filter(|_| !networkless) {
            command.env("PATH", path);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn agent");
        Agent {
            child: Some(child),
            state,
            log,
        }
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(self.child.as_ref().expect("running").id() as i32)
    }

    fn report(&self) -> Option<serde_json::Value> {
        let text = std::fs::read(self.state.join("report.json")).ok()?;
        serde_json::from_slice(&text).ok()
    }

    /// Waits until the report passes `pred`; on timing out, fails with
    /// the last report and the agent's log.
    fn wait_report(
        &self,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let until = Instant::now() + PATIENCE;
        loop {
            let report = self.report();
            match report {
                Some(r) if pred(&r) => return r,
                _ if Instant::now() > until => panic!(
                    "timed out waiting for {what}; the last report: {}\nthe agent's log:\n{}",
                    report.unwrap_or_default(),
                    self.log_text()
                ),
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn stop(&mut self, signal: Signal) -> ExitStatus {
        kill(self.pid(), signal).expect("signal");
        let mut child = self.child.take().expect("running");
        let until = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                return status;
            }
            if Instant::now() > until {
                let _ = child.kill();
                panic!("agent did not exit after {signal}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn desired(dir: &Path, json: &str) {
    let path = dir.join("desired.json");
    let temp = dir.join(".desired.tmp");
    std::fs::write(&temp, json).expect("write desired");
    std::fs::rename(temp, path).expect("rename desired");
}

const ONE_VOLUME: &str = r#"{"volumes":[{"volume_id":"data-1","size_gb":1}]}"#;
const TWO_VOLUMES: &str =
    r#"{"volumes":[{"volume_id":"data-1","size_gb":1},{"volume_id":"data-2","size_gb":1}]}"#;

fn volumes(report: &serde_json::Value) -> Vec<String> {
    report["report"]["volumes"]
        .as_array()
        .map(|v| {
            v.iter()
                .filter_map(|v| v["volume_id"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn help_lists_every_flag_of_run_by_section() {
    let out = eitri(&["--help"]);

    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    let state = text.find("State: ").expect("a State section");
    let reporting = text.find("Reporting: ").expect("a Reporting section");
    let in_state = &text[state..reporting];
    let in_reporting = &text[reporting..];
    assert!(in_state.contains("\n  --state-dir "), "{text}");
    assert!(in_reporting.contains("\n  --notify-fd "), "{text}");
}

#[test]
fn every_verbs_help_is_its_own() {
    for verb in [
        "config", "check", "status", "logs", "images", "release", "epoch", "keygen", "sign",
        "host-key",
    ] {
        let out = eitri(&[verb, "--help"]);

        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{verb}: {out:?}");
        assert!(
            text.starts_with(&format!("usage: eitri-agent {verb} ")),
            "{verb}: {text}"
        );
    }
}

#[test]
fn run_help_exits_0_with_runs_flags() {
    let out = eitri(&["run", "--help"]);

    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text.contains("Flags of `run`") && text.contains("--notify-fd") && text.contains("--tick"),
        "{text}"
    );
}

#[test]
fn run_help_all_gives_each_flags_default_environment_variable_and_file_key() {
    let out = eitri(&["run", "--help-all"]);

    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    let tick = text.find("--tick ").expect("--tick");
    let rest = &text[tick..];
    let entry = &rest[..rest.find("\n  --").unwrap_or(rest.len())];
    assert!(
        entry.contains("[5s]")
            && entry.contains("$EITRI_TICK")
            && entry.contains("file: reconcile.tick"),
        "{entry}"
    );
}

#[test]
fn status_help_exits_0_with_its_flags_even_beside_others() {
    let out = eitri(&["status", "--json", "--help"]);

    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(text.starts_with("usage: eitri-agent status"), "{text}");
    assert!(
        text.contains("--json") && text.contains("--watch") && text.contains("--state-dir"),
        "{text}"
    );
}

#[test]
fn logs_help_exits_0_with_its_flags_and_needs_no_vm() {
    let out = eitri(&["logs", "--help"]);

    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(text.starts_with("usage: eitri-agent logs VM"), "{text}");
    assert!(
        text.contains("--lines") && text.contains("--follow") && text.contains("--hypervisor"),
        "{text}"
    );
}

#[test]
fn version_prints_the_release() {
    let out = eitri(&["--version"]);

    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("eitri-agent "));
}

#[test]
fn bad_flag_value_exits_2_naming_the_flag() {
    let out = eitri(&["run", "--desired", "/nonexistent", "--tick", "soon"]);

    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--tick"),
        "{out:?}"
    );
}

#[test]
fn check_on_a_host_missing_its_pieces_fails_naming_each_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state").display().to_string();
    let kvm = dir.path().join("no-kvm").display().to_string();

    let out = eitri(&[
        "check",
        "--desired",
        "/d.json",
        "--state-dir",
        &state,
        "--hypervisor",
        "/nonexistent/cloud-hypervisor",
        "--kvm-device",
        &kvm,
        "--underlay-bridge=",
    ]);

    assert_eq!(out.status.code(), Some(1));
    let table = String::from_utf8_lossy(&out.stdout);
    let failed: Vec<&str> = table.lines().filter(|l| l.starts_with("FAIL")).collect();
    for what in ["hypervisor", "boot file", "kvm"] {
        assert!(
            failed.iter().any(|l| l.contains(what)),
            "{what} not failed:\n{table}"
        );
    }
    assert!(table.contains("install cloud-hypervisor"), "{table}");
    assert!(
        !dir.path().join("state").exists(),
        "a check changes nothing"
    );
}

#[test]
fn check_on_a_host_with_all_it_needs_exits_0() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hypervisor = dir.path().join("cloud-hypervisor");
    eitri_agent::testkit::standin_hypervisor(
        Path::new(env!("CARGO_BIN_EXE_eitri-standin-hypervisor")),
        &hypervisor,
        &[],
    );
    let kernel = dir.path().join("vmlinux");
    std::fs::write(&kernel, b"a kernel").expect("kernel");
    let (kvm, uffd) = (dir.path().join("kvm"), dir.path().join("userfaultfd"));
    std::fs::write(&kvm, b"").expect("kvm");
    std::fs::write(&uffd, b"").expect("userfaultfd");
    let path = |p: &Path| p.display().to_string();

    let out = eitri(&[
        "check",
        "--desired",
        "/d.json",
        "--state-dir",
        &path(&dir.path().join("state")),
        "--hypervisor",
        &path(&hypervisor),
        "--kernel",
        &path(&kernel),
        "--kvm-device",
        &path(&kvm),
        "--userfaultfd-device",
        &path(&uffd),
        "--image-root",
        &path(dir.path()),
        "--underlay-bridge=",
        // Whatever the machine running the test lacks of confinement
        // warns instead.
        "--allow-without",
        "jail,cgroups,landlock",
    ]);

    let table = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{table}");
    assert!(!table.contains("FAIL"), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("ok") && l.contains("hypervisor") && l.contains("v53")),
        "{table}"
    );
}

#[test]
fn an_agent_started_on_a_host_missing_pieces_logs_each_and_notes_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), r#"{"vms":[]}"#);

    let agent = Agent::start(dir.path(), &[]);
    let report = agent.wait_report("a report", |_| true);

    let log = agent.log_text();
    for what in ["host check: hypervisor", "host check: boot file"] {
        assert!(
            log.lines().any(|l| l.contains("ERROR") && l.contains(what)),
            "{what}:\n{log}"
        );
    }
    let notes = report["notes"].to_string();
    assert!(notes.contains("at start, host check: boot file"), "{notes}");
}

#[test]
fn a_mistyped_eitri_log_refuses_the_start_naming_the_levels() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), r#"{"vms":[]}"#);

    let out = Command::new(BIN)
        .args(["run", "--desired"])
        .arg(dir.path().join("desired.json"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env_clear()
        .env("EITRI_LOG", "verbose")
        .output()
        .expect("run");

    assert_eq!(out.status.code(), Some(2));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("\"verbose\" is not a log level")
            && said.contains("off, error, warn, info, debug, trace"),
        "{said}"
    );
    assert!(!dir.path().join("state").exists(), "nothing was started");
}

#[test]
fn unknown_flag_exits_2() {
    let out = eitri(&["run", "--turbo"]);

    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--turbo"));
}

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

#[test]
fn standalone_writes_report_json_and_status_prints_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(
        dir.path(),
        r#"{"vms":[{"vm_id":"web-1","name":"web-1","image_url":"http://mirror.test/a.raw","image_sha256":"00000000000000000000000000000000000000000000000000000000000000aa","vcpus":1,"mem_mb":128,"disk_gb":1,"power_state":"running"}],"volumes":[{"volume_id":"data-1","size_gb":1}]}"#,
    );
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_report("the VM's row", |r| {
        r["report"]["vms"][0]["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("is not an executable file"))
    });

    let table = eitri(&["status", "--state-dir", &agent.state.display().to_string()]);
    let json = eitri(&[
        "status",
        "--json",
        "--state-dir",
        &agent.state.display().to_string(),
    ]);

    let text = String::from_utf8_lossy(&table.stdout);
    assert!(table.status.success(), "{table:?}");
    assert!(
        text.lines().any(|l| l.starts_with("web-1")
            && l.contains("creating")
            && l.contains("waiting for the host to be fixed")),
        "a missing hypervisor is the host's to fix, not a failed spec: {text}"
    );
    assert!(
        text.contains("/nonexistent/cloud-hypervisor is not an executable file"),
        "the reason is shown: {text}"
    );
    assert!(text.contains("data-1 1 GiB ready"), "{text}");
    assert!(text.contains("note: guest networking is off"), "{text}");
    assert!(
        text.contains("note: this host cannot run guests until it is fixed: the hypervisor /nonexistent/cloud-hypervisor is not an executable file"),
        "what the host lacks is a host note: {text}"
    );
    let parsed: serde_json::Value =
        serde_json::from_slice(&json.stdout).expect("status --json is JSON");
    assert_eq!(parsed["report"]["vms"][0]["vm_id"], "web-1");
}

#[test]
fn status_without_a_report_says_where_it_looked() {
    let dir = tempfile::tempdir().expect("tempdir");

    let out = eitri(&["status", "--state-dir", &dir.path().display().to_string()]);

    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr.contains("report.json"), "{stderr}");
    assert!(
        stderr.contains("caused by: No such file or directory"),
        "the cause is printed too: {stderr}"
    );
}

#[test]
fn malformed_desired_file_keeps_the_previous_state() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_report("data-1", |r| volumes(r) == ["data-1"]);

    desired(dir.path(), "{\"volumes\": [\n  {\"volume_id\": oops}\n]}");
    let report = agent.wait_report("the parse error", |r| {
        r["contact"]
            .as_str()
            .is_some_and(|c| c.contains("line 2, column"))
    });

    assert_eq!(volumes(&report), ["data-1"]);
    assert!(agent.state.join("volumes/data-1").exists());
    assert!(
        agent.log_text().contains("line 2, column"),
        "{}",
        agent.log_text()
    );
}

#[test]
fn sighup_rereads_the_desired_file_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);
    // A tick so long that only the SIGHUP can explain a re-read.
    let agent = Agent::start_ticking(dir.path(), "1h", &[]);
    agent.wait_report("data-1", |r| volumes(r) == ["data-1"]);
    desired(dir.path(), TWO_VOLUMES);

    kill(agent.pid(), Signal::SIGHUP).expect("sighup");

    agent.wait_report("data-2", |r| volumes(r) == ["data-1", "data-2"]);
}

#[test]
fn images_prune_keeps_every_image_a_vm_names() {
    use eitri_agent::model::{Id, VmSpec};
    use eitri_agent::state::{Record, Store};
    let dir = tempfile::tempdir().expect("tempdir");
    let (used, unused) = ("a".repeat(64), "b".repeat(64));
    {
        let store = Store::open(dir.path()).expect("store");
        store
            .save(&Record::new(VmSpec {
                vm_id: Id::parse("vm-1").expect("id"),
                name: String::new(),
                image_url: "file:///x".into(),
                image_sha256: used.clone(),
                cloud_init: String::new(),
                ssh_authorized_key: String::new(),
                network: String::new(),
                volume_ids: vec![],
                vcpus: 1,
                mem_mb: 128,
                disk_gb: 1,
                limits: Default::default(),
            }))
            .expect("record");
        std::fs::write(store.layout().images().join(&used), b"used").expect("image");
        std::fs::write(store.layout().images().join(&unused), b"unused").expect("image");
    }

    let out = eitri(&[
        "images",
        "prune",
        "--state-dir",
        &dir.path().display().to_string(),
    ]);

    assert!(out.status.success(), "{out:?}");
    assert!(dir.path().join("images").join(&used).exists());
    assert!(!dir.path().join("images").join(&unused).exists());
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("removed {unused}")));
}

#[test]
fn images_prune_runs_beside_a_running_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_report("first report", |_| true);
    let unused = agent.state.join("images").join("c".repeat(64));
    std::fs::write(&unused, b"unused").expect("image");

    let out = eitri(&[
        "images",
        "prune",
        "--state-dir",
        &agent.state.display().to_string(),
    ]);

    assert!(out.status.success(), "{out:?}");
    assert!(!unused.exists());
    desired(dir.path(), TWO_VOLUMES);
    agent.wait_report("data-2, by the agent still running", |r| {
        volumes(r) == ["data-1", "data-2"]
    });
}

#[test]
fn a_desired_file_change_is_acted_on_without_waiting_for_the_tick() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);
    // A tick so long that only the file watch can explain a re-read.
    let agent = Agent::start_ticking(dir.path(), "1h", &[]);
    agent.wait_report("data-1", |r| volumes(r) == ["data-1"]);

    desired(dir.path(), TWO_VOLUMES);

    agent.wait_report("data-2", |r| volumes(r) == ["data-1", "data-2"]);
}

#[test]
fn a_bad_desired_file_is_reported_until_it_is_fixed() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);
    let agent = Agent::start(dir.path(), &[]);
    let first = agent.wait_report("data-1", |r| volumes(r) == ["data-1"]);
    let bad = |r: &serde_json::Value| {
        r["contact"]
            .as_str()
            .is_some_and(|c| c.contains("not a valid snapshot"))
    };

    desired(dir.path(), "{\"volumes\": [}");
    let broken = agent.wait_report("the parse error", bad);
    // Ten ticks later (at 100 ms) it is still said, not replaced by "ok".
    agent.wait_report("a report ten ticks on", |r| {
        r["written_at_unix_ms"].as_u64() > broken["written_at_unix_ms"].as_u64().map(|t| t + 1000)
    });
    let later = agent.report().expect("report");
    desired(dir.path(), TWO_VOLUMES);
    let fixed = agent.wait_report("the fix", |r| r["contact"] == "ok");

    assert_eq!(first["contact"], "ok");
    assert!(bad(&later), "{}", later["contact"]);
    assert_eq!(volumes(&fixed), ["data-1", "data-2"]);
}

#[test]
fn a_bad_entry_refuses_that_entry_only_naming_its_key_and_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(
        dir.path(),
        "{\"volumes\": [{\"volume_id\": \"data-1\", \"size_gb\": 1}],\n \"vms\": [\n  {\"vm_id\": \"web-1\",\n   \"vcpu\": 2}\n]}",
    );

    let agent = Agent::start(dir.path(), &[]);
    let report = agent.wait_report("web-1's row", |r| r["report"]["vms"][0]["vm_id"] == "web-1");

    let error = report["report"]["vms"][0]["last_error"]
        .as_str()
        .unwrap_or_default();
    assert_eq!(report["report"]["vms"][0]["phase"], "failed");
    assert!(
        error.contains("\"vcpu\" at line 4") && error.contains("unknown field"),
        "{error}"
    );
    assert_eq!(
        volumes(&report),
        ["data-1"],
        "the rest of the file is acted on"
    );
    assert_eq!(report["contact"], "ok");
}

/// A running VM's entry of a desired file, `extra` (",\"key\":value…")
/// added to it.
fn vm_json(id: &str, extra: &str) -> String {
    format!(
        r#"{{"vm_id":"{id}","name":"{id}","image_url":"http://mirror.test/a.raw","image_sha256":"{}","vcpus":1,"mem_mb":128,"disk_gb":1,"power_state":"running"{extra}}}"#,
        "0".repeat(62) + "aa"
    )
}

/// The report's row of `id`; null when there is none.
fn row_of(report: &serde_json::Value, id: &str) -> serde_json::Value {
    report["report"]["vms"]
        .as_array()
        .and_then(|v| v.iter().find(|r| r["vm_id"] == id))
        .cloned()
        .unwrap_or_default()
}

#[test]
fn a_bad_egress_range_refuses_its_vm_alone_naming_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(
        dir.path(),
        &format!(
            r#"{{"vms":[{},{}]}}"#,
            vm_json("bad-1", r#","egress_deny":["10.0.0.0/33"]"#),
            vm_json("good-1", r#","egress_deny":["10.0.0.0/8"]"#)
        ),
    );

    let agent = Agent::start(dir.path(), &[]);
    let report = agent.wait_report("both rows", |r| {
        r["report"]["vms"].as_array().is_some_and(|v| v.len() == 2)
    });

    let row = |id: &str| row_of(&report, id);
    let bad = row("bad-1");
    let error = bad["last_error"].as_str().unwrap_or_default();
    assert_eq!(bad["phase"], "failed");
    assert!(
        error.contains("egress_deny") && error.contains("/33 is not a prefix length"),
        "{error}"
    );
    assert_eq!(row("good-1")["phase"], "creating");
}

#[test]
fn a_bad_limit_or_probe_refuses_its_vm_alone_naming_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(
        dir.path(),
        &format!(
            r#"{{"vms":[{},{},{}]}}"#,
            vm_json("cpu-1", r#","cpu_max_millis":1001"#),
            vm_json(
                "probe-1",
                r#","readiness":{"tcp_port":22,"serial_contains":"login:"}"#
            ),
            vm_json(
                "good-1",
                r#","cpu_max_millis":500,"readiness":{"tcp_port":22}"#
            )
        ),
    );

    let agent = Agent::start(dir.path(), &[]);
    let report = agent.wait_report("three rows", |r| {
        r["report"]["vms"].as_array().is_some_and(|v| v.len() == 3)
    });

    let row = |id: &str| row_of(&report, id);
    let error = |id: &str| {
        row(id)["last_error"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(row("cpu-1")["phase"], "failed");
    assert!(
        error("cpu-1").contains("invalid cpu_max_millis"),
        "{}",
        error("cpu-1")
    );
    assert_eq!(row("probe-1")["phase"], "failed");
    assert!(
        error("probe-1").contains("invalid readiness"),
        "{}",
        error("probe-1")
    );
    assert_eq!(row("good-1")["phase"], "creating");
}

/// Agents that boot VMs: the stand-in hypervisor jailed as on a Linux host
/// (cgroups, a network namespace of the test's own).
#[cfg(target_os = "linux")]
mod booted {
    use super::*;

    /// What an agent that boots VMs needs beside its temp dir: the stand-in
    /// hypervisor and a kernel file, a KVM device of its own, a base image,
    /// and a cgroup root whose VMMs are ended with the test (they outlive
    /// their agent, by design).
    struct Booting {
        flags: Vec<String>,
        image: String,
        image_sha256: String,
        cgroup_root: String,
    }

    impl Booting {
        fn new(dir: &Path) -> Booting {
            Booting::with_knobs(dir, &[])
        }

        /// As `new`, the stand-in's `knobs` set.
        fn with_knobs(dir: &Path, knobs: &[(&str, &str)]) -> Booting {
            use std::os::unix::fs::PermissionsExt;
            // The jailed VMM must reach its binary and kernel.
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).expect("chmod");
            let hypervisor = dir.join("hypervisor");
            eitri_agent::testkit::standin_hypervisor(
                Path::new(env!("CARGO_BIN_EXE_eitri-standin-hypervisor")),
                &hypervisor,
                knobs,
            );
            let kernel = dir.join("vmlinux");
            std::fs::write(&kernel, b"not really a kernel").expect("kernel");
            let kvm = dir.join("kvm");
            std::fs::write(&kvm, b"").expect("kvm");
            let base = dir.join("base.raw");
            std::fs::write(&base, vec![0x5a; 1 << 20]).expect("base image");
            let cgroup_root = format!("eitri-test-{}-binary", std::process::id());
            let path = |p: &Path| p.display().to_string();
            Booting {
                flags: vec![
                    "--hypervisor".into(),
                    path(&hypervisor),
                    "--kernel".into(),
                    path(&kernel),
                    "--kvm-device".into(),
                    path(&kvm),
                    "--userfaultfd-device=".into(),
                    "--cgroup-root".into(),
                    cgroup_root.clone(),
                    "--image-root".into(),
                    path(dir),
                ],
                image: format!("file://{}", path(&base)),
                image_sha256: eitri_agent::image::sha256_file(&base).expect("hash"),
                cgroup_root,
            }
        }

        /// A desired VM of one vCPU booting the base image, with `extra` keys.
        fn vm_json(&self, id: &str, extra: &str) -> String {
            format!(
                r#"{{"vm_id":"{id}","name":"{id}","image_url":"{}","image_sha256":"{}","vcpus":1,"mem_mb":128,"disk_gb":1,"power_state":"running"{extra}}}"#,
                self.image, self.image_sha256
            )
        }

        fn start(&self, dir: &Path, extra: &[&str]) -> Agent {
            let mut flags: Vec<&str> = self.flags.iter().map(String::as_str).collect();
            flags.extend_from_slice(extra);
            Agent::start(dir, &flags)
        }
    }

    impl Drop for Booting {
        fn drop(&mut self) {
            eitri_agent::testkit::end_cgroup_root(&self.cgroup_root);
        }
    }

    #[test]
    fn a_vm_is_ready_once_its_guest_prints_the_probes_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let boot = Booting::new(dir.path());
        // The stand-in prints "eitri standin: booting" as it starts.
        desired(
            dir.path(),
            &format!(
                r#"{{"vms":[{}]}}"#,
                boot.vm_json(
                    "up-1",
                    r#","readiness":{"serial_contains":"standin: booting","period_s":1}"#
                )
            ),
        );

        let agent = boot.start(dir.path(), &[]);
        let report = agent.wait_report("up-1 ready", |r| row_of(r, "up-1")["phase"] == "ready");

        let row = row_of(&report, "up-1");
        assert_eq!(row["power_state"], "running", "{row}");
        let readiness = row["readiness"].as_str().unwrap_or_default();
        assert!(readiness.contains("answered"), "{row}");
    }

    #[test]
    fn a_vm_whose_guest_never_prints_the_probes_line_stays_creating_and_says_why() {
        let dir = tempfile::tempdir().expect("tempdir");
        let boot = Booting::new(dir.path());
        desired(
            dir.path(),
            &format!(
                r#"{{"vms":[{}]}}"#,
                boot.vm_json(
                    "mute-1",
                    r#","readiness":{"serial_contains":"never printed","period_s":1,"grace_s":60}"#
                )
            ),
        );

        let agent = boot.start(dir.path(), &[]);
        let report = agent.wait_report("mute-1 waiting for its guest", |r| {
            row_of(r, "mute-1")["status_detail"]
                .as_str()
                .is_some_and(|d| d.contains("waiting for the guest"))
        });

        let row = row_of(&report, "mute-1");
        assert_eq!(row["phase"], "creating", "{row}");
        let detail = row["status_detail"].as_str().unwrap_or_default();
        assert!(
            detail.contains("never printed") && detail.contains("of 60 s"),
            "{row}"
        );
    }

    #[test]
    fn the_hosts_per_vcpu_cpu_cap_flag_is_a_booted_vms_cgroup_quota() {
        let dir = tempfile::tempdir().expect("tempdir");
        let boot = Booting::new(dir.path());
        desired(
            dir.path(),
            &format!(r#"{{"vms":[{}]}}"#, boot.vm_json("cap-1", r#","vcpus":2"#)),
        );

        let agent = boot.start(dir.path(), &["--vm-cpu-max-millis-per-vcpu", "250"]);
        let report = agent.wait_report("cap-1 ready", |r| row_of(r, "cap-1")["phase"] == "ready");

        let row = row_of(&report, "cap-1");
        assert!(
            row["limits"]
                .as_str()
                .is_some_and(|l| l.contains("cpu 0.5")),
            "{row}"
        );
        // Half a CPU: 50 ms of every 100 ms period.
        assert_eq!(quota(&boot, "cap-1"), Some(50_000));
    }

    #[test]
    fn a_limit_changed_on_a_running_vm_waits_saying_so_and_is_taken_at_its_next_boot() {
        let dir = tempfile::tempdir().expect("tempdir");
        let boot = Booting::new(dir.path());
        let wanted = |millis: u32, power: &str| {
            let vm = boot
                .vm_json("cap-1", &format!(r#","cpu_max_millis":{millis}"#))
                .replace(
                    r#""power_state":"running""#,
                    &format!(r#""power_state":"{power}""#),
                );
            format!(r#"{{"vms":[{vm}]}}"#)
        };
        desired(dir.path(), &wanted(500, "running"));
        let agent = boot.start(dir.path(), &[]);
        agent.wait_report("cap-1 ready", |r| row_of(r, "cap-1")["phase"] == "ready");
        let pid = vmm_pid(&boot, "cap-1");

        desired(dir.path(), &wanted(250, "running"));
        let waiting = agent.wait_report("the change said to wait", |r| {
            row_of(r, "cap-1")["status_detail"]
                .as_str()
                .is_some_and(|d| d.contains("limits change at the next boot"))
        });
        let (quota_while_waiting, pid_while_waiting) =
            (quota(&boot, "cap-1"), vmm_pid(&boot, "cap-1"));
        desired(dir.path(), &wanted(250, "stopped"));
        agent.wait_report("cap-1 stopped", |r| {
            row_of(r, "cap-1")["power_state"] == "stopped"
        });
        desired(dir.path(), &wanted(250, "running"));
        let booted = agent.wait_report("cap-1 booted again", |r| {
            let row = row_of(r, "cap-1");
            row["power_state"] == "running" && row["phase"] == "ready"
        });

        assert_eq!(row_of(&waiting, "cap-1")["limits"], "cpu 0.5", "{waiting}");
        assert_eq!(quota_while_waiting, Some(50_000));
        assert_eq!(pid_while_waiting, pid);
        assert_eq!(quota(&boot, "cap-1"), Some(25_000));
        assert_eq!(row_of(&booted, "cap-1")["limits"], "cpu 0.25", "{booted}");
        assert!(
            row_of(&booted, "cap-1")["status_detail"]
                .as_str()
                .is_some_and(|d| !d.contains("limits change"))
        );
    }

    /// An agent over `dir` with guest networking on `bridge`, `subnet` and
    /// taps `prefix…`, its claim recorded in `registry`.
    fn networked(
        dir: &Path,
        registry: &str,
        (bridge, subnet, prefix): (&str, &str, &str),
    ) -> Agent {
        std::fs::create_dir_all(dir).expect("dir");
        desired(dir, ONE_VOLUME);
        Agent::start(
            dir,
            &[
                "--agents-dir",
                registry,
                "--underlay-bridge",
                bridge,
                "--underlay-subnet",
                subnet,
                "--tap-prefix",
                prefix,
            ],
        )
    }

    /// The name of the agent's firewall tables, as its claim records it.
    fn tables_of(agent: &Agent) -> String {
        let text = std::fs::read(agent.state.join("jail/claim.json")).expect("claim");
        let claim: serde_json::Value = serde_json::from_slice(&text).expect("json");
        claim["network"]["table"]
            .as_str()
            .expect("table")
            .to_owned()
    }

    /// What `nft` lists of one of the agent's ip tables ("" when none).
    fn ip_table(name: &str) -> String {
        eitri_agent::testkit::net::nft_table("ip", name).unwrap_or_default()
    }

    #[test]
    fn a_second_agents_start_leaves_the_first_agents_firewall_tables_alone() {
        eitri_agent::testkit::net::private_network();
        let host = tempfile::tempdir().expect("tempdir");
        let registry = host.path().join("agents").display().to_string();
        let a = networked(
            &host.path().join("one"),
            &registry,
            ("etbina", "100.77.0.0/16", "etba"),
        );
        a.wait_report("the first agent", |r| volumes(r).len() == 1);

        let b = networked(
            &host.path().join("two"),
            &registry,
            ("etbinb", "100.78.0.0/16", "etbb"),
        );
        b.wait_report("the second agent", |r| volumes(r).len() == 1);

        let (table_a, table_b) = (tables_of(&a), tables_of(&b));
        assert_ne!(table_a, table_b);
        let (rules_a, rules_b) = (ip_table(&table_a), ip_table(&table_b));
        assert!(
            rules_a.contains("\"etbina\"") && !rules_a.contains("etbinb"),
            "{rules_a}"
        );
        assert!(rules_b.contains("\"etbinb\""), "{rules_b}");
    }

    #[test]
    fn a_released_state_dir_leaves_no_bridge_and_no_firewall_table() {
        eitri_agent::testkit::net::private_network();
        let host = tempfile::tempdir().expect("tempdir");
        let registry = host.path().join("agents").display().to_string();
        let mut agent = networked(
            &host.path().join("one"),
            &registry,
            ("etbinr", "100.77.0.0/16", "etbr"),
        );
        agent.wait_report("the agent", |r| volumes(r).len() == 1);
        let table = tables_of(&agent);
        assert!(agent.stop(Signal::SIGTERM).success());
        assert!(!ip_table(&table).is_empty(), "the agent made its table");

        // As an operator runs it: from a shell, with ip and nft on PATH.
        let out = Command::new(BIN)
            .args(["release", "--state-dir"])
            .arg(&agent.state)
            .args(["--agents-dir", &registry, "--force"])
            .output()
            .expect("release");

        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(ip_table(&table), "", "its ip table is left");
        let bridge = eitri_agent::testkit::tools::tool("ip")
            .args(["link", "show", "dev", "etbinr"])
            .output()
            .expect("ip");
        assert!(!bridge.status.success(), "its bridge is left");
    }

    #[test]
    fn a_second_agent_on_the_first_agents_bridge_stops_naming_the_first() {
        eitri_agent::testkit::net::private_network();
        let host = tempfile::tempdir().expect("tempdir");
        let registry = host.path().join("agents").display().to_string();
        let a = networked(
            &host.path().join("one"),
            &registry,
            ("etbina", "100.77.0.0/16", "etba"),
        );
        a.wait_report("the first agent", |r| volumes(r).len() == 1);
        let rules_before = ip_table(&tables_of(&a));

        let mut b = networked(
            &host.path().join("two"),
            &registry,
            ("etbina", "100.78.0.0/16", "etbb"),
        );

        let status = b.child.take().expect("child").wait().expect("exit");
        assert_eq!(status.code(), Some(1));
        let log = b.log_text();
        assert!(
            log.contains("bridge etbina")
                && log.contains("--underlay-bridge")
                && log.contains(&a.state.display().to_string()),
            "{log}"
        );
        assert!(rules_before.contains("\"etbina\""), "{rules_before}");
        assert_eq!(ip_table(&tables_of(&a)), rules_before);
    }

    #[test]
    fn a_spec_error_in_a_running_vms_entry_keeps_it_running_and_says_so() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (boot, agent) = one_vm_ready(dir.path(), "run-1");
        let pid = vmm_pid(&boot, "run-1");

        let bad = boot.vm_json("run-1", r#","no_such_key":1"#);
        desired(dir.path(), &format!(r#"{{"vms":[{bad}]}}"#));
        let report = agent.wait_report("the entry refused", |r| {
            row_of(r, "run-1")["spec_rejected"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
        });

        let row = row_of(&report, "run-1");
        assert_eq!(row["phase"], "ready", "{row}");
        assert_eq!(row["power_state"], "running", "{row}");
        assert!(
            row["spec_rejected"]
                .as_str()
                .is_some_and(|s| s.contains("no_such_key")),
            "{row}"
        );
        assert_eq!(vmm_pid(&boot, "run-1"), pid, "its VMM was touched");
        let status = eitri(&["status", "--state-dir", &agent.state.display().to_string()]);
        let header = String::from_utf8_lossy(&status.stdout);
        assert!(
            header.contains("1 spec rejected") && !header.contains("failed"),
            "{header}"
        );
    }

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

    /// `vm`'s cgroup file `name` under `boot`'s root.
    fn cgroup_file(boot: &Booting, vm: &str, name: &str) -> Option<String> {
        eitri_agent::testkit::cgroup_file(&boot.cgroup_root, &eitri_agent::testkit::id(vm), name)
    }

    /// `vm`'s CPU quota, in µs per period (cgroup v1 or v2).
    fn quota(boot: &Booting, vm: &str) -> Option<u64> {
        cgroup_file(boot, vm, "cpu.cfs_quota_us")
            .or_else(|| cgroup_file(boot, vm, "cpu.max"))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    }

    /// The pid of the VMM in `vm`'s cgroup under `boot`'s root.
    fn vmm_pid(boot: &Booting, vm: &str) -> Option<u32> {
        cgroup_file(boot, vm, "cgroup.procs")?
            .lines()
            .next()?
            .parse()
            .ok()
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

    /// An agent over `dir` whose one desired VM, `vm`, is ready.
    fn one_vm_ready(dir: &Path, vm: &str) -> (Booting, Agent) {
        let boot = Booting::new(dir);
        desired(dir, &format!(r#"{{"vms":[{}]}}"#, boot.vm_json(vm, "")));
        let agent = boot.start(dir, &[]);
        agent.wait_report(&format!("{vm} ready"), |r| {
            row_of(r, vm)["phase"] == "ready"
        });
        (boot, agent)
    }

    #[test]
    fn status_of_a_vm_agrees_with_its_hypervisor_after_boot_suspend_and_resume() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (boot, agent) = one_vm_ready(dir.path(), "nap-1");
        let state = agent.state.display().to_string();
        let show = || {
            let out = eitri(&["status", "nap-1", "--state-dir", &state]);
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        let field = |text: &str, key: &str| {
            text.lines()
                .find_map(|l| l.trim_start().strip_prefix(key).map(str::trim))
                .unwrap_or_default()
                .to_owned()
        };
        let at = |power: &str| {
            let vm = boot.vm_json("nap-1", "").replace(
                r#""power_state":"running""#,
                &format!(r#""power_state":"{power}""#),
            );
            desired(dir.path(), &format!(r#"{{"vms":[{vm}]}}"#));
        };
        let booted_pid = vmm_pid(&boot, "nap-1").expect("its VMM");
        let booted = show();

        at("suspended");
        agent.wait_report("nap-1 suspended", |r| {
            row_of(r, "nap-1")["power_state"] == "suspended"
        });
        let suspended = show();
        let suspended_vmm = vmm_pid(&boot, "nap-1");
        at("running");
        agent.wait_report("nap-1 resumed", |r| {
            row_of(r, "nap-1")["power_state"] == "running" && detail_of(r, "nap-1")["pid"].is_u64()
        });
        let resumed = show();
        let resumed_pid = vmm_pid(&boot, "nap-1").expect("its new VMM");

        // Booted: the pid /proc and the cgroup have, up as long as running.
        let hypervisor = field(&booted, "hypervisor ");
        assert!(
            hypervisor.starts_with(&format!("pid {booted_pid}, up ")),
            "{booted}"
        );
        let up = hypervisor.rsplit("up ").next().unwrap_or_default();
        assert_eq!(
            field(&booted, "power "),
            format!("running for {up}"),
            "{booted}"
        );
        assert_ne!(field(&booted, "boot id "), "-", "{booted}");
        // Suspended: no hypervisor, a snapshot.
        assert!(
            field(&suspended, "power ").starts_with("suspended for "),
            "{suspended}"
        );
        assert_eq!(
            field(&suspended, "hypervisor "),
            "not running",
            "{suspended}"
        );
        assert!(
            field(&suspended, "snapshot ").contains("on disk"),
            "{suspended}"
        );
        assert_eq!(suspended_vmm, None, "no hypervisor runs it");
        // Resumed: the new hypervisor, none of the old.
        assert_ne!(resumed_pid, booted_pid);
        assert!(
            field(&resumed, "hypervisor ").starts_with(&format!("pid {resumed_pid}, up ")),
            "{resumed}"
        );
        assert!(
            field(&resumed, "power ").starts_with("running for "),
            "{resumed}"
        );
    }

    /// `vm`'s detail in `report` (what `status VM` shows).
    fn detail_of(report: &serde_json::Value, vm: &str) -> serde_json::Value {
        report["details"][vm].clone()
    }

    #[test]
    fn a_running_vms_durations_go_on_across_an_agent_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let boot = Booting::new(dir.path());
        desired(
            dir.path(),
            &format!(r#"{{"vms":[{}]}}"#, boot.vm_json("on-1", "")),
        );
        let mut agent = boot.start(dir.path(), &[]);
        let before = agent.wait_report("on-1's hypervisor seen", |r| {
            detail_of(r, "on-1")["pid"].is_u64()
        });
        assert!(agent.stop(Signal::SIGTERM).success());
        std::thread::sleep(Duration::from_millis(1100));

        let agent = boot.start(dir.path(), &[]);
        let after = agent.wait_report("a report of the second agent", |r| {
            r["agent_pid"] == agent.pid().as_raw() && detail_of(r, "on-1")["pid"].is_u64()
        });

        let (before, after) = (detail_of(&before, "on-1"), detail_of(&after, "on-1"));
        assert_eq!(after["pid"], before["pid"], "the same hypervisor");
        assert_eq!(after["pid_since_ms"], before["pid_since_ms"], "{after}");
        assert_eq!(after["power_since_ms"], before["pid_since_ms"], "{after}");
        assert_eq!(after["phase_since_ms"], before["phase_since_ms"], "{after}");
        assert_eq!(after["created_at_ms"], before["created_at_ms"], "{after}");
    }

    #[test]
    fn a_hypervisor_that_died_counts_as_a_restart_in_status() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (boot, agent) = one_vm_ready(dir.path(), "die-1");
        let pid = vmm_pid(&boot, "die-1").expect("its VMM");

        kill(Pid::from_raw(pid as i32), Signal::SIGKILL).expect("kill");
        let report = agent.wait_report("die-1 booted again", |r| {
            detail_of(r, "die-1")["restarts"] == 1 && row_of(r, "die-1")["phase"] == "ready"
        });

        assert_ne!(vmm_pid(&boot, "die-1"), Some(pid));
        let detail = eitri(&[
            "status",
            "die-1",
            "--state-dir",
            &agent.state.display().to_string(),
        ]);
        let detail = String::from_utf8_lossy(&detail.stdout);
        let events = detail.split("\n  events ").nth(1).unwrap_or_default();
        assert!(
            events.contains("WARN  lost (") && events.contains("INFO  booted"),
            "{detail}"
        );
        let status = eitri(&["status", "--state-dir", &agent.state.display().to_string()]);
        let text = String::from_utf8_lossy(&status.stdout);
        let header = text
            .lines()
            .find(|l| l.starts_with("VM "))
            .unwrap_or_default();
        let row = text
            .lines()
            .find(|l| l.starts_with("die-1"))
            .unwrap_or_default();
        let column = header.find("RESTARTS").expect("a RESTARTS column");
        assert_eq!(row.get(column..column + 1), Some("1"), "{text}");
        assert!(report["agent_pid"].is_u64());
    }

    #[test]
    fn a_vm_asleep_when_the_agent_is_killed_9_wakes_for_a_client_under_the_next_agent() {
        eitri_agent::testkit::net::private_network();
        let dir = tempfile::tempdir().expect("tempdir");
        let boot = Booting::with_knobs(dir.path(), &[("STANDIN_GUEST_TCP", "1")]);
        let vm = boot
            .vm_json(
                "nap-1",
                r#","wake_on_traffic":true,"published_ports":[{"host_port":30080,"guest_port":8080}]"#,
            )
            .replace(r#""power_state":"running""#, r#""power_state":"suspended""#);
        desired(dir.path(), &format!(r#"{{"vms":[{vm}]}}"#));
        let network = [
            "--underlay-bridge",
            "etbinbr0",
            "--publish-ports",
            "30000-30999",
        ];
        let asleep = |r: &serde_json::Value| row_of(r, "nap-1")["asleep"] == true;
        let mut first = boot.start(dir.path(), &network);
        first.wait_report("nap-1 asleep", asleep);
        // A client on a host beyond this one.
        let ns = format!("etbn{:x}", std::process::id() & 0xffff);
        let _remote = eitri_agent::testkit::net::remote_host(&ns, "etbremote");

        first.stop(Signal::SIGKILL);
        let second = boot.start(dir.path(), &network);
        let pid = second.pid().as_raw();
        second.wait_report("nap-1 asleep under the next agent", |r| {
            r["agent_pid"] == pid && asleep(r)
        });
        let connected = eitri_agent::testkit::net::within(&ns, || {
            std::net::TcpStream::connect_timeout(
                &(std::net::Ipv4Addr::new(198, 51, 100, 1), 30080).into(),
                Duration::from_secs(10),
            )
        });

        let stream = connected.expect("the client's connect is answered");
        assert_eq!(
            eitri_agent::testkit::net::retransmits(&stream).expect("TCP_INFO"),
            0,
            "its first SYN was delivered"
        );
        let report = second.wait_report("nap-1 woken", |r| {
            row_of(r, "nap-1")["last_wake"]
                .as_str()
                .is_some_and(|w| w.contains("tcp from 198.51.100.2:"))
        });
        assert_eq!(row_of(&report, "nap-1")["power_state"], "running");
    }

    #[test]
    fn an_adopted_vm_whose_tap_is_gone_is_not_ready_and_says_why() {
        eitri_agent::testkit::net::private_network();
        let dir = tempfile::tempdir().expect("tempdir");
        let boot = Booting::new(dir.path());
        desired(
            dir.path(),
            &format!(r#"{{"vms":[{}]}}"#, boot.vm_json("cut-1", "")),
        );
        let network = ["--underlay-bridge", "etbinbr0"];
        let mut first = boot.start(dir.path(), &network);
        first.wait_report("cut-1 ready", |r| row_of(r, "cut-1")["phase"] == "ready");
        first.stop(Signal::SIGKILL);
        let taps = eitri_agent::testkit::tools::tool("ip")
            .args(["-o", "link", "show", "master", "etbinbr0"])
            .output()
            .expect("ip link");
        let tap = String::from_utf8_lossy(&taps.stdout)
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|name| name.split('@').next().unwrap_or(name).to_owned())
            .find(|name| name.starts_with("etbin"))
            .expect("the VM's tap on the bridge");
        let deleted = eitri_agent::testkit::tools::tool("ip")
            .args(["link", "del", &tap])
            .status()
            .expect("ip link del");
        assert!(deleted.success());

        let second = boot.start(dir.path(), &network);
        let report = second.wait_report("cut-1 said to be cut off", |r| {
            row_of(r, "cut-1")["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("not served"))
        });

        let row = row_of(&report, "cut-1");
        assert_eq!(row["phase"], "failed", "{row}");
        assert_eq!(row["power_state"], "running", "{row}");
        assert!(
            row["last_error"].as_str().is_some_and(|e| e.contains(&tap)),
            "{row}"
        );
    }

    #[test]
    fn a_running_vms_egress_change_is_held_by_the_binary_with_its_vmm_untouched() {
        eitri_agent::testkit::net::private_network();
        let dir = tempfile::tempdir().expect("tempdir");
        let boot = Booting::new(dir.path());
        let wanted = |deny: &str| {
            let extra = format!(r#","egress_deny":["{deny}"]"#);
            format!(r#"{{"vms":[{}]}}"#, boot.vm_json("web-1", &extra))
        };
        desired(dir.path(), &wanted("203.0.113.10/32"));
        let agent = boot.start(dir.path(), &["--underlay-bridge", "etbinbr0"]);
        agent.wait_report("web-1 ready", |r| {
            let row = row_of(r, "web-1");
            row["phase"] == "ready" && row["egress"] == "deny 203.0.113.10/32"
        });
        let (pid, before) = (
            vmm_pid(&boot, "web-1"),
            eitri_agent::testkit::net::nft_set_elements("vm_deny"),
        );

        desired(dir.path(), &wanted("203.0.113.20/32"));
        agent.wait_report("the new list held", |r| {
            row_of(r, "web-1")["egress"] == "deny 203.0.113.20/32"
        });

        let after = eitri_agent::testkit::net::nft_set_elements("vm_deny");
        assert!(before.contains("203.0.113.10"), "{before}");
        assert!(
            after.contains("203.0.113.20") && !after.contains("203.0.113.10"),
            "{after}"
        );
        assert!(pid.is_some());
        assert_eq!(vmm_pid(&boot, "web-1"), pid);
    }
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

const ONE_VM: &str = r#"{"vms":[{"vm_id":"web-1","name":"web-1","image_url":"http://mirror.test/a.raw","image_sha256":"00000000000000000000000000000000000000000000000000000000000000aa","vcpus":1,"mem_mb":128,"disk_gb":1,"power_state":"running"}]}"#;

#[test]
fn the_agent_writes_its_metrics_file_every_tick() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VM);
    let metrics = dir.path().join("eitri.prom");
    let agent = Agent::start(
        dir.path(),
        &["--metrics-file", &metrics.display().to_string()],
    );
    agent.wait_report("the VM's row", |r| {
        r["report"]["vms"][0]["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("is not an executable file"))
    });
    let ticks = |text: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix("eitri_tick_duration_seconds_count "))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let first = ticks(&std::fs::read_to_string(&metrics).unwrap_or_default());

    wait_for("more ticks in the metrics file", || {
        ticks(&std::fs::read_to_string(&metrics).unwrap_or_default()) > first + 2
    });

    let text = std::fs::read_to_string(&metrics).expect("metrics");
    assert!(
        text.contains("eitri_vms{power=\"stopped\",phase=\"creating\"} 1"),
        "{text}"
    );
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&metrics).expect("meta").permissions(),
    );
    assert_eq!(
        mode & 0o777,
        0o644,
        "a collector running as another user reads it"
    );
}

#[test]
fn status_of_one_vm_shows_its_error_and_how_old_it_is() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VM);
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_report("the VM's row", |r| {
        r["report"]["vms"][0]["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("is not an executable file"))
    });

    let out = eitri(&[
        "status",
        "web-1",
        "--state-dir",
        &agent.state.display().to_string(),
    ]);
    let unknown = eitri(&[
        "status",
        "nope",
        "--state-dir",
        &agent.state.display().to_string(),
    ]);

    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(text.starts_with("VM web-1\n"), "{text}");
    assert!(text.contains("phase      creating for "), "{text}");
    assert!(text.contains("is not an executable file"), "{text}");
    assert!(
        text.contains(" (first ") && text.contains(" ago, last "),
        "{text}"
    );
    assert!(text.contains("hypervisor not running"), "{text}");
    assert_eq!(unknown.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&unknown.stderr).contains("VM nope is not on this host"),
        "{unknown:?}"
    );
}

#[test]
fn status_watch_redraws_every_tick() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VM);
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_report("a report", |_| true);
    // A terminal of its own: --watch redraws only on one.
    let pty = nix::pty::openpty(None, None).expect("a pty");
    let mut watch = Command::new(BIN)
        .args([
            "status",
            "--watch",
            "--state-dir",
            &agent.state.display().to_string(),
        ])
        .env_clear()
        .stdout(Stdio::from(pty.slave))
        .spawn()
        .expect("status --watch");

    // The agent ticks every 100 ms; --watch redraws at its tick (at least
    // 200 ms apart): a second is several redraws.
    std::thread::sleep(Duration::from_secs(1));
    let _ = watch.kill();
    let _ = watch.wait();
    let text = read_available(&pty.master);

    let redraws = text.matches("\u{1b}[H\u{1b}[2J").count();
    assert!(redraws >= 3, "{redraws} redraws");
}

/// What can be read from `fd` now, without waiting for more.
fn read_available(fd: &std::os::fd::OwnedFd) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        let mut poll = [nix::poll::PollFd::new(
            std::os::fd::AsFd::as_fd(fd),
            nix::poll::PollFlags::POLLIN,
        )];
        match nix::poll::poll(&mut poll, nix::poll::PollTimeout::ZERO) {
            Ok(n) if n > 0 => {}
            _ => break,
        }
        match nix::unistd::read(fd, &mut buf) {
            Ok(n) if n > 0 => out.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn status_watch_into_a_pipe_writes_pages_without_terminal_codes() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VM);
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_report("a report", |_| true);
    let mut watch = Command::new(BIN)
        .args([
            "status",
            "--watch",
            "--state-dir",
            &agent.state.display().to_string(),
        ])
        .env_clear()
        .stdout(Stdio::piped())
        .spawn()
        .expect("status --watch");
    let mut stdout = watch.stdout.take().expect("stdout");

    std::thread::sleep(Duration::from_secs(1));
    let _ = watch.kill();
    let _ = watch.wait();
    let mut text = String::new();
    stdout.read_to_string(&mut text).expect("read");

    let pages = text.lines().filter(|l| l.starts_with("host ")).count();
    assert!(pages >= 3, "{pages} pages: {text}");
    assert!(!text.contains('\u{1b}'), "{text:?}");
}

/// A claim file's id range and cgroup root.
fn claim_of(state: &Path) -> (u64, u64, String) {
    let text = std::fs::read(state.join("jail/claim.json")).expect("claim");
    let claim: serde_json::Value = serde_json::from_slice(&text).expect("json");
    (
        claim["first_id"].as_u64().expect("first"),
        claim["id_count"].as_u64().expect("count"),
        claim["cgroup_root"].as_str().expect("root").to_owned(),
    )
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

#[test]
fn over_image_cache_max_the_agent_removes_the_oldest_unused_image() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);
    let images = dir.path().join("state/images");
    std::fs::create_dir_all(&images).expect("images");
    let (old, new) = ("a".repeat(64), "b".repeat(64));
    for (name, age) in [(&old, 7200), (&new, 60)] {
        let path = images.join(name);
        std::fs::write(&path, vec![0u8; 1024]).expect("image");
        std::fs::File::options()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_modified(std::time::SystemTime::now() - Duration::from_secs(age)))
            .expect("mtime");
    }

    let agent = Agent::start(dir.path(), &["--image-cache-max", "1K"]);

    wait_for("the old image to go", || !images.join(&old).exists());
    assert!(images.join(&new).exists());
    assert!(
        agent.log_text().contains("--image-cache-max"),
        "{}",
        agent.log_text()
    );
}

#[test]
fn without_caps_status_says_every_vm_is_admitted() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), ONE_VOLUME);

    let agent = Agent::start(dir.path(), &["--max-vcpus", "64"]);

    let report = agent.wait_report("the first report", |r| volumes(r).len() == 1);
    let notes = report["notes"].to_string();
    assert!(
        notes.contains("no cap on --max-disk-gb") && !notes.contains("--max-vcpus"),
        "{notes}"
    );
}

/// The README's Quick start: the shell block between its markers, as it
/// stands.
#[cfg(target_os = "linux")]
fn quick_start() -> String {
    let readme = include_str!("../../README.md");
    let begin = readme
        .find("<!-- quick-start:begin -->")
        .expect("the README marks its Quick start");
    let end = readme
        .find("<!-- quick-start:end -->")
        .expect("the Quick start's end");
    readme[begin..end]
        .lines()
        .skip_while(|l| !l.starts_with("```sh"))
        .skip(1)
        .take_while(|l| !l.starts_with("```"))
        .map(|l| format!("{l}\n"))
        .collect()
}

#[cfg(target_os = "linux")]
#[test]
fn quick_start_boots_a_vm_to_ready() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).expect("bin");
    std::os::unix::fs::symlink(BIN, bin.join("eitri-agent")).expect("the agent on PATH");
    // The stand-in, or the real parts when they are given.
    let real = ["EITRI_REAL_CH", "EITRI_REAL_KERNEL", "EITRI_REAL_IMAGE"]
        .map(|v| std::env::var(v).ok().filter(|p| !p.is_empty()));
    let (kernel, image, kvm) = match real {
        [Some(ch), Some(kernel), Some(image)] => {
            std::fs::copy(ch, bin.join("cloud-hypervisor")).expect("cloud-hypervisor");
            (kernel.into(), image.into(), PathBuf::from("/dev/kvm"))
        }
        _ => {
            eitri_agent::testkit::standin_hypervisor(
                Path::new(env!("CARGO_BIN_EXE_eitri-standin-hypervisor")),
                &bin.join("cloud-hypervisor"),
                &[],
            );
            let kernel = dir.path().join("vmlinux");
            std::fs::write(&kernel, b"a kernel").expect("kernel");
            let image = dir.path().join("guest.raw");
            std::fs::write(&image, vec![0x5a; 1 << 20]).expect("image");
            let kvm = dir.path().join("kvm");
            std::fs::write(&kvm, b"").expect("kvm");
            (kernel, image, kvm)
        }
    };
    let script = dir.path().join("quick-start.sh");
    std::fs::write(&script, quick_start()).expect("script");
    let cgroup_root = format!("eitri-test-{}-quick", std::process::id());
    // A host of its own for the run: /srv a tmpfs, a network namespace
    // (the agent's bridge and firewall), a pid namespace (whatever the
    // Quick start leaves running ends with it). The agent and its VMMs are
    // stopped, and the state dir's claim released, before it ends.
    let harness = r#"set -e
ip link set lo up
mount -t tmpfs tmpfs /srv
mkdir /srv/eitri
cp "$KERNEL" /srv/eitri/vmlinux
touch /srv/eitri/guest.raw
mount --bind "$IMAGE" /srv/eitri/guest.raw
timeout 120 bash -e "$SCRIPT"
pkill -TERM -f '[e]itri-agent run' || true
while pgrep -f '[e]itri-agent run' > /dev/null; do sleep 0.1; done
pkill -KILL cloud-hyperviso || true
while pgrep cloud-hyperviso > /dev/null; do sleep 0.1; done
eitri-agent release --state-dir /srv/eitri/state --force
"#;
    let path = |p: &Path| p.display().to_string();

    let out = Command::new("unshare")
        .args([
            "--mount",
            "--net",
            "--pid",
            "--fork",
            "--mount-proc",
            "--propagation",
            "private",
            "bash",
            "-c",
            harness,
        ])
        .env_clear()
        .env(
            "PATH",
            format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", path(&bin)),
        )
        .env("KERNEL", path(&kernel))
        .env("IMAGE", path(&image))
        .env("SCRIPT", path(&script))
        // What the Quick start leaves at its defaults, kept off this host.
        .env("EITRI_KVM_DEVICE", path(&kvm))
        .env("EITRI_USERFAULTFD_DEVICE", "")
        .env("EITRI_CGROUP_ROOT", &cgroup_root)
        .env("EITRI_AGENTS_DIR", path(&dir.path().join("agents")))
        .env("EITRI_RUN_DIR", path(&dir.path().join("run")))
        .output()
        .expect("unshare");
    eitri_agent::testkit::end_cgroup_root(&cgroup_root);

    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(!stdout.contains("FAIL"), "{stdout}");
    let row = stdout
        .lines()
        .find(|l| l.starts_with("hello-1 "))
        .unwrap_or_default();
    assert!(
        row.contains(" running ") && row.contains(" ready "),
        "{stdout}"
    );
}

#[test]
fn the_readmes_contents_name_every_section_in_order() {
    let readme = include_str!("../../README.md");
    let mut in_code = false;
    let mut headings = Vec::new();
    for line in readme.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
        } else if !in_code
            && (line.starts_with("## ") || line.starts_with("### "))
            && line != "## Contents"
        {
            headings.push(line.trim_start_matches('#').trim().to_owned());
        }
    }
    let contents: Vec<String> = readme
        .split("## Contents\n")
        .nth(1)
        .unwrap_or_default()
        .lines()
        .take_while(|l| !l.starts_with("## "))
        .filter_map(|l| Some(l.split_once("- [")?.1.split_once("](")?.0.to_owned()))
        .collect();

    assert_eq!(contents, headings);
}
