//! The DHCP responder's socket and thread, one per VM, bound to its tap.
//!
//! A packet socket with ETH_P_ALL, bound to the interface: an ETH_P_IP
//! packet socket on a bridge port receives nothing, and a UDP socket on
//! port 67 would need an address on every tap. Replies are built whole
//! (Ethernet, IPv4, UDP, checksums) and sent L2-unicast to the VM's MAC.
//! Malformed packets are counted and dropped; a guest flooding DHCP gets a
//! bounded number of answers per second.

use std::io;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::net::packet::PacketSocket;
use crate::threads::{OwnedThread, StopFlag};

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

/// The `dhcp-<tap>` thread; stopped and joined on drop.
pub struct Responder {
    _thread: OwnedThread,
    stats: Arc<ResponderStats>,
}

impl Responder {
    /// Starts answering `lease.mac` on `iface`.
    pub fn start(iface: &str, lease: Lease) -> io::Result<Responder> {
        let socket = PacketSocket::open_dhcp(iface, Some(Duration::from_millis(200)))?;
        let our_mac = socket.mac();
        let stats = Arc::new(ResponderStats::default());
        let thread = {
            let stats = Arc::clone(&stats);
            OwnedThread::spawn(format!("dhcp-{iface}"), 128 * 1024, None, move |stop| {
                serve(&socket, &lease, our_mac, &stop, &stats);
            })?
        };
        Ok(Responder {
            _thread: thread,
            stats,
        })
    }

    pub fn stats(&self) -> &ResponderStats {
        &self.stats
    }
}

fn serve(
    socket: &PacketSocket,
    lease: &Lease,
    our_mac: [u8; 6],
    stop: &StopFlag,
    stats: &ResponderStats,
) {
    let mut buf = vec![0u8; 2048];
    let mut tokens = BURST;
    let mut refilled = Instant::now();
    while !stop.stopped() {
        let n = match socket.recv(&mut buf) {
            Ok(0) => continue,
            Ok(n) => n,
            // The receive timeout (to look at `stop`), or a signal.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            // The interface went away (its VMM exited): nothing left to
            // answer; the next boot starts a new responder.
            Err(e) => {
                log::debug!("DHCP responder for {:02x?} ends: {e}", lease.mac);
                return;
            }
        };
        let frame = &buf[..n];
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
        if let Err(e) = socket.send(&out) {
            log::warn!("DHCP: cannot answer {:02x?}: {e}", lease.mac);
            continue;
        }
        stats.answered.fetch_add(1, Ordering::Relaxed);
        if reply.kind() == Some(Kind::Nak) {
            stats.naks.fetch_add(1, Ordering::Relaxed);
        }
    }
}
