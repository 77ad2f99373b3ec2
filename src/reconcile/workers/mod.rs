//! One long-lived OS thread per VM, and the router's side of talking to it.
//!
//! Protocol between `Engine::step` (the router) and a VM's worker:
//! 1. The step writes the VM's newest assignment into the worker's mailbox
//!    ([`mailbox`]; replacing any the worker has not taken yet: latest
//!    wins). Once the step's report is built, [`Workers::ring`] hands the
//!    doorbells of every VM it wrote to (and, for a tick's re-check, the
//!    roster of every worker) to [`Workers::send`]: a batch of at most a
//!    chunk ([`router::RING_CHUNK`], 16) is rung on the step's thread at
//!    once, which makes a single create one thread hop; a larger one goes
//!    to the `router` thread ([`router`]), which rings it a chunk at a
//!    time. A doorbell is a bounded(1) channel, so ringing never blocks
//!    and a worker woken once sees every assignment written before it
//!    looked. Ringing a thousand doorbells is a thousand futex wakes, and
//!    the woken workers would preempt the step on a small host; off the
//!    step's thread, the heartbeat pays for neither.
//! 2. The worker ([`thread`]) takes the mailbox, starts a pass with a fresh
//!    generation ([`shared`]),
//!    and runs it. Mid-pass it may publish narration tagged with that
//!    generation; when the pass ends it publishes the final result and
//!    closes the generation.
//! 3. A publish lands only while its generation is the live one, so a row
//!    from a pass that ended (e.g. a download progress callback firing after
//!    the pass gave up) can never overwrite a newer one.
//! 4. The step reads published results at any time without waiting
//!    ([`rows`]); a worker busy for minutes delays nothing.
//! 5. Retiring a worker empties its mailbox, then drops its doorbell; the
//!    worker ends after its current pass (a ring still buffered finds the
//!    mailbox empty, so no stale assignment runs) and the router joins it
//!    once it has finished.
//!
//!    One pass per VM, ever: a VM that comes back while its retired worker
//!    is still inside a pass (waiting for a host key, a slot, a download)
//!    gets a new worker that first waits for the old one to end. Two passes
//!    of one VM at once would clone its disk and boot it twice.
//! 6. A poke ([`pokes`]; a VMM exited on its own) runs a pass at once
//!    without a step:
//!    the worker's newest assignment is put back in its mailbox, unless a
//!    newer one is already waiting there, and its doorbell rung. The rules
//!    the pass applies are the tick's: a poke only changes *when* it runs.
//!    At most one poke per [`POKE_SPACING`] per VM runs at once; a VMM that
//!    keeps crashing as soon as it boots is retried at the tick's pace, not
//!    as fast as it can crash.
//! 7. Whenever a worker's published result changes, the engine's change
//!    doorbell rings (bounded(1): many changes, one wake), so the daemon can
//!    write the report at once instead of at the next tick.
//!
//! A pass that panics is caught on the worker and fails that VM's row; a
//! worker whose thread is gone (it could not be spawned, or its loop ended)
//! is noticed on the next delivery, reported, and spawned again. Neither
//! touches other VMs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use parking_lot::Mutex;

mod mailbox;
mod pokes;
mod router;
mod rows;
mod shared;
mod thread;

pub(crate) use self::pokes::Pokes;
use self::router::{Batch, Doorbell, RING_CHUNK, Ringer, ring_now};
use self::rows::Collected;
use self::shared::Signals;
use self::thread::WorkerHandle;
use super::Trigger;
use super::pass::{Assignment, VmResult};
use super::step::Spine;
use crate::deadline::Deadline;
use crate::model::Id;

/// How soon after one poke of a VM another may run a pass at once.
pub(crate) const POKE_SPACING: Duration = Duration::from_secs(10);

/// Every VM's worker, owned by the engine's router.
pub(crate) struct Workers {
    /// Ordered by id, so a report collected from them is already sorted.
    live: BTreeMap<Id, WorkerHandle>,
    /// Workers told to stop, by VM, joined once their thread has finished;
    /// never joined inline, since a worker may be inside a long pass. A VM
    /// that comes back takes its entry: its new worker waits for it.
    retiring: HashMap<Id, JoinHandle<()>>,
    stack_bytes: usize,
    /// Doorbells of the assignments written this step, rung by
    /// [`Workers::ring`].
    to_ring: Vec<Doorbell>,
    /// Every live worker's doorbell, made once for as long as the workers
    /// stay the same (`None`: to be made again). A tick's re-check hands it
    /// to the router whole, instead of a copy of ten thousand doorbells.
    roster: Option<Arc<Vec<Doorbell>>>,
    /// A re-check of every worker asked this step, as of its instant.
    recheck: Option<(Arc<Vec<Doorbell>>, Instant)>,
    /// How many worker loops had ended when the last full delivery began:
    /// a worker that died since makes the next step a full delivery, which
    /// starts it again.
    ended_seen: usize,
    /// The last rows collected, reused while no result changed and the
    /// workers stayed the same.
    collected: Mutex<Option<Collected>>,
    ringer: Option<Ringer>,
    pokes: Arc<Pokes>,
    signals: Arc<Signals>,
}

