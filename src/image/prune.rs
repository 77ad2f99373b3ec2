//! `eitri-agent images prune`: delete cached images no VM record names,
//! beside a running agent or not; and the agent's own hold of its cache
//! to `--image-cache-max`.
//!
//! A prune beside a running agent never removes an image under a create:
//! the cache has a lock file, which a create holds shared from the moment
//! its image is found to the moment its root disk is made ([`Hold`]), and
//! a prune takes exclusively. A create saves its record before it looks
//! for its image, so one holding the lock is named by a record the prune
//! reads under the lock, and its image is kept; one that comes after
//! finds its image gone and fetches it again.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::model::Id;
use crate::state::{Layout, RecordSlot, Store};

/// Why a prune removed nothing, or stopped part way.
#[derive(Debug)]
pub enum PruneError {
    /// An unreadable record might name an image.
    UnreadableRecord { vm_id: crate::model::Id },
    /// The records could not be read.
    Records(crate::state::StoreError),
    /// The cache's lock could not be taken.
    Lock {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    /// Creates held the cache for longer than a prune waits.
    Busy { waited: Duration },
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
            PruneError::Records(_) => write!(f, "cannot read the VM records; nothing was pruned"),
            PruneError::Lock { path, .. } => {
                write!(f, "cannot lock the image cache ({})", path.display())
            }
            PruneError::Busy { waited } => write!(
                f,
                "VMs being created held the image cache for {} s; nothing was pruned: run it again once they are up",
                waited.as_secs()
            ),
            PruneError::List { dir, .. } => write!(f, "cannot list {}", dir.display()),
            PruneError::Remove { path, .. } => write!(f, "cannot remove {}", path.display()),
        }
    }
}

impl std::error::Error for PruneError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PruneError::UnreadableRecord { .. } | PruneError::Busy { .. } => None,
            PruneError::Records(source) => Some(source),
            PruneError::List { source, .. }
            | PruneError::Remove { source, .. }
            | PruneError::Lock { source, .. } => Some(source),
        }
    }
}

/// What a prune removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    pub removed: Vec<String>,
    pub bytes: u64,
}

/// How long a prune waits for the creates that hold the cache.
const BUSY_WAIT: Duration = Duration::from_secs(30);

/// Removes every verified image no record names and `wanted` (the digests
/// the last desired state names) does not hold, beside a running agent or
/// not (see the module's why). Refuses to remove anything while a record
/// is unreadable: it might name an image, and an image deleted in error is
/// a VM that cannot be rebuilt offline.
pub fn prune(layout: &Layout, wanted: &HashSet<String>) -> Result<Pruned, PruneError> {
    prune_within(layout, wanted, BUSY_WAIT)
}

/// [`prune`], waiting at most `bound` for the creates that hold the cache.
fn prune_within(
    layout: &Layout,
    wanted: &HashSet<String>,
    bound: Duration,
) -> Result<Pruned, PruneError> {
    let _lock = exclusive(&layout.images_lock(), bound)?;
    let records = match crate::state::read_records(layout) {
        Ok(records) => records,
        // A state dir no agent has run in yet: no VM.
        Err(_) if !layout.vms().exists() => BTreeMap::new(),
        Err(e) => return Err(PruneError::Records(e)),
    };
    let keep = in_use(&records, wanted)?;
    let mut candidates = unused(&layout.images(), &keep)?;
    candidates.sort_by(|a, b| a.name.cmp(&b.name));
    remove(candidates, u64::MAX)
}

/// The cache's lock, taken exclusively, waiting at most `bound`.
fn exclusive(path: &Path, bound: Duration) -> Result<fs::File, PruneError> {
    let lock_err = |source| PruneError::Lock {
        path: path.to_path_buf(),
        source,
    };
    let file = open_lock(path).map_err(lock_err)?;
    let since = Instant::now();
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(file),
            Err(fs::TryLockError::WouldBlock) if since.elapsed() < bound => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(fs::TryLockError::WouldBlock) => return Err(PruneError::Busy { waited: bound }),
            Err(fs::TryLockError::Error(e)) => return Err(lock_err(e)),
        }
    }
}

fn open_lock(path: &Path) -> std::io::Result<fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    fs::File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
}

/// A create's hold of the image cache: while it lives, no prune removes
/// an image (see the module's why).
#[derive(Debug)]
pub struct Hold {
    _lock: fs::File,
}

impl Hold {
    /// The cache's lock at `path`, shared; blocks while a prune runs
    /// (which takes well under a second: it removes files).
    pub fn take(path: &Path) -> std::io::Result<Hold> {
        let file = open_lock(path)?;
        file.lock_shared()?;
        Ok(Hold { _lock: file })
    }
}

/// A verified base image, kept from a prune while this lives.
#[derive(Debug)]
pub struct Base {
    pub path: std::path::PathBuf,
    _hold: Option<Hold>,
}

impl Base {
    pub fn held(path: std::path::PathBuf, hold: Hold) -> Base {
        Base {
            path,
            _hold: Some(hold),
        }
    }

    /// An image no prune can reach (a test's).
    pub fn unheld(path: std::path::PathBuf) -> Base {
        Base { path, _hold: None }
    }
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
    let keep = in_use(&store.load_all(), wanted)?;
    let mut candidates = unused(&store.layout().images(), &keep)?;
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
        match fs::remove_file(&c.path) {
            Ok(()) => {}
            // Removed meanwhile by the agent's own hold to its cap.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => {
                return Err(PruneError::Remove {
                    path: c.path.clone(),
                    source,
                });
            }
        }
        pruned.bytes += c.len;
        pruned.removed.push(c.name);
    }
    Ok(pruned)
}

/// The digests records name, with `also`; an error while a record is
/// unreadable.
fn in_use(
    records: &BTreeMap<Id, RecordSlot>,
    also: &HashSet<String>,
) -> Result<HashSet<String>, PruneError> {
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
fn unused(dir: &Path, keep: &HashSet<String>) -> Result<Vec<Cached>, PruneError> {
    let mut images = cached(dir)?;
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
                clone_of: None,
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
    fn a_prune_removes_what_no_record_names_and_desired_state_does_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_with(dir.path(), "used", &["used", "wanted", "other"]);
        let wanted: HashSet<String> = ["wanted".to_owned()].into();

        let pruned = prune(store.layout(), &wanted).expect("prune");

        assert_eq!(pruned.removed, vec!["other"]);
        assert_eq!(left(&store), vec![".lock", "used", "wanted"]);
    }

    #[test]
    fn a_prune_removes_nothing_while_a_create_holds_the_cache() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_with(dir.path(), "used", &["used", "other"]);
        let hold = Hold::take(&store.layout().images_lock()).expect("hold");

        let busy = prune_within(store.layout(), &HashSet::new(), Duration::from_millis(100));

        assert!(matches!(busy, Err(PruneError::Busy { .. })), "{busy:?}");
        assert_eq!(left(&store), vec![".lock", "other", "used"]);
        drop(hold);
        let pruned = prune_within(store.layout(), &HashSet::new(), Duration::from_millis(100));
        assert_eq!(pruned.expect("prune").removed, vec!["other"]);
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
