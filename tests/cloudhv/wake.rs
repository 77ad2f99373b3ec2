//! Scale to zero through the whole backend and the stand-in's guest on the
//! wire (`STANDIN_GUEST_TCP`): a sleeping VM woken by the first SYN of a
//! client on another host, which its restored VMM reads; a running one
//! put to sleep once its NICs are quiet, and not while frames flow.

use super::publish::{publishing, remote_host, syns};
use super::*;
use eitri_agent::model::{Publish, Sleep};
use std::net::TcpStream;

/// `vm` publishing 30080 → 8080, waking on traffic, wanted `power`, idle
/// after `idle`.
fn sleeper(h: &Host, epoch: u64, power: PowerState, idle: Option<Duration>) -> Snapshot {
    let mut snap = publishing(h, epoch, &[("vm-1", vec![Publish::tcp(30080, 8080)])]);
    for vm in &mut snap.vms {
        if let eitri_agent::model::WantedVm::Present(d) = vm {
            let d = Arc::make_mut(d);
            d.power = power;
            d.sleep = Sleep {
                wake_on_traffic: true,
                idle_after: idle,
            };
        }
    }
    snap
}

fn wire_host() -> (Host, eitri_agent::testkit::net::Namespaces, String) {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[("STANDIN_GUEST_TCP", "1")]);
    h.connect();
    let (remote, ns) = remote_host();
    (h, remote, ns)
}

/// A client on the other host connects to the published port: the
/// stream, and how many segments its kernel sent again.
fn connect_from(ns: &str) -> std::io::Result<(TcpStream, u32)> {
    eitri_agent::testkit::net::within(ns, || {
        let stream = TcpStream::connect_timeout(
            &(Ipv4Addr::new(198, 51, 100, 1), 30080).into(),
            Duration::from_secs(10),
        )?;
        eitri_agent::testkit::net::reset_on_close(&stream)?;
        Ok((
            stream.try_clone()?,
            eitri_agent::testkit::net::retransmits(&stream)?,
        ))
    })
}

