//! The daemon: the main loop, signals, readiness and a graceful stop.
//!
//! Three kinds of thread meet here, and only the first may ever wait on
//! the network:
//! - `source` (see [`exchange`]): contacts the control plane or reads the
//!   desired file, hands new desired state over, sends the newest report.
//! - `main` (this module): acts on events the moment they arrive, and
//!   steps the engine at every tick as the level-triggered safety net:
//!   1. New desired state: check its epoch (a stale snapshot from a
//!      control plane is fenced: logged once, never kept, and every report
//!      says so until a current one arrives), convert and validate it, keep
//!      it (persisted, so an agent restarted during an outage still has
//!      it), and step the engine with it at once.
//!   2. A tick: step the engine with the last desired state (reachable or
//!      not, so a crashed VM is restarted while the control plane is down),
//!      or observe the host if there has never been any (stepping an empty
//!      snapshot would reap every VM as vanished).
//!   3. A VM's row changed between steps (a pass ended, a crashed VM was
//!      repaired): report it at once, at most every [`MIN_WRITE_GAP`].
//!   4. Every report is published to the exchange and written to
//!      `report.json` atomically; after the first, readiness is signalled.
//! - `signals`: SIGTERM/SIGINT stop the loop (passes in flight get the
//!   shutdown grace, VMs keep running); SIGHUP re-reads the desired file.

mod backoff;
mod details;
mod discover;
pub mod exchange;
mod last;
pub mod metrics;
mod notify;
pub mod recover;
mod signals;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, select};

pub use backoff::{Backoff, XorShift};
pub use exchange::{Contact, Exchange, ExchangeThread, Link};
pub use notify::Readiness;
pub use recover::Recovered;
pub use signals::Signals;

use crate::config::{Config, DesiredSource};
use crate::deadline::Deadline;
use crate::logonce::LogOnce;
use crate::model::Snapshot;
use crate::pb::{self, convert};
use crate::reconcile::seams::{HostFacts, SystemHost};
use crate::reconcile::{Engine, Seams};
use crate::seed::NoCloudSeed;
use crate::source::{Desired, FileSource, HttpSource, Source, SourceError};
use crate::state::{Store, StoreError};
use crate::status::ReportFile;

/// The shortest gap between two change-driven `report.json` writes: a burst
/// of rows changing (a hundred VMs booting) is a few writes, not a hundred.
const MIN_WRITE_GAP: Duration = Duration::from_millis(10);

/// What the main loop is told from outside.
#[derive(Debug, Clone)]
pub enum Event {
    /// SIGTERM or SIGINT.
    Shutdown,
    /// SIGHUP: read the desired file afresh.
    Reload,
    /// The exchange handed over new desired state.
    Desired,
    /// The contact state changed; `report.json` says it.
    Contact,
    /// Step now, as at a tick; `done` is told once the step's report is
    /// out (a test waiting for exactly that step).
    Step {
        done: Option<crossbeam_channel::Sender<()>>,
    },
}

/// Monotonic time since an arbitrary start; a fake in tests.
pub trait Clock: Send {
    fn now(&self) -> Duration;
}

pub struct SystemClock(Instant);

impl SystemClock {
    pub fn new() -> SystemClock {
        SystemClock(Instant::now())
    }
}