impl Workers {
    /// `changed` is the engine's change doorbell (see step 7).
    pub(crate) fn new(stack_bytes: usize, changed: Sender<()>) -> Workers {
        let ringer = Ringer::start(stack_bytes);
        Workers {
            live: BTreeMap::new(),
            retiring: HashMap::new(),
            stack_bytes,
            to_ring: Vec::new(),
            roster: None,
            recheck: None,
            ended_seen: 0,
            collected: Mutex::new(None),
            ringer,
            pokes: Arc::new(Pokes::default()),
            signals: Signals::new(changed),
        }
    }

    /// Workers whose thread is alive (live or still finishing).
    pub(crate) fn alive(&self) -> usize {
        self.live.len() + self.retiring.len()
    }

    pub(crate) fn pokes(&self) -> Arc<Pokes> {
        Arc::clone(&self.pokes)
    }

    /// Writes `vm_id`'s newest assignment into its worker's mailbox,
    /// starting the worker if it has none and restarting it if its thread is
    /// gone. The worker is woken by the next [`Workers::ring`]. A new worker
    /// starts with `initial()` as its row, so the VM is in the very report
    /// of the step that first names it, not one tick later.
    ///
    /// For a [`Trigger::News`] step, a live worker whose last assignment
    /// is this one is left as it is, neither given it again nor woken:
    /// nothing it works toward changed, and the next tick's level trigger
    /// runs it.
    pub(crate) fn deliver(
        &mut self,
        vm_id: &Id,
        assignment: Assignment,
        trigger: Trigger,
        spine: &Arc<Spine>,
        initial: impl FnOnce() -> Option<VmResult>,
    ) {
        let dead = self.live.get(vm_id).map(WorkerHandle::is_dead);
        match dead {
            None => {
                let predecessor = self.retiring.remove(vm_id);
                let handle = self.spawn(vm_id, spine, initial(), predecessor);
                self.live.insert(vm_id.clone(), handle);
                self.changed_workers();
            }
            Some(true) => self.restart(vm_id, spine),
            Some(false) => {}
        }
        let Some(handle) = self.live.get(vm_id) else {
            return;
        };
        // A worker that did not start takes no work: nothing would ever
        // take it, and the next delivery brings a newer assignment anyway.
        if handle.thread.is_some() {
            let mut mailbox = handle.shared.mailbox.lock();
            if trigger == Trigger::News && mailbox.last.as_ref() == Some(&assignment) {
                return;
            }
            mailbox.deliver(assignment);
            drop(mailbox);
            self.to_ring.push(handle.doorbell_of());
        }
    }

    /// A full delivery begins: a worker that dies from now on is seen by
    /// the next [`Workers::redeliver_all`].
    pub(crate) fn full_delivery_begins(&mut self) {
        self.ended_seen = self.signals.ended.load(Ordering::Acquire);
    }

    /// Asks every worker to run its newest assignment again, for the level
    /// trigger of a step whose snapshot and records are the ones of the
    /// step before (what a full delivery would write is what each worker
    /// already has). The asking is the router's, a chunk at a time; the
    /// step only hands it the roster. Returns false when a worker's thread
    /// is gone or never started: the full delivery the caller then makes
    /// replaces it.
    pub(crate) fn redeliver_all(&mut self, now: Instant) -> bool {
        if self.signals.ended.load(Ordering::Acquire) != self.ended_seen {
            return false;
        }
        let roster = match &self.roster {
            Some(roster) => Arc::clone(roster),
            None => {
                if self.live.values().any(|h| h.thread.is_none()) {
                    return false;
                }
                let roster: Arc<Vec<Doorbell>> =
                    Arc::new(self.live.values().map(WorkerHandle::doorbell_of).collect());
                self.roster = Some(Arc::clone(&roster));
                roster
            }
        };
        self.recheck = Some((roster, now));
        true
    }

    /// Wakes every worker delivered to since the last ring, and every one
    /// a re-check was asked of.
    pub(crate) fn ring(&mut self) {
        let delivered = std::mem::take(&mut self.to_ring);
        if !delivered.is_empty() {
            self.send(Batch {
                bells: Arc::new(delivered),
                recheck: None,
            });
        }
        if let Some((roster, now)) = self.recheck.take() {
            self.send(Batch {
                bells: roster,
                recheck: Some(now),
            });
        }
    }

