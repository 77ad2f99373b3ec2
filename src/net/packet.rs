//! A packet socket bound to one interface: whole Ethernet frames in and
//! out, every protocol (ETH_P_ALL: an ETH_P_IP packet socket on a bridge
//! port receives nothing).

use std::ffi::CString;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use nix::libc;

pub struct PacketSocket {
    fd: OwnedFd,
    mac: [u8; 6],
}

/// One classic BPF instruction.
const fn op(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

// The classic BPF opcodes the filters below use.
const LDH_ABS: u16 = 0x28; // BPF_LD | BPF_H | BPF_ABS
const LDB_ABS: u16 = 0x30; // BPF_LD | BPF_B | BPF_ABS
const LDXB_MSH: u16 = 0xb1; // BPF_LDX | BPF_B | BPF_MSH: x = 4 * (p[k] & 0xf)
const LDH_IND: u16 = 0x48; // BPF_LD | BPF_H | BPF_IND
const JEQ: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const JGT: u16 = 0x25; // BPF_JMP | BPF_JGT | BPF_K
const JGE: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
const JSET: u16 = 0x45; // BPF_JMP | BPF_JSET | BPF_K
const RET: u16 = 0x06; // BPF_RET | BPF_K
/// SKF_AD_OFF + SKF_AD_PKTTYPE: where a load reads the frame's packet type.
const PKTTYPE: u32 = 0xffff_f000 + 4;

/// A classic BPF program that passes only IPv4 UDP frames from or to port
/// 67 or 68 (DHCP), unfragmented, whatever the IP header's length: a
/// guest flooding its tap with anything else wakes neither the responder
/// nor the snooper (it took 2 CPU-seconds for 667k frames in 5 s when
/// every frame came up to the thread to be looked at).
const DHCP_ONLY: [libc::sock_filter; 15] = [
    op(LDH_ABS, 0, 0, 12),      // 0: the ethertype
    op(JEQ, 0, 11, 0x0800),     // 1: IPv4, else drop (13)
    op(LDB_ABS, 0, 0, 23),      // 2: the IP protocol
    op(JEQ, 0, 9, 17),          // 3: UDP, else drop
    op(LDH_ABS, 0, 0, 20),      // 4: flags and fragment offset
    op(JSET, 7, 0, 0x1fff),     // 5: a later fragment: drop
    op(LDXB_MSH, 0, 0, 14),     // 6: x = the IP header's length
    op(LDH_IND, 0, 0, 14),      // 7: the source port
    op(JEQ, 5, 0, 67),          // 8: 67: pass (jumps count from the next)
    op(JEQ, 4, 0, 68),          // 9: 68: pass
    op(LDH_IND, 0, 0, 16),      // 10: the destination port
    op(JEQ, 2, 0, 67),          // 11: 67: pass
    op(JEQ, 1, 0, 68),          // 12: 68: pass
    op(RET, 0, 0, 0),           // 13: drop
    op(RET, 0, 0, 0x0004_0000), // 14: pass, whole
];

/// A classic BPF program that passes the head (96 bytes: Ethernet, IPv4
/// and the ports) of frames the interface sends, IPv4 or ARP, and nothing
/// else: on a tap, what goes to the guest.
const TO_GUEST_HEADS: [libc::sock_filter; 7] = [
    op(LDB_ABS, 0, 0, PKTTYPE),                  // 0
    op(JEQ, 0, 4, libc::PACKET_OUTGOING as u32), // 1: else drop (6)
    op(LDH_ABS, 0, 0, 12),                       // 2: the ethertype
    op(JEQ, 1, 0, 0x0800),                       // 3: IPv4: pass (5)
    op(JEQ, 0, 1, 0x0806),                       // 4: ARP: pass, else drop
    op(RET, 0, 0, 96),                           // 5: pass its head
    op(RET, 0, 0, 0),                            // 6: drop
];

/// A classic BPF program that passes (its first byte only: nothing reads
/// it) each frame a tap's guest sent that is its own activity: not what
/// the host sends to it, not ARP, not IPv6 neighbour or router discovery
/// or multicast listener reports (ICMPv6 types 130 to 137 and 143), nor an
/// IPv6 packet starting with hop-by-hop options (how MLD is sent). A guest
/// answers those for its stack, not for a user: an idle guest refreshes
/// the host's address a few seconds after every exchange, a probe's
/// included.
const GUEST_ACTIVITY: [libc::sock_filter; 14] = [
    op(LDB_ABS, 0, 0, PKTTYPE),                   // 0
    op(JEQ, 10, 0, libc::PACKET_OUTGOING as u32), // 1: to the guest: drop (12)
    op(LDH_ABS, 0, 0, 12),                        // 2: the ethertype
    op(JEQ, 8, 0, 0x0806),                        // 3: ARP: drop
    op(JEQ, 0, 8, 0x86dd),                        // 4: not IPv6: pass (13)
    op(LDB_ABS, 0, 0, 14 + 6),                    // 5: its next header
    op(JEQ, 5, 0, 0),                             // 6: hop-by-hop: drop
    op(JEQ, 0, 5, 58),                            // 7: not ICMPv6: pass
    op(LDB_ABS, 0, 0, 14 + 40),                   // 8: the ICMPv6 type
    op(JEQ, 2, 0, 143),                           // 9: MLDv2 report: drop
    op(JGE, 0, 2, 130),                           // 10: below 130: pass
    op(JGT, 1, 0, 137),                           // 11: above 137: pass, else drop
    op(RET, 0, 0, 0),                             // 12: drop
    op(RET, 0, 0, 1),                             // 13: pass, one byte
];

/// What a frame for a guest is, in words: "tcp from 192.0.2.9:40312 to
/// port 8080", "udp from …", "arp from 10.0.0.1"; `None` for anything
/// else, or a frame too short to say.
pub fn describe(frame: &[u8]) -> Option<String> {
    let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    let ip = |at: usize| -> Option<Ipv4Addr> {
        let b = frame.get(at..at + 4)?;
        Some(Ipv4Addr::new(b[0], b[1], b[2], b[3]))
    };
    match ethertype {
        0x0806 => Some(format!("arp from {}", ip(14 + 14)?)),
        0x0800 => {
            let ihl = usize::from(frame.get(14)? & 0x0f) * 4;
            let proto = match frame.get(14 + 9)? {
                6 => "tcp",
                17 => "udp",
                1 => return Some(format!("icmp from {}", ip(14 + 12)?)),
                _ => return Some(format!("ip from {}", ip(14 + 12)?)),
            };
            let l4 = 14 + ihl;
            let port = |at: usize| -> Option<u16> {
                Some(u16::from_be_bytes([*frame.get(at)?, *frame.get(at + 1)?]))
            };
            Some(format!(
                "{proto} from {}:{} to port {}",
                ip(14 + 12)?,
                port(l4)?,
                port(l4 + 2)?
            ))
        }
        _ => None,
    }
}

impl PacketSocket {
    /// Opens a packet socket on the tap `iface` that sees the head of
    /// every IPv4 and ARP frame sent to its guest (see [`TO_GUEST_HEADS`]),
    /// queueing at most a few: a copy, the frames themselves are the
    /// guest's.
    pub fn open_to_guest_heads(iface: &str) -> io::Result<PacketSocket> {
        let socket = PacketSocket::open_with(iface, None, Some(&TO_GUEST_HEADS))?;
        // Heads of a wake's first frames only: 4 KiB holds dozens.
        nix::sys::socket::setsockopt(&socket.fd, nix::sys::socket::sockopt::RcvBuf, &4096)?;
        Ok(socket)
    }

    /// Opens a socket on the tap `iface` that counts the frames its guest
    /// sends of its own accord (see [`GUEST_ACTIVITY`]); read with
    /// [`PacketSocket::take_count`], never received from.
    pub fn open_guest_activity(iface: &str) -> io::Result<PacketSocket> {
        let socket = PacketSocket::open_with(iface, None, Some(&GUEST_ACTIVITY))?;
        // Nothing is read: one frame queued, every later one counted as
        // dropped, before the kernel copies it.
        nix::sys::socket::setsockopt(&socket.fd, nix::sys::socket::sockopt::RcvBuf, &0)?;
        Ok(socket)
    }

    /// The frames its filter passed since the last count (queued or
    /// dropped alike), as the kernel counts them; counting starts over.
    pub fn take_count(&self) -> io::Result<u64> {
        let mut stats = libc::tpacket_stats {
            tp_packets: 0,
            tp_drops: 0,
        };
        let mut len = std::mem::size_of::<libc::tpacket_stats>() as libc::socklen_t;
        // SAFETY: PACKET_STATISTICS fills a tpacket_stats of at most `len`
        // bytes, both valid for the call.
        let rc = unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_STATISTICS,
                std::ptr::from_mut(&mut stats).cast(),
                &mut len,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        // The kernel's `tp_packets` already includes the drops.
        Ok(u64::from(stats.tp_packets))
    }

    /// One frame into `buf` if one waits, without waiting.
    pub fn recv_now(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        // SAFETY: `buf` is valid for writes of its length.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::WouldBlock {
            Ok(None)
        } else {
            Err(e)
        }
    }

    /// Opens a packet socket on `iface` that receives every frame;
    /// `timeout` bounds each receive.
    pub fn open(iface: &str, timeout: Option<Duration>) -> io::Result<PacketSocket> {
        PacketSocket::open_with(iface, timeout, None)
    }

    /// As [`PacketSocket::open`], receiving only DHCP (see [`DHCP_ONLY`]):
    /// the filter is attached before the socket is bound, so no other
    /// frame is ever queued to it.
    pub fn open_dhcp(iface: &str, timeout: Option<Duration>) -> io::Result<PacketSocket> {
        PacketSocket::open_with(iface, timeout, Some(&DHCP_ONLY))
    }

    fn open_with(
        iface: &str,
        timeout: Option<Duration>,
        filter: Option<&[libc::sock_filter]>,
    ) -> io::Result<PacketSocket> {
        let fd = packet_socket(iface, filter)?;
        if let Some(t) = timeout {
            let timeout = nix::sys::time::TimeVal::new(t.as_secs() as _, t.subsec_micros() as _);
            nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::ReceiveTimeout, &timeout)?;
        }
        let mac = interface_mac(iface)?;
        Ok(PacketSocket { fd, mac })
    }

    pub fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.fd)
    }

    /// The interface's own MAC.
    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }

    /// One frame into `buf`; its length.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for writes of its length.
        let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    /// One frame into `buf`: its length, and whether the interface sent it
    /// (`true`) or received it. On a tap, a frame the interface sends goes
    /// to the guest: it came from the bridge side; one it receives came
    /// from the guest.
    pub fn recv_with_direction(&self, buf: &mut [u8]) -> io::Result<(usize, bool)> {
        // SAFETY: sockaddr_ll is plain data; zeroed is a valid value for it.
        let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        // SAFETY: `buf` is valid for writes of its length; `from` and `len`
        // are a valid address buffer and its size for recvfrom(2).
        let n = unsafe {
            libc::recvfrom(
                self.fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
                std::ptr::from_mut(&mut from).cast(),
                &mut len,
            )
        };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok((n as usize, from.sll_pkttype == libc::PACKET_OUTGOING))
        }
    }

    /// Sends one whole frame out of the interface.
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: `frame` is valid for reads of its length; the socket is
        // bound to the interface, so send(2) needs no address.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }
}

