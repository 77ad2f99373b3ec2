//! Admission: whether a VM may exist on this host (the quota ledger), and how
//! many creates may do heavy I/O at once (the create slots). They are kept
//! apart on purpose: quota is a durable decision about the host's capacity,
//! a slot is transient scheduling that only shapes how fast work happens.

use std::collections::HashMap;

use crossbeam_channel::{Receiver, Sender, bounded};
use parking_lot::Mutex;

use crate::deadline::Deadline;
use crate::error::DeadlineExpired;
use crate::model::{Committed, Id, Quota, VmSpec};

/// Host capacity caps; 0 = unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostCaps {
    pub max_vcpus: u64,
    pub max_mem_mb: u64,
    pub max_disk_gb: u64,
    /// The agent's own open files (see [`FdBudget`]).
    pub fds: FdBudget,
}

/// Descriptors counted for a VM at its create, besides one each published
/// port holds: what a sleeper holds, the most a VM holds (its held tap,
/// that tap's polled copy, a packet socket, its DHCP responder's socket);
/// a running VM holds one (an agent with 1 booted VM held 19 descriptors,
/// with 11 held 29), and the difference is the margin a VM's sleep needs.
pub const FDS_PER_VM: u64 = 5;

/// The agent's own open files, held to a budget: its soft `RLIMIT_NOFILE`
/// (raised to the hard limit at start) less a reserve for what it opens
/// for a while — creates in flight, probes, downloads, the control plane.
/// What a VM would hold past it waits, as a host condition, so a tenant's
/// ports can never take the descriptors another VM's create needs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FdBudget {
    /// The soft limit; 0: no budget (not counted).
    pub limit: u64,
    pub reserve: u64,
}

impl FdBudget {
    /// The budget under `limit`: a quarter of it kept back, at most 1,024
    /// and at least 64 (a create holds a dozen files for a while, a probe
    /// one, and four creates and every VM's probe may run at once).
    pub fn under(limit: u64) -> FdBudget {
        FdBudget {
            limit,
            reserve: (limit / 4).clamp(64.min(limit), 1024),
        }
    }

    /// Whether `more` descriptors fit beside what the agent holds now
    /// (asked of the kernel: everything it really holds counts) and what
    /// other VMs' claims are about to open (`claimed`).
    pub fn check(&self, more: u64, claimed: u64) -> Result<(), FdShort> {
        if self.limit == 0 {
            return Ok(());
        }
        let open = open_files() + claimed;
        if open + more + self.reserve <= self.limit {
            return Ok(());
        }
        Err(FdShort {
            open,
            more,
            budget: *self,
        })
    }
}

/// How many files this process holds open.
fn open_files() -> u64 {
    let dir = if cfg!(target_os = "linux") {
        "/proc/self/fd"
    } else {
        "/dev/fd"
    };
    std::fs::read_dir(dir).map_or(0, |d| d.count() as u64)
}

/// More descriptors than the agent's budget has left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FdShort {
    pub open: u64,
    pub more: u64,
    pub budget: FdBudget,
}

impl std::fmt::Display for FdShort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let FdShort { open, more, budget } = self;
        write!(
            f,
            "the agent holds {open} open files of its limit {} ({} kept for creates, probes and downloads in flight), and this needs {more} more; raise the agent's open-file limit (ulimit -n, LimitNOFILE=, s6-softlimit -o) or publish fewer ports",
            budget.limit, budget.reserve
        )
    }
}

impl std::error::Error for FdShort {}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Compute {
    vcpus: u64,
    mem_mb: u64,
    disk_gb: u64,
}

impl Compute {
    fn of(spec: &VmSpec) -> Compute {
        Compute {
            vcpus: u64::from(spec.vcpus),
            mem_mb: spec.mem_mb,
            disk_gb: spec.disk_gb,
        }
    }
}

