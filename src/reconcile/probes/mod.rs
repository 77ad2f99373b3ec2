//! Readiness: a VM whose spec names a probe is `ready` only once its guest
//! answers it, and `unhealthy` in its row when it stops answering.
//!
//! A probe runs in the VM's own pass, at most once a period (so at least
//! once a tick), bounded by its timeout: a console line containing a text
//! (the agent keeps the console; a boot starts it afresh; once printed it
//! answers for the life of that hypervisor, so the console is not read
//! again), a TCP connection to a port of the guest's underlay address, or
//! an HTTP GET there answering 2xx. What a probe
//! knows lives in memory and starts over with each hypervisor (a new pid):
//! a restarted agent asks again, and a guest that answers at once loses
//! nothing.
//!
//! Until the first answer since its boot the row says `creating` and what
//! it waits for ("waiting for the guest: tcp 22, 4 s of 60 s"); past the
//! grace, and whenever a probe fails after an answer, its error says
//! `unhealthy: …` and each such probe is counted. With `restart_after`, a
//! guest failing that long on end is booted again (its hypervisor stopped
//! by the usual ladder and started afresh), said in its row and counted:
//! [`Probes::probe`] says when, and the spine has the boot verb do it.
//!
//! A VM whose spec names no probe is judged by its guest agent instead
//! ([`agent`]): ready once the agent says its guest's system is up, or, with
//! no agent, once its hypervisor runs, its row saying which.
//!
//! What the probes know is theirs ([`Probes`]); what the other steps of a
//! pass may ask of it is whether the guest answered ([`Probes::answered`],
//! [`Probes::answering`]).

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use super::context::Context;
use super::pass::{Began, VmResult};
use crate::deadline::Deadline;
use crate::model::{ANSWERED, Check, DesiredVm, Id, Phase, PowerState, Readiness, UNHEALTHY};
use crate::state::Record;

mod agent;
mod ask;

pub(crate) use agent::AGENT_WAIT;

/// What the engine knows of one VM's probe, for its current hypervisor.
#[derive(Clone, Debug)]
struct ProbeState {
    /// The hypervisor it is about, and when it was first seen running.
    pid: Option<u32>,
    since: SystemTime,
    /// When the probe last answered, and since when it has failed on end.
    answered: Option<SystemTime>,
    failing_since: Option<SystemTime>,
    next_at: SystemTime,
    /// The last probe's result, for the row.
    last: String,
    /// How much of the live console a serial probe has searched.
    console_searched: Option<u64>,
    /// No probe is named yet: the entry only remembers that this
    /// hypervisor ran (and was ready) without one.
    unprobed: bool,
    /// The probe came to a hypervisor already running without one: the
    /// VM is created and running, so it is not `creating` while the probe
    /// waits for its first answer, only not ready.
    added_while_running: bool,
    /// Whether the row says unhealthy, so a flip either way is logged once.
    unhealthy: bool,
}

/// What a probe knows of a hypervisor first seen running at `now`.
fn fresh(pid: Option<u32>, now: SystemTime) -> ProbeState {
    ProbeState {
        pid,
        since: now,
        answered: None,
        failing_since: None,
        next_at: now,
        last: String::new(),
        console_searched: None,
        unprobed: false,
        added_while_running: false,
        unhealthy: false,
    }
}

/// Every VM's probe state, keyed by VM, and what its guest agent said
/// where it has no probe.
pub(crate) struct Probes {
    states: parking_lot::Mutex<HashMap<Id, ProbeState>>,
    agents: agent::Agents,
}

impl Probes {
    /// The probes of an engine whose new VMs' guest agents are waited for
    /// `agent_wait` from their boot's start (`None`: none is delivered).
    pub(crate) fn new(agent_wait: Option<Duration>) -> Probes {
        Probes {
            states: parking_lot::Mutex::default(),
            agents: agent::Agents::new(agent_wait),
        }
    }

