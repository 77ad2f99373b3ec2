//! Every thread the agent starts is one of two kinds, and says which:
//!
//! 1. **Owned**: stopped and joined by its owner, within a bound. An
//!    [`OwnedThread`] (a DHCP responder or a snooper on a tap, the watch on
//!    adopted hypervisors, the watch on the desired file) is named, runs
//!    its body with a [`StopFlag`], and is stopped and joined when dropped
//!    (crosvm's `WorkerThread` is the model). A body looks at the flag
//!    whenever its blocking call returns: one blocked on a socket with a
//!    receive timeout sees it within that timeout; one blocked in poll(2)
//!    puts a [`Wakeup`] in its poll set, and the drop wakes it at once.
//!    Owners whose stop is a message instead (the `signals`, `source` and
//!    `router` threads, the VM workers) join through [`join_within`]: a
//!    thread still busy at the bound is left to the process's exit, said.
//! 2. **Detached on purpose** ([`detached`]): threads that must outlive
//!    whoever started them, each for a reason named by an [`Outlives`].

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::deadline::Deadline;

/// Whether the thread's owner asked it to stop.
#[derive(Clone)]
pub struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    pub fn stopped(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// A named thread, stopped and joined on drop.
pub struct OwnedThread {
    stop: StopFlag,
    wakeup: Option<Arc<Wakeup>>,
    thread: Option<JoinHandle<()>>,
}

impl OwnedThread {
    /// Starts `body` on a thread called `name`. `wakeup`, when the body
    /// polls one, is woken on drop so the body sees its flag at once.
    pub fn spawn(
        name: String,
        stack_bytes: usize,
        wakeup: Option<Arc<Wakeup>>,
        body: impl FnOnce(StopFlag) + Send + 'static,
    ) -> io::Result<OwnedThread> {
        let stop = StopFlag(Arc::new(AtomicBool::new(false)));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(name)
                .stack_size(stack_bytes)
                .spawn(move || body(stop))?
        };
        Ok(OwnedThread {
            stop,
            wakeup,
            thread: Some(thread),
        })
    }
}

/// How long dropping an [`OwnedThread`] waits for its body to see the
/// flag: its bodies block at most a receive timeout (a second) at a time.
const OWNED_JOIN: Duration = Duration::from_secs(5);

impl Drop for OwnedThread {
    fn drop(&mut self) {
        self.stop.0.store(true, Ordering::Relaxed);
        if let Some(wakeup) = &self.wakeup {
            wakeup.wake();
        }
        if let Some(thread) = self.thread.take() {
            join_within(thread, Deadline::after(OWNED_JOIN));
        }
    }
}

/// Joins `thread` if it ends by `deadline`; whether it did. One still
/// running then is detached (dropping a handle does that) and said: it is
/// inside a call that has its own bound, and the process exiting ends it.
/// A body that panicked has nothing left to stop: joined all the same.
pub fn join_within(thread: JoinHandle<()>, deadline: Deadline) -> bool {
    while !thread.is_finished() && !deadline.expired() {
        std::thread::sleep(Duration::from_millis(2));
    }
    if thread.is_finished() {
        let _ = thread.join();
        return true;
    }
    let name = thread.thread().name().unwrap_or("unnamed").to_owned();
    log::warn!("thread {name} is still busy; not waiting for it");
    false
}

/// Why a thread is started detached: nothing joins it, and it ends on its
/// own when its work does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outlives {
    /// A reaper waits in waitpid for its VMM, which outlives a stop of the
    /// engine (VMs keep running) and is not the agent's to end.
    TheChild,
    /// An image download is shared by every pass waiting for it; a pass
    /// that gives up (its deadline) must not end it for the others.
    ThePass,
}

/// Starts `body` on a thread called `name` that nothing will join, for
/// the reason `why` names (see [`Outlives`]).
pub fn detached(
    name: String,
    stack_bytes: usize,
    why: Outlives,
    body: impl FnOnce() + Send + 'static,
) -> io::Result<()> {
    log::trace!("starting {name}, detached: it outlives {why:?}");
    std::thread::Builder::new()
        .name(name)
        .stack_size(stack_bytes)
        .spawn(body)
        .map(drop)
}

/// Waking a thread blocked in poll(2): the read end of a pipe sits in its
/// poll set, and [`Wakeup::wake`] writes a byte to the other end.
use nix::errno::Errno;
use nix::fcntl::OFlag;
#[cfg(not(target_os = "linux"))]
use nix::fcntl::{FcntlArg, FdFlag, fcntl};

pub struct Wakeup {
    read: OwnedFd,
    write: OwnedFd,
}

