//! One message on the stream: its length as 4 bytes, big-endian, then its
//! bytes. Reading is bounded twice: a length over the reader's limit is
//! refused before a byte of the body is read, and the whole read (however
//! the peer trickles it) ends at the deadline.

use std::fmt;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::deadline::Deadline;

/// A stream whose blocking reads and writes can be bounded: each call
/// below sets the time left before it blocks.
pub trait Channel: Read + Write {
    /// Bound the next reads and writes to `left` (never zero).
    fn time_left(&mut self, left: Duration) -> io::Result<()>;
}

impl Channel for UnixStream {
    fn time_left(&mut self, left: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(left))?;
        self.set_write_timeout(Some(left))
    }
}

/// Why a frame was not read or written.
#[derive(Debug)]
pub enum FrameError {
    /// The peer said a length over the limit.
    TooLong {
        said: u32,
        max: u32,
    },
    /// The peer closed the stream after `read` bytes of the frame.
    Closed {
        read: usize,
    },
    /// The deadline passed first.
    TimedOut,
    Io(io::Error),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::TooLong { said, max } => {
                write!(f, "said a message of {said} bytes, over the {max} allowed")
            }
            FrameError::Closed { read: 0 } => write!(f, "closed the connection without a word"),
            FrameError::Closed { read } => {
                write!(f, "closed the connection {read} bytes into a message")
            }
            FrameError::TimedOut => write!(f, "did not finish within its deadline"),
            FrameError::Io(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for FrameError {}

/// The time left before `deadline`, or `TimedOut` once it passed. With no
/// deadline a call is still bounded: a stream is never read without one.
fn left(deadline: Deadline) -> Result<Duration, FrameError> {
    const UNBOUNDED: Duration = Duration::from_secs(3600);
    match deadline.remaining() {
        None => Ok(UNBOUNDED),
        Some(d) if d.is_zero() => Err(FrameError::TimedOut),
        Some(d) => Ok(d),
    }
}

fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Fills `buf`, each read bounded by what is left of `deadline`; `done`
/// counts bytes of the frame read before `buf`, for the error.
fn fill(
    stream: &mut impl Channel,
    buf: &mut [u8],
    done: usize,
    deadline: Deadline,
) -> Result<(), FrameError> {
    let mut at = 0;
    while at < buf.len() {
        stream.time_left(left(deadline)?).map_err(FrameError::Io)?;
        match stream.read(&mut buf[at..]) {
            Ok(0) => return Err(FrameError::Closed { read: done + at }),
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if timed_out(&e) => return Err(FrameError::TimedOut),
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    Ok(())
}

/// Reads one frame of at most `max` bytes.
pub fn read(
    stream: &mut impl Channel,
    max: u32,
    deadline: Deadline,
) -> Result<Vec<u8>, FrameError> {
    let mut head = [0u8; 4];
    fill(stream, &mut head, 0, deadline)?;
    let said = u32::from_be_bytes(head);
    if said > max {
        return Err(FrameError::TooLong { said, max });
    }
    // The length is at most `max`, so this allocation is bounded by the
    // reader, never by the peer.
    let mut body = vec![0u8; said as usize];
    fill(stream, &mut body, head.len(), deadline)?;
    Ok(body)
}

/// Writes `body` as one frame (one write call, so a frame is never split
/// by another writer).
pub fn write(stream: &mut impl Channel, body: &[u8], deadline: Deadline) -> Result<(), FrameError> {
    let len = u32::try_from(body.len()).map_err(|_| FrameError::TooLong {
        said: u32::MAX,
        max: u32::MAX,
    })?;
    let mut out = Vec::with_capacity(body.len() + 4);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(body);
    stream.time_left(left(deadline)?).map_err(FrameError::Io)?;
    match stream.write_all(&out).and_then(|()| stream.flush()) {
        Ok(()) => Ok(()),
        Err(e) if timed_out(&e) => Err(FrameError::TimedOut),
        Err(e) => Err(FrameError::Io(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_frame_written_is_read_back_whole() {
        let (mut a, mut b) = UnixStream::pair().expect("pair");
        write(&mut a, b"hello", Deadline::after(Duration::from_secs(5))).expect("write");
        let got = read(&mut b, 16, Deadline::after(Duration::from_secs(5))).expect("read");
        assert_eq!(got, b"hello");
    }

    #[test]
    fn a_length_over_the_limit_is_refused_before_its_body() {
        let (mut a, mut b) = UnixStream::pair().expect("pair");
        a.write_all(&u32::MAX.to_be_bytes()).expect("write");
        let got = read(&mut b, 16, Deadline::after(Duration::from_secs(5)));
        assert!(
            matches!(
                got,
                Err(FrameError::TooLong {
                    said: u32::MAX,
                    max: 16
                })
            ),
            "{got:?}"
        );
    }

    #[test]
    fn a_peer_that_trickles_is_cut_at_the_deadline() {
        let (mut a, mut b) = UnixStream::pair().expect("pair");
        let trickle = std::thread::spawn(move || {
            let _ = a.write_all(&8u32.to_be_bytes());
            for _ in 0..100 {
                if a.write_all(b"x").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let started = Instant::now();
        let got = read(&mut b, 16, Deadline::after(Duration::from_millis(200)));
        let took = started.elapsed();
        assert!(matches!(got, Err(FrameError::TimedOut)), "{got:?}");
        // The trickle would take 5 s; the deadline ends the read long before.
        assert!(took < Duration::from_secs(2), "took {took:?}");
        drop(b);
        let _ = trickle.join();
    }

    #[test]
    fn a_peer_that_closes_mid_frame_is_named() {
        let (mut a, mut b) = UnixStream::pair().expect("pair");
        a.write_all(&8u32.to_be_bytes()).expect("write");
        a.write_all(b"abc").expect("write");
        drop(a);
        let got = read(&mut b, 16, Deadline::after(Duration::from_secs(5)));
        assert!(
            matches!(got, Err(FrameError::Closed { read: 7 })),
            "{got:?}"
        );
    }
}
