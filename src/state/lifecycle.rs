//! A VM's life as the agent tracks it, in one place.
//!
//! - [`State`]: where a VM with a record is, derived from the record alone
//!   (no on-disk format of its own: the record's fields are the state).
//! - [`phase`]: the one derivation of the phase every row reports, read by
//!   the passes and by the reports made without a pass (`observe`, the
//!   fence, a refusal) alike, so two reports of one record never disagree.
//! - [`Lifecycle`]: the record's lifecycle fields (`create_attempts`,
//!   `created_at`, `last_error`, `failed_at`, `failure_permanent`,
//!   `boot_id`, `stop_requested`, `quarantined_at`,
//!   `quarantine_tombstoned`, `suspension`), private to this module: everyone reads them
//!   through getters, and the transitions, methods on `Record` named for
//!   what happened, are the only code that can write them. A pass that set
//!   a field by hand does not compile. A pass reads as: decide, transition
//!   (the intent), save, side effect, transition (the outcome), save.
//!
//! It lives beside the record it writes (in `state`, below the engine),
//! so the compiler holds the rule; the engine re-exports it as
//! `reconcile::lifecycle`.
//!
//! ```text
//!             begin_attempt / attempt_failed (retry after backoff)
//!              ┌────┐
//!              ▼    │                created(up)       stop_intended → stopped
//!  (no record) ──▶ Creating ─────────────────────▶ Up ◀────────────────────▶ Down
//!                   │  ▲      created(down)─────────────────────────────────▲
//!                   │  └ rearm (spent on transient errors, after --create-rearm)
//!                   ▼                                  booted / lost_while_stopped
//!           Creating(spent) ── spec_changed ──▶ Creating
//!
//!  any ── quarantine ──▶ Quarantined ── unquarantine ──▶ (the state before)
//!                          └─ grace over: destroyed (the record is deleted)
//!
//!        suspend_intended          suspended            resume_intended
//!  Up ─────────────────▶ Suspending ─────────▶ Suspended ──────────────▶ Resuming ── resumed ──▶ Up
//!   ▲                      │ suspend_failed      │ suspension_discarded ──▶ Down       │
//!   └──────────────────────┘                     └ suspension_lost ───────▶ Down ◀──────┘ suspension_lost
//! ```
//!
//! A suspension's rules, which the engine's passes and `make chaos` hold:
//! - Suspending is saved before the VMM is paused: a crash mid-suspend
//!   finds either a live VMM (resumed, or suspended again) or a committed
//!   snapshot (the suspend happened), never neither while the agent alone
//!   died (a VMM outlives it).
//! - Suspended holds what the backend saved ([`Saved`]); the VMM is gone,
//!   so its absence is no crash, and neither is a host reboot.
//! - Resuming is saved before the VMM that restores the snapshot starts:
//!   from then the snapshot is spent. Its memory is stale the moment the
//!   guest runs, so a resume that does not end with that VMM running is
//!   never tried again: the VM is booted from its disks (`suspension_lost`).
//!
//! Departure from the reference, argued: the reference retries a failed
//! create on the very next tick and fails it for good after the budget,
//! so an image server refusing connections for a minute spent every
//! attempt in seconds and the VM stayed failed until its spec changed.
//! Here a failed attempt waits out a backoff (10 s, then 30 s, 90 s, …:
//! times three, from the failure), so a budget spans minutes; and a budget
//! spent only on transient errors re-arms after `--create-rearm` (1 h), so
//! an outage heals without a spec change. A permanent error (a digest that
//! does not match, a disk that would shrink) stays terminal until the spec
//! changes, as in the reference: no retry of that spec can succeed.

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::Record;
use super::record::unix_ms;
use crate::model::{Phase, Saved, VmSpec};

