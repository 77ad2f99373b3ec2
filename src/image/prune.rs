//! `eitri-agent images prune`: delete cached images no VM record names.

use std::collections::HashSet;
use std::fs;

use crate::state::{RecordSlot, Store};

/// Why a prune removed nothing, or stopped part way.
#[derive(Debug)]
pub enum PruneError {
    /// An unreadable record might name an image.
    UnreadableRecord { vm_id: crate::model::Id },
    List {
        dir: std::path::PathBuf,
        source: std::io::Error,
    },
    Remove {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

impl std::fmt::Display for PruneError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PruneError::UnreadableRecord { vm_id } => write!(
                f,
                "the record of VM {vm_id} is unreadable and may name an image; nothing was pruned"
            ),
            PruneError::List { dir, .. } => write!(f, "cannot list {}", dir.display()),
            PruneError::Remove { path, .. } => write!(f, "cannot remove {}", path.display()),
        }
    }
}

impl std::error::Error for PruneError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PruneError::UnreadableRecord { .. } => None,
            PruneError::List { source, .. } | PruneError::Remove { source, .. } => Some(source),
        }
    }
}

/// What a prune removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    pub removed: Vec<String>,
    pub bytes: u64,
}

/// Removes every verified image no record names. Refuses to remove
/// anything while a record is unreadable: it might name an image, and an
/// image deleted in error is a VM that cannot be rebuilt offline.
pub fn prune(store: &Store) -> Result<Pruned, PruneError> {
    let records = store.load_all();
    let mut keep = HashSet::new();
    for (vm_id, slot) in records.iter() {
        match slot {
            RecordSlot::Readable(rec) => {
                keep.insert(rec.spec.image_sha256.clone());
            }
            RecordSlot::Unreadable(_) => {
                return Err(PruneError::UnreadableRecord {
                    vm_id: vm_id.clone(),
                });
            }
        }
    }
    let dir = store.layout().images();
    let entries = fs::read_dir(&dir).map_err(|source| PruneError::List {
        dir: dir.clone(),
        source,
    })?;
    let mut pruned = Pruned::default();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || keep.contains(&name) {
            continue;
        }
        let len = entry.metadata().map_or(0, |m| m.len());
        fs::remove_file(entry.path()).map_err(|source| PruneError::Remove {
            path: entry.path(),
            source,
        })?;
        pruned.bytes += len;
        pruned.removed.push(name);
    }
    pruned.removed.sort();
    Ok(pruned)
}
