//! The agent's nft rules as text: the whole ruleset (its ip and bridge
//! tables), and the elements that guard a port, hold a VM's own egress
//! rules and publish its ports. Pure text, built everywhere; the
//! underlay applies it (see [`super::underlay`] for what it holds).

use std::net::Ipv4Addr;

use super::addresses::Subnet;
use super::port::Port;
use crate::model::Egress as VmEgress;
use crate::model::{Cidr, PortRange, Publish};

/// What the agent's rules are made for: its bridge and guests' subnet,
/// the nft tables it owns, its taps' names, where guests may go and which
/// host ports may be published.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnderlayConfig {
    pub bridge: String,
    pub subnet: Subnet,
    /// The nft tables (ip and bridge) and iptables chain prefix the agent owns.
    pub table: String,
    /// Every guest tap's name starts with it: one without a guard is dropped.
    pub tap_prefix: String,
    pub egress: Egress,
    /// The host ports guests may be published on (`--publish-ports`).
    pub publish: PortRange,
}

/// Where guests may not go, beyond what is always refused (the host
/// itself, link-local, other guests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Egress {
    /// Ranges guests never reach: the operator's, and the control plane's
    /// address.
    pub deny: Vec<Cidr>,
    /// Exceptions to every refusal but guest to guest, the host included.
    pub allow: Vec<Cidr>,
    /// The DNS servers guests are told: port 53 on them is always open.
    pub dns: Vec<Ipv4Addr>,
}

/// Link-local: where clouds serve instance metadata (169.254.169.254).
pub const LINK_LOCAL: Cidr = Cidr {
    network: Ipv4Addr::new(169, 254, 0, 0),
    prefix: 16,
};

/// The agent's nft tables, as one transaction: make sure each exists,
/// delete it, define it afresh (so every VM's port chain is gone until its
/// tap is guarded again, and its tap meanwhile dropped).
///
/// The bridge table's guard is the same for every tap, underlay or site,
/// in the manner of DHCP snooping with dynamic ARP inspection: a frame
/// carries the tap's own MAC, no VLAN tag of any kind (802.1Q, 802.1ad,
/// the old QinQ 0x9100: an uplink that honours an S-tag would let a guest
/// hop VLANs), and is IPv4 from the tap's address, DHCP from 0.0.0.0, or
/// ARP whose sender is its MAC and its address (or 0.0.0.0, a probe).
/// A tap's address is the one the agent leased (underlay), or the one the
/// site's DHCP server granted in an ACK the snooper saw from the site side
/// (see [`crate::net::snoop`]); until then it can only ask. IPv6 and every
/// other ethertype are dropped: no site policy here serves IPv6, and an
/// IPv6 fragment hides its header from any rule that would inspect it.
///
/// Guests are isolated from each other in every state: two guest ports
/// the kernel isolates (`isolated on`) pass nothing to each other, and
/// every other pair meets the bridge table's forward chain, which passes
/// only a connection to a published port (the ip table's mark) and drops
/// the rest, every ethertype, whether the receiving guest runs or
/// sleeps, and whether or not bridged frames also pass the ip and arp
/// tables (`bridge-nf-call-*`). A sleeping guest's tap is passed, from the
/// host, only frames to its MAC and ARP for its address.
pub fn nft_ruleset(cfg: &UnderlayConfig) -> String {
    ip_table(cfg) + &bridge_table(cfg)
}