impl Default for SystemClock {
    fn default() -> SystemClock {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

/// What the main loop is made of; its own settings come from `Config`.
pub struct Parts {
    pub store: Arc<Store>,
    pub engine: Arc<Engine>,
    pub link: Arc<Link>,
    pub host: pb::HostInfo,
    /// What the source is called in logs and `status`.
    pub source: String,
    /// Whether snapshots come from a control plane (and fence), or from a
    /// file (and never do).
    pub remote: bool,
    pub readiness: Option<Readiness>,
    /// Lasting facts for `status` (e.g. networking is host-only).
    pub notes: Vec<String>,
    /// `--metrics-file`, when asked for.
    pub metrics: Option<metrics::MetricsFile>,
}

pub struct Daemon {
    store: Arc<Store>,
    engine: Arc<Engine>,
    link: Arc<Link>,
    host: pb::HostInfo,
    source: String,
    remote: bool,
    readiness: Option<Readiness>,
    notes: Vec<String>,
    tick: Duration,
    /// The last accepted desired state, as read and as checked.
    last: Option<(Desired, Snapshot)>,
    /// The epoch of the stale snapshot the control plane sent last, while
    /// it sends stale ones.
    fenced: Option<u64>,
    logs: LogOnce,
    /// When `report.json` was last written, and whether a change waits.
    written: Option<Instant>,
    dirty: bool,
    metrics: Option<metrics::MetricsFile>,
    details: details::Details,
}

impl Daemon {
    /// Builds the main loop, loading the last accepted snapshot if one was
    /// persisted (a restart during an outage keeps converging).
    pub fn new(tick: Duration, parts: Parts) -> Daemon {
        let last = load_last(&parts.store);
        if let Some((_, snap)) = &last {
            log::info!(
                "resuming with the last accepted snapshot (epoch {})",
                snap.epoch
            );
        }
        Daemon {
            store: parts.store,
            engine: parts.engine,
            link: parts.link,
            host: parts.host,
            source: parts.source,
            remote: parts.remote,
            readiness: parts.readiness,
            notes: parts.notes,
            tick,
            last,
            fenced: None,
            logs: LogOnce::new(),
            written: None,
            dirty: false,
            metrics: parts.metrics,
            details: details::Details::default(),
        }
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Runs until told to stop (see the module steps), then stops the
    /// exchange and gives passes in flight `grace`, all within `grace`.
    pub fn run(
        mut self,
        events: &Receiver<Event>,
        exchange: Option<ExchangeThread>,
        grace: Duration,
    ) {
        let changes = self.engine.changes().clone();
        self.step(None);
        let mut next_tick = Instant::now() + self.tick;
        loop {
            let wake = match self.write_due_at() {
                Some(at) => at.min(next_tick),
                None => next_tick,
            };
            select! {
                recv(events) -> event => match event {
                    Ok(Event::Shutdown) | Err(_) => break,
                    Ok(Event::Reload) => {
                        log::info!("reloading {}", self.source);
                        if let Some(x) = &exchange {
                            x.reload();
                        }
                    }
                    Ok(Event::Desired) => {
                        if let Some((seq, desired)) = self.link.take_desired() {
                            self.accept(desired);
                            self.step(Some(seq));
                        }
                    }
                    Ok(Event::Contact) => self.dirty = true,
                    Ok(Event::Step { done }) => {
                        self.step(None);
                        next_tick = Instant::now() + self.tick;
                        if let Some(done) = done {
                            let _ = done.send(());
                        }
                    }
                },
                recv(changes) -> _ => self.dirty = true,
                default(wake.saturating_duration_since(Instant::now())) => {}
            }
            if Instant::now() >= next_tick {
                self.step(None);
                next_tick = Instant::now() + self.tick;
            }
            if self.write_due_at().is_some_and(|at| at <= Instant::now()) {
                self.report_changes();
            }
        }
        log::info!(
            "stopping: passes in flight get up to {}s; VMs keep running",
            grace.as_secs()
        );
        let deadline = Deadline::after(grace);
        if let Some(x) = &exchange {
            x.ask_to_stop();
        }
        self.engine.shutdown(deadline);
        if let Some(x) = exchange {
            x.join(deadline);
        }
    }

    /// When a waiting change may be written: at once, or once the last
    /// write is [`MIN_WRITE_GAP`] old.
    fn write_due_at(&self) -> Option<Instant> {
        if !self.dirty {
            return None;
        }
        Some(match self.written {
            Some(at) => at + MIN_WRITE_GAP,
            None => Instant::now(),
        })
    }

    /// Takes new desired state (see the module's step 1).
    fn accept(&mut self, desired: Desired) {
        let Desired {
            mut wire,
            refused_vms,
            refused_volumes,
        } = desired;
        let current = self.store.epoch();
        if self.remote && wire.epoch < current {
            self.logs.warn(
                "fence",
                &format!(
                    "refusing a stale snapshot: its epoch {} is older than the accepted epoch {current}; keeping the last accepted desired state, and reporting the fence",
                    wire.epoch
                ),
            );
            self.fenced = Some(wire.epoch);
            return;
        }
        if !self.remote {
            // Standalone mode never fences: a hand-written file may leave
            // the epoch out, or reset it.
            wire.epoch = wire.epoch.max(current);
        }
        if self.fenced.take().is_some() {
            self.logs.clear("fence");
            log::info!("snapshot epoch {} accepted; no longer fenced", wire.epoch);
        }
        let desired = Desired {
            wire,
            refused_vms,
            refused_volumes,
        };
        // A control plane sends the same snapshot tick after tick: check
        // and convert only what changed.
        if self.last.as_ref().is_some_and(|(old, _)| *old == desired) {
            return;
        }
        let mut snap = convert::snapshot_from_wire(&desired.wire);
        snap.refuse_more(desired.refused_vms.clone(), desired.refused_volumes.clone());
        self.logs.clear_prefix("rejected/");
        for rejected in snap.rejected_vms.iter().chain(&snap.rejected_volumes) {
            self.logs.warn(
                &format!("rejected/{}", rejected.raw_id),
                &format!(
                    "refusing the entry {}: {}",
                    crate::quote::text(&rejected.raw_id),
                    rejected.error
                ),
            );
        }
        self.persist_last(&desired.wire);
        self.last = Some((desired, snap));
    }

    /// Steps the engine (the module's steps 1 and 2) and reports.
    fn step(&mut self, reflects: Option<u64>) {
        let started = Instant::now();
        let report = match &self.last {
            Some((_, snap)) => self.engine.step(snap),
            None => self.engine.observe(),
        };
        self.publish(&report, reflects, true);
        if let Some(m) = &self.metrics {
            let text = m.render(
                &self.host,
                &self.engine,
                &report,
                self.store.epoch(),
                self.link.failures(),
            );
            match m.write(&text) {
                Ok(()) => {
                    if self.logs.clear("metrics") {
                        log::info!("{} is written again", m.path.display());
                    }
                }
                Err(e) => {
                    self.logs.error(
                        "metrics",
                        &format!("cannot write the metrics file {}: {e}", m.path.display()),
                    );
                }
            }
            m.tick_took(started.elapsed());
        }
    }

    /// Reports the rows that changed since the last report, dispatching
    /// nothing (the module's step 3).
    fn report_changes(&mut self) {
        let report = match &self.last {
            Some((_, snap)) => self.engine.report(snap),
            None => self.engine.observe(),
        };
        self.publish(&report, None, false);
    }

    /// Reports `report`; `tick` says it is a tick's (not a change's), when
    /// the slower details (the hypervisors' pids) are looked up too.
    fn publish(&mut self, report: &crate::model::Report, reflects: Option<u64>, tick: bool) {
        let mut wire = convert::report_to_wire(report);
        if self.fenced.is_some() {
            wire.fence_violation = true;
        }
        self.link.publish(wire.clone(), reflects);
        self.write_report(wire, tick);
        self.written = Some(Instant::now());
        self.dirty = false;
    }

    fn persist_last(&self, wire: &pb::Snapshot) {
        let path = self.store.layout().last_snapshot();
        match last::save(&path, wire) {
            Ok(()) => crate::crash::point("snapshot.persisted"),
            Err(e) => {
                self.logs.error(
                    "persist",
                    &format!(
                        "cannot persist the last snapshot to {}: {e}",
                        path.display()
                    ),
                );
            }
        }
    }

    fn write_report(&mut self, report: pb::Report, tick: bool) {
        let details = self
            .details
            .update(&report, &self.store, &self.engine, tick);
        let file = ReportFile {
            notes: self.notes.clone(),
            tick_ms: u64::try_from(self.tick.as_millis()).unwrap_or(u64::MAX),
            details,
            quota: self.engine.quota(),
            ..ReportFile::new(
                self.host.clone(),
                self.source.clone(),
                self.link.contact(),
                report,
            )
        };
        match file.write(self.store.root()) {
            Ok(()) => {
                if self.logs.clear("report") {
                    log::info!("report.json is written again");
                }
                if let Some(readiness) = self.readiness.take() {
                    readiness.signal();
                }
            }
            Err(e) => {
                self.logs.error(
                    "report",
                    &format!(
                        "cannot write report.json: {e}; it goes stale until this is fixed (status shows its age)"
                    ),
                );
            }
        }
    }
}

fn load_last(store: &Store) -> Option<(Desired, Snapshot)> {
    let path = store.layout().last_snapshot();
    match last::load(&path) {
        Ok(None) => None,
        Ok(Some(wire)) => {
            let snap = convert::snapshot_from_wire(&wire);
            Some((
                Desired {
                    wire,
                    ..Desired::default()
                },
                snap,
            ))
        }
        // Observed instead, as at a first start: nothing is reaped until
        // desired state comes.
        Err(why) => {
            log::warn!(
                "ignoring the last snapshot at {}: {why}; observing the host until desired state comes",
                path.display()
            );
            None
        }
    }
}

/// Why the daemon could not start.
#[derive(Debug)]
pub enum DaemonError {
    Store(StoreError),
    BootId(std::io::Error),
    Notify {
        fd: i32,
        source: nix::Error,
    },
    Signals(std::io::Error),
    /// The token file cannot be used (unreadable, or readable by others).
    Token(SourceError),
    /// A thread the daemon needs could not be started.
    Thread {
        name: &'static str,
        source: std::io::Error,
    },
}

impl std::fmt::Display for DaemonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DaemonError::Store(_) => f.write_str("cannot open the state directory"),
            DaemonError::BootId(_) => {
                f.write_str("cannot read the boot id from /proc/sys/kernel/random/boot_id")
            }
            DaemonError::Notify { fd, .. } => {
                write!(f, "--notify-fd {fd} is not an open file descriptor")
            }
            DaemonError::Signals(_) => f.write_str("cannot install the signal handlers"),
            DaemonError::Token(_) => f.write_str("cannot use the token file"),
            DaemonError::Thread { name, .. } => write!(f, "cannot start the {name} thread"),
        }
    }
}

