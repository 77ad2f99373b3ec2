//! Desired state, in checked form.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::Id;

/// Whether `name` is an RFC 1123 hostname: dot-separated labels of 1-63
/// letters, digits and inner hyphens, 253 bytes at most. A hostname ends up
/// in YAML and /etc/hostname, so this is the whole check, not a hint.
pub fn is_hostname(name: &str) -> bool {
    name.len() <= 253
        && name.split('.').all(|l| {
            (1..=63).contains(&l.len())
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

/// Bounds on what one VM or volume may ask for. A request above them is a
/// typo or an attack, not a workload this agent will try to place.
pub struct Limits;

impl Limits {
    pub const MAX_VCPUS: u32 = 512;
    /// 16 TiB of guest memory, in MiB.
    pub const MAX_MEM_MB: u64 = 16 * 1024 * 1024;
    /// 64 TiB of disk, in GiB (root disks and volumes alike).
    pub const MAX_DISK_GB: u64 = 64 * 1024;
    /// URLs, keys and certificates are single lines of at most this many bytes.
    pub const MAX_LINE: usize = 16 * 1024;
    /// Tenant user-data travels in the seed image; cloud-init itself refuses
    /// far less, so this only stops a runaway control plane filling the disk.
    pub const MAX_USER_DATA: usize = 4 * 1024 * 1024;
    pub const MAX_USER_CA_KEYS: usize = 64;
    /// Volumes one VM may attach: each is a virtio-blk device of its own,
    /// and a guest's PCI bus has slots for about 30.
    pub const MAX_VOLUMES_PER_VM: usize = 32;
    /// Ranges in each of a VM's egress lists: elements of one nft set per
    /// list, each a lookup on the guest's packets.
    pub const MAX_EGRESS_RULES: usize = 64;
    /// Published ports a VM may have.
    pub const MAX_PUBLISHED_PORTS: usize = 32;
    /// A CPU cap under this is under the kernel's smallest quota (1 ms of
    /// each 100 ms period).
    pub const MIN_CPU_MAX_MILLIS: u64 = 10;
    /// 1 TB/s, 100 M operations/s, 1 Tbit/s: past any device; a larger
    /// number is a typo.
    pub const MAX_DISK_MBPS: u64 = 1_000_000;
    pub const MAX_DISK_IOPS: u64 = 100_000_000;
    pub const MAX_NET_MBPS: u64 = 1_000_000;
}

/// The part of a VM's desired state that defines *what the VM is*. It is
/// persisted in the VM's record; when it changes, the create budget resets.
/// Power state and certificate material are deliberately not in it: they
/// change what the VM is doing, not what it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmSpec {
    pub vm_id: Id,
    /// Guest hostname; empty = none asked for.
    pub name: String,
    pub image_url: String,
    /// Lowercase hex SHA-256 of the base image.
    pub image_sha256: String,
    pub cloud_init: String,
    pub ssh_authorized_key: String,
    /// Host network for the second NIC; empty = underlay only.
    pub network: String,
    pub volume_ids: Vec<Id>,
    pub vcpus: u32,
    pub mem_mb: u64,
    pub disk_gb: u64,
    /// What holds it back from its neighbours. A created VM's change is
    /// taken at its next cold boot (the record's spec says what it runs
    /// with); absent from records older than it: all zero, the host's.
    #[serde(default, skip_serializing_if = "VmLimits::is_hosts")]
    pub limits: VmLimits,
    /// The template it is a clone of: its root disk and memory are copied
    /// from that VM's snapshot at its create, instead of made from an
    /// image and booted. Its image fields are empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clone_of: Option<Id>,
}

#[cfg(test)]
impl VmSpec {
    /// A VM of `vcpus`, 100 MB and 1 GB of disk, with nothing else asked,
    /// for unit tests.
    pub(crate) fn for_tests(id: &str, vcpus: u32) -> VmSpec {
        VmSpec {
            vm_id: Id::parse(id).expect("a test's VM id"),
            name: String::new(),
            image_url: "file:///x".into(),
            image_sha256: "0".repeat(64),
            cloud_init: String::new(),
            ssh_authorized_key: String::new(),
            network: String::new(),
            volume_ids: vec![],
            vcpus,
            mem_mb: 100,
            disk_gb: 1,
            limits: VmLimits::default(),
            clone_of: None,
        }
    }
}

/// A VM's limits as its spec asks: each zero means the host's default
/// (its `--vm-…` flag), which may be none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default)]
pub struct VmLimits {
    /// Hard CPU cap, thousandths of a CPU (1500 = one and a half CPUs).
    pub cpu_max_millis: u32,
    /// CPU time, in ms per 100 ms, the VM may spend above its cap from
    /// what it left unused before.
    pub cpu_burst_ms: u32,
    /// Bytes a second (in MB, 10^6) across its root disk and volumes.
    pub disk_mbps: u32,
    /// I/O operations a second across its root disk and volumes.
    pub disk_iops: u32,
    /// Megabits a second, each way, on each NIC.
    pub net_mbps: u32,
}

impl VmLimits {
    /// Nothing asked for: the host's defaults throughout.
    pub fn is_hosts(&self) -> bool {
        *self == VmLimits::default()
    }

    /// The limits in force for a VM of `vcpus`: each the spec's, else the
    /// host's; 0 is none. A burst is held to its cap's quota of one
    /// period (the kernel refuses more) and is none without a cap.
    pub fn in_force(&self, vcpus: u32, host: &LimitDefaults) -> VmLimits {
        let pick = |own: u32, hosts: u32| if own != 0 { own } else { hosts };
        let cpu_max_millis = pick(
            self.cpu_max_millis,
            host.cpu_max_millis_per_vcpu.saturating_mul(vcpus),
        );
        VmLimits {
            cpu_max_millis,
            cpu_burst_ms: pick(self.cpu_burst_ms, host.cpu_burst_ms).min(cpu_max_millis / 10),
            disk_mbps: pick(self.disk_mbps, host.disk_mbps),
            disk_iops: pick(self.disk_iops, host.disk_iops),
            net_mbps: pick(self.net_mbps, host.net_mbps),
        }
    }
}

/// Limits in force, for people: "cpu 1.5 (burst 20 ms/100 ms), disk 200
/// MB/s, 5000 IOPS, net 1000 Mbit/s each way", or "none".
impl fmt::Display for VmLimits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if self.cpu_max_millis != 0 {
            let cpus = f64::from(self.cpu_max_millis) / 1000.0;
            parts.push(if self.cpu_burst_ms != 0 {
                format!("cpu {cpus} (burst {} ms/100 ms)", self.cpu_burst_ms)
            } else {
                format!("cpu {cpus}")
            });
        }
        let disk: Vec<String> = [(self.disk_mbps, "MB/s"), (self.disk_iops, "IOPS")]
            .iter()
            .filter(|(v, _)| *v != 0)
            .map(|(v, unit)| format!("{v} {unit}"))
            .collect();
        if !disk.is_empty() {
            parts.push(format!("disk {}", disk.join(", ")));
        }
        if self.net_mbps != 0 {
            parts.push(format!("net {} Mbit/s each way", self.net_mbps));
        }
        if parts.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// The host's limits for a VM whose spec sets none (its `--vm-…` flags);
/// 0 is none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitDefaults {
    /// Thousandths of a CPU per vCPU: 1000 holds each vCPU to one CPU.
    pub cpu_max_millis_per_vcpu: u32,
    pub cpu_burst_ms: u32,
    pub disk_mbps: u32,
    pub disk_iops: u32,
    pub net_mbps: u32,
}

/// Whether a VM should be (or is) running.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PowerState {
    Running,
    Stopped,
    /// Its guest's state saved on the host, ready to continue where it
    /// left off; no VMM runs for it.
    Suspended,
}

