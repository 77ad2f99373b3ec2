//! Waiting for a new VMM to say Running.
//!
//! A VMM's API is up a few ms after exec, so the wait polls finely at
//! first and then backs off, so a slow guest costs no CPU. It ends one of
//! three ways:
//! 1. the API says Running: booted;
//! 2. the process exits: the boot failed with its own account, read once
//!    its reaper has kept its exit status;
//! 3. time runs out: the VMM is killed, and the failure is the pass's
//!    deadline (never permanent: the attempt is refunded) or, if the
//!    boot's own bound ran out first, a boot timeout.

use std::time::{Duration, Instant};

use super::{SuperviseError, Vmm, ladder};
use crate::deadline::Deadline;
use crate::error::{BoxFailure, DeadlineExpired};
use crate::model::Id;
use crate::stages::span;

/// How long the first, fine polls go on, and their gap.
const FINE_FOR: Duration = Duration::from_millis(50);
const FINE_GAP: Duration = Duration::from_micros(250);
/// The gap after that.
const COARSE_GAP: Duration = Duration::from_millis(5);
/// How long an exited VMM's reaper is given to keep its exit status.
const REAP_WAIT: Duration = Duration::from_secs(1);

/// Waits until `vmm` says Running, exits, or `boot_wait` (or the pass's
/// `deadline`, whichever is first) runs out; see the module steps.
pub fn await_running(
    vm_id: &Id,
    vmm: &dyn Vmm,
    boot_wait: Duration,
    deadline: Deadline,
) -> Result<(), BoxFailure> {
    let _span = span("wait running");
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
        if vmm.says_running() {
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
                    waiting_for: "waiting for the VMM's API to say Running",
                }
                .into());
            }
            return Err(SuperviseError::BootTimeout {
                vm_id: vm_id.clone(),
                noun: vmm.noun(),
                waited: boot_wait,
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
