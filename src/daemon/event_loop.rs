//! The main loop (the module steps of [`super`]): events in, engine
//! steps, reports out.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{Receiver, select};

use super::last::load_last;
use super::{ExchangeThread, Link, Readiness, details, metrics};
use crate::deadline::Deadline;
use crate::logonce::LogOnce;
use crate::model::Snapshot;
use crate::pb;
use crate::reconcile::Engine;
use crate::source::Desired;
use crate::state::Store;

/// The shortest gap between two change-driven `report.json` writes: a burst
/// of rows changing (a hundred VMs booting) is a few writes, not a hundred.
pub(super) const MIN_WRITE_GAP: Duration = Duration::from_millis(10);

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
    /// `--image-cache-max`: the most bytes cached images may hold.
    pub image_cache_max: Option<u64>,
    /// `--agents-dir`, for `status` to list the host's claims.
    pub agents_dir: Option<std::path::PathBuf>,
    /// `--max-epoch-step`: how far one unsigned answer may raise the fence.
    pub max_epoch_step: u64,
    /// What each running VM uses, sampled (`--usage-interval`); `None`:
    /// not sampled.
    pub usage: Option<crate::usage::Sampler>,
}

/// Why a snapshot's epoch may not move the fence (see `epoch_rule`).
#[derive(Debug)]
pub(super) enum EpochRefusal {
    /// A signed reset names another fence than the host's.
    ResetFromElsewhere { to: u64, from: u64, current: u64 },
    /// A signed reset this host obeyed once already: replayed after the
    /// fence counted back up to where it was made.
    ResetObeyed { to: u64, current: u64 },
    /// A signed reset that never expires: one found years later would be
    /// obeyed whenever the fence came back to where it was made.
    ResetWithoutExpiry { to: u64 },
    /// An unsigned epoch more than `--max-epoch-step` above the fence.
    TooFar { epoch: u64, current: u64, step: u64 },
    /// An unsigned snapshot asks to lower the fence.
    UnsignedReset { to: u64, current: u64 },
}

impl std::fmt::Display for EpochRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EpochRefusal::ResetFromElsewhere { to, from, current } => write!(
                f,
                "refusing a signed epoch reset to {to} from epoch {from}: this host's fence is {current}. A reset is obeyed only at the fence it names (epoch_reset_from), so one signed before the fence moved on cannot move it back; have the control plane sign a reset from {current}"
            ),
            EpochRefusal::ResetObeyed { to, current } => write!(
                f,
                "refusing a signed epoch reset to {to} from epoch {current}: this host obeyed that very reset before (a reset is obeyed once; this one is replayed). Have the control plane sign a new reset if the fence must move back again"
            ),
            EpochRefusal::ResetWithoutExpiry { to } => write!(
                f,
                "refusing a signed epoch reset to {to} that never expires (no not_after_unix_ms): a reset must carry its expiry, so that it cannot be replayed later; sign it again with an expiry (eitri-agent sign sets one: --valid-for)"
            ),
            EpochRefusal::TooFar {
                epoch,
                current,
                step,
            } => write!(
                f,
                "refusing a snapshot whose epoch {epoch} is more than {step} (--max-epoch-step) above the accepted epoch {current}: unsigned desired state may not move the fence that far (a forged answer could fence the real control plane out for good). Keeping the last accepted desired state; pin the control plane's keys with --trusted-keys to let signed snapshots move it, or raise --max-epoch-step if the control plane's epochs really leap so"
            ),
            EpochRefusal::UnsignedReset { to, current } => write!(
                f,
                "refusing an unsigned snapshot that asks to reset the epoch from {current} to {to}: only desired state signed by a key in --trusted-keys may lower the fence"
            ),
        }
    }
}

impl EpochRefusal {
    /// Its label in `eitri_epoch_refusals_total{kind}`.
    pub(super) fn kind(&self) -> &'static str {
        match self {
            EpochRefusal::ResetFromElsewhere { .. } => "reset_elsewhere",
            EpochRefusal::ResetObeyed { .. } => "reset_obeyed",
            EpochRefusal::ResetWithoutExpiry { .. } => "reset_without_expiry",
            EpochRefusal::TooFar { .. } => "too_far",
            EpochRefusal::UnsignedReset { .. } => "unsigned_reset",
        }
    }
}

