//! The pass value: what one VM's pass is given (its [`Assignment`]), what
//! it builds (its [`VmResult`]), and how it tells its row what it is doing
//! while it runs ([`Pass`], [`Narrator`]).
//!
//! A pass is bounded by `vm_timeout` (its [`Deadline`]) and loads only its
//! own VM's record; its steps are the spine's (`step.rs`).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::deadline::Deadline;
use crate::model::{DesiredVm, Id, Phase, PowerState, QuarantinedVm, Report, VmStatus};
use crate::state::Record;

/// One VM's slice of a snapshot. It holds the desired spec by `Arc`: the
/// worker keeps it for as long as its pass runs, well past the step that
/// delivered it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Assignment {
    Desired {
        vm: Arc<DesiredVm>,
        /// For a clone: the same snapshot wants its template, as one. A
        /// template with no record yet is then on its way (its own worker
        /// is making it), not gone.
        template_wanted: bool,
    },
    /// Absent from desired state (vanished) or tombstoned: reap it. The two
    /// differ in grace period, so the flag stays explicit.
    Reap { tombstoned: bool },
}

/// One VM's contribution to the host report: at most one row, or one
/// quarantined entry.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct VmResult {
    pub row: Option<VmStatus>,
    pub quarantined: Option<QuarantinedVm>,
    /// Stamped on the row when merged. Kept apart because it is
    /// level-triggered: every row of a VM with a host key carries it, or the
    /// control plane would forget the guest's certificate for a tick.
    pub host_pubkey: String,
    /// What the VM's guest agent said of its guest earlier in this pass
    /// (a clone's identity carries its status): its probes step takes it
    /// as an answer to the status it would ask (see `probes::agent`).
    pub guest_said: Option<crate::guest::Status>,
}

impl VmResult {
    /// The row of a VM the host does not have yet, waiting for its first
    /// pass: nothing runs (stopped), being created, `queued`.
    pub fn queued(vm_id: &Id) -> VmResult {
        VmResult {
            row: Some(VmStatus {
                vm_id: vm_id.to_string(),
                power: Some(PowerState::Stopped),
                phase: Some(Phase::Creating),
                status_detail: "queued".into(),
                ..VmStatus::default()
            }),
            ..VmResult::default()
        }
    }

    /// A row for a VM the agent could not work on and did not look at.
    pub(crate) fn failed_unobserved(vm_id: &Id, why: String) -> VmResult {
        VmResult {
            row: Some(VmStatus {
                vm_id: vm_id.to_string(),
                power: None,
                phase: Some(Phase::Failed),
                last_error: why,
                ..VmStatus::default()
            }),
            ..VmResult::default()
        }
    }

    /// Sets this VM's row (a later call in the same pass replaces it).
    pub fn report(
        &mut self,
        rec: &Record,
        power: Option<PowerState>,
        phase: Phase,
        last_error: impl Into<String>,
    ) {
        self.row = Some(VmStatus {
            vm_id: rec.spec.vm_id.to_string(),
            ip: rec.ip.clone(),
            network_ip: rec.network_ip.clone(),
            power,
            phase: Some(phase),
            last_error: last_error.into(),
            status_detail: String::new(),
            ssh_host_pubkey: String::new(),
            egress: String::new(),
            limits: String::new(),
            readiness: String::new(),
            spec_rejected: String::new(),
            published: Vec::new(),
            asleep: false,
            last_wake: String::new(),
            guest: String::new(),
            guest_memory: None,
        });
    }

    /// The row as reported: with the VM's host key.
    pub fn stamped_row(&self) -> Option<VmStatus> {
        self.row.as_ref().map(|row| VmStatus {
            ssh_host_pubkey: self.host_pubkey.clone(),
            ..row.clone()
        })
    }

    pub fn merge_into(mut self, report: &mut Report) {
        if let Some(mut row) = self.row.take() {
            row.ssh_host_pubkey = self.host_pubkey;
            report.vms.push(std::sync::Arc::new(row));
        }
        if let Some(q) = self.quarantined {
            report.quarantined.push(q);
        }
    }
}

/// One VM's pass as every verb of the engine takes it: its deadline, the
/// result it builds, and who is told what it is doing as it goes.
pub(crate) struct Pass<'a> {
    pub deadline: Deadline,
    pub res: &'a mut VmResult,
    pub publisher: Option<&'a Publisher>,
    /// What its assignment says of a clone's template (see
    /// [`Assignment::Desired`]).
    pub template_wanted: bool,
}

