//! Layer 5: a real Linux guest under the real agent. Each test starts the
//! agent binary in standalone mode in a network namespace of its own,
//! gives it a desired VM booting a real kernel and a Debian root
//! filesystem with cloud-init and sshd on a real cloud-hypervisor, and
//! checks one thing from where its tenant or its operator stands: over
//! SSH into the guest, in the agent's report, on the host. Skipped, saying
//! why, unless the environment names the real parts (`make e2e-real`
//! builds them and runs these); each prints the figures it measured as
//! `timing: …` lines.

#![cfg(target_os = "linux")]

#[path = "real_guest/lab.rs"]
mod lab;

use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::time::{Duration, Instant};

use lab::{
    BOOT, Ca, Lab, PROBE_PERIOD_S, SOON, STOP_GRACE_S, Site, USER, address, outside, ready, timing,
};
use serde_json::{Value, json};

/// Opens the lab for the test it is called in, or returns from it.
macro_rules! lab {
    ($test:literal) => {
        match Lab::open($test) {
            Some(lab) => lab,
            None => return,
        }
    };
}

/// User-data that lets root in with the tenant's key too, for the checks
/// only root can make inside the guest (raw sockets, block devices).
const ROOT_LOGIN: &str = "#cloud-config\ndisable_root: false\n";

fn with(mut vm: Value, key: &str, value: Value) -> Value {
    vm[key] = value;
    vm
}

/// Whether a row's `field` is a non-empty string.
fn has(field: &'static str) -> impl Fn(&Value) -> bool {
    move |row| row[field].as_str().is_some_and(|v| !v.is_empty())
}

