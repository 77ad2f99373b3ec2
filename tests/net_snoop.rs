//! The second NIC: a site DHCP server (dnsmasq, in its own namespace on a
//! named bridge) grants the guest an address; the agent's snooper learns
//! it, and keeps it across a restart. All inside a network namespace this
//! test unshares, so the host's links are never touched.

// Linux only: it drives Linux-only parts (namespaces, taps, /proc, the
// cloud-hypervisor backend or its stand-in).
#![cfg(target_os = "linux")]

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use eitri_agent::model::{Id, Mac};
use eitri_agent::net::dhcp::codec::{Kind, Message, build_frame, option};
use eitri_agent::net::host::HostNetwork;
use eitri_agent::net::packet::{PacketSocket, arp_frame};
use eitri_agent::testkit::net::{
    client_frame, ip, private_network, script, udhcpc, underlay_config, within,
};

const SECOND_MAC: &str = "02:e1:00:00:00:77";

fn second_mac() -> Mac {
    Mac::parse(SECOND_MAC).expect("a MAC")
}

struct Cleanup {
    namespaces: Vec<String>,
    dnsmasq: Option<Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(mut d) = self.dnsmasq.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
        for ns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

fn host_network(state: &std::path::Path) -> HostNetwork {
    HostNetwork::setup(
        underlay_config(),
        &eitri_agent::state::Layout::new(state),
        vec![],
        HashMap::from([("site".to_owned(), "etsite".to_owned())]),
    )
    .expect("host network")
}

/// A site bridge with a DHCP server (dnsmasq, 192.0.2.1) behind it, and a
/// guest whose second NIC (`eth1` in its namespace; the host end `etsnp`
/// plays the tap) is plugged into it. Torn down on drop.
struct Site {
    dir: tempfile::TempDir,
    site_ns: String,
    guest_ns: String,
    network: HostNetwork,
    _cleanup: Cleanup,
}

impl Site {
    fn new() -> Site {
        private_network();
        let tag = format!("{:x}", std::process::id() & 0xffff);
        let (site_ns, guest_ns) = (format!("etdn{tag}"), format!("etgn{tag}"));
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cleanup = Cleanup {
            namespaces: vec![site_ns.clone(), guest_ns.clone()],
            dnsmasq: None,
        };
        ip(&["link", "add", "etsite", "type", "bridge"]);
        ip(&["link", "set", "etsite", "up"]);
        ip(&["netns", "add", &site_ns]);
        ip(&[
            "link", "add", "etdnh", "type", "veth", "peer", "name", "eth0", "netns", &site_ns,
        ]);
        ip(&["link", "set", "etdnh", "master", "etsite"]);
        ip(&["link", "set", "etdnh", "up"]);
        ip(&["-n", &site_ns, "addr", "add", "192.0.2.1/24", "dev", "eth0"]);
        ip(&["-n", &site_ns, "link", "set", "eth0", "up"]);
        eitri_agent::testkit::tools::require("dnsmasq");
        let leases = dir.path().join("dnsmasq.leases");
        cleanup.dnsmasq = Some(
            Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &site_ns,
                    "dnsmasq",
                    "--no-daemon",
                    "--port=0",
                    "--interface=eth0",
                    "--bind-interfaces",
                ])
                .arg("--dhcp-range=192.0.2.50,192.0.2.60,255.255.255.0,1h")
                .arg(format!("--dhcp-leasefile={}", leases.display()))
                .arg(format!(
                    "--pid-file={}",
                    dir.path().join("dnsmasq.pid").display()
                ))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("dnsmasq"),
        );
        ip(&["netns", "add", &guest_ns]);
        ip(&[
            "link", "add", "etsnp", "type", "veth", "peer", "name", "eth1", "netns", &guest_ns,
        ]);
        ip(&[
            "-n", &guest_ns, "link", "set", "eth1", "address", SECOND_MAC,
        ]);
        ip(&["-n", &guest_ns, "link", "set", "eth1", "up"]);
        let network = host_network(&dir.path().join("state"));
        network
            .plug_named(
                &Id::parse("vm-1").expect("id"),
                "site",
                "etsnp",
                second_mac(),
            )
            .expect("plugged");
        Site {
            dir,
            site_ns,
            guest_ns,
            network,
            _cleanup: cleanup,
        }
    }

    fn state(&self) -> std::path::PathBuf {
        self.dir.path().join("state")
    }

    /// The guest asks the site for an address (busybox udhcpc); the one
    /// granted, once the agent has learned it.
    fn lease(&self) -> Ipv4Addr {
        let run = self.dir.path().join("script.sh");
        let granted = self.dir.path().join("granted");
        script(
            &run,
            &format!(
                "[ \"$1\" = bound ] && echo \"$ip\" > {}\nexit 0\n",
                granted.display()
            ),
        );
        let dhcp = udhcpc(&self.guest_ns, "eth1", &run, &[]);
        assert!(
            dhcp.status.success(),
            "the site granted nothing: {}",
            String::from_utf8_lossy(&dhcp.stderr)
        );
        let granted: Ipv4Addr = std::fs::read_to_string(&granted)
            .expect("granted")
            .trim()
            .parse()
            .expect("an address");
        let until = Instant::now() + Duration::from_secs(10);
        while self.network.network_address(second_mac()) != Some(granted) && Instant::now() < until
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        granted
    }

    /// Frames sent out of the guest's NIC, as its kernel never would.
    fn send_as_guest(&self, frames: &[Vec<u8>]) {
        send(&self.guest_ns, "eth1", frames);
    }

    /// Frames sent by another host on the site.
    fn send_as_site_host(&self, frames: &[Vec<u8>]) {
        send(&self.site_ns, "eth0", frames);
    }
}

