//! Waiting for a new VMM to say Running (or, for one restoring a saved
//! guest that is to run only once its resume is recorded, Paused).
//!
//! A VMM's API is up a few ms after exec, so the wait polls finely at
//! first and then backs off, so a slow guest costs no CPU. It ends one of
//! three ways:
//! 1. the API says what was awaited: booted;
//! 2. the process exits: the boot failed with its own account, read once
//!    its reaper has kept its exit status;
//! 3. time runs out: the VMM is killed, and the failure is the pass's
//!    deadline (never permanent: the attempt is refunded) or, if the
//!    boot's own bound ran out first, a boot timeout.

use std::time::{Duration, Instant};

use super::{SuperviseError, Vmm, ladder};
use crate::deadline::Deadline;
use crate::error::{DeadlineExpired, Outcome};
use crate::model::Id;
use crate::stages::span;

/// How long the first, fine polls go on, and their gap.
const FINE_FOR: Duration = Duration::from_millis(50);
const FINE_GAP: Duration = Duration::from_micros(250);
/// The gap after that.
const COARSE_GAP: Duration = Duration::from_millis(5);
/// How long an exited VMM's reaper is given to keep its exit status.
const REAP_WAIT: Duration = Duration::from_secs(1);

/// The state a new VMM's guest is awaited in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Awaited {
    /// Its guest runs.
    Running,
    /// Its guest is restored and held still, to be run by a later call.
    Paused,
    /// Either: a VMM found alive, whose restore may still be under way.
    PausedOrRunning,
}

impl Awaited {
    /// The state's word in the VMMs' APIs and in what people read.
    pub fn word(self) -> &'static str {
        match self {
            Awaited::Running => "Running",
            Awaited::Paused => "Paused",
            Awaited::PausedOrRunning => "Paused or Running",
        }
    }

    /// What a wait for it is, for a deadline that ran out.
    fn waiting_for(self) -> &'static str {
        match self {
            Awaited::Running => "waiting for the VMM's API to say Running",
            Awaited::Paused => "waiting for the VMM's API to say Paused",
            Awaited::PausedOrRunning => "waiting for the VMM's API to say Paused or Running",
        }
    }

    fn said_by(self, vmm: &dyn Vmm) -> bool {
        match self {
            Awaited::Running => vmm.says_running(),
            Awaited::Paused => vmm.says_paused(),
            Awaited::PausedOrRunning => vmm.says_paused() || vmm.says_running(),
        }
    }
}

/// Waits until `vmm` says Running, exits, or `boot_wait` (or the pass's
/// `deadline`, whichever is first) runs out; see the module steps.
pub fn await_running(
    vm_id: &Id,
    vmm: &dyn Vmm,
    boot_wait: Duration,
    deadline: Deadline,
) -> Outcome {
    await_state(vm_id, vmm, Awaited::Running, boot_wait, deadline)
}

/// Waits until `vmm` says `awaited`, as [`await_running`] does Running.
pub fn await_state(
    vm_id: &Id,
    vmm: &dyn Vmm,
    awaited: Awaited,
    boot_wait: Duration,
    deadline: Deadline,
) -> Outcome {
    let _span = span(match awaited {
        Awaited::Running => "wait running",
        Awaited::Paused | Awaited::PausedOrRunning => "wait restored",
    });
    let until = deadline.capped(boot_wait);
    let started = Instant::now();
    loop {
        if !vmm.alive() {
            ladder::wait_gone(vmm, Deadline::after(REAP_WAIT));
            return Err(SuperviseError::ExitedDuringBoot {
                vm_id: vm_id.clone(),
                noun: vmm.noun(),
                reason: vmm.failure_reason(),
            }
            .into());
        }
        if awaited.said_by(vmm) {
            return Ok(());
        }
        if until.expired() {
            ladder::kill(vmm);
            let reason = vmm.failure_reason();
            if deadline.expired() {
                log::warn!(
                    "VM {vm_id}: killed {} that did not boot in time: {reason}",
                    vmm.noun()
                );
                return Err(DeadlineExpired {
                    waiting_for: awaited.waiting_for(),
                }
                .into());
            }
            return Err(SuperviseError::BootTimeout {
                vm_id: vm_id.clone(),
                noun: vmm.noun(),
                waited: boot_wait,
                awaited: awaited.word(),
                reason,
            }
            .into());
        }
        let gap = if started.elapsed() < FINE_FOR {
            FINE_GAP
        } else {
            COARSE_GAP
        };
        std::thread::sleep(gap);
    }
}
