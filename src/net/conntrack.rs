//! Forgetting the connections a published port forwarded to a guest, once
//! the port is moved to another guest or given back. The kernel keeps
//! each forwarded flow's translation in its connection tracker: without
//! this, a UDP flow (and any TCP connection still open) to the port goes
//! on reaching the guest that held it, after the ruleset gave the port to
//! another VM — one tenant's traffic to another's guest.
//!
//! By ctnetlink, as `conntrack -D` does (no program is run): the table is
//! dumped, and each entry whose original direction came to the port and
//! whose reply comes from the old guest is deleted by its original tuple.

use std::io;
use std::net::Ipv4Addr;

use nix::libc;

use super::netlink::{Message, NETLINK_NETFILTER, NLM_F_ACK, NLMSG_ERROR, Socket};
use crate::model::{Publish, Transport};

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_DONE: u16 = 3;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_DST_PORT: u16 = 3;
/// `struct nlmsghdr`, then `struct nfgenmsg`.
const HEADER: usize = 16;
const NFGEN: usize = 4;

/// The flows one published port forwarded to one guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Forwarded {
    pub transport: Transport,
    pub host_port: u16,
    /// `None`: the port on every address of the host.
    pub host_address: Option<Ipv4Addr>,
    pub guest: Ipv4Addr,
}

impl Forwarded {
    pub fn of(publish: &Publish, guest: Ipv4Addr) -> Forwarded {
        Forwarded {
            transport: publish.transport,
            host_port: publish.host_port,
            host_address: publish.host_address,
            guest,
        }
    }

    fn protocol(&self) -> u8 {
        match self.transport {
            Transport::Tcp => libc::IPPROTO_TCP as u8,
            Transport::Udp => libc::IPPROTO_UDP as u8,
        }
    }

    /// Whether a tracked connection is one of these flows.
    fn holds(&self, entry: &Entry) -> bool {
        entry.protocol == self.protocol()
            && entry.dst_port == self.host_port
            && self.host_address.is_none_or(|a| a == entry.dst)
            && entry.reply_src == self.guest
    }
}

/// What is read of one tracked connection.
#[derive(Debug)]
struct Entry {
    protocol: u8,
    dst: Ipv4Addr,
    dst_port: u16,
    reply_src: Ipv4Addr,
    /// Its original tuple as the kernel wrote it: what deletes it.
    orig: Vec<u8>,
}

/// Deletes every tracked connection of `flows`: how many went.
pub fn forget(flows: &[Forwarded]) -> io::Result<usize> {
    if flows.is_empty() {
        return Ok(0);
    }
    let socket = Socket::open(NETLINK_NETFILTER)?;
    let doomed: Vec<Vec<u8>> = dump(&socket)?
        .into_iter()
        .filter(|e| flows.iter().any(|f| f.holds(e)))
        .map(|e| e.orig)
        .collect();
    let mut gone = 0;
    for (seq, orig) in (2u32..).zip(&doomed) {
        let mut m = Message::new(kind(IPCTNL_MSG_CT_DELETE), NLM_F_ACK, seq);
        m.raw(&nfgen());
        let at = m.begin(CTA_TUPLE_ORIG);
        m.raw(orig);
        m.end(at);
        match socket.ask(&m.finish()) {
            Ok(()) => gone += 1,
            // Ended meanwhile.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(gone)
}

fn kind(message: u16) -> u16 {
    (NFNL_SUBSYS_CTNETLINK << 8) | message
}

/// `struct nfgenmsg`: IPv4, version 0, resource 0.
fn nfgen() -> [u8; NFGEN] {
    [libc::AF_INET as u8, 0, 0, 0]
}

/// Every IPv4 connection the kernel tracks.
fn dump(socket: &Socket) -> io::Result<Vec<Entry>> {
    let mut m = Message::new(kind(IPCTNL_MSG_CT_GET), NLM_F_DUMP, 1);
    m.raw(&nfgen());
    socket.send(&m.finish())?;
    let mut entries = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = socket.receive(&mut buf)?;
        let mut datagram = &buf[..n];
        while datagram.len() >= HEADER {
            let len =
                u32::from_ne_bytes([datagram[0], datagram[1], datagram[2], datagram[3]]) as usize;
            let message = u16::from_ne_bytes([datagram[4], datagram[5]]);
            if len < HEADER || len > datagram.len() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a torn ctnetlink answer",
                ));
            }
            match message {
                NLMSG_DONE => return Ok(entries),
                NLMSG_ERROR => {
                    let code = datagram
                        .get(HEADER..HEADER + 4)
                        .map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                    if code != 0 {
                        return Err(io::Error::from_raw_os_error(-code));
                    }
                }
                _ => entries.extend(datagram.get(HEADER + NFGEN..len).and_then(entry)),
            }
            datagram = datagram.get((len + 3) & !3..).unwrap_or_default();
        }
    }
}

