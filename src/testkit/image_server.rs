//! A file server on 127.0.0.1 for image-cache tests and benchmarks: serves
//! one file at any path, counts requests, and can refuse or dawdle.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

/// How the server answers.
#[derive(Clone, Debug)]
pub enum Serve {
    /// 200 with the file's bytes, sent as fast as the socket takes them.
    File(PathBuf),
    /// 200 with the file's bytes, 64 KiB at a time with this pause between.
    Throttled(PathBuf, Duration),
    /// This status and no body.
    Status(u16),
    /// 200 with the file's length, its first bytes (this many), then
    /// nothing: a server stalled mid-body. The connection stays open until
    /// the server is dropped.
    Stall(PathBuf, usize),
    /// 302 to this URL.
    Redirect(String),
    /// 200 with the file's length, then its bytes one at a time with this
    /// pause between: a server that never stalls long enough to time out.
    Trickle(PathBuf, Duration),
    /// Waits this long, then answers as the inner mode says.
    Delayed(Duration, Box<Serve>),
}

pub struct ImageServer {
    addr: SocketAddr,
    serve: Arc<Mutex<Serve>>,
    requests: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ImageServer {
    pub fn start(serve: Serve) -> std::io::Result<ImageServer> {
        ImageServer::start_on(std::net::Ipv4Addr::LOCALHOST, serve)
    }

    /// A server on another loopback address (127.0.0.0/8 is all this
    /// host's): for tests that tell two servers apart by address.
    pub fn start_on(ip: std::net::Ipv4Addr, serve: Serve) -> std::io::Result<ImageServer> {
        let listener = TcpListener::bind((ip, 0))?;
        let addr = listener.local_addr()?;
        let serve = Arc::new(Mutex::new(serve));
        let requests = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (serve, requests, stop) =
                (Arc::clone(&serve), Arc::clone(&requests), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("image-server".into())
                .spawn(move || {
                    for conn in listener.incoming() {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        let Ok(conn) = conn else { continue };
                        requests.fetch_add(1, Ordering::Relaxed);
                        let how = serve.lock().clone();
                        // One thread per request, so concurrent clients overlap.
                        let _ = std::thread::Builder::new().name("image-conn".into()).spawn(
                            move || {
                                let _ = answer(conn, &how);
                            },
                        );
                    }
                })?
        };
        Ok(ImageServer {
            addr,
            serve,
            requests,
            stop,
            thread: Some(thread),
        })
    }

    pub fn url(&self, name: &str) -> String {
        format!("http://{}/{name}", self.addr)
    }

    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::Relaxed)
    }

    pub fn set(&self, serve: Serve) {
        *self.serve.lock() = serve;
    }
}

impl Drop for ImageServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn answer(conn: TcpStream, how: &Serve) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    while reader.read_line(&mut line)? > 2 {
        line.clear();
    }
    answer_with(conn, how)
}

/// The answer, once the request was read.
fn answer_with(conn: TcpStream, how: &Serve) -> std::io::Result<()> {
    let mut conn = conn;
    let (path, pause) = match how {
        Serve::Status(code) => {
            return write!(
                conn,
                "HTTP/1.1 {code} \r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
        }
        Serve::Delayed(wait, then) => {
            std::thread::sleep(*wait);
            return answer_with(conn, then);
        }
        Serve::Trickle(p, pause) => {
            let bytes = std::fs::read(p)?;
            write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                bytes.len()
            )?;
            for b in bytes {
                conn.write_all(&[b])?;
                conn.flush()?;
                std::thread::sleep(*pause);
            }
            return Ok(());
        }
        Serve::Redirect(to) => {
            return write!(
                conn,
                "HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
        }
        Serve::File(p) => (p, None),
        Serve::Throttled(p, pause) => (p, Some(*pause)),
        Serve::Stall(p, first) => {
            let bytes = std::fs::read(p)?;
            write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                bytes.len()
            )?;
            conn.write_all(&bytes[..(*first).min(bytes.len())])?;
            conn.flush()?;
            // Hold the connection, sending nothing, until the client gives
            // up (its read then fails, and so does this one).
            let mut sink = [0u8; 1];
            let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(60)));
            let _ = std::io::Read::read(&mut conn, &mut sink);
            return Ok(());
        }
    };
    let mut file = File::open(path)?;
    let len = file.metadata()?.len();
    write!(
        conn,
        "HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
    )?;
    match pause {
        None => {
            std::io::copy(&mut file, &mut conn)?;
        }
        Some(pause) => {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = file.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                conn.write_all(&buf[..n])?;
                std::thread::sleep(pause);
            }
        }
    }
    conn.flush()
}