/// Boots `vm` wanting a host certificate: waits for the host key the agent
/// reports, has `ca` certify it for the VM's id, and boots it with that;
/// its ready row, the reported key and the certificate.
fn boot_certified(lab: &Lab, vm: Value, ca: &Ca) -> (Value, String, String) {
    let id = vm["vm_id"].as_str().unwrap_or_default().to_owned();
    let vm = with(vm, "host_cert_required", json!(true));
    lab.desire(std::slice::from_ref(&vm));
    let (waiting, _) = lab.wait_row(&id, "its host key", SOON, has("ssh_host_pubkey"));
    let reported = waiting["ssh_host_pubkey"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let cert = ca.sign(&reported, &id, true);
    let (row, _) = lab.boot(&[with(vm, "ssh_host_cert", json!(cert.clone()))], &id);
    (row, reported, cert)
}

fn port_22_answers(ip: &str) -> bool {
    let at = SocketAddrV4::new(ip.parse().expect("an address"), 22);
    TcpStream::connect_timeout(&at.into(), Duration::from_secs(1)).is_ok()
}

#[test]
fn a_vm_waits_for_its_host_certificate_and_is_ready_only_once_sshd_answers() {
    let mut lab = lab!("a_vm_waits_for_its_host_certificate_and_is_ready_only_once_sshd_answers");
    let ca = Ca::new(&lab, "host-ca");
    lab.start(&[]);
    let vm = with(lab.vm("cert-1"), "host_cert_required", json!(true));

    lab.desire(std::slice::from_ref(&vm));
    let (waiting, took) = lab.wait_row("cert-1", "its host key", SOON, |r| {
        r["last_error"] == "awaiting host certificate" && r["ssh_host_pubkey"] != ""
    });
    timing("desired -> awaiting host certificate", took);
    assert_eq!(waiting["power_state"], "stopped", "{waiting}");
    let public = waiting["ssh_host_pubkey"].as_str().unwrap_or_default();
    let cert = ca.sign(public, "cert-1", true);
    lab.desire(&[with(vm, "ssh_host_cert", json!(cert))]);
    let (running, _) = lab.wait_row("cert-1", "its hypervisor", BOOT, |r| {
        r["power_state"] == "running"
    });
    let sshd_then = port_22_answers(&address(&running));
    let (report, took) = lab.wait_report("cert-1", "ready", BOOT, ready);
    let row = lab::row_of(&report, "cert-1");

    timing("certificate in desired -> ready", took);
    timing(
        "VMM start -> sshd answers (the probe)",
        lab::since_hypervisor_start(&report, "cert-1"),
    );
    assert!(
        !ready(&running) && !sshd_then,
        "ready before sshd answered: {running}"
    );
    assert_eq!(row["readiness"], "tcp 22 answered", "{row}");
    assert!(port_22_answers(&address(&row)));
}

#[test]
fn the_lease_on_the_guests_nic_is_the_rows_address() {
    let mut lab = lab!("the_lease_on_the_guests_nic_is_the_rows_address");
    lab.start(&[]);
    let (row, _) = lab.boot(&[lab.vm("lease-1")], "lease-1");

    let ip = address(&row);
    let shown = lab.guest(USER, &ip, "ip -4 -o addr show dev eth0");

    // "2: eth0    inet 100.77.4.89/16 metric 1024 brd … scope global dynamic eth0"
    let leased = shown
        .split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .and_then(|cidr| cidr.split('/').next())
        .unwrap_or_default();
    assert_eq!(leased, ip, "{shown}");
    assert!(shown.contains("dynamic"), "not a DHCP lease: {shown}");
}

#[test]
fn the_desired_key_logs_in_as_the_images_user() {
    let mut lab = lab!("the_desired_key_logs_in_as_the_images_user");
    lab.start(&[]);
    let (row, _) = lab.boot(&[lab.vm("key-1")], "key-1");

    let who = lab.guest(USER, &address(&row), "id -un");

    assert_eq!(who, USER);
}

#[test]
fn the_host_key_the_guest_presents_is_the_reported_one_and_its_certificate_verifies() {
    let mut lab =
        lab!("the_host_key_the_guest_presents_is_the_reported_one_and_its_certificate_verifies");
    let (ca, stranger) = (Ca::new(&lab, "host-ca"), Ca::new(&lab, "other-ca"));
    lab.start(&[]);
    let (row, reported, _) = boot_certified(&lab, lab.vm("hk-1"), &ca);
    let ip = address(&row);

    let scanned =
        lab::run(eitri_agent::testkit::tools::tool("ssh-keyscan").args(["-t", "ed25519", &ip]));
    let trusting = |ca: &Ca, name: &str| {
        let known = lab.dir.path().join(name);
        std::fs::write(&known, format!("@cert-authority * {}\n", ca.public())).expect("write");
        lab.ssh_with(
            USER,
            &ip,
            "true",
            &[
                format!("UserKnownHostsFile={}", known.display()),
                "StrictHostKeyChecking=yes".into(),
                // The certificate names the VM, not its address.
                "HostKeyAlias=hk-1".into(),
            ],
            None,
        )
    };
    let with_our_ca = trusting(&ca, "known-ours");
    let with_another_ca = trusting(&stranger, "known-other");

    // "100.77.4.89 ssh-ed25519 AAAA…": the key is the last two words; the
    // reported line has a comment after them.
    let presented: Vec<&str> = scanned.split_whitespace().skip(1).collect();
    let expected: Vec<&str> = reported.split_whitespace().take(2).collect();
    assert_eq!(presented, expected, "scanned {scanned:?}");
    assert!(
        with_our_ca.status.success(),
        "{}",
        String::from_utf8_lossy(&with_our_ca.stderr)
    );
    assert!(!with_another_ca.status.success());
}

#[test]
fn the_host_key_files_in_the_guest_are_the_reported_key() {
    let mut lab = lab!("the_host_key_files_in_the_guest_are_the_reported_key");
    let ca = Ca::new(&lab, "host-ca");
    lab.start(&[]);
    let vm = with(lab.vm("hkf-1"), "cloud_init", json!(ROOT_LOGIN));
    let (row, reported, cert) = boot_certified(&lab, vm, &ca);
    let ip = address(&row);

    let public_file = lab.guest("root", &ip, "cat /etc/ssh/ssh_host_ed25519_key.pub");
    let from_private = lab.guest(
        "root",
        &ip,
        "ssh-keygen -y -f /etc/ssh/ssh_host_ed25519_key",
    );
    let cert_file = lab.guest("root", &ip, "cat /etc/ssh/ssh_host_ed25519_key-cert.pub");

    let key = |line: &str| {
        line.split_whitespace()
            .take(2)
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(key(&public_file), key(&reported));
    assert_eq!(key(&from_private), key(&reported));
    assert_eq!(cert_file, cert);
}

#[test]
fn a_user_certificate_from_the_tenants_ca_logs_in() {
    let mut lab = lab!("a_user_certificate_from_the_tenants_ca_logs_in");
    let ca = Ca::new(&lab, "user-ca");
    lab.start(&[]);
    let mut vm = with(
        lab.vm("uc-1"),
        "ssh_user_ca_authorized_keys",
        json!([ca.public()]),
    );
    vm.as_object_mut()
        .expect("an object")
        .remove("ssh_authorized_key");
    let (row, _) = lab.boot(&[vm], "uc-1");
    let ip = address(&row);
    let cert = lab.key.with_extension("cert");
    std::fs::write(&cert, ca.sign(&lab.public_key(), USER, false)).expect("write the cert");

    let with_cert = lab.ssh_with(
        USER,
        &ip,
        "id -un",
        &[format!("CertificateFile={}", cert.display())],
        None,
    );
    let key_alone = lab.ssh(USER, &ip, "id -un");

    assert!(
        with_cert.status.success(),
        "{}",
        String::from_utf8_lossy(&with_cert.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&with_cert.stdout).trim(), USER);
    assert!(!key_alone.status.success(), "the key alone was let in");
}

#[test]
fn the_guest_has_its_hostname() {
    let mut lab = lab!("the_guest_has_its_hostname");
    lab.start(&[]);
    let vm = with(lab.vm("host-1"), "name", json!("web-7"));
    let (row, _) = lab.boot(&[vm], "host-1");

    let hostname = lab.guest(USER, &address(&row), "hostname");

    assert_eq!(hostname, "web-7");
}

#[test]
fn the_guest_reaches_an_outside_namespace_through_nat_as_the_host() {
    let mut lab = lab!("the_guest_reaches_an_outside_namespace_through_nat_as_the_host");
    let outside = outside();
    let listener = outside.listen_tcp(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 7777));
    lab.start(&[]);
    let (row, _) = lab.boot(&[lab.vm("nat-1")], "nat-1");

    lab.guest(
        USER,
        &address(&row),
        "timeout 10 bash -c 'echo hello > /dev/tcp/192.0.2.2/7777'",
    );

    // The host's own address on the way out, never the guest's.
    let peers: Vec<Ipv4Addr> = listener.all().into_iter().map(|(ip, _)| ip).collect();
    assert_eq!(peers, [Ipv4Addr::new(192, 0, 2, 1)]);
}

#[test]
fn egress_rules_applied_live_drop_what_they_name_and_nothing_else() {
    let mut lab = lab!("egress_rules_applied_live_drop_what_they_name_and_nothing_else");
    let outside = outside();
    let denied = outside.listen_tcp(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 2), 7777));
    let allowed = outside.listen_tcp(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 3), 7777));
    lab.start(&[]);
    let vm = lab.vm("egress-1");
    let (row, _) = lab.boot(std::slice::from_ref(&vm), "egress-1");
    let ip = address(&row);
    let reach = |to: &str| {
        lab.ssh(
            USER,
            &ip,
            &format!("timeout 5 bash -c 'echo hello > /dev/tcp/{to}/7777'"),
        )
        .status
        .success()
    };
    let before = reach("192.0.2.2");
    let pid = lab.hypervisor_pid("egress-1");

    lab.desire(&[with(vm, "egress_deny", json!(["192.0.2.2/32"]))]);
    let (row, took) = lab.wait_row("egress-1", "its egress rules", SOON, |r| {
        r["egress"]
            .as_str()
            .is_some_and(|e| e.contains("192.0.2.2/32"))
    });
    timing("egress change -> held", took);

    assert!(before, "the guest could not reach 192.0.2.2 to begin with");
    assert!(!reach("192.0.2.2"), "192.0.2.2 still reached: {row}");
    assert!(reach("192.0.2.3"), "192.0.2.3 is not denied");
    assert_eq!(denied.all().len(), 1, "{:?}", denied.all());
    assert_eq!(allowed.all().len(), 1, "{:?}", allowed.all());
    assert_eq!(lab.hypervisor_pid("egress-1"), pid, "its VMM was touched");
}

