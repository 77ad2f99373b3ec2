//! Reaping a VM that left desired state (vanished) or was tombstoned, and
//! bringing one back that returns before its grace is out.
//!
//! 1. Its compute is released: a quarantined guest is stopped.
//! 2. First sight: quarantine it, with the stop intent saved **before** the
//!    shutdown (if that save fails nothing is stopped; the next pass
//!    retries), and publish the quarantined entry **before** the stop, so
//!    the control plane sees the decision at once, not after a guest has
//!    taken its time over the power button.
//! 3. A vanished VM that is later tombstoned switches to the (shorter)
//!    tombstone grace.
//! 4. After its grace: destroy, then delete the record. A failed destroy
//!    keeps the record, so the next pass tries again; until the record is
//!    gone the VM is reported quarantined, never silently omitted.
//!
//! A quarantined VM back in desired state leaves quarantine and is driven
//! as what it was; a suspended one kept its saved state through it.

use super::context::Context;
use super::pass::{Next, Pass, VmResult, grace_expired, quarantined_entry};
use crate::error::chain;
use crate::state::Record;

/// Step 2: a VM not yet quarantined is, and stopped; then its grace is
/// looked at like any quarantined VM's. A suspended VM keeps its saved
/// state through quarantine: back in desired state, it resumes;
/// destroyed, the state goes with its directory.
pub(crate) fn quarantine(
    ctx: &Context,
    mut rec: Record,
    tombstoned: bool,
    pass: &mut Pass<'_>,
) -> Next {
    let vm_id = rec.spec.vm_id.clone();
    ctx.ledger.release(&vm_id);
    rec.quarantine(ctx.host.now(), tombstoned);
    if let Err(e) = ctx.store.save(&rec) {
        ctx.logs.error(
            &format!("{vm_id}/quarantine"),
            &format!("VM {vm_id}: not quarantining it: {}", chain(&e)),
        );
        // Reported as entering quarantine, but nothing was done; the next
        // pass starts over.
        pass.res.quarantined = Some(quarantined_entry(&rec, ctx.grace_for(&rec)));
        return Next::Done;
    }
    crate::crash::point("quarantine.saved");
    log::info!(
        "VM {vm_id}: {} from desired state; quarantined and stopping",
        if tombstoned { "tombstoned" } else { "gone" }
    );
    if let Some(publisher) = pass.publisher {
        let mut entry = VmResult {
            host_pubkey: pass.res.host_pubkey.clone(),
            ..VmResult::default()
        };
        entry.quarantined = Some(quarantined_entry(&rec, ctx.grace_for(&rec)));
        publisher.publish(entry);
    }
    let say = |what: &str| crate::provision::supervise::ladder::log_stop(&vm_id, what);
    if let Err(e) = ctx.backend.shutdown(&vm_id, pass.deadline, &say) {
        let err: &dyn std::error::Error = &*e;
        log::warn!("VM {vm_id}: shutdown on quarantine failed: {}", chain(err));
    }
    Next::Drive(rec)
}

/// Steps 3 and 4, for a quarantined VM: `newly_tombstoned` when it
/// vanished first and is tombstoned now. Destroyed once its grace is out.
pub(crate) fn when_due(
    ctx: &Context,
    mut rec: Record,
    newly_tombstoned: bool,
    pass: &mut Pass<'_>,
) -> Next {
    let vm_id = rec.spec.vm_id.clone();
    ctx.ledger.release(&vm_id);
    if newly_tombstoned {
        rec.tombstoned_in_quarantine();
        ctx.save_best_effort(&rec);
    }
    let now = ctx.host.now();
    let grace = ctx.grace_for(&rec);
    let since = rec.lifecycle.quarantined_at().unwrap_or(now);
    if grace_expired(since, now, grace) && destroy(ctx, &rec, pass) {
        return Next::Destroyed(vm_id);
    }
    pass.res.quarantined = Some(quarantined_entry(&rec, grace));
    Next::Done
}

/// Destroys the VM and deletes its record; whether both were done (a
/// failure is logged, and the next pass tries again).
fn destroy(ctx: &Context, rec: &Record, pass: &Pass<'_>) -> bool {
    let vm_id = &rec.spec.vm_id;
    let destroyed = ctx.backend.destroy(vm_id, pass.deadline).inspect(|()| {
        crate::crash::point("destroy.vmm-gone");
    });
    match destroyed.map(|()| ctx.store.delete(vm_id)) {
        Ok(Ok(())) => {
            log::info!("VM {vm_id}: destroyed");
            let counts = &ctx.counts;
            counts.destroyed.inc();
            counts.lost.remove(vm_id.as_str());
            counts.unhealthy.remove(vm_id.as_str());
            counts.probe_restarts.remove(vm_id.as_str());
            counts.guest_panics.remove(vm_id.as_str());
            counts.held.lock().remove(vm_id.as_str());
            ctx.forget_logs(vm_id);
            true
        }
        Ok(Err(e)) => {
            ctx.logs.error(
                &format!("{vm_id}/delete"),
                &format!("VM {vm_id}: destroyed, but {}", chain(&e)),
            );
            false
        }
        Err(e) => {
            let err: &dyn std::error::Error = &*e;
            ctx.logs.warn(
                &format!("{vm_id}/destroy"),
                &format!(
                    "VM {vm_id}: destroy failed, retried next tick: {}",
                    chain(err)
                ),
            );
            false
        }
    }
}

/// A quarantined VM back in desired state leaves quarantine (a save that
/// fails is logged; the next pass saves it again) and is driven as what
/// it was.
pub(crate) fn bring_back(ctx: &Context, mut rec: Record) -> Next {
    rec.unquarantine();
    let vm_id = &rec.spec.vm_id;
    if let Err(e) = ctx.store.save(&rec) {
        ctx.logs.warn(
            &format!("{vm_id}/unquarantine"),
            &format!("VM {vm_id}: cannot save its return from quarantine: {e}"),
        );
    }
    log::info!("VM {vm_id}: back in desired state, leaving quarantine");
    Next::Drive(rec)
}
