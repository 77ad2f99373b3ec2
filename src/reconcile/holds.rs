//! What a VM is held to beyond its lifecycle, as a pass records and says
//! it: its own egress rules (recorded before they are held, and a VM never
//! started where they cannot be), its published ports, its limits and size
//! (a change waits for its next boot, and its row says so, as it says what
//! a created VM keeps for good), whether its network is served, and its
//! probe's answer, in its row and for the metrics file.
//!
//! The backend's [`Holds`] capability is taken once a pass
//! ([`Holding::of`]); a backend without it holds nothing, takes an open
//! egress and no published port, and refuses any other as what the host
//! lacks.

use super::context::Context;
use super::counts::Held;
use super::pass::VmResult;
use crate::error::{Failure, Outcome, Simple};
use crate::model::{DesiredVm, Egress, Id, Phase, PowerState, Publish, VmSpec};
use crate::provision::Holds;
use crate::state::Record;

/// The row of a VM not started because its egress rules cannot be held
/// here.
pub(crate) fn refuse_unfenced(
    ctx: &Context,
    vm_id: &Id,
    e: &dyn Failure,
    rec: Option<&Record>,
    res: &mut VmResult,
) {
    let why = format!(
        "its own egress rules cannot be held on this host, so it is not started: {}",
        crate::error::chain(e)
    );
    ctx.logs
        .warn(&format!("{vm_id}/egress"), &format!("VM {vm_id}: {why}"));
    match rec {
        Some(rec) => ctx.report_recorded(res, rec, PowerState::Stopped),
        None => *res = VmResult::queued(vm_id),
    }
    if let Some(row) = res.row.as_mut() {
        row.status_detail = "waiting for the host".into();
        row.last_error = why;
    }
}

/// Records the VM's own egress rules when they change, before they are
/// held: an agent's start holds the recorded ones again for a running VM
/// before any pass (a save that fails is retried next pass).
pub(crate) fn note_egress(ctx: &Context, desired: &DesiredVm, mut rec: Record) -> Record {
    if rec.egress != desired.egress {
        rec.egress = desired.egress.clone();
        ctx.save_best_effort(&rec);
    }
    rec
}

/// Takes what a created VM takes from a changed spec at its next boot from
/// cold (call it while no VMM runs for it): its limits, vCPUs and memory,
/// the VMM's command line and cgroups. They are recorded before the boot,
/// so the record says what it runs with. A size the host's caps have no
/// room for is not taken: the VM boots as it was, and its row says why.
pub(crate) fn take_next_boot_changes(ctx: &Context, desired: &DesiredVm, rec: &mut Record) {
    let mut next = at_next_boot(&rec.spec, &desired.spec);
    if resized(&rec.spec, &next)
        && let Err(why) = ctx.ledger.admit(&next)
    {
        let vm_id = &rec.spec.vm_id;
        ctx.logs.warn(
            &format!("{vm_id}/resize"),
            &format!("VM {vm_id}: keeps {} at its boot: {why}", size(&rec.spec)),
        );
        (next.vcpus, next.mem_mb) = (rec.spec.vcpus, rec.spec.mem_mb);
    }
    if next != rec.spec {
        rec.spec = next;
        ctx.save_best_effort(rec);
    }
}

/// One pass's view of what the host holds for its VMs: the context, and
/// the backend's [`Holds`], asked once.
pub(crate) struct Holding<'a> {
    ctx: &'a Context,
    holds: Option<&'a dyn Holds>,
}