/// The compute committed to live VMs, under one lock: the one invariant
/// that spans VMs, so concurrent workers can neither oversubscribe a cap
/// nor count a VM twice.
///
/// A VM is committed when admitted for create, re-noted on every converge
/// (so an un-quarantined VM counts again), and released when quarantined
/// (its guest is stopped, its compute free).
pub struct Ledger {
    caps: HostCaps,
    committed: Mutex<HashMap<Id, Compute>>,
    /// Descriptors claimed and not opened yet (see [`FdClaim`]).
    fds_claimed: Mutex<u64>,
}

/// Descriptors a VM may open: counted against the budget until dropped,
/// once they are open (and `/proc/self/fd` counts them) or were not
/// needed. Without it two VMs' workers could each find room for their
/// ports at once, and both open them.
pub struct FdClaim<'a> {
    claimed: &'a Mutex<u64>,
    more: u64,
}

impl Drop for FdClaim<'_> {
    fn drop(&mut self) {
        let mut claimed = self.claimed.lock();
        *claimed = claimed.saturating_sub(self.more);
    }
}

impl Ledger {
    pub fn new(caps: HostCaps) -> Ledger {
        Ledger {
            caps,
            committed: Mutex::new(HashMap::new()),
            fds_claimed: Mutex::new(0),
        }
    }

    /// Commits `spec` if it fits under every cap, counting every other
    /// committed VM (never this one twice: a retry replaces its own entry).
    /// Returns the refusal, naming the cap, when it does not fit.
    pub fn admit(&self, spec: &VmSpec) -> Result<(), OverCap> {
        let mut committed = self.committed.lock();
        Ledger::fit(&self.caps, &committed, spec)?;
        committed.insert(spec.vm_id.clone(), Compute::of(spec));
        Ok(())
    }

    /// Whether `spec` would be admitted now, committing nothing.
    pub fn fits(&self, spec: &VmSpec) -> Result<(), OverCap> {
        Ledger::fit(&self.caps, &self.committed.lock(), spec)
    }

    fn fit(
        caps: &HostCaps,
        committed: &HashMap<Id, Compute>,
        spec: &VmSpec,
    ) -> Result<(), OverCap> {
        let mut need = Compute::of(spec);
        for (id, c) in committed.iter() {
            if *id != spec.vm_id {
                need.vcpus += c.vcpus;
                need.mem_mb += c.mem_mb;
                need.disk_gb += c.disk_gb;
            }
        }
        [
            (Resource::Vcpus, need.vcpus, caps.max_vcpus),
            (Resource::Memory, need.mem_mb, caps.max_mem_mb),
            (Resource::Disk, need.disk_gb, caps.max_disk_gb),
        ]
        .into_iter()
        .find(|(_, need, cap)| *cap > 0 && need > cap)
        .map_or(Ok(()), |(resource, need, cap)| {
            Err(OverCap {
                resource,
                need,
                cap,
            })
        })
    }

    /// Counts an existing VM without a cap check: it is already on the host,
    /// however it got there.
    pub fn note(&self, spec: &VmSpec) {
        self.committed
            .lock()
            .insert(spec.vm_id.clone(), Compute::of(spec));
    }

    /// Counts a suspended VM: its disk and the disk its saved state holds,
    /// and no vCPUs or memory (no VMM runs for it), unless its state is
    /// held in memory (a paused VMM, which keeps its guest's memory).
    pub fn note_suspended(&self, spec: &VmSpec, saved: &crate::model::Saved) {
        const GIB: u64 = 1 << 30;
        let mut compute = Compute::of(spec);
        compute.disk_gb = compute.disk_gb.saturating_add(saved.bytes.div_ceil(GIB));
        if !saved.in_memory {
            compute.vcpus = 0;
            compute.mem_mb = 0;
        }
        self.committed.lock().insert(spec.vm_id.clone(), compute);
    }

    pub fn release(&self, vm_id: &Id) {
        self.committed.lock().remove(vm_id);
    }