fn send(ns: &str, nic: &str, frames: &[Vec<u8>]) {
    within(ns, || {
        let socket = PacketSocket::open(nic, None).expect("packet socket");
        for f in frames {
            socket.send(f).expect("send");
        }
    });
    // Long enough for the snooper to have seen them.
    std::thread::sleep(Duration::from_millis(300));
}

/// A BOOTREPLY of `kind` for the guest's second NIC, as `server` would
/// send it.
fn reply(kind: Kind, xid: u32, server: Ipv4Addr, yiaddr: Ipv4Addr, from: [u8; 6]) -> Vec<u8> {
    let m = Message {
        yiaddr,
        options: vec![
            (option::MESSAGE_TYPE, vec![kind.byte()]),
            (option::SERVER_ID, server.octets().to_vec()),
            (option::LEASE_TIME, u32::MAX.to_be_bytes().to_vec()),
        ],
        ..Message::new(2, xid, second_mac().octets())
    };
    build_frame(
        from,
        second_mac().octets(),
        (server, 67),
        (yiaddr, 68),
        &m.encode(),
    )
}

#[test]
fn the_address_the_site_grants_is_learned_and_survives_a_restart() {
    let site = Site::new();

    let granted = site.lease();
    let learned = site.network.network_address(second_mac());
    let state = site.state();
    let Site { network, .. } = site;
    drop(network);
    let restarted = host_network(&state);

    assert_eq!(learned, Some(granted));
    assert_eq!(
        restarted.network_address(second_mac()),
        Some(granted),
        "remembered across a restart"
    );
    assert!(
        (50..=60).contains(&granted.octets()[3]),
        "{granted} from the site's pool"
    );
}

#[test]
fn an_ack_the_guest_forges_changes_nothing_reported() {
    let site = Site::new();
    let granted = site.lease();
    let forged = reply(
        Kind::Ack,
        0x1234,
        Ipv4Addr::new(192, 0, 2, 1),
        Ipv4Addr::new(10, 9, 9, 9),
        second_mac().octets(),
    );

    site.send_as_guest(&[forged]);

    assert_eq!(site.network.network_address(second_mac()), Some(granted));
}