/// The ip table: the guests' NAT, the published ports' DNAT, what a guest
/// may reach of this host, and what it may reach beyond it.
fn ip_table(cfg: &UnderlayConfig) -> String {
    let (t, b, s) = (&cfg.table, &cfg.bridge, cfg.subnet);
    let gateway = s.gateway();
    let set = |name: &str, ranges: &[Cidr]| {
        let mut text =
            format!("\tset {name} {{\n\t\ttype ipv4_addr; flags interval; auto-merge;\n");
        if !ranges.is_empty() {
            let list: Vec<String> = ranges.iter().map(Cidr::to_string).collect();
            text.push_str(&format!("\t\telements = {{ {} }}\n", list.join(", ")));
        }
        text.push_str("\t}\n");
        text
    };
    let mut deny = cfg.egress.deny.clone();
    deny.push(LINK_LOCAL);
    let dns_rule = if cfg.egress.dns.is_empty() {
        String::new()
    } else {
        let list: Vec<String> = cfg.egress.dns.iter().map(Ipv4Addr::to_string).collect();
        format!(
            "\t\tiifname \"{b}\" ip daddr {{ {} }} meta l4proto {{ tcp, udp }} th dport 53 accept comment \"DNS to the servers guests are told\"\n",
            list.join(", ")
        )
    };
    format!(
        "table ip {t} {{}}\n\
         delete table ip {t}\n\
         table ip {t} {{\n\
         {deny_set}\
         {allow_set}\
         \tchain postrouting {{\n\
         \t\ttype nat hook postrouting priority srcnat; policy accept;\n\
         \t\tip saddr {s} oifname != \"{b}\" masquerade\n\
         \t\tip saddr {s} oifname \"{b}\" ct status dnat masquerade comment \"a guest to a published port: answered through the host\"\n\
         \t}}\n\
         \tmap publish_any {{\n\
         \t\ttype inet_proto . inet_service : ipv4_addr . inet_service;\n\
         \t}}\n\
         \tmap publish_at {{\n\
         \t\ttype ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service;\n\
         \t}}\n\
         \tchain publish_in {{\n\
         \t\ttype nat hook prerouting priority dstnat; policy accept;\n\
         \t\tfib daddr type local dnat ip to ip daddr . meta l4proto . th dport map @publish_at\n\
         \t\tfib daddr type local dnat ip to meta l4proto . th dport map @publish_any\n\
         \t}}\n\
         \tchain publish_out {{\n\
         \t\ttype nat hook output priority -100; policy accept;\n\
         \t\tip daddr != 127.0.0.0/8 fib daddr type local dnat ip to ip daddr . meta l4proto . th dport map @publish_at\n\
         \t\tip daddr != 127.0.0.0/8 fib daddr type local dnat ip to meta l4proto . th dport map @publish_any\n\
         \t}}\n\
         \tchain input {{\n\
         \t\ttype filter hook input priority filter; policy accept;\n\
         \t\tiifname \"{b}\" ct state established,related accept\n\
         \t\tiifname \"{b}\" ip daddr {{ 255.255.255.255, {gateway} }} udp dport 67 accept comment \"DHCP, broadcast or to the bridge\"\n\
         {dns_rule}\
         \t\tiifname \"{b}\" ip daddr {gateway} icmp type echo-request limit rate 10/second accept comment \"ping the gateway\"\n\
         \t\tiifname \"{b}\" ip daddr @allow accept\n\
         \t\tiifname \"{b}\" counter drop comment \"a guest reaching into this host\"\n\
         \t}}\n\
         \tset vm_ruled {{\n\
         \t\ttype ipv4_addr;\n\
         \t}}\n\
         \tset vm_deny {{\n\
         \t\ttype ipv4_addr . ipv4_addr; flags interval;\n\
         \t}}\n\
         \tset vm_allow {{\n\
         \t\ttype ipv4_addr . ipv4_addr; flags interval;\n\
         \t}}\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority filter; policy accept;\n\
         {dns_rule}\
         \t\tiifname \"{b}\" ip saddr @vm_ruled ip saddr . ip daddr @vm_deny ip saddr . ip daddr != @vm_allow counter drop comment \"denied by the VM's own egress rules\"\n\
         \t\toifname \"{b}\" ct status dnat meta mark set meta mark or {PUBLISHED_MARK:#010x} comment \"to a published port: let through the bridge\"\n\
         \t\tct state established,related accept\n\
         \t\toifname \"{b}\" ct status dnat accept comment \"to a published port\"\n\
         \t\tiifname \"{b}\" oifname \"{b}\" counter drop comment \"guest to guest\"\n\
         \t\tiifname \"{b}\" ip daddr @allow accept\n\
         \t\tiifname \"{b}\" ip daddr @deny counter drop comment \"a denied destination\"\n\
         \t\tiifname \"{b}\" accept\n\
         \t\toifname \"{b}\" counter drop comment \"a connection opened from outside\"\n\
         \t}}\n\
         }}\n",
        deny_set = set("deny", &deny),
        allow_set = set("allow", &cfg.egress.allow),
    )
}