    /// Hands `rings` to the router; rings them here if it is gone, or if
    /// they are a chunk's worth: as few wakes as the router would make at
    /// once, without the router's own wake in between (a create's dispatch
    /// is then one thread hop, not two).
    fn send(&self, batch: Batch) {
        let undelivered = match &self.ringer {
            Some(_) if batch.bells.len() <= RING_CHUNK => Some(batch),
            Some(ringer) => {
                ringer.pending.fetch_add(1, Ordering::AcqRel);
                ringer.batches.send(batch).err().map(|e| {
                    ringer.pending.fetch_sub(1, Ordering::AcqRel);
                    e.into_inner()
                })
            }
            None => Some(batch),
        };
        if let Some(batch) = undelivered {
            ring_now(&batch.bells, batch.recheck);
        }
    }

    /// Replaces a worker whose thread is gone. If the new thread cannot
    /// start either, the VM's row says so and the next delivery tries again.
    fn restart(&mut self, vm_id: &Id, spine: &Arc<Spine>) {
        let mut last = None;
        let mut predecessor = None;
        if let Some(old) = self.live.remove(vm_id) {
            log::error!("VM {vm_id}: its worker thread is gone; starting a new one");
            last = old.shared.result();
            predecessor = old.thread;
        }
        let new = self.spawn(vm_id, spine, last, predecessor);
        self.live.insert(vm_id.clone(), new);
        self.changed_workers();
    }

    fn spawn(
        &self,
        vm_id: &Id,
        spine: &Arc<Spine>,
        initial: Option<VmResult>,
        predecessor: Option<JoinHandle<()>>,
    ) -> WorkerHandle {
        let handle = thread::spawn(
            vm_id,
            spine,
            self.stack_bytes,
            Arc::clone(&self.signals),
            initial,
            predecessor,
        );
        self.pokes.insert(vm_id, &handle);
        handle
    }

    /// Retires the workers of VMs not in `keep`.
    pub(crate) fn retire_absent(&mut self, keep: &HashSet<&Id>) {
        let gone: Vec<Id> = self
            .live
            .keys()
            .filter(|id| !keep.contains(id))
            .cloned()
            .collect();
        if !gone.is_empty() {
            self.changed_workers();
        }
        for id in gone {
            self.pokes.remove(&id);
            if let Some(handle) = self.live.remove(&id) {
                // Emptied first: a ring still buffered must find nothing
                // to run. Then dropping `handle.doorbell` is the stop signal.
                handle.shared.mailbox.lock().clear();
                if let Some(thread) = handle.thread {
                    self.retiring.insert(id, thread);
                }
            }
        }
    }

    /// Joins retired workers whose threads have finished.
    pub(crate) fn join_finished(&mut self) {
        let done: Vec<Id> = self
            .retiring
            .iter()
            .filter(|(_, t)| t.is_finished())
            .map(|(id, _)| id.clone())
            .collect();
        for thread in done.iter().filter_map(|id| self.retiring.remove(id)) {
            // A worker catches its passes' panics; a panic here would be in
            // the loop itself, and there is nothing left of it to fail.
            let _ = thread.join();
        }
    }

    pub(crate) fn is_idle(&self) -> bool {
        let routing = self
            .ringer
            .as_ref()
            .is_some_and(|r| r.pending.load(Ordering::Acquire) > 0);
        !routing && self.live.values().all(|h| h.shared.is_idle())
    }

    /// Stops every worker: no new passes start, and each thread is joined if
    /// it finishes by `deadline`. One stuck in a provisioner call is detached
    /// and left to finish on its own (the process exiting ends it): a second
    /// `stop_all` (the engine's drop after the daemon's shutdown) must not
    /// wait for it all over again.
    pub(crate) fn stop_all(&mut self, deadline: Deadline) {
        self.to_ring.clear();
        self.pokes.clear();
        // The router ends once its channel closes; joining it drops every
        // doorbell clone it held, so the workers see theirs close.
        if let Some(ringer) = self.ringer.take() {
            drop(ringer.batches);
            crate::threads::join_within(ringer.thread, deadline);
        }
        self.changed_workers();
        self.recheck = None;
        let handles: Vec<_> = std::mem::take(&mut self.live).into_iter().collect();
        for (id, handle) in handles {
            handle.shared.mailbox.lock().clear();
            drop(handle.doorbell);
            if let Some(thread) = handle.thread {
                // A VM whose worker waits for a retired predecessor: the
                // waiting worker holds that one and ends after it.
                self.retiring.insert(id, thread);
            }
        }
        while !self.retiring.is_empty() && !deadline.expired() {
            self.join_finished();
            if !self.retiring.is_empty() {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        self.join_finished();
        if !self.retiring.is_empty() {
            log::warn!(
                "{} VM worker(s) still inside a pass at shutdown; leaving them to finish",
                self.retiring.len()
            );
            // Dropping a JoinHandle detaches its thread.
            self.retiring.clear();
        }
    }
}
