//! The image cache: (url, sha256) → a verified raw base image under
//! `STATE_DIR/images/<sha256>`.
//!
//! - A file named by a digest has been verified against it, so a hit is a
//!   stat: no re-download and no re-hash, across agent restarts too.
//!   Downloads in progress live under hidden `.partial-*` names, which are
//!   never mistaken for images and are swept at start.
//! - Concurrent requests for one digest from one URL share **one**
//!   download, on its own thread (`image-<sha8>`); another URL for the same
//!   digest is another download, so a VM naming a URL that fails cannot
//!   fail a VM naming a good one. Each requester is held to its own disk
//!   size. A waiter whose pass deadline passes stops waiting but does not
//!   cancel the download: it lands for the next pass.
//! - The digest is computed while streaming. A mismatch deletes the partial
//!   file and is permanent, naming only the expected digest (the computed
//!   one would tell whoever named the URL a digest of what answers there);
//!   so is a 4xx other than 408/429, a redirect, or a missing file.
//!   Everything else is transient.
//! - Sources are untrusted (see the threat model in the crate's docs): `file://` is
//!   served only from under the operator's `--image-root`; HTTP connects
//!   only to addresses `destinations` allows, and follows no redirect; a download may
//!   not be larger than the VM's disk; a server that sends nothing for the
//!   stall timeout, averages less than the minimum rate over one, or is
//!   still sending at the download timeout fails the download
//!   (transiently), which frees its in-flight entry for a fresh one.

mod destinations;
mod fetch;
mod format;
mod prune;

use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

pub use destinations::{Reach, Refused, this_hosts_addresses};
pub use fetch::sha256_file;
pub use prune::{Base, Cached, Hold, PruneError, Pruned, cached, prune, prune_to};

use crate::deadline::Deadline;
use crate::error::{DeadlineExpired, Failure, Outcome};
use crate::threads::{Outlives, detached};

/// Called as an image download advances: (bytes done, total when known).
/// It may be called from a shared download thread after the pass that asked
/// gave up; the engine's generation check makes such late calls harmless.
pub type Progress = Arc<dyn Fn(u64, Option<u64>) + Send + Sync>;

/// A base image a create asks for: where it is, its digest, the most it
/// may be (the VM's disk), the pass's deadline, and who is told how far
/// its download has come.
pub struct Request<'a> {
    pub url: &'a str,
    pub sha256: &'a str,
    pub max_bytes: u64,
    pub deadline: Deadline,
    pub progress: Progress,
}

#[derive(Debug, Clone)]
pub enum ImageError {
    BadDigest {
        sha256: String,
    },
    BadUrl {
        url: String,
        why: String,
    },
    Source {
        url: String,
        permanent: bool,
        why: String,
    },
    /// The server could not be reached at all (see `fetch::unreachable`):
    /// a host condition, which spends no create attempt.
    Unreachable {
        url: String,
        why: String,
    },
    /// The bytes do not hash to the spec's digest. What they do hash to
    /// is never told: whoever named the URL could learn a digest of what
    /// answers there (a host file, a service the agent can reach).
    Mismatch {
        url: String,
        want: String,
    },
    TooLarge {
        url: String,
        size: u64,
        max: u64,
    },
    /// A verified image in a format other than raw (see `format`).
    NotRaw {
        url: String,
        format: &'static str,
    },
    Store {
        path: PathBuf,
        source: std::sync::Arc<std::io::Error>,
    },
}

impl ImageError {
    fn store(path: PathBuf, source: std::io::Error) -> ImageError {
        ImageError::Store {
            path,
            source: Arc::new(source),
        }
    }
}

impl fmt::Display for ImageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use crate::quote::url as shown;
        match self {
            ImageError::BadDigest { sha256 } => {
                write!(f, "{sha256:?} is not a sha256 (64 hex characters)")
            }
            ImageError::BadUrl { url, why } => write!(f, "cannot fetch {}: {why}", shown(url)),
            ImageError::Source { url, why, .. } => write!(f, "cannot fetch {}: {why}", shown(url)),
            ImageError::Unreachable { url, why } => write!(
                f,
                "cannot reach the image server of {}: {why}; check that this host can reach it (its address, DNS, a firewall)",
                shown(url)
            ),
            ImageError::Mismatch { url, want } => write!(
                f,
                "the image at {} does not have sha256 {want}; the download was deleted: check the digest the spec names",
                shown(url)
            ),
            ImageError::TooLarge { url, size, max } => write!(
                f,
                "the image at {} is {size} bytes or more, larger than the VM's disk ({max} bytes); give the VM a larger disk_gb or a smaller image",
                shown(url)
            ),
            ImageError::NotRaw { url, format } => write!(
                f,
                "the image at {} is a {format} image; guests boot raw images only (a format header can name a host file as a backing file): convert it with `qemu-img convert -O raw IMAGE IMAGE.raw` and publish the raw file's sha256",
                shown(url)
            ),
            ImageError::Store { path, source } => {
                write!(f, "cannot write {}: {source}", path.display())
            }
        }
    }
}