/// A record's lifecycle fields: written only by the transitions below
/// (the fields are private to this module), read through the getters. On
/// disk they are the record's own fields, as before (see
/// [`Record::lifecycle`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lifecycle {
    /// Create attempts spent on this spec. Reset when the spec changes.
    create_attempts: u32,
    /// When the latest create attempt started.
    #[serde(with = "unix_ms")]
    created_at: Option<SystemTime>,
    last_error: String,
    /// When the latest create attempt failed; the next waits out a backoff
    /// from then. Absent in records of older agents: no wait.
    #[serde(with = "unix_ms", default)]
    failed_at: Option<SystemTime>,
    /// The latest create attempt failed permanently: no retry can succeed
    /// until the spec changes (a budget spent on transient errors re-arms).
    #[serde(default)]
    failure_permanent: bool,
    /// Boot id of the host when the VM was last created or booted. Empty
    /// until a create completes: it is the create's completion witness.
    boot_id: String,
    /// The VM was deliberately stopped; its absence is not a crash.
    stop_requested: bool,
    /// When the VM entered quarantine; `None` when it is not quarantined.
    #[serde(with = "unix_ms")]
    quarantined_at: Option<SystemTime>,
    /// Quarantined because it was tombstoned (the shorter grace) rather
    /// than because it vanished from desired state.
    quarantine_tombstoned: bool,
    /// The last create was stopped by a host condition (`last_error` says
    /// which): no attempt was spent, and the next tick tries again.
    #[serde(default)]
    waiting_for_host: bool,
    /// Where a suspension stands; absent in records of VMs never
    /// suspended (and of older agents).
    #[serde(default, skip_serializing_if = "Suspension::is_none")]
    suspension: Suspension,
    /// When its hypervisor was last started to boot the guest from its
    /// disks after its create (a resume goes on with the boot it had);
    /// absent until then, and in records of older agents.
    #[serde(with = "unix_ms", default, skip_serializing_if = "Option::is_none")]
    booted_at: Option<SystemTime>,
}

/// Where a VM's suspension stands (see the module's rules).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum Suspension {
    #[default]
    None,
    /// Intended, saved before the VMM is paused; under way.
    Suspending,
    /// Its guest's state saved, as the backend made it.
    Suspended(Saved),
    /// Intended, saved beside the restore and always before the restored
    /// guest runs: the saved state is spent from here.
    Resuming,
}

impl Suspension {
    pub fn is_none(&self) -> bool {
        *self == Suspension::None
    }

    /// The saved state of a suspended VM.
    pub fn saved(&self) -> Option<Saved> {
        match self {
            Suspension::Suspended(saved) => Some(*saved),
            Suspension::None | Suspension::Suspending | Suspension::Resuming => None,
        }
    }
}

impl Lifecycle {
    pub fn create_attempts(&self) -> u32 {
        self.create_attempts
    }

    pub fn created_at(&self) -> Option<SystemTime> {
        self.created_at
    }

    /// When its guest's boot started: its last boot from its disks, or
    /// else its create attempt.
    pub fn boot_started(&self) -> Option<SystemTime> {
        self.booted_at.or(self.created_at)
    }

    pub fn last_error(&self) -> &str {
        &self.last_error
    }

    pub fn failed_at(&self) -> Option<SystemTime> {
        self.failed_at
    }

    pub fn failure_permanent(&self) -> bool {
        self.failure_permanent
    }

    pub fn boot_id(&self) -> &str {
        &self.boot_id
    }

    pub fn stop_requested(&self) -> bool {
        self.stop_requested
    }

    pub fn quarantined_at(&self) -> Option<SystemTime> {
        self.quarantined_at
    }

    pub fn quarantine_tombstoned(&self) -> bool {
        self.quarantine_tombstoned
    }

    pub fn waiting_for_host(&self) -> bool {
        self.waiting_for_host
    }

    pub fn suspension(&self) -> Suspension {
        self.suspension
    }

    /// Any lifecycle at all, field by field, for tests that arrange a
    /// state no sequence of transitions reaches quickly (a table of every
    /// combination, a record an older agent wrote). Not in a release
    /// build: there, only the transitions write.
    #[cfg(any(test, feature = "testkit"))]
    pub fn from_parts(parts: LifecycleParts) -> Lifecycle {
        Lifecycle {
            create_attempts: parts.create_attempts,
            created_at: parts.created_at,
            last_error: parts.last_error,
            failed_at: parts.failed_at,
            failure_permanent: parts.failure_permanent,
            boot_id: parts.boot_id,
            stop_requested: parts.stop_requested,
            quarantined_at: parts.quarantined_at,
            quarantine_tombstoned: parts.quarantine_tombstoned,
            waiting_for_host: parts.waiting_for_host,
            suspension: parts.suspension,
            booted_at: parts.booted_at,
        }
    }

