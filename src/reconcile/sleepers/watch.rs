//! The sleepers' state and their one thread (what a pass does with them
//! is the rules', in this folder's `mod.rs`): the VMs asleep and what is
//! polled for each, the running ones watched for quiet, the wakes not yet
//! acted on, and each VM's last wake, with who sent the frames that woke
//! it as the backend's witness tells them.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use parking_lot::Mutex;

use crate::model::Id;
use crate::provision::{Lifecycle, Listening, Witness};
use crate::threads::{OwnedThread, StopFlag, Wakeup};

/// How often the idle VMs' counters are read.
const SAMPLE_EVERY: Duration = Duration::from_secs(1);
/// How often the thread looks at what it polls when nothing can wake it.
const RELOOK: Duration = Duration::from_millis(200);
/// How long after a wake its frames are looked at to say who woke it.
const TELLING: Duration = Duration::from_secs(2);

/// Runs a pass of a VM now (the engine's poke, without its spacing: a
/// wake is not a crash loop).
pub(crate) type Poke = Arc<dyn Fn(&Id) + Send + Sync>;

/// The sleepers and the idle watch, and their thread (started with the
/// first VM that needs it).
pub(super) struct Watch {
    shared: Arc<Shared>,
    thread: Mutex<Option<OwnedThread>>,
}

struct Shared {
    /// Sleeping VMs: what is polled for their first frame.
    listening: Mutex<HashMap<Id, Listener>>,
    /// Running VMs with an idle time: how quiet they have been.
    quiet: Mutex<HashMap<Id, Quiet>>,
    /// VMs a frame woke, and when, until their pass takes it.
    woken: Mutex<HashMap<Id, Instant>>,
    /// The last wake of each VM, for its row.
    last: Mutex<HashMap<Id, LastWake>>,
    /// How each VM's sleeps went (see [`Watch::stretched`]).
    loops: Mutex<HashMap<Id, Loop>>,
    /// Wakes the thread when what it polls changed; `None` if the pipe
    /// could not be made (then it looks again every [`RELOOK`]).
    wakeup: Option<Arc<Wakeup>>,
    poke: Poke,
    prov: Arc<dyn Lifecycle>,
}

struct Listener {
    ready: Vec<Arc<OwnedFd>>,
    witness: Option<Arc<dyn Witness>>,
}

/// A VM's sleeps, to bound a wake loop.
#[derive(Default)]
struct Loop {
    slept_at: Option<Instant>,
    /// Wakes in a row that came before the sleep they ended had lasted
    /// the VM's idle time.
    short: u32,
}

/// The most an idle time is stretched by a wake loop: 2^6 = 64 times.
const MAX_STRETCH: u32 = 6;

struct Quiet {
    limit: Duration,
    /// Its guest's frames, less those of the agent's own exchanges.
    frames: Option<u64>,
    since: Instant,
    told: bool,
    /// Frames the guest sent while the agent's own exchanges with it were
    /// open (its readiness probes): the agent's, not the tenant's.
    own: u64,
    /// The guest's frame count when an exchange of the agent's opened,
    /// while one is open: no sample is taken meanwhile.
    open: Option<Option<u64>>,
}

#[derive(Default)]
struct LastWake {
    at: Option<SystemTime>,
    /// What was seen of the frames that woke it, first the first.
    by: Vec<String>,
    running_in: Option<Duration>,
    telling: Option<(Arc<dyn Witness>, Instant)>,
}

impl Watch {
    pub(super) fn new(prov: Arc<dyn Lifecycle>, poke: Poke) -> Watch {
        let wakeup = Wakeup::new()
            .map(Arc::new)
            .inspect_err(|e| {
                log::error!("cannot make the pipe that wakes the sleepers' thread ({e}); what it polls is looked at every {RELOOK:?}");
            })
            .ok();
        Watch {
            shared: Arc::new(Shared {
                listening: Mutex::default(),
                quiet: Mutex::default(),
                woken: Mutex::default(),
                last: Mutex::default(),
                loops: Mutex::default(),
                wakeup,
                poke,
                prov,
            }),
            thread: Mutex::new(None),
        }
    }

    fn wake_thread(&self) {
        if let Some(w) = &self.shared.wakeup {
            w.wake();
        }
    }

