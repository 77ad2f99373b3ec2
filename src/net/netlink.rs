//! The one link change a create waits on, by rtnetlink: a tap made an
//! isolated, up port of the underlay bridge.
//!
//! Everything else the underlay does runs `ip`, which an operator can read
//! back; this is on every create's path, where forking and exec'ing `ip`
//! cost 1.8 ms of CPU for two messages the kernel answers in microseconds
//! (measured with `make bench-create`). The two messages are exactly the
//! `ip` commands named in [`JOIN`], and an error names the command it
//! stands for, so the log reads as if `ip` had run.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use nix::libc;

use super::packet::ifindex;

/// What [`join_isolated`] does, as `ip` commands (`{tap}`, `{bridge}`).
pub const JOIN: [&str; 2] = [
    "ip link set dev {tap} master {bridge} up",
    "ip link set dev {tap} type bridge_slave isolated on",
];

const RTM_NEWLINK: u16 = 16;
pub(super) const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 0x1;
pub(super) const NLM_F_ACK: u16 = 0x4;
/// The netfilter family's netlink protocol (nftables, conntrack).
pub(super) const NETLINK_NETFILTER: libc::c_int = 12;
const NLA_F_NESTED: u16 = 0x8000;
const IFLA_MASTER: u16 = 10;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_SLAVE_KIND: u16 = 4;
const IFLA_INFO_SLAVE_DATA: u16 = 5;
const IFLA_BRPORT_ISOLATED: u16 = 33;
const IFF_UP: u32 = 0x1;
/// `struct nlmsghdr` and `struct ifinfomsg`.
const HEADER: usize = 16;
#[cfg(test)]
const IFINFO: usize = 16;

/// A link change that failed: the `ip` command it stands for, and why.
#[derive(Debug)]
pub struct LinkError {
    pub command: String,
    pub source: io::Error,
}

impl From<LinkError> for super::command::NetError {
    fn from(e: LinkError) -> Self {
        super::command::NetError::Netlink {
            request: e.command,
            source: e.source,
        }
    }
}

/// Makes `tap` a port of `bridge`, up, and isolated (see [`JOIN`]).
pub fn join_isolated(tap: &str, bridge: &str) -> Result<(), LinkError> {
    let command = |i: usize| JOIN[i].replace("{tap}", tap).replace("{bridge}", bridge);
    let fail = |i: usize| {
        move |source| LinkError {
            command: command(i),
            source,
        }
    };
    let socket = Socket::open(libc::NETLINK_ROUTE).map_err(fail(0))?;
    let (tap_index, bridge_index) = (
        ifindex(tap).map_err(fail(0))?,
        ifindex(bridge).map_err(fail(0))?,
    );

    let mut up = Message::link(1, tap_index, IFF_UP, IFF_UP);
    up.attr(IFLA_MASTER, &bridge_index.to_ne_bytes());
    socket.ask(&up.finish()).map_err(fail(0))?;

    socket
        .ask(&isolation(2, tap_index, true).finish())
        .map_err(fail(1))
}

/// Makes the bridge port `tap` isolated or not: as `ip link set dev {tap}
/// type bridge_slave isolated on|off`.
pub fn set_isolated(tap: &str, on: bool) -> Result<(), LinkError> {
    let fail = |source| LinkError {
        command: format!(
            "ip link set dev {tap} type bridge_slave isolated {}",
            if on { "on" } else { "off" }
        ),
        source,
    };
    let socket = Socket::open(libc::NETLINK_ROUTE).map_err(fail)?;
    let index = ifindex(tap).map_err(fail)?;
    socket.ask(&isolation(1, index, on).finish()).map_err(fail)
}

const RTM_NEWNEIGH: u16 = 28;
const RTM_DELNEIGH: u16 = 29;
const NLM_F_REPLACE: u16 = 0x100;
const NLM_F_CREATE: u16 = 0x400;
const NUD_PERMANENT: u16 = 0x80;
const NDA_DST: u16 = 1;
const NDA_LLADDR: u16 = 2;

/// Tells the host that `ip`, on `bridge`, is at `mac`, for good: as `ip
/// neigh replace {ip} lladdr {mac} dev {bridge} nud permanent`. The host
/// then never asks (by ARP) where a guest it addressed itself is: a frame
/// for a guest goes to its port at once, and waits there while the guest
/// sleeps, where an ARP unanswered for 3 s would fail the sender with "no
/// route to host".
pub fn set_neighbour(bridge: &str, ip: std::net::Ipv4Addr, mac: [u8; 6]) -> Result<(), LinkError> {
    let fail = |source| LinkError {
        command: format!(
            "ip neigh replace {ip} lladdr {} dev {bridge} nud permanent",
            crate::model::Mac::from(mac)
        ),
        source,
    };
    let socket = Socket::open(libc::NETLINK_ROUTE).map_err(fail)?;
    let index = ifindex(bridge).map_err(fail)?;
    let mut m = neighbour(
        RTM_NEWNEIGH,
        NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        index,
        ip,
    );
    m.attr(NDA_LLADDR, &mac);
    socket.ask(&m.finish()).map_err(fail)
}

