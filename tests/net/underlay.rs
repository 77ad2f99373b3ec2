//! The underlay in a network namespace of the test's own: each test
//! unshares one first (nextest runs each test in its own process), so the
//! bridge, the nft table and the forwarding switch it sets never touch the
//! host's. Named namespaces it adds for a guest and a "remote" are removed.

// Linux only: it drives Linux-only parts (namespaces, taps, /proc, the
// cloud-hypervisor backend or its stand-in).
#![cfg(target_os = "linux")]

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::Command;
use std::time::Duration;

use eitri_agent::model::Mac;
use eitri_agent::model::{Cidr, Egress};
use eitri_agent::net::dhcp::Responder;
use eitri_agent::net::dhcp::codec::build_frame;
use eitri_agent::net::packet::{PacketSocket, arp_frame};
use eitri_agent::net::underlay::{Nat, Port, Underlay};
use eitri_agent::testkit::net::{
    Namespaces, ip, lease, nft_counter, private_network, script, udhcpc, underlay_config, within,
};
use eitri_agent::testkit::tools::{require, tool, without};

pub(crate) const GUEST_MAC: [u8; 6] = [0x02, 0xe1, 0, 0, 0, 0x07];

fn nft_table() -> String {
    eitri_agent::testkit::net::nft_table("ip", "eitri_test").unwrap_or_default()
}

#[test]
fn nat_applied_twice_is_what_applying_it_once_left() {
    private_network();
    Underlay::setup(underlay_config()).expect("first");
    let once = nft_table();

    let second = Underlay::setup(underlay_config()).expect("second");

    assert_eq!(second.nat(), Nat::Nft);
    assert!(once.contains("masquerade"), "{once}");
    assert_eq!(nft_table(), once);
}

fn has_table(family: &str, name: &str) -> bool {
    eitri_agent::testkit::net::nft_table(family, name).is_some()
}

#[test]
fn an_agents_tables_of_the_old_shared_name_go_when_it_builds_its_own() {
    private_network();
    let legacy = eitri_agent::net::underlay::UnderlayConfig {
        table: "eitri".into(),
        ..underlay_config()
    };
    Underlay::setup(legacy).expect("as an older agent built it");

    Underlay::setup(underlay_config()).expect("with its own name");

    assert!(!has_table("ip", "eitri") && !has_table("bridge", "eitri"));
    assert!(has_table("ip", "eitri_test"));
}

#[test]
fn another_agents_tables_of_the_old_shared_name_stay() {
    private_network();
    let other = eitri_agent::net::underlay::UnderlayConfig {
        table: "eitri".into(),
        bridge: "etbr9".into(),
        subnet: eitri_agent::net::addresses::Subnet::parse("100.78.0.0/16").expect("subnet"),
        ..underlay_config()
    };
    Underlay::setup(other).expect("the other agent's");

    Underlay::setup(underlay_config()).expect("this agent's");

    assert!(has_table("ip", "eitri") && has_table("bridge", "eitri"));
}

#[test]
fn the_bridge_holds_the_gateway_and_forwarding_is_on() {
    private_network();

    Underlay::setup(underlay_config()).expect("setup");

    let addrs = String::from_utf8_lossy(
        &Command::new("ip")
            .args(["-4", "addr", "show", "etbr0"])
            .output()
            .expect("ip")
            .stdout,
    )
    .into_owned();
    assert!(addrs.contains("100.77.0.1/16"), "{addrs}");
    assert_eq!(
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
            .expect("sysctl")
            .trim(),
        "1"
    );
}