impl PowerState {
    /// The reference's wire string.
    pub fn as_wire(self) -> &'static str {
        match self {
            PowerState::Running => "running",
            PowerState::Stopped => "stopped",
            PowerState::Suspended => "suspended",
        }
    }

    pub fn from_wire(raw: &str) -> Option<PowerState> {
        match raw {
            "running" => Some(PowerState::Running),
            "stopped" => Some(PowerState::Stopped),
            "suspended" => Some(PowerState::Suspended),
            _ => None,
        }
    }

    /// What a backend's liveness answer means as a power state.
    pub fn observed(running: bool) -> PowerState {
        if running {
            PowerState::Running
        } else {
            PowerState::Stopped
        }
    }
}

/// Where a VM is in its life as the agent sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Not yet created; a create is in progress or will be retried.
    Creating,
    /// Created and at (or being driven to) its desired power state.
    Ready,
    /// Needs attention: the error says why. Terminal for a create whose
    /// budget is spent; otherwise the next tick tries again.
    Failed,
}

impl Phase {
    pub fn as_wire(self) -> &'static str {
        match self {
            Phase::Creating => "creating",
            Phase::Ready => "ready",
            Phase::Failed => "failed",
        }
    }

    pub fn from_wire(raw: &str) -> Option<Phase> {
        match raw {
            "creating" => Some(Phase::Creating),
            "ready" => Some(Phase::Ready),
            "failed" => Some(Phase::Failed),
            _ => None,
        }
    }
}

