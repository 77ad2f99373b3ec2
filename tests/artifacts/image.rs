//! The image cache against a local HTTP server and file URLs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use eitri_agent::deadline::Deadline;
use eitri_agent::image::Progress;
use eitri_agent::image::{ImageCache, ImageOptions, Reach, sha256_file};
use eitri_agent::model::IpRange;
use eitri_agent::testkit::image_server::{ImageServer, Serve};
use parking_lot::Mutex;

/// A bound to fail on, not a measurement.
const PATIENCE: Duration = Duration::from_secs(20);
/// The asking VM's disk: the most an image may be.
const DISK: u64 = 1 << 30;

struct Fixture {
    dir: tempfile::TempDir,
    image: PathBuf,
    sha: String,
}

impl Fixture {
    /// A 2 MiB image of varied bytes in the image root (`library/`), and
    /// an empty cache dir.
    fn new() -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("library")).expect("library");
        let image = dir.path().join("library/source.raw");
        let bytes: Vec<u8> = (0..2u32 << 20)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        std::fs::write(&image, bytes).expect("image");
        std::fs::create_dir_all(dir.path().join("images")).expect("images dir");
        let sha = sha256_file(&image).expect("hash");
        Fixture { dir, image, sha }
    }

    /// A cache serving `file://` from the library, and HTTP from the test
    /// servers on loopback (refused unless allowed).
    fn cache(&self) -> ImageCache {
        self.cache_with(ImageOptions {
            file_root: Some(self.library()),
            reach: loopback_allowed(),
            ..ImageOptions::default()
        })
    }

    fn cache_with(&self, options: ImageOptions) -> ImageCache {
        ImageCache::with(self.images(), &options)
    }

    fn library(&self) -> PathBuf {
        self.dir.path().join("library")
    }

    /// The cache's answer for `path` as a `file://` image of digest `sha`.
    fn resolve_file(
        &self,
        path: &Path,
        sha: &str,
    ) -> Result<PathBuf, eitri_agent::error::BoxFailure> {
        self.cache().resolve(
            &format!("file://{}", path.display()),
            sha,
            DISK,
            Deadline::NONE,
            quiet(),
        )
    }

    fn images(&self) -> PathBuf {
        self.dir.path().join("images")
    }
}

fn loopback_allowed() -> Reach {
    Reach {
        allow: vec![IpRange::parse("127.0.0.0/8").expect("range")],
        ..Reach::default()
    }
}

fn quiet() -> Progress {
    Arc::new(|_, _| {})
}

fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .expect("list")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect()
}

#[test]
fn a_download_is_verified_and_named_by_its_digest() {
    let f = Fixture::new();
    let server = ImageServer::start(Serve::File(f.image.clone())).expect("server");

    let path = f
        .cache()
        .resolve(&server.url("a.raw"), &f.sha, DISK, Deadline::NONE, quiet())
        .expect("fetched");

    assert_eq!(path, f.images().join(&f.sha));
    assert_eq!(sha256_file(&path).expect("hash"), f.sha);
    assert_eq!(entries(&f.images()), vec![f.sha.clone()]);
}

#[test]
fn a_digest_mismatch_is_permanent_and_leaves_no_file() {
    let f = Fixture::new();
    let server = ImageServer::start(Serve::File(f.image.clone())).expect("server");
    let wrong = "0".repeat(64);

    let err = f
        .cache()
        .resolve(&server.url("a.raw"), &wrong, DISK, Deadline::NONE, quiet())
        .expect_err("mismatch");

    assert!(err.is_permanent());
    assert!(err.to_string().contains(&wrong), "{err}");
    assert!(
        entries(&f.images()).is_empty(),
        "{:?}",
        entries(&f.images())
    );
}

#[test]
fn a_server_nothing_answers_at_is_a_host_condition_not_the_vms_failure() {
    let f = Fixture::new();
    // A port just let go: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();

    let err = f
        .cache()
        .resolve(
            &format!("http://127.0.0.1:{port}/a.raw"),
            &f.sha,
            DISK,
            Deadline::NONE,
            quiet(),
        )
        .expect_err("nothing answers");

    assert!(err.is_host_condition(), "{err}");
    assert!(!err.is_permanent(), "{err}");
    assert!(
        err.to_string().contains("cannot reach the image server"),
        "{err}"
    );
}

