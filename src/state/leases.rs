//! A persisted pool of numbered slots, one per key, sticky until released:
//! guest addresses (keyed by MAC) and VMM user ids (keyed by VM id).
//!
//! 1. A key's first choice is derived from a seed (the VM id), so a VM
//!    usually gets the same slot on any host and across re-creation.
//! 2. A taken choice probes linearly to the next free slot.
//! 3. The map is written (temp → fsync → rename) **before** a slot is
//!    handed out, so a crash can never hand one out twice. [`Leases::reserve`]
//!    leaves the rename's own durability (the directory's fsync) to its
//!    caller, who makes it durable before anything outside the agent's
//!    books uses the slot: a crash before that forgets a slot nothing used.
//! 4. An unreadable map hands out nothing: starting from an empty one could
//!    give a live VM's slot to another.
//! 5. Readers never wait on the disk. Changes are written one at a time
//!    (`writing`), each as the whole next map, which readers see only once
//!    its write has succeeded. A VM asking for the slot it already holds
//!    (its tap's name at its start, its VMM's user) does not queue.
//! 6. Keys that ask while a write is under way are written together, by
//!    the first of them to get the turn (`waiting`): a burst of N creates
//!    costs a few writes and fsyncs of the map, not N one after another.
//!    One whose slot did not make it into a write (the pool full, the
//!    write failed) tries again on its own, so each learns its own fate.

use std::collections::{BTreeMap, HashSet};
use std::hash::Hash;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use super::atomic::{Pending, write_atomic, write_then_rename};

/// What a pool hands out: a value made from a slot number.
pub trait Slot: Copy + Eq + Hash + Serialize + DeserializeOwned + From<u32> {}

impl<T: Copy + Eq + Hash + Serialize + DeserializeOwned + From<u32>> Slot for T {}

#[derive(Debug)]
pub enum LeaseError {
    /// Every slot is taken.
    Full,
    Unreadable {
        path: PathBuf,
        problem: String,
    },
    Save {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The persisted key → slot map over the slots `first..first + size`.
pub struct Leases<V: Slot> {
    path: PathBuf,
    first: u32,
    size: u32,
    /// The map as last written: what readers see.
    map: Mutex<BTreeMap<String, V>>,
    /// Held through each change's write, so changes reach the file in the
    /// order they reach `map` (step 5).
    writing: Mutex<()>,
    /// Keys (and seeds) waiting for a slot, for the next write (step 6).
    waiting: Mutex<Vec<(String, String)>>,
}

impl<V: Slot> Leases<V> {
    /// Loads the map at `path` (absent = empty).
    pub fn open(path: &Path, first: u32, size: u32) -> Result<Leases<V>, LeaseError> {
        let unreadable = |problem: String| LeaseError::Unreadable {
            path: path.to_path_buf(),
            problem,
        };
        let map = match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| unreadable(e.to_string()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(unreadable(e.to_string())),
        };
        Ok(Leases {
            path: path.to_path_buf(),
            first,
            size,
            map: Mutex::new(map),
            writing: Mutex::new(()),
            waiting: Mutex::new(Vec::new()),
        })
    }

    pub fn get(&self, key: &str) -> Option<V> {
        self.map.lock().get(key).copied()
    }

    /// Every key holding a slot.
    pub fn keys(&self) -> Vec<String> {
        self.map.lock().keys().cloned().collect()
    }

    /// The VMs among the keys holding a slot (a key that names none, of
    /// an older format, is left out).
    pub fn vm_ids(&self) -> Vec<crate::model::Id> {
        let map = self.map.lock();
        map.keys()
            .filter_map(|key| crate::model::Id::parse(key).ok())
            .collect()
    }

    /// The key's slot: the one it has, or a new one (first choice from
    /// `seed`), saved before it is returned.
    pub fn allocate(&self, key: &str, seed: &str) -> Result<V, LeaseError> {
        let (slot, waited) = self.take(key, seed, write_then_rename)?;
        if waited {
            // Whichever write carried it, its name is made durable here.
            Pending::renamed(&self.path)
                .sync()
                .map_err(|source| self.save_error(source))?;
        }
        Ok(slot)
    }

    /// As [`Leases::allocate`], the map's bytes durable and in place when
    /// it returns, its name durable once the returned [`Pending`] is
    /// synced: for a caller with other durable writes to wait for, which
    /// syncs them all at once. The pending sync is returned for a slot
    /// the key had too: an earlier reserve's may never have been made.
    pub fn reserve(&self, key: &str, seed: &str) -> Result<(V, Pending), LeaseError> {
        let (slot, _) = self.take(key, seed, write_then_rename)?;
        Ok((slot, Pending::renamed(&self.path)))
    }

    /// The key's slot, and whether it had to wait for a write (step 6:
    /// its own, or another key's that carried it).
    fn take(
        &self,
        key: &str,
        seed: &str,
        write: fn(&Path, &[u8]) -> std::io::Result<()>,
    ) -> Result<(V, bool), LeaseError> {
        if let Some(v) = self.get(key) {
            return Ok((v, false));
        }
        self.waiting.lock().push((key.to_owned(), seed.to_owned()));
        let _writing = self.writing.lock();
        if let Some(v) = self.get(key) {
            // A write made while this one waited carried it.
            return Ok((v, true));
        }
        let mut asking = std::mem::take(&mut *self.waiting.lock());
        if !asking.iter().any(|(k, _)| k == key) {
            // Taken into a write that failed, or that found no slot for
            // it: asked again, so that its own answer is its own.
            asking.push((key.to_owned(), seed.to_owned()));
        }
        let mut next = self.map.lock().clone();
        for (k, s) in &asking {
            if !next.contains_key(k)
                && let Some(slot) = self.free_slot(&next, s)
            {
                next.insert(k.clone(), slot);
            }
        }
        let slot = next.get(key).copied();
        if next.len() > self.map.lock().len() {
            self.commit(next, write)?;
        }
        slot.map(|v| (v, true)).ok_or(LeaseError::Full)
    }

    /// The first free slot of `map` from `seed`'s first choice on.
    fn free_slot(&self, map: &BTreeMap<String, V>, seed: &str) -> Option<V> {
        if self.size == 0 {
            return None;
        }
        let digest = Sha256::digest(seed.as_bytes());
        let start = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]) % self.size;
        let taken: HashSet<V> = map.values().copied().collect();
        (0..self.size)
            .map(|i| V::from(self.first + (start + i) % self.size))
            .find(|v| !taken.contains(v))
    }