/// The bridge table: every guest tap's guard (see [`nft_ruleset`]), what
/// reaches a sleeping guest, and the isolation of the taps the kernel
/// does not isolate.
fn bridge_table(cfg: &UnderlayConfig) -> String {
    let t = &cfg.table;
    format!(
        "table bridge {t} {{}}\n\
         delete table bridge {t}\n\
         table bridge {t} {{\n\
         \tset macs {{\n\
         \t\ttype ifname . ether_addr;\n\
         \t}}\n\
         \tset addrs {{\n\
         \t\ttype ifname . ipv4_addr;\n\
         \t}}\n\
         \tchain prerouting {{\n\
         \t\ttype filter hook prerouting priority filter; policy accept;\n\
         \t\tiifname != \"{prefix}*\" accept\n\
         \t\tether type {{ 0x8100, 0x88a8, 0x9100 }} counter drop comment \"VLAN-tagged (802.1Q, 802.1ad or QinQ)\"\n\
         \t\tiifname . ether saddr != @macs counter drop comment \"not its MAC, or a tap with no guard\"\n\
         \t\tiifname . ip saddr @addrs meta l4proto != udp accept\n\
         \t\tiifname . ip saddr @addrs udp sport != {{ 67, 547 }} accept\n\
         \t\tiifname . arp saddr ether != @macs counter drop comment \"ARP for another MAC\"\n\
         \t\tmeta l4proto udp udp sport {{ 67, 547 }} counter drop comment \"a DHCP server\"\n\
         \t\tarp saddr ip != 0.0.0.0 iifname . arp saddr ip != @addrs counter drop comment \"ARP for another address\"\n\
         \t\tip saddr 0.0.0.0 udp sport 68 udp dport 67 accept comment \"DHCP before it has its address\"\n\
         \t\tether type ip counter drop comment \"not its address\"\n\
         \t\tether type ip6 counter drop comment \"IPv6 is not served\"\n\
         \t\tether type arp accept\n\
         \t\tcounter drop comment \"neither IPv4 nor ARP\"\n\
         \t}}\n\
         \tset unisolated {{\n\
         \t\ttype ifname;\n\
         \t}}\n\
         \tset asleep {{\n\
         \t\ttype ifname;\n\
         \t}}\n\
         \tchain to_sleeper {{\n\
         \t\toifname . ether daddr @macs accept comment \"to a sleeping guest's own MAC: it wakes\"\n\
         \t\tarp operation request oifname . arp daddr ip @addrs accept comment \"ARP for a sleeping guest's address: it wakes\"\n\
         \t\tcounter drop comment \"flooded to a sleeping guest: it would wake for nothing\"\n\
         \t}}\n\
         \tchain output {{\n\
         \t\ttype filter hook output priority 100; policy accept;\n\
         \t\toifname @asleep jump to_sleeper\n\
         \t}}\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority 100; policy accept;\n\
         \t\tiifname @unisolated meta mark and {PUBLISHED_MARK:#010x} == {PUBLISHED_MARK:#010x} meta mark set meta mark and {unmark:#010x} accept comment \"a published port's answer\"\n\
         \t\toifname @unisolated meta mark and {PUBLISHED_MARK:#010x} == {PUBLISHED_MARK:#010x} meta mark set meta mark and {unmark:#010x} accept comment \"to a published port: it wakes a sleeping guest\"\n\
         \t\toifname @asleep counter drop comment \"another guest to a sleeping one: what it is not sent awake, it is not sent asleep\"\n\
         \t\tiifname @unisolated counter drop comment \"guest to guest, from a port the kernel does not isolate\"\n\
         \t\toifname @unisolated counter drop comment \"guest to guest, to a port the kernel does not isolate\"\n\
         \t}}\n\
         }}\n",
        unmark = !PUBLISHED_MARK,
        prefix = cfg.tap_prefix,
    )
}

/// The bit of a packet's mark that says "a connection to a published
/// port" from the ip table's forward chain to the bridge table's, which
/// clears it as it lets the frame through: it lives for one hop of one
/// packet, so a host's other users of the mark see it only there.
pub const PUBLISHED_MARK: u32 = 0x0100_0000;

/// What holds one port, as set elements: its tap and MAC in `macs`, and
/// for an underlay port its tap and address in `addrs` (see
/// [`nft_ruleset`] for the rules that read them). One transaction; adding
/// an element already there is no error.
///
/// Elements, not a chain of rules per port: nft reads every rule of the
/// ruleset into its cache before it adds one, so a guard made of rules
/// cost 19 ms at a thousand guarded VMs and grew with every VM, where
/// adding elements stays at 2.4 ms at five thousand (timed by hand with
/// `nft -f` against that many ports; `make bench-create` times one add as
/// its `nft guard` stage).
pub fn port_ruleset(table: &str, port: &Port<'_>) -> String {
    port_elements(table, port)
        .iter()
        .map(|e| format!("add element {e}\n"))
        .collect()
}

/// Removes a port's elements, in one transaction; each is added first, so
/// what is absent is no error.
pub fn unport_ruleset(table: &str, port: &Port<'_>) -> String {
    port_elements(table, port)
        .iter()
        .map(|e| format!("add element {e}\ndelete element {e}\n"))
        .collect()
}

