//! systemd's system state, asked of PID 1 itself over its private socket
//! (`/run/systemd/private`, root's, where `systemctl` run as root asks
//! it too) in D-Bus's own wire format: one `Properties.Get` of the
//! manager's `SystemState`. Running `systemctl is-system-running` costs a
//! process, a dynamic loader and systemd's shared library, paid at every
//! status; in a clone just restored, whose pages are all cold, that was
//! the slowest part of its first status. The caller falls back to
//! `systemctl` when this fails.
//!
//! Only what the one call needs: authentication by `EXTERNAL` (the
//! socket's peer credentials), a method call with string arguments, and a
//! reply whose body is a variant holding a string (D-Bus specification,
//! "Message Protocol"). Every length in a reply is bounded before it is
//! read.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Where systemd listens for its own clients.
pub(super) const PRIVATE: &str = "/run/systemd/private";

/// A reply larger than this is no answer to one property's read.
const MAX_MESSAGE: usize = 64 << 10;
/// Messages read before the reply is given up on (PID 1 sends nothing
/// else to a client that subscribed to nothing).
const MAX_MESSAGES: usize = 4;

const METHOD_CALL: u8 = 1;
const METHOD_RETURN: u8 = 2;
const ERROR: u8 = 3;

const FIELD_PATH: u8 = 1;
const FIELD_INTERFACE: u8 = 2;
const FIELD_MEMBER: u8 = 3;
const FIELD_ERROR_NAME: u8 = 4;
const FIELD_REPLY_SERIAL: u8 = 5;
const FIELD_SIGNATURE: u8 = 8;

/// The serial of the one call made on a connection.
const SERIAL: u32 = 1;

/// systemd's `SystemState` ("running", "degraded", "starting", …), asked
/// at `socket` within `limit`.
pub(super) fn system_state(socket: &Path, limit: Duration) -> Result<String, String> {
    let mut stream = UnixStream::connect(socket)
        .map_err(|e| format!("cannot reach {}: {e}", socket.display()))?;
    stream
        .set_read_timeout(Some(limit))
        .and_then(|()| stream.set_write_timeout(Some(limit)))
        .map_err(|e| format!("cannot bound the wait: {e}"))?;
    authenticate(&mut stream, nix::unistd::getuid().as_raw())?;
    stream
        .write_all(&get_property(
            "/org/freedesktop/systemd1",
            "org.freedesktop.systemd1.Manager",
            "SystemState",
        ))
        .map_err(|e| format!("cannot ask: {e}"))?;
    for _ in 0..MAX_MESSAGES {
        let message = read_message(&mut stream)?;
        match reply_to(&message, SERIAL)? {
            Some(state) => return Ok(state),
            None => continue,
        }
    }
    Err("no reply came".into())
}

/// SASL `EXTERNAL` as `uid`, then `BEGIN`: the socket's credentials are
/// what is checked.
fn authenticate(stream: &mut UnixStream, uid: u32) -> Result<(), String> {
    let hex: String = uid
        .to_string()
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect();
    stream
        .write_all(format!("\0AUTH EXTERNAL {hex}\r\n").as_bytes())
        .map_err(|e| format!("cannot authenticate: {e}"))?;
    let line = read_line(stream)?;
    if !line.starts_with("OK ") {
        return Err(format!("authentication refused: {}", line.trim_end()));
    }
    stream
        .write_all(b"BEGIN\r\n")
        .map_err(|e| format!("cannot begin: {e}"))
}

/// One line of the authentication exchange, `\r\n` included (bounded).
fn read_line(stream: &mut UnixStream) -> Result<String, String> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while !line.ends_with(b"\r\n") {
        if line.len() > 512 {
            return Err("an authentication line over 512 bytes".into());
        }
        stream
            .read_exact(&mut byte)
            .map_err(|e| format!("no answer to the authentication: {e}"))?;
        line.push(byte[0]);
    }
    String::from_utf8(line).map_err(|_| "an authentication line that is not text".into())
}

/// A message being written, little-endian, its offsets counted from its
/// first byte (D-Bus aligns every value to its own size from there).
struct Writer(Vec<u8>);

impl Writer {
    fn pad(&mut self, to: usize) {
        while !self.0.len().is_multiple_of(to) {
            self.0.push(0);
        }
    }

