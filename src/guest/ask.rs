//! The host's side of one exchange: connect to the VMM's vsock socket,
//! pass its `CONNECT` handshake, write the request, read and check the
//! answer, all within one deadline.
//!
//! Each exchange has a connection of its own: a guest that stalled or
//! lied in one leaves nothing behind for the next, and the cost of a
//! connection (a unix connect and the guest's accept) is well under a
//! millisecond.

use std::fmt;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::deadline::Deadline;
use crate::pb::guest::{Request, request};

use super::frame::{self, Channel, FrameError};
use super::said::{self, Said, SaidError};

/// The longest `OK <port>\n` a VMM answers (a u32 port).
const MAX_ACK: usize = 16;

/// Why an exchange with a guest failed, by the step that failed.
#[derive(Debug)]
pub enum AskError {
    /// The VMM's socket is not there or refused (no VMM, or one without
    /// vsock).
    NoSocket(io::Error),
    /// The socket at the VM's path is held by another process than its
    /// VMM: the path was swapped (the VMM owns its directory) for a
    /// host service's. Nothing was written to it.
    NotItsVmm { expected: u32, found: Option<i32> },
    /// The VMM did not acknowledge the `CONNECT` (nothing listens on the
    /// port in the guest: no guest agent, or not started yet).
    NotListening(String),
    /// The request could not be sent.
    Send(FrameError),
    /// The answer did not come whole.
    Answer(FrameError),
    /// It came, and was not taken.
    Said(SaidError),
}

impl AskError {
    /// Whether the guest agent was reached at all: a guest that was not
    /// (no socket, nothing listening) may not have one yet; one that was
    /// and then failed has one that misbehaves.
    pub fn reached(&self) -> bool {
        matches!(self, AskError::Answer(_) | AskError::Said(_))
    }
}

impl fmt::Display for AskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AskError::NoSocket(e) => write!(f, "cannot reach the VM's vsock socket: {e}"),
            AskError::NotItsVmm { expected, found } => write!(
                f,
                "the VM's vsock socket is held by {}, not its hypervisor (pid {expected}); nothing was sent to it",
                found.map_or("an unknown process".to_owned(), |pid| format!("pid {pid}"))
            ),
            AskError::NotListening(why) => {
                write!(
                    f,
                    "no guest agent listens on vsock port {}: {why}",
                    super::PORT
                )
            }
            AskError::Send(e) => write!(f, "the guest agent took no request: {e}"),
            AskError::Answer(e) => write!(f, "the guest agent's answer {e}"),
            AskError::Said(e) => write!(f, "the guest agent {e}"),
        }
    }
}

impl std::error::Error for AskError {}

/// What came back, and how long the exchange took from the connect.
#[derive(Debug)]
pub struct Asked {
    pub said: Said,
    pub took: Duration,
    /// Of which the connect and the VMM's `OK`: until the guest agent
    /// took the connection.
    pub reached: Duration,
}

/// Connects without ever blocking on a full backlog: a unix connect to a
/// listener that does not accept waits for room, for ever.
fn connect(socket: &Path) -> Result<UnixStream, AskError> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket as open};
    use std::os::fd::AsRawFd;
    // Close-on-exec from its creation where the kernel can (a VMM forked
    // meanwhile must not inherit it); macOS sets it after.
    #[cfg(target_os = "linux")]
    let flags = SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC;
    #[cfg(not(target_os = "linux"))]
    let flags = SockFlag::empty();
    let fd = open(AddressFamily::Unix, SockType::Stream, flags, None)
        .map_err(|e| AskError::NoSocket(e.into()))?;
    let stream = UnixStream::from(fd);
    #[cfg(not(target_os = "linux"))]
    {
        use nix::fcntl::{FcntlArg, FdFlag, fcntl};
        fcntl(&stream, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))
            .map_err(|e| AskError::NoSocket(e.into()))?;
        stream.set_nonblocking(true).map_err(AskError::NoSocket)?;
    }
    let addr = UnixAddr::new(socket).map_err(|e| AskError::NoSocket(e.into()))?;
    connect(stream.as_raw_fd(), &addr).map_err(|e| AskError::NoSocket(e.into()))?;
    stream.set_nonblocking(false).map_err(AskError::NoSocket)?;
    Ok(stream)
}

