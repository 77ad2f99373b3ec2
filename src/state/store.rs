use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::atomic::{is_temp_name, remove_stray_temps, sync_dir, write_then_rename};
use super::fence::Fence;
use super::record::Envelope;
use super::{Layout, RECORD_FILE, RECORD_FORMAT, Record, StoreError};
use crate::model::Id;

/// A VM directory being deleted is first renamed to a name with this prefix,
/// so a crash mid-delete leaves something no loader mistakes for a VM.
const DELETING_PREFIX: &str = ".deleting-";

/// One VM's record as the store holds it.
#[derive(Clone, Debug)]
pub enum RecordSlot {
    Readable(Arc<Record>),
    /// Present on disk but not usable; the message says why.
    Unreadable(Arc<str>),
}

/// The state directory, locked for this process's lifetime.
pub struct Store {
    layout: Layout,
    /// Held for its flock; released when the store is dropped.
    _lock: File,
    /// The epoch fence (see [`Fence`]).
    fence: Mutex<Fence>,
    /// Copy-on-write: readers take the current map for the price of an
    /// `Arc` clone, and a save copies it only while a reader still holds
    /// the old one.
    records: RwLock<Records>,
    /// How many slots are unreadable: the step asks every tick, and the
    /// answer is almost always none.
    unreadable: AtomicUsize,
}

static DELETE_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A record saved by [`Store::save_visible`] whose name is not yet durable:
/// hand it to [`Store::make_durable`].
#[must_use = "a record's save is durable only once make_durable has run"]
#[derive(Debug)]
pub struct Unsynced {
    vm_id: Id,
    /// Its VM's directory was made by this save.
    new_dir: bool,
}

impl Store {
    /// Opens (creating if needed) the state dir at `root` and takes its
    /// lock. Fails at once, naming the dir, when another agent holds it.
    pub fn open(root: &Path) -> Result<Store, StoreError> {
        Store::open_within(root, Duration::ZERO)
    }

    /// As [`Store::open`], but a lock held by another process is waited
    /// for, up to `patience`, saying so once with who holds it: the agent
    /// that held it may be on its way out (a supervisor's restart, or a
    /// child it forked that has not yet closed its copy of the fd), and a
    /// new agent that exits at once leaves the host unreported until it
    /// is started again. Past `patience` it fails as [`Store::open`] does.
    pub fn open_within(root: &Path, patience: Duration) -> Result<Store, StoreError> {
        let layout = Layout::new(root);
        for dir in [
            root.to_path_buf(),
            layout.vms(),
            layout.images(),
            layout.volumes(),
        ] {
            super::perms::make_dir(&dir).map_err(|source| StoreError::CreateDir {
                path: dir.clone(),
                source,
            })?;
        }
        // Before the lock is opened: a lock others could open, they could
        // hold (flock needs only read access), and the agent would not start.
        let changed = super::perms::tighten(root).map_err(|source| StoreError::Tighten {
            path: root.to_path_buf(),
            source,
        })?;
        if changed > 0 {
            log::warn!(
                "made {changed} entries under {} private to root (files 0600, dirs 0700, the state dir, vms/ and volumes/ 0711)",
                root.display()
            );
        }
        let lock_path = layout.lock();
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(super::perms::FILE)
            .open(&lock_path)
            .map_err(|source| StoreError::OpenLock {
                path: lock_path.clone(),
                source,
            })?;
        take_lock(&lock, root, &lock_path, patience)?;
        let fence = Fence::read(&layout);
        let records = scan_records(&layout.vms())?;
        Ok(Store {
            layout,
            _lock: lock,
            fence: Mutex::new(fence),
            unreadable: AtomicUsize::new(count_unreadable(&records)),
            records: RwLock::new(Records {
                map: Arc::new(records),
                generation: 0,
            }),
        })
    }

    /// The state dir.
    pub fn root(&self) -> &Path {
        self.layout.state_dir()
    }

    /// Where everything under the state dir is.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The highest accepted epoch. An epoch file that could not be read at
    /// open counts as 0 (and was logged): failing open means the next
    /// snapshot is accepted rather than the host refusing all work.
    pub fn epoch(&self) -> u64 {
        self.fence.lock().epoch
    }

    /// Sets the fence to `epoch`, lower or not: the operator's own move
    /// (`eitri-agent epoch --set`), of a stopped agent's state dir.
    pub fn reset_epoch(&self, epoch: u64) -> Result<(), StoreError> {
        self.move_fence(|fence| fence.at(epoch))
    }

    /// Records `epoch` as accepted. Only ever raises it; an equal epoch (the
    /// same snapshot repeated every tick) costs no write.
    pub fn save_epoch(&self, epoch: u64) -> Result<(), StoreError> {
        if epoch <= self.epoch() {
            return Ok(());
        }
        self.move_fence(|fence| fence.at(epoch.max(fence.epoch)))
    }

