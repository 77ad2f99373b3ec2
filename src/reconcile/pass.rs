//! One VM's reconcile pass: the whole unit of work a worker runs.
//!
//! A pass is bounded by `vm_timeout` (its [`Deadline`]), loads only its own
//! VM's record, and either drives the VM toward desired (create or converge)
//! or reaps it. The only cross-VM state it touches that the engine owns is
//! the compute ledger; the image cache and the provisioner carry their own
//! locking.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::EngineConfig;
use super::admission::{CreateSlots, Ledger};
use super::lifecycle::{self, Budget, State};
use super::seams::{HostFacts, HostKeys, Images, SeedBuilder};
use crate::deadline::Deadline;
use crate::logonce::LogOnce;
use crate::model::{DesiredVm, Id, Phase, PowerState, QuarantinedVm, Report, VmStatus};
use crate::provision::Lifecycle;
use crate::stages::Stages;
use crate::state::{Record, RecordSlot, Store};

/// One VM's slice of a snapshot. It holds the desired spec by `Arc`: the
/// worker keeps it for as long as its pass runs, well past the step that
/// delivered it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Assignment {
    Desired(Arc<DesiredVm>),
    /// Absent from desired state (vanished) or tombstoned: reap it. The two
    /// differ in grace period, so the flag stays explicit.
    Reap {
        tombstoned: bool,
    },
}

/// One VM's contribution to the host report: at most one row, or one
/// quarantined entry.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct VmResult {
    pub row: Option<VmStatus>,
    pub quarantined: Option<QuarantinedVm>,
    /// Stamped on the row when merged. Kept apart because it is
    /// level-triggered: every row of a VM with a host key carries it, or the
    /// control plane would forget the guest's certificate for a tick.
    pub host_pubkey: String,
}

impl VmResult {
    /// The row of a VM the host does not have yet, waiting for its first
    /// pass: nothing runs (stopped), being created, `queued`.
    pub fn queued(vm_id: &Id) -> VmResult {
        VmResult {
            row: Some(VmStatus {
                vm_id: vm_id.to_string(),
                power: Some(PowerState::Stopped),
                phase: Some(Phase::Creating),
                status_detail: "queued".into(),
                ..VmStatus::default()
            }),
            ..VmResult::default()
        }
    }

    /// A row for a VM the agent could not work on and did not look at.
    pub(crate) fn failed_unobserved(vm_id: &Id, why: String) -> VmResult {
        VmResult {
            row: Some(VmStatus {
                vm_id: vm_id.to_string(),
                power: None,
                phase: Some(Phase::Failed),
                last_error: why,
                ..VmStatus::default()
            }),
            ..VmResult::default()
        }
    }

    /// Sets this VM's row (a later call in the same pass replaces it).
    pub fn report(
        &mut self,
        rec: &Record,
        power: Option<PowerState>,
        phase: Phase,
        last_error: impl Into<String>,
    ) {
        self.row = Some(VmStatus {
            vm_id: rec.spec.vm_id.to_string(),
            ip: rec.ip.clone(),
            network_ip: rec.network_ip.clone(),
            power,
            phase: Some(phase),
            last_error: last_error.into(),
            status_detail: String::new(),
            ssh_host_pubkey: String::new(),
            egress: String::new(),
            limits: String::new(),
            readiness: String::new(),
            spec_rejected: String::new(),
            published: Vec::new(),
            asleep: false,
            last_wake: String::new(),
        });
    }

    /// The row as reported: with the VM's host key.
    pub fn stamped_row(&self) -> Option<VmStatus> {
        self.row.as_ref().map(|row| VmStatus {
            ssh_host_pubkey: self.host_pubkey.clone(),
            ..row.clone()
        })
    }

    pub fn merge_into(mut self, report: &mut Report) {
        if let Some(mut row) = self.row.take() {
            row.ssh_host_pubkey = self.host_pubkey;
            report.vms.push(std::sync::Arc::new(row));
        }
        if let Some(q) = self.quarantined {
            report.quarantined.push(q);
        }
    }
}

/// One VM's pass as every verb of the engine takes it: its deadline, the
/// result it builds, and who is told what it is doing as it goes.
pub(crate) struct Pass<'a> {
    pub deadline: Deadline,
    pub res: &'a mut VmResult,
    pub publisher: Option<&'a Publisher>,
}

