//! The agent binary run as an operator runs it, for the benchmarks that
//! time it from outside: a desired file renamed into place and SIGHUP, then
//! the new VMM's own API polled until it says `Running`. Nothing here asks
//! the agent anything while it works: the wait for a VMM's socket is an
//! inotify watch on the run dir, and the API polled is the VMM's.

#![allow(
    dead_code,
    reason = "shared by the benchmarks, each of which uses only a part"
)]

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use eitri_agent::model::Id;
use eitri_agent::provision::unix_http;
use eitri_agent::state::Layout;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};

type Error = Box<dyn std::error::Error>;

/// Of a `report.json`, its rows alone: the rest (each VM's details among
/// it) is read past and never built. [`Daemon::wait_rows`] reads the file
/// every 20 ms, on the host whose burst it times.
#[derive(serde::Deserialize)]
struct RowsOnly {
    report: Rows,
}

#[derive(serde::Deserialize)]
struct Rows {
    #[serde(default)]
    vms: Vec<serde_json::Value>,
}

/// What the daemon is given to boot its guests with.
pub struct Parts<'a> {
    pub hypervisor: &'a Path,
    pub kernel: &'a Path,
    /// A `file://` base image under `images`, and its digest.
    pub image: (&'a str, &'a str),
    pub images: &'a Path,
    /// The cgroup root its VMMs run under (the caller ends it).
    pub cgroup_root: &'a str,
    /// Its tap names' prefix and its bridge's name: unlike a host's.
    pub tap_prefix: &'a str,
    pub bridge: &'a str,
    /// The guest kernel's command line.
    pub cmdline: &'a str,
    /// More of the agent's flags.
    pub extra: &'a [&'a str],
    /// Its VMMs' ids (first, count), the first their group: of this
    /// bench process's range ([`vmm_ids`]), apart from any other daemon's.
    pub vmm_ids: (u32, u32),
    /// The agent binary to run; `None`, `EITRI_BENCH_AGENT` or this build.
    pub binary: Option<&'a Path>,
}

pub struct Daemon {
    dir: PathBuf,
    child: Child,
    image: (String, String),
    wanted: Vec<String>,
    /// Its VMMs' group, whose ACL entries it takes back.
    group: u32,
}