    /// Whether the signed reset whose signed bytes have `digest` was
    /// obeyed (see [`Fence`]).
    pub fn reset_obeyed(&self, digest: &[u8; 32]) -> bool {
        self.fence.lock().obeyed(digest)
    }

    /// Sets the fence to `epoch`, lower or not, for desired state signed
    /// by a pinned key that asks for it (`epoch_reset`, as a control plane
    /// restored from a backup does), remembering that reset (`digest`) in
    /// the same write, so it is obeyed once.
    pub fn obey_reset(&self, epoch: u64, digest: &[u8; 32]) -> Result<(), StoreError> {
        self.move_fence(|fence| fence.reset_by(epoch, digest))
    }

    fn move_fence(&self, to: impl FnOnce(&Fence) -> Fence) -> Result<(), StoreError> {
        let mut fence = self.fence.lock();
        let moved = to(&fence);
        moved
            .write(&self.layout)
            .map_err(|source| StoreError::WriteEpoch {
                path: self.layout.fence(),
                source,
            })?;
        *fence = moved;
        Ok(())
    }

    /// Every record, from memory: a consistent view that later saves do
    /// not change.
    pub fn load_all(&self) -> Arc<BTreeMap<Id, RecordSlot>> {
        Arc::clone(&self.records.read().map)
    }

    /// Every record, with the count of changes made to them: two loads
    /// with the same count hold the same records. What compares records
    /// across steps keeps the count, not the map (a held map would make
    /// every save copy it whole).
    pub fn load_all_counted(&self) -> (u64, Arc<BTreeMap<Id, RecordSlot>>) {
        let records = self.records.read();
        (records.generation, Arc::clone(&records.map))
    }