impl std::error::Error for ImageError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ImageError::Store { source, .. } => Some(&**source),
            _ => None,
        }
    }
}

impl Failure for ImageError {
    fn is_permanent(&self) -> bool {
        match self {
            ImageError::BadDigest { .. }
            | ImageError::BadUrl { .. }
            | ImageError::Mismatch { .. }
            | ImageError::TooLarge { .. }
            | ImageError::NotRaw { .. } => true,
            ImageError::Source { permanent, .. } => *permanent,
            ImageError::Unreachable { .. } | ImageError::Store { .. } => false,
        }
    }

    fn is_host_condition(&self) -> bool {
        matches!(self, ImageError::Unreachable { .. })
    }
}

/// One download that any number of passes may be waiting for.
struct Download {
    state: Mutex<DownloadState>,
    changed: Condvar,
    /// The bound the download was started with: its first requester's
    /// disk. A later requester with a larger disk that this bound failed
    /// starts one of its own; one with a smaller disk checks the result.
    max_bytes: u64,
}

struct DownloadState {
    result: Option<Result<PathBuf, ImageError>>,
    listeners: Vec<Progress>,
}

/// A download thread's stack.
const DOWNLOAD_STACK: usize = 2 << 20;

/// How images are fetched on this host: the operator's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageOptions {
    /// An HTTP proxy (`--proxy`, already checked); proxy variables in the
    /// environment are never used.
    pub proxy: Option<String>,
    /// The directory `file://` images must be under (`--image-root`);
    /// `None` refuses every `file://` image.
    pub file_root: Option<PathBuf>,
    /// How long a download may receive nothing before it fails; also the
    /// window its rate is measured over.
    pub stall: Duration,
    /// How long one download may take in all.
    pub deadline: Duration,
    /// The fewest bytes a second a download may average over one stall
    /// window (0: no minimum): a server that trickles a byte just inside
    /// each stall timeout fails on this.
    pub min_rate: u64,
    /// Which addresses downloads may connect to (see `destinations`).
    pub reach: Reach,
}

impl Default for ImageOptions {
    fn default() -> ImageOptions {
        ImageOptions {
            proxy: None,
            file_root: None,
            stall: Duration::from_secs(60),
            deadline: Duration::from_secs(3600),
            min_rate: 64 << 10,
            reach: Reach::default(),
        }
    }
}

pub struct ImageCache {
    dir: PathBuf,
    agent: ureq::Agent,
    /// `--image-root`, canonical.
    file_root: Option<PathBuf>,
    pace: fetch::Pace,
    /// Downloads running, by (digest, URL): two URLs for one digest are two
    /// downloads, so a URL that fails (a 404, a trickle, a lie) fails only
    /// the VMs that named it.
    inflight: Arc<Mutex<HashMap<Key, Arc<Download>>>>,
    stats: Arc<CacheStats>,
}

/// What the cache counted, for the metrics file.
#[derive(Debug, Default)]
pub struct CacheStats {
    /// Resolves answered from the cache.
    pub hits: crate::metrics::Counter,
    /// Downloads that landed (verified).
    pub downloads: crate::metrics::Counter,
    /// Bytes of the downloads that landed.
    pub download_bytes: crate::metrics::Counter,
}

impl ImageCache {
    /// A cache over `dir` (the state dir's `images/`) with the default
    /// options: direct downloads, no `file://` images.
    pub fn new(dir: PathBuf) -> ImageCache {
        ImageCache::with(dir, &ImageOptions::default())
    }

