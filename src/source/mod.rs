//! Where desired state comes from, and where reports go: a control plane
//! over HTTP, or a local file in standalone mode. Either way the exchange
//! runs on its own thread (see `daemon::exchange`), so nothing local ever
//! waits on it.

mod file;
mod http;
#[cfg(target_os = "linux")]
mod watch;

use std::fmt;
use std::path::PathBuf;

#[cfg(target_os = "linux")]
use crossbeam_channel::Sender;

pub use file::FileSource;
pub use http::{ControlPlane, HttpSource, check_token_mode, url_addresses};
#[cfg(target_os = "linux")]
pub use watch::Watcher;

use crate::model::Rejected;
use crate::pb;

/// Bounds on one snapshot, checked before it is decoded: a small answer can
/// otherwise expand into gigabytes of entries (see `pb::prescan`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotLimits {
    /// The largest answer or desired file read, in bytes.
    pub max_bytes: u64,
    pub max_vms: usize,
    pub max_volumes: usize,
}

impl Default for SnapshotLimits {
    fn default() -> SnapshotLimits {
        SnapshotLimits {
            max_bytes: 16 << 20,
            max_vms: 10_000,
            max_volumes: 10_000,
        }
    }
}

impl SnapshotLimits {
    /// Refuses more entries than the limits allow, naming the flag to raise.
    pub fn check(&self, from: &str, vms: usize, volumes: usize) -> Result<(), SourceError> {
        let over = |what, count, max, flag| SourceError::TooManyEntries {
            from: from.to_owned(),
            what,
            count,
            max,
            flag,
        };
        if vms > self.max_vms {
            return Err(over("VM", vms, self.max_vms, "--max-vms"));
        }
        if volumes > self.max_volumes {
            return Err(over("volume", volumes, self.max_volumes, "--max-volumes"));
        }
        Ok(())
    }
}

/// Desired state as a source read it: the snapshot, and the entries the
/// source itself could not read (a desired-file entry with a bad type or an
/// unknown key). Those are refused one by one, as a bad entry from a
/// control plane is, and still claim their ids.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Desired {
    pub wire: pb::Snapshot,
    /// The pinned key that signed it; `None`: unauthenticated (no
    /// `--trusted-keys`).
    pub signed_by: Option<String>,
    pub refused_vms: Vec<Rejected>,
    pub refused_volumes: Vec<Rejected>,
    /// SHA-256 of the exact bytes it arrived as (a signed snapshot's signed
    /// bytes, a desired file's below its signature line), which each report
    /// names as what it answers; `None` for what an earlier agent
    /// persisted.
    pub digest: Option<[u8; 32]>,
}

/// What desired state must be besides well formed, from a control plane
/// or a file alike: signed (by `signed_by`), for this host; and not past
/// its `not_after` (see [`crate::trust::in_date`]).
pub(super) fn admissible(
    signed_by: Option<&str>,
    wire: &pb::Snapshot,
    this_host: &str,
) -> Result<(), crate::trust::Refusal> {
    if let Some(key_id) = signed_by {
        http::for_this_host(key_id, &wire.host_id, this_host)?;
    }
    crate::trust::in_date(
        signed_by.unwrap_or(""),
        wire.not_after_unix_ms,
        std::time::SystemTime::now(),
    )
}

