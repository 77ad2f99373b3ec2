//! The exchange with the source of desired state, on its own `source`
//! thread, so that nothing local ever waits on the network: a control plane
//! that hangs for its whole request timeout delays no repair, no report
//! write, no shutdown.
//!
//! One contact, in order:
//! 1. Fetch desired state. Something new is handed to the main loop through
//!    the [`Link`] (latest wins) and the main loop is woken.
//! 2. For a control plane: wait, briefly, for the main loop's report that
//!    reflects what was just handed over (every VM it names has a row, if
//!    only `queued`), then send the newest report.
//! 3. Settle the contact: the state the main loop writes into
//!    `report.json` is updated before the next report is written, and the
//!    next contact is scheduled from the *end* of this one: a tick after a
//!    success, the backoff after a failure (so a slow request timing out
//!    never eats the backoff).
//!
//! Between contacts the thread sleeps until the next is due, or until the
//! main loop asks for a reload (SIGHUP) or to stop, or (standalone mode)
//! until the desired file changes.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, bounded, select};
use parking_lot::{Condvar, Mutex};

use super::{Backoff, Clock, Event};
use crate::deadline::Deadline;
use crate::error::chain;
use crate::logonce::LogOnce;
use crate::model::Snapshot;
use crate::pb::{self, convert};
use crate::source::{Desired, Source, SourceError};
use crate::threads::join_within;

/// How the contact went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Contact {
    Ok,
    /// Failed; the next contact waits this long.
    Failed {
        error: String,
        retry_in: Duration,
    },
}

/// What the main loop and the exchange share. Each side only ever holds a
/// lock for a copy in or out.
pub struct Link {
    /// Desired state fetched and not yet taken by the main loop, with its
    /// sequence number and its checked form.
    desired: Mutex<Option<(u64, Desired, Snapshot)>>,
    report: Mutex<Published>,
    published: Condvar,
    /// How the last contact went, as `report.json` says it.
    contact: Mutex<String>,
    /// Failed contacts, by kind (see `SourceError::kind`).
    failures: crate::metrics::CounterVec,
    events: Sender<Event>,
}

#[derive(Default)]
struct Published {
    report: Option<pb::Report>,
    /// The sequence number of the newest desired state this report reflects.
    reflects: u64,
    /// Bumped at every publish.
    generation: u64,
}

impl Link {
    pub fn new(events: Sender<Event>) -> Arc<Link> {
        Arc::new(Link {
            desired: Mutex::new(None),
            report: Mutex::new(Published::default()),
            published: Condvar::new(),
            contact: Mutex::new("not yet".into()),
            failures: crate::metrics::CounterVec::default(),
            events,
        })
    }

    /// Hands `desired` over with its checked form, made here: checking the
    /// largest snapshot the limits allow takes ~130 ms (`make bench-intake`),
    /// which this thread spends and the main loop never waits for.
    fn hand(&self, seq: u64, desired: Desired) {
        let mut snap = convert::snapshot_from_wire(&desired.wire);
        snap.refuse_more(desired.refused_vms.clone(), desired.refused_volumes.clone());
        *self.desired.lock() = Some((seq, desired, snap));
        let _ = self.events.send(Event::Desired);
    }

    /// The newest desired state handed over, with its checked form, if the
    /// main loop has not taken it yet.
    pub fn take_desired(&self) -> Option<(u64, Desired, Snapshot)> {
        self.desired.lock().take()
    }

    /// The main loop's newest report; `reflects` is the sequence number of
    /// the desired state it was made from, when it was made from a new one.
    pub fn publish(&self, report: pb::Report, reflects: Option<u64>) {
        let mut p = self.report.lock();
        p.report = Some(report);
        if let Some(seq) = reflects {
            p.reflects = p.reflects.max(seq);
        }
        p.generation += 1;
        self.published.notify_all();
    }

    pub fn newest_report(&self) -> Option<pb::Report> {
        self.report.lock().report.clone()
    }

    /// How many reports have been published.
    pub fn generation(&self) -> u64 {
        self.report.lock().generation
    }