    /// A cache over `dir` fetching as `options` say. An `--image-root`
    /// that cannot be resolved refuses every `file://` image (each refusal
    /// says why).
    pub fn with(dir: PathBuf, options: &ImageOptions) -> ImageCache {
        let config = ureq::Agent::config_builder()
            .timeout_connect(Some(Duration::from_secs(15)))
            .timeout_recv_response(Some(Duration::from_secs(60)))
            .timeout_per_read(Some(options.stall))
            .timeout_global(Some(options.deadline))
            .http_status_as_error(false)
            // A redirect is answered as it is (fetch refuses it): a hop
            // would reach an address nobody checked.
            .max_redirects(0)
            .max_redirects_will_error(false)
            .proxy(
                options
                    .proxy
                    .as_deref()
                    .and_then(|p| ureq::Proxy::new(p).ok()),
            )
            .build();
        let agent = ureq::Agent::with_parts(
            config,
            ureq::unversioned::transport::DefaultConnector::default(),
            destinations::CheckedResolver::new(options.reach.clone()),
        );
        let file_root = options.file_root.as_ref().map(|root| {
            fs::canonicalize(root).unwrap_or_else(|e| {
                log::error!(
                    "--image-root {}: {e}; file:// images are refused",
                    crate::quote::path(root)
                );
                PathBuf::new()
            })
        });
        ImageCache {
            dir,
            agent,
            file_root,
            pace: fetch::Pace {
                stall: options.stall,
                deadline: options.deadline,
                min_rate: options.min_rate,
            },
            inflight: Arc::new(Mutex::new(HashMap::new())),
            stats: Arc::new(CacheStats::default()),
        }
    }

    pub fn stats(&self) -> &CacheStats {
        &self.stats
    }

    /// Bytes the cached images hold on disk (partial downloads included).
    pub fn bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.metadata().ok())
            .filter(|m| m.is_file())
            .map(|m| m.blocks().saturating_mul(512))
            .sum()
    }

    /// Removes the partial downloads a crashed agent left; returns how
    /// many. Only safe before any download starts (start-up recovery).
    pub fn sweep_partials(&self) -> usize {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return 0;
        };
        entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(".partial-"))
            .filter(|e| fs::remove_file(e.path()).is_ok())
            .count()
    }

    pub fn path_of(&self, sha256: &str) -> PathBuf {
        self.dir.join(sha256)
    }

    /// The download of `sha256` from `url`: the running one, or a new one
    /// on its own thread. Checked under the in-flight lock, so one URL is
    /// never fetched twice at once for one digest, nor again once its
    /// digest landed.
    fn download(
        &self,
        url: &str,
        sha256: &str,
        max_bytes: u64,
        progress: Progress,
    ) -> Result<Arc<Download>, ImageError> {
        let key: Key = (sha256.to_owned(), url.to_owned());
        let mut inflight = self.inflight.lock();
        if let Some(d) = inflight.get(&key) {
            d.state.lock().listeners.push(progress);
            return Ok(Arc::clone(d));
        }
        let path = self.path_of(sha256);
        if path.is_file() {
            return Ok(Arc::new(Download::finished(Ok(path), max_bytes)));
        }
        let download = Arc::new(Download {
            state: Mutex::new(DownloadState {
                result: None,
                listeners: vec![progress],
            }),
            changed: Condvar::new(),
            max_bytes,
        });
        let (agent, dir, root, pace) = (
            self.agent.clone(),
            self.dir.clone(),
            self.file_root.clone(),
            self.pace,
        );
        let (registry, d, stats) = (
            Arc::clone(&self.inflight),
            Arc::clone(&download),
            Arc::clone(&self.stats),
        );
        let name = format!("image-{}", &sha256[..8]);
        let thread_key = key.clone();
        // Rust's default stack: an HTTP client (and, with the tls feature,
        // a TLS handshake) below it.
        detached(name, DOWNLOAD_STACK, Outlives::ThePass, move || {
            let (sha, url) = &thread_key;
            let mut report = |done: u64, total: Option<u64>| {
                let listeners = d.state.lock().listeners.clone();
                for listener in listeners {
                    listener(done, total);
                }
            };
            let source = fetch::Source {
                agent: &agent,
                file_root: root.as_deref(),
                url,
                sha256: sha,
                max_bytes,
                pace,
            };
            let result = fetch::fetch(&source, &dir, &mut report);
            let shown = crate::quote::url(url);
            match &result {
                Ok(path) => {
                    stats.downloads.inc();
                    stats
                        .download_bytes
                        .add(fs::metadata(path).map_or(0, |m| m.len()));
                    log::info!("image {sha}: downloaded and verified from {shown}");
                }
                Err(e) => log::warn!("image {sha}: {e}"),
            }
            // Deregister first: a pass arriving after this finds the
            // file (or, on failure, starts afresh).
            registry.lock().remove(&thread_key);
            let mut state = d.state.lock();
            state.result = Some(result);
            state.listeners.clear();
            d.changed.notify_all();
        })
        .map_err(|e| ImageError::store(self.dir.clone(), e))?;
        inflight.insert(key, Arc::clone(&download));
        Ok(download)
    }
}

