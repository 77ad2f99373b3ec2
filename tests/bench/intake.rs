//! `make bench-intake`: taking in the worst desired state the limits allow.
//!
//! - The largest snapshot a control plane may send (`--max-response-bytes`,
//!   16 MiB) at the entry caps (10,000 VMs, 10,000 volumes), each VM with
//!   as many volume ids as a VM may attach: counted before it is decoded
//!   (`pb::count_snapshot_entries`), decoded, and converted to the checked
//!   form (`pb::convert::snapshot_from_wire`), as the control-plane path
//!   does; and the same as a desired file, read entry by entry and
//!   converted, as standalone mode does.
//! - The attack that found the quadratic check: one VM naming 100,000
//!   volume ids, refused.
//!
//! The last line: `bench=intake bytes=… proto_ms=… json_ms=… attack_ms=…`;
//! the goal is every figure under 1,000 ms (what a tick may give it).

use std::time::{Duration, Instant};

use eitri_agent::model::Limits;
use eitri_agent::pb;
use eitri_agent::source::{FileSource, SnapshotLimits, Source};
use prost::Message;

type Error = Box<dyn std::error::Error>;

/// The limits' worst snapshot: the most VMs and volumes, each VM with the
/// most volume ids, padded with user-data
/// to the byte limit as `size` measures it (protobuf, or a desired file's
/// JSON).
fn worst(limits: SnapshotLimits, size: impl Fn(&pb::Snapshot) -> usize) -> pb::Snapshot {
    let id = |kind: &str, n: usize| format!("{kind}-{n}");
    let volumes: Vec<pb::VolumeSpec> = (0..limits.max_volumes)
        .map(|n| pb::VolumeSpec {
            volume_id: id("vol", n),
            size_gb: 1,
            ..Default::default()
        })
        .collect();
    let mut snap = pb::Snapshot {
        epoch: 1,
        vms: (0..limits.max_vms)
            .map(|n| pb::VmSpec {
                vm_id: id("vm", n),
                name: format!("vm-{n}"),
                image_url: "http://images.example/base.raw".into(),
                image_sha256: "ab".repeat(32),
                volume_ids: (0..Limits::MAX_VOLUMES_PER_VM)
                    .map(|v| id("vol", (n * 7 + v) % limits.max_volumes))
                    .collect(),
                vcpus: 1,
                mem_mb: 256,
                disk_gb: 1,
                power_state: "running".into(),
                ..Default::default()
            })
            .collect(),
        volumes,
        ..Default::default()
    };
    let room = (limits.max_bytes as usize).saturating_sub(size(&snap) + 64);
    let per_vm = room / limits.max_vms;
    for vm in &mut snap.vms {
        vm.cloud_init = "#".repeat(per_vm.saturating_sub(8));
    }
    snap
}

/// The control-plane path: count, decode, convert; how long it took.
fn proto(bytes: &[u8]) -> Result<Duration, Error> {
    let started = Instant::now();
    pb::count_snapshot_entries(bytes)?;
    let wire = pb::Snapshot::decode(bytes)?;
    let snap = pb::convert::snapshot_from_wire(&wire);
    let took = started.elapsed();
    if !snap.rejected_vms.is_empty() {
        return Err(format!("{} entries refused", snap.rejected_vms.len()).into());
    }
    Ok(took)
}

/// The standalone path: the file read entry by entry, then converted.
fn json(
    dir: &std::path::Path,
    wire: &pb::Snapshot,
    limits: SnapshotLimits,
) -> Result<Duration, Error> {
    let path = dir.join("desired.json");
    std::fs::write(&path, desired_json(wire))?;
    let started = Instant::now();
    let mut source = FileSource::new(path, limits, None);
    let desired = source
        .fetch(&pb::HostInfo::default())?
        .ok_or("the file read as nothing")?;
    let snap = pb::convert::snapshot_from_wire(&desired.wire);
    let took = started.elapsed();
    if !snap.rejected_vms.is_empty() || !desired.refused_vms.is_empty() {
        return Err("entries refused".into());
    }
    Ok(took)
}

/// A snapshot as a desired file writes it.
fn desired_json(wire: &pb::Snapshot) -> String {
    let vms: Vec<serde_json::Value> = wire
        .vms
        .iter()
        .map(|v| {
            serde_json::json!({
                "vm_id": v.vm_id, "name": v.name, "image_url": v.image_url,
                "image_sha256": v.image_sha256, "volume_ids": v.volume_ids,
                "vcpus": v.vcpus, "mem_mb": v.mem_mb, "disk_gb": v.disk_gb,
                "power_state": v.power_state, "cloud_init": v.cloud_init,
            })
        })
        .collect();
    let volumes: Vec<serde_json::Value> = wire
        .volumes
        .iter()
        .map(|v| serde_json::json!({"volume_id": v.volume_id, "size_gb": v.size_gb}))
        .collect();
    serde_json::json!({"epoch": wire.epoch, "vms": vms, "volumes": volumes}).to_string()
}

/// One VM naming 100,000 volume ids, as a desired file: refused; how
/// long that took.
fn attack(dir: &std::path::Path, limits: SnapshotLimits) -> Result<Duration, Error> {
    let ids: Vec<String> = (0..100_000).map(|n| format!("v{n}")).collect();
    let text = serde_json::json!({"vms": [{
        "vm_id": "big", "image_url": "http://images.example/base.raw",
        "image_sha256": "ab".repeat(32), "volume_ids": ids,
        "vcpus": 1, "mem_mb": 256, "disk_gb": 1, "power_state": "running",
    }]})
    .to_string();
    let path = dir.join("attack.json");
    std::fs::write(&path, text)?;
    let started = Instant::now();
    let mut source = FileSource::new(path, limits, None);
    let desired = source
        .fetch(&pb::HostInfo::default())?
        .ok_or("the file read as nothing")?;
    let snap = pb::convert::snapshot_from_wire(&desired.wire);
    let took = started.elapsed();
    if snap.rejected_vms.is_empty() {
        return Err("the 100,000-id entry was not refused".into());
    }
    Ok(took)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() -> Result<(), Error> {
    let limits = SnapshotLimits::default();
    let wire = worst(limits, |s| s.encoded_len());
    let bytes = wire.encode_to_vec();
    let as_file = worst(limits, |s| desired_json(s).len());
    let dir = tempfile::tempdir()?;
    eitri_agent::testkit::remove_on_signal(dir.path());
    let proto_ms = (0..3)
        .map(|_| proto(&bytes).map(ms))
        .collect::<Result<Vec<_>, _>>()?;
    let json_ms = (0..3)
        .map(|_| json(dir.path(), &as_file, limits).map(ms))
        .collect::<Result<Vec<_>, _>>()?;
    let attack_ms = (0..3)
        .map(|_| attack(dir.path(), limits).map(ms))
        .collect::<Result<Vec<_>, _>>()?;
    let best = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    println!(
        "the worst snapshot the limits allow: {} bytes, {} VMs of {} volume ids each, {} volumes",
        bytes.len(),
        wire.vms.len(),
        Limits::MAX_VOLUMES_PER_VM,
        wire.volumes.len()
    );
    println!(
        "bench=intake bytes={} proto_ms={:.1} json_ms={:.1} attack_ms={:.1}",
        bytes.len(),
        best(&proto_ms),
        best(&json_ms),
        best(&attack_ms)
    );
    Ok(())
}