    /// Waits until a report newer than `generation` is published, at most
    /// `bound`; returns whether one was.
    pub fn wait_generation(&self, generation: u64, bound: Duration) -> bool {
        let until = Instant::now() + bound;
        let mut p = self.report.lock();
        while p.generation <= generation {
            if self.published.wait_until(&mut p, until).timed_out() {
                return p.generation > generation;
            }
        }
        true
    }

    fn wait_reflecting(&self, seq: u64, bound: Duration) {
        let until = Instant::now() + bound;
        let mut p = self.report.lock();
        while p.reflects < seq {
            if self.published.wait_until(&mut p, until).timed_out() {
                return;
            }
        }
    }

    /// Failed contacts so far, by kind.
    pub fn failures(&self) -> &crate::metrics::CounterVec {
        &self.failures
    }

    pub fn contact(&self) -> String {
        self.contact.lock().clone()
    }

    fn set_contact(&self, text: String) {
        let changed = {
            let mut contact = self.contact.lock();
            let changed = *contact != text;
            *contact = text;
            changed
        };
        if changed {
            let _ = self.events.send(Event::Contact);
        }
    }
}

/// What the main loop can ask of the exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceCtl {
    /// Read afresh now (SIGHUP).
    Reload,
    Stop,
}

pub struct Exchange {
    source: Box<dyn Source>,
    host: pb::HostInfo,
    tick: Duration,
    backoff: Backoff,
    clock: Box<dyn Clock>,
    /// Jitter draws in `[0, 1)`.
    jitter: Box<dyn FnMut() -> f64 + Send>,
    link: Arc<Link>,
    next_contact: Duration,
    seq: u64,
    logs: LogOnce,
}

/// How long a contact waits for the main loop to reflect a new snapshot in
/// its report before sending what it has. The main loop steps at once on a
/// new snapshot, so this is reached only if it is stuck; the report then
/// goes out a little stale rather than not at all.
const REFLECT_WAIT: Duration = Duration::from_secs(2);

impl Exchange {
    pub fn new(
        source: Box<dyn Source>,
        host: pb::HostInfo,
        tick: Duration,
        backoff_max: Duration,
        clock: Box<dyn Clock>,
        jitter: Box<dyn FnMut() -> f64 + Send>,
        link: Arc<Link>,
    ) -> Exchange {
        Exchange {
            source,
            host,
            tick,
            backoff: Backoff::new(tick, backoff_max),
            clock,
            jitter,
            link,
            next_contact: Duration::ZERO,
            seq: 0,
            logs: LogOnce::new(),
        }
    }

    /// How long until the next contact is due (zero: now).
    pub fn due_in(&self) -> Duration {
        self.next_contact.saturating_sub(self.clock.now())
    }

    /// A contact if one is due now; `None` while waiting (for the next
    /// tick, or out a backoff).
    pub fn contact_if_due(&mut self) -> Option<Contact> {
        self.due_in().is_zero().then(|| self.contact())
    }

    /// One contact (see the module steps).
    pub fn contact(&mut self) -> Contact {
        let remote = self.source.is_remote();
        let mut failure = None;
        match self.source.fetch(&self.host) {
            Ok(Some(desired)) => {
                self.seq += 1;
                self.link.hand(self.seq, desired);
                if remote {
                    self.link.wait_reflecting(self.seq, REFLECT_WAIT);
                }
            }
            Ok(None) => {}
            Err(e) => failure = Some(e),
        }
        // An answer refused is still an answer: the control plane hears at
        // once that it was refused, and what the host runs meanwhile.
        let refused = failure.as_ref().and_then(SourceError::refusal);
        if remote
            && (failure.is_none() || refused.is_some())
            && let Some(mut report) = self.newest_report()
        {
            report.refused = refused;
            if let Err(e) = self.source.send_report(&self.host, &report) {
                failure = Some(e);
            }
        }
        self.settle(failure)
    }

