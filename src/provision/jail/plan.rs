//! The jail's one way in for a backend: a [`Plan`] of the VMM it is about
//! to start (its VM, its limits, the files it writes, what it sees) in;
//! everything the host needs done before the fork ([`Prepared`]: the
//! [`Jail`] the child enters and the cgroup files it moves itself into)
//! out. The fork itself is [`fork::start`](super::fork::start).

use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use super::fork::Jail;
use super::view::{View, Visible};
use super::{Confined, JailError, VmmIds, acl, cgroup_limits, give, jail_for, lack};
use crate::model::{Id, VmLimits, VmSpec};
use crate::provision::Piece;
use crate::stages::timed;
use crate::state::atomic::Pending;

/// What a backend asks of the jail for one VMM.
pub struct Plan<'a> {
    pub spec: &'a VmSpec,
    /// The tenant's limits in force (its CPU quota and burst).
    pub limits: &'a VmLimits,
    /// The files it writes, made its own (created when missing).
    pub owns: Vec<PathBuf>,
    /// Its disks: the largest of them, or the spec's disk size, bounds
    /// every file it may grow.
    pub disks: Vec<PathBuf>,
    /// What it sees of the host's files, and the empty directory its view
    /// is mounted on.
    pub sees: Vec<Visible>,
    pub mountpoint: PathBuf,
    /// The backend's own preparation of what it lends the VMM besides
    /// (a directory it writes into, a snapshot it reads), given the VMM's
    /// user id, or `None` when VMMs run unjailed.
    pub lend: &'a dyn Fn(Option<u32>) -> io::Result<()>,
}

/// What the host made ready for the VMM, to hand to the fork.
pub struct Prepared {
    /// Its jail; `None` where the host cannot jail and the operator allowed
    /// that.
    pub jail: Option<Jail>,
    /// The cgroups' files it writes itself into before it execs; none where
    /// the host has no cgroups and the operator allowed that.
    pub cgroups: Vec<OwnedFd>,
}

impl Confined {
    /// Makes the host ready for the planned VMM: its own id, the KVM
    /// device open to its group, its files made its own, its limits, its
    /// view planned, its cgroups made, limited and opened.
    pub fn prepare(&self, plan: &Plan<'_>) -> Result<Prepared, JailError> {
        let vm_id = &plan.spec.vm_id;
        let jail = self.jail_of(plan)?;
        let cgroups = match timed("cgroups", || self.cgroups())? {
            Some(cgroups) => timed("cgroup", || {
                cgroups.prepare(vm_id, cgroup_limits(plan.spec, plan.limits))?;
                cgroups.entry_files(vm_id)
            })
            .map_err(|source| JailError::Cgroup {
                vm_id: vm_id.clone(),
                source,
            })?,
            None => Vec::new(),
        };
        Ok(Prepared { jail, cgroups })
    }

    fn jail_of(&self, plan: &Plan<'_>) -> Result<Option<Jail>, JailError> {
        let vm_id = &plan.spec.vm_id;
        let give_failed = |source| JailError::GiveFiles {
            vm_id: vm_id.clone(),
            source,
        };
        let Some(ids) = self.jail()? else {
            (plan.lend)(None).map_err(give_failed)?;
            return Ok(None);
        };
        timed("kvm access", || self.open_kvm(ids.kvm_group))?;
        let id = id_of(ids, vm_id)?;
        timed("give files", || {
            give(&plan.owns, id)?;
            (plan.lend)(Some(id))
        })
        .map_err(give_failed)?;
        let largest = plan
            .disks
            .iter()
            .filter_map(|file| fs::metadata(file).ok())
            .map(|m| m.len())
            .max()
            .unwrap_or(0)
            .max(plan.spec.disk_gb.saturating_mul(1 << 30));
        let mut jail = jail_for(plan.spec, id, ids.kvm_group, largest);
        let view = timed("view", || {
            crate::state::perms::make_dir(&plan.mountpoint)?;
            View::plan(&plan.mountpoint, &plan.sees)
        });
        jail.view = Some(view.map_err(|source| JailError::View {
            vm_id: vm_id.clone(),
            source,
        })?);
        Ok(Some(jail))
    }

