//! Wire ⇄ domain conversion. Validation happens here, once: everything the
//! control plane (or a desired file) sends is checked before any of it can
//! name a path, size a file or reach a hypervisor's command line (what
//! a VM is promised beyond its hardware: `tenant.rs`).
//!
//! A bad entry fails that entry alone. It is kept as a [`Rejected`] with its
//! reason so the report can say which VM or volume was refused and why,
//! while the rest of the snapshot is acted on.

use std::collections::HashMap;

use super::tenant::{
    egress_list, on_panic, published_ports, published_to_wire, readiness, readiness_to_wire, sleep,
    vm_limits,
};
use crate::model::is_hostname;
use crate::model::{
    Cidr, DesiredVm, Egress, GuestMemory, Id, Limits, Phase, PowerState, QuarantinedVm, Rejected,
    Report, Sleep, Snapshot, SpecError, VmSpec, VmStatus, VolumeSpec, VolumeState, VolumeStatus,
    WantedVm, WantedVolume,
};
use crate::pb;
use crate::quote;

/// Checks a wire snapshot. Never fails as a whole: bad entries become
/// rejections. An id that appears twice is refused in every place it
/// appears, since the agent cannot tell which entry the control plane meant.
pub fn snapshot_from_wire(wire: &pb::Snapshot) -> Snapshot {
    let mut snap = Snapshot {
        epoch: wire.epoch,
        min_agent_version: wire.min_agent_version.clone(),
        ..Snapshot::default()
    };
    let vm_counts = count_ids(wire.vms.iter().map(|v| v.vm_id.as_str()));
    for raw in &wire.vms {
        match vm_from_wire(raw, vm_counts.get(raw.vm_id.as_str()).copied()) {
            Ok(vm) => snap.vms.push(vm),
            Err(rejected) => snap.rejected_vms.push(rejected),
        }
    }
    hold_clones_to_templates(&mut snap);
    let volume_counts = count_ids(wire.volumes.iter().map(|v| v.volume_id.as_str()));
    for raw in &wire.volumes {
        let count = volume_counts.get(raw.volume_id.as_str()).copied();
        match volume_from_wire(raw, count) {
            Ok(volume) => snap.volumes.push(volume),
            Err(rejected) => snap.rejected_volumes.push(rejected),
        }
    }
    snap
}

pub fn snapshot_to_wire(snap: &Snapshot) -> pb::Snapshot {
    pb::Snapshot {
        epoch: snap.epoch,
        min_agent_version: snap.min_agent_version.clone(),
        vms: snap.vms.iter().map(vm_to_wire).collect(),
        volumes: snap.volumes.iter().map(volume_to_wire).collect(),
        ..pb::Snapshot::default()
    }
}

/// Every clone whose template is an entry of the snapshot held to it
/// ([`clone_mismatch`]); one that breaks it is refused.
fn hold_clones_to_templates(snap: &mut Snapshot) {
    let is_clone = |vm: &WantedVm| matches!(vm, WantedVm::Present(d) if d.spec.clone_of.is_some());
    if !snap.vms.iter().any(is_clone) {
        return;
    }
    let by_id: HashMap<Id, WantedVm> = snap
        .vms
        .iter()
        .map(|vm| (vm.id().clone(), vm.clone()))
        .collect();
    let (kept, refused): (Vec<_>, Vec<_>) = std::mem::take(&mut snap.vms)
        .into_iter()
        .map(|vm| {
            let why = match &vm {
                WantedVm::Present(d) => d
                    .spec
                    .clone_of
                    .as_ref()
                    .and_then(|t| by_id.get(t))
                    .and_then(|t| clone_mismatch(d, t)),
                WantedVm::Tombstoned(_) => None,
            };
            (vm, why)
        })
        .partition(|(_, why)| why.is_none());
    snap.vms = kept.into_iter().map(|(vm, _)| vm).collect();
    snap.rejected_vms
        .extend(refused.into_iter().filter_map(|(vm, why)| {
            Some(Rejected {
                id: Some(vm.id().clone()),
                raw_id: vm.id().to_string(),
                error: why?,
            })
        }));
}

fn count_ids<'a>(ids: impl Iterator<Item = &'a str>) -> HashMap<&'a str, usize> {
    let mut counts = HashMap::new();
    for id in ids {
        *counts.entry(id).or_insert(0) += 1;
    }
    counts
}

