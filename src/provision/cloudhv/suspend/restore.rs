//! A resume's half (see the protocol in [`super`]): a live VMM resumed
//! where it stands, or the snapshot restored into a new one held paused,
//! vetted, and run once the engine's record of it has landed.

use super::{API_TIMEOUT, checked, failed, put};
use crate::deadline::Deadline;
use crate::error::Outcome;
use crate::model::{Id, VmSpec};
use crate::provision::Spend;
use crate::provision::cloudhv::argv::{Launch, MemoryRestore};
use crate::provision::cloudhv::process::Tracked;
use crate::provision::cloudhv::{CloudHypervisor, api};
use crate::provision::supervise::{self, Awaited};
use crate::stages::timed;

impl CloudHypervisor {
    /// Resumes the VM (see the steps in [`super`]).
    pub(in crate::provision::cloudhv) fn resume_vm(
        &self,
        spec: &VmSpec,
        deadline: Deadline,
        spend: Spend<'_>,
    ) -> Outcome {
        let vm_id = &spec.vm_id;
        if let Some(tracked) = self.find(vm_id) {
            // One a crash left restoring may not have finished.
            self.await_state(vm_id, tracked, Awaited::PausedOrRunning, deadline)?;
            spend()?;
            if api::vm_state(&self.socket_path(vm_id), API_TIMEOUT).as_deref() == Some("Paused") {
                self.unpause(vm_id, deadline)?;
            }
            self.await_running(vm_id, tracked, deadline)?;
            return self.discard_saved(vm_id);
        }
        let layout = self.store.layout();
        let snapshot = layout.snapshot(vm_id);
        let manifest = match timed("check", || {
            checked(&layout.snapshot_manifest(vm_id), &snapshot)
        }) {
            Ok((_, manifest)) => manifest,
            Err(why) => {
                return Err(failed(
                    vm_id,
                    "restore its snapshot",
                    crate::error::chain(&why),
                ));
            }
        };
        // A clone's first restore reads its memory whole: what its guest
        // agent does to make it its own touches much of it at once, and
        // faulted in a page at a time (with cloud-hypervisor's background
        // prefault spinning a core beside it) that took twice as long
        // (`make bench-clone`; README, Templates and clones).
        let memory = match &manifest.clone_of {
            Some(template) => {
                log::debug!(
                    "VM {vm_id}: restoring its copy of {template} with its memory read whole"
                );
                MemoryRestore::Copy
            }
            None => self.memory_restore(),
        };
        let launch = Launch::Restore {
            snapshot: &snapshot,
            memory,
        };
        let started = self.start_vmm(spec, launch, deadline, || {
            crate::crash::point("resume.restore-started");
        });
        self.take_back_memory(vm_id, &snapshot);
        started?;
        self.vet_restored(vm_id)?;
        crate::crash::point("resume.restored");
        let Some(tracked) = self.find(vm_id) else {
            return Err(failed(
                vm_id,
                "run its restored guest",
                "its hypervisor is gone",
            ));
        };
        if let Err(e) = spend() {
            log::warn!(
                "VM {vm_id}: its restored guest is not run ({}); its hypervisor is stopped, its snapshot kept",
                crate::error::chain(&*e)
            );
            self.end_restored(vm_id, tracked);
            return Err(e);
        }
        let ran = self
            .unpause(vm_id, deadline)
            .and_then(|()| self.await_running(vm_id, tracked, deadline));
        if let Err(e) = ran {
            self.end_restored(vm_id, tracked);
            return Err(e);
        }
        crate::crash::point("resume.resumed");
        self.discard_saved(vm_id)?;
        crate::crash::point("resume.snapshot-discarded");
        Ok(())
    }

