//! The DHCP responder against a real client: busybox udhcpc, in a network
//! namespace the test makes, on a veth whose other end the responder binds
//! (as it binds a VM's tap). Names are test-only and removed afterwards.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::Ordering;

use eitri_agent::net::dhcp::{Lease, Responder};

const GUEST_MAC: [u8; 6] = [0x02, 0xe1, 0x00, 0x00, 0x00, 0x01];

fn mac_text(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A namespace with a veth into it; both removed on drop.
struct Wire {
    ns: String,
    host: String,
    guest: String,
}

impl Wire {
    fn new(tag: &str, guest_mac: [u8; 6]) -> Wire {
        let id = format!("{:x}{tag}", std::process::id() & 0xffff);
        let w = Wire {
            ns: format!("etdh{id}"),
            host: format!("etdh{id}h"),
            guest: format!("etdh{id}g"),
        };
        ip(&["netns", "add", &w.ns]);
        ip(&[
            "link", "add", &w.host, "type", "veth", "peer", "name", &w.guest,
        ]);
        ip(&["link", "set", &w.guest, "netns", &w.ns]);
        ip(&[
            "-n",
            &w.ns,
            "link",
            "set",
            &w.guest,
            "address",
            &mac_text(guest_mac),
        ]);
        ip(&["link", "set", &w.host, "up"]);
        ip(&["-n", &w.ns, "link", "set", &w.guest, "up"]);
        w
    }

    /// Runs udhcpc in the namespace; returns what its script saw, one line
    /// per event, or None when it got no lease.
    fn udhcpc(&self, dir: &Path, extra: &[&str]) -> Option<String> {
        let out = dir.join(format!("leases-{}", extra.len()));
        let script = dir.join("script.sh");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\ncase \"$1\" in bound|renew) echo \"$1 ip=$ip router=$router dns=$dns subnet=$subnet\" >> {} ;; esac\n",
                out.display()
            ),
        )
        .expect("script");
        Command::new("chmod")
            .arg("+x")
            .arg(&script)
            .status()
            .expect("chmod");
        let status = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.ns,
                "udhcpc",
                "-i",
                &self.guest,
                "-f",
                "-q",
                "-n",
                "-t",
                "3",
                "-T",
                "1",
                "-s",
            ])
            .arg(&script)
            .args(extra)
            .output()
            .expect("udhcpc (busybox)");
        status
            .status
            .success()
            .then(|| std::fs::read_to_string(&out).unwrap_or_default())
    }
}

impl Drop for Wire {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.host])
            .output();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
    }
}

fn lease() -> Lease {
    Lease {
        mac: GUEST_MAC,
        ip: Ipv4Addr::new(100, 77, 3, 9),
        netmask: Ipv4Addr::new(255, 255, 0, 0),
        gateway: Ipv4Addr::new(100, 77, 0, 1),
        dns: vec![Ipv4Addr::new(100, 77, 0, 1)],
        lease_secs: 3600,
    }
}

#[test]
fn udhcpc_gets_exactly_the_vms_address_gateway_and_dns() {
    let dir = tempfile::tempdir().expect("tempdir");
    let wire = Wire::new("a", GUEST_MAC);
    let _responder = Responder::start(&wire.host, lease()).expect("responder");

    let got = wire.udhcpc(dir.path(), &[]).expect("a lease");

    assert!(
        got.contains("bound ip=100.77.3.9 router=100.77.0.1 dns=100.77.0.1 subnet=255.255.0.0"),
        "{got}"
    );
}

#[test]
fn asking_for_the_vms_address_again_is_acked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let wire = Wire::new("r", GUEST_MAC);
    let responder = Responder::start(&wire.host, lease()).expect("responder");

    let got = wire
        .udhcpc(dir.path(), &["-r", "100.77.3.9"])
        .expect("a lease");

    assert!(got.contains("ip=100.77.3.9"), "{got}");
    assert_eq!(responder.stats().naks.load(Ordering::Relaxed), 0);
}

#[test]
fn a_duid_client_id_still_gets_the_macs_address() {
    let dir = tempfile::tempdir().expect("tempdir");
    let wire = Wire::new("d", GUEST_MAC);
    let _responder = Responder::start(&wire.host, lease()).expect("responder");

    let got = wire
        .udhcpc(dir.path(), &["-x", "0x3d:ff00000001000100010203040506"])
        .expect("a lease");

    assert!(got.contains("ip=100.77.3.9"), "{got}");
}

#[test]
fn another_mac_gets_nothing_from_this_vms_responder() {
    let dir = tempfile::tempdir().expect("tempdir");
    let wire = Wire::new("o", [0x02, 0xe1, 0, 0, 0, 0x99]);
    let responder = Responder::start(&wire.host, lease()).expect("responder");

    let got = wire.udhcpc(dir.path(), &[]);

    assert_eq!(got, None);
    assert_eq!(responder.stats().answered.load(Ordering::Relaxed), 0);
}

/// A veth pair in a namespace of this test's own: the responder on one
/// end, a raw client (with the lease's MAC) on the other.
fn private_pair() -> eitri_agent::net::packet::PacketSocket {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare (needs root)");
    ip(&[
        "link", "add", "etfh", "type", "veth", "peer", "name", "etfc",
    ]);
    ip(&["link", "set", "etfc", "address", &mac_text(GUEST_MAC)]);
    ip(&["link", "set", "etfh", "up"]);
    ip(&["link", "set", "etfc", "up"]);
    eitri_agent::net::packet::PacketSocket::open(
        "etfc",
        Some(std::time::Duration::from_millis(100)),
    )
    .expect("client socket")
}

fn discover(xid: u32) -> Vec<u8> {
    use eitri_agent::net::dhcp::codec::{Kind, Message, build_frame, option};
    let m = Message {
        op: 1,
        xid,
        secs: 0,
        flags: 0,
        ciaddr: Ipv4Addr::UNSPECIFIED,
        yiaddr: Ipv4Addr::UNSPECIFIED,
        siaddr: Ipv4Addr::UNSPECIFIED,
        giaddr: Ipv4Addr::UNSPECIFIED,
        chaddr: GUEST_MAC,
        options: vec![(option::MESSAGE_TYPE, vec![Kind::Discover.byte()])],
    };
    build_frame(
        GUEST_MAC,
        [0xff; 6],
        (Ipv4Addr::UNSPECIFIED, 68),
        (Ipv4Addr::BROADCAST, 67),
        &m.encode(),
    )
}

fn settle_until(what: &str, done: impl Fn() -> bool) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !done() {
        assert!(
            std::time::Instant::now() < until,
            "timed out waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn a_guest_flooding_dhcp_is_rate_limited() {
    let client = private_pair();
    let responder = Responder::start("etfh", lease()).expect("responder");

    // A flood to the responder (200 in about 20 ms, where it refills 10
    // answers a second), paced just enough that no frame is lost in the
    // socket's receive buffer: this counts answers, not drops.
    for xid in 0..200 {
        client.send(&discover(xid)).expect("send");
        std::thread::sleep(std::time::Duration::from_micros(100));
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
    let responder = Responder::start("etfh", lease()).expect("responder");
    let garbage = eitri_agent::net::dhcp::codec::build_frame(
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