    fn ensure_thread(&self) {
        let mut thread = self.thread.lock();
        if thread.is_some() {
            return;
        }
        let shared = Arc::clone(&self.shared);
        let wakeup = shared.wakeup.clone();
        match OwnedThread::spawn("sleepers".into(), 64 * 1024, wakeup, move |stop| {
            run(&shared, &stop);
        }) {
            Ok(t) => *thread = Some(t),
            Err(e) => log::error!(
                "cannot start the thread that wakes sleeping VMs ({e}); they wake at the tick"
            ),
        }
    }

    pub(super) fn is_listening(&self, vm_id: &Id) -> bool {
        self.shared.listening.lock().contains_key(vm_id)
    }

    /// Polls what `listening` gives for the VM's first frame.
    pub(super) fn listen(&self, vm_id: &Id, listening: Listening) {
        let listener = Listener {
            ready: listening.ready.into_iter().map(Arc::new).collect(),
            witness: listening.witness.map(Arc::from),
        };
        self.shared.listening.lock().insert(vm_id.clone(), listener);
        self.ensure_thread();
        self.wake_thread();
    }

    /// Watches the running VM's NICs for `limit` of quiet.
    /// Every pass of a watched VM asks again: the thread is woken only
    /// for a VM it did not watch yet (its poll then needs a timeout).
    pub(super) fn watch_quiet(&self, vm_id: &Id, limit: Duration) {
        let mut quiet = self.shared.quiet.lock();
        if let Some(q) = quiet.get_mut(vm_id) {
            if q.limit != limit {
                // Told at the old limit, it is told again at the new one.
                q.limit = limit;
                q.told = false;
            }
            return;
        }
        quiet.insert(
            vm_id.clone(),
            Quiet {
                limit,
                frames: None,
                since: Instant::now(),
                told: false,
                own: 0,
                open: None,
            },
        );
        drop(quiet);
        self.ensure_thread();
        self.wake_thread();
    }

    /// How long the VM's NICs have been quiet, once their counters have
    /// been read at least once.
    pub(super) fn quiet_for(&self, vm_id: &Id) -> Option<Duration> {
        let quiet = self.shared.quiet.lock();
        let q = quiet.get(vm_id)?;
        q.frames.map(|_| q.since.elapsed())
    }

    pub(super) fn unwatch_quiet(&self, vm_id: &Id) {
        self.shared.quiet.lock().remove(vm_id);
    }

    /// An exchange of the agent's own with the watched VM's guest opens
    /// (a readiness probe): what the guest sends until it closes
    /// ([`Watch::own_closed`]) is not its own traffic.
    pub(super) fn own_opened(&self, vm_id: &Id) {
        let frames = self.shared.prov.waker().and_then(|w| w.frames(vm_id));
        if let Some(q) = self.shared.quiet.lock().get_mut(vm_id) {
            q.open = Some(frames);
        }
    }

    /// The exchange closed: the frames the guest sent while it was open
    /// are taken off what it sent.
    pub(super) fn own_closed(&self, vm_id: &Id) {
        let frames = self.shared.prov.waker().and_then(|w| w.frames(vm_id));
        if let Some(q) = self.shared.quiet.lock().get_mut(vm_id)
            && let Some(before) = q.open.take()
            && let (Some(before), Some(after)) = (before, frames)
        {
            q.own += after.saturating_sub(before);
        }
    }

    /// When a frame woke the VM, until its pass has acted on it.
    pub(super) fn woken_at(&self, vm_id: &Id) -> Option<Instant> {
        self.shared.woken.lock().get(vm_id).copied()
    }

    pub(super) fn take_woken(&self, vm_id: &Id) -> Option<Instant> {
        self.shared.woken.lock().remove(vm_id)
    }

    /// Stops listening for the VM and watching it; what it was woken by
    /// is kept for its row (a destroyed VM's goes with [`Watch::forget`]).
    pub(super) fn quit(&self, vm_id: &Id) {
        self.shared.listening.lock().remove(vm_id);
        self.shared.woken.lock().remove(vm_id);
        self.unwatch_quiet(vm_id);
    }