#[test]
fn arp_from_another_site_host_claiming_the_vms_mac_changes_nothing_reported() {
    let site = Site::new();
    // A guest with a static address, learned from its own ARP (no lease,
    // so nothing but the frame's direction tells the claims apart).
    let arp = |sender: Ipv4Addr| {
        arp_frame(
            1,
            None,
            (second_mac().octets(), sender),
            ([0; 6], Ipv4Addr::new(192, 0, 2, 1)),
        )
    };
    let own = Ipv4Addr::new(192, 0, 2, 42);
    site.send_as_guest(&[arp(own)]);
    assert_eq!(site.network.network_address(second_mac()), Some(own));

    site.send_as_site_host(&[arp(Ipv4Addr::new(192, 0, 2, 99))]);

    assert_eq!(site.network.network_address(second_mac()), Some(own));
}

#[test]
fn a_nak_from_a_third_party_changes_nothing_reported() {
    let site = Site::new();
    let granted = site.lease();
    // The guest asks again in a transaction the third party sees (it is
    // broadcast), and the third party answers it first.
    let xid = 0x5eed;
    site.send_as_guest(&[client_frame(
        second_mac().octets(),
        Kind::Request,
        xid,
        Some(granted),
    )]);
    let rogue = reply(
        Kind::Nak,
        xid,
        Ipv4Addr::new(192, 0, 2, 66),
        Ipv4Addr::UNSPECIFIED,
        [0x02, 0xe1, 0, 0, 0, 0x66],
    );

    site.send_as_site_host(&[rogue]);

    assert_eq!(site.network.network_address(second_mac()), Some(granted));
}

#[test]
fn a_thousand_addresses_claimed_by_arp_cause_a_few_writes() {
    let site = Site::new();
    let mac = second_mac().octets();
    let claims: Vec<Vec<u8>> = (0..1000u32)
        .map(|n| {
            arp_frame(
                1,
                None,
                (mac, Ipv4Addr::from(0x0a00_0001 + n)),
                ([0; 6], Ipv4Addr::new(192, 0, 2, 1)),
            )
        })
        .collect();

    site.send_as_guest(&claims);

    assert!(
        site.network.learned_writes() <= 3,
        "{} writes",
        site.network.learned_writes()
    );
}

#[test]
fn an_unknown_host_network_is_a_permanent_error_naming_the_served_ones() {
    private_network();
    let dir = tempfile::tempdir().expect("tempdir");
    ip(&["link", "add", "etsite", "type", "bridge"]);
    let network = host_network(dir.path());

    let err = network
        .plug_named(
            &Id::parse("vm-1").expect("id"),
            "lab",
            "etnope",
            second_mac(),
        )
        .expect_err("unknown");

    assert!(err.is_permanent());
    assert!(
        err.to_string().contains("\"lab\"") && err.to_string().contains("site"),
        "{err}"
    );
}

#[test]
fn tap_names_follow_the_address_so_no_two_vms_share_one() {
    private_network();
    let dir = tempfile::tempdir().expect("tempdir");
    let network = host_network(dir.path());
    let ids: Vec<Id> = (0..300)
        .map(|n| Id::parse(&format!("vm-{n}")).expect("id"))
        .collect();

    let names: Vec<String> = ids
        .iter()
        .map(|id| network.reserve(id).expect("reserve").underlay)
        .collect();

    let distinct: std::collections::HashSet<&String> = names.iter().collect();
    assert_eq!(distinct.len(), names.len());
    for (id, name) in ids.iter().zip(&names) {
        let ip = network.address(id).expect("an address");
        let offset = u32::from(ip) - u32::from(Ipv4Addr::new(100, 77, 0, 0));
        assert_eq!(name, &format!("etg{offset:x}"));
        assert!(name.len() <= 15);
    }
}
