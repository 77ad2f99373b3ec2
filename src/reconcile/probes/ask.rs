//! Asking a guest whether it answers its probe's check: a TCP connect, an
//! HTTP GET (its status line, at most 512 bytes read: the guest is
//! untrusted), or a line of its console. Each is bounded by the probe's
//! timeout; why a check was not answered is an [`Unanswered`], whose words
//! are the row's.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::model::{Check, Id};
use crate::reconcile::context::Context;

/// How much of the console's end is searched for the line.
const CONSOLE_TAIL: u64 = 8 << 20;

/// Whether the guest answers `check` now; why not, if it does not.
/// `searched` is how much of the live console a serial check of this
/// hypervisor has read (see [`console`]).
pub(super) fn ask(
    ctx: &Context,
    vm_id: &Id,
    check: &Check,
    timeout: Duration,
    searched: &mut Option<u64>,
) -> Result<(), Unanswered> {
    let address = |what: &'static str, port: u16| {
        ctx.backend
            .address(vm_id)
            .ok_or(Unanswered::NoAddress { what, port })
    };
    match check {
        Check::Tcp(port) => {
            let to = SocketAddr::from((address("tcp", *port)?, *port));
            TcpStream::connect_timeout(&to, timeout)
                .map(reset)
                .map_err(|source| Unanswered::Tcp { to, source })
        }
        Check::Http { port, path } => {
            let to = SocketAddr::from((address("http", *port)?, *port));
            http_status(to, path, timeout).and_then(|status| {
                if (200..300).contains(&status) {
                    Ok(())
                } else {
                    Err(Unanswered::HttpStatus {
                        to,
                        path: path.clone(),
                        status,
                    })
                }
            })
        }
        Check::Serial(text) => console(ctx, vm_id, text, searched),
    }
}

/// Whether a console line of this boot holds `text`. `searched` is how
/// much of the live console an earlier look of this hypervisor's
/// searched: only what the guest printed since is read (the guest picks
/// how much it prints; reading it all again every period cost tens of
/// ms a probe), and it is set to what this look searched.
fn console(
    ctx: &Context,
    vm_id: &Id,
    text: &str,
    searched: &mut Option<u64>,
) -> Result<(), Unanswered> {
    let layout = ctx.store.layout();
    let live = layout.serial_log(vm_id);
    let needle = text.as_bytes();
    let unread = Unanswered::Console;
    let len = std::fs::metadata(&live).map_err(unread)?.len();
    let holds = if let Some(seen) = searched.filter(|seen| len >= *seen) {
        // A line straddling the last look's end began before it.
        let from = seen.saturating_sub(needle.len() as u64);
        console_holds(&live, needle, from, CONSOLE_TAIL)
            .map_err(unread)?
            .0
    } else {
        // The whole boot's console: a resumed guest does not print its
        // boot line again, and what it printed before its suspend
        // still counts.
        let paths = layout.serial_of_this_boot(vm_id);
        let mut budget = CONSOLE_TAIL;
        let mut holds = false;
        for path in paths.iter().rev() {
            match console_holds(path, needle, 0, budget) {
                Ok((true, _)) => {
                    holds = true;
                    break;
                }
                Ok((false, read)) => budget = budget.saturating_sub(read),
                // A segment may be gone under it (the oldest are
                // removed past the bound): the console itself may not.
                Err(_) if path != &live => {}
                Err(e) => return Err(unread(e)),
            }
            if budget == 0 {
                break;
            }
        }
        holds
    };
    *searched = Some(len);
    if holds {
        Ok(())
    } else {
        Err(Unanswered::NotPrinted {
            text: text.to_owned(),
        })
    }
}

/// The status code a GET of `path` at `to` answers, all of it (connect,
/// request, status line) within `timeout`; the guest is untrusted, so at
/// most its first 512 bytes are read.
/// Ends a probe's connection with a reset (no linger): the guest sends
/// nothing more for it once the probe is done, so what it sends for the
/// probe falls within the probe (see the sleepers' idle rule).
fn reset(conn: TcpStream) {
    let none = nix::libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    let _ = nix::sys::socket::setsockopt(&conn, nix::sys::socket::sockopt::Linger, &none);
    drop(conn);
}