#[test]
fn an_attached_port_is_isolated() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    ip(&[
        "link", "add", "etport0", "type", "veth", "peer", "name", "etport1",
    ]);

    underlay
        .attach(&Port {
            tap: "etport0",
            mac: Mac::parse("02:e1:00:00:00:01").expect("mac"),
            ip: Some(Ipv4Addr::new(100, 77, 0, 9)),
        })
        .expect("attach");

    let detail = String::from_utf8_lossy(
        &Command::new("ip")
            .args(["-d", "link", "show", "etport0"])
            .output()
            .expect("ip")
            .stdout,
    )
    .into_owned();
    assert!(detail.contains("master etbr0"), "{detail}");
    assert!(detail.contains("isolated on"), "{detail}");
    assert!(detail.contains(",UP"), "{detail}");
}

#[test]
fn a_port_that_cannot_join_names_the_ip_command_it_stands_for() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");

    let err = underlay
        .attach(&Port {
            tap: "etgone0",
            mac: Mac::parse("02:e1:00:00:00:01").expect("mac"),
            ip: Some(Ipv4Addr::new(100, 77, 0, 9)),
        })
        .expect_err("no such link");

    assert!(
        err.to_string()
            .contains("ip link set dev etgone0 master etbr0 up"),
        "{err}"
    );
    assert!(err.to_string().contains("etgone0"), "{err}");
}

/// Guest A's address, as the agent would allocate it.
pub(crate) const GUEST_IP: Ipv4Addr = Ipv4Addr::new(100, 77, 5, 5);

/// A guest namespace behind a bridge port (as a VM behind its tap), its
/// port guarded to its MAC and address.
fn add_guest(underlay: &Underlay, ns: &str, port: &str, mac: &str, address: Ipv4Addr) {
    ip(&["netns", "add", ns]);
    ip(&[
        "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns,
    ]);
    ip(&["-n", ns, "link", "set", "eth0", "address", mac]);
    ip(&["-n", ns, "link", "set", "eth0", "up"]);
    underlay
        .attach(&Port {
            tap: port,
            mac: Mac::parse(mac).expect("mac"),
            ip: Some(address),
        })
        .expect("attach");
}

/// A guest namespace behind a bridge port (as a VM behind its tap) and a
/// "remote" namespace reachable from the host with no route back to the
/// guests. Removed on drop.
pub(crate) struct Topology {
    pub(crate) guest: String,
    pub(crate) remote: String,
    /// A second guest's namespace, made by [`Topology::add_peer`].
    pub(crate) peer: String,
    _cleanup: Namespaces,
}

impl Topology {
    pub(crate) fn new(underlay: &Underlay) -> Topology {
        let tag = format!("{:x}", std::process::id() & 0xffff);
        let (guest, remote) = (format!("etg{tag}"), format!("etr{tag}"));
        let cleanup = Namespaces(vec![guest.clone(), remote.clone(), format!("etp{tag}")]);
        add_guest(underlay, &guest, "etgport", "02:e1:00:00:00:07", GUEST_IP);
        ip(&["netns", "add", &remote]);
        ip(&[
            "link", "add", "etremote", "type", "veth", "peer", "name", "eth0", "netns", &remote,
        ]);
        ip(&["addr", "add", "198.51.100.1/24", "dev", "etremote"]);
        ip(&["link", "set", "etremote", "up"]);
        ip(&[
            "-n",
            &remote,
            "addr",
            "add",
            "198.51.100.2/24",
            "dev",
            "eth0",
        ]);
        ip(&["-n", &remote, "link", "set", "eth0", "up"]);
        Topology {
            guest,
            remote,
            peer: format!("etp{tag}"),
            _cleanup: cleanup,
        }
    }

    /// Guest B, behind port `etgpeer`, with its address set by hand.
    pub(crate) fn add_peer(&self, underlay: &Underlay) {
        add_guest(underlay, &self.peer, "etgpeer", PEER_MAC, PEER_IP);
        configure(&self.peer, PEER_IP);
    }

    /// A script for udhcpc that configures the guest and logs each event.
    fn script(&self, dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
        let (run, events) = (dir.join("configure.sh"), dir.join("events"));
        script(
            &run,
            &format!(
                "case \"$1\" in bound|renew) ip addr flush dev \"$interface\"; ip addr add \"$ip/16\" dev \"$interface\"; ip route replace default via \"$router\" ;; esac\necho \"$1 $ip\" >> {}\n",
                events.display()
            ),
        );
        (run, events)
    }

