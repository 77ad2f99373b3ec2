//! A VM's persisted record: everything the agent must remember about a VM
//! across its own restarts, written before the side effect it announces.

use serde::{Deserialize, Serialize};

use super::Lifecycle;
use crate::model::{Egress, Publish, VmSpec};

/// The on-disk format this agent writes. A record of a higher format was
/// written by a newer agent and is reported unreadable rather than half
/// understood.
pub const RECORD_FORMAT: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub spec: VmSpec,
    /// Where the VM is in its life: the fields only the lifecycle's
    /// transitions write. Flattened: on disk they are this record's own
    /// fields, as in every record written before they were grouped.
    #[serde(flatten)]
    pub lifecycle: Lifecycle,
    pub ip: String,
    pub network_ip: String,
    /// OpenSSH public line of the guest's host key, when one was made.
    pub host_pubkey: String,
    /// The VM's own egress rules as last wanted: held again when an
    /// agent's start adopts its running hypervisor, before any pass.
    #[serde(default, skip_serializing_if = "Egress::is_open")]
    pub egress: Egress,
    /// The ports published for it, as last held: held again at an
    /// agent's start, before any pass. Saved after they are held, so a
    /// record names only ports that were granted to it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub published: Vec<Publish>,
    /// Suspended (or being suspended) by the agent for idleness while
    /// wanted running: it sleeps until traffic wakes it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub asleep: bool,
    /// Running because traffic woke it while wanted suspended: it runs
    /// until it is idle, then sleeps again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub woken: bool,
    /// Its guest is being saved as its template (a running template):
    /// it may be paused, and a pass that finds this resumes it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub templating: bool,
}

impl Record {
    /// A fresh record for a VM about to be created.
    pub fn new(spec: VmSpec) -> Record {
        Record {
            spec,
            lifecycle: Lifecycle::default(),
            ip: String::new(),
            network_ip: String::new(),
            host_pubkey: String::new(),
            egress: Egress::default(),
            published: Vec::new(),
            asleep: false,
            woken: false,
            templating: false,
        }
    }
}

/// The file's outer shape: the format first, so a reader can refuse a
/// newer one before trying to understand it.
#[derive(Serialize, Deserialize)]
pub(super) struct Envelope<R> {
    pub format: u32,
    pub record: R,
}

/// Times as Unix milliseconds: readable in the file, exact enough for a
/// grace period, and free of serde's platform-shaped SystemTime encoding.
pub(super) mod unix_ms {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            None => s.serialize_none(),
            Some(t) => {
                let ms = t
                    .duration_since(UNIX_EPOCH)
                    .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
                    .unwrap_or(0);
                s.serialize_some(&ms)
            }
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SystemTime>, D::Error> {
        let ms: Option<u64> = Option::deserialize(d)?;
        Ok(ms.map(|ms| UNIX_EPOCH + Duration::from_millis(ms)))
    }
}
