//! What a tenant's VM is promised beyond its hardware, through the engine
//! against the fake backend: its own egress rules, held from before its
//! first boot and changed on a running VM without touching it; its
//! published ports, held once it has a record and recorded as held; and its
//! limits, which a running VM takes at its next boot; and its readiness
//! probe, which holds `ready` back and says when the guest stops answering.

use crate::common::Harness;
use std::net::TcpListener;
use std::time::Duration;

use eitri_agent::model::{
    Check, Cidr, Egress, Phase, PowerState, Publish, Readiness, Snapshot, VmLimits, VmStatus,
};
use eitri_agent::testkit::{Call, desired, id, present, snapshot};

const VM: &str = "vm-1";

fn egress(deny: &str, allow: &str) -> Egress {
    Egress {
        deny: Cidr::parse_list(deny).expect("deny"),
        allow: Cidr::parse_list(allow).expect("allow"),
    }
}

fn wanted(epoch: u64, rules: &Egress) -> Snapshot {
    let mut d = desired(VM);
    d.egress = rules.clone();
    snapshot(epoch, vec![present(d)])
}

#[test]
fn a_new_vms_egress_rules_reach_the_backend_in_the_pass_that_boots_it() {
    let h = Harness::new();
    let rules = egress("0.0.0.0/0", "10.1.0.0/16");

    h.tick(&wanted(1, &rules));

    assert_eq!(h.row(VM).phase, Some(Phase::Ready));
    assert_eq!(h.fakes.egress_of(VM), Some(rules.clone()));
    assert_eq!(h.record(VM).egress, rules);
}

#[test]
fn changed_egress_rules_are_held_within_a_tick_and_the_vm_is_not_rebooted() {
    let h = Harness::new();
    h.tick(&wanted(1, &egress("203.0.113.10", "")));
    let boots = h.fakes.count(|c| matches!(c, Call::Boot(_)));

    h.tick(&wanted(2, &egress("203.0.113.20", "")));

    assert_eq!(h.fakes.egress_of(VM), Some(egress("203.0.113.20", "")));
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Boot(_))), boots);
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Shutdown(_))), 0);
    assert_eq!(h.row(VM).power, Some(PowerState::Running));
}

#[test]
fn changed_egress_rules_are_recorded_for_the_next_agent_start() {
    let h = Harness::new();
    h.tick(&wanted(1, &Egress::default()));

    h.tick(&wanted(2, &egress("0.0.0.0/0", "")));

    assert_eq!(h.record(VM).egress, egress("0.0.0.0/0", ""));
}

fn publishing(epoch: u64, ports: &[Publish]) -> Snapshot {
    let mut d = desired(VM);
    d.published = ports.to_vec();
    snapshot(epoch, vec![present(d)])
}

#[test]
fn a_new_vms_published_ports_are_held_in_the_pass_that_creates_it_and_recorded() {
    let h = Harness::new();

    h.tick(&publishing(1, &[Publish::tcp(30080, 80)]));

    assert_eq!(h.row(VM).published, [Publish::tcp(30080, 80)]);
    assert_eq!(h.record(VM).published, [Publish::tcp(30080, 80)]);
}

#[test]
fn a_refused_port_is_said_in_the_row_left_out_of_the_record_and_the_vm_runs() {
    let h = Harness::new();
    h.fakes.refuse_port(30081);

    h.tick(&publishing(
        1,
        &[Publish::tcp(30080, 80), Publish::tcp(30081, 81)],
    ));

    let row = h.row(VM);
    assert_eq!(row.power, Some(PowerState::Running));
    assert_eq!(row.published, [Publish::tcp(30080, 80)]);
    assert!(
        row.last_error
            .contains("30081/tcp: the fake host gave it to another VM"),
        "{row:?}"
    );
    assert_eq!(h.record(VM).published, [Publish::tcp(30080, 80)]);
}

#[test]
fn a_port_removed_from_a_running_vm_leaves_its_record_and_the_vm_is_not_rebooted() {
    let h = Harness::new();
    h.tick(&publishing(1, &[Publish::tcp(30080, 80)]));
    let boots = h.fakes.count(|c| matches!(c, Call::Boot(_)));

    h.tick(&publishing(2, &[]));

    assert!(h.record(VM).published.is_empty());
    assert!(h.row(VM).published.is_empty());
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Boot(_))), boots);
}