impl Daemon {
    /// Starts `eitri-agent run` over an empty desired file in `dir`, its log
    /// at `dir/agent.log` (info), and waits for its first report.
    pub fn start(dir: &Path, parts: &Parts<'_>, patience: Duration) -> Result<Daemon, Error> {
        let path = |p: &Path| p.display().to_string();
        let image = (parts.image.0.to_owned(), parts.image.1.to_owned());
        std::fs::create_dir_all(dir)?;
        write_desired(dir, &image, &[], false)?;
        let log = std::fs::File::create(dir.join("agent.log"))?;
        let args: Vec<String> = vec![
            "run".into(),
            "--state-dir".into(),
            path(&dir.join("state")),
            "--desired".into(),
            path(&dir.join(DESIRED)),
            // Only the rename (and SIGHUP) brings a change: no tick lands
            // inside a measurement.
            "--tick".into(),
            "1h".into(),
            "--run-dir".into(),
            path(&dir.join("run")),
            "--agents-dir".into(),
            path(&dir.join("agents")),
            "--hypervisor".into(),
            path(parts.hypervisor),
            "--kernel".into(),
            path(parts.kernel),
            "--cmdline".into(),
            parts.cmdline.into(),
            "--image-root".into(),
            path(parts.images),
            "--cgroup-root".into(),
            parts.cgroup_root.into(),
            // Its part of the bench process's own range, whose group's ACL
            // entry on the host's devices it gives back at its end (see
            // `Drop`).
            "--vmm-ids".into(),
            format!("{}:{}", parts.vmm_ids.0, parts.vmm_ids.1),
            "--underlay-bridge".into(),
            parts.bridge.into(),
            "--tap-prefix".into(),
            parts.tap_prefix.into(),
            "--stop-grace".into(),
            "1s".into(),
            "--tombstone-grace".into(),
            "1s".into(),
        ];
        let mut args = args;
        // A bench's own tick replaces the hour.
        if parts.extra.contains(&"--tick")
            && let Some(at) = args.iter().position(|a| a == "--tick")
        {
            args.drain(at..at + 2);
        }
        let args: Vec<String> = args
            .into_iter()
            .chain(parts.extra.iter().map(|a| (*a).to_owned()))
            .collect();
        // Another build of the agent to time instead (two builds compared
        // in turns, on one machine's same afternoon): EITRI_BENCH_AGENT.
        let binary = match parts.binary {
            Some(binary) => binary.to_path_buf(),
            None => std::env::var_os("EITRI_BENCH_AGENT").map_or_else(
                || PathBuf::from(env!("CARGO_BIN_EXE_eitri-agent")),
                PathBuf::from,
            ),
        };
        let child = Command::new(binary)
            .args(&args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            // Where each create's time went is said at debug.
            .env(
                "EITRI_LOG",
                "info,eitri_agent::reconcile::step=debug,eitri_agent::reconcile::clones=debug",
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        let mut daemon = Daemon {
            dir: dir.to_path_buf(),
            child,
            image,
            wanted: Vec::new(),
            group: parts.vmm_ids.0,
        };
        let report = daemon.state().join("report.json");
        let deadline = Instant::now() + patience;
        while !report.exists() {
            if Instant::now() > deadline || daemon.child.try_wait()?.is_some() {
                return Err(format!("the agent wrote no report: {}", daemon.log_tail(20)).into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(daemon)
    }

    /// Makes `vms` (each a VMSpec as JSON) the desired state, as an
    /// operator does: the file renamed into place, then SIGHUP.
    pub fn desire(&self, vms: &[serde_json::Value]) -> Result<(), Error> {
        let temp = self.dir.join(".desired.json.new");
        std::fs::write(&temp, serde_json::json!({ "vms": vms }).to_string())?;
        std::fs::rename(&temp, self.dir.join(DESIRED))?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGHUP,
        )?;
        Ok(())
    }

    /// A VM of `name` as the desired file writes it: 1 vCPU, 256 MiB,
    /// the base image, running; the caller sets the rest.
    pub fn vm(&self, name: &str) -> serde_json::Value {
        serde_json::json!({
            "vm_id": name, "name": name, "image_url": self.image.0,
            "image_sha256": self.image.1, "vcpus": 1, "mem_mb": 256, "disk_gb": 1,
            "power_state": "running",
        })
    }

    /// Waits (polling the report.json the agent writes, at most
    /// `patience`) until `done` holds for the rows of its report.
    pub fn wait_rows(
        &self,
        what: &str,
        patience: Duration,
        done: impl Fn(&[serde_json::Value]) -> bool,
    ) -> Result<(), Error> {
        let deadline = Instant::now() + patience;
        loop {
            let rows = std::fs::read(self.state().join("report.json"))
                .ok()
                .and_then(|b| serde_json::from_slice::<RowsOnly>(&b).ok())
                .map(|r| r.report.vms)
                .unwrap_or_default();
            if done(&rows) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("{what}: never: {}", self.log_tail(20)).into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits (at most `patience`) until no VM of `ids` is in the report,
    /// neither as a row nor as a quarantined entry: each one's VMM is
    /// gone from the host, not only from its rows. A quarantined VM is
    /// destroyed by the pass after its stop, so `nudge` (a SIGHUP, say)
    /// is called each second it waits, for a daemon whose tick is long.
    pub fn wait_gone(
        &self,
        ids: &[String],
        patience: Duration,
        nudge: impl Fn() -> Result<(), Error>,
    ) -> Result<(), Error> {
        let deadline = Instant::now() + patience;
        let mut nudge_at = Instant::now() + Duration::from_secs(1);
        loop {
            let report = std::fs::read(self.state().join("report.json"))
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
            let named = |section: &str| {
                report.as_ref().is_some_and(|r| {
                    r["report"][section].as_array().is_some_and(|entries| {
                        entries
                            .iter()
                            .any(|e| ids.iter().any(|id| e["vm_id"] == id.as_str()))
                    })
                })
            };
            if report.is_some() && !named("vms") && !named("quarantined") {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("{ids:?} never gone: {}", self.log_tail(20)).into());
            }
            if Instant::now() >= nudge_at {
                nudge()?;
                nudge_at = Instant::now() + Duration::from_secs(1);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The agent's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    pub fn state(&self) -> PathBuf {
        self.dir.join("state")
    }

    fn run_dir(&self) -> PathBuf {
        self.dir.join("run")
    }

    /// Adds VM `name` (1 vCPU, 256 MiB, the base image) to the desired
    /// state, as an operator does, and times it until its VMM's API says
    /// `Running`.
    pub fn create(&mut self, name: &str, patience: Duration) -> Result<Duration, Error> {
        let id = Id::parse(name)?;
        let socket = Layout::new(&self.state()).api_socket(&self.run_dir(), &id);
        let watch = Inotify::init(InitFlags::IN_CLOEXEC)?;
        watch.add_watch(
            &self.run_dir(),
            AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO,
        )?;
        self.wanted.push(name.to_owned());
        let started = Instant::now();
        write_desired(&self.dir, &self.image, &self.wanted, false)?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGHUP,
        )?;
        let deadline = started + patience;
        while !socket.exists() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!("{name}: no API socket: {}", self.log_tail(20)).into());
            }
            let mut fds = [nix::poll::PollFd::new(
                watch.as_fd(),
                nix::poll::PollFlags::POLLIN,
            )];
            let wait = nix::poll::PollTimeout::try_from(left.min(Duration::from_millis(100)))
                .unwrap_or(nix::poll::PollTimeout::NONE);
            if nix::poll::poll(&mut fds, wait)? > 0 {
                let _ = watch.read_events();
            }
        }
        // The agent's VMM is not this process's child: the deadline bounds it.
        wait_running(&socket, deadline, || false)
            .map(|()| started.elapsed())
            .map_err(|e| format!("{name}: {e}: {}", self.log_tail(20)).into())
    }

    /// Every VM tombstoned, and waits (bounded) until the agent has
    /// destroyed them.
    pub fn destroy_all(&mut self, patience: Duration) -> Result<(), Error> {
        write_desired(&self.dir, &self.image, &self.wanted, true)?;
        self.wanted.clear();
        let deadline = Instant::now() + patience;
        let vms_dir = self.state().join("vms");
        while std::fs::read_dir(&vms_dir)?.next().is_some() {
            if Instant::now() > deadline {
                return Err(format!("VMs left: {}", self.log_tail(20)).into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// The create passes the agent logged, in order: each line's `took`
    /// part (`12.3 ms (stage 0.1, ...)`).
    pub fn create_passes(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.join("agent.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                // An agent before the stages moved to debug said them in
                // its info line (a build compared in turns).
                l.split_once(": create attempt stages: ")
                    .or_else(|| {
                        l.split_once(": create attempt took ")
                            .filter(|(_, t)| t.contains('('))
                    })
                    .map(|(_, t)| t.to_owned())
            })
            .collect()
    }

    fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
        // What the agent gave its VMMs' group on the host's devices.
        for device in ["/dev/kvm", "/dev/userfaultfd"] {
            let _ = eitri_agent::provision::jail::acl::revoke_group(Path::new(device), self.group);
        }
    }
}

/// The daemon's VMM ids (first, count): this bench process's own range;
/// the first is its VMMs' group, the last the user of a bare start.
pub fn vmm_ids() -> (u32, u32) {
    eitri_agent::testkit::test_vmm_ids()
}

const DESIRED: &str = "desired.json";

/// Writes the desired file in `dir`: `names` (1 vCPU, 256 MiB, the base
/// `image`), tombstoned or not; a new file renamed over the old, as an
/// operator's tools do.
fn write_desired(
    dir: &Path,
    (url, sha): &(String, String),
    names: &[String],
    tombstoned: bool,
) -> Result<(), Error> {
    let vms: Vec<serde_json::Value> = names
        .iter()
        .map(|n| {
            serde_json::json!({
                "vm_id": n, "name": n, "image_url": url, "image_sha256": sha,
                "vcpus": 1, "mem_mb": 256, "disk_gb": 1, "power_state": "running",
                "tombstoned": tombstoned,
            })
        })
        .collect();
    let temp = dir.join(".desired.json.new");
    std::fs::write(&temp, serde_json::json!({ "vms": vms }).to_string())?;
    std::fs::rename(&temp, dir.join(DESIRED))?;
    Ok(())
}

/// Polls the VMM's API at `socket` until it says `Running`; gives up past
/// `deadline`, or when `exited` says the VMM is gone.
pub fn wait_running(
    socket: &Path,
    deadline: Instant,
    exited: impl Fn() -> bool,
) -> Result<(), String> {
    loop {
        let answer = unix_http::request(
            socket,
            "GET",
            "/api/v1/vm.info",
            None,
            Duration::from_millis(500),
        );
        let state = answer.as_ref().ok().and_then(|(status, body)| {
            let v: serde_json::Value = serde_json::from_slice(body).ok()?;
            (*status == 200).then(|| v.get("state")?.as_str().map(str::to_owned))?
        });
        if state.as_deref() == Some("Running") {
            return Ok(());
        }
        if Instant::now() > deadline || exited() {
            return Err(format!("the VMM never said Running (last: {answer:?})"));
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}
