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
//! suspend (`suspend.rs`), and listening: the backend holds the VM's NICs
//! open ([`Wake`](crate::provision::Wake)) and this module's one thread
//! polls a copy of each (never reading it) with every other sleeper's.
//! The first frame pokes the VM's worker, whose pass resumes it like any
//! resume (admitted first: a full host keeps it asleep, its row says why,
//! the tick tries again, and the client's retransmits wait meanwhile) on
//! the same NICs, where the frame waits for its restored VMM.
//!
//! The same thread samples the frame counters of each running VM with an
//! idle time, once a second, and pokes its worker once they have not
//! moved for that long. The frames its guest sent count: every
//! conversation makes a guest answer, while what the bridge floods to
//! every port would keep it awake for ever. A connection that is open and
//! silent is no reason to stay awake (its next segment wakes the guest,
//! whose TCP state slept with it); one that keeps alive is.
//!
//! Only what is for the guest wakes it: while it sleeps, its underlay tap
//! is passed frames to its MAC and ARP for its address, and nothing the
//! bridge floods (see `Underlay::sleep`). A second NIC's tap is held too
//! (what arrives waits for the guest) but not polled: a site's network
//! is the site's, and its chatter would wake it for nothing.
//!
//! Who woke it is seen on a packet socket on its tap that sees only the
//! heads of IPv4 and ARP frames sent to the guest: the first one with
//! ports is reported (an ARP before it too, when a sender on the bridge
//! asked for the guest first).

use std::borrow::Cow;

use super::lifecycle::{self, State};
use super::pass::{Core, Pass};
use crate::model::{DesiredVm, Id, Phase, PowerState};
use crate::state::Record;