    /// Claims `more` descriptors for a VM to open, if they fit (see
    /// [`FdBudget`]); hold the claim until they are open.
    pub fn descriptors(&self, more: u64) -> Result<FdClaim<'_>, FdShort> {
        let mut claimed = self.fds_claimed.lock();
        self.caps.fds.check(more, *claimed)?;
        *claimed += more;
        Ok(FdClaim {
            claimed: &self.fds_claimed,
            more,
        })
    }

    /// Committed vCPUs, MB and GB, and the caps on each (0 = none).
    pub fn usage(&self) -> Quota {
        let committed = self.committed.lock();
        let sum = |of: fn(&Compute) -> u64| committed.values().map(of).sum::<u64>();
        let with = |used, cap| Committed { used, cap };
        Quota {
            vcpus: with(sum(|c| c.vcpus), self.caps.max_vcpus),
            mem_mb: with(sum(|c| c.mem_mb), self.caps.max_mem_mb),
            disk_gb: with(sum(|c| c.disk_gb), self.caps.max_disk_gb),
        }
    }
}

/// A counting semaphore over a bounded channel: a slot is taken by sending
/// into it and given back by receiving. Zero slots means unlimited.
pub struct CreateSlots {
    slots: Option<(Sender<()>, Receiver<()>)>,
}

/// A held create slot; dropping it gives the slot back.
pub struct SlotGuard<'a> {
    slots: Option<&'a Receiver<()>>,
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        if let Some(rx) = self.slots {
            // Cannot fail to find a token: this guard's own send put it there.
            let _ = rx.try_recv();
        }
    }
}

impl CreateSlots {
    pub fn new(max_concurrent: usize) -> CreateSlots {
        CreateSlots {
            slots: (max_concurrent > 0).then(|| bounded(max_concurrent)),
        }
    }

    /// Waits for a slot until `deadline`, never longer, so a queued VM cannot
    /// outlive its own pass.
    pub fn acquire(&self, deadline: Deadline) -> Result<SlotGuard<'_>, DeadlineExpired> {
        let Some((tx, rx)) = &self.slots else {
            return Ok(SlotGuard { slots: None });
        };
        let sent = match deadline.instant() {
            Some(at) => tx.send_deadline((), at).is_ok(),
            None => tx.send(()).is_ok(),
        };
        if sent {
            Ok(SlotGuard { slots: Some(rx) })
        } else {
            Err(DeadlineExpired {
                waiting_for: "waiting for a create slot",
            })
        }
    }
}

/// What a host cap counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource {
    Vcpus,
    Memory,
    Disk,
}

/// A VM that does not fit: with it, the host's VMs would need `need` of
/// `resource`, over the host's `cap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverCap {
    pub resource: Resource,
    pub need: u64,
    pub cap: u64,
}

impl std::fmt::Display for OverCap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let OverCap { need, cap, .. } = self;
        let what = match self.resource {
            Resource::Vcpus => "vcpus",
            Resource::Memory => "MB memory",
            Resource::Disk => "GB disk",
        };
        write!(
            f,
            "host capacity limit reached: needs {need} {what}, host cap {cap}"
        )
    }
}

impl std::error::Error for OverCap {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Id;

    fn spec(id: &str, vcpus: u32) -> VmSpec {
        VmSpec::for_tests(id, vcpus)
    }

    fn caps(max_vcpus: u64) -> HostCaps {
        HostCaps {
            max_vcpus,
            ..HostCaps::default()
        }
    }

    #[test]
    fn a_quarter_of_the_open_file_limit_is_kept_back_within_bounds() {
        assert_eq!(FdBudget::under(1024).reserve, 256);
        assert_eq!(FdBudget::under(192).reserve, 64);
        assert_eq!(FdBudget::under(1 << 20).reserve, 1024);
    }

    #[test]
    fn descriptors_past_the_budget_are_refused_saying_what_to_raise() {
        let budget = FdBudget {
            limit: 100,
            reserve: 64,
        };

        let short = budget.check(100, 0).expect_err("over");

        assert!(short.open > 0, "{short:?}");
        assert!(short.to_string().contains("ulimit -n"), "{short}");
        assert!(FdBudget::default().check(u64::MAX / 2, 0).is_ok());
    }

