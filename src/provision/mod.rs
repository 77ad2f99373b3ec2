//! The hypervisor backend seam: one VM's whole lifecycle on this host,
//! networking included.
//!
//! Networking sits inside this seam rather than beside it because a VM's NIC
//! is not lifecycled apart from the VM: cloud-hypervisor takes its tap as a
//! launch argument and vfkit takes a virtio-net device, so on every backend
//! "attach the NIC" is a step of "start the VM". What generalises across
//! backends is data (the deterministic MAC, a VM's current address), which is
//! why addresses are polled through [`Lifecycle::address`] rather than
//! returned by [`Lifecycle::boot`].
//!
//! Every blocking method takes the pass's [`Deadline`] and must return by it
//! (a deadline error is never permanent: the engine refunds the attempt).

pub mod checklist;
#[cfg(target_os = "linux")]
pub mod cloudhv;
pub mod hugepages;
#[cfg(target_os = "linux")]
pub mod jail;
pub mod supervise;
mod suspend;
pub mod unix_http;
pub mod vfkit;

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::deadline::Deadline;
use crate::error::Outcome;
use crate::model::{Id, Saved, VmSpec};
use crate::state::atomic::Pending;

pub use suspend::Suspend;

/// Told what a long operation is doing now, for the VM's row.
pub type Say<'a> = &'a dyn Fn(&str);

/// Asked once by a resume, when the VM's saved guest is restored and held
/// still, right before it runs (see [`Suspend::resume`]). The engine's
/// `Ok` says the resume is recorded: the saved guest is spent from here.
/// Its `Err` ends the resume: the restore is undone, the saved guest kept,
/// and the error is the resume's.
pub type Spend<'a> = &'a dyn Fn() -> Outcome;

/// Told the id of a VM whose hypervisor process ended, for whatever reason.
/// Called from the backend's own threads: it must not block.
pub type ExitListener = Arc<dyn Fn(&Id) + Send + Sync>;

/// What every backend does: a VM's whole life on this host, from its
/// root disk to its destruction, and what the engine observes of it. What
/// only some backends can do is a capability of its own ([`Suspend`],
/// [`Holds`], [`HostChecks`], [`Wake`]), reached through
/// [`Lifecycle::suspender`], [`Lifecycle::holds`],
/// [`Lifecycle::host_checks`] and [`Lifecycle::waker`]: "this backend
/// cannot suspend" is a `None`, and a new capability widens no backend
/// that lacks it. The engine asks for a capability once where it needs
/// it, and says itself what a backend without it does.
pub trait Lifecycle: Send + Sync {
    /// Whether this backend can run a guest on this host at all.
    fn preflight(&self, deadline: Deadline) -> Outcome;

    /// Materialises the VM's root disk from a verified base image (clone and
    /// grow). Root disk only: the rebuild path calls create again, so routing
    /// a volume through here would destroy data meant to outlive the VM.
    /// In place when this returns, durable once the returned
    /// [`Pending`] is synced.
    fn prepare_root_disk(
        &self,
        spec: &VmSpec,
        base_image: &Path,
        deadline: Deadline,
    ) -> Outcome<Pending>;

    /// Takes what of the host the VM's boot will hold (its addresses,
    /// its VMM's user id), so the boot finds it taken: in place and its
    /// bytes durable when this returns, the rest of its durability (the
    /// names of what it wrote) in the returned [`Pending`], which the
    /// engine syncs beside the making of the root disk and always before
    /// the boot. A crash before that sync forgets a share no VMM ever
    /// used. Asked beside the save of the create's attempt, which it
    /// overlaps, so it must touch nothing but the backend's own
    /// bookkeeping; a backend that implements it gives back, in
    /// [`Lifecycle::recover`], what a VM with no record and no hypervisor
    /// holds (a crash came before the save). Idempotent; nothing by
    /// default.
    fn reserve(&self, _spec: &VmSpec) -> Outcome<Pending> {
        Ok(Pending::none())
    }

    /// Starts the VM and attaches it to the host network. Idempotent: a VM
    /// whose hypervisor is alive is never started twice.
    fn boot(&self, spec: &VmSpec, deadline: Deadline) -> Outcome;

