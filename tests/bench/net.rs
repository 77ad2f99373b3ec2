//! `make bench-net`: the DHCP responder's latency on a veth, from a client
//! frame sent to the reply received, for DISCOVER → OFFER and
//! REQUEST → ACK. The floor, in the same run: a bare echo thread on the
//! same veth (a frame's round trip with no DHCP work at all).
//!
//! Runs in a network namespace of its own (root). Requests are paced under
//! the responder's flood limit (10 answers a second after a burst of 20):
//! this measures latency, not throughput.
//!
//! Then the guards' cost: a guest namespace behind a guarded port sends TCP
//! to a "remote" namespace through the NAT, with the masquerade alone, with
//! the agent's whole ruleset (port guard, host egress policy), and with
//! that and a deny-list of the guest's own its traffic passes, all three
//! in each of 15 rounds (the order rotates). `filter_ratio` is the median
//! of the rounds' guarded-over-bare ratios, `own_rules_ratio` the same
//! with the guest's own rules (1.0 = they cost nothing). On two busy cores
//! one round's ratio still swings by ±10 %: pairing cancels the drift
//! between rounds, not within one.

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use eitri_agent::model::{Cidr, Egress, Mac};
use eitri_agent::net::dhcp::Responder;
use eitri_agent::net::dhcp::codec::{Frame, Kind, Message};
use eitri_agent::net::packet::PacketSocket;
use eitri_agent::net::underlay::{Port, Underlay};
use eitri_agent::testkit::net::{Namespaces, client_frame, lease, underlay_config, within};

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
    let Throughput {
        guarded_mbps: filtered,
        bare_mbps: bare,
        own_rules_mbps: own,
        ratio,
        own_rules_ratio,
    } = throughput_with_and_without_guards()?;
    println!(
        "guest to remote TCP through the NAT: {filtered:.0} Mbit/s guarded, {own:.0} Mbit/s guarded with a deny-list of its own, {bare:.0} Mbit/s with the masquerade alone"
    );
    println!(
        "DHCP on a veth: OFFER p50 {offer:.0} us (after idle; a bare echo after idle {idle:.0} us), ACK p50 {ack:.0} us (right after; a bare echo {hot:.0} us)"
    );
    println!(
        "bench=net offer_us_p50={offer:.0} ack_us_p50={ack:.0} echo_idle_us_p50={idle:.0} echo_hot_us_p50={hot:.0} offer_ratio={:.2} ack_ratio={:.2} guarded_mbps={filtered:.0} bare_mbps={bare:.0} filter_ratio={:.3} own_rules_mbps={own:.0} own_rules_ratio={own_rules_ratio:.3}",
        offer / idle,
        ack / hot,
        ratio
    );
    Ok(())
}

const GUEST: Ipv4Addr = Ipv4Addr::new(100, 77, 5, 5);
const REMOTE: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
const ROUND: Duration = Duration::from_millis(1000);
const TCP_ROUNDS: usize = 15;

/// Megabits a second a guest sends to the remote over one TCP connection
/// for one round.
fn send_round(guest_ns: &str, to: std::net::SocketAddr) -> Res<f64> {
    use std::io::Write;
    let sent = within(guest_ns, move || -> std::io::Result<u64> {
        let mut conn = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(2))?;
        let chunk = vec![0x5au8; 256 * 1024];
        let (start, mut sent) = (Instant::now(), 0u64);
        while start.elapsed() < ROUND {
            conn.write_all(&chunk)?;
            sent += chunk.len() as u64;
        }
        Ok(sent)
    })?;
    Ok(sent as f64 * 8.0 / ROUND.as_secs_f64() / 1e6)
}

fn guest_mac() -> Res<Mac> {
    Mac::parse("02:e1:00:00:00:07").ok_or_else(|| "a MAC".into())
}

/// What guards the guest in a round.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Setup {
    /// The masquerade alone.
    Bare,
    /// The agent's whole ruleset, the guest with no rules of its own.
    Guarded,
    /// The same, the guest with a deny-list of its own its traffic passes
    /// (every packet looked up in it).
    OwnRules,
}

