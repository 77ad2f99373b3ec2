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
//!    gets its slice of the snapshot on its own worker thread. A VM seen for
//!    the first time starts with a row (`queued`, or what its record says),
//!    so it is in this very report.
//! 5. **Aggregate.** The report is each worker's last published result plus
//!    the destroy ack, one row per id; it never waits on a worker.
//!
//! Every call re-examines the whole state, so repeating a snapshot is
//! idempotent, and whatever one tick could not do the next one retries.
//! Between steps, two things happen without one: a hypervisor that exits
//! wakes its VM's worker at once (the provisioner's exit watch), and every
//! change of a published row rings [`Engine::changes`], so the daemon can
//! report it through [`Engine::report`] without dispatching anything.

mod admission;
mod clones;
mod context;
mod converge;
pub mod counts;
mod create;
mod guests;
mod holds;
/// The lifecycle lives beside the record it writes (see its header).
pub use crate::state::lifecycle;
mod panics;
mod pass;
mod probes;
mod reap;
pub mod seams;
mod sleepers;
mod step;
mod suspension;
mod templates;
pub mod volumes;
mod workers;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crossbeam_channel::{Receiver, bounded};
use parking_lot::Mutex;

use admission::{CreateSlots, Ledger};
pub use admission::{FDS_PER_VM, FdBudget, FdShort, HostCaps};
use context::Context;
use create::Create;
use pass::{Assignment, VmResult};
use seams::{HostFacts, HostKeys, Images, SeedBuilder};
use step::Spine;
use workers::{Pokes, Workers};

use crate::deadline::Deadline;
use crate::logonce::LogOnce;
use crate::model::{
    Id, Phase, PowerState, Rejected, Report, Snapshot, VmStatus, VolumeStatus, WantedVm,
};
use crate::provision::Lifecycle;
use crate::stages::Stages;
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
    /// Create attempts per spec before the VM is failed (until its spec
    /// changes, or, when every failure was one that may pass, until
    /// `create_rearm` has passed).
    pub max_create_attempts: u32,
    /// How long a create budget spent only on transient errors stays spent.
    pub create_rearm: Duration,
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
            create_rearm: Duration::from_secs(60 * 60),
            max_concurrent_creates: 4,
            caps: HostCaps::default(),
            worker_stack_bytes: 256 * 1024,
        }
    }
}

/// The engine's collaborators, passed in: real ones in the daemon, fakes in
/// tests.
pub struct Seams {
    pub provisioner: Arc<dyn Lifecycle>,
    pub images: Arc<dyn Images>,
    pub seed: Arc<dyn SeedBuilder>,
    pub host_keys: Arc<dyn HostKeys>,
    pub host: Arc<dyn HostFacts>,
}

pub struct Engine {
    spine: Arc<Spine>,
    workers: Mutex<Workers>,
    /// Rung whenever a VM's published result changes.
    changes: Receiver<()>,
    /// The volume rows of the last step, for reports made between steps.
    volumes: Mutex<Vec<VolumeStatus>>,
    /// The reason the current snapshot is refused, once logged.
    refusing: Mutex<Option<String>>,
    /// What the last full delivery was made from.
    dispatched: Mutex<Option<Dispatched>>,
}

/// The inputs of a full delivery. A step with the very same desired VMs
/// (the same shared entries, not equal copies: a pointer compare per VM),
/// the same refused ids and the same records (the store's change count)
/// would deliver to every worker exactly what it already has:
/// it gives each its newest assignment again instead, and skips building
/// and comparing ten thousand assignments.
struct Dispatched {
    vms: Vec<WantedVm>,
    rejected: Vec<String>,
    /// The records' change count (see [`Store::load_all_counted`]).
    records: u64,
}

impl Dispatched {
    fn of(snap: &Snapshot, records: u64) -> Dispatched {
        Dispatched {
            vms: snap.vms.clone(),
            rejected: snap.rejected_vms.iter().map(|r| r.raw_id.clone()).collect(),
            records,
        }
    }

