//! `status` of a booted VM, through boots, suspends, resumes, restarts of
//! the agent and of its hypervisor, and a wake under the next agent.

use super::*;

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
    assert_ne!(field(&booted, "host boot "), "-", "{booted}");
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
        events.contains("Warning  Lost") && events.contains("Normal   Started"),
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
