//! The `router` thread: rings batches of doorbells off the step's thread,
//! a chunk at a time (see the protocol in [`super`], step 1).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use super::shared::WorkerShared;

/// What the router rings at once: the doorbells, and for a re-check the
/// instant as of which each worker is first asked to run its last
/// assignment again.
pub(super) struct Batch {
    pub(super) bells: Arc<Vec<Doorbell>>,
    pub(super) recheck: Option<Instant>,
}

/// A worker's doorbell, with its shared half: what tells whether it took
/// its mailbox.
#[derive(Clone)]
pub(super) struct Doorbell {
    pub(super) bell: Sender<()>,
    pub(super) shared: Arc<WorkerShared>,
}

/// Workers woken at once by the router. Waking ten thousand at once makes
/// ten thousand threads runnable on a few cores: each finishes its pass
/// in microseconds, but they are still queued when the next step (or the
/// heartbeat) wants the CPU, and preempt it for whole time slices. A chunk
/// is woken once the previous one has taken its mailboxes (begun its
/// passes; a long pass, a create or a stop, then blocks, off the CPU).
pub(super) const RING_CHUNK: usize = 16;

/// How long the router waits for a chunk to begin before waking the next
/// anyway (a worker stuck behind a lock must not hold the rest back).
const CHUNK_WAIT: Duration = Duration::from_millis(20);

/// Rings `bells` at once; with `recheck`, asks each worker first to run its
/// last assignment again (one that never had one is not rung).
pub(super) fn ring_now(bells: &[Doorbell], recheck: Option<Instant>) {
    for Doorbell { bell, shared } in bells {
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
fn ring_in_chunks(bells: &[Doorbell], recheck: Option<Instant>) {
    for chunk in bells.chunks(RING_CHUNK) {
        ring_now(chunk, recheck);
        let started = Instant::now();
        while started.elapsed() < CHUNK_WAIT
            && chunk.iter().any(|d| d.shared.mailbox.lock().has_work())
        {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// The `router` thread: rings batches of doorbells off the step's thread.
pub(super) struct Ringer {
    pub(super) batches: Sender<Batch>,
    /// Batches handed to the router and not yet rung through: a re-check
    /// not yet asked of every worker is work the engine has not done.
    pub(super) pending: Arc<AtomicUsize>,
    pub(super) thread: JoinHandle<()>,
}

impl Ringer {
    /// Starts the `router` thread; `None` (said) if it cannot start, and
    /// then the steps ring their doorbells themselves.
    pub(super) fn start(stack_bytes: usize) -> Option<Ringer> {
        let (batches, rx) = crossbeam_channel::unbounded::<Batch>();
        let pending = Arc::new(AtomicUsize::new(0));
        let thread = {
            let pending = Arc::clone(&pending);
            std::thread::Builder::new()
                .name("router".into())
                .stack_size(stack_bytes)
                .spawn(move || {
                    for batch in rx {
                        ring_in_chunks(&batch.bells, batch.recheck);
                        pending.fetch_sub(1, Ordering::Release);
                    }
                })
        };
        match thread {
            Ok(thread) => Some(Ringer {
                batches,
                pending,
                thread,
            }),
            Err(e) => {
                log::warn!("cannot start the router thread ({e}); steps ring doorbells themselves");
                None
            }
        }
    }
}