impl Pass<'_> {
    /// Who tells the VM's row, as `rec` at `power` and `phase`, what this
    /// pass is doing.
    pub(crate) fn narrator(&self, rec: &Record, power: PowerState, phase: Phase) -> Narrator {
        let mut template = VmResult {
            host_pubkey: self.res.host_pubkey.clone(),
            ..VmResult::default()
        };
        template.report(rec, Some(power), phase, "");
        Narrator {
            publisher: self.publisher.cloned(),
            deadline: self.deadline,
            template,
        }
    }
}

/// Publishes what a pass is doing right now, on the row the VM would
/// report anyway (for a create: creating, stopped, no error). `'static`
/// and cheap to clone, so it can ride the image cache's progress callback.
///
/// A narrator of a pass past its deadline says nothing: the polite half of
/// the guarantee. The load-bearing half is the publisher's generation
/// check, since a deadline passing and a pass ending are not one instant.
#[derive(Clone)]
pub(crate) struct Narrator {
    publisher: Option<Publisher>,
    deadline: Deadline,
    template: VmResult,
}

impl Narrator {
    pub(crate) fn say(&self, detail: &str) {
        let Some(publisher) = &self.publisher else {
            return;
        };
        if self.deadline.expired() {
            return;
        }
        let mut result = self.template.clone();
        if let Some(row) = &mut result.row {
            row.status_detail = detail.to_owned();
        }
        publisher.publish(result);
    }
}

/// How a pass ended.
pub(crate) enum PassOutcome {
    Done(VmResult),
    /// The pass did nothing (the record is unreadable). The VM's previous
    /// row stands; `fallback` is used only when it has none.
    Skipped {
        fallback: VmResult,
        why: String,
    },
}

/// What every pass shares: the store, the backend, the host, the
/// configuration, the admission ledger, the log memory and the counts;
/// and the state of the two verbs that keep some across passes, each in a
/// field of its own (creating, probing). Owned by the engine and each
/// worker through an `Arc`.
pub(crate) struct Core {
    pub store: Arc<Store>,
    pub prov: Arc<dyn Lifecycle>,
    pub host: Arc<dyn HostFacts>,
    pub config: EngineConfig,
    pub ledger: Ledger,
    /// Per-VM log memory (subjects `<vm_id>/<what>`): a VM failing the same
    /// way every pass is one line, not one a tick.
    pub logs: LogOnce,
    pub counts: super::counts::Counts,
    /// Told the stages of every timed pass (see [`Engine::watch_stages`](super::Engine::watch_stages)).
    pub create_watch: parking_lot::RwLock<Option<CreateWatch>>,
    /// What only a create uses (see `create.rs`).
    pub creates: Creates,
    /// What each VM's readiness probe knows (see `probe.rs`).
    pub probes: super::probing::Probes,
    /// The VMs asleep until traffic wakes them, and the running ones
    /// watched for idleness (see `sleep.rs`).
    pub sleepers: super::sleepers::Sleepers,
}

/// What only a create uses: where its image, seed and host key come from,
/// the slots that bound creates at once, and the creates that wait for
/// the host.
pub(crate) struct Creates {
    pub images: Arc<dyn Images>,
    pub seed: Arc<dyn SeedBuilder>,
    pub host_keys: Arc<dyn HostKeys>,
    pub slots: CreateSlots,
    /// The VMs whose create waits for the host to be fixed (a full
    /// filesystem, an image server out of reach, what the backend lacks),
    /// with what the row of each says: the host's condition while any waits.
    pub waiting: parking_lot::Mutex<std::collections::BTreeMap<Id, Waiting>>,
}

/// A VM whose create waits for the host to be fixed.
#[derive(Clone, Debug)]
pub(crate) struct Waiting {
    /// What its row says.
    pub said: String,
    /// For a full filesystem: how many bytes it had free when the create
    /// met it, and when. The create is tried again only once there is
    /// more room, or a while later (a quota, which the free bytes do not
    /// show, may have been raised): an attempt on an unchanged full disk
    /// would only fail again, and write its record twice doing so.
    pub full: Option<(u64, std::time::SystemTime)>,
}

/// What [`Engine::watch_stages`] is given: the VM and its create's stages.
///
/// [`Engine::watch_stages`]: super::Engine::watch_stages
pub type CreateWatch = Arc<dyn Fn(&Id, &Stages) + Send + Sync>;

/// The span of a counted create attempt, from its saved count to its end: a
/// pass with one is logged with all its stages (those before it too).
pub(crate) const CREATE_STAGE: &str = "create";
/// The spans of a suspend and of a resume: a pass with one is logged with
/// its stages too.
pub(crate) const SUSPEND_STAGE: &str = "suspend";
pub(crate) const RESUME_STAGE: &str = "resume";