    fn lease_and_ping(&self) -> bool {
        require("ping");
        let dir = tempfile::tempdir().expect("tempdir");
        let (run, _) = self.script(dir.path());
        let dhcp = udhcpc(&self.guest, "eth0", &run, &[]);
        assert!(
            dhcp.status.success(),
            "no lease: {}",
            String::from_utf8_lossy(&dhcp.stderr)
        );
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.guest,
                "ping",
                "-c",
                "1",
                "-W",
                "3",
                "198.51.100.2",
            ])
            .output()
            .expect("ping")
            .status
            .success()
    }
}

fn responder(address: Ipv4Addr) -> Responder {
    Responder::start("etgport", lease(GUEST_MAC, address)).expect("responder")
}

#[test]
fn a_guest_reaches_a_remote_namespace_through_the_nat() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    let _dhcp = responder(Ipv4Addr::new(100, 77, 5, 5));

    let reached = topology.lease_and_ping();

    assert!(reached, "no reply from {} through the NAT", topology.remote);
}

#[test]
fn a_forward_policy_of_drop_is_handled() {
    private_network();
    // What Docker leaves on a host: iptables FORWARD policy DROP.
    let dropped = tool("iptables")
        .args(["-P", "FORWARD", "DROP"])
        .status()
        .expect("iptables");
    assert!(dropped.success());
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    let _dhcp = responder(Ipv4Addr::new(100, 77, 5, 5));

    let reached = topology.lease_and_ping();

    assert!(reached, "the DROP policy swallowed the guest's traffic");
}

/// Waits until `file` has a line equal to `line`.
fn wait_for_line(file: &std::path::Path, line: &str) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        if text.lines().any(|l| l == line) {
            return;
        }
        assert!(std::time::Instant::now() < until, "no {line:?} in {text:?}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// udhcpc in the background, killed on drop.
struct Client(std::process::Child);

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_renewal_is_acked_and_naked_once_the_address_changed() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    let dir = tempfile::tempdir().expect("tempdir");
    let (script, events) = topology.script(dir.path());
    let first = responder(Ipv4Addr::new(100, 77, 5, 5));
    require("udhcpc");
    let client = Client(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &topology.guest,
                "udhcpc",
                "-i",
                "eth0",
                "-f",
                "-t",
                "5",
                "-T",
                "1",
                "-s",
            ])
            .arg(&script)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("udhcpc"),
    );
    wait_for_line(&events, "bound 100.77.5.5");
    let renew = || {
        // ip netns exec runs udhcpc in place of itself: the child is it.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(client.0.id() as i32),
            nix::sys::signal::Signal::SIGUSR1,
        )
        .expect("SIGUSR1");
    };

    renew();
    wait_for_line(&events, "renew 100.77.5.5");
    drop(first);
    let _second = responder(Ipv4Addr::new(100, 77, 6, 6));
    renew();

    wait_for_line(&events, "bound 100.77.6.6");
}

#[test]
fn without_nft_iptables_does_the_nat() {
    require("iptables");
    let _fakes = without(&["nft"]);
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    let _dhcp = responder(Ipv4Addr::new(100, 77, 5, 5));

    let reached = topology.lease_and_ping();

    assert_eq!(underlay.nat(), Nat::Iptables);
    assert!(
        reached,
        "no reply from {} through iptables' NAT",
        topology.remote
    );
}

