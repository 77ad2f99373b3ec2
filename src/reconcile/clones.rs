//! Clones: the create verb's other road. A VM whose spec names a template
//! is made from that template's snapshot (its disk and memory copied by the
//! backend, then restored) instead of from an image and a boot, and is made
//! a machine of its own through its guest agent before its row may say it
//! is ready.
//!
//! Before an attempt is counted, the template must be a VM of this host
//! that is suspended with a usable snapshot, or running with a usable save
//! (`templates`); a template on its way there
//! (wanted but not yet recorded, being created, booting, suspending) is
//! waited for without spending the clone's budget, and one that is gone
//! fails the clone for good.
//!
//! After the restore, in order, each answer checked against what was
//! asked (a guest agent that says it did something else has not done it):
//! 1. **Reseed**: fresh entropy from the host credited and the generator
//!    reseeded, and the clock set: first, since what the identity starts
//!    (sshd again, a DHCP client) draws from the generator.
//! 2. **Identity**: its hostname, its own ssh host key (and certificate,
//!    where the control plane gave one), its authorized keys written whole
//!    (cleared when it has none: never its template's), and each NIC given
//!    the clone's MAC. Until then the bridge's guard drops every frame the
//!    guest sends from its template's MAC; its guest agent waits for each
//!    moved NIC's new lease (its new MAC has its own address), and for
//!    sshd to listen again with its new key, side by side, taking its
//!    guest's status meanwhile: the clone's row is ready by it in the same
//!    pass (see `probes::agent`), without a second exchange.
//!
//! Any failure stops its hypervisor and fails the attempt: a guest that is
//! still its template's copy never runs on as this VM.

use std::time::{Duration, Instant};

use super::context::Context;
use super::guests::{self, Whole};
use super::lifecycle::{self, State};
use crate::deadline::Deadline;
use crate::guest::Said;
use crate::model::{Id, Mac};
use crate::pb::guest::{Identity, NicMac, request};
use crate::provision::{Lifecycle, SavedGuest};

/// How long a clone's guest agent is given to apply its identity: an sshd
/// reload is waited for where one is needed (5 s at most in
/// `eitri-guest`), and each moved NIC's new lease (3 s at most).
const IDENTITY_WITHIN: Duration = Duration::from_secs(10);

/// Where a clone's template stands.
pub(super) enum Template {
    /// Suspended, its snapshot usable: the clone can be made now.
    Ready,
    /// Not yet: the row says what it waits for.
    NotYet(String),
    /// It will not be: the clone's create fails for good, saying why.
    Gone(String),
}

/// Where `template` stands, for a clone of it; `wanted`: the clone's
/// snapshot wants it, as a template.
pub(super) fn template(ctx: &Context, template: &Id, wanted: bool) -> Template {
    let rec = match ctx.store.get(template) {
        Ok(Some(rec)) => rec,
        // Wanted in the same delivery, its worker has not yet saved its
        // first record: each VM's pass runs on its own thread.
        Ok(None) if wanted => {
            return Template::NotYet(format!("its template {template} to be created"));
        }
        Ok(None) => {
            return Template::Gone(format!(
                "its template {template} is no VM of this host: add it to the desired state (template: true, power_state \"suspended\"), or clone another"
            ));
        }
        Err(e) => {
            return Template::NotYet(format!(
                "its template {template}, whose record cannot be read: {}",
                crate::error::chain(&e)
            ));
        }
    };
    let suspender = ctx.backend.suspender();
    match lifecycle::state(&rec, ctx.budget()) {
        State::Suspended => {}
        // A running template: its clones are made from its save.
        State::Up => {
            return match suspender.and_then(|s| s.template_saved(template)) {
                Some(SavedGuest::Usable(_)) => Template::Ready,
                _ => Template::NotYet(format!(
                    "its template {template} to be saved (suspended, or running as a template once it is ready)"
                )),
            };
        }
        State::Quarantined { .. } => {
            return Template::Gone(format!(
                "its template {template} is gone from the desired state (quarantined)"
            ));
        }
        State::Creating(lifecycle::Attempts::Permanent) => {
            return Template::Gone(format!(
                "its template {template} failed to be created: {}",
                rec.lifecycle.last_error()
            ));
        }
        _ => {
            return Template::NotYet(format!(
                "its template {template} to be suspended (a clone is made from its snapshot)"
            ));
        }
    }
    match suspender.and_then(|s| s.suspension(template)) {
        Some(SavedGuest::Usable(_)) => Template::Ready,
        Some(SavedGuest::Unusable(why)) => Template::NotYet(format!(
            "its template {template} to be saved again (its snapshot cannot be used: {why})"
        )),
        None => Template::NotYet(format!("its template {template} to be saved")),
    }
}