/// The SHA-256 of `bytes`, as [`Desired::digest`] holds it.
pub(crate) fn digest_of(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

pub trait Source: Send {
    /// Fetches desired state; `Ok(None)` when there is nothing new (a file
    /// that did not change).
    fn fetch(&mut self, host: &pb::HostInfo) -> Result<Option<Desired>, SourceError>;

    /// Hands a report upward. A file source has no one to hand it to; its
    /// reports are the `report.json` the daemon writes anyway.
    fn send_report(&mut self, host: &pb::HostInfo, report: &pb::Report) -> Result<(), SourceError>;

    /// A remote source's snapshots carry an epoch that fences, and its
    /// failures back off. A file's do neither: standalone mode never fences.
    fn is_remote(&self) -> bool;

    /// Makes the next fetch read afresh (SIGHUP).
    fn reload(&mut self) {}

    /// What to call this source in logs and `status`.
    fn describe(&self) -> String;

    /// Starts telling `changed` whenever there is something new to fetch
    /// before the next contact would look (the desired file was written).
    /// `Ok(None)`: nothing to watch; the tick is the only trigger.
    #[cfg(target_os = "linux")]
    fn watch(&mut self, _changed: Sender<()>) -> std::io::Result<Option<Watcher>> {
        Ok(None)
    }
}

/// Why a fetch or a report did not go through.
#[derive(Debug)]
pub enum SourceError {
    /// The request did not complete: refused, reset, timed out.
    Unreachable {
        url: String,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// 401 or 403.
    TokenRejected {
        url: String,
        status: u16,
    },
    Status {
        url: String,
        status: u16,
    },
    /// A 3xx: redirects are refused, since a redirected POST loses its body
    /// or its token, and may land on another host.
    Redirected {
        url: String,
        status: u16,
        location: String,
    },
    /// The answer was not a message of the expected type.
    Garbage {
        url: String,
        problem: String,
    },
    TooLarge {
        url: String,
        limit: u64,
    },
    /// Desired state that is not signed as this host requires: nothing in
    /// it is read further.
    Refused {
        from: String,
        why: crate::trust::Refusal,
    },
    /// More entries than the agent takes, counted before decoding.
    TooManyEntries {
        from: String,
        what: &'static str,
        count: usize,
        max: usize,
        flag: &'static str,
    },
    Token {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The token file is readable by group or others.
    TokenMode {
        path: PathBuf,
        mode: u32,
    },
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The desired file is not a valid Snapshot as a whole; the previous
    /// desired state stands. Said at every contact until the file changes.
    Malformed {
        path: PathBuf,
        line: usize,
        column: usize,
        problem: String,
    },
}

impl SourceError {
    /// A short name for the kind of failure, for the metrics file.
    /// Why the control plane's answer was refused, for the report, when it
    /// was one: it answered, and the answer was not taken. `None` for an
    /// outage (unreachable, a status, a rejected token) or a local error.
    pub fn refusal(&self) -> Option<crate::pb::DesiredRefused> {
        use crate::trust::Refusal;
        let (kind, key_id) = match self {
            SourceError::Refused { why, .. } => match why {
                Refusal::Unsigned { .. } => ("unsigned", ""),
                Refusal::UnknownKey { key_id } => ("unknown_key", key_id.as_str()),
                Refusal::BadSignature { key_id } => ("bad_signature", key_id.as_str()),
                Refusal::OtherHost { key_id, .. } => ("other_host", key_id.as_str()),
                Refusal::Expired { key_id, .. } => ("expired", key_id.as_str()),
            },
            SourceError::TooLarge { .. } => ("too_large", ""),
            SourceError::TooManyEntries { .. } => ("too_many_entries", ""),
            SourceError::Garbage { .. } => ("garbage", ""),
            _ => return None,
        };
        Some(crate::pb::DesiredRefused {
            kind: kind.into(),
            reason: crate::error::chain(self),
            key_id: key_id.into(),
        })
    }

    pub fn kind(&self) -> &'static str {
        match self {
            SourceError::Unreachable { .. } => "unreachable",
            SourceError::TokenRejected { .. } => "token_rejected",
            SourceError::Status { .. } => "status",
            SourceError::Redirected { .. } => "redirected",
            SourceError::Garbage { .. } => "garbage",
            SourceError::TooLarge { .. } => "too_large",
            SourceError::TooManyEntries { .. } => "too_many_entries",
            SourceError::Refused { .. } => "refused",
            SourceError::Token { .. } => "token_unreadable",
            SourceError::TokenMode { .. } => "token_mode",
            SourceError::ReadFile { .. } => "read_file",
            SourceError::Malformed { .. } => "malformed",
        }
    }
}

impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourceError::Unreachable { url, .. } => {
                write!(f, "cannot reach the control plane at {url}")
            }
            SourceError::TokenRejected { url, status } => write!(
                f,
                "token rejected by the control plane ({status} from {url}); check --token-file"
            ),
            SourceError::Status { url, status } => {
                write!(f, "the control plane answered {status} to {url}")
            }
            SourceError::Redirected {
                url,
                status,
                location,
            } => write!(
                f,
                "the control plane answered {status} to {url}, redirecting to {}; redirects are refused (a redirected request loses its token or reaches another host): point --control-plane at the final address",
                crate::quote::text(location)
            ),
            SourceError::Garbage { url, problem } => {
                write!(
                    f,
                    "the control plane's answer to {url} is not a valid message: {problem}"
                )
            }
            SourceError::TooLarge { url, limit } => write!(
                f,
                "the control plane's answer to {url} is larger than {limit} bytes; raise --max-response-bytes if that is expected"
            ),
            SourceError::Refused { from, why } => write!(
                f,
                "refused the desired state from {from}: {why}; nothing in it was acted on, and the last accepted desired state stands"
            ),
            SourceError::TooManyEntries {
                from,
                what,
                count,
                max,
                flag,
            } => write!(
                f,
                "the snapshot from {from} has {count} {what} entries, more than {max}; refused before decoding it. Raise {flag} if this host really takes that many"
            ),
            SourceError::Token { path, .. } => {
                write!(f, "cannot read the token file {}", path.display())
            }
            SourceError::TokenMode { path, mode } => write!(
                f,
                "the token file {} is readable by group or others (mode {mode:04o}); refusing to send a secret anyone on this host can read: chmod 600 {}",
                path.display(),
                path.display()
            ),
            SourceError::ReadFile { path, .. } => {
                write!(f, "cannot read the desired file {}", path.display())
            }
            SourceError::Malformed {
                path,
                line,
                column,
                problem,
            } => write!(
                f,
                "the desired file {} is not a valid snapshot at line {line}, column {column}: {problem}; keeping the previous desired state",
                path.display()
            ),
        }
    }
}

impl std::error::Error for SourceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SourceError::Unreachable { source, .. } => Some(source.as_ref()),
            SourceError::Token { source, .. } | SourceError::ReadFile { source, .. } => {
                Some(source)
            }
            _ => None,
        }
    }
}
