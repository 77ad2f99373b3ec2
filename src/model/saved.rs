//! What holds a suspended VM's guest: what a backend's suspend made, as
//! the VM's record keeps it.

use serde::{Deserialize, Serialize};

/// A suspended guest's saved state on this host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Saved {
    /// When it was saved, in Unix milliseconds.
    pub taken_at_ms: u64,
    /// What it holds of the host's disk (allocated, not apparent, bytes).
    pub bytes: u64,
    /// Held in memory by a paused VMM (vfkit) rather than written to the
    /// host's disk: the VM then still holds its memory.
    #[serde(default)]
    pub in_memory: bool,
}