    /// Frees the key's slot.
    pub fn release(&self, key: &str) -> Result<(), LeaseError> {
        if self.get(key).is_none() {
            return Ok(());
        }
        let _writing = self.writing.lock();
        let mut next = self.map.lock().clone();
        if next.remove(key).is_some() {
            self.commit(next, write_atomic)?;
        }
        Ok(())
    }

    /// Writes `next` and makes it what readers see; the caller holds
    /// `writing`. A failed write leaves both as they were.
    fn commit(
        &self,
        next: BTreeMap<String, V>,
        write: fn(&Path, &[u8]) -> std::io::Result<()>,
    ) -> Result<(), LeaseError> {
        self.save(&next, write)
            .map_err(|source| self.save_error(source))?;
        *self.map.lock() = next;
        Ok(())
    }

    fn save_error(&self, source: std::io::Error) -> LeaseError {
        LeaseError::Save {
            path: self.path.clone(),
            source,
        }
    }

    fn save(
        &self,
        map: &BTreeMap<String, V>,
        write: fn(&Path, &[u8]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        if let Some(dir) = self.path.parent() {
            super::perms::make_dir_in(dir)?;
        }
        write(
            &self.path,
            &serde_json::to_vec_pretty(map).map_err(std::io::Error::other)?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reserved_slot_is_in_the_saved_map_before_its_name_is_synced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ids.json");
        let leases = Leases::<u32>::open(&path, 100, 10).expect("open");

        let (slot, pending) = leases.reserve("vm-1", "vm-1").expect("reserve");

        let reread = Leases::<u32>::open(&path, 100, 10).expect("reopen");
        assert_eq!(reread.get("vm-1"), Some(slot));
        pending.sync().expect("the name made durable");
    }

    #[test]
    fn a_reserve_gives_the_slot_an_allocate_gave_before() {
        let dir = tempfile::tempdir().expect("tempdir");
        let leases = Leases::<u32>::open(&dir.path().join("ids.json"), 100, 10).expect("open");
        let allocated = leases.allocate("vm-1", "vm-1").expect("allocate");

        let (reserved, pending) = leases.reserve("vm-1", "vm-1").expect("reserve");

        assert_eq!(reserved, allocated);
        pending.sync().expect("sync");
    }

    /// One test at a time holds a write (`HELD` is the process's).
    static ONE_AT_A_TIME: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

    /// A write that waits, once it has begun, until the test lets it go on.
    static HELD: parking_lot::Mutex<Option<(Sender, Receiver)>> = parking_lot::Mutex::new(None);
    type Sender = std::sync::mpsc::Sender<()>;
    type Receiver = std::sync::mpsc::Receiver<()>;

    fn held_write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        if let Some((begun, go_on)) = HELD.lock().as_ref() {
            let _ = begun.send(());
            let _ = go_on.recv_timeout(std::time::Duration::from_secs(10));
        }
        write_atomic(path, bytes)
    }

    /// `leases` with "vm-2"'s slot being taken on a thread whose write is
    /// held; the returned sender lets it go on (and the guard is held
    /// until the test ends).
    fn with_a_write_held(
        leases: std::sync::Arc<Leases<u32>>,
    ) -> (
        Sender,
        std::thread::JoinHandle<Result<u32, LeaseError>>,
        parking_lot::MutexGuard<'static, ()>,
    ) {
        let one = ONE_AT_A_TIME.lock();
        let (begun_tx, begun) = std::sync::mpsc::channel();
        let (go_on, go_on_rx) = std::sync::mpsc::channel();
        *HELD.lock() = Some((begun_tx, go_on_rx));
        let taking = std::thread::spawn(move || {
            leases
                .take("vm-2", "vm-2", held_write)
                .map(|(slot, _)| slot)
        });
        begun
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the write began");
        (go_on, taking, one)
    }

    #[test]
    fn a_slot_held_is_read_while_another_keys_write_is_under_way() {
        let dir = tempfile::tempdir().expect("tempdir");
        let leases = std::sync::Arc::new(
            Leases::<u32>::open(&dir.path().join("ids.json"), 100, 10).expect("open"),
        );
        let held = leases.allocate("vm-1", "vm-1").expect("allocate");
        let (go_on, taking, _one) = with_a_write_held(leases.clone());

        let (answer_tx, answer) = std::sync::mpsc::channel();
        let reader = leases.clone();
        std::thread::spawn(move || answer_tx.send(reader.allocate("vm-1", "vm-1").ok()));
        let read = answer.recv_timeout(std::time::Duration::from_secs(5));
        go_on.send(()).expect("the writer waits");
        taking.join().expect("the writer ends").expect("vm-2 taken");

        assert_eq!(read, Ok(Some(held)));
    }

    #[test]
    fn a_slot_is_not_seen_before_its_map_is_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        let leases = std::sync::Arc::new(
            Leases::<u32>::open(&dir.path().join("ids.json"), 100, 10).expect("open"),
        );
        let (go_on, taking, _one) = with_a_write_held(leases.clone());

        let during = leases.get("vm-2");
        go_on.send(()).expect("the writer waits");
        let taken = taking.join().expect("the writer ends").expect("vm-2 taken");

        assert_eq!((during, leases.get("vm-2")), (None, Some(taken)));
    }