    /// Takes back the read of the snapshot's memory its VMM's user was
    /// lent for its restore (see `lend`): restored, its VMM has the file
    /// open or read it whole; failed, it needs nothing.
    fn take_back_memory(&self, vm_id: &Id, snapshot: &std::path::Path) {
        let Ok(Some(ids)) = self.confined.jail() else {
            return;
        };
        let Some(uid) = ids.get(vm_id) else {
            return;
        };
        if let Err(e) = super::take_back(snapshot, uid) {
            log::warn!(
                "VM {vm_id}: cannot take back its hypervisor's read of {}: {e} (taken back at the agent's next start)",
                snapshot.display()
            );
        }
    }

    /// Runs the VM's paused guest (`vm.resume`).
    fn unpause(&self, vm_id: &Id, deadline: Deadline) -> Outcome {
        timed("run", || {
            put(
                &self.socket_path(vm_id),
                "/api/v1/vm.resume",
                None,
                deadline.capped(API_TIMEOUT),
            )
        })
        .map_err(|e| failed(vm_id, "resume its paused guest", e))
    }

    /// Ends a VMM that restored the VM's snapshot, and what it forked;
    /// the snapshot is left as it is.
    pub(in crate::provision::cloudhv) fn end_restored(&self, vm_id: &Id, tracked: Tracked) {
        supervise::ladder::kill(&self.vmm(vm_id, tracked));
        let _ = self.end_leftovers(vm_id, &|_| {});
    }

    /// A restored hypervisor's own account of its VM (`vm.info`), held to
    /// what the agent started the VM with (see `vet`); one that differs,
    /// or says nothing, is killed.
    fn vet_restored(&self, vm_id: &Id) -> Outcome {
        let expected = crate::provision::cloudhv::vet::Expected {
            // Its guest runs from its memory, not the file it booted.
            payload: None,
            ..self.snapshot_of(vm_id).expected
        };
        let info = api::vm_info(&self.socket_path(vm_id), API_TIMEOUT);
        let why = match info {
            Some(info) => crate::provision::cloudhv::vet::difference(&info["config"], &expected),
            None => Some("it does not answer vm.info".into()),
        };
        let Some(why) = why else {
            return Ok(());
        };
        log::error!("VM {vm_id}: its restored hypervisor is not the VM it was: {why}; killing it");
        match self.find(vm_id) {
            Some(tracked) => self.end_restored(vm_id, tracked),
            None => {
                let _ = self.end_leftovers(vm_id, &|_| {});
            }
        }
        Err(failed(vm_id, "check its restored hypervisor", why))
    }

    /// How a restoring VMM fills its guest's memory: on demand where the
    /// host's userfaultfd device can be given to the VMMs' group (or the
    /// VMMs are not jailed, and run as root), else by reading it whole.
    /// The group is given the device here, at a resume, not at the agent's
    /// start: a host whose agent never resumes a VM keeps its ACL as it
    /// was (the claim's release takes the entry back).
    pub(in crate::provision::cloudhv) fn memory_restore(&self) -> MemoryRestore {
        let why = self.memory_restore_why().or_else(|| {
            let device = self.cfg.confinement.userfaultfd.as_deref()?;
            let Ok(Some(ids)) = self.confined.jail() else {
                return None;
            };
            crate::provision::jail::acl::give_group_read_write(device, ids.kvm_group)
                .err()
                .map(|e| {
                    format!(
                        "cannot give the hypervisors' group {} {}: {e}",
                        ids.kvm_group,
                        device.display()
                    )
                })
        });
        why.map_or(MemoryRestore::OnDemand, |why| {
            log::warn!("resumes read the whole snapshot first: {why}");
            MemoryRestore::Copy
        })
    }

    /// Why a resume here reads the whole snapshot before its guest runs,
    /// as far as the settings and the host say without touching the
    /// device; `None` when it faults its memory in on demand. For
    /// `status` too.
    pub(in crate::provision::cloudhv) fn memory_restore_why(&self) -> Option<String> {
        let Some(device) = &self.cfg.confinement.userfaultfd else {
            return Some("--userfaultfd-device is empty".into());
        };
        (!device.exists()).then(|| {
            format!(
                "{} is missing (Linux 6.1 or later has it)",
                device.display()
            )
        })
    }
}
