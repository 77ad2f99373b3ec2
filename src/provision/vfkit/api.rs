//! vfkit's REST API on its unix socket (`--restful-uri unix://…`):
//! `GET /vm/state` → `{"state":"VirtualMachineStateRunning",…}`, and
//! `POST /vm/state {"state":"Stop"|"HardStop"|"Pause"|"Resume"}`.
//!
//! - 200 or 202 (the power button answers 202 with an empty body) is done.
//! - A connection closed before any answer, for HardStop, is done too:
//!   vfkit exits before it replies.
//! - ECONNREFUSED or ENOENT on connect: nothing serves there, the VM is not
//!   running.

use std::fmt;
use std::io;
use std::path::Path;
use std::time::Duration;

use crate::provision::unix_http;

/// The state vfkit reports for a running VM.
pub const RUNNING: &str = "VirtualMachineStateRunning";
/// The state vfkit reports once the guest powered off.
pub const STOPPED: &str = "VirtualMachineStateStopped";
/// The state vfkit reports for a guest paused in place.
pub const PAUSED: &str = "VirtualMachineStatePaused";

#[derive(Debug)]
pub enum RestError {
    /// Nothing listens on the socket.
    NotRunning,
    /// vfkit answered with an error status.
    Status {
        code: u16,
        body: String,
    },
    /// An answer that is not vfkit's.
    BadAnswer(String),
    Io(io::Error),
}

impl fmt::Display for RestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RestError::NotRunning => {
                f.write_str("vfkit is not running (nothing listens on its socket)")
            }
            RestError::Status { code, body } => {
                write!(f, "vfkit answered {code}: {}", crate::quote::inline(body))
            }
            RestError::BadAnswer(what) => write!(f, "vfkit's answer is not understood: {what}"),
            RestError::Io(e) => write!(f, "talking to vfkit: {e}"),
        }
    }
}

impl std::error::Error for RestError {}

fn connect_error(e: io::Error) -> RestError {
    match e.kind() {
        io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound => RestError::NotRunning,
        _ => RestError::Io(e),
    }
}

/// The VM's state as vfkit names it (e.g. [`RUNNING`]).
pub fn state(socket: &Path, timeout: Duration) -> Result<String, RestError> {
    let (code, body) =
        unix_http::request(socket, "GET", "/vm/state", None, timeout).map_err(connect_error)?;
    if code != 200 {
        return Err(RestError::Status {
            code,
            body: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    let v: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| RestError::BadAnswer(format!("{e}")))?;
    v.get("state")
        .and_then(|s| s.as_str())
        .map(str::to_owned)
        .ok_or_else(|| RestError::BadAnswer("no \"state\"".into()))
}

/// Asks for a state change: `"Stop"` (the power button), `"HardStop"`,
/// `"Pause"` or `"Resume"`.
pub fn change(socket: &Path, to: &str, timeout: Duration) -> Result<(), RestError> {
    let body = serde_json::json!({ "state": to }).to_string();
    match unix_http::request(socket, "POST", "/vm/state", Some(body.as_bytes()), timeout) {
        Ok((200 | 202, _)) => Ok(()),
        Ok((code, body)) => Err(RestError::Status {
            code,
            body: String::from_utf8_lossy(&body).into_owned(),
        }),
        Err(e) if to == "HardStop" && e.kind() == io::ErrorKind::UnexpectedEof => Ok(()),
        Err(e) => Err(connect_error(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::os::unix::net::UnixListener;
    use std::path::PathBuf;

    /// A server on a socket in a temp dir that reads one request and
    /// answers `answer` verbatim (nothing: closes at once).
    fn serve(
        answer: &'static str,
    ) -> (tempfile::TempDir, PathBuf, std::thread::JoinHandle<String>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("vfkit.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().expect("accept");
            let mut reader = BufReader::new(conn.try_clone().expect("clone"));
            let mut request = String::new();
            let mut len = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).expect("read") == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().expect("length");
                }
                request.push_str(&line);
            }
            let mut body = vec![0u8; len];
            reader.read_exact(&mut body).expect("body");
            request.push_str(&String::from_utf8_lossy(&body));
            conn.write_all(answer.as_bytes()).expect("answer");
            request
        });
        (dir, path, server)
    }

    const T: Duration = Duration::from_secs(2);

    #[test]
    fn a_200_state_is_read() {
        let (_dir, path, _s) = serve(
            "HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{\"state\":\"VirtualMachineStateRunning\",\"canStop\":1}",
        );

        assert_eq!(state(&path, T).expect("state"), RUNNING);
    }

    #[test]
    fn the_power_button_answered_202_is_done_and_sent_as_json() {
        let (_dir, path, server) = serve("HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n");

        change(&path, "Stop", T).expect("stop");

        let request = server.join().expect("server");
        assert!(
            request.starts_with("POST /vm/state HTTP/1.1\r\n"),
            "{request}"
        );
        assert!(request.ends_with("{\"state\":\"Stop\"}"), "{request}");
    }

    #[test]
    fn a_400_is_an_error_with_its_body() {
        let (_dir, path, _s) =
            serve("HTTP/1.1 400 Bad Request\r\nContent-Length: 13\r\n\r\nbad state: x\n");

        let err = change(&path, "Stop", T).expect_err("400");

        assert!(
            matches!(&err, RestError::Status { code: 400, body } if body.contains("bad state"))
        );
    }

    #[test]
    fn a_500_is_an_error() {
        let (_dir, path, _s) =
            serve("HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n");

        assert!(matches!(
            state(&path, T),
            Err(RestError::Status { code: 500, .. })
        ));
    }

    #[test]
    fn eof_after_a_hard_stop_is_done() {
        let (_dir, path, _s) = serve("");

        assert!(change(&path, "HardStop", T).is_ok());
    }

    #[test]
    fn eof_after_the_power_button_is_an_error() {
        let (_dir, path, _s) = serve("");

        assert!(change(&path, "Stop", T).is_err());
    }

    #[test]
    fn a_socket_nobody_listens_on_is_not_running() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("vfkit.sock");
        // Bound, then closed: the file stays, the listener is gone.
        drop(UnixListener::bind(&path).expect("bind"));

        assert!(matches!(state(&path, T), Err(RestError::NotRunning)));
    }

    #[test]
    fn a_missing_socket_is_not_running() {
        let dir = tempfile::tempdir().expect("tempdir");

        assert!(matches!(
            change(&dir.path().join("absent.sock"), "Stop", T),
            Err(RestError::NotRunning)
        ));
    }
}
