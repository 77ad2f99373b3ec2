//! Fakes of every engine seam, for engine tests and benchmarks.
//!
//! [`Fakes`] implements the provisioner, image cache, seed builder, host-key
//! store and host facts at once, so a test sees every call in one ordered
//! log. Each operation can be told, per VM (per URL for images), to fail
//! transiently or permanently, to panic, or to block at a [`Gate`] until the
//! test releases it or the pass's deadline passes. The fakes are passed to
//! the engine through [`Fakes::seams`]; nothing in the agent switches on
//! them.

pub mod bare;
pub mod control_plane;
pub mod image_server;
pub mod logs;
pub mod net;
pub mod sources;
pub mod tmpfs;
pub mod tools;

use std::collections::{HashMap, HashSet};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::{Condvar, Mutex};

use crate::deadline::Deadline;
use crate::error::{BoxFailure, DeadlineExpired, Simple};
use crate::model::{DesiredVm, Id, PowerState, Saved, Snapshot, VmSpec, WantedVm};
use crate::provision::{ExitListener, Holds, Lifecycle, SavedGuest, Say, Spend, Suspend};
use crate::reconcile::Seams;
use crate::reconcile::seams::{
    HostFacts, HostKey, HostKeys, Images, Progress, SeedBuilder, SeedParams,
};

/// An operation a fake can be told how to behave in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Preflight,
    Resolve,
    PrepareRootDisk,
    Seed,
    HostKey,
    Boot,
    Shutdown,
    Destroy,
    Suspend,
    Resume,
    /// A resume's guest set running, once its `spend` agreed.
    Run,
    Resumable,
}

/// One call a fake received, in order across all seams.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    Preflight,
    Resolve {
        url: String,
    },
    PrepareRootDisk(Id),
    Seed(Box<SeedParams>),
    HostKey(PathBuf),
    Boot(Id),
    Shutdown(Id),
    Destroy(Id),
    Suspend(Id),
    Resume(Id),
    /// A resume whose `spend` refused: its guest never ran.
    ResumeRefused(Id),
    DiscardSuspension(Id),
    Suspension(Id),
    Running(Id),
    FailureReason(Id),
    Address(Id),
    NetworkAddress(Id),
}

impl Call {
    /// Whether the call asks rather than acts.
    pub fn is_query(&self) -> bool {
        matches!(
            self,
            Call::Running(_)
                | Call::FailureReason(_)
                | Call::Address(_)
                | Call::NetworkAddress(_)
                | Call::Suspension(_)
        )
    }
}

/// A barrier a fake call waits at until the test opens it, or until the
/// pass's deadline passes (then the call fails as a deadline error would).
#[derive(Default)]
pub struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Default)]
struct GateState {
    open: bool,
    entered: usize,
}

impl Gate {
    pub fn new() -> Arc<Gate> {
        Arc::new(Gate::default())
    }

    pub fn release(&self) {
        self.state.lock().open = true;
        self.changed.notify_all();
    }

    /// How many calls have arrived at this gate so far.
    pub fn entered(&self) -> usize {
        self.state.lock().entered
    }

    /// Waits until `n` calls have arrived, at most `timeout`; returns
    /// whether they did. A bound for a test to fail on, not a measurement.
    pub fn wait_entered(&self, n: usize, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        let mut state = self.state.lock();
        while state.entered < n {
            if self.changed.wait_until(&mut state, until).timed_out() {
                return state.entered >= n;
            }
        }
        true
    }

    fn pass(&self, deadline: Deadline, honor_deadline: bool) -> Result<(), DeadlineExpired> {
        let deadline = if honor_deadline {
            deadline
        } else {
            Deadline::NONE
        };
        let mut state = self.state.lock();
        state.entered += 1;
        self.changed.notify_all();
        while !state.open {
            match deadline.instant() {
                Some(at) => {
                    if self.changed.wait_until(&mut state, at).timed_out() && !state.open {
                        return Err(DeadlineExpired {
                            waiting_for: "blocked in a fake call",
                        });
                    }
                }
                None => self.changed.wait(&mut state),
            }
        }
        Ok(())
    }
}

/// (bytes done, total when known), as a download reports it.
pub type ProgressStep = (u64, Option<u64>);

#[derive(Clone, Default)]
struct Rule {
    fail: Option<Simple>,
    gate: Option<Arc<Gate>>,
    /// The gate is waited at even past the pass's deadline: a stuck call.
    stalls: bool,
    panic: bool,
}

/// What the fake says a VM's addresses are.
#[derive(Clone, Copy, Default)]
struct Addresses {
    underlay: Option<Ipv4Addr>,
    network: Option<Ipv4Addr>,
}

