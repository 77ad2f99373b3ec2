//! Where an image download may connect. Image URLs come from the wire, and
//! the agent fetches them as root from the host's own network: without a
//! rule, a URL naming `127.0.0.1`, `169.254.169.254` or the management LAN
//! turns the agent into a prober of everything the guests are kept from.
//!
//! - Refused unless `--image-allow` names them: loopback, link-local,
//!   unspecified and multicast addresses, every address of this host (asked
//!   of the kernel at each connection, so an address added since start
//!   counts), and the operator's `--guest-deny` ranges.
//! - Refused always, whatever `--image-allow` says: the guests' underlay
//!   subnet. A guest is untrusted; the agent fetching from one as root
//!   would let it feed the host what it likes and learn when and what the
//!   host downloads.
//! - The check sits in the HTTP client's resolver: a name is resolved once,
//!   its addresses are checked, and only the checked ones are handed to the
//!   connector. A name that answers differently the second time (DNS
//!   rebinding) is never asked a second time.
//! - Redirects are not followed (see `fetch`): a hop to another address
//!   would need the same check, and a mirror that redirects is better named
//!   by its final URL in the spec.
//! - With `--proxy`, the proxy connects to the image's host: the agent
//!   checks the proxy's address against nothing (the operator chose it) and
//!   the proxy's own rules decide what it reaches.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ureq::config::Config;
use ureq::http::Uri;
use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::NextTimeout;

use crate::model::{Cidr, IpRange};

/// The operator's ranges: what to refuse besides the host, and what to
/// allow although refused.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reach {
    /// `--guest-deny`: the management LAN and the like, IPv4 or IPv6.
    pub deny: Vec<IpRange>,
    /// `--image-allow`: an image mirror on one of the refused ranges.
    pub allow: Vec<IpRange>,
    /// `--underlay-subnet`, where the guests live: refused whatever
    /// `allow` says.
    pub guests: Option<Cidr>,
}

/// Why an address is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    Loopback,
    LinkLocal,
    Unspecified,
    Multicast,
    ThisHost,
    Denied(IpRange),
    /// In the guests' underlay subnet: another guest (or the bridge).
    Guests(Cidr),
    /// fc00::/7 and the old site-local fec0::/10: IPv6's private ranges,
    /// where clouds put their metadata services (fd00:ec2::254).
    UniqueLocal,
    /// A tunnel or translation address whose IPv4 end cannot be checked:
    /// Teredo (2001::/32), a local-use NAT64 prefix (64:ff9b:1::/48).
    Tunnel,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refused::Loopback => f.write_str("a loopback address"),
            Refused::LinkLocal => {
                f.write_str("a link-local address (metadata services live there)")
            }
            Refused::Unspecified => f.write_str("the unspecified address (it reaches this host)"),
            Refused::Multicast => f.write_str("a multicast or broadcast address"),
            Refused::ThisHost => f.write_str("an address of this host"),
            Refused::Denied(range) => write!(f, "in --guest-deny's {range}"),
            Refused::Guests(subnet) => write!(
                f,
                "in the guests' subnet {subnet} (--underlay-subnet): a guest never serves the host's images, whatever --image-allow says"
            ),
            Refused::UniqueLocal => f.write_str(
                "an IPv6 unique-local or site-local address (metadata services live there); serve the image from a global IPv6 or an IPv4 address",
            ),
            Refused::Tunnel => f.write_str(
                "an IPv6 tunnel or local NAT64 address, whose IPv4 end cannot be checked; name the server's own address",
            ),
        }
    }
}