impl Wakeup {
    /// Close-on-exec, so a hypervisor forked meanwhile never holds the
    /// pipe (atomically where pipe2 exists); non-blocking, so a wake never
    /// blocks its caller however many are pending, and a drain stops when
    /// the pipe is empty.
    pub fn new() -> io::Result<Wakeup> {
        #[cfg(target_os = "linux")]
        let (read, write) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)?;
        #[cfg(not(target_os = "linux"))]
        let (read, write) = {
            let (read, write) = nix::unistd::pipe()?;
            for fd in [&read, &write] {
                fcntl(fd.as_fd(), FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
                fcntl(fd.as_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;
            }
            (read, write)
        };
        Ok(Wakeup { read, write })
    }

    /// Makes the waiting thread's poll return. A full pipe already holds a
    /// wake, so it is as good as written.
    pub fn wake(&self) {
        match nix::unistd::write(&self.write, &[1]) {
            Ok(_) | Err(Errno::EAGAIN) => {}
            Err(e) => log::debug!("wake-up pipe: {e}"),
        }
    }

    /// The end to poll for readability.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.read.as_fd()
    }

    /// Empties the pipe after a wake was seen, so the next poll blocks.
    pub fn drain(&self) {
        let mut buf = [0u8; 64];
        while matches!(nix::unistd::read(&self.read, &mut buf), Ok(n) if n > 0) {}
    }
}

/// Runs `side` on a helper thread named `name` while `main` runs on this
/// one, and returns both results once both are done: `side`'s as `Err`
/// with its panic's message if it panicked. What `side` timed (see
/// [`crate::stages`]) joins this thread's recording. If no thread can be
/// started, `side` runs here first: slower, never lost.
pub fn alongside<A: Send, B>(
    name: &str,
    side: impl FnOnce() -> A + Send,
    main: impl FnOnce() -> B,
) -> (Result<A, Panicked>, B) {
    let side = parking_lot::Mutex::new(Some(side));
    // Whoever calls this first runs `side`; the other finds it taken.
    let run_side = &|| {
        let side = side.lock().take()?;
        let recording = crate::stages::record();
        let out = side();
        Some((out, recording.finish()))
    };
    std::thread::scope(|scope| {
        let helper = std::thread::Builder::new()
            .name(name.to_owned())
            .stack_size(256 * 1024)
            .spawn_scoped(scope, run_side);
        let inline = match &helper {
            Ok(_) => None,
            Err(e) => {
                log::warn!("cannot start the thread {name} ({e}); running its work first");
                run_side()
            }
        };
        let main = main();
        let side = match (inline, helper) {
            (Some(done), _) => Ok(done),
            (None, Ok(helper)) => helper
                .join()
                .map_err(|payload| Panicked(panic_message(payload.as_ref())))
                .and_then(|done| done.ok_or_else(Panicked::never_ran)),
            (None, Err(_)) => Err(Panicked::never_ran()),
        };
        let side = side.map(|(out, stages)| {
            crate::stages::absorb(&stages);
            out
        });
        (side, main)
    })
}

/// The part of a long-lived thread's stack a deep call left resident,
/// given back to the kernel once the thread is shallow again.
///
/// A VM's worker lives as long as its VM and runs one pass at a time: a
/// create goes deep (an image download, a copy, a boot, each beside a
/// helper), a pass at a tick stays shallow. Pages a thread's stack once
/// touched stay resident for its life, so a thousand workers kept what
/// their creates touched (`make bench-engine`'s `worker stacks` figure).
/// [`StackTrim::trim`], called where the thread is shallow, drops every
/// page below it with `MADV_DONTNEED`: the kernel gives zeroed pages back
/// on the next touch, which is what an unused stack page holds anyway.
pub struct StackTrim {
    /// The lowest address of this thread's stack; `None` where it cannot
    /// be known (then nothing is trimmed).
    low: Option<usize>,
}

/// How much of the stack below the trimming call is kept: the frames of
/// `trim` and `madvise` themselves, and the red zone below them.
const KEPT_BELOW: usize = 4 << 10;

impl StackTrim {
    /// For the calling thread.
    pub fn of_this_thread() -> StackTrim {
        StackTrim { low: stack_low() }
    }

    /// Gives back what lies more than [`KEPT_BELOW`] below the caller's
    /// frame. Call it where nothing deeper is live (between passes).
    #[inline(never)]
    pub fn trim(&self) {
        let Some(low) = self.low else {
            return;
        };
        let here = std::ptr::addr_of!(low) as usize;
        let page = page_size();
        let high = here.saturating_sub(KEPT_BELOW) & !(page - 1);
        // The guard page at the bottom is the kernel's: left alone.
        let start = (low + page).next_multiple_of(page);
        if high > start {
            // SAFETY: [start, high) lies inside this thread's own stack,
            // below every live frame (the caller's and this one's are
            // within KEPT_BELOW of `here`); MADV_DONTNEED on private
            // anonymous memory only drops pages, which read as zeroes
            // when next touched.
            unsafe {
                nix::libc::madvise(
                    start as *mut nix::libc::c_void,
                    high - start,
                    nix::libc::MADV_DONTNEED,
                );
            }
        }
    }
}