#[test]
fn without_nft_and_iptables_guests_reach_the_host_only() {
    let _fakes = without(&["nft", "iptables"]);
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    let _dhcp = responder(Ipv4Addr::new(100, 77, 5, 5));

    let reached_remote = topology.lease_and_ping();
    let reached_host = Command::new("ip")
        .args([
            "netns",
            "exec",
            &topology.guest,
            "ping",
            "-c",
            "1",
            "-W",
            "2",
            "100.77.0.1",
        ])
        .status()
        .expect("ping")
        .success();

    assert_eq!(underlay.nat(), Nat::HostOnly);
    assert!(reached_host, "the guest reaches its gateway on this host");
    assert!(!reached_remote, "and nothing beyond it");
}

// ── what a hostile guest tries ──────────────────────────────────────────

pub(crate) const PEER_MAC: &str = "02:e1:00:00:00:08";
pub(crate) const PEER_IP: Ipv4Addr = Ipv4Addr::new(100, 77, 5, 6);
pub(crate) const REMOTE: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
pub(crate) const GATEWAY: Ipv4Addr = Ipv4Addr::new(100, 77, 0, 1);

/// Gives a guest its address by hand, with the gateway as its route out.
pub(crate) fn configure(ns: &str, address: Ipv4Addr) {
    ip(&[
        "-n",
        ns,
        "addr",
        "add",
        &format!("{address}/16"),
        "dev",
        "eth0",
    ]);
    ip(&["-n", ns, "route", "add", "default", "via", "100.77.0.1"]);
}

fn bridge_mac() -> [u8; 6] {
    PacketSocket::open("etbr0", None).expect("bridge").mac()
}

/// Sends whole frames out of a guest's NIC, as its kernel never would.
pub(crate) fn send_from(ns: &str, frames: &[Vec<u8>]) {
    within(ns, || {
        let nic = PacketSocket::open("eth0", None).expect("packet socket");
        for f in frames {
            nic.send(f).expect("send");
        }
    });
}

/// Whether a TCP connection from namespace `ns` to `to` opens within 1 s.
pub(crate) fn connects(ns: &str, to: SocketAddr) -> bool {
    within(ns, || {
        TcpStream::connect_timeout(&to, Duration::from_secs(1)).is_ok()
    })
}

/// A TCP listener bound in namespace `ns` (it stays there).
pub(crate) fn listen_in(ns: &str, at: Ipv4Addr) -> TcpListener {
    within(ns, || TcpListener::bind((at, 0)).expect("listen"))
}

fn neighbour(ip: Ipv4Addr) -> String {
    let out = tool("ip")
        .args(["neigh", "show", &ip.to_string(), "dev", "etbr0"])
        .output()
        .expect("ip");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn guest_mac() -> [u8; 6] {
    GUEST_MAC
}

#[test]
fn a_forged_arp_leaves_the_hosts_entry_for_another_guest_untouched() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    topology.add_peer(&underlay);
    assert!(
        tool("ping")
            .args(["-c", "1", "-W", "2", &PEER_IP.to_string()])
            .status()
            .expect("ping")
            .success(),
        "the host reaches guest B"
    );
    assert!(neighbour(PEER_IP).contains(PEER_MAC));
    // The kernel lets an ARP reply override an entry a second after it
    // was last updated: wait that out, so only the guard can stop it.
    std::thread::sleep(Duration::from_millis(1200));
    let forged = arp_frame(2, None, (guest_mac(), PEER_IP), (bridge_mac(), GATEWAY));

    send_from(&topology.guest, &[forged.clone(), forged.clone(), forged]);
    std::thread::sleep(Duration::from_millis(200));

    let entry = neighbour(PEER_IP);
    assert!(entry.contains(PEER_MAC), "the host's entry for B: {entry}");
    assert!(
        nft_counter(
            "bridge",
            "eitri_test",
            "prerouting",
            "ARP for another address"
        ) >= 3
    );
}