    /// Takes the VM's own user and group id, the one it has or a new one
    /// (nothing when VMMs run unjailed): the id table's bytes saved, its
    /// name durable once the returned [`Pending`] is synced, before the
    /// VMM starts.
    pub fn reserve_vmm_id(&self, vm_id: &Id) -> Result<Pending, JailError> {
        let Some(ids) = self.jail()? else {
            return Ok(Pending::none());
        };
        let (_, pending) = ids.reserve(vm_id).map_err(id_error(vm_id))?;
        Ok(pending)
    }

    /// Whether the planned VMM confines itself with Landlock: the host has
    /// it, or the operator allowed its lack (`Ok(false)`).
    pub fn landlock(&self) -> Result<bool, JailError> {
        self.uses(Piece::Landlock)
    }

    /// Makes sure the jailed VMMs' `group` may open the KVM device: it
    /// does already, or an ACL entry is added (see [`acl`]).
    pub fn open_kvm(&self, group: u32) -> Result<(), JailError> {
        acl::give_group_read_write(&self.kvm, group).map_err(|source| JailError::KvmGroup {
            path: self.kvm.clone(),
            group,
            source,
        })
    }

    /// Takes back what the VM's VMMs were given: its cgroups and its id.
    pub fn release(&self, vm_id: &Id) -> Result<(), JailError> {
        if let Ok(cgroups) = &self.cgroups {
            cgroups.remove(vm_id).map_err(|source| JailError::Cgroup {
                vm_id: vm_id.clone(),
                source,
            })?;
        }
        if let Ok(ids) = &self.ids {
            ids.release(vm_id).map_err(|e| JailError::VmmId {
                vm_id: vm_id.clone(),
                why: lack::describe(&e),
            })?;
        }
        Ok(())
    }
}

/// The VM's id in `ids`: the one it has, or a new one, saved.
fn id_of(ids: &VmmIds, vm_id: &Id) -> Result<u32, JailError> {
    ids.of(vm_id).map_err(id_error(vm_id))
}

fn id_error(vm_id: &Id) -> impl FnOnce(crate::state::leases::LeaseError) -> JailError + '_ {
    |e| JailError::VmmId {
        vm_id: vm_id.clone(),
        why: lack::describe(&e),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;
    use crate::model::VmSpec;

    fn spec() -> VmSpec {
        VmSpec::for_tests("vm-1", 1)
    }

    fn plan<'a>(spec: &'a VmSpec, lend: &'a dyn Fn(Option<u32>) -> io::Result<()>) -> Plan<'a> {
        // Nothing of this plan is on the host: a lacking host touches none.
        Plan {
            spec,
            limits: &spec.limits,
            owns: vec![PathBuf::from("/nonexistent/disk.raw")],
            disks: vec![PathBuf::from("/nonexistent/disk.raw")],
            sees: Vec::new(),
            mountpoint: PathBuf::from("/nonexistent/vmm-root"),
            lend,
        }
    }

    #[test]
    fn an_allowed_unjailed_host_prepares_no_jail_and_lends_unjailed() {
        let host = super::super::tests::lacking(vec![Piece::Jail, Piece::Cgroups]);
        let spec = spec();
        let lent = RefCell::new(Vec::new());
        let lend = |id| {
            lent.borrow_mut().push(id);
            Ok(())
        };

        let prepared = host.prepare(&plan(&spec, &lend)).expect("prepared");

        assert!(prepared.jail.is_none());
        assert!(prepared.cgroups.is_empty());
        assert_eq!(*lent.borrow(), [None]);
    }

    #[test]
    fn a_host_that_cannot_jail_refuses_the_plan_as_a_host_condition() {
        let host = super::super::tests::lacking(vec![]);
        let spec = spec();
        let lend = |_| Ok(());

        let refused = host.prepare(&plan(&spec, &lend)).err().expect("refused");

        assert!(matches!(
            refused,
            JailError::Unconfinable { piece: "jail", .. }
        ));
        assert!(crate::error::Failure::is_host_condition(&refused));
    }

    #[test]
    fn a_failed_lend_is_the_vms_and_is_retried() {
        let host = super::super::tests::lacking(vec![Piece::Jail, Piece::Cgroups]);
        let spec = spec();
        let lend = |_| Err(io::Error::from(io::ErrorKind::StorageFull));

        let failed = host.prepare(&plan(&spec, &lend)).err().expect("failed");

        assert_eq!(
            failed.to_string(),
            "VM vm-1: cannot make its files its hypervisor's own"
        );
        assert!(!crate::error::Failure::is_host_condition(&failed));
    }
}