/// What identifies a download: the digest wanted and the URL asked.
type Key = (String, String);

impl Download {
    fn finished(result: Result<PathBuf, ImageError>, max_bytes: u64) -> Download {
        Download {
            state: Mutex::new(DownloadState {
                result: Some(result),
                listeners: Vec::new(),
            }),
            changed: Condvar::new(),
            max_bytes,
        }
    }
}

fn valid_digest(sha256: &str) -> bool {
    sha256.len() == 64
        && sha256
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl ImageCache {
    /// [`ImageCache::resolve`], the image then held against a prune until
    /// the returned [`Base`] is dropped. An image pruned between its find
    /// and the hold is found again (fetched).
    pub fn resolve_held(&self, wanted: Request<'_>) -> Outcome<Base> {
        let Request {
            url,
            sha256,
            max_bytes,
            deadline,
            progress,
        } = wanted;
        let lock = crate::state::Layout::images_lock_in(&self.dir);
        loop {
            let path = self.resolve(url, sha256, max_bytes, deadline, Arc::clone(&progress))?;
            let hold = Hold::take(&lock).map_err(|e| ImageError::store(lock.clone(), e))?;
            if path.is_file() {
                return Ok(Base::held(path, hold));
            }
            log::info!("image {sha256} was pruned as it was found; fetching it again");
            if deadline.expired() {
                return Err(DeadlineExpired {
                    waiting_for: "the image, pruned as it was found",
                }
                .into());
            }
        }
    }

    /// The verified base image for `sha256`: the cached one, or downloaded
    /// from `url` (one download per digest, however many VMs ask; it may
    /// be at most `max_bytes`, the asking VM's disk), within `deadline`. A
    /// download outliving its deadline goes on and lands for a later pass.
    pub fn resolve(
        &self,
        url: &str,
        sha256: &str,
        max_bytes: u64,
        deadline: Deadline,
        progress: Progress,
    ) -> Outcome<PathBuf> {
        if !valid_digest(sha256) {
            return Err(ImageError::BadDigest {
                sha256: sha256.into(),
            }
            .into());
        }
        let path = self.path_of(sha256);
        if path.is_file() {
            // Cached by an agent that did not check the format.
            return match format::foreign_format(&path) {
                Ok(None) => {
                    self.stats.hits.inc();
                    own_bound(path, url, max_bytes)
                }
                Ok(Some(format)) => Err(ImageError::NotRaw {
                    url: url.into(),
                    format,
                }
                .into()),
                Err(e) => Err(ImageError::store(path, e).into()),
            };
        }
        loop {
            let download = self.download(url, sha256, max_bytes, Arc::clone(&progress))?;
            let result = download.wait(deadline)?;
            match result {
                // Too large for the bound it was started with, not for
                // this requester's: its own download, with its own bound.
                Err(ImageError::TooLarge { size, .. })
                    if download.max_bytes < max_bytes && size <= max_bytes =>
                {
                    continue;
                }
                Err(e) => return Err(e.into()),
                Ok(path) => return own_bound(path, url, max_bytes),
            }
        }
    }
}

impl Download {
    /// The download's result, once it has one; a deadline passing first
    /// leaves the download running, to land for a later pass.
    fn wait(&self, deadline: Deadline) -> Outcome<Result<PathBuf, ImageError>> {
        let mut state = self.state.lock();
        loop {
            if let Some(result) = &state.result {
                return Ok(result.clone());
            }
            match deadline.instant() {
                Some(at) => {
                    if self.changed.wait_until(&mut state, at).timed_out() && state.result.is_none()
                    {
                        return Err(DeadlineExpired {
                            waiting_for: "waiting for the image download",
                        }
                        .into());
                    }
                }
                None => self.changed.wait(&mut state),
            }
        }
    }
}

/// A verified image, for a requester whose disk must hold it: one that
/// joined a download another VM with a larger disk started is held to its
/// own disk.
fn own_bound(path: PathBuf, url: &str, max_bytes: u64) -> Outcome<PathBuf> {
    let size = fs::metadata(&path)
        .map_err(|e| ImageError::store(path.clone(), e))?
        .len();
    if size > max_bytes {
        return Err(ImageError::TooLarge {
            url: url.into(),
            size,
            max: max_bytes,
        }
        .into());
    }
    Ok(path)
}