    /// Probes a running VM whose spec names a probe, when one is due, and
    /// says in its row what the probe says. A VM with no probe, or not
    /// running and ready by its lifecycle, is left as its pass reported it.
    /// Why the VM is to be booted again, when its probe has failed past
    /// its `restart_after` and it has a `record` to boot from (its row then
    /// says nothing of the probe: the boot says it). One with no probe is
    /// asked of its guest agent instead.
    pub(crate) fn probe(
        &self,
        ctx: &Context,
        deadline: Deadline,
        desired: &DesiredVm,
        record: Option<&Record>,
        res: &mut VmResult,
    ) -> Option<String> {
        let vm_id = &desired.spec.vm_id;
        if !up(res) {
            self.states.lock().remove(vm_id);
            self.agents.forget(vm_id);
            return None;
        }
        let has_record = record.is_some();
        let now = ctx.host.now();
        let pid = ctx.backend.pid(vm_id);
        let Some(probe) = &desired.readiness else {
            // Remembered, so a probe added later finds it running.
            let mut all = self.states.lock();
            if all.get(vm_id).is_none_or(|s| !s.unprobed || s.pid != pid) {
                let seen = ProbeState {
                    unprobed: true,
                    ..fresh(pid, now)
                };
                all.insert(vm_id.clone(), seen);
            }
            drop(all);
            let booted = record.and_then(|r| r.lifecycle.boot_started());
            self.agents
                .look(ctx, deadline, (vm_id, pid), (booted, now), res);
            return None;
        };
        let mut state = {
            let mut all = self.states.lock();
            let state = all.entry(vm_id.clone()).or_insert_with(|| fresh(pid, now));
            if state.pid != pid {
                *state = fresh(pid, now);
            } else if state.unprobed {
                *state = ProbeState {
                    added_while_running: true,
                    ..fresh(pid, now)
                };
            }
            state.clone()
        };
        let printed = matches!(probe.check, Check::Serial(_)) && state.answered.is_some();
        if now >= state.next_at && !printed {
            state.next_at = now + probe.period;
            let timeout = deadline
                .remaining()
                .map_or(probe.timeout, |left| probe.timeout.min(left));
            let timeout = timeout.max(Duration::from_millis(1));
            match ask::ask(
                ctx,
                vm_id,
                &probe.check,
                timeout,
                &mut state.console_searched,
            ) {
                Ok(()) => {
                    state.answered = Some(now);
                    state.failing_since = None;
                    state.last = format!("{}{ANSWERED}", probe.check);
                }
                Err(why) => {
                    state.failing_since.get_or_insert(now);
                    state.last = crate::error::chain(&why);
                    if state.answered.is_some() || past(now, state.since, probe.grace) {
                        ctx.counts.unhealthy.inc(vm_id.as_str());
                    }
                }
            }
        }
        say_flip(vm_id, probe, &mut state, now);
        self.states.lock().insert(vm_id.clone(), state.clone());
        if has_record && let Some(why) = restart_due(probe, &state, now) {
            log::warn!("VM {vm_id}: {why}");
            ctx.counts.probe_restarts.inc(vm_id.as_str());
            self.states.lock().remove(vm_id);
            return Some(why);
        }
        say(res, probe, &state, now);
        self.agents.describe(ctx, deadline, (vm_id, pid), now, res);
        None
    }

    /// The row of a VM whose hypervisor was just started, for a publish
    /// before its pass probes it: with a probe in its spec it is not
    /// `ready` until its guest answers, and nothing of this hypervisor has
    /// answered yet.
    /// With none, a guest just created is held back for its guest agent
    /// the same way (within its wait), and a resumed one's agent is asked
    /// now: the boot it goes on with may be one whose agent said it up.
    pub(crate) fn before_first_look(
        &self,
        ctx: &Context,
        desired: &DesiredVm,
        (booted, began): (Option<SystemTime>, Began),
        deadline: Deadline,
        res: &mut VmResult,
    ) {
        let Some(probe) = &desired.readiness else {
            if !up(res) {
                return;
            }
            match began {
                Began::Created(_) => self.agents.hold(ctx, booted, res),
                Began::Resumed => {
                    let vm_id = &desired.spec.vm_id;
                    let at = (booted, ctx.host.now());
                    let pid = ctx.backend.pid(vm_id);
                    self.agents.look(ctx, deadline, (vm_id, pid), at, res);
                }
            }
            return;
        };
        if up(res) {
            let state = fresh(ctx.backend.pid(&desired.spec.vm_id), ctx.host.now());
            say(res, probe, &state, state.since);
        }
    }

    /// Whether the running VM's guest is up as its entry says: its
    /// readiness probe answered its hypervisor, or it has none and its
    /// row is not held for its guest agent. A guest still booting sends
    /// nothing for seconds, and is not idle.
    pub(crate) fn answered(&self, desired: &DesiredVm) -> bool {
        if desired.readiness.is_none() {
            return !self.agents.waiting(&desired.spec.vm_id);
        }
        self.states
            .lock()
            .get(&desired.spec.vm_id)
            .is_some_and(|p| p.answered.is_some())
    }