/// An entry's id, checked (as its `field`, sent `raw_id`) and seen once
/// in its snapshot (`count` times, where counted), with how the entry is
/// refused from then on.
fn entry_id(raw_id: &str, field: &'static str, count: Option<usize>) -> Result<Entry, Rejected> {
    let id = Id::parse(raw_id).map_err(|e| Rejected {
        id: None,
        raw_id: raw_id.to_owned(),
        error: SpecError::new(field, e.to_string()),
    })?;
    let entry = Entry {
        id,
        raw_id: raw_id.to_owned(),
    };
    match count {
        Some(n) if n > 1 => Err(entry.reject(SpecError::new(
            field,
            format!("the id appears {n} times in one snapshot"),
        ))),
        _ => Ok(entry),
    }
}

/// An entry whose id is good: what refuses it for another field.
struct Entry {
    id: Id,
    raw_id: String,
}

impl Entry {
    fn reject(&self, error: SpecError) -> Rejected {
        Rejected {
            id: Some(self.id.clone()),
            raw_id: self.raw_id.clone(),
            error,
        }
    }
}

/// Checks one VM entry. `count` is how often its id appears in the snapshot.
fn vm_from_wire(raw: &pb::VmSpec, count: Option<usize>) -> Result<WantedVm, Rejected> {
    let entry = entry_id(&raw.vm_id, "vm_id", count)?;
    let (id, reject) = (entry.id.clone(), |e| entry.reject(e));
    if raw.tombstoned {
        return Ok(WantedVm::Tombstoned(id));
    }
    desired_vm(id.clone(), raw)
        .map(|d| WantedVm::Present(std::sync::Arc::new(d)))
        .map_err(reject)
}

fn desired_vm(vm_id: Id, raw: &pb::VmSpec) -> Result<DesiredVm, SpecError> {
    let power = PowerState::from_wire(&raw.power_state).ok_or_else(|| {
        SpecError::new(
            "power_state",
            format!(
                "{} is not \"running\", \"stopped\" or \"suspended\"",
                quote::text(&raw.power_state)
            ),
        )
    })?;
    if raw.volume_ids.len() > Limits::MAX_VOLUMES_PER_VM {
        return Err(SpecError::new(
            "volume_ids",
            format!(
                "{} volumes, at most {}",
                raw.volume_ids.len(),
                Limits::MAX_VOLUMES_PER_VM
            ),
        ));
    }
    let mut volume_ids = Vec::with_capacity(raw.volume_ids.len());
    // A set, not a search of the list: a check per id that grows with the
    // list made a 100,000-id entry an 18 s stall of the main loop.
    let mut seen = std::collections::HashSet::with_capacity(raw.volume_ids.len());
    for v in &raw.volume_ids {
        let id = Id::parse(v).map_err(|e| SpecError::new("volume_ids", e.to_string()))?;
        if !seen.insert(id.clone()) {
            return Err(SpecError::new(
                "volume_ids",
                format!("volume {id} is attached twice"),
            ));
        }
        volume_ids.push(id);
    }
    let ca_keys = raw
        .ssh_user_ca_authorized_keys
        .iter()
        .map(|k| single_line("ssh_user_ca_authorized_keys", k))
        .collect::<Result<Vec<_>, _>>()?;
    if ca_keys.len() > Limits::MAX_USER_CA_KEYS {
        return Err(SpecError::new(
            "ssh_user_ca_authorized_keys",
            format!(
                "{} keys, at most {}",
                ca_keys.len(),
                Limits::MAX_USER_CA_KEYS
            ),
        ));
    }
    let egress = Egress {
        allow: egress_list("egress_allow", &raw.egress_allow)?,
        deny: egress_list("egress_deny", &raw.egress_deny)?,
    };
    let vcpus = bounded("vcpus", raw.vcpus, u64::from(Limits::MAX_VCPUS))? as u32;
    let limits = vm_limits(raw, vcpus)?;
    let clone_of = clone_of(&vm_id, raw)?;
    if clone_of.is_some() && power == PowerState::Stopped {
        return Err(SpecError::new(
            "power_state",
            "a clone starts from its template's running guest: ask for \"running\" or \"suspended\"",
        ));
    }
    let sleep = sleep(raw.wake_on_traffic, raw.idle_suspend_after_s)?;
    if raw.template {
        template(raw, power, &sleep)?;
    }
    let (image_url, image_sha256) = match clone_of {
        // A clone's disk is its template's: it names no image.
        Some(_) => (String::new(), String::new()),
        None => (image_url(&raw.image_url)?, sha256_hex(&raw.image_sha256)?),
    };
    let spec = VmSpec {
        vm_id,
        name: hostname(&raw.name)?,
        image_url,
        image_sha256,
        cloud_init: user_data(&raw.cloud_init)?,
        ssh_authorized_key: single_line("ssh_authorized_key", &raw.ssh_authorized_key)?,
        network: network_name(&raw.network)?,
        volume_ids,
        vcpus,
        mem_mb: bounded("mem_mb", raw.mem_mb, Limits::MAX_MEM_MB)?,
        disk_gb: bounded("disk_gb", raw.disk_gb, Limits::MAX_DISK_GB)?,
        limits,
        clone_of,
    };
    Ok(DesiredVm {
        spec,
        power,
        host_cert_required: raw.host_cert_required,
        ssh_host_cert: single_line("ssh_host_cert", &raw.ssh_host_cert)?,
        ssh_user_ca_keys: ca_keys,
        egress,
        readiness: raw.readiness.as_ref().map(readiness).transpose()?,
        published: published_ports(&raw.published_ports)?,
        sleep,
        on_panic: on_panic(&raw.on_panic)?,
        template: raw.template,
    })
}

