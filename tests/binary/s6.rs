//! The static binary under a real s6-svscan, with the service dir shipped in
//! contrib/s6: it becomes ready (s6-svwait -U), and a stop is clean.
//!
//! Needs `make static` (which `make test` runs first) and Debian's s6
//! (which `.ci/run` installs); without either it fails, naming what is
//! missing: a test that skips itself is a hole nobody sees in CI.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};

use eitri_agent::testkit::tools::{require, tool};

fn static_binary() -> PathBuf {
    std::env::var_os("EITRI_STATIC_BIN").map_or_else(
        || {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("target/x86_64-unknown-linux-musl/release/eitri-agent")
        },
        PathBuf::from,
    )
}

/// Fails the test, naming it, when a program or the static binary is missing.
fn require_prerequisites() {
    assert!(
        static_binary().is_file(),
        "{} is not built; run make static (make test does)",
        static_binary().display()
    );
    // One call each, not a loop: make programs-check reads these names.
    require("s6-svscan");
    require("s6-svscanctl");
    require("s6-svwait");
    require("s6-svc");
    require("s6-svstat");
    require("s6-envdir");
    require("s6-log");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read contrib") {
        let entry = entry.expect("entry");
        let dest = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &dest);
        } else {
            std::fs::copy(entry.path(), &dest).expect("copy");
        }
    }
}

struct Scanner(Child, PathBuf);

impl Drop for Scanner {
    fn drop(&mut self) {
        let _ = tool("s6-svscanctl").arg("-t").arg(&self.1).status();
        if self.0.wait().is_err() {
            let _ = self.0.kill();
        }
    }
}

fn s6(program: &str, args: &[&str], service: &Path) -> std::process::Output {
    tool(program)
        .args(args)
        .arg(service)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"))
}

#[test]
fn static_binary_runs_under_s6_and_stops_cleanly() {
    require_prerequisites();
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).expect("bin");
    std::fs::copy(static_binary(), bin.join("eitri-agent")).expect("install binary");
    let scan = dir.path().join("scan");
    let service = scan.join("eitri-agent");
    copy_dir(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("contrib/s6/eitri-agent"),
        &service,
    );
    let env = service.join("env");
    std::fs::write(
        env.join("EITRI_STATE_DIR"),
        dir.path().join("state").display().to_string(),
    )
    .expect("env");
    std::fs::write(
        env.join("EITRI_DESIRED"),
        dir.path().join("desired.json").display().to_string(),
    )
    .expect("env");
    std::fs::write(env.join("EITRI_TICK"), "200ms").expect("env");
    std::fs::write(env.join("EITRI_SHUTDOWN_GRACE"), "5s").expect("env");
    std::fs::write(env.join("EITRI_TAP_PREFIX"), "ets6").expect("env");
    std::fs::write(
        env.join("EITRI_AGENTS_DIR"),
        dir.path().join("agents").display().to_string(),
    )
    .expect("env");
    // No guest networking, so no bridge or firewall table on the test
    // machine's host. Not an empty file: s6-envdir unsets the variable
    // for one, and the agent would take its default bridge.
    std::fs::write(env.join("EITRI_UNDERLAY_BRIDGE"), "none").expect("env");
    // A file of the test's own: the host's /dev/userfaultfd would get an
    // ACL entry for this claim, which nothing takes back once it is gone.
    let userfaultfd = dir.path().join("userfaultfd");
    std::fs::write(&userfaultfd, b"").expect("userfaultfd");
    std::fs::write(
        env.join("EITRI_USERFAULTFD_DEVICE"),
        userfaultfd.display().to_string(),
    )
    .expect("env");
    std::fs::write(
        env.join("EITRI_RUN_DIR"),
        dir.path().join("run").display().to_string(),
    )
    .expect("env");
    std::fs::write(
        dir.path().join("desired.json"),
        r#"{"volumes":[{"volume_id":"v1","size_gb":1}]}"#,
    )
    .expect("desired");
    let log_dir = dir.path().join("log");

    let scanner = Scanner(
        tool("s6-svscan")
            .arg(&scan)
            .env_clear()
            .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
            .env("EITRI_LOG_DIR", &log_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("s6-svscan"),
        scan.clone(),
    );
    // s6-svscan starts supervising on its first scan; s6-svwait needs the
    // supervisor's status file to exist.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !service.join("supervise/status").exists() && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let ready = s6("s6-svwait", &["-U", "-t", "20000"], &service);
    let report = std::fs::read_to_string(dir.path().join("state/report.json")).unwrap_or_default();
    let down = s6("s6-svc", &["-wD", "-d", "-T", "20000"], &service);
    let status = String::from_utf8_lossy(&s6("s6-svstat", &[], &service).stdout).into_owned();
    drop(scanner);
    let log = std::fs::read_to_string(log_dir.join("current")).unwrap_or_default();

    assert!(ready.status.success(), "not ready: {ready:?}");
    assert!(!report.is_empty(), "readiness came after the first report");
    assert!(report.contains("guest networking is off"), "{report}");
    assert!(down.status.success(), "did not stop: {down:?}");
    assert!(
        status.starts_with("down") && status.contains("exitcode 0"),
        "{status}"
    );
    assert!(log.contains("starting") && log.contains("stopped"), "{log}");
    // One time per line, the agent's ("2026-12-06T18:32:13.156Z INFO …").
    assert!(
        log.lines().all(|l| {
            let mut words = l.split_whitespace();
            words.next().is_some_and(|t| t.ends_with('Z'))
                && words.next().is_some_and(|level| {
                    ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"].contains(&level)
                })
        }),
        "{log}"
    );
}
