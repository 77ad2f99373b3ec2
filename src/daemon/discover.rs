//! What the daemon finds out from the host as it starts, where the flags
//! left it open: kept out of `config`, which only reads flags and the
//! environment, so parsing a command line never touches the host.

use std::net::Ipv4Addr;

/// `/etc/machine-id`, else the kernel's hostname, else "unknown-host".
pub fn host_id() -> String {
    ["/etc/machine-id", "/proc/sys/kernel/hostname"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .map(|s| s.trim().to_owned())
        .find(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown-host".into())
}

/// The host's own DNS servers from /etc/resolv.conf, less loopback ones a
/// guest cannot reach (a local caching resolver).
pub fn resolvers() -> Vec<Ipv4Addr> {
    parse_resolvers(&std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default())
}

fn parse_resolvers(text: &str) -> Vec<Ipv4Addr> {
    text.lines()
        .filter_map(|l| l.strip_prefix("nameserver"))
        .filter_map(|v| v.trim().parse::<Ipv4Addr>().ok())
        .filter(|ip| !ip.is_loopback())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_ipv6_resolvers_are_left_out() {
        let text =
            "# comment\nnameserver 127.0.0.53\nnameserver 192.0.2.53\nnameserver ::1\nsearch lan\n";

        assert_eq!(parse_resolvers(text), vec![Ipv4Addr::new(192, 0, 2, 53)]);
    }
}
