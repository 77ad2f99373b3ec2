//! Standalone mode: the desired file read and re-read, each bad entry
//! refused alone, the report, metrics and `status` written from it, and
//! the image cache kept in bounds.

use super::*;

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
                clone_of: None,
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
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains(&format!("removed {unused}")), "{said}");
    assert!(
        said.contains(&format!("kept {used}: VM vm-1 still has a record")),
        "{said}"
    );
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