    /// Stops the guest (politely first); the VM's files stay. `say` is told
    /// each stage as it starts ("stopping: waiting for the guest to power
    /// off, 12 s of 30"), for the VM's row: a polite stop can take minutes.
    fn shutdown(&self, vm_id: &Id, deadline: Deadline, say: Say<'_>) -> Outcome;

    /// Stops the VM and releases every host resource it holds: its process,
    /// its network attachment, its address reservation.
    fn destroy(&self, vm_id: &Id, deadline: Deadline) -> Outcome;

    /// Whether the VM's hypervisor is alive. Cheap: called on report paths.
    fn running(&self, vm_id: &Id) -> bool;

    /// The live hypervisor's pid, for `status`; `None` when it is not
    /// running or the backend cannot say.
    fn pid(&self, _vm_id: &Id) -> Option<u32> {
        None
    }

    /// What the hypervisor said before it stopped, or `None` when the
    /// backend has nothing to add. Asked when a guest that should run does
    /// not, so the report says why, not only that.
    fn failure_reason(&self, vm_id: &Id) -> Option<String>;

    /// The VM's address on the host underlay, `None` while unknown.
    fn address(&self, vm_id: &Id) -> Option<Ipv4Addr>;

    /// The address of the VM's second NIC on a named host network, `None`
    /// when it has none or it is not learned yet. Learned late: someone
    /// else's DHCP server grants it after boot.
    fn network_address(&self, vm_id: &Id) -> Option<Ipv4Addr>;

    /// Registers who to tell the moment a VM's hypervisor exits, so a guest
    /// that crashed is repaired at once instead of at the next tick. The
    /// engine registers itself once, at construction; it decides (by the
    /// same rules as a tick) whether the exit needs anything done, so a
    /// backend reports every exit, asked for or not. A backend that cannot
    /// tell leaves repair to the tick.
    fn watch_exits(&self, _listener: ExitListener) {}

    /// Takes over what a previous agent left on this host, once, at start,
    /// before the engine's first step (see `daemon::recover`): host
    /// resources no live hypervisor holds are removed; hypervisors still
    /// running are found (whatever their pidfiles say) and adopted if
    /// `known` (the VMs with a record or in the last desired state)
    /// explains them, their exits watched and their networks served again,
    /// so the first step restarts none; the rest are stopped. Returns what
    /// an operator should know (the orphans stopped).
    fn recover(&self, _known: &[Id]) -> Vec<String> {
        Vec::new()
    }

    /// Whether a hypervisor of this VM is alive and provably its own,
    /// whatever its files say; if so, it is tracked from now on. Asked
    /// before a create does anything: a VMM left running by a crash
    /// between its start and its record is adopted, never started twice,
    /// and its disk never replaced.
    fn adopt(&self, vm_id: &Id) -> bool {
        self.running(vm_id)
    }

    /// Suspend and resume, where this backend can: `None` says it cannot.
    fn suspender(&self) -> Option<&dyn Suspend> {
        None
    }

    /// The tenant's limits and egress rules held on the host, where this
    /// backend holds them.
    fn holds(&self) -> Option<&dyn Holds> {
        None
    }

    /// What the host lacks now, where this backend can tell.
    fn host_checks(&self) -> Option<&dyn HostChecks> {
        None
    }

    /// Waking a suspended VM on the first frame for its guest, where this
    /// backend can.
    fn waker(&self) -> Option<&dyn Wake> {
        None
    }

    /// The way to each VM's guest agent, where this backend gives its VMs
    /// a vsock device.
    fn guest_doors(&self) -> Option<&dyn GuestDoors> {
        None
    }

    /// What each running VM has used, where this backend can read it.
    fn meters(&self) -> Option<&dyn Meters> {
        None
    }
}

/// What a running VM has used since its hypervisor started, read at one
/// instant: running totals, each `None` where the backend could not read
/// it this time. Rates are the reader's business (two readings of one
/// process apart).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reading {
    /// Its hypervisor, and when that process started (clock ticks after
    /// boot): totals of two readings compare only within one process.
    pub pid: u32,
    pub started: u64,
    /// CPU time its VMM spent (nanoseconds).
    pub cpu_ns: Option<u64>,
    /// Memory its VMM holds resident (the guest's touched pages and the
    /// VMM's own).
    pub resident_bytes: Option<u64>,
    /// Its disks, summed, as its VMM counts the guest's requests.
    pub disk: Option<DiskCounts>,
    /// Its NICs, summed, from the guest's side: `rx` what the guest took
    /// in, `tx` what it sent.
    pub net: Option<NetCounts>,
    /// Who counted `net`.
    pub net_from: NetSource,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskCounts {
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_ops: u64,
    pub write_ops: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetCounts {
    pub rx_bytes: u64,
    pub tx_bytes: u64,
}

/// Who counted a VM's network bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NetSource {
    /// Its VMM (`vm.counters`).
    #[default]
    Vmm,
    /// The host kernel, on its taps: the VMM did not answer.
    Taps,
}

/// Reads what running VMs use (see [`Reading`]).
pub trait Meters: Send + Sync {
    /// The VM's totals now; `None` when no hypervisor of it runs. Bounded:
    /// a VMM that does not answer costs at most a fraction of a second,
    /// and its disk and NIC totals are then `None` (or the taps').
    fn read(&self, vm_id: &Id) -> Option<Reading>;
}

/// Where each VM's guest agent is reached (see [`crate::guest`]).
pub trait GuestDoors: Send + Sync {
    /// The VM's door now; `None` while no VMM of it runs.
    fn guest_door(&self, vm_id: &Id) -> Option<GuestDoor>;
}

/// A running VM's way in to its guest agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestDoor {
    /// Its VMM's vsock socket.
    pub socket: std::path::PathBuf,
    /// Its VMM, the one process that may be listening there.
    pub vmm_pid: u32,
}

