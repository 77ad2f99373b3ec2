//! The underlay in a network namespace of the test's own: each test
//! unshares one first (nextest runs each test in its own process), so the
//! bridge, the nft table and the forwarding switch it sets never touch the
//! host's. Named namespaces it adds for a guest and a "remote" are removed.

use std::net::Ipv4Addr;
use std::process::Command;

use eitri_agent::model::Mac;
use eitri_agent::net::dhcp::Responder;
use eitri_agent::net::underlay::{Nat, Port, Underlay};
use eitri_agent::testkit::net::{
    Namespaces, ip, lease, private_network, script, udhcpc, underlay_config,
};
use eitri_agent::testkit::tools::{require, tool};

const GUEST_MAC: [u8; 6] = [0x02, 0xe1, 0, 0, 0, 0x07];

fn nft_table() -> String {
    let out = tool("nft")
        .args(["list", "table", "ip", "eitri_test"])
        .output()
        .expect("nft");
    String::from_utf8_lossy(&out.stdout).into_owned()
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
}

/// Guest A's address, as the agent would allocate it.
const GUEST_IP: Ipv4Addr = Ipv4Addr::new(100, 77, 5, 5);

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
struct Topology {
    guest: String,
    remote: String,
    _cleanup: Namespaces,
}

impl Topology {
    fn new(underlay: &Underlay) -> Topology {
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
            _cleanup: cleanup,
        }
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

/// Puts failing stand-ins for `tools` first on PATH, as if they were not
/// installed. Called first thing in a test, while its process has no other
/// thread (nextest runs each test in its own process).
fn without(tools: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for tool in tools {
        script(&dir.path().join(tool), "exit 127\n");
    }
    let path = format!(
        "{}:{}",
        dir.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // SAFETY: no other thread of this process reads the environment now.
    unsafe { std::env::set_var("PATH", path) };
    dir
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
