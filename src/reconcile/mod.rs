//! The reconcile engine: a level-triggered loop that makes the host match a
//! snapshot and reports what the host has.
//!
//! [`Engine::step`] is a router, not a worker. In order:
//! 1. **Epoch fence.** A snapshot older than the stored epoch changes
//!    nothing (no epoch save, no record write, no dispatch, no provisioner
//!    call but `running`) and gets a read-only report of the host as it is.
//!    Passes dispatched by earlier snapshots keep running.
//! 2. **Version floor.** A snapshot this agent is too old to read is
//!    refused after its epoch is accepted, so the control plane sees the
//!    refusal instead of a stall: every VM failed, power unobserved.
//! 3. **Volumes**, synchronously, so a VM arriving with its volume in one
//!    snapshot finds the file when its pass boots it.
//! 4. **Dispatch.** Each VM in the union of desired state and local records
//!    gets its slice of the snapshot on its own worker thread.
//! 5. **Aggregate.** The report is each worker's last published result plus
//!    the destroy ack; it never waits on a worker.
//!
//! Every call re-examines the whole state, so repeating a snapshot is
//! idempotent, and whatever one tick could not do the next one retries.

mod admission;
mod converge;
mod create;
mod pass;
mod reap;
pub mod seams;
pub mod volumes;
mod workers;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

pub use admission::HostCaps;
use admission::{CreateSlots, Ledger};
use pass::{Assignment, Core, VmResult, quarantined_entry};
use seams::{HostFacts, HostKeys, Images, SeedBuilder};
use workers::Workers;

use crate::deadline::Deadline;
use crate::model::{Id, Phase, PowerState, Rejected, Report, Snapshot, VmStatus, WantedVm};
use crate::provision::Provisioner;
use crate::state::{RecordSlot, Store};
use crate::version::{FloorVerdict, check_floor};

/// How the engine behaves; the daemon fills it from flags.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// This binary's release, ordered against `min_agent_version`.
    pub agent_version: String,
    /// Bounds one VM's whole pass; `None` = unbounded. Set it well above the
    /// longest legitimate operation (a first image download): convergence
    /// across ticks is still guaranteed because finished downloads are
    /// durably cached.
    pub vm_timeout: Option<Duration>,
    /// Quarantine before destroying a tombstoned VM.
    pub tombstone_grace: Duration,
    /// Quarantine before destroying a VM that vanished from desired state.
    pub vanish_grace: Duration,
    /// Create attempts per spec before the VM is terminally failed.
    pub max_create_attempts: u32,
    /// Creates allowed in their I/O-heavy part at once; 0 = unlimited.
    pub max_concurrent_creates: usize,
    pub caps: HostCaps,
    /// Stack of each VM worker thread. Chosen on purpose: a host runs
    /// hundreds of workers, and a pass needs little stack (it blocks in
    /// syscalls, it does not recurse).
    pub worker_stack_bytes: usize,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            agent_version: crate::version::AGENT_VERSION.to_owned(),
            vm_timeout: Some(Duration::from_secs(15 * 60)),
            tombstone_grace: Duration::from_secs(60 * 60),
            vanish_grace: Duration::from_secs(24 * 60 * 60),
            max_create_attempts: 3,
            max_concurrent_creates: 4,
            caps: HostCaps::default(),
            worker_stack_bytes: 256 * 1024,
        }
    }
}

/// The engine's collaborators, passed in: real ones in the daemon, fakes in
/// tests.
pub struct Seams {
    pub provisioner: Arc<dyn Provisioner>,
    pub images: Arc<dyn Images>,
    pub seed: Arc<dyn SeedBuilder>,
    pub host_keys: Arc<dyn HostKeys>,
    pub host: Arc<dyn HostFacts>,
}

pub struct Engine {
    core: Arc<Core>,
    workers: Mutex<Workers>,
}

impl Engine {
    /// Builds the engine over an open store. The compute ledger is rebuilt
    /// from the records, so the first step accounts for every VM that
    /// survived a restart (quarantined ones excluded: their compute is free).
    pub fn new(store: Arc<Store>, seams: Seams, config: EngineConfig) -> Engine {
        let ledger = Ledger::new(config.caps);
        for slot in store.load_all().values() {
            if let RecordSlot::Readable(rec) = slot
                && rec.quarantined_at.is_none()
            {
                ledger.note(&rec.spec);
            }
        }
        let slots = CreateSlots::new(config.max_concurrent_creates);
        let stack = config.worker_stack_bytes;
        let core = Core {
            store,
            prov: seams.provisioner,
            images: seams.images,
            seed: seams.seed,
            host_keys: seams.host_keys,
            host: seams.host,
            config,
            ledger,
            slots,
        };
        Engine {
            core: Arc::new(core),
            workers: Mutex::new(Workers::new(stack)),
        }
    }

