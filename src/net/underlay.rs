//! The underlay: one agent-owned bridge holding the guests' gateway, each
//! VM's tap an isolated port on it, and NAT to the outside through one nft
//! table the agent owns.
//!
//! At every start:
//! 1. The bridge exists, is up and holds the gateway address.
//! 2. IPv4 forwarding is on (logged when the agent turns it on; the
//!    agents' registry notes it, so the last agent's `release` turns it
//!    off again: see `state::claim`).
//! 3. The NAT is applied in one `nft -f` transaction that creates, deletes
//!    and redefines the agent's table, so applying it twice leaves exactly
//!    what applying it once did, and nothing is ever half-applied. Without
//!    nft, iptables with the agent's own chains; without either, host-only
//!    (guests reach the host, not beyond), said in the log and in `status`.
//! 4. A FORWARD chain whose policy is DROP (as Docker sets it) would drop
//!    guest traffic whatever the agent's table accepts: it gets accept
//!    rules for the bridge, inserted once.
//!
//! Ports are `isolated on`: guests cannot reach each other's L2, only the
//! gateway. (To let them, `bridge link set dev <tap> isolated off`.)
//!
//! With nft, guests are also held to what the host gave them (a guest owns
//! its NIC, so nothing it sends is believed):
//! - **Per port** (`table bridge <table>`): one chain for every tap,
//!   reading sets: each VM tap's name with its MAC (`macs`), and an
//!   underlay tap's name with its address (`addrs`, `underlay`), added in
//!   one transaction when the tap is plugged and removed at destroy.
//!   Frames must carry the VM's MAC; ARP must claim its MAC and address;
//!   IPv4 must come from its address (0.0.0.0 only for DHCP to a server);
//!   no DHCP server answers, no VLAN tags, no IPv6 on the underlay (it is
//!   not served) and no router advertisements anywhere. Every drop is
//!   counted (`nft list table bridge <table>`). A tap with the agent's
//!   prefix and no elements, as an adopted VM's is between a restart and
//!   its re-plug, matches no MAC and is dropped whole: the guard fails
//!   closed.
//! - **Egress** (`table ip <table>`): from the bridge, the host itself is
//!   reachable only for DHCP, DNS to the servers guests are told, and ping
//!   to the gateway; forwarding refuses guest to guest, link-local
//!   (169.254.0.0/16, where clouds keep metadata services), and every
//!   range in the deny list (`--guest-deny`, and the control plane's
//!   address), unless `--guest-allow` lets it. Nothing from outside opens
//!   a connection to a guest. Each VM's own rules (its spec's
//!   `egress_deny`/`egress_allow`) are elements of sets keyed by its
//!   address, checked first (see [`egress_ruleset`]).
//!
//! The rules themselves, as the `nft` text the agent applies, are
//! [`rules`](super::rules)'.
//!
//! Without nft nothing holds a guest to its MAC and address: the agent
//! says so in the log and in `status` ("unprotected").
//!
//! This shells out to iproute2 and nft/iptables, the tools every host has
//! and an operator can read back; netlink by hand would hide the same
//! operations in a few hundred lines of message building. One exception:
//! a tap joining the bridge, on every create's path, is two rtnetlink
//! messages (see [`netlink`](super::netlink)) that stand for two `ip`
//! commands and are named as them in errors.

#[cfg(target_os = "linux")]
use std::net::Ipv4Addr;

#[cfg(target_os = "linux")]
use super::addresses::Subnet;
pub use super::command::NetError;
#[cfg(target_os = "linux")]
use super::command::{have, run};
pub use super::port::Port;
pub use super::rules::{Egress, LINK_LOCAL, UnderlayConfig};
#[cfg(target_os = "linux")]
use super::rules::{
    address_element, egress_ruleset, nft_ruleset, port_ruleset, publish_ruleset, unport_ruleset,
};
#[cfg(target_os = "linux")]
use crate::model::Egress as VmEgress;
#[cfg(target_os = "linux")]
use crate::model::Publish;