    /// Reads again, from disk, the records that were unreadable, and only
    /// those: an operator's repair (or removal) of a bad record is noticed
    /// within a tick, while every other read stays in memory. Returns the
    /// VMs whose record became readable.
    pub fn reread_unreadable(&self) -> Vec<Id> {
        if self.unreadable.load(Ordering::Relaxed) == 0 {
            return Vec::new();
        }
        let unreadable: Vec<Id> = self
            .records
            .read()
            .map
            .iter()
            .filter(|(_, slot)| matches!(slot, RecordSlot::Unreadable(_)))
            .map(|(id, _)| id.clone())
            .collect();
        let mut repaired = Vec::new();
        for vm_id in unreadable {
            let now = match fs::read(self.layout.record(&vm_id)) {
                Ok(bytes) => Some(decode(&vm_id, &bytes)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => Some(RecordSlot::Unreadable(e.to_string().into())),
            };
            let mut records = self.records.write();
            let map = records.change();
            match now {
                Some(RecordSlot::Readable(rec)) => {
                    map.insert(vm_id.clone(), RecordSlot::Readable(rec));
                    repaired.push(vm_id);
                }
                Some(unreadable) => {
                    map.insert(vm_id, unreadable);
                }
                // Removed: the VM has no record any more.
                None => {
                    map.remove(&vm_id);
                }
            }
        }
        let left = count_unreadable(&self.records.read().map);
        self.unreadable.store(left, Ordering::Relaxed);
        repaired
    }

    /// One VM's record: `Ok(None)` when there is none, `Err` when there is
    /// one that cannot be read.
    pub fn get(&self, vm_id: &Id) -> Result<Option<Arc<Record>>, StoreError> {
        match self.records.read().map.get(vm_id) {
            None => Ok(None),
            Some(RecordSlot::Readable(rec)) => Ok(Some(Arc::clone(rec))),
            Some(RecordSlot::Unreadable(problem)) => Err(StoreError::UnreadableRecord {
                vm_id: vm_id.clone(),
                path: self.layout.record(vm_id),
                problem: problem.to_string(),
            }),
        }
    }

    /// Saves a record durably, then updates the in-memory copy. A failed
    /// save changes neither.
    pub fn save(&self, rec: &Record) -> Result<(), StoreError> {
        let unsynced = self.save_visible(rec)?;
        self.make_durable(unsynced)
    }

    /// The first half of [`Store::save`]: the record's bytes durable and
    /// its name in place, so an agent started after a crash reads it, and
    /// the in-memory copy updated; but the name not yet durable, so a power
    /// cut may still leave the VM's previous record, or none.
    /// [`Store::make_durable`] finishes it.
    ///
    /// For a create, whose attempt must be recorded before its side effects
    /// and durable before its VMM starts: the name's fsyncs run beside the
    /// making of the root disk and seed, where taken at once they were
    /// one more wait on the way to the VMM (`make bench-create`).
    pub fn save_visible(&self, rec: &Record) -> Result<Unsynced, StoreError> {
        let _span = crate::stages::span("record save");
        let vm_id = &rec.spec.vm_id;
        let dir = self.layout.vm_dir(vm_id);
        let write_err = |path: PathBuf| {
            move |source| StoreError::WriteRecord {
                vm_id: vm_id.clone(),
                path,
                source,
            }
        };
        let new_dir = !dir.is_dir();
        if new_dir {
            super::perms::make_dir_in(&dir).map_err(write_err(dir.clone()))?;
        }
        let bytes = serde_json::to_vec_pretty(&Envelope {
            format: RECORD_FORMAT,
            record: rec,
        })
        .map_err(|source| StoreError::EncodeRecord {
            vm_id: vm_id.clone(),
            source,
        })?;
        let path = self.layout.record(vm_id);
        write_then_rename(&path, &bytes).map_err(write_err(path.clone()))?;
        let was = self
            .records
            .write()
            .change()
            .insert(vm_id.clone(), RecordSlot::Readable(Arc::new(rec.clone())));
        if matches!(was, Some(RecordSlot::Unreadable(_))) {
            self.unreadable.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(Unsynced {
            vm_id: vm_id.clone(),
            new_dir,
        })
    }

    /// The second half of [`Store::save`]: the record's name made durable
    /// (its directory fsynced, and for a VM's first record the directory
    /// that names it).
    pub fn make_durable(&self, unsynced: Unsynced) -> Result<(), StoreError> {
        let _span = crate::stages::span("record sync");
        let Unsynced { vm_id, new_dir } = unsynced;
        let dir = self.layout.vm_dir(&vm_id);
        let sync = |path: PathBuf| {
            sync_dir(&path).map_err(|source| StoreError::WriteRecord {
                vm_id: vm_id.clone(),
                path,
                source,
            })
        };
        sync(dir)?;
        if new_dir {
            // The new directory's own name must survive a crash too.
            sync(self.layout.vms())?;
        }
        Ok(())
    }

    /// Deletes a VM: its record and everything in its directory (root disk,
    /// seed, host key, …). Volumes live elsewhere and are never touched.
    ///
    /// The directory is first renamed aside (atomic, durable), so after a
    /// crash the VM is either wholly present or gone; the renamed leftovers
    /// are removed then, or at the next open.
    pub fn delete(&self, vm_id: &Id) -> Result<(), StoreError> {
        let dir = self.layout.vm_dir(vm_id);
        let vms = self.layout.vms();
        let n = DELETE_COUNTER.fetch_add(1, Ordering::Relaxed);
        let aside = vms.join(format!(
            "{DELETING_PREFIX}{vm_id}-{}-{n}",
            std::process::id()
        ));
        let delete_err = |source| StoreError::DeleteVm {
            vm_id: vm_id.clone(),
            path: dir.clone(),
            source,
        };
        match fs::rename(&dir, &aside) {
            Ok(()) => {
                sync_dir(&vms).map_err(delete_err)?;
                crate::crash::point("store.delete-renamed");
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(delete_err(e)),
        }
        let was = self.records.write().change().remove(vm_id);
        if matches!(was, Some(RecordSlot::Unreadable(_))) {
            self.unreadable.fetch_sub(1, Ordering::Relaxed);
        }
        if let Err(e) = fs::remove_dir_all(&aside)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            log::warn!(
                "VM {vm_id} is deleted but {} could not be removed: {e}; it is retried at the next start",
                aside.display()
            );
        }
        Ok(())
    }
}

/// What [`Store::sweep`] removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    pub temp_files: usize,
    pub half_deleted_vms: usize,
}

impl Store {
    /// Removes what crashed writers left behind, in every directory the
    /// agent writes (the root, each VM's, `net/`, `volumes/`, `images/`):
    /// stray temp files, and VM directories that were mid-delete. Only safe
    /// under the lock and before any writer starts, i.e. at start-up
    /// recovery.
    pub fn sweep(&self) -> Swept {
        sweep(self.layout.state_dir())
    }
}

fn sweep(root: &Path) -> Swept {
    let mut swept = Swept::default();
    let vms = root.join("vms");
    // The state dir and every directory in it (net/, volumes/, images/,
    // jail/, and any a later agent adds), then each VM's.
    let mut dirs = vec![root.to_path_buf()];
    if let Ok(entries) = fs::read_dir(root) {
        dirs.extend(
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir() && *p != vms),
        );
    }
    if let Ok(entries) = fs::read_dir(&vms) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(DELETING_PREFIX) {
                match fs::remove_dir_all(entry.path()) {
                    Ok(()) => swept.half_deleted_vms += 1,
                    Err(e) => log::warn!("cannot finish deleting {}: {e}", entry.path().display()),
                }
            } else if entry.path().is_dir() {
                dirs.push(entry.path());
            }
        }
    }
    for dir in dirs {
        match remove_stray_temps(&dir) {
            Ok(n) => swept.temp_files += n,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => log::warn!("cannot sweep temp files in {}: {e}", dir.display()),
        }
    }
    swept
}

