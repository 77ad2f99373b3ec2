//! What a real guest uses, as the agent samples it (`top`, `status VM`,
//! the report's `usage`), against what the guest measured of itself: a
//! busy loop's share of a core, a `dd`'s bytes written, the bytes a
//! download brought in. The bytes are compared as totals across the
//! activity (the agent's sample before it began against its first sample
//! after it ended), so the comparison does not hang on where a sample's
//! window falls; the CPU as a rate, from samples whose second lies inside
//! the loop (the totals would count the ssh logins around it too).

use std::process::Command;

use super::*;

/// How often the agent samples, here: often, so the samples around an
/// activity are near it.
const EVERY: &str = "1s";

/// The VM's last sample in the report: its time and its totals.
fn sample(lab: &Lab, id: &str) -> (u64, Value) {
    let usage = &lab.details(id)["usage"];
    (
        usage["sampled_at_ms"].as_u64().unwrap_or(0),
        usage["totals"].clone(),
    )
}

/// Waits for a sample taken after `after_ms` (Unix ms); its totals.
fn sample_after(lab: &Lab, id: &str, after_ms: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (at, totals) = sample(lab, id);
        if at > after_ms && !totals.is_null() {
            return totals;
        }
        assert!(Instant::now() < deadline, "no sample after {after_ms}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn now_ms() -> u64 {
    eitri_agent::human::unix_ms(std::time::SystemTime::now())
}

/// The growth of `key` between two samples' totals.
fn grew(before: &Value, after: &Value, key: &str) -> f64 {
    after[key]
        .as_u64()
        .unwrap_or(0)
        .saturating_sub(before[key].as_u64().unwrap_or(0)) as f64
}

fn within_a_fifth(agent: f64, guest: f64) -> bool {
    guest > 0.0 && (agent - guest).abs() <= 0.2 * guest
}

/// Runs `command` in the guest between two of the agent's samples: the
/// totals before and after, and what the command printed.
fn around(
    lab: &Lab,
    id: &str,
    ip: &str,
    command: &str,
    stdin: Option<&str>,
) -> (Value, Value, String) {
    let before = sample_after(lab, id, now_ms());
    let out = lab.ssh_with(USER, ip, command, &[], stdin);
    assert!(
        out.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after = sample_after(lab, id, now_ms());
    (
        before,
        after,
        String::from_utf8_lossy(&out.stdout).trim().to_owned(),
    )
}

#[test]
fn what_top_shows_of_a_guest_is_what_the_guest_measured_itself() {
    let mut lab = lab!("what_top_shows_of_a_guest_is_what_the_guest_measured_itself");
    lab.start(&["--usage-interval", EVERY]);
    let (row, _) = lab.boot(&[lab.vm("use-1")], "use-1");
    let ip = address(&row);

    // A busy loop for 12 s, in the background; the guest's own share of
    // its CPUs busy over it (all but idle and iowait of /proc/stat), in %
    // of one core. The agent's CPU figure is a rate over its last second:
    // three samples from inside the loop.
    let script = r#"stat() { awk '/^cpu / {print $2+$3+$4+$7+$8+$9, $2+$3+$4+$5+$6+$7+$8+$9}' /proc/stat; }
set -- $(stat); a=$1; s=$2
timeout 12 sh -c 'while :; do :; done'
set -- $(stat); echo $(( ($1 - a) * 100 * $(nproc) / ($2 - s) )) > /tmp/busy
"#;
    lab.guest(
        USER,
        &ip,
        &format!("cat > /tmp/busy.sh <<'EOF'\n{script}EOF"),
    );
    let busy = "nohup sh /tmp/busy.sh >/dev/null 2>&1 &";
    lab.guest(USER, &ip, busy);
    std::thread::sleep(Duration::from_secs(4));
    let mut agent_cpu: Vec<f64> = (0..3)
        .map(|_| {
            sample_after(&lab, "use-1", now_ms());
            lab.details("use-1")["usage"]["cpu_millis"]
                .as_u64()
                .map_or(0.0, |m| m as f64 / 10.0)
        })
        .collect();
    agent_cpu.sort_by(f64::total_cmp);
    std::thread::sleep(Duration::from_secs(8));
    let guest_cpu: f64 = lab
        .guest(USER, &ip, "cat /tmp/busy")
        .parse()
        .expect("the guest's busy %");
    // 64 MiB written past the page cache, dd's own count of it.
    let (disk_before, disk_after, written) = around(
        &lab,
        "use-1",
        &ip,
        "dd if=/dev/zero of=/var/tmp/usage.bin bs=1M count=64 oflag=direct conv=fsync 2>&1 | awk '/bytes/ {print $1}'; rm -f /var/tmp/usage.bin",
        None,
    );
    // 32 MiB downloaded into the guest (sent down its ssh session), as the
    // guest counted it.
    let download = "x".repeat(32 << 20);
    let (net_before, net_after, received) = around(&lab, "use-1", &ip, "wc -c", Some(&download));
    let top = Command::new(env!("CARGO_BIN_EXE_eitri-agent"))
        .args(["top", "--once", "--state-dir"])
        .arg(lab.state())
        .output()
        .expect("eitri-agent top");
    println!("{}", String::from_utf8_lossy(&top.stdout));
    println!("{}", lab.events("use-1"));

    let agent_cpu = agent_cpu[1];
    let guest_written: f64 = written.parse().expect("dd's bytes");
    let agent_written = grew(&disk_before, &disk_after, "disk_write_bytes");
    let guest_received: f64 = received.parse().expect("wc's bytes");
    let agent_received = grew(&net_before, &net_after, "net_rx_bytes");
    println!(
        "timing: cpu guest {guest_cpu:.0}% agent {agent_cpu:.1}% of a core; disk written guest {guest_written:.0} agent {agent_written:.0}; received guest {guest_received:.0} agent {agent_received:.0}"
    );
    assert!(top.status.success() && String::from_utf8_lossy(&top.stdout).contains("use-1"));
    assert!(
        within_a_fifth(agent_cpu, guest_cpu),
        "CPU: agent {agent_cpu}%, guest {guest_cpu}%"
    );
    assert!(
        within_a_fifth(agent_written, guest_written),
        "disk: agent {agent_written}, guest {guest_written}"
    );
    assert!(
        within_a_fifth(agent_received, guest_received),
        "network: agent {agent_received}, guest {guest_received}"
    );
}

#[test]
fn top_shows_the_memory_a_real_guest_says_it_has() {
    let mut lab = lab!("top_shows_the_memory_a_real_guest_says_it_has");
    let Some(ip) = booted_with_guest_agent(&mut lab, "mem-1", &["--usage-interval", EVERY]) else {
        return;
    };

    // The agent asks the guest agent for its status at least every 30 s.
    let (row, _) = lab.wait_row("mem-1", "the guest's memory", SOON, |row| {
        row["guest_memory_total_kib"].as_u64() > Some(0)
    });
    let guest_total: u64 = lab
        .guest(USER, &ip, "awk '/^MemTotal:/ {print $2}' /proc/meminfo")
        .parse()
        .expect("the guest's MemTotal");
    let top = Command::new(env!("CARGO_BIN_EXE_eitri-agent"))
        .args(["top", "--once", "--state-dir"])
        .arg(lab.state())
        .output()
        .expect("eitri-agent top");
    let page = String::from_utf8_lossy(&top.stdout).into_owned();
    println!("{page}");

    let reported = row["guest_memory_total_kib"].as_u64().unwrap_or(0);
    let available = row["guest_memory_available_kib"].as_u64().unwrap_or(0);
    println!(
        "timing: guest MemTotal {guest_total} KiB, reported {reported} KiB, {available} KiB available"
    );
    assert_eq!(reported, guest_total, "{row}");
    assert!(available > 0 && available < reported, "{row}");
    let cell = page
        .lines()
        .find(|l| l.starts_with("mem-1 "))
        .and_then(|l| l.split("  ").map(str::trim).find(|c| c.contains('/')))
        .unwrap_or_else(|| panic!("no GUEST-MEM cell: {page}"));
    assert!(
        cell.ends_with(&format!("/{} MiB", guest_total / 1024)),
        "{cell} against MemTotal {guest_total} KiB"
    );
}