#[test]
fn a_server_that_answers_500_is_not_a_host_condition() {
    let f = Fixture::new();
    let server = ImageServer::start(Serve::Status(500)).expect("server");

    let err = f
        .cache()
        .resolve(&server.url("a.raw"), &f.sha, DISK, Deadline::NONE, quiet())
        .expect_err("500");

    assert!(!err.is_host_condition(), "{err}");
    assert!(!err.is_permanent(), "{err}");
}

#[test]
fn a_mismatch_never_tells_what_the_bytes_hash_to() {
    let f = Fixture::new();
    let server = ImageServer::start(Serve::File(f.image.clone())).expect("server");

    let err = f
        .cache()
        .resolve(
            &server.url("a.raw"),
            &"0".repeat(64),
            DISK,
            Deadline::NONE,
            quiet(),
        )
        .expect_err("mismatch");

    assert!(!err.to_string().contains(&f.sha), "{err}");
}

#[test]
fn a_loopback_url_is_refused_before_any_request() {
    let f = Fixture::new();
    let server = ImageServer::start(Serve::File(f.image.clone())).expect("server");
    let cache = f.cache_with(ImageOptions::default());

    let err = cache
        .resolve(
            &server.url("secret"),
            &"0".repeat(64),
            DISK,
            Deadline::NONE,
            quiet(),
        )
        .expect_err("refused");

    assert!(err.is_permanent(), "{err}");
    assert!(
        err.to_string().contains("loopback") && err.to_string().contains("--image-allow"),
        "{err}"
    );
    assert_eq!(server.requests(), 0);
}

#[test]
fn a_redirect_is_not_followed_and_its_target_is_neither_fetched_nor_told() {
    let f = Fixture::new();
    let secret = ImageServer::start(Serve::File(f.image.clone())).expect("secret");
    let mirror = ImageServer::start_on(
        std::net::Ipv4Addr::new(127, 0, 0, 2),
        Serve::Redirect(secret.url("secret")),
    )
    .expect("mirror");
    // The mirror's address is allowed; the secret's is not.
    let cache = f.cache_with(ImageOptions {
        reach: Reach {
            allow: vec![IpRange::parse("127.0.0.2").expect("range")],
            ..Reach::default()
        },
        ..ImageOptions::default()
    });

    let err = cache
        .resolve(
            &mirror.url("a.raw"),
            &"0".repeat(64),
            DISK,
            Deadline::NONE,
            quiet(),
        )
        .expect_err("refused");

    assert!(err.is_permanent(), "{err}");
    assert!(err.to_string().contains("redirect"), "{err}");
    assert!(!err.to_string().contains(&f.sha), "{err}");
    assert!(!err.to_string().contains(&secret.url("secret")), "{err}");
    assert_eq!(mirror.requests(), 1);
    assert_eq!(secret.requests(), 0);
}

#[test]
fn credentials_in_an_image_url_are_never_shown() {
    let f = Fixture::new();
    let url = "http://ann:s3cret@127.0.0.1:9/a.raw";

    let err = f
        .cache_with(ImageOptions::default())
        .resolve(url, &f.sha, DISK, Deadline::NONE, quiet())
        .expect_err("refused");

    assert!(!err.to_string().contains("s3cret"), "{err}");
    assert!(
        err.to_string().contains("http://***@127.0.0.1:9/a.raw"),
        "{err}"
    );
}

fn qcow2(dir: &Path) -> (PathBuf, String) {
    let path = dir.join("base.qcow2");
    let mut bytes = b"QFI\xfb\0\0\0\x03".to_vec();
    bytes.resize(64 << 10, 0);
    std::fs::write(&path, bytes).expect("qcow2");
    let sha = sha256_file(&path).expect("hash");
    (path, sha)
}

#[test]
fn a_qcow2_image_is_refused_permanently_naming_the_conversion_and_not_cached() {
    let f = Fixture::new();
    let (path, sha) = qcow2(f.dir.path());
    let server = ImageServer::start(Serve::File(path)).expect("server");

    let err = f
        .cache()
        .resolve(&server.url("a.qcow2"), &sha, DISK, Deadline::NONE, quiet())
        .expect_err("not raw");

    assert!(err.is_permanent());
    assert!(
        err.to_string().contains("QCOW2") && err.to_string().contains("qemu-img convert -O raw"),
        "{err}"
    );
    assert!(
        entries(&f.images()).is_empty(),
        "{:?}",
        entries(&f.images())
    );
}

