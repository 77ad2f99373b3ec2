//! Scale to zero on cloud-hypervisor: a suspended VM's taps held open by
//! the agent, with no VMM behind them.
//!
//! A tap is not persistent (see `tap`): it dies with the VMM that holds
//! it. Once a suspend has stopped the VMM, [`Wake::listen`] opens the VM's
//! taps again and joins them to the host's networks as a boot does: the
//! bridge forwards to a tap that has an fd open (its carrier is up), and
//! the kernel queues what it forwards there, up to the tap's queue, for
//! whoever reads it next. The agent never reads it: it polls a copy of the
//! fd, and the resume hands the held taps to the restored VMM (through the
//! same path a boot's taps take), which reads the frames that waited (a
//! client's first SYN among them: the host knows each guest's MAC for
//! good, see `netlink::set_neighbour`, so it never waits on an ARP).
//!
//! What the agent holds dies with it: after a restart, the next pass of a
//! sleeping VM listens again on taps made afresh (a frame in between is
//! lost, and its sender's retransmit is the one that wakes the guest).
//!
//! Who woke it is told by a packet socket on its underlay tap that sees
//! only the heads of IPv4 and ARP frames sent to the guest
//! ([`TapWitness`]): opened with the listening, read only once a frame
//! woke it, and gone when the engine has heard enough.

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Duration;

use super::error::CloudHvError;
use super::{CloudHypervisor, tap};
use crate::deadline::Deadline;
use crate::error::{BoxFailure, Outcome};
use crate::model::{Id, Mac, VmSpec};
use crate::net::packet::{self, PacketSocket};
use crate::provision::{Listening, Wake, Witness};

/// The taps of sleeping VMs, held by the agent until their resume.
pub(super) type Held = parking_lot::Mutex<HashMap<Id, Vec<(OwnedFd, Mac)>>>;

/// How long a tap whose last fd just closed may take to go.
const TAP_SETTLE: Duration = Duration::from_secs(2);

/// Waits (within [`TAP_SETTLE`]) for the tap `name` to be gone, as the
/// kernel unregisters a tap a moment after its last fd closes; returns
/// whether it is.
pub(super) fn settled(name: &str) -> bool {
    let settle = Deadline::after(TAP_SETTLE);
    while tap::exists(name) && !settle.expired() {
        std::thread::sleep(Duration::from_millis(5));
    }
    !tap::exists(name)
}

impl CloudHypervisor {
    /// The VM's taps for a VMM about to start, and whether they are joined
    /// to the host's networks already: those held while it slept, with
    /// what waited on them (their sleep's filter still on: see
    /// [`CloudHypervisor::awake`]), or new ones.
    pub(super) fn taps_for_start(
        &self,
        spec: &VmSpec,
    ) -> Result<(Vec<(OwnedFd, Mac)>, bool), BoxFailure> {
        match self.listening.lock().remove(&spec.vm_id) {
            Some(held) => Ok((held, true)),
            None => self.open_nics(spec).map(|taps| (taps, false)),
        }
    }

    /// Its underlay tap passes whatever the bridge sends it again. Done
    /// beside a woken VM's start: until then the filter passes all that is
    /// for the guest, so nothing for it waits on this.
    pub(super) fn awake(&self, vm_id: &Id) -> Outcome {
        match &self.cfg.network {
            Some(network) => network.set_asleep(vm_id, false),
            None => Ok(()),
        }
    }

    fn dup_all(vm_id: &Id, held: &[(OwnedFd, Mac)]) -> Outcome<Vec<OwnedFd>> {
        held.iter()
            .map(|(fd, _)| {
                fd.try_clone().map_err(|source| {
                    CloudHvError::OpenTap {
                        vm_id: vm_id.clone(),
                        tap: "(a copy of its tap's fd)".into(),
                        source,
                    }
                    .into()
                })
            })
            .collect()
    }
}

/// The frames a sleeping VM's underlay tap passes to its guest, as a
/// packet socket copies their heads (see [`PacketSocket::open_to_guest_heads`]).
struct TapWitness(PacketSocket);

/// The most frames one look at a witness reads: a flood of them costs the
/// sleepers' thread no more.
const HEARD_AT_ONCE: usize = 16;

impl TapWitness {
    /// A witness on `nic`, or `None`, logged, when it cannot be opened:
    /// the VM still wakes, its row only cannot say who woke it.
    fn on(vm_id: &Id, nic: &str) -> Option<Box<dyn Witness>> {
        match PacketSocket::open_to_guest_heads(nic) {
            Ok(socket) => Some(Box::new(TapWitness(socket))),
            Err(e) => {
                log::warn!("VM {vm_id}: cannot watch who wakes it on {nic}: {e}");
                None
            }
        }
    }
}

impl Witness for TapWitness {
    fn fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }

    fn heard(&self) -> Vec<String> {
        let mut buf = [0u8; 128];
        let mut heard = Vec::new();
        for _ in 0..HEARD_AT_ONCE {
            let Ok(Some(n)) = self.0.recv_now(&mut buf) else {
                break;
            };
            heard.extend(packet::describe(&buf[..n]));
        }
        heard
    }
}

