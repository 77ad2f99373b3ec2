//! Published ports through the underlay's own table: a connection to a
//! port of the host reaches the guest's port, from a remote namespace,
//! from another guest and from the host itself; what is removed reaches
//! nothing.

// Linux only: namespaces, the bridge and nft.
#![cfg(target_os = "linux")]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::Duration;

use eitri_agent::model::{Publish, Transport};
use eitri_agent::net::underlay::Underlay;
use eitri_agent::testkit::net::{nft_counter, private_network, underlay_config, within};

use super::underlay::{
    GATEWAY, GUEST_IP, PEER_IP, REMOTE, Topology, configure, connects, listen_in,
};

/// The host's address on the remote's link.
pub(crate) const HOST_ON_REMOTE: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);

/// The underlay with the guest configured, listening; its port published
/// as host port 30080.
pub(crate) fn published() -> (Underlay, Topology, TcpListener) {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    configure(&topology.guest, GUEST_IP);
    let listener = listen_in(&topology.guest, GUEST_IP);
    let guest_port = listener.local_addr().expect("addr").port();
    underlay
        .publish(
            None,
            Some(&(GUEST_IP, vec![Publish::tcp(30080, guest_port)])),
        )
        .expect("publish");
    // As the host network leaves the port of a VM that publishes.
    underlay.isolate("etgport", false).expect("isolation off");
    (underlay, topology, listener)
}

/// Connects from namespace `ns` (or the host, with `None`) to `to`, and
/// returns the client address the guest's listener saw, or `None` when
/// the connection did not open within 1 s.
pub(crate) fn seen_by_guest(
    ns: Option<&str>,
    to: SocketAddr,
    listener: &TcpListener,
) -> Option<Ipv4Addr> {
    let connect = || {
        let mut stream = TcpStream::connect_timeout(&to, Duration::from_secs(1)).ok()?;
        stream.write_all(b"hi").ok()?;
        Some(stream)
    };
    let _stream = match ns {
        Some(ns) => within(ns, connect)?,
        None => connect()?,
    };
    listener.set_nonblocking(false).ok()?;
    let (mut served, peer) = listener.accept().ok()?;
    let mut said = [0u8; 2];
    served.read_exact(&mut said).ok()?;
    assert_eq!(&said, b"hi");
    match peer {
        SocketAddr::V4(v4) => Some(*v4.ip()),
        SocketAddr::V6(_) => None,
    }
}

#[test]
fn a_published_port_reaches_the_guest_from_a_remote_host_keeping_its_address() {
    let (_underlay, topology, listener) = published();

    let seen = seen_by_guest(
        Some(&topology.remote),
        (HOST_ON_REMOTE, 30080).into(),
        &listener,
    );

    assert_eq!(seen, Some(REMOTE));
}

#[test]
fn a_published_port_reaches_the_guest_from_another_guest() {
    let (underlay, topology, listener) = published();
    topology.add_peer(&underlay);

    let seen = seen_by_guest(Some(&topology.peer), (GATEWAY, 30080).into(), &listener);

    // Answered through the host: the bridge carries nothing between
    // guests directly.
    assert_eq!(seen, Some(GATEWAY));
}

#[test]
fn a_guest_that_publishes_a_port_is_still_unreachable_from_another_guest_directly() {
    let (underlay, topology, listener) = published();
    topology.add_peer(&underlay);
    // On the bridge's link, as a guest that ignores its router would.
    let direct = listener.local_addr().expect("addr");

    let reached = connects(&topology.peer, direct);

    assert!(!reached, "a guest reached another's port without the host");
    let dropped = nft_counter(
        "bridge",
        "eitri_test",
        "forward",
        "guest to guest, to a port the kernel does not isolate",
    );
    assert!(dropped > 0, "dropped by the bridge table: {dropped}");
}

