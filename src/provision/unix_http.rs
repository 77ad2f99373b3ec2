//! A minimal HTTP/1.1 client over a unix socket, for the hypervisors'
//! APIs (cloud-hypervisor's `--api-socket`, vfkit's `--restful-uri`).
//!
//! The peer is a VMM, and a VMM is as hostile as the guest that may have
//! taken it over (the threat model in `lib.rs`), so nothing it sends is
//! trusted to end:
//! - the whole request (connect, write, every read) runs under one
//!   deadline: each blocking call's timeout is the time left, so a peer
//!   that trickles a byte at a time still ends when the deadline does;
//! - the status line and headers are read into one buffer of at most
//!   [`MAX_HEAD`] bytes and [`MAX_HEADERS`] lines, never line by line
//!   into a growing string;
//! - the body is at most [`MAX_BODY`] bytes, by its Content-Length.
//!
//! One request per connection. A body is read by its Content-Length and
//! then this side closes (cloud-hypervisor never closes a connection
//! itself, so waiting for EOF would leak connections until it answered
//! 503). A server that closes before answering gives an `UnexpectedEof`
//! error, which a caller may take as an answer (vfkit's HardStop exits
//! before it replies).

use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr, sockopt};
use nix::sys::time::TimeVal;

use crate::deadline::Deadline;

/// The status line and every header together.
pub const MAX_HEAD: usize = 8 << 10;
/// Header lines after the status line.
pub const MAX_HEADERS: usize = 64;
/// The body.
pub const MAX_BODY: usize = 1 << 20;
const DAY: Duration = Duration::from_secs(24 * 3600);

/// One request, with a JSON body when given, all of it within `timeout`;
/// the status and the body.
pub fn request(
    socket: &Path,
    method: &str,
    path: &str,
    json: Option<&[u8]>,
    timeout: Duration,
) -> io::Result<(u16, Vec<u8>)> {
    // A bound, always: a day at most, so the deadline cannot overflow.
    let deadline = Deadline::after(timeout.clamp(Duration::from_millis(1), DAY));
    let mut stream = connect(socket, deadline)?;
    let body = json.unwrap_or_default();
    let content_type = if json.is_some() {
        "Content-Type: application/json\r\n"
    } else {
        ""
    };
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n{content_type}Content-Length: {}\r\n\r\n",
        body.len()
    );
    let mut out = head.into_bytes();
    out.extend_from_slice(body);
    // The connect's send timeout bounds the write: set to the time left.
    stream.set_write_timeout(Some(left(deadline)?))?;
    stream.write_all(&out)?;
    let (status, len, mut rest) = read_head(&mut stream, deadline)?;
    if len > MAX_BODY {
        return Err(invalid(format!(
            "a {len}-byte answer is over the {MAX_BODY}-byte cap"
        )));
    }
    rest.truncate(len);
    let mut got = rest.len();
    rest.resize(len, 0);
    while got < len {
        within(&stream, deadline)?;
        match stream.read(&mut rest[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    // Dropping the stream closes our side; the server may not.
    Ok((status, rest))
}

/// A connection to `socket`, its connect bounded too: a listener that
/// never accepts fills its backlog, and a plain connect then waits for
/// room without end (a unix socket's connect waits for as long as its send
/// timeout says).
fn connect(socket: &Path, deadline: Deadline) -> io::Result<UnixStream> {
    // Close-on-exec from its birth where the kernel can (Linux); macOS
    // sets it just after, and its VMMs are spawned, not forked by hand.
    #[cfg(target_os = "linux")]
    let flags = SockFlag::SOCK_CLOEXEC;
    #[cfg(not(target_os = "linux"))]
    let flags = SockFlag::empty();
    let fd: OwnedFd = socket::socket(AddressFamily::Unix, SockType::Stream, flags, None)?;
    #[cfg(not(target_os = "linux"))]
    nix::fcntl::fcntl(
        &fd,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )?;
    let addr = UnixAddr::new(socket)?;
    socket::setsockopt(&fd, sockopt::SendTimeout, &timeval(left(deadline)?))?;
    socket::connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr).map_err(|e| match e {
        // A full backlog for as long as we could wait.
        nix::errno::Errno::EAGAIN => io::Error::new(
            io::ErrorKind::TimedOut,
            "the API socket did not accept the connection in time",
        ),
        e => io::Error::from(e),
    })?;
    Ok(UnixStream::from(fd))
}

/// The time left before `deadline`, or a timeout error when none is.
fn left(deadline: Deadline) -> io::Result<Duration> {
    match deadline.remaining() {
        Some(left) if left.is_zero() => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the API did not answer in time",
        )),
        Some(left) => Ok(left),
        None => Err(invalid("a request needs a deadline".into())),
    }
}

/// The stream's read timeout set to the time left, before each read.
fn within(stream: &UnixStream, deadline: Deadline) -> io::Result<()> {
    stream.set_read_timeout(Some(left(deadline)?))
}

fn timeval(d: Duration) -> TimeVal {
    // A zero timeval is "no timeout": at least a microsecond.
    let us = d.as_micros().clamp(1, i64::MAX as u128) as i64;
    TimeVal::new(us / 1_000_000, (us % 1_000_000) as _)
}

