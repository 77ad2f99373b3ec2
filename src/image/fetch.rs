//! One download: stream the source into a hidden partial file, hashing as
//! the bytes pass, and name it by its digest only once the digest matches.

use std::fs::{self, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::ImageError;
use super::destinations::Unreachable;
use crate::state::atomic::sync_dir;

/// Bytes read and hashed per step.
const BLOCK: usize = 1 << 20;
/// Blocks in flight between the download and the hasher.
const PIPELINE: usize = 4;
/// Progress is reported at most this often.
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// Where and how much to fetch.
pub(super) struct Source<'a> {
    pub agent: &'a ureq::Agent,
    /// `--image-root`, canonical; `None` refuses `file://`.
    pub file_root: Option<&'a Path>,
    pub url: &'a str,
    pub sha256: &'a str,
    /// The most bytes the image may have.
    pub max_bytes: u64,
    pub pace: Pace,
}

/// How slow a download may be before it fails (transiently: the next pass
/// starts afresh, perhaps from a server that has recovered).
#[derive(Clone, Copy, Debug)]
pub(super) struct Pace {
    /// The longest a read may wait (the HTTP client's per-read timeout);
    /// also the window the rate is measured over.
    pub stall: Duration,
    /// The longest the whole download may take (the HTTP client's global
    /// timeout, checked here too for `file://`).
    pub deadline: Duration,
    /// The fewest bytes a second over one window; 0: no minimum.
    pub min_rate: u64,
}

