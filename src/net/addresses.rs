//! Underlay addresses: one per VM, sticky by VM id, never two live VMs on
//! one (a [`Leases`] pool over the subnet's guest addresses, first choice
//! from the VM id). An address is released at destroy, not at stop: a
//! stopped VM keeps it.
//!
//! A VM's underlay MAC is derived from its id (46 bits of a hash), so a
//! control plane that searched for two ids with one MAC (about 2^23
//! hashes) could put two guests behind one MAC, and the bridge would hand
//! one the other's frames. The second of such a pair gets no address: a
//! permanent error naming both.

use std::fmt;
use std::net::Ipv4Addr;
use std::path::Path;

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::model::{Cidr, CidrError};
use crate::model::{Id, Mac};
use crate::state::atomic::Pending;
use crate::state::leases::{LeaseError, Leases};

/// The underlay's subnet: a [`Cidr`] written `a.b.c.d/n`, from /8 to /29,
/// so it holds the gateway (its first host address) and guests (the rest).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Subnet(Cidr);

/// Why a text is not an underlay subnet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SubnetError {
    NoPrefix { text: String },
    Range(CidrError),
    Size { prefix: u8 },
}

impl fmt::Display for SubnetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SubnetError::NoPrefix { text } => write!(f, "{text:?} is not an a.b.c.d/n subnet"),
            SubnetError::Range(e) => e.fmt(f),
            SubnetError::Size { prefix } => write!(f, "/{prefix} must be between /8 and /29"),
        }
    }
}

impl std::error::Error for SubnetError {}

impl Subnet {
    /// Parses `a.b.c.d/n`, refusing host bits and subnets too small for a
    /// gateway and a guest.
    pub fn parse(text: &str) -> Result<Subnet, SubnetError> {
        if !text.contains('/') {
            return Err(SubnetError::NoPrefix {
                text: text.to_owned(),
            });
        }
        let cidr = Cidr::parse(text).map_err(SubnetError::Range)?;
        if !(8..=29).contains(&cidr.prefix) {
            return Err(SubnetError::Size {
                prefix: cidr.prefix,
            });
        }
        Ok(Subnet(cidr))
    }

    pub fn network(&self) -> Ipv4Addr {
        self.0.network
    }

    /// The range, as every other prefix of the agent is held.
    pub fn cidr(&self) -> Cidr {
        self.0
    }

    pub fn prefix(&self) -> u8 {
        self.0.prefix
    }

    pub fn netmask(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.0.mask())
    }

    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.0.network) + 1)
    }

    /// Guest addresses: after the gateway, before the broadcast address.
    fn guests(&self) -> (u32, u32) {
        let first = u32::from(self.0.network) + 2;
        let last = (u32::from(self.0.network) | !self.0.mask()) - 1;
        (first, last)
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        self.0.contains(ip)
    }
}

impl fmt::Display for Subnet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[derive(Debug)]
pub enum AddressError {
    Full {
        subnet: Subnet,
    },
    /// The persisted map could not be read or saved.
    Map(LeaseError),
    /// The VM's MAC is another VM's.
    MacCollision {
        vm_id: Id,
        other: Id,
        mac: Mac,
    },
}

impl fmt::Display for AddressError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AddressError::Full { subnet } => write!(
                f,
                "no free address left in {subnet}; use a larger --underlay-subnet"
            ),
            AddressError::Map(LeaseError::Unreadable { path, problem }) => write!(
                f,
                "the address map {} is unreadable ({problem}); no address is handed out until it is repaired, since a fresh map could give a live VM's address away",
                path.display()
            ),
            AddressError::Map(LeaseError::Save { path, .. }) => {
                write!(f, "cannot save the address map {}", path.display())
            }
            // Mapped to `Full` with its subnet (see `from`).
            AddressError::Map(LeaseError::Full) => f.write_str("no free address left"),
            AddressError::MacCollision { vm_id, other, mac } => write!(
                f,
                "a MAC of VM {vm_id}, {mac}, is one of VM {other}'s too; two guests cannot share a MAC (on the underlay or a site network): create it under another id"
            ),
        }
    }
}

impl std::error::Error for AddressError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            AddressError::Map(LeaseError::Save { source, .. }) => Some(source),
            _ => None,
        }
    }
}

impl crate::error::Failure for AddressError {
    fn is_permanent(&self) -> bool {
        matches!(
            self,
            AddressError::Full { .. } | AddressError::MacCollision { .. }
        )
    }
}

/// Every MAC a VM's NICs may have: derived from its id, 48 bits of a
/// hash, so a control plane that searched ids for it could make two VMs
/// share one (on the underlay, on a site network, or one VM's underlay MAC
/// another's second NIC's).
fn macs_of(vm_id: &Id) -> [Mac; 2] {
    [Mac::underlay(vm_id), Mac::second_nic(vm_id)]
}