#[test]
fn a_forged_source_address_never_leaves_the_bridge() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    configure(&topology.guest, GUEST_IP);
    let remote = within(&topology.remote, || {
        let s = UdpSocket::bind((REMOTE, 9999)).expect("bind");
        s.set_read_timeout(Some(Duration::from_secs(1)))
            .expect("timeout");
        s
    });
    let datagram = |from: Ipv4Addr| {
        build_frame(
            GUEST_MAC,
            bridge_mac(),
            (from, 5000),
            (REMOTE, 9999),
            b"from a guest",
        )
    };
    let mut buf = [0u8; 64];

    send_from(&topology.guest, &[datagram(Ipv4Addr::new(100, 77, 9, 9))]);
    let forged_arrived = remote.recv_from(&mut buf).is_ok();
    send_from(&topology.guest, &[datagram(GUEST_IP)]);
    let genuine_arrived = remote.recv_from(&mut buf).is_ok();

    assert!(!forged_arrived, "a datagram from a forged source got out");
    assert!(
        genuine_arrived,
        "its own address goes out (the test can tell)"
    );
    assert!(nft_counter("bridge", "eitri_test", "prerouting", "not its address") >= 1);
}

#[test]
fn a_guest_cannot_reach_a_listener_on_the_hosts_address() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    configure(&topology.guest, GUEST_IP);
    // The host's own address on its "LAN" (the link to the remote).
    let sshd = TcpListener::bind((Ipv4Addr::new(198, 51, 100, 1), 0)).expect("listen");
    let gateway = TcpListener::bind((GATEWAY, 0)).expect("listen");

    let reached_lan_address = connects(&topology.guest, sshd.local_addr().expect("addr"));
    let reached_gateway = connects(&topology.guest, gateway.local_addr().expect("addr"));

    assert!(!reached_lan_address);
    assert!(!reached_gateway);
    assert!(
        nft_counter(
            "ip",
            "eitri_test",
            "input",
            "a guest reaching into this host"
        ) >= 2
    );
}

#[test]
fn a_guests_dhcp_packet_to_another_host_address_is_dropped() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    configure(&topology.guest, GUEST_IP);

    // Port 67 of the host's LAN address: a DHCP server there is not the
    // agent's, and a guest has no business with it.
    within(&topology.guest, || {
        let socket = std::net::UdpSocket::bind((GUEST_IP, 0)).expect("bind");
        socket
            .send_to(b"not really dhcp", (Ipv4Addr::new(198, 51, 100, 1), 67))
            .expect("send");
    });

    let until = std::time::Instant::now() + Duration::from_secs(5);
    let dropped = || {
        nft_counter(
            "ip",
            "eitri_test",
            "input",
            "a guest reaching into this host",
        )
    };
    while dropped() < 1 && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(dropped() >= 1, "the packet was not dropped");
}

#[test]
fn a_guest_cannot_reach_link_local_metadata_but_reaches_the_remote() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    configure(&topology.guest, GUEST_IP);
    let metadata = Ipv4Addr::new(169, 254, 169, 254);
    ip(&[
        "-n",
        &topology.remote,
        "addr",
        "add",
        "169.254.169.254/32",
        "dev",
        "eth0",
    ]);
    ip(&["route", "add", "169.254.169.254/32", "via", "198.51.100.2"]);
    let service = listen_in(&topology.remote, metadata);
    let remote = listen_in(&topology.remote, REMOTE);

    let reached_metadata = connects(&topology.guest, service.local_addr().expect("addr"));
    let reached_remote = connects(&topology.guest, remote.local_addr().expect("addr"));

    assert!(!reached_metadata, "169.254.169.254 is not for guests");
    assert!(reached_remote, "the remote is reached through the NAT");
}

