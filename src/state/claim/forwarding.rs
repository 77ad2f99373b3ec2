//! The host's IPv4 forwarding, which an agent with guests turns on at its
//! start (its guests' traffic is routed through the host): the registry
//! notes that an agent found it off, and the release of the last claim
//! with a guest network turns it off again, so a host whose agents are all
//! released routes no more than it did before the first came.
//!
//! The note is host-wide, not a claim's: two agents with guests share the
//! host's one switch, and the first to be released must leave it on for
//! the other.

use std::fs;
use std::io;
use std::path::Path;

use super::registry::records;
use super::{Claim, ClaimError, Files, Reclaim, Reclaimed};
use crate::state::atomic::write_atomic;

/// The note's name in the registry: not a `.json`, so never read as a
/// claim. It holds the state dir whose agent turned forwarding on.
const NOTE: &str = "forwarding-turned-on";

/// Notes, under the registry's lock, that this state dir's agent found
/// IPv4 forwarding off and turned it on. A note already there stays (the
/// first agent's word on what the host had).
pub fn note_turned_on(files: Files<'_>) -> Result<(), ClaimError> {
    let (state_dir, _lock) = files.locked()?;
    let note = files.registry.join(NOTE);
    if note.exists() {
        return Ok(());
    }
    write_atomic(&note, format!("{}\n", state_dir.display()).as_bytes())
        .map_err(|e| files.registry_error(e))
}

/// Whether the registry holds the note (for `status` and tests).
pub fn noted(registry: &Path) -> bool {
    registry.join(NOTE).exists()
}

/// At the release of `claim` (the registry locked by the caller): when it
/// had a guest network, no other live claim has one and the note says an
/// agent turned forwarding on, it is turned off again and the note goes.
/// What was done, or could not be, goes into `out`.
pub(super) fn after_release(
    registry: &Path,
    claim: &Claim,
    reclaim: &dyn Reclaim,
    out: &mut Reclaimed,
) -> io::Result<()> {
    if claim.network.is_none() || !noted(registry) {
        return Ok(());
    }
    let (live, _) = records(registry)?;
    let others = live
        .iter()
        .filter(|(_, c)| c.state_dir != claim.state_dir && c.network.is_some())
        .count();
    if others > 0 {
        log::info!("IPv4 forwarding stays on: {others} other agent(s) on this host have guests");
        return Ok(());
    }
    match reclaim.stop_forwarding() {
        None => {}
        Some(Ok(())) => {
            out.taken
                .push("IPv4 forwarding, which an agent turned on (off again)".into());
            match fs::remove_file(registry.join(NOTE)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Some(Err(e)) => out
            .left
            .push(format!("IPv4 forwarding, which an agent turned on: {e}")),
    }
    Ok(())
}