impl Core {
    /// What this pass drives the VM to, its sleep taken into account (see
    /// the module's rules); the record's sleep flags set to match, and
    /// saved when they changed.
    pub(crate) fn with_sleep<'d>(
        &self,
        d: &'d DesiredVm,
        rec: Option<&mut Record>,
        pass: &mut Pass<'_>,
    ) -> Cow<'d, DesiredVm> {
        let Some(rec) = rec else {
            return Cow::Borrowed(d);
        };
        let was = (rec.asleep, rec.woken);
        let power = self.sleep_power(d, rec);
        let waking = power == Some(PowerState::Running)
            && lifecycle::state(rec, self.budget()) == State::Suspended
            && self.sleepers.woken_at(&d.spec.vm_id).is_some();
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
            self.save_best_effort(rec);
            crate::crash::point("sleep.flags-saved");
        }
        match power {
            Some(power) if power != d.power => Cow::Owned(DesiredVm { power, ..d.clone() }),
            _ => Cow::Borrowed(d),
        }
    }

    fn sleep_power(&self, d: &DesiredVm, rec: &mut Record) -> Option<PowerState> {
        let vm_id = &d.spec.vm_id;
        let sleepers = &self.sleepers;
        if !d.sleep.wake_on_traffic || d.power == PowerState::Stopped {
            rec.asleep = false;
            rec.woken = false;
            self.quit_listening(vm_id);
            return None;
        }
        if d.power == PowerState::Running {
            rec.woken = false;
        }
        let state = lifecycle::state(rec, self.budget());
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
        let running = state == State::Up && self.prov.running(vm_id) && self.answered(d);
        match limit {
            Some(limit) if running => {
                sleepers.watch_quiet(vm_id, limit);
                if sleepers.quiet_for(vm_id).is_some_and(|q| q >= limit) {
                    log::info!(
                        "VM {vm_id}: its guest sent nothing for {} s: suspending it until traffic wakes it",
                        limit.as_secs()
                    );
                    self.counts.idle_suspends.inc();
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
    /// `Sleepers::stretched`); `None`: it never sleeps for idleness.
    fn idle_limit(&self, d: &DesiredVm, rec: &Record) -> Option<std::time::Duration> {
        let base = d.sleep.idle_limit(d.power, rec.woken)?;
        Some(self.sleepers.stretched(&d.spec.vm_id, base))
    }

    /// Whether the running VM's guest is up as its entry says: its
    /// readiness probe answered its hypervisor, or it has none. A guest
    /// still booting sends nothing for seconds, and is not idle.
    fn answered(&self, d: &DesiredVm) -> bool {
        d.readiness.is_none()
            || self
                .probes
                .lock()
                .get(&d.spec.vm_id)
                .is_some_and(|p| p.answered.is_some())
    }

    fn quit_listening(&self, vm_id: &Id) {
        if self.sleepers.is_listening(vm_id) {
            self.sleepers.quit(vm_id);
        }
        if let Some(waker) = self.prov.waker() {
            waker.stop_listening(vm_id);
        }
    }

    /// After the lifecycle's pass: a VM that sleeps now listens for its
    /// first frame, and one a frame woke says how soon it ran; its row
    /// says both.
    pub(crate) fn after_sleep(&self, d: &DesiredVm, pass: &mut Pass<'_>) {
        let vm_id = &d.spec.vm_id;
        let woke_at = self.sleepers.take_woken(vm_id);
        if !d.sleep.wake_on_traffic {
            return;
        }
        let rec = match self.store.get(vm_id) {
            Ok(Some(rec)) => rec,
            _ => return,
        };
        let suspended = lifecycle::state(&rec, self.budget()) == State::Suspended;
        let running = !suspended && self.prov.running(vm_id);
        if let Some(at) = woke_at {
            if running {
                let took = at.elapsed();
                self.counts.wakes.observe(took);
                self.sleepers.ran(vm_id, took);
                if let Some(base) = d.sleep.idle_limit(d.power, rec.woken)
                    && self.sleepers.woke(vm_id, base)
                {
                    self.counts.wake_loops.inc();
                    log::info!(
                        "VM {vm_id}: woken again before it slept its idle time ({} s); it stays awake {} s idle before it sleeps again",
                        base.as_secs(),
                        self.sleepers.stretched(vm_id, base).as_secs()
                    );
                }
                log::info!(
                    "VM {vm_id}: woken by traffic; its guest ran {} ms after the first frame",
                    took.as_millis()
                );
            } else if suspended {
                // Not resumed (no room on the host yet): still woken, for
                // the tick to try again; the frame waits on its NIC.
                self.sleepers.rewake(vm_id, at);
            }
        }
        // Its idle watch from now: no pass may come before its idle time
        // is up (a daemon's tick can be an hour).
        if running
            && self.answered(d)
            && let Some(limit) = self.idle_limit(d, &rec)
        {
            self.sleepers.watch_quiet(vm_id, limit);
        }
        let mut listening = self.sleepers.is_listening(vm_id);
        if suspended && wants_sleep(d, &rec) && !listening && woke_at.is_none() {
            listening = self.listen(d, pass);
        }
        if let Some(row) = pass.res.row.as_mut() {
            row.asleep = suspended && listening;
            row.last_wake = self.sleepers.last_wake(vm_id);
        }
    }

    /// Holds the sleeping VM's NICs and polls them; its row says why not
    /// when it cannot.
    fn listen(&self, d: &DesiredVm, pass: &mut Pass<'_>) -> bool {
        let vm_id = &d.spec.vm_id;
        let Some(waker) = self.prov.waker() else {
            if let Some(row) = pass.res.row.as_mut() {
                row.last_error =
                    "wake_on_traffic: this host's hypervisor cannot wake a VM on traffic".into();
            }
            return false;
        };
        match waker.listen(&d.spec) {
            Ok(listening) => {
                self.sleepers.listen(vm_id, listening);
                crate::crash::point("wake.listening");
                log::info!("VM {vm_id}: asleep; its next frame wakes it");
                true
            }
            Err(e) => {
                let why = crate::error::chain(&*e);
                self.logs.warn(
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