fn rules(setup: Setup) -> Res<()> {
    let port = Port {
        tap: "etgbench",
        mac: guest_mac()?,
        ip: Some(GUEST),
    };
    let mut text = match setup {
        Setup::Bare => "flush ruleset\ntable ip bare {\n\tchain postrouting {\n\t\ttype nat hook postrouting priority srcnat; policy accept;\n\t\tip saddr 100.77.0.0/16 oifname != \"etbr0\" masquerade\n\t}\n}\n".to_owned(),
        Setup::Guarded | Setup::OwnRules => {
            eitri_agent::net::rules::nft_ruleset(&underlay_config())
                + &eitri_agent::net::rules::port_ruleset("eitri_test", &port)
        }
    };
    if setup == Setup::OwnRules {
        text += &eitri_agent::net::rules::egress_ruleset(
            "eitri_test",
            GUEST,
            &Egress::default(),
            &Egress {
                deny: Cidr::parse_list("10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16")?,
                allow: Cidr::parse_list("10.1.0.0/16")?,
            },
        );
    }
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        use std::io::Write;
        stdin.write_all(text.as_bytes())?;
    }
    if child.wait()?.success() {
        Ok(())
    } else {
        Err("nft refused the ruleset".into())
    }
}

/// Throughput guarded and bare, in paired rounds.
fn throughput_with_and_without_guards() -> Res<Throughput> {
    let underlay = Underlay::setup(underlay_config())?;
    let tag = format!("{:x}", std::process::id() & 0xffff);
    let (guest, remote) = (format!("etbg{tag}"), format!("etbr{tag}"));
    let _cleanup = Namespaces(vec![guest.clone(), remote.clone()]);
    ip(&["netns", "add", &guest])?;
    ip(&[
        "link", "add", "etgbench", "type", "veth", "peer", "name", "eth0", "netns", &guest,
    ])?;
    ip(&[
        "-n",
        &guest,
        "link",
        "set",
        "eth0",
        "address",
        "02:e1:00:00:00:07",
    ])?;
    ip(&["-n", &guest, "link", "set", "eth0", "up"])?;
    ip(&["-n", &guest, "addr", "add", "100.77.5.5/16", "dev", "eth0"])?;
    ip(&["-n", &guest, "route", "add", "default", "via", "100.77.0.1"])?;
    underlay.attach(&Port {
        tap: "etgbench",
        mac: guest_mac()?,
        ip: Some(GUEST),
    })?;
    ip(&["netns", "add", &remote])?;
    ip(&[
        "link",
        "add",
        "etbremote",
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        &remote,
    ])?;
    ip(&["addr", "add", "198.51.100.1/24", "dev", "etbremote"])?;
    ip(&["link", "set", "etbremote", "up"])?;
    ip(&[
        "-n",
        &remote,
        "addr",
        "add",
        "198.51.100.2/24",
        "dev",
        "eth0",
    ])?;
    ip(&["-n", &remote, "link", "set", "eth0", "up"])?;
    let listener = within(&remote, || std::net::TcpListener::bind((REMOTE, 0)))?;
    let to = listener.local_addr()?;
    let sink = std::thread::spawn(move || {
        use std::io::Read;
        let mut buf = vec![0u8; 256 * 1024];
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            while matches!(conn.read(&mut buf), Ok(n) if n > 0) {}
        }
    });
    // Each round measures all three, in an order that rotates between
    // rounds, so the machine's drift and whichever runs last weigh on each
    // alike; a ratio is the median of the rounds' own ratios.
    let order = [Setup::Bare, Setup::Guarded, Setup::OwnRules];
    let (mut rates, mut guard_ratios, mut own_ratios) = ([vec![], vec![], vec![]], vec![], vec![]);
    for round in 0..TCP_ROUNDS {
        let mut rate = [0.0f64; 3];
        for k in 0..3 {
            let which = (round + k) % 3;
            rules(order[which])?;
            rate[which] = send_round(&guest, to)?;
        }
        for (all, r) in rates.iter_mut().zip(rate) {
            all.push(r);
        }
        guard_ratios.push(rate[1] / rate[0]);
        own_ratios.push(rate[2] / rate[0]);
    }
    drop(sink);
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let [bare, guarded, own] = rates;
    Ok(Throughput {
        bare_mbps: median(bare),
        guarded_mbps: median(guarded),
        own_rules_mbps: median(own),
        ratio: median(guard_ratios),
        own_rules_ratio: median(own_ratios),
    })
}

/// What the TCP rounds measured: each setup's median and the medians of
/// the rounds' ratios over bare.
struct Throughput {
    guarded_mbps: f64,
    bare_mbps: f64,
    own_rules_mbps: f64,
    ratio: f64,
    own_rules_ratio: f64,
}