    /// Routes one snapshot to the VM workers and returns the host's report
    /// (see the module steps). Never waits for a worker: a VM busy in a long
    /// operation reports its last published row, or none yet.
    pub fn step(&self, snap: &Snapshot) -> Report {
        let store = &self.core.store;
        let current = store.epoch();
        if snap.epoch < current {
            return self.fence_report(current);
        }
        if let Err(e) = store.save_epoch(snap.epoch) {
            log::error!("{}", crate::error::chain(&e));
        }
        match check_floor(&self.core.config.agent_version, &snap.min_agent_version) {
            FloorVerdict::Allowed => {}
            FloorVerdict::Below => {
                return refuse(
                    snap,
                    format!(
                        "agent {} is below this snapshot's floor {}; upgrade the agent",
                        self.core.config.agent_version, snap.min_agent_version
                    ),
                );
            }
            FloorVerdict::UnreadableFloor => {
                return refuse(
                    snap,
                    format!(
                        "this snapshot's floor {:?} is not a version agent {} can compare; fix min_agent_version or upgrade the agent",
                        snap.min_agent_version, self.core.config.agent_version
                    ),
                );
            }
        }

        // One record read serves the tick: dispatch slices it, and the
        // destroy ack is computed against it, before this tick's passes run.
        let records = store.load_all();
        let volumes = volumes::converge(store, snap, &records);
        let claimed: HashSet<&Id> = snap
            .rejected_vms
            .iter()
            .filter_map(|r| r.id.as_ref())
            .collect();

        let mut workers = self.workers.lock();
        workers.join_finished();
        let assignments = assignments(snap, &records, &claimed);
        for (vm_id, assignment) in &assignments {
            workers.deliver(vm_id, assignment.clone(), &self.core);
        }
        // A refused entry still claims its id: its worker (if any) is kept,
        // and the VM is neither created nor reaped.
        let keep: HashSet<&Id> = assignments
            .keys()
            .copied()
            .chain(claimed.iter().copied())
            .collect();
        workers.retire_absent(&keep);

        let mut report = Report {
            last_seen_epoch: snap.epoch,
            volumes,
            ..Report::default()
        };
        workers.collect(&mut report, &claimed);
        // Last, so the wakes and the passes they start cost this step nothing.
        workers.ring();
        drop(workers);
        for rejected in &snap.rejected_vms {
            report.vms.push(self.rejected_row(rejected, &records));
        }
        report.destroyed = destroyed_ack(snap, &records);
        sort(&mut report);
        report
    }

    /// The report as it stands, without dispatching anything: every VM's
    /// last published row and quarantined entry. For `status` and tests.
    pub fn published(&self) -> Report {
        let mut report = Report::default();
        self.workers.lock().collect(&mut report, &HashSet::new());
        sort(&mut report);
        report
    }