/// Where a pass publishes its VM's row mid-pass: the worker's, under the
/// pass's generation (see `workers`), so a publish from a pass that is
/// over lands nowhere.
pub(crate) trait Publish: Send + Sync {
    fn publish(&self, result: VmResult);
}

/// A pass's publisher: cheap to clone and `'static`, so it can ride a
/// progress callback onto another thread.
pub(crate) type Publisher = Arc<dyn Publish>;

impl Core {
    /// After each pass: a pass that made a create attempt (or a suspend,
    /// a resume) logs how long it took, and at debug where the time went,
    /// and tells the watcher.
    pub(crate) fn timed_pass(&self, vm_id: &Id, stages: Stages) {
        let Some(what) = [
            (CREATE_STAGE, "create attempt"),
            (SUSPEND_STAGE, "suspend"),
            (RESUME_STAGE, "resume"),
        ]
        .into_iter()
        .find(|(stage, _)| stages.marks.iter().any(|m| m.stage == *stage))
        .map(|(_, what)| what) else {
            return;
        };
        log::info!(
            "VM {vm_id}: {what} took {:.1} ms",
            stages.total.as_secs_f64() * 1e3
        );
        log::debug!("VM {vm_id}: {what} stages: {stages}");
        if let Some(watch) = self.create_watch.read().as_ref() {
            watch(vm_id, &stages);
        }
    }

    pub(crate) fn reconcile_one(
        &self,
        vm_id: &Id,
        assignment: &Assignment,
        publisher: Option<&Publisher>,
    ) -> PassOutcome {
        let deadline = Deadline::from_timeout(self.config.vm_timeout);
        let rec = match self.store.get(vm_id) {
            Ok(rec) => rec,
            Err(e) => {
                // While this lasts the VM's row is frozen, so the log is the
                // operator's signal; the worker logs it once per change.
                let why = crate::error::chain(&e);
                return PassOutcome::Skipped {
                    fallback: VmResult::failed_unobserved(vm_id, why.clone()),
                    why,
                };
            }
        };
        let mut res = VmResult {
            host_pubkey: rec
                .as_ref()
                .map(|r| r.host_pubkey.clone())
                .unwrap_or_default(),
            ..VmResult::default()
        };
        let mut pass = Pass {
            deadline,
            res: &mut res,
            publisher,
        };
        match assignment {
            Assignment::Desired(desired) => {
                let rec = rec.map(|r| (*r).clone());
                self.drive(desired, rec, &mut pass);
            }
            Assignment::Reap { tombstoned } => {
                if let Some(rec) = rec {
                    self.reap((*rec).clone(), *tombstoned, &mut pass);
                }
            }
        }
        PassOutcome::Done(res)
    }

    /// Drives a desired VM by the state its record is in: a create not yet
    /// done (the boot id is its completion witness, written only after
    /// every side effect succeeded; a disk left by a create that died before
    /// boot is none), a created VM to converge, or a quarantined VM back in
    /// desired state, which leaves quarantine and is driven as what it was.
    fn drive(&self, desired: &DesiredVm, rec: Option<Record>, pass: &mut Pass<'_>) {
        let vm_id = &desired.spec.vm_id;
        let mut rec = rec.map(|rec| self.note_egress(desired, rec));
        let wanted = self.with_sleep(desired, rec.as_mut(), pass);
        let held = self.prov.set_egress(vm_id, &desired.egress);
        // Rules this host cannot hold keep a VM that is not running from
        // starting: a guest meant to be fenced in is never let out
        // unfenced. One already running keeps the rules it has.
        if let Err(e) = &held
            && e.is_host_condition()
            && !self.prov.running(vm_id)
        {
            return self.refuse_unfenced(vm_id, &**e, rec.as_ref(), pass.res);
        }
        self.drive_lifecycle(&wanted, rec, pass);
        self.after_sleep(desired, pass);
        let published = self.publish(desired);
        self.probe(pass.deadline, desired, pass.res);
        self.say_unserved(vm_id, pass.res);
        self.say_what_it_is_held_to(desired, held, pass.res);
        self.say_published(vm_id, published, pass.res);
    }

