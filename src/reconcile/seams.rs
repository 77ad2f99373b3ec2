//! What the engine needs from the rest of the agent, as traits so each can
//! be a real implementation in the daemon and a fake in engine tests.
//!
//! The traits live here, with their consumer, and so do their
//! implementations for the real parts: the image cache, the seed builder
//! and the host-key store sit below the engine and know nothing of it.

use std::path::Path;
use std::time::SystemTime;

use crate::error::Outcome;
pub use crate::hostkey::HostKey;
use crate::hostkey::LocalHostKeys;
pub use crate::image::Base;
use crate::image::ImageCache;
pub use crate::image::Progress;
pub use crate::image::Request as ImageRequest;
use crate::seed::NoCloudSeed;
pub use crate::seed::SeedParams;

/// Resolves an image URL and digest to a verified local base image of at
/// most `max_bytes`, fetching it when needed, and held against a prune
/// while the returned [`Base`] lives.
pub trait Images: Send + Sync {
    fn resolve(&self, wanted: ImageRequest<'_>) -> Outcome<Base>;
}

/// Builds the cloud-init NoCloud seed image at a path, atomically.
pub trait SeedBuilder: Send + Sync {
    /// The seed in place at `out`; durable once the returned
    /// [`Pending`](crate::state::atomic::Pending) is synced.
    fn build(&self, out: &Path, params: &SeedParams) -> Outcome<crate::state::atomic::Pending>;

    /// Whether the seeds it builds install a guest agent: the guests of
    /// such seeds are waited for until their agents answer.
    fn carries_guest_agent(&self) -> bool {
        false
    }
}

/// Loads the host key stored at a path, creating and persisting one when
/// there is none. Load-or-create, not create: a VM waiting for its
/// certificate must present the same key after an agent restart.
pub trait HostKeys: Send + Sync {
    fn load_or_create(&self, path: &Path) -> Outcome<HostKey>;
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

impl Images for ImageCache {
    fn resolve(&self, wanted: ImageRequest<'_>) -> Outcome<Base> {
        ImageCache::resolve_held(self, wanted)
    }
}

impl SeedBuilder for NoCloudSeed {
    fn build(&self, out: &Path, params: &SeedParams) -> Outcome<crate::state::atomic::Pending> {
        NoCloudSeed::build(self, out, params)
    }

    fn carries_guest_agent(&self) -> bool {
        NoCloudSeed::carries_guest_agent(self)
    }
}

impl HostKeys for LocalHostKeys {
    fn load_or_create(&self, path: &Path) -> Outcome<HostKey> {
        LocalHostKeys::load_or_create(self, path)
    }
}