    /// Waits until no worker has a pass running or an assignment waiting, or
    /// until `deadline`. Returns whether the engine went idle.
    pub fn wait_idle(&self, deadline: Deadline) -> bool {
        loop {
            if self.workers.lock().is_idle() {
                return true;
            }
            if deadline.expired() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Stops every worker: no pass starts after this, and passes in flight
    /// get until `deadline` to finish. VMs keep running.
    pub fn shutdown(&self, deadline: Deadline) {
        self.workers.lock().stop_all(deadline);
    }

    /// The read-only report for a stale snapshot.
    fn fence_report(&self, current: u64) -> Report {
        Report {
            fence_violation: true,
            last_seen_epoch: current,
            ..self.observe()
        }
    }

    /// The host as the records and the backend's liveness say it is, and the
    /// volumes as they lie, changing nothing and dispatching nothing. For an
    /// agent with no desired state at all (a first start while the control
    /// plane is down): stepping an empty snapshot instead would read every
    /// VM as vanished and start reaping the host.
    pub fn observe(&self) -> Report {
        let mut report = Report {
            last_seen_epoch: self.core.store.epoch(),
            volumes: volumes::sweep(&self.core.store),
            ..Report::default()
        };
        for (vm_id, slot) in self.core.store.load_all().iter() {
            let rec = match slot {
                RecordSlot::Readable(rec) => rec,
                RecordSlot::Unreadable(problem) => {
                    let why = format!("record unreadable: {problem}");
                    VmResult::failed_unobserved(vm_id, why).merge_into(&mut report);
                    continue;
                }
            };
            let mut res = VmResult {
                host_pubkey: rec.host_pubkey.clone(),
                ..VmResult::default()
            };
            if rec.quarantined_at.is_some() {
                res.quarantined = Some(quarantined_entry(rec, self.core.grace_for(rec)));
            } else {
                let power = PowerState::observed(self.core.prov.running(vm_id));
                let phase = if !rec.last_error.is_empty() {
                    Phase::Failed
                } else if rec.boot_id.is_empty() {
                    Phase::Creating
                } else {
                    Phase::Ready
                };
                res.report(rec, Some(power), phase, rec.last_error.clone());
            }
            res.merge_into(&mut report);
        }
        sort(&mut report);
        report
    }

    /// The row of a VM entry the agent refused. When the id names a VM this
    /// host has, the row says whether it runs: refusing the entry does not
    /// make the VM's actual state unknown.
    fn rejected_row(&self, rejected: &Rejected, records: &BTreeMap<Id, RecordSlot>) -> VmStatus {
        let rec = rejected.id.as_ref().and_then(|id| match records.get(id) {
            Some(RecordSlot::Readable(rec)) => Some(rec),
            _ => None,
        });
        let mut row = VmStatus {
            vm_id: rejected.raw_id.clone(),
            phase: Some(Phase::Failed),
            last_error: rejected.error.to_string(),
            ..VmStatus::default()
        };
        if let Some(rec) = rec {
            row.power = Some(PowerState::observed(
                self.core.prov.running(&rec.spec.vm_id),
            ));
            row.ip = rec.ip.clone();
            row.network_ip = rec.network_ip.clone();
            row.ssh_host_pubkey = rec.host_pubkey.clone();
        }
        row
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.workers
            .get_mut()
            .stop_all(Deadline::after(Duration::from_secs(5)));
    }
}

/// Slices a snapshot into one assignment per VM over the union of desired
/// state and local records: desired-only is a create, record-only is a
/// vanished VM to reap, both is a converge. A tombstoned VM with no record
/// needs no pass (the destroy ack covers it), and a refused entry's id gets
/// none either.
fn assignments<'a>(
    snap: &'a Snapshot,
    records: &'a BTreeMap<Id, RecordSlot>,
    claimed: &HashSet<&Id>,
) -> HashMap<&'a Id, Assignment> {
    let mut out = HashMap::with_capacity(snap.vms.len() + records.len());
    for wanted in &snap.vms {
        match wanted {
            WantedVm::Present(d) => {
                out.insert(&d.spec.vm_id, Assignment::Desired(Arc::clone(d)));
            }
            WantedVm::Tombstoned(id) if records.contains_key(id) => {
                out.insert(id, Assignment::Reap { tombstoned: true });
            }
            WantedVm::Tombstoned(_) => {}
        }
    }
    for id in records.keys() {
        if !out.contains_key(id) && !claimed.contains(id) {
            out.insert(id, Assignment::Reap { tombstoned: false });
        }
    }
    out
}

/// Tombstoned VMs this host holds no record of, computed against the record
/// view read before this tick's passes ran: the ack lands a tick or more
/// after the pass that deleted the record, never in the same one.
fn destroyed_ack(snap: &Snapshot, records: &BTreeMap<Id, RecordSlot>) -> Vec<Id> {
    snap.vms
        .iter()
        .filter_map(|w| match w {
            WantedVm::Tombstoned(id) if !records.contains_key(id) => Some(id.clone()),
            _ => None,
        })
        .collect()
}

/// Every VM in the snapshot, failed for one reason, power unobserved: this
/// path looks at nothing, and the control plane persists what a report
/// claims, so "stopped" here would be a fleet-wide lie about running guests.
/// Tombstoned VMs are skipped: hanging an upgrade error on a VM on its way
/// out would leave a failure nobody can clear.
///
/// It carries no volumes. That is safe only because an agent refusing a
/// snapshot is below its floor, and snapshots that carry volumes set their
/// floor at or above the first volume-aware release; if a floor is ever
/// raised past that, this must sweep and report volumes too, or the refusal
/// reads upward as "every tombstoned volume is gone".
fn refuse(snap: &Snapshot, reason: String) -> Report {
    log::error!("refusing snapshot {}: {reason}", snap.epoch);
    let present = snap.vms.iter().filter_map(|w| match w {
        WantedVm::Present(d) => Some(d.spec.vm_id.to_string()),
        WantedVm::Tombstoned(_) => None,
    });
    let refused = snap.rejected_vms.iter().map(|r| r.raw_id.clone());
    let vms = present
        .chain(refused)
        .map(|vm_id| VmStatus {
            vm_id,
            power: None,
            phase: Some(Phase::Failed),
            last_error: reason.clone(),
            ..VmStatus::default()
        })
        .collect();
    let mut report = Report {
        last_seen_epoch: snap.epoch,
        vms,
        ..Report::default()
    };
    sort(&mut report);
    report
}

/// Orders a report by id, so reports diff cleanly from tick to tick.
fn sort(report: &mut Report) {
    report.vms.sort_by(|a, b| a.vm_id.cmp(&b.vm_id));
    report.quarantined.sort_by(|a, b| a.vm_id.cmp(&b.vm_id));
    report.destroyed.sort();
}
