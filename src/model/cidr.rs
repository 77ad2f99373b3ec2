//! An IPv4 range as an operator writes it: `a.b.c.d/n`, or a bare address
//! for one host. The one prefix type of the agent: the host's egress
//! policy (`--guest-deny`, `--guest-allow`) and each VM's own
//! (`egress_allow`, `egress_deny`) are lists of them, and the underlay's
//! [`Subnet`](crate::net::addresses::Subnet) is one that can hold a
//! gateway and guests. Here, beside the other checked types, because
//! desired state is checked into them.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Why a text is not a range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CidrError {
    NotAnAddress {
        text: String,
    },
    NotAPrefix {
        text: String,
    },
    /// The address has bits set past the prefix: `meant` is the range.
    HostBits {
        text: String,
        meant: Cidr,
    },
    NotAnIpv6Address {
        text: String,
    },
    NotAnIpv6Prefix {
        text: String,
    },
    /// An IPv6 range with bits set past its prefix: `meant` is the range.
    HostBits6 {
        text: String,
        meant: String,
    },
}

impl fmt::Display for CidrError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CidrError::NotAnAddress { text } => write!(f, "{text:?} is not an IPv4 address"),
            CidrError::NotAPrefix { text } => {
                write!(f, "/{text} is not a prefix length (0 to 32)")
            }
            CidrError::HostBits { text, meant } => {
                write!(f, "{text} has host bits set; did you mean {meant}?")
            }
            CidrError::NotAnIpv6Address { text } => write!(f, "{text:?} is not an IPv6 address"),
            CidrError::NotAnIpv6Prefix { text } => {
                write!(f, "/{text} is not an IPv6 prefix length (0 to 128)")
            }
            CidrError::HostBits6 { text, meant } => {
                write!(f, "{text} has host bits set; did you mean {meant}?")
            }
        }
    }
}

impl std::error::Error for CidrError {}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr {
    pub network: Ipv4Addr,
    pub prefix: u8,
}

impl Cidr {
    /// One host.
    pub fn host(ip: Ipv4Addr) -> Cidr {
        Cidr {
            network: ip,
            prefix: 32,
        }
    }

    /// Parses `a.b.c.d/n` (0 ≤ n ≤ 32, no host bits) or `a.b.c.d`.
    pub fn parse(text: &str) -> Result<Cidr, CidrError> {
        let text = text.trim();
        let (addr, prefix) = text.split_once('/').unwrap_or((text, "32"));
        let network: Ipv4Addr = addr.parse().map_err(|_| CidrError::NotAnAddress {
            text: addr.to_owned(),
        })?;
        let prefix: u8 =
            prefix
                .parse()
                .ok()
                .filter(|p| *p <= 32)
                .ok_or_else(|| CidrError::NotAPrefix {
                    text: prefix.to_owned(),
                })?;
        let cidr = Cidr { network, prefix };
        let masked = Ipv4Addr::from(u32::from(network) & cidr.mask());
        if masked != network {
            return Err(CidrError::HostBits {
                text: text.to_owned(),
                meant: Cidr {
                    network: masked,
                    prefix,
                },
            });
        }
        Ok(cidr)
    }

    /// A comma-separated list; empty text is an empty list.
    pub fn parse_list(text: &str) -> Result<Vec<Cidr>, CidrError> {
        text.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(Cidr::parse)
            .collect()
    }

    /// The prefix's bits, as a number.
    pub fn mask(&self) -> u32 {
        u32::MAX
            .checked_shl(32 - u32::from(self.prefix))
            .unwrap_or(0)
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask() == u32::from(self.network)
    }

    /// Whether every address of `other` is in this range.
    pub fn covers(&self, other: &Cidr) -> bool {
        self.prefix <= other.prefix && self.contains(other.network)
    }