impl std::error::Error for EpochRefusal {}

pub struct Daemon {
    pub(super) store: Arc<Store>,
    pub(super) engine: Arc<Engine>,
    pub(super) link: Arc<Link>,
    pub(super) host: pb::HostInfo,
    pub(super) source: String,
    pub(super) remote: bool,
    pub(super) readiness: Option<Readiness>,
    pub(super) notes: Vec<String>,
    pub(super) tick: Duration,
    /// The last accepted desired state, as read and as checked.
    pub(super) last: Option<(Desired, Snapshot)>,
    /// `last` is the one a previous agent persisted, and the source has
    /// not answered this agent yet: it is not acted on (see `step`).
    pub(super) unheard: bool,
    /// The epoch of the stale snapshot the control plane sent last, while
    /// it sends stale ones.
    pub(super) fenced: Option<u64>,
    /// Why the last snapshot's epoch was refused outright (see
    /// `epoch_rule`), while snapshots keep being refused so.
    pub(super) refused_epoch: Option<String>,
    /// Snapshots refused for their epoch, by [`EpochRefusal::kind`].
    pub(super) epoch_refusals: crate::metrics::CounterVec,
    pub(super) max_epoch_step: u64,
    pub(super) logs: LogOnce,
    /// When `report.json` was last written, and whether a change waits.
    pub(super) written: Option<Instant>,
    pub(super) dirty: bool,
    pub(super) metrics: Option<metrics::MetricsFile>,
    pub(super) details: details::Details,
    pub(super) image_cache_max: Option<u64>,
    pub(super) agents_dir: String,
    /// When this agent started (Unix ms), for `status`.
    pub(super) started_at_ms: u64,
    pub(super) usage: Option<crate::usage::Sampler>,
}

impl Daemon {
    /// Builds the main loop, loading the last accepted snapshot if one was
    /// persisted (a restart during an outage keeps converging).
    pub fn new(tick: Duration, parts: Parts) -> Daemon {
        let last = load_last(&parts.store);
        // Before this agent writes its first: the last agent's report.
        let last_report = crate::status::ReportFile::read(parts.store.root()).ok();
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
            unheard: last.is_some(),
            last,
            fenced: None,
            refused_epoch: None,
            epoch_refusals: crate::metrics::CounterVec::default(),
            max_epoch_step: parts.max_epoch_step,
            logs: LogOnce::new(),
            written: None,
            dirty: false,
            metrics: parts.metrics,
            image_cache_max: parts.image_cache_max,
            agents_dir: parts
                .agents_dir
                .map(|d| d.display().to_string())
                .unwrap_or_default(),
            details: details::Details::going_on_from(last_report),
            started_at_ms: details::unix_ms(SystemTime::now()),
            usage: parts.usage,
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
                        if let Some((seq, desired, snap)) = self.link.take_desired() {
                            // The first answer a restarted agent acts on
                            // is its first step over every VM.
                            let news = !std::mem::take(&mut self.unheard);
                            let fresh = self.accept(desired, snap);
                            if news {
                                self.step_news(Some(seq));
                            } else {
                                self.step(Some(seq));
                            }
                            // After the step, which has handed its passes
                            // to their workers: see `accept`.
                            if fresh {
                                self.persist_last();
                            }
                        }
                    }
                    Ok(Event::Contact) => {
                        // The source's first answer was none (an outage, a
                        // refusal): the persisted state is all there is.
                        self.unheard = false;
                        self.dirty = true;
                    }
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