#[test]
fn a_published_port_reaches_the_guest_from_the_host_itself() {
    let (_underlay, _topology, listener) = published();

    let seen = seen_by_guest(None, (HOST_ON_REMOTE, 30080).into(), &listener);

    assert!(
        seen.is_some(),
        "the host's own connection did not reach the guest"
    );
}

#[test]
fn a_port_on_one_host_address_is_not_published_on_another() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    configure(&topology.guest, GUEST_IP);
    let listener = listen_in(&topology.guest, GUEST_IP);
    let on_gateway = Publish {
        host_address: Some(GATEWAY),
        ..Publish::tcp(30080, listener.local_addr().expect("addr").port())
    };
    underlay
        .publish(None, Some(&(GUEST_IP, vec![on_gateway])))
        .expect("publish");

    let reached = connects(&topology.remote, (HOST_ON_REMOTE, 30080).into());

    assert!(!reached);
}

#[test]
fn a_port_no_longer_published_reaches_nothing() {
    let (underlay, topology, listener) = published();
    let list = vec![Publish::tcp(
        30080,
        listener.local_addr().expect("addr").port(),
    )];

    underlay
        .publish(Some(&(GUEST_IP, list)), Some(&(GUEST_IP, Vec::new())))
        .expect("unpublish");

    assert!(!connects(&topology.remote, (HOST_ON_REMOTE, 30080).into()));
}

#[test]
fn publishing_leaves_guests_unreachable_on_their_own_ports() {
    let (_underlay, topology, listener) = published();

    let direct = connects(&topology.remote, listener.local_addr().expect("addr"));

    assert!(
        !direct,
        "a remote reached the guest's port without a published one"
    );
}

/// A UDP socket bound in namespace `ns` at `at:port`, its reads bounded.
fn udp_in(ns: &str, at: Ipv4Addr, port: u16) -> UdpSocket {
    let socket = within(ns, || UdpSocket::bind((at, port)).expect("bind"));
    socket
        .set_read_timeout(Some(Duration::from_secs(1)))
        .expect("timeout");
    socket
}

/// What `socket` received within a second, if anything.
fn received(socket: &UdpSocket) -> Option<Vec<u8>> {
    let mut buf = [0u8; 64];
    let (n, _) = socket.recv_from(&mut buf).ok()?;
    Some(buf[..n].to_vec())
}

#[test]
fn a_udp_flow_follows_a_port_moved_to_another_guest() {
    private_network();
    let underlay = Underlay::setup(underlay_config()).expect("setup");
    let topology = Topology::new(&underlay);
    configure(&topology.guest, GUEST_IP);
    topology.add_peer(&underlay);
    let (a, b) = (
        udp_in(&topology.guest, GUEST_IP, 5353),
        udp_in(&topology.peer, PEER_IP, 5353),
    );
    let port = vec![Publish {
        transport: Transport::Udp,
        host_port: 30053,
        guest_port: 5353,
        host_address: None,
    }];
    underlay
        .publish(None, Some(&(GUEST_IP, port.clone())))
        .expect("publish to A");
    underlay.isolate("etgport", false).expect("isolation off");
    // One flow: the same source port throughout, as a DNS or game client.
    let client = udp_in(&topology.remote, REMOTE, 40053);
    client
        .send_to(b"one", (HOST_ON_REMOTE, 30053))
        .expect("send");
    assert_eq!(received(&a).as_deref(), Some(&b"one"[..]), "A first");

    underlay
        .publish(Some(&(GUEST_IP, port.clone())), None)
        .expect("take it from A");
    underlay
        .publish(None, Some(&(PEER_IP, port)))
        .expect("give it to B");
    underlay.isolate("etgpeer", false).expect("isolation off");
    client
        .send_to(b"two", (HOST_ON_REMOTE, 30053))
        .expect("send");

    assert_eq!(received(&b).as_deref(), Some(&b"two"[..]), "B now");
    assert_eq!(received(&a), None, "A still got the flow");
}