/// The attributes of `bytes`: each one's type (flags cleared) and payload.
fn attributes(mut bytes: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if bytes.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([bytes[0], bytes[1]]) as usize;
        let kind = u16::from_ne_bytes([bytes[2], bytes[3]]) & 0x3fff;
        let payload = bytes.get(4..len)?;
        bytes = bytes.get((len + 3) & !3..).unwrap_or_default();
        Some((kind, payload))
    })
}

fn find(bytes: &[u8], kind: u16) -> Option<&[u8]> {
    attributes(bytes).find(|(k, _)| *k == kind).map(|(_, p)| p)
}

fn address(bytes: &[u8], kind: u16) -> Option<Ipv4Addr> {
    let ip = find(find(bytes, CTA_TUPLE_IP)?, kind)?;
    Some(Ipv4Addr::new(
        *ip.first()?,
        *ip.get(1)?,
        *ip.get(2)?,
        *ip.get(3)?,
    ))
}

/// One dumped connection's attributes, read; `None` for one not IPv4 or
/// without ports.
fn entry(attrs: &[u8]) -> Option<Entry> {
    let orig = find(attrs, CTA_TUPLE_ORIG)?;
    let reply = find(attrs, CTA_TUPLE_REPLY)?;
    let proto = find(orig, CTA_TUPLE_PROTO)?;
    let port = find(proto, CTA_PROTO_DST_PORT)?;
    Some(Entry {
        protocol: *find(proto, CTA_PROTO_NUM)?.first()?,
        dst: address(orig, CTA_IP_V4_DST)?,
        dst_port: u16::from_be_bytes([*port.first()?, *port.get(1)?]),
        reply_src: address(reply, CTA_IP_V4_SRC)?,
        orig: orig.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dumped connection's attributes: orig `src → dst:port`, reply from
    /// `reply_src`.
    fn dumped(protocol: u8, dst: [u8; 4], port: u16, reply_src: [u8; 4]) -> Vec<u8> {
        let mut m = Message::new(0, 0, 0);
        let tuple = |m: &mut Message, kind: u16, src: [u8; 4], dst: [u8; 4], dport: u16| {
            let t = m.begin(kind);
            let ip = m.begin(CTA_TUPLE_IP);
            m.attr(CTA_IP_V4_SRC, &src);
            m.attr(CTA_IP_V4_DST, &dst);
            m.end(ip);
            let p = m.begin(CTA_TUPLE_PROTO);
            m.attr(CTA_PROTO_NUM, &[protocol]);
            m.attr(2, &40000u16.to_be_bytes());
            m.attr(CTA_PROTO_DST_PORT, &dport.to_be_bytes());
            m.end(p);
            m.end(t);
        };
        tuple(&mut m, CTA_TUPLE_ORIG, [192, 0, 2, 9], dst, port);
        tuple(&mut m, CTA_TUPLE_REPLY, reply_src, [192, 0, 2, 9], 40000);
        m.finish()[HEADER..].to_vec()
    }

    #[test]
    fn a_flow_to_the_port_answered_by_the_old_guest_is_the_ports() {
        let flow = Forwarded {
            transport: Transport::Udp,
            host_port: 5353,
            host_address: None,
            guest: Ipv4Addr::new(100, 77, 0, 5),
        };
        let udp = libc::IPPROTO_UDP as u8;

        let ours = entry(&dumped(udp, [192, 0, 2, 1], 5353, [100, 77, 0, 5])).expect("read");
        let another_guests =
            entry(&dumped(udp, [192, 0, 2, 1], 5353, [100, 77, 0, 6])).expect("read");
        let tcp = entry(&dumped(6, [192, 0, 2, 1], 5353, [100, 77, 0, 5])).expect("read");

        assert!(flow.holds(&ours), "{ours:?}");
        assert!(!flow.holds(&another_guests));
        assert!(!flow.holds(&tcp));
        assert_eq!(ours.dst, Ipv4Addr::new(192, 0, 2, 1));
    }
}
