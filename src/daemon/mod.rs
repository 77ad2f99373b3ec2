//! The daemon: the tick loop, signals, readiness and a graceful stop.
//!
//! Each tick:
//! 1. If contact is due (always, unless backing off after failures), fetch
//!    desired state. A new snapshot the engine will accept becomes the last
//!    snapshot, persisted atomically so an agent restarted during an outage
//!    still has it.
//! 2. Step the engine with the last snapshot: every tick, reachable or not,
//!    so a crashed VM is restarted even while the control plane is down.
//!    With no snapshot ever, observe the host instead of stepping an empty
//!    one (which would reap every VM as vanished).
//! 3. Write `report.json` atomically; after the first, signal readiness.
//! 4. If contact is due and the fetch went through, send the report. A
//!    failure backs off with jitter; success resets the backoff. The report
//!    sent on return is always the newest.
//!
//! Signals arrive as messages: SIGTERM/SIGINT stop ticking, give in-flight
//! passes the shutdown grace, and return; VMs keep running. SIGHUP re-reads
//! the desired file at once.

mod backoff;
mod notify;
mod signals;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};
use prost::Message;

pub use backoff::{Backoff, XorShift};
pub use notify::Readiness;

use crate::config::{Config, DesiredSource};
use crate::deadline::Deadline;
use crate::error::chain;
use crate::hostkey::LocalHostKeys;
use crate::image::ImageCache;
use crate::model::Snapshot;
use crate::pb::{self, convert};
use crate::reconcile::seams::{HostFacts, SystemHost};
use crate::reconcile::{Engine, Seams};
use crate::seed::NoCloudSeed;
use crate::source::{FileSource, HttpSource, Source, SourceError};
use crate::state::atomic::write_atomic;
use crate::state::{Store, StoreError};
use crate::status::ReportFile;

const LAST_SNAPSHOT: &str = "snapshot.pb";

/// What the tick loop is told from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    Shutdown,
    Reload,
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

/// How one tick's contact with the source went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Contact {
    /// Backing off; the next contact is due in this long.
    Waiting {
        due_in: Duration,
    },
    Ok,
    /// Failed; the next contact waits this long.
    Failed {
        error: String,
        retry_in: Duration,
    },
}

pub struct Tick {
    pub report: pb::Report,
    pub contact: Contact,
}

/// What a daemon is made of; the daemon's own settings come from `Config`.
pub struct Parts {
    pub store: Arc<Store>,
    pub engine: Engine,
    pub source: Box<dyn Source>,
    pub host: pb::HostInfo,
    pub clock: Box<dyn Clock>,
    /// Jitter draws in `[0, 1)`.
    pub jitter: Box<dyn FnMut() -> f64 + Send>,
    pub readiness: Option<Readiness>,
    /// Lasting facts for `status` (e.g. networking is host-only).
    pub notes: Vec<String>,
}

pub struct Daemon {
    store: Arc<Store>,
    engine: Engine,
    source: Box<dyn Source>,
    host: pb::HostInfo,
    clock: Box<dyn Clock>,
    jitter: Box<dyn FnMut() -> f64 + Send>,
    readiness: Option<Readiness>,
    tick: Duration,
    backoff: Backoff,
    next_contact: Duration,
    last: Option<(pb::Snapshot, Snapshot)>,
    last_contact: String,
    logged: LogOnce,
    notes: Vec<String>,
}

impl Daemon {
    /// Builds the daemon, loading the last accepted snapshot if one was
    /// persisted (a restart during an outage keeps converging).
    pub fn new(tick: Duration, backoff_max: Duration, parts: Parts) -> Daemon {
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
            source: parts.source,
            host: parts.host,
            clock: parts.clock,
            jitter: parts.jitter,
            readiness: parts.readiness,
            tick,
            backoff: Backoff::new(tick, backoff_max),
            next_contact: Duration::ZERO,
            last,
            last_contact: "not yet".into(),
            logged: LogOnce::default(),
            notes: parts.notes,
        }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// One tick (see the module steps).
    pub fn tick(&mut self) -> Tick {
        let now = self.clock.now();
        let due = !self.source.is_remote() || now >= self.next_contact;
        let mut failure = None;
        let mut fresh = None;
        if due {
            match self.source.fetch(&self.host) {
                Ok(Some(wire)) => fresh = Some(wire),
                Ok(None) => {}
                Err(e) => failure = Some(e),
            }
        }
        let report = self.step(fresh);
        self.write_report(&report);
        if due && failure.is_none() {
            failure = self.source.send_report(&self.host, &report).err();
        }
        let contact = self.settle_contact(now, due, failure);
        Tick { report, contact }
    }

