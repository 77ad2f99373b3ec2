//! Counting a guest's own activity on its tap (what the idle rule goes
//! by): the frames it sends of its own accord count; ARP, IPv6 neighbour
//! and router discovery, multicast listener reports and what the host
//! sends to it do not.

// Linux only: namespaces, veths and packet sockets.
#![cfg(target_os = "linux")]

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use eitri_agent::net::dhcp::codec::build_frame;
use eitri_agent::net::packet::{PacketSocket, arp_frame};

use super::dhcp::{GUEST_MAC, VM_IP, private_pair};

/// An IPv6 frame from the guest with `next` as its next header and
/// `first` as the first byte of its payload (an ICMPv6 type).
fn ipv6_from_guest(next: u8, first: u8) -> Vec<u8> {
    let mut frame = Vec::new();
    frame.extend_from_slice(&[0x33, 0x33, 0, 0, 0, 1]);
    frame.extend_from_slice(&GUEST_MAC);
    frame.extend_from_slice(&[0x86, 0xdd]);
    // Version 6, payload 8 bytes, `next`, hop limit 255.
    frame.extend_from_slice(&[0x60, 0, 0, 0, 0, 8, next, 255]);
    frame.extend_from_slice(&[0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
    frame.extend_from_slice(&[0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
    frame.extend_from_slice(&[first, 0, 0, 0, 0, 0, 0, 0]);
    frame
}

/// What `counter` counts until it has counted nothing new for 200 ms.
fn counted(counter: &PacketSocket) -> u64 {
    let mut total = 0;
    let mut quiet_since = Instant::now();
    while quiet_since.elapsed() < Duration::from_millis(200) {
        let n = counter.take_count().expect("the counter's statistics");
        if n > 0 {
            total += n;
            quiet_since = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    total
}

#[test]
fn a_guests_own_frames_count_as_activity_and_its_stacks_chatter_does_not() {
    let guest = private_pair();
    let counter = PacketSocket::open_guest_activity("etfh").expect("an activity counter");
    let udp = build_frame(
        GUEST_MAC,
        [0xff; 6],
        (VM_IP, 4000),
        (Ipv4Addr::BROADCAST, 4000),
        b"the guest's own",
    );
    let arp = arp_frame(
        1,
        None,
        (GUEST_MAC, VM_IP),
        ([0; 6], Ipv4Addr::new(100, 77, 0, 1)),
    );
    let echo = ipv6_from_guest(58, 128);
    let chatter = [
        arp,
        ipv6_from_guest(58, 133), // router solicitation
        ipv6_from_guest(58, 135), // neighbour solicitation
        ipv6_from_guest(58, 136), // neighbour advertisement
        ipv6_from_guest(58, 143), // MLDv2 report
        ipv6_from_guest(0, 58),   // hop-by-hop options first
    ];

    for frame in chatter.iter().chain([&udp, &echo]) {
        guest.send(frame).expect("send");
    }

    assert_eq!(counted(&counter), 2);
}

#[test]
fn what_the_host_sends_its_guest_is_not_the_guests_activity() {
    let _guest = private_pair();
    let counter = PacketSocket::open_guest_activity("etfh").expect("an activity counter");
    let host = PacketSocket::open("etfh", None).expect("the host's end");
    let to_guest = build_frame(
        [0x02, 0xe1, 0, 0, 0, 0xfe],
        GUEST_MAC,
        (Ipv4Addr::new(100, 77, 0, 1), 4000),
        (VM_IP, 4000),
        b"for the guest",
    );

    host.send(&to_guest).expect("send");

    assert_eq!(counted(&counter), 0);
}