#[test]
fn the_guest_has_the_cpus_and_memory_of_its_spec() {
    let mut lab = lab!("the_guest_has_the_cpus_and_memory_of_its_spec");
    lab.start(&[]);
    let (row, _) = lab.boot(&[with(lab.vm("size-1"), "vcpus", json!(2))], "size-1");
    let ip = address(&row);

    let cpus = lab.guest(USER, &ip, "nproc");
    let mem_kib: u64 = lab
        .guest(USER, &ip, "awk '/^MemTotal/ {print $2}' /proc/meminfo")
        .parse()
        .expect("MemTotal in KiB");

    assert_eq!(cpus, "2");
    // 512 MiB less what the kernel keeps for itself (its image, reserved
    // pages): it sees no more, and not much less.
    assert!(
        (400 * 1024..=512 * 1024).contains(&mem_kib),
        "{mem_kib} KiB"
    );
}

/// Compares a 1 MiB buffer with an equal copy and with one that differs in
/// its last byte, `ROUNDS` times, and prints how many answers were wrong.
/// Python's bytes comparison is glibc's memcmp, which on a CPU with AVX2 or
/// AVX-512 holds both buffers in vector registers: a task preempted in the
/// middle finds them as the kernel restored them.
const COMPARE_BUFFERS: &str = r#"
import os
a = os.urandom(1 << 20)
same = bytes(bytearray(a))
other = bytearray(a)
other[-1] ^= 1
other = bytes(other)
print(sum(1 for _ in range(ROUNDS) if a != same or a == other))
"#;

#[test]
fn the_guests_tasks_keep_their_own_vector_registers() {
    let mut lab = lab!("the_guests_tasks_keep_their_own_vector_registers");
    lab.start(&[]);
    let (row, _) = lab.boot(&[lab.vm("vec-1")], "vec-1");
    let ip = address(&row);
    let script = COMPARE_BUFFERS.replace("ROUNDS", "20000");
    lab.guest(
        USER,
        &ip,
        &format!("cat > /tmp/compare.py <<'EOF'{script}EOF"),
    );

    // Three at once on one vCPU: each is preempted by the others, mid-compare,
    // hundreds of times.
    let started = Instant::now();
    let wrong = lab.guest(
        USER,
        &ip,
        "for i in 1 2 3; do python3 /tmp/compare.py & done; wait",
    );
    timing("three tasks comparing buffers", started.elapsed());

    let wrong: Vec<&str> = wrong.lines().collect();
    assert_eq!(wrong, ["0", "0", "0"], "wrong answers in each task");
}

#[test]
fn a_disk_rate_limit_holds_the_guests_reads_to_it() {
    let mut lab = lab!("a_disk_rate_limit_holds_the_guests_reads_to_it");
    lab.start(&[]);
    const MBPS: f64 = 20.0;
    let vm = with(
        with(lab.vm("disk-1"), "disk_mbps", json!(MBPS as u64)),
        "cloud_init",
        json!(ROOT_LOGIN),
    );
    let (row, _) = lab.boot(&[vm], "disk-1");
    let ip = address(&row);

    // The bucket starts full (a second of its rate): the first read
    // empties it, and the measured one follows at once, before it fills.
    let dd = lab
        .ssh(
            "root",
            &ip,
            "dd if=/dev/vda of=/dev/null bs=1M count=30 iflag=direct 2>/dev/null && \
             dd if=/dev/vda of=/dev/null bs=1M skip=30 count=100 iflag=direct",
        )
        .stderr;

    // "104857600 bytes (105 MB, 100 MiB) copied, 5.2 s, 20.1 MB/s"
    let text = String::from_utf8_lossy(&dd);
    let seconds: f64 = text
        .split(", ")
        .find_map(|part| part.strip_suffix(" s")?.parse().ok())
        .unwrap_or_else(|| panic!("no time in dd's answer: {text}"));
    let measured = 100.0 * 1048576.0 / seconds / 1e6;
    println!("timing: disk reads at {measured:.2} MB/s, limit {MBPS} MB/s");
    let ratio = measured / MBPS;
    assert!(
        (0.9..=1.1).contains(&ratio),
        "{measured:.2} MB/s read: {text}"
    );
}

