//! The fakes as a backend with no capability but its lifecycle: it cannot
//! suspend, holds no limits, egress rules or ports, tells no host
//! condition and wakes nothing. What the engine does for a backend that
//! lacks a capability is shown against it.

use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::Arc;

use super::Fakes;
use crate::deadline::Deadline;
use crate::error::BoxFailure;
use crate::model::{Id, VmSpec};
use crate::provision::{ExitListener, Lifecycle, Say};
use crate::reconcile::Seams;
use crate::state::atomic::Pending;

/// The lifecycle of [`Fakes`], and nothing more.
pub struct Bare(pub Arc<Fakes>);

impl Fakes {
    /// The fakes' seams, their backend [`Bare`].
    pub fn bare_seams(self: &Arc<Self>) -> Seams {
        Seams {
            provisioner: Arc::new(Bare(Arc::clone(self))),
            ..self.seams()
        }
    }
}

impl Lifecycle for Bare {
    fn preflight(&self, deadline: Deadline) -> Result<(), BoxFailure> {
        self.0.preflight(deadline)
    }

    fn prepare_root_disk(
        &self,
        spec: &VmSpec,
        base: &Path,
        deadline: Deadline,
    ) -> Result<Pending, BoxFailure> {
        self.0.prepare_root_disk(spec, base, deadline)
    }

    fn boot(&self, spec: &VmSpec, deadline: Deadline) -> Result<(), BoxFailure> {
        self.0.boot(spec, deadline)
    }

    fn shutdown(&self, vm_id: &Id, deadline: Deadline, say: Say<'_>) -> Result<(), BoxFailure> {
        self.0.shutdown(vm_id, deadline, say)
    }

    fn destroy(&self, vm_id: &Id, deadline: Deadline) -> Result<(), BoxFailure> {
        self.0.destroy(vm_id, deadline)
    }

    fn running(&self, vm_id: &Id) -> bool {
        self.0.running(vm_id)
    }

    fn failure_reason(&self, vm_id: &Id) -> Option<String> {
        self.0.failure_reason(vm_id)
    }

    fn address(&self, vm_id: &Id) -> Option<Ipv4Addr> {
        self.0.address(vm_id)
    }

    fn network_address(&self, vm_id: &Id) -> Option<Ipv4Addr> {
        self.0.network_address(vm_id)
    }

    fn watch_exits(&self, listener: ExitListener) {
        self.0.watch_exits(listener);
    }
}