    /// This lifecycle's fields, to change some and make it again with
    /// [`Lifecycle::from_parts`] (tests only, as that is).
    #[cfg(any(test, feature = "testkit"))]
    pub fn parts(&self) -> LifecycleParts {
        LifecycleParts {
            create_attempts: self.create_attempts,
            created_at: self.created_at,
            last_error: self.last_error.clone(),
            failed_at: self.failed_at,
            failure_permanent: self.failure_permanent,
            boot_id: self.boot_id.clone(),
            stop_requested: self.stop_requested,
            quarantined_at: self.quarantined_at,
            quarantine_tombstoned: self.quarantine_tombstoned,
            waiting_for_host: self.waiting_for_host,
            suspension: self.suspension,
            booted_at: self.booted_at,
        }
    }
}

/// Every lifecycle field, for [`Lifecycle::from_parts`].
#[cfg(any(test, feature = "testkit"))]
#[derive(Clone, Debug, Default)]
pub struct LifecycleParts {
    pub create_attempts: u32,
    pub created_at: Option<SystemTime>,
    pub last_error: String,
    pub failed_at: Option<SystemTime>,
    pub failure_permanent: bool,
    pub boot_id: String,
    pub stop_requested: bool,
    pub quarantined_at: Option<SystemTime>,
    pub quarantine_tombstoned: bool,
    pub waiting_for_host: bool,
    pub suspension: Suspension,
    pub booted_at: Option<SystemTime>,
}

/// The first retry waits this long after a failed attempt; each next one
/// three times as long.
pub const FIRST_RETRY: Duration = Duration::from_secs(10);
const RETRY_FACTOR: u32 = 3;

/// How creates are paced: the engine's settings the lifecycle reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    pub max_attempts: u32,
    /// How long a budget spent only on transient errors stays spent.
    pub rearm: Duration,
}

/// Where a VM with a record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// No create has completed (the boot id is the completion witness).
    Creating(Attempts),
    /// Created, and not deliberately stopped: it should run.
    Up,
    /// Created, and deliberately stopped: its absence is no crash.
    Down,
    /// A suspend under way (or cut short by a crash): its VMM may be
    /// paused, its snapshot written or committed.
    Suspending,
    /// Its guest's state saved ([`Suspension::Suspended`]); no VMM runs
    /// and none should.
    Suspended,
    /// A resume under way (or cut short): its saved state is spent.
    Resuming,
    /// Gone from desired state, stopped, waiting out its grace.
    Quarantined { tombstoned: bool },
}

/// Where a create stands with its budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attempts {
    /// An attempt may start at `due` (`None`: now).
    Open { due: Option<SystemTime> },
    /// Spent on transient errors: the budget re-arms at `rearm_at`.
    Spent { rearm_at: SystemTime },
    /// A permanent error: terminal until the spec changes.
    Permanent,
    /// Stopped by a host condition, with no attempt spent: tried again at
    /// every pass, so a fixed host is seen within a tick.
    WaitingForHost,
}

/// The state `rec` is in, under `budget`.
pub fn state(rec: &Record, budget: Budget) -> State {
    if rec.lifecycle.quarantined_at.is_some() {
        return State::Quarantined {
            tombstoned: rec.lifecycle.quarantine_tombstoned,
        };
    }
    if !rec.lifecycle.boot_id.is_empty() {
        return match rec.lifecycle.suspension {
            Suspension::Suspending => State::Suspending,
            Suspension::Suspended(_) => State::Suspended,
            Suspension::Resuming => State::Resuming,
            Suspension::None if rec.lifecycle.stop_requested => State::Down,
            Suspension::None => State::Up,
        };
    }
    if rec.lifecycle.failure_permanent {
        return State::Creating(Attempts::Permanent);
    }
    if rec.lifecycle.waiting_for_host {
        return State::Creating(Attempts::WaitingForHost);
    }
    let failed_at = rec.lifecycle.failed_at.unwrap_or(SystemTime::UNIX_EPOCH);
    if rec.lifecycle.create_attempts >= budget.max_attempts {
        return State::Creating(Attempts::Spent {
            rearm_at: failed_at + budget.rearm,
        });
    }
    let due = (rec.lifecycle.create_attempts > 0 && rec.lifecycle.failed_at.is_some())
        .then(|| failed_at + retry_delay(rec.lifecycle.create_attempts));
    State::Creating(Attempts::Open { due })
}