    fn matches(&self, snap: &Snapshot, records: u64) -> bool {
        self.records == records
            && self.vms.len() == snap.vms.len()
            && self.rejected.len() == snap.rejected_vms.len()
            && self.vms.iter().zip(&snap.vms).all(|pair| match pair {
                (WantedVm::Present(a), WantedVm::Present(b)) => Arc::ptr_eq(a, b),
                (WantedVm::Tombstoned(a), WantedVm::Tombstoned(b)) => a == b,
                _ => false,
            })
            && self
                .rejected
                .iter()
                .zip(&snap.rejected_vms)
                .all(|(a, b)| *a == b.raw_id)
    }
}

/// What the engine makes of a snapshot before acting on it.
enum Verdict {
    /// Older than the stored epoch: nothing changes.
    Fenced {
        current: u64,
    },
    /// Below its version floor: reported, not acted on.
    Refused(String),
    Accepted,
}

impl Engine {
    /// Builds the engine over an open store. The compute ledger is rebuilt
    /// from the records, so the first step accounts for every VM that
    /// survived a restart (quarantined ones excluded: their compute is free).
    /// The engine asks the provisioner to tell it of every hypervisor exit,
    /// and runs that VM's pass at once.
    pub fn new(store: Arc<Store>, seams: Seams, config: EngineConfig) -> Engine {
        let ledger = Ledger::new(config.caps);
        for slot in store.load_all().values() {
            if let RecordSlot::Readable(rec) = slot
                && rec.lifecycle.quarantined_at().is_none()
            {
                ledger.note(&rec.spec);
            }
        }
        let slots = CreateSlots::new(config.max_concurrent_creates);
        let agent_wait = seams
            .seed
            .carries_guest_agent()
            .then_some(probes::AGENT_WAIT);
        let stack = config.worker_stack_bytes;
        let (changed, changes) = bounded(1);
        let workers = Workers::new(stack, changed);
        // Weak: a dropped engine must stop being poked, and the backend
        // (which holds the listener) must not keep the workers alive.
        let pokes: Weak<Pokes> = Arc::downgrade(&workers.pokes());
        let wakes = Weak::clone(&pokes);
        let sleepers = sleepers::Sleepers::new(
            Arc::clone(&seams.provisioner),
            Arc::new(move |vm_id: &Id| {
                if let Some(pokes) = wakes.upgrade() {
                    pokes.wake(vm_id);
                }
            }),
        );
        let spine = Spine {
            ctx: Context {
                store,
                backend: seams.provisioner,
                host: seams.host,
                config,
                ledger,
                logs: LogOnce::new(),
                counts: counts::Counts::default(),
            },
            create: Create::new(seams.images, seams.seed, seams.host_keys, slots),
            probes: probes::Probes::new(agent_wait),
            panics: panics::Panics::default(),
            sleepers,
            templates: templates::Templates::default(),
            watch: parking_lot::RwLock::new(None),
        };
        spine.ctx.backend.watch_exits(Arc::new(move |vm_id: &Id| {
            if let Some(pokes) = pokes.upgrade()
                && pokes.poke(vm_id)
            {
                log::debug!("VM {vm_id}: its hypervisor exited; checking it now");
            }
        }));
        Engine {
            spine: Arc::new(spine),
            workers: Mutex::new(workers),
            changes,
            volumes: Mutex::new(Vec::new()),
            refusing: Mutex::new(None),
            dispatched: Mutex::new(None),
        }
    }

    /// Rings whenever a VM's published result changes (a pass ended with a
    /// different row, or narrated a new step), so the caller can report it
    /// without waiting for the next step. Bounded(1): a burst of changes is
    /// one wake.
    pub fn changes(&self) -> &Receiver<()> {
        &self.changes
    }

