//! Compute committed to this host's live VMs, against the host's caps.

use serde::{Deserialize, Serialize};

/// One resource: how much is committed, and the cap (0 = none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Committed {
    pub used: u64,
    pub cap: u64,
}

/// What the host's live VMs hold, by resource.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quota {
    pub vcpus: Committed,
    pub mem_mb: Committed,
    pub disk_gb: Committed,
}
