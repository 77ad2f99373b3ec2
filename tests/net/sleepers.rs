//! A sleeping guest is as isolated as a running one: another guest's
//! frames (IPv4 of any protocol, ARP) never reach its tap, so they neither
//! wake it nor wait there for it, whether or not the kernel passes bridged
//! frames through the ip and arp tables (`br_netfilter`'s
//! `bridge-nf-call-*`); a connection to a port it publishes still does.

// Linux only: namespaces, the bridge and nft.
#![cfg(target_os = "linux")]

use std::time::{Duration, Instant};

use eitri_agent::net::dhcp::codec::build_frame;
use eitri_agent::net::packet::{PacketSocket, arp_frame};
use eitri_agent::net::underlay::Underlay;
use eitri_agent::testkit::net::within;

use super::publish::{HOST_ON_REMOTE, published, seen_by_guest};
use super::underlay::{GUEST_IP, GUEST_MAC, PEER_IP, PEER_MAC, Topology, send_from};

/// Whether bridged frames are passed through the ip and arp tables, in
/// this test's own network namespace.
fn bridge_netfilter(on: bool) {
    for table in ["iptables", "arptables"] {
        let path = format!("/proc/sys/net/bridge/bridge-nf-call-{table}");
        std::fs::write(&path, if on { "1" } else { "0" }).unwrap_or_else(|e| panic!("{path}: {e}"));
    }
}

/// The publishing guest asleep, its port held as the agent holds a
/// sleeper's, and a second guest beside it, configured.
fn asleep_beside_a_peer(netfilter: bool) -> (Underlay, Topology, std::net::TcpListener) {
    let (underlay, topology, listener) = published();
    bridge_netfilter(netfilter);
    topology.add_peer(&underlay);
    underlay.sleep("etgport", true).expect("asleep");
    (underlay, topology, listener)
}

fn peer_mac() -> [u8; 6] {
    eitri_agent::model::Mac::parse(PEER_MAC)
        .expect("mac")
        .octets()
}

/// A TCP SYN from the peer to `port` of the sleeping guest.
fn syn_to_guest(port: u16) -> Vec<u8> {
    let mut frame = Vec::with_capacity(54);
    frame.extend_from_slice(&GUEST_MAC);
    frame.extend_from_slice(&peer_mac());
    frame.extend_from_slice(&[0x08, 0x00]);
    // IPv4: version 4, 20 bytes, total 40, TTL 64, TCP.
    frame.extend_from_slice(&[0x45, 0, 0, 40, 0, 1, 0x40, 0, 64, 6, 0, 0]);
    frame.extend_from_slice(&PEER_IP.octets());
    frame.extend_from_slice(&GUEST_IP.octets());
    // TCP: ports, sequence, no ack, 20 bytes, SYN, window.
    frame.extend_from_slice(&40000u16.to_be_bytes());
    frame.extend_from_slice(&port.to_be_bytes());
    frame.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0]);
    frame
}

/// How many frames from the peer reach the guest's NIC while `send` runs
/// and for half a second after.
fn peer_frames_reaching_the_guest(topology: &Topology, send: impl FnOnce()) -> usize {
    let nic = within(&topology.guest, || {
        PacketSocket::open("eth0", Some(Duration::from_millis(50))).expect("packet socket")
    });
    send();
    let (until, mut seen, mut buf) = (Instant::now() + Duration::from_millis(500), 0, [0u8; 2048]);
    while Instant::now() < until {
        if let Ok(n) = nic.recv(&mut buf)
            && n >= 12
            && buf[6..12] == peer_mac()
        {
            seen += 1;
        }
    }
    seen
}

fn another_guests_frames_never_reach_a_sleeper(netfilter: bool) {
    let (_underlay, topology, listener) = asleep_beside_a_peer(netfilter);
    let port = listener.local_addr().expect("addr").port();
    let frames = vec![
        syn_to_guest(port),
        build_frame(
            peer_mac(),
            GUEST_MAC,
            (PEER_IP, 5000),
            (GUEST_IP, 5000),
            b"wake",
        ),
        arp_frame(1, None, (peer_mac(), PEER_IP), ([0; 6], GUEST_IP)),
    ];

    let seen = peer_frames_reaching_the_guest(&topology, || send_from(&topology.peer, &frames));

    assert_eq!(seen, 0, "frames of another guest reached the sleeper");
}

#[test]
fn another_guests_tcp_udp_and_arp_never_reach_a_sleeping_publisher() {
    another_guests_frames_never_reach_a_sleeper(false);
}

#[test]
fn another_guests_tcp_udp_and_arp_never_reach_a_sleeping_publisher_with_bridged_netfilter() {
    another_guests_frames_never_reach_a_sleeper(true);
}

#[test]
fn a_connection_to_a_sleepers_published_port_still_reaches_it() {
    let (_underlay, topology, listener) = asleep_beside_a_peer(false);

    let seen = seen_by_guest(
        Some(&topology.remote),
        (HOST_ON_REMOTE, 30080).into(),
        &listener,
    );

    assert_eq!(seen, Some(super::underlay::REMOTE));
}
