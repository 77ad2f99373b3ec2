//! Published ports: a port of the host forwarded to a guest's port on its
//! underlay address (nft DNAT, in the agent's own table; see
//! [`nft_ruleset`](super::rules::nft_ruleset) for the rules that read
//! the maps this fills).
//!
//! A host port is one VM's at a time: the VM that holds it keeps it, and
//! one that asks for it while another holds it is refused, naming the
//! holder. A port must come from the operator's range (`--publish-ports`).
//! While a VM holds a port the agent holds a socket bound to it, so no
//! host process can take it from under the guest, and one that had it
//! first refuses it to the VM (a host condition: the host's to fix). What
//! a VM holds is kept while it exists, running or not (its guest's address
//! is kept as long), and given back at its destroy.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::OwnedFd;

use crate::error::Failure;
use crate::model::{HostPort, Id, PortRange, Publish, Transport};

/// Why a port was not published for a VM: the first two are the entry's
/// to fix (permanent), the others the host's (a host condition: an
/// address may be added, a process may let its port go).
#[derive(Debug)]
pub enum Refusal {
    OutOfRange {
        port: HostPort,
        range: PortRange,
    },
    HeldBy {
        port: HostPort,
        other: Id,
    },
    InUse {
        port: HostPort,
        source: std::io::Error,
    },
    /// Its host address is none of this host's.
    NotHere {
        port: HostPort,
    },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::OutOfRange { port, range } if range.is_empty() => write!(
                f,
                "{port}: this host publishes no ports (its operator sets a range with --publish-ports)"
            ),
            Refusal::OutOfRange { port, range } => write!(
                f,
                "{port}: outside this host's range {range} (--publish-ports); pick a port in it"
            ),
            Refusal::HeldBy { port, other } => write!(
                f,
                "{port} is published for VM {other}; a host port is one VM's at a time"
            ),
            Refusal::NotHere { port } => write!(
                f,
                "{port}: its host_address is not an address of this host; name one of the host's, or none for every address"
            ),
            Refusal::InUse { port, source } => write!(
                f,
                "{port} is in use on this host ({source}): a host process holds it; stop it, or pick another port"
            ),
        }
    }
}

/// The ports of a VM's entry that are not published, each with why (the
/// rest are).
#[derive(Debug)]
pub struct PublishError {
    pub vm_id: Id,
    pub refused: Vec<Refusal>,
}

impl std::fmt::Display for PublishError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let said: Vec<String> = self.refused.iter().map(Refusal::to_string).collect();
        write!(f, "not published: {}", said.join("; "))
    }
}

impl std::error::Error for PublishError {}

impl Failure for PublishError {
    /// A port outside the range or another VM's stays so until the entry
    /// changes.
    fn is_permanent(&self) -> bool {
        self.refused
            .iter()
            .any(|r| matches!(r, Refusal::OutOfRange { .. } | Refusal::HeldBy { .. }))
    }

    /// A host process on the port, or an address the host lacks, is the
    /// host's to fix.
    fn is_host_condition(&self) -> bool {
        !self.is_permanent()
    }
}

/// One port a VM holds: what it forwards, and the socket that keeps the
/// host port from host processes.
struct Held {
    publish: Publish,
    _reserved: OwnedFd,
}

/// What a VM holds, and what the ruleset forwards for it now.
#[derive(Default)]
struct VmPorts {
    held: Vec<Held>,
    /// The guest address the ruleset's elements name, and what they say.
    applied: Option<(Ipv4Addr, Vec<Publish>)>,
}

impl VmPorts {
    fn publishes(&self) -> Vec<Publish> {
        self.held.iter().map(|h| h.publish).collect()
    }
}

/// Every VM's published ports on this host.
pub struct Ports {
    range: PortRange,
    by_vm: HashMap<Id, VmPorts>,
}

/// What the ruleset must change for a VM: its elements from `old` at its
/// old address to `new` at its address now.
pub struct Change {
    pub old: Option<(Ipv4Addr, Vec<Publish>)>,
    pub new: Option<(Ipv4Addr, Vec<Publish>)>,
}

impl Ports {
    pub fn new(range: PortRange) -> Ports {
        Ports {
            range,
            by_vm: HashMap::new(),
        }
    }

