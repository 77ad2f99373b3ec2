//! A host's guest networking, as the backend uses it: at boot a VM gets its
//! address (allocated and saved first) and, from it, its tap names; its tap
//! is guarded (see [`underlay`](super::underlay)) and becomes an isolated
//! bridge port, and a DHCP responder on that tap tells the guest the
//! address. The address is kept while the VM exists, stopped or not, and
//! released at destroy, with its guards.
//!
//! Tap names come from the address's place in the subnet (`<prefix><hex>`,
//! and `s` after it for the second NIC): two VMs never hold one address, so
//! they never share a name, however their ids were chosen. (A name hashed
//! from the id fits only 40 bits in 15 bytes, and a control plane can find
//! two ids that share one.)

use crate::state::Layout;
use crate::state::atomic::Pending;
use std::collections::HashMap;
use std::net::Ipv4Addr;

use parking_lot::Mutex;

use std::sync::Arc;

use super::addresses::{AddressError, Addresses};
use super::dhcp::{Lease, Responder};
use super::publish::{Change, Ports};
use super::snoop::{Learned, Snooper, Writer};
use super::underlay::{Port, Underlay, UnderlayConfig};
use crate::error::{BoxFailure, Failure, Outcome};
use crate::model::{Egress, Id, Mac, Publish};

/// What can go wrong plugging a VM into the host's networks, beyond the
/// address map (`AddressError`) and the underlay's commands (`NetError`).
#[derive(Debug)]
pub enum HostNetError {
    Responder {
        tap: String,
        source: std::io::Error,
    },
    Snoop {
        tap: String,
        source: std::io::Error,
    },
    Thread {
        what: &'static str,
        source: std::io::Error,
    },
    /// The spec's second NIC names a network this host does not serve.
    NotServed {
        network: String,
        served: Vec<String>,
    },
}

impl std::fmt::Display for HostNetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostNetError::Responder { tap, .. } => {
                write!(f, "cannot start the DHCP responder on {tap}")
            }
            HostNetError::Snoop { tap, .. } => write!(f, "cannot watch {tap}"),
            HostNetError::Thread { what, .. } => write!(f, "cannot start the {what} thread"),
            HostNetError::NotServed { network, served } => write!(
                f,
                "host network {network:?} is not served on this host (served: {}); add it with --host-network {network}=BRIDGE",
                if served.is_empty() {
                    "none".to_owned()
                } else {
                    served.join(", ")
                }
            ),
        }
    }
}

impl std::error::Error for HostNetError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HostNetError::Responder { source, .. }
            | HostNetError::Snoop { source, .. }
            | HostNetError::Thread { source, .. } => Some(source),
            HostNetError::NotServed { .. } => None,
        }
    }
}

impl Failure for HostNetError {
    /// A network this host does not serve stays unserved; the rest is a
    /// moment's trouble.
    fn is_permanent(&self) -> bool {
        matches!(self, HostNetError::NotServed { .. })
    }
}

/// A VM's tap names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Taps {
    pub underlay: String,
    /// The second NIC's, on a named host network.
    pub site: String,
}

/// A VM's own egress rules, wanted and held.
#[derive(Default)]
struct EgressHeld {
    wanted: Egress,
    /// The guest address they are keyed by, and the rules.
    applied: Option<(Ipv4Addr, Egress)>,
}

pub struct HostNetwork {
    /// Shared with each snooper, which rebinds its site tap's address.
    underlay: Arc<Underlay>,
    addresses: Addresses,
    dns: Vec<Ipv4Addr>,
    lease_secs: u32,
    responders: Mutex<HashMap<Id, Responder>>,
    /// Named host networks: name → the site bridge a second NIC joins.
    named: HashMap<String, String>,
    learned: Arc<Learned>,
    snoopers: Mutex<HashMap<Id, Snooper>>,
    /// Each VM's own egress rules: what is wanted, and what the ruleset
    /// holds for its address (none before its first plug). One lock, so
    /// two changes of one VM never interleave their transactions.
    egress: Mutex<HashMap<Id, EgressHeld>>,
    /// Each VM's published ports: what it holds, and what the ruleset
    /// forwards to its address. One lock, as for the egress rules.
    ports: Mutex<Ports>,
    /// Declared after the snoopers: dropped after them, it writes what
    /// they learned last.
    _writer: Writer,
}