#[test]
fn the_row_says_which_egress_rules_are_held() {
    let h = Harness::new();

    h.tick(&wanted(1, &egress("0.0.0.0/0", "10.1.0.0/16, 192.0.2.7")));

    assert_eq!(
        h.row(VM).egress,
        "deny 0.0.0.0/0 except 10.1.0.0/16, 192.0.2.7/32"
    );
}

#[test]
fn a_vm_with_no_egress_rules_of_its_own_says_nothing_of_them() {
    let h = Harness::new();

    h.tick(&wanted(1, &Egress::default()));

    assert_eq!(h.row(VM).egress, "");
    assert_eq!(h.record(VM).egress, Egress::default());
    assert_eq!(h.fakes.egress_of(VM), Some(Egress::default()));
}

#[test]
fn a_vm_whose_egress_rules_the_host_cannot_hold_is_not_started() {
    let h = Harness::new();
    h.fakes.refuse_egress();

    h.tick(&wanted(1, &egress("0.0.0.0/0", "")));

    let row = h.row(VM);
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Boot(_))), 0);
    assert_eq!(row.power, Some(PowerState::Stopped));
    assert_eq!(row.phase, Some(Phase::Creating));
    assert!(
        row.last_error
            .contains("cannot be held on this host, so it is not started")
            && row.last_error.contains("holds no egress rules"),
        "{row:?}"
    );
}

#[test]
fn a_vm_whose_egress_rules_the_host_cannot_hold_starts_once_it_has_none() {
    let h = Harness::new();
    h.fakes.refuse_egress();
    h.tick(&wanted(1, &egress("0.0.0.0/0", "")));

    h.tick(&wanted(2, &Egress::default()));

    assert_eq!(h.fakes.count(|c| matches!(c, Call::Boot(_))), 1);
    assert_eq!(h.row(VM).power, Some(PowerState::Running));
}

fn limited(epoch: u64, power: PowerState, limits: VmLimits) -> Snapshot {
    let mut d = desired(VM);
    d.spec.limits = limits;
    d.power = power;
    snapshot(epoch, vec![present(d)])
}

fn cpu(millis: u32) -> VmLimits {
    VmLimits {
        cpu_max_millis: millis,
        ..VmLimits::default()
    }
}

#[test]
fn a_new_vm_boots_with_its_limits() {
    let h = Harness::new();

    h.tick(&limited(1, PowerState::Running, cpu(500)));

    assert_eq!(h.record(VM).spec.limits, cpu(500));
    assert_eq!(h.row(VM).limits, "cpu 0.5");
}

#[test]
fn a_running_vms_changed_limit_waits_for_its_next_boot_and_says_so() {
    let h = Harness::new();
    h.tick(&limited(1, PowerState::Running, cpu(500)));
    let boots = h.fakes.count(|c| matches!(c, Call::Boot(_)));

    h.tick(&limited(2, PowerState::Running, cpu(250)));

    let row = h.row(VM);
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Boot(_))), boots);
    assert_eq!(h.record(VM).spec.limits, cpu(500));
    assert_eq!(row.limits, "cpu 0.5");
    assert!(
        row.status_detail.contains("limits change at the next boot"),
        "{row:?}"
    );
}

#[test]
fn a_changed_limit_is_taken_at_the_next_boot_from_cold() {
    let h = Harness::new();
    h.tick(&limited(1, PowerState::Running, cpu(500)));
    h.tick(&limited(2, PowerState::Running, cpu(250)));
    h.tick(&limited(3, PowerState::Stopped, cpu(250)));

    h.tick(&limited(4, PowerState::Running, cpu(250)));

    let row = h.row(VM);
    assert_eq!(h.record(VM).spec.limits, cpu(250));
    assert_eq!(row.power, Some(PowerState::Running));
    assert_eq!(row.limits, "cpu 0.25");
    assert!(!row.status_detail.contains("next boot"), "{row:?}");
}