    /// A running VM whose network is not served (adopted while it could
    /// not be plugged, or its tap gone) is not ready, whatever its guest
    /// says: it cannot be reached. Its row says why; serving it is tried
    /// again at its every pass.
    fn say_unserved(&self, vm_id: &Id, res: &mut VmResult) {
        let Some(row) = res.row.as_mut() else {
            return;
        };
        if row.power != Some(PowerState::Running) {
            return;
        }
        if let Err(e) = self.prov.network_served(vm_id) {
            let why = crate::error::chain(&*e as &dyn std::error::Error);
            self.logs.warn(
                &format!("{vm_id}/unserved"),
                &format!("VM {vm_id}: its network is not served: {why}"),
            );
            row.phase = Some(Phase::Failed);
            row.last_error = format!("its network is not served: {why}");
        } else {
            self.logs.clear(&format!("{vm_id}/unserved"));
        }
    }

    fn drive_lifecycle(&self, desired: &DesiredVm, rec: Option<Record>, pass: &mut Pass<'_>) {
        let Some(mut rec) = rec else {
            return self.create(desired, None, pass);
        };
        match lifecycle::state(&rec, self.budget()) {
            State::Creating(_) => self.create(desired, Some(&rec), pass),
            State::Up | State::Down | State::Suspending | State::Suspended | State::Resuming => {
                self.converge(desired, rec, pass)
            }
            State::Quarantined { .. } => {
                rec.unquarantine();
                let vm_id = &rec.spec.vm_id;
                if let Err(e) = self.store.save(&rec) {
                    self.logs.warn(
                        &format!("{vm_id}/unquarantine"),
                        &format!("VM {vm_id}: cannot save its return from quarantine: {e}"),
                    );
                }
                log::info!("VM {vm_id}: back in desired state, leaving quarantine");
                self.drive(desired, Some(rec), pass);
            }
        }
    }

    /// How creates are paced.
    pub(crate) fn budget(&self) -> Budget {
        Budget {
            max_attempts: self.config.max_create_attempts,
            rearm: self.config.create_rearm,
        }
    }

    /// Sets `res` to what the record says: its quarantined entry, or its
    /// row with the lifecycle's phase, its error and how long a create waits
    /// (the same derivation for every report, made with a pass or without).
    pub(crate) fn report_recorded(&self, res: &mut VmResult, rec: &Record, power: PowerState) {
        let budget = self.budget();
        match lifecycle::phase(rec, budget) {
            None => res.quarantined = Some(quarantined_entry(rec, self.grace_for(rec))),
            Some(phase) => {
                res.report(
                    rec,
                    Some(power),
                    phase,
                    rec.lifecycle.last_error().to_owned(),
                );
                // Only a create waits for anything the row should time.
                if rec.lifecycle.boot_id().is_empty()
                    && let Some(row) = &mut res.row
                {
                    row.status_detail = lifecycle::detail(rec, budget, self.host.now());
                }
            }
        }
    }

    /// What the host has for a VM, from its record and the backend's
    /// liveness, changing nothing: its quarantined entry, or its row.
    pub(crate) fn observed(&self, vm_id: &Id, slot: &RecordSlot) -> VmResult {
        let rec = match slot {
            RecordSlot::Readable(rec) => rec,
            RecordSlot::Unreadable(problem) => {
                return VmResult::failed_unobserved(vm_id, format!("record unreadable: {problem}"));
            }
        };
        let mut res = VmResult {
            host_pubkey: rec.host_pubkey.clone(),
            ..VmResult::default()
        };
        let power = if rec.lifecycle.quarantined_at().is_some() {
            PowerState::Stopped
        } else if rec.lifecycle.suspension().saved().is_some() {
            PowerState::Suspended
        } else {
            PowerState::observed(self.prov.running(vm_id))
        };
        self.report_recorded(&mut res, rec, power);
        res
    }

    /// The row a VM starts with when its worker is made, before its first
    /// pass has said anything: what its record says, or `queued` for a VM
    /// the host has never had. A VM to reap with no record has no row.
    pub(crate) fn initial_result(
        &self,
        vm_id: &Id,
        assignment: &Assignment,
        slot: Option<&RecordSlot>,
    ) -> Option<VmResult> {
        match (slot, assignment) {
            (Some(slot), _) => Some(self.observed(vm_id, slot)),
            (None, Assignment::Desired(_)) => Some(VmResult::queued(vm_id)),
            (None, Assignment::Reap { .. }) => None,
        }
    }

    /// Logs a VM's failure once per change (see [`LogOnce`]).
    pub(crate) fn log_failure(&self, vm_id: &Id, what: &str, error: &str) {
        self.logs.warn(
            &format!("{vm_id}/{what}"),
            &format!("VM {vm_id}: {what}: {error}"),
        );
    }

    /// Forgets what was logged about a VM: it recovered, or is gone, so the
    /// same failure later is news again.
    pub(crate) fn forget_logs(&self, vm_id: &Id) {
        self.logs.clear_prefix(&format!("{vm_id}/"));
    }