#[test]
fn a_denied_range_is_refused_and_an_allowed_host_in_it_is_not() {
    private_network();
    let mut cfg = underlay_config();
    cfg.egress.deny = vec![Cidr::parse("203.0.113.0/24").expect("cidr")];
    cfg.egress.allow = vec![Cidr::parse("203.0.113.20").expect("cidr")];
    let underlay = Underlay::setup(cfg).expect("setup");
    let topology = Topology::new(&underlay);
    configure(&topology.guest, GUEST_IP);
    for host in ["203.0.113.10/32", "203.0.113.20/32"] {
        ip(&["-n", &topology.remote, "addr", "add", host, "dev", "eth0"]);
    }
    ip(&["route", "add", "203.0.113.0/24", "via", "198.51.100.2"]);
    let denied = listen_in(&topology.remote, Ipv4Addr::new(203, 0, 113, 10));
    let allowed = listen_in(&topology.remote, Ipv4Addr::new(203, 0, 113, 20));

    let reached_denied = connects(&topology.guest, denied.local_addr().expect("addr"));
    let reached_allowed = connects(&topology.guest, allowed.local_addr().expect("addr"));

    assert!(!reached_denied);
    assert!(reached_allowed);
}

/// Two remote hosts, 203.0.113.10 and .20, behind the remote namespace;
/// a listener on each.
fn two_remote_hosts(topology: &Topology) -> (TcpListener, TcpListener) {
    for host in ["203.0.113.10/32", "203.0.113.20/32"] {
        ip(&["-n", &topology.remote, "addr", "add", host, "dev", "eth0"]);
    }
    ip(&["route", "add", "203.0.113.0/24", "via", "198.51.100.2"]);
    (
        listen_in(&topology.remote, Ipv4Addr::new(203, 0, 113, 10)),
        listen_in(&topology.remote, Ipv4Addr::new(203, 0, 113, 20)),
    )
}

fn egress(deny: &str, allow: &str) -> Egress {
    Egress {
        deny: Cidr::parse_list(deny).expect("deny"),
        allow: Cidr::parse_list(allow).expect("allow"),
    }
}

fn reaches(ns: &str, listener: &TcpListener) -> bool {
    connects(ns, listener.local_addr().expect("addr"))
}

#[test]
fn a_vms_own_deny_list_applies_to_its_running_guest_and_is_reversed_in_one_change() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    configure(&topology.guest, GUEST_IP);
    let (a, b) = two_remote_hosts(&topology);
    let (deny_a, deny_b) = (egress("203.0.113.10", ""), egress("203.0.113.20", ""));
    underlay
        .set_egress(GUEST_IP, &Egress::default(), &deny_a)
        .expect("deny a");
    let before = (reaches(&topology.guest, &a), reaches(&topology.guest, &b));

    underlay
        .set_egress(GUEST_IP, &deny_a, &deny_b)
        .expect("deny b instead");

    let after = (reaches(&topology.guest, &a), reaches(&topology.guest, &b));
    assert_eq!(before, (false, true));
    assert_eq!(after, (true, false));
}

#[test]
fn a_deny_everything_with_exceptions_is_an_allow_list() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    configure(&topology.guest, GUEST_IP);
    let (a, b) = two_remote_hosts(&topology);
    let plain = listen_in(&topology.remote, Ipv4Addr::new(198, 51, 100, 2));

    underlay
        .set_egress(
            GUEST_IP,
            &Egress::default(),
            &egress("0.0.0.0/0, 10.0.0.0/8", "203.0.113.20"),
        )
        .expect("allow-list");

    assert!(!reaches(&topology.guest, &a));
    assert!(reaches(&topology.guest, &b));
    assert!(!reaches(&topology.guest, &plain));
}

#[test]
fn a_vms_own_allow_cannot_open_what_the_host_denies() {
    private_network();
    let mut cfg = underlay_config();
    cfg.egress.deny = vec![Cidr::parse("203.0.113.0/24").expect("cidr")];
    let underlay = Underlay::setup(cfg).expect("setup");
    let topology = Topology::new(&underlay);
    configure(&topology.guest, GUEST_IP);
    let (a, _) = two_remote_hosts(&topology);

    underlay
        .set_egress(
            GUEST_IP,
            &Egress::default(),
            &egress("0.0.0.0/0", "203.0.113.10"),
        )
        .expect("rules");

    assert!(!reaches(&topology.guest, &a));
}

