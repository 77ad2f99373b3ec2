//! Scale to zero: a suspended VM woken by the first frame for its guest,
//! and a running one suspended when its NICs fall quiet.
//!
//! What a pass drives a VM with `wake_on_traffic` to (the entry's power
//! is level-triggered, as ever; this is what satisfies it):
//! - **wanted running**: running; or asleep (suspended by the agent for
//!   idleness, its record says so) until a frame for it arrives. Idle
//!   for its `idle_suspend_after_s`, it is suspended and sleeps.
//! - **wanted suspended**: asleep; once a frame wakes it, running
//!   (`woken` in its record) until it is idle for its idle time (or
//!   [`Sleep::AWAKE_IDLE`](crate::model::Sleep::AWAKE_IDLE)), then asleep again.
//! - **wanted stopped**, or its wake turned off: as without it (an idle
//!   sleeper wanted running is resumed).
//!
//! Asleep is suspended, through the same crash-proof steps as any
//! suspend (`suspension.rs`), and listening: the backend holds the VM's
//! NICs open ([`Wake`](crate::provision::Wake)) and this module's one
//! thread (`watch.rs`) polls a copy of each (never reading it) with every
//! other sleeper's.
//! The first frame pokes the VM's worker, whose pass resumes it like any
//! resume (admitted first: a full host keeps it asleep, its row says why,
//! the tick tries again, and the client's retransmits wait meanwhile) on
//! the same NICs, where the frame waits for its restored VMM.
//!
//! The same thread samples the frame counters of each running VM with an
//! idle time, once a second, and pokes its worker once they have not
//! moved for that long. The frames its guest sent of its own accord
//! count: every conversation makes a guest answer, while what the bridge
//! floods to every port would keep it awake for ever, and so would what
//! its stack says for itself (ARP, IPv6 neighbour discovery: the backend
//! leaves those out, see [`Wake::frames`](crate::provision::Wake::frames)).
//! The frames it sent while the
//! agent's own readiness probe was open to it (a TCP or HTTP check: the
//! guest's SYN-ACK, its answer) do not: they are the agent's traffic, and
//! a probe every period would keep a guest awake for ever. The probe ends
//! its connection with a reset, so the guest sends nothing for it after. A connection that is open and
//! silent is no reason to stay awake (its next segment wakes the guest,
//! whose TCP state slept with it); one that keeps alive is.
//!
//! Only what is for the guest wakes it: while it sleeps, its underlay tap
//! is passed frames to its MAC and ARP for its address, and nothing the
//! bridge floods (see `Underlay::sleep`). A second NIC's tap is held too
//! (what arrives waits for the guest) but not polled: a site's network
//! is the site's, and its chatter would wake it for nothing.
//!
//! Who woke it is told by the backend's witness of the frames sent to the
//! guest ([`Witness`](crate::provision::Witness)): the first one with
//! ports is reported (an ARP before it too, when a sender on the bridge
//! asked for the guest first). The engine reads no frame itself.

use std::borrow::Cow;
use std::sync::Arc;

use super::context::Context;
use super::lifecycle::{self, State};
use super::pass::Pass;
use crate::model::{DesiredVm, Id, Phase, PowerState};
use crate::provision::Lifecycle;
use crate::state::Record;

mod watch;

pub(crate) use watch::Poke;
use watch::Watch;

/// An exchange of the agent's own with a guest, open (see
/// [`Sleepers::own_exchange`]).
pub(crate) struct OwnExchange<'s> {
    watch: &'s Watch,
    vm_id: &'s Id,
}

impl Drop for OwnExchange<'_> {
    fn drop(&mut self) {
        self.watch.own_closed(self.vm_id);
    }
}

/// The sleepers' rules and their watch (its one thread), with the
/// backend's [`Wake`](crate::provision::Wake) asked of when they need it.
pub(crate) struct Sleepers {
    watch: Watch,
    backend: Arc<dyn Lifecycle>,
}

impl Sleepers {
    /// `poke` runs a pass of a VM now: a woken one, or one quiet for its
    /// idle time.
    pub(crate) fn new(backend: Arc<dyn Lifecycle>, poke: Poke) -> Sleepers {
        Sleepers {
            watch: Watch::new(Arc::clone(&backend), poke),
            backend,
        }
    }

    /// Everything about the VM, gone with it.
    pub(crate) fn forget(&self, vm_id: &Id) {
        self.watch.forget(vm_id);
    }