/// How guests reach beyond the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Nat {
    Nft,
    Iptables,
    /// Neither tool: guests reach the host only.
    HostOnly,
}

#[cfg(target_os = "linux")]
pub struct Underlay {
    cfg: UnderlayConfig,
    nat: Nat,
    /// This start found IPv4 forwarding off and turned it on.
    turned_on_forwarding: bool,
}

impl Nat {
    /// Whether guests are held to their MAC and address and to the egress
    /// policy (only nft does it).
    pub fn guards(self) -> bool {
        self == Nat::Nft
    }
}

#[cfg(target_os = "linux")]
impl Underlay {
    /// Brings the underlay up (see the module steps).
    pub fn setup(cfg: UnderlayConfig) -> Result<Underlay, NetError> {
        let bridge = cfg.bridge.as_str();
        // Asked of the kernel, not of /sys: sysfs shows the network
        // namespace that mounted it, which need not be this process's.
        if run("ip", &["link", "show", "dev", bridge], None).is_err() {
            run("ip", &["link", "add", bridge, "type", "bridge"], None)?;
            log::info!("created the underlay bridge {bridge}");
        }
        pin_address(bridge)?;
        let gateway = format!("{}/{}", cfg.subnet.gateway(), cfg.subnet.prefix());
        run("ip", &["addr", "replace", &gateway, "dev", bridge], None)?;
        run("ip", &["link", "set", bridge, "up"], None)?;
        let turned_on_forwarding = enable_forwarding()?;
        let nat = if have("nft") {
            run("nft", &["-f", "-"], Some(&nft_ruleset(&cfg)))?;
            remove_legacy_tables(&cfg);
            Nat::Nft
        } else if have("iptables") {
            iptables_nat(&cfg)?;
            Nat::Iptables
        } else {
            log::warn!(
                "neither nft nor iptables is installed: guests reach this host only (host-only networking)"
            );
            Nat::HostOnly
        };
        if !nat.guards() {
            log::warn!("{UNGUARDED}");
        }
        accept_through_drop_policy(&cfg);
        Ok(Underlay {
            cfg,
            nat,
            turned_on_forwarding,
        })
    }

    pub fn nat(&self) -> Nat {
        self.nat
    }

    /// Whether this start turned the host's IPv4 forwarding on.
    pub fn turned_on_forwarding(&self) -> bool {
        self.turned_on_forwarding
    }

    pub fn subnet(&self) -> Subnet {
        self.cfg.subnet
    }

    pub fn config(&self) -> &UnderlayConfig {
        &self.cfg
    }

    /// Guards `port`, then makes it an isolated, up port of the bridge.
    pub fn attach(&self, port: &Port<'_>) -> Result<(), NetError> {
        self.guard(port)?;
        let _span = crate::stages::span("netlink");
        if let Some(ip) = port.ip {
            super::netlink::set_neighbour(&self.cfg.bridge, ip, port.mac.octets())?;
        }
        Ok(super::netlink::join_isolated(port.tap, &self.cfg.bridge)?)
    }