/// The template a clone names, checked against the entry's own fields:
/// `None` for a VM that is no clone.
fn clone_of(vm_id: &Id, raw: &pb::VmSpec) -> Result<Option<Id>, SpecError> {
    if raw.clone_of.is_empty() {
        return Ok(None);
    }
    let template =
        Id::parse(&raw.clone_of).map_err(|e| SpecError::new("clone_of", e.to_string()))?;
    if &template == vm_id {
        return Err(SpecError::new(
            "clone_of",
            "a VM cannot be a clone of itself",
        ));
    }
    let own = [
        ("image_url", raw.image_url.is_empty()),
        ("image_sha256", raw.image_sha256.is_empty()),
        ("volume_ids", raw.volume_ids.is_empty()),
    ];
    if let Some((field, _)) = own.iter().find(|(_, empty)| !empty) {
        return Err(SpecError::new(
            field,
            format!(
                "a clone takes its disk from its template {template} and has no volumes: leave {field} empty"
            ),
        ));
    }
    Ok(Some(template))
}

/// What a template may not be: stopped (a guest that does not run has
/// nothing to save), woken by traffic (its disk and snapshot must stay as
/// clones copy them), or the holder of a volume (each clone would copy a
/// tenant's data). Suspended, clones are made from its snapshot; running,
/// from the save the agent makes of it once it is ready.
fn template(raw: &pb::VmSpec, power: PowerState, sleep: &Sleep) -> Result<(), SpecError> {
    if power == PowerState::Stopped {
        return Err(SpecError::new(
            "template",
            format!(
                "a template is wanted \"suspended\" or \"running\" (its saved guest is what clones are made from), not {}",
                quote::text(&raw.power_state)
            ),
        ));
    }
    if sleep.wake_on_traffic {
        return Err(SpecError::new(
            "template",
            "a template is never woken: turn wake_on_traffic off",
        ));
    }
    if !raw.volume_ids.is_empty() {
        return Err(SpecError::new(
            "template",
            "a template carries no volumes (each clone would copy them): detach them",
        ));
    }
    Ok(())
}

