//! Volumes: sparse files under `STATE_DIR/volumes/`, converged on the
//! heartbeat path because they are cheap (a truncate, never a copy) and
//! because a VM arriving with its volume in one snapshot must find the file
//! there when its pass boots it.
//!
//! The rule above all others: nothing here deletes a volume that the current
//! snapshot does not tombstone, and a tombstoned one only once no VM record
//! refers to it. A volume outlives every VM that used it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::error::{Outcome, Simple};
use crate::model::{
    Id, Rejected, Snapshot, VmSpec, VolumeSpec, VolumeState, VolumeStatus, WantedVolume,
};
use crate::state::atomic::{sync_dir, write_atomic};
use crate::state::{RecordSlot, Store};

const GIB: u64 = 1 << 30;

/// Converges every volume of `snap` and reports every volume on the host:
/// desired, tombstoned, refused, and files no snapshot mentions (reported,
/// never touched).
pub fn converge(
    store: &Store,
    snap: &Snapshot,
    records: &BTreeMap<Id, RecordSlot>,
) -> Vec<VolumeStatus> {
    // Who uses which volume is only needed to reclaim one: a tick with no
    // tombstoned volume (most of them) reads no VM record for it.
    let reclaiming = snap
        .volumes
        .iter()
        .any(|w| matches!(w, WantedVolume::Tombstoned(_)));
    let (users, any_unreadable) = if reclaiming {
        let any_unreadable = records
            .values()
            .any(|r| matches!(r, RecordSlot::Unreadable(_)));
        (volume_users(records), any_unreadable)
    } else {
        (HashMap::new(), false)
    };
    let mut rows = Vec::new();
    let mut mentioned: HashSet<&str> = HashSet::new();
    for wanted in &snap.volumes {
        mentioned.insert(wanted.id().as_str());
        let row = match wanted {
            WantedVolume::Present(v) => Some(ensure(store, v)),
            WantedVolume::Tombstoned(id) => reclaim(store, id, &users, any_unreadable),
        };
        rows.extend(row);
    }
    for rejected in &snap.rejected_volumes {
        if let Some(id) = &rejected.id {
            mentioned.insert(id.as_str());
        }
        rows.push(refused(store, rejected));
    }
    rows.extend(
        sweep(store)
            .into_iter()
            .filter(|row| !mentioned.contains(row.volume_id.as_str())),
    );
    rows.sort_by(|a, b| a.volume_id.cmp(&b.volume_id));
    rows
}

/// Reports every volume file on the host, changing nothing. Used where no
/// snapshot may be acted on (a fenced one): a report that named no volumes
/// would read upward as this host having none, and the control plane reaps
/// tombstoned volumes on exactly that silence.
pub fn sweep(store: &Store) -> Vec<VolumeStatus> {
    let Ok(entries) = fs::read_dir(store.layout().volumes()) else {
        return Vec::new();
    };
    let mut rows: Vec<VolumeStatus> = entries
        .flatten()
        .filter_map(|entry| {
            let id = Id::parse(entry.file_name().to_str()?).ok()?;
            let meta = entry.metadata().ok()?;
            let state = if store.layout().volume_tombstone(&id).exists() {
                VolumeState::Tombstoned
            } else {
                VolumeState::Ready
            };
            Some(row(&id, state, meta.len(), String::new()))
        })
        .collect();
    rows.sort_by(|a, b| a.volume_id.cmp(&b.volume_id));
    rows
}

/// Checks that every volume a VM needs is a file on this host, and that no
/// other VM whose VMM is `live`, or that is suspended, has it attached: a volume is one guest's
/// disk at a time (two VMMs writing one filesystem corrupt it, and the
/// file would become the VMM's that booted last while the first still
/// holds it open). Either is permanent for the VM until its spec, or the
/// other VM's, changes.
pub fn materialized(store: &Store, spec: &VmSpec, live: &dyn Fn(&Id) -> bool) -> Outcome {
    for id in &spec.volume_ids {
        let path = store.layout().volume(id);
        if !path.is_file() {
            return Err(Simple::permanent(format!(
                "volume {id} is not on this host ({} is missing); add it to the snapshot's volumes",
                path.display()
            ))
            .into());
        }
    }
    if spec.volume_ids.is_empty() {
        return Ok(());
    }
    let records = store.load_all();
    for (other, slot) in records.iter() {
        let RecordSlot::Readable(rec) = slot else {
            continue;
        };
        if *other == spec.vm_id {
            continue;
        }
        let Some(shared) = spec
            .volume_ids
            .iter()
            .find(|v| rec.spec.volume_ids.contains(v))
        else {
            continue;
        };
        // A suspended guest holds its volumes as it left them: its saved
        // state was taken with them, and it resumes on them.
        if !rec.lifecycle.suspension().is_none() {
            return Err(Simple::permanent(format!(
                "volume {shared} is attached to VM {other}, which is suspended with it; a volume is one VM's at a time: detach it from {other} (or stop {other}) before attaching it here"
            ))
            .into());
        }
        if live(other) {
            return Err(Simple::permanent(format!(
                "volume {shared} is attached to VM {other}, whose hypervisor runs; a volume is one VM's at a time: detach it from {other} (or stop {other}) before attaching it here"
            ))
            .into());
        }
    }
    Ok(())
}