    /// Makes the guest port `tap` isolated from the bridge's other ports
    /// by the kernel (`on`, as [`Underlay::attach`] leaves it), or only by
    /// the bridge table's forward chain, which lets the connections to a
    /// published port through (see [`nft_ruleset`]): a port's isolation is
    /// off while its VM publishes ports, as a bridged connection to them
    /// from another guest (with `br_netfilter`, which bridges a DNAT back
    /// onto the bridge it came from) must pass it.
    ///
    /// The bridge table's rules for the port are in place before its
    /// isolation goes, and stay until it is back: the port is never left
    /// to the kernel's isolation alone while it has none. A port no longer
    /// there is isolated enough.
    pub fn isolate(&self, tap: &str, on: bool) -> Result<(), NetError> {
        let element = format!("bridge {} unisolated {{ \"{tap}\" }}", self.cfg.table);
        let netlink = |on| super::netlink::set_isolated(tap, on).map_err(NetError::from);
        if on {
            match netlink(true) {
                Err(NetError::Netlink { source, .. })
                    if source.raw_os_error() == Some(nix::libc::ENODEV) => {}
                other => other?,
            }
            if self.nat.guards() {
                let text = format!("add element {element}\ndelete element {element}\n");
                run("nft", &["-f", "-"], Some(&text))?;
            }
            return Ok(());
        }
        if !self.nat.guards() {
            return Err(NetError::Unenforceable {
                what: "a published port's way in from other guests",
            });
        }
        run(
            "nft",
            &["-f", "-"],
            Some(&format!("add element {element}\n")),
        )?;
        netlink(false)
    }

    /// Whether the tap `tap` of a sleeping VM (see `reconcile::sleepers`) is
    /// passed only what is for its guest: frames to its MAC and ARP for
    /// its address. Flooded frames (broadcasts, multicast, unicast to a
    /// MAC the bridge has not learned) would wake it for nothing.
    pub fn sleep(&self, tap: &str, on: bool) -> Result<(), NetError> {
        if !self.nat.guards() {
            return Ok(());
        }
        let element = format!("bridge {} asleep {{ \"{tap}\" }}", self.cfg.table);
        self.by_netlink_or_nft(
            || super::nftables::asleep(&self.cfg.table, tap, on),
            || {
                if on {
                    format!("add element {element}\n")
                } else {
                    format!("add element {element}\ndelete element {element}\n")
                }
            },
        )
    }

    /// Holds `port` to its MAC (and address), in one transaction. Nothing to do without nft (said at setup).
    pub fn guard(&self, port: &Port<'_>) -> Result<(), NetError> {
        if !self.nat.guards() {
            return Ok(());
        }
        let _span = crate::stages::span("nft guard");
        self.by_netlink_or_nft(
            || super::nftables::add(&self.cfg.table, port),
            || port_ruleset(&self.cfg.table, port),
        )
    }

    /// Lets the site tap `tap` send from `new` instead of `old` (either may
    /// be none), in one transaction: the address the site's DHCP server
    /// granted it, while the lease lasts.
    pub fn rebind(
        &self,
        tap: &str,
        old: Option<Ipv4Addr>,
        new: Option<Ipv4Addr>,
    ) -> Result<(), NetError> {
        if !self.nat.guards() || old == new {
            return Ok(());
        }
        let table = &self.cfg.table;
        self.by_netlink_or_nft(
            || super::nftables::rebind(table, tap, old, new),
            || {
                let mut text = String::new();
                if let Some(old) = old {
                    let e = address_element(table, tap, old);
                    text.push_str(&format!("add element {e}\ndelete element {e}\n"));
                }
                if let Some(new) = new {
                    text.push_str(&format!(
                        "add element {}\n",
                        address_element(table, tap, new)
                    ));
                }
                text
            },
        )
    }

    /// Removes `port`'s guard, in one transaction (absent is fine), and
    /// what the host was told of its address (see [`Underlay::attach`]).
    pub fn unguard(&self, port: &Port<'_>) -> Result<(), NetError> {
        if let Some(ip) = port.ip {
            super::netlink::forget_neighbour(&self.cfg.bridge, ip)?;
        }
        if !self.nat.guards() {
            return Ok(());
        }
        self.by_netlink_or_nft(
            || super::nftables::remove(&self.cfg.table, port),
            || unport_ruleset(&self.cfg.table, port),
        )
    }