/// The wait before the next attempt, after `failed` attempts failed:
/// 10 s, 30 s, 90 s, …
pub fn retry_delay(failed: u32) -> Duration {
    let exponent = failed.saturating_sub(1).min(12);
    FIRST_RETRY.saturating_mul(RETRY_FACTOR.saturating_pow(exponent))
}

/// The phase a row reports for `rec`; `None` for a quarantined VM, which
/// is reported as a quarantined entry, not a row.
///
/// - A create not yet done is `creating`, with its last error shown, while
///   attempts remain; `failed` once the budget is spent or an error was
///   permanent.
/// - A created VM is `ready`, or `failed` while its last operation (a
///   boot, a stop) failed: a success clears the error, so an error on a
///   created VM is always a current one.
pub fn phase(rec: &Record, budget: Budget) -> Option<Phase> {
    match state(rec, budget) {
        State::Quarantined { .. } => None,
        State::Creating(Attempts::Open { .. } | Attempts::WaitingForHost) => Some(Phase::Creating),
        State::Creating(Attempts::Spent { .. } | Attempts::Permanent) => Some(Phase::Failed),
        State::Up | State::Down | State::Suspending | State::Suspended | State::Resuming => {
            Some(if rec.lifecycle.last_error.is_empty() {
                Phase::Ready
            } else {
                Phase::Failed
            })
        }
    }
}

/// What a row of `rec` says besides its phase and error, at `now`: how
/// long until a create is tried again.
pub fn detail(rec: &Record, budget: Budget, now: SystemTime) -> String {
    match state(rec, budget) {
        State::Creating(Attempts::Open { due: Some(due) }) if due > now => {
            format!(
                "retrying in {}: {}",
                human(due, now),
                rec.lifecycle.last_error
            )
        }
        State::Creating(Attempts::Spent { rearm_at }) => format!(
            "{} create attempts spent on errors that may pass; trying again in {} (--create-rearm)",
            rec.lifecycle.create_attempts,
            human(rearm_at.max(now), now)
        ),
        State::Creating(Attempts::Permanent) => {
            "no retry can succeed with this spec; change the spec to try again".into()
        }
        State::Creating(Attempts::WaitingForHost) => {
            "waiting for the host to be fixed (no create attempt is spent; checked again every tick)"
                .into()
        }
        State::Creating(Attempts::Open { .. })
        | State::Up
        | State::Down
        | State::Suspending
        | State::Suspended
        | State::Resuming
        | State::Quarantined { .. } => String::new(),
    }
}

/// How long from `now` until `at`, for people.
fn human(at: SystemTime, now: SystemTime) -> String {
    crate::human::duration(at.duration_since(now).unwrap_or_default())
}

/// The transitions: the only writers of a record's lifecycle fields.
/// Public: anyone may say what happened; nobody may set a field.
impl Record {
    /// The desired spec differs from the one recorded: what the VM is
    /// changed, so the create budget starts over (a permanent error was
    /// about the old spec).
    pub fn spec_changed(&mut self, spec: VmSpec) {
        self.spec = spec;
        self.lifecycle.create_attempts = 0;
        self.lifecycle.last_error.clear();
        self.lifecycle.failed_at = None;
        self.lifecycle.failure_permanent = false;
        self.lifecycle.waiting_for_host = false;
    }

    /// A create was stopped by a host condition before it did anything
    /// the host must undo: no attempt is spent (a counted one is given
    /// back), and the next pass tries again.
    pub fn host_not_ready(&mut self, error: String, counted: bool) {
        if counted {
            self.lifecycle.create_attempts = self.lifecycle.create_attempts.saturating_sub(1);
        }
        self.lifecycle.last_error = error;
        self.lifecycle.waiting_for_host = true;
    }

    /// A budget spent on transient errors, past its re-arm time.
    pub fn rearm(&mut self) {
        self.lifecycle.create_attempts = 0;
        self.lifecycle.failed_at = None;
    }