fn port_elements(table: &str, port: &Port<'_>) -> Vec<String> {
    let (t, tap, mac) = (table, port.tap, port.mac);
    let mut elements = vec![format!("bridge {t} macs {{ \"{tap}\" . {mac} }}")];
    if let Some(ip) = port.ip {
        elements.push(address_element(table, tap, ip));
    }
    elements
}

/// Moves a VM's own egress rules from `old` to `new`, in one transaction:
/// elements of `vm_deny` and `vm_allow` keyed by the guest's underlay
/// address (which the bridge's guard pins to its tap), so the lookups are
/// the same whatever the number of VMs, and only a guest with a deny-list
/// (in `vm_ruled`) pays for them. Checked before the
/// forward chain accepts an established connection, so a range denied now
/// cuts what was open to it; the host's policy follows and still applies.
/// Each list is reduced to its outermost ranges first: the sets take no
/// overlapping elements.
pub fn egress_ruleset(table: &str, guest: Ipv4Addr, old: &VmEgress, new: &VmEgress) -> String {
    let mut text = String::new();
    // A guest with rules is in `vm_ruled`, one hash lookup that spares
    // every other guest's packets the range lookups.
    let ruled = format!("ip {table} vm_ruled {{ {guest} }}");
    if old.deny.is_empty() && !new.deny.is_empty() {
        text.push_str(&format!("add element {ruled}\n"));
    }
    for (set, was, now) in [
        ("vm_deny", &old.deny, &new.deny),
        ("vm_allow", &old.allow, &new.allow),
    ] {
        let (was, now) = (Cidr::outermost(was), Cidr::outermost(now));
        // Removed before added: an added range may cover a removed one.
        for gone in was.iter().filter(|c| !now.contains(c)) {
            let e = format!("ip {table} {set} {{ {guest} . {gone} }}");
            text.push_str(&format!("add element {e}\ndelete element {e}\n"));
        }
        for came in now.iter().filter(|c| !was.contains(c)) {
            text.push_str(&format!(
                "add element ip {table} {set} {{ {guest} . {came} }}\n"
            ));
        }
    }
    if !old.deny.is_empty() && new.deny.is_empty() {
        text.push_str(&format!("add element {ruled}\ndelete element {ruled}\n"));
    }
    text
}

/// Moves a VM's published ports from what the ruleset says for it (`old`,
/// at its guest's address then) to `new`, in one transaction: elements of
/// `publish_any` (every address of the host) and `publish_at` (one),
/// keyed by the host side, so a lookup costs the same at any number of
/// ports. Each removed element is added first, so what is absent is no
/// error; removed before added, as a port may move to another guest port.
pub fn publish_ruleset(
    table: &str,
    old: Option<&(Ipv4Addr, Vec<Publish>)>,
    new: Option<&(Ipv4Addr, Vec<Publish>)>,
) -> String {
    let listed = |side: Option<&(Ipv4Addr, Vec<Publish>)>| -> Vec<String> {
        side.map(|(guest, list)| {
            list.iter()
                .map(|p| publish_element(table, *guest, p))
                .collect()
        })
        .unwrap_or_default()
    };
    let (was, now) = (listed(old), listed(new));
    let mut text = String::new();
    for gone in was.iter().filter(|e| !now.contains(e)) {
        text.push_str(&format!(
            "add element {gone}\ndelete element {}\n",
            key_only(gone)
        ));
    }
    for came in now.iter().filter(|e| !was.contains(e)) {
        text.push_str(&format!("add element {came}\n"));
    }
    text
}

/// One published port as a map element: `ip T publish_any { tcp . 30080 :
/// 10.0.0.2 . 80 }`, or in `publish_at` with the host address first.
fn publish_element(table: &str, guest: Ipv4Addr, p: &Publish) -> String {
    let (map, at) = match p.host_address {
        Some(address) => ("publish_at", format!("{address} . ")),
        None => ("publish_any", String::new()),
    };
    format!(
        "ip {table} {map} {{ {at}{} . {} : {guest} . {} }}",
        p.transport, p.host_port, p.guest_port
    )
}

/// A map element without its value: what `delete element` takes.
fn key_only(element: &str) -> String {
    match element.split_once(" : ") {
        Some((key, _)) => format!("{key} }}"),
        None => element.to_owned(),
    }
}

pub(super) fn address_element(table: &str, tap: &str, ip: Ipv4Addr) -> String {
    format!("bridge {table} addrs {{ \"{tap}\" . {ip} }}")
}