#[test]
fn a_changed_limit_does_not_reboot_or_reset_a_created_vm() {
    let h = Harness::new();
    h.tick(&limited(1, PowerState::Running, cpu(500)));

    h.tick(&limited(2, PowerState::Running, cpu(250)));

    let rec = h.record(VM);
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Shutdown(_))), 0);
    assert_eq!(rec.lifecycle.create_attempts(), 1);
    assert!(!rec.lifecycle.boot_id().is_empty());
}

/// A probe of `check` every 2 s, with a grace of 60 s.
fn probe(check: Check, restart_after: Option<Duration>) -> Readiness {
    Readiness {
        check,
        period: Duration::from_secs(2),
        timeout: Duration::from_millis(300),
        grace: Duration::from_secs(60),
        restart_after,
    }
}

fn probed(epoch: u64, check: Check, restart_after: Option<Duration>) -> Snapshot {
    let mut d = desired(VM);
    d.readiness = Some(probe(check, restart_after));
    snapshot(epoch, vec![present(d)])
}

/// A loopback port nothing listens on (one just given up).
fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
    listener.local_addr().expect("addr").port()
}

/// The fake VM's guest at 127.0.0.1, so its TCP probe reaches loopback.
fn on_loopback(h: &Harness) {
    h.fakes.set_addresses(&id(VM), "127.0.0.1", "");
}

#[test]
fn a_serial_probe_holds_ready_back_until_the_console_has_its_line() {
    let h = Harness::new();
    let snap = probed(1, Check::Serial("login:".into()), None);
    h.tick(&snap);
    let waiting = h.row(VM);
    let console = h.store.layout().serial_log(&id(VM));
    std::fs::create_dir_all(console.parent().expect("vm dir")).expect("vm dir");
    std::fs::write(&console, "booting\nweb-1 login: \n").expect("console");

    h.fakes.advance_clock(Duration::from_secs(2));
    h.tick(&snap);

    assert_eq!(waiting.power, Some(PowerState::Running));
    assert_eq!(waiting.phase, Some(Phase::Creating));
    assert!(
        waiting
            .status_detail
            .starts_with("waiting for the guest: console line \"login:\", 0 s of 60 s"),
        "{waiting:?}"
    );
    assert_eq!(h.row(VM).phase, Some(Phase::Ready));
}

/// The fake VM's console, made with `text`.
fn console_says(h: &Harness, text: &str) -> std::path::PathBuf {
    let console = h.store.layout().serial_log(&id(VM));
    std::fs::create_dir_all(console.parent().expect("vm dir")).expect("vm dir");
    std::fs::write(&console, text).expect("console");
    console
}

#[test]
fn a_serial_probe_does_not_read_again_what_it_has_searched() {
    let h = Harness::new();
    let snap = probed(1, Check::Serial("login:".into()), None);
    h.tick(&snap);
    let console = console_says(&h, "aaaaaaaaaaaa\n");
    h.fakes.advance_clock(Duration::from_secs(2));
    h.tick(&snap);
    // Bytes already searched, changed in place: a new look reads only
    // what was printed since (a guest's console only grows).
    std::fs::write(&console, "login: aaaaa\n").expect("rewrite");

    h.fakes.advance_clock(Duration::from_secs(2));
    h.tick(&snap);

    assert_eq!(h.row(VM).phase, Some(Phase::Creating), "{:?}", h.row(VM));
}

#[test]
fn a_serial_probe_finds_a_line_printed_across_two_looks() {
    let h = Harness::new();
    let snap = probed(1, Check::Serial("login:".into()), None);
    h.tick(&snap);
    let console = console_says(&h, "booting\nweb-1 log");
    h.fakes.advance_clock(Duration::from_secs(2));
    h.tick(&snap);
    let waiting = h.row(VM);
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&console)
        .expect("console");
    std::io::Write::write_all(&mut file, b"in: \n").expect("append");

    h.fakes.advance_clock(Duration::from_secs(2));
    h.tick(&snap);

    assert_eq!(waiting.phase, Some(Phase::Creating));
    assert_eq!(h.row(VM).phase, Some(Phase::Ready));
}