#[test]
fn a_range_denied_while_a_connection_to_it_is_open_cuts_it() {
    use std::io::{Read, Write};
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    configure(&topology.guest, GUEST_IP);
    let (a, _) = two_remote_hosts(&topology);
    let to = a.local_addr().expect("addr");
    let mut conn = within(&topology.guest, || {
        TcpStream::connect_timeout(&to, Duration::from_secs(1)).expect("open")
    });
    let (mut far, _) = a.accept().expect("accept");
    far.set_read_timeout(Some(Duration::from_secs(1)))
        .expect("timeout");
    conn.write_all(b"before").expect("write");
    let mut got = [0u8; 6];
    far.read_exact(&mut got).expect("read before");

    underlay
        .set_egress(GUEST_IP, &Egress::default(), &egress("203.0.113.0/24", ""))
        .expect("deny");
    conn.write_all(b"after!").expect("write is buffered");

    assert_eq!(&got, b"before");
    assert!(far.read(&mut got).is_err(), "bytes crossed a denied range");
}

#[test]
fn guests_cannot_reach_each_other_through_the_gateway() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    configure(&topology.guest, GUEST_IP);
    topology.add_peer(&underlay);
    let peer = listen_in(&topology.peer, PEER_IP);
    // Each sends to the other by way of the gateway (isolated ports carry
    // nothing between them directly), so only the host's routing could
    // join them.
    for (ns, other) in [
        (&topology.guest, "100.77.5.6/32"),
        (&topology.peer, "100.77.5.5/32"),
    ] {
        ip(&["-n", ns, "route", "add", other, "via", "100.77.0.1"]);
    }

    let reached = connects(&topology.guest, peer.local_addr().expect("addr"));

    assert!(!reached);
}

#[test]
fn an_agent_tap_without_a_guard_carries_nothing() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    configure(&topology.guest, GUEST_IP);
    underlay
        .unguard(&Port {
            tap: "etgport",
            mac: Mac::from(GUEST_MAC),
            ip: Some(GUEST_IP),
        })
        .expect("unguard");

    let reached = tool("ip")
        .args([
            "netns",
            "exec",
            &topology.guest,
            "ping",
            "-c",
            "1",
            "-W",
            "1",
            "100.77.0.1",
        ])
        .status()
        .expect("ping")
        .success();

    assert!(!reached);
    assert!(!nft_table_bridge().contains("\"etgport\""));
}

fn nft_table_bridge() -> String {
    let out = tool("nft")
        .args(["list", "table", "bridge", "eitri_test"])
        .output()
        .expect("nft");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A router advertisement from `mac` (link-local `fe80::<low 4 bytes>`)
/// offering itself as the default router for 30 minutes.
fn router_advertisement(mac: [u8; 6]) -> Vec<u8> {
    let mut src = [0u8; 16];
    src[..2].copy_from_slice(&[0xfe, 0x80]);
    src[12..].copy_from_slice(&mac[2..]);
    let mut dst = [0u8; 16];
    dst[..2].copy_from_slice(&[0xff, 0x02]);
    dst[15] = 1;
    // Type 134, code 0, checksum, hop limit 64, no flags, lifetime 1800 s,
    // reachable and retransmit times unspecified.
    let mut icmp = vec![134, 0, 0, 0, 64, 0, 0x07, 0x08, 0, 0, 0, 0, 0, 0, 0, 0];
    let mut sum: u32 = 0;
    let mut add = |bytes: &[u8]| {
        for pair in bytes.chunks(2) {
            sum += u32::from(u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]));
        }
    };
    add(&src);
    add(&dst);
    add(&(icmp.len() as u32).to_be_bytes());
    add(&[0, 0, 0, 58]);
    add(&icmp);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    icmp[2..4].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    let mut f = vec![0x33, 0x33, 0, 0, 0, 1];
    f.extend_from_slice(&mac);
    f.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
    f.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
    f.extend_from_slice(&[58, 255]);
    f.extend_from_slice(&src);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&icmp);
    f
}

