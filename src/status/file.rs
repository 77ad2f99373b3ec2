//! `report.json`: the daemon's last report as a file, with when it was
//! written and how the last contact with the control plane went. The
//! daemon rewrites it every tick, in both modes; `status` reads it, taking
//! no lock, so it works beside a running agent.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::model::Quota;
use crate::pb;
use crate::state::Layout;
use crate::state::atomic::replace_unsynced;

const FORMAT: u32 = 1;

/// Why `status` has no report to show.
#[derive(Debug)]
pub enum StatusError {
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    NotAReport {
        path: PathBuf,
        source: serde_json::Error,
    },
}

impl std::fmt::Display for StatusError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StatusError::Read { path, .. } => write!(
                f,
                "cannot read {}; is the agent running with --state-dir {}?",
                path.display(),
                path.parent().unwrap_or(path).display()
            ),
            StatusError::NotAReport { path, .. } => {
                write!(f, "{} is not a report", path.display())
            }
        }
    }
}

impl std::error::Error for StatusError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StatusError::Read { source, .. } => Some(source),
            StatusError::NotAReport { source, .. } => Some(source),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportFile {
    pub format: u32,
    pub written_at_unix_ms: u64,
    pub host: pb::HostInfo,
    /// Where desired state comes from.
    pub source: String,
    /// How the last contact with the source went: "ok", or why it failed.
    pub contact: String,
    pub report: pb::Report,
    /// Lasting facts about this host an operator should know (e.g. guest
    /// networking is host-only).
    #[serde(default)]
    pub notes: Vec<String>,
    /// The agent's tick: a report much older than this is stale (the agent
    /// is stopped, or cannot write).
    #[serde(default)]
    pub tick_ms: u64,
    /// What `status VM` shows beyond the report's row, by VM id.
    #[serde(default)]
    pub details: BTreeMap<String, VmDetail>,
    /// Compute committed against the host's caps.
    #[serde(default)]
    pub quota: Quota,
    /// The host-wide registry of agents' claims (`--agents-dir`), where
    /// `status` reads whose claims this host holds.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub agents_dir: String,
    /// The agent that wrote it: its pid, and when it started (Unix ms).
    #[serde(default)]
    pub agent_pid: u32,
    #[serde(default)]
    pub agent_started_at_ms: u64,
}

/// One VM's history and shape, kept by the daemon across reports.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmDetail {
    /// When the row's power and phase last changed (Unix ms).
    pub power_since_ms: u64,
    pub phase_since_ms: u64,
    /// When the current error was first and last seen (0: no error).
    pub error_first_ms: u64,
    pub error_last_ms: u64,
    pub attempts: u32,
    pub max_attempts: u32,
    /// The host boot id the VM was last booted under.
    pub booted_as: String,
    /// The hypervisor's pid, and since when it has been this one.
    pub pid: Option<u32>,
    pub pid_since_ms: u64,
    pub vcpus: u32,
    pub mem_mb: u64,
    pub disk_gb: u64,
    pub image_url: String,
    pub network: String,
    pub volume_ids: Vec<String>,
    /// A suspended VM's snapshot: when it was taken (Unix ms; 0: the VM
    /// is not suspended) and what it holds of the host's disk.
    #[serde(default)]
    pub suspended_at_ms: u64,
    #[serde(default)]
    pub snapshot_bytes: u64,
    /// How many times the VM was booted again unasked (its hypervisor
    /// died, or its probe's `restart_after`), over the agents that ran it.
    #[serde(default)]
    pub restarts: u64,
    /// When its last create began (Unix ms; 0: never).
    #[serde(default)]
    pub created_at_ms: u64,
    /// What it uses, while it runs and the agent samples it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::usage::Usage>,
}

impl ReportFile {
    pub fn new(
        host: pb::HostInfo,
        source: String,
        contact: String,
        report: pb::Report,
    ) -> ReportFile {
        let written_at_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        ReportFile {
            format: FORMAT,
            written_at_unix_ms,
            host,
            source,
            contact,
            report,
            notes: Vec::new(),
            tick_ms: 0,
            details: BTreeMap::new(),
            quota: Quota::default(),
            agents_dir: String::new(),
            agent_pid: 0,
            agent_started_at_ms: 0,
        }
    }

    /// Whether the report is older than three ticks at `now`: an agent that
    /// runs writes one at least every tick.
    pub fn is_stale(&self, now: SystemTime) -> bool {
        let written = UNIX_EPOCH + Duration::from_millis(self.written_at_unix_ms);
        let age = now.duration_since(written).unwrap_or_default();
        self.tick_ms > 0 && age > Duration::from_millis(self.tick_ms.saturating_mul(3))
    }

    /// Replaces `report.json` atomically for readers, unsynced: it is a
    /// view of memory rewritten every tick, not state (see
    /// [`replace_unsynced`]).
    pub fn write(&self, state_dir: &Path) -> std::io::Result<()> {
        let json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        replace_unsynced(&Layout::new(state_dir).report(), &json)
    }

    pub fn read(state_dir: &Path) -> Result<ReportFile, StatusError> {
        let path = Layout::new(state_dir).report();
        let bytes = std::fs::read(&path).map_err(|source| StatusError::Read {
            path: path.clone(),
            source,
        })?;
        serde_json::from_slice(&bytes).map_err(|source| StatusError::NotAReport { path, source })
    }
}