/// The persisted VM id → address map of one subnet.
pub struct Addresses {
    subnet: Subnet,
    leases: Leases<Ipv4Addr>,
    /// Both MACs (underlay and second NIC) of every VM holding an address.
    macs: Mutex<HashMap<Mac, Id>>,
}

impl Addresses {
    /// Loads the map at `path` (absent = empty). An unreadable map is an
    /// error: starting from nothing could hand a live VM's address to another.
    pub fn open(path: &Path, subnet: Subnet) -> Result<Addresses, AddressError> {
        let (first, last) = subnet.guests();
        let leases: Leases<Ipv4Addr> =
            Leases::open(path, first, last - first + 1).map_err(|e| from(e, subnet))?;
        let mut macs = HashMap::new();
        for key in leases.keys() {
            match Id::parse(&key) {
                Ok(id) => {
                    for mac in macs_of(&id) {
                        macs.insert(mac, id.clone());
                    }
                }
                // A map from before addresses were keyed by VM id (its
                // keys were MACs): the entry's VM cannot be named, and its
                // slot would be held for ever. Its guest is given its
                // address afresh at its next boot or renewal.
                Err(_) => {
                    leases.release(&key).map_err(|e| from(e, subnet))?;
                    log::info!("address map: dropped {key:?}, a key of an older format");
                }
            }
        }
        Ok(Addresses {
            subnet,
            leases,
            macs: Mutex::new(macs),
        })
    }

    pub fn subnet(&self) -> Subnet {
        self.subnet
    }

    pub fn get(&self, vm_id: &Id) -> Option<Ipv4Addr> {
        self.leases.get(vm_id.as_str())
    }

    /// The VM's address: the one it has, or a new one, saved before it is
    /// returned.
    pub fn allocate(&self, vm_id: &Id) -> Result<Ipv4Addr, AddressError> {
        self.take(vm_id, |key| {
            self.leases.allocate(key, key).map(|ip| (ip, ()))
        })
        .map(|(ip, ())| ip)
    }

    /// As [`Addresses::allocate`], the map's name left for the caller to
    /// make durable (see [`Leases::reserve`]).
    pub fn reserve(&self, vm_id: &Id) -> Result<(Ipv4Addr, Pending), AddressError> {
        self.take(vm_id, |key| self.leases.reserve(key, key))
    }

    /// The VM's address from `lease` (with what it returns beside), once
    /// no other VM holds one of its MACs. The MACs are claimed first, and
    /// the lock on them is not held through the lease's write: a VM's
    /// start asking for the address it holds does not wait on a burst of
    /// other VMs' reserves (see `Leases`).
    fn take<T>(
        &self,
        vm_id: &Id,
        lease: impl FnOnce(&str) -> Result<(Ipv4Addr, T), LeaseError>,
    ) -> Result<(Ipv4Addr, T), AddressError> {
        let mine = macs_of(vm_id);
        let claimed = {
            let mut macs = self.macs.lock();
            for mac in mine {
                if let Some(other) = macs.get(&mac)
                    && other != vm_id
                {
                    return Err(AddressError::MacCollision {
                        vm_id: vm_id.clone(),
                        other: other.clone(),
                        mac,
                    });
                }
            }
            mine.into_iter()
                .filter(|mac| macs.insert(*mac, vm_id.clone()).is_none())
                .collect::<Vec<_>>()
        };
        lease(vm_id.as_str()).map_err(|e| {
            // Claims this call made are given back: the VM holds no
            // address by them.
            let mut macs = self.macs.lock();
            for mac in &claimed {
                macs.remove(mac);
            }
            from(e, self.subnet)
        })
    }

    /// The VMs holding an address.
    pub fn holders(&self) -> Vec<Id> {
        self.leases.vm_ids()
    }

    /// Frees the VM's address (at destroy). Its MACs are given back only
    /// once the map no longer holds it.
    pub fn release(&self, vm_id: &Id) -> Result<(), AddressError> {
        self.leases
            .release(vm_id.as_str())
            .map_err(|e| from(e, self.subnet))?;
        let mut macs = self.macs.lock();
        for mac in macs_of(vm_id) {
            if macs.get(&mac) == Some(vm_id) {
                macs.remove(&mac);
            }
        }
        Ok(())
    }

    /// Where `ip` sits in the subnet: distinct for every address, so it
    /// names the VM's taps (see `tap_names`).
    pub fn offset(&self, ip: Ipv4Addr) -> u32 {
        u32::from(ip).wrapping_sub(u32::from(self.subnet.network()))
    }
}