fn http_status(to: SocketAddr, path: &str, timeout: Duration) -> Result<u16, Unanswered> {
    use std::io::Write;
    let start = std::time::Instant::now();
    let left = || {
        timeout
            .saturating_sub(start.elapsed())
            .max(Duration::from_millis(1))
    };
    let what = |source: std::io::Error| Unanswered::Http {
        to,
        path: path.to_owned(),
        source,
    };
    let mut conn = TcpStream::connect_timeout(&to, timeout).map_err(what)?;
    conn.set_write_timeout(Some(left())).map_err(what)?;
    conn.write_all(
        format!(
            "GET {path} HTTP/1.0\r\nHost: {}\r\nConnection: close\r\n\r\n",
            to.ip()
        )
        .as_bytes(),
    )
    .map_err(what)?;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 512];
    while head.len() < 512 && !head.contains(&b'\n') {
        conn.set_read_timeout(Some(left())).map_err(what)?;
        let n = conn.read(&mut buf[..512 - head.len()]).map_err(what)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    reset(conn);
    // "HTTP/1.1 200 OK"
    let line = String::from_utf8_lossy(&head);
    line.split_whitespace()
        .nth(1)
        .filter(|_| line.starts_with("HTTP/"))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| Unanswered::NoStatusLine {
            to,
            path: path.to_owned(),
        })
}

/// Why a probe's check was not answered; its words, with its source's
/// (`error::chain`), are the row's.
#[derive(Debug)]
pub(super) enum Unanswered {
    NoAddress {
        what: &'static str,
        port: u16,
    },
    Tcp {
        to: SocketAddr,
        source: std::io::Error,
    },
    Http {
        to: SocketAddr,
        path: String,
        source: std::io::Error,
    },
    HttpStatus {
        to: SocketAddr,
        path: String,
        status: u16,
    },
    NoStatusLine {
        to: SocketAddr,
        path: String,
    },
    Console(std::io::Error),
    NotPrinted {
        text: String,
    },
}

impl std::fmt::Display for Unanswered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unanswered::NoAddress { what, port } => {
                write!(f, "{what} {port}: the guest has no address yet")
            }
            Unanswered::Tcp { to, .. } => write!(f, "tcp {} on {}", to.port(), to.ip()),
            Unanswered::Http { to, path, .. } => {
                write!(f, "http {} {path} on {}", to.port(), to.ip())
            }
            Unanswered::HttpStatus { to, path, status } => {
                write!(
                    f,
                    "http {} {path} on {} answered {status}",
                    to.port(),
                    to.ip()
                )
            }
            Unanswered::NoStatusLine { to, path } => write!(
                f,
                "http {} {path} on {}: no HTTP status line in its answer",
                to.port(),
                to.ip()
            ),
            Unanswered::Console(_) => f.write_str("cannot read the console"),
            Unanswered::NotPrinted { text } => write!(f, "no console line holds {text:?} yet"),
        }
    }
}

impl std::error::Error for Unanswered {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Unanswered::Tcp { source, .. }
            | Unanswered::Http { source, .. }
            | Unanswered::Console(source) => Some(source),
            _ => None,
        }
    }
}

/// Whether a line of the console at `path`, from byte `from` on (at most
/// its last `tail` bytes), holds `text`; and how many bytes were read.
fn console_holds(
    path: &std::path::Path,
    text: &[u8],
    from: u64,
    tail: u64,
) -> std::io::Result<(bool, u64)> {
    use std::io::{Seek, SeekFrom};
    let mut file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(tail).max(from)))?;
    let mut bytes = Vec::new();
    file.take(tail).read_to_end(&mut bytes)?;
    let read = bytes.len() as u64;
    if text.is_empty() {
        return Ok((true, read));
    }
    let holds = bytes
        .split(|b| *b == b'\n')
        .any(|line| line.windows(text.len()).any(|w| w == text));
    Ok((holds, read))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;

    /// A loopback peer that answers whatever it is sent with `answer`.
    fn peer(answer: &'static [u8]) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
        let at = listener.local_addr().expect("addr");
        std::thread::spawn(move || {
            if let Ok((mut conn, _)) = listener.accept() {
                let _ = conn.write_all(answer);
                std::thread::sleep(Duration::from_secs(2));
            }
        });
        at
    }

    #[test]
    fn a_status_line_is_read_and_its_code_taken() {
        let at = peer(b"HTTP/1.1 204 No Content\r\n\r\n");

        assert_eq!(
            http_status(at, "/", Duration::from_secs(1)).map_err(|e| e.to_string()),
            Ok(204)
        );
    }

    #[test]
    fn a_guest_answering_no_status_line_is_read_no_further_than_512_bytes() {
        let at = peer(&[b'A'; 64 * 1024]);

        let read = http_status(at, "/", Duration::from_secs(1));

        assert!(
            matches!(read, Err(Unanswered::NoStatusLine { .. })),
            "{read:?}"
        );
    }

    #[test]
    fn a_guest_that_never_answers_fails_within_the_timeout() {
        let at = peer(b"");
        let start = std::time::Instant::now();

        let read = http_status(at, "/", Duration::from_millis(300));

        assert!(read.is_err(), "{read:?}");
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
    }
}
