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
    client_frame, ip, nft_counter, private_network, script, udhcpc, underlay_config, within,
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
    // The agent's state dir is there before its network is set up.
    std::fs::create_dir_all(state).expect("state dir");
    HostNetwork::setup(
        underlay_config(),
        &eitri_agent::state::Layout::new(state),
        vec![],
        HashMap::from([("site".to_owned(), "etsite".to_owned())]),
    )
    .expect("host network")
}

/// A site bridge with a DHCP server (dnsmasq, 192.0.2.1) behind it, and a
/// guest whose second NIC (`eth1` in its namespace; the host end `etgsnp`, named with the guarded taps' prefix,
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
            "link", "add", "etgsnp", "type", "veth", "peer", "name", "eth1", "netns", &guest_ns,
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
                "etgsnp",
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

    /// Every frame the site's uplink (the server's NIC) receives while
    /// `act` runs, and shortly after.
    fn seen_on_site(&self, act: impl FnOnce()) -> Vec<Vec<u8>> {
        let socket = within(&self.site_ns, || {
            PacketSocket::open("eth0", Some(Duration::from_millis(50))).expect("packet socket")
        });
        act();
        let mut seen = Vec::new();
        let mut buf = vec![0u8; 2048];
        let until = Instant::now() + Duration::from_millis(500);
        while Instant::now() < until {
            if let Ok(n) = socket.recv(&mut buf) {
                seen.push(buf[..n].to_vec());
            }
        }
        seen
    }

    /// Frames sent by another host on the site.
    fn send_as_site_host(&self, frames: &[Vec<u8>]) {
        send(&self.site_ns, "eth0", frames);
    }
}

/// An ARP request from the guest's second NIC claiming `sender`.
fn arp(sender: Ipv4Addr) -> Vec<u8> {
    arp_frame(
        1,
        None,
        (second_mac().octets(), sender),
        ([0; 6], Ipv4Addr::new(192, 0, 2, 1)),
    )
}

/// An ARP reply from the guest telling the site host 192.0.2.50 that
/// `sender` is at the guest's MAC.
fn arp_reply_claiming(sender: Ipv4Addr) -> Vec<u8> {
    arp_frame(
        2,
        None,
        (second_mac().octets(), sender),
        ([0x02, 0xe1, 0, 0, 0, 0x50], Ipv4Addr::new(192, 0, 2, 50)),
    )
}

/// An IPv6 frame from the guest's MAC whose payload is a later fragment
/// (so no rule can read its UDP or ICMPv6 header), carrying `marker`.
fn ipv6_fragment(marker: &[u8]) -> Vec<u8> {
    let mut f = vec![0x33, 0x33, 0, 0, 0, 1];
    f.extend_from_slice(&second_mac().octets());
    f.extend_from_slice(&[0x86, 0xdd]);
    let payload_len = 8 + marker.len() as u16;
    // Version 6, no class or flow; the payload's length; next header 44
    // (fragment); hop limit 64; from fe80::1 to ff02::1.
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&payload_len.to_be_bytes());
    f.extend_from_slice(&[44, 64]);
    f.extend_from_slice(&[0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
    f.extend_from_slice(&[0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
    // The fragment header: next header UDP, offset 8 (a later fragment).
    f.extend_from_slice(&[17, 0, 0x00, 0x08, 0, 0, 0, 1]);
    f.extend_from_slice(marker);
    f
}

/// A UDP frame from the guest's MAC and `src`, to the site broadcast,
/// carrying `marker`.
fn ipv4_from(src: Ipv4Addr, marker: &[u8]) -> Vec<u8> {
    build_frame(
        second_mac().octets(),
        [0xff; 6],
        (src, 4000),
        (Ipv4Addr::new(192, 0, 2, 255), 4000),
        marker,
    )
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
    let granted = site.lease();

    site.send_as_site_host(&[arp(Ipv4Addr::new(192, 0, 2, 99))]);

    assert_eq!(site.network.network_address(second_mac()), Some(granted));
}

#[test]
fn a_release_then_arp_and_traffic_from_the_guest_report_no_address() {
    // What a guest choosing its reported address would send: it gives its
    // lease up, then claims the site gateway's address.
    let site = Site::new();
    let granted = site.lease();
    let release = client_frame(second_mac().octets(), Kind::Release, 0x77, Some(granted));
    let gateway = Ipv4Addr::new(192, 0, 2, 1);

    site.send_as_guest(&[release, arp(gateway), ipv4_from(gateway, b"claim")]);

    assert_eq!(site.network.network_address(second_mac()), None);
}

#[test]
fn a_guest_cannot_spoof_the_site_network_from_its_second_nic() {
    let site = Site::new();
    let granted = site.lease();
    let gateway = Ipv4Addr::new(192, 0, 2, 1);
    // An 802.1ad S-tag, then an 802.1Q C-tag, around an IPv4 frame.
    let mut stagged = ipv4_from(granted, b"s-tagged");
    stagged.splice(12..12, [0x88, 0xa8, 0x00, 0x05, 0x81, 0x00, 0x00, 0x07]);
    let forged = [
        arp_reply_claiming(gateway),
        ipv4_from(gateway, b"from-the-gateway"),
        stagged,
        ipv6_fragment(b"ipv6-fragment"),
    ];
    let honest = ipv4_from(granted, b"honest");

    let seen = site.seen_on_site(|| site.send_as_guest(&[forged.as_slice(), &[honest]].concat()));

    let carries = |marker: &[u8]| {
        seen.iter()
            .any(|f| f.windows(marker.len()).any(|w| w == marker))
    };
    assert!(
        carries(b"honest"),
        "the guest's own traffic reaches the site"
    );
    assert!(
        !carries(b"from-the-gateway"),
        "IPv4 from the gateway's address"
    );
    assert!(!carries(b"s-tagged"), "an 802.1ad-tagged frame");
    assert!(
        !carries(b"ipv6-fragment"),
        "an IPv6 fragment hiding its header"
    );
    let gateway_claim = |f: &Vec<u8>| {
        f.get(12..14) == Some(&[0x08, 0x06]) && f.get(28..32) == Some(&gateway.octets())
    };
    assert!(!seen.iter().any(gateway_claim), "ARP claiming the gateway");
    let counter = |why| nft_counter("bridge", "eitri_test", "prerouting", why);
    assert!(counter("ARP for another address") >= 1);
    assert!(counter("not its address") >= 1);
    assert!(counter("VLAN-tagged (802.1Q, 802.1ad or QinQ)") >= 1);
}

#[test]
fn a_second_nic_sends_nothing_but_dhcp_before_the_site_grants_it_an_address() {
    let site = Site::new();
    let own = Ipv4Addr::new(192, 0, 2, 42);

    let seen = site.seen_on_site(|| site.send_as_guest(&[arp(own), ipv4_from(own, b"static")]));

    assert!(!seen.iter().any(|f| f.windows(6).any(|w| w == b"static")));
    assert!(!seen.iter().any(|f| f.get(12..14) == Some(&[0x08, 0x06])));
    assert_eq!(site.network.network_address(second_mac()), None);
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
