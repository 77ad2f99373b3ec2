//! A minimal HTTP/1.1 client for cloud-hypervisor's API socket.
//!
//! The server answers `Connection: keep-alive` even to `Connection: close`
//! and never closes a connection itself, so a body is read by its
//! Content-Length and then this side closes (agents that waited for EOF
//! leaked connections until the API answered 503). Status lines have an
//! empty reason phrase (`HTTP/1.1 204 `). Bodies are capped: a VMM cannot
//! make the agent allocate without bound.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

const MAX_BODY: usize = 1 << 20;

/// One request; returns the status and the body.
pub fn call(
    socket: &Path,
    method: &str,
    path: &str,
    timeout: Duration,
) -> io::Result<(u16, Vec<u8>)> {
    let timeout = timeout.max(Duration::from_millis(1));
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\nContent-Length: 0\r\n\r\n"
    )?;
    stream.flush()?;
    let mut reader = BufReader::new(&stream);
    let mut status_line = String::new();
    reader.read_line(&mut status_line)?;
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.trim().parse::<u16>().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad status line {status_line:?}"),
            )
        })?;
    let mut len = 0usize;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header == "\r\n" {
            break;
        }
        if let Some((name, value)) = header.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            len = value
                .trim()
                .parse()
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad Content-Length"))?;
        }
    }
    if len > MAX_BODY {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a {len}-byte answer is over the cap"),
        ));
    }
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body)?;
    // Dropping the stream closes our side; the server will not.
    Ok((status, body))
}

/// `vm.info`'s `"state"`, or `None` when the VMM does not answer with one.
pub fn vm_state(socket: &Path, timeout: Duration) -> Option<String> {
    let (status, body) = call(socket, "GET", "/api/v1/vm.info", timeout).ok()?;
    if status != 200 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
    v.get("state")?.as_str().map(str::to_owned)
}
