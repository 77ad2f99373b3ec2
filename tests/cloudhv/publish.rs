//! Published ports through the whole backend: held within a tick of the
//! desired state that asks for them, changed with the VMM untouched, one
//! VM's at a time, given back with the VM, and held again by an agent
//! that starts over.

use super::*;
use eitri_agent::model::Publish;

/// The desired state of `vms`, each publishing `ports`.
pub(crate) fn publishing(h: &Host, epoch: u64, vms: &[(&str, Vec<Publish>)]) -> Snapshot {
    let wanted = vms
        .iter()
        .map(|(vm, ports)| {
            let mut d = h.desired(vm);
            d.published = ports.clone();
            present(d)
        })
        .collect();
    snapshot(epoch, wanted)
}

/// The agent's map of ports published on every host address.
fn forwarded() -> String {
    let table = eitri_agent::testkit::net::nft_table("ip", "eitri_test").unwrap_or_default();
    let start = table.find("map publish_any").unwrap_or(0);
    let end = table[start..].find("}").map_or(table.len(), |e| start + e);
    table[start..end].to_owned()
}

/// Whether the kernel isolates the bridge port `tap`.
fn isolated(tap: &str) -> bool {
    let out = std::process::Command::new("ip")
        .args(["-d", "link", "show", tap])
        .output()
        .expect("ip");
    String::from_utf8_lossy(&out.stdout).contains("isolated on")
}

fn networked() -> Host {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[]);
    h.connect();
    h
}

#[test]
fn a_running_vms_published_port_is_forwarded_within_a_tick_with_its_vmm_untouched() {
    let h = networked();
    h.tick(&publishing(&h, 1, &[("vm-1", vec![])]));
    let pid = h.pid("vm-1");
    let ip = h.backend.address(&id("vm-1")).expect("ip");
    let tap = h.backend.taps(&id("vm-1")).expect("taps").underlay;
    assert!(isolated(&tap));

    h.tick(&publishing(
        &h,
        2,
        &[("vm-1", vec![Publish::tcp(30080, 80)])],
    ));

    let map = forwarded();
    assert!(map.contains(&format!("tcp . 30080 : {ip} . 80")), "{map}");
    assert!(
        !isolated(&tap),
        "a published port's way in from other guests"
    );
    assert_eq!(h.pid("vm-1"), pid);
    assert!(pid.is_some_and(alive));
    assert_eq!(h.row("vm-1").published, [Publish::tcp(30080, 80)]);
}

#[test]
fn a_port_removed_live_is_forwarded_no_more_and_the_tap_is_isolated_again() {
    let h = networked();
    h.tick(&publishing(
        &h,
        1,
        &[("vm-1", vec![Publish::tcp(30080, 80)])],
    ));
    let tap = h.backend.taps(&id("vm-1")).expect("taps").underlay;
    let pid = h.pid("vm-1");

    h.tick(&publishing(&h, 2, &[("vm-1", vec![])]));

    assert!(!forwarded().contains("30080"), "{}", forwarded());
    assert!(isolated(&tap));
    assert!(std::net::TcpListener::bind(("0.0.0.0", 30080)).is_ok());
    assert_eq!(h.pid("vm-1"), pid);
    assert!(h.row("vm-1").published.is_empty());
}

#[test]
fn a_port_another_vm_holds_is_refused_naming_it_and_the_holder_keeps_it() {
    let h = networked();
    h.tick(&publishing(
        &h,
        1,
        &[("vm-a", vec![Publish::tcp(30080, 80)])],
    ));

    h.tick(&publishing(
        &h,
        2,
        &[
            ("vm-a", vec![Publish::tcp(30080, 80)]),
            ("vm-b", vec![Publish::tcp(30080, 8080)]),
        ],
    ));

    let (a, b) = (h.row("vm-a"), h.row("vm-b"));
    assert_eq!(a.published, [Publish::tcp(30080, 80)]);
    assert!(b.published.is_empty());
    assert!(
        b.last_error.contains("30080/tcp is published for VM vm-a"),
        "{}",
        b.last_error
    );
    // It runs whatever its ports: a port is a way in, not its life.
    assert_eq!(b.power, Some(PowerState::Running));
}

