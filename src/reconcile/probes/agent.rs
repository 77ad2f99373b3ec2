//! Readiness without a probe: what the guest agent says of its guest.
//!
//! A VM whose spec names no probe is asked for its guest's status over the
//! guest agent's door (see [`crate::guest`]). Its row is `ready` with
//! readiness [`GUEST_AGENT_READY`] once the agent says the guest's system
//! is up (systemd running or degraded) to this hypervisor; until then:
//!
//! - where the seeds install a guest agent, the guest is waited for
//!   ([`AGENT_WAIT`] from its boot's start): `creating`, "waiting for the
//!   guest: its guest agent …";
//! - past that, or where no agent was delivered, the hypervisor running is
//!   all there is to go by: `ready`, with readiness [`HYPERVISOR_ONLY`]
//!   and why ("no probe, no guest agent").
//!
//! A VM with a probe is asked too, every [`REFRESH`], only for what its
//! row shows of its guest (the `guest` words and its memory, which `top`
//! shows): its readiness stays its probe's.
//!
//! A status its agent gave unasked earlier in the same pass (a clone's
//! identity carries one, taken alongside its last steps) counts as an
//! answer to this hypervisor: a clone made its own and up is ready in the
//! pass that made it, without a second exchange.
//!
//! The wait counts from the boot's start as its record has it, not from
//! when this agent first saw the VM, so a restarted agent does not hold a
//! guest without an agent back for another wait, and a resumed guest (long
//! past its boot) is asked at once and never held.
//!
//! A resumed guest goes on with the boot it had, whose agent may have said
//! it up long before: it is asked before its row is first said, never
//! presumed unanswered. A guest just booted, whose row is said before its
//! agent is asked, is held as one whose agent is "not asked yet".
//!
//! The guest agent is the tenant's code: each ask is bounded by
//! [`ASK_WITHIN`] and the pass's deadline; one that answers late is
//! waited for as one that has not answered yet (a guest busy booting on a
//! loaded host is slow), one that answers badly is asked again only every
//! [`REFRESH`] and never holds its VM back, and what it says is shown in
//! the row's `guest` field, never acted upon.
//! Its exchange goes over vsock, not the VM's NICs, so it is no traffic of
//! the guest for the idle rule.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use crate::deadline::Deadline;
use crate::guest::frame::FrameError;
use crate::guest::{AskError, Said, Status};
use crate::model::{GUEST_AGENT_READY, GuestMemory, HYPERVISOR_ONLY, Id, Phase};
use crate::pb::guest::{StatusAsk, request};
use crate::reconcile::context::Context;
use crate::reconcile::pass::VmResult;

/// How long a delivered guest agent is waited for, from its boot's start:
/// a Debian cloud image's agent said its system was up 40–49 s into its
/// first boot on a 2-core host (systemd says `running` once cloud-init's
/// last stage is done).
pub(crate) const AGENT_WAIT: Duration = Duration::from_secs(120);

/// The longest one ask may take: more than the 2 s `eitri-guest` gives
/// `systemctl is-system-running`, which a real guest busy booting on a
/// loaded host took over 1 s to answer.
const ASK_WITHIN: Duration = Duration::from_secs(3);

/// How often a guest is asked once its agent said it is up, or once its
/// agent answered badly or was waited out.
const REFRESH: Duration = Duration::from_secs(30);

/// What the last ask came to.
#[derive(Clone, Debug)]
enum Heard {
    /// Nothing asked of this hypervisor's agent yet: a row said before
    /// the pass's ask (its hypervisor just booted) presumes nothing.
    NotAsked,
    Status(Status),
    /// Nothing listens on the agent's port (or no VMM door).
    NoAgent,
    /// It was reached, and its answer did not come in time: a guest busy
    /// booting may be slow; waited for as one that has not answered yet.
    Late(String),
    /// It was reached, and its answer was not taken.
    Bad(String),
}

/// What is known of one VM's guest agent, for its current hypervisor.
#[derive(Clone, Debug)]
struct Seen {
    pid: Option<u32>,
    next_at: SystemTime,
    /// Its system said up to this hypervisor.
    up: bool,
    heard: Heard,
    /// Its row was held `creating` for it at the last look.
    waiting: bool,
    /// Asked only for what the row shows of the guest, the VM having a
    /// probe: never asked about its readiness.
    described: bool,
}

/// Every running VM's guest agent, as the probes' step asks it.
pub(super) struct Agents {
    /// How long a boot waits for its agent: `None` where the seeds deliver
    /// none (an agent the image carries is still asked, never waited for).
    wait: Option<Duration>,
    seen: parking_lot::Mutex<HashMap<Id, Seen>>,
    ids: AtomicU64,
}

impl Agents {
    pub(super) fn new(wait: Option<Duration>) -> Agents {
        Agents {
            wait,
            seen: parking_lot::Mutex::default(),
            ids: AtomicU64::new(1),
        }
    }

