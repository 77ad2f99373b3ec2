//! A minimal HTTP/1.1 client over a unix socket, for the hypervisors'
//! APIs (cloud-hypervisor's `--api-socket`, vfkit's `--restful-uri`).
//!
//! One request per connection. A body is read by its Content-Length and
//! then this side closes (cloud-hypervisor never closes a connection
//! itself, so waiting for EOF would leak connections until it answered
//! 503). Bodies are capped: a hypervisor cannot make the agent allocate
//! without bound. A server that closes before answering gives an
//! `UnexpectedEof` error, which a caller may take as an answer (vfkit's
//! HardStop exits before it replies).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

const MAX_BODY: usize = 1 << 20;

/// One request, with a JSON body when given; the status and the body.
pub fn request(
    socket: &Path,
    method: &str,
    path: &str,
    json: Option<&[u8]>,
    timeout: Duration,
) -> io::Result<(u16, Vec<u8>)> {
    let timeout = timeout.max(Duration::from_millis(1));
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let body = json.unwrap_or_default();
    let content_type = if json.is_some() {
        "Content-Type: application/json\r\n"
    } else {
        ""
    };
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n{content_type}Content-Length: {}\r\n\r\n",
        body.len()
    )?;
    stream.write_all(body)?;
    stream.flush()?;
    let mut reader = BufReader::new(&stream);
    let mut status_line = String::new();
    if reader.read_line(&mut status_line)? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the server closed the connection without answering",
        ));
    }
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
    // Dropping the stream closes our side; the server may not.
    Ok((status, body))
}
