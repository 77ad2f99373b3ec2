//! Driving a created VM, up or down by its record, to its desired power
//! state: booting it, stopping it, or booting it again when it was lost.
//!
//! lost = the host rebooted since the VM last booted (boot id changed), or
//! its hypervisor is gone without a recorded stop request. A deliberately
//! stopped VM is stopped, not lost. A lost VM that should run is booted
//! again: every VM is persistent.
//!
//! Each branch reads as its transitions: the intent saved before the side
//! effect, the outcome saved after it, and the row derived from the record
//! the way every report derives it (`lifecycle::phase`). A VM wanted
//! suspended is handed back to the spine to suspend once it runs.

use super::context::Context;
use super::holds;
use super::pass::{Next, Pass, VmResult};
use super::volumes;
use crate::deadline::Deadline;
use crate::error::{BoxFailure, chain};
use crate::model::{DesiredVm, Phase, PowerState};
use crate::state::Record;

/// Drives a created VM that is `up` (created and not deliberately
/// stopped) or down by its record.
pub(crate) fn run(
    ctx: &Context,
    d: &DesiredVm,
    mut rec: Record,
    up: bool,
    pass: &mut Pass<'_>,
) -> Next {
    // Keeps the ledger true for every live VM, however it got here (an
    // un-quarantined VM's compute was released).
    ctx.ledger.note(&rec.spec);
    ctx.counts.lost.touch(rec.spec.vm_id.as_str());
    let running = ctx.backend.running(&rec.spec.vm_id);
    // A running VM keeps what it booted with (its row says what waits);
    // the next boot from cold takes it.
    if !running {
        holds::take_next_boot_changes(ctx, d, &mut rec);
    }
    let boot_id = ctx.host.boot_id();
    if ctx.note_address(&mut rec) {
        ctx.save_best_effort(&rec);
    }

    let rebooted = rec.lifecycle.boot_id() != boot_id;
    if rebooted || (!running && up) {
        return lost(ctx, d, rec, rebooted, boot_id, pass);
    }
    match (d.power, running) {
        (PowerState::Running, false) => {
            boot(ctx, pass.deadline, rec, boot_id, pass.res);
            Next::Done
        }
        (PowerState::Stopped, true) => stop(ctx, rec, pass),
        (PowerState::Suspended, true) => Next::Suspend(rec),
        // A stopped VM is suspended by way of a boot: what is wanted is
        // a guest's state saved, and a guest that never ran has none.
        (PowerState::Suspended, false) => match boot(ctx, pass.deadline, rec, boot_id, pass.res) {
            Some(rec) => Next::Suspend(rec),
            None => Next::Done,
        },
        // At the desired state: whatever an earlier operation left in
        // the record is history now.
        (PowerState::Running, true) | (PowerState::Stopped, false) => {
            if rec.lifecycle.stop_requested() == running || !rec.lifecycle.last_error().is_empty() {
                rec.converged(running);
                ctx.save_best_effort(&rec);
            }
            ctx.report_recorded(pass.res, &rec, PowerState::observed(running));
            Next::Done
        }
    }
}

/// A VM lost to a host reboot or a hypervisor gone unasked: booted again
/// if it should run (and suspended after, if that is what is wanted), or
/// recorded as stopped.
fn lost(
    ctx: &Context,
    d: &DesiredVm,
    mut rec: Record,
    rebooted: bool,
    boot_id: String,
    pass: &mut Pass<'_>,
) -> Next {
    let why = if rebooted {
        "the host rebooted"
    } else {
        "its hypervisor is gone without a stop request"
    };
    log::warn!("VM {}: lost ({why})", rec.spec.vm_id);
    ctx.counts.lost.inc(rec.spec.vm_id.as_str());
    match d.power {
        PowerState::Running | PowerState::Suspended => {
            // Said before the boot: the guest is down until it ends.
            pass.narrator(&rec, PowerState::Stopped, Phase::Ready)
                .say(&format!("booting again: {why}"));
            match boot(ctx, pass.deadline, rec, boot_id, pass.res) {
                Some(rec) if d.power == PowerState::Suspended => Next::Suspend(rec),
                _ => Next::Done,
            }
        }
        PowerState::Stopped => {
            rec.lost_while_stopped(boot_id);
            ctx.save_best_effort(&rec);
            ctx.report_recorded(pass.res, &rec, PowerState::Stopped);
            Next::Done
        }
    }
}