/// Scale to zero: a suspended VM's NICs held open with no VMM behind
/// them, so what arrives for its guest waits there for the VMM that
/// resumes it (see [`Lifecycle::waker`]).
pub trait Wake: Send + Sync {
    /// Holds the NICs of the suspended VM open (opened and joined to the
    /// host's networks when they are not held yet; held already, they are
    /// kept) and returns what to poll. The next resume hands them to its
    /// VMM, which reads what waited.
    fn listen(&self, spec: &VmSpec) -> Outcome<Listening>;

    /// Lets go of what [`Wake::listen`] held: the VM is not to wake (its
    /// wake turned off, stopped, destroyed).
    fn stop_listening(&self, vm_id: &Id);

    /// How many frames the VM's guest sent on its NICs of its own accord
    /// (what its stack says for itself, ARP and the like, left out where
    /// the backend can), read now; `None` when it has none.
    fn frames(&self, vm_id: &Id) -> Option<u64>;
}

/// What a listening VM's wake is seen by.
pub struct Listening {
    /// Readable once a frame for the guest waits on its NIC: polled, never
    /// read (the frames are the guest's).
    pub ready: Vec<std::os::fd::OwnedFd>,
    /// What tells who sent the frames that woke it; `None` where the
    /// backend cannot tell.
    pub witness: Option<Box<dyn Witness>>,
}

/// Who woke a sleeping VM, as its backend sees the frames sent to its
/// guest: a copy of their heads, never the frames themselves (those wait
/// for the guest). Polled by the engine's sleepers' thread from the wake
/// on, for a moment.
pub trait Witness: Send + Sync {
    /// Readable when a frame waits to be told.
    fn fd(&self) -> std::os::fd::BorrowedFd<'_>;

    /// The frames waiting now, first the first, each in words (`tcp from
    /// 10.0.0.5:41234 to port 22`, `arp from 10.0.0.5`), without waiting;
    /// a frame it has no words for is passed over. Bounded: a flood of
    /// frames costs one call a bounded number of reads.
    fn heard(&self) -> Vec<String>;
}

/// Holding a tenant's own limits and egress rules on the host: a
/// capability of some backends (see [`Lifecycle::holds`]).
pub trait Holds: Send + Sync {
    /// Makes `egress` the VM's own egress rules (see
    /// [`Egress`](crate::model::Egress)): held within the call while the VM
    /// has its network, and from its next plug otherwise, before its guest
    /// sends anything; its hypervisor untouched. Cheap when unchanged:
    /// called on every pass. A backend that cannot hold them says so.
    fn set_egress(&self, vm_id: &Id, egress: &crate::model::Egress) -> Outcome;

    /// The VM's own egress rules held on the host now; `None` when none
    /// are (the host's policy alone).
    fn egress_in_force(&self, vm_id: &Id) -> Option<crate::model::Egress>;

    /// Makes `wanted` the VM's published ports, as far as the host lets it:
    /// each held within the call (forwarded while the VM has its network,
    /// from its next plug otherwise), its hypervisor untouched. The ports
    /// refused are the error (permanent: another VM holds one, or the
    /// host's range lacks it; a host condition: a host process holds
    /// one); the rest are held. Cheap when unchanged: called on every pass.
    fn set_published(&self, vm_id: &Id, wanted: &[crate::model::Publish]) -> Outcome;

    /// The ports the VM holds on the host now (forwarded or, before its
    /// network is plugged, kept for it).
    fn published(&self, vm_id: &Id) -> Vec<crate::model::Publish>;

    /// The limits a VM of `spec` runs with on this host (its own, else the
    /// host's defaults); `None` when this backend holds none.
    fn limits_in_force(&self, spec: &VmSpec) -> Option<crate::model::VmLimits>;