    /// A create attempt starts; saved before any of its side effects, so a
    /// crash mid-create still counts against the budget.
    pub fn begin_attempt(&mut self, now: SystemTime) {
        self.lifecycle.create_attempts += 1;
        self.lifecycle.created_at = Some(now);
        self.lifecycle.last_error.clear();
        self.lifecycle.waiting_for_host = false;
    }

    /// The attempt this pass counted gives its attempt back: it only ran
    /// out of time (queued for a slot, a download still going).
    pub fn refund_attempt(&mut self, error: String) {
        self.lifecycle.create_attempts = self.lifecycle.create_attempts.saturating_sub(1);
        self.lifecycle.last_error = error;
    }

    /// A create attempt failed; after a permanent error no attempt is made
    /// until the spec changes.
    pub fn attempt_failed(&mut self, error: String, permanent: bool, now: SystemTime) {
        self.lifecycle.last_error = error;
        self.lifecycle.failed_at = Some(now);
        // No retry can succeed: none is made. The attempts stay what was
        // spent, so nothing says "3 of 3" after one.
        self.lifecycle.failure_permanent |= permanent;
    }

    /// A create failed before it could count an attempt (its own record
    /// could not be saved): the error is said, nothing is spent.
    pub fn could_not_attempt(&mut self, error: String) {
        self.lifecycle.last_error = error;
    }

    /// Every side effect of the create succeeded: the boot id is its
    /// completion witness. `up`: it was booted; else created stopped.
    pub fn created(&mut self, boot_id: String, up: bool) {
        self.lifecycle.boot_id = boot_id;
        self.lifecycle.stop_requested = !up;
        self.lifecycle.last_error.clear();
        self.lifecycle.failed_at = None;
        self.lifecycle.failure_permanent = false;
        self.lifecycle.waiting_for_host = false;
    }

    /// A created VM's hypervisor was started (again) at `now` to boot its
    /// guest from its disks; `boot_id` is the host's now, which re-stamps
    /// a VM lost to a reboot. A boot from the disks ends whatever
    /// suspension there was.
    pub fn booted(&mut self, boot_id: String, now: SystemTime) {
        self.lifecycle.booted_at = Some(now);
        self.hypervisor_started(boot_id);
    }

    fn hypervisor_started(&mut self, boot_id: String) {
        self.lifecycle.boot_id = boot_id;
        self.lifecycle.stop_requested = false;
        self.lifecycle.last_error.clear();
        self.lifecycle.suspension = Suspension::None;
    }

    /// A suspend is about to pause the VMM: saved first, so a crash
    /// mid-suspend is finished (or undone) by the next pass, never taken
    /// for a lost VM.
    pub fn suspend_intended(&mut self) {
        self.lifecycle.suspension = Suspension::Suspending;
        self.lifecycle.stop_requested = false;
    }

    /// The guest's state is saved and committed, and its VMM is gone: its
    /// absence is no crash, and neither is a host reboot.
    pub fn suspended(&mut self, saved: Saved) {
        self.lifecycle.suspension = Suspension::Suspended(saved);
        self.lifecycle.stop_requested = true;
        self.lifecycle.last_error.clear();
    }

    /// A suspend failed and its VMM was left running (or found gone): the
    /// error is said, and the next pass tries again if it is still wanted.
    pub fn suspend_failed(&mut self, error: String) {
        self.lifecycle.suspension = Suspension::None;
        self.lifecycle.last_error = error;
    }

    /// A resume is about to start the VMM that restores the saved state:
    /// saved first, and from here the saved state is spent.
    pub fn resume_intended(&mut self) {
        self.lifecycle.suspension = Suspension::Resuming;
        self.lifecycle.stop_requested = false;
    }

    /// The guest runs again where it left off, on a VMM started on this
    /// host's `boot_id`.
    pub fn resumed(&mut self, boot_id: String) {
        self.hypervisor_started(boot_id);
    }

    /// A suspended VM is to be stopped: its saved state is discarded, and it
    /// is down, to be booted from its disks when it is wanted again.
    pub fn suspension_discarded(&mut self) {
        self.lifecycle.suspension = Suspension::None;
        self.lifecycle.stop_requested = true;
    }

