//! The binary's words: `--help` and each verb's, `--version`, a flag or
//! value it does not take, and `check`'s account of what the host lacks.

use super::*;

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
        "config", "check", "status", "logs", "events", "top", "images", "release", "epoch",
        "keygen", "sign", "host-key",
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
fn events_prints_every_vms_events_in_time_order_with_their_type_and_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (vm, text) in [
        (
            "web-1",
            "2026-12-06T10:00:01.000Z INFO  hypervisor started (pid 7)\n2026-12-06T10:00:05.000Z WARN  unhealthy: its probe (tcp 22) failed 3 times\n",
        ),
        (
            "web-2",
            "2026-12-06T10:00:03.000Z INFO  cloned from base: restored and made its own 480 ms after its restore began\n",
        ),
    ] {
        let vm_dir = dir.path().join("vms").join(vm);
        std::fs::create_dir_all(&vm_dir).expect("vm dir");
        std::fs::write(vm_dir.join("events.log"), text).expect("events");
    }
    let state_dir = dir.path().display().to_string();

    let all = eitri(&["events", "--state-dir", &state_dir]);
    let one = eitri(&["events", "web-2", "--state-dir", &state_dir]);

    let lines = |out: &std::process::Output| {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| l.split_whitespace().take(4).collect::<Vec<_>>().join(" "))
            .collect::<Vec<_>>()
    };
    assert!(all.status.success(), "{all:?}");
    assert_eq!(
        lines(&all),
        [
            "2026-12-06T10:00:01.000Z Normal Started web-1",
            "2026-12-06T10:00:03.000Z Normal Cloned web-2",
            "2026-12-06T10:00:05.000Z Warning Unhealthy web-1",
        ]
    );
    assert_eq!(
        lines(&one),
        ["2026-12-06T10:00:03.000Z Normal Cloned web-2"]
    );
}

#[test]
fn events_of_a_vm_not_on_the_host_says_so() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join("vms")).expect("vms");

    let out = eitri(&[
        "events",
        "gone-1",
        "--state-dir",
        &dir.path().display().to_string(),
    ]);

    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("VM gone-1 is not on this host"),
        "{out:?}"
    );
}

#[test]
fn no_command_exits_2_naming_the_daemons() {
    let out = eitri(&[]);

    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("no command given (the daemon is `eitri-agent run`)"),
        "{out:?}"
    );
}

#[test]
fn a_verbs_own_flags_show_no_default_line() {
    let out = eitri(&["logs", "--help"]);

    let text = String::from_utf8_lossy(&out.stdout);
    // The state dir is a setting (its default shown); --follow is not.
    assert_eq!(text.matches("[none]").count(), 0, "{text}");
    assert!(
        text.contains("  --follow                   keep printing what is added\n"),
        "{text}"
    );
}

#[test]
fn release_beside_a_running_agent_says_to_stop_it_first() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    // Holding the state dir's lock as its agent does.
    let _agent = eitri_agent::state::Store::open(&state).expect("the lock");

    let out = eitri(&["release", "--state-dir", &state.display().to_string()]);

    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains(": stop it first; release ends the claim"),
        "{said}"
    );
    assert!(!said.contains("choose another --state-dir"), "{said}");
}

/// `config`'s line for `flag`: its value and where it came from.
fn config_line(state_dir: &std::path::Path, flag: &str) -> (String, String) {
    let out = eitri(&["config", "--state-dir", &state_dir.display().to_string()]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(flag))
        .unwrap_or_default()
        .to_owned();
    let mut words = line.split_whitespace().skip(1);
    let value = words.next().unwrap_or_default().to_owned();
    (value, words.collect::<Vec<_>>().join(" "))
}

#[test]
fn config_shows_the_ids_and_cgroup_root_a_new_state_dir_would_claim() {
    let dir = tempfile::tempdir().expect("tempdir");

    let (ids, from) = config_line(dir.path(), "vmm-ids");
    let (root, _) = config_line(dir.path(), "cgroup-root");

    assert_ne!(ids, "1900000000:65536", "the default state dir's");
    assert!(from.starts_with("derived"), "{from}");
    assert!(root.starts_with("eitri-"), "{root}");
}

#[test]
fn config_shows_a_state_dirs_recorded_claim() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join("jail")).expect("jail");
    let claim = serde_json::json!({"state_dir": dir.path(), "first_id": 1_900_131_072u32,
        "id_count": 65_536, "cgroup_root": "eitri-2"});
    std::fs::write(dir.path().join("jail/claim.json"), claim.to_string()).expect("claim");

    assert_eq!(
        config_line(dir.path(), "vmm-ids"),
        ("1900131072:65536".to_owned(), "claim".to_owned())
    );
    assert_eq!(config_line(dir.path(), "cgroup-root").0, "eitri-2");
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
fn check_refuses_a_hypervisor_below_the_floor_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let old = dir.path().join("cloud-hypervisor");
    std::fs::write(&old, "#!/bin/sh\necho 'cloud-hypervisor v52.0.0'\n").expect("old");
    std::fs::set_permissions(&old, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");

    let out = eitri(&[
        "check",
        "--desired",
        "/d.json",
        "--state-dir",
        &dir.path().join("state").display().to_string(),
        "--hypervisor",
        &old.display().to_string(),
        "--underlay-bridge=",
    ]);

    let table = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{table}");
    assert!(
        table.lines().any(|l| l.starts_with("FAIL")
            && l.contains("hypervisor")
            && l.contains("v52.0.0")
            && l.contains("v53 or later")),
        "{table}"
    );
}

#[test]
fn check_fails_a_claim_another_agent_holds_naming_the_setting() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let (theirs, registry) = (dir.path().join("theirs"), dir.path().join("agents"));
    std::fs::create_dir_all(&theirs).expect("their state dir");
    std::fs::create_dir_all(&registry).expect("registry");
    std::fs::set_permissions(&registry, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let record = serde_json::json!({
        "state_dir": theirs, "first_id": 300_000_000u32, "id_count": 65536,
        "cgroup_root": "theirs",
    });
    std::fs::write(registry.join("theirs.json"), record.to_string()).expect("record");

    let out = eitri(&[
        "check",
        "--desired",
        "/d.json",
        "--state-dir",
        &dir.path().join("mine").display().to_string(),
        "--agents-dir",
        &registry.display().to_string(),
        "--vmm-ids",
        "300000000:65536",
        "--underlay-bridge=",
    ]);

    let table = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{table}");
    assert!(
        table.lines().any(|l| l.starts_with("FAIL")
            && l.contains("claim")
            && l.contains("--vmm-ids")
            && l.contains(&theirs.display().to_string())),
        "{table}"
    );
}