#[test]
fn a_port_outside_the_hosts_range_is_refused_saying_the_range() {
    let h = networked();

    h.tick(&publishing(
        &h,
        1,
        &[("vm-1", vec![Publish::tcp(8080, 80)])],
    ));

    let row = h.row("vm-1");
    assert!(row.published.is_empty());
    assert!(
        row.last_error
            .contains("outside this host's range 30000-30999"),
        "{}",
        row.last_error
    );
}

#[test]
fn a_destroyed_vm_gives_its_ports_back() {
    let mut h = networked();
    h.tick(&publishing(
        &h,
        1,
        &[("vm-1", vec![Publish::tcp(30080, 80)])],
    ));
    // No engine to boot it again when its VMM goes.
    drop(h.engine.take());

    h.backend
        .destroy(&id("vm-1"), Deadline::NONE)
        .expect("destroy");

    assert!(!forwarded().contains("30080"), "{}", forwarded());
    assert!(std::net::TcpListener::bind(("0.0.0.0", 30080)).is_ok());
    let unisolated = eitri_agent::testkit::net::nft_set_elements("unisolated");
    assert!(!unisolated.contains("elements"), "{unisolated}");
}

#[test]
fn a_restarted_agent_forwards_a_vms_ports_again_before_its_first_tick() {
    let h = networked();
    h.tick(&publishing(
        &h,
        1,
        &[("vm-1", vec![Publish::tcp(30080, 80)])],
    ));
    let ip = h.backend.address(&id("vm-1")).expect("ip");
    let tap = h.backend.taps(&id("vm-1")).expect("taps").underlay;

    // The old agent's host network goes with it (its held ports too); the
    // ruleset is made afresh, as at an agent's start, and the backend
    // starts over from the records.
    let mut h = h;
    h.cfg.network = None;
    let mut h = h.restart();
    h.connect();

    let map = forwarded();
    assert!(map.contains(&format!("tcp . 30080 : {ip} . 80")), "{map}");
    assert!(!isolated(&tap));
    assert!(
        std::net::TcpListener::bind(("0.0.0.0", 30080)).is_err(),
        "the port is held for the VM again"
    );
}

/// A host beyond this one (198.51.100.2; the host is 198.51.100.1), with
/// no route to the guests. Removed on drop.
pub(crate) fn remote_host() -> (eitri_agent::testkit::net::Namespaces, String) {
    let ns = format!("etr{:x}", std::process::id() & 0xffff);
    (eitri_agent::testkit::net::remote_host(&ns, "etremote"), ns)
}

/// The SYNs the stand-in's guest read (`STANDIN_GUEST_TCP`), as it logged
/// them.
pub(crate) fn syns(h: &Host, vm: &str) -> Vec<String> {
    std::fs::read_to_string(h.store.layout().hypervisor_log(&id(vm)))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("standin-guest: syn from"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn a_connection_from_another_host_reaches_the_guest_through_its_published_port() {
    eitri_agent::testkit::net::private_network();
    let mut h = Host::new(&[("STANDIN_GUEST_TCP", "1")]);
    h.connect();
    let (_remote, ns) = remote_host();
    h.tick(&publishing(
        &h,
        1,
        &[("vm-1", vec![Publish::tcp(30080, 8080)])],
    ));

    let connected = eitri_agent::testkit::net::within(&ns, || {
        std::net::TcpStream::connect_timeout(
            &(std::net::Ipv4Addr::new(198, 51, 100, 1), 30080).into(),
            Duration::from_secs(2),
        )
    });

    assert!(connected.is_ok(), "{connected:?}");
    let syns = syns(&h, "vm-1");
    // The guest read the client's first SYN, on its own port, from the
    // client's own address: one SYN, no retransmit.
    assert_eq!(syns.len(), 1, "{syns:?}");
    assert!(
        syns[0].contains("from 198.51.100.2:") && syns[0].ends_with("to port 8080"),
        "{syns:?}"
    );
}