#[test]
fn the_power_button_powers_the_guest_off_inside_the_stop_grace() {
    let mut lab = lab!("the_power_button_powers_the_guest_off_inside_the_stop_grace");
    lab.start(&[]);
    let vm = lab.vm("pwr-1");
    let (row, _) = lab.boot(std::slice::from_ref(&vm), "pwr-1");
    // Its boot finished (sshd answers before cloud-init's last stage has
    // run, and systemd waits for that stage to end before it powers off:
    // a slow boot under load once spent the whole grace there).
    lab.guest(
        USER,
        &address(&row),
        "systemctl is-system-running --wait > /dev/null; true",
    );

    lab.desire(&[with(vm, "power_state", json!("stopped"))]);
    let (_, took) = lab.wait_row("pwr-1", "stopped", SOON * 2, |r| {
        r["power_state"] == "stopped" && r["status_detail"] == ""
    });

    timing("power button -> off", took);
    assert!(took < Duration::from_secs(STOP_GRACE_S));
    let console = lab.console("pwr-1", 20);
    assert!(console.contains("reboot: Power down"), "{console}");
    let log = lab.agent_log();
    assert!(
        log.contains("VM pwr-1: the guest powered off"),
        "the agent does not say the guest powered off: {log}"
    );
    assert!(
        !log.contains("did not power off") && !log.contains("SIGTERM") && !log.contains("killing"),
        "{log}"
    );
}

#[test]
fn suspend_and_resume_twice_keep_the_guests_boot_and_uptime() {
    let mut lab = lab!("suspend_and_resume_twice_keep_the_guests_boot_and_uptime");
    lab.start(&[]);
    let vm = lab.vm("nap-1");
    let (row, _) = lab.boot(std::slice::from_ref(&vm), "nap-1");
    let ip = address(&row);
    let boot_id = lab.guest(USER, &ip, "cat /proc/sys/kernel/random/boot_id");
    let uptime = |lab: &Lab| -> f64 {
        let up = lab.guest(USER, &ip, "cut -d' ' -f1 /proc/uptime");
        up.parse().expect("seconds")
    };
    let mut last_uptime = uptime(&lab);
    // A guest busy switching between user and kernel mode is the one this
    // host's KVM is likeliest to be caught mid-switch in (what a snapshot
    // must then save right: README, Running real guests).
    lab.guest(
        USER,
        &ip,
        "nohup setsid sh -c 'while :; do cat /proc/uptime > /dev/null; done' \
         </dev/null >/dev/null 2>&1 &",
    );

    for round in 1..=2 {
        lab.desire(&[with(vm.clone(), "power_state", json!("suspended"))]);
        let (_, suspend) = lab.wait_row("nap-1", "suspended", SOON, |r| {
            r["power_state"] == "suspended"
        });
        lab.desire(std::slice::from_ref(&vm));
        let (report, resume) = lab.wait_report("nap-1", "running and ready", SOON, ready);
        let resumed_to_ready = lab::since_hypervisor_start(&report, "nap-1");
        timing(&format!("suspend {round}"), suspend);
        timing(&format!("resume {round} -> ready"), resume);
        timing(
            &format!("resume {round}: hypervisor running -> ready"),
            resumed_to_ready,
        );

        assert_eq!(
            lab.guest(USER, &ip, "cat /proc/sys/kernel/random/boot_id"),
            boot_id,
            "round {round}: the guest booted again"
        );
        let now = uptime(&lab);
        assert!(
            now > last_uptime,
            "round {round}: uptime {now} after {last_uptime}"
        );
        assert!(
            resumed_to_ready <= Duration::from_secs(PROBE_PERIOD_S),
            "round {round}: ready {resumed_to_ready:?} after its hypervisor ran again"
        );
        last_uptime = now;
    }
}

#[test]
fn a_killed_hypervisor_boots_the_guest_again_with_its_disk_intact() {
    let mut lab = lab!("a_killed_hypervisor_boots_the_guest_again_with_its_disk_intact");
    lab.start(&[]);
    let vm = with(lab.vm("crash-1"), "cloud_init", json!(ROOT_LOGIN));
    let (row, _) = lab.boot(&[vm], "crash-1");
    let ip = address(&row);
    let boot_id = lab.guest(USER, &ip, "cat /proc/sys/kernel/random/boot_id");
    lab.guest(
        "root",
        &ip,
        "echo written-before-the-crash > /root/marker && sync",
    );
    let pid = lab.hypervisor_pid("crash-1");

    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL)
        .expect("SIGKILL the hypervisor");
    let killed = Instant::now();
    lab.wait_row("crash-1", "its new hypervisor", SOON, |r| {
        r["power_state"] == "running" && lab.details("crash-1")["pid"] != json!(pid)
    });
    let (_, _) = lab.wait_row("crash-1", "ready again", BOOT, ready);

    timing("VMM killed -> ready again", killed.elapsed());
    assert_ne!(
        lab.guest(USER, &ip, "cat /proc/sys/kernel/random/boot_id"),
        boot_id
    );
    assert_eq!(
        lab.guest("root", &ip, "cat /root/marker"),
        "written-before-the-crash"
    );
}