/// Forgets what [`set_neighbour`] told: as `ip neigh del {ip} dev
/// {bridge}`. One the host does not hold is no error.
pub fn forget_neighbour(bridge: &str, ip: std::net::Ipv4Addr) -> Result<(), LinkError> {
    let fail = |source| LinkError {
        command: format!("ip neigh del {ip} dev {bridge}"),
        source,
    };
    let socket = Socket::open(libc::NETLINK_ROUTE).map_err(fail)?;
    let index = match ifindex(bridge) {
        Ok(index) => index,
        Err(_) => return Ok(()),
    };
    match socket.ask(&neighbour(RTM_DELNEIGH, NLM_F_ACK, index, ip).finish()) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other.map_err(fail),
    }
}

/// A neighbour request about `ip` on the link `index`: `struct ndmsg`
/// (IPv4, permanent) and the address.
fn neighbour(kind: u16, flags: u16, index: i32, ip: std::net::Ipv4Addr) -> Message {
    let mut m = Message::new(kind, flags, 1);
    m.raw(&[libc::AF_INET as u8, 0, 0, 0]);
    m.raw(&index.to_ne_bytes());
    m.raw(&NUD_PERMANENT.to_ne_bytes());
    m.raw(&[0, 0]);
    m.attr(NDA_DST, &ip.octets());
    m
}

/// The request that sets a bridge port's isolation.
fn isolation(seq: u32, index: i32, on: bool) -> Message {
    let mut m = Message::link(seq, index, 0, 0);
    let info = m.begin(IFLA_LINKINFO);
    m.attr(IFLA_INFO_SLAVE_KIND, b"bridge\0");
    let data = m.begin(IFLA_INFO_SLAVE_DATA);
    m.attr(IFLA_BRPORT_ISOLATED, &[u8::from(on)]);
    m.end(data);
    m.end(info);
    m
}

/// One netlink request, built in place.
pub(super) struct Message(Vec<u8>);

impl Message {
    /// A request of `kind` with `flags` (NLM_F_REQUEST is added); its
    /// length is set by [`Message::finish`].
    pub(super) fn new(kind: u16, flags: u16, seq: u32) -> Message {
        let mut bytes = Vec::with_capacity(HEADER + 128);
        bytes.extend_from_slice(&0u32.to_ne_bytes());
        bytes.extend_from_slice(&kind.to_ne_bytes());
        bytes.extend_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
        bytes.extend_from_slice(&seq.to_ne_bytes());
        bytes.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
        Message(bytes)
    }

    /// RTM_NEWLINK on an existing link (no create flag: it only changes).
    fn link(seq: u32, index: i32, flags: u32, change: u32) -> Message {
        let mut m = Message::new(RTM_NEWLINK, NLM_F_ACK, seq);
        // struct ifinfomsg: family (unspecified), padding, type, index,
        // flags, change mask.
        m.raw(&[0, 0, 0, 0]);
        m.raw(&index.to_ne_bytes());
        m.raw(&flags.to_ne_bytes());
        m.raw(&change.to_ne_bytes());
        m
    }

    /// Bytes as they are (a family header).
    pub(super) fn raw(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }

    pub(super) fn attr(&mut self, kind: u16, data: &[u8]) {
        let len = 4 + data.len();
        self.0.extend_from_slice(&(len as u16).to_ne_bytes());
        self.0.extend_from_slice(&kind.to_ne_bytes());
        self.0.extend_from_slice(data);
        self.pad();
    }

    /// Opens a nested attribute; [`Message::end`] closes it.
    pub(super) fn begin(&mut self, kind: u16) -> usize {
        let at = self.0.len();
        self.0.extend_from_slice(&0u16.to_ne_bytes());
        self.0
            .extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        at
    }

    pub(super) fn end(&mut self, at: usize) {
        let len = (self.0.len() - at) as u16;
        self.0[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    }

    fn pad(&mut self) {
        while !self.0.len().is_multiple_of(4) {
            self.0.push(0);
        }
    }

    pub(super) fn finish(mut self) -> Vec<u8> {
        let len = self.0.len() as u32;
        self.0[..4].copy_from_slice(&len.to_ne_bytes());
        self.0
    }
}

pub(super) struct Socket(OwnedFd);

impl Socket {
    /// A netlink socket of `protocol` (NETLINK_ROUTE, NETLINK_NETFILTER).
    pub(super) fn open(protocol: libc::c_int) -> io::Result<Socket> {
        // SAFETY: plain socket(2); the result is checked before use.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                protocol,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by socket(2) and is owned by no one else.
        let socket = Socket(unsafe { OwnedFd::from_raw_fd(fd) });
        // The kernel answers at once; a bound, not a wait.
        let limit = Duration::from_secs(5);
        let timeout = nix::sys::time::TimeVal::new(limit.as_secs() as _, 0);
        nix::sys::socket::setsockopt(
            &socket.0,
            nix::sys::socket::sockopt::ReceiveTimeout,
            &timeout,
        )?;
        Ok(socket)
    }

