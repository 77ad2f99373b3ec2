//! `top` and `status VM`'s usage of a booted VM: what its VMM counted,
//! sampled by the agent, read from the report.

use super::*;

/// A VM whose guest reads its disk at 4 MiB/s, under an agent sampling
/// every 200 ms, until its figures are rates.
fn reading_vm(dir: &Path) -> (Booting, Agent) {
    let boot = Booting::with_knobs(dir, &[("STANDIN_DISK_READ", "4194304")]);
    desired(dir, &format!(r#"{{"vms":[{}]}}"#, boot.vm_json("io-1", "")));
    let agent = boot.start(dir, &["--usage-interval", "200ms"]);
    agent.wait_report("io-1 with rates", |r| {
        detail_of(r, "io-1")["usage"]["disk_read_bps"].as_u64() > Some(0)
    });
    (boot, agent)
}

#[test]
fn top_shows_a_running_vms_disk_reads_as_its_vmm_counted_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_boot, agent) = reading_vm(dir.path());

    let (row, figures) = top_of_io_1(&agent);

    assert!(
        columns(&row).get(4).is_some_and(|c| c.ends_with(" MiB")),
        "4 MiB/s of reads shows in MiB: {row}"
    );
    let read = figures["io-1"]["disk_read_bps"]
        .as_u64()
        .expect("a read rate");
    // What the stand-in's guest reads, give or take its pacing and the
    // sample's window: the figure is its VMM's count, not a guess.
    assert!((2 << 20..8 << 20).contains(&read), "{read} B/s");
}

/// `top --once`'s row of io-1, and `top --json`'s figures.
fn top_of_io_1(agent: &Agent) -> (String, serde_json::Value) {
    let state = agent.state.display().to_string();
    let once = eitri(&["top", "--once", "--state-dir", &state]);
    let json = eitri(&["top", "--json", "--state-dir", &state]);
    assert!(once.status.success(), "{once:?}");
    let text = String::from_utf8_lossy(&once.stdout);
    let row = text
        .lines()
        .find(|l| l.starts_with("io-1 "))
        .unwrap_or_else(|| panic!("no row for io-1: {text}"))
        .to_owned();
    let figures = serde_json::from_slice(&json.stdout).expect("JSON");
    (row, figures)
}

/// A row's cells: they stand two spaces apart (VM, CPU%, MEM, GUEST-MEM,
/// READ/s, ...).
fn columns(row: &str) -> Vec<&str> {
    row.split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect()
}

#[test]
fn top_shows_the_guests_memory_as_its_guest_agent_said_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_boot, agent) = reading_vm(dir.path());

    let (row, figures) = top_of_io_1(&agent);

    // The stand-in's guest agent says 400 of 512 MiB are available.
    assert_eq!(columns(&row).get(3), Some(&"112/512 MiB"), "{row}");
    assert_eq!(
        figures["io-1"]["guest_memory"],
        serde_json::json!({"total_bytes": 512u64 << 20, "available_bytes": 400u64 << 20})
    );
}

#[test]
fn status_of_a_running_vm_has_its_usage_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_boot, agent) = reading_vm(dir.path());

    let out = eitri(&[
        "status",
        "io-1",
        "--state-dir",
        &agent.state.display().to_string(),
    ]);

    let text = String::from_utf8_lossy(&out.stdout);
    let usage = text
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("usage"))
        .unwrap_or_else(|| panic!("no usage line: {text}"));
    assert!(
        usage.contains("% of a core") && usage.contains("resident") && usage.contains("MiB/s read"),
        "{usage}"
    );
}

#[test]
fn top_without_a_running_vm_says_so() {
    let dir = tempfile::tempdir().expect("tempdir");
    desired(dir.path(), r#"{"vms":[]}"#);
    let agent = Agent::start(dir.path(), &[]);
    agent.wait_report("a report", |_| true);

    let out = eitri(&[
        "top",
        "--once",
        "--state-dir",
        &agent.state.display().to_string(),
    ]);

    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "0 running\n");
}
