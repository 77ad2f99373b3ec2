//! One long-lived OS thread per VM, and the router's side of talking to it.
//!
//! Protocol between `Engine::step` (the router) and a VM's worker:
//! 1. The router writes the VM's newest assignment into the worker's mailbox
//!    (replacing any the worker has not taken yet: latest wins). Once the
//!    step's report is built, it hands the doorbells of every VM it wrote to
//!    to the `router` thread, which rings them: a doorbell is a bounded(1)
//!    channel, so ringing never blocks and a worker woken once sees every
//!    assignment written before it looked. Ringing a thousand doorbells is a
//!    thousand futex wakes, and the woken workers would preempt the step on
//!    a small host; off the step's thread, the heartbeat pays for neither.
//! 2. The worker takes the mailbox, starts a pass with a fresh generation,
//!    and runs it. Mid-pass it may publish narration tagged with that
//!    generation; when the pass ends it publishes the final result and
//!    closes the generation.
//! 3. A publish lands only while its generation is the live one, so a row
//!    from a pass that ended (e.g. a download progress callback firing after
//!    the pass gave up) can never overwrite a newer one.
//! 4. The router reads published results at any time without waiting; a
//!    worker busy for minutes delays nothing.
//! 5. Retiring a worker empties its mailbox, then drops its doorbell; the
//!    worker ends after its current pass (a ring still buffered finds the
//!    mailbox empty, so no stale assignment runs) and the router joins it
//!    once it has finished.
//!
//!    One pass per VM, ever: a VM that comes back while its retired worker
//!    is still inside a pass (waiting for a host key, a slot, a download)
//!    gets a new worker that first waits for the old one to end. Two passes
//!    of one VM at once would clone its disk and boot it twice.
//! 6. A poke (a VMM exited on its own) runs a pass at once without a step:
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
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, bounded};
use parking_lot::Mutex;

use super::pass::{Assignment, Core, PassOutcome, VmResult};
use crate::deadline::Deadline;
use crate::model::{Id, Phase, QuarantinedVm, Rows, VmStatus};
use crate::stages;

/// How soon after one poke of a VM another may run a pass at once.
pub(crate) const POKE_SPACING: Duration = Duration::from_secs(10);

/// What a worker shares with the router.
pub(crate) struct WorkerShared {
    mailbox: Mutex<Mailbox>,
    published: Mutex<Published>,
    signals: Arc<Signals>,
    /// When a poke last ran a pass for this VM.
    poked: Mutex<Option<Instant>>,
}

/// What every worker tells the engine, one for all of them.
pub(crate) struct Signals {
    /// The engine's change doorbell, rung when a VM's result changes.
    changed: Sender<()>,
    /// How many worker loops have ended.
    ended: AtomicUsize,
    /// How many times a published result has changed: rows collected at
    /// one count are the rows as long as it stays the same.
    published: AtomicU64,
}

impl Signals {
    pub(crate) fn new(changed: Sender<()>) -> Arc<Signals> {
        Arc::new(Signals {
            changed,
            ended: AtomicUsize::new(0),
            published: AtomicU64::new(0),
        })
    }
}

/// What the worker is to run next, and what it last was given. One lock
/// for all of it: a tick's re-check of ten thousand VMs costs one lock per
/// VM, and never a copy of an assignment.
#[derive(Default)]
struct Mailbox {
    /// Delivered and not yet taken; a newer delivery replaces it.
    waiting: Option<Assignment>,
    /// The newest assignment ever delivered: what a re-check or a poke
    /// runs again.
    last: Option<Assignment>,
    /// Run `last` again (when nothing newer is waiting).
    again: bool,
    /// The worker's loop is over: its thread is ending or gone.
    ended: bool,
    /// When the work waiting now was asked for: the pass's dispatch time.
    asked_at: Option<Instant>,
}

