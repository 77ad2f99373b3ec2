//! Guest addresses under vfkit's `nat`: macOS's bootpd leases them from
//! 192.168.64.0/24 and records them in `/var/db/dhcpd_leases`, newest
//! first, one `{ key=value … }` block per lease:
//!
//! ```text
//! {
//!     name=ubuntu
//!     ip_address=192.168.64.3
//!     hw_address=1,8e:1:99:2b:3c:4d
//!     identifier=1,8e:1:99:2b:3c:4d
//!     lease=0x65a1b2c3
//! }
//! ```
//!
//! MAC octets lose their leading zeros (`8e:1:99`), so MACs are compared as
//! bytes. A guest that identifies itself by DUID (netplan and
//! systemd-networkd do, on macOS 15+, unless the seed says
//! `dhcp-identifier: mac`) is recorded as `ff,<IAID><DUID>`; its MAC is
//! read from a link-layer DUID (types 1 and 3), and a DUID without one
//! matches nothing. Unknown keys are ignored; a missing file (no lease
//! yet) is no address. A reused MAC can find a stale lease: the newest
//! wins.

use std::net::Ipv4Addr;
use std::path::Path;

/// Where bootpd keeps its leases.
pub const LEASE_FILE: &str = "/var/db/dhcpd_leases";

/// Colon-separated hex octets, leading zeros optional.
fn octets(text: &str) -> Option<Vec<u8>> {
    text.split(':')
        .map(|o| {
            (!o.is_empty() && o.len() <= 2)
                .then(|| u8::from_str_radix(o, 16).ok())
                .flatten()
        })
        .collect()
}

/// The MAC a `hw_address` value names, if any.
fn hw_mac(value: &str) -> Option<[u8; 6]> {
    let (kind, rest) = value.split_once(',')?;
    let bytes = octets(rest)?;
    let mac: &[u8] = match kind {
        "1" => &bytes,
        // IAID (4 bytes), then the DUID: type 1 (link-layer plus time:
        // hardware type 2, time 4, address) or 3 (link-layer: hardware
        // type 2, address), hardware type 1 (Ethernet).
        "ff" => {
            let duid = bytes.get(4..)?;
            match duid.get(..4)? {
                [0, 1, 0, 1] => duid.get(8..)?,
                [0, 3, 0, 1] => duid.get(4..)?,
                _ => return None,
            }
        }
        _ => return None,
    };
    mac.try_into().ok()
}

/// The address of the newest lease for `mac` in a lease file's text.
pub fn address_in(text: &str, mac: [u8; 6]) -> Option<Ipv4Addr> {
    let mut ip: Option<Ipv4Addr> = None;
    let mut hw: Option<[u8; 6]> = None;
    for line in text.lines().map(str::trim) {
        match line {
            "{" => (ip, hw) = (None, None),
            "}" => {
                if hw == Some(mac)
                    && let Some(found) = ip
                {
                    return Some(found);
                }
            }
            _ => match line.split_once('=') {
                Some(("ip_address", v)) => ip = v.trim().parse().ok(),
                Some(("hw_address", v)) => hw = hw_mac(v.trim()),
                _ => {}
            },
        }
    }
    None
}

/// The address of the newest lease for `mac` in the file at `path`.
pub fn address(path: &Path, mac: [u8; 6]) -> Option<Ipv4Addr> {
    address_in(&std::fs::read_to_string(path).ok()?, mac)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: [u8; 6] = [0x8e, 0x01, 0x99, 0x2b, 0x0c, 0x4d];

    #[test]
    fn leading_zeros_stripped_still_match() {
        let text = "{\n\tname=a\n\tip_address=192.168.64.3\n\thw_address=1,8e:1:99:2b:c:4d\n\tlease=0x1\n}\n";

        assert_eq!(address_in(text, MAC), Some(Ipv4Addr::new(192, 168, 64, 3)));
    }

    #[test]
    fn the_newest_of_two_leases_for_one_mac_wins() {
        let text = "{\n\tip_address=192.168.64.9\n\thw_address=1,8e:1:99:2b:c:4d\n}\n\
                    {\n\tip_address=192.168.64.3\n\thw_address=1,8e:1:99:2b:c:4d\n}\n";

        assert_eq!(address_in(text, MAC), Some(Ipv4Addr::new(192, 168, 64, 9)));
    }

    #[test]
    fn a_duid_lease_is_matched_by_the_mac_inside_it() {
        // IAID 27:c:4d:1, DUID-LLT: 0:1, hardware 0:1, time 4 bytes, MAC.
        let text = "{\n\tip_address=192.168.64.5\n\thw_address=ff,27:c:4d:1:0:1:0:1:2c:f1:3a:10:8e:1:99:2b:c:4d\n\tidentifier=ff,27:c:4d:1:0:1:0:1:2c:f1:3a:10:8e:1:99:2b:c:4d\n}\n";

        assert_eq!(address_in(text, MAC), Some(Ipv4Addr::new(192, 168, 64, 5)));
    }

    #[test]
    fn a_duid_without_a_mac_matches_nothing() {
        // DUID-UUID (type 4).
        let text = "{\n\tip_address=192.168.64.6\n\thw_address=ff,1:2:3:4:0:4:8e:1:99:2b:c:4d:0:0:0:0:0:0:0:0:0:0\n}\n";

        assert_eq!(address_in(text, MAC), None);
    }

    #[test]
    fn unknown_keys_and_other_macs_are_passed_over() {
        let text = "{\n\tip_address=192.168.64.7\n\thw_address=1,2:0:0:0:0:1\n\tsomething_new=1\n}\n\
                    {\n\tname=b\n\tfuture_key=x=y\n\tip_address=192.168.64.8\n\thw_address=1,8e:1:99:2b:c:4d\n}\n";

        assert_eq!(address_in(text, MAC), Some(Ipv4Addr::new(192, 168, 64, 8)));
    }

    #[test]
    fn a_missing_file_is_no_address() {
        let dir = tempfile::tempdir().expect("tempdir");

        assert_eq!(address(&dir.path().join("dhcpd_leases"), MAC), None);
    }
}
