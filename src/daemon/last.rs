//! The last accepted snapshot, kept in the state dir so an agent restarted
//! while its control plane is down keeps converging the host.
//!
//! A snapshot is taken on faith only when it proves it is whole: an empty
//! protobuf decodes as a valid, *empty* snapshot, and stepping that would
//! quarantine every VM on the host. So the file is framed:
//!
//! ```text
//! "EITRISNP" | format u32 LE | length u64 LE | sha256 of the payload | payload
//! ```
//!
//! Anything else (empty, short, another format, a length or digest that
//! does not match, a payload that does not decode, or the unframed file an
//! older agent wrote) is "no snapshot": the agent observes the host, as at
//! its very first start, and reaps nothing until desired state arrives.

use std::path::Path;

use prost::Message;
use sha2::{Digest, Sha256};

use crate::model::Snapshot;
use crate::pb::{self, convert};
use crate::source::Desired;
use crate::state::Store;
use crate::state::atomic::write_atomic;

const MAGIC: &[u8; 8] = b"EITRISNP";
const FORMAT: u32 = 1;
const HEADER: usize = 8 + 4 + 8 + 32;

/// Writes `wire` framed, durably, readable by the agent alone (it carries
/// user-data).
pub fn save(path: &Path, wire: &pb::Snapshot) -> std::io::Result<()> {
    let payload = wire.encode_to_vec();
    let mut bytes = Vec::with_capacity(HEADER + payload.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&FORMAT.to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&Sha256::digest(&payload));
    bytes.extend_from_slice(&payload);
    write_atomic(path, &bytes)
}

/// Why the last snapshot's file is not a whole snapshot.
#[derive(Debug)]
pub enum LastError {
    Read(std::io::Error),
    /// Too short, or without the magic: empty, torn, or an older agent's.
    NotFramed {
        bytes: usize,
    },
    Format {
        found: u32,
    },
    /// Its header says `said` bytes; it holds `held`.
    Torn {
        said: u64,
        held: usize,
    },
    Checksum,
    Decode(prost::DecodeError),
}

impl std::fmt::Display for LastError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LastError::Read(e) => write!(f, "cannot read it: {e}"),
            LastError::NotFramed { bytes } => write!(
                f,
                "it is not a framed snapshot ({bytes} bytes; an empty or torn file, or one an older agent wrote)"
            ),
            LastError::Format { found } => {
                write!(f, "its format is {found}, this agent reads {FORMAT}")
            }
            LastError::Torn { said, held } => {
                write!(f, "it says {said} bytes and holds {held}: torn")
            }
            LastError::Checksum => f.write_str("its checksum does not match its content"),
            LastError::Decode(e) => write!(f, "it does not decode: {e}"),
        }
    }
}

impl std::error::Error for LastError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LastError::Read(e) => Some(e),
            LastError::Decode(e) => Some(e),
            _ => None,
        }
    }
}

/// The snapshot at `path`: `Ok(None)` when there is no file, `Err` (why)
/// when there is one that is not a whole snapshot.
pub fn load(path: &Path) -> Result<Option<pb::Snapshot>, LastError> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(LastError::Read(e)),
    };
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return Err(LastError::NotFramed { bytes: bytes.len() });
    }
    let field = |at: usize, len: usize| &bytes[at..at + len];
    let format = u32::from_le_bytes(field(8, 4).try_into().unwrap_or([0; 4]));
    if format != FORMAT {
        return Err(LastError::Format { found: format });
    }
    let len = u64::from_le_bytes(field(12, 8).try_into().unwrap_or([0; 8]));
    let payload = &bytes[HEADER..];
    if payload.len() as u64 != len {
        return Err(LastError::Torn {
            said: len,
            held: payload.len(),
        });
    }
    if Sha256::digest(payload).as_slice() != field(20, 32) {
        return Err(LastError::Checksum);
    }
    pb::Snapshot::decode(payload)
        .map(Some)
        .map_err(LastError::Decode)
}

/// The image digests the snapshot at `path` names (none when there is no
/// file): what `images prune` keeps so that the agent need not fetch them
/// again.
pub fn images_named(path: &Path) -> Result<std::collections::HashSet<String>, LastError> {
    Ok(load(path)?
        .map(|snap| snap.vms.into_iter().map(|vm| vm.image_sha256).collect())
        .unwrap_or_default())
}

/// The last accepted snapshot a previous agent persisted, read and checked.
pub(super) fn load_last(store: &Store) -> Option<(Desired, Snapshot)> {
    let path = store.layout().last_snapshot();
    match load(&path) {
        Ok(None) => None,
        Ok(Some(wire)) => {
            let snap = convert::snapshot_from_wire(&wire);
            Some((
                Desired {
                    wire,
                    ..Desired::default()
                },
                snap,
            ))
        }
        // Observed instead, as at a first start: nothing is reaped until
        // desired state comes.
        Err(why) => {
            log::warn!(
                "ignoring the last snapshot at {}: {why}; observing the host until desired state comes",
                path.display()
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap() -> pb::Snapshot {
        pb::Snapshot {
            epoch: 7,
            vms: vec![pb::VmSpec {
                vm_id: "vm-1".into(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn a_saved_snapshot_loads_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("snapshot.pb");
        save(&path, &snap()).expect("save");

        assert_eq!(load(&path).ok(), Some(Some(snap())));
    }

    #[test]
    fn an_empty_file_is_no_snapshot_not_an_empty_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("snapshot.pb");
        std::fs::write(&path, b"").expect("empty");

        assert!(load(&path).is_err());
    }

    #[test]
    fn a_torn_or_altered_snapshot_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("snapshot.pb");
        save(&path, &snap()).expect("save");
        let whole = std::fs::read(&path).expect("read");

        std::fs::write(&path, &whole[..whole.len() - 1]).expect("torn");
        let torn = load(&path);
        let mut altered = whole.clone();
        let last = altered.len() - 1;
        altered[last] ^= 1;
        std::fs::write(&path, &altered).expect("altered");
        let changed = load(&path);

        assert!(matches!(torn, Err(LastError::Torn { .. })));
        assert!(matches!(changed, Err(LastError::Checksum)));
    }

    #[test]
    fn an_unframed_snapshot_of_an_older_agent_is_no_snapshot() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("snapshot.pb");
        std::fs::write(&path, snap().encode_to_vec()).expect("old format");

        assert!(load(&path).is_err());
    }
}