#[test]
fn a_qcow2_image_cached_before_the_check_is_refused() {
    let f = Fixture::new();
    let (path, sha) = qcow2(f.dir.path());
    std::fs::copy(&path, f.images().join(&sha)).expect("planted in the cache");

    let err = f
        .cache()
        .resolve(
            "http://127.0.0.1:9/unused",
            &sha,
            DISK,
            Deadline::NONE,
            quiet(),
        )
        .expect_err("not raw");

    assert!(err.is_permanent());
    assert!(err.to_string().contains("QCOW2"), "{err}");
}

#[test]
fn ten_threads_asking_for_one_image_cause_one_request() {
    let f = Fixture::new();
    // Slow enough that all ten ask while the one download runs.
    let server = ImageServer::start(Serve::Throttled(f.image.clone(), Duration::from_millis(5)))
        .expect("server");
    let cache = f.cache();
    let url = server.url("a.raw");

    let paths: Vec<PathBuf> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..10)
            .map(|_| {
                s.spawn(|| {
                    cache
                        .resolve(&url, &f.sha, DISK, Deadline::NONE, quiet())
                        .expect("fetched")
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });

    assert_eq!(server.requests(), 1);
    assert!(paths.iter().all(|p| *p == f.images().join(&f.sha)));
}

#[test]
fn a_waiter_gives_up_at_its_deadline_while_the_download_completes() {
    let f = Fixture::new();
    let server = ImageServer::start(Serve::Throttled(f.image.clone(), Duration::from_millis(10)))
        .expect("server");
    let cache = f.cache();

    let err = cache
        .resolve(
            &server.url("a.raw"),
            &f.sha,
            DISK,
            Deadline::after(Duration::from_millis(100)),
            quiet(),
        )
        .expect_err("gave up");

    assert!(!err.is_permanent());
    assert!(err.to_string().contains("deadline"), "{err}");
    let landed = f.images().join(&f.sha);
    let until = std::time::Instant::now() + PATIENCE;
    while !landed.exists() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(landed.exists(), "the download went on and landed");
    assert_eq!(server.requests(), 1);
}

/// Waits until `server` has been asked `n` times: a download is in flight.
fn until_asked(server: &ImageServer, n: usize) {
    let until = std::time::Instant::now() + PATIENCE;
    while server.requests() < n && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(server.requests(), n, "the server was not asked in time");
}

#[test]
fn a_failing_url_fails_only_its_own_vm_not_another_url_for_the_same_digest() {
    let f = Fixture::new();
    // The attacker names the image's digest with a URL that answers 404,
    // but only after the innocent VM asked.
    let attacker = ImageServer::start(Serve::Delayed(
        Duration::from_millis(500),
        Box::new(Serve::Status(404)),
    ))
    .expect("server");
    let cache = f.cache();
    let innocent_url = format!("file://{}", f.image.display());

    let (attacked, innocent) = std::thread::scope(|s| {
        let attacked =
            s.spawn(|| cache.resolve(&attacker.url("x"), &f.sha, DISK, Deadline::NONE, quiet()));
        until_asked(&attacker, 1);
        let innocent = cache.resolve(&innocent_url, &f.sha, DISK, Deadline::NONE, quiet());
        (attacked.join().expect("thread"), innocent)
    });

    assert_eq!(
        innocent.expect("the innocent VM's image"),
        f.images().join(&f.sha)
    );
    assert!(attacked.expect_err("404").is_permanent());
}

type Resolved = Result<PathBuf, eitri_agent::error::BoxFailure>;

/// Two VMs asking for the image from one slow URL, the second once the
/// first's download is under way, with disks of `first` and `second`
/// bytes: what each got.
fn two_requesters(f: &Fixture, first: u64, second: u64) -> (Resolved, Resolved) {
    let server = ImageServer::start(Serve::Throttled(f.image.clone(), Duration::from_millis(10)))
        .expect("server");
    let cache = f.cache();
    let url = server.url("a.raw");
    std::thread::scope(|s| {
        let one = s.spawn(|| cache.resolve(&url, &f.sha, first, Deadline::NONE, quiet()));
        until_asked(&server, 1);
        let two = cache.resolve(&url, &f.sha, second, Deadline::NONE, quiet());
        (one.join().expect("thread"), two)
    })
}

#[test]
fn a_requester_joining_a_download_is_held_to_its_own_smaller_disk() {
    let f = Fixture::new();

    let (large, small) = two_requesters(&f, DISK, 1 << 20);

    assert!(large.is_ok(), "{large:?}");
    let err = small.expect_err("too large for its disk");
    assert!(
        err.is_permanent() && err.to_string().contains("larger than the VM's disk"),
        "{err}"
    );
}

#[test]
fn a_requester_with_a_larger_disk_is_not_failed_by_a_smaller_ones_bound() {
    let f = Fixture::new();

    let (small, large) = two_requesters(&f, 1 << 20, DISK);

    assert!(small.is_err());
    assert_eq!(large.expect("its own download"), f.images().join(&f.sha));
}

/// The image from a server answering as `serve`, through a cache with
/// `options` (loopback allowed), within the test's patience.
fn fetch_slow(f: &Fixture, serve: Serve, options: ImageOptions) -> Resolved {
    let server = ImageServer::start(serve).expect("server");
    let cache = f.cache_with(ImageOptions {
        reach: loopback_allowed(),
        ..options
    });
    cache.resolve(
        &server.url("a.raw"),
        &f.sha,
        DISK,
        Deadline::after(PATIENCE),
        quiet(),
    )
}

#[test]
fn a_trickling_server_fails_on_the_minimum_rate() {
    let f = Fixture::new();

    // One byte every 20 ms: never silent for the stall timeout.
    let err = fetch_slow(
        &f,
        Serve::Trickle(f.image.clone(), Duration::from_millis(20)),
        ImageOptions {
            stall: Duration::from_millis(300),
            min_rate: 1024,
            ..ImageOptions::default()
        },
    )
    .expect_err("too slow");

    assert!(!err.is_permanent(), "{err}");
    assert!(err.to_string().contains("--image-min-rate-kib"), "{err}");
}

#[test]
fn a_download_still_running_at_the_download_timeout_fails() {
    let f = Fixture::new();

    // Steady, above any minimum rate, and slower than the timeout allows.
    let err = fetch_slow(
        &f,
        Serve::Throttled(f.image.clone(), Duration::from_millis(50)),
        ImageOptions {
            deadline: Duration::from_millis(400),
            min_rate: 0,
            ..ImageOptions::default()
        },
    )
    .expect_err("too long");

    assert!(!err.is_permanent(), "{err}");
    assert!(
        err.to_string().contains("--image-download-timeout"),
        "{err}"
    );
    assert!(
        entries(&f.images()).is_empty(),
        "{:?}",
        entries(&f.images())
    );
}

#[test]
fn a_restarted_cache_finds_the_verified_image_without_network() {
    let f = Fixture::new();
    let server = ImageServer::start(Serve::File(f.image.clone())).expect("server");
    f.cache()
        .resolve(&server.url("a.raw"), &f.sha, DISK, Deadline::NONE, quiet())
        .expect("fetched");
    let before = server.requests();
    drop(server);

    let path = f
        .cache()
        .resolve(
            "http://127.0.0.1:9/gone.raw",
            &f.sha,
            DISK,
            Deadline::NONE,
            quiet(),
        )
        .expect("a hit");

    assert_eq!(path, f.images().join(&f.sha));
    assert_eq!(before, 1);
}

#[test]
fn a_file_url_is_served() {
    let f = Fixture::new();
    let url = format!("file://{}", f.image.display());

    let path = f
        .cache()
        .resolve(&url, &f.sha, DISK, Deadline::NONE, quiet())
        .expect("copied");

    assert_eq!(sha256_file(&path).expect("hash"), f.sha);
}

#[test]
fn a_host_file_outside_the_image_root_is_refused_and_its_digest_never_told() {
    let f = Fixture::new();
    let secret = f.dir.path().join("shadow");
    std::fs::write(&secret, b"root:$6$secret:19000:0:99999:7:::\n").expect("secret");
    let real = sha256_file(&secret).expect("hash");
    let made_up = "0".repeat(64);

    let err = f
        .resolve_file(&secret, &made_up)
        .expect_err("outside the root");

    assert!(err.is_permanent());
    assert!(err.to_string().contains("image root"), "{err}");
    assert!(!err.to_string().contains(&real), "{err}");
    assert!(
        entries(&f.images()).is_empty(),
        "{:?}",
        entries(&f.images())
    );
}

#[test]
fn etc_shadow_is_refused_and_nothing_lands_in_the_cache() {
    let f = Fixture::new();

    let err = f
        .cache()
        .resolve(
            "file:///etc/shadow",
            &"0".repeat(64),
            DISK,
            Deadline::NONE,
            quiet(),
        )
        .expect_err("refused");

    assert!(err.is_permanent(), "{err}");
    assert!(
        entries(&f.images()).is_empty(),
        "{:?}",
        entries(&f.images())
    );
}

#[test]
fn without_an_image_root_every_file_url_is_refused_naming_the_flag() {
    let f = Fixture::new();
    let url = format!("file://{}", f.image.display());

    let err = f
        .cache_with(ImageOptions::default())
        .resolve(&url, &f.sha, DISK, Deadline::NONE, quiet())
        .expect_err("no root");

    assert!(err.is_permanent());
    assert!(err.to_string().contains("--image-root"), "{err}");
}

#[test]
fn a_symlink_out_of_the_image_root_is_refused() {
    let f = Fixture::new();
    let outside = f.dir.path().join("outside.raw");
    std::fs::copy(&f.image, &outside).expect("copy");
    let link = f.library().join("link.raw");
    std::os::unix::fs::symlink(&outside, &link).expect("symlink");

    let err = f.resolve_file(&link, &f.sha).expect_err("escapes");

    assert!(err.is_permanent());
    assert!(err.to_string().contains("image root"), "{err}");
}

#[test]
fn a_fifo_in_the_image_root_is_refused_without_blocking() {
    let f = Fixture::new();
    let fifo = f.library().join("pipe.raw");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");

    let err = f.resolve_file(&fifo, &f.sha).expect_err("not a file");

    assert!(err.is_permanent());
    assert!(err.to_string().contains("not a regular file"), "{err}");
}

#[test]
fn a_local_mismatch_names_the_wanted_digest_only() {
    let f = Fixture::new();
    let wrong = "0".repeat(64);

    let err = f.resolve_file(&f.image, &wrong).expect_err("mismatch");

    assert!(err.is_permanent());
    assert!(err.to_string().contains(&wrong), "{err}");
    assert!(!err.to_string().contains(&f.sha), "{err}");
}

#[test]
fn an_image_larger_than_the_vms_disk_is_refused_and_not_kept() {
    let f = Fixture::new();
    let server = ImageServer::start(Serve::File(f.image.clone())).expect("server");

    let err = f
        .cache()
        .resolve(
            &server.url("a.raw"),
            &f.sha,
            1 << 20,
            Deadline::NONE,
            quiet(),
        )
        .expect_err("too large");

    assert!(err.is_permanent());
    assert!(
        err.to_string().contains("larger than the VM's disk"),
        "{err}"
    );
    assert!(
        entries(&f.images()).is_empty(),
        "{:?}",
        entries(&f.images())
    );
}

#[test]
fn a_stalled_server_fails_the_download_and_the_next_request_starts_afresh() {
    let f = Fixture::new();
    let server = ImageServer::start(Serve::Stall(f.image.clone(), 64 << 10)).expect("server");
    let cache = f.cache_with(ImageOptions {
        stall: Duration::from_millis(300),
        reach: loopback_allowed(),
        ..ImageOptions::default()
    });

    let started = std::time::Instant::now();
    let err = cache
        .resolve(
            &server.url("a.raw"),
            &f.sha,
            DISK,
            Deadline::after(PATIENCE),
            quiet(),
        )
        .expect_err("stalled");
    let took = started.elapsed();
    server.set(Serve::File(f.image.clone()));
    let path = cache
        .resolve(
            &server.url("a.raw"),
            &f.sha,
            DISK,
            Deadline::after(PATIENCE),
            quiet(),
        )
        .expect("a fresh download");

    assert!(!err.is_permanent(), "{err}");
    assert!(err.to_string().contains("sent nothing"), "{err}");
    assert!(
        took < PATIENCE,
        "failed at the stall timeout, not the deadline: {took:?}"
    );
    assert_eq!(server.requests(), 2);
    assert_eq!(path, f.images().join(&f.sha));
}

#[test]
fn a_missing_file_is_permanent() {
    let f = Fixture::new();

    let err = f
        .cache()
        .resolve(
            &format!("file://{}/missing.raw", f.library().display()),
            &f.sha,
            DISK,
            Deadline::NONE,
            quiet(),
        )
        .expect_err("missing");

    assert!(err.is_permanent(), "{err}");
}

#[test]
fn a_404_is_permanent() {
    let f = Fixture::new();
    let server = ImageServer::start(Serve::Status(404)).expect("server");

    let err = f
        .cache()
        .resolve(&server.url("a.raw"), &f.sha, DISK, Deadline::NONE, quiet())
        .expect_err("404");

    assert!(err.is_permanent());
    assert!(err.to_string().contains("404"), "{err}");
}

#[test]
fn a_429_and_a_503_are_transient() {
    let f = Fixture::new();
    let server = ImageServer::start(Serve::Status(429)).expect("server");
    let limited = f
        .cache()
        .resolve(&server.url("a.raw"), &f.sha, DISK, Deadline::NONE, quiet())
        .expect_err("429");
    server.set(Serve::Status(503));

    let unavailable = f
        .cache()
        .resolve(&server.url("a.raw"), &f.sha, DISK, Deadline::NONE, quiet())
        .expect_err("503");

    assert!(!limited.is_permanent());
    assert!(!unavailable.is_permanent());
}

#[test]
fn a_refused_connection_is_transient() {
    let f = Fixture::new();

    let err = f
        .cache()
        .resolve(
            "http://127.0.0.1:9/x.raw",
            &f.sha,
            DISK,
            Deadline::NONE,
            quiet(),
        )
        .expect_err("refused");

    assert!(!err.is_permanent());
}

#[test]
fn an_unsupported_scheme_is_permanent() {
    let f = Fixture::new();

    let err = f
        .cache()
        .resolve("ftp://mirror/x.raw", &f.sha, DISK, Deadline::NONE, quiet())
        .expect_err("ftp");

    assert!(err.is_permanent());
}

#[test]
fn a_digest_that_is_not_hex_is_permanent() {
    let f = Fixture::new();

    let err = f
        .cache()
        .resolve(
            "file:///x",
            "../../etc/passwd",
            DISK,
            Deadline::NONE,
            quiet(),
        )
        .expect_err("bad digest");

    assert!(err.is_permanent());
}

#[test]
fn progress_ends_at_the_total() {
    let f = Fixture::new();
    let server = ImageServer::start(Serve::File(f.image.clone())).expect("server");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);

    f.cache()
        .resolve(
            &server.url("a.raw"),
            &f.sha,
            DISK,
            Deadline::NONE,
            Arc::new(move |d, t| log.lock().push((d, t))),
        )
        .expect("fetched");

    let seen = seen.lock();
    assert_eq!(seen.last(), Some(&(2 << 20, Some(2 << 20))));
}