    /// Whether the running VM's network is served: its taps are there and
    /// plugged. A network that could not be served when the VM was
    /// adopted is tried again here. Called on every pass of a running VM:
    /// cheap when all is well.
    fn network_served(&self, _vm_id: &Id) -> Outcome {
        Ok(())
    }
}

/// Telling what the host lacks right now: a capability of some backends
/// (see [`Lifecycle::host_checks`]).
pub trait HostChecks: Send + Sync {
    /// What the host lacks right now (a host condition, see
    /// [`Failure`](crate::error::Failure)), for `status`: `None` when it
    /// can run guests. Cheap and bounded: asked with every report.
    fn host_condition(&self) -> Option<String>;
}

/// A suspended guest's saved state as the backend finds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SavedGuest {
    /// Whole, and taken with the disks the VM has now: a resume continues
    /// it.
    Usable(Saved),
    /// There, but it cannot be restored; why (torn, or taken with other
    /// disks). Never guessed at: the VM is booted from its disks.
    Unusable(String),
}

/// How guests boot on this host, and the network they join: built from
/// the settings by `config`, its sections shared (not copied) with the
/// backend that uses them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestBoot {
    /// `None` when guest networking is off.
    pub underlay: Option<crate::net::underlay::UnderlayConfig>,
    /// DNS servers told to guests; `None`: the host's own (the daemon
    /// reads them when it starts).
    pub guest_dns: Option<Vec<std::net::Ipv4Addr>>,
    /// Named host networks: name → site bridge.
    pub host_networks: HashMap<String, String>,
    pub tap_prefix: String,
    pub hypervisor: Arc<HypervisorSettings>,
    pub confinement: Arc<Confinement>,
    pub limits: Arc<GuestLimits>,
    /// `--guest-agent`, resolved: the static `eitri-guest` each new VM's
    /// seed carries; `None`: none (off, or none beside the agent).
    pub guest_agent: Option<std::path::PathBuf>,
}

/// The hypervisor section: what runs a guest, how it boots, and how long
/// each step of its stop may take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HypervisorSettings {
    /// The hypervisor binary (a path, or a name looked up in PATH).
    pub binary: PathBuf,
    pub kernel: Option<PathBuf>,
    pub firmware: Option<PathBuf>,
    pub cmdline: String,
    /// Where API sockets live: short, since a unix socket path is limited
    /// to 108 bytes whatever the state dir's length.
    pub run_dir: PathBuf,
    /// The power button's wait is `--stop-grace`; the rest are the agent's.
    pub stop: supervise::StopTimeouts,
    /// Guest memory on 2 MiB huge pages (see [`hugepages`]).
    pub hugepages: bool,
}

impl HypervisorSettings {
    /// `binary` booting `kernel` with no command line, its API sockets in
    /// `run_dir`, the default stop timeouts.
    pub fn new(binary: PathBuf, kernel: Option<PathBuf>, run_dir: PathBuf) -> HypervisorSettings {
        HypervisorSettings {
            binary,
            kernel,
            firmware: None,
            cmdline: String::new(),
            run_dir,
            stop: supervise::StopTimeouts::default(),
            hugepages: false,
        }
    }
}

/// The limits section's share of a guest: what a VM whose spec sets none
/// may use, and how much of its serial output is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestLimits {
    pub defaults: crate::model::LimitDefaults,
    /// Disk a guest's serial output may hold (see `cloudhv::serial`).
    pub serial_log_bytes: u64,
}

impl Default for GuestLimits {
    /// No limit but the serial log's, at `--serial-log-max-mb`'s default.
    fn default() -> GuestLimits {
        GuestLimits {
            defaults: crate::model::LimitDefaults::default(),
            serial_log_bytes: 16 << 20,
        }
    }
}

/// How much of a hypervisor's log a failure reason is taken from.
const REASON_BYTES: u64 = 2048;

/// The last lines of a hypervisor's log (at most its last 2 KiB), on one
/// line. The log is the hypervisor's, and a guest can make it write: what
/// reaches a report or a terminal has its control characters escaped.
pub fn log_tail(path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(REASON_BYTES)));
    let mut bytes = Vec::new();
    let _ = file.read_to_end(&mut bytes);
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    crate::quote::inline(&lines[lines.len().saturating_sub(3)..].join(" | "))
}

/// A piece of a VMM's confinement a host may lack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Piece {
    /// Its own user, no capabilities, no_new_privs, limits.
    Jail,
    /// Its own cgroup with memory, pids and cpu limits.
    Cgroups,
    /// Landlock, applied by the hypervisor to its own files.
    Landlock,
}

