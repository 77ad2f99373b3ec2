//! The real binary: flags, the lock, signals, readiness, standalone mode and
//! `status`. Each agent runs in standalone mode in a temp dir, pointed at a
//! hypervisor that does not exist, so VMs report why they cannot start;
//! volumes are real files. Where a test needs VMs that run, the agent boots
//! the stand-in hypervisor, jailed as on a host (`Booting`).

// Each concern a module of this crate: the binary's words, one agent on
// its host, standalone mode, VMs the agent boots, the README's promises,
// signed desired state against a fake control plane, and the static binary
// under s6.
#[cfg(target_os = "linux")]
mod booted;
mod cli;
mod host;
mod readme;
mod s6;
mod signed;
mod standalone;
mod systemd;

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

/// The report's row of `id`; null when there is none.
fn row_of(report: &serde_json::Value, id: &str) -> serde_json::Value {
    report["report"]["vms"]
        .as_array()
        .and_then(|v| v.iter().find(|r| r["vm_id"] == id))
        .cloned()
        .unwrap_or_default()
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