impl Pass<'_> {
    /// Who tells the VM's row, as `rec` at `power` and `phase`, what this
    /// pass is doing.
    pub(crate) fn narrator(&self, rec: &Record, power: PowerState, phase: Phase) -> Narrator {
        let mut template = VmResult {
            host_pubkey: self.res.host_pubkey.clone(),
            ..VmResult::default()
        };
        template.report(rec, Some(power), phase, "");
        Narrator {
            publisher: self.publisher.cloned(),
            deadline: self.deadline,
            template,
        }
    }
}

/// Publishes what a pass is doing right now, on the row the VM would
/// report anyway (for a create: creating, stopped, no error). `'static`
/// and cheap to clone, so it can ride the image cache's progress callback.
///
/// A narrator of a pass past its deadline says nothing: the polite half of
/// the guarantee. The load-bearing half is the publisher's generation
/// check, since a deadline passing and a pass ending are not one instant.
#[derive(Clone)]
pub(crate) struct Narrator {
    publisher: Option<Publisher>,
    deadline: Deadline,
    template: VmResult,
}

impl Narrator {
    /// The deadline of the pass it tells of.
    pub(crate) fn deadline(&self) -> Deadline {
        self.deadline
    }

    pub(crate) fn say(&self, detail: &str) {
        let Some(publisher) = &self.publisher else {
            return;
        };
        if self.deadline.expired() {
            return;
        }
        let mut result = self.template.clone();
        if let Some(row) = &mut result.row {
            row.status_detail = detail.to_owned();
        }
        publisher.publish(result);
    }
}

/// What should happen next in a pass, as a verb returns it.
pub(crate) enum Next {
    /// Nothing more: the row is said.
    Done,
    /// Drive the record again by its state: it changed under the verb (a
    /// VM back from quarantine, a saved state discarded, a guest resumed
    /// while it is wanted otherwise, a VM quarantined).
    Drive(Record),
    /// Suspend the VM, which runs (a create or boot of a VM wanted
    /// suspended: a guest that never ran has no state to save).
    Suspend(Record),
    /// The host has what `rec` says and the row is set (a create done, a
    /// guest resumed), the record not yet saved: the row is published
    /// first, as the pass will end it, then the record follows, then the
    /// crash point. Said first because the VMM runs whether or not the
    /// save lands, and a crash before it is adopted, never started twice.
    Announce(Record, Began),
    /// The VM is destroyed and its record deleted: what every concern
    /// kept of it goes.
    Destroyed(Id),
}

/// How the guest of an [`Next::Announce`] came to run.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Began {
    /// Created: booted from its disks, or a clone restored and made its
    /// own; the crash point is hit once its record is saved.
    Created(crate::crash::Point),
    /// Resumed where it left off: the boot it had goes on, and what its
    /// guest agent says of it is asked for at once, never presumed.
    Resumed,
}

/// How a pass ended.
pub(crate) enum PassOutcome {
    Done(VmResult),
    /// The pass did nothing (the record is unreadable). The VM's previous
    /// row stands; `fallback` is used only when it has none.
    Skipped {
        fallback: VmResult,
        why: String,
    },
}

/// The span of a counted create attempt, from its saved count to its end: a
/// pass with one is logged with all its stages (those before it too).
pub(crate) const CREATE_STAGE: &str = "create";
/// The spans of a suspend and of a resume: a pass with one is logged with
/// its stages too.
pub(crate) const SUSPEND_STAGE: &str = "suspend";
pub(crate) const RESUME_STAGE: &str = "resume";

/// Where a pass publishes its VM's row mid-pass: the worker's, under the
/// pass's generation (see `workers`), so a publish from a pass that is
/// over lands nowhere.
pub(crate) trait Publish: Send + Sync {
    fn publish(&self, result: VmResult);
}

/// A pass's publisher: cheap to clone and `'static`, so it can ride a
/// progress callback onto another thread.
pub(crate) type Publisher = Arc<dyn Publish>;

/// The quarantined entry for a record: its spec as JSON, so the control
/// plane can restore it, and when it will be destroyed.
pub(crate) fn quarantined_entry(rec: &Record, grace: Duration) -> QuarantinedVm {
    let since = rec.lifecycle.quarantined_at().unwrap_or(UNIX_EPOCH);
    let destroy_at = since
        .checked_add(grace)
        .unwrap_or(since)
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    QuarantinedVm {
        vm_id: rec.spec.vm_id.clone(),
        name: rec.spec.name.clone(),
        vmspec_json: serde_json::to_vec(&rec.spec).unwrap_or_default(),
        destroy_at_unix: destroy_at,
    }
}

/// Whether `grace` has passed since `since`. A clock that went backwards
/// counts as no time passed: destroying early is the worse mistake.
pub(crate) fn grace_expired(since: SystemTime, now: SystemTime, grace: Duration) -> bool {
    now.duration_since(since).unwrap_or(Duration::ZERO) >= grace
}
