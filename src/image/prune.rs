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
    let keep = in_use(store, &HashSet::new())?;
    let mut candidates = unused(store, &keep)?;
    candidates.sort_by(|a, b| a.name.cmp(&b.name));
    remove(candidates, u64::MAX)
}

/// Removes images no record names and `wanted` does not hold (the digests
/// desired state names), oldest first, until the cache holds at most
/// `max_bytes` (`--image-cache-max`), or nothing more may go.
pub fn prune_to(
    store: &Store,
    wanted: &HashSet<String>,
    max_bytes: u64,
) -> Result<Pruned, PruneError> {
    // A directory listing a tick, and the records only when over.
    let held = cached_bytes(store);
    if held <= max_bytes {
        return Ok(Pruned::default());
    }
    let keep = in_use(store, wanted)?;
    let mut candidates = unused(store, &keep)?;
    candidates.sort_by_key(|c| c.modified);
    remove(candidates, held - max_bytes)
}

/// Bytes every cached image holds.
fn cached_bytes(store: &Store) -> u64 {
    fs::read_dir(store.layout().images())
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// A cached image, as the cache's directory has it.
#[derive(Debug)]
pub struct Cached {
    /// Its digest.
    pub name: String,
    pub path: std::path::PathBuf,
    pub len: u64,
    /// What it holds of the disk (it is cached sparse).
    pub allocated: u64,
    /// When it was cached.
    pub modified: std::time::SystemTime,
}

/// Every image in the cache at `dir`; partial downloads (dot files) are
/// none. What `images list` shows and what a prune chooses from.
pub fn cached(dir: &std::path::Path) -> Result<Vec<Cached>, PruneError> {
    use std::os::unix::fs::MetadataExt;
    let entries = fs::read_dir(dir).map_err(|source| PruneError::List {
        dir: dir.to_path_buf(),
        source,
    })?;
    Ok(entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                return None;
            }
            let meta = entry.metadata().ok()?;
            Some(Cached {
                name,
                path: entry.path(),
                len: meta.len(),
                allocated: meta.blocks().saturating_mul(512),
                modified: meta.modified().unwrap_or(std::time::UNIX_EPOCH),
            })
        })
        .collect())
}

/// Removes `candidates` in order until `enough` bytes are freed.
fn remove(candidates: Vec<Cached>, enough: u64) -> Result<Pruned, PruneError> {
    let mut pruned = Pruned::default();
    for c in candidates {
        if pruned.bytes >= enough {
            break;
        }
        fs::remove_file(&c.path).map_err(|source| PruneError::Remove {
            path: c.path.clone(),
            source,
        })?;
        pruned.bytes += c.len;
        pruned.removed.push(c.name);
    }
    Ok(pruned)
}

/// The digests records name, with `also`; an error while a record is
/// unreadable.
fn in_use(store: &Store, also: &HashSet<String>) -> Result<HashSet<String>, PruneError> {
    let records = store.load_all();
    let mut keep = also.clone();
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
    Ok(keep)
}

/// The verified images outside `keep`.
fn unused(store: &Store, keep: &HashSet<String>) -> Result<Vec<Cached>, PruneError> {
    let mut images = cached(&store.layout().images())?;
    images.retain(|c| !keep.contains(&c.name));
    Ok(images)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Id, VmSpec};
    use crate::state::Record;
    use std::time::{Duration, SystemTime};

    /// A store whose one record uses image `used`, and these images, each
    /// 1 KiB, modified in the order given (oldest first).
    fn store_with(dir: &std::path::Path, used: &str, images: &[&str]) -> Store {
        let store = Store::open(dir).expect("store");
        store
            .save(&Record::new(VmSpec {
                vm_id: Id::parse("vm-1").expect("id"),
                name: String::new(),
                image_url: "file:///x".into(),
                image_sha256: used.into(),
                cloud_init: String::new(),
                ssh_authorized_key: String::new(),
                network: String::new(),
                volume_ids: vec![],
                vcpus: 1,
                mem_mb: 128,
                disk_gb: 1,
                limits: crate::model::VmLimits::default(),
            }))
            .expect("record");
        let start = SystemTime::now() - Duration::from_secs(3600);
        for (i, name) in images.iter().enumerate() {
            let path = store.layout().images().join(name);
            fs::write(&path, vec![0u8; 1024]).expect("image");
            let file = fs::File::options().write(true).open(&path).expect("open");
            file.set_modified(start + Duration::from_secs(i as u64))
                .expect("mtime");
        }
        store
    }

    fn left(store: &Store) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(store.layout().images())
            .expect("list")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn over_the_cap_the_oldest_unused_images_go_first_until_it_fits() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_with(dir.path(), "used", &["old", "used", "mid", "new"]);

        let pruned = prune_to(&store, &HashSet::new(), 2048).expect("prune");

        assert_eq!(pruned.removed, vec!["old", "mid"]);
        assert_eq!(left(&store), vec!["new", "used"]);
    }

    #[test]
    fn an_image_desired_state_names_is_kept_though_no_record_does() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_with(dir.path(), "used", &["used", "wanted", "other"]);
        let wanted: HashSet<String> = ["wanted".to_owned()].into();

        prune_to(&store, &wanted, 0).expect("prune");

        assert_eq!(left(&store), vec!["used", "wanted"]);
    }

    #[test]
    fn under_the_cap_nothing_goes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_with(dir.path(), "used", &["a", "b", "used"]);

        let pruned = prune_to(&store, &HashSet::new(), 1 << 20).expect("prune");

        assert!(pruned.removed.is_empty());
        assert_eq!(left(&store), vec!["a", "b", "used"]);
    }
}