    /// Steps the engine with the newest snapshot it will accept, or the last
    /// one; observes the host when there has never been one.
    fn step(&mut self, fresh: Option<pb::Snapshot>) -> pb::Report {
        if let Some(mut wire) = fresh {
            if !self.source.is_remote() {
                // Standalone mode never fences: a hand-written file may leave
                // the epoch out, or reset it.
                wire.epoch = wire.epoch.max(self.store.epoch());
            }
            // A control plane sends the same snapshot tick after tick:
            // validate and convert only what changed.
            let unchanged = self.last.as_ref().is_some_and(|(old, _)| *old == wire);
            if !unchanged {
                let snap = convert::snapshot_from_wire(&wire);
                for rejected in snap.rejected_vms.iter().chain(&snap.rejected_volumes) {
                    self.logged
                        .warn(&format!("{}: {}", rejected.raw_id, rejected.error));
                }
                if snap.epoch < self.store.epoch() {
                    // Answered with the fence report, never kept as "last".
                    return convert::report_to_wire(&self.engine.step(&snap));
                }
                self.persist_last(&wire);
                self.last = Some((wire, snap));
            }
        }
        let report = match &self.last {
            Some((_, snap)) => self.engine.step(snap),
            None => self.engine.observe(),
        };
        convert::report_to_wire(&report)
    }

    fn persist_last(&self, wire: &pb::Snapshot) {
        let path = self.store.root().join(LAST_SNAPSHOT);
        if let Err(e) = write_atomic(&path, &wire.encode_to_vec()) {
            log::error!(
                "cannot persist the last snapshot to {}: {e}",
                path.display()
            );
        }
    }

    fn write_report(&mut self, report: &pb::Report) {
        let file = ReportFile {
            notes: self.notes.clone(),
            ..ReportFile::new(
                self.host.clone(),
                self.source.describe(),
                self.last_contact.clone(),
                report.clone(),
            )
        };
        match file.write(self.store.root()) {
            Ok(()) => {
                if let Some(readiness) = self.readiness.take() {
                    readiness.signal();
                }
            }
            Err(e) => self.logged.error(&format!("cannot write report.json: {e}")),
        }
    }

    fn settle_contact(
        &mut self,
        now: Duration,
        due: bool,
        failure: Option<SourceError>,
    ) -> Contact {
        if !due {
            return Contact::Waiting {
                due_in: self.next_contact.saturating_sub(now),
            };
        }
        match failure {
            None => {
                if self.backoff.failures() > 0 {
                    log::info!("{} reachable again", self.source.describe());
                }
                self.backoff.reset();
                self.logged.clear();
                self.next_contact = now;
                self.last_contact = "ok".into();
                Contact::Ok
            }
            Some(e) => {
                let error = chain(&e);
                let retry_in = if self.source.is_remote() {
                    self.backoff.fail((self.jitter)())
                } else {
                    Duration::ZERO
                };
                self.next_contact = now + retry_in;
                self.logged.warn(&error);
                self.last_contact = error.clone();
                Contact::Failed { error, retry_in }
            }
        }
    }

    /// Ticks until told to stop, then gives in-flight passes `grace`.
    pub fn run(mut self, control: &Receiver<Control>, grace: Duration) {
        loop {
            self.tick();
            match control.recv_timeout(self.tick) {
                Ok(Control::Shutdown) | Err(RecvTimeoutError::Disconnected) => break,
                Ok(Control::Reload) => {
                    log::info!("reloading {}", self.source.describe());
                    self.source.reload();
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
        log::info!(
            "stopping: passes in flight get up to {}s; VMs keep running",
            grace.as_secs()
        );
        self.engine.shutdown(Deadline::after(grace));
    }
}

fn load_last(store: &Store) -> Option<(pb::Snapshot, Snapshot)> {
    let path = store.root().join(LAST_SNAPSHOT);
    let bytes = std::fs::read(&path).ok()?;
    match pb::Snapshot::decode(bytes.as_slice()) {
        Ok(wire) => {
            let snap = convert::snapshot_from_wire(&wire);
            Some((wire, snap))
        }
        Err(e) => {
            log::warn!("ignoring the last snapshot at {}: {e}", path.display());
            None
        }
    }
}

/// Logs a message when it differs from the last one, or once a minute while
/// it repeats: a failure on every tick is one line, not thousands.
#[derive(Default)]
struct LogOnce {
    last: Option<(String, Instant)>,
}

impl LogOnce {
    fn should(&mut self, msg: &str) -> bool {
        let fresh = match &self.last {
            Some((m, at)) => m != msg || at.elapsed() >= Duration::from_secs(60),
            None => true,
        };
        if fresh {
            self.last = Some((msg.to_owned(), Instant::now()));
        }
        fresh
    }

    fn warn(&mut self, msg: &str) {
        if self.should(msg) {
            log::warn!("{msg}");
        }
    }

    fn error(&mut self, msg: &str) {
        if self.should(msg) {
            log::error!("{msg}");
        }
    }

    fn clear(&mut self) {
        self.last = None;
    }
}

/// Why the daemon could not start.
#[derive(Debug)]
pub enum DaemonError {
    Store(StoreError),
    BootId(std::io::Error),
    Notify { fd: i32, source: nix::Error },
    Signals(std::io::Error),
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
        }
    }
}

impl std::error::Error for DaemonError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DaemonError::Store(e) => Some(e),
            DaemonError::BootId(e) | DaemonError::Signals(e) => Some(e),
            DaemonError::Notify { source, .. } => Some(source),
        }
    }
}

