//! Network test support: a private network namespace, links, named
//! namespaces removed on drop, a one-shot DHCP client, and DHCP frames and
//! leases for the responder. Every name it makes is test-only.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Output;

use crate::net::addresses::Subnet;
use crate::net::dhcp::Lease;
use crate::net::dhcp::codec::{Kind, Message, build_frame, option};
use crate::net::underlay::UnderlayConfig;

/// Moves this test process into a network namespace of its own, so what
/// it builds never touches the host's links or firewall. Call it first,
/// while the process has one thread (nextest runs a test per process).
#[cfg(target_os = "linux")]
pub fn private_network() {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
        .unwrap_or_else(|e| panic!("unshare a network namespace (needs root): {e}"));
}

/// Runs `ip` and fails the test, with its stderr, if it fails.
pub fn ip(args: &[&str]) {
    let out = super::tools::tool("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("ip: {e}"));
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Named namespaces, deleted on drop.
pub struct Namespaces(pub Vec<String>);

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = super::tools::tool("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// The address of this namespace on a [`remote_host`]'s link, and the
/// remote host's.
pub const THIS_SIDE: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
pub const REMOTE: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);

/// A host beyond this one: the namespace `ns` on a veth link of its own
/// (`link` on this side, [`THIS_SIDE`]; `eth0` there, [`REMOTE`]), with no
/// route to anywhere else. Removed (the link with it) on drop.
pub fn remote_host(ns: &str, link: &str) -> Namespaces {
    let cleanup = Namespaces(vec![ns.to_owned()]);
    ip(&["netns", "add", ns]);
    ip(&[
        "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns,
    ]);
    ip(&["addr", "add", &format!("{THIS_SIDE}/24"), "dev", link]);
    ip(&["link", "set", link, "up"]);
    ip(&[
        "-n",
        ns,
        "addr",
        "add",
        &format!("{REMOTE}/24"),
        "dev",
        "eth0",
    ]);
    ip(&["-n", ns, "link", "set", "eth0", "up"]);
    ip(&["-n", ns, "link", "set", "lo", "up"]);
    cleanup
}

/// How many segments `stream`'s kernel sent again (TCP_INFO's total): 0
/// for a connection whose first SYN was answered.
#[cfg(target_os = "linux")]
pub fn retransmits(stream: &std::net::TcpStream) -> std::io::Result<u32> {
    use nix::libc;
    use std::os::fd::AsRawFd;
    // SAFETY: tcp_info is plain data; zeroed is a valid value for it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: TCP_INFO fills a tcp_info of at most `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            std::ptr::from_mut(&mut info).cast(),
            &mut len,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(info.tcpi_total_retrans)
}

/// Closes `stream` with a reset when it is dropped (SO_LINGER 0): the
/// stand-in's guest keeps no connection, and a FIN it never answers is
/// sent again and again, each a frame that wakes a sleeping VM.
#[cfg(target_os = "linux")]
pub fn reset_on_close(stream: &std::net::TcpStream) -> std::io::Result<()> {
    nix::sys::socket::setsockopt(
        stream,
        nix::sys::socket::sockopt::Linger,
        &nix::libc::linger {
            l_onoff: 1,
            l_linger: 0,
        },
    )
    .map_err(std::io::Error::from)
}

/// One lease attempt of busybox udhcpc on `iface` in namespace `ns`, with
/// `script` run on each event; `extra` arguments are passed on.
pub fn udhcpc(ns: &str, iface: &str, script: &Path, extra: &[&str]) -> Output {
    super::tools::require("udhcpc");
    super::tools::tool("ip")
        .args([
            "netns", "exec", ns, "udhcpc", "-i", iface, "-f", "-q", "-n", "-t", "5", "-T", "1",
            "-s",
        ])
        .arg(script)
        .args(extra)
        .output()
        .unwrap_or_else(|e| panic!("udhcpc (busybox): {e}"))
}

pub use super::tools::script;

/// The tests' underlay: bridge `etbr0`, 100.77.0.0/16, table `eitri_test`,
/// guest taps named `etg…`, no ranges denied beyond the defaults.
pub fn underlay_config() -> UnderlayConfig {
    UnderlayConfig {
        bridge: "etbr0".into(),
        subnet: Subnet::parse("100.77.0.0/16").unwrap_or_else(|e| panic!("{e}")),
        table: "eitri_test".into(),
        tap_prefix: "etg".into(),
        egress: crate::net::underlay::Egress::default(),
        publish: crate::model::PortRange::new(30000, 30999).unwrap_or_default(),
    }
}

/// A lease on the tests' underlay.
pub fn lease(mac: [u8; 6], ip: Ipv4Addr) -> Lease {
    Lease {
        mac,
        ip,
        netmask: Ipv4Addr::new(255, 255, 0, 0),
        gateway: Ipv4Addr::new(100, 77, 0, 1),
        dns: vec![Ipv4Addr::new(100, 77, 0, 1)],
        lease_secs: 3600,
    }
}

/// A client's DHCP message in a broadcast frame from `mac`.
pub fn client_frame(mac: [u8; 6], kind: Kind, xid: u32, requested: Option<Ipv4Addr>) -> Vec<u8> {
    let mut options = vec![(option::MESSAGE_TYPE, vec![kind.byte()])];
    if let Some(ip) = requested {
        options.push((option::REQUESTED_IP, ip.octets().to_vec()));
    }
    let m = Message {
        options,
        ..Message::new(1, xid, mac)
    };
    build_frame(
        mac,
        [0xff; 6],
        (Ipv4Addr::UNSPECIFIED, 68),
        (Ipv4Addr::BROADCAST, 67),
        &m.encode(),
    )
}

/// Runs `f` on a thread inside the named network namespace `ns` (as made
/// by `ip netns add`): sockets it opens belong to that namespace.
#[cfg(target_os = "linux")]
pub fn within<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let file = std::fs::File::open(format!("/run/netns/{ns}"))
                    .unwrap_or_else(|e| panic!("namespace {ns}: {e}"));
                nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET)
                    .unwrap_or_else(|e| panic!("enter namespace {ns}: {e}"));
                f()
            })
            .join()
            .unwrap_or_else(|_| panic!("the thread in namespace {ns} panicked"))
    })
}

