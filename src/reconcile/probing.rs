//! What each VM's readiness probe knows, kept by the engine's core (the
//! probing itself is `probe.rs`'s).

use std::collections::HashMap;
use std::time::SystemTime;

use crate::model::Id;

/// What the engine knows of one VM's probe, for its current hypervisor.
#[derive(Clone, Debug)]
pub(crate) struct ProbeState {
    /// The hypervisor it is about, and when it was first seen running.
    pub pid: Option<u32>,
    pub since: SystemTime,
    /// When the probe last answered, and since when it has failed on end.
    pub answered: Option<SystemTime>,
    pub failing_since: Option<SystemTime>,
    pub next_at: SystemTime,
    /// The last probe's result, for the row.
    pub last: String,
    /// How much of the live console a serial probe has searched.
    pub console_searched: Option<u64>,
    /// No probe is named yet: the entry only remembers that this
    /// hypervisor ran (and was ready) without one.
    pub unprobed: bool,
    /// The probe came to a hypervisor already running without one: the
    /// VM is created and running, so it is not `creating` while the probe
    /// waits for its first answer, only not ready.
    pub added_while_running: bool,
    /// Whether the row says unhealthy, so a flip either way is logged once.
    pub unhealthy: bool,
}

/// Every VM's probe state, keyed by VM.
pub(crate) type Probes = parking_lot::Mutex<HashMap<Id, ProbeState>>;

/// What a probe knows of a hypervisor first seen running at `now`.
pub(crate) fn fresh(pid: Option<u32>, now: SystemTime) -> ProbeState {
    ProbeState {
        pid,
        since: now,
        answered: None,
        failing_since: None,
        next_at: now,
        last: String::new(),
        console_searched: None,
        unprobed: false,
        added_while_running: false,
        unhealthy: false,
    }
}