/// A clone whose template is in the same snapshot, held to it: the
/// template is one, and the clone's shape is its. `None` when it keeps to
/// it. A template absent from the snapshot, or tombstoned, is the
/// engine's to judge: a clone already made needs it no more.
fn clone_mismatch(clone: &DesiredVm, template: &WantedVm) -> Option<SpecError> {
    // A template tombstoned is the engine's to judge too: its clones
    // already made run on.
    let WantedVm::Present(t) = template else {
        return None;
    };
    let (c, ts) = (&clone.spec, &t.spec);
    if !t.template {
        return Some(SpecError::new(
            "clone_of",
            format!(
                "{} is not a template: mark it with template: true (and power_state \"suspended\")",
                ts.vm_id
            ),
        ));
    }
    let shape = [
        ("vcpus", u64::from(c.vcpus), u64::from(ts.vcpus)),
        ("mem_mb", c.mem_mb, ts.mem_mb),
        ("disk_gb", c.disk_gb, ts.disk_gb),
    ];
    if let Some((field, own, its)) = shape.iter().find(|(_, own, its)| own != its) {
        return Some(SpecError::new(
            field,
            format!(
                "{own}, where its template {} has {its}: a clone runs in its template's memory, on a copy of its disk; ask for {its}",
                ts.vm_id
            ),
        ));
    }
    if c.network.is_empty() != ts.network.is_empty() {
        return Some(SpecError::new(
            "network",
            format!(
                "a clone has the NICs of its template {}, which has {}",
                ts.vm_id,
                if ts.network.is_empty() {
                    "no second NIC: leave network empty".to_owned()
                } else {
                    "a second NIC: name a network".to_owned()
                }
            ),
        ));
    }
    None
}

pub fn vm_to_wire(vm: &WantedVm) -> pb::VmSpec {
    match vm {
        WantedVm::Tombstoned(id) => pb::VmSpec {
            vm_id: id.to_string(),
            tombstoned: true,
            ..pb::VmSpec::default()
        },
        WantedVm::Present(d) => {
            let s = &d.spec;
            pb::VmSpec {
                vm_id: s.vm_id.to_string(),
                name: s.name.clone(),
                image_url: s.image_url.clone(),
                image_sha256: s.image_sha256.clone(),
                cloud_init: s.cloud_init.clone(),
                ssh_authorized_key: s.ssh_authorized_key.clone(),
                network: s.network.clone(),
                volume_ids: s.volume_ids.iter().map(Id::to_string).collect(),
                vcpus: i64::from(s.vcpus),
                mem_mb: s.mem_mb as i64,
                disk_gb: s.disk_gb as i64,
                cpu_max_millis: i64::from(s.limits.cpu_max_millis),
                cpu_burst_ms: i64::from(s.limits.cpu_burst_ms),
                disk_mbps: i64::from(s.limits.disk_mbps),
                disk_iops: i64::from(s.limits.disk_iops),
                net_mbps: i64::from(s.limits.net_mbps),
                readiness: d.readiness.as_ref().map(readiness_to_wire),
                power_state: d.power.as_wire().to_owned(),
                tombstoned: false,
                host_cert_required: d.host_cert_required,
                ssh_host_cert: d.ssh_host_cert.clone(),
                ssh_user_ca_authorized_keys: d.ssh_user_ca_keys.clone(),
                egress_allow: d.egress.allow.iter().map(Cidr::to_string).collect(),
                egress_deny: d.egress.deny.iter().map(Cidr::to_string).collect(),
                published_ports: published_to_wire(&d.published),
                wake_on_traffic: d.sleep.wake_on_traffic,
                idle_suspend_after_s: d
                    .sleep
                    .idle_after
                    .map_or(0, |t| u32::try_from(t.as_secs()).unwrap_or(u32::MAX)),
                on_panic: match d.on_panic {
                    crate::model::OnPanic::Stay => String::new(),
                    other => other.as_wire().to_owned(),
                },
                template: d.template,
                clone_of: s.clone_of.as_ref().map(Id::to_string).unwrap_or_default(),
            }
        }
    }
}

fn volume_from_wire(raw: &pb::VolumeSpec, count: Option<usize>) -> Result<WantedVolume, Rejected> {
    let entry = entry_id(&raw.volume_id, "volume_id", count)?;
    let (id, reject) = (entry.id.clone(), |e| entry.reject(e));
    if raw.tombstoned {
        return Ok(WantedVolume::Tombstoned(id));
    }
    let size_gb = i64::try_from(raw.size_gb).unwrap_or(i64::MAX);
    let size_gb = bounded("size_gb", size_gb, Limits::MAX_DISK_GB).map_err(reject)?;
    Ok(WantedVolume::Present(VolumeSpec {
        volume_id: id,
        size_gb,
    }))
}

pub fn volume_to_wire(volume: &WantedVolume) -> pb::VolumeSpec {
    match volume {
        WantedVolume::Present(v) => pb::VolumeSpec {
            volume_id: v.volume_id.to_string(),
            size_gb: v.size_gb,
            tombstoned: false,
        },
        WantedVolume::Tombstoned(id) => pb::VolumeSpec {
            volume_id: id.to_string(),
            size_gb: 0,
            tombstoned: true,
        },
    }
}