    /// Everything about the VM, gone with it.
    pub(super) fn forget(&self, vm_id: &Id) {
        self.quit(vm_id);
        self.shared.last.lock().remove(vm_id);
        self.shared.loops.lock().remove(vm_id);
    }

    /// The VM is suspended for idleness now.
    pub(super) fn slept(&self, vm_id: &Id) {
        self.shared
            .loops
            .lock()
            .entry(vm_id.clone())
            .or_default()
            .slept_at = Some(Instant::now());
    }

    /// The VM was woken: whether this wake ends a sleep shorter than its
    /// `idle` time (a wake loop: a peer, or its guest's own timer, sending
    /// a frame each idle period), which stretches its next idle time.
    pub(super) fn woke(&self, vm_id: &Id, idle: Duration) -> bool {
        let mut loops = self.shared.loops.lock();
        let l = loops.entry(vm_id.clone()).or_default();
        let short = l.slept_at.is_some_and(|at| at.elapsed() < idle);
        l.short = if short { l.short.saturating_add(1) } else { 0 };
        short
    }

    /// The VM's idle time `idle`, doubled for each short sleep in a row
    /// (at most [`MAX_STRETCH`] times): a loop of wakes and sleeps costs a
    /// suspend (its memory written) and a resume each turn, and this
    /// spaces the turns out until its sleeps are long again.
    pub(super) fn stretched(&self, vm_id: &Id, idle: Duration) -> Duration {
        let short = self
            .shared
            .loops
            .lock()
            .get(vm_id)
            .map_or(0, |l| l.short.min(MAX_STRETCH));
        idle.saturating_mul(1 << short)
    }

    /// The wake at `at` ran the VM's guest after `took`.
    pub(super) fn ran(&self, vm_id: &Id, took: Duration) {
        if let Some(w) = self.shared.last.lock().get_mut(vm_id) {
            w.running_in = Some(took);
        }
    }

    /// A wake not acted on yet (no room on the host): kept for the next
    /// pass.
    pub(super) fn rewake(&self, vm_id: &Id, at: Instant) {
        self.shared.woken.lock().insert(vm_id.clone(), at);
    }

    /// Its last wake, in words (see `VMStatus.last_wake`).
    pub(super) fn last_wake(&self, vm_id: &Id) -> String {
        let last = self.shared.last.lock();
        let Some(w) = last.get(vm_id) else {
            return String::new();
        };
        let Some(at) = w.at else {
            return String::new();
        };
        let ago = SystemTime::now()
            .duration_since(at)
            .unwrap_or_default()
            .as_secs();
        let by = if w.by.is_empty() {
            "a frame".to_owned()
        } else {
            w.by.join(", then ")
        };
        let ran = w
            .running_in
            .map(|t| format!(", running in {} ms", t.as_millis()))
            .unwrap_or_default();
        format!("woken {ago} s ago by {by}{ran}")
    }
}

impl Shared {
    /// A frame waits for the sleeping VM: it is woken (its pass resumes it).
    fn fire(&self, vm_id: &Id) {
        let Some(listener) = self.listening.lock().remove(vm_id) else {
            return;
        };
        self.woken.lock().insert(vm_id.clone(), Instant::now());
        let mut last = self.last.lock();
        let w = last.entry(vm_id.clone()).or_default();
        *w = LastWake {
            at: Some(SystemTime::now()),
            ..LastWake::default()
        };
        if let Some(witness) = &listener.witness {
            w.telling = Some((Arc::clone(witness), Instant::now()));
        }
        drop(last);
        // The worker first: a client waits on this resume, not on what is
        // said of it (the log, who sent the frame: told just after).
        (self.poke)(vm_id);
        if let Some(w) = self.last.lock().get_mut(vm_id) {
            tell(vm_id, w);
        }
        // Its copies of the NIC's fd go: what is polled is only what sleeps.
        drop(listener);
        log::info!("VM {vm_id}: a frame for its guest woke it");
    }