impl Wake for CloudHypervisor {
    fn listen(&self, spec: &VmSpec) -> Outcome<Listening> {
        let vm_id = &spec.vm_id;
        let witness = || {
            self.taps(vm_id)
                .and_then(|t| TapWitness::on(vm_id, &t.underlay))
        };
        let mut listening = self.listening.lock();
        if let Some(held) = listening.get(vm_id) {
            return Ok(Listening {
                ready: Self::dup_all(vm_id, &held[..1.min(held.len())])?,
                witness: witness(),
            });
        }
        if self.find(vm_id).is_some() {
            return Err(CloudHvError::Suspension {
                vm_id: vm_id.clone(),
                doing: "hold its taps to wake it on traffic",
                why: "its hypervisor runs".into(),
            }
            .into());
        }
        if self.cfg.network.is_none() {
            return Err(CloudHvError::Suspension {
                vm_id: vm_id.clone(),
                doing: "wake it on traffic",
                why: "this host's networking is off, so no traffic can reach it; run the agent with a bridge".into(),
            }
            .into());
        }
        // The taps its stopped VMM held go a moment after it: new ones of
        // the same names are made once they have.
        if let Some(taps) = self.taps(vm_id) {
            for name in [taps.underlay, taps.site] {
                settled(&name);
            }
        }
        // Passed only what is for its guest before it is up: nothing the
        // bridge floods waits on it to wake it for nothing.
        if let Some(network) = &self.cfg.network {
            network.set_asleep(vm_id, true)?;
        }
        let held = self.open_nics(spec)?;
        self.plug_nics(spec)?;
        let ready = Self::dup_all(vm_id, &held[..1.min(held.len())])?;
        listening.insert(vm_id.clone(), held);
        Ok(Listening {
            ready,
            witness: witness(),
        })
    }

    fn stop_listening(&self, vm_id: &Id) {
        if self.listening.lock().remove(vm_id).is_some()
            && let Err(e) = self.awake(vm_id)
        {
            log::warn!("VM {vm_id}: {}", crate::error::chain(&*e));
        }
    }

    /// Frames its guest sent of its own accord (see
    /// [`PacketSocket::open_guest_activity`]): every conversation makes a
    /// guest answer, while what the bridge floods to every port (the
    /// host's ARP for another guest, its IPv6 router solicitations) would
    /// keep an idle guest awake for ever, and so would what its stack says
    /// for itself (its ARP for the host a few seconds after each exchange,
    /// its neighbour discovery).
    fn frames(&self, vm_id: &Id) -> Option<u64> {
        let taps = self.taps(vm_id)?;
        let mut counted = self.counted.lock();
        counted.prune();
        let mut frames = None;
        for name in [taps.underlay, taps.site] {
            if let Some(n) = counted.count(&name) {
                frames = Some(frames.unwrap_or(0u64).wrapping_add(n));
            }
        }
        frames
    }
}

/// How often the counters of taps gone (a VM stopped, destroyed, asleep)
/// are closed.
const PRUNE_EVERY: Duration = Duration::from_secs(10);

/// Each watched tap's count of its guest's own frames: a counter opened
/// the first time its VM's idle is asked, and again whenever its tap was
/// made again (a boot, a wake), so a count never spans two taps.
#[derive(Default)]
pub(super) struct Activity {
    taps: HashMap<String, TapCount>,
    pruned: Option<std::time::Instant>,
}

/// One tap's counter, and what it counted so far.
struct TapCount {
    ifindex: i32,
    counter: PacketSocket,
    total: u64,
}

pub(super) type Counted = parking_lot::Mutex<Activity>;

impl Activity {
    /// What the tap `name`'s guest sent of its own accord since its
    /// counter was opened; `None` while it has no tap.
    fn count(&mut self, name: &str) -> Option<u64> {
        let Ok(ifindex) = packet::ifindex(name) else {
            self.taps.remove(name);
            return None;
        };
        if self.taps.get(name).is_none_or(|t| t.ifindex != ifindex) {
            match PacketSocket::open_guest_activity(name) {
                Ok(counter) => {
                    let fresh = TapCount {
                        ifindex,
                        counter,
                        total: 0,
                    };
                    self.taps.insert(name.to_owned(), fresh);
                }
                Err(e) => {
                    log::debug!("tap {name}: cannot count its guest's frames: {e}");
                    self.taps.remove(name);
                    return None;
                }
            }
        }
        let tap = self.taps.get_mut(name)?;
        match tap.counter.take_count() {
            Ok(n) => tap.total = tap.total.wrapping_add(n),
            Err(e) => {
                log::debug!("tap {name}: cannot read its guest's frame count: {e}");
                self.taps.remove(name);
                return None;
            }
        }
        Some(tap.total)
    }

    /// Closes the counters of taps that are gone or were made again.
    fn prune(&mut self) {
        if self.pruned.is_some_and(|at| at.elapsed() < PRUNE_EVERY) {
            return;
        }
        self.pruned = Some(std::time::Instant::now());
        self.taps
            .retain(|name, t| packet::ifindex(name).is_ok_and(|i| i == t.ifindex));
    }
}