pub fn report_to_wire(report: &Report) -> pb::Report {
    pb::Report {
        last_seen_epoch: report.last_seen_epoch,
        vms: report
            .vms
            .iter()
            .map(|row| vm_status_to_wire(row))
            .collect(),
        quarantined: report
            .quarantined
            .iter()
            .map(|q| pb::QuarantinedVm {
                vm_id: q.vm_id.to_string(),
                name: q.name.clone(),
                vmspec_json: q.vmspec_json.clone(),
                destroy_at_unix: q.destroy_at_unix,
            })
            .collect(),
        destroyed: report.destroyed.iter().map(Id::to_string).collect(),
        volumes: report
            .volumes
            .iter()
            .map(|v| pb::VolumeStatus {
                volume_id: v.volume_id.clone(),
                state: v.state.as_wire().to_owned(),
                size_gb: v.size_gb,
                last_error: v.last_error.clone(),
            })
            .collect(),
        fence_violation: report.fence_violation,
        // The exchange's to say: only it knows how the last contact went.
        refused: None,
        // The daemon's to fill: the engine knows no bytes.
        answers_sha256: Vec::new(),
    }
}

fn vm_status_to_wire(row: &VmStatus) -> pb::VmStatus {
    pb::VmStatus {
        vm_id: row.vm_id.clone(),
        ip: row.ip.clone(),
        network_ip: row.network_ip.clone(),
        power_state: row.power.map(PowerState::as_wire).unwrap_or("").to_owned(),
        phase: row.phase.map(Phase::as_wire).unwrap_or("").to_owned(),
        last_error: row.last_error.clone(),
        status_detail: row.status_detail.clone(),
        ssh_host_pubkey: row.ssh_host_pubkey.clone(),
        egress: row.egress.clone(),
        limits: row.limits.clone(),
        readiness: row.readiness.clone(),
        spec_rejected: row.spec_rejected.clone(),
        published_ports: published_to_wire(&row.published),
        asleep: row.asleep,
        last_wake: row.last_wake.clone(),
        guest: row.guest.clone(),
        guest_memory_total_kib: row.guest_memory.map_or(0, |m| m.total_kib),
        guest_memory_available_kib: row.guest_memory.map_or(0, |m| m.available_kib),
    }
}

/// Reads a report back (e.g. the `report.json` a previous tick wrote). The
/// report is the agent's own output, so an unknown enum string means the
/// file is from a newer agent or damaged: an error, not a guess.
pub fn report_from_wire(wire: &pb::Report) -> Result<Report, SpecError> {
    let mut report = Report {
        last_seen_epoch: wire.last_seen_epoch,
        fence_violation: wire.fence_violation,
        ..Report::default()
    };
    for row in &wire.vms {
        report.vms.push(std::sync::Arc::new(VmStatus {
            vm_id: row.vm_id.clone(),
            ip: row.ip.clone(),
            network_ip: row.network_ip.clone(),
            power: optional_enum("power_state", &row.power_state, PowerState::from_wire)?,
            phase: optional_enum("phase", &row.phase, Phase::from_wire)?,
            last_error: row.last_error.clone(),
            status_detail: row.status_detail.clone(),
            ssh_host_pubkey: row.ssh_host_pubkey.clone(),
            egress: row.egress.clone(),
            limits: row.limits.clone(),
            readiness: row.readiness.clone(),
            spec_rejected: row.spec_rejected.clone(),
            published: published_ports(&row.published_ports)?,
            asleep: row.asleep,
            last_wake: row.last_wake.clone(),
            guest: row.guest.clone(),
            guest_memory: (row.guest_memory_total_kib > 0).then_some(GuestMemory {
                total_kib: row.guest_memory_total_kib,
                available_kib: row.guest_memory_available_kib,
            }),
        }));
    }
    for q in &wire.quarantined {
        report.quarantined.push(QuarantinedVm {
            vm_id: Id::parse(&q.vm_id).map_err(|e| SpecError::new("vm_id", e.to_string()))?,
            name: q.name.clone(),
            vmspec_json: q.vmspec_json.clone(),
            destroy_at_unix: q.destroy_at_unix,
        });
    }
    for id in &wire.destroyed {
        report
            .destroyed
            .push(Id::parse(id).map_err(|e| SpecError::new("destroyed", e.to_string()))?);
    }
    for v in &wire.volumes {
        report.volumes.push(VolumeStatus {
            volume_id: v.volume_id.clone(),
            state: VolumeState::from_wire(&v.state).ok_or_else(|| {
                SpecError::new(
                    "state",
                    format!("unknown volume state {}", quote::text(&v.state)),
                )
            })?,
            size_gb: v.size_gb,
            last_error: v.last_error.clone(),
        });
    }
    Ok(report)
}

