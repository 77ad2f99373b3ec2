//! The underlay: one agent-owned bridge holding the guests' gateway, each
//! VM's tap an isolated port on it, and NAT to the outside through one nft
//! table the agent owns.
//!
//! At every start:
//! 1. The bridge exists, is up and holds the gateway address.
//! 2. IPv4 forwarding is on (logged when the agent turns it on).
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
//! This shells out to iproute2 and nft/iptables, the tools every host has
//! and an operator can read back; netlink by hand would hide the same
//! operations in a few hundred lines of message building.

use std::fmt;
use std::process::Command;

use super::addresses::Subnet;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnderlayConfig {
    pub bridge: String,
    pub subnet: Subnet,
    /// The nft table (and iptables chain prefix) the agent owns.
    pub table: String,
}

/// How guests reach beyond the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Nat {
    Nft,
    Iptables,
    /// Neither tool: guests reach the host only.
    HostOnly,
}

#[derive(Debug)]
pub struct NetError {
    pub what: String,
    pub detail: String,
}

impl fmt::Display for NetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.what, self.detail)
    }
}

impl std::error::Error for NetError {}

impl crate::error::Failure for NetError {}

fn run(program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, NetError> {
    use std::io::Write;
    let what = || format!("{program} {}", args.join(" "));
    let Some(path) = crate::programs::resolved(program) else {
        return Err(NetError {
            what: what(),
            detail: format!(
                "{program} is not installed (not found in PATH when the agent started)"
            ),
        });
    };
    let mut cmd = Command::new(path);
    cmd.args(args)
        .stdin(if stdin.is_some() {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| NetError {
        what: what(),
        detail: e.to_string(),
    })?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).map_err(|e| NetError {
            what: what(),
            detail: e.to_string(),
        })?;
    }
    let out = child.wait_with_output().map_err(|e| NetError {
        what: what(),
        detail: e.to_string(),
    })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(NetError {
            what: what(),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

fn have(program: &str) -> bool {
    let Some(path) = crate::programs::resolved(program) else {
        return false;
    };
    Command::new(path)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub struct Underlay {
    cfg: UnderlayConfig,
    nat: Nat,
}

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
        let gateway = format!("{}/{}", cfg.subnet.gateway(), cfg.subnet.prefix);
        run("ip", &["addr", "replace", &gateway, "dev", bridge], None)?;
        run("ip", &["link", "set", bridge, "up"], None)?;
        enable_forwarding()?;
        let nat = if have("nft") {
            run("nft", &["-f", "-"], Some(&nft_ruleset(&cfg)))?;
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
        accept_through_drop_policy(&cfg);
        Ok(Underlay { cfg, nat })
    }

    pub fn nat(&self) -> Nat {
        self.nat
    }

    pub fn subnet(&self) -> Subnet {
        self.cfg.subnet
    }

    /// Makes `tap` an isolated, up port of the bridge.
    pub fn attach(&self, tap: &str) -> Result<(), NetError> {
        run(
            "ip",
            &["link", "set", tap, "master", &self.cfg.bridge],
            None,
        )?;
        run(
            "ip",
            &[
                "link",
                "set",
                "dev",
                tap,
                "type",
                "bridge_slave",
                "isolated",
                "on",
            ],
            None,
        )?;
        run("ip", &["link", "set", tap, "up"], None)?;
        Ok(())
    }
}

fn enable_forwarding() -> Result<(), NetError> {
    let path = "/proc/sys/net/ipv4/ip_forward";
    let now = std::fs::read_to_string(path).unwrap_or_default();
    if now.trim() != "1" {
        std::fs::write(path, "1").map_err(|e| NetError {
            what: "enable IPv4 forwarding".into(),
            detail: e.to_string(),
        })?;
        log::info!("enabled IPv4 forwarding ({path} was {:?})", now.trim());
    }
    Ok(())
}

/// The agent's whole nft table, as one transaction: make sure the table
/// exists, delete it, define it afresh.
pub fn nft_ruleset(cfg: &UnderlayConfig) -> String {
    let (t, b, s) = (&cfg.table, &cfg.bridge, cfg.subnet);
    format!(
        "table ip {t} {{}}\n\
         delete table ip {t}\n\
         table ip {t} {{\n\
         \tchain postrouting {{\n\
         \t\ttype nat hook postrouting priority srcnat; policy accept;\n\
         \t\tip saddr {s} oifname != \"{b}\" masquerade\n\
         \t}}\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority filter; policy accept;\n\
         \t\tiifname \"{b}\" accept\n\
         \t\toifname \"{b}\" ct state established,related accept\n\
         \t}}\n\
         }}\n"
    )
}

/// NAT with iptables: the agent's own chain, flushed and refilled, jumped
/// to once from POSTROUTING.
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
    let wanted: [&[&str]; 2] = [
        &["FORWARD", "-i", b, "-j", "ACCEPT"],
        &[
            "FORWARD",
            "-o",
            b,
            "-m",
            "conntrack",
            "--ctstate",
            "RELATED,ESTABLISHED",
            "-j",
            "ACCEPT",
        ],
    ];
    for rule in wanted {
        let check: Vec<&str> = ["-C"].iter().copied().chain(rule.iter().copied()).collect();
        if run("iptables", &check, None).is_err() {
            let insert: Vec<&str> = ["-I"].iter().copied().chain(rule.iter().copied()).collect();
            match run("iptables", &insert, None) {
                Ok(_) => log::info!("FORWARD policy is DROP: accepting the underlay bridge {b}"),
                Err(e) => log::warn!(
                    "FORWARD policy is DROP and {e}; guests may not reach beyond this host"
                ),
            }
        }
    }
}

/// Makes `iface` an up port of `bridge` (a site bridge: not isolated, the
/// site's own rules apply there).
pub fn join(iface: &str, bridge: &str) -> Result<(), NetError> {
    run("ip", &["link", "set", iface, "master", bridge], None)?;
    run("ip", &["link", "set", iface, "up"], None)?;
    Ok(())
}