    /// Asks the guest agent of a running VM with no probe, when due, and
    /// says in its row what it said; `pid` is its hypervisor's, `booted`
    /// when its boot started (see [`Lifecycle::boot_started`]).
    ///
    /// [`Lifecycle::boot_started`]: crate::state::lifecycle::Lifecycle::boot_started
    pub(super) fn look(
        &self,
        ctx: &Context,
        deadline: Deadline,
        (vm_id, pid): (&Id, Option<u32>),
        (booted, now): (Option<SystemTime>, SystemTime),
        res: &mut VmResult,
    ) {
        let mut seen = self
            .seen
            .lock()
            .get(vm_id)
            .filter(|s| s.pid == pid && !s.described)
            .cloned()
            .unwrap_or_else(|| Seen::fresh(pid, now));
        // What its agent said of its guest earlier in this pass (a clone's
        // identity) is this hypervisor's answer, as if asked now.
        if let Some(status) = res.guest_said.take() {
            seen = Seen::told(pid, now, status);
        }
        if now >= seen.next_at {
            seen.heard = self.ask(ctx, vm_id, deadline);
            if let Heard::Status(status) = &seen.heard {
                seen.up |= status.system.is_up();
            }
            let settled =
                seen.up || matches!(seen.heard, Heard::Bad(_)) || !self.waits(booted, now);
            seen.next_at = now + if settled { REFRESH } else { Duration::ZERO };
        }
        // One that answers badly is the tenant's to fix: not waited for.
        seen.waiting = !seen.up && !matches!(seen.heard, Heard::Bad(_)) && self.waits(booted, now);
        self.say(&seen, booted, now, res);
        self.seen.lock().insert(vm_id.clone(), seen);
    }

    /// Asks the guest agent of a running VM that has a probe, every
    /// [`REFRESH`], for what its row shows of its guest (`guest`, its
    /// memory); its readiness stays its probe's.
    pub(super) fn describe(
        &self,
        ctx: &Context,
        deadline: Deadline,
        (vm_id, pid): (&Id, Option<u32>),
        now: SystemTime,
        res: &mut VmResult,
    ) {
        let mut seen = self
            .seen
            .lock()
            .get(vm_id)
            .filter(|s| s.pid == pid && s.described)
            .cloned()
            .unwrap_or_else(|| Seen {
                described: true,
                ..Seen::fresh(pid, now)
            });
        if let Some(status) = res.guest_said.take() {
            seen.heard = Heard::Status(status);
            seen.next_at = now + REFRESH;
        }
        if now >= seen.next_at {
            seen.heard = self.ask(ctx, vm_id, deadline);
            seen.next_at = now + REFRESH;
        }
        if let (Heard::Status(status), Some(row)) = (&seen.heard, res.row.as_mut()) {
            shown(status, row);
        }
        self.seen.lock().insert(vm_id.clone(), seen);
    }

    /// Holds back the row of a VM whose hypervisor was just started, for a
    /// publish before its pass asks its agent: a guest whose agent is
    /// waited for is not ready yet.
    pub(super) fn hold(&self, ctx: &Context, booted: Option<SystemTime>, res: &mut VmResult) {
        let now = ctx.host.now();
        if let Some(status) = res.guest_said.clone() {
            let told = Seen::told(None, now, status);
            if told.up {
                self.say(&told, booted, now, res);
                return;
            }
        }
        if self.waits(booted, now) {
            let fresh = Seen {
                waiting: true,
                ..Seen::fresh(None, now)
            };
            self.say(&fresh, booted, now, res);
        }
    }

    /// Whether the VM's row is held `creating` for its guest agent.
    pub(super) fn waiting(&self, vm_id: &Id) -> bool {
        self.seen.lock().get(vm_id).is_some_and(|s| s.waiting)
    }

    /// Its guest does not run: what was known of its agent goes.
    pub(super) fn forget(&self, vm_id: &Id) {
        self.seen.lock().remove(vm_id);
    }

    /// Whether a boot that started at `booted` is still within its wait.
    fn waits(&self, booted: Option<SystemTime>, now: SystemTime) -> bool {
        let Some(wait) = self.wait else {
            return false;
        };
        booted.is_none_or(|at| now.duration_since(at).is_ok_and(|d| d < wait) || at > now)
    }

    fn ask(&self, ctx: &Context, vm_id: &Id, deadline: Deadline) -> Heard {
        let Some(door) = ctx.backend.guest_doors().and_then(|d| d.guest_door(vm_id)) else {
            return Heard::NoAgent;
        };
        let id = self.ids.fetch_add(1, Ordering::Relaxed);
        let ask = request::Ask::Status(StatusAsk {});
        match crate::guest::ask(
            &door.socket,
            door.vmm_pid,
            id,
            ask,
            deadline.capped(ASK_WITHIN),
        ) {
            Ok(asked) => match asked.said {
                Said::Status(status) => Heard::Status(status),
                _ => Heard::Bad("answered a status request with another answer".into()),
            },
            Err(e) if !e.reached() => {
                if let AskError::NotItsVmm { .. } = e {
                    ctx.logs
                        .warn(&format!("{vm_id}/guest-agent"), &format!("VM {vm_id}: {e}"));
                }
                Heard::NoAgent
            }
            Err(e @ AskError::Answer(FrameError::TimedOut)) => Heard::Late(e.to_string()),
            Err(e) => {
                let why = e.to_string();
                ctx.logs.warn(
                    &format!("{vm_id}/guest-agent"),
                    &format!("VM {vm_id}: its guest agent is not heeded: {why}"),
                );
                Heard::Bad(why)
            }
        }
    }

