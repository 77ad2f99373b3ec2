//! Where an image download may connect. Image URLs come from the wire, and
//! the agent fetches them as root from the host's own network: without a
//! rule, a URL naming `127.0.0.1`, `169.254.169.254` or the management LAN
//! turns the agent into a prober of everything the guests are kept from.
//!
//! - Refused unless `--image-allow` names them: loopback, link-local,
//!   unspecified and multicast addresses, every address of this host (asked
//!   of the kernel at each connection, so an address added since start
//!   counts), and the operator's `--guest-deny` ranges.
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

use crate::model::Cidr;

/// The operator's ranges: what to refuse besides the host, and what to
/// allow although refused.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reach {
    /// `--guest-deny`: the management LAN and the like.
    pub deny: Vec<Cidr>,
    /// `--image-allow`: an image mirror on one of the refused ranges.
    pub allow: Vec<Cidr>,
}

/// Why an address is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    Loopback,
    LinkLocal,
    Unspecified,
    Multicast,
    ThisHost,
    Denied(Cidr),
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
        }
    }
}

impl Reach {
    /// Why `ip` may not be connected to, given this host's addresses
    /// `own`; `None` when it may.
    pub fn refusal(&self, ip: IpAddr, own: &[IpAddr]) -> Option<Refused> {
        // ::ffff:127.0.0.1 is 127.0.0.1 to the kernel.
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        let refused = match ip {
            IpAddr::V4(v4) => refusal_v4(v4, &self.deny),
            IpAddr::V6(v6) => refusal_v6(v6),
        }
        .or_else(|| own.contains(&ip).then_some(Refused::ThisHost))?;
        let allowed = match ip {
            IpAddr::V4(v4) => self.allow.iter().any(|r| r.contains(v4)),
            IpAddr::V6(_) => false,
        };
        (!allowed).then_some(refused)
    }
}

fn refusal_v4(ip: Ipv4Addr, deny: &[Cidr]) -> Option<Refused> {
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
        deny.iter()
            .find(|r| r.contains(ip))
            .map(|r| Refused::Denied(*r))
    }
}

fn refusal_v6(ip: Ipv6Addr) -> Option<Refused> {
    if ip.is_loopback() {
        Some(Refused::Loopback)
    } else if ip.is_unspecified() {
        Some(Refused::Unspecified)
    } else if ip.is_unicast_link_local() {
        Some(Refused::LinkLocal)
    } else if ip.is_multicast() {
        Some(Refused::Multicast)
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

    #[test]
    fn this_hosts_own_address_is_refused() {
        let own = [v4("192.0.2.10")];

        assert_eq!(
            Reach::default().refusal(v4("192.0.2.10"), &own),
            Some(Refused::ThisHost)
        );
    }

    #[test]
    fn guest_deny_is_refused_and_image_allow_overrides_it() {
        let lan = Cidr::parse("10.1.0.0/16").expect("range");
        let denied = Reach {
            deny: vec![lan],
            allow: Vec::new(),
        };
        let allowed = Reach {
            deny: vec![lan],
            allow: vec![Cidr::parse("10.1.2.0/24").expect("range")],
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
    fn the_kernel_reports_loopback_among_this_hosts_addresses() {
        let own = this_hosts_addresses();

        assert!(own.contains(&v4("127.0.0.1")), "{own:?}");
    }
}