#[test]
fn partial_downloads_left_by_a_crash_are_swept() {
    let f = Fixture::new();
    let partial = f.images().join(format!(".partial-{}-123", f.sha));
    std::fs::write(&partial, b"half").expect("partial");

    let removed = f.cache().sweep_partials();

    assert_eq!(removed, 1);
    assert!(!partial.exists());
}

#[test]
fn a_full_image_cache_is_told_apart_as_out_of_space() {
    let f = Fixture::new();
    let tmpfs = eitri_agent::testkit::tmpfs::Tmpfs::mount(&f.dir.path().join("small"), "512k");
    let server = ImageServer::start(Serve::File(f.image.clone())).expect("server");

    let err = ImageCache::with(
        tmpfs.path().to_path_buf(),
        &ImageOptions {
            reach: loopback_allowed(),
            ..ImageOptions::default()
        },
    )
    .resolve(&server.url("a.raw"), &f.sha, DISK, Deadline::NONE, quiet())
    .expect_err("no space");

    assert!(eitri_agent::error::out_of_space(&*err), "{err}");
}

#[test]
fn a_full_disk_fails_and_leaves_no_partial_file() {
    let f = Fixture::new();
    // A filesystem too small for the image.
    let tmpfs = eitri_agent::testkit::tmpfs::Tmpfs::mount(&f.dir.path().join("small"), "512k");
    let small = tmpfs.path().to_path_buf();
    let server = ImageServer::start(Serve::File(f.image.clone())).expect("server");

    let err = ImageCache::with(
        small.clone(),
        &ImageOptions {
            reach: loopback_allowed(),
            ..ImageOptions::default()
        },
    )
    .resolve(&server.url("a.raw"), &f.sha, DISK, Deadline::NONE, quiet())
    .expect_err("no space");

    assert!(err.to_string().contains("No space left"), "{err}");
    assert!(entries(&small).is_empty(), "{:?}", entries(&small));
}

