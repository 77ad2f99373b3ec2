//! An IPv4 range as an operator writes it: `a.b.c.d/n`, or a bare address
//! for one host. Used for the guests' egress policy (`--guest-deny`,
//! `--guest-allow`).

use std::fmt;
use std::net::Ipv4Addr;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
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
    pub fn parse(text: &str) -> Result<Cidr, String> {
        let text = text.trim();
        let (addr, prefix) = text.split_once('/').unwrap_or((text, "32"));
        let network: Ipv4Addr = addr
            .parse()
            .map_err(|_| format!("{addr:?} is not an IPv4 address"))?;
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| *p <= 32)
            .ok_or_else(|| format!("/{prefix} is not a prefix length (0 to 32)"))?;
        let cidr = Cidr { network, prefix };
        let masked = Ipv4Addr::from(u32::from(network) & cidr.mask());
        if masked != network {
            return Err(format!(
                "{text} has host bits set; did you mean {masked}/{prefix}?"
            ));
        }
        Ok(cidr)
    }

    /// A comma-separated list; empty text is an empty list.
    pub fn parse_list(text: &str) -> Result<Vec<Cidr>, String> {
        text.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(Cidr::parse)
            .collect()
    }

    fn mask(&self) -> u32 {
        u32::MAX
            .checked_shl(32 - u32::from(self.prefix))
            .unwrap_or(0)
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask() == u32::from(self.network)
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_address_is_one_host() {
        let c = Cidr::parse("192.0.2.7").expect("parses");

        assert_eq!(c, Cidr::host(Ipv4Addr::new(192, 0, 2, 7)));
    }

    #[test]
    fn host_bits_are_refused_with_the_range_meant() {
        let e = Cidr::parse("10.1.2.3/8").expect_err("host bits");

        assert!(e.contains("10.0.0.0/8"), "{e}");
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