    /// Takes new desired state (see the module's step 1); whether it is new
    /// and so to be persisted.
    ///
    /// It is persisted once the step that acts on it has handed its passes
    /// to their workers, not before: its two fsync waits would otherwise
    /// lie before every create it asks for. The persisted snapshot is only
    /// what an agent restarted during an outage converges to; the fence is
    /// `fence.json`, saved before any pass starts. A crash in between
    /// leaves the previous snapshot on disk: a VM created meanwhile is then
    /// one it no longer names, held for `--vanish-grace` (a day), never
    /// destroyed, until the control plane is heard again.
    fn accept(&mut self, desired: Desired, mut snap: Snapshot) -> bool {
        let Desired {
            mut wire,
            signed_by,
            refused_vms,
            refused_volumes,
            digest,
        } = desired;
        if let Err(why) = self.epoch_rule(&wire, signed_by.as_deref(), digest) {
            self.epoch_refusals.inc(why.kind());
            let why = why.to_string();
            self.logs.warn("epoch", &why);
            self.refused_epoch = Some(why);
            return false;
        }
        if self.refused_epoch.take().is_some() {
            self.logs.clear("epoch");
        }
        let current = self.store.epoch();
        if let Some(key_id) = &signed_by
            && wire.epoch_reset
            && wire.epoch != current
        {
            log::warn!(
                "the fence moves from epoch {current} to {}: a snapshot signed by key {} asks for it (epoch_reset)",
                wire.epoch,
                crate::quote::text(key_id)
            );
            // What an earlier agent persisted has no digest, and never
            // moves the fence: its reset, if it had one, moved it then.
            let Some(reset) = digest else {
                return false;
            };
            if let Err(e) = self.store.obey_reset(wire.epoch, &reset) {
                self.logs.error("epoch-reset", &crate::error::chain(&e));
                return false;
            }
        }
        let current = self.store.epoch();
        let fences = self.remote || signed_by.is_some();
        if fences && wire.epoch < current {
            self.logs.warn(
                "fence",
                &format!(
                    "refusing a stale snapshot: its epoch {} is older than the accepted epoch {current}; keeping the last accepted desired state, and reporting the fence",
                    wire.epoch
                ),
            );
            self.fenced = Some(wire.epoch);
            return false;
        }
        if !fences {
            // An unsigned desired file never fences: a hand-written file
            // may leave the epoch out, or reset it.
            wire.epoch = wire.epoch.max(current);
        }
        if self.fenced.take().is_some() {
            self.logs.clear("fence");
            log::info!("snapshot epoch {} accepted; no longer fenced", wire.epoch);
        }
        let desired = Desired {
            wire,
            signed_by,
            refused_vms,
            refused_volumes,
            digest,
        };
        // A control plane sends the same snapshot tick after tick: check
        // and convert only what changed.
        if self.last.as_ref().is_some_and(|(old, _)| *old == desired) {
            return false;
        }
        // Checked on the exchange thread; only the epoch may have moved.
        snap.epoch = desired.wire.epoch;
        self.logs.clear_prefix("rejected/");
        for rejected in &snap.rejected_vms {
            // Said of the VM where its id is one, so that a VM of this
            // host keeps it among its events ("spec rejected").
            let said = match crate::model::Id::parse(&rejected.raw_id) {
                Ok(id) => format!("VM {id}: spec rejected: {}", rejected.error),
                Err(_) => format!(
                    "refusing the entry {}: {}",
                    crate::quote::text(&rejected.raw_id),
                    rejected.error
                ),
            };
            self.logs
                .warn(&format!("rejected/{}", rejected.raw_id), &said);
        }
        for rejected in &snap.rejected_volumes {
            self.logs.warn(
                &format!("rejected/{}", rejected.raw_id),
                &format!(
                    "refusing the volume entry {}: {}",
                    crate::quote::text(&rejected.raw_id),
                    rejected.error
                ),
            );
        }
        self.last = Some((desired, snap));
        true
    }