/// An ARP frame (op 1 request, 2 reply) from `sender` to `target`, each a
/// MAC and an address; the Ethernet source is the sender's MAC unless
/// `ether_src` says otherwise.
pub fn arp_frame(
    op: u16,
    ether_src: Option<[u8; 6]>,
    sender: ([u8; 6], Ipv4Addr),
    target: ([u8; 6], Ipv4Addr),
) -> Vec<u8> {
    let dst = if op == 1 { [0xff; 6] } else { target.0 };
    let mut f = Vec::with_capacity(42);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&ether_src.unwrap_or(sender.0));
    f.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4]);
    f.extend_from_slice(&op.to_be_bytes());
    f.extend_from_slice(&sender.0);
    f.extend_from_slice(&sender.1.octets());
    f.extend_from_slice(&target.0);
    f.extend_from_slice(&target.1.octets());
    f
}

/// The interface's index in this process's network namespace.
pub(crate) fn ifindex(name: &str) -> io::Result<i32> {
    let c = CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "interface name has a NUL"))?;
    // SAFETY: `c` is a valid NUL-terminated string for the call.
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if index == 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(index as i32)
    }
}

/// A socket to ask the kernel about interfaces with, and a request naming
/// `name`.
fn interface_request(name: &str) -> io::Result<(OwnedFd, libc::ifreq)> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad interface name {name:?}"),
        ));
    }
    // SAFETY: plain socket(2); the result is checked and owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by no one else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is plain data; zeroed is a valid value for it.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    Ok((fd, req))
}