    /// Reads the idle VMs' counters; pokes those quiet for their limit.
    fn sample(&self) {
        let Some(waker) = self.prov.waker() else {
            return;
        };
        let ids: Vec<Id> = self.quiet.lock().keys().cloned().collect();
        let mut due = Vec::new();
        for vm_id in ids {
            let frames = waker.frames(&vm_id);
            let mut quiet = self.quiet.lock();
            let Some(q) = quiet.get_mut(&vm_id) else {
                continue;
            };
            // Looked at again once the agent's own exchange is over.
            if q.open.is_some() {
                continue;
            }
            let frames = frames.map(|f| f.saturating_sub(q.own));
            if frames != q.frames {
                q.frames = frames;
                q.since = Instant::now();
                q.told = false;
            } else if q.frames.is_some() && !q.told && q.since.elapsed() >= q.limit {
                q.told = true;
                due.push(vm_id);
            }
        }
        for vm_id in due {
            log::debug!("VM {vm_id}: quiet for its idle time; checking it now");
            (self.poke)(&vm_id);
        }
    }
}

/// Takes what the witness of a woken VM's frames heard, into its last
/// wake; done once a frame with ports (or any but ARP) was heard, or
/// [`TELLING`] after the wake.
fn tell(vm_id: &Id, w: &mut LastWake) {
    let Some((witness, since)) = &w.telling else {
        return;
    };
    let mut done = since.elapsed() >= TELLING;
    for seen in witness.heard() {
        let arp = seen.starts_with("arp");
        if w.by.len() < 2 && !w.by.contains(&seen) {
            log::info!("VM {vm_id}: woken by {seen}");
            w.by.push(seen);
        }
        if !arp {
            done = true;
            break;
        }
    }
    if done {
        w.telling = None;
    }
}

fn run(shared: &Shared, stop: &StopFlag) {
    let mut sampled = Instant::now();
    while !stop.stopped() {
        let fds: Vec<(Id, Arc<OwnedFd>)> = shared
            .listening
            .lock()
            .iter()
            .flat_map(|(id, l)| l.ready.iter().map(|fd| (id.clone(), Arc::clone(fd))))
            .collect();
        let copies: Vec<(Id, Arc<dyn Witness>)> = shared
            .last
            .lock()
            .iter()
            .filter_map(|(id, w)| w.telling.as_ref().map(|(c, _)| (id.clone(), Arc::clone(c))))
            .collect();
        let mut set = Vec::with_capacity(fds.len() + copies.len() + 1);
        // Without a wakeup pipe, a placeholder that never fires: the
        // thread then looks again every RELOOK.
        let placeholder = shared.wakeup.is_none();
        if let Some(w) = &shared.wakeup {
            set.push(PollFd::new(w.fd(), PollFlags::POLLIN));
        }
        set.extend(
            fds.iter()
                .map(|(_, fd)| PollFd::new(fd.as_fd(), PollFlags::POLLIN)),
        );
        set.extend(
            copies
                .iter()
                .map(|(_, c)| PollFd::new(c.fd(), PollFlags::POLLIN)),
        );
        let timeout = if copies.is_empty() && shared.quiet.lock().is_empty() && !placeholder {
            PollTimeout::NONE
        } else {
            let left = SAMPLE_EVERY.saturating_sub(sampled.elapsed());
            PollTimeout::try_from(left.min(RELOOK)).unwrap_or(PollTimeout::ZERO)
        };
        if let Err(e) = poll(&mut set, timeout) {
            if e != nix::errno::Errno::EINTR {
                log::error!("waking sleeping VMs: poll failed: {e}; they wake at the tick");
                return;
            }
            continue;
        }
        let first = usize::from(!placeholder);
        if let Some(w) = &shared.wakeup
            && set[0].revents().is_some_and(|r| !r.is_empty())
        {
            w.drain();
        }
        let fired: Vec<Id> = fds
            .iter()
            .zip(&set[first..])
            .filter(|(_, p)| p.revents().is_some_and(|r| !r.is_empty()))
            .map(|((id, _), _)| id.clone())
            .collect();
        drop(set);
        for vm_id in fired {
            shared.fire(&vm_id);
        }
        for (vm_id, _) in &copies {
            if let Some(w) = shared.last.lock().get_mut(vm_id) {
                tell(vm_id, w);
            }
        }
        if sampled.elapsed() >= SAMPLE_EVERY {
            sampled = Instant::now();
            shared.sample();
        }
    }
}