impl Mailbox {
    fn deliver(&mut self, assignment: Assignment) {
        self.waiting = Some(assignment.clone());
        self.last = Some(assignment);
        self.again = false;
        self.asked_at = Some(Instant::now());
    }

    /// Asks for `last` to run again, as of `now`. Returns whether there is
    /// work to wake the worker for (a worker never given anything has none).
    fn again(&mut self, now: Instant) -> bool {
        if self.last.is_some() && !self.has_work() {
            self.again = true;
            self.asked_at = Some(now);
        }
        self.has_work()
    }

    fn take(&mut self) -> Option<Assignment> {
        let again = std::mem::take(&mut self.again);
        match self.waiting.take() {
            Some(newest) => Some(newest),
            None if again => self.last.clone(),
            None => None,
        }
    }

    /// How long the work just taken waited for its worker.
    fn waited(&mut self) -> Duration {
        self.asked_at
            .take()
            .map_or(Duration::ZERO, |at| at.elapsed())
    }

    fn has_work(&self) -> bool {
        self.waiting.is_some() || self.again
    }

    /// Forgets everything: a ring still buffered finds nothing to run.
    fn clear(&mut self) {
        self.waiting = None;
        self.last = None;
        self.again = false;
        self.asked_at = None;
    }
}

#[derive(Default)]
struct Published {
    last_generation: u64,
    /// The generation of the pass running now, if any.
    live: Option<u64>,
    result: Option<VmResult>,
    /// The result's row as reported (its host key stamped), made once
    /// when the result changes, shared by every report until then.
    row: Option<Arc<VmStatus>>,
}

impl WorkerShared {
    fn new(signals: Arc<Signals>, initial: Option<VmResult>) -> WorkerShared {
        WorkerShared {
            mailbox: Mutex::new(Mailbox::default()),
            published: Mutex::new(Published {
                row: initial
                    .as_ref()
                    .and_then(VmResult::stamped_row)
                    .map(Arc::new),
                result: initial,
                ..Published::default()
            }),
            signals,
            poked: Mutex::new(None),
        }
    }

    /// Replaces the published result, ringing the change doorbell when it
    /// differs. Full means a wake is already pending; disconnected means
    /// nobody listens. Neither is this worker's business.
    fn set_result(&self, p: &mut Published, result: VmResult) {
        if p.result.as_ref() != Some(&result) {
            p.row = result.stamped_row().map(Arc::new);
            p.result = Some(result);
            // Under the lock: a collection that read the count before this
            // reads the new row after it.
            self.signals.published.fetch_add(1, Ordering::Release);
            let _ = self.signals.changed.try_send(());
        }
    }

    fn begin_pass(&self) -> u64 {
        let mut p = self.published.lock();
        p.last_generation += 1;
        p.live = Some(p.last_generation);
        p.last_generation
    }

    fn end_pass(&self, generation: u64, outcome: PassOutcome) {
        let mut p = self.published.lock();
        if p.live != Some(generation) {
            return;
        }
        p.live = None;
        match outcome {
            PassOutcome::Done(result) => self.set_result(&mut p, result),
            // The VM's row stays frozen at what it last said; a VM that
            // never said anything gets the reason it is not being worked on.
            PassOutcome::Skipped { fallback, .. } => {
                if p.result.is_none() {
                    self.set_result(&mut p, fallback);
                }
            }
        }
    }

    fn publish(&self, generation: u64, result: VmResult) {
        let mut p = self.published.lock();
        if p.live == Some(generation) {
            self.set_result(&mut p, result);
        }
    }

    fn set_failed(&self, vm_id: &Id, why: String) {
        let mut p = self.published.lock();
        self.set_result(&mut p, VmResult::failed_unobserved(vm_id, why));
    }

    fn is_idle(&self) -> bool {
        !self.mailbox.lock().has_work() && self.published.lock().live.is_none()
    }

    fn result(&self) -> Option<VmResult> {
        self.published.lock().result.clone()
    }
}

