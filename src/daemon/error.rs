//! Why the daemon could not start.

use crate::source::SourceError;
use crate::state::StoreError;

#[derive(Debug)]
pub enum DaemonError {
    Store(StoreError),
    BootId(std::io::Error),
    Notify {
        fd: i32,
        source: nix::Error,
    },
    Signals(std::io::Error),
    /// The token file cannot be used (unreadable, or readable by others).
    Token(SourceError),
    /// This agent's VMM ids or cgroup root cannot be had (see
    /// `state::claim`).
    Claim(crate::state::claim::ClaimError),
    /// A thread the daemon needs could not be started.
    Thread {
        name: &'static str,
        source: std::io::Error,
    },
}

impl std::fmt::Display for DaemonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DaemonError::Store(_) => f.write_str("cannot open the state directory"),
            DaemonError::BootId(_) => {
                f.write_str("cannot read the boot id from /proc/sys/kernel/random/boot_id")
            }
            DaemonError::Notify { fd, .. } => {
                write!(f, "--notify-fd {fd} is not an open file descriptor")
            }
            DaemonError::Signals(_) => f.write_str("cannot install the signal handlers"),
            DaemonError::Token(_) => f.write_str("cannot use the token file"),
            DaemonError::Claim(_) => f.write_str(
                "cannot claim this agent's share of the host (VMM ids, cgroup root, guest network)",
            ),
            DaemonError::Thread { name, .. } => write!(f, "cannot start the {name} thread"),
        }
    }
}

impl std::error::Error for DaemonError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DaemonError::Store(e) => Some(e),
            DaemonError::BootId(e) | DaemonError::Signals(e) => Some(e),
            DaemonError::Notify { source, .. } => Some(source),
            DaemonError::Token(e) => Some(e),
            DaemonError::Thread { source, .. } => Some(source),
            DaemonError::Claim(e) => Some(e),
        }
    }
}