/// The records, and how many times they have changed.
struct Records {
    map: Arc<BTreeMap<Id, RecordSlot>>,
    generation: u64,
}

impl Records {
    /// The map, to change (copied first if a reader holds it), counted.
    fn change(&mut self) -> &mut BTreeMap<Id, RecordSlot> {
        self.generation += 1;
        Arc::make_mut(&mut self.map)
    }
}

fn count_unreadable(records: &BTreeMap<Id, RecordSlot>) -> usize {
    records
        .values()
        .filter(|slot| matches!(slot, RecordSlot::Unreadable(_)))
        .count()
}

/// Takes the state dir's lock (see [`Store::open_within`]): at once, or
/// within `patience`, polled every 50 ms.
fn take_lock(
    lock: &File,
    root: &Path,
    lock_path: &Path,
    patience: Duration,
) -> Result<(), StoreError> {
    let started = Instant::now();
    let mut said = false;
    loop {
        match lock.try_lock() {
            Ok(()) => {
                if said {
                    log::info!(
                        "took the lock of state dir {} after {:.1} s",
                        root.display(),
                        started.elapsed().as_secs_f64()
                    );
                }
                return Ok(());
            }
            // Who holds it is read from /proc only when it is said: once
            // on the way in, once on giving up, not at every poll.
            Err(TryLockError::WouldBlock) if started.elapsed() >= patience => {
                return Err(StoreError::Locked {
                    dir: root.to_path_buf(),
                    holders: super::holders::holders(lock_path),
                });
            }
            Err(TryLockError::WouldBlock) => {
                if !said {
                    said = true;
                    log::warn!(
                        "state dir {} is locked ({}); waiting up to {} s for it to be let go",
                        root.display(),
                        super::holders::describe(&super::holders::holders(lock_path)),
                        patience.as_secs()
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(TryLockError::Error(source)) => {
                return Err(StoreError::OpenLock {
                    path: lock_path.to_path_buf(),
                    source,
                });
            }
        }
    }
}

/// Every record of the state dir at `layout`, read without its lock: for
/// a reader beside a running agent (whose saves are atomic renames).
pub fn read_records(layout: &Layout) -> Result<BTreeMap<Id, RecordSlot>, StoreError> {
    scan_records(&layout.vms())
}

fn scan_records(vms: &Path) -> Result<BTreeMap<Id, RecordSlot>, StoreError> {
    let scan_err = |source| StoreError::ScanDir {
        path: vms.to_path_buf(),
        source,
    };
    let mut records = BTreeMap::new();
    for entry in fs::read_dir(vms).map_err(scan_err)? {
        let entry = entry.map_err(scan_err)?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.starts_with('.') || is_temp_name(name) {
            continue;
        }
        let Ok(vm_id) = Id::parse(name) else {
            log::warn!(
                "ignoring {}: not a VM id this agent would have written",
                entry.path().display()
            );
            continue;
        };
        let path = entry.path().join(RECORD_FILE);
        match fs::read(&path) {
            Ok(bytes) => {
                records.insert(vm_id.clone(), decode(&vm_id, &bytes));
            }
            // A directory with no record holds no VM: the record is always
            // written before anything else in it.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                records.insert(vm_id, RecordSlot::Unreadable(e.to_string().into()));
            }
        }
    }
    Ok(records)
}

fn decode(vm_id: &Id, bytes: &[u8]) -> RecordSlot {
    #[derive(serde::Deserialize)]
    struct Format {
        format: u32,
    }
    let format = match serde_json::from_slice::<Format>(bytes) {
        Ok(f) => f.format,
        Err(e) => return RecordSlot::Unreadable(format!("not a record: {e}").into()),
    };
    if format != RECORD_FORMAT {
        return RecordSlot::Unreadable(
            format!("record format {format}, this agent reads {RECORD_FORMAT}; was it written by a newer agent?").into(),
        );
    }
    match serde_json::from_slice::<Envelope<Record>>(bytes) {
        Ok(env) if env.record.spec.vm_id == *vm_id => RecordSlot::Readable(Arc::new(env.record)),
        Ok(env) => RecordSlot::Unreadable(
            format!(
                "it names VM {} but lives in the directory of {vm_id}",
                env.record.spec.vm_id
            )
            .into(),
        ),
        Err(e) => RecordSlot::Unreadable(format!("not a record: {e}").into()),
    }
}
