//! The DHCP responder's socket and thread, one per VM, bound to its tap.
//!
//! A packet socket with ETH_P_ALL, bound to the interface: an ETH_P_IP
//! packet socket on a bridge port receives nothing, and a UDP socket on
//! port 67 would need an address on every tap. Replies are built whole
//! (Ethernet, IPv4, UDP, checksums) and sent L2-unicast to the VM's MAC.
//! Malformed packets are counted and dropped; a guest flooding DHCP gets a
//! bounded number of answers per second.

use std::ffi::CString;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use nix::libc;

use super::codec::{self, Frame, Kind, Message};
use super::{Lease, respond};

/// Answers allowed in a burst, and refilled per second.
const BURST: f64 = 20.0;
const PER_SECOND: f64 = 10.0;

#[derive(Debug, Default)]
pub struct ResponderStats {
    pub requests: AtomicU64,
    pub answered: AtomicU64,
    pub naks: AtomicU64,
    pub malformed: AtomicU64,
    pub rate_limited: AtomicU64,
}

pub struct Responder {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<ResponderStats>,
}

fn ifindex(name: &str) -> io::Result<i32> {
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

/// The interface's MAC, from the kernel of this process's network
/// namespace (SIOCGIFHWADDR; /sys may show another namespace).
fn interface_mac(name: &str) -> io::Result<[u8; 6]> {
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
    // SAFETY: SIOCGIFHWADDR reads the name from and writes the address into
    // `req`, a valid ifreq for the duration of the call.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFHWADDR, &mut req) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: after SIOCGIFHWADDR succeeds the union holds ifru_hwaddr.
    let data = unsafe { req.ifr_ifru.ifru_hwaddr.sa_data };
    let mut mac = [0u8; 6];
    for (dst, src) in mac.iter_mut().zip(data.iter()) {
        *dst = *src as u8;
    }
    Ok(mac)
}

/// A packet socket bound to `iface`, receiving every protocol.
fn packet_socket(iface: &str) -> io::Result<OwnedFd> {
    let index = ifindex(iface)?;
    let proto = (libc::ETH_P_ALL as u16).to_be();
    // SAFETY: plain socket(2); the result is checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            i32::from(proto),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by no one else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
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
    let timeout = libc::timeval {
        tv_sec: 0,
        tv_usec: 200_000,
    };
    // SAFETY: SO_RCVTIMEO takes a timeval, passed with its size.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            std::ptr::from_ref(&timeout).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

impl Responder {
    /// Starts answering `lease.mac` on `iface`.
    pub fn start(iface: &str, lease: Lease) -> io::Result<Responder> {
        let fd = packet_socket(iface)?;
        let our_mac = interface_mac(iface)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(ResponderStats::default());
        let thread = {
            let (stop, stats) = (Arc::clone(&stop), Arc::clone(&stats));
            std::thread::Builder::new()
                .name(format!("dhcp-{iface}"))
                .stack_size(128 * 1024)
                .spawn(move || serve(&fd, &lease, our_mac, &stop, &stats))?
        };
        Ok(Responder {
            stop,
            thread: Some(thread),
            stats,
        })
    }

    pub fn stats(&self) -> &ResponderStats {
        &self.stats
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(fd: &OwnedFd, lease: &Lease, our_mac: [u8; 6], stop: &AtomicBool, stats: &ResponderStats) {
    let mut buf = vec![0u8; 2048];
    let mut tokens = BURST;
    let mut refilled = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        // SAFETY: `buf` is valid for writes of its length.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            match err.kind() {
                // The receive timeout (to look at `stop`), or a signal.
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => continue,
                // The interface went away (its VMM exited): nothing left to
                // answer; the next boot starts a new responder.
                _ => {
                    log::debug!("DHCP responder for {:02x?} ends: {err}", lease.mac);
                    return;
                }
            }
        }
        if n == 0 {
            continue;
        }
        let frame = &buf[..n as usize];
        // Only the VM's own frames to the server port are ours to read; the
        // socket also sees our replies and all other traffic on the tap.
        let Ok(parsed) = Frame::parse(frame) else {
            continue;
        };
        if parsed.src_mac != lease.mac || parsed.dst_port != codec::SERVER_PORT {
            continue;
        }
        stats.requests.fetch_add(1, Ordering::Relaxed);
        let request = match Message::parse(parsed.payload) {
            Ok(m) => m,
            Err(_) => {
                stats.malformed.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        tokens = (tokens + refilled.elapsed().as_secs_f64() * PER_SECOND).min(BURST);
        refilled = Instant::now();
        if tokens < 1.0 {
            stats.rate_limited.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let Some(reply) = respond(lease, &request) else {
            continue;
        };
        tokens -= 1.0;
        let dst_ip = match reply.kind() {
            Some(Kind::Nak) => Ipv4Addr::BROADCAST,
            Some(_) if reply.yiaddr.is_unspecified() => request.ciaddr,
            _ => reply.yiaddr,
        };
        let out = codec::build_frame(
            our_mac,
            lease.mac,
            (lease.server_id(), codec::SERVER_PORT),
            (dst_ip, codec::CLIENT_PORT),
            &reply.encode(),
        );
        // SAFETY: `out` is valid for reads of its length; the socket is
        // bound, so send(2) needs no address.
        let sent = unsafe { libc::send(fd.as_raw_fd(), out.as_ptr().cast(), out.len(), 0) };
        if sent < 0 {
            log::warn!(
                "DHCP: cannot answer {:02x?}: {}",
                lease.mac,
                io::Error::last_os_error()
            );
            continue;
        }
        stats.answered.fetch_add(1, Ordering::Relaxed);
        if reply.kind() == Some(Kind::Nak) {
            stats.naks.fetch_add(1, Ordering::Relaxed);
        }
    }
}