    /// Whether the VM's probe answers now, for the metrics file; `None`
    /// before it has been asked, or without a probe.
    pub(crate) fn answering(&self, vm_id: &Id) -> Option<bool> {
        self.states
            .lock()
            .get(vm_id)
            .filter(|p| p.answered.is_some() || p.failing_since.is_some())
            .map(|p| p.failing_since.is_none())
    }

    /// The VM is gone: what its probe knew goes with it.
    pub(crate) fn forget(&self, vm_id: &Id) {
        self.states.lock().remove(vm_id);
        self.agents.forget(vm_id);
    }
}

/// Logs the VM turning unhealthy, or answering again after it was.
fn say_flip(vm_id: &Id, probe: &Readiness, state: &mut ProbeState, now: SystemTime) {
    let unhealthy = match (state.answered, state.failing_since) {
        (None, _) => past(now, state.since, probe.grace),
        (Some(_), failing) => failing.is_some(),
    };
    if unhealthy == state.unhealthy {
        return;
    }
    state.unhealthy = unhealthy;
    if unhealthy {
        log::warn!(
            "VM {vm_id}: unhealthy: its probe ({}) fails: {}",
            probe.check,
            state.last
        );
    } else {
        log::info!("VM {vm_id}: healthy again: {}", state.last);
    }
}

/// Why a guest whose probe has failed `restart_after` on end is to be
/// booted again; `None` when it is not due (a guest never ready is given
/// its grace first).
fn restart_due(probe: &Readiness, state: &ProbeState, now: SystemTime) -> Option<String> {
    let (Some(bound), Some(failing)) = (probe.restart_after, state.failing_since) else {
        return None;
    };
    let from = if state.answered.is_some() {
        failing
    } else {
        state.since + probe.grace
    };
    if !past(now, from, bound) {
        return None;
    }
    Some(format!(
        "unhealthy for {} s ({}): booting it again",
        now.duration_since(from).unwrap_or_default().as_secs(),
        state.last
    ))
}

/// Whether the pass reports the VM running and ready by its lifecycle:
/// what a probe may hold back.
fn up(res: &VmResult) -> bool {
    res.row
        .as_ref()
        .is_some_and(|r| r.power == Some(PowerState::Running) && r.phase == Some(Phase::Ready))
}

/// Whether `bound` has passed from `from` at `now`.
fn past(now: SystemTime, from: SystemTime, bound: Duration) -> bool {
    now.duration_since(from).is_ok_and(|d| d >= bound)
}

/// The row as the probe has it: `creating` and waiting before the first
/// answer, `unhealthy: …` past the grace or when failing after one.
fn say(res: &mut VmResult, probe: &Readiness, state: &ProbeState, now: SystemTime) {
    let Some(row) = res.row.as_mut() else {
        return;
    };
    let waited = now
        .duration_since(state.since)
        .unwrap_or_default()
        .as_secs();
    row.readiness = match state.failing_since {
        None if state.answered.is_some() => state.last.clone(),
        None => format!("{}: not asked yet", probe.check),
        Some(failing) => format!(
            "failing for {} s: {}",
            now.duration_since(failing).unwrap_or_default().as_secs(),
            state.last
        ),
    };
    match (state.answered, state.failing_since) {
        (None, _) => {
            // Created and running all along: not ready, never `creating`.
            let added = if state.added_while_running {
                " (a probe added while it ran)"
            } else {
                row.phase = Some(Phase::Creating);
                ""
            };
            row.status_detail = format!(
                "waiting for the guest: {}{added}, {waited} s of {} s",
                probe.check,
                probe.grace.as_secs()
            );
            if past(now, state.since, probe.grace) {
                row.last_error = format!(
                    "{UNHEALTHY}the guest has not answered {} in {} s: {}",
                    probe.check,
                    probe.grace.as_secs(),
                    state.last
                );
            }
        }
        (Some(_), Some(failing)) => {
            let for_s = now.duration_since(failing).unwrap_or_default().as_secs();
            row.last_error = format!("{UNHEALTHY}failing for {for_s} s: {}", state.last);
        }
        (Some(_), None) => {}
    }
}