#[test]
fn a_sparse_file_image_is_cached_sparse() {
    use std::os::unix::fs::{FileExt, MetadataExt};
    let f = Fixture::new();
    // 64 MiB, of which two pages hold data: a fresh filesystem's image.
    let sparse = f.library().join("sparse.raw");
    let file = std::fs::File::create(&sparse).expect("sparse image");
    file.set_len(64 << 20).expect("size");
    file.write_all_at(&[0x5a; 4096], 0).expect("data");
    file.write_all_at(&[0xa5; 4096], 40 << 20).expect("data");
    drop(file);
    let sha = sha256_file(&sparse).expect("hash");

    let cached = f.resolve_file(&sparse, &sha).expect("cached");

    let meta = std::fs::metadata(&cached).expect("cached image");
    assert_eq!(meta.len(), 64 << 20, "its size kept");
    assert!(
        meta.blocks() * 512 <= 1 << 20,
        "{} bytes held",
        meta.blocks() * 512
    );
    assert_eq!(sha256_file(&cached).expect("hash"), sha, "its bytes kept");
}

#[test]
fn a_symlinked_directory_on_the_way_out_of_the_image_root_is_refused() {
    let f = Fixture::new();
    let outside = f.dir.path().join("outside");
    std::fs::create_dir(&outside).expect("outside");
    std::fs::copy(&f.image, outside.join("x.raw")).expect("copy");
    std::os::unix::fs::symlink(&outside, f.library().join("sub")).expect("symlink");

    let err = f
        .resolve_file(&f.library().join("sub/x.raw"), &f.sha)
        .expect_err("through a symlinked directory");

    assert!(err.is_permanent());
    assert!(err.to_string().contains("symlink"), "{err}");
    assert!(entries(&f.images()).is_empty());
}