    /// Makes `wanted` what the VM holds, as far as the host lets it: each
    /// port it holds already is kept, each new one taken if the range has
    /// it, no other VM holds it and no host process does. What it no
    /// longer wants is given back. The refusals, if any, are the error;
    /// what changes in the ruleset for the guest at `address` is returned
    /// either way (see [`Ports::applied`]).
    pub fn set(
        &mut self,
        vm_id: &Id,
        wanted: &[Publish],
        address: Option<Ipv4Addr>,
    ) -> (Change, Result<(), PublishError>) {
        let mut refused = Vec::new();
        let mut mine = self.by_vm.remove(vm_id).unwrap_or_default();
        let mut kept: Vec<Held> = Vec::with_capacity(wanted.len());
        for publish in wanted {
            let port = publish.host_side();
            if let Some(at) = mine.held.iter().position(|h| h.publish.host_side() == port) {
                let mut held = mine.held.swap_remove(at);
                held.publish = *publish;
                kept.push(held);
                continue;
            }
            match self.take(port) {
                Ok(reserved) => kept.push(Held {
                    publish: *publish,
                    _reserved: reserved,
                }),
                Err(why) => refused.push(why),
            }
        }
        // What is left of `mine.held` is no longer wanted: its sockets
        // close as it drops.
        mine.held = kept;
        let change = Change {
            old: mine.applied.clone(),
            new: address.map(|ip| (ip, mine.publishes())),
        };
        if !mine.held.is_empty() || mine.applied.is_some() {
            self.by_vm.insert(vm_id.clone(), mine);
        }
        let result = if refused.is_empty() {
            Ok(())
        } else {
            Err(PublishError {
                vm_id: vm_id.clone(),
                refused,
            })
        };
        (change, result)
    }

    /// Records that the ruleset now says `now` for the VM.
    pub fn applied(&mut self, vm_id: &Id, now: Option<(Ipv4Addr, Vec<Publish>)>) {
        match self.by_vm.get_mut(vm_id) {
            Some(mine) => {
                mine.applied = now.filter(|(_, list)| !list.is_empty());
                if mine.held.is_empty() && mine.applied.is_none() {
                    self.by_vm.remove(vm_id);
                }
            }
            None if now.as_ref().is_some_and(|(_, list)| !list.is_empty()) => {
                self.by_vm.insert(
                    vm_id.clone(),
                    VmPorts {
                        held: Vec::new(),
                        applied: now,
                    },
                );
            }
            None => {}
        }
    }

    /// What the VM's guest at `address` is forwarded now, to move the
    /// ruleset to (the plug of a VM whose address is new, or the same).
    pub fn at(&self, vm_id: &Id, address: Ipv4Addr) -> Change {
        let mine = self.by_vm.get(vm_id);
        Change {
            old: mine.and_then(|m| m.applied.clone()),
            new: Some((address, mine.map(VmPorts::publishes).unwrap_or_default())),
        }
    }

    /// The ruleset change that forwards nothing to the VM any more: made
    /// before [`Ports::forget`] gives its ports back.
    pub fn release(&self, vm_id: &Id) -> Change {
        Change {
            old: self.by_vm.get(vm_id).and_then(|m| m.applied.clone()),
            new: None,
        }
    }

    /// Gives back every port the VM holds (its sockets close).
    pub fn forget(&mut self, vm_id: &Id) {
        self.by_vm.remove(vm_id);
    }

    /// Whether the VM holds any port.
    pub fn holds_any(&self, vm_id: &Id) -> bool {
        self.by_vm.get(vm_id).is_some_and(|m| !m.held.is_empty())
    }

    /// The ports the VM holds.
    pub fn held(&self, vm_id: &Id) -> Vec<Publish> {
        self.by_vm
            .get(vm_id)
            .map(VmPorts::publishes)
            .unwrap_or_default()
    }

    /// The ports the ruleset forwards to the VM now.
    pub fn in_force(&self, vm_id: &Id) -> Vec<Publish> {
        self.by_vm
            .get(vm_id)
            .and_then(|m| m.applied.as_ref())
            .map(|(_, list)| list.clone())
            .unwrap_or_default()
    }

    /// Takes a host port no VM holds, within the range, that no host
    /// process holds: a socket bound to it, held while the VM holds it.
    fn take(&self, port: HostPort) -> Result<OwnedFd, Refusal> {
        if !self.range.contains(port.port) {
            return Err(Refusal::OutOfRange {
                port,
                range: self.range,
            });
        }
        let holder = self.by_vm.iter().find(|(_, mine)| {
            mine.held
                .iter()
                .any(|h| h.publish.host_side().overlaps(&port))
        });
        if let Some((other, _)) = holder {
            return Err(Refusal::HeldBy {
                port,
                other: other.clone(),
            });
        }
        reserve(port).map_err(|source| {
            if source.raw_os_error() == Some(nix::libc::EADDRNOTAVAIL) {
                Refusal::NotHere { port }
            } else {
                Refusal::InUse { port, source }
            }
        })
    }
}

