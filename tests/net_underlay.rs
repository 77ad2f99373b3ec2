//! The underlay in a network namespace of the test's own: each test
//! unshares one first (nextest runs each test in its own process), so the
//! bridge, the nft table and the forwarding switch it sets never touch the
//! host's. Named namespaces it adds for a guest and a "remote" are removed.

use std::net::Ipv4Addr;
use std::process::Command;

use eitri_agent::net::addresses::Subnet;
use eitri_agent::net::dhcp::{Lease, Responder};
use eitri_agent::net::underlay::{Nat, Underlay, UnderlayConfig};

const GUEST_MAC: [u8; 6] = [0x02, 0xe1, 0, 0, 0, 0x07];

fn private_network() {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
        .expect("unshare a network namespace (needs root)");
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn config() -> UnderlayConfig {
    UnderlayConfig {
        bridge: "etbr0".into(),
        subnet: Subnet::parse("100.77.0.0/16").expect("subnet"),
        table: "eitri_test".into(),
    }
}

fn nft_table() -> String {
    let out = Command::new("nft")
        .args(["list", "table", "ip", "eitri_test"])
        .output()
        .expect("nft");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Named namespaces, deleted on drop.
struct Namespaces(Vec<String>);

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

#[test]
fn nat_applied_twice_is_what_applying_it_once_left() {
    private_network();
    Underlay::setup(config()).expect("first");
    let once = nft_table();

    let second = Underlay::setup(config()).expect("second");

    assert_eq!(second.nat(), Nat::Nft);
    assert!(once.contains("masquerade"), "{once}");
    assert_eq!(nft_table(), once);
}

#[test]
fn the_bridge_holds_the_gateway_and_forwarding_is_on() {
    private_network();

    Underlay::setup(config()).expect("setup");

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
    let underlay = Underlay::setup(config()).expect("setup");
    ip(&[
        "link", "add", "etport0", "type", "veth", "peer", "name", "etport1",
    ]);

    underlay.attach("etport0").expect("attach");

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

#[test]
fn a_guest_reaches_a_remote_namespace_through_the_nat() {
    private_network();
    let tag = format!("{:x}", std::process::id() & 0xffff);
    let (guest, remote) = (format!("etg{tag}"), format!("etr{tag}"));
    let _cleanup = Namespaces(vec![guest.clone(), remote.clone()]);
    let underlay = Underlay::setup(config()).expect("setup");
    // The guest: a namespace behind a bridge port, as a VM behind its tap.
    ip(&["netns", "add", &guest]);
    ip(&[
        "link", "add", "etgport", "type", "veth", "peer", "name", "eth0", "netns", &guest,
    ]);
    ip(&[
        "-n",
        &guest,
        "link",
        "set",
        "eth0",
        "address",
        "02:e1:00:00:00:07",
    ]);
    ip(&["-n", &guest, "link", "set", "eth0", "up"]);
    underlay.attach("etgport").expect("attach");
    // The remote: reachable from this host, with no route back to guests.
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
    let _dhcp = Responder::start(
        "etgport",
        Lease {
            mac: GUEST_MAC,
            ip: Ipv4Addr::new(100, 77, 5, 5),
            netmask: Ipv4Addr::new(255, 255, 0, 0),
            gateway: Ipv4Addr::new(100, 77, 0, 1),
            dns: vec![],
            lease_secs: 3600,
        },
    )
    .expect("responder");
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("configure.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\ncase \"$1\" in bound) ip addr add \"$ip/16\" dev \"$interface\"; ip route add default via \"$router\" ;; esac\n",
    )
    .expect("script");
    Command::new("chmod")
        .arg("+x")
        .arg(&script)
        .status()
        .expect("chmod");
    let dhcp = Command::new("ip")
        .args([
            "netns", "exec", &guest, "udhcpc", "-i", "eth0", "-f", "-q", "-n", "-t", "3", "-T",
            "1", "-s",
        ])
        .arg(&script)
        .output()
        .expect("udhcpc");
    assert!(
        dhcp.status.success(),
        "no lease: {}",
        String::from_utf8_lossy(&dhcp.stderr)
    );

    let ping = Command::new("ip")
        .args([
            "netns",
            "exec",
            &guest,
            "ping",
            "-c",
            "1",
            "-W",
            "3",
            "198.51.100.2",
        ])
        .output()
        .expect("ping");

    assert!(
        ping.status.success(),
        "{}",
        String::from_utf8_lossy(&ping.stdout)
    );
}