    /// Sends one datagram whole.
    pub(super) fn send(&self, datagram: &[u8]) -> io::Result<()> {
        // SAFETY: `datagram` is valid for reads of its length.
        let sent = unsafe {
            libc::send(
                self.0.as_raw_fd(),
                datagram.as_ptr().cast(),
                datagram.len(),
                0,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Receives one datagram of the kernel's into `buf`: its length.
    pub(super) fn receive(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for writes of its length.
        let n = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// Sends `request` and waits for the kernel's acknowledgement of it.
    pub(super) fn ask(&self, request: &[u8]) -> io::Result<()> {
        let seq = u32::from_ne_bytes([request[8], request[9], request[10], request[11]]);
        self.ask_all(request, &[seq])
    }

    /// Sends `datagram` (one request, or a batch of them) and waits until
    /// the kernel has acknowledged each of `seqs`; its first refusal is the
    /// error.
    pub(super) fn ask_all(&self, datagram: &[u8], seqs: &[u32]) -> io::Result<()> {
        self.send(datagram)?;
        let mut buf = [0u8; 8192];
        let mut waiting: Vec<u32> = seqs.to_vec();
        while !waiting.is_empty() {
            let n = self.receive(&mut buf)?;
            let answers = &buf[..n];
            let mut acknowledged = Vec::new();
            for seq in &waiting {
                match acknowledgement(answers, *seq) {
                    Some(Ok(())) => acknowledged.push(*seq),
                    Some(Err(e)) => return Err(e),
                    None => {}
                }
            }
            waiting.retain(|s| !acknowledged.contains(s));
        }
        Ok(())
    }
}

/// The kernel's answer to request `seq` in `datagram`, if it holds one: an
/// NLMSG_ERROR whose code is 0 (done) or a negative errno.
fn acknowledgement(mut datagram: &[u8], seq: u32) -> Option<io::Result<()>> {
    while datagram.len() >= HEADER {
        let word = |i: usize| {
            u32::from_ne_bytes([
                datagram[i],
                datagram[i + 1],
                datagram[i + 2],
                datagram[i + 3],
            ])
        };
        let len = word(0) as usize;
        let kind = u16::from_ne_bytes([datagram[4], datagram[5]]);
        if len < HEADER || len > datagram.len() {
            return Some(Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a torn netlink answer",
            )));
        }
        if kind == NLMSG_ERROR && word(8) == seq && len >= HEADER + 4 {
            let code = i32::from_ne_bytes([
                datagram[HEADER],
                datagram[HEADER + 1],
                datagram[HEADER + 2],
                datagram[HEADER + 3],
            ]);
            return Some(if code == 0 {
                Ok(())
            } else {
                Err(io::Error::from_raw_os_error(-code))
            });
        }
        datagram = &datagram[(len + 3) & !3..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nested_attribute_counts_what_it_holds() {
        let mut m = Message::link(7, 3, 0, 0);
        let info = m.begin(IFLA_LINKINFO);
        m.attr(IFLA_INFO_SLAVE_KIND, b"bridge\0");
        m.end(info);

        let bytes = m.finish();

        assert_eq!(bytes.len(), HEADER + IFINFO + 4 + 12);
        assert_eq!(
            u32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
            bytes.len() as u32
        );
        let nested = &bytes[HEADER + IFINFO..];
        assert_eq!(u16::from_ne_bytes([nested[0], nested[1]]), 16);
        assert_eq!(
            u16::from_ne_bytes([nested[2], nested[3]]),
            IFLA_LINKINFO | NLA_F_NESTED
        );
        assert_eq!(
            u16::from_ne_bytes([nested[4], nested[5]]),
            11,
            "4 + 7 bytes, padded after"
        );
    }

    fn error_answer(seq: u32, code: i32) -> Vec<u8> {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&36u32.to_ne_bytes());
        bytes.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        bytes.extend_from_slice(&0u16.to_ne_bytes());
        bytes.extend_from_slice(&seq.to_ne_bytes());
        bytes.extend_from_slice(&0u32.to_ne_bytes());
        bytes.extend_from_slice(&code.to_ne_bytes());
        bytes.extend_from_slice(&[0; 16]);
        bytes
    }

    #[test]
    fn a_zero_code_acknowledges_and_a_negative_one_is_the_errno() {
        assert!(matches!(
            acknowledgement(&error_answer(4, 0), 4),
            Some(Ok(()))
        ));
        let refused = acknowledgement(&error_answer(4, -libc::ENODEV), 4);

        assert_eq!(
            refused.and_then(Result::err).and_then(|e| e.raw_os_error()),
            Some(libc::ENODEV)
        );
    }

    #[test]
    fn an_answer_to_another_request_is_not_ours() {
        assert!(acknowledgement(&error_answer(3, 0), 4).is_none());
    }

    #[test]
    fn a_length_past_the_datagram_is_torn() {
        let mut answer = error_answer(4, 0);
        answer.truncate(20);

        let torn = acknowledgement(&answer, 4);

        assert!(matches!(torn, Some(Err(e)) if e.kind() == io::ErrorKind::InvalidData));
    }
}