    fn verdict(&self, snap: &Snapshot) -> Verdict {
        let current = self.spine.ctx.store.epoch();
        if snap.epoch < current {
            return Verdict::Fenced { current };
        }
        let version = &self.spine.ctx.config.agent_version;
        match check_floor(version, &snap.min_agent_version) {
            FloorVerdict::Allowed => Verdict::Accepted,
            FloorVerdict::Below => Verdict::Refused(format!(
                "agent {version} is below this snapshot's floor {}; upgrade the agent",
                snap.min_agent_version
            )),
            FloorVerdict::UnreadableFloor => Verdict::Refused(format!(
                "this snapshot's floor {:?} is not a version agent {version} can compare; fix min_agent_version or upgrade the agent",
                snap.min_agent_version
            )),
        }
    }

    /// Routes one snapshot to the VM workers and returns the host's report
    /// (see the module steps), every VM's pass run again: the level
    /// trigger. Never waits for a worker: a VM busy in a long operation
    /// reports its last published row, and a VM named for the first time
    /// reports `queued`.
    pub fn step(&self, snap: &Snapshot) -> Report {
        self.step_as(snap, Trigger::Level)
    }

    /// [`Engine::step`] for a snapshot that arrived between ticks: only
    /// the VMs it changes (and those it names for the first time) are
    /// woken. The passes of the others would find what they found at the
    /// last tick and, run beside a create on a host's few cores, would
    /// only delay it; they run at the next [`Engine::step`].
    pub fn step_news(&self, snap: &Snapshot) -> Report {
        self.step_as(snap, Trigger::News)
    }

    fn step_as(&self, snap: &Snapshot, trigger: Trigger) -> Report {
        let started = std::time::Instant::now();
        let report = self.step_timed(snap, trigger);
        self.spine.ctx.counts.steps.observe(started.elapsed());
        report
    }

    /// What the engine counted (see [`counts::Counts`]).
    pub fn counts(&self) -> &counts::Counts {
        &self.spine.ctx.counts
    }

    /// Compute committed to live VMs and the host's caps (0 = none):
    /// vCPUs, memory in MB, disk in GB.
    pub fn quota(&self) -> crate::model::Quota {
        self.spine.ctx.ledger.usage()
    }

    /// What the host lacks to run guests right now, if anything: what the
    /// backend says it lacks (see
    /// [`HostChecks::host_condition`](crate::provision::HostChecks::host_condition)),
    /// else what a VM's create waits for (room on a full filesystem, an
    /// image server out of reach).
    pub fn host_condition(&self) -> Option<String> {
        let backend = &self.spine.ctx.backend;
        backend
            .host_checks()
            .and_then(|checks| checks.host_condition())
            .or_else(|| self.spine.create.host_condition())
    }

    /// The VM's live hypervisor's pid, if the backend can say.
    pub fn hypervisor_pid(&self, vm_id: &Id) -> Option<u32> {
        self.spine.ctx.backend.pid(vm_id)
    }

    /// Tells `watch` the stages of every create attempt, suspend and
    /// resume from now on, as they end (on the VM's worker thread: keep it
    /// short). Each is logged with its stages too; this is for what
    /// measures them.
    pub fn watch_stages(&self, watch: impl Fn(&Id, &Stages) + Send + Sync + 'static) {
        *self.spine.watch.write() = Some(Arc::new(watch));
    }

    /// Create attempts a VM is given before its create is failed.
    pub fn max_attempts(&self) -> u32 {
        self.spine.ctx.budget().max_attempts
    }

    /// VM workers alive now.
    pub fn workers_alive(&self) -> usize {
        self.workers.lock().alive()
    }