#[test]
fn a_dot_dot_out_of_the_image_root_is_refused() {
    let f = Fixture::new();
    std::fs::copy(&f.image, f.dir.path().join("outside.raw")).expect("copy");

    let err = f
        .resolve_file(&f.library().join("../outside.raw"), &f.sha)
        .expect_err("out by ..");

    assert!(err.is_permanent());
    assert!(entries(&f.images()).is_empty());
}

#[test]
fn an_image_in_a_directory_under_the_root_is_served() {
    let f = Fixture::new();
    std::fs::create_dir(f.library().join("debian")).expect("dir");
    let nested = f.library().join("debian/bookworm.raw");
    std::fs::copy(&f.image, &nested).expect("copy");

    let cached = f.resolve_file(&nested, &f.sha).expect("served");

    assert_eq!(sha256_file(&cached).expect("hash"), f.sha);
}

#[test]
fn an_image_a_create_holds_is_kept_from_a_prune_until_its_root_disk_is_made() {
    let f = Fixture::new();
    let url = format!("file://{}", f.image.display());
    let base = f
        .cache()
        .resolve_held(request(&url, &f.sha))
        .expect("found");
    let layout = eitri_agent::state::Layout::new(f.dir.path());
    let lock = std::fs::File::open(layout.images_lock()).expect("lock file");

    let while_held = lock.try_lock();
    drop(base);
    let after = lock.try_lock();

    assert!(
        matches!(while_held, Err(std::fs::TryLockError::WouldBlock)),
        "{while_held:?}"
    );
    assert!(after.is_ok(), "{after:?}");
}

#[test]
fn an_image_pruned_before_a_create_holds_it_is_fetched_again() {
    let f = Fixture::new();
    let url = format!("file://{}", f.image.display());
    let cache = f.cache();
    let first = cache.resolve_held(request(&url, &f.sha)).expect("found");
    drop(first);
    let layout = eitri_agent::state::Layout::new(f.dir.path());
    let pruned = eitri_agent::image::prune(&layout, &Default::default()).expect("pruned");

    let again = cache
        .resolve_held(request(&url, &f.sha))
        .expect("found again");

    assert_eq!(pruned.removed, vec![f.sha.clone()]);
    assert_eq!(sha256_file(&again.path).expect("hash"), f.sha);
}

/// A request for the image at `url` of digest `sha`, of at most [`DISK`]
/// bytes, with no deadline, telling nobody of its progress.
fn request<'a>(url: &'a str, sha: &'a str) -> eitri_agent::image::Request<'a> {
    eitri_agent::image::Request {
        url,
        sha256: sha,
        max_bytes: DISK,
        deadline: Deadline::NONE,
        progress: quiet(),
    }
}
