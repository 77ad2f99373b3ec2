//! A fake control plane: a tiny HTTP/1.1 server on 127.0.0.1 that answers
//! the agent's two requests as a test tells it to, and records every
//! request it got.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prost::Message;

use crate::pb;

/// How the fake answers a request.
#[derive(Clone, Debug)]
pub enum Answer {
    /// 200 with this snapshot (for the snapshot endpoint).
    Snapshot(pb::Snapshot),
    /// 200 with an empty body (a ReportResponse).
    Accepted,
    /// This status, empty body.
    Status(u16),
    /// 200 with bytes that are no protobuf message.
    Garbage,
    /// 200 with a body of this many bytes.
    Oversized(usize),
    /// 200 with exactly these bytes.
    Raw(Vec<u8>),
    /// 301 to this location.
    Redirect(String),
    /// Waits this long before answering with the inner answer.
    Slow(Duration, Box<Answer>),
}

/// One request the fake received.
#[derive(Clone, Debug)]
pub struct Request {
    pub path: String,
    /// Header names lowercased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub at: Instant,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

struct State {
    snapshot: Answer,
    report: Answer,
    requests: Vec<Request>,
}

pub struct FakeControlPlane {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FakeControlPlane {
    /// Starts on a free port of 127.0.0.1.
    pub fn start() -> std::io::Result<FakeControlPlane> {
        FakeControlPlane::start_on(0)
    }

    /// Starts on `port` (to bring back a control plane that was down).
    pub fn start_on(port: u16) -> std::io::Result<FakeControlPlane> {
        let listener = TcpListener::bind(("127.0.0.1", port))?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State {
            snapshot: Answer::Snapshot(pb::Snapshot::default()),
            report: Answer::Accepted,
            requests: Vec::new(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (state, stop) = (Arc::clone(&state), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("fake-cp".into())
                .spawn(move || serve(&listener, &state, &stop))?
        };
        Ok(FakeControlPlane {
            addr,
            state,
            stop,
            thread: Some(thread),
        })
    }

    /// A port on 127.0.0.1 that nothing listens on (for a control plane
    /// that is down), found by binding and releasing it.
    pub fn free_port() -> std::io::Result<u16> {
        Ok(TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port())
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn answer_snapshots(&self, answer: Answer) {
        self.state.lock().snapshot = answer;
    }

    pub fn answer_reports(&self, answer: Answer) {
        self.state.lock().report = answer;
    }

    pub fn requests(&self) -> Vec<Request> {
        self.state.lock().requests.clone()
    }

    /// Every report received, decoded.
    pub fn reports(&self) -> Vec<pb::ReportRequest> {
        self.requests()
            .iter()
            .filter(|r| r.path == "/v1/agent/report")
            .filter_map(|r| pb::ReportRequest::decode(r.body.as_slice()).ok())
            .collect()
    }
}

impl Drop for FakeControlPlane {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the blocking accept so the thread sees the flag.
        let _ = TcpStream::connect(self.addr);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Each connection on a thread of its own: a slow answer (a control plane
/// that hangs) neither delays the next request nor the fake's shutdown.
fn serve(listener: &TcpListener, state: &Arc<Mutex<State>>, stop: &AtomicBool) {
    for conn in listener.incoming() {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        if let Ok(conn) = conn {
            let state = Arc::clone(state);
            let _ = std::thread::Builder::new()
                .name("fake-cp-conn".into())
                .spawn(move || handle(conn, &state));
        }
    }
}

fn handle(conn: TcpStream, state: &Mutex<State>) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" {
            break;
        }
        if let Some((n, v)) = h.trim_end().split_once(':') {
            headers.push((n.trim().to_ascii_lowercase(), v.trim().to_owned()));
        }
    }
    let len = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; len];
    reader.read_exact(&mut body)?;
    let answer = {
        let mut s = state.lock();
        s.requests.push(Request {
            path: path.clone(),
            headers,
            body,
            at: Instant::now(),
        });
        if path == "/v1/agent/snapshot" {
            s.snapshot.clone()
        } else {
            s.report.clone()
        }
    };
    respond(conn, answer)
}

fn respond(mut conn: TcpStream, answer: Answer) -> std::io::Result<()> {
    let mut extra = String::new();
    let (status, body) = match answer {
        Answer::Slow(wait, inner) => {
            std::thread::sleep(wait);
            return respond(conn, *inner);
        }
        Answer::Raw(bytes) => (200, bytes),
        Answer::Redirect(location) => {
            extra = format!("Location: {location}\r\n");
            (301, Vec::new())
        }
        Answer::Snapshot(s) => (200, s.encode_to_vec()),
        Answer::Accepted => (200, Vec::new()),
        Answer::Status(code) => (code, Vec::new()),
        // A field header promising 200 bytes that never come.
        Answer::Garbage => (200, vec![0x0a, 0xc8, 0x01, 0x01]),
        Answer::Oversized(n) => (200, vec![0; n]),
    };
    write!(
        conn,
        "HTTP/1.1 {status} \r\n{extra}Content-Type: application/x-protobuf\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    conn.write_all(&body)?;
    conn.flush()
}