    /// What the fence may not be moved by: an unsigned snapshot from a
    /// control plane may raise the epoch by at most `--max-epoch-step`
    /// at once, so one forged answer with epoch 2^64-1 cannot fence the
    /// real control plane out for good; and `epoch_reset` is obeyed only
    /// when signed, and then only at the fence it names (a reset replayed
    /// after the fence moved on moves nothing), only with an expiry, and
    /// only once (its `digest` remembered with the fence it set: one
    /// replayed once the fence counted back up to where it was made moves
    /// nothing either).
    /// Signed desired state moves the fence as it says.
    fn epoch_rule(
        &self,
        wire: &pb::Snapshot,
        signed_by: Option<&str>,
        digest: Option<[u8; 32]>,
    ) -> Result<(), EpochRefusal> {
        let current = self.store.epoch();
        if signed_by.is_some() && wire.epoch_reset {
            if wire.epoch_reset_from != current {
                return Err(EpochRefusal::ResetFromElsewhere {
                    to: wire.epoch,
                    from: wire.epoch_reset_from,
                    current,
                });
            }
            if wire.not_after_unix_ms == 0 {
                return Err(EpochRefusal::ResetWithoutExpiry { to: wire.epoch });
            }
            if digest.is_some_and(|d| self.store.reset_obeyed(&d)) {
                return Err(EpochRefusal::ResetObeyed {
                    to: wire.epoch,
                    current,
                });
            }
        }
        if signed_by.is_some() || !self.remote {
            return Ok(());
        }
        if wire.epoch > current.saturating_add(self.max_epoch_step) {
            return Err(EpochRefusal::TooFar {
                epoch: wire.epoch,
                current,
                step: self.max_epoch_step,
            });
        }
        if wire.epoch_reset && wire.epoch < current {
            return Err(EpochRefusal::UnsignedReset {
                to: wire.epoch,
                current,
            });
        }
        Ok(())
    }

    /// Steps the engine (the module's steps 1 and 2) and reports.
    ///
    /// A snapshot a previous agent persisted is acted on only once the
    /// source has been asked and had nothing newer: it is persisted after
    /// the step that acts on it (see `accept`), so it can be older than
    /// what that agent last did. Acted on at once, it would undo it: a VM
    /// resumed before a crash suspended again, one started stopped again,
    /// only to be redone when the source answers.
    fn step(&mut self, reflects: Option<u64>) {
        let started = Instant::now();
        let report = match &self.last {
            Some((_, snap)) if !self.unheard => self.engine.step(snap),
            _ => self.engine.observe(),
        };
        self.publish(&report, reflects, true);
        self.write_metrics(&report, started);
        self.evict_images();
    }

    /// A step for desired state that arrived between ticks: only the VMs
    /// it changes are woken (see [`Engine::step_news`]), and the report's
    /// details look up the hypervisors' pids only of rows whose power
    /// changed; the next tick does the rest. A create asked for by a new
    /// desired file then shares the host's cores with nothing the agent
    /// could have left for later.
    fn step_news(&mut self, reflects: Option<u64>) {
        let Some((_, snap)) = &self.last else {
            return self.step(reflects);
        };
        let report = self.engine.step_news(snap);
        self.publish(&report, reflects, false);
    }

    /// Holds the image cache to `--image-cache-max`: images no record names
    /// and desired state does not name go, oldest first.
    fn evict_images(&self) {
        let Some(max) = self.image_cache_max else {
            return;
        };
        let wanted: std::collections::HashSet<String> = self
            .last
            .iter()
            .flat_map(|(_, snap)| &snap.vms)
            .filter_map(|vm| match vm {
                crate::model::WantedVm::Present(d) => Some(d.spec.image_sha256.clone()),
                crate::model::WantedVm::Tombstoned(_) => None,
            })
            .collect();
        match crate::image::prune_to(&self.store, &wanted, max) {
            Ok(pruned) if !pruned.removed.is_empty() => {
                let _ = self.logs.clear("image-cache");
                log::info!(
                    "the image cache was over --image-cache-max ({max} bytes): removed {} unused image(s), {} bytes: {}",
                    pruned.removed.len(),
                    pruned.bytes,
                    pruned.removed.join(", ")
                );
            }
            Ok(_) => {}
            Err(e) => {
                let _ = self.logs.warn(
                    "image-cache",
                    &format!(
                        "cannot hold the image cache to --image-cache-max: {}",
                        crate::error::chain(&e)
                    ),
                );
            }
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
}