    /// The row as the agent has it.
    fn say(&self, seen: &Seen, booted: Option<SystemTime>, now: SystemTime, res: &mut VmResult) {
        let Some(row) = res.row.as_mut() else {
            return;
        };
        if let Heard::Status(status) = &seen.heard {
            shown(status, row);
        }
        if seen.up {
            row.readiness = GUEST_AGENT_READY.to_owned();
            return;
        }
        let heard = match &seen.heard {
            Heard::Status(status) => {
                format!("its guest agent says the system is {}", status.system)
            }
            Heard::NotAsked => "its guest agent is not asked yet".to_owned(),
            Heard::NoAgent => "no guest agent answers".to_owned(),
            Heard::Late(why) => format!("its guest agent is late: {why}"),
            Heard::Bad(why) => format!("its guest agent fails: {why}"),
        };
        if seen.waiting {
            let waited = booted
                .and_then(|at| now.duration_since(at).ok())
                .unwrap_or_default()
                .as_secs();
            row.phase = Some(Phase::Creating);
            row.readiness = format!("guest agent: {heard}");
            row.status_detail = format!(
                "waiting for the guest: {heard}, {waited} s of {} s",
                self.wait.unwrap_or_default().as_secs()
            );
            return;
        }
        row.readiness = match (&seen.heard, self.wait) {
            (Heard::NoAgent, None) => format!("{HYPERVISOR_ONLY}no probe, no guest agent"),
            (Heard::NoAgent, Some(wait)) => format!(
                "{HYPERVISOR_ONLY}no probe, and no guest agent answered in {} s",
                wait.as_secs()
            ),
            _ => format!("{HYPERVISOR_ONLY}no probe; {heard}"),
        };
    }
}

impl Seen {
    /// What `status`, told unasked by this hypervisor's guest agent, makes
    /// known: up, and asked again at the next refresh; else due now.
    fn told(pid: Option<u32>, now: SystemTime, status: Status) -> Seen {
        let up = status.system.is_up();
        Seen {
            up,
            next_at: if up { now + REFRESH } else { now },
            heard: Heard::Status(status),
            ..Seen::fresh(pid, now)
        }
    }

    /// Nothing asked yet of this hypervisor's guest agent: due now.
    fn fresh(pid: Option<u32>, now: SystemTime) -> Seen {
        Seen {
            pid,
            next_at: now,
            up: false,
            heard: Heard::NotAsked,
            waiting: false,
            described: false,
        }
    }
}

/// What the row shows of the guest from its agent's status: its words,
/// and its memory as it says it (available held to its total).
fn shown(status: &Status, row: &mut crate::model::VmStatus) {
    row.guest = describe(status);
    row.guest_memory = (status.memory_total_kib > 0).then_some(GuestMemory {
        total_kib: status.memory_total_kib,
        available_kib: status.memory_available_kib.min(status.memory_total_kib),
    });
}

/// A guest's status, for people: the tenant's words as they came (bounded
/// and free of control characters by [`crate::guest::said`]), escaped
/// again for the row all the same.
fn describe(s: &Status) -> String {
    let mib = |kib: u64| kib / 1024;
    let gib = |bytes: u64| bytes as f64 / f64::from(1u32 << 30);
    let mut words = format!("system {}", s.system);
    if !s.system_detail.is_empty() {
        words.push_str(&format!(" ({})", crate::quote::inline(&s.system_detail)));
    }
    words.push_str(&format!(
        ", up {}",
        crate::human::duration(Duration::from_millis(s.uptime_ms))
    ));
    if s.memory_total_kib > 0 {
        words.push_str(&format!(
            ", {} of {} MiB available",
            mib(s.memory_available_kib),
            mib(s.memory_total_kib)
        ));
    }
    words.push_str(&format!(", load {:.2}", f64::from(s.load_milli) / 1000.0));
    if s.root_total_bytes > 0 {
        words.push_str(&format!(
            ", root {:.1} of {:.1} GiB free",
            gib(s.root_free_bytes),
            gib(s.root_total_bytes)
        ));
    }
    if !s.agent_version.is_empty() {
        words.push_str(&format!(
            ", eitri-guest {}",
            crate::quote::inline(&s.agent_version)
        ));
    }
    if !s.boot_id.is_empty() {
        words.push_str(&format!(", boot {}", crate::quote::inline(&s.boot_id)));
    }
    words
}
