//! Where desired state comes from, and where reports go: a control plane
//! over HTTP, or a local file in standalone mode.

mod file;
mod http;

use std::fmt;
use std::path::PathBuf;

pub use file::FileSource;
pub use http::HttpSource;

use crate::pb;

pub trait Source: Send {
    /// Fetches desired state; `Ok(None)` when there is nothing new (a file
    /// that did not change).
    fn fetch(&mut self, host: &pb::HostInfo) -> Result<Option<pb::Snapshot>, SourceError>;

    /// Hands a report upward. A file source has no one to hand it to; its
    /// reports are the `report.json` every tick writes anyway.
    fn send_report(&mut self, host: &pb::HostInfo, report: &pb::Report) -> Result<(), SourceError>;

    /// A remote source's snapshots carry an epoch that fences, and its
    /// failures back off. A file's do neither: standalone mode never fences.
    fn is_remote(&self) -> bool;

    /// Makes the next fetch read afresh (SIGHUP).
    fn reload(&mut self) {}

    /// What to call this source in logs and `status`.
    fn describe(&self) -> String;
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
    /// The answer was not a message of the expected type.
    Garbage {
        url: String,
        problem: String,
    },
    TooLarge {
        url: String,
        limit: u64,
    },
    Token {
        path: PathBuf,
        source: std::io::Error,
    },
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The desired file is not a valid Snapshot; the previous one stands.
    Malformed {
        path: PathBuf,
        line: usize,
        column: usize,
        problem: String,
    },
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
            SourceError::Token { path, .. } => {
                write!(f, "cannot read the token file {}", path.display())
            }
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
