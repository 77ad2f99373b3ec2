//! The DHCP responder against a real client, busybox udhcpc, in network
//! namespaces the tests make; and against a raw client for floods and
//! garbage. Names are test-only and removed afterwards.

// Linux only: it drives Linux-only parts (namespaces, taps, /proc, the
// cloud-hypervisor backend or its stand-in).
#![cfg(target_os = "linux")]

use std::net::Ipv4Addr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use eitri_agent::model::Mac;
use eitri_agent::net::dhcp::Responder;
use eitri_agent::net::dhcp::codec::{Kind, build_frame};
use eitri_agent::net::packet::PacketSocket;
use eitri_agent::testkit::net::{
    Namespaces, client_frame, ip, lease, private_network, script, udhcpc,
};

pub(crate) const GUEST_MAC: [u8; 6] = [0x02, 0xe1, 0x00, 0x00, 0x00, 0x01];
pub(crate) const VM_IP: Ipv4Addr = Ipv4Addr::new(100, 77, 3, 9);

/// A namespace with a veth into it, the guest end carrying `guest_mac`.
struct Wire {
    host: String,
    ns: Namespaces,
}

impl Wire {
    fn new(tag: &str, guest_mac: [u8; 6]) -> Wire {
        let id = format!("{:x}{tag}", std::process::id() & 0xffff);
        let (ns, host) = (format!("etdh{id}"), format!("etdh{id}h"));
        ip(&["netns", "add", &ns]);
        ip(&[
            "link", "add", &host, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        ip(&[
            "-n",
            &ns,
            "link",
            "set",
            "eth0",
            "address",
            &Mac::from(guest_mac).to_string(),
        ]);
        ip(&["link", "set", &host, "up"]);
        ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        Wire {
            host,
            ns: Namespaces(vec![ns]),
        }
    }

    /// What udhcpc's script saw, one line per event, or None with no lease.
    fn lease(&self, extra: &[&str]) -> Option<String> {
        let dir = tempfile::tempdir().expect("tempdir");
        let (events, run) = (dir.path().join("events"), dir.path().join("script.sh"));
        script(
            &run,
            &format!(
                "case \"$1\" in bound|renew) echo \"$1 ip=$ip router=$router dns=$dns subnet=$subnet\" >> {} ;; esac\n",
                events.display()
            ),
        );
        let out = udhcpc(&self.ns.0[0], "eth0", &run, extra);
        out.status
            .success()
            .then(|| std::fs::read_to_string(&events).unwrap_or_default())
    }
}

impl Drop for Wire {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.host])
            .output();
    }
}

#[test]
fn udhcpc_gets_exactly_the_vms_address_gateway_and_dns() {
    let wire = Wire::new("a", GUEST_MAC);
    let _responder = Responder::start(&wire.host, lease(GUEST_MAC, VM_IP)).expect("responder");

    let got = wire.lease(&[]).expect("a lease");

    // udhcpc checks IP and UDP checksums: a lease at all means they hold.
    assert!(
        got.contains("bound ip=100.77.3.9 router=100.77.0.1 dns=100.77.0.1 subnet=255.255.0.0"),
        "{got}"
    );
}

#[test]
fn asking_for_the_vms_address_again_is_acked() {
    let wire = Wire::new("r", GUEST_MAC);
    let responder = Responder::start(&wire.host, lease(GUEST_MAC, VM_IP)).expect("responder");

    let got = wire.lease(&["-r", "100.77.3.9"]).expect("a lease");

    assert!(got.contains("ip=100.77.3.9"), "{got}");
    assert_eq!(responder.stats().naks.load(Ordering::Relaxed), 0);
}

#[test]
fn a_duid_client_id_still_gets_the_macs_address() {
    let wire = Wire::new("d", GUEST_MAC);
    let _responder = Responder::start(&wire.host, lease(GUEST_MAC, VM_IP)).expect("responder");

    let got = wire
        .lease(&["-x", "0x3d:ff00000001000100010203040506"])
        .expect("a lease");

    assert!(got.contains("ip=100.77.3.9"), "{got}");
}