    fn step_timed(&self, snap: &Snapshot, trigger: Trigger) -> Report {
        let store = &self.spine.ctx.store;
        match self.verdict(snap) {
            Verdict::Fenced { current } => return self.fence_report(current),
            Verdict::Refused(reason) => {
                if let Err(e) = store.save_epoch(snap.epoch) {
                    self.spine.ctx.logs.error("epoch", &crate::error::chain(&e));
                }
                return self.refuse(snap, reason);
            }
            Verdict::Accepted => {}
        }
        if let Err(e) = store.save_epoch(snap.epoch) {
            self.spine.ctx.logs.error("epoch", &crate::error::chain(&e));
        }
        if self.refusing.lock().take().is_some() {
            log::info!("snapshot {} is within this agent's floor again", snap.epoch);
        }

        // Only unreadable records are read from disk again, so an operator's
        // repair is noticed within a tick; everything else is memory.
        // (The VM's worker says so when its pass runs again.)
        store.reread_unreadable();
        // One record read serves the tick: dispatch slices it, and the
        // destroy ack is computed against it, before this tick's passes run.
        let (generation, records) = store.load_all_counted();
        let volumes = volumes::converge(store, snap, &records);
        self.volumes.lock().clone_from(&volumes);
        let claimed = claimed_ids(snap);

        let mut workers = self.workers.lock();
        workers.join_finished();
        let same = self
            .dispatched
            .lock()
            .as_ref()
            .is_some_and(|d| d.matches(snap, generation));
        let level = trigger == Trigger::Level;
        let redelivered = same && (!level || workers.redeliver_all(std::time::Instant::now()));
        if !redelivered {
            workers.full_delivery_begins();
            let assignments = assignments(snap, &records, &claimed);
            for (vm_id, assignment) in &assignments {
                let initial = || self.initial_result(vm_id, assignment, records.get(*vm_id));
                workers.deliver(vm_id, assignment.clone(), trigger, &self.spine, initial);
            }
            // A refused entry still claims its id: its worker (if any) is
            // kept, and the VM is neither created nor reaped.
            let keep: HashSet<&Id> = assignments
                .keys()
                .copied()
                .chain(claimed.iter().copied())
                .collect();
            workers.retire_absent(&keep);
            *self.dispatched.lock() = Some(Dispatched::of(snap, generation));
        }
        let report = self.aggregate(snap, &workers, &records, volumes, &claimed);
        // Last, so the wakes and the passes they start cost this step nothing.
        workers.ring();
        report
    }

    /// The report for `snap` as the host stands now, dispatching nothing:
    /// every VM's last published row, the last step's volumes, the refused
    /// entries and the destroy ack. Made between steps, when a pass changed
    /// a VM's row, so the change is reported without waiting for a tick.
    pub fn report(&self, snap: &Snapshot) -> Report {
        match self.verdict(snap) {
            Verdict::Fenced { current } => self.fence_report(current),
            Verdict::Refused(reason) => self.refuse(snap, reason),
            Verdict::Accepted => {
                let records = self.spine.ctx.store.load_all();
                let volumes = self.volumes.lock().clone();
                let claimed = claimed_ids(snap);
                let workers = self.workers.lock();
                self.aggregate(snap, &workers, &records, volumes, &claimed)
            }
        }
    }

    fn aggregate(
        &self,
        snap: &Snapshot,
        workers: &Workers,
        records: &BTreeMap<Id, RecordSlot>,
        volumes: Vec<VolumeStatus>,
        claimed: &HashSet<&Id>,
    ) -> Report {
        let mut report = Report {
            last_seen_epoch: snap.epoch,
            volumes,
            ..Report::default()
        };
        (report.vms, report.quarantined) = workers.collect(claimed);
        let collected = (report.vms.len(), report.quarantined.len());
        // One row per id: a control plane keyed on vm_id cannot use two. An
        // id sent twice is refused in both places, and said once.
        let mut said = HashSet::new();
        for rejected in &snap.rejected_vms {
            if said.insert(rejected.raw_id.as_str()) {
                let row = self.rejected_row(rejected, records, workers);
                report.vms.push(Arc::new(row));
            }
        }
        // A refused entry for a quarantined VM leaves it quarantined: its
        // entry, and when it will be destroyed, stay in the report (from
        // its record, when no worker of this agent has said it yet).
        for id in claimed {
            if let Some(RecordSlot::Readable(rec)) = records.get(*id)
                && rec.lifecycle.quarantined_at().is_some()
                && !report.quarantined.iter().any(|q| q.vm_id == **id)
            {
                report
                    .quarantined
                    .push(pass::quarantined_entry(rec, self.spine.ctx.grace_for(rec)));
            }
        }
        report.destroyed = destroyed_ack(snap, records);
        sort(&mut report, collected);
        report
    }