    /// The agent's own exchange with the VM's guest (its readiness probe
    /// over the network), open until the value is dropped: what the guest
    /// sends meanwhile (the probe's answer) is not the traffic that keeps
    /// it awake.
    pub(crate) fn own_exchange<'s>(&'s self, vm_id: &'s Id) -> OwnExchange<'s> {
        self.watch.own_opened(vm_id);
        OwnExchange {
            watch: &self.watch,
            vm_id,
        }
    }

    /// What this pass drives the VM to, its sleep taken into account (see
    /// the module's rules); the record's sleep flags set to match, and
    /// saved when they changed. `answered`: whether its guest is up as its
    /// entry says (see [`Probes::answered`](super::probes::Probes::answered)).
    pub(crate) fn rules<'d>(
        &self,
        ctx: &Context,
        d: &'d DesiredVm,
        rec: Option<&mut Record>,
        answered: bool,
        pass: &mut Pass<'_>,
    ) -> Cow<'d, DesiredVm> {
        let Some(rec) = rec else {
            return Cow::Borrowed(d);
        };
        let was = (rec.asleep, rec.woken);
        let state = lifecycle::state(rec, ctx.budget());
        let power = self.sleep_power(ctx, d, rec, state, answered);
        let waking = power == Some(PowerState::Running)
            && state == State::Suspended
            && self.watch.woken_at(&d.spec.vm_id).is_some();
        if waking {
            pass.narrator(rec, PowerState::Suspended, Phase::Ready)
                .say("waking: traffic arrived for it");
        }
        // A wake's flags ride on its resume's own save, made beside the
        // restore: one durable write fewer before the guest runs. A crash
        // before that save forgets the wake, not the sleep: the record
        // still says asleep, the next agent listens again, and the
        // client's retransmit wakes the VM as the first frame did.
        if (rec.asleep, rec.woken) != was && !waking {
            ctx.save_best_effort(rec);
            crate::crash::point("sleep.flags-saved");
        }
        match power {
            Some(power) if power != d.power => Cow::Owned(DesiredVm { power, ..d.clone() }),
            _ => Cow::Borrowed(d),
        }
    }

    fn sleep_power(
        &self,
        ctx: &Context,
        d: &DesiredVm,
        rec: &mut Record,
        state: State,
        answered: bool,
    ) -> Option<PowerState> {
        let vm_id = &d.spec.vm_id;
        let sleepers = &self.watch;
        if !d.sleep.wake_on_traffic || d.power == PowerState::Stopped {
            rec.asleep = false;
            rec.woken = false;
            self.quit_listening(vm_id);
            return None;
        }
        if d.power == PowerState::Running {
            rec.woken = false;
        }
        let sleeping = matches!(state, State::Suspended | State::Suspending);
        if !sleeping {
            rec.asleep = false;
        }
        if wants_sleep(d, rec) {
            sleepers.unwatch_quiet(vm_id);
            if state == State::Suspended
                && let Some(at) = sleepers.woken_at(vm_id)
            {
                log::debug!(
                    "VM {vm_id}: woken {} ms ago; resuming it",
                    at.elapsed().as_millis()
                );
                rec.woken = d.power == PowerState::Suspended;
                rec.asleep = false;
                return Some(PowerState::Running);
            }
            return Some(PowerState::Suspended);
        }
        // Wanted running, or awake by a wake: quiet for its idle time, it
        // sleeps.
        let limit = self.idle_limit(d, rec);
        let running = state == State::Up && self.backend.running(vm_id) && answered;
        match limit {
            Some(limit) if running => {
                sleepers.watch_quiet(vm_id, limit);
                if sleepers.quiet_for(vm_id).is_some_and(|q| q >= limit) {
                    log::info!(
                        "VM {vm_id}: its guest sent nothing for {} s: suspending it until traffic wakes it",
                        limit.as_secs()
                    );
                    ctx.counts.idle_suspends.inc();
                    sleepers.unwatch_quiet(vm_id);
                    sleepers.slept(vm_id);
                    rec.asleep = d.power == PowerState::Running;
                    rec.woken = false;
                    return Some(PowerState::Suspended);
                }
            }
            _ => sleepers.unwatch_quiet(vm_id),
        }
        Some(PowerState::Running)
    }

    /// How long the running VM may be idle before it sleeps: its entry's
    /// idle time, stretched while it wakes and sleeps in a loop (see
    /// `Watch::stretched`); `None`: it never sleeps for idleness.
    fn idle_limit(&self, d: &DesiredVm, rec: &Record) -> Option<std::time::Duration> {
        let base = d.sleep.idle_limit(d.power, rec.woken)?;
        Some(self.watch.stretched(&d.spec.vm_id, base))
    }

    fn quit_listening(&self, vm_id: &Id) {
        if self.watch.is_listening(vm_id) {
            self.watch.quit(vm_id);
        }
        if let Some(waker) = self.backend.waker() {
            waker.stop_listening(vm_id);
        }
    }

    /// After the lifecycle's pass: a VM that sleeps now listens for its
    /// first frame, and one a frame woke says how soon it ran; its row
    /// says both. `saved` is its record as the lifecycle left it, in
    /// `state`.
    pub(crate) fn after(
        &self,
        ctx: &Context,
        d: &DesiredVm,
        saved: Option<&Record>,
        state: Option<State>,
        answered: bool,
        pass: &mut Pass<'_>,
    ) {
        let vm_id = &d.spec.vm_id;
        let woke_at = self.watch.take_woken(vm_id);
        if !d.sleep.wake_on_traffic {
            return;
        }
        let Some(rec) = saved else {
            return;
        };
        let suspended = state == Some(State::Suspended);
        let running = !suspended && self.backend.running(vm_id);
        let sleepers = &self.watch;
        if let Some(at) = woke_at {
            if running {
                let took = at.elapsed();
                ctx.counts.wakes.observe(took);
                sleepers.ran(vm_id, took);
                if let Some(base) = d.sleep.idle_limit(d.power, rec.woken)
                    && sleepers.woke(vm_id, base)
                {
                    ctx.counts.wake_loops.inc();
                    log::info!(
                        "VM {vm_id}: woken again before it slept its idle time ({} s); it stays awake {} s idle before it sleeps again",
                        base.as_secs(),
                        sleepers.stretched(vm_id, base).as_secs()
                    );
                }
                log::info!(
                    "VM {vm_id}: woken by traffic; its guest ran {} ms after the first frame",
                    took.as_millis()
                );
            } else if suspended {
                // Not resumed (no room on the host yet): still woken, for
                // the tick to try again; the frame waits on its NIC.
                sleepers.rewake(vm_id, at);
            }
        }
        // Its idle watch from now: no pass may come before its idle time
        // is up (a daemon's tick can be an hour).
        if running
            && answered
            && let Some(limit) = self.idle_limit(d, rec)
        {
            sleepers.watch_quiet(vm_id, limit);
        }
        let mut listening = sleepers.is_listening(vm_id);
        if suspended && wants_sleep(d, rec) && !listening && woke_at.is_none() {
            listening = self.listen(ctx, d, pass);
        }
        if let Some(row) = pass.res.row.as_mut() {
            row.asleep = suspended && listening;
            row.last_wake = sleepers.last_wake(vm_id);
        }
    }

    /// Holds the sleeping VM's NICs and polls them; its row says why not
    /// when it cannot.
    fn listen(&self, ctx: &Context, d: &DesiredVm, pass: &mut Pass<'_>) -> bool {
        let vm_id = &d.spec.vm_id;
        let Some(waker) = self.backend.waker() else {
            if let Some(row) = pass.res.row.as_mut() {
                row.last_error =
                    "wake_on_traffic: this host's hypervisor cannot wake a VM on traffic".into();
            }
            return false;
        };
        match waker.listen(&d.spec) {
            Ok(listening) => {
                self.watch.listen(vm_id, listening);
                crate::crash::point("wake.listening");
                log::info!("VM {vm_id}: asleep; its next frame wakes it");
                true
            }
            Err(e) => {
                let why = crate::error::chain(&*e);
                ctx.logs.warn(
                    &format!("{vm_id}/listen"),
                    &format!("VM {vm_id}: cannot listen for traffic to wake it: {why}"),
                );
                if let Some(row) = pass.res.row.as_mut() {
                    row.last_error = format!("cannot wake on traffic: {why}");
                }
                false
            }
        }
    }
}

/// Whether the VM is to sleep now: suspended by the agent for idleness
/// (while wanted running), or wanted suspended and not woken since.
fn wants_sleep(d: &DesiredVm, rec: &Record) -> bool {
    rec.asleep || (d.power == PowerState::Suspended && !rec.woken)
}
