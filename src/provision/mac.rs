//! Deterministic MAC addresses: a VM's NICs keep their MACs across agent
//! restarts and host reboots, which is what keeps its addresses sticky.

use sha2::{Digest, Sha256};

use crate::model::Id;

/// The MAC of a VM's underlay NIC.
pub fn underlay(vm_id: &Id) -> String {
    derive("underlay", vm_id)
}

/// The MAC of a VM's second NIC, on a named host network.
pub fn second_nic(vm_id: &Id) -> String {
    derive("network", vm_id)
}

/// Six bytes of SHA-256 over the role and id, made locally administered
/// (bit 1 of the first octet set) and unicast (bit 0 clear), so it can never
/// collide with a vendor-assigned MAC or be read as multicast.
fn derive(role: &str, vm_id: &Id) -> String {
    let digest = Sha256::new()
        .chain_update(role.as_bytes())
        .chain_update([0u8])
        .chain_update(vm_id.as_str().as_bytes())
        .finalize();
    let mut mac = [0u8; 6];
    mac.copy_from_slice(&digest[..6]);
    mac[0] = (mac[0] | 0b10) & !0b1;
    text(mac)
}

/// `02:ab:…`, the form `ip`, cloud-init and cloud-hypervisor all take.
pub fn text(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Reads `02:ab:…` back; `None` for anything else.
pub fn parse(text: &str) -> Option<[u8; 6]> {
    let bytes: Vec<u8> = text
        .split(':')
        .map(|h| {
            (h.len() == 2)
                .then(|| u8::from_str_radix(h, 16).ok())
                .flatten()
        })
        .collect::<Option<_>>()?;
    bytes.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(raw: &str) -> Id {
        Id::parse(raw).expect("id")
    }

    #[test]
    fn stable_for_an_id() {
        assert_eq!(underlay(&id("vm-1")), underlay(&id("vm-1")));
    }

    #[test]
    fn differs_by_role_and_id() {
        assert_ne!(underlay(&id("vm-1")), second_nic(&id("vm-1")));
        assert_ne!(underlay(&id("vm-1")), underlay(&id("vm-2")));
    }

    #[test]
    fn text_round_trips() {
        let mac = [0x02, 0xab, 0, 1, 0xfe, 0x10];

        assert_eq!(parse(&text(mac)), Some(mac));
        assert_eq!(parse("02:ab:00"), None);
    }

    #[test]
    fn locally_administered_unicast() {
        let mac = underlay(&id("vm-1"));
        let first = u8::from_str_radix(&mac[..2], 16).expect("hex");

        assert_eq!(first & 0b11, 0b10, "{mac}");
        assert_eq!(mac.len(), 17);
    }
}