fn optional_enum<T>(
    field: &'static str,
    raw: &str,
    parse: fn(&str) -> Option<T>,
) -> Result<Option<T>, SpecError> {
    if raw.is_empty() {
        return Ok(None);
    }
    parse(raw)
        .map(Some)
        .ok_or_else(|| SpecError::new(field, format!("unknown value {}", quote::text(raw))))
}

fn bounded(field: &'static str, value: i64, max: u64) -> Result<u64, SpecError> {
    match u64::try_from(value) {
        Ok(v) if (1..=max).contains(&v) => Ok(v),
        _ => Err(SpecError::new(
            field,
            format!("{value} is outside 1..={max}"),
        )),
    }
}

/// An RFC 1123 hostname, or empty. It is written into the seed's YAML and
/// the guest's /etc/hostname, so anything else (a newline above all) is
/// refused rather than escaped.
fn hostname(raw: &str) -> Result<String, SpecError> {
    if raw.is_empty() {
        return Ok(String::new());
    }
    if is_hostname(raw) {
        Ok(raw.to_owned())
    } else {
        Err(SpecError::new(
            "name",
            format!(
                "{} is not a hostname (dot-separated labels of 1-63 letters, digits and inner hyphens)",
                quote::text(raw)
            ),
        ))
    }
}

fn sha256_hex(raw: &str) -> Result<String, SpecError> {
    if raw.len() == 64 && raw.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(raw.to_ascii_lowercase())
    } else {
        Err(SpecError::new(
            "image_sha256",
            format!("{} is not 64 hexadecimal characters", quote::text(raw)),
        ))
    }
}

/// The schemes the image cache serves. Which of them this build can fetch
/// (https needs the TLS feature) is the image cache's answer, at fetch time.
const IMAGE_SCHEMES: [&str; 3] = ["http://", "https://", "file://"];

fn image_url(raw: &str) -> Result<String, SpecError> {
    let field = "image_url";
    let line = single_line(field, raw)?;
    let scheme = IMAGE_SCHEMES
        .iter()
        .find(|s| line.len() > s.len() && line[..s.len()].eq_ignore_ascii_case(s));
    match scheme {
        Some(_) if !line.contains(' ') => Ok(line),
        Some(_) => Err(SpecError::new(
            field,
            "a URL has no spaces; percent-encode them",
        )),
        None => Err(SpecError::new(
            field,
            format!("{} is not an http, https or file URL", quote::text(raw)),
        )),
    }
}

fn network_name(raw: &str) -> Result<String, SpecError> {
    if raw.is_empty() {
        return Ok(String::new());
    }
    Id::parse(raw)
        .map(String::from)
        .map_err(|e| SpecError::new("network", e.to_string()))
}

/// One line of text: a key, a certificate, a URL. A trailing newline (as
/// pasted) is dropped; any other control character is refused, since these
/// end up in files and YAML where a newline would start a new directive.
fn single_line(field: &'static str, raw: &str) -> Result<String, SpecError> {
    let line = raw.trim_end_matches(['\r', '\n']);
    if line.len() > Limits::MAX_LINE {
        return Err(SpecError::new(
            field,
            format!("{} bytes, at most {}", line.len(), Limits::MAX_LINE),
        ));
    }
    if line.chars().any(char::is_control) {
        return Err(SpecError::new(
            field,
            "it has a control character (a newline?); send one line",
        ));
    }
    Ok(line.to_owned())
}

fn user_data(raw: &str) -> Result<String, SpecError> {
    if raw.len() > Limits::MAX_USER_DATA {
        return Err(SpecError::new(
            "cloud_init",
            format!("{} bytes, at most {}", raw.len(), Limits::MAX_USER_DATA),
        ));
    }
    if raw.contains('\0') {
        return Err(SpecError::new("cloud_init", "it has a NUL byte"));
    }
    Ok(raw.to_owned())
}