/// A socket bound to the host port, never listening: no host process can
/// bind the port while it is open, and it answers nothing itself (what
/// arrives for the port is forwarded before any socket could see it).
fn reserve(port: HostPort) -> std::io::Result<OwnedFd> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, bind, socket};
    let kind = match port.transport {
        Transport::Tcp => SockType::Stream,
        Transport::Udp => SockType::Datagram,
    };
    let fd = socket(AddressFamily::Inet, kind, SockFlag::SOCK_CLOEXEC, None)?;
    let address = SocketAddrV4::new(port.address.unwrap_or(Ipv4Addr::UNSPECIFIED), port.port);
    bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrIn::from(address),
    )?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> Id {
        Id::parse(s).expect("id")
    }

    /// A free port of loopback's range for this test to publish: bound
    /// once and let go, so the host has it free.
    fn free_port() -> u16 {
        std::net::TcpListener::bind("0.0.0.0:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port")
    }

    fn ports_around(port: u16) -> Ports {
        Ports::new(PortRange::new(port, port.saturating_add(1)).expect("range"))
    }

    #[test]
    fn a_port_held_by_one_vm_is_refused_to_another_naming_it_and_the_first_keeps_it() {
        let port = free_port();
        let mut ports = ports_around(port);
        let guest = Some(Ipv4Addr::new(10, 0, 0, 2));
        let (_, first) = ports.set(&id("vm-a"), &[Publish::tcp(port, 80)], guest);

        let (change, second) = ports.set(&id("vm-b"), &[Publish::tcp(port, 8080)], guest);

        assert!(first.is_ok());
        let e = second.expect_err("refused");
        assert!(e.is_permanent());
        assert!(e.to_string().contains("published for VM vm-a"), "{e}");
        assert_eq!(change.new.map(|(_, l)| l), Some(vec![]));
        ports.applied(
            &id("vm-a"),
            Some((Ipv4Addr::new(10, 0, 0, 2), vec![Publish::tcp(port, 80)])),
        );
        assert_eq!(ports.in_force(&id("vm-a")), [Publish::tcp(port, 80)]);
    }

    #[test]
    fn a_port_outside_the_range_is_refused_saying_the_range() {
        let mut ports = Ports::new(PortRange::new(30000, 30010).expect("range"));

        let (_, result) = ports.set(&id("vm-a"), &[Publish::tcp(8080, 80)], None);

        let e = result.expect_err("refused");
        assert!(e.to_string().contains("30000-30010"), "{e}");
        assert!(e.is_permanent());
    }

    #[test]
    fn a_port_a_host_process_holds_is_a_host_condition() {
        let listener = std::net::TcpListener::bind("0.0.0.0:0").expect("listen");
        let port = listener.local_addr().expect("addr").port();
        let mut ports = ports_around(port);

        let (_, result) = ports.set(&id("vm-a"), &[Publish::tcp(port, 80)], None);

        let e = result.expect_err("refused");
        assert!(e.is_host_condition() && !e.is_permanent(), "{e}");
        assert!(e.to_string().contains("host process"), "{e}");
    }

    #[test]
    fn a_port_on_an_address_the_host_lacks_is_refused_saying_so() {
        let port = free_port();
        let mut ports = ports_around(port);
        let elsewhere = Publish {
            host_address: Some(Ipv4Addr::new(192, 0, 2, 77)),
            ..Publish::tcp(port, 80)
        };

        let (_, result) = ports.set(&id("vm-a"), &[elsewhere], None);

        let e = result.expect_err("refused");
        assert!(e.to_string().contains("not an address of this host"), "{e}");
        assert!(e.is_host_condition());
    }

    #[test]
    fn a_held_port_keeps_host_processes_off_it_until_given_back() {
        let port = free_port();
        let mut ports = ports_around(port);
        let (_, held) = ports.set(&id("vm-a"), &[Publish::tcp(port, 80)], None);

        let while_held = std::net::TcpListener::bind(("0.0.0.0", port));
        ports.forget(&id("vm-a"));
        let after = std::net::TcpListener::bind(("0.0.0.0", port));

        assert!(held.is_ok());
        assert!(while_held.is_err(), "a host process took a held port");
        assert!(after.is_ok(), "the port was not given back: {after:?}");
    }

    #[test]
    fn a_port_no_longer_wanted_is_given_back_and_its_element_removed() {
        let port = free_port();
        let mut ports = ports_around(port);
        let guest = Ipv4Addr::new(10, 0, 0, 2);
        let (change, _) = ports.set(&id("vm-a"), &[Publish::tcp(port, 80)], Some(guest));
        ports.applied(&id("vm-a"), change.new);

        let (change, result) = ports.set(&id("vm-a"), &[], Some(guest));

        assert!(result.is_ok());
        assert_eq!(change.old, Some((guest, vec![Publish::tcp(port, 80)])));
        assert_eq!(change.new, Some((guest, vec![])));
        assert!(std::net::TcpListener::bind(("0.0.0.0", port)).is_ok());
    }
}