    /// The saved state cannot be used (gone, torn, taken with other disks,
    /// or spent by a resume that did not end running): the VM is down, to
    /// be booted from its disks. Never guessed at, never restored twice.
    pub fn suspension_lost(&mut self) {
        self.lifecycle.suspension = Suspension::None;
        self.lifecycle.stop_requested = true;
    }

    pub fn boot_failed(&mut self, error: String) {
        self.lifecycle.last_error = error;
    }

    /// A VM that should not run is lost (its hypervisor gone, or the host
    /// rebooted): it is recorded as deliberately stopped on this boot.
    pub fn lost_while_stopped(&mut self, boot_id: String) {
        self.lifecycle.boot_id = boot_id;
        self.lifecycle.stop_requested = true;
        self.lifecycle.last_error.clear();
    }

    /// The stop is about to be asked for: saved first, so a stop without a
    /// durable intent never reads as a crash after an agent restart.
    pub fn stop_intended(&mut self) {
        self.lifecycle.stop_requested = true;
    }

    pub fn stopped(&mut self) {
        self.lifecycle.last_error.clear();
    }

    pub fn stop_failed(&mut self, error: String) {
        self.lifecycle.last_error = error;
    }

    /// At its desired power state (`up`: running): an error left by an
    /// earlier operation is history, not a failure, and the stop intent
    /// says what the VM is doing now.
    pub fn converged(&mut self, up: bool) {
        self.lifecycle.stop_requested = !up;
        self.lifecycle.last_error.clear();
    }

    /// Gone from desired state (or tombstoned): quarantined, and the stop
    /// intent recorded with it, before the guest is stopped.
    pub fn quarantine(&mut self, now: SystemTime, tombstoned: bool) {
        self.lifecycle.quarantined_at = Some(now);
        self.lifecycle.quarantine_tombstoned = tombstoned;
        self.lifecycle.stop_requested = true;
    }

    /// A vanished VM later tombstoned: the (shorter) tombstone grace now.
    pub fn tombstoned_in_quarantine(&mut self) {
        self.lifecycle.quarantine_tombstoned = true;
    }

