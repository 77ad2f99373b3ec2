//! The guest agent's part in a VM's life, as the engine asks it (the
//! exchange itself is [`crate::guest`]'s): after every resume the guest is
//! a copy of its snapshot, and is made to stop being one before the pass
//! goes on: fresh entropy from the host credited and its generator
//! reseeded, its clock checked against the host's and set when off.
//!
//! A VM without a guest agent (nothing listens on its vsock port) is left
//! as it is, said once at debug. One whose agent answers badly, late or not
//! at all once reached is the tenant's problem, not the VM's failure: it
//! runs on, the failure logged. Either way the exchange is bounded by
//! [`ASK_WITHIN`] and the pass's deadline, whichever comes first, so a
//! hostile guest costs its own worker that long and no other VM anything.

use std::io::Read;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::deadline::Deadline;
use crate::guest::{AskError, Reseeded, Said};
use crate::model::Id;
use crate::pb::guest::{Resumed, Saving, request};
use crate::provision::Lifecycle;

/// The longest an exchange with a guest agent may take.
pub(super) const ASK_WITHIN: Duration = Duration::from_secs(2);

/// The longest a guest agent may take to ready its guest for a save (it
/// writes one file): a slower one's guest is saved all the same.
const SAVING_WITHIN: Duration = Duration::from_millis(500);

/// Entropy sent at each resume: 512 bits, the kernel's pool's size.
const ENTROPY: usize = 64;

/// The guest's clock is set when it is off the host's by more than this.
const CLOCK_SLACK_MS: u32 = 100;

/// What came of making a resumed guest whole.
#[derive(Debug)]
pub(super) enum Whole {
    /// The backend gives VMs no guest agent, or its VMM is gone.
    NoDoor,
    /// No guest agent listens in the guest.
    NoAgent,
    /// It did, `after` the guest ran: the pass asked `asked` after it
    /// ran, the guest agent took the connection `reached` after that, and
    /// answered the request `answered` after that.
    Done {
        said: Reseeded,
        after: Duration,
        asked: Duration,
        reached: Duration,
        answered: Duration,
    },
    Failed(AskError),
    /// The host's own random source could not be read (nothing was sent).
    NoEntropy(std::io::Error),
}

/// `ENTROPY` bytes of the host's CRNG.
fn entropy() -> std::io::Result<Vec<u8>> {
    let mut bytes = vec![0u8; ENTROPY];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes)
}

/// Sends a resumed guest what it needs to stop being a copy; `ran` is when
/// its guest began to run.
pub(super) fn make_whole(
    backend: &dyn Lifecycle,
    vm_id: &Id,
    ran: Instant,
    deadline: Deadline,
) -> Whole {
    let Some(door) = backend.guest_doors().and_then(|d| d.guest_door(vm_id)) else {
        return Whole::NoDoor;
    };
    let entropy = match entropy() {
        Ok(bytes) => bytes,
        Err(e) => return Whole::NoEntropy(e),
    };
    // The host's clock is read once the guest agent is reached.
    let ask = || {
        let host_unix_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
        request::Ask::Resumed(Resumed {
            entropy,
            host_unix_ns,
            clock_slack_ms: CLOCK_SLACK_MS,
            // A clone's new leases are its identity's to wait for.
            renew_lease: false,
        })
    };
    let deadline = deadline.capped(ASK_WITHIN);
    let asking = ran.elapsed();
    match crate::guest::ask_made(&door.socket, door.vmm_pid, 1, ask, deadline) {
        Ok(asked) => match asked.said {
            Said::Reseeded(said) => Whole::Done {
                said,
                after: ran.elapsed(),
                asked: asking,
                reached: asked.reached,
                answered: asked.took.saturating_sub(asked.reached),
            },
            other => Whole::Failed(AskError::Said(crate::guest::SaidError::OtherKind {
                asked: "a reseed",
                said: match other {
                    Said::Status(_) => "a status",
                    _ => "another answer",
                },
            })),
        },
        Err(e) if !e.reached() => Whole::NoAgent,
        Err(e) => Whole::Failed(e),
    }
}

/// Tells a guest it is about to be paused and saved, so that its guest
/// agent quiets what its resume would otherwise report falsely (see
/// `Saving` in the protocol), and logs what came of it. Nothing of it
/// holds the save back: a guest without an agent, or whose agent fails or
/// stalls, is saved as it is, `SAVING_WITHIN` later at most.
pub(super) fn warn_of_save(backend: &dyn Lifecycle, vm_id: &Id, deadline: Deadline) {
    let Some(door) = backend.guest_doors().and_then(|d| d.guest_door(vm_id)) else {
        return;
    };
    let ask = request::Ask::Saving(Saving {});
    let deadline = deadline.capped(SAVING_WITHIN);
    match crate::guest::ask(&door.socket, door.vmm_pid, 1, ask, deadline) {
        Ok(asked) => match asked.said {
            Said::Quieted {
                stall_check_quiet,
                was_quiet,
            } => log::debug!(
                "VM {vm_id}: its guest agent readied it for its save in {:.1} ms: its kernel's RCU stall check {}",
                ms(asked.took),
                match (stall_check_quiet, was_quiet) {
                    (true, true) => "was quiet already",
                    (true, false) => "quiet until it runs again",
                    (false, _) => "is not there to quiet",
                }
            ),
            other => log::warn!(
                "VM {vm_id}: its guest agent answered a save's warning with something else ({other:?}); saved all the same"
            ),
        },
        Err(e) if !e.reached() => {}
        Err(e) => log::warn!(
            "VM {vm_id}: its guest agent was not readied for its save ({e}); saved all the same, a resume may print a false RCU stall to its console"
        ),
    }
}

/// Says what came of it, once, in the VM's log and events.
pub(super) fn say(vm_id: &Id, whole: &Whole) {
    match whole {
        Whole::NoDoor => {}
        Whole::NoAgent => log::debug!(
            "VM {vm_id}: no guest agent answers; its resumed guest keeps the entropy and clock of its snapshot"
        ),
        Whole::Done {
            said,
            after,
            asked,
            reached,
            answered,
        } => log::info!(
            "VM {vm_id}: its guest agent answered {:.1} ms after its guest ran (asked at {:.1} ms, its connection taken {:.1} ms later, answered {:.1} ms after that): {} bytes of entropy credited{}, its clock {} ms off the host's{}",
            ms(*after),
            ms(*asked),
            ms(*reached),
            ms(*answered),
            said.credited_bytes,
            if said.crng_reseeded {
                " and its generator reseeded"
            } else {
                " (its generator not reseeded)"
            },
            said.clock_offset_ms,
            if said.clock_set { " (set)" } else { "" },
        ),
        Whole::Failed(e) => log::warn!("VM {vm_id}: its resumed guest was not made whole: {e}"),
        Whole::NoEntropy(e) => log::warn!(
            "VM {vm_id}: its resumed guest was not made whole: cannot read this host's /dev/urandom: {e}"
        ),
    }
}

/// A duration in milliseconds, for the log.
fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