/// Waits (without a step: the wake is the agent's own doing) until the
/// VM's row says `done`.
fn until_row(
    h: &Host,
    done: impl Fn(&eitri_agent::model::VmStatus) -> bool,
) -> eitri_agent::model::VmStatus {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let row = h.row("vm-1");
        if done(&row) || Instant::now() > deadline {
            return row;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_sleeping_vm_is_woken_by_the_first_syn_which_its_guest_reads_without_a_retransmit() {
    let (h, _remote, ns) = wire_host();
    h.tick(&sleeper(&h, 1, PowerState::Suspended, None));
    let row = h.row("vm-1");
    assert_eq!(row.power, Some(PowerState::Suspended), "{row:?}");
    assert!(row.asleep, "{row:?}");
    assert_eq!(
        h.pid("vm-1").filter(|p| alive(*p)),
        None,
        "no VMM while it sleeps"
    );

    let connected = connect_from(&ns);

    let (_stream, retransmits) = connected.expect("the client's connect is answered");
    assert_eq!(retransmits, 0, "the client never sent its SYN again");
    let syns = syns(&h, "vm-1");
    assert_eq!(syns.len(), 1, "{syns:?}");
    assert!(syns[0].contains("from 198.51.100.2:"), "{syns:?}");
    let row = until_row(&h, |r| {
        r.power == Some(PowerState::Running) && r.last_wake.contains("tcp")
    });
    assert!(!row.asleep, "{row:?}");
    assert!(
        row.last_wake.contains("tcp from 198.51.100.2:") && row.last_wake.contains("to port 8080"),
        "{row:?}"
    );
}

#[test]
fn a_vm_wanted_suspended_stays_awake_after_its_wake_at_the_next_tick() {
    let (h, _remote, ns) = wire_host();
    let snap = sleeper(&h, 1, PowerState::Suspended, Some(Duration::from_secs(600)));
    h.tick(&snap);
    connect_from(&ns).expect("connect");
    until_row(&h, |r| r.power == Some(PowerState::Running));
    let pid = h.pid("vm-1");

    h.tick(&snap);

    let row = h.row("vm-1");
    assert_eq!(row.power, Some(PowerState::Running), "{row:?}");
    assert_eq!(h.pid("vm-1"), pid, "its VMM untouched");
}

#[test]
fn a_running_vm_sleeps_once_its_nics_are_quiet_for_its_idle_time_and_not_while_frames_flow() {
    let (h, _remote, ns) = wire_host();
    let idle = Duration::from_secs(2);
    let snap = sleeper(&h, 1, PowerState::Running, Some(idle));
    h.tick(&snap);
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));

    // Its guest answering for 4 s, a connection every 300 ms: twice its
    // idle time.
    let flowing = Instant::now();
    let mut last_frame = flowing;
    while flowing.elapsed() < idle * 2 {
        connect_from(&ns).expect("connect");
        last_frame = Instant::now();
        h.tick(&snap);
        assert_eq!(
            h.row("vm-1").power,
            Some(PowerState::Running),
            "asleep while frames flow"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let row = until_row(&h, |r| r.asleep);

    assert!(row.asleep, "{row:?}");
    assert_eq!(row.power, Some(PowerState::Suspended));
    assert!(
        last_frame.elapsed() >= idle,
        "asleep {:?} after the last frame",
        last_frame.elapsed()
    );
    // Wanted running, and satisfied asleep: the next tick leaves it so.
    h.tick(&snap);
    assert!(h.row("vm-1").asleep);
}

#[test]
fn a_vm_asleep_when_the_agent_is_killed_wakes_on_traffic_under_the_next_one() {
    let (h, _remote, ns) = wire_host();
    let snap = sleeper(&h, 1, PowerState::Suspended, None);
    h.tick(&snap);
    assert!(h.row("vm-1").asleep);

    // The old agent's taps and host network go with it, as with a kill -9.
    let mut h = h;
    h.cfg.network = None;
    let mut h = h.restart();
    h.connect();
    h.tick(&snap);
    assert!(h.row("vm-1").asleep, "{:?}", h.row("vm-1"));
    let connected = connect_from(&ns);

    let (_stream, retransmits) = connected.expect("connect");
    assert_eq!(retransmits, 0);
    let row = until_row(&h, |r| r.power == Some(PowerState::Running));
    assert_eq!(row.power, Some(PowerState::Running), "{row:?}");
}

#[test]
fn a_woken_vm_wanted_suspended_sleeps_again_after_its_idle_time_without_a_tick() {
    let (h, _remote, ns) = wire_host();
    h.tick(&sleeper(
        &h,
        1,
        PowerState::Suspended,
        Some(Duration::from_secs(1)),
    ));
    connect_from(&ns).expect("connect");
    until_row(&h, |r| r.power == Some(PowerState::Running));

    // No tick from here: the agent's own idle watch puts it back to sleep.
    let row = until_row(&h, |r| r.asleep);

    assert!(row.asleep, "{row:?}");
    assert_eq!(row.power, Some(PowerState::Suspended));
}

#[test]
fn a_wake_the_host_has_no_room_for_waits_said_and_then_serves_the_client() {
    let (mut h, _remote, ns) = wire_host();
    // Room for one running vCPU: a sleeper holds none.
    h.caps = eitri_agent::reconcile::HostCaps {
        max_vcpus: 1,
        ..Default::default()
    };
    h.engine = Some(h.make_engine());
    let sleeping = sleeper(&h, 1, PowerState::Suspended, None);
    h.tick(&sleeping);
    let mut both = sleeping.clone();
    both.epoch = 2;
    both.vms.push(present(h.desired("vm-2")));
    h.tick(&both);
    assert_eq!(h.row("vm-2").power, Some(PowerState::Running));

    let client = std::thread::scope(|scope| {
        let client = scope.spawn(|| connect_from(&ns));
        let waiting = until_row(&h, |r| r.status_detail.contains("waiting for room"));
        assert_eq!(waiting.power, Some(PowerState::Suspended), "{waiting:?}");
        // Room made: the other VM destroyed, and a tick resumes it.
        let mut room = sleeping.clone();
        room.epoch = 3;
        room.vms.push(tombstoned("vm-2"));
        h.tick_until_row(&room, "vm-1", |r| r.power == Some(PowerState::Running));
        client.join().expect("client")
    });

    client.expect("the client's connect is answered once the VM runs");
    assert_eq!(h.row("vm-1").power, Some(PowerState::Running));
}

#[test]
fn a_vm_woken_again_before_it_slept_its_idle_time_stays_awake_twice_as_long() {
    let (h, _remote, ns) = wire_host();
    let idle = Duration::from_secs(1);
    h.tick(&sleeper(&h, 1, PowerState::Suspended, Some(idle)));
    connect_from(&ns).expect("connect");
    until_row(&h, |r| r.power == Some(PowerState::Running));
    until_row(&h, |r| r.asleep);

    // At once: a sleep shorter than its idle time.
    connect_from(&ns).expect("connect");
    until_row(&h, |r| r.power == Some(PowerState::Running));
    let woke = Instant::now();
    let row = until_row(&h, |r| r.asleep);

    assert!(row.asleep, "{row:?}");
    assert!(
        woke.elapsed() >= idle * 2,
        "asleep {:?} after its loop's wake",
        woke.elapsed()
    );
    assert_eq!(h.engine().counts().wake_loops.get(), 1);
}

#[test]
fn a_sleeping_vm_destroyed_leaves_no_tap_no_sleeper_element_and_no_neighbour() {
    let (h, _remote, _ns) = wire_host();
    h.tick(&sleeper(&h, 1, PowerState::Suspended, None));
    let tap = h.backend.taps(&id("vm-1")).expect("taps").underlay;
    let ip = h.backend.address(&id("vm-1")).expect("ip");
    assert!(h.row("vm-1").asleep);

    h.tick(&snapshot(2, vec![tombstoned("vm-1")]));

    assert!(!link_exists(&tap), "{tap} left");
    assert!(!nft_set_elements("asleep").contains(&tap));
    let neigh = std::process::Command::new("ip")
        .args(["neigh", "show", &ip.to_string()])
        .output()
        .expect("ip neigh");
    assert!(
        String::from_utf8_lossy(&neigh.stdout).trim().is_empty(),
        "{}",
        String::from_utf8_lossy(&neigh.stdout)
    );
}

#[test]
fn a_guest_whose_probe_has_not_answered_yet_is_not_idle() {
    let (h, _remote, _ns) = wire_host();
    let idle = Duration::from_secs(1);
    let mut snap = sleeper(&h, 1, PowerState::Running, Some(idle));
    for vm in &mut snap.vms {
        if let eitri_agent::model::WantedVm::Present(d) = vm {
            Arc::make_mut(d).readiness = Some(eitri_agent::model::Readiness {
                check: eitri_agent::model::Check::Serial("a line it never prints".into()),
                period: Duration::from_secs(1),
                timeout: Duration::from_millis(500),
                grace: Duration::from_secs(60),
                restart_after: None,
            });
        }
    }
    h.tick(&snap);

    // Three times its idle time, its guest silent: still booting, as far
    // as anyone can tell.
    for _ in 0..6 {
        std::thread::sleep(Duration::from_millis(500));
        h.tick(&snap);
    }

    let row = h.row("vm-1");
    assert_eq!(row.power, Some(PowerState::Running), "{row:?}");
    assert!(!row.asleep, "{row:?}");
}

#[test]
fn a_guest_answering_its_tcp_probe_every_period_still_sleeps_after_its_idle_time() {
    let (h, _remote, _ns) = wire_host();
    let idle = Duration::from_secs(2);
    let mut snap = sleeper(&h, 1, PowerState::Running, Some(idle));
    for vm in &mut snap.vms {
        if let eitri_agent::model::WantedVm::Present(d) = vm {
            Arc::make_mut(d).readiness = Some(eitri_agent::model::Readiness {
                check: eitri_agent::model::Check::Tcp(8080),
                period: Duration::from_secs(1),
                timeout: Duration::from_millis(500),
                grace: Duration::from_secs(60),
                restart_after: None,
            });
        }
    }
    h.tick(&snap);

    // The daemon's ticks, a probe at each one due (the probes' clock is
    // the engine's: moved as the wall clock): twice a period, for up to
    // four idle times.
    let started = Instant::now();
    while started.elapsed() < idle * 4 && !h.row("vm-1").asleep {
        h.tick(&snap);
        std::thread::sleep(Duration::from_millis(500));
        h.fakes.advance_clock(Duration::from_millis(500));
    }

    let row = h.row("vm-1");
    let log =
        std::fs::read_to_string(h.store.layout().hypervisor_log(&id("vm-1"))).unwrap_or_default();
    let probes = log.matches("to port 8080").count();
    assert!(probes >= 2, "its guest answered {probes} probes: {log}");
    assert!(
        row.asleep,
        "still awake after {:?}: {row:?}",
        started.elapsed()
    );
}