    /// Back in desired state: out of quarantine; converge decides the rest.
    pub fn unquarantine(&mut self) {
        self.lifecycle.quarantined_at = None;
        self.lifecycle.quarantine_tombstoned = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Id;

    const BUDGET: Budget = Budget {
        max_attempts: 3,
        rearm: Duration::from_secs(3600),
    };

    fn rec() -> Record {
        Record::new(VmSpec {
            vm_id: Id::parse("vm-1").expect("id"),
            name: String::new(),
            image_url: "http://x/a.raw".into(),
            image_sha256: "ab".repeat(32),
            cloud_init: String::new(),
            ssh_authorized_key: String::new(),
            network: String::new(),
            volume_ids: vec![],
            vcpus: 1,
            mem_mb: 64,
            disk_gb: 1,
            limits: crate::model::VmLimits::default(),
            clone_of: None,
        })
    }

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + s)
    }

    #[test]
    fn on_disk_the_lifecycle_fields_are_the_records_own_as_before() {
        let mut r = rec();
        r.begin_attempt(t(0));
        r.created("boot-1".into(), false);

        let json = serde_json::to_value(&r).expect("json");
        let back: Record = serde_json::from_value(json.clone()).expect("back");

        assert_eq!(json["boot_id"], "boot-1");
        assert_eq!(json["create_attempts"], 1);
        assert_eq!(json["stop_requested"], true);
        assert!(json.get("lifecycle").is_none(), "{json}");
        assert_eq!(back, r);
    }

    #[test]
    fn a_record_never_suspended_has_no_suspension_on_disk_and_a_suspended_one_keeps_it() {
        let mut never = rec();
        never.created("boot-1".into(), true);
        let mut asleep = never.clone();
        let saved = Saved {
            taken_at_ms: 1_800_000_000_000,
            bytes: 4096,
            in_memory: false,
        };
        asleep.suspend_intended();
        asleep.suspended(saved);

        let never_json = serde_json::to_value(&never).expect("json");
        let asleep_json = serde_json::to_value(&asleep).expect("json");
        let back: Record = serde_json::from_value(asleep_json.clone()).expect("back");

        assert!(never_json.get("suspension").is_none(), "{never_json}");
        assert_eq!(asleep_json["suspension"]["state"], "suspended");
        assert_eq!(back.lifecycle.suspension().saved(), Some(saved));
        assert_eq!(state(&back, BUDGET), State::Suspended);
    }

    #[test]
    fn a_resume_ends_the_suspension_and_the_vm_is_up_on_the_new_boot() {
        let mut r = rec();
        r.created("boot-1".into(), true);
        r.suspend_intended();
        r.suspended(Saved::default());
        r.resume_intended();
        assert_eq!(state(&r, BUDGET), State::Resuming);

        r.resumed("boot-2".into());

        assert_eq!(state(&r, BUDGET), State::Up);
        assert_eq!(r.lifecycle.boot_id(), "boot-2");
        assert!(r.lifecycle.suspension().is_none());
    }

    #[test]
    fn a_lost_suspension_leaves_the_vm_down_to_be_booted_from_its_disks() {
        let mut r = rec();
        r.created("boot-1".into(), true);
        r.resume_intended();

        r.suspension_lost();

        assert_eq!(state(&r, BUDGET), State::Down);
        assert_eq!(phase(&r, BUDGET), Some(Phase::Ready));
    }

    #[test]
    fn retries_wait_ten_thirty_ninety_seconds() {
        assert_eq!(
            (1..=3).map(retry_delay).collect::<Vec<_>>(),
            [10, 30, 90].map(Duration::from_secs)
        );
    }

    #[test]
    fn a_failed_attempt_is_due_again_after_its_backoff() {
        let mut r = rec();
        r.begin_attempt(t(0));
        r.attempt_failed("refused".into(), false, t(1));

        assert_eq!(
            state(&r, BUDGET),
            State::Creating(Attempts::Open { due: Some(t(11)) })
        );
        assert_eq!(phase(&r, BUDGET), Some(Phase::Creating));
        assert_eq!(detail(&r, BUDGET, t(5)), "retrying in 6 s: refused");
    }

    #[test]
    fn a_budget_spent_on_transient_errors_rearms_and_a_permanent_one_does_not() {
        let mut transient = rec();
        let mut permanent = rec();
        for _ in 0..3 {
            transient.begin_attempt(t(0));
            transient.attempt_failed("refused".into(), false, t(2));
        }
        permanent.begin_attempt(t(0));
        permanent.attempt_failed("digest mismatch".into(), true, t(2));

        assert_eq!(
            state(&transient, BUDGET),
            State::Creating(Attempts::Spent { rearm_at: t(3602) })
        );
        assert_eq!(
            state(&permanent, BUDGET),
            State::Creating(Attempts::Permanent)
        );
        assert_eq!(phase(&transient, BUDGET), Some(Phase::Failed));
        assert_eq!(phase(&permanent, BUDGET), Some(Phase::Failed));
    }

    #[test]
    fn a_permanent_failure_counts_the_one_attempt_it_took() {
        let mut r = rec();
        r.begin_attempt(t(0));

        r.attempt_failed("digest mismatch".into(), true, t(1));

        assert_eq!(r.lifecycle.create_attempts(), 1);
        assert_eq!(state(&r, BUDGET), State::Creating(Attempts::Permanent));
    }

    #[test]
    fn a_good_stop_clears_the_error_of_a_failed_one() {
        let mut r = rec();
        r.created("boot-1".into(), true);
        r.stop_intended();
        r.stop_failed("guest ignored the power button".into());
        assert_eq!(phase(&r, BUDGET), Some(Phase::Failed));

        r.stopped();

        assert_eq!(state(&r, BUDGET), State::Down);
        assert_eq!(phase(&r, BUDGET), Some(Phase::Ready));
    }

    #[test]
    fn a_spec_change_starts_the_budget_over_even_after_a_permanent_error() {
        let mut r = rec();
        r.begin_attempt(t(0));
        r.attempt_failed("would shrink".into(), true, t(1));
        let mut bigger = r.spec.clone();
        bigger.disk_gb = 10;

        r.spec_changed(bigger);

        assert_eq!(
            state(&r, BUDGET),
            State::Creating(Attempts::Open { due: None })
        );
    }
}