    /// `list` without the ranges another of it covers: the same addresses,
    /// no two ranges overlapping (two prefixes either nest or are apart).
    pub fn outermost(list: &[Cidr]) -> Vec<Cidr> {
        let mut out: Vec<Cidr> = Vec::with_capacity(list.len());
        for c in list {
            if !list.iter().any(|d| d != c && d.covers(c)) && !out.contains(c) {
                out.push(*c);
            }
        }
        out
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

/// As its text, in records.
impl serde::Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Cidr, D::Error> {
        let text = String::deserialize(d)?;
        Cidr::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// An IPv4 or an IPv6 range: what the host's reach lists take where both
/// families matter (`--guest-deny` as image downloads obey it,
/// `--image-allow`). The guests' own network is IPv4: there, [`Cidr`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpRange {
    V4(Cidr),
    V6 { network: Ipv6Addr, prefix: u8 },
}

impl IpRange {
    /// Parses an IPv4 range as [`Cidr::parse`] does, or an IPv6 one,
    /// `x::y/n` (0 ≤ n ≤ 128, no host bits) or a bare address.
    pub fn parse(text: &str) -> Result<IpRange, CidrError> {
        let text = text.trim();
        if !text.contains(':') {
            return Cidr::parse(text).map(IpRange::V4);
        }
        let (addr, prefix) = text.split_once('/').unwrap_or((text, "128"));
        let network: Ipv6Addr = addr.parse().map_err(|_| CidrError::NotAnIpv6Address {
            text: addr.to_owned(),
        })?;
        let prefix: u8 = prefix.parse().ok().filter(|p| *p <= 128).ok_or_else(|| {
            CidrError::NotAnIpv6Prefix {
                text: prefix.to_owned(),
            }
        })?;
        let masked = Ipv6Addr::from(u128::from(network) & mask6(prefix));
        if masked != network {
            return Err(CidrError::HostBits6 {
                text: text.to_owned(),
                meant: format!("{masked}/{prefix}"),
            });
        }
        Ok(IpRange::V6 { network, prefix })
    }

    /// A comma-separated list; empty text is an empty list.
    pub fn parse_list(text: &str) -> Result<Vec<IpRange>, CidrError> {
        text.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(IpRange::parse)
            .collect()
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self, ip) {
            (IpRange::V4(c), IpAddr::V4(v4)) => c.contains(v4),
            (IpRange::V6 { network, prefix }, IpAddr::V6(v6)) => {
                u128::from(v6) & mask6(*prefix) == u128::from(*network)
            }
            _ => false,
        }
    }

    /// The IPv4 range, if it is one.
    pub fn v4(&self) -> Option<Cidr> {
        match self {
            IpRange::V4(c) => Some(*c),
            IpRange::V6 { .. } => None,
        }
    }
}

fn mask6(prefix: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0)
}

impl fmt::Display for IpRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IpRange::V4(c) => c.fmt(f),
            IpRange::V6 { network, prefix } => write!(f, "{network}/{prefix}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_range_holds_what_its_prefix_covers() {
        let r = IpRange::parse("fd00:ec2::/32").expect("parses");

        assert!(r.contains("fd00:ec2::254".parse().expect("ip")));
        assert!(!r.contains("fd00:ec3::254".parse().expect("ip")));
        assert!(!r.contains("10.0.0.1".parse().expect("ip")));
        assert_eq!(r.to_string(), "fd00:ec2::/32");
    }

    #[test]
    fn a_mixed_list_takes_both_families_and_refuses_host_bits() {
        let list = IpRange::parse_list("10.0.0.0/8, 2001:db8::1").expect("list");
        let bits = IpRange::parse("2001:db8::1/32");

        assert_eq!(list.len(), 2);
        assert!(list[1].contains("2001:db8::1".parse().expect("ip")));
        assert_eq!(
            bits.map_err(|e| e.to_string()),
            Err("2001:db8::1/32 has host bits set; did you mean 2001:db8::/32?".to_owned())
        );
    }

    #[test]
    fn outermost_drops_what_another_range_covers_and_keeps_the_rest() {
        let list = Cidr::parse_list("10.1.0.0/16, 0.0.0.0/0, 192.0.2.7, 10.0.0.0/8").expect("list");

        assert_eq!(
            Cidr::outermost(&list),
            vec![Cidr::parse("0.0.0.0/0").expect("any")]
        );
        let apart = Cidr::parse_list("10.1.0.0/16, 10.2.0.0/16, 10.1.2.0/24").expect("list");
        assert_eq!(Cidr::outermost(&apart), apart[..2].to_vec());
    }

    #[test]
    fn a_bare_address_is_one_host() {
        let c = Cidr::parse("192.0.2.7").expect("parses");

        assert_eq!(c, Cidr::host(Ipv4Addr::new(192, 0, 2, 7)));
    }

    #[test]
    fn host_bits_are_refused_with_the_range_meant() {
        let e = Cidr::parse("10.1.2.3/8").expect_err("host bits");

        assert!(e.to_string().contains("did you mean 10.0.0.0/8?"), "{e}");
    }

    #[test]
    fn slash_zero_contains_everything() {
        let all = Cidr::parse("0.0.0.0/0").expect("parses");

        assert!(all.contains(Ipv4Addr::new(203, 0, 113, 9)));
    }

    #[test]
    fn a_prefix_over_32_is_refused() {
        assert!(Cidr::parse("10.0.0.0/33").is_err());
    }
}