impl std::error::Error for DaemonError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DaemonError::Store(e) => Some(e),
            DaemonError::BootId(e) | DaemonError::Signals(e) => Some(e),
            DaemonError::Notify { source, .. } => Some(source),
            DaemonError::Token(e) => Some(e),
            DaemonError::Thread { source, .. } => Some(source),
        }
    }
}

/// The host's self-description, sent with every request.
pub fn host_info(config: &Config, host_id: String, boot_id: String) -> pb::HostInfo {
    pb::HostInfo {
        host_id,
        agent_version: crate::version::AGENT_VERSION.to_owned(),
        boot_id,
        max_vcpus: config.engine.caps.max_vcpus as i64,
        max_mem_mb: config.engine.caps.max_mem_mb as i64,
        max_disk_gb: config.engine.caps.max_disk_gb as i64,
    }
}

/// Runs the daemon with the host's real parts until SIGTERM or SIGINT.
/// `signals` were installed first thing in `main`, so a signal that came
/// while the agent was starting is acted on, not fatal.
pub fn run(config: Config, signals: Signals) -> Result<(), DaemonError> {
    // Take the readiness fd first, so no child can inherit it.
    let readiness = config
        .notify_fd
        .map(|fd| Readiness::adopt(fd).map_err(|source| DaemonError::Notify { fd, source }))
        .transpose()?;
    if let DesiredSource::ControlPlane(cp) = &config.source
        && let Some(token) = &cp.token_file
    {
        crate::source::check_token_mode(token).map_err(DaemonError::Token)?;
    }
    // Every program the agent will run, found once by absolute path (and
    // logged) before anything runs one.
    if config.guest.underlay.is_some() {
        for program in ["ip", "nft", "iptables"] {
            crate::programs::resolved(program);
        }
    }
    let (events, rx) = crossbeam_channel::unbounded();
    let signal_thread = signals
        .spawn(events.clone())
        .map_err(DaemonError::Signals)?;
    let host = Arc::new(SystemHost::new().map_err(DaemonError::BootId)?);
    let boot_id = host.boot_id();
    let guest_dns = config
        .guest
        .guest_dns
        .clone()
        .unwrap_or_else(discover::resolvers);
    let Recovered {
        store,
        images,
        provisioner,
        notes,
    } = recover::recover(&config, guest_dns)?;
    let seams = Seams {
        provisioner,
        images: Arc::clone(&images) as Arc<dyn crate::reconcile::seams::Images>,
        seed: Arc::new(NoCloudSeed),
        host_keys: Arc::new(crate::hostkey::LocalHostKeys),
        host,
    };
    let engine = Arc::new(Engine::new(
        Arc::clone(&store),
        seams,
        config.engine.clone(),
    ));
    let source: Box<dyn Source> = match &config.source {
        DesiredSource::File(path) => Box::new(FileSource::new(PathBuf::from(path), config.limits)),
        DesiredSource::ControlPlane(cp) => Box::new(HttpSource::new(
            cp.clone(),
            config.limits,
            config.proxy.as_deref(),
        )),
    };
    let (remote, described) = (source.is_remote(), source.describe());
    let host_id = config.host_id.clone().unwrap_or_else(discover::host_id);
    log::info!(
        "eitri-agent {} starting: host {host_id}, state dir {}, {described}",
        crate::version::AGENT_VERSION,
        config.state_dir.display(),
    );
    let link = Link::new(events);
    let info = host_info(&config, host_id, boot_id);
    let mut rng = XorShift::seeded();
    let exchange = Exchange::new(
        source,
        info.clone(),
        config.tick,
        config.backoff_max,
        Box::new(SystemClock::new()),
        Box::new(move || rng.next_unit()),
        Arc::clone(&link),
    )
    .spawn()
    .map_err(|source| DaemonError::Thread {
        name: "source",
        source,
    })?;
    let daemon = Daemon::new(
        config.tick,
        Parts {
            store,
            engine,
            link,
            host: info,
            source: described,
            remote,
            readiness,
            notes,
            metrics: config
                .metrics_file
                .clone()
                .map(|path| metrics::MetricsFile::new(path, Arc::clone(&images))),
        },
    );
    daemon.run(&rx, Some(exchange), config.shutdown_grace);
    signal_thread.stop();
    log::info!("stopped");
    Ok(())
}