/// One VM the control plane wants on this host, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredVm {
    pub spec: VmSpec,
    pub power: PowerState,
    pub host_cert_required: bool,
    /// OpenSSH host certificate; empty until the control plane issues one.
    pub ssh_host_cert: String,
    pub ssh_user_ca_keys: Vec<String>,
    /// What the VM may reach through its NAT NIC. Not in [`VmSpec`]: like
    /// the power state it changes what the VM does, not what it is, and it
    /// applies to a running VM.
    pub egress: Egress,
    /// How the agent knows its guest is up; `None`: once its hypervisor
    /// runs. Not in [`VmSpec`] either: it applies to a running VM.
    pub readiness: Option<Readiness>,
    /// Ports of the host forwarded to the guest. Not in [`VmSpec`]: like
    /// the egress rules they apply to a running VM.
    pub published: Vec<super::Publish>,
    /// When it sleeps and what wakes it. Not in [`VmSpec`]: it applies to
    /// a running VM.
    pub sleep: Sleep,
    /// What is done when its guest's kernel panics. Not in [`VmSpec`]: it
    /// applies to a running VM.
    pub on_panic: OnPanic,
    /// Its snapshot is what clones are made from: it is wanted suspended,
    /// and never woken, while it is one. Not in [`VmSpec`]: it says what
    /// others may do with the VM, not what the VM is.
    pub template: bool,
}

/// What the agent does with a guest whose kernel panicked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OnPanic {
    /// Left as it is, for someone to look at: its row failed, saying why.
    #[default]
    Stay,
    /// Booted again from its disks.
    Reboot,
}

impl OnPanic {
    pub fn as_wire(self) -> &'static str {
        match self {
            OnPanic::Stay => "stay",
            OnPanic::Reboot => "reboot",
        }
    }
}

/// Scale to zero: a VM suspended with `wake_on_traffic` is woken by the
/// first frame for its guest; one idle for `idle_after` is suspended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Sleep {
    pub wake_on_traffic: bool,
    /// Suspended once its NICs carried no frame for this long; only with
    /// `wake_on_traffic` (a VM suspended for idleness wakes only on
    /// traffic).
    pub idle_after: Option<std::time::Duration>,
}

impl Sleep {
    /// How long a VM woken by traffic while wanted suspended runs idle
    /// before it sleeps again, when its entry names no idle time.
    pub const AWAKE_IDLE: std::time::Duration = std::time::Duration::from_secs(60);
    /// The longest idle time an entry may name.
    pub const MAX_IDLE: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);

    /// How long it runs idle before the agent suspends it, for a VM wanted
    /// `power` that traffic did (`woken`) or did not wake; `None`: never.
    pub fn idle_limit(&self, power: PowerState, woken: bool) -> Option<std::time::Duration> {
        if !self.wake_on_traffic {
            return None;
        }
        match power {
            PowerState::Running => self.idle_after,
            PowerState::Suspended if woken => Some(self.idle_after.unwrap_or(Self::AWAKE_IDLE)),
            PowerState::Suspended | PowerState::Stopped => None,
        }
    }
}

/// A readiness probe and its timing.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Readiness {
    pub check: Check,
    pub period: std::time::Duration,
    pub timeout: std::time::Duration,
    /// From a boot, how long the guest has to answer.
    pub grace: std::time::Duration,
    /// How long a probe may fail on end before the VM is booted again.
    pub restart_after: Option<std::time::Duration>,
}

/// What a probe asks.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Check {
    /// A console line containing the text.
    Serial(String),
    /// A TCP connection to the port of the guest's underlay address.
    Tcp(u16),
    /// An HTTP GET of the path on that port answering 2xx.
    Http { port: u16, path: String },
}

impl Check {
    /// Whether it asks the guest over its network (which makes the guest
    /// send frames), not its console.
    pub fn is_network(&self) -> bool {
        matches!(self, Check::Tcp(_) | Check::Http { .. })
    }
}

impl fmt::Display for Check {
    /// "tcp 22", "console line \"login:\"", as the row says it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Check::Serial(text) => write!(f, "console line {text:?}"),
            Check::Tcp(port) => write!(f, "tcp {port}"),
            Check::Http { port, path } => write!(f, "http {port} {path}"),
        }
    }
}

/// A VM's own egress rules: a destination in `deny` is dropped unless it
/// is also in `allow`. Both empty: the host's policy alone.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default)]
pub struct Egress {
    pub allow: Vec<super::Cidr>,
    pub deny: Vec<super::Cidr>,
}

