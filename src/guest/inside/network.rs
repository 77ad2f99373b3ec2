//! A clone's NICs in the guest: each given its clone's MAC, by ioctl, and
//! its new lease waited for; leases renewed through systemd-networkd.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use super::run;
use crate::pb::guest::NicMac;

/// Renews the lease of every Ethernet interface through systemd-networkd,
/// where it runs: whether any was renewed.
pub(super) fn renew_leases() -> bool {
    let ethernet = |name: &String| {
        // ARPHRD_ETHER.
        fs::read_to_string(format!("/sys/class/net/{name}/type")).is_ok_and(|t| t.trim() == "1")
    };
    let links: Vec<String> = fs::read_dir("/sys/class/net")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(ethernet)
                .collect()
        })
        .unwrap_or_default();
    renew_leases_of(&links)
}

/// Renews the leases of `links` through systemd-networkd, where it runs
/// (one at a time: a tunnel or an interface it does not manage fails a
/// renewal named with it). Whether any was renewed.
fn renew_leases_of(links: &[String]) -> bool {
    if !Path::new("/run/systemd/netif").is_dir() {
        return false;
    }
    let mut renewed = false;
    for link in links {
        match run("networkctl", &["renew", link], Duration::from_secs(5)) {
            Ok(_) => renewed = true,
            Err(e) => eprintln!("eitri-guest: {link}'s lease was not renewed: {e}"),
        }
    }
    renewed
}

/// The interface whose MAC is `mac`, by its name in `/sys/class/net`.
fn interface_with(mac: crate::model::Mac) -> Option<String> {
    fs::read_dir("/sys/class/net").ok()?.find_map(|entry| {
        let name = entry.ok()?.file_name().into_string().ok()?;
        let address = fs::read_to_string(format!("/sys/class/net/{name}/address")).ok()?;
        (crate::model::Mac::parse(address.trim()) == Some(mac)).then_some(name)
    })
}

/// An interface whose MAC was changed, and the IPv4 addresses it held
/// before (its template's lease).
pub(super) struct Moved {
    name: String,
    before: Vec<std::net::Ipv4Addr>,
}

/// Each interface whose MAC is a pair's `from` given its `to` (taken
/// down for it where the driver cannot change it live): the MACs those
/// interfaces have now, and those changed now (one changed by an earlier
/// ask, answered and lost, is not again).
pub(super) fn change_macs(nics: &[NicMac]) -> Result<(Vec<String>, Vec<Moved>), String> {
    let mut now = Vec::new();
    let mut moved = Vec::new();
    for nic in nics {
        let parse = |text: &str| {
            crate::model::Mac::parse(text).ok_or_else(|| format!("{text:?} is not a MAC"))
        };
        let (from, to) = (parse(&nic.from)?, parse(&nic.to)?);
        let name = match (interface_with(from), interface_with(to)) {
            (Some(name), _) => {
                moved.push(Moved {
                    name: name.clone(),
                    before: ipv4_addresses(&name),
                });
                name
            }
            // Done before: a request asked again after a lost answer.
            (None, Some(name)) => name,
            (None, None) => return Err(format!("no interface has the MAC {from}")),
        };
        // Live where the driver can (virtio-net can), else taken down for
        // it and brought up again.
        let set = || crate::net::packet::set_interface_mac(&name, to.octets());
        if set().is_err() {
            let fail = |what: &str, e: std::io::Error| format!("cannot {what} {name}: {e}");
            crate::net::packet::set_interface_up(&name, false).map_err(|e| fail("take down", e))?;
            let changed = set().map_err(|e| fail(&format!("give {to} to"), e));
            crate::net::packet::set_interface_up(&name, true).map_err(|e| fail("bring up", e))?;
            changed?;
        }
        let address = fs::read_to_string(format!("/sys/class/net/{name}/address"))
            .map_err(|e| format!("cannot read {name}'s MAC: {e}"))?;
        now.push(address.trim().to_owned());
    }
    Ok((now, moved))
}

/// The IPv4 addresses interface `name` holds now.
fn ipv4_addresses(name: &str) -> Vec<std::net::Ipv4Addr> {
    let Ok(all) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    all.filter(|a| a.interface_name == name)
        .filter_map(|a| Some(a.address?.as_sockaddr_in()?.ip()))
        .collect()
}

/// How long the interfaces a clone's identity moved are given to take
/// their new MACs' leases, and after how long their DHCP client is asked
/// to renew (systemd-networkd restarts its client when a MAC changes, so
/// the nudge is for a client that does not).
const NEW_LEASE: Duration = Duration::from_secs(3);
const NUDGE_AFTER: Duration = Duration::from_secs(1);

/// Waits until each moved interface holds an IPv4 address it did not
/// hold before: whether all do within [`NEW_LEASE`]. Until they do, the
/// guest answers nothing at its new address, and its row must not say
/// ready on the strength of an identity half applied.
pub(super) fn await_new_leases(moved: &[Moved]) -> bool {
    let started = Instant::now();
    let mut nudged = false;
    loop {
        let waiting: Vec<&Moved> = moved
            .iter()
            .filter(|m| {
                !ipv4_addresses(&m.name)
                    .iter()
                    .any(|a| !m.before.contains(a))
            })
            .collect();
        if waiting.is_empty() {
            return true;
        }
        if started.elapsed() >= NEW_LEASE {
            return false;
        }
        if !nudged && started.elapsed() >= NUDGE_AFTER {
            nudged = true;
            let names: Vec<String> = waiting.iter().map(|m| m.name.clone()).collect();
            renew_leases_of(&names);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