/// What makes a clone a machine of its own.
pub(super) struct Own {
    pub hostname: String,
    /// Its host key (OpenSSH PEM) and the public line it presents.
    pub host_key_pem: String,
    pub host_key_public: String,
    pub host_certificate: String,
    pub authorized_keys: Vec<String>,
    /// Each NIC's MAC: its template's, and its own.
    pub nics: Vec<(Mac, Mac)>,
}

/// What a clone's guest agent said as it made the clone its own.
pub(super) struct Made {
    /// What it did, for the log.
    pub said: String,
    /// Its guest's status, taken alongside its identity's last steps: the
    /// row's readiness goes by it in the same pass, as by a status asked
    /// (see `probes::agent`). `None` from an agent that sends none.
    pub status: Option<crate::guest::Status>,
}

/// Makes the clone `vm_id`'s restored guest (running since `ran`) a
/// machine of its own (the steps of the module): what it said, or why it
/// is not.
pub(super) fn make_own(
    backend: &dyn Lifecycle,
    vm_id: &Id,
    own: &Own,
    ran: Instant,
    deadline: Deadline,
) -> Result<Made, String> {
    // Its generator first: what the identity starts (sshd again, a DHCP
    // client) draws from it.
    let (reseeded, reached, answered) = match guests::make_whole(backend, vm_id, ran, deadline) {
        Whole::Done {
            said,
            reached,
            answered,
            ..
        } if said.crng_reseeded => (said, reached, answered),
        Whole::Done { .. } => return Err("its guest agent did not reseed its generator".into()),
        Whole::NoDoor => return Err("its hypervisor is gone".into()),
        Whole::NoAgent => return Err("no guest agent answers the reseed".into()),
        Whole::Failed(e) => return Err(format!("its guest agent failed the reseed: {e}")),
        Whole::NoEntropy(e) => return Err(format!("cannot read this host's /dev/urandom: {e}")),
    };
    let mut applied = identity(backend, vm_id, own, deadline)?;
    let said = format!(
        "its guest agent made it its own in {:.1} ms (reached in {:.1} ms, answered {:.1} ms later: {} bytes of entropy credited and its generator reseeded, its clock {} ms off{}; then its identity, in {:.1} ms{}): hostname {}, host key {}, {} MACs{}",
        ran.elapsed().as_secs_f64() * 1000.0,
        reached.as_secs_f64() * 1000.0,
        answered.as_secs_f64() * 1000.0,
        reseeded.credited_bytes,
        reseeded.clock_offset_ms,
        if reseeded.clock_set { " (set)" } else { "" },
        applied.took.as_secs_f64() * 1000.0,
        if applied.sshd_reloaded {
            ", sshd reloaded"
        } else {
            ""
        },
        applied.hostname,
        applied.fingerprint,
        applied.macs,
        if applied.readdressed {
            " and their new leases"
        } else {
            ""
        },
    );
    Ok(Made {
        said,
        status: applied.status.take(),
    })
}