#[test]
fn a_killed_agent_is_followed_by_one_that_adopts_the_guest() {
    let mut lab = lab!("a_killed_agent_is_followed_by_one_that_adopts_the_guest");
    lab.start(&[]);
    let (row, _) = lab.boot(&[lab.vm("adopt-1")], "adopt-1");
    let ip = address(&row);
    let boot_id = lab.guest(USER, &ip, "cat /proc/sys/kernel/random/boot_id");
    let pid = lab.hypervisor_pid("adopt-1");

    lab.kill_agent();
    std::fs::remove_file(lab.state().join("report.json")).expect("remove the old report");
    lab.start(&[]);
    let (row, took) = lab.wait_row("adopt-1", "ready", SOON, ready);

    timing("agent restart -> ready", took);
    assert_eq!(lab.details("adopt-1")["pid"], json!(pid), "{row}");
    assert_eq!(
        lab.guest(USER, &ip, "cat /proc/sys/kernel/random/boot_id"),
        boot_id
    );
}

#[test]
fn destroying_the_vm_leaves_nothing_of_it_on_the_host() {
    let mut lab = lab!("destroying_the_vm_leaves_nothing_of_it_on_the_host");
    lab.start(&[]);
    let vm = lab.vm("gone-1");
    lab.boot(std::slice::from_ref(&vm), "gone-1");
    let pid = lab.hypervisor_pid("gone-1");
    let taps = || {
        let links = lab::run(eitri_agent::testkit::tools::tool("ip").args(["-o", "link"]));
        links
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .filter(|name| name.starts_with("etr") && *name != "etrbr0")
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let tap = taps();
    assert_eq!(tap.len(), 1, "{tap:?}");

    lab.desire(&[with(vm, "tombstoned", json!(true))]);
    let started = Instant::now();
    loop {
        let report = lab.report().unwrap_or_default();
        let acked = report["report"]["destroyed"]
            .as_array()
            .is_some_and(|d| d.contains(&json!("gone-1")));
        if acked {
            break;
        }
        assert!(started.elapsed() < SOON * 2, "never destroyed: {report}");
        std::thread::sleep(Duration::from_millis(200));
    }
    timing("tombstoned -> destroyed", started.elapsed());

    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
    assert_eq!(taps(), Vec::<String>::new());
    assert!(!lab.state().join("vms").join("gone-1").exists());
    let addresses = lab::read(&lab.state().join("net").join("addresses.json"));
    assert!(!addresses.contains("gone-1"), "{addresses}");
    let guard = lab::run(eitri_agent::testkit::tools::tool("nft").args(["list", "ruleset"]));
    assert!(!guard.contains(&tap[0]), "{guard}");
    let cgroup = eitri_agent::testkit::cgroup_file(
        &lab.cgroup_root,
        &eitri_agent::testkit::id("gone-1"),
        "cgroup.procs",
    );
    assert_eq!(cgroup, None, "its cgroup is still there");
}

#[test]
fn a_second_nic_on_a_site_network_has_its_address_discovered() {
    let mut lab = lab!("a_second_nic_on_a_site_network_has_its_address_discovered");
    let _site = Site::new(&lab);
    lab.start(&[Site::FLAG]);
    let vm = with(lab.vm("site-1"), "network", json!("site"));
    lab.boot(&[vm], "site-1");

    let (row, took) = lab.wait_row("site-1", "its site address", SOON, has("network_ip"));
    timing("ready -> site address learned", took);
    let shown = lab.guest(USER, &address(&row), "ip -4 -o addr show dev eth1");

    let network_ip = row["network_ip"].as_str().unwrap_or_default();
    assert!(
        shown.contains(&format!("inet {network_ip}/")),
        "{shown} / {row}"
    );
}

/// Sends, from the guest's `eth1` through a raw socket, ARP and UDP to the
/// site's server three times each: claiming `192.0.2.99` (not its lease),
/// and as itself (argv[1], its lease) for contrast.
const SPOOF: &str = r#"
import socket, struct, sys, time
own, forged, server = sys.argv[1], "192.0.2.99", "192.0.2.1"
mac = bytes.fromhex(open("/sys/class/net/eth1/address").read().strip().replace(":", ""))
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("eth1", 0))
def arp(sender):
    return (b"\xff" * 6 + mac + b"\x08\x06" + struct.pack("!HHBBH", 1, 0x0800, 6, 4, 1)
            + mac + socket.inet_aton(sender) + b"\x00" * 6 + socket.inet_aton(server))
def checksum(b):
    total = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    total = (total >> 16) + (total & 0xffff)
    return ~(total + (total >> 16)) & 0xffff
def udp(source, said):
    body = struct.pack("!HHHH", 40000, 9999, 8 + len(said), 0) + said
    head = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(body), 1, 0, 64, 17, 0,
                       socket.inet_aton(source), socket.inet_aton(server))
    head = head[:10] + struct.pack("!H", checksum(head)) + head[12:]
    return b"\xff" * 6 + mac + b"\x08\x00" + head + body
for _ in range(3):
    s.send(arp(forged)); s.send(udp(forged, b"SPOOF"))
    s.send(arp(own)); s.send(udp(own, b"LEGIT"))
    time.sleep(0.2)
"#;

