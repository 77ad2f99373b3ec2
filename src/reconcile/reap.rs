//! Reaping a VM that left desired state (vanished) or was tombstoned.
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

use super::lifecycle::{self, State};
use super::pass::{Core, Pass, VmResult, grace_expired, quarantined_entry};
use crate::error::chain;
use crate::state::Record;

impl Core {
    pub(crate) fn reap(&self, mut rec: Record, tombstoned: bool, pass: &mut Pass<'_>) {
        let vm_id = rec.spec.vm_id.clone();
        self.ledger.release(&vm_id);
        let now = self.host.now();
        match lifecycle::state(&rec, self.budget()) {
            // A suspended VM keeps its saved state through quarantine: back
            // in desired state, it resumes; destroyed, the state goes with
            // its directory.
            State::Creating(_)
            | State::Up
            | State::Down
            | State::Suspending
            | State::Suspended
            | State::Resuming => {
                rec.quarantine(now, tombstoned);
                if let Err(e) = self.store.save(&rec) {
                    self.logs.error(
                        &format!("{vm_id}/quarantine"),
                        &format!("VM {vm_id}: not quarantining it: {}", chain(&e)),
                    );
                    // Reported as entering quarantine, but nothing was done;
                    // the next pass starts over.
                    pass.res.quarantined = Some(quarantined_entry(&rec, self.grace_for(&rec)));
                    return;
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
                    entry.quarantined = Some(quarantined_entry(&rec, self.grace_for(&rec)));
                    publisher.publish(entry);
                }
                let say = |what: &str| log::info!("VM {vm_id}: {what}");
                if let Err(e) = self.prov.shutdown(&vm_id, pass.deadline, &say) {
                    let err: &dyn std::error::Error = &*e;
                    log::warn!("VM {vm_id}: shutdown on quarantine failed: {}", chain(err));
                }
            }
            State::Quarantined { tombstoned: false } if tombstoned => {
                rec.tombstoned_in_quarantine();
                self.save_best_effort(&rec);
            }
            State::Quarantined { .. } => {}
        }

        let grace = self.grace_for(&rec);
        let since = rec.lifecycle.quarantined_at().unwrap_or(now);
        if grace_expired(since, now, grace) {
            let destroyed = self.prov.destroy(&vm_id, pass.deadline).inspect(|()| {
                crate::crash::point("destroy.vmm-gone");
            });
            match destroyed {
                Ok(()) => match self.store.delete(&vm_id) {
                    Ok(()) => {
                        log::info!("VM {vm_id}: destroyed");
                        self.counts.destroyed.inc();
                        self.counts.lost.remove(vm_id.as_str());
                        self.counts.unhealthy.remove(vm_id.as_str());
                        self.counts.probe_restarts.remove(vm_id.as_str());
                        self.counts.held.lock().remove(vm_id.as_str());
                        self.probes.lock().remove(&vm_id);
                        self.sleepers.forget(&vm_id);
                        self.creates.waiting.lock().remove(&vm_id);
                        self.forget_logs(&vm_id);
                        return;
                    }
                    Err(e) => {
                        self.logs.error(
                            &format!("{vm_id}/delete"),
                            &format!("VM {vm_id}: destroyed, but {}", chain(&e)),
                        );
                    }
                },
                Err(e) => {
                    let err: &dyn std::error::Error = &*e;
                    self.logs.warn(
                        &format!("{vm_id}/destroy"),
                        &format!(
                            "VM {vm_id}: destroy failed, retried next tick: {}",
                            chain(err)
                        ),
                    );
                }
            }
        }
        pass.res.quarantined = Some(quarantined_entry(&rec, grace));
    }
}