#[test]
fn a_tcp_probe_holds_ready_back_until_the_guest_listens() {
    let h = Harness::new();
    let port = closed_port();
    let snap = probed(1, Check::Tcp(port), None);
    h.tick(&snap);
    on_loopback(&h);
    h.fakes.advance_clock(Duration::from_secs(2));
    h.tick(&snap);
    let waiting = h.row(VM);
    let _guest = TcpListener::bind(("127.0.0.1", port)).expect("the guest listens");

    h.fakes.advance_clock(Duration::from_secs(2));
    h.tick(&snap);

    assert_eq!(waiting.phase, Some(Phase::Creating));
    assert!(
        waiting
            .status_detail
            .contains(&format!("tcp {port}, 2 s of 60 s")),
        "{waiting:?}"
    );
    assert_eq!(h.row(VM).phase, Some(Phase::Ready));
    assert_eq!(h.row(VM).readiness, format!("tcp {port} answered"));
}

#[test]
fn a_probe_failing_after_ready_is_in_the_row_and_counted() {
    let h = Harness::new();
    on_loopback(&h);
    let guest = TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = guest.local_addr().expect("addr").port();
    let snap = probed(1, Check::Tcp(port), None);
    h.tick(&snap);
    assert_eq!(h.row(VM).phase, Some(Phase::Ready));

    drop(guest);
    h.fakes.advance_clock(Duration::from_secs(2));
    h.tick(&snap);

    let row = h.row(VM);
    assert_eq!(row.phase, Some(Phase::Ready));
    assert!(
        row.last_error
            .starts_with("unhealthy: failing for 0 s: tcp"),
        "{row:?}"
    );
    assert!(row.readiness.starts_with("failing for 0 s: tcp"), "{row:?}");
    assert_eq!(h.engine.counts().unhealthy.get(VM), 1);
}

#[test]
fn a_probe_added_to_a_running_vm_never_makes_it_creating() {
    let h = Harness::new();
    on_loopback(&h);
    let port = closed_port();
    h.tick(&snapshot(1, vec![present(desired(VM))]));
    assert_eq!(h.row(VM).phase, Some(Phase::Ready));

    h.tick(&probed(2, Check::Tcp(port), None));

    let row = h.row(VM);
    assert_eq!(row.phase, Some(Phase::Ready), "{row:?}");
    assert_eq!(row.power, Some(PowerState::Running));
    assert!(
        row.status_detail.starts_with(&format!(
            "waiting for the guest: tcp {port} (a probe added while it ran), 0 s of 60 s"
        )),
        "{row:?}"
    );
    assert!(!row.readiness.ends_with("answered"), "{row:?}");
    assert!(
        row.last_error.is_empty(),
        "not unhealthy within its grace: {row:?}"
    );
}

#[test]
fn a_vm_turning_unhealthy_is_logged_once_and_again_when_it_answers() {
    let logs = eitri_agent::testkit::logs::capture();
    let h = Harness::new();
    on_loopback(&h);
    let guest = TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = guest.local_addr().expect("addr").port();
    let snap = probed(1, Check::Tcp(port), None);
    h.tick(&snap);
    drop(guest);

    for _ in 0..3 {
        h.fakes.advance_clock(Duration::from_secs(2));
        h.tick(&snap);
    }
    let _guest = TcpListener::bind(("127.0.0.1", port)).expect("the guest listens again");
    h.fakes.advance_clock(Duration::from_secs(2));
    h.tick(&snap);

    assert_eq!(logs.count(log::Level::Warn, "VM vm-1: unhealthy"), 1);
    assert_eq!(logs.count(log::Level::Info, "VM vm-1: healthy again"), 1);
    assert_eq!(h.row(VM).last_error, "");
}