fn from(e: LeaseError, subnet: Subnet) -> AddressError {
    match e {
        LeaseError::Full => AddressError::Full { subnet },
        other => AddressError::Map(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> Id {
        Id::parse(s).expect("id")
    }

    fn small() -> Subnet {
        Subnet::parse("192.0.2.0/29").expect("subnet")
    }

    #[test]
    fn the_first_choice_depends_on_the_vm_id_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = Addresses::open(
            &dir.path().join("a.json"),
            Subnet::parse("100.77.0.0/16").expect("net"),
        )
        .expect("open");
        let b = Addresses::open(
            &dir.path().join("b.json"),
            Subnet::parse("100.77.0.0/16").expect("net"),
        )
        .expect("open");

        assert_eq!(a.allocate(&id("vm-1")).ok(), b.allocate(&id("vm-1")).ok());
    }

    #[test]
    fn collisions_probe_to_distinct_addresses_until_full() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = Addresses::open(&dir.path().join("a.json"), small()).expect("open");

        let ips: Vec<Ipv4Addr> = (0..5)
            .map(|n| a.allocate(&id(&format!("vm-{n}"))).expect("room"))
            .collect();
        let full = a.allocate(&id("vm-5"));

        let distinct: std::collections::HashSet<_> = ips.iter().collect();
        assert_eq!(distinct.len(), 5, "a /29 has 5 guest addresses: {ips:?}");
        assert!(
            ips.iter()
                .all(|ip| small().contains(*ip) && *ip != small().gateway())
        );
        assert!(matches!(full, Err(AddressError::Full { .. })));
    }

    #[test]
    fn a_vm_refused_an_address_holds_none_of_its_macs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = Addresses::open(&dir.path().join("a.json"), small()).expect("open");
        for n in 0..5 {
            a.allocate(&id(&format!("vm-{n}"))).expect("room");
        }

        let full = a.reserve(&id("vm-5"));

        let claimed: Vec<Mac> = macs_of(&id("vm-5"))
            .into_iter()
            .filter(|mac| a.macs.lock().contains_key(mac))
            .collect();
        assert!(matches!(full, Err(AddressError::Full { .. })));
        assert_eq!(claimed, Vec::<Mac>::new());
    }

    #[test]
    fn an_address_survives_a_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.json");
        let ip = Addresses::open(&path, small())
            .expect("open")
            .allocate(&id("vm-1"))
            .expect("ip");

        let again = Addresses::open(&path, small()).expect("reopen");

        assert_eq!(again.get(&id("vm-1")), Some(ip));
    }

    #[test]
    fn release_frees_the_address() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = Addresses::open(&dir.path().join("a.json"), small()).expect("open");
        let ip = a.allocate(&id("vm-1")).expect("ip");

        a.release(&id("vm-1")).expect("release");

        assert_eq!(a.get(&id("vm-1")), None);
        assert_eq!(a.allocate(&id("vm-1")).ok(), Some(ip));
    }

    #[test]
    fn a_vm_whose_mac_is_anothers_gets_no_address() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.json");
        // A map holding an address under the key of another VM whose MAC
        // is vm-1's, as a control plane that searched for a collision
        // would make it (forged here: the file is keyed by id, the MAC is
        // computed).
        let a = Addresses::open(&path, small()).expect("open");
        a.allocate(&id("vm-1")).expect("ip");
        a.macs.lock().insert(Mac::underlay(&id("vm-2")), id("vm-1"));

        let err = a.allocate(&id("vm-2")).expect_err("collision");

        assert!(matches!(err, AddressError::MacCollision { .. }), "{err}");
        assert!(err.to_string().contains("vm-1"), "{err}");
    }

    #[test]
    fn a_vm_whose_second_nic_mac_is_anothers_underlay_mac_gets_no_address() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = Addresses::open(&dir.path().join("a.json"), small()).expect("open");
        a.allocate(&id("vm-1")).expect("ip");
        // As a searched-for id would make it.
        a.macs
            .lock()
            .insert(Mac::second_nic(&id("vm-2")), id("vm-1"));

        let err = a.allocate(&id("vm-2")).expect_err("collision");

        assert!(
            err.to_string()
                .contains(&Mac::second_nic(&id("vm-2")).to_string()),
            "{err}"
        );
    }

    #[test]
    fn entries_keyed_by_mac_from_an_older_format_free_their_slots() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.json");
        std::fs::write(&path, br#"{"02:aa:00:00:00:01":"192.0.2.2"}"#).expect("write");

        let a = Addresses::open(&path, small()).expect("open");
        let ips: Vec<Ipv4Addr> = (0..5)
            .map(|n| a.allocate(&id(&format!("vm-{n}"))).expect("room"))
            .collect();

        assert!(ips.contains(&Ipv4Addr::new(192, 0, 2, 2)), "{ips:?}");
    }

    #[test]
    fn an_unreadable_map_hands_out_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.json");
        std::fs::write(&path, b"{not json").expect("write");

        let err = Addresses::open(&path, small()).err().expect("refused");

        assert!(err.to_string().contains("unreadable"), "{err}");
    }

    #[test]
    fn subnets_with_host_bits_are_refused() {
        let err = Subnet::parse("10.0.0.5/24").expect_err("host bits");

        assert!(
            err.to_string().contains("did you mean 10.0.0.0/24?"),
            "{err}"
        );
    }
}