    /// Moves the guest at `guest`'s own egress rules from `old` to `new`
    /// (see [`egress_ruleset`]). Without nft nothing can hold them: an
    /// error when there are any.
    pub fn set_egress(
        &self,
        guest: Ipv4Addr,
        old: &VmEgress,
        new: &VmEgress,
    ) -> Result<(), NetError> {
        if !self.nat.guards() {
            return if new.is_open() {
                Ok(())
            } else {
                Err(NetError::Unenforceable {
                    what: "a VM's own egress rules",
                })
            };
        }
        let text = egress_ruleset(&self.cfg.table, guest, old, new);
        if text.is_empty() {
            return Ok(());
        }
        run("nft", &["-f", "-"], Some(&text)).map(drop)
    }

    /// Moves a VM's published ports in the ruleset (see
    /// [`publish_ruleset`]). Without nft nothing can forward them: an
    /// error when there are any.
    pub fn publish(
        &self,
        old: Option<&(Ipv4Addr, Vec<Publish>)>,
        new: Option<&(Ipv4Addr, Vec<Publish>)>,
    ) -> Result<(), NetError> {
        if !self.nat.guards() {
            return if new.is_none_or(|(_, list)| list.is_empty()) {
                Ok(())
            } else {
                Err(NetError::Unenforceable {
                    what: "a VM's published ports",
                })
            };
        }
        let text = publish_ruleset(&self.cfg.table, old, new);
        if text.is_empty() {
            return Ok(());
        }
        run("nft", &["-f", "-"], Some(&text))?;
        forget_moved_flows(old, new);
        Ok(())
    }

    /// A guard change by netlink (see [`nftables`](super::nftables)); if
    /// the kernel refuses it, the same change as `nft` text, whose error is
    /// the one an operator can read.
    fn by_netlink_or_nft(
        &self,
        netlink: impl FnOnce() -> std::io::Result<()>,
        text: impl FnOnce() -> String,
    ) -> Result<(), NetError> {
        match netlink() {
            Ok(()) => Ok(()),
            Err(e) => {
                log::debug!("a guard change by netlink failed ({e}); running it with nft");
                run("nft", &["-f", "-"], Some(&text())).map(drop)
            }
        }
    }
}

/// What the log and `status` say where nothing guards the guests.
pub const UNGUARDED: &str = "guest traffic is unprotected: nft is not installed, so nothing holds a guest to its MAC and address or keeps it from this host's services (install nftables)";

/// Sets the bridge's MAC to the one it has: set, it is the bridge's own,
/// where a bridge left to itself takes the lowest of its ports' and
/// changes whenever a tap with a lower one joins or leaves. Each change
/// makes every guest's gateway another MAC (its ARP cache stale until it
/// asks again) and flushes the host's neighbour entries on the bridge,
/// the ones that say where each guest is too (see `netlink::set_neighbour`).
#[cfg(target_os = "linux")]
fn pin_address(bridge: &str) -> Result<(), NetError> {
    let mac = super::packet::interface_mac(bridge).map_err(|source| NetError::Netlink {
        request: format!("ip link show dev {bridge}"),
        source,
    })?;
    let mac = crate::model::Mac::from(mac).to_string();
    run("ip", &["link", "set", "dev", bridge, "address", &mac], None)?;
    Ok(())
}

/// Where the kernel keeps whether this network namespace forwards IPv4.
pub const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// Turns IPv4 forwarding on; whether it was off.
#[cfg(target_os = "linux")]
fn enable_forwarding() -> Result<bool, NetError> {
    let path = IP_FORWARD;
    let now = std::fs::read_to_string(path).unwrap_or_default();
    if now.trim() == "1" {
        return Ok(false);
    }
    std::fs::write(path, "1").map_err(|source| NetError::Forwarding { path, source })?;
    log::warn!(
        "turned IPv4 forwarding on ({path} was {:?}): this host is now its guests' router; `eitri-agent release` of the last agent with guests turns it off again",
        now.trim()
    );
    Ok(true)
}

