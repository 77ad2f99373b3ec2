//! `make bench-net`: the DHCP responder's latency on a veth, from a client
//! frame sent to the reply received, for DISCOVER → OFFER and
//! REQUEST → ACK. The floor, in the same run: a bare echo thread on the
//! same veth (a frame's round trip with no DHCP work at all).
//!
//! Runs in a network namespace of its own (root). Requests are paced under
//! the responder's flood limit (10 answers a second after a burst of 20):
//! this measures latency, not throughput.

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use eitri_agent::net::dhcp::Responder;
use eitri_agent::net::dhcp::codec::{Frame, Kind, Message};
use eitri_agent::net::packet::PacketSocket;
use eitri_agent::testkit::net::{client_frame, lease};

const CLIENT_MAC: [u8; 6] = [0x02, 0xe1, 0, 0, 0, 0x42];
const ROUNDS: usize = 40;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn ip(args: &[&str]) -> Res<()> {
    let ok = Command::new("ip").args(args).status()?.success();
    if ok {
        Ok(())
    } else {
        Err(format!("ip {args:?} failed").into())
    }
}

fn message(kind: Kind, xid: u32, requested: Option<Ipv4Addr>) -> Vec<u8> {
    client_frame(CLIENT_MAC, kind, xid, requested)
}

/// Sends `frame` and waits for a frame `accept` takes; the time between.
fn round_trip(
    client: &PacketSocket,
    frame: &[u8],
    accept: impl Fn(&[u8]) -> bool,
) -> Res<Duration> {
    let mut buf = vec![0u8; 2048];
    let start = Instant::now();
    client.send(frame)?;
    loop {
        let n = client.recv(&mut buf)?;
        if accept(&buf[..n]) {
            return Ok(start.elapsed());
        }
        if start.elapsed() > Duration::from_secs(2) {
            return Err("no answer within 2 s".into());
        }
    }
}

fn is_reply(frame: &[u8], xid: u32, kind: Kind) -> bool {
    Frame::parse(frame)
        .ok()
        .filter(|f| f.dst_port == 68)
        .and_then(|f| Message::parse(f.payload).ok())
        .is_some_and(|m| m.xid == xid && m.kind() == Some(kind))
}

fn p50(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e6
}

fn main() -> Res<()> {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)?;
    ip(&[
        "link", "add", "etnh", "type", "veth", "peer", "name", "etnc",
    ])?;
    ip(&["link", "set", "etnc", "address", "02:e1:00:00:00:42"])?;
    ip(&["link", "set", "etnh", "up"])?;
    ip(&["link", "set", "etnc", "up"])?;
    let client = PacketSocket::open("etnc", Some(Duration::from_millis(500)))?;

    // The floor: an echo thread on the server side of the same veth.
    let stop = Arc::new(AtomicBool::new(false));
    let echo = {
        let stop = Arc::clone(&stop);
        let server = PacketSocket::open("etnh", Some(Duration::from_millis(100)))?;
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 2048];
            while !stop.load(Ordering::Relaxed) {
                if let Ok(n) = server.recv(&mut buf)
                    && n >= 14
                    && buf[6..12] == CLIENT_MAC
                {
                    let mut reply = buf[..n].to_vec();
                    reply[..6].copy_from_slice(&CLIENT_MAC);
                    reply[6..12].copy_from_slice(&[0x02, 0xe1, 0, 0, 0, 0x01]);
                    let _ = server.send(&reply);
                }
            }
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    // Paced exactly like the DHCP rounds below: the first echo of a round
    // follows 210 ms of idleness (paying the CPU's wake-up), the second
    // follows at once.
    let echoed = |f: &[u8]| f.len() >= 12 && f[6..12] == [0x02, 0xe1, 0, 0, 0, 0x01];
    let (mut idle_echoes, mut hot_echoes) = (Vec::new(), Vec::new());
    for i in 0..ROUNDS as u32 {
        idle_echoes.push(round_trip(
            &client,
            &message(Kind::Discover, i, None),
            echoed,
        )?);
        hot_echoes.push(round_trip(
            &client,
            &message(Kind::Discover, i, None),
            echoed,
        )?);
        std::thread::sleep(Duration::from_millis(210));
    }
    stop.store(true, Ordering::Relaxed);
    let _ = echo.join();

    let lease = lease(CLIENT_MAC, Ipv4Addr::new(100, 77, 0, 42));
    let _responder = Responder::start("etnh", lease.clone())?;
    std::thread::sleep(Duration::from_millis(50));
    let (mut offers, mut acks) = (Vec::new(), Vec::new());
    for i in 0..ROUNDS as u32 {
        let xid = 1000 + i;
        offers.push(round_trip(
            &client,
            &message(Kind::Discover, xid, None),
            |f| is_reply(f, xid, Kind::Offer),
        )?);
        acks.push(round_trip(
            &client,
            &message(Kind::Request, xid, Some(lease.ip)),
            |f| is_reply(f, xid, Kind::Ack),
        )?);
        // Two answers per round, paced under the flood limit.
        std::thread::sleep(Duration::from_millis(210));
    }
    let (offer, ack) = (p50(offers), p50(acks));
    let (idle, hot) = (p50(idle_echoes), p50(hot_echoes));
    println!(
        "DHCP on a veth: OFFER p50 {offer:.0} us (after idle; a bare echo after idle {idle:.0} us), ACK p50 {ack:.0} us (right after; a bare echo {hot:.0} us)"
    );
    println!(
        "bench=net offer_us_p50={offer:.0} ack_us_p50={ack:.0} echo_idle_us_p50={idle:.0} echo_hot_us_p50={hot:.0} offer_ratio={:.2} ack_ratio={:.2}",
        offer / idle,
        ack / hot
    );
    Ok(())
}