impl HostNetwork {
    /// Brings the underlay up and loads the address map from the state dir
    /// `layout` describes.
    pub fn setup(
        cfg: UnderlayConfig,
        layout: &Layout,
        dns: Vec<Ipv4Addr>,
        named: HashMap<String, String>,
    ) -> Outcome<HostNetwork> {
        let addresses = Addresses::open(&layout.addresses(), cfg.subnet)
            .map_err(|e: AddressError| -> BoxFailure { e.into() })?;
        // Guests may always reach the DNS servers they are told.
        let mut cfg = cfg;
        cfg.egress.dns.clone_from(&dns);
        let ports = Ports::new(cfg.publish);
        let underlay = Underlay::setup(cfg).map_err(|e| -> BoxFailure { e.into() })?;
        let learned = Arc::new(Learned::open(&layout.learned()));
        let writer = Writer::start(Arc::clone(&learned)).map_err(|source| -> BoxFailure {
            HostNetError::Thread {
                what: "learned-writer",
                source,
            }
            .into()
        })?;
        Ok(HostNetwork {
            underlay: Arc::new(underlay),
            addresses,
            dns,
            lease_secs: 3600,
            responders: Mutex::new(HashMap::new()),
            named,
            learned,
            snoopers: Mutex::new(HashMap::new()),
            egress: Mutex::new(HashMap::new()),
            ports: Mutex::new(ports),
            _writer: writer,
        })
    }

    /// The VM's address (allocated and saved if it has none) and the names
    /// of its taps, which follow from it.
    pub fn reserve(&self, vm_id: &Id) -> Outcome<Taps> {
        let ip = self.addresses.allocate(vm_id)?;
        Ok(self.taps_of(ip))
    }

    /// The VM's address taken as by [`HostNetwork::reserve`], the address
    /// map's name durable once the returned [`Pending`] is synced: before
    /// the VM's boot hands the address to a guest.
    pub fn take_address(&self, vm_id: &Id) -> Outcome<Pending> {
        let (_, pending) = self.addresses.reserve(vm_id)?;
        Ok(pending)
    }

    /// The VMs holding an address.
    pub fn holders(&self) -> Vec<Id> {
        self.addresses.holders()
    }

    /// The names of the VM's taps, while it holds an address.
    pub fn taps(&self, vm_id: &Id) -> Option<Taps> {
        self.addresses.get(vm_id).map(|ip| self.taps_of(ip))
    }

    fn taps_of(&self, ip: Ipv4Addr) -> Taps {
        let underlay = format!("{}{:x}", self.tap_prefix(), self.addresses.offset(ip));
        Taps {
            site: format!("{underlay}s"),
            underlay,
        }
    }

    fn tap_prefix(&self) -> &str {
        &self.underlay.config().tap_prefix
    }

    /// Connects a VM's freshly opened underlay tap (named by [`reserve`]):
    /// guard, bridge port, responder.
    ///
    /// [`reserve`]: HostNetwork::reserve
    pub fn plug(&self, vm_id: &Id, mac: Mac) -> Outcome<Ipv4Addr> {
        let ip = crate::stages::timed("address", || self.addresses.allocate(vm_id))?;
        let tap = &self.taps_of(ip).underlay;
        // Before the tap is guarded, so before the guest sends a frame.
        self.hold_egress(vm_id, Some(ip))?;
        {
            let mut ports = self.ports.lock();
            let change = ports.at(vm_id, ip);
            self.forward(&mut ports, vm_id, change)?;
        }
        self.underlay.attach(&Port {
            tap,
            mac,
            ip: Some(ip),
        })?;
        // A VM that publishes ports leaves the kernel's isolation for the
        // bridge table's (see `Underlay::isolate`).
        if self.ports.lock().holds_any(vm_id) {
            self.underlay.isolate(tap, false)?;
        }
        let subnet = self.underlay.subnet();
        let lease = Lease {
            mac: mac.octets(),
            ip,
            netmask: subnet.netmask(),
            gateway: subnet.gateway(),
            dns: self.dns.clone(),
            lease_secs: self.lease_secs,
        };
        let responder = crate::stages::timed("dhcp responder", || Responder::start(tap, lease))
            .map_err(|source| HostNetError::Responder {
                tap: tap.to_owned(),
                source,
            })?;
        self.responders.lock().insert(vm_id.clone(), responder);
        Ok(ip)
    }