    /// The report as it stands, without dispatching anything: every VM's
    /// last published row and quarantined entry. For `status` and tests.
    pub fn published(&self) -> Report {
        let mut report = Report::default();
        (report.vms, report.quarantined) = self.workers.lock().collect(&HashSet::new());
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

    /// The read-only report for a snapshot older than the stored epoch:
    /// the host as the records say, flagged as fenced.
    pub fn fenced(&self) -> Report {
        self.fence_report(self.spine.ctx.store.epoch())
    }

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
            last_seen_epoch: self.spine.ctx.store.epoch(),
            volumes: volumes::sweep(&self.spine.ctx.store),
            ..Report::default()
        };
        for (vm_id, slot) in self.spine.ctx.store.load_all().iter() {
            self.spine.ctx.observed(vm_id, slot).merge_into(&mut report);
        }
        sort(&mut report, (0, 0));
        report
    }

    /// A snapshot this agent is too old to read: nothing is dispatched, every
    /// VM it names is failed with the reason, and every VM the host has is
    /// still reported as it is (a VM absent from the refused snapshot must
    /// not drop out of sight). Logged once per change of reason.
    ///
    /// A VM the host has keeps its observed power; one it does not have is
    /// reported with power unobserved, never "stopped": the control plane
    /// persists what a report claims. Tombstoned entries get no row: hanging
    /// an upgrade error on a VM on its way out leaves a failure nobody can
    /// clear. The volumes are swept as they lie, as for a fenced snapshot:
    /// a report that named none would read upward as "every tombstoned
    /// volume is gone".
    fn refuse(&self, snap: &Snapshot, reason: String) -> Report {
        {
            let mut refusing = self.refusing.lock();
            if refusing.as_deref() != Some(reason.as_str()) {
                log::error!("refusing snapshot {}: {reason}", snap.epoch);
                *refusing = Some(reason.clone());
            }
        }
        let mut report = Report {
            last_seen_epoch: snap.epoch,
            ..self.observe()
        };
        let present = snap.vms.iter().filter_map(|w| match w {
            WantedVm::Present(d) => Some(d.spec.vm_id.to_string()),
            WantedVm::Tombstoned(_) => None,
        });
        let refused = snap.rejected_vms.iter().map(|r| r.raw_id.clone());
        let mut said = HashSet::new();
        for vm_id in present.chain(refused) {
            if !said.insert(vm_id.clone()) {
                continue;
            }
            match report
                .vms
                .to_mut()
                .iter_mut()
                .find(|row| row.vm_id == vm_id)
            {
                Some(row) => {
                    let row = Arc::make_mut(row);
                    row.phase = Some(Phase::Failed);
                    row.last_error.clone_from(&reason);
                    row.status_detail.clear();
                }
                None => report.vms.push(Arc::new(VmStatus {
                    vm_id,
                    power: None,
                    phase: Some(Phase::Failed),
                    last_error: reason.clone(),
                    ..VmStatus::default()
                })),
            }
        }
        sort(&mut report, (0, 0));
        report
    }

    /// The row of a VM entry the agent refused. An entry for a VM this host
    /// does not have failed: nothing was made of it. A refused entry for a
    /// VM the host has changes nothing of the VM, which runs on under its
    /// last accepted spec: its row is what its worker last said (phase and
    /// all), with the refusal beside it in `spec_rejected`, not a failure
    /// (kubectl refusing a bad manifest leaves the pod as it was).
    fn rejected_row(
        &self,
        rejected: &Rejected,
        records: &BTreeMap<Id, RecordSlot>,
        workers: &Workers,
    ) -> VmStatus {
        let why = rejected.error.to_string();
        let rec = rejected.id.as_ref().and_then(|id| match records.get(id) {
            Some(RecordSlot::Readable(rec)) => Some(rec),
            _ => None,
        });
        let Some(rec) = rec else {
            return VmStatus {
                vm_id: rejected.raw_id.clone(),
                phase: Some(Phase::Failed),
                last_error: why,
                ..VmStatus::default()
            };
        };
        let said = workers.row_of(&rec.spec.vm_id);
        let mut row = match said {
            Some(row) => VmStatus::clone(&row),
            // No worker has said it yet (an agent that started with the
            // entry refused): what the host sees, and no phase.
            None => VmStatus {
                vm_id: rejected.raw_id.clone(),
                power: Some(PowerState::observed(
                    self.spine.ctx.backend.running(&rec.spec.vm_id),
                )),
                ip: rec.ip.clone(),
                network_ip: rec.network_ip.clone(),
                ssh_host_pubkey: rec.host_pubkey.clone(),
                ..VmStatus::default()
            },
        };
        row.spec_rejected = why;
        row
    }
}