#[test]
fn a_guest_cannot_claim_another_address_on_its_site_nic() {
    let mut lab = lab!("a_guest_cannot_claim_another_address_on_its_site_nic");
    let site = Site::new(&lab);
    let arp = site.ns.capture_arp();
    let udp = site.ns.listen_udp(SocketAddrV4::new(Site::SERVER, 9999));
    lab.start(&[Site::FLAG]);
    let vm = with(
        with(lab.vm("spoof-1"), "network", json!("site")),
        "cloud_init",
        json!(ROOT_LOGIN),
    );
    lab.boot(&[vm], "spoof-1");
    let (row, _) = lab.wait_row("spoof-1", "its site address", SOON, has("network_ip"));
    let lease: Ipv4Addr = row["network_ip"]
        .as_str()
        .unwrap_or_default()
        .parse()
        .expect("an address");

    let sent = lab.ssh_with(
        "root",
        &address(&row),
        &format!("python3 - {lease}"),
        &[],
        Some(SPOOF),
    );
    std::thread::sleep(Duration::from_secs(1));

    assert!(
        sent.status.success(),
        "{}",
        String::from_utf8_lossy(&sent.stderr)
    );
    let forged = Ipv4Addr::new(192, 0, 2, 99);
    assert_eq!(arp.from(forged), Vec::<String>::new(), "forged ARP arrived");
    assert_eq!(udp.from(forged), Vec::<String>::new(), "forged UDP arrived");
    assert!(!arp.from(lease).is_empty(), "its own ARP never arrived");
    assert_eq!(udp.from(lease), ["LEGIT"; 3], "{:?}", udp.all());
}