/// `request` (an interface ioctl reading and writing `req`) on `fd`.
fn interface_ioctl(fd: &OwnedFd, request: libc::Ioctl, req: &mut libc::ifreq) -> io::Result<()> {
    // SAFETY: every request passed here reads the name from and writes at
    // most an ifreq into `req`, valid for the duration of the call.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request, req as *mut libc::ifreq) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The interface's MAC, from the kernel of this process's network
/// namespace (SIOCGIFHWADDR; /sys may show another namespace).
pub fn interface_mac(name: &str) -> io::Result<[u8; 6]> {
    let (fd, mut req) = interface_request(name)?;
    interface_ioctl(&fd, libc::SIOCGIFHWADDR as _, &mut req)?;
    // SAFETY: after SIOCGIFHWADDR succeeds the union holds ifru_hwaddr.
    let data = unsafe { req.ifr_ifru.ifru_hwaddr.sa_data };
    let mut mac = [0u8; 6];
    for (dst, src) in mac.iter_mut().zip(data.iter()) {
        *dst = *src as u8;
    }
    Ok(mac)
}

/// Gives the Ethernet interface `name` the MAC `mac` (SIOCSIFHWADDR): the
/// kernel's answer as it is (EBUSY where the driver cannot change it while
/// the interface is up).
pub fn set_interface_mac(name: &str, mac: [u8; 6]) -> io::Result<()> {
    let (fd, mut req) = interface_request(name)?;
    let mut address: libc::sockaddr = libc::sockaddr {
        sa_family: libc::ARPHRD_ETHER,
        sa_data: [0; 14],
    };
    for (dst, src) in address.sa_data.iter_mut().zip(mac) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_hwaddr = address;
    interface_ioctl(&fd, libc::SIOCSIFHWADDR as _, &mut req)
}

/// Brings the interface `name` up or down (its IFF_UP flag), its other
/// flags kept.
pub fn set_interface_up(name: &str, up: bool) -> io::Result<()> {
    let (fd, mut req) = interface_request(name)?;
    interface_ioctl(&fd, libc::SIOCGIFFLAGS as _, &mut req)?;
    // SAFETY: after SIOCGIFFLAGS succeeds the union holds ifru_flags.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    let up_flag = libc::IFF_UP as libc::c_short;
    req.ifr_ifru.ifru_flags = if up {
        flags | up_flag
    } else {
        flags & !up_flag
    };
    interface_ioctl(&fd, libc::SIOCSIFFLAGS as _, &mut req)
}

/// A packet socket bound to `iface`, receiving every protocol.
///
/// Made with protocol 0, which receives nothing, and given its protocol by
/// the bind: a socket made with a protocol listens on every interface at
/// once, and binding it must first take that listener down, which waits
/// out an RCU grace period (10 ms of every VM's plug: the `dhcp responder`
/// stage of `make bench-create`).
fn packet_socket(iface: &str, filter: Option<&[libc::sock_filter]>) -> io::Result<OwnedFd> {
    let index = ifindex(iface)?;
    let proto = (libc::ETH_P_ALL as u16).to_be();
    // SAFETY: plain socket(2); the result is checked before use. Protocol
    // 0: it receives nothing until it is bound below.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by no one else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    if let Some(program) = filter {
        let prog = libc::sock_fprog {
            len: program.len() as u16,
            filter: program.as_ptr().cast_mut(),
        };
        // SAFETY: SO_ATTACH_FILTER takes a sock_fprog, passed with its size;
        // the kernel copies the program it points to during the call.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ATTACH_FILTER,
                std::ptr::from_ref(&prog).cast(),
                std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    // SAFETY: sockaddr_ll is plain data; zeroed is a valid value for it.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = proto;
    addr.sll_ifindex = index;
    // SAFETY: `addr` is a valid sockaddr_ll and its size is passed with it.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            std::ptr::from_ref(&addr).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}
