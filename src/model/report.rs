//! What the host has, as the engine reports it.

use std::sync::Arc;

use super::{Id, Phase, PowerState};

/// The host's report for one tick.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub last_seen_epoch: u64,
    /// Shared with the VM workers that published them: a step hands out
    /// ten thousand rows without copying one, and a step in which no row
    /// changed hands out the last step's list whole.
    pub vms: Rows,
    pub quarantined: Vec<QuarantinedVm>,
    pub destroyed: Vec<Id>,
    pub volumes: Vec<VolumeStatus>,
    pub fence_violation: bool,
}

/// A report's VM rows: a shared list, copied only when it is changed
/// while shared (see [`Rows::to_mut`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rows(Arc<Vec<Arc<VmStatus>>>);

impl Rows {
    pub fn push(&mut self, row: Arc<VmStatus>) {
        self.to_mut().push(row);
    }

    /// The list to change: this one's own, copied first if it is shared.
    pub fn to_mut(&mut self) -> &mut Vec<Arc<VmStatus>> {
        Arc::make_mut(&mut self.0)
    }

    /// Whether `self` and `other` are one list, not two equal ones.
    pub fn same_list(&self, other: &Rows) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::ops::Deref for Rows {
    type Target = [Arc<VmStatus>];

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl From<Vec<Arc<VmStatus>>> for Rows {
    fn from(rows: Vec<Arc<VmStatus>>) -> Rows {
        Rows(Arc::new(rows))
    }
}

impl IntoIterator for Rows {
    type Item = Arc<VmStatus>;
    type IntoIter = std::vec::IntoIter<Arc<VmStatus>>;

    fn into_iter(self) -> Self::IntoIter {
        Arc::unwrap_or_clone(self.0).into_iter()
    }
}

impl<'a> IntoIterator for &'a Rows {
    type Item = &'a Arc<VmStatus>;
    type IntoIter = std::slice::Iter<'a, Arc<VmStatus>>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// One VM's row.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VmStatus {
    /// The id as the control plane knows it. A string, not an [`Id`]: a VM
    /// whose id was refused is still reported under the id that was sent.
    pub vm_id: String,
    pub ip: String,
    pub network_ip: String,
    /// `None` = no observation was made (not "stopped").
    pub power: Option<PowerState>,
    pub phase: Option<Phase>,
    pub last_error: String,
    pub status_detail: String,
    pub ssh_host_pubkey: String,
    /// The VM's own egress rules held now, as words; empty when none.
    pub egress: String,
    /// The limits it runs with, as words; empty when the backend holds none.
    pub limits: String,
    /// Its readiness probe's state and last result, as words; without a
    /// probe, what its guest agent says of its readiness (see
    /// [`GUEST_AGENT_READY`], [`HYPERVISOR_ONLY`]); empty when it does not
    /// run.
    pub readiness: String,
    /// Why the VM's entry in desired state was refused, while the host has
    /// the VM and runs it on as it was; empty otherwise.
    pub spec_rejected: String,
    /// The ports published for it now.
    pub published: Vec<super::Publish>,
    /// Suspended and listening: its next frame wakes it.
    pub asleep: bool,
    /// Its last wake, as words; empty when traffic never woke it.
    pub last_wake: String,
    /// What its guest agent last said of the guest, as words; empty when
    /// none answered.
    pub guest: String,
    /// The guest's memory as its guest agent last said it; `None` when
    /// none said it.
    pub guest_memory: Option<GuestMemory>,
}

/// What a guest says of its own memory, in KiB: its word, not the host's
/// measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestMemory {
    pub total_kib: u64,
    pub available_kib: u64,
}

/// How a row's `readiness` ends while its probe answers ("tcp 22 answered").
pub const ANSWERED: &str = " answered";

/// A row's `readiness` while its guest agent says the guest is up (it has
/// no probe).
pub const GUEST_AGENT_READY: &str = "guest agent answered";

/// How a row's `readiness` begins when nothing but its hypervisor running
/// makes it ready: no probe, and no guest agent that said its system is up.
pub const HYPERVISOR_ONLY: &str = "the hypervisor runs; ";

/// How a row's error begins while its readiness probe fails past its
/// grace, or after it answered: the VM runs, and is not ready.
pub const UNHEALTHY: &str = "unhealthy: ";

impl VmStatus {
    /// Whether its readiness probe says the VM is unhealthy (see
    /// [`UNHEALTHY`]).
    pub fn unhealthy(&self) -> bool {
        is_unhealthy(&self.last_error)
    }
}

/// Whether a row's error `last_error` says its VM is unhealthy.
pub fn is_unhealthy(last_error: &str) -> bool {
    last_error.starts_with(UNHEALTHY)
}

/// A VM waiting out its grace before destruction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuarantinedVm {
    pub vm_id: Id,
    pub name: String,
    pub vmspec_json: Vec<u8>,
    pub destroy_at_unix: i64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VolumeState {
    /// The file exists at its desired size.
    Ready,
    /// The volume is not as desired; the row's error says why.
    Failed,
    /// Deleted by the control plane, kept until no VM record refers to it.
    Tombstoned,
}

impl VolumeState {
    pub fn as_wire(self) -> &'static str {
        match self {
            VolumeState::Ready => "ready",
            VolumeState::Failed => "failed",
            VolumeState::Tombstoned => "tombstoned",
        }
    }

    pub fn from_wire(raw: &str) -> Option<VolumeState> {
        match raw {
            "ready" => Some(VolumeState::Ready),
            "failed" => Some(VolumeState::Failed),
            "tombstoned" => Some(VolumeState::Tombstoned),
            _ => None,
        }
    }
}

/// One volume's row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeStatus {
    pub volume_id: String,
    pub state: VolumeState,
    pub size_gb: u64,
    pub last_error: String,
}