    /// Writes made through `counted_write`.
    static WRITES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    fn counted_write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        WRITES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        write_atomic(path, bytes)
    }

    /// Each key asking on a thread of its own (`ask`), returned once all
    /// of them wait for the write under way.
    fn ask_while_held<T: Send + 'static>(
        leases: &std::sync::Arc<Leases<u32>>,
        keys: &[&'static str],
        ask: fn(&Leases<u32>, &'static str) -> T,
    ) -> Vec<std::thread::JoinHandle<T>> {
        let askers: Vec<_> = keys
            .iter()
            .map(|key| {
                let (leases, key) = (leases.clone(), *key);
                std::thread::spawn(move || ask(&leases, key))
            })
            .collect();
        let queued = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while leases.waiting.lock().len() < keys.len() && std::time::Instant::now() < queued {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        askers
    }

    #[test]
    fn keys_that_ask_during_a_write_are_written_together() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ids.json");
        let leases = std::sync::Arc::new(Leases::<u32>::open(&path, 100, 10).expect("open"));
        let (go_on, taking, _one) = with_a_write_held(leases.clone());
        WRITES.store(0, std::sync::atomic::Ordering::SeqCst);
        let askers = ask_while_held(&leases, &["vm-3", "vm-4", "vm-5"], |leases, key| {
            leases.take(key, key, counted_write)
        });

        go_on.send(()).expect("the writer waits");
        taking.join().expect("the writer ends").expect("vm-2 taken");
        let slots: HashSet<u32> = askers
            .into_iter()
            .map(|a| a.join().expect("an asker ends").expect("a slot").0)
            .collect();

        let reread = Leases::<u32>::open(&path, 100, 10).expect("reopen");
        let saved: HashSet<u32> = ["vm-3", "vm-4", "vm-5"]
            .iter()
            .filter_map(|k| reread.get(k))
            .collect();
        assert_eq!(
            (
                WRITES.load(std::sync::atomic::Ordering::SeqCst),
                slots.len(),
                saved
            ),
            (1, 3, slots)
        );
    }

    #[test]
    fn a_key_with_no_slot_left_is_told_so_while_the_others_are_saved() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ids.json");
        let leases = std::sync::Arc::new(Leases::<u32>::open(&path, 100, 2).expect("open"));
        let (go_on, taking, _one) = with_a_write_held(leases.clone());
        let askers = ask_while_held(&leases, &["vm-3", "vm-4"], |leases, key| {
            leases.allocate(key, key).is_ok()
        });

        go_on.send(()).expect("the writer waits");
        taking.join().expect("the writer ends").expect("vm-2 taken");
        let answers: Vec<bool> = askers
            .into_iter()
            .map(|a| a.join().expect("an asker ends"))
            .collect();

        let reread = Leases::<u32>::open(&path, 100, 2).expect("reopen");
        assert_eq!(
            (
                answers.iter().filter(|ok| **ok).count(),
                reread.keys().len()
            ),
            (1, 2)
        );
    }
}