impl Reach {
    /// Why `ip` may not be connected to, given this host's addresses
    /// `own`; `None` when it may.
    pub fn refusal(&self, ip: IpAddr, own: &[IpAddr]) -> Option<Refused> {
        // ::ffff:127.0.0.1 is 127.0.0.1 to the kernel, and 64:ff9b::a9fe:a9fe
        // is 169.254.169.254 to a NAT64 gateway: an IPv6 address that carries
        // an IPv4 one is held to the IPv4 rules (and ranges) of that one.
        let ip = match ip {
            IpAddr::V6(v6) => embedded_v4(v6).map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        let refused = match ip {
            IpAddr::V4(v4) => refusal_v4(v4),
            IpAddr::V6(v6) => refusal_v6(v6),
        }
        .or_else(|| {
            self.deny
                .iter()
                .find(|r| r.contains(ip))
                .map(|r| Refused::Denied(*r))
        })
        .or_else(|| own.contains(&ip).then_some(Refused::ThisHost));
        if let (Some(subnet), IpAddr::V4(v4)) = (self.guests, ip)
            && subnet.contains(v4)
        {
            return Some(Refused::Guests(subnet));
        }
        let allowed = self.allow.iter().any(|r| r.contains(ip));
        refused.filter(|_| !allowed)
    }
}

fn refusal_v4(ip: Ipv4Addr) -> Option<Refused> {
    if ip.is_loopback() {
        Some(Refused::Loopback)
    } else if ip.is_link_local() {
        Some(Refused::LinkLocal)
    } else if ip.octets()[0] == 0 {
        // 0.0.0.0/8: "this network"; Linux connects 0.0.0.0 to itself.
        Some(Refused::Unspecified)
    } else if ip.is_multicast() || ip.is_broadcast() {
        Some(Refused::Multicast)
    } else {
        None
    }
}

/// The IPv4 address an IPv6 one stands for, where the mapping is fixed:
/// IPv4-mapped (::ffff:0:0/96), IPv4-compatible (::/96), the well-known
/// NAT64 prefix (64:ff9b::/96, RFC 6052) and 6to4 (2002::/16, RFC 3056).
fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let seg = ip.segments();
    let low = Ipv4Addr::new(
        (seg[6] >> 8) as u8,
        seg[6] as u8,
        (seg[7] >> 8) as u8,
        seg[7] as u8,
    );
    if let Some(mapped) = ip.to_ipv4_mapped() {
        Some(mapped)
    } else if (seg[..6] == [0; 6] && !ip.is_loopback() && !ip.is_unspecified())
        || seg[..6] == [0x64, 0xff9b, 0, 0, 0, 0]
    {
        Some(low)
    } else if seg[0] == 0x2002 {
        Some(Ipv4Addr::new(
            (seg[1] >> 8) as u8,
            seg[1] as u8,
            (seg[2] >> 8) as u8,
            seg[2] as u8,
        ))
    } else {
        None
    }
}

fn refusal_v6(ip: Ipv6Addr) -> Option<Refused> {
    let seg = ip.segments();
    if ip.is_loopback() {
        Some(Refused::Loopback)
    } else if ip.is_unspecified() {
        Some(Refused::Unspecified)
    } else if ip.is_unicast_link_local() {
        Some(Refused::LinkLocal)
    } else if ip.is_multicast() {
        Some(Refused::Multicast)
    } else if seg[0] & 0xfe00 == 0xfc00 || seg[0] & 0xffc0 == 0xfec0 {
        Some(Refused::UniqueLocal)
    } else if (seg[0], seg[1]) == (0x2001, 0) || (seg[0], seg[1], seg[2]) == (0x64, 0xff9b, 1) {
        Some(Refused::Tunnel)
    } else {
        None
    }
}

/// Every address this host's interfaces hold, as the kernel says now; empty
/// if it cannot be asked (then loopback and the ranges are still refused).
pub fn this_hosts_addresses() -> Vec<IpAddr> {
    let Ok(interfaces) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    interfaces
        .filter_map(|i| {
            let addr = i.address?;
            addr.as_sockaddr_in()
                .map(|a| IpAddr::V4(a.ip()))
                .or_else(|| addr.as_sockaddr_in6().map(|a| IpAddr::V6(a.ip())))
        })
        .collect()
}

/// The refusal the resolver hands back, found again by the caller so the
/// VM's error can say which address and why.
#[derive(Debug)]
pub struct Unreachable {
    pub host: String,
    pub refused: Vec<(IpAddr, Refused)>,
}