#[test]
fn another_mac_gets_nothing_from_this_vms_responder() {
    let wire = Wire::new("o", [0x02, 0xe1, 0, 0, 0, 0x99]);
    let responder = Responder::start(&wire.host, lease(GUEST_MAC, VM_IP)).expect("responder");

    let got = wire.lease(&[]);

    assert_eq!(got, None);
    assert_eq!(responder.stats().answered.load(Ordering::Relaxed), 0);
}

/// A veth pair in this test's own namespace: the responder on one end, a
/// raw client with the lease's MAC on the other.
pub(crate) fn private_pair() -> PacketSocket {
    private_network();
    ip(&[
        "link", "add", "etfh", "type", "veth", "peer", "name", "etfc",
    ]);
    ip(&[
        "link",
        "set",
        "etfc",
        "address",
        &Mac::from(GUEST_MAC).to_string(),
    ]);
    ip(&["link", "set", "etfh", "up"]);
    ip(&["link", "set", "etfc", "up"]);
    PacketSocket::open("etfc", Some(Duration::from_millis(100))).expect("client socket")
}

fn settle_until(what: &str, done: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_guest_flooding_dhcp_is_rate_limited() {
    let client = private_pair();
    let responder = Responder::start("etfh", lease(GUEST_MAC, VM_IP)).expect("responder");

    // A flood to the responder (200 in about 20 ms, where it refills 10
    // answers a second), paced just enough that no frame is lost in the
    // socket's receive buffer: this counts answers, not drops.
    for xid in 0..200 {
        client
            .send(&client_frame(GUEST_MAC, Kind::Discover, xid, None))
            .expect("send");
        std::thread::sleep(Duration::from_micros(100));
    }
    settle_until("every request to be seen", || {
        responder.stats().requests.load(Ordering::Relaxed) == 200
    });

    let answered = responder.stats().answered.load(Ordering::Relaxed);
    assert!(
        answered < 40,
        "a burst of 20 plus what refills while sending; got {answered}"
    );
    assert!(responder.stats().rate_limited.load(Ordering::Relaxed) >= 160);
}

#[test]
fn malformed_packets_are_counted_and_dropped() {
    let client = private_pair();
    let responder = Responder::start("etfh", lease(GUEST_MAC, VM_IP)).expect("responder");
    let garbage = build_frame(
        GUEST_MAC,
        [0xff; 6],
        (Ipv4Addr::UNSPECIFIED, 68),
        (Ipv4Addr::BROADCAST, 67),
        b"not a dhcp message at all",
    );

    for _ in 0..5 {
        client.send(&garbage).expect("send");
    }
    settle_until("the garbage to be seen", || {
        responder.stats().malformed.load(Ordering::Relaxed) == 5
    });

    assert_eq!(responder.stats().answered.load(Ordering::Relaxed), 0);
}

#[test]
fn a_dhcp_socket_is_woken_by_dhcp_alone() {
    // What a guest flooding its tap sends, then one DHCP frame.
    let client = private_pair();
    let dhcp_only =
        PacketSocket::open_dhcp("etfh", Some(Duration::from_millis(100))).expect("a DHCP socket");
    let other_udp = build_frame(
        GUEST_MAC,
        [0xff; 6],
        (VM_IP, 4000),
        (Ipv4Addr::BROADCAST, 4000),
        b"not dhcp",
    );
    let arp = eitri_agent::net::packet::arp_frame(
        1,
        None,
        (GUEST_MAC, VM_IP),
        ([0; 6], Ipv4Addr::new(100, 77, 0, 1)),
    );
    let mut fragment = client_frame(GUEST_MAC, Kind::Discover, 9, None);
    fragment[20] = 0x00;
    fragment[21] = 0x10; // a later fragment, offset 128 bytes
    let discover = client_frame(GUEST_MAC, Kind::Discover, 7, None);

    for frame in [other_udp, arp, fragment, discover.clone()] {
        client.send(&frame).expect("send");
    }

    let mut got = Vec::new();
    let mut buf = vec![0u8; 2048];
    while let Ok(n) = dhcp_only.recv(&mut buf) {
        got.push(buf[..n].to_vec());
    }
    assert_eq!(got, vec![discover]);
}
