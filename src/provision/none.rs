//! The backend of a host that has none: every create fails with a
//! permanent error that says so, and nothing on the host is touched.
//!
//! The daemon uses it where no hypervisor backend exists for the platform
//! or build. Volumes, reports and every other part of the agent keep
//! working, which is what lets an operator run `status` and standalone mode
//! on such a host and see exactly why no VM starts.

use std::path::Path;

use super::Provisioner;
use crate::deadline::Deadline;
use crate::error::{BoxFailure, Simple};
use crate::model::{Id, VmSpec};

pub struct NoBackend {
    why: String,
}

impl NoBackend {
    pub fn new(why: impl Into<String>) -> NoBackend {
        NoBackend { why: why.into() }
    }

    fn refuse(&self) -> Result<(), BoxFailure> {
        Err(Simple::permanent(self.why.clone()).into())
    }
}

impl Provisioner for NoBackend {
    fn preflight(&self, _deadline: Deadline) -> Result<(), BoxFailure> {
        self.refuse()
    }

    fn prepare_root_disk(
        &self,
        _spec: &VmSpec,
        _base: &Path,
        _deadline: Deadline,
    ) -> Result<(), BoxFailure> {
        self.refuse()
    }

    fn boot(&self, _spec: &VmSpec, _deadline: Deadline) -> Result<(), BoxFailure> {
        self.refuse()
    }

    /// Nothing runs, so nothing needs stopping.
    fn shutdown(&self, _vm_id: &Id, _deadline: Deadline) -> Result<(), BoxFailure> {
        Ok(())
    }

    fn destroy(&self, _vm_id: &Id, _deadline: Deadline) -> Result<(), BoxFailure> {
        Ok(())
    }

    fn running(&self, _vm_id: &Id) -> bool {
        false
    }

    fn failure_reason(&self, _vm_id: &Id) -> String {
        self.why.clone()
    }

    fn address(&self, _vm_id: &Id) -> String {
        String::new()
    }

    fn network_address(&self, _vm_id: &Id) -> String {
        String::new()
    }
}