impl fmt::Display for Unreachable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} is refused for image downloads: ", self.host)?;
        for (i, (ip, why)) in self.refused.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{ip} is {why}")?;
        }
        f.write_str(
            "; serve images from another host, or let an operator allow the range with --image-allow",
        )
    }
}

impl std::error::Error for Unreachable {}

/// The HTTP client's resolver: the default one, with every address it
/// finds checked before the connector sees it.
#[derive(Debug)]
pub struct CheckedResolver {
    reach: Reach,
    inner: DefaultResolver,
}

impl CheckedResolver {
    pub fn new(reach: Reach) -> CheckedResolver {
        CheckedResolver {
            reach,
            inner: DefaultResolver::default(),
        }
    }
}

impl Resolver for CheckedResolver {
    fn resolve(
        &self,
        uri: &Uri,
        config: &Config,
        timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        let found = self.inner.resolve(uri, config, timeout)?;
        let host = uri.host().unwrap_or_default();
        let is_proxy = config
            .proxy()
            .is_some_and(|p| p.host().eq_ignore_ascii_case(host));
        if is_proxy {
            return Ok(found);
        }
        let own = this_hosts_addresses();
        let mut kept = self.empty();
        let mut refused = Vec::new();
        for &addr in found.iter() {
            match self.reach.refusal(addr.ip(), &own) {
                None => kept.push(addr),
                Some(why) => refused.push((addr.ip(), why)),
            }
        }
        if kept.is_empty() {
            return Err(ureq::Error::Other(Box::new(Unreachable {
                host: host.to_owned(),
                refused,
            })));
        }
        if !refused.is_empty() {
            log::info!(
                "image host {}: {} of its addresses refused, connecting to the others",
                crate::quote::text(host),
                refused.len()
            );
        }
        Ok(kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(s: &str) -> IpAddr {
        IpAddr::V4(s.parse().expect("address"))
    }

    #[test]
    fn loopback_link_local_and_zero_are_refused_by_default() {
        let reach = Reach::default();

        assert_eq!(reach.refusal(v4("127.0.0.2"), &[]), Some(Refused::Loopback));
        assert_eq!(
            reach.refusal(v4("169.254.169.254"), &[]),
            Some(Refused::LinkLocal)
        );
        assert_eq!(
            reach.refusal(v4("0.0.0.0"), &[]),
            Some(Refused::Unspecified)
        );
        assert_eq!(reach.refusal(v4("203.0.113.7"), &[]), None);
    }

    #[test]
    fn a_mapped_v6_loopback_is_loopback() {
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().expect("address");

        assert_eq!(
            Reach::default().refusal(mapped, &[]),
            Some(Refused::Loopback)
        );
    }

    fn v6(s: &str) -> IpAddr {
        IpAddr::V6(s.parse().expect("address"))
    }

    #[test]
    fn ipv6_private_ranges_are_refused_as_metadata_could_live_there() {
        let reach = Reach::default();

        for ip in ["fd00:ec2::254", "fc00::1", "fec0::1"] {
            assert_eq!(
                reach.refusal(v6(ip), &[]),
                Some(Refused::UniqueLocal),
                "{ip}"
            );
        }
    }

    #[test]
    fn an_ipv4_inside_an_ipv6_address_is_held_to_the_ipv4_rules() {
        let lan = IpRange::parse("10.1.0.0/16").expect("range");
        let reach = Reach {
            deny: vec![lan],
            allow: Vec::new(),
            guests: None,
        };

        // NAT64 (well-known prefix), 6to4 and IPv4-compatible forms.
        assert_eq!(
            reach.refusal(v6("64:ff9b::a9fe:a9fe"), &[]),
            Some(Refused::LinkLocal)
        );
        assert_eq!(
            reach.refusal(v6("2002:7f00:1::1"), &[]),
            Some(Refused::Loopback)
        );
        assert_eq!(
            reach.refusal(v6("::a01:203"), &[]),
            Some(Refused::Denied(lan))
        );
        assert_eq!(reach.refusal(v6("64:ff9b::cb00:7107"), &[]), None);
    }

    #[test]
    fn tunnels_whose_ipv4_end_cannot_be_checked_are_refused() {
        let reach = Reach::default();

        for ip in [
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
            "64:ff9b:1::a9fe:a9fe",
        ] {
            assert_eq!(reach.refusal(v6(ip), &[]), Some(Refused::Tunnel), "{ip}");
        }
    }

    #[test]
    fn a_global_ipv6_address_is_reached() {
        assert_eq!(
            Reach::default().refusal(v6("2a00:1450:4001::200e"), &[]),
            None
        );
    }

    #[test]
    fn this_hosts_own_address_is_refused() {
        let own = [v4("192.0.2.10")];

        assert_eq!(
            Reach::default().refusal(v4("192.0.2.10"), &own),
            Some(Refused::ThisHost)
        );
    }

    #[test]
    fn the_guests_subnet_is_refused_even_where_image_allow_names_it() {
        let guests = Cidr::parse("100.77.0.0/16").expect("subnet");
        let reach = Reach {
            deny: Vec::new(),
            allow: vec![IpRange::parse("100.77.0.0/24").expect("range")],
            guests: Some(guests),
        };

        assert_eq!(
            reach.refusal(v4("100.77.0.9"), &[]),
            Some(Refused::Guests(guests))
        );
        assert_eq!(
            reach.refusal(v6("::ffff:100.77.3.4"), &[]),
            Some(Refused::Guests(guests))
        );
        assert_eq!(reach.refusal(v4("100.78.0.9"), &[]), None);
    }

    #[test]
    fn guest_deny_is_refused_and_image_allow_overrides_it() {
        let lan = IpRange::parse("10.1.0.0/16").expect("range");
        let denied = Reach {
            deny: vec![lan],
            allow: Vec::new(),
            guests: None,
        };
        let allowed = Reach {
            deny: vec![lan],
            allow: vec![IpRange::parse("10.1.2.0/24").expect("range")],
            guests: None,
        };

        assert_eq!(
            denied.refusal(v4("10.1.2.3"), &[]),
            Some(Refused::Denied(lan))
        );
        assert_eq!(allowed.refusal(v4("10.1.2.3"), &[]), None);
        assert_eq!(
            allowed.refusal(v4("10.1.9.9"), &[]),
            Some(Refused::Denied(lan))
        );
    }

    #[test]
    fn an_ipv6_range_in_guest_deny_is_refused_and_image_allow_overrides_it() {
        let lan = IpRange::parse("2001:db8:1::/48").expect("range");
        let denied = Reach {
            deny: vec![lan],
            allow: Vec::new(),
            guests: None,
        };
        let mirror = Reach {
            deny: vec![lan],
            allow: vec![IpRange::parse("2001:db8:1:2::/64").expect("range")],
            guests: None,
        };

        assert_eq!(
            denied.refusal(v6("2001:db8:1:2::10"), &[]),
            Some(Refused::Denied(lan))
        );
        assert_eq!(mirror.refusal(v6("2001:db8:1:2::10"), &[]), None);
        assert_eq!(denied.refusal(v6("2001:db8:2::10"), &[]), None);
    }

    #[test]
    fn an_ipv6_mirror_on_a_unique_local_range_is_reached_once_allowed() {
        let reach = Reach {
            deny: Vec::new(),
            allow: vec![IpRange::parse("fd12:3456::/32").expect("range")],
            guests: None,
        };

        assert_eq!(reach.refusal(v6("fd12:3456::80"), &[]), None);
        assert_eq!(
            reach.refusal(v6("fd00:ec2::254"), &[]),
            Some(Refused::UniqueLocal)
        );
    }

    #[test]
    fn the_kernel_reports_loopback_among_this_hosts_addresses() {
        let own = this_hosts_addresses();

        assert!(own.contains(&v4("127.0.0.1")), "{own:?}");
    }
}