/// Deletes the tracked connections of the ports the ruleset no longer
/// forwards to `old`'s guest as it did (moved to another guest or guest
/// port, or given back): a flow the kernel already translates is not asked
/// the new rules again, so without this it would go on reaching the old
/// guest. Said, not failed: the ports are already where they should be.
#[cfg(target_os = "linux")]
fn forget_moved_flows(
    old: Option<&(Ipv4Addr, Vec<Publish>)>,
    new: Option<&(Ipv4Addr, Vec<Publish>)>,
) {
    let Some((ip, list)) = old else {
        return;
    };
    let kept = |p: &Publish| new.is_some_and(|(at, now)| at == ip && now.contains(p));
    let stale: Vec<super::conntrack::Forwarded> = list
        .iter()
        .filter(|p| !kept(p))
        .map(|p| super::conntrack::Forwarded::of(p, *ip))
        .collect();
    match super::conntrack::forget(&stale) {
        Ok(0) => {}
        Ok(n) => log::info!("forgot {n} connection(s) published ports no longer forward to {ip}"),
        Err(e) => log::warn!(
            "cannot forget the connections published ports forwarded to {ip} before they moved (they reach it until they end): {e}"
        ),
    }
}

/// What every agent's tables were named before each agent's were its own.
#[cfg(target_os = "linux")]
const LEGACY_TABLE: &str = "eitri";

/// Removes the tables this agent built under [`LEGACY_TABLE`] before its
/// own were named after its claim (an agent of a state dir other than the
/// default one): left, their guard sets would stay as they were and drop
/// the traffic of every guest started since. Tables of that name that do
/// not name this agent's bridge are another agent's, and stay.
#[cfg(target_os = "linux")]
fn remove_legacy_tables(cfg: &UnderlayConfig) {
    if cfg.table == LEGACY_TABLE {
        return;
    }
    let ours = run("nft", &["list", "table", "ip", LEGACY_TABLE], None)
        .is_ok_and(|rules| rules.contains(&format!("iifname \"{}\"", cfg.bridge)));
    if !ours {
        return;
    }
    for family in ["ip", "bridge"] {
        if let Err(e) = run("nft", &["delete", "table", family, LEGACY_TABLE], None) {
            log::warn!("cannot remove this agent's old firewall table: {e}");
        }
    }
    log::info!(
        "removed this agent's firewall tables {LEGACY_TABLE:?} (its own are now {:?})",
        cfg.table
    );
}

/// NAT with iptables: the agent's own chain, flushed and refilled, jumped
/// to once from POSTROUTING.
#[cfg(target_os = "linux")]
fn iptables_nat(cfg: &UnderlayConfig) -> Result<(), NetError> {
    let chain = format!("{}-POSTROUTING", cfg.table.to_uppercase());
    let subnet = cfg.subnet.to_string();
    let _ = run("iptables", &["-t", "nat", "-N", &chain], None);
    run("iptables", &["-t", "nat", "-F", &chain], None)?;
    run(
        "iptables",
        &[
            "-t",
            "nat",
            "-A",
            &chain,
            "-s",
            &subnet,
            "!",
            "-o",
            &cfg.bridge,
            "-j",
            "MASQUERADE",
        ],
        None,
    )?;
    if run(
        "iptables",
        &["-t", "nat", "-C", "POSTROUTING", "-j", &chain],
        None,
    )
    .is_err()
    {
        run(
            "iptables",
            &["-t", "nat", "-I", "POSTROUTING", "-j", &chain],
            None,
        )?;
    }
    Ok(())
}

/// The FORWARD rules that accept `bridge`'s traffic through a DROP policy.
#[cfg(target_os = "linux")]
fn forward_accepts(bridge: &str) -> [Vec<&str>; 2] {
    [
        vec!["FORWARD", "-i", bridge, "-j", "ACCEPT"],
        vec![
            "FORWARD",
            "-o",
            bridge,
            "-m",
            "conntrack",
            "--ctstate",
            "RELATED,ESTABLISHED",
            "-j",
            "ACCEPT",
        ],
    ]
}