impl<'a> Holding<'a> {
    pub(crate) fn of(ctx: &'a Context) -> Holding<'a> {
        Holding {
            ctx,
            holds: ctx.backend.holds(),
        }
    }

    /// Holds `egress` as the VM's own rules (see [`Holds::set_egress`]).
    /// An open egress needs no holding; any other is refused, as a host
    /// condition, by a backend that cannot hold it.
    pub(crate) fn set_egress(&self, vm_id: &Id, egress: &Egress) -> Outcome {
        match self.holds {
            Some(h) => h.set_egress(vm_id, egress),
            None if egress.is_open() => Ok(()),
            None => Err(Simple::host(
                "this host's hypervisor backend cannot hold a VM's own egress rules",
            )
            .into()),
        }
    }

    /// A running VM whose network is not served (adopted while it could
    /// not be plugged, or its tap gone) is not ready, whatever its guest
    /// says: it cannot be reached. Its row says why; serving it is tried
    /// again at its every pass. A backend that holds nothing serves no
    /// network to lose.
    pub(crate) fn say_unserved(&self, vm_id: &Id, res: &mut VmResult) {
        let Some(row) = res.row.as_mut() else {
            return;
        };
        if row.power != Some(PowerState::Running) {
            return;
        }
        let served = self.holds.map_or(Ok(()), |h| h.network_served(vm_id));
        let subject = format!("{vm_id}/unserved");
        if let Err(e) = served {
            let why = crate::error::chain(&*e as &dyn std::error::Error);
            self.ctx.logs.warn(
                &subject,
                &format!("VM {vm_id}: its network is not served: {why}"),
            );
            row.phase = Some(Phase::Failed);
            row.last_error = format!("its network is not served: {why}");
        } else {
            self.ctx.logs.clear(&subject);
        }
    }

    /// What the VM is held to, in its row and for the metrics file: its
    /// egress rules (and why a change of them is not held, when it is
    /// not), its limits (and that a change waits for the next boot), and
    /// whether its probe answers (`answering`, see [`Held::answering`]).
    pub(crate) fn say_what_it_is_held_to(
        &self,
        desired: &DesiredVm,
        egress_held: Outcome,
        answering: Option<bool>,
        res: &mut VmResult,
    ) {
        let ctx = self.ctx;
        let vm_id = &desired.spec.vm_id;
        let mut holds = Held {
            answering,
            ..Held::default()
        };
        if let Some(egress) = self.holds.and_then(|h| h.egress_in_force(vm_id)) {
            (holds.deny, holds.allow) = (egress.deny.len(), egress.allow.len());
            if let Some(row) = res.row.as_mut() {
                row.egress = egress.to_string();
            }
        }
        if let Some(row) = res.row.as_mut()
            && let Ok(Some(now)) = ctx.store.get(vm_id)
        {
            if let Some(limits) = self.holds.and_then(|h| h.limits_in_force(&now.spec)) {
                row.limits = limits.to_string();
                holds.limits = Some(limits);
            }
            let said = [
                self.what_waits_for_boot(&now.spec, &desired.spec),
                kept_from_create(&now.spec, &desired.spec),
            ];
            for what in said.into_iter().flatten() {
                row.status_detail = if row.status_detail.is_empty() {
                    what
                } else {
                    format!("{}; {what}", row.status_detail)
                };
            }
        }
        ctx.counts.held.lock().insert(vm_id.to_string(), holds);
        if let Err(e) = egress_held {
            let why = format!(
                "its own egress rules are not held: {}",
                crate::error::chain(&*e)
            );
            ctx.logs
                .warn(&format!("{vm_id}/egress"), &format!("VM {vm_id}: {why}"));
            if let Some(row) = res.row.as_mut() {
                row.last_error = if row.last_error.is_empty() {
                    why
                } else {
                    format!("{}; {why}", row.last_error)
                };
            }
        }
    }

    /// Holds the VM's published ports as its entry says, once it has a
    /// record `saved` (after its lifecycle's step: a create's record comes
    /// first, and a VM that never had one holds nothing a destroy would not
    /// give back), and records what is held when that changed: an agent's
    /// start holds the recorded ones again before any pass. A port refused
    /// stays refused to this VM only; it runs whatever its ports. What is
    /// held, and the refusals. No port to publish needs holding; any is
    /// refused, as a host condition, by a backend that cannot hold it.
    pub(crate) fn publish(
        &self,
        desired: &DesiredVm,
        saved: Option<&Record>,
    ) -> (Vec<Publish>, Outcome) {
        let vm_id = &desired.spec.vm_id;
        let Some(rec) = saved else {
            return (Vec::new(), Ok(()));
        };
        let wanted = &desired.published;
        let (result, held) = match self.holds {
            Some(h) => {
                let (within, short, claim) = self.within_budget(wanted, &h.published(vm_id));
                let result = h.set_published(vm_id, &within);
                // Its sockets are open now: counted by the kernel.
                drop(claim);
                (short.map_or(result, Err), h.published(vm_id))
            }
            None if wanted.is_empty() => (Ok(()), Vec::new()),
            None => (
                Err(
                    Simple::host("this host's hypervisor backend cannot publish a VM's ports")
                        .into(),
                ),
                Vec::new(),
            ),
        };
        if rec.published != held {
            let mut rec = rec.clone();
            rec.published.clone_from(&held);
            self.ctx.save_best_effort(&rec);
        }
        (held, result)
    }

    /// Of `wanted`, what the agent's descriptor budget lets the VM hold:
    /// everything when the ports it does not hold yet fit (each holds a
    /// socket), else only what it holds already, and the shortage as a
    /// host condition (the ports wait; the VM runs on). The claim is held
    /// until the sockets are open.
    fn within_budget(
        &self,
        wanted: &[Publish],
        held: &[Publish],
    ) -> (
        Vec<Publish>,
        Option<crate::error::BoxFailure>,
        Option<super::admission::FdClaim<'a>>,
    ) {
        let holds = |p: &Publish| held.iter().any(|h| h.host_side() == p.host_side());
        let new = wanted.iter().filter(|p| !holds(p)).count() as u64;
        if new == 0 {
            return (wanted.to_vec(), None, None);
        }
        match self.ctx.ledger.descriptors(new) {
            Ok(claim) => (wanted.to_vec(), None, Some(claim)),
            Err(short) => (
                wanted.iter().filter(|p| holds(p)).copied().collect(),
                Some(
                    Simple::host(format!(
                        "{new} published port(s) wait for file descriptors: {short}"
                    ))
                    .into(),
                ),
                None,
            ),
        }
    }

    /// The ports held for the VM in its row, and why the others its entry
    /// asks for are not.
    pub(crate) fn say_published(
        &self,
        vm_id: &Id,
        (held, published): (Vec<Publish>, Outcome),
        res: &mut VmResult,
    ) {
        let Some(row) = res.row.as_mut() else {
            return;
        };
        row.published = held;
        if let Err(e) = published {
            let why = crate::error::chain(&*e);
            self.ctx
                .logs
                .warn(&format!("{vm_id}/publish"), &format!("VM {vm_id}: {why}"));
            row.last_error = if row.last_error.is_empty() {
                why
            } else {
                format!("{}; {why}", row.last_error)
            };
        }
    }

    /// What of `desired` the VM recorded as `now` does not run with yet,
    /// and when it will: at its next boot, or once the host has room.
    fn what_waits_for_boot(&self, now: &VmSpec, desired: &VmSpec) -> Option<String> {
        let next = at_next_boot(now, desired);
        let no_room = resized(now, &next)
            .then(|| self.ctx.ledger.fits(&next).err())
            .flatten();
        let mut waiting = Vec::new();
        if next.limits != now.limits {
            waiting.push("limits");
        }
        if no_room.is_none() && next.vcpus != now.vcpus {
            waiting.push("vCPUs");
        }
        if no_room.is_none() && next.mem_mb != now.mem_mb {
            waiting.push("memory");
        }
        let mut said = Vec::new();
        if !waiting.is_empty() && self.ctx.backend.running(&now.vm_id) {
            said.push(format!(
                "{} change at the next boot (stop and start it to apply them now)",
                listed(&waiting)
            ));
        }
        if let Some(why) = no_room {
            said.push(format!("{} wait for room: {why}", size(&next)));
        }
        (!said.is_empty()).then(|| said.join("; "))
    }
}
/// `now` with what a boot from cold takes of `desired`.
fn at_next_boot(now: &VmSpec, desired: &VmSpec) -> VmSpec {
    VmSpec {
        limits: desired.limits,
        vcpus: desired.vcpus,
        mem_mb: desired.mem_mb,
        ..now.clone()
    }
}

fn resized(now: &VmSpec, next: &VmSpec) -> bool {
    (now.vcpus, now.mem_mb) != (next.vcpus, next.mem_mb)
}

fn size(spec: &VmSpec) -> String {
    format!("{} vCPUs and {} MB", spec.vcpus, spec.mem_mb)
}

/// What a created VM keeps from its create however desired state changes
/// it, when desired state asks for other: its root disk, seed and NICs are
/// made once, and its volumes are attached as they were.
fn kept_from_create(now: &VmSpec, desired: &VmSpec) -> Option<String> {
    let fields = [
        ("name", now.name != desired.name),
        (
            "image",
            (&now.image_url, &now.image_sha256) != (&desired.image_url, &desired.image_sha256),
        ),
        ("disk_gb", now.disk_gb != desired.disk_gb),
        ("cloud_init", now.cloud_init != desired.cloud_init),
        (
            "ssh_authorized_key",
            now.ssh_authorized_key != desired.ssh_authorized_key,
        ),
        ("network", now.network != desired.network),
        ("volume_ids", now.volume_ids != desired.volume_ids),
    ];
    let changed: Vec<&str> = fields
        .iter()
        .filter(|(_, changed)| *changed)
        .map(|(name, _)| *name)
        .collect();
    (!changed.is_empty()).then(|| {
        format!(
            "keeps its {} from its create (destroy and create it to change them)",
            listed(&changed)
        )
    })
}

/// "a", "a and b", "a, b and c".
fn listed(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => (*one).to_owned(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}