#[test]
fn a_guests_router_advertisement_gives_the_host_no_route() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    // As on a host that takes router advertisements on the bridge.
    std::fs::write("/proc/sys/net/ipv6/conf/etbr0/accept_ra", "2").expect("accept_ra");
    std::fs::write("/proc/sys/net/ipv6/conf/etbr0/forwarding", "0").expect("forwarding");

    send_from(&topology.guest, &[router_advertisement(GUEST_MAC)]);
    std::thread::sleep(Duration::from_millis(300));

    let routes = tool("ip")
        .args(["-6", "route", "show", "default"])
        .output()
        .expect("ip");
    let routes = String::from_utf8_lossy(&routes.stdout);
    assert!(routes.trim().is_empty(), "{routes}");
    assert!(nft_counter("bridge", "eitri_test", "prerouting", "IPv6 is not served") >= 1);
}

#[test]
fn guard_elements_made_by_netlink_read_back_as_nft_writes_them() {
    private_network();
    let _underlay = Underlay::setup(underlay_config()).expect("setup");
    let port = Port {
        tap: "etnl0",
        mac: Mac::parse("02:e1:00:00:00:2a").expect("mac"),
        ip: Some(Ipv4Addr::new(100, 77, 0, 42)),
    };

    eitri_agent::net::nftables::add("eitri_test", &port).expect("added by netlink");

    let listed = nft_table_bridge();
    assert!(listed.contains("\"etnl0\" . 02:e1:00:00:00:2a"), "{listed}");
    assert!(listed.contains("\"etnl0\" . 100.77.0.42"), "{listed}");
    eitri_agent::net::nftables::remove("eitri_test", &port).expect("removed by netlink");
    eitri_agent::net::nftables::remove("eitri_test", &port).expect("absent is no error");
    assert!(!nft_table_bridge().contains("etnl0"));
}

#[test]
fn a_sleepers_tap_made_by_netlink_reads_back_in_the_asleep_set() {
    private_network();
    let _underlay = Underlay::setup(underlay_config()).expect("setup");

    eitri_agent::net::nftables::asleep("eitri_test", "etsl0", true).expect("added by netlink");

    let listed = eitri_agent::testkit::net::nft_set_elements("asleep");
    assert!(listed.contains("\"etsl0\""), "{listed}");
    eitri_agent::net::nftables::asleep("eitri_test", "etsl0", false).expect("removed by netlink");
    eitri_agent::net::nftables::asleep("eitri_test", "etsl0", false).expect("absent is no error");
    assert!(!eitri_agent::testkit::net::nft_set_elements("asleep").contains("etsl0"));
}

#[test]
fn the_host_holds_an_attached_guests_address_to_its_mac_while_other_ports_come_and_go() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    ip(&[
        "link", "add", "etport0", "type", "veth", "peer", "name", "etport1",
    ]);
    underlay
        .attach(&Port {
            tap: "etport0",
            mac: Mac::parse("02:e1:00:00:00:01").expect("mac"),
            ip: Some(Ipv4Addr::new(100, 77, 0, 9)),
        })
        .expect("attach");

    // A port with a lower MAC than any: a bridge left to itself takes it,
    // and flushes what it knew of its neighbours.
    ip(&[
        "link", "add", "etport2", "type", "veth", "peer", "name", "etport3",
    ]);
    ip(&["link", "set", "etport2", "address", "00:00:00:00:00:01"]);
    ip(&["link", "set", "etport2", "master", "etbr0", "up"]);

    let neigh = String::from_utf8_lossy(
        &Command::new("ip")
            .args(["neigh", "show", "dev", "etbr0"])
            .output()
            .expect("ip")
            .stdout,
    )
    .into_owned();
    assert!(
        neigh.contains("100.77.0.9 lladdr 02:e1:00:00:00:01 PERMANENT"),
        "{neigh}"
    );
}