/// For each volume id, the VMs whose records attach it.
fn volume_users(records: &BTreeMap<Id, RecordSlot>) -> HashMap<&Id, Vec<&Id>> {
    let mut users: HashMap<&Id, Vec<&Id>> = HashMap::new();
    for (vm_id, slot) in records {
        if let RecordSlot::Readable(rec) = slot {
            for volume_id in &rec.spec.volume_ids {
                users.entry(volume_id).or_default().push(vm_id);
            }
        }
    }
    users
}

fn row(id: &Id, state: VolumeState, len: u64, last_error: String) -> VolumeStatus {
    VolumeStatus {
        volume_id: id.to_string(),
        state,
        size_gb: len / GIB,
        last_error,
    }
}

fn failed(id: &Id, len: u64, why: String) -> VolumeStatus {
    row(id, VolumeState::Failed, len, why)
}

/// Makes a desired volume a file of its size: created sparse, grown when
/// asked, never shrunk.
fn ensure(store: &Store, v: &VolumeSpec) -> VolumeStatus {
    let id = &v.volume_id;
    let path = store.layout().volume(id);
    let want = v.size_gb * GIB;
    // Un-deleted: the control plane wants it again.
    let marker = store.layout().volume_tombstone(id);
    if marker.exists()
        && let Err(e) = fs::remove_file(&marker)
    {
        log::warn!(
            "volume {id}: cannot remove its tombstone marker {}: {e}",
            marker.display()
        );
    }
    let result = match fs::metadata(&path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => create_sparse(&path, want).map(|()| want),
        Err(e) => Err(e),
        Ok(meta) if !meta.is_file() => {
            return failed(
                id,
                0,
                format!("{} is not a regular file; move it away", path.display()),
            );
        }
        Ok(meta) if meta.len() > want => {
            return failed(
                id,
                meta.len(),
                format!(
                    "the volume is {} GiB and the snapshot asks for {} GiB; volumes are never shrunk, ask for at least {} GiB",
                    meta.len().div_ceil(GIB),
                    v.size_gb,
                    meta.len().div_ceil(GIB)
                ),
            );
        }
        Ok(meta) if meta.len() < want => grow(&path, want).map(|()| want),
        Ok(meta) => Ok(meta.len()),
    };
    match result {
        Ok(len) => row(id, VolumeState::Ready, len, String::new()),
        Err(e) => failed(id, 0, format!("cannot size {}: {e}", path.display())),
    }
}

fn create_sparse(path: &Path, len: u64) -> io::Result<()> {
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(crate::state::perms::FILE)
        .open(path)?;
    file.set_len(len)?;
    file.sync_all()?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))?;
    crate::crash::point("volume.created");
    Ok(())
}

fn grow(path: &Path, len: u64) -> io::Result<()> {
    let file = OpenOptions::new().write(true).open(path)?;
    file.set_len(len)?;
    file.sync_all()?;
    crate::crash::point("volume.grown");
    Ok(())
}

/// Reclaims a tombstoned volume once nothing can still need it. Returns the
/// row to report, or `None` once the file is gone: absence is the ack.
fn reclaim(
    store: &Store,
    id: &Id,
    users: &HashMap<&Id, Vec<&Id>>,
    any_unreadable: bool,
) -> Option<VolumeStatus> {
    let path = store.layout().volume(id);
    let marker = store.layout().volume_tombstone(id);
    let len = match fs::metadata(&path) {
        Ok(meta) => meta.len(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let _ = fs::remove_file(&marker);
            return None;
        }
        Err(e) => {
            return Some(failed(
                id,
                0,
                format!("cannot stat {}: {e}", path.display()),
            ));
        }
    };
    if !marker.exists()
        && let Err(e) = write_atomic(&marker, b"")
    {
        log::warn!("volume {id}: cannot write its tombstone marker: {e}");
    }
    let waiting = |why: String| Some(row(id, VolumeState::Tombstoned, len, why));
    if let Some(vms) = users.get(id) {
        let names: Vec<&str> = vms.iter().map(|v| v.as_str()).collect();
        return waiting(format!(
            "still attached to VM {}; reclaimed once no VM uses it",
            names.join(", ")
        ));
    }
    if any_unreadable {
        return waiting(
            "not reclaimed while a VM record is unreadable: that VM may use it".to_owned(),
        );
    }
    if let Err(e) = fs::remove_file(&path) {
        return Some(row(
            id,
            VolumeState::Tombstoned,
            len,
            format!("cannot remove {}: {e}", path.display()),
        ));
    }
    if let Err(e) = sync_dir(&store.layout().volumes()) {
        log::warn!("volume {id}: removed, but syncing the volumes dir failed: {e}");
    }
    let _ = fs::remove_file(&marker);
    log::info!("volume {id}: reclaimed");
    None
}

/// A volume entry the agent refused: reported with its reason, never touched.
fn refused(store: &Store, rejected: &Rejected) -> VolumeStatus {
    let len = rejected
        .id
        .as_ref()
        .and_then(|id| fs::metadata(store.layout().volume(id)).ok())
        .map_or(0, |m| m.len());
    VolumeStatus {
        volume_id: rejected.raw_id.clone(),
        state: VolumeState::Failed,
        size_gb: len / GIB,
        last_error: rejected.error.to_string(),
    }
}
