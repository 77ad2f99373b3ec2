//! The DHCP codec and the answering rules against random and mutated
//! packets: nothing may panic. `EITRI_FUZZ_ITERATIONS` sets how many (the
//! default keeps CI quick; run a million with
//! `EITRI_FUZZ_ITERATIONS=1000000 cargo test --release --features testkit --test artifacts fuzz_dhcp`).

use std::net::Ipv4Addr;

use eitri_agent::net::dhcp::codec::{Frame, Kind, Message, build_frame, option};
use eitri_agent::net::dhcp::{Lease, respond};

fn seed_frames() -> Vec<Vec<u8>> {
    let kinds = [
        Kind::Discover,
        Kind::Request,
        Kind::Inform,
        Kind::Release,
        Kind::Decline,
    ];
    kinds
        .iter()
        .map(|k| {
            let m = Message {
                flags: 0x8000,
                options: vec![
                    (option::MESSAGE_TYPE, vec![k.byte()]),
                    (option::REQUESTED_IP, vec![100, 77, 0, 9]),
                    (option::SERVER_ID, vec![100, 77, 0, 1]),
                    (option::CLIENT_ID, vec![255, 1, 2, 3, 4]),
                ],
                ..Message::new(1, 9, [2, 0, 0, 0, 0, 1])
            };
            build_frame(
                [2, 0, 0, 0, 0, 1],
                [255; 6],
                (Ipv4Addr::UNSPECIFIED, 68),
                (Ipv4Addr::BROADCAST, 67),
                &m.encode(),
            )
        })
        .collect()
}

#[test]
fn random_and_mutated_packets_never_panic() {
    let iterations: usize = std::env::var("EITRI_FUZZ_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let lease = Lease {
        mac: [2, 0, 0, 0, 0, 1],
        ip: Ipv4Addr::new(100, 77, 0, 9),
        netmask: Ipv4Addr::new(255, 255, 0, 0),
        gateway: Ipv4Addr::new(100, 77, 0, 1),
        dns: vec![],
        lease_secs: 60,
    };
    let seeds = seed_frames();
    let mut rng = eitri_agent::rng::XorShift::from_seed(0x2545_f491_4f6c_dd1d);
    let mut parsed = 0usize;
    for i in 0..iterations {
        let mut packet = if i % 4 == 0 {
            (0..rng.below(600)).map(|_| rng.next_u64() as u8).collect()
        } else {
            seeds[rng.below(seeds.len())].clone()
        };
        for _ in 0..rng.below(8) {
            match rng.below(4) {
                0 if !packet.is_empty() => {
                    let at = rng.below(packet.len());
                    packet[at] = rng.next_u64() as u8;
                }
                1 => packet.truncate(rng.below(packet.len() + 1)),
                2 => packet.extend((0..rng.below(64)).map(|_| rng.next_u64() as u8)),
                _ => {}
            }
        }
        let payload = Frame::parse(&packet)
            .map(|f| f.payload.to_vec())
            .unwrap_or(packet);
        if let Ok(message) = Message::parse(&payload) {
            parsed += 1;
            if let Some(reply) = respond(&lease, &message) {
                assert_eq!(
                    Message::parse(&reply.encode()).ok().map(|m| m.xid),
                    Some(message.xid)
                );
            }
        }
    }
    println!("fuzzed {iterations} packets, {parsed} parsed as DHCP");
    assert!(
        parsed > 0,
        "the mutations must reach the parser's deep paths too"
    );
}
