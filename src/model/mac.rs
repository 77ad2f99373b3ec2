//! MAC addresses: a domain value, derived from a VM's id so a VM's NICs keep
//! their MACs across agent restarts and host reboots, which is what keeps
//! its addresses sticky. The backend puts them on command lines, the seed
//! tells them to cloud-init, the network keys leases and learned addresses
//! by them.

use std::fmt;

use sha2::{Digest, Sha256};

use super::Id;

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Mac([u8; 6]);

impl Mac {
    /// The MAC of a VM's underlay NIC.
    pub fn underlay(vm_id: &Id) -> Mac {
        Mac::derive("underlay", vm_id)
    }

    /// The MAC of a VM's second NIC, on a named host network.
    pub fn second_nic(vm_id: &Id) -> Mac {
        Mac::derive("network", vm_id)
    }

    /// Six bytes of SHA-256 over the role and id, made locally administered
    /// (bit 1 of the first octet set) and unicast (bit 0 clear), so it can
    /// never collide with a vendor-assigned MAC or be read as multicast.
    fn derive(role: &str, vm_id: &Id) -> Mac {
        let digest = Sha256::new()
            .chain_update(role.as_bytes())
            .chain_update([0u8])
            .chain_update(vm_id.as_str().as_bytes())
            .finalize();
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&digest[..6]);
        mac[0] = (mac[0] | 0b10) & !0b1;
        Mac(mac)
    }

    /// Reads `02:ab:…` back; `None` for anything else.
    pub fn parse(text: &str) -> Option<Mac> {
        let bytes: Vec<u8> = text
            .split(':')
            .map(|h| {
                (h.len() == 2)
                    .then(|| u8::from_str_radix(h, 16).ok())
                    .flatten()
            })
            .collect::<Option<_>>()?;
        bytes.try_into().ok().map(Mac)
    }

    pub fn octets(self) -> [u8; 6] {
        self.0
    }
}

impl From<[u8; 6]> for Mac {
    fn from(octets: [u8; 6]) -> Mac {
        Mac(octets)
    }
}

/// `02:ab:…`, the form `ip`, cloud-init and cloud-hypervisor all take.
impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&crate::hex::encode_with(&self.0, ":"))
    }
}

impl fmt::Debug for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(raw: &str) -> Id {
        Id::parse(raw).expect("id")
    }

    #[test]
    fn stable_for_an_id() {
        assert_eq!(Mac::underlay(&id("vm-1")), Mac::underlay(&id("vm-1")));
    }

    #[test]
    fn differs_by_role_and_id() {
        assert_ne!(Mac::underlay(&id("vm-1")), Mac::second_nic(&id("vm-1")));
        assert_ne!(Mac::underlay(&id("vm-1")), Mac::underlay(&id("vm-2")));
    }

    #[test]
    fn text_round_trips() {
        let mac = Mac::from([0x02, 0xab, 0, 1, 0xfe, 0x10]);

        assert_eq!(mac.to_string(), "02:ab:00:01:fe:10");
        assert_eq!(Mac::parse(&mac.to_string()), Some(mac));
        assert_eq!(Mac::parse("02:ab:00"), None);
    }

    #[test]
    fn locally_administered_unicast() {
        let mac = Mac::underlay(&id("vm-1"));

        assert_eq!(mac.octets()[0] & 0b11, 0b10, "{mac}");
    }
}