#[test]
fn a_guest_failing_its_probe_past_restart_after_is_booted_again() {
    let h = Harness::new();
    on_loopback(&h);
    let guest = TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = guest.local_addr().expect("addr").port();
    let snap = probed(1, Check::Tcp(port), Some(Duration::from_secs(10)));
    h.tick(&snap);
    drop(guest);
    h.fakes.advance_clock(Duration::from_secs(2));
    h.tick(&snap);
    let boots = h.fakes.count(|c| matches!(c, Call::Boot(_)));

    h.fakes.advance_clock(Duration::from_secs(10));
    h.tick(&snap);

    let row = h.row(VM);
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Boot(_))), boots + 1);
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Shutdown(_))), 1);
    assert!(
        row.status_detail.starts_with("unhealthy for 10 s")
            && row.status_detail.ends_with("booting it again"),
        "{row:?}"
    );
    assert_eq!(h.engine.counts().probe_restarts.get(VM), 1);
}

#[test]
fn a_probe_restart_never_throws_away_a_guest_resumed_within_its_grace() {
    let h = Harness::new();
    on_loopback(&h);
    let port = closed_port();
    let wanted = |epoch: u64, power: PowerState| {
        let mut d = desired(VM);
        d.power = power;
        d.readiness = Some(probe(Check::Tcp(port), Some(Duration::from_secs(10))));
        snapshot(epoch, vec![present(d)])
    };
    // Failing since its boot, and asleep for longer than grace and bound.
    h.tick(&wanted(1, PowerState::Running));
    h.fakes.advance_clock(Duration::from_secs(2));
    h.tick(&wanted(1, PowerState::Running));
    h.tick(&wanted(2, PowerState::Suspended));
    h.fakes.advance_clock(Duration::from_secs(600));
    h.tick(&wanted(3, PowerState::Running));

    h.fakes.advance_clock(Duration::from_secs(50));
    h.tick(&wanted(3, PowerState::Running));

    let row = h.row(VM);
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Resume(_))), 1);
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Boot(_))), 1);
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Shutdown(_))), 0);
    assert_eq!(row.power, Some(PowerState::Running));
    assert!(row.status_detail.contains("50 s of 60 s"), "{row:?}");
}

#[test]
fn a_failing_probe_without_restart_after_never_reboots() {
    let h = Harness::new();
    on_loopback(&h);
    let snap = probed(1, Check::Tcp(closed_port()), None);
    h.tick(&snap);

    h.fakes.advance_clock(Duration::from_secs(3600));
    h.tick(&snap);

    let row = h.row(VM);
    assert_eq!(h.fakes.count(|c| matches!(c, Call::Boot(_))), 1);
    assert!(
        row.last_error
            .starts_with("unhealthy: the guest has not answered tcp"),
        "{row:?}"
    );
}

/// A one-thread HTTP server on loopback answering every GET with `status`
/// (changed through the returned cell), and its port.
fn http_guest(status: u16) -> (std::sync::Arc<std::sync::atomic::AtomicU16>, u16) {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicU16, Ordering};
    let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = listener.local_addr().expect("addr").port();
    let answer = std::sync::Arc::new(AtomicU16::new(status));
    let said = std::sync::Arc::clone(&answer);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut request = [0u8; 1024];
            let _ = conn.read(&mut request);
            let code = said.load(Ordering::SeqCst);
            let _ = write!(conn, "HTTP/1.1 {code} X\r\nContent-Length: 0\r\n\r\n");
        }
    });
    (answer, port)
}

#[test]
fn an_http_probe_holds_ready_back_until_the_guest_answers_2xx() {
    let h = Harness::new();
    on_loopback(&h);
    let (answer, port) = http_guest(503);
    let check = Check::Http {
        port,
        path: "/health".into(),
    };
    let snap = probed(1, check, None);
    h.tick(&snap);
    let waiting = h.row(VM);
    answer.store(204, std::sync::atomic::Ordering::SeqCst);

    h.fakes.advance_clock(Duration::from_secs(2));
    h.tick(&snap);

    assert_eq!(waiting.phase, Some(Phase::Creating));
    assert!(
        waiting
            .readiness
            .contains(&format!("http {port} /health on 127.0.0.1 answered 503")),
        "{waiting:?}"
    );
    assert_eq!(h.row(VM).phase, Some(Phase::Ready));
}

