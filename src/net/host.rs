//! A host's guest networking, as the backend uses it: at boot a VM gets its
//! address (allocated and saved first), its tap becomes an isolated bridge
//! port, and a DHCP responder on that tap tells the guest the address. The
//! address is kept while the VM exists, stopped or not, and released at
//! destroy.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::Path;

use parking_lot::Mutex;

use super::addresses::{AddressError, Addresses};
use super::dhcp::{Lease, Responder};
use super::underlay::{Underlay, UnderlayConfig};
use crate::error::{BoxFailure, Simple};
use crate::model::Id;

pub struct HostNetwork {
    underlay: Underlay,
    addresses: Addresses,
    dns: Vec<Ipv4Addr>,
    lease_secs: u32,
    responders: Mutex<HashMap<Id, Responder>>,
}

impl HostNetwork {
    /// Brings the underlay up and loads the address map from `state_dir`.
    pub fn setup(
        cfg: UnderlayConfig,
        state_dir: &Path,
        dns: Vec<Ipv4Addr>,
    ) -> Result<HostNetwork, BoxFailure> {
        let addresses = Addresses::open(&state_dir.join("net/addresses.json"), cfg.subnet)
            .map_err(|e: AddressError| -> BoxFailure { e.into() })?;
        let underlay = Underlay::setup(cfg).map_err(|e| -> BoxFailure { e.into() })?;
        Ok(HostNetwork {
            underlay,
            addresses,
            dns,
            lease_secs: 3600,
            responders: Mutex::new(HashMap::new()),
        })
    }

    /// Connects a VM's freshly opened tap: address, bridge port, responder.
    pub fn plug(&self, vm_id: &Id, tap: &str, mac: &str) -> Result<Ipv4Addr, BoxFailure> {
        let ip = self.addresses.allocate(vm_id, mac)?;
        self.underlay.attach(tap)?;
        let subnet = self.underlay.subnet();
        let lease = Lease {
            mac: parse_mac(mac).ok_or_else(|| -> BoxFailure {
                Simple::permanent(format!("{mac:?} is not a MAC address")).into()
            })?,
            ip,
            netmask: subnet.netmask(),
            gateway: subnet.gateway(),
            dns: self.dns.clone(),
            lease_secs: self.lease_secs,
        };
        let responder = Responder::start(tap, lease).map_err(|e| -> BoxFailure {
            Simple::transient(format!("cannot start the DHCP responder on {tap}: {e}")).into()
        })?;
        self.responders.lock().insert(vm_id.clone(), responder);
        Ok(ip)
    }

    pub fn address(&self, mac: &str) -> Option<Ipv4Addr> {
        self.addresses.get(mac)
    }

    /// Disconnects a destroyed VM and frees its address.
    pub fn release(&self, vm_id: &Id, mac: &str) -> Result<(), BoxFailure> {
        self.responders.lock().remove(vm_id);
        self.addresses.release(mac).map_err(Into::into)
    }
}

fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let bytes: Vec<u8> = text
        .split(':')
        .map(|h| u8::from_str_radix(h, 16).ok())
        .collect::<Option<_>>()?;
    bytes.try_into().ok()
}
