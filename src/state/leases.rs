//! A persisted pool of numbered slots, one per key, sticky until released:
//! guest addresses (keyed by MAC) and VMM user ids (keyed by VM id).
//!
//! 1. A key's first choice is derived from a seed (the VM id), so a VM
//!    usually gets the same slot on any host and across re-creation.
//! 2. A taken choice probes linearly to the next free slot.
//! 3. The map is written (temp → fsync → rename) **before** a slot is
//!    handed out, so a crash can never hand one out twice.
//! 4. An unreadable map hands out nothing: starting from an empty one could
//!    give a live VM's slot to another.

use std::collections::{BTreeMap, HashSet};
use std::hash::Hash;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use super::atomic::write_atomic;

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
    map: Mutex<BTreeMap<String, V>>,
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
        let mut map = self.map.lock();
        if let Some(v) = map.get(key) {
            return Ok(*v);
        }
        if self.size == 0 {
            return Err(LeaseError::Full);
        }
        let digest = Sha256::digest(seed.as_bytes());
        let start = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]) % self.size;
        let taken: HashSet<V> = map.values().copied().collect();
        let slot = (0..self.size)
            .map(|i| V::from(self.first + (start + i) % self.size))
            .find(|v| !taken.contains(v))
            .ok_or(LeaseError::Full)?;
        map.insert(key.to_owned(), slot);
        if let Err(source) = self.save(&map) {
            map.remove(key);
            return Err(LeaseError::Save {
                path: self.path.clone(),
                source,
            });
        }
        Ok(slot)
    }

    /// Frees the key's slot.
    pub fn release(&self, key: &str) -> Result<(), LeaseError> {
        let mut map = self.map.lock();
        if map.remove(key).is_some() {
            self.save(&map).map_err(|source| LeaseError::Save {
                path: self.path.clone(),
                source,
            })?;
        }
        Ok(())
    }

    fn save(&self, map: &BTreeMap<String, V>) -> std::io::Result<()> {
        if let Some(dir) = self.path.parent() {
            super::perms::make_dir_in(dir)?;
        }
        write_atomic(
            &self.path,
            &serde_json::to_vec_pretty(map).map_err(std::io::Error::other)?,
        )
    }
}