#[test]
fn a_console_line_once_printed_answers_for_the_life_of_its_hypervisor() {
    let h = Harness::new();
    let snap = probed(1, Check::Serial("login:".into()), None);
    let console = h.store.layout().serial_log(&id(VM));
    std::fs::create_dir_all(console.parent().expect("vm dir")).expect("vm dir");
    std::fs::write(&console, "web-1 login: \n").expect("console");
    h.tick(&snap);
    std::fs::remove_file(&console).expect("console gone");

    h.fakes.advance_clock(Duration::from_secs(10));
    h.tick(&snap);

    let row = h.row(VM);
    assert_eq!(row.phase, Some(Phase::Ready));
    assert!(row.last_error.is_empty(), "{row:?}");
    assert_eq!(h.engine.counts().unhealthy.get(VM), 0);
}

/// A guest at 127.0.0.1 that takes a connection and says nothing, so a
/// probe of it waits out its timeout; and its port.
fn silent_guest() -> (TcpListener, u16) {
    let guest = TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = guest.local_addr().expect("addr").port();
    guest.set_nonblocking(true).expect("nonblocking");
    (guest, port)
}

/// `VM` powered `power`, probed by an HTTP GET of `port` given 5 s.
fn slowly_probed(epoch: u64, port: u16, power: PowerState) -> Snapshot {
    let mut d = desired(VM);
    d.power = power;
    d.readiness = Some(Readiness {
        check: Check::Http {
            port,
            path: "/".into(),
        },
        period: Duration::from_secs(2),
        timeout: Duration::from_secs(5),
        grace: Duration::from_secs(60),
        restart_after: None,
    });
    snapshot(epoch, vec![present(d)])
}

/// Steps to `snap`, and reads `VM`'s published row once the pass's probe
/// has reached `guest` (and waits on it).
fn row_while_probing(h: &Harness, snap: &Snapshot, guest: &TcpListener) -> VmStatus {
    h.engine.step(snap);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let _asked = loop {
        match guest.accept() {
            Ok(conn) => break conn,
            Err(_) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("the probe never asked: {e}"),
        }
    };
    let published = h.engine.published();
    let row = published.vms.iter().find(|r| r.vm_id == VM);
    (**row.expect("a row")).clone()
}

#[test]
fn a_probed_vm_is_not_said_ready_while_its_first_probe_waits_for_the_guest() {
    let h = Harness::new();
    on_loopback(&h);
    let (guest, port) = silent_guest();

    let row = row_while_probing(&h, &slowly_probed(1, port, PowerState::Running), &guest);

    assert_eq!(row.phase, Some(Phase::Creating), "{row:?}");
    assert!(
        row.status_detail.starts_with("waiting for the guest: http"),
        "{row:?}"
    );
}

#[test]
fn a_resumed_probed_vm_is_not_said_ready_before_its_guest_answers_again() {
    let h = Harness::new();
    on_loopback(&h);
    let (guest, port) = silent_guest();
    h.tick(&probed(1, Check::Tcp(closed_port()), None));
    h.tick(&slowly_probed(2, port, PowerState::Suspended));
    h.idle();

    let row = row_while_probing(&h, &slowly_probed(3, port, PowerState::Running), &guest);

    assert_eq!(row.power, Some(PowerState::Running), "{row:?}");
    assert_eq!(row.phase, Some(Phase::Creating), "{row:?}");
}

#[test]
fn a_probe_restart_is_a_boot_that_takes_a_waiting_limit() {
    let h = Harness::new();
    on_loopback(&h);
    let guest = TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = guest.local_addr().expect("addr").port();
    let with_cap = |epoch, millis| {
        let mut d = desired(VM);
        d.spec.limits = cpu(millis);
        d.readiness = Some(probe(Check::Tcp(port), Some(Duration::from_secs(10))));
        snapshot(epoch, vec![present(d)])
    };
    h.tick(&with_cap(1, 500));
    drop(guest);
    h.fakes.advance_clock(Duration::from_secs(2));
    h.tick(&with_cap(2, 250));
    let waiting = h.record(VM).spec.limits;

    h.fakes.advance_clock(Duration::from_secs(10));
    h.tick(&with_cap(2, 250));

    assert_eq!(waiting, cpu(500));
    assert_eq!(h.engine.counts().probe_restarts.get(VM), 1);
    assert_eq!(h.record(VM).spec.limits, cpu(250));
}