impl Engine {
    /// The row a VM starts with when its worker is made, before its first
    /// pass has said anything: what its record says, or `queued` for a VM
    /// the host has never had. A VM to reap with no record has no row.
    fn initial_result(
        &self,
        vm_id: &Id,
        assignment: &Assignment,
        slot: Option<&RecordSlot>,
    ) -> Option<VmResult> {
        match (slot, assignment) {
            (Some(slot), _) => Some(self.spine.ctx.observed(vm_id, slot)),
            (None, Assignment::Desired { .. }) => Some(VmResult::queued(vm_id)),
            (None, Assignment::Reap { .. }) => None,
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.workers
            .get_mut()
            .stop_all(Deadline::after(Duration::from_secs(5)));
    }
}

/// What a step wakes: every VM's worker, or only those whose assignment
/// changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Trigger {
    /// Every VM is reconciled again, changed or not (the tick).
    Level,
    /// News between ticks: only the VMs it changes.
    News,
}

/// The ids refused entries claim: no pass creates or reaps under them.
fn claimed_ids(snap: &Snapshot) -> HashSet<&Id> {
    snap.rejected_vms
        .iter()
        .filter_map(|r| r.id.as_ref())
        .collect()
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
    let templates: HashSet<&Id> = snap
        .vms
        .iter()
        .filter_map(|w| match w {
            WantedVm::Present(d) if d.template => Some(&d.spec.vm_id),
            _ => None,
        })
        .collect();
    for wanted in &snap.vms {
        match wanted {
            WantedVm::Present(d) => {
                let template_wanted = d
                    .spec
                    .clone_of
                    .as_ref()
                    .is_some_and(|t| templates.contains(t));
                let vm = Arc::clone(d);
                out.insert(
                    &d.spec.vm_id,
                    Assignment::Desired {
                        vm,
                        template_wanted,
                    },
                );
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

/// Tombstoned VMs this host holds no record of.
fn destroyed_ack(snap: &Snapshot, records: &BTreeMap<Id, RecordSlot>) -> Vec<Id> {
    snap.vms
        .iter()
        .filter_map(|w| match w {
            WantedVm::Tombstoned(id) if !records.contains_key(id) => Some(id.clone()),
            _ => None,
        })
        .collect()
}

/// Orders a report by id, so reports diff cleanly from tick to tick. The
/// first `collected` rows and quarantined entries came from the workers in
/// id order; only what was added after them makes a sort necessary (at ten
/// thousand VMs, comparing rows that are in order already costs a tenth of
/// a step).
fn sort(report: &mut Report, collected: (usize, usize)) {
    if report.vms.len() > collected.0 {
        report.vms.to_mut().sort_by(|a, b| a.vm_id.cmp(&b.vm_id));
    }
    if report.quarantined.len() > collected.1 {
        report.quarantined.sort_by(|a, b| a.vm_id.cmp(&b.vm_id));
    }
    report.destroyed.sort();
}
