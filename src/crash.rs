//! Named crash points, for the crash-consistency proof (`make chaos`).
//!
//! Each point sits right after one durable step of the agent's work (a
//! record saved, a pidfile written, a disk prepared, …). Built with the
//! `crashpoints` feature, an agent started with `EITRI_CRASH_AT=<name>`
//! kills itself with SIGKILL the first time it reaches that point: the
//! same death as `kill -9`, no destructor run, no buffer flushed. The chaos
//! harness then restarts it and checks that nothing was lost, doubled or
//! misreported. Without the feature (every release build) a point is an
//! empty inline function.

/// Every crash point, and what a crash right after it must not break.
pub const POINTS: &[(&str, &str)] = &[
    (
        "create.attempt-saved",
        "the attempt counted before any side effect is not lost, and the create resumes",
    ),
    (
        "create.reserved",
        "an address and VMM id taken beside the attempt's save, which the crash may have kept from landing, are taken again by the create, or given back at start",
    ),
    (
        "create.disk-prepared",
        "a root disk made but not booted is made again, never under a live VMM",
    ),
    (
        "create.seed-built",
        "a seed built but not booted is built again",
    ),
    (
        "boot.pidfile-written",
        "a VMM forked and recorded but not yet released never runs: it exits on the agent's death",
    ),
    (
        "boot.hypervisor-started",
        "a VMM running whose record does not say so is adopted, not started twice",
    ),
    (
        "create.booted-saved",
        "a create fully recorded is only converged",
    ),
    (
        "stop.intent-saved",
        "a stop intended but not done is done; the VM is not booted again",
    ),
    (
        "stop.done",
        "a stopped VM whose record was not yet updated stays stopped",
    ),
    (
        "sleep.flags-saved",
        "a sleep or a wake decided (the record says asleep or woken) but not yet begun is driven again from what the record says: a VM wanted running and asleep sleeps, one woken runs until idle",
    ),
    (
        "wake.listening",
        "a sleeping VM's taps held by an agent that dies go with it; the next agent listens again and the VM still wakes on traffic",
    ),
    (
        "suspend.intent-saved",
        "a suspend intended but not begun is done, or undone if the VM is wanted running",
    ),
    (
        "suspend.snapshot-written",
        "a guest paused with its snapshot written but not committed is resumed or suspended again, never left paused",
    ),
    (
        "suspend.committed",
        "a committed snapshot with its VMM still alive ends as one of the two: suspended with no VMM, or running with no snapshot",
    ),
    (
        "suspend.vmm-stopped",
        "a suspend done but not recorded is recorded: suspended, its snapshot whole",
    ),
    (
        "resume.restore-started",
        "a restoring VMM found after a restart is stopped if the record still says suspended (its guest never ran; the snapshot is resumed again), else finished; never started twice",
    ),
    (
        "resume.restored",
        "a restored guest held paused, its resume perhaps not yet recorded, is run only if the record says resuming, else its VMM is stopped and the whole snapshot resumed again",
    ),
    (
        "resume.intent-saved",
        "a resume recorded with its guest restored but not yet run is finished by running that guest, never restored twice",
    ),
    (
        "resume.resumed",
        "a resumed VM not yet recorded is recorded running, and its snapshot discarded",
    ),
    (
        "resume.snapshot-discarded",
        "a resumed VM whose snapshot is gone is recorded running",
    ),
    (
        "create.clone-copied",
        "a clone whose disk and snapshot were copied from its template but not restored is copied again, its template untouched",
    ),
    (
        "create.clone-restored",
        "a clone's VMM restored from the copy but not yet made its own is stopped, never adopted as created, and the clone made again",
    ),
    (
        "create.clone-own",
        "a clone made its own but not yet recorded created is made again from its template (a clone is never adopted before its record says made)",
    ),
    (
        "template.intent-saved",
        "a running template whose save is recorded under way, its guest not yet paused, runs on and is saved again",
    ),
    (
        "template.paused",
        "a running template's guest paused for its save, nothing written, is resumed at its next pass and saved again",
    ),
    (
        "template.snapshot-written",
        "a running template's guest paused with its snapshot written, its disk not yet copied, is resumed and saved again whole",
    ),
    (
        "template.committed",
        "a running template's save committed and its guest resumed, its record not yet updated, keeps its whole save",
    ),
    (
        "resume.guest-reseeded",
        "a resumed guest sent its entropy and clock but not yet recorded running is recorded running (and sent them again: fresh entropy twice is no harm)",
    ),
    (
        "stop.snapshot-discarded",
        "a suspended VM stopped, its snapshot gone but not recorded, is recorded stopped and never resumed",
    ),
    (
        "quarantine.saved",
        "a quarantine decided but not acted on is acted on, and reported",
    ),
    (
        "destroy.vmm-gone",
        "a VM destroyed but not yet deleted is deleted; its VMM stays gone",
    ),
    (
        "store.delete-renamed",
        "a VM directory half deleted is finished at start",
    ),
    (
        "record.temp-written",
        "a record written to its temp file but not renamed loads as the old one",
    ),
    (
        "snapshot.persisted",
        "the last snapshot survives, and a torn one is no snapshot",
    ),
    (
        "volume.created",
        "a volume made once is never made again, nor lost",
    ),
    (
        "volume.grown",
        "a volume grown keeps its data and its new size; it is not made again",
    ),
    (
        "image.fetched",
        "a download verified but not yet in the cache is swept, fetched again and used",
    ),
    (
        "image.stored",
        "an image in the cache but not yet used is used; the create resumes",
    ),
];

#[cfg(feature = "crashpoints")]
pub fn point(name: &'static str) {
    use std::sync::OnceLock;
    static AT: OnceLock<Option<String>> = OnceLock::new();
    let at = AT.get_or_init(|| std::env::var("EITRI_CRASH_AT").ok());
    if at.as_deref() == Some(name) {
        log::error!("crash point {name}: killing myself");
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
}

#[cfg(not(feature = "crashpoints"))]
#[inline(always)]
pub fn point(_name: &'static str) {}

/// A crash point named where a step is asked for and hit where the step
/// is done: the pass protocol (`Context::intend`) hits the one its caller
/// names once the intent is saved. Named with [`at`] and a literal name,
/// so every crash point is found in the source where it is named, by a
/// call of [`point`] or of [`at`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Point(&'static str);

/// The crash point `name`, to be hit later (see [`Point`]).
pub const fn at(name: &'static str) -> Point {
    Point(name)
}

impl Point {
    pub fn hit(self) {
        point(self.0);
    }
}