    /// Folds the backend's current answers for the VM's addresses into
    /// `rec`, reporting whether either changed. Polled, not returned by boot:
    /// the second NIC's address is granted by someone else's DHCP server and
    /// arrives after boot.
    pub(crate) fn note_address(&self, rec: &mut Record) -> bool {
        let mut changed = false;
        if let Some(ip) = self.prov.address(&rec.spec.vm_id).map(|ip| ip.to_string())
            && ip != rec.ip
        {
            rec.ip = ip;
            changed = true;
        }
        if let Some(ip) = self
            .prov
            .network_address(&rec.spec.vm_id)
            .map(|ip| ip.to_string())
            && ip != rec.network_ip
        {
            rec.network_ip = ip;
            changed = true;
        }
        changed
    }

    pub(crate) fn grace_for(&self, rec: &Record) -> Duration {
        if rec.lifecycle.quarantine_tombstoned() {
            self.config.tombstone_grace
        } else {
            self.config.vanish_grace
        }
    }

    /// The protocol every side effect of a pass follows: the intent `rec`
    /// now holds is saved before it (see [`Core::save_intent`]), the crash
    /// point `saved` marks the moment, and the row's narrator, as `rec` at
    /// `power`, is handed back to tell what is under way. `None` when the
    /// intent could not be saved: nothing is to be done.
    pub(crate) fn intend(
        &self,
        rec: &Record,
        doing: &str,
        power: PowerState,
        saved: crate::crash::Point,
        pass: &mut Pass<'_>,
    ) -> Option<Narrator> {
        if !self.save_intent(rec, doing, power, pass) {
            return None;
        }
        saved.hit();
        Some(pass.narrator(rec, power, Phase::Ready))
    }

    /// Saves the intent `rec` now holds, before its side effect (a crash
    /// after reads as that intent, never as a crash of the guest). If it
    /// cannot be saved nothing is done: the failure is logged (once per
    /// change) as not `doing` it, the row says so with `power` (the record
    /// is unchanged, and this error cannot be saved either), and false is
    /// returned.
    pub(crate) fn save_intent(
        &self,
        rec: &Record,
        doing: &str,
        power: PowerState,
        pass: &mut Pass<'_>,
    ) -> bool {
        let Err(e) = self.store.save(rec) else {
            return true;
        };
        self.intent_failed(rec, doing, power, &crate::error::chain(&e), pass);
        false
    }

    /// An intent that could not be saved, `why`: nothing was done. Logged
    /// once per change as not `doing` it; the row says so with `power`.
    pub(crate) fn intent_failed(
        &self,
        rec: &Record,
        doing: &str,
        power: PowerState,
        why: &str,
        pass: &mut Pass<'_>,
    ) {
        let vm_id = &rec.spec.vm_id;
        self.logs.error(
            &format!("{vm_id}/{doing}"),
            &format!("VM {vm_id}: not {doing} it: {why}"),
        );
        pass.res.report(rec, Some(power), Phase::Failed, why);
    }

    /// Saves a record whose save failing changes nothing this pass decides.
    /// The failure is logged, and the next pass writes the record again.
    pub(crate) fn save_best_effort(&self, rec: &Record) {
        let vm_id = &rec.spec.vm_id;
        if let Err(e) = self.store.save(rec) {
            self.logs.error(
                &format!("{vm_id}/save"),
                &format!("VM {vm_id}: {}", crate::error::chain(&e)),
            );
        }
    }
}

/// The quarantined entry for a record: its spec as JSON, so the control
/// plane can restore it, and when it will be destroyed.
pub(crate) fn quarantined_entry(rec: &Record, grace: Duration) -> QuarantinedVm {
    let since = rec.lifecycle.quarantined_at().unwrap_or(UNIX_EPOCH);
    let destroy_at = since
        .checked_add(grace)
        .unwrap_or(since)
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    QuarantinedVm {
        vm_id: rec.spec.vm_id.clone(),
        name: rec.spec.name.clone(),
        vmspec_json: serde_json::to_vec(&rec.spec).unwrap_or_default(),
        destroy_at_unix: destroy_at,
    }
}

/// Whether `grace` has passed since `since`. A clock that went backwards
/// counts as no time passed: destroying early is the worse mistake.
pub(crate) fn grace_expired(since: SystemTime, now: SystemTime, grace: Duration) -> bool {
    now.duration_since(since).unwrap_or(Duration::ZERO) >= grace
}