/// The host's self-description, sent with every request.
pub fn host_info(config: &Config, boot_id: String) -> pb::HostInfo {
    pb::HostInfo {
        host_id: config.host_id.clone(),
        agent_version: crate::version::AGENT_VERSION.to_owned(),
        boot_id,
        max_vcpus: config.engine.caps.max_vcpus as i64,
        max_mem_mb: config.engine.caps.max_mem_mb as i64,
        max_disk_gb: config.engine.caps.max_disk_gb as i64,
    }
}

/// Runs the daemon with the host's real parts until SIGTERM or SIGINT.
pub fn run(config: Config) -> Result<(), DaemonError> {
    // Take the readiness fd first, so no child can inherit it.
    let readiness = config
        .notify_fd
        .map(|fd| Readiness::adopt(fd).map_err(|source| DaemonError::Notify { fd, source }))
        .transpose()?;
    let store = Arc::new(Store::open(&config.state_dir).map_err(DaemonError::Store)?);
    let host = Arc::new(SystemHost::new().map_err(DaemonError::BootId)?);
    let boot_id = host.boot_id();
    // Without its network a VM still boots; the log and the VM's missing
    // address say why it is unreachable.
    let mut notes = Vec::new();
    let network = match config.guest.underlay.clone() {
        None => {
            notes.push("guest networking is off (--underlay-bridge is empty)".to_owned());
            None
        }
        Some(underlay) => match crate::net::host::HostNetwork::setup(
            underlay,
            store.root(),
            config.guest.guest_dns.clone(),
            config.guest.host_networks.clone(),
        ) {
            Ok(n) => {
                if n.nat() == crate::net::underlay::Nat::HostOnly {
                    notes.push(
                        "guest networking is host-only: neither nft nor iptables is installed"
                            .to_owned(),
                    );
                }
                Some(Arc::new(n))
            }
            Err(e) => {
                let why = chain(&*e as &dyn std::error::Error);
                log::error!("guest networking is off: {why}");
                notes.push(format!("guest networking is off: {why}"));
                None
            }
        },
    };
    let seams = Seams {
        provisioner: crate::provision::for_host(Arc::clone(&store), &config.guest, network),
        images: Arc::new(ImageCache::new(store.images_dir())),
        seed: Arc::new(NoCloudSeed),
        host_keys: Arc::new(LocalHostKeys),
        host,
    };
    let engine = Engine::new(Arc::clone(&store), seams, config.engine.clone());
    let source: Box<dyn Source> = match &config.source {
        DesiredSource::File(path) => Box::new(FileSource::new(PathBuf::from(path))),
        DesiredSource::ControlPlane(cp) => Box::new(HttpSource::new(cp.clone())),
    };
    let (tx, rx) = crossbeam_channel::unbounded();
    let signals = signals::spawn(tx).map_err(DaemonError::Signals)?;
    log::info!(
        "eitri-agent {} starting: host {}, state dir {}, {}",
        crate::version::AGENT_VERSION,
        config.host_id,
        config.state_dir.display(),
        source.describe()
    );
    let mut rng = XorShift::seeded();
    let daemon = Daemon::new(
        config.tick,
        config.backoff_max,
        Parts {
            host: host_info(&config, boot_id),
            store,
            engine,
            source,
            clock: Box::new(SystemClock::new()),
            jitter: Box::new(move || rng.next_unit()),
            readiness,
            notes,
        },
    );
    daemon.run(&rx, config.shutdown_grace);
    signals.stop();
    log::info!("stopped");
    Ok(())
}
