//! What the engine needs from the rest of the agent, as traits so each can
//! be a real implementation in the daemon and a fake in engine tests.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use crate::deadline::Deadline;
use crate::error::BoxFailure;

/// Called as an image download advances: (bytes done, total when known).
/// It may be called from a shared download thread after the pass that asked
/// gave up; the engine's generation check makes such late calls harmless.
pub type Progress = Arc<dyn Fn(u64, Option<u64>) + Send + Sync>;

/// Resolves an image URL and digest to a verified local base image,
/// fetching it when needed.
pub trait Images: Send + Sync {
    fn resolve(
        &self,
        url: &str,
        sha256: &str,
        deadline: Deadline,
        progress: Progress,
    ) -> Result<PathBuf, BoxFailure>;
}

/// What the cloud-init seed of one VM holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeedParams {
    pub hostname: String,
    /// Stable forever (the VM id), so cloud-init never regenerates host keys.
    pub instance_id: String,
    pub ssh_authorized_key: String,
    /// Tenant user-data, byte for byte.
    pub user_data: String,
    /// The tenant user-CA keys as TrustedUserCAKeys content, one per line.
    pub ssh_user_ca_keys: String,
    pub ssh_host_key_pem: String,
    /// The host key's public line, when there is a host key.
    pub ssh_host_key_public: String,
    pub ssh_host_cert: String,
    /// MAC of the underlay NIC.
    pub mac: String,
    /// MAC of the second NIC; empty when the VM has none.
    pub network_mac: String,
}

/// Builds the cloud-init NoCloud seed image at a path, atomically.
pub trait SeedBuilder: Send + Sync {
    fn build(&self, out: &Path, params: &SeedParams) -> Result<(), BoxFailure>;
}

/// A guest SSH host key: the public line is reported for certification, the
/// private PEM goes into the seed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostKey {
    pub public_line: String,
    pub private_pem: String,
}

/// Loads the host key stored at a path, creating and persisting one when
/// there is none. Load-or-create, not create: a VM waiting for its
/// certificate must present the same key after an agent restart.
pub trait HostKeys: Send + Sync {
    fn load_or_create(&self, path: &Path) -> Result<HostKey, BoxFailure>;
}

/// Facts about the host that tests need to control.
pub trait HostFacts: Send + Sync {
    /// The kernel's boot id; it changes on reboot, which is what makes a VM
    /// "lost" rather than merely stopped.
    fn boot_id(&self) -> String;
    /// Wall-clock time, for quarantine graces and record timestamps.
    fn now(&self) -> SystemTime;
}

/// The real host: the boot id read once (it cannot change while this
/// process lives) and the system clock.
pub struct SystemHost {
    boot_id: String,
}

impl SystemHost {
    pub fn new() -> std::io::Result<SystemHost> {
        let raw = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
        Ok(SystemHost {
            boot_id: raw.trim().to_owned(),
        })
    }
}

impl HostFacts for SystemHost {
    fn boot_id(&self) -> String {
        self.boot_id.clone()
    }

    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}