    /// Makes `egress` the VM's own egress rules: held at once while it has
    /// an address, else from its plug, before its guest sends anything.
    /// Its hypervisor is not involved.
    pub fn set_egress(&self, vm_id: &Id, egress: &Egress) -> Outcome {
        {
            let mut all = self.egress.lock();
            let held = all.entry(vm_id.clone()).or_default();
            if held.wanted == *egress && held.applied.as_ref().is_some_and(|(_, a)| a == egress) {
                return Ok(());
            }
            held.wanted = egress.clone();
        }
        self.hold_egress(vm_id, self.addresses.get(vm_id))
    }

    /// Whether the VM sleeps: its underlay tap then passes only what is
    /// for its guest (see [`Underlay::sleep`]).
    pub fn set_asleep(&self, vm_id: &Id, on: bool) -> Outcome {
        let Some(ip) = self.addresses.get(vm_id) else {
            return Ok(());
        };
        self.underlay.sleep(&self.taps_of(ip).underlay, on)?;
        Ok(())
    }

    /// Makes `wanted` the VM's published ports, as far as the host lets
    /// it (see [`publish`](super::publish)): forwarded at once while it has
    /// an address, else from its plug. The ports refused are the error;
    /// the rest are held. Its hypervisor is not involved.
    pub fn set_published(&self, vm_id: &Id, wanted: &[Publish]) -> Outcome {
        let mut ports = self.ports.lock();
        let had = ports.holds_any(vm_id);
        // Every pass asks; a VM that publishes nothing costs a lookup.
        if !had && wanted.is_empty() {
            return Ok(());
        }
        let address = self.addresses.get(vm_id);
        let (change, held) = ports.set(vm_id, wanted, address);
        let has = ports.holds_any(vm_id);
        // Isolated again before the last port goes, and not before the
        // first is forwarded; a tap not there yet is made isolated and
        // loses it at its plug.
        let tap = address.map(|ip| self.taps_of(ip).underlay);
        if let Some(tap) = tap.as_deref().filter(|_| had && !has) {
            self.underlay.isolate(tap, true)?;
        }
        self.forward(&mut ports, vm_id, change)?;
        if let Some(tap) = tap.as_deref().filter(|t| !had && has && tap_exists(t)) {
            self.underlay.isolate(tap, false)?;
        }
        held.map_err(BoxFailure::from)
    }

    /// The ports the VM holds.
    pub fn published(&self, vm_id: &Id) -> Vec<Publish> {
        self.ports.lock().held(vm_id)
    }

    /// Moves the ruleset's published ports for the VM as `change` says,
    /// and notes what it says now.
    fn forward(&self, ports: &mut Ports, vm_id: &Id, change: Change) -> Outcome {
        if change.old == change.new {
            return Ok(());
        }
        self.underlay
            .publish(change.old.as_ref(), change.new.as_ref())?;
        ports.applied(vm_id, change.new);
        Ok(())
    }

    /// The VM's own egress rules in the ruleset now, when it has any there.
    pub fn egress_in_force(&self, vm_id: &Id) -> Option<Egress> {
        let all = self.egress.lock();
        all.get(vm_id)?.applied.as_ref().map(|(_, e)| e.clone())
    }

    /// Moves the ruleset's elements for the VM from what it holds to what
    /// is wanted, for the guest at `ip` (none: nothing can be held yet).
    fn hold_egress(&self, vm_id: &Id, ip: Option<Ipv4Addr>) -> Outcome {
        let Some(ip) = ip else {
            return Ok(());
        };
        let mut all = self.egress.lock();
        let held = all.entry(vm_id.clone()).or_default();
        let none = Egress::default();
        let was = match &held.applied {
            Some((at, e)) if *at == ip => e,
            _ => &none,
        };
        self.underlay.set_egress(ip, was, &held.wanted)?;
        held.applied = Some((ip, held.wanted.clone()));
        Ok(())
    }

