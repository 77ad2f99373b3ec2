//! The host programs the underlay runs (iproute2, nft, iptables, found
//! once on PATH at start), and what can go wrong running them or the
//! netlink requests that stand for some of them.

use std::fmt;
#[cfg(target_os = "linux")]
use std::process::Command;

#[derive(Debug)]
pub enum NetError {
    /// The program is not installed (not found when the agent started).
    Missing {
        program: &'static str,
        command: String,
    },
    /// The program could not be run, or its input written.
    Run {
        command: String,
        source: std::io::Error,
    },
    /// It ran and failed: its exit status and what it said.
    Failed {
        command: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
    /// A netlink request the kernel refused.
    Netlink {
        request: String,
        source: std::io::Error,
    },
    /// IPv4 forwarding could not be turned on.
    Forwarding {
        path: &'static str,
        source: std::io::Error,
    },
    /// Asked to hold guests to rules only nft can hold, without nft.
    Unenforceable { what: &'static str },
}

impl fmt::Display for NetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NetError::Missing { program, command } => write!(
                f,
                "{command}: {program} is not installed (not found in PATH when the agent started)"
            ),
            NetError::Run { command, .. } => write!(f, "cannot run {command}"),
            NetError::Failed {
                command,
                status,
                stderr,
            } => write!(
                f,
                "{command} failed ({}): {}",
                crate::human::exit(*status),
                crate::quote::inline(stderr)
            ),
            NetError::Netlink { request, .. } => f.write_str(request),
            NetError::Forwarding { path, .. } => {
                write!(f, "cannot enable IPv4 forwarding ({path})")
            }
            NetError::Unenforceable { what } => write!(
                f,
                "{what} cannot be held: nft is not installed on this host (install nftables)"
            ),
        }
    }
}

impl std::error::Error for NetError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            NetError::Run { source, .. }
            | NetError::Netlink { source, .. }
            | NetError::Forwarding { source, .. } => Some(source),
            NetError::Missing { .. } | NetError::Failed { .. } | NetError::Unenforceable { .. } => {
                None
            }
        }
    }
}

impl crate::error::Failure for NetError {
    /// What the host lacks is the host's to change, not the spec's.
    fn is_host_condition(&self) -> bool {
        matches!(self, NetError::Unenforceable { .. })
    }
}

#[cfg(target_os = "linux")]
pub(super) fn run(
    program: &'static str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<String, NetError> {
    use std::io::Write;
    let _span = crate::stages::span(match program {
        "ip" => "ip",
        "nft" => "nft",
        _ => "command",
    });
    let command = || format!("{program} {}", args.join(" "));
    let Some(path) = crate::programs::resolved(program) else {
        return Err(NetError::Missing {
            program,
            command: command(),
        });
    };
    let run_err = |source| NetError::Run {
        command: command(),
        source,
    };
    let mut cmd = Command::new(path);
    cmd.args(args)
        .stdin(if stdin.is_some() {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().map_err(run_err)?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).map_err(run_err)?;
    }
    let out = child.wait_with_output().map_err(run_err)?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(NetError::Failed {
            command: command(),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

#[cfg(target_os = "linux")]
pub(super) fn have(program: &str) -> bool {
    let Some(path) = crate::programs::resolved(program) else {
        return false;
    };
    Command::new(path)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}