/// A pass's handle for publishing mid-pass. Cheap to clone and `'static`,
/// so it can ride a progress callback onto another thread; the generation
/// check keeps it harmless once the pass is over.
#[derive(Clone)]
pub(crate) struct Publisher {
    shared: Arc<WorkerShared>,
    generation: u64,
}

impl Publisher {
    pub(crate) fn publish(&self, result: VmResult) {
        self.shared.publish(self.generation, result);
    }
}

struct WorkerHandle {
    shared: Arc<WorkerShared>,
    doorbell: Sender<()>,
    thread: Option<JoinHandle<()>>,
}

impl WorkerHandle {
    /// Its thread never started, or its loop is over.
    fn is_dead(&self) -> bool {
        self.thread.is_none() || self.shared.mailbox.lock().ended
    }
}

/// Every live worker's shared half and doorbell, by VM: what a poke needs.
/// Kept apart from the worker table, under a lock held only for a lookup,
/// so a poke (from a reaper thread) never waits on a step, nor on a
/// shutdown that holds the table while passes finish.
#[derive(Default)]
pub(crate) struct Pokes(Mutex<HashMap<Id, Pokeable>>);

/// A worker's shared half and its doorbell.
type Pokeable = (Arc<WorkerShared>, Sender<()>);

impl Pokes {
    /// Runs a pass for `vm_id` at once, on its newest assignment (see the
    /// module's step 6). Returns whether a pass was asked for: a VM with no
    /// worker, or whose worker never got an assignment, has nothing to run.
    pub(crate) fn poke(&self, vm_id: &Id) -> bool {
        let Some((shared, doorbell)) = self.0.lock().get(vm_id).cloned() else {
            return false;
        };
        {
            let mut poked = shared.poked.lock();
            if poked.is_some_and(|at| at.elapsed() < POKE_SPACING) {
                log::debug!("VM {vm_id}: poked again within {POKE_SPACING:?}; left to the tick");
                return false;
            }
            *poked = Some(Instant::now());
        }
        if !shared.mailbox.lock().again(Instant::now()) {
            return false;
        }
        // Full: a pass is already due, and it takes the mailbox.
        let _ = doorbell.try_send(());
        true
    }

    fn insert(&self, vm_id: &Id, handle: &WorkerHandle) {
        self.0.lock().insert(
            vm_id.clone(),
            (Arc::clone(&handle.shared), handle.doorbell.clone()),
        );
    }

    fn remove(&self, vm_id: &Id) {
        self.0.lock().remove(vm_id);
    }

    fn clear(&self) {
        self.0.lock().clear();
    }
}

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
    to_ring: Vec<Bell>,
    /// Every live worker's doorbell, made once for as long as the workers
    /// stay the same (`None`: to be made again). A tick's re-check hands it
    /// to the router whole, instead of a copy of ten thousand doorbells.
    roster: Option<Arc<Vec<Bell>>>,
    /// A re-check of every worker asked this step, as of its instant.
    recheck: Option<(Arc<Vec<Bell>>, Instant)>,
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

/// Rows and quarantined entries collected from every worker.
struct Collected {
    /// The published count they were collected at.
    count: u64,
    /// The VMs whose rows were left out.
    skipped: Vec<Id>,
    rows: Rows,
    quarantined: Vec<QuarantinedVm>,
}

/// What the router rings: the doorbells, and for a re-check the instant
/// as of which each worker is first asked to run its last assignment again.
type Rings = (Arc<Vec<Bell>>, Option<Instant>);

/// A worker's doorbell, with what tells whether it took its mailbox.
type Bell = (Sender<()>, Arc<WorkerShared>);

/// Workers woken at once by the router. Waking ten thousand at once makes
/// ten thousand threads runnable on a few cores: each finishes its pass
/// in microseconds, but they are still queued when the next step (or the
/// heartbeat) wants the CPU, and preempt it for whole time slices. A chunk
/// is woken once the previous one has taken its mailboxes (begun its
/// passes; a long pass, a create or a stop, then blocks, off the CPU).
const RING_CHUNK: usize = 16;

