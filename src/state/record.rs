//! A VM's persisted record: everything the agent must remember about a VM
//! across its own restarts, written before the side effect it announces.

use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::model::VmSpec;

/// The on-disk format this agent writes. A record of a higher format was
/// written by a newer agent and is reported unreadable rather than half
/// understood.
pub const RECORD_FORMAT: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub spec: VmSpec,
    /// Create attempts spent on this spec. Reset when the spec changes.
    pub create_attempts: u32,
    /// When the latest create attempt started.
    #[serde(with = "unix_ms")]
    pub created_at: Option<SystemTime>,
    pub last_error: String,
    /// When the latest create attempt failed; the next waits out a backoff
    /// from then. Absent in records of older agents: no wait.
    #[serde(with = "unix_ms", default)]
    pub failed_at: Option<SystemTime>,
    /// The latest create attempt failed permanently: no retry can succeed
    /// until the spec changes (a budget spent on transient errors re-arms).
    #[serde(default)]
    pub failure_permanent: bool,
    /// Boot id of the host when the VM was last created or booted. Empty
    /// until a create completes: it is the create's completion witness.
    pub boot_id: String,
    /// The VM was deliberately stopped; its absence is not a crash.
    pub stop_requested: bool,
    /// When the VM entered quarantine; `None` when it is not quarantined.
    #[serde(with = "unix_ms")]
    pub quarantined_at: Option<SystemTime>,
    /// Quarantined because it was tombstoned (the shorter grace) rather than
    /// because it vanished from desired state.
    pub quarantine_tombstoned: bool,
    pub ip: String,
    pub network_ip: String,
    /// OpenSSH public line of the guest's host key, when one was made.
    pub host_pubkey: String,
}

impl Record {
    /// A fresh record for a VM about to be created.
    pub fn new(spec: VmSpec) -> Record {
        Record {
            spec,
            create_attempts: 0,
            created_at: None,
            last_error: String::new(),
            failed_at: None,
            failure_permanent: false,
            boot_id: String::new(),
            stop_requested: false,
            quarantined_at: None,
            quarantine_tombstoned: false,
            ip: String::new(),
            network_ip: String::new(),
            host_pubkey: String::new(),
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
mod unix_ms {
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