/// The packets counted by the rule of nft chain `chain` (in `family`
/// table `table`) whose comment is `comment`; 0 when it counted none.
pub fn nft_counter(family: &str, table: &str, chain: &str, comment: &str) -> u64 {
    let out = super::tools::tool("nft")
        .args(["list", "chain", family, table, chain])
        .output()
        .unwrap_or_else(|e| panic!("nft: {e}"));
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains(&format!("comment \"{comment}\"")))
        .unwrap_or_else(|| panic!("no rule {comment:?} in {family} {table} {chain}: {text}"));
    line.split_whitespace()
        .skip_while(|w| *w != "packets")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no counter on {line:?}"))
}

/// The whole nft ruleset, as `nft list ruleset` prints it.
pub fn nft_ruleset() -> String {
    let out = super::tools::tool("nft")
        .args(["list", "ruleset"])
        .output()
        .unwrap_or_else(|e| panic!("nft: {e}"));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The elements of the nft set `set`, as `nft list ruleset` prints it (the
/// set's first listing).
pub fn nft_set_elements(set: &str) -> String {
    let rules = nft_ruleset();
    let start = rules
        .find(&format!("set {set} {{"))
        .unwrap_or_else(|| panic!("no set {set}: {rules}"));
    let end = rules[start..].find('}').map_or(rules.len(), |e| start + e);
    rules[start..end].to_owned()
}

/// The nft table `name` of `family` as `nft list table` prints it; `None`
/// when there is none.
pub fn nft_table(family: &str, name: &str) -> Option<String> {
    let out = super::tools::tool("nft")
        .args(["list", "table", family, name])
        .output()
        .unwrap_or_else(|e| panic!("nft: {e}"));
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether a link of this name exists in this process's network namespace
/// (asked of the kernel: /sys shows the namespace that mounted it).
pub fn link_exists(name: &str) -> bool {
    let Ok(c) = std::ffi::CString::new(name) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated string for the call.
    unsafe { nix::libc::if_nametoindex(c.as_ptr()) != 0 }
}
