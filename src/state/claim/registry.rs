//! The host-wide registry of claims (`--agents-dir`): one record per
//! state dir, named by its path's digest, written and read under one lock,
//! owned by the agent's user and by nobody else; and what `status` lists
//! of it.

use std::fs;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{Claim, ClaimError, Reclaim, SLOTS};

/// One claim of the host, as `status` lists it: whose it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    pub claim: Claim,
    pub agent: Holding,
}

/// Whether a claim's agent runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holding {
    /// Its state dir's lock is held, by these processes.
    Running(Vec<crate::state::holders::Holder>),
    /// Its state dir is there, and no agent holds it.
    Stopped,
    /// Its state dir is gone: the next agent to start takes the claim back.
    Gone,
}

/// Every claim recorded in `registry`, by state dir. Read without the
/// registry's lock: a look, not a change.
pub fn list(registry: &Path) -> io::Result<Vec<Listed>> {
    let (live, ended) = records(registry)?;
    let mut out: Vec<Listed> = live
        .into_iter()
        .map(|(_, claim)| {
            let lock = crate::state::Layout::new(&claim.state_dir).lock();
            let holders = crate::state::holders::holders(&lock);
            let agent = if holders.is_empty() {
                Holding::Stopped
            } else {
                Holding::Running(holders)
            };
            Listed { claim, agent }
        })
        .chain(ended.into_iter().map(|(_, claim)| Listed {
            claim,
            agent: Holding::Gone,
        }))
        .collect();
    out.sort_by(|a, b| a.claim.state_dir.cmp(&b.claim.state_dir));
    Ok(out)
}

/// Takes the registry's lock (made, with the registry, when missing). The
/// lock file is never followed through a symlink: root would create or
/// lock whatever file it pointed at.
pub(super) fn lock_registry(registry: &Path) -> io::Result<fs::File> {
    fs::create_dir_all(registry)?;
    only_its_owner_writes(registry)?;
    let lock = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(registry.join(".lock"))?;
    lock.lock()?;
    Ok(lock)
}

/// The registry decides which ids, cgroup roots and bridges an agent may
/// take, and what the reaper takes back from the host: a registry others
/// can write is one where anybody plants a claim that blocks every agent,
/// or points the reaper at what is not its. Refused, naming the fix.
pub(super) fn only_its_owner_writes(registry: &Path) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::metadata(registry)?;
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() == me && meta.mode() & 0o022 == 0 {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "it is owned by uid {} with mode {:o}, so others could plant or change claims in it; make it this agent's user's ({me}) and not writable by group or others (chown {me} DIR; chmod go-w DIR)",
        meta.uid(),
        meta.mode() & 0o7777
    )))
}

/// Ends the claim recorded in `record`, whose state dir is gone: what it
/// left is taken back and its record removed; what could not be taken is
/// said, and the record kept to be tried at the next start.
pub(super) fn end(record: &Path, claim: &Claim, reclaim: &dyn Reclaim) {
    let dir = claim.state_dir.display();
    let reclaimed = reclaim.take_back(claim);
    if !reclaimed.taken.is_empty() {
        log::info!(
            "the state dir {dir} is gone: took back what its agent left ({})",
            reclaimed.taken.join(", ")
        );
    }
    if reclaimed.left.is_empty() {
        if let Err(e) = fs::remove_file(record) {
            log::warn!("could not remove {}: {e}", record.display());
        }
    } else {
        log::warn!(
            "the state dir {dir} is gone, but what its agent left could not all be taken back: {} (tried again at the next start)",
            reclaimed.left.join("; ")
        );
    }
}

pub(super) fn read_own(path: &Path) -> Result<Option<Claim>, ClaimError> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| ClaimError::Own {
                path: path.to_path_buf(),
                problem: e.to_string(),
            }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ClaimError::Own {
            path: path.to_path_buf(),
            problem: e.to_string(),
        }),
    }
}

/// Every agent's record in the registry (with its path), apart: those
/// whose state dir is there, and those whose state dir is gone (a test's
/// temp dir, a decommissioned agent), whose claims have ended. Unreadable
/// records are skipped.
pub(super) type Records = Vec<(PathBuf, Claim)>;

pub(super) fn records(registry: &Path) -> io::Result<(Records, Records)> {
    let (mut live, mut ended) = (Vec::new(), Vec::new());
    for entry in fs::read_dir(registry)? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let Some(claim) = fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Claim>(&b).ok())
        else {
            continue;
        };
        if claim.state_dir.is_dir() {
            live.push((path, claim));
        } else {
            ended.push((path, claim));
        }
    }
    Ok((live, ended))
}

pub(super) fn digest(state_dir: &Path) -> [u8; 32] {
    Sha256::digest(state_dir.as_os_str().as_encoded_bytes()).into()
}

pub(super) fn slot_of(state_dir: &Path) -> u32 {
    let d = digest(state_dir);
    u32::from_be_bytes([d[0], d[1], d[2], d[3]]) % SLOTS
}

pub(super) fn record_name(state_dir: &Path) -> String {
    format!("{}.json", crate::hex::encode(&digest(state_dir)[..8]))
}