/// Every seam, faked. See the module docs.
pub struct Fakes {
    calls: Mutex<Vec<Call>>,
    rules: Mutex<HashMap<(Op, String), Rule>>,
    running: Mutex<HashSet<Id>>,
    /// What holds each suspended VM's guest: a suspend puts it here, a
    /// resume takes it (and runs the VM), a discard removes it.
    saved: Mutex<HashMap<Id, SavedGuest>>,
    addresses: Mutex<HashMap<Id, Addresses>>,
    reasons: Mutex<HashMap<Id, String>>,
    progress: Mutex<HashMap<String, Vec<ProgressStep>>>,
    callbacks: Mutex<HashMap<String, Progress>>,
    in_flight: Mutex<HashMap<Op, (usize, usize)>>,
    busy: Mutex<HashMap<Op, Duration>>,
    boot_id: Mutex<String>,
    now: Mutex<SystemTime>,
    delay: Mutex<Duration>,
    keys_made: AtomicU64,
    recording: std::sync::atomic::AtomicBool,
    exits: Mutex<Option<ExitListener>>,
    /// Each VM's own egress rules as last set (not a [`Call`]: set on
    /// every pass, they would crowd every test's list of calls).
    egress: Mutex<HashMap<Id, crate::model::Egress>>,
    egress_refused: std::sync::atomic::AtomicBool,
    /// Each VM's published ports as granted (not a [`Call`], as egress).
    published: Mutex<HashMap<Id, Vec<crate::model::Publish>>>,
    /// Host ports refused to any VM that asks (see [`Fakes::refuse_port`]).
    ports_refused: Mutex<Vec<u16>>,
    /// What a VM's root disk is said to leave to sync (see
    /// [`Fakes::root_disk_at`]); nothing for the others.
    made: Mutex<HashMap<Id, std::path::PathBuf>>,
}