/// Boots a VM that should run and does not; `boot_id` is the host's,
/// which re-stamps a VM lost to a reboot. The record as saved, if it
/// booted.
fn boot(
    ctx: &Context,
    deadline: Deadline,
    mut rec: Record,
    boot_id: String,
    res: &mut VmResult,
) -> Option<Record> {
    let booting = std::time::Instant::now();
    let backend = &ctx.backend;
    let booted = volumes::materialized(&ctx.store, &rec.spec, &|other| backend.running(other))
        .and_then(|()| backend.boot(&rec.spec, deadline));
    match booted {
        Ok(()) => {
            ctx.counts.boots.observe(booting.elapsed());
            ctx.note_address(&mut rec);
            rec.booted(boot_id, ctx.host.now());
            ctx.save_best_effort(&rec);
            ctx.forget_logs(&rec.spec.vm_id);
            log::info!("VM {}: booted", rec.spec.vm_id);
            ctx.report_recorded(res, &rec, PowerState::Running);
            Some(rec)
        }
        Err(e) => {
            fail_boot(ctx, rec, e, res);
            None
        }
    }
}

/// Stops a VM that should not run. The stop intent is saved first: a
/// stop without a durable intent would read as a crash after an agent
/// restart, and the VM would be booted again. A long stop (a guest
/// taking its time over the power button) is narrated as it goes.
fn stop(ctx: &Context, mut rec: Record, pass: &mut Pass<'_>) -> Next {
    rec.stop_intended();
    let Some(narrator) = ctx.intend(
        &rec,
        "stopping",
        PowerState::Running,
        crate::crash::at("stop.intent-saved"),
        pass,
    ) else {
        return Next::Done;
    };
    let say = |what: &str| narrator.say(what);
    match ctx.backend.shutdown(&rec.spec.vm_id, pass.deadline, &say) {
        Ok(()) => {
            crate::crash::point("stop.done");
            rec.stopped();
            ctx.save_best_effort(&rec);
            log::info!("VM {}: stopped", rec.spec.vm_id);
            ctx.report_recorded(pass.res, &rec, PowerState::Stopped);
        }
        // Unlike the reference, a failed shutdown is not reported as
        // stopped: the row says what the host has, and the saved intent
        // makes the next pass try again.
        Err(e) => {
            let err: &dyn std::error::Error = &*e;
            let why = chain(err);
            ctx.log_failure(&rec.spec.vm_id, "shutdown failed", &why);
            rec.stop_failed(why);
            ctx.save_best_effort(&rec);
            let power = PowerState::observed(ctx.backend.running(&rec.spec.vm_id));
            ctx.report_recorded(pass.res, &rec, power);
        }
    }
    Next::Done
}

/// Records a failed boot with the hypervisor's own account of why.
fn fail_boot(ctx: &Context, mut rec: Record, err: BoxFailure, res: &mut VmResult) {
    let err: &dyn std::error::Error = &*err;
    let mut error = chain(err);
    if let Some(reason) = ctx.backend.failure_reason(&rec.spec.vm_id) {
        error = format!("{error}: {reason}");
    }
    ctx.log_failure(&rec.spec.vm_id, "boot failed", &error);
    rec.boot_failed(error);
    ctx.save_best_effort(&rec);
    ctx.report_recorded(res, &rec, PowerState::Stopped);
}

/// Boots again a running VM whose probe has failed past its
/// `restart_after` (`why` says so): its hypervisor stopped by the usual
/// ladder, a new one started as its record says (what it was created
/// with, and what waits for its next boot: never a spec nothing
/// recorded). Its row says so, and whether it failed.
pub(crate) fn restart(ctx: &Context, desired: &DesiredVm, why: &str, pass: &mut Pass<'_>) {
    let vm_id = &desired.spec.vm_id;
    let Ok(Some(rec)) = ctx.store.get(vm_id) else {
        return;
    };
    let mut rec = (*rec).clone();
    let deadline = pass.deadline;
    let say = |what: &str| crate::provision::supervise::ladder::log_stop(vm_id, what);
    let restarted = ctx.backend.shutdown(vm_id, deadline, &say).and_then(|()| {
        holds::take_next_boot_changes(ctx, desired, &mut rec);
        ctx.backend.boot(&rec.spec, deadline)
    });
    if restarted.is_ok() {
        // A boot from its disks, as any: what waits on its boot (its
        // guest agent) counts from now.
        rec.booted(ctx.host.boot_id(), ctx.host.now());
        ctx.save_best_effort(&rec);
    }
    if let Some(row) = pass.res.row.as_mut() {
        row.phase = Some(Phase::Creating);
        match restarted {
            Ok(()) => row.status_detail = why.to_owned(),
            Err(e) => {
                row.power = Some(PowerState::observed(ctx.backend.running(vm_id)));
                row.last_error = format!("{why}, which failed: {}", chain(&*e));
            }
        }
    }
}
