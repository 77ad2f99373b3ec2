//! The static binary under a real s6-svscan, with the service dir shipped in
//! contrib/s6: it becomes ready (s6-svwait -U), and a stop is clean.
//!
//! Needs `make static` and Debian's s6. Without them the test says so and
//! passes, except under CI (`CI` set), where `.ci/run` installs both and
//! their absence is a failure.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

fn static_binary() -> PathBuf {
    std::env::var_os("EITRI_STATIC_BIN").map_or_else(
        || {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("target/x86_64-unknown-linux-musl/release/eitri-agent")
        },
        PathBuf::from,
    )
}

fn missing_prerequisite() -> Option<String> {
    if !static_binary().is_file() {
        return Some(format!(
            "{} is not built (make static)",
            static_binary().display()
        ));
    }
    let have = |tool: &str| {
        Command::new(tool)
            .arg("-h")
            .stderr(Stdio::null())
            .stdout(Stdio::null())
            .status()
            .is_ok()
    };
    [
        "s6-svscan",
        "s6-svwait",
        "s6-svc",
        "s6-svstat",
        "s6-envdir",
        "s6-log",
    ]
    .iter()
    .find(|t| !have(t))
    .map(|t| format!("{t} is not installed (apt-get install s6)"))
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
        let _ = Command::new("s6-svscanctl").arg("-t").arg(&self.1).status();
        if self.0.wait().is_err() {
            let _ = self.0.kill();
        }
    }
}

fn s6(tool: &str, args: &[&str], service: &Path) -> std::process::Output {
    Command::new(tool)
        .args(args)
        .arg(service)
        .output()
        .expect(tool)
}

#[test]
fn static_binary_runs_under_s6_and_stops_cleanly() {
    if let Some(why) = missing_prerequisite() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must provide it: {why}"
        );
        println!("SKIPPED: {why}");
        return;
    }
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
    // An empty env file sets the variable empty: no guest networking, so no
    // bridge or firewall table on the test machine's host.
    std::fs::write(env.join("EITRI_UNDERLAY_BRIDGE"), "").expect("env");
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
        Command::new("s6-svscan")
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
    let report_written = dir.path().join("state/report.json").is_file();
    let down = s6("s6-svc", &["-wD", "-d", "-T", "20000"], &service);
    let status = String::from_utf8_lossy(&s6("s6-svstat", &[], &service).stdout).into_owned();
    drop(scanner);
    let log = std::fs::read_to_string(log_dir.join("current")).unwrap_or_default();

    assert!(ready.status.success(), "not ready: {ready:?}");
    assert!(report_written, "readiness came after the first report");
    assert!(down.status.success(), "did not stop: {down:?}");
    assert!(
        status.starts_with("down") && status.contains("exitcode 0"),
        "{status}"
    );
    assert!(log.contains("starting") && log.contains("stopped"), "{log}");
}