/// What a clone's guest agent said it did of its identity, checked.
struct Applied {
    took: Duration,
    hostname: String,
    fingerprint: String,
    macs: usize,
    sshd_reloaded: bool,
    readdressed: bool,
    status: Option<crate::guest::Status>,
}

/// Step 2 of the module, each answer checked against what was asked.
fn identity(
    backend: &dyn Lifecycle,
    vm_id: &Id,
    own: &Own,
    deadline: Deadline,
) -> Result<Applied, String> {
    let door = backend
        .guest_doors()
        .and_then(|d| d.guest_door(vm_id))
        .ok_or("its hypervisor gives it no guest agent's door")?;
    let identity = Identity {
        hostname: own.hostname.clone(),
        ssh_host_key: own.host_key_pem.clone(),
        ssh_host_certificate: own.host_certificate.clone(),
        user: String::new(),
        authorized_keys: own.authorized_keys.clone(),
        set_authorized_keys: true,
        nics: own
            .nics
            .iter()
            .map(|(from, to)| NicMac {
                from: from.to_string(),
                to: to.to_string(),
            })
            .collect(),
    };
    let asked = crate::guest::ask(
        &door.socket,
        door.vmm_pid,
        1,
        request::Ask::Identity(identity),
        deadline.capped(IDENTITY_WITHIN),
    )
    .map_err(|e| format!("its guest agent did not apply its identity: {e}"))?;
    let Said::Identity {
        hostname,
        ssh_host_key_fingerprint,
        macs,
        sshd_reloaded,
        readdressed,
        steps,
        status,
        ..
    } = asked.said
    else {
        return Err("its guest agent answered its identity with something else".into());
    };
    let fingerprint = crate::hostkey::fingerprint(&own.host_key_public).unwrap_or_default();
    let wanted_macs: Vec<Mac> = own.nics.iter().map(|(_, to)| *to).collect();
    if hostname != own.hostname || ssh_host_key_fingerprint != fingerprint || macs != wanted_macs {
        return Err(format!(
            "its guest agent says it is {}, presenting {}, with MACs {:?}: not what it was asked",
            crate::quote::text(&hostname),
            crate::quote::text(&ssh_host_key_fingerprint),
            macs.iter().map(Mac::to_string).collect::<Vec<_>>()
        ));
    }
    log::debug!(
        "VM {vm_id}: its identity reached its guest agent in {:.1} ms; its steps there, as it says: {}",
        asked.reached.as_secs_f64() * 1000.0,
        steps
            .iter()
            .map(|(step, took)| format!("{step} {:.1} ms", took.as_secs_f64() * 1000.0))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if !readdressed && !wanted_macs.is_empty() {
        log::warn!(
            "VM {vm_id}: its guest took no new address for its new MAC within 3 s: it may not answer at its own address until its DHCP client renews"
        );
    }
    Ok(Applied {
        took: asked.took,
        hostname,
        fingerprint,
        macs: macs.len(),
        sshd_reloaded,
        readdressed,
        status,
    })
}

/// The hostname a clone is given: its spec's name, else its id made one.
pub(super) fn hostname(d: &crate::model::DesiredVm) -> String {
    if !d.spec.name.is_empty() {
        return d.spec.name.clone();
    }
    let name: String = d.spec.vm_id.as_str().replace(['_', '.'], "-");
    name.trim_matches('-').chars().take(63).collect()
}

/// Each of the clone's NICs, its template's MAC and its own: none where
/// the host gives VMs no network.
pub(super) fn nics(
    backend: &dyn Lifecycle,
    d: &crate::model::DesiredVm,
    template: &Id,
) -> Vec<(Mac, Mac)> {
    let vm_id = &d.spec.vm_id;
    if backend.address(vm_id).is_none() {
        return Vec::new();
    }
    let mut nics = vec![(Mac::underlay(template), Mac::underlay(vm_id))];
    if !d.spec.network.is_empty() {
        nics.push((Mac::second_nic(template), Mac::second_nic(vm_id)));
    }
    nics
}
