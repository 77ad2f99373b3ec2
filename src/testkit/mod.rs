//! Fakes of every engine seam, for engine tests and benchmarks.
//!
//! [`Fakes`] implements the provisioner, image cache, seed builder, host-key
//! store and host facts at once, so a test sees every call in one ordered
//! log. Each operation can be told, per VM (per URL for images), to fail
//! transiently or permanently, to panic, or to block at a [`Gate`] until the
//! test releases it or the pass's deadline passes. The fakes are passed to
//! the engine through [`Fakes::seams`]; nothing in the agent switches on
//! them.

mod backend;
pub mod control_plane;
mod desired;
mod host;
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
use crate::error::{DeadlineExpired, Outcome, Simple};
use crate::model::Id;
use crate::provision::{ExitListener, Lifecycle, SavedGuest};
use crate::reconcile::Seams;
use crate::reconcile::seams::{HostFacts, HostKeys, Images, Progress, SeedBuilder, SeedParams};

pub use desired::{
    STANDIN_KNOBS, desired, id, image_url, present, snapshot, standin_hypervisor, tombstoned,
};
#[cfg(target_os = "linux")]
pub use host::{
    cgroup_file, end_cgroup_root, end_when_signalled, remove_cgroup_root, sweep_stale_test_roots,
};
pub use host::{confinement, remove_on_signal, test_vmm_ids};

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
    Clone,
    SaveTemplate,
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
    /// A clone's copy of its template's saved guest: (clone, template).
    CloneSaved(Id, Id),
    /// A running VM's guest saved as its template.
    SaveTemplate(Id),
    DiscardTemplate(Id),
    /// A guest resumed where it was left paused.
    Unpause(Id),
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
    /// Running VMs' guests saved as templates.
    templates: Mutex<HashMap<Id, SavedGuest>>,
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
    /// Told to be a backend with no capability but its lifecycle.
    bare: std::sync::atomic::AtomicBool,
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
            templates: Mutex::new(HashMap::new()),
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
            bare: std::sync::atomic::AtomicBool::new(false),
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

    /// From now on, a backend with no capability but its lifecycle: it
    /// cannot suspend, holds no limits, egress rules or ports, and wakes
    /// nothing (what the engine does for such a backend is shown with it).
    pub fn lack_capabilities(&self) {
        self.bare.store(true, Ordering::SeqCst);
    }

    /// Whether [`Fakes::lack_capabilities`] was asked.
    fn is_bare(&self) -> bool {
        self.bare.load(Ordering::SeqCst)
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

    fn act(&self, op: Op, key: &str, deadline: Deadline) -> Outcome {
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

    fn behave(&self, op: Op, key: &str, deadline: Deadline) -> Outcome {
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