impl Piece {
    pub const ALL: [Piece; 3] = [Piece::Jail, Piece::Cgroups, Piece::Landlock];

    pub fn name(self) -> &'static str {
        match self {
            Piece::Jail => "jail",
            Piece::Cgroups => "cgroups",
            Piece::Landlock => "landlock",
        }
    }
}

/// How each VMM is confined: every piece, always, unless the host cannot
/// do it and the operator allowed running without it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confinement {
    /// VMM users and groups: `first_id` is the group that may open the KVM
    /// device; each VM's own id is one of the `id_count - 1` after it.
    pub first_id: u32,
    pub id_count: u32,
    /// The KVM device the jailed VMMs' group is given.
    pub kvm: PathBuf,
    /// The device a resuming VMM faults its guest's memory in through,
    /// given to the same group and seen only in a restoring VMM's view;
    /// `None`: a resume reads the whole snapshot before its guest runs.
    pub userfaultfd: Option<PathBuf>,
    /// The cgroup, in each hierarchy, under which each VM gets its own.
    pub cgroup_root: String,
    /// Pieces a VMM may run without where the host lacks them.
    pub allow_without: Vec<Piece>,
}

impl Confinement {
    /// The devices a VMM's group is given: the KVM device, and the
    /// userfaultfd device when there is one.
    pub fn devices(&self) -> Vec<PathBuf> {
        std::iter::once(self.kvm.clone())
            .chain(self.userfaultfd.clone())
            .collect()
    }
}

impl Default for Confinement {
    fn default() -> Confinement {
        Confinement {
            first_id: 1_900_000_000,
            id_count: 65_536,
            kvm: PathBuf::from("/dev/kvm"),
            userfaultfd: Some(PathBuf::from("/dev/userfaultfd")),
            cgroup_root: "eitri".into(),
            allow_without: Vec::new(),
        }
    }
}

/// What takes back what an ended claim left on this host: its VMM group's
/// entries on the devices' ACLs (`devices`, the ones this agent is told
/// of, and the usual ones, which the ended agent may have used) and its
/// cgroup roots.
#[cfg(target_os = "linux")]
pub fn reclaimer(devices: &[PathBuf]) -> jail::reclaim::HostReclaim {
    let mut devices: Vec<PathBuf> = jail::reclaim::DEVICES
        .iter()
        .map(PathBuf::from)
        .chain(devices.iter().cloned())
        .collect();
    devices.sort();
    devices.dedup();
    jail::reclaim::HostReclaim::on(devices)
}

/// What an ended claim left elsewhere: nothing (vfkit takes no device ACL
/// and no cgroup).
#[cfg(not(target_os = "linux"))]
pub fn reclaimer(_: &[PathBuf]) -> NothingLeft {
    NothingLeft
}

#[cfg(not(target_os = "linux"))]
pub struct NothingLeft;

#[cfg(not(target_os = "linux"))]
impl crate::state::claim::Reclaim for NothingLeft {
    fn take_back(&self, _: &crate::state::claim::Claim) -> crate::state::claim::Reclaimed {
        crate::state::claim::Reclaimed::default()
    }
}

/// The backend this host runs guests with: cloud-hypervisor on Linux.
#[cfg(target_os = "linux")]
pub fn for_host(
    store: std::sync::Arc<crate::state::Store>,
    guest: &GuestBoot,
    network: Option<std::sync::Arc<crate::net::host::HostNetwork>>,
) -> std::sync::Arc<dyn Lifecycle> {
    std::sync::Arc::new(cloudhv::CloudHypervisor::new(
        store,
        cloudhv::CloudHvConfig {
            hypervisor: Arc::clone(&guest.hypervisor),
            tap_prefix: guest.tap_prefix.clone(),
            boot_wait: std::time::Duration::from_secs(60),
            network,
            confinement: Arc::clone(&guest.confinement),
            limits: Arc::clone(&guest.limits),
        },
    ))
}

/// The backend this host runs guests with: vfkit elsewhere (macOS).
#[cfg(not(target_os = "linux"))]
pub fn for_host(
    store: std::sync::Arc<crate::state::Store>,
    guest: &GuestBoot,
) -> std::sync::Arc<dyn Lifecycle> {
    std::sync::Arc::new(vfkit::Vfkit::new(
        store,
        vfkit::VfkitConfig {
            hypervisor: Arc::clone(&guest.hypervisor),
            boot_wait: std::time::Duration::from_secs(60),
            leases: vfkit::leases::LEASE_FILE.into(),
        },
    ))
}