impl Fakes {
    pub fn new() -> Arc<Fakes> {
        Arc::new(Fakes {
            calls: Mutex::new(Vec::new()),
            rules: Mutex::new(HashMap::new()),
            running: Mutex::new(HashSet::new()),
            saved: Mutex::new(HashMap::new()),
            addresses: Mutex::new(HashMap::new()),
            reasons: Mutex::new(HashMap::new()),
            progress: Mutex::new(HashMap::new()),
            callbacks: Mutex::new(HashMap::new()),
            in_flight: Mutex::new(HashMap::new()),
            busy: Mutex::new(HashMap::new()),
            boot_id: Mutex::new("boot-1".into()),
            now: Mutex::new(SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000)),
            delay: Mutex::new(Duration::ZERO),
            keys_made: AtomicU64::new(0),
            recording: std::sync::atomic::AtomicBool::new(true),
            exits: Mutex::new(None),
            egress: Mutex::new(HashMap::new()),
            egress_refused: std::sync::atomic::AtomicBool::new(false),
            published: Mutex::new(HashMap::new()),
            ports_refused: Mutex::new(Vec::new()),
            made: Mutex::new(HashMap::new()),
        })
    }

    /// `vm_id`'s root disk is said to be made at `path`, not yet durable:
    /// the create syncs it (a path that is not there fails that sync).
    pub fn root_disk_at(&self, vm_id: &Id, path: &Path) {
        self.made.lock().insert(vm_id.clone(), path.to_path_buf());
    }

    /// The engine's seams, all served by these fakes.
    pub fn seams(self: &Arc<Self>) -> Seams {
        Seams {
            provisioner: Arc::clone(self) as Arc<dyn Lifecycle>,
            images: Arc::clone(self) as Arc<dyn Images>,
            seed: Arc::clone(self) as Arc<dyn SeedBuilder>,
            host_keys: Arc::clone(self) as Arc<dyn HostKeys>,
            host: Arc::clone(self) as Arc<dyn HostFacts>,
        }
    }

    // ── telling the fakes what to do ─────────────────────────────────────

    /// `op` for `key` (a VM id; the URL for `Resolve`; "" for `Preflight`)
    /// fails with a transient error from now on.
    pub fn fail(&self, op: Op, key: &str, message: &str) {
        self.rule(op, key).fail = Some(Simple::transient(message));
    }

    pub fn fail_permanently(&self, op: Op, key: &str, message: &str) {
        self.rule(op, key).fail = Some(Simple::permanent(message));
    }

    /// `op` fails with a host condition: the host must change.
    pub fn fail_on_host(&self, op: Op, key: &str, message: &str) {
        self.rule(op, key).fail = Some(Simple::host(message));
    }

    pub fn panic_in(&self, op: Op, key: &str) {
        self.rule(op, key).panic = true;
    }

    /// `op` for `key` blocks at the returned gate until it is released or
    /// the pass's deadline passes.
    pub fn block(&self, op: Op, key: &str) -> Arc<Gate> {
        let gate = Gate::new();
        self.rule(op, key).gate = Some(Arc::clone(&gate));
        gate
    }

    /// Like [`Fakes::block`], but the call ignores the pass's deadline too:
    /// a backend call that is stuck.
    pub fn stall(&self, op: Op, key: &str) -> Arc<Gate> {
        let gate = self.block(op, key);
        self.rule(op, key).stalls = true;
        gate
    }

    /// Makes `op` for `key` behave normally again.
    pub fn clear(&self, op: Op, key: &str) {
        self.rules.lock().remove(&(op, key.to_owned()));
    }

    fn rule(&self, op: Op, key: &str) -> parking_lot::MappedMutexGuard<'_, Rule> {
        parking_lot::MutexGuard::map(self.rules.lock(), |rules| {
            rules.entry((op, key.to_owned())).or_default()
        })
    }

    /// Stops (or resumes) logging calls: a benchmark making millions of
    /// calls would otherwise measure the log's memory.
    pub fn set_recording(&self, on: bool) {
        self.recording.store(on, Ordering::Relaxed);
    }

    /// Every fake call sleeps this long first (for benchmarks).
    pub fn set_delay(&self, delay: Duration) {
        *self.delay.lock() = delay;
    }

    /// The VM's hypervisor dies and, as a real backend's reaper does, the
    /// fake tells the engine at once (see [`Lifecycle::watch_exits`]).
    pub fn kill(&self, vm_id: &Id) {
        self.running.lock().remove(vm_id);
        let listener = self.exits.lock().clone();
        if let Some(listener) = listener {
            listener(vm_id);
        }
    }

    /// The VM's hypervisor dies (or comes back) behind the agent's back,
    /// unnoticed until the engine next asks: a backend with no exit watch.
    pub fn set_running(&self, vm_id: &Id, running: bool) {
        let mut set = self.running.lock();
        if running {
            set.insert(vm_id.clone());
        } else {
            set.remove(vm_id);
        }
    }

    /// What holds the VM's suspended guest from now on (`None`: nothing,
    /// as if its saved state were deleted behind the agent's back).
    pub fn set_saved(&self, vm_id: &Id, saved: Option<SavedGuest>) {
        let mut all = self.saved.lock();
        match saved {
            Some(saved) => all.insert(vm_id.clone(), saved),
            None => all.remove(vm_id),
        };
    }

    /// What holds the VM's suspended guest now, as the fake has it.
    pub fn saved(&self, vm_id: &Id) -> Option<SavedGuest> {
        self.saved.lock().get(vm_id).cloned()
    }

    /// The addresses the fake reports for the VM; "" for none. A text that
    /// is not an address panics: the fakes are for tests.
    pub fn set_addresses(&self, vm_id: &Id, ip: &str, network_ip: &str) {
        let parse = |text: &str| {
            (!text.is_empty()).then(|| text.parse().unwrap_or_else(|e| panic!("{text:?}: {e}")))
        };
        let addresses = Addresses {
            underlay: parse(ip),
            network: parse(network_ip),
        };
        self.addresses.lock().insert(vm_id.clone(), addresses);
    }

    pub fn set_failure_reason(&self, vm_id: &Id, reason: &str) {
        self.reasons.lock().insert(vm_id.clone(), reason.to_owned());
    }

    /// Progress the image fake reports for `url` before it returns (or
    /// blocks).
    pub fn set_progress(&self, url: &str, steps: Vec<ProgressStep>) {
        self.progress.lock().insert(url.to_owned(), steps);
    }

    /// The progress callback the engine handed over for `url`, so a test can
    /// fire it late, as a shared download thread would.
    pub fn progress_callback(&self, url: &str) -> Option<Progress> {
        self.callbacks.lock().get(url).cloned()
    }

    pub fn set_boot_id(&self, boot_id: &str) {
        *self.boot_id.lock() = boot_id.to_owned();
    }

    pub fn advance_clock(&self, by: Duration) {
        *self.now.lock() += by;
    }

    // ── reading what happened ────────────────────────────────────────────

    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().clone()
    }

    /// From now on, like a host without nft: egress rules are refused as
    /// a host condition.
    pub fn refuse_egress(&self) {
        self.egress_refused.store(true, Ordering::SeqCst);
    }

    /// From now on, host port `port` is refused to any VM that asks for
    /// it, as another VM's.
    pub fn refuse_port(&self, port: u16) {
        self.ports_refused.lock().push(port);
    }

    /// The VM's own egress rules as the engine last set them.
    pub fn egress_of(&self, vm: &str) -> Option<crate::model::Egress> {
        self.egress.lock().get(&id(vm)).cloned()
    }

    /// Calls that act on the host (not queries such as `running`).
    pub fn actions(&self) -> Vec<Call> {
        self.calls().into_iter().filter(|c| !c.is_query()).collect()
    }

    pub fn count(&self, pred: impl Fn(&Call) -> bool) -> usize {
        self.calls.lock().iter().filter(|c| pred(c)).count()
    }

    pub fn forget_calls(&self) {
        self.calls.lock().clear();
    }

    /// The time calls of `op` took in all, summed over calls: what a
    /// benchmark's ideal is computed from, so the fake's own inaccuracy
    /// (a 2 ms sleep takes a little longer) is not charged to the engine.
    pub fn busy_time(&self, op: Op) -> Duration {
        self.busy.lock().get(&op).copied().unwrap_or_default()
    }

    /// The most calls of `op` that were ever in progress at once.
    pub fn max_concurrent(&self, op: Op) -> usize {
        self.in_flight.lock().get(&op).map_or(0, |&(_, max)| max)
    }

    // ── the behaviour every fake call shares ─────────────────────────────

    fn record(&self, call: Call) {
        if self.recording.load(Ordering::Relaxed) {
            self.calls.lock().push(call);
        }
    }

    fn act(&self, op: Op, key: &str, deadline: Deadline) -> Result<(), BoxFailure> {
        {
            let mut flight = self.in_flight.lock();
            let entry = flight.entry(op).or_default();
            entry.0 += 1;
            entry.1 = entry.1.max(entry.0);
        }
        let started = Instant::now();
        let result = self.behave(op, key, deadline);
        *self.busy.lock().entry(op).or_default() += started.elapsed();
        if let Some(entry) = self.in_flight.lock().get_mut(&op) {
            entry.0 -= 1;
        }
        result
    }

    fn behave(&self, op: Op, key: &str, deadline: Deadline) -> Result<(), BoxFailure> {
        let delay = *self.delay.lock();
        if !delay.is_zero() {
            precise_sleep(delay);
        }
        let rule = self
            .rules
            .lock()
            .get(&(op, key.to_owned()))
            .cloned()
            .unwrap_or_default();
        if let Some(gate) = rule.gate {
            gate.pass(deadline, !rule.stalls)?;
        }
        if rule.panic {
            panic!("injected panic in {op:?} for {key}");
        }
        match rule.fail {
            Some(err) => Err(err.into()),
            None => Ok(()),
        }
    }
}