/// Writes `CONNECT <port>\n` and reads the VMM's `OK <port>\n`, a byte at
/// a time so that nothing of the guest's stream is read past it.
fn handshake(stream: &mut UnixStream, deadline: Deadline) -> Result<(), AskError> {
    let not = |why: String| AskError::NotListening(why);
    let left = deadline.remaining().unwrap_or(Duration::from_secs(3600));
    if left.is_zero() {
        return Err(not("the deadline passed before the handshake".into()));
    }
    stream.time_left(left).map_err(|e| not(e.to_string()))?;
    stream
        .write_all(format!("CONNECT {}\n", super::PORT).as_bytes())
        .map_err(|e| not(e.to_string()))?;
    let mut line = Vec::with_capacity(MAX_ACK);
    let mut byte = [0u8; 1];
    loop {
        let left = deadline.remaining().unwrap_or(Duration::from_secs(3600));
        if left.is_zero() {
            return Err(not("the VMM did not acknowledge within the deadline".into()));
        }
        stream.time_left(left).map_err(|e| not(e.to_string()))?;
        match stream.read(&mut byte) {
            // The VMM closes a host connection the guest refused.
            Ok(0) => return Err(not("the connection was refused".into())),
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) if line.len() < MAX_ACK => line.push(byte[0]),
            Ok(_) => return Err(not("the VMM's acknowledgement is too long".into())),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(not(e.to_string())),
        }
    }
    let ok = std::str::from_utf8(&line)
        .ok()
        .and_then(|l| l.strip_prefix("OK "))
        .is_some_and(|port| port.parse::<u32>().is_ok());
    if !ok {
        return Err(not(format!(
            "the VMM answered {} to the CONNECT",
            crate::quote::text(&String::from_utf8_lossy(&line))
        )));
    }
    Ok(())
}

/// Refuses a socket whose listener is not the VMM `pid`: the VMM owns the
/// socket's directory, and a VMM its guest took over could put a link to a
/// host service's socket there for the agent, root, to talk to.
fn check_peer(stream: &UnixStream, pid: u32) -> Result<(), AskError> {
    use nix::sys::socket::getsockopt;
    #[cfg(target_os = "linux")]
    let found = getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
        .ok()
        .map(|c| c.pid());
    #[cfg(not(target_os = "linux"))]
    let found = getsockopt(stream, nix::sys::socket::sockopt::LocalPeerPid).ok();
    if found.and_then(|p| u32::try_from(p).ok()) == Some(pid) {
        return Ok(());
    }
    Err(AskError::NotItsVmm {
        expected: pid,
        found,
    })
}

/// One exchange with the guest agent behind the vsock `socket` of the VMM
/// `vmm_pid`: request `id` asking `ask`, answered and checked before
/// `deadline`.
pub fn ask(
    socket: &Path,
    vmm_pid: u32,
    id: u64,
    ask: request::Ask,
    deadline: Deadline,
) -> Result<Asked, AskError> {
    ask_made(socket, vmm_pid, id, || ask, deadline)
}

/// As [`ask()`], the request made by `make` once the guest agent is
/// reached, just before it is written: what it says of the host's clock
/// is then no older than the write (a just-resumed guest took 60-300 ms
/// to take the connection, and a clock stamped before it was set that far
/// behind).
pub fn ask_made(
    socket: &Path,
    vmm_pid: u32,
    id: u64,
    make: impl FnOnce() -> request::Ask,
    deadline: Deadline,
) -> Result<Asked, AskError> {
    use prost::Message;
    let started = Instant::now();
    let mut stream = connect(socket)?;
    check_peer(&stream, vmm_pid)?;
    handshake(&mut stream, deadline)?;
    let reached = started.elapsed();
    let ask = make();
    let asked = ask.clone();
    let request = Request {
        version: super::VERSION,
        id,
        ask: Some(ask),
    };
    frame::write(&mut stream, &request.encode_to_vec(), deadline).map_err(AskError::Send)?;
    let bytes = frame::read(&mut stream, super::MAX_ANSWER, deadline).map_err(AskError::Answer)?;
    let said = said::check(&bytes, id, &asked).map_err(AskError::Said)?;
    Ok(Asked {
        said,
        took: started.elapsed(),
        reached,
    })
}