    /// The main loop's newest report; at a first contact, waited for
    /// (briefly) when the main loop has published none yet.
    fn newest_report(&self) -> Option<pb::Report> {
        if self.link.generation() == 0 {
            self.link.wait_generation(0, REFLECT_WAIT);
        }
        self.link.newest_report()
    }

    fn settle(&mut self, failure: Option<SourceError>) -> Contact {
        let ended = self.clock.now();
        match failure {
            None => {
                if self.backoff.failures() > 0 || self.logs.clear("contact") {
                    log::info!("{} reachable again", self.source.describe());
                }
                self.backoff.reset();
                self.next_contact = ended + self.tick;
                self.link.set_contact("ok".into());
                Contact::Ok
            }
            Some(e) => {
                self.link.failures.inc(e.kind());
                let error = chain(&e);
                // A refused answer (not a snapshot, a bad signature,
                // another host's, expired) is backed off like no answer:
                // the control plane was told (its report says so), and a
                // thousand hosts behind one broken proxy must not ask it
                // again at every tick.
                let retry_in = if self.source.is_remote() {
                    self.backoff.fail((self.jitter)())
                } else {
                    self.backoff.reset();
                    self.tick
                };
                self.next_contact = ended + retry_in;
                self.logs.warn("contact", &error);
                self.link.set_contact(error.clone());
                Contact::Failed { error, retry_in }
            }
        }
    }

    /// Contacts whenever one is due or asked for, until told to stop.
    fn run(mut self, ctl: &Receiver<SourceCtl>) {
        let (changed, changes) = bounded::<()>(1);
        #[cfg(target_os = "linux")]
        let _watcher = match self.source.watch(changed.clone()) {
            Ok(watcher) => watcher,
            Err(e) => {
                log::warn!(
                    "cannot watch {} ({e}); changes are read at the tick",
                    self.source.describe()
                );
                None
            }
        };
        // Held for the loop's life: a disconnected channel would be ready
        // at every select.
        let _changed = changed;
        loop {
            let asked = select! {
                recv(ctl) -> msg => match msg {
                    Ok(SourceCtl::Reload) => {
                        self.source.reload();
                        true
                    }
                    Ok(SourceCtl::Stop) | Err(_) => return,
                },
                recv(changes) -> _ => true,
                default(self.due_in()) => false,
            };
            if asked {
                self.contact();
            } else {
                self.contact_if_due();
            }
        }
    }

    /// Runs the exchange on its own `source` thread.
    pub fn spawn(self) -> std::io::Result<ExchangeThread> {
        let (ctl, rx) = crossbeam_channel::unbounded();
        let thread = std::thread::Builder::new()
            .name("source".into())
            .spawn(move || self.run(&rx))?;
        Ok(ExchangeThread {
            ctl,
            thread: Some(thread),
        })
    }
}

/// The `source` thread.
pub struct ExchangeThread {
    ctl: Sender<SourceCtl>,
    thread: Option<JoinHandle<()>>,
}

impl ExchangeThread {
    pub fn reload(&self) {
        let _ = self.ctl.send(SourceCtl::Reload);
    }

    /// Asks the thread to stop; it does so between contacts.
    pub fn ask_to_stop(&self) {
        let _ = self.ctl.send(SourceCtl::Stop);
    }

    /// Joins the thread if it stops by `deadline`. One inside a request
    /// that has not timed out yet is left behind: the process exiting ends
    /// it, and the agent's exit must not wait on the network either.
    pub fn join(mut self, deadline: Deadline) {
        if let Some(thread) = self.thread.take() {
            join_within(thread, deadline);
        }
    }
}

/// Dropped without [`ExchangeThread::join`]: asked to stop, and given a
/// request timeout's worth of a moment at most; the process exiting ends
/// one still inside a request.
const DROP_JOIN: Duration = Duration::from_secs(1);

impl Drop for ExchangeThread {
    fn drop(&mut self) {
        self.ask_to_stop();
        if let Some(thread) = self.thread.take() {
            join_within(thread, Deadline::after(DROP_JOIN));
        }
    }
}