#[cfg(target_os = "linux")]
fn stack_low() -> Option<usize> {
    use nix::libc;
    let mut attr = std::mem::MaybeUninit::<libc::pthread_attr_t>::uninit();
    // SAFETY: pthread_getattr_np fills `attr` for the calling thread; it
    // is read only if that succeeded, and destroyed once read.
    unsafe {
        if libc::pthread_getattr_np(libc::pthread_self(), attr.as_mut_ptr()) != 0 {
            return None;
        }
        let mut addr: *mut libc::c_void = std::ptr::null_mut();
        let mut size: libc::size_t = 0;
        let got = libc::pthread_attr_getstack(attr.as_ptr(), &mut addr, &mut size);
        libc::pthread_attr_destroy(attr.as_mut_ptr());
        (got == 0 && !addr.is_null()).then_some(addr as usize)
    }
}

#[cfg(not(target_os = "linux"))]
fn stack_low() -> Option<usize> {
    None
}

fn page_size() -> usize {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .and_then(|p| usize::try_from(p).ok())
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

/// Why the side of [`alongside`] brought no result: what its panic said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Panicked(pub String);

impl Panicked {
    fn never_ran() -> Panicked {
        Panicked("its work never ran".to_owned())
    }
}

impl std::fmt::Display for Panicked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Panicked {}

/// What a panic said, from its payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "no message".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Resident pages of this thread's stack below `below`, by mincore(2).
    #[cfg(target_os = "linux")]
    fn resident_below(low: usize, below: usize) -> usize {
        let page = page_size();
        let start = (low + page).next_multiple_of(page);
        let end = below & !(page - 1);
        let mut vec = vec![0u8; (end - start) / page];
        // SAFETY: [start, end) is inside this thread's stack mapping, and
        // `vec` has one byte for each of its pages.
        let rc = unsafe {
            nix::libc::mincore(
                start as *mut nix::libc::c_void,
                end - start,
                vec.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0, "mincore: {}", io::Error::last_os_error());
        vec.iter().filter(|b| **b & 1 == 1).count()
    }

    /// Touches `depth` KiB of stack below the caller.
    #[cfg(target_os = "linux")]
    #[inline(never)]
    fn go_deep(depth: usize) -> u8 {
        let mut page = [0u8; 1024];
        page[0] = std::hint::black_box(1);
        if depth == 0 {
            return page[0];
        }
        page[0].wrapping_add(std::hint::black_box(go_deep(depth - 1)))
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_trim_gives_back_what_a_deep_call_left_on_the_stack() {
        let (before, after) = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(|| {
                let trim = StackTrim::of_this_thread();
                let low = trim.low.expect("this thread's stack");
                let here = std::ptr::addr_of!(trim) as usize;
                std::hint::black_box(go_deep(512));
                let before = resident_below(low, here - KEPT_BELOW);

                trim.trim();

                (before, resident_below(low, here - KEPT_BELOW))
            })
            .expect("thread")
            .join()
            .expect("joined");

        assert!(before >= 100, "the deep call left {before} pages");
        assert!(after <= 2, "{after} pages left of {before}");
    }
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

    fn readable(w: &Wakeup) -> bool {
        let mut fds = [PollFd::new(w.fd(), PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::ZERO).expect("poll") > 0
    }

    #[test]
    fn dropping_an_owned_thread_stops_and_joins_it() {
        let ran_to_the_end = Arc::new(AtomicBool::new(false));
        let thread = {
            let done = Arc::clone(&ran_to_the_end);
            OwnedThread::spawn("test-owned".into(), 64 * 1024, None, move |stop| {
                while !stop.stopped() {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                done.store(true, Ordering::Relaxed);
            })
            .expect("spawn")
        };

        drop(thread);

        assert!(ran_to_the_end.load(Ordering::Relaxed));
    }

    #[test]
    fn join_within_joins_a_thread_that_ends_and_leaves_one_that_does_not() {
        let quick = std::thread::spawn(|| {});
        let (_hold, held) = crossbeam_channel::bounded::<()>(0);
        let busy = std::thread::spawn(move || {
            let _ = held.recv();
        });

        let joined = join_within(quick, Deadline::after(std::time::Duration::from_secs(5)));
        let left = join_within(busy, Deadline::after(std::time::Duration::from_millis(20)));

        assert!(joined);
        assert!(!left);
    }

    #[test]
    fn a_wake_makes_the_pipe_readable_until_drained() {
        let w = Wakeup::new().expect("pipe");

        w.wake();
        w.wake();
        let woken = readable(&w);
        w.drain();

        assert!(woken);
        assert!(!readable(&w));
    }

    #[test]
    fn alongside_returns_both_and_the_sides_stages_join_this_thread() {
        let recording = crate::stages::record();

        let (side, main) = alongside("test-side", || crate::stages::timed("side", || 1), || 2);
        let stages = recording.finish();

        assert_eq!((side, main), (Ok(1), 2));
        assert_eq!(stages.marks.len(), 1);
        assert_eq!(stages.marks[0].stage, "side");
    }

    #[test]
    fn a_side_that_panics_is_an_error_and_main_still_runs() {
        let (side, main): (Result<(), Panicked>, _) = alongside(
            "test-side",
            || panic!("test: the side failed"),
            || "main ran",
        );

        assert_eq!(side, Err(Panicked("test: the side failed".to_owned())));
        assert_eq!(main, "main ran");
    }
}
