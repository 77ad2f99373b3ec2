//! What the host has, as the engine reports it.

use std::sync::Arc;

use super::{Id, Phase, PowerState};

/// The host's report for one tick.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub last_seen_epoch: u64,
    /// Shared with the VM workers that published them: a step hands out
    /// ten thousand rows without copying one.
    pub vms: Vec<Arc<VmStatus>>,
    pub quarantined: Vec<QuarantinedVm>,
    pub destroyed: Vec<Id>,
    pub volumes: Vec<VolumeStatus>,
    pub fence_violation: bool,
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