/// `rule` after the iptables operation `op` (`-C`, `-I`, `-D`).
#[cfg(target_os = "linux")]
fn iptables_op<'a>(op: &'a str, rule: &[&'a str]) -> Vec<&'a str> {
    std::iter::once(op).chain(rule.iter().copied()).collect()
}

/// Takes back what an ended claim's agent set up for its guests (see
/// [`Underlay::setup`]): its nft tables (ip and bridge), or its iptables
/// NAT chain and FORWARD accepts, and its bridge, once no port is left on
/// it (a guest still plugged in keeps it, said in `left`). Names come from
/// the claim's record; what is not there is not an error.
#[cfg(target_os = "linux")]
pub fn take_back(
    network: &crate::state::claim::Network,
    taken: &mut Vec<String>,
    left: &mut Vec<String>,
) {
    let (t, b) = (network.table.as_str(), network.bridge.as_str());
    if let Ok(ports) = run("ip", &["-o", "link", "show", "master", b], None)
        && !ports.trim().is_empty()
    {
        left.push(format!("bridge {b}: guests are still plugged into it"));
        return;
    }
    let mut said = |what: String, done: Result<String, NetError>| match done {
        Ok(_) => taken.push(what),
        Err(e) => left.push(format!("{what}: {e}")),
    };
    for family in ["ip", "bridge"] {
        if run("nft", &["list", "table", family, t], None).is_ok() {
            said(
                format!("nft table {family} {t}"),
                run("nft", &["delete", "table", family, t], None),
            );
        }
    }
    let chain = format!("{}-POSTROUTING", t.to_uppercase());
    if run("iptables", &["-t", "nat", "-S", &chain], None).is_ok() {
        while run(
            "iptables",
            &["-t", "nat", "-D", "POSTROUTING", "-j", &chain],
            None,
        )
        .is_ok()
        {}
        let _ = run("iptables", &["-t", "nat", "-F", &chain], None);
        said(
            format!("iptables chain nat {chain}"),
            run("iptables", &["-t", "nat", "-X", &chain], None),
        );
    }
    for rule in forward_accepts(b) {
        let check = iptables_op("-C", &rule);
        if run("iptables", &check, None).is_ok() {
            let delete = iptables_op("-D", &rule);
            said(
                format!("iptables {}", rule.join(" ")),
                run("iptables", &delete, None),
            );
        }
    }
    if run("ip", &["link", "show", "dev", b], None).is_ok() {
        said(format!("bridge {b}"), run("ip", &["link", "del", b], None));
    }
}

#[cfg(target_os = "linux")]
/// With a FORWARD policy of DROP in iptables (Docker's), the bridge's
/// traffic is accepted explicitly, once.
fn accept_through_drop_policy(cfg: &UnderlayConfig) {
    let Ok(rules) = run("iptables", &["-S", "FORWARD"], None) else {
        return;
    };
    if !rules.lines().any(|l| l.trim() == "-P FORWARD DROP") {
        return;
    }
    let b = cfg.bridge.as_str();
    for rule in forward_accepts(b) {
        let check = iptables_op("-C", &rule);
        if run("iptables", &check, None).is_err() {
            let insert = iptables_op("-I", &rule);
            match run("iptables", &insert, None) {
                Ok(_) => log::info!("FORWARD policy is DROP: accepting the underlay bridge {b}"),
                Err(e) => log::warn!(
                    "FORWARD policy is DROP and {e}; guests may not reach beyond this host"
                ),
            }
        }
    }
}

#[cfg(target_os = "linux")]
/// Makes `iface` an up port of `bridge` (a site bridge: not isolated, the
/// site's own rules apply there).
pub fn join(iface: &str, bridge: &str) -> Result<(), NetError> {
    run("ip", &["link", "set", iface, "master", bridge], None)?;
    run("ip", &["link", "set", iface, "up"], None)?;
    Ok(())
}
