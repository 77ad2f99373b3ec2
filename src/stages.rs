//! Where a create's time goes: named stages, timed on the thread that runs
//! them.
//!
//! A create is one pass on one worker thread, down through the engine, the
//! stores and the backend. Passing a recorder through every seam would put
//! a timing parameter on every trait method; instead the pass starts a
//! [`Recording`] on its thread, and any code below it opens a [`span`]. A
//! span on a thread that records nothing costs an `Instant::now` and a
//! thread-local look, and records nothing: the backend's code is the same
//! whether anyone is timing it.
//!
//! Spans nest (a record save inside "seed", say): each is recorded with its
//! own duration, in the order it ended, so a stage and its parts are both
//! there to read.

use std::cell::RefCell;
use std::fmt;
use std::time::{Duration, Instant};

thread_local! {
    static MARKS: RefCell<Option<Vec<Mark>>> = const { RefCell::new(None) };
}

/// One stage and how long it took.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mark {
    pub stage: &'static str,
    pub took: Duration,
}

/// The stages one create went through, in the order they ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stages {
    pub marks: Vec<Mark>,
    /// From the recording's start (less what was added before it) to its
    /// end.
    pub total: Duration,
}

impl Stages {
    /// The summed time of every span named `stage`.
    pub fn of(&self, stage: &str) -> Duration {
        self.marks
            .iter()
            .filter(|m| m.stage == stage)
            .map(|m| m.took)
            .sum()
    }
}

impl fmt::Display for Stages {
    /// `12.3 ms (image 0.1, root disk 1.2, ...)`: milliseconds, one entry
    /// per stage name (repeats summed and counted).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        write!(f, "{:.1} ms (", ms(self.total))?;
        let mut seen: Vec<&str> = Vec::new();
        for mark in &self.marks {
            if seen.contains(&mark.stage) {
                continue;
            }
            seen.push(mark.stage);
            let times = self.marks.iter().filter(|m| m.stage == mark.stage).count();
            if seen.len() > 1 {
                f.write_str(", ")?;
            }
            write!(f, "{} {:.1}", mark.stage, ms(self.of(mark.stage)))?;
            if times > 1 {
                write!(f, " ×{times}")?;
            }
        }
        f.write_str(")")
    }
}

/// Records the spans opened on this thread until [`Recording::finish`]
/// (or the drop, which discards them).
pub struct Recording {
    started: Instant,
    /// A stage that ended before the recording began (see
    /// [`Recording::add_before`]), put first at the finish.
    before: Option<Mark>,
    /// Whatever recorded before, put back when this one ends.
    outer: Option<Vec<Mark>>,
}

/// Starts recording this thread's spans. Allocates nothing until a span
/// ends: the ten thousand passes of a tick that time nothing cost nothing.
pub fn record() -> Recording {
    Recording {
        started: Instant::now(),
        before: None,
        outer: MARKS.with(|m| m.borrow_mut().replace(Vec::new())),
    }
}

impl Recording {
    /// Adds a stage that ended just before the recording began (the wait
    /// before a pass), counted in the total.
    pub fn add_before(&mut self, stage: &'static str, took: Duration) {
        self.started = self.started.checked_sub(took).unwrap_or(self.started);
        self.before = Some(Mark { stage, took });
    }

    /// Ends the recording and returns what it saw.
    pub fn finish(mut self) -> Stages {
        let mut marks = MARKS.with(|m| m.borrow_mut().take()).unwrap_or_default();
        if let Some(before) = self.before.take() {
            // In the list's own room: no second allocation.
            marks.insert(0, before);
        }
        Stages {
            marks,
            total: self.started.elapsed(),
        }
        // The drop puts back whatever recorded before.
    }

    /// Whether a span has ended since the recording began.
    pub fn saw_any(&self) -> bool {
        MARKS.with(|m| m.borrow().as_ref().is_some_and(|v| !v.is_empty()))
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        let outer = self.outer.take();
        MARKS.with(|m| *m.borrow_mut() = outer);
    }
}

/// Adds to this thread's recording what another thread recorded for it
/// (work the pass handed to a helper thread), each stage as it was.
pub fn absorb(stages: &Stages) {
    for mark in &stages.marks {
        push(mark.stage, mark.took);
    }
}

/// Room for every stage of a create, allocated at its first: one
/// allocation per timed pass, and one too big for the allocator's
/// per-thread caches (glibc keeps freed chunks up to 1 KiB per thread; ten
/// thousand workers each keeping the few a growing list leaves behind held
/// 13 MB, measured with `make bench-scale`).
const ROOM: usize = 64;

fn push(stage: &'static str, took: Duration) {
    MARKS.with(|m| {
        if let Some(marks) = m.borrow_mut().as_mut() {
            if marks.capacity() == 0 {
                marks.reserve_exact(ROOM);
            }
            marks.push(Mark { stage, took });
        }
    });
}

/// Times `stage` until the returned guard drops.
pub fn span(stage: &'static str) -> Span {
    Span {
        stage,
        started: Instant::now(),
    }
}

/// Times `f` as `stage`.
pub fn timed<T>(stage: &'static str, f: impl FnOnce() -> T) -> T {
    let _span = span(stage);
    f()
}

/// An open stage (see [`span`]).
#[must_use = "a span times until it is dropped"]
pub struct Span {
    stage: &'static str,
    started: Instant,
}

impl Drop for Span {
    fn drop(&mut self) {
        push(self.stage, self.started.elapsed());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(stages: &Stages) -> Vec<&'static str> {
        stages.marks.iter().map(|m| m.stage).collect()
    }

    #[test]
    fn spans_are_recorded_in_the_order_they_end() {
        let recording = record();

        timed("outer", || {
            timed("inner", || ());
        });
        let stages = recording.finish();

        assert_eq!(names(&stages), ["inner", "outer"]);
        assert!(stages.of("outer") >= stages.of("inner"));
    }

    #[test]
    fn a_span_with_nothing_recording_leaves_nothing() {
        timed("unseen", || ());

        let stages = record().finish();

        assert!(stages.marks.is_empty());
    }

    #[test]
    fn a_span_on_another_thread_is_not_this_threads() {
        let recording = record();

        std::thread::spawn(|| timed("elsewhere", || ()))
            .join()
            .expect("the thread ran");
        let stages = recording.finish();

        assert!(stages.marks.is_empty());
    }

    #[test]
    fn a_helper_threads_stages_are_absorbed_into_the_pass() {
        let recording = record();

        let helper = std::thread::spawn(|| {
            let inner = record();
            timed("helper", || ());
            inner.finish()
        })
        .join()
        .expect("the thread ran");
        absorb(&helper);
        let stages = recording.finish();

        assert_eq!(names(&stages), ["helper"]);
    }

    #[test]
    fn a_dropped_recording_stops_recording() {
        drop(record());

        timed("after", || ());
        let stages = record().finish();

        assert!(stages.marks.is_empty());
    }

    #[test]
    fn repeats_are_summed_and_counted_in_the_line() {
        let stages = Stages {
            marks: vec![
                Mark {
                    stage: "save",
                    took: Duration::from_micros(300),
                },
                Mark {
                    stage: "seed",
                    took: Duration::from_micros(800),
                },
                Mark {
                    stage: "save",
                    took: Duration::from_micros(200),
                },
            ],
            total: Duration::from_micros(2500),
        };

        assert_eq!(stages.to_string(), "2.5 ms (save 0.5 ×2, seed 0.8)");
    }
}