    /// Whether a DHCP responder is serving this VM.
    pub fn serves_dhcp(&self, vm_id: &Id) -> bool {
        self.responders.lock().contains_key(vm_id)
    }

    pub fn address(&self, vm_id: &Id) -> Option<Ipv4Addr> {
        self.addresses.get(vm_id)
    }

    /// Connects a VM's second tap to the named host network's bridge,
    /// guarded to its MAC, and starts learning the address the site's DHCP
    /// server grants it.
    pub fn plug_named(&self, vm_id: &Id, network: &str, tap: &str, mac: Mac) -> Outcome {
        let Some(bridge) = self.named.get(network) else {
            let mut served: Vec<String> = self.named.keys().cloned().collect();
            served.sort_unstable();
            return Err(HostNetError::NotServed {
                network: network.to_owned(),
                served,
            }
            .into());
        };
        self.underlay.guard(&Port { tap, mac, ip: None })?;
        super::underlay::join(tap, bridge)?;
        let rebind: super::snoop::Rebind = {
            let (underlay, tap) = (Arc::clone(&self.underlay), tap.to_owned());
            Box::new(move |old, new| {
                // Failing closed: without its element the tap only asks.
                if let Err(e) = underlay.rebind(&tap, old, new) {
                    log::warn!(
                        "cannot let the site tap {tap} send from {new:?} (was {old:?}): {e}"
                    );
                }
            })
        };
        let snooper =
            Snooper::start(tap, mac, Arc::clone(&self.learned), rebind).map_err(|source| {
                HostNetError::Snoop {
                    tap: tap.to_owned(),
                    source,
                }
            })?;
        self.snoopers.lock().insert(vm_id.clone(), snooper);
        Ok(())
    }

    /// How guests reach beyond the host.
    pub fn nat(&self) -> super::underlay::Nat {
        self.underlay.nat()
    }

    /// Whether this start turned the host's IPv4 forwarding on.
    pub fn turned_on_forwarding(&self) -> bool {
        self.underlay.turned_on_forwarding()
    }

    /// Whether this host serves the named network.
    pub fn serves(&self, network: &str) -> bool {
        self.named.contains_key(network)
    }

    /// How many times the learned addresses have been written.
    pub fn learned_writes(&self) -> u64 {
        self.learned.writes()
    }

    /// The address learned for a second NIC's MAC, while its lease lasts.
    pub fn network_address(&self, mac: Mac) -> Option<Ipv4Addr> {
        self.learned.get(&mac.to_string())
    }

    /// Disconnects a destroyed VM: its guards deleted, its address freed,
    /// what was learned of its second NIC forgotten.
    pub fn release(&self, vm_id: &Id, second_mac: Mac) -> Outcome {
        self.responders.lock().remove(vm_id);
        // Stopped first, so nothing binds the address again after this.
        let snooper = self.snoopers.lock().remove(vm_id);
        let bound = snooper.and_then(Snooper::end);
        {
            let mut ports = self.ports.lock();
            let change = ports.release(vm_id);
            if ports.holds_any(vm_id)
                && let Some(ip) = self.addresses.get(vm_id)
            {
                self.underlay.isolate(&self.taps_of(ip).underlay, true)?;
            }
            self.forward(&mut ports, vm_id, change)?;
            ports.forget(vm_id);
        }
        {
            let mut all = self.egress.lock();
            if let Some((at, applied)) = all.get(vm_id).and_then(|h| h.applied.clone()) {
                self.underlay.set_egress(at, &applied, &Egress::default())?;
            }
            all.remove(vm_id);
        }
        if let Some(ip) = self.addresses.get(vm_id) {
            let taps = self.taps_of(ip);
            self.underlay.rebind(&taps.site, bound, None)?;
            self.underlay.unguard(&Port {
                tap: &taps.underlay,
                mac: Mac::underlay(vm_id),
                ip: Some(ip),
            })?;
            self.underlay.unguard(&Port {
                tap: &taps.site,
                mac: second_mac,
                ip: None,
            })?;
        }
        self.learned.forget(&second_mac.to_string());
        self.addresses.release(vm_id).map_err(Into::into)
    }
}

/// Whether the link `name` is there (a stopped VM's tap is not).
fn tap_exists(name: &str) -> bool {
    super::packet::ifindex(name).is_ok()
}