/// Distinguishes the partial files of two downloads of one digest (from
/// two URLs) in one agent.
static PARTIALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Fetches the source into `dir/<sha256>`, verifying it. `progress` gets
/// (done, total when known) at a bounded rate.
pub(super) fn fetch(
    source: &Source<'_>,
    dir: &Path,
    progress: &mut dyn FnMut(u64, Option<u64>),
) -> Result<PathBuf, ImageError> {
    let (url, sha256) = (source.url, source.sha256);
    let (reader, total) = match url.strip_prefix("file://") {
        Some(path) => open_file(source.file_root, url, path)?,
        None => open_http(source.agent, url)?,
    };
    if let Some(total) = total
        && total > source.max_bytes
    {
        return Err(ImageError::TooLarge {
            url: url.into(),
            size: total,
            max: source.max_bytes,
        });
    }
    let partial = dir.join(format!(
        ".partial-{sha256}-{}-{}",
        std::process::id(),
        PARTIALS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let result = stream(reader, total, &partial, source, progress).and_then(|()| {
        match super::format::foreign_format(&partial) {
            Ok(None) => {}
            Ok(Some(format)) => {
                return Err(ImageError::NotRaw {
                    url: url.into(),
                    format,
                });
            }
            Err(e) => return Err(ImageError::store(partial.clone(), e)),
        }
        crate::crash::point("image.fetched");
        let target = dir.join(sha256);
        fs::rename(&partial, &target).map_err(|e| ImageError::store(target.clone(), e))?;
        sync_dir(dir).map_err(|e| ImageError::store(dir.to_path_buf(), e))?;
        crate::crash::point("image.stored");
        Ok(target)
    });
    if result.is_err() {
        // Never leave a partial download that looks like progress.
        let _ = fs::remove_file(&partial);
    }
    result
}

type Opened = (Box<dyn Read + Send>, Option<u64>);

/// A `file://` image: only a regular file under the operator's image root,
/// named by its path there and reached with no symlink at all: opened one
/// component at a time from the root, each relative to the directory the
/// last one opened and without following a link, so no rename or link
/// swapped in meanwhile can lead it out (what was checked is what is
/// read).
fn open_file(root: Option<&Path>, url: &str, path: &str) -> Result<Opened, ImageError> {
    let refuse = |why: String| ImageError::BadUrl {
        url: url.into(),
        why,
    };
    let Some(root) = root else {
        return Err(refuse(
            "file:// images are refused on this host; an operator may allow a directory with --image-root".into(),
        ));
    };
    let path = Path::new(path);
    if !path.is_absolute() {
        return Err(refuse(
            "a file URL needs an absolute path (file:///srv/images/x.raw)".into(),
        ));
    }
    let missing = |e: io::Error| ImageError::Source {
        url: url.into(),
        permanent: e.kind() == io::ErrorKind::NotFound,
        why: e.to_string(),
    };
    let under = path
        .strip_prefix(root)
        .ok()
        .filter(|rel| !root.as_os_str().is_empty() && rel.components().count() > 0);
    let Some(rel) = under else {
        return Err(refuse(format!(
            "it is not under the image root {}: name the image by its path there",
            crate::quote::path(root)
        )));
    };
    let file = match open_beneath(root, rel) {
        Ok(file) => file,
        Err(Beneath::Link) => {
            return Err(refuse(format!(
                "a component of its path under the image root {} is a symlink (or ..), and none is followed: name the file itself",
                crate::quote::path(root)
            )));
        }
        Err(Beneath::Io(e)) => return Err(missing(e)),
    };
    let meta = file.metadata().map_err(missing)?;
    if !meta.is_file() {
        return Err(refuse("it is not a regular file".into()));
    }
    Ok((Box::new(file), Some(meta.len())))
}

/// Why a file under the image root could not be opened.
enum Beneath {
    /// A component is a symlink, or `..`.
    Link,
    Io(io::Error),
}

/// `rel` under the directory `root`, opened one component at a time, each
/// relative to the last and never through a symlink; the file read-only.
fn open_beneath(root: &Path, rel: &Path) -> Result<fs::File, Beneath> {
    use nix::fcntl::{OFlag, openat};
    use nix::sys::stat::Mode;
    use std::path::Component;
    let io_err = |e: nix::Error| Beneath::Io(io::Error::from(e));
    let mut dir: std::os::fd::OwnedFd = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_DIRECTORY)
        .open(root)
        .map_err(Beneath::Io)?
        .into();
    let parts: Vec<Component<'_>> = rel.components().collect();
    for (i, part) in parts.iter().enumerate() {
        let Component::Normal(name) = part else {
            return Err(Beneath::Link);
        };
        let last = i + 1 == parts.len();
        let kind = if last {
            OFlag::O_NONBLOCK
        } else {
            OFlag::O_DIRECTORY
        };
        let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | kind;
        dir = match openat(&dir, *name, flags, Mode::empty()) {
            Ok(fd) => fd,
            // O_NOFOLLOW met a symlink: ELOOP for the last component,
            // ENOTDIR (with O_DIRECTORY) for one before it.
            Err(nix::Error::ELOOP) => return Err(Beneath::Link),
            Err(nix::Error::ENOTDIR) if !last => {
                let meta =
                    fs::symlink_metadata(root.join(rel.iter().take(i + 1).collect::<PathBuf>()));
                return match meta {
                    Ok(m) if m.file_type().is_symlink() => Err(Beneath::Link),
                    _ => Err(io_err(nix::Error::ENOTDIR)),
                };
            }
            Err(e) => return Err(io_err(e)),
        };
    }
    Ok(fs::File::from(dir))
}

/// Whether no answer could be had from the server at all: its name does
/// not resolve, or nothing takes the connection. The host's network (or
/// the mirror) must change, not the VM's spec; a server that answers
/// badly is the image's problem, not this.
fn unreachable(e: &ureq::Error) -> bool {
    use std::io::ErrorKind as K;
    match e {
        ureq::Error::HostNotFound | ureq::Error::ConnectionFailed => true,
        ureq::Error::Timeout(t) => matches!(t, ureq::Timeout::Resolve | ureq::Timeout::Connect),
        ureq::Error::Io(io) => matches!(
            io.kind(),
            K::ConnectionRefused | K::HostUnreachable | K::NetworkUnreachable | K::TimedOut
        ),
        _ => false,
    }
}

fn open_http(agent: &ureq::Agent, url: &str) -> Result<Opened, ImageError> {
    let scheme_ok =
        url.starts_with("http://") || (cfg!(feature = "tls") && url.starts_with("https://"));
    if !scheme_ok {
        return Err(ImageError::BadUrl {
            url: url.into(),
            why: if url.starts_with("https://") {
                "this build has no TLS; serve the image over http:// or file://, or build with --features tls".into()
            } else {
                "only http://, https:// and file:// images are served".into()
            },
        });
    }
    let response = agent.get(url).call().map_err(|e| match e {
        ureq::Error::Other(inner) if inner.is::<Unreachable>() => ImageError::BadUrl {
            url: url.into(),
            why: inner.to_string(),
        },
        e if unreachable(&e) => ImageError::Unreachable {
            url: url.into(),
            why: e.to_string(),
        },
        e => ImageError::Source {
            url: url.into(),
            permanent: false,
            why: e.to_string(),
        },
    })?;
    let status = response.status().as_u16();
    if (300..400).contains(&status) {
        // Where it points is not told: it may be an address the check
        // would refuse, and naming it would tell what lives there.
        return Err(ImageError::Source {
            url: url.into(),
            permanent: true,
            why: format!(
                "the server answered {status}, a redirect, and redirects are not followed (each hop could reach an address no one checked): put the final URL in the spec"
            ),
        });
    }
    if status != 200 {
        // A 4xx will not change by asking again, except timeouts and
        // rate limits; a 5xx might.
        let permanent = (400..500).contains(&status) && status != 408 && status != 429;
        return Err(ImageError::Source {
            url: url.into(),
            permanent,
            why: format!("the server answered {status}"),
        });
    }
    let total = response
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let reader = response
        .into_body()
        .into_with_config()
        .limit(u64::MAX)
        .reader();
    Ok((Box::new(reader), total))
}

fn stream(
    mut reader: Box<dyn Read + Send>,
    total: Option<u64>,
    partial: &Path,
    source: &Source<'_>,
    progress: &mut dyn FnMut(u64, Option<u64>),
) -> Result<(), ImageError> {
    let (url, sha256) = (source.url, source.sha256);
    let store_err = |source| ImageError::store(partial.to_path_buf(), source);
    let out = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(crate::state::perms::FILE)
        .open(partial)
        .map_err(store_err)?;
    // Hashing runs on its own thread, fed the blocks this one has read and
    // written: a download then takes as long as the slower of the network
    // and the hash, not both. Blocks go back through `spare` for reuse.
    let (full_tx, full_rx) = crossbeam_channel::bounded::<(Vec<u8>, usize)>(PIPELINE);
    let (spare_tx, spare_rx) = crossbeam_channel::bounded::<Vec<u8>>(PIPELINE + 1);
    for _ in 0..=PIPELINE {
        let _ = spare_tx.send(vec![0u8; BLOCK]);
    }
    let hasher = hash_alongside(full_rx, spare_tx).map_err(store_err)?;
    let mut done = 0u64;
    let mut reported = Instant::now();
    let mut pace = Pacer::new(source.pace);
    let mut written_back = 0u64;
    progress(0, total);
    let copied = (|| {
        loop {
            let Ok(mut block) = spare_rx.recv() else {
                return Err(ImageError::store(
                    partial.to_path_buf(),
                    io::Error::other("the hasher stopped"),
                ));
            };
            let n = fill(&mut *reader, &mut block, done, &mut pace, source)?;
            if n == 0 {
                return Ok(());
            }
            done += n as u64;
            write_sparse(&out, &block[..n], done - n as u64).map_err(store_err)?;
            if done - written_back >= WRITEBACK_EVERY {
                start_writeback(&out, written_back, done);
                written_back = done;
            }
            if full_tx.send((block, n)).is_err() {
                return Err(ImageError::store(
                    partial.to_path_buf(),
                    io::Error::other("the hasher stopped"),
                ));
            }
            if reported.elapsed() >= PROGRESS_EVERY {
                progress(done, total);
                reported = Instant::now();
            }
        }
    })();
    drop(full_tx);
    let got = hasher.join().unwrap_or_default();
    copied?;
    progress(done, total);
    if let Some(total) = total
        && done != total
    {
        return Err(ImageError::Source {
            url: url.into(),
            permanent: false,
            why: format!("the download ended after {done} of {total} bytes"),
        });
    }
    if got != sha256 {
        return Err(ImageError::Mismatch {
            url: url.into(),
            want: sha256.into(),
        });
    }
    // A run of zeros at the end was never written: the size says it.
    out.set_len(done).map_err(store_err)?;
    out.sync_data().map_err(store_err)
}

/// Fills `block` from `reader`, until it is full or the source ends, each
/// read held to the pace and to the image's bound (`done` bytes came
/// before it); how many bytes it holds. A socket answers a read with what
/// has arrived (tens of KiB): a block sent to the hasher for each read was
/// a thread's wake-up for each, on a host whose cores the download and
/// the hash share (`make bench-storage`: a third of a download's time).
fn fill(
    reader: &mut dyn Read,
    block: &mut [u8],
    done: u64,
    pace: &mut Pacer,
    source: &Source<'_>,
) -> Result<usize, ImageError> {
    let mut filled = 0;
    while filled < block.len() {
        let n = match reader.read(&mut block[filled..]) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(broke_off(&e, done + filled as u64, pace, source)),
        };
        filled += n;
        let so_far = done + filled as u64;
        if let Err(why) = pace.check(so_far) {
            return Err(ImageError::Source {
                url: source.url.into(),
                permanent: false,
                why: why.to_string(),
            });
        }
        if so_far > source.max_bytes {
            return Err(ImageError::TooLarge {
                url: source.url.into(),
                size: so_far,
                max: source.max_bytes,
            });
        }
    }
    Ok(filled)
}