#[test]
fn a_guest_whose_kernel_panics_is_never_ready_and_its_row_says_why() {
    let mut lab = lab!("a_guest_whose_kernel_panics_is_never_ready_and_its_row_says_why");
    // No such disk: the kernel cannot mount its root and panics (and,
    // with panic=0, stays so).
    lab.start(&["--cmdline", "console=ttyS0 root=/dev/vdz rw panic=0"]);
    let vm = lab.vm("oops-1");
    lab.desire(std::slice::from_ref(&vm));
    let was_ready = std::cell::Cell::new(false);

    let (report, took) =
        lab.wait_report("oops-1", "its row to say the guest panicked", SOON, |r| {
            was_ready.set(was_ready.get() || ready(r));
            r["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("the guest panicked"))
        });

    let row = lab::row_of(&report, "oops-1");
    timing("desired -> the panic in the row", took);
    timing(
        "hypervisor start -> the panic in the row",
        lab::since_hypervisor_start(&report, "oops-1"),
    );
    assert!(!was_ready.get(), "it read ready before: {row}");
    assert_eq!(row["phase"], "failed", "{row}");
    assert!(
        row["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("Kernel panic - not syncing: VFS: Unable to mount root fs")),
        "{row}"
    );
}

#[test]
fn a_guest_probed_over_tcp_sleeps_after_its_idle_time() {
    let mut lab = lab!("a_guest_probed_over_tcp_sleeps_after_its_idle_time");
    lab.start(&[]);
    const IDLE_S: u64 = 20;
    let vm = with(
        with(lab.vm("doze-1"), "wake_on_traffic", json!(true)),
        "idle_suspend_after_s",
        json!(IDLE_S),
    );
    let (row, _) = lab.boot(std::slice::from_ref(&vm), "doze-1");
    // A guest just booted still talks (cloud-init's last stage, its clock
    // and addresses): its own traffic, which keeps it awake as it should.
    // Measured from its boot's end.
    lab.guest(
        USER,
        &address(&row),
        "systemctl is-system-running --wait > /dev/null; true",
    );

    // Its probe (tcp 22, every 2 s) answers all the while: without the
    // rule that its answers are not the guest's traffic it never sleeps.
    let (row, took) = lab.wait_row("doze-1", "asleep", SOON * 2, |r| r["asleep"] == true);

    timing("boot finished -> asleep", took);
    timing("its idle time", Duration::from_secs(IDLE_S));
    assert_eq!(row["power_state"], "suspended", "{row}");
}

/// The static guest agent `make static` builds, for the agent to deliver;
/// `None` (the check skips, saying so) when it is not built.
fn static_guest_agent() -> Option<std::path::PathBuf> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/x86_64-unknown-linux-musl/release/eitri-guest");
    if path.is_file() {
        Some(path)
    } else {
        println!(
            "SKIPPED: no static eitri-guest at {} (make static builds it)",
            path.display()
        );
        None
    }
}

/// Asks vm `id`'s guest agent for its status, within `patience`: the
/// answer, or the last error.
fn guest_status(lab: &Lab, id: &str) -> Result<eitri_agent::guest::Status, String> {
    use eitri_agent::pb::guest::{StatusAsk, request};
    let pid = lab.hypervisor_pid(id) as u32;
    let asked = eitri_agent::guest::ask(
        &lab.guest_socket(id),
        pid,
        1,
        request::Ask::Status(StatusAsk {}),
        eitri_agent::deadline::Deadline::after(Duration::from_secs(2)),
    )
    .map_err(|e| e.to_string())?;
    match asked.said {
        eitri_agent::guest::Said::Status(s) => Ok(s),
        other => Err(format!("{other:?}")),
    }
}

#[test]
fn the_delivered_guest_agent_makes_a_vm_without_a_probe_ready_and_reseeds_it_after_a_resume() {
    let mut lab = lab!(
        "the_delivered_guest_agent_makes_a_vm_without_a_probe_ready_and_reseeds_it_after_a_resume"
    );
    let Some(agent) = static_guest_agent() else {
        return;
    };
    lab.start(&["--guest-agent", &agent.display().to_string()]);
    let mut vm = lab.vm("ga-1");
    vm.as_object_mut().map(|o| o.remove("readiness"));
    let (report, _) = {
        lab.desire(std::slice::from_ref(&vm));
        lab.wait_report("ga-1", "running and ready", lab::BOOT, ready)
    };
    let to_ready = lab::since_hypervisor_start(&report, "ga-1");
    let row = lab::row_of(&report, "ga-1");
    let sshd = port_22_answers(&address(&row));
    timing("VMM start -> ready by its guest agent", to_ready);
    assert_eq!(row["readiness"], "guest agent answered", "{row}");
    let guest = row["guest"].as_str().unwrap_or_default();
    if guest.starts_with("system degraded") {
        let failed = lab.guest(
            USER,
            &address(&row),
            "systemctl --failed --no-legend; grep -h -i -B2 -A8 'fail\\|error\\|traceback' /var/log/cloud-init.log | tail -30",
        );
        println!("timing: its system is degraded; failed units: {failed}");
    }
    assert!(
        guest.starts_with("system up") || guest.starts_with("system degraded"),
        "{row}"
    );
    assert!(sshd, "ready by its guest agent before sshd answered: {row}");

    let answered = suspended_and_resumed(&lab, &vm, "ga-1", Duration::ZERO);
    println!("timing: {answered}");
    assert!(
        answered.contains("64 bytes of entropy credited and its generator reseeded"),
        "{answered}"
    );
}

/// Suspends vm `id` (wanted as `vm`), waits `nap`, resumes it: what the
/// agent's log says of its guest agent's reseed after the resume.
fn suspended_and_resumed(lab: &Lab, vm: &Value, id: &str, nap: Duration) -> String {
    lab.desire(&[with(vm.clone(), "power_state", json!("suspended"))]);
    lab.wait_row(id, "suspended", SOON, |r| r["power_state"] == "suspended");
    std::thread::sleep(nap);
    lab.desire(std::slice::from_ref(vm));
    lab.wait_row(id, "running", SOON, |r| r["power_state"] == "running");
    let log = lab.agent_log();
    let said = format!("VM {id}: ");
    log.lines()
        .find(|l| l.contains(&format!("{said}its guest agent answered")))
        .and_then(|l| l.split(&said).nth(1))
        .unwrap_or_else(|| panic!("no reseed after the resume: {log}"))
        .to_owned()
}

/// How long the clock check's guest sleeps (`EITRI_TEST_NAP_S`, default
/// 30 s; the README's figure was taken with 600).
fn nap() -> Duration {
    Duration::from_secs(
        std::env::var("EITRI_TEST_NAP_S")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(30),
    )
}

#[test]
fn a_resumed_guests_clock_is_the_hosts_within_100_ms() {
    let mut lab = lab!("a_resumed_guests_clock_is_the_hosts_within_100_ms");
    let Some(ip) = booted_with_guest_agent(&mut lab, "clk-1", &[]) else {
        return;
    };
    let vm = lab.vm("clk-1");
    let answered = suspended_and_resumed(&lab, &vm, "clk-1", nap());
    let (offset, within) = lab.guest_clock_offset(USER, &ip);

    println!(
        "timing: after a {} s sleep, as the guest agent found it: {}",
        nap().as_secs(),
        answered.split("its clock ").nth(1).unwrap_or_default()
    );
    println!(
        "timing: after a {} s sleep, over ssh once set: {:+.1} ms (± {:.1} ms)",
        nap().as_secs(),
        offset * 1000.0,
        within * 1000.0
    );
    assert!(
        offset.abs() <= 0.1 + within,
        "the guest's clock is {offset:+.3} s off the host's (± {within:.3} s)"
    );
}

/// Waits until vm `id`'s guest agent says its system is up.
fn guest_agent_up(lab: &Lab, id: &str) {
    let started = Instant::now();
    loop {
        match guest_status(lab, id) {
            Ok(s) if s.system.is_up() => return,
            Ok(s) => assert!(started.elapsed() < SOON, "not up yet: {s:?}"),
            Err(e) => assert!(started.elapsed() < SOON, "its guest agent: {e}"),
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// One request to vm `id`'s guest agent, answered within `patience`.
fn ask_guest(
    lab: &Lab,
    id: &str,
    ask: eitri_agent::pb::guest::request::Ask,
    patience: Duration,
) -> eitri_agent::guest::Said {
    eitri_agent::guest::ask(
        &lab.guest_socket(id),
        lab.hypervisor_pid(id) as u32,
        7,
        ask,
        eitri_agent::deadline::Deadline::after(patience),
    )
    .unwrap_or_else(|e| panic!("vm {id}'s guest agent: {e}"))
    .said
}

/// A booted VM whose delivered guest agent is up, the agent started with
/// `extra` flags too; its address.
fn booted_with_guest_agent(lab: &mut Lab, id: &str, extra: &[&str]) -> Option<String> {
    let agent = static_guest_agent()?;
    let agent = agent.display().to_string();
    let mut flags = vec!["--guest-agent", agent.as_str()];
    flags.extend_from_slice(extra);
    lab.start(&flags);
    let (row, _) = lab.boot(&[lab.vm(id)], id);
    guest_agent_up(lab, id);
    Some(address(&row))
}

#[test]
fn an_identity_applied_by_the_guest_agent_is_what_ssh_presents_under_strict_checking() {
    use eitri_agent::pb::guest::{Identity, request};
    let mut lab =
        lab!("an_identity_applied_by_the_guest_agent_is_what_ssh_presents_under_strict_checking");
    let ca = Ca::new(&lab, "host-ca");
    let Some(ip) = booted_with_guest_agent(&mut lab, "id-1", &[]) else {
        return;
    };
    let key = lab.dir.path().join("clone-7-host-key");
    lab::run(
        eitri_agent::testkit::tools::tool("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", "", "-f"])
            .arg(&key),
    );
    let public = lab::read(&key.with_extension("pub")).trim().to_owned();
    let identity = Identity {
        hostname: "clone-7".into(),
        ssh_host_key: lab::read(&key),
        ssh_host_certificate: ca.sign(&public, "clone-7", true),
        user: USER.into(),
        authorized_keys: vec![lab.public_key()],
        ..Identity::default()
    };

    let started = Instant::now();
    let said = ask_guest(&lab, "id-1", request::Ask::Identity(identity), SOON);
    timing("identity applied and confirmed", started.elapsed());

    let eitri_agent::guest::Said::Identity {
        hostname,
        sshd_reloaded,
        authorized_keys,
        ..
    } = said
    else {
        panic!("{said:?}")
    };
    assert_eq!(
        (hostname.as_str(), sshd_reloaded, authorized_keys),
        ("clone-7", true, 1)
    );
    // Strictly: the new key alone is known, then the CA alone.
    let strictly = |known_line: String, name: &str| {
        let known = lab.dir.path().join(name);
        std::fs::write(&known, known_line).expect("write");
        lab.ssh_with(
            USER,
            &ip,
            "hostname",
            &[
                format!("UserKnownHostsFile={}", known.display()),
                "StrictHostKeyChecking=yes".into(),
                "HostKeyAlias=clone-7".into(),
            ],
            None,
        )
    };
    let by_key = strictly(format!("clone-7 {public}\n"), "known-key");
    let by_ca = strictly(
        format!("@cert-authority clone-7 {}\n", ca.public()),
        "known-ca",
    );
    for out in [&by_key, &by_ca] {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "clone-7");
    }
}

#[test]
fn a_guest_frozen_around_a_copy_of_its_disk_is_thawed_and_thaws_itself_when_the_host_is_gone() {
    use eitri_agent::pb::guest::{Freeze, Thaw, request};
    let mut lab = lab!(
        "a_guest_frozen_around_a_copy_of_its_disk_is_thawed_and_thaws_itself_when_the_host_is_gone"
    );
    let Some(ip) = booted_with_guest_agent(&mut lab, "fz-1", &[]) else {
        return;
    };
    let disk = lab.state().join("vms").join("fz-1").join("disk.raw");
    let copy = lab.dir.path().join("fz-1-copy.raw");
    lab.guest(USER, &ip, "echo before > ~/mark && sync");

    // Frozen: a write the guest starts waits, and its disk is still while
    // it is copied.
    let frozen = ask_guest(
        &lab,
        "fz-1",
        request::Ask::Freeze(Freeze {
            thaw_after_ms: 60_000,
        }),
        SOON,
    );
    let started = Instant::now();
    let (first, second, thawed_at, written_at) = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let out = lab.ssh(USER, &ip, "echo during > ~/mark2 && sync");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            Instant::now()
        });
        std::thread::sleep(Duration::from_secs(1));
        let first = eitri_agent::image::sha256_file(&disk).expect("hash the disk");
        std::fs::copy(&disk, &copy).expect("copy the disk");
        let second = eitri_agent::image::sha256_file(&disk).expect("hash the disk");
        // Nothing of the guest's can land before the thaw is asked.
        let thawed_at = Instant::now();
        let thawed = ask_guest(&lab, "fz-1", request::Ask::Thaw(Thaw {}), SOON);
        println!("timing: froze {frozen:?}, thawed {thawed:?}");
        (first, second, thawed_at, writer.join().expect("the writer"))
    });
    timing(
        "frozen, disk copied and hashed twice, thawed",
        thawed_at - started,
    );

    assert!(written_at >= thawed_at, "a write landed while frozen");
    assert_eq!(first, second, "the disk changed while frozen");
    assert_eq!(
        first,
        eitri_agent::image::sha256_file(&copy).expect("hash the copy")
    );
    lab.guest(USER, &ip, "echo after > ~/mark3 && sync");

    // Frozen by a host agent that dies: the guest thaws itself in time.
    ask_guest(
        &lab,
        "fz-1",
        request::Ask::Freeze(Freeze {
            thaw_after_ms: 3_000,
        }),
        SOON,
    );
    let frozen_at = Instant::now();
    lab.kill_agent();
    let wrote = lab.ssh(USER, &ip, "timeout 20 sh -c 'echo alone > ~/mark4 && sync'");
    timing(
        "frozen, host agent killed -> a write lands",
        frozen_at.elapsed(),
    );
    assert!(
        wrote.status.success(),
        "{}",
        String::from_utf8_lossy(&wrote.stderr)
    );
    assert!(frozen_at.elapsed() >= Duration::from_secs(3));
}

#[test]
fn a_guest_restored_whole_before_it_runs_is_reseeded_too() {
    // The same resume with the snapshot read whole before the guest runs
    // (no userfaultfd device: cloud-hypervisor's copy restore), for where
    // the time of a reseed goes: against the on-demand restore's figure in
    // the_delivered_guest_agent_makes_…, what is left is not fault-in.
    let mut lab = lab!("a_guest_restored_whole_before_it_runs_is_reseeded_too");
    if booted_with_guest_agent(&mut lab, "cp-1", &["--userfaultfd-device", ""]).is_none() {
        return;
    }
    let vm = lab.vm("cp-1");
    let answered = suspended_and_resumed(&lab, &vm, "cp-1", Duration::ZERO);
    println!("timing: restored by copy: {answered}");
    assert!(
        answered.contains("64 bytes of entropy credited and its generator reseeded"),
        "{answered}"
    );
}

#[path = "real_guest/clones.rs"]
mod clones;
#[path = "real_guest/usage.rs"]
mod usage;