impl Egress {
    /// No rules of the VM's own.
    pub fn is_open(&self) -> bool {
        self.allow.is_empty() && self.deny.is_empty()
    }
}

impl fmt::Display for Egress {
    /// "deny 0.0.0.0/0 except 10.1.0.0/16, 192.0.2.7/32", as `status` says it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |l: &[super::Cidr]| {
            l.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        match (self.deny.is_empty(), self.allow.is_empty()) {
            (true, true) => f.write_str("the host's policy alone"),
            (true, false) => write!(f, "allow {} (nothing denied)", list(&self.allow)),
            (false, true) => write!(f, "deny {}", list(&self.deny)),
            (false, false) => write!(f, "deny {} except {}", list(&self.deny), list(&self.allow)),
        }
    }
}

/// A VM entry of a snapshot: wanted, or deleted. A tombstone needs nothing
/// but its id, and is honoured even when the rest of its entry would not
/// pass validation: refusing to delete a VM because its deleted spec is odd
/// would keep a customer's guest running against their wish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WantedVm {
    /// Shared: a worker holds it for as long as its pass runs.
    Present(Arc<DesiredVm>),
    Tombstoned(Id),
}

impl WantedVm {
    pub fn id(&self) -> &Id {
        match self {
            WantedVm::Present(d) => &d.spec.vm_id,
            WantedVm::Tombstoned(id) => id,
        }
    }
}

/// One volume the control plane wants on this host, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeSpec {
    pub volume_id: Id,
    pub size_gb: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WantedVolume {
    Present(VolumeSpec),
    Tombstoned(Id),
}

impl WantedVolume {
    pub fn id(&self) -> &Id {
        match self {
            WantedVolume::Present(v) => &v.volume_id,
            WantedVolume::Tombstoned(id) => id,
        }
    }
}

/// An entry the agent refused to act on. When its id was valid the entry
/// still *claims* that id: the engine must neither create nor reap anything
/// under it, so a bad update to an existing VM leaves the VM alone instead
/// of reading as "vanished" and destroying it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejected {
    pub id: Option<Id>,
    /// The id as sent, for the report row.
    pub raw_id: String,
    pub error: SpecError,
}

/// A snapshot, checked. Valid entries are ready to act on; invalid ones are
/// kept apart with their reasons so they can be reported per VM.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub epoch: u64,
    pub min_agent_version: String,
    pub vms: Vec<WantedVm>,
    pub volumes: Vec<WantedVolume>,
    pub rejected_vms: Vec<Rejected>,
    pub rejected_volumes: Vec<Rejected>,
}

impl Snapshot {
    /// Adds entries a source refused before they could be converted (a
    /// desired-file entry of the wrong shape). An id such an entry claims
    /// is refused among the valid entries too, as an id sent twice is: the
    /// agent cannot tell which of the two was meant.
    pub fn refuse_more(&mut self, vms: Vec<Rejected>, volumes: Vec<Rejected>) {
        fn take<T>(
            valid: &mut Vec<T>,
            rejected: &mut Vec<Rejected>,
            refused: Vec<Rejected>,
            id_of: impl Fn(&T) -> &Id,
            field: &'static str,
        ) {
            for r in &refused {
                let Some(id) = &r.id else { continue };
                let before = valid.len();
                valid.retain(|v| id_of(v) != id);
                if valid.len() < before {
                    rejected.push(Rejected {
                        id: Some(id.clone()),
                        raw_id: id.to_string(),
                        error: SpecError::new(field, "the id appears twice in one snapshot"),
                    });
                }
            }
            rejected.extend(refused);
        }
        take(
            &mut self.vms,
            &mut self.rejected_vms,
            vms,
            WantedVm::id,
            "vm_id",
        );
        take(
            &mut self.volumes,
            &mut self.rejected_volumes,
            volumes,
            WantedVolume::id,
            "volume_id",
        );
    }
}

/// Why one field of one entry was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecError {
    pub field: &'static str,
    pub problem: String,
}

impl SpecError {
    pub fn new(field: &'static str, problem: impl Into<String>) -> SpecError {
        SpecError {
            field,
            problem: problem.into(),
        }
    }

    /// The same, with what the value means added to the problem.
    pub fn hint(mut self, meaning: &str) -> SpecError {
        self.problem = format!("{} ({meaning})", self.problem);
        self
    }
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid {}: {}; fix this entry of the desired state",
            self.field, self.problem
        )
    }
}

impl std::error::Error for SpecError {}