    /// Room for `more` descriptors beside what this process holds now.
    fn room_for(more: u64) -> HostCaps {
        let budget = FdBudget::under(4096);
        HostCaps {
            fds: FdBudget {
                limit: open_files() + more + budget.reserve,
                reserve: budget.reserve,
            },
            ..HostCaps::default()
        }
    }

    #[test]
    fn a_claim_counts_until_it_is_dropped() {
        let ledger = Ledger::new(room_for(40));

        let first = ledger.descriptors(32).expect("room for the first");
        let second = ledger.descriptors(32).err();
        drop(first);
        let third = ledger.descriptors(32).map(drop);

        assert!(second.is_some(), "two claims of 32 in room for 40");
        assert!(third.is_ok(), "the first claim was given back");
    }

    #[test]
    fn admission_sums_other_vms() {
        let ledger = Ledger::new(caps(4));
        ledger.admit(&spec("a", 3)).expect("fits");

        let err = ledger.admit(&spec("b", 2)).expect_err("over the cap");

        assert_eq!(
            err,
            OverCap {
                resource: Resource::Vcpus,
                need: 5,
                cap: 4
            }
        );
        assert_eq!(
            err.to_string(),
            "host capacity limit reached: needs 5 vcpus, host cap 4"
        );
    }

    #[test]
    fn a_retry_does_not_count_itself_twice() {
        let ledger = Ledger::new(caps(4));
        ledger.admit(&spec("a", 3)).expect("first");

        let again = ledger.admit(&spec("a", 3));

        assert!(again.is_ok());
    }

    #[test]
    fn a_vm_saved_to_disk_holds_disk_for_its_state_but_no_compute() {
        let ledger = Ledger::new(caps(4));
        let saved = crate::model::Saved {
            taken_at_ms: 0,
            bytes: (1 << 30) + 1,
            in_memory: false,
        };

        ledger.note_suspended(&spec("a", 3), &saved);
        let usage = ledger.usage();

        assert_eq!(usage.vcpus.used, 0);
        assert_eq!(usage.mem_mb.used, 0);
        assert_eq!(
            usage.disk_gb.used,
            1 + 2,
            "its disk and its state, rounded up"
        );
    }

    #[test]
    fn a_vm_held_in_memory_by_a_paused_vmm_keeps_its_compute() {
        let ledger = Ledger::new(caps(4));
        let saved = crate::model::Saved {
            in_memory: true,
            ..crate::model::Saved::default()
        };

        ledger.note_suspended(&spec("a", 3), &saved);

        assert_eq!(ledger.usage().vcpus.used, 3);
    }

    #[test]
    fn release_frees_compute() {
        let ledger = Ledger::new(caps(4));
        ledger.admit(&spec("a", 3)).expect("first");
        ledger.release(&Id::parse("a").expect("id"));

        let b = ledger.admit(&spec("b", 4));

        assert!(b.is_ok());
    }

    #[test]
    fn zero_caps_are_unlimited() {
        let ledger = Ledger::new(HostCaps::default());

        let big = ledger.admit(&spec("a", 512));

        assert!(big.is_ok());
    }

    #[test]
    fn slots_refuse_past_the_deadline_when_full() {
        let slots = CreateSlots::new(1);
        let _held = slots.acquire(Deadline::NONE).expect("first slot");

        let second = slots.acquire(Deadline::after(std::time::Duration::from_millis(10)));

        assert!(second.is_err());
    }

    #[test]
    fn a_dropped_guard_gives_its_slot_back() {
        let slots = CreateSlots::new(1);
        drop(slots.acquire(Deadline::NONE).expect("first slot"));

        let again = slots.acquire(Deadline::after(std::time::Duration::from_millis(10)));

        assert!(again.is_ok());
    }
}