/// How much of a download is written before its write-back is started.
const WRITEBACK_EVERY: u64 = 16 << 20;

/// Starts writing `[from, to)` of `out` to its disk, without waiting: the
/// disk works while the download goes on, and the `fdatasync` that makes
/// the image durable at its end finds little left to write (`make
/// bench-storage`: it took a third of a 512 MiB download's time, all at
/// its end). A failure here only leaves that work to the `fdatasync`.
#[cfg(target_os = "linux")]
fn start_writeback(out: &std::fs::File, from: u64, to: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (i64::try_from(from), i64::try_from(to - from)) else {
        return;
    };
    // SAFETY: sync_file_range only reads its arguments; the fd is open.
    unsafe {
        nix::libc::sync_file_range(
            out.as_raw_fd(),
            offset,
            len,
            nix::libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn start_writeback(_: &std::fs::File, _: u64, _: u64) {}

/// The granule of holes: a page, a filesystem's usual block.
const PAGE: usize = 4096;

/// Writes `bytes` at `offset` of `out`, leaving each page of zeros a hole:
/// an image that is mostly empty (a fresh filesystem, a sparse source)
/// takes only its data on the host's disk, as its source did, not its
/// whole size. `out` was made empty, so what is not written reads as
/// zeros.
fn write_sparse(out: &std::fs::File, bytes: &[u8], offset: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut run: Option<usize> = None;
    for (i, page) in bytes.chunks(PAGE).enumerate() {
        let at = i * PAGE;
        let zero = page.iter().all(|b| *b == 0);
        match (run, zero) {
            (None, false) => run = Some(at),
            (Some(start), true) => {
                out.write_all_at(&bytes[start..at], offset + start as u64)?;
                run = None;
            }
            _ => {}
        }
    }
    if let Some(start) = run {
        out.write_all_at(&bytes[start..], offset + start as u64)?;
    }
    Ok(())
}

/// Hashes, on a thread of its own, the blocks sent on `full` (each with
/// its length), handing each back on `spare`; its result is the digest.
fn hash_alongside(
    full: crossbeam_channel::Receiver<(Vec<u8>, usize)>,
    spare: crossbeam_channel::Sender<Vec<u8>>,
) -> io::Result<std::thread::JoinHandle<String>> {
    std::thread::Builder::new()
        .name("image-hash".into())
        .spawn(move || {
            let mut hasher = Sha256::new();
            for (block, n) in full {
                hasher.update(&block[..n]);
                if spare.send(block).is_err() {
                    break;
                }
            }
            crate::hex::encode(&hasher.finalize())
        })
}

/// Why a download broke off after `done` bytes with the read error `e`:
/// out of its whole time, stalled, or cut; each may pass.
fn broke_off(e: &io::Error, done: u64, pace: &Pacer, source: &Source<'_>) -> ImageError {
    let why = if is_global_timeout(e) {
        pace.too_long(done).to_string()
    } else if is_timeout(e) {
        format!(
            "the server sent nothing for {} s after {done} bytes (--image-stall-timeout); the next attempt starts afresh",
            source.pace.stall.as_secs_f64()
        )
    } else {
        format!("the download broke off after {done} bytes: {e}")
    };
    ImageError::Source {
        url: source.url.into(),
        permanent: false,
        why,
    }
}

/// The sha256 of a file, streamed: for checking and for benchmarks.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    let mut file = fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; BLOCK];
    loop {
        match file.read(&mut buf)? {
            0 => return Ok(crate::hex::encode(&hasher.finalize())),
            n => hasher.update(&buf[..n]),
        }
    }
}

/// A download's clock: its overall deadline and its rate, window by
/// window.
struct Pacer {
    pace: Pace,
    started: Instant,
    window_started: Instant,
    window_bytes_before: u64,
}

impl Pacer {
    fn new(pace: Pace) -> Pacer {
        let now = Instant::now();
        Pacer {
            pace,
            started: now,
            window_started: now,
            window_bytes_before: 0,
        }
    }

    /// After a read that brought the total to `done`: whether the download
    /// may go on, or why not.
    fn check(&mut self, done: u64) -> Result<(), OutOfPace> {
        if self.started.elapsed() > self.pace.deadline {
            return Err(self.too_long(done));
        }
        let window = self.window_started.elapsed();
        if window < self.pace.stall {
            return Ok(());
        }
        let got = done - self.window_bytes_before;
        let rate = got as f64 / window.as_secs_f64();
        if self.pace.min_rate > 0 && rate < self.pace.min_rate as f64 {
            return Err(OutOfPace::Slow {
                got,
                window,
                min_rate: self.pace.min_rate,
            });
        }
        self.window_started = Instant::now();
        self.window_bytes_before = done;
        Ok(())
    }

    fn too_long(&self, done: u64) -> OutOfPace {
        OutOfPace::Overdue {
            deadline: self.pace.deadline,
            done,
        }
    }
}

/// Why a download's pace ends it; either may pass.
#[derive(Debug)]
enum OutOfPace {
    /// Still running at `--image-download-timeout`, with `done` bytes.
    Overdue { deadline: Duration, done: u64 },
    /// `got` bytes in the last `window`, below `--image-min-rate-kib`.
    Slow {
        got: u64,
        window: Duration,
        min_rate: u64,
    },
}

impl std::fmt::Display for OutOfPace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OutOfPace::Overdue { deadline, done } => write!(
                f,
                "the download was still running after {} s, with {done} bytes (--image-download-timeout); the next attempt starts afresh",
                deadline.as_secs_f64()
            ),
            OutOfPace::Slow {
                got,
                window,
                min_rate,
            } => write!(
                f,
                "the server sent {got} bytes in {:.1} s ({:.0} bytes/s), slower than --image-min-rate-kib ({} KiB/s); the next attempt starts afresh",
                window.as_secs_f64(),
                *got as f64 / window.as_secs_f64(),
                min_rate / 1024
            ),
        }
    }
}

/// Whether a read failed on the HTTP client's overall timeout.
fn is_global_timeout(e: &io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<ureq::Error>())
        .is_some_and(|u| matches!(u, ureq::Error::Timeout(ureq::Timeout::Global)))
}

/// Whether a read failed on the per-read timeout (ureq wraps its own
/// timeout error in the io::Error it returns).
fn is_timeout(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::TimedOut
        || e.get_ref()
            .and_then(|inner| inner.downcast_ref::<ureq::Error>())
            .is_some_and(|u| matches!(u, ureq::Error::Timeout(_)))
}
