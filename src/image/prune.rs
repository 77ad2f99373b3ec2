//! `eitri-agent images prune`: delete cached images no VM record names.

use std::collections::HashSet;
use std::fs;

use crate::state::{RecordSlot, Store};

/// What a prune removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    pub removed: Vec<String>,
    pub bytes: u64,
}

/// Removes every verified image no record names. Refuses to remove
/// anything while a record is unreadable: it might name an image, and an
/// image deleted in error is a VM that cannot be rebuilt offline.
pub fn prune(store: &Store) -> Result<Pruned, String> {
    let records = store.load_all();
    let mut keep = HashSet::new();
    for (vm_id, slot) in records.iter() {
        match slot {
            RecordSlot::Readable(rec) => {
                keep.insert(rec.spec.image_sha256.clone());
            }
            RecordSlot::Unreadable(_) => {
                return Err(format!(
                    "the record of VM {vm_id} is unreadable and may name an image; nothing was pruned"
                ));
            }
        }
    }
    let dir = store.images_dir();
    let entries = fs::read_dir(&dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let mut pruned = Pruned::default();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || keep.contains(&name) {
            continue;
        }
        let len = entry.metadata().map_or(0, |m| m.len());
        fs::remove_file(entry.path())
            .map_err(|e| format!("cannot remove {}: {e}", entry.path().display()))?;
        pruned.bytes += len;
        pruned.removed.push(name);
    }
    pruned.removed.sort();
    Ok(pruned)
}