fn invalid(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

/// Reads up to the blank line that ends the head: the status, the
/// Content-Length (0 when absent), and the bytes read past the head.
fn read_head(stream: &mut UnixStream, deadline: Deadline) -> io::Result<(u16, usize, Vec<u8>)> {
    let mut buf = vec![0u8; MAX_HEAD];
    let mut have = 0;
    let end = loop {
        if let Some(at) = find(&buf[..have], b"\r\n\r\n") {
            break at;
        }
        if have == MAX_HEAD {
            return Err(invalid(format!(
                "the answer's status line and headers are over {MAX_HEAD} bytes"
            )));
        }
        within(stream, deadline)?;
        match stream.read(&mut buf[have..]) {
            Ok(0) if have == 0 => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the server closed the connection without answering",
                ));
            }
            Ok(0) => return Err(invalid("the answer ended inside its headers".into())),
            Ok(n) => have += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    };
    let head = std::str::from_utf8(&buf[..end])
        .map_err(|_| invalid("the answer's head is not text".into()))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.trim().parse::<u16>().ok())
        .ok_or_else(|| invalid(format!("bad status line {status_line:?}")))?;
    let mut len = 0usize;
    for (n, header) in lines.enumerate() {
        if n == MAX_HEADERS {
            return Err(invalid(format!(
                "the answer has over {MAX_HEADERS} headers"
            )));
        }
        if let Some((name, value)) = header.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            len = value
                .trim()
                .parse()
                .map_err(|_| invalid(format!("bad Content-Length {:?}", value.trim())))?;
        }
    }
    let rest = buf[end + 4..have].to_vec();
    Ok((status, len, rest))
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;
    use std::time::Instant;

    /// A server on a socket in a temp dir that reads one request, then
    /// runs `answer` on the connection.
    fn serve(
        answer: impl FnOnce(&mut UnixStream) + Send + 'static,
    ) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("api.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        std::thread::spawn(move || {
            if let Ok((mut conn, _)) = listener.accept() {
                let mut req = [0u8; 4096];
                let _ = conn.read(&mut req);
                answer(&mut conn);
            }
        });
        (dir, path)
    }

    #[test]
    fn an_answer_is_read_by_its_content_length() {
        let (_dir, path) = serve(|c| {
            let _ = c.write_all(b"HTTP/1.1 200 \r\nContent-Length: 4\r\n\r\nbody");
            std::thread::sleep(Duration::from_secs(2));
        });

        let (status, body) =
            request(&path, "GET", "/x", None, Duration::from_secs(5)).expect("answer");

        assert_eq!((status, body.as_slice()), (200, b"body".as_slice()));
    }

    #[test]
    fn a_status_line_without_end_is_refused_at_the_head_cap() {
        let (_dir, path) = serve(|c| {
            let chunk = [b'A'; 4096];
            while c.write_all(&chunk).is_ok() {}
        });

        let err = request(&path, "GET", "/x", None, Duration::from_secs(5)).expect_err("refused");

        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("over 8192 bytes"), "{err}");
    }

    #[test]
    fn too_many_headers_are_refused() {
        let (_dir, path) = serve(|c| {
            let _ = c.write_all(b"HTTP/1.1 200 \r\n");
            for _ in 0..100 {
                let _ = c.write_all(b"X: y\r\n");
            }
            let _ = c.write_all(b"\r\n");
        });

        let err = request(&path, "GET", "/x", None, Duration::from_secs(5)).expect_err("refused");

        assert!(err.to_string().contains("over 64 headers"), "{err}");
    }

    #[test]
    fn a_body_over_the_cap_is_refused_before_it_is_read() {
        let (_dir, path) = serve(|c| {
            let _ = c.write_all(b"HTTP/1.1 200 \r\nContent-Length: 1073741824\r\n\r\n");
        });

        let err = request(&path, "GET", "/x", None, Duration::from_secs(5)).expect_err("refused");

        assert!(err.to_string().contains("over the"), "{err}");
    }

    #[test]
    fn a_peer_that_trickles_is_cut_off_at_the_deadline() {
        // A byte every 50 ms, for far longer than the request may take:
        // each read succeeds, so only an overall deadline ends it.
        let (_dir, path) = serve(|c| {
            for _ in 0..400 {
                if c.write_all(b"H").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let started = Instant::now();

        let err =
            request(&path, "GET", "/x", None, Duration::from_millis(300)).expect_err("cut off");

        assert!(
            matches!(
                err.kind(),
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
            ),
            "{err}"
        );
        // Ended by the deadline, not by the 20 s the peer would go on.
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn a_listener_that_never_accepts_is_cut_off_at_the_deadline() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("api.sock");
        let _listener = UnixListener::bind(&path).expect("bind");
        // Fill its backlog: connections nobody accepts.
        let mut held = Vec::new();
        let deadline = Deadline::after(Duration::from_millis(200));
        while let Ok(s) = connect(&path, deadline) {
            held.push(s);
            if held.len() > 10_000 {
                break;
            }
        }

        let err =
            request(&path, "GET", "/x", None, Duration::from_millis(200)).expect_err("cut off");

        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
    }
}