/// Sleeps `d` without the kernel's wake-up lateness: a sleep of 2 ms runs
/// 2.07 ms on a small VM (the calibration `make bench-engine` prints), an
/// error the fake would otherwise charge to
/// whatever it is timing. Sleeps to just short of the target, then spins.
fn precise_sleep(d: Duration) {
    const SPIN: Duration = Duration::from_micros(150);
    let until = Instant::now() + d;
    std::thread::sleep(d.saturating_sub(SPIN));
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

impl Lifecycle for Fakes {
    fn preflight(&self, deadline: Deadline) -> Result<(), BoxFailure> {
        self.record(Call::Preflight);
        self.act(Op::Preflight, "", deadline)
    }

    fn prepare_root_disk(
        &self,
        spec: &VmSpec,
        _base: &Path,
        deadline: Deadline,
    ) -> Result<crate::state::atomic::Pending, BoxFailure> {
        self.record(Call::PrepareRootDisk(spec.vm_id.clone()));
        self.act(Op::PrepareRootDisk, spec.vm_id.as_str(), deadline)?;
        Ok(match self.made.lock().get(&spec.vm_id) {
            Some(path) => crate::state::atomic::Pending::file(path),
            None => crate::state::atomic::Pending::none(),
        })
    }

    fn boot(&self, spec: &VmSpec, deadline: Deadline) -> Result<(), BoxFailure> {
        self.record(Call::Boot(spec.vm_id.clone()));
        self.act(Op::Boot, spec.vm_id.as_str(), deadline)?;
        self.running.lock().insert(spec.vm_id.clone());
        Ok(())
    }

    fn shutdown(&self, vm_id: &Id, deadline: Deadline, say: Say<'_>) -> Result<(), BoxFailure> {
        self.record(Call::Shutdown(vm_id.clone()));
        say("stopping: pressing the power button");
        self.act(Op::Shutdown, vm_id.as_str(), deadline)?;
        self.running.lock().remove(vm_id);
        Ok(())
    }

    fn destroy(&self, vm_id: &Id, deadline: Deadline) -> Result<(), BoxFailure> {
        self.record(Call::Destroy(vm_id.clone()));
        self.act(Op::Destroy, vm_id.as_str(), deadline)?;
        self.running.lock().remove(vm_id);
        Ok(())
    }

    fn running(&self, vm_id: &Id) -> bool {
        self.record(Call::Running(vm_id.clone()));
        self.running.lock().contains(vm_id)
    }

    fn failure_reason(&self, vm_id: &Id) -> Option<String> {
        self.record(Call::FailureReason(vm_id.clone()));
        self.reasons.lock().get(vm_id).cloned()
    }

    fn address(&self, vm_id: &Id) -> Option<Ipv4Addr> {
        self.record(Call::Address(vm_id.clone()));
        self.addresses.lock().get(vm_id).and_then(|a| a.underlay)
    }

    fn network_address(&self, vm_id: &Id) -> Option<Ipv4Addr> {
        self.record(Call::NetworkAddress(vm_id.clone()));
        self.addresses.lock().get(vm_id).and_then(|a| a.network)
    }

    fn watch_exits(&self, listener: ExitListener) {
        *self.exits.lock() = Some(listener);
    }

    fn suspender(&self) -> Option<&dyn Suspend> {
        Some(self)
    }

    fn holds(&self) -> Option<&dyn Holds> {
        Some(self)
    }
}

impl Suspend for Fakes {
    /// Saves 64 MiB "taken" now and stops the VM's hypervisor, as the
    /// cloud-hypervisor backend does.
    fn suspend(&self, vm_id: &Id, deadline: Deadline, say: Say<'_>) -> Result<Saved, BoxFailure> {
        self.record(Call::Suspend(vm_id.clone()));
        say("suspending: saving the guest's state");
        self.act(Op::Suspend, vm_id.as_str(), deadline)?;
        let taken_at_ms = self
            .now
            .lock()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let saved = Saved {
            taken_at_ms,
            bytes: 64 << 20,
            in_memory: false,
        };
        self.saved
            .lock()
            .insert(vm_id.clone(), SavedGuest::Usable(saved));
        self.running.lock().remove(vm_id);
        Ok(saved)
    }

    /// Runs a live hypervisor on, or one restored from a usable saved
    /// state, which it then takes; either only once `spend` agrees (a
    /// refusal is recorded as [`Call::ResumeRefused`], the saved state
    /// kept).
    fn resume(
        &self,
        spec: &VmSpec,
        deadline: Deadline,
        spend: Spend<'_>,
    ) -> Result<(), BoxFailure> {
        let vm_id = &spec.vm_id;
        self.record(Call::Resume(vm_id.clone()));
        self.act(Op::Resume, vm_id.as_str(), deadline)?;
        let live = self.running.lock().contains(vm_id);
        match (live, self.saved.lock().get(vm_id)) {
            (true, _) | (false, Some(SavedGuest::Usable(_))) => {}
            (false, Some(SavedGuest::Unusable(why))) => {
                return Err(Simple::transient(why.clone()).into());
            }
            (false, None) => return Err(Simple::transient("no saved state to resume").into()),
        }
        if let Err(e) = spend() {
            self.record(Call::ResumeRefused(vm_id.clone()));
            return Err(e);
        }
        self.act(Op::Run, vm_id.as_str(), deadline)?;
        self.saved.lock().remove(vm_id);
        self.running.lock().insert(vm_id.clone());
        Ok(())
    }

    /// What a test scripted for `Op::Resumable` (nothing: it can).
    fn resumable(&self, spec: &VmSpec) -> Result<(), BoxFailure> {
        self.act(Op::Resumable, spec.vm_id.as_str(), Deadline::NONE)
    }

    fn suspension(&self, vm_id: &Id) -> Option<SavedGuest> {
        self.record(Call::Suspension(vm_id.clone()));
        self.saved.lock().get(vm_id).cloned()
    }

    fn discard_suspension(&self, vm_id: &Id, _deadline: Deadline) -> Result<(), BoxFailure> {
        self.record(Call::DiscardSuspension(vm_id.clone()));
        self.saved.lock().remove(vm_id);
        Ok(())
    }
}

impl Holds for Fakes {
    fn set_egress(&self, vm_id: &Id, egress: &crate::model::Egress) -> Result<(), BoxFailure> {
        if self.egress_refused.load(Ordering::SeqCst) && !egress.is_open() {
            return Err(crate::error::Simple::host("the fake host holds no egress rules").into());
        }
        self.egress.lock().insert(vm_id.clone(), egress.clone());
        Ok(())
    }

    fn egress_in_force(&self, vm_id: &Id) -> Option<crate::model::Egress> {
        self.egress
            .lock()
            .get(vm_id)
            .filter(|e| !e.is_open())
            .cloned()
    }

    /// The spec's own: the fake host has no defaults.
    fn limits_in_force(&self, spec: &VmSpec) -> Option<crate::model::VmLimits> {
        Some(spec.limits)
    }

    /// Every port is granted, unless `ports_refused` names it: refused as
    /// another VM's (a permanent error).
    fn set_published(
        &self,
        vm_id: &Id,
        wanted: &[crate::model::Publish],
    ) -> Result<(), BoxFailure> {
        let refused = self.ports_refused.lock().clone();
        let (granted, denied): (Vec<_>, Vec<_>) =
            wanted.iter().partition(|p| !refused.contains(&p.host_port));
        self.published.lock().insert(vm_id.clone(), granted);
        match denied.first() {
            None => Ok(()),
            Some(p) => Err(crate::error::Simple::permanent(format!(
                "{}: the fake host gave it to another VM",
                p.host_side()
            ))
            .into()),
        }
    }

    fn published(&self, vm_id: &Id) -> Vec<crate::model::Publish> {
        self.published
            .lock()
            .get(vm_id)
            .cloned()
            .unwrap_or_default()
    }
}

impl Images for Fakes {
    fn resolve(
        &self,
        url: &str,
        sha256: &str,
        _max_bytes: u64,
        deadline: Deadline,
        progress: Progress,
    ) -> Result<crate::reconcile::seams::Base, BoxFailure> {
        self.record(Call::Resolve {
            url: url.to_owned(),
        });
        self.callbacks
            .lock()
            .insert(url.to_owned(), Arc::clone(&progress));
        let steps = self.progress.lock().get(url).cloned().unwrap_or_default();
        for (done, total) in steps {
            progress(done, total);
        }
        self.act(Op::Resolve, url, deadline)?;
        Ok(crate::reconcile::seams::Base::unheld(PathBuf::from(
            format!("/fake/images/{sha256}"),
        )))
    }
}

impl SeedBuilder for Fakes {
    fn build(
        &self,
        _out: &Path,
        params: &SeedParams,
    ) -> Result<crate::state::atomic::Pending, BoxFailure> {
        self.record(Call::Seed(Box::new(params.clone())));
        self.act(Op::Seed, &params.instance_id, Deadline::NONE)
            .map(|()| crate::state::atomic::Pending::none())
    }
}

impl HostKeys for Fakes {
    /// Persists a made-up key at `path` (creating its directory), so the
    /// same key comes back after an engine restart, as with the real one.
    fn load_or_create(&self, path: &Path) -> Result<HostKey, BoxFailure> {
        self.record(Call::HostKey(path.to_path_buf()));
        let vm = path
            .parent()
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        self.act(Op::HostKey, &vm, Deadline::NONE)?;
        let io = |e: std::io::Error| -> BoxFailure { Simple::transient(e.to_string()).into() };
        if let Ok(text) = std::fs::read_to_string(path)
            && let Some((public, private)) = text.split_once('\n')
        {
            return Ok(HostKey {
                public_line: public.to_owned(),
                private_pem: private.to_owned(),
            });
        }
        let n = self.keys_made.fetch_add(1, Ordering::Relaxed);
        let key = HostKey {
            public_line: format!("ssh-ed25519 AAAAFAKE{n}{vm} fake"),
            private_pem: format!("FAKE PRIVATE KEY {n}"),
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        std::fs::write(path, format!("{}\n{}", key.public_line, key.private_pem)).map_err(io)?;
        Ok(key)
    }
}

impl HostFacts for Fakes {
    fn boot_id(&self) -> String {
        self.boot_id.lock().clone()
    }

    fn now(&self) -> SystemTime {
        *self.now.lock()
    }
}

// ── desired state builders ───────────────────────────────────────────────

/// Parses a test id; panics on a bad one (a test bug).
/// What comes, in a copy of the stand-in hypervisor (see
/// [`standin_hypervisor`]), after its binary and before the knobs it
/// carries, and what ends the copy after them.
pub const STANDIN_KNOBS: (&[u8], &[u8]) = (b"\n--eitri-standin-knobs--\n", b"\n--end--\n");

/// A copy of the stand-in hypervisor `standin` at `at`, carrying `knobs`
/// (its `STANDIN_*` settings) after its last byte, where no ELF loader
/// looks. A VMM sees only its own binary (a mount namespace of its own)
/// and starts with an empty environment, so a wrapper script that set the
/// knobs and exec'd the stand-in would find neither: the copy is the
/// whole hypervisor, knobs and all.
pub fn standin_hypervisor(standin: &std::path::Path, at: &std::path::Path, knobs: &[(&str, &str)]) {
    use std::os::unix::fs::PermissionsExt;
    let mut bytes = std::fs::read(standin).unwrap_or_else(|e| panic!("{}: {e}", standin.display()));
    bytes.extend_from_slice(STANDIN_KNOBS.0);
    for (name, value) in knobs {
        bytes.extend_from_slice(format!("{name}={value}\n").as_bytes());
    }
    bytes.extend_from_slice(STANDIN_KNOBS.1);
    std::fs::write(at, bytes).unwrap_or_else(|e| panic!("{}: {e}", at.display()));
    std::fs::set_permissions(at, std::fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", at.display()));
}

pub fn id(raw: &str) -> Id {
    Id::parse(raw).unwrap_or_else(|e| panic!("test id: {e}"))
}

/// The image URL the builders give `vm`; the image fake is keyed by it.
pub fn image_url(vm: &str) -> String {
    format!("http://images.test/{vm}.raw")
}

/// A valid desired VM, running, 1 vCPU, 256 MiB, 1 GiB disk.
pub fn desired(vm: &str) -> DesiredVm {
    DesiredVm {
        spec: VmSpec {
            vm_id: id(vm),
            name: vm.replace(['_', '.'], "-"),
            image_url: image_url(vm),
            image_sha256: "ab".repeat(32),
            cloud_init: String::new(),
            ssh_authorized_key: String::new(),
            network: String::new(),
            volume_ids: Vec::new(),
            vcpus: 1,
            mem_mb: 256,
            disk_gb: 1,
            limits: crate::model::VmLimits::default(),
        },
        power: PowerState::Running,
        host_cert_required: false,
        ssh_host_cert: String::new(),
        ssh_user_ca_keys: Vec::new(),
        egress: crate::model::Egress::default(),
        readiness: None,
        published: Vec::new(),
        sleep: crate::model::Sleep::default(),
    }
}

pub fn present(d: DesiredVm) -> WantedVm {
    WantedVm::Present(Arc::new(d))
}

pub fn tombstoned(vm: &str) -> WantedVm {
    WantedVm::Tombstoned(id(vm))
}

/// A snapshot of `vms` at `epoch`.
pub fn snapshot(epoch: u64, vms: Vec<WantedVm>) -> Snapshot {
    Snapshot {
        epoch,
        vms,
        ..Snapshot::default()
    }
}

/// Confinement for tests that start hypervisors: every piece on, with a
/// KVM device stand-in (a root-only file under `dir`) so the grant to the
/// hypervisors' group never touches the host's /dev/kvm, and a cgroup root
/// of the test's own.
pub fn confinement(dir: &std::path::Path) -> crate::provision::Confinement {
    use std::os::unix::fs::PermissionsExt;
    let kvm = dir.join("kvm");
    if !kvm.exists() {
        let _ = std::fs::write(&kvm, b"");
        let _ = std::fs::set_permissions(&kvm, std::fs::Permissions::from_mode(0o600));
    }
    #[cfg(target_os = "linux")]
    {
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(|| {
            sweep_stale_test_roots();
            end_when_signalled(format!("{TEST_ROOT_PREFIX}{}", std::process::id()));
        });
    }
    // A root-only file of the test's own, like its KVM device: no test
    // changes the host's device's ACL (the stand-in faults nothing in).
    let userfaultfd = dir.join("userfaultfd");
    if !userfaultfd.exists() {
        let _ = std::fs::write(&userfaultfd, b"");
        let _ = std::fs::set_permissions(&userfaultfd, std::fs::Permissions::from_mode(0o600));
    }
    crate::provision::Confinement {
        kvm,
        userfaultfd: Some(userfaultfd),
        cgroup_root: format!("{TEST_ROOT_PREFIX}{}", std::process::id()),
        // VMM users of this process's own, as each agent takes its own
        // from the host's registry: a test's VMMs are told apart from
        // another's running beside it by their user too.
        first_id: test_vmm_ids().0,
        id_count: test_vmm_ids().1,
        ..crate::provision::Confinement::default()
    }
}

/// This test process's VMM ids (first, count): its own range, below an
/// agent's default (1.9e9 up), so a test's VMMs are told apart from
/// another's by their user, and the ACL entry its group gets on a host's
/// device is its own to take back.
pub fn test_vmm_ids() -> (u32, u32) {
    (
        TEST_FIRST_ID + (std::process::id() % (1 << 20)) * TEST_ID_COUNT,
        TEST_ID_COUNT,
    )
}

/// Where the test processes' VMM users begin: below an agent's default
/// range (1.9e9 up) at any pid.
const TEST_FIRST_ID: u32 = 200_000_000;
/// How many VMM users each test process has (a bench's bursts included).
const TEST_ID_COUNT: u32 = 1024;

/// A test's cgroup root is this and its process's pid.
const TEST_ROOT_PREFIX: &str = "eitri-test-";

/// Removes a test's cgroup root (see [`confinement`]) from every
/// hierarchy, with the empty VM cgroups left in it. What a VM still runs
/// in stays: tests of one process share the root (`cargo test` runs them
/// as threads), so one test's end must not end another's VMMs.
#[cfg(target_os = "linux")]
pub fn remove_cgroup_root(root: &str) {
    clear_cgroup_root(root, false);
}

/// `vm`'s cgroup file `name` under `root`, trimmed, from whichever
/// hierarchy has it.
#[cfg(target_os = "linux")]
pub fn cgroup_file(root: &str, vm: &Id, name: &str) -> Option<String> {
    let cgroups = crate::provision::jail::cgroup::Cgroups::probe(root).ok()?;
    cgroups
        .dirs(vm)
        .iter()
        .find_map(|d| std::fs::read_to_string(d.join(name)).ok())
        .map(|v| v.trim().to_owned())
}

/// Ends a cgroup root whose whole process is over (a benchmark's end, its
/// ^C, a gone run's root): every process still in it killed, then every
/// cgroup of it removed.
#[cfg(target_os = "linux")]
pub fn end_cgroup_root(root: &str) {
    clear_cgroup_root(root, true);
}

#[cfg(target_os = "linux")]
fn clear_cgroup_root(root: &str, kill: bool) {
    let Ok(cgroups) = crate::provision::jail::cgroup::Cgroups::probe(root) else {
        return;
    };
    for dir in cgroups.roots() {
        let vms: Vec<PathBuf> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        for vm in &vms {
            if kill {
                let deadline = crate::deadline::Deadline::after(Duration::from_secs(2));
                let _ = crate::provision::jail::cgroup::kill_until_empty(vm, deadline);
            }
            let _ = std::fs::remove_dir(vm);
        }
        let _ = std::fs::remove_dir(&dir);
    }
}

/// On ^C or a TERM, this process exits and a reaper it leaves behind ends
/// every process in the cgroups under `root` once this one is gone, then
/// removes the temp dirs given to [`remove_on_signal`].
///
/// The hypervisors run in sessions of their own, so the signal that ends
/// a test or a benchmark never reaches them; and killing them from here
/// would race the engine's own threads, which go on creating, restarting
/// and spawning until the process is gone (an interrupted real-hypervisor
/// bench left two VMMs that way). After this process's death nothing of
/// it spawns any more, so the reaper's passes end: one VMM whose spawn was
/// in flight lands in its cgroup before it execs, and the next pass has
/// it. A `sh` script, not code of this process: it must outlive it.
#[cfg(target_os = "linux")]
pub fn end_when_signalled(root: String) {
    LEFT_ON_SIGNAL.lock().roots.push(root);
    clean_up_when_signalled();
}

/// Has `dir` (a test's or a benchmark's temp dir) removed when ^C or a
/// TERM ends this process before its own clean-up runs (a benchmark's
/// image and disks are tens of MB): the reaper [`end_when_signalled`]
/// leaves removes it, after the VMMs that may still write there are gone.
pub fn remove_on_signal(dir: &Path) {
    LEFT_ON_SIGNAL.lock().dirs.push(dir.to_path_buf());
    clean_up_when_signalled();
}

/// What the reaper ends and removes if a signal ends this process.
#[derive(Default)]
struct LeftOnSignal {
    /// Cgroup roots: there are none to end off Linux.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    roots: Vec<String>,
    dirs: Vec<PathBuf>,
}

static LEFT_ON_SIGNAL: parking_lot::Mutex<LeftOnSignal> = parking_lot::Mutex::new(LeftOnSignal {
    roots: Vec::new(),
    dirs: Vec::new(),
});

/// Once per process: a thread that, at ^C or a TERM, leaves the reaper
/// and exits as the signal would have.
fn clean_up_when_signalled() {
    static WATCHING: std::sync::Once = std::sync::Once::new();
    WATCHING.call_once(|| {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM]) else {
            return;
        };
        let _ = std::thread::Builder::new()
            .name("end-when-signalled".into())
            .spawn(move || {
                if let Some(signal) = signals.forever().next() {
                    leave_a_reaper(&LEFT_ON_SIGNAL.lock());
                    std::process::exit(128 + signal);
                }
            });
    });
}

/// Waits for this process to be gone, then kills what runs in the VM
/// cgroups of the roots (before `--`) until a pass finds none (at most
/// 5 s), removes those cgroups, and removes the temp dirs (after `--`).
const REAPER: &str = r#"
pid=$1; shift
roots=
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do roots="$roots $1"; shift; done
[ "$#" -gt 0 ] && shift
while [ -d "/proc/$pid" ]; do sleep 0.01; done
pass=0
while [ "$pass" -lt 500 ]; do
    found=
    for procs in $(for root in $roots; do echo "$root"/*/cgroup.procs; done); do
        [ -f "$procs" ] || continue
        for victim in $(cat "$procs"); do
            kill -9 "$victim" 2>/dev/null
            found=1
        done
    done
    [ -z "$found" ] && break
    sleep 0.01
    pass=$((pass + 1))
done
for root in $roots; do
    for vm in "$root"/*/; do [ -d "$vm" ] && rmdir "$vm" 2>/dev/null; done
    rmdir "$root" 2>/dev/null
done
for dir in "$@"; do rm -rf -- "$dir"; done
exit 0
"#;

fn leave_a_reaper(left: &LeftOnSignal) {
    use std::os::unix::process::CommandExt;
    #[cfg(target_os = "linux")]
    let roots: Vec<PathBuf> = left
        .roots
        .iter()
        .filter_map(|root| crate::provision::jail::cgroup::Cgroups::probe(root).ok())
        .flat_map(|cgroups| cgroups.roots())
        .collect();
    #[cfg(not(target_os = "linux"))]
    let roots: Vec<PathBuf> = Vec::new();
    let _ = std::process::Command::new("sh")
        .arg("-c")
        .arg(REAPER)
        .arg("eitri-reaper")
        .arg(std::process::id().to_string())
        .args(roots)
        .arg("--")
        .args(left.dirs.iter().filter(|d| d.exists()))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn();
}

/// Ends the cgroup roots of earlier test and benchmark processes that are
/// gone (killed, interrupted with ^C) with their hypervisors still in
/// them: one run must not leave the next its VMMs. Once per process.
#[cfg(target_os = "linux")]
pub fn sweep_stale_test_roots() {
    let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut stale = std::collections::BTreeSet::new();
    for mount in mountinfo.lines().filter(|l| l.contains(" - cgroup")) {
        let Some(point) = mount.split(' ').nth(4) else {
            continue;
        };
        for entry in std::fs::read_dir(point).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            // `eitri-test-PID`, or a root of its named `eitri-test-PID-what`.
            let gone = name
                .strip_prefix(TEST_ROOT_PREFIX)
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse::<u32>().ok())
                .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
            if gone {
                stale.insert(name);
            }
        }
    }
    for root in stale {
        end_cgroup_root(&root);
    }
}