/// How long the router waits for a chunk to begin before waking the next
/// anyway (a worker stuck behind a lock must not hold the rest back).
const CHUNK_WAIT: Duration = Duration::from_millis(20);

/// Rings `bells` at once; with `recheck`, asks each worker first to run its
/// last assignment again (one that never had one is not rung).
fn ring_now(bells: &[Bell], recheck: Option<Instant>) {
    for (bell, shared) in bells {
        if let Some(now) = recheck
            && !shared.mailbox.lock().again(now)
        {
            continue;
        }
        // Full: already ringing. Disconnected: the worker is gone, which
        // the next delivery notices and repairs.
        let _ = bell.try_send(());
    }
}

/// Rings `bells` a chunk at a time (see [`RING_CHUNK`]).
fn ring_in_chunks(bells: &[Bell], recheck: Option<Instant>) {
    for chunk in bells.chunks(RING_CHUNK) {
        ring_now(chunk, recheck);
        let started = Instant::now();
        while started.elapsed() < CHUNK_WAIT
            && chunk
                .iter()
                .any(|(_, shared)| shared.mailbox.lock().has_work())
        {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// The `router` thread: rings batches of doorbells off the step's thread.
struct Ringer {
    batches: Sender<Rings>,
    /// Batches handed to the router and not yet rung through: a re-check
    /// not yet asked of every worker is work the engine has not done.
    pending: Arc<AtomicUsize>,
    thread: JoinHandle<()>,
}

impl Workers {
    /// `changed` is the engine's change doorbell (see step 7).
    pub(crate) fn new(stack_bytes: usize, changed: Sender<()>) -> Workers {
        let (batches, rx) = crossbeam_channel::unbounded::<Rings>();
        let pending = Arc::new(AtomicUsize::new(0));
        let ringer = {
            let pending = Arc::clone(&pending);
            std::thread::Builder::new()
                .name("router".into())
                .stack_size(stack_bytes)
                .spawn(move || {
                    for (bells, recheck) in rx {
                        ring_in_chunks(&bells, recheck);
                        pending.fetch_sub(1, Ordering::Release);
                    }
                })
        };
        let ringer = match ringer {
            Ok(thread) => Some(Ringer {
                batches,
                pending,
                thread,
            }),
            Err(e) => {
                log::warn!("cannot start the router thread ({e}); steps ring doorbells themselves");
                None
            }
        };
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
    pub(crate) fn deliver(
        &mut self,
        vm_id: &Id,
        assignment: Assignment,
        core: &Arc<Core>,
        initial: impl FnOnce() -> Option<VmResult>,
    ) {
        let dead = self.live.get(vm_id).map(WorkerHandle::is_dead);
        match dead {
            None => {
                let predecessor = self.retiring.remove(vm_id);
                let handle = self.spawn(vm_id, core, initial(), predecessor);
                self.live.insert(vm_id.clone(), handle);
                self.changed_workers();
            }
            Some(true) => self.restart(vm_id, core),
            Some(false) => {}
        }
        let Some(handle) = self.live.get(vm_id) else {
            return;
        };
        // A worker that did not start takes no work: nothing would ever
        // take it, and the next delivery brings a newer assignment anyway.
        if handle.thread.is_some() {
            handle.shared.mailbox.lock().deliver(assignment);
            self.to_ring
                .push((handle.doorbell.clone(), Arc::clone(&handle.shared)));
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
                let roster: Arc<Vec<Bell>> = Arc::new(
                    self.live
                        .values()
                        .map(|h| (h.doorbell.clone(), Arc::clone(&h.shared)))
                        .collect(),
                );
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
        let batch = std::mem::take(&mut self.to_ring);
        if !batch.is_empty() {
            self.send((Arc::new(batch), None));
        }
        if let Some((roster, now)) = self.recheck.take() {
            self.send((roster, Some(now)));
        }
    }

    /// Hands `rings` to the router; rings them here if it is gone, or if
    /// they are a chunk's worth: as few wakes as the router would make at
    /// once, without the router's own wake in between (a create's dispatch
    /// is then one thread hop, not two).
    fn send(&self, rings: Rings) {
        let undelivered = match &self.ringer {
            Some(_) if rings.0.len() <= RING_CHUNK => Some(rings),
            Some(ringer) => {
                ringer.pending.fetch_add(1, Ordering::AcqRel);
                ringer.batches.send(rings).err().map(|e| {
                    ringer.pending.fetch_sub(1, Ordering::AcqRel);
                    e.into_inner()
                })
            }
            None => Some(rings),
        };
        if let Some((bells, recheck)) = undelivered {
            ring_now(&bells, recheck);
        }
    }

    /// Replaces a worker whose thread is gone. If the new thread cannot
    /// start either, the VM's row says so and the next delivery tries again.
    fn restart(&mut self, vm_id: &Id, core: &Arc<Core>) {
        let mut last = None;
        let mut predecessor = None;
        if let Some(old) = self.live.remove(vm_id) {
            log::error!("VM {vm_id}: its worker thread is gone; starting a new one");
            last = old.shared.result();
            predecessor = old.thread;
        }
        let new = self.spawn(vm_id, core, last, predecessor);
        self.live.insert(vm_id.clone(), new);
        self.changed_workers();
    }

    fn spawn(
        &self,
        vm_id: &Id,
        core: &Arc<Core>,
        initial: Option<VmResult>,
        predecessor: Option<JoinHandle<()>>,
    ) -> WorkerHandle {
        let handle = spawn(
            vm_id,
            core,
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

    /// Every worker's last published row, but those of the VMs in `skip`
    /// (refused entries: their rows come from elsewhere this tick), in id
    /// order; and every quarantined entry. The last step's lists, untouched,
    /// when no result changed and the workers and `skip` are the same.
    pub(crate) fn collect(&self, skip: &HashSet<&Id>) -> (Rows, Vec<QuarantinedVm>) {
        // Read before the rows: a result published after this is either
        // in them or makes the count differ next time.
        let count = self.signals.published.load(Ordering::Acquire);
        let mut collected = self.collected.lock();
        if let Some(c) = collected.as_ref()
            && c.count == count
            && c.skipped.len() == skip.len()
            && c.skipped.iter().all(|id| skip.contains(id))
        {
            return (c.rows.clone(), c.quarantined.clone());
        }
        let mut rows = Vec::with_capacity(self.live.len());
        let mut quarantined = Vec::new();
        for (id, handle) in &self.live {
            let p = handle.shared.published.lock();
            // Its row comes from elsewhere; a quarantined entry does not.
            if let Some(row) = p.row.as_ref().filter(|_| !skip.contains(id)) {
                rows.push(Arc::clone(row));
            }
            if let Some(q) = p.result.as_ref().and_then(|r| r.quarantined.as_ref()) {
                quarantined.push(q.clone());
            }
        }
        let rows = Rows::from(rows);
        *collected = Some(Collected {
            count,
            skipped: skip.iter().map(|id| (*id).clone()).collect(),
            rows: rows.clone(),
            quarantined: quarantined.clone(),
        });
        (rows, quarantined)
    }

    /// A worker was started, replaced or retired: the roster and the rows
    /// collected are made again when next needed.
    fn changed_workers(&mut self) {
        self.roster = None;
        *self.collected.get_mut() = None;
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
            let _ = ringer.thread.join();
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

fn spawn(
    vm_id: &Id,
    core: &Arc<Core>,
    stack_bytes: usize,
    signals: Arc<Signals>,
    initial: Option<VmResult>,
    predecessor: Option<JoinHandle<()>>,
) -> WorkerHandle {
    let (doorbell, rings) = bounded(1);
    let shared = Arc::new(WorkerShared::new(signals, initial));
    let thread = {
        let (vm_id, core, shared) = (vm_id.clone(), Arc::clone(core), Arc::clone(&shared));
        std::thread::Builder::new()
            .name(format!("vm-{vm_id}"))
            .stack_size(stack_bytes)
            .spawn(move || {
                // One pass per VM: the retired worker ends its pass first.
                // Said however the loop ends, a panic included.
                let _ended = Ended(&shared);
                if let Some(predecessor) = predecessor {
                    let _ = predecessor.join();
                }
                run(&vm_id, &core, &shared, &rings);
            })
    };
    let thread = match thread {
        Ok(t) => Some(t),
        Err(e) => {
            // The next delivery finds no thread and tries again.
            log::error!("VM {vm_id}: cannot start its worker thread: {e}");
            shared.set_failed(
                vm_id,
                format!("cannot start this VM's worker thread ({e}); retried next tick"),
            );
            None
        }
    };
    WorkerHandle {
        shared,
        doorbell,
        thread,
    }
}

/// Marks the worker's mailbox ended, and counts it, when dropped.
struct Ended<'a>(&'a WorkerShared);

impl Drop for Ended<'_> {
    fn drop(&mut self) {
        self.0.mailbox.lock().ended = true;
        self.0.signals.ended.fetch_add(1, Ordering::Release);
    }
}

/// The worker's loop: one pass per ring, on the newest assignment.
fn run(vm_id: &Id, core: &Core, shared: &Arc<WorkerShared>, rings: &Receiver<()>) {
    // A VM skipped every tick for the same reason is logged once, not once a
    // tick; a new reason, or recovery, is logged again.
    let mut skipping: Option<String> = None;
    while rings.recv().is_ok() {
        // Taken and begun under the mailbox's lock: never a moment where
        // the mailbox is empty and no pass is live while one is about to
        // run (`wait_idle` would call that idle).
        let (assignment, generation, waited) = {
            let mut mailbox = shared.mailbox.lock();
            let Some(assignment) = mailbox.take() else {
                continue;
            };
            (assignment, shared.begin_pass(), mailbox.waited())
        };
        let mut recording = stages::record();
        recording.add_before("dispatch", waited);
        let publisher = Publisher {
            shared: Arc::clone(shared),
            generation,
        };
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
            core.reconcile_one(vm_id, &assignment, Some(&publisher))
        }))
        .unwrap_or_else(|payload| {
            let what = crate::threads::panic_message(payload.as_ref());
            log::error!("VM {vm_id}: reconcile pass panicked: {what}");
            PassOutcome::Done(VmResult::failed_unobserved(
                vm_id,
                format!("internal error: the reconcile pass panicked ({what}); retried next tick"),
            ))
        });
        match &outcome {
            PassOutcome::Skipped { why, .. } if skipping.as_ref() != Some(why) => {
                log::warn!("VM {vm_id}: not reconciling it: {why}");
                skipping = Some(why.clone());
            }
            PassOutcome::Done(_) if skipping.take().is_some() => {
                log::info!("VM {vm_id}: its record is readable again");
            }
            _ => {}
        }
        shared.end_pass(generation, outcome);
        // Most passes time nothing: only one that did is looked at.
        if recording.saw_any() {
            core.timed_pass(vm_id, recording.finish());
        }
    }
}

impl VmResult {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(vm: &str, detail: &str) -> VmResult {
        VmResult {
            row: Some(VmStatus {
                vm_id: vm.into(),
                status_detail: detail.into(),
                ..VmStatus::default()
            }),
            ..VmResult::default()
        }
    }

    fn shared() -> WorkerShared {
        WorkerShared::new(Signals::new(bounded(1).0), None)
    }

    fn detail(shared: &WorkerShared) -> Option<String> {
        shared.result().and_then(|r| r.row).map(|r| r.status_detail)
    }

    fn reaps(mailbox: &mut Mailbox) -> Option<bool> {
        match mailbox.take() {
            Some(Assignment::Reap { tombstoned }) => Some(tombstoned),
            Some(Assignment::Desired(_)) => panic!("a desired assignment was never delivered"),
            None => None,
        }
    }

    #[test]
    fn a_recheck_runs_the_last_assignment_again() {
        let mut mailbox = Mailbox::default();
        mailbox.deliver(Assignment::Reap { tombstoned: true });
        assert_eq!(reaps(&mut mailbox), Some(true));

        let woken = mailbox.again(Instant::now());

        assert!(woken);
        assert_eq!(reaps(&mut mailbox), Some(true));
        assert_eq!(reaps(&mut mailbox), None, "once per recheck");
    }

    #[test]
    fn a_newer_delivery_wins_over_a_recheck() {
        let mut mailbox = Mailbox::default();
        mailbox.deliver(Assignment::Reap { tombstoned: false });
        mailbox.take();
        mailbox.again(Instant::now());

        mailbox.deliver(Assignment::Reap { tombstoned: true });

        assert_eq!(reaps(&mut mailbox), Some(true));
        assert_eq!(reaps(&mut mailbox), None, "the recheck is covered by it");
    }

    #[test]
    fn a_worker_never_given_work_is_not_woken_by_a_recheck() {
        let mut mailbox = Mailbox::default();

        let woken = mailbox.again(Instant::now());

        assert!(!woken);
        assert!(!mailbox.has_work());
    }

    #[test]
    fn a_cleared_mailbox_runs_nothing_even_when_a_recheck_was_asked() {
        let mut mailbox = Mailbox::default();
        mailbox.deliver(Assignment::Reap { tombstoned: true });
        mailbox.again(Instant::now());

        mailbox.clear();

        assert_eq!(reaps(&mut mailbox), None);
        assert!(
            !mailbox.again(Instant::now()),
            "and a later recheck finds nothing to run"
        );
    }

    #[test]
    fn a_worker_whose_loop_ended_is_dead_even_by_a_panic() {
        let shared = Arc::new(shared());
        let inside = Arc::clone(&shared);

        let ended = std::thread::spawn(move || {
            let _ended = Ended(&inside);
            panic!("test: the loop itself failed");
        })
        .join();

        assert!(ended.is_err());
        assert!(shared.mailbox.lock().ended);
        assert_eq!(shared.signals.ended.load(Ordering::Acquire), 1);
    }

    #[test]
    fn skipped_pass_freezes_the_previous_row() {
        let shared = shared();
        let first = shared.begin_pass();
        shared.end_pass(first, PassOutcome::Done(result("vm", "before")));
        let second = shared.begin_pass();

        shared.end_pass(
            second,
            PassOutcome::Skipped {
                fallback: result("vm", "fallback"),
                why: "unreadable".into(),
            },
        );

        assert_eq!(detail(&shared).as_deref(), Some("before"));
    }

    #[test]
    fn skipped_first_pass_uses_the_fallback() {
        let shared = shared();
        let first = shared.begin_pass();

        shared.end_pass(
            first,
            PassOutcome::Skipped {
                fallback: result("vm", "fallback"),
                why: "unreadable".into(),
            },
        );

        assert_eq!(detail(&shared).as_deref(), Some("fallback"));
    }

    #[test]
    fn publish_from_an_ended_generation_is_dropped() {
        let shared = shared();
        let old = shared.begin_pass();
        shared.end_pass(old, PassOutcome::Done(result("vm", "final")));
        let current = shared.begin_pass();

        shared.publish(old, result("vm", "late"));

        assert_eq!(detail(&shared).as_deref(), Some("final"));
        shared.publish(current, result("vm", "live"));
        assert_eq!(detail(&shared).as_deref(), Some("live"));
    }
}
