//! The stand-in's guest on the wire (`STANDIN_GUEST_TCP`): what a guest's
//! network stack would answer on its NIC, read and written on the tap the
//! agent handed the VMM, so a test sees real frames cross the host's
//! bridge, guard and NAT into a "VM" and back.
//!
//! It answers an ARP request for any address (the port guard drops a
//! reply for an address that is not the guest's, as it would a real
//! guest's) and a TCP SYN to any port with a SYN-ACK, so a client's
//! `connect()` through the host completes; it logs each SYN it reads
//! (`standin-guest: syn from A:P to port N`), so a test can count how many
//! a connection took. It keeps no connection: what follows the handshake
//! is read and dropped. A jailed VMM has no network namespace to enter,
//! no capabilities and a Landlock view of its own files: a guest's stack
//! in the VMM itself is what a stand-in can have.

use std::net::Ipv4Addr;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;

/// The tap's `virtio_net_hdr` (the agent opens it with IFF_VNET_HDR and
/// no offloads, so the header is all zeros and the checksums whole).
const VNET_HDR: usize = 10;
const ETHER: usize = 14;

/// Answers on the tap `fd` as the NIC `mac`, telling `said` each SYN,
/// until the fd fails (the process's end).
pub fn answer(fd: RawFd, mac: [u8; 6], said: impl Fn(&str)) {
    let mut buf = vec![0u8; 65536];
    loop {
        // SAFETY: `buf` is valid for its length; `fd` is the tap this
        // process inherited and holds for its life.
        let n = unsafe { nix::libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        let Ok(n) = usize::try_from(n) else {
            return;
        };
        let Some(frame) = buf.get(VNET_HDR..n) else {
            continue;
        };
        crate::counters::NET_RX_BYTES.fetch_add(frame.len() as u64, Ordering::Relaxed);
        crate::counters::NET_RX_FRAMES.fetch_add(1, Ordering::Relaxed);
        let reply = match ethertype(frame) {
            Some(0x0806) => arp_reply(frame, mac),
            Some(0x0800) => syn_ack(frame, mac, &said),
            _ => None,
        };
        if let Some(reply) = reply {
            let mut out = vec![0u8; VNET_HDR];
            out.extend_from_slice(&reply);
            // SAFETY: `out` is valid for its length.
            let _ = unsafe { nix::libc::write(fd, out.as_ptr().cast(), out.len()) };
            crate::counters::NET_TX_BYTES.fetch_add(reply.len() as u64, Ordering::Relaxed);
            crate::counters::NET_TX_FRAMES.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn ethertype(frame: &[u8]) -> Option<u16> {
    frame.get(12..14).map(|t| u16::from_be_bytes([t[0], t[1]]))
}

fn ether(to: &[u8], from: [u8; 6], kind: u16) -> Vec<u8> {
    let mut f = Vec::with_capacity(64);
    f.extend_from_slice(to);
    f.extend_from_slice(&from);
    f.extend_from_slice(&kind.to_be_bytes());
    f
}

/// The reply to an ARP request: "the address asked for is at `mac`".
fn arp_reply(frame: &[u8], mac: [u8; 6]) -> Option<Vec<u8>> {
    let arp = frame.get(ETHER..ETHER + 28)?;
    // Ethernet/IPv4 request.
    if arp[..8] != [0, 1, 8, 0, 6, 4, 0, 1] {
        return None;
    }
    let (asker_mac, asker_ip, wanted_ip) = (&arp[8..14], &arp[14..18], &arp[24..28]);
    let mut f = ether(asker_mac, mac, 0x0806);
    f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 2]);
    f.extend_from_slice(&mac);
    f.extend_from_slice(wanted_ip);
    f.extend_from_slice(asker_mac);
    f.extend_from_slice(asker_ip);
    Some(f)
}

/// The SYN-ACK to a TCP SYN, said to `said`.
fn syn_ack(frame: &[u8], mac: [u8; 6], said: &impl Fn(&str)) -> Option<Vec<u8>> {
    let ip = frame.get(ETHER..)?;
    let ihl = usize::from(ip.first()? & 0x0f) * 4;
    if ip.get(9) != Some(&6) || ihl < 20 {
        return None;
    }
    let tcp = ip.get(ihl..ihl + 20)?;
    let flags = tcp[13];
    // SYN alone.
    if flags & 0x12 != 0x02 {
        return None;
    }
    let (src, dst) = (
        Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
        Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]),
    );
    let (sport, dport) = (
        u16::from_be_bytes([tcp[0], tcp[1]]),
        u16::from_be_bytes([tcp[2], tcp[3]]),
    );
    let seq = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
    said(&format!(
        "standin-guest: syn from {src}:{sport} to port {dport}"
    ));

    let mut segment = Vec::with_capacity(20);
    segment.extend_from_slice(&dport.to_be_bytes());
    segment.extend_from_slice(&sport.to_be_bytes());
    segment.extend_from_slice(&0x5eed_0000u32.to_be_bytes());
    segment.extend_from_slice(&seq.wrapping_add(1).to_be_bytes());
    segment.extend_from_slice(&[0x50, 0x12, 0xff, 0xff, 0, 0, 0, 0]);
    let mut pseudo = Vec::with_capacity(32);
    pseudo.extend_from_slice(&dst.octets());
    pseudo.extend_from_slice(&src.octets());
    pseudo.extend_from_slice(&[0, 6, 0, 20]);
    pseudo.extend_from_slice(&segment);
    let sum = checksum(&pseudo).to_be_bytes();
    segment[16..18].copy_from_slice(&sum);

    let mut header = vec![0x45, 0, 0, 40, 0, 0, 0x40, 0, 64, 6, 0, 0];
    header.extend_from_slice(&dst.octets());
    header.extend_from_slice(&src.octets());
    let sum = checksum(&header).to_be_bytes();
    header[10..12].copy_from_slice(&sum);

    let mut f = ether(&frame[6..12], mac, 0x0800);
    f.extend_from_slice(&header);
    f.extend_from_slice(&segment);
    Some(f)
}

/// The Internet checksum (RFC 1071).
fn checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}
