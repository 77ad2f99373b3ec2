//! Links other than the agent's bridge that hold the guests' subnet: an
//! address in it, or a route into it. The kernel sends a frame for a guest
//! by the most specific route, and of two equal ones by the first made: a
//! stale bridge left with the subnet (an old agent's, a test's) takes the
//! frames meant for sleeping guests, so they never wake, and the replies
//! meant for running ones, without a word. The agent names each at start
//! and `check` does too (they are the operator's to remove).
//!
//! Read from `ip -4 -o addr show` and `ip -4 route show`, whose text is the
//! one iproute2 has printed for two decades.

use std::net::Ipv4Addr;

use crate::model::Cidr;

/// What holds part of `subnet` besides `bridge`, each said as a sentence
/// naming the link and what to do; empty when nothing does.
pub fn rivals(subnet: Cidr, bridge: &str) -> Result<Vec<String>, super::underlay::NetError> {
    let addresses = super::command::run("ip", &["-4", "-o", "addr", "show"], None)?;
    let routes = super::command::run("ip", &["-4", "route", "show"], None)?;
    let mut out = in_addresses(&addresses, subnet, bridge);
    // A link's own address makes its route too: each link named once.
    for (link, said) in in_routes(&routes, subnet, bridge) {
        if link.is_none() || !out.iter().any(|(named, _)| *named == link) {
            out.push((link, said));
        }
    }
    Ok(out.into_iter().map(|(_, said)| said).collect())
}

/// A rival: the link it is on (none for a route of no link), and what is
/// said of it.
type Rival = (Option<String>, String);

/// The addresses inside `subnet` that links other than `bridge` hold.
fn in_addresses(text: &str, subnet: Cidr, bridge: &str) -> Vec<Rival> {
    text.lines()
        .filter_map(|line| {
            // "3: eth0    inet 100.77.0.1/16 brd … scope global eth0\ …"
            let mut words = line.split_whitespace().skip(1);
            let link = words.next()?.trim_end_matches(':');
            let link = link.split('@').next().unwrap_or(link);
            let address = words.skip_while(|w| *w != "inet").nth(1)?;
            let ip: Ipv4Addr = address.split('/').next()?.parse().ok()?;
            (link != bridge && subnet.contains(ip)).then(|| {
                (Some(link.to_owned()), format!(
                    "link {link} holds {address}, in the guests' subnet {subnet}: frames for guests may go to it instead of the bridge {bridge} (remove the address or the link, or give --underlay-subnet a range of its own)"
                ))
            })
        })
        .collect()
}

/// The routes into `subnet` (as specific as it or more) through anything
/// but `bridge`.
fn in_routes(text: &str, subnet: Cidr, bridge: &str) -> Vec<Rival> {
    text.lines()
        .filter_map(|line| {
            // "[type] DEST [via GW] [dev LINK] …"; a route of no link (a
            // blackhole) swallows guests' frames as surely.
            let words: Vec<&str> = line.split_whitespace().collect();
            let dest = words.iter().find_map(|w| Cidr::parse(w).ok())?;
            let link = words
                .iter()
                .position(|w| *w == "dev")
                .and_then(|i| words.get(i + 1))
                .copied();
            if !subnet.covers(&dest) || link == Some(bridge) {
                return None;
            }
            Some(match link {
                Some(link) => (Some(link.to_owned()), format!(
                    "link {link} is routed {dest}, in the guests' subnet {subnet}: frames for guests may go to it instead of the bridge {bridge} (remove the route or the link, or give --underlay-subnet a range of its own)"
                )),
                None => (None, format!(
                    "route {line:?} covers {dest}, in the guests' subnet {subnet}: frames for guests may never reach the bridge {bridge} (remove it, or give --underlay-subnet a range of its own)"
                )),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subnet() -> Cidr {
        Cidr::parse("100.77.0.0/16").expect("subnet")
    }

    #[test]
    fn another_links_address_in_the_subnet_is_named() {
        let text = "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n\
                    7: stale0    inet 100.77.0.1/16 scope global stale0\\       valid_lft forever\n\
                    8: eitri0    inet 100.77.0.1/16 scope global eitri0\\       valid_lft forever\n";

        let found = in_addresses(text, subnet(), "eitri0");

        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].0.as_deref(), Some("stale0"));
        assert!(
            found[0].1.starts_with("link stale0 holds 100.77.0.1/16"),
            "{found:?}"
        );
    }

    #[test]
    fn a_route_into_the_subnet_through_another_link_is_named() {
        let text = "default via 10.0.0.1 dev eth0\n\
                    100.64.0.0/10 via 10.0.0.2 dev eth0\n\
                    100.77.0.0/16 dev stale0 proto kernel scope link src 100.77.0.1 linkdown\n\
                    100.77.0.0/16 dev eitri0 proto kernel scope link src 100.77.0.1\n\
                    blackhole 100.77.9.0/24\n";

        let found = in_routes(text, subnet(), "eitri0");

        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found[0]
                .1
                .starts_with("link stale0 is routed 100.77.0.0/16"),
            "{found:?}"
        );
        assert_eq!(found[1].0, None);
        assert!(found[1].1.contains("blackhole 100.77.9.0/24"), "{found:?}");
    }

    #[test]
    fn a_host_of_the_bridge_alone_names_nothing() {
        let addresses = "8: eitri0    inet 100.77.0.1/16 scope global eitri0\\ x\n";
        let routes = "default via 10.0.0.1 dev eth0\n100.77.0.0/16 dev eitri0 proto kernel\n";

        assert!(in_addresses(addresses, subnet(), "eitri0").is_empty());
        assert!(in_routes(routes, subnet(), "eitri0").is_empty());
    }
}
