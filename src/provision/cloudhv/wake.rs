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

    /// Frames its guest sent: every conversation makes a guest answer,
    /// while what the bridge floods to every port (the host's ARP for
    /// another guest, its IPv6 router solicitations) would keep an idle
    /// guest awake for ever.
    fn frames(&self, vm_id: &Id) -> Option<u64> {
        let taps = self.taps(vm_id)?;
        let mut counted = self.counted.lock();
        if counted
            .as_ref()
            .is_none_or(|(at, _)| at.elapsed() >= COUNTED_FOR)
        {
            *counted = Some((std::time::Instant::now(), link_frames()));
        }
        let all = &counted.as_ref()?.1;
        let mut frames = None;
        for name in [taps.underlay, taps.site] {
            if let Some(n) = all.get(&name) {
                frames = Some(frames.unwrap_or(0u64).wrapping_add(*n));
            }
        }
        frames
    }

    fn frames_now(&self, vm_id: &Id) -> Option<u64> {
        let taps = self.taps(vm_id)?;
        let mut frames = None;
        for name in [taps.underlay, taps.site] {
            if let Ok(n) = crate::net::netlink::received_frames(&name) {
                // As the shared reading counts them (32 bits).
                let n = n & u64::from(u32::MAX);
                frames = Some(frames.unwrap_or(0u64).wrapping_add(n));
            }
        }
        frames
    }
}

/// How long one reading of every link's counters answers for: the idle
/// watch asks of each VM in turn, once a second.
const COUNTED_FOR: Duration = Duration::from_millis(500);

/// Every link's counters, as one reading.
pub(super) type Counted = parking_lot::Mutex<Option<(std::time::Instant, HashMap<String, u64>)>>;

/// Frames each link of this network namespace received: on a tap, the
/// frames its guest sent (the kernel's 32-bit counter: it wraps, which an
/// idle watch, asking only whether it moved, does not mind). Asked of the kernel, by netlink
/// under getifaddrs(3): /sys shows the namespace that mounted it.
fn link_frames() -> HashMap<String, u64> {
    use nix::libc;
    let mut all = HashMap::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a list freed by freeifaddrs,
    // called once below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return all;
    }
    let mut entry = list;
    while !entry.is_null() {
        // SAFETY: `entry` is a node of the list getifaddrs returned, valid
        // until freeifaddrs. For an AF_PACKET entry, ifa_data points at the
        // link's `struct rtnl_link_stats`, whose first two fields are its
        // received and sent packets (u32 each).
        unsafe {
            let e = &*entry;
            if !e.ifa_addr.is_null()
                && i32::from((*e.ifa_addr).sa_family) == libc::AF_PACKET
                && !e.ifa_data.is_null()
                && !e.ifa_name.is_null()
            {
                let stats = e.ifa_data.cast::<u32>();
                let frames = u64::from(stats.read_unaligned());
                let name = std::ffi::CStr::from_ptr(e.ifa_name)
                    .to_string_lossy()
                    .into_owned();
                all.insert(name, frames);
            }
            entry = e.ifa_next;
        }
    }
    // SAFETY: `list` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    all
}
