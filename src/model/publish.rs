//! Ports of the host published to a guest: what a VM's entry asks for,
//! checked, and the host's range they must come from.

use std::fmt;
use std::net::Ipv4Addr;

/// The transport a published port forwards.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    Tcp,
    Udp,
}

impl Transport {
    /// From the wire: "tcp", "udp", or empty for "tcp".
    pub fn parse(text: &str) -> Option<Transport> {
        match text {
            "" | "tcp" => Some(Transport::Tcp),
            "udp" => Some(Transport::Udp),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Udp => "udp",
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One port of the host that reaches the guest: `host_port` (on
/// `host_address`, or on every address of the host) forwarded to the
/// guest's `guest_port`.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct Publish {
    pub transport: Transport,
    pub host_port: u16,
    pub guest_port: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_address: Option<Ipv4Addr>,
}

impl Publish {
    /// `host_port` of every address of the host to the guest's TCP
    /// `guest_port`: the common case.
    pub fn tcp(host_port: u16, guest_port: u16) -> Publish {
        Publish {
            transport: Transport::Tcp,
            host_port,
            guest_port,
            host_address: None,
        }
    }

    /// What on the host it takes: one VM's at a time.
    pub fn host_side(&self) -> HostPort {
        HostPort {
            transport: self.transport,
            port: self.host_port,
            address: self.host_address,
        }
    }
}

impl fmt::Display for Publish {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} → {}", self.host_side(), self.guest_port)
    }
}

/// A port of the host as a published port takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostPort {
    pub transport: Transport,
    pub port: u16,
    /// `None`: every address of the host.
    pub address: Option<Ipv4Addr>,
}

impl HostPort {
    /// Whether a connection could reach both: the same transport and port,
    /// and addresses that meet (every address meets each).
    pub fn overlaps(&self, other: &HostPort) -> bool {
        self.transport == other.transport
            && self.port == other.port
            && match (self.address, other.address) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.address {
            Some(address) => write!(f, "{address}:{}/{}", self.port, self.transport),
            None => write!(f, "{}/{}", self.port, self.transport),
        }
    }
}

/// Why a host address cannot be published on.
pub fn unpublishable(address: Ipv4Addr) -> Option<&'static str> {
    if address.is_unspecified() {
        Some("0.0.0.0 is every address: leave host_address empty for that")
    } else if address.is_loopback() {
        Some("a loopback address is the host's alone: connections to it are never forwarded")
    } else if address.is_multicast() || address.is_broadcast() {
        Some("a multicast or broadcast address names no one host")
    } else {
        None
    }
}

/// The host ports an operator lets VMs publish (`--publish-ports`), both
/// ends included; empty: none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortRange {
    bounds: Option<(u16, u16)>,
}

impl PortRange {
    pub fn new(first: u16, last: u16) -> Option<PortRange> {
        (first >= 1 && first <= last).then_some(PortRange {
            bounds: Some((first, last)),
        })
    }

    /// `FIRST-LAST` (or one port), or empty for none.
    pub fn parse(text: &str) -> Result<PortRange, PortRangeError> {
        let text = text.trim();
        if text.is_empty() {
            return Ok(PortRange::default());
        }
        let (first, last) = text.split_once('-').unwrap_or((text, text));
        let port = |s: &str| {
            s.trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| PortRangeError::NotAPort(s.to_owned()))
        };
        let (first, last) = (port(first)?, port(last)?);
        PortRange::new(first, last).ok_or_else(|| PortRangeError::Backwards(text.to_owned()))
    }

    pub fn contains(&self, port: u16) -> bool {
        self.bounds
            .is_some_and(|(first, last)| (first..=last).contains(&port))
    }

    pub fn is_empty(&self) -> bool {
        self.bounds.is_none()
    }
}

/// Why a `--publish-ports` value is no range of ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortRangeError {
    /// One end is not a port from 1 to 65535.
    NotAPort(String),
    /// The first port is past the last.
    Backwards(String),
}

impl fmt::Display for PortRangeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortRangeError::NotAPort(s) => write!(f, "{s:?} is not a port (1-65535)"),
            PortRangeError::Backwards(s) => {
                write!(
                    f,
                    "{s:?}: the first port is past the last; write FIRST-LAST"
                )
            }
        }
    }
}

impl std::error::Error for PortRangeError {}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.bounds {
            Some((first, last)) if first == last => write!(f, "{first}"),
            Some((first, last)) => write!(f, "{first}-{last}"),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(address: Option<[u8; 4]>, port: u16) -> HostPort {
        HostPort {
            transport: Transport::Tcp,
            port,
            address: address.map(Ipv4Addr::from),
        }
    }

    #[test]
    fn every_address_overlaps_one_address_of_the_same_port() {
        assert!(on(None, 30080).overlaps(&on(Some([10, 0, 0, 1]), 30080)));
        assert!(on(Some([10, 0, 0, 1]), 30080).overlaps(&on(None, 30080)));
    }

    #[test]
    fn two_addresses_or_two_ports_or_two_transports_do_not_overlap() {
        assert!(!on(Some([10, 0, 0, 1]), 30080).overlaps(&on(Some([10, 0, 0, 2]), 30080)));
        assert!(!on(None, 30080).overlaps(&on(None, 30081)));
        let udp = HostPort {
            transport: Transport::Udp,
            ..on(None, 30080)
        };
        assert!(!on(None, 30080).overlaps(&udp));
    }

    #[test]
    fn a_range_parses_and_holds_both_ends() {
        let range = PortRange::parse("30000-30010").expect("range");

        assert!(range.contains(30000) && range.contains(30010));
        assert!(!range.contains(29999) && !range.contains(30011));
        assert_eq!(range.to_string(), "30000-30010");
    }

    #[test]
    fn an_empty_range_holds_no_port() {
        let range = PortRange::parse("").expect("empty");

        assert!(range.is_empty() && !range.contains(30000));
    }

    #[test]
    fn a_range_backwards_or_with_port_zero_is_refused_saying_how_to_write_it() {
        let backwards = PortRange::parse("30010-30000").expect_err("backwards");
        let zero = PortRange::parse("0-10").expect_err("zero");

        assert!(backwards.to_string().contains("FIRST-LAST"), "{backwards}");
        assert!(zero.to_string().contains("not a port"), "{zero}");
    }

    #[test]
    fn loopback_and_every_address_cannot_be_published_on() {
        assert!(unpublishable(Ipv4Addr::LOCALHOST).is_some());
        assert!(unpublishable(Ipv4Addr::UNSPECIFIED).is_some());
        assert!(unpublishable(Ipv4Addr::BROADCAST).is_some());
        assert_eq!(unpublishable(Ipv4Addr::new(192, 0, 2, 1)), None);
    }
}