    fn u32(&mut self, v: u32) {
        self.pad(4);
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    /// A string or an object path: its length, its bytes, a NUL.
    fn string(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
        self.0.push(0);
    }

    fn signature(&mut self, s: &str) {
        self.0.push(s.len() as u8);
        self.0.extend_from_slice(s.as_bytes());
        self.0.push(0);
    }

    /// A header field: its code and its value as a variant.
    fn field(&mut self, code: u8, kind: &str, value: &str) {
        self.pad(8);
        self.0.push(code);
        self.signature(kind);
        match kind {
            "g" => self.signature(value),
            _ => self.string(value),
        }
    }
}

/// The method call `org.freedesktop.DBus.Properties.Get(interface,
/// property)` on `path`, serial [`SERIAL`].
fn get_property(path: &str, interface: &str, property: &str) -> Vec<u8> {
    let mut body = Writer(Vec::new());
    body.string(interface);
    body.string(property);
    let mut m = Writer(vec![b'l', METHOD_CALL, 0, 1]);
    m.u32(body.0.len() as u32);
    m.u32(SERIAL);
    let mut fields = Writer(Vec::new());
    fields.field(FIELD_PATH, "o", path);
    fields.field(FIELD_INTERFACE, "s", "org.freedesktop.DBus.Properties");
    fields.field(FIELD_MEMBER, "s", "Get");
    fields.field(FIELD_SIGNATURE, "g", "ss");
    // The fields start at offset 16, a multiple of 8: aligned alike.
    m.u32(fields.0.len() as u32);
    m.0.extend_from_slice(&fields.0);
    m.pad(8);
    m.0.extend_from_slice(&body.0);
    m.0
}

/// One whole message from `stream`, its lengths bounded.
fn read_message(stream: &mut UnixStream) -> Result<Vec<u8>, String> {
    let mut fixed = [0u8; 16];
    stream
        .read_exact(&mut fixed)
        .map_err(|e| format!("no reply: {e}"))?;
    let reader = Reader::new(&fixed)?;
    let body = reader.u32_at(4)? as usize;
    let fields = reader.u32_at(12)? as usize;
    let header = (16 + fields).next_multiple_of(8);
    let total = header.saturating_add(body);
    if fields > MAX_MESSAGE || total > MAX_MESSAGE {
        return Err(format!("a reply of {total} bytes, over {MAX_MESSAGE}"));
    }
    let mut message = fixed.to_vec();
    message.resize(total, 0);
    stream
        .read_exact(&mut message[16..])
        .map_err(|e| format!("a reply cut short: {e}"))?;
    Ok(message)
}

/// What `message` says, if it is the reply to the call `serial`: the
/// string its variant body holds, or the error it names.
fn reply_to(message: &[u8], serial: u32) -> Result<Option<String>, String> {
    let r = Reader::new(message)?;
    let kind = r.byte(1)?;
    let fields_len = r.u32_at(12)? as usize;
    let mut at = 16;
    let end = 16 + fields_len;
    let (mut reply_serial, mut signature, mut error) = (None, String::new(), String::new());
    while at < end {
        at = at.next_multiple_of(8);
        if at >= end {
            break;
        }
        let code = r.byte(at)?;
        let (kind_sig, next) = r.signature(at + 1)?;
        at = next;
        match kind_sig.as_str() {
            "u" => {
                let v;
                (v, at) = r.u32(at)?;
                if code == FIELD_REPLY_SERIAL {
                    reply_serial = Some(v);
                }
            }
            "s" | "o" => {
                let v;
                (v, at) = r.string(at)?;
                if code == FIELD_ERROR_NAME {
                    error = v;
                }
            }
            "g" => {
                let v;
                (v, at) = r.signature(at)?;
                if code == FIELD_SIGNATURE {
                    signature = v;
                }
            }
            other => return Err(format!("a header field of type {other:?}")),
        }
    }
    if reply_serial != Some(serial) || !matches!(kind, METHOD_RETURN | ERROR) {
        return Ok(None);
    }
    if kind == ERROR {
        return Err(format!("systemd answered {error}"));
    }
    if signature != "v" {
        return Err(format!("a reply of signature {signature:?}, not a variant"));
    }
    let body = end.next_multiple_of(8);
    let (inner, at) = r.signature(body)?;
    if inner != "s" {
        return Err(format!("a property of type {inner:?}, not a string"));
    }
    let (value, _) = r.string(at)?;
    Ok(Some(value))
}

/// A received message, read little- or big-endian as its first byte says,
/// every read bounded by its length.
struct Reader<'a> {
    bytes: &'a [u8],
    little: bool,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Result<Reader<'a>, String> {
        let little = match bytes.first() {
            Some(b'l') => true,
            Some(b'B') => false,
            _ => return Err("a reply that is no D-Bus message".into()),
        };
        Ok(Reader { bytes, little })
    }

    fn byte(&self, at: usize) -> Result<u8, String> {
        self.bytes
            .get(at)
            .copied()
            .ok_or_else(|| "a reply cut short".to_owned())
    }

    fn u32_at(&self, at: usize) -> Result<u32, String> {
        let raw: [u8; 4] = self
            .bytes
            .get(at..at + 4)
            .and_then(|b| b.try_into().ok())
            .ok_or("a reply cut short")?;
        Ok(if self.little {
            u32::from_le_bytes(raw)
        } else {
            u32::from_be_bytes(raw)
        })
    }

    /// The u32 aligned at or after `at`, and where the next value starts.
    fn u32(&self, at: usize) -> Result<(u32, usize), String> {
        let at = at.next_multiple_of(4);
        Ok((self.u32_at(at)?, at + 4))
    }

    fn string(&self, at: usize) -> Result<(String, usize), String> {
        let (len, at) = self.u32(at)?;
        let len = len as usize;
        let raw = self
            .bytes
            .get(at..at.saturating_add(len))
            .ok_or("a reply cut short")?;
        let text = std::str::from_utf8(raw).map_err(|_| "a string that is not UTF-8")?;
        Ok((text.to_owned(), at + len + 1))
    }

    fn signature(&self, at: usize) -> Result<(String, usize), String> {
        let len = usize::from(self.byte(at)?);
        let raw = self
            .bytes
            .get(at + 1..at + 1 + len)
            .ok_or("a reply cut short")?;
        let text = std::str::from_utf8(raw).map_err(|_| "a signature that is not ASCII")?;
        Ok((text.to_owned(), at + 2 + len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reply to `serial` whose body is the variant string `value`, as
    /// sd-bus writes one.
    fn reply(serial: u32, value: &str) -> Vec<u8> {
        let mut body = Writer(Vec::new());
        body.signature("s");
        body.string(value);
        let mut fields = Writer(Vec::new());
        fields.pad(8);
        fields.0.push(FIELD_REPLY_SERIAL);
        fields.signature("u");
        fields.u32(serial);
        fields.field(FIELD_SIGNATURE, "g", "v");
        let mut m = Writer(vec![b'l', METHOD_RETURN, 1, 1]);
        m.u32(body.0.len() as u32);
        m.u32(7);
        m.u32(fields.0.len() as u32);
        m.0.extend_from_slice(&fields.0);
        m.pad(8);
        m.0.extend_from_slice(&body.0);
        m.0
    }

    #[test]
    fn the_call_names_the_property_its_path_and_its_arguments_signature() {
        let call = get_property("/org/freedesktop/systemd1", "org.x.Manager", "SystemState");

        let r = Reader::new(&call).unwrap();
        assert_eq!((call[1], call[3]), (METHOD_CALL, 1));
        assert_eq!(r.u32_at(8).unwrap(), SERIAL);
        let fields = r.u32_at(12).unwrap() as usize;
        let body = (16 + fields).next_multiple_of(8);
        assert_eq!(call.len(), body + r.u32_at(4).unwrap() as usize);
        let (interface, at) = r.string(body).unwrap();
        let (property, end) = r.string(at).unwrap();
        assert_eq!(
            (interface.as_str(), property.as_str()),
            ("org.x.Manager", "SystemState")
        );
        assert_eq!(end, call.len());
        let text = String::from_utf8_lossy(&call);
        assert!(text.contains("/org/freedesktop/systemd1"), "{text:?}");
        assert!(text.contains("\u{1}g\0\u{2}ss\0"), "{text:?}");
    }

    #[test]
    fn a_reply_to_the_call_gives_the_string_its_variant_holds() {
        let message = reply(SERIAL, "running");

        assert_eq!(reply_to(&message, SERIAL), Ok(Some("running".into())));
    }

    #[test]
    fn a_reply_to_another_call_is_passed_over() {
        let message = reply(SERIAL + 1, "running");

        assert_eq!(reply_to(&message, SERIAL), Ok(None));
    }

    #[test]
    fn a_reply_whose_string_runs_past_its_end_is_refused() {
        let mut message = reply(SERIAL, "running");
        let cut = message.len() - 4;
        message.truncate(cut);

        assert_eq!(
            reply_to(&message, SERIAL),
            Err("a reply cut short".to_owned())
        );
    }

    #[test]
    fn the_state_is_read_from_a_server_that_speaks_the_protocol() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("private");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let server = std::thread::spawn(move || {
            let (mut peer, _) = listener.accept().unwrap();
            let mut auth = [0u8; 1];
            peer.read_exact(&mut auth).unwrap();
            let mut line = Vec::new();
            while !line.ends_with(b"\r\n") {
                peer.read_exact(&mut auth).unwrap();
                line.push(auth[0]);
            }
            peer.write_all(b"OK 0123456789abcdef\r\n").unwrap();
            let mut begin = [0u8; 7];
            peer.read_exact(&mut begin).unwrap();
            let call = read_message(&mut peer).unwrap();
            peer.write_all(&reply(SERIAL, "degraded")).unwrap();
            (String::from_utf8(line).unwrap(), begin, call)
        });

        let state = system_state(&socket, Duration::from_secs(5));

        let (line, begin, call) = server.join().unwrap();
        assert_eq!(state, Ok("degraded".into()));
        let uid = nix::unistd::getuid().as_raw().to_string();
        let hex: String = uid.bytes().map(|b| format!("{b:02x}")).collect();
        assert_eq!(line, format!("AUTH EXTERNAL {hex}\r\n"));
        assert_eq!(&begin, b"BEGIN\r\n");
        assert_eq!(call[1], METHOD_CALL);
    }
}
