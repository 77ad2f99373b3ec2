//! The Linux backend: cloud-hypervisor, one process per VM.
//!
//! Boot, in order:
//! 1. A VM whose hypervisor is alive is never started twice (two VMMs on one
//!    socket is a known failure of other agents).
//! 2. Open the VM's tap on /dev/net/tun (not persistent) and fork the VMM in
//!    its own session (setsid, so signals to the agent's group never reach
//!    it and it outlives the agent), stdin from /dev/null, output appended to
//!    the VM's `hypervisor.log`, the tap as fd 3 (`--net fd=3,…`) and no
//!    other agent fd (everything the agent opens is close-on-exec).
//! 3. Record pid and start time in the pidfile, atomically; a thread blocked
//!    in waitpid reaps the child and keeps its exit status.
//! 4. Wait, within the pass deadline, for the API to say `Running`;
//!    otherwise kill the child and fail with the hypervisor's own words.
//!
//! Stop: power button, bounded wait for the guest; `vmm.shutdown`, bounded
//! wait; SIGTERM, bounded wait; SIGKILL. A process already gone is stopped.
//! A pass whose deadline has passed goes straight to SIGKILL.
//!
//! After an agent restart, VMMs are found again through their pidfiles and
//! /proc; none is restarted. Only a changed boot id (the engine's business)
//! makes them lost.

mod api;
mod process;
mod tap;

use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use parking_lot::Mutex;
use sha2::{Digest, Sha256};

use self::process::Tracked;
use super::{Provisioner, mac};
use crate::deadline::Deadline;
use crate::error::{BoxFailure, DeadlineExpired, Simple};
use crate::model::{Id, VmSpec};
use crate::state::Store;

/// The oldest cloud-hypervisor this backend drives.
pub const MIN_VERSION: u32 = 40;
/// Bytes of the hypervisor's log a failure reason quotes, at most.
const REASON_BYTES: u64 = 2048;

/// How long each stage of a stop may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StopTimeouts {
    /// For the guest to act on the power button.
    pub power_button: Duration,
    /// For the VMM to exit after `vmm.shutdown`.
    pub vmm_shutdown: Duration,
    /// For the VMM to exit after SIGTERM, before SIGKILL.
    pub terminate: Duration,
}

impl Default for StopTimeouts {
    fn default() -> StopTimeouts {
        StopTimeouts {
            power_button: Duration::from_secs(30),
            vmm_shutdown: Duration::from_secs(5),
            terminate: Duration::from_secs(5),
        }
    }
}

#[derive(Clone)]
pub struct CloudHvConfig {
    pub hypervisor: PathBuf,
    pub kernel: Option<PathBuf>,
    pub firmware: Option<PathBuf>,
    pub cmdline: String,
    /// Where API sockets live: short, since a unix socket path is limited to
    /// 108 bytes whatever the state dir's length.
    pub run_dir: PathBuf,
    /// Prefix of this agent's tap names; links with it that no live VMM
    /// holds are removed at start.
    pub tap_prefix: String,
    /// Bound on waiting for a new VMM's API to say Running.
    pub boot_wait: Duration,
    pub stop: StopTimeouts,
    /// The host network taps join; `None` leaves taps unconnected.
    pub network: Option<Arc<crate::net::host::HostNetwork>>,
}

pub struct CloudHypervisor {
    store: Arc<Store>,
    cfg: CloudHvConfig,
    /// Exit statuses of children this process spawned, kept by their reapers.
    exits: Arc<Mutex<HashMap<Id, ExitStatus>>>,
    /// Pids of children spawned and not yet reaped: a stop waits for the
    /// reaper too, so when it returns no zombie of the VM is left.
    unreaped: Arc<Mutex<std::collections::HashSet<i32>>>,
}

impl CloudHypervisor {
    /// Builds the backend and removes leaked taps with its prefix: links no
    /// live VMM holds (a stale tap on the underlay can swallow a new guest's
    /// DHCP replies).
    pub fn new(store: Arc<Store>, cfg: CloudHvConfig) -> CloudHypervisor {
        if let Err(e) = fs::create_dir_all(&cfg.run_dir)
            .and_then(|()| fs::set_permissions(&cfg.run_dir, fs::Permissions::from_mode(0o700)))
        {
            log::warn!(
                "cannot prepare the socket dir {}: {e}",
                cfg.run_dir.display()
            );
        }
        for link in tap::with_prefix(&cfg.tap_prefix) {
            if tap::remove(&link).is_ok() {
                log::info!("removed leaked tap {link}");
            }
        }
        let backend = CloudHypervisor {
            store,
            cfg,
            exits: Arc::new(Mutex::new(HashMap::new())),
            unreaped: Arc::new(Mutex::new(std::collections::HashSet::new())),
        };
        backend.readopt_networks();
        backend
    }

    /// Serves the guests of VMMs that outlived the previous agent: their DHCP
    /// responders and snoopers lived in that agent's process, and a guest
    /// renewing its lease with nobody answering would lose its address.
    fn readopt_networks(&self) {
        let Some(network) = &self.cfg.network else {
            return;
        };
        for slot in self.store.load_all().values() {
            let crate::state::RecordSlot::Readable(rec) = slot else {
                continue;
            };
            let vm_id = &rec.spec.vm_id;
            if self.alive(vm_id).is_none() {
                continue;
            }
            let mut plugged = network
                .plug(vm_id, &self.tap_name(vm_id), &mac::underlay(vm_id))
                .map(drop);
            if plugged.is_ok() && !rec.spec.network.is_empty() {
                plugged = network.plug_named(
                    vm_id,
                    &rec.spec.network,
                    &self.site_tap_name(vm_id),
                    &mac::second_nic(vm_id),
                );
            }
            match plugged {
                Ok(()) => log::info!("VM {vm_id}: adopted; serving its network again"),
                Err(e) => log::error!("VM {vm_id}: adopted, but its network is not served: {e}"),
            }
        }
    }

    fn digest(&self, vm_id: &Id) -> String {
        let d = Sha256::new()
            .chain_update(self.store.root().as_os_str().as_encoded_bytes())
            .chain_update([0])
            .chain_update(vm_id.as_str())
            .finalize();
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn socket_path(&self, vm_id: &Id) -> PathBuf {
        self.cfg
            .run_dir
            .join(format!("{}.sock", &self.digest(vm_id)[..16]))
    }

    /// ≤ 15 bytes, as Linux link names must be.
    pub fn tap_name(&self, vm_id: &Id) -> String {
        let room = 15usize.saturating_sub(self.cfg.tap_prefix.len()).min(12);
        format!("{}{}", self.cfg.tap_prefix, &self.digest(vm_id)[..room])
    }

    /// The second NIC's tap: the same, its last character made `s`.
    pub fn site_tap_name(&self, vm_id: &Id) -> String {
        let mut name = self.tap_name(vm_id);
        name.pop();
        name.push('s');
        name
    }

    fn tracked(&self, vm_id: &Id) -> Option<Tracked> {
        Tracked::read(&self.store.pidfile_path(vm_id))
    }

    /// The VM's hypervisor, if it is alive: the pidfile's process, started
    /// when recorded, not a zombie, and running with this VM's API socket on
    /// its command line (so no other process can pass for it).
    fn alive(&self, vm_id: &Id) -> Option<Tracked> {
        let tracked = self.tracked(vm_id).filter(Tracked::alive)?;
        let socket = format!("path={}", self.socket_path(vm_id).display());
        let cmdline = fs::read(format!("/proc/{}/cmdline", tracked.pid)).ok()?;
        cmdline
            .split(|b| *b == 0)
            .any(|arg| arg == socket.as_bytes())
            .then_some(tracked)
    }

    fn spawn(&self, spec: &VmSpec) -> Result<Tracked, BoxFailure> {
        let vm_id = &spec.vm_id;
        let transient = |what: &str, e: std::io::Error| -> BoxFailure {
            Simple::transient(format!("VM {vm_id}: cannot {what}: {e}")).into()
        };
        fs::create_dir_all(self.store.vm_dir(vm_id))
            .map_err(|e| transient("create its directory", e))?;
        let socket = self.socket_path(vm_id);
        let _ = fs::remove_file(&socket);
        let tap_name = self.tap_name(vm_id);
        let tap =
            tap::open(&tap_name).map_err(|e| transient(&format!("open its tap {tap_name}"), e))?;
        if let Some(network) = &self.cfg.network {
            let ip = network.plug(vm_id, &tap_name, &mac::underlay(vm_id))?;
            log::info!("VM {vm_id}: {ip} on its tap {tap_name}");
        }
        // The second NIC, on a named host network: its own tap, joined to
        // the site's bridge, its address learned from the site's DHCP.
        let site_tap = if spec.network.is_empty() {
            None
        } else {
            let Some(network) = self
                .cfg
                .network
                .as_ref()
                .filter(|n| n.serves(&spec.network))
            else {
                return Err(Simple::permanent(format!(
                    "host network {:?} is not served on this host; add it with --host-network {}=BRIDGE",
                    spec.network, spec.network
                ))
                .into());
            };
            let name = self.site_tap_name(vm_id);
            let fd = tap::open(&name).map_err(|e| transient(&format!("open its tap {name}"), e))?;
            network.plug_named(vm_id, &spec.network, &name, &mac::second_nic(vm_id))?;
            Some(fd)
        };
        let log_path = self.store.hypervisor_log_path(vm_id);
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&log_path)
            .map_err(|e| transient("open its log", e))?;
        let log2 = log.try_clone().map_err(|e| transient("open its log", e))?;

        let mut cmd = Command::new(&self.cfg.hypervisor);
        cmd.arg("--api-socket")
            .arg(format!("path={}", socket.display()));
        match (&self.cfg.kernel, &self.cfg.firmware) {
            (Some(kernel), _) => {
                cmd.arg("--kernel")
                    .arg(kernel)
                    .arg("--cmdline")
                    .arg(&self.cfg.cmdline);
            }
            (None, Some(firmware)) => {
                cmd.arg("--firmware").arg(firmware);
            }
            (None, None) => {}
        }
        cmd.arg("--disk")
            .arg(format!(
                "path={}",
                self.store.root_disk_path(vm_id).display()
            ))
            .arg(format!(
                "path={},readonly=on",
                self.store.seed_path(vm_id).display()
            ));
        for volume in &spec.volume_ids {
            cmd.arg(format!("path={}", self.store.volume_path(volume).display()));
        }
        cmd.arg("--net")
            .arg(format!("fd=3,mac={}", mac::underlay(vm_id)));
        if site_tap.is_some() {
            cmd.arg(format!("fd=4,mac={}", mac::second_nic(vm_id)));
        }
        cmd.arg("--serial")
            .arg(format!(
                "file={}",
                self.store.serial_log_path(vm_id).display()
            ))
            .arg("--console")
            .arg("off")
            .arg("--cpus")
            .arg(format!("boot={}", spec.vcpus))
            .arg("--memory")
            .arg(format!("size={}M", spec.mem_mb))
            .arg("--log-file")
            .arg(&log_path)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        let tap_fd = tap.as_raw_fd();
        let site_fd = site_tap.as_ref().map(AsRawFd::as_raw_fd);
        // SAFETY: the closure runs in the forked child before exec and calls
        // only async-signal-safe functions (setsid, dup2, fcntl); it touches
        // no memory shared with the parent's other threads.
        unsafe {
            cmd.pre_exec(move || {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                if tap_fd == 3 {
                    // dup2 onto itself keeps close-on-exec: clear it instead.
                    let fd = std::os::fd::BorrowedFd::borrow_raw(3);
                    nix::fcntl::fcntl(
                        fd,
                        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
                    )
                    .map_err(std::io::Error::from)?;
                } else if nix::libc::dup2(tap_fd, 3) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The site tap's fd is never 3 (fd 3 is taken above), and a
                // dup2 onto 4 clears close-on-exec.
                if let Some(fd) = site_fd
                    && fd != 4
                    && nix::libc::dup2(fd, 4) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| -> BoxFailure {
            Simple::transient(format!(
                "cannot start {}: {e}",
                self.cfg.hypervisor.display()
            ))
            .into()
        })?;
        // The VMM holds the taps now; the agent's copies must not keep them
        // alive.
        drop(tap);
        drop(site_tap);
        let pid = child.id() as i32;
        let tracked = Tracked::of(pid).unwrap_or(Tracked { pid, start: 0 });
        if let Err(e) = tracked.write(&self.store.pidfile_path(vm_id)) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(transient("write its pidfile", e));
        }
        self.exits.lock().remove(vm_id);
        self.unreaped.lock().insert(pid);
        let (exits, unreaped, id) = (
            Arc::clone(&self.exits),
            Arc::clone(&self.unreaped),
            vm_id.clone(),
        );
        let reaper = std::thread::Builder::new()
            .name(format!("reap-{vm_id}"))
            .stack_size(64 * 1024)
            .spawn(move || {
                if let Ok(status) = child.wait() {
                    log::info!("VM {id}: hypervisor {pid} exited ({})", describe(status));
                    exits.lock().insert(id, status);
                }
                unreaped.lock().remove(&pid);
            });
        if let Err(e) = reaper {
            // Without a reaper the child would become a zombie: stop it now.
            let _ = tracked.signal(Signal::SIGKILL);
            return Err(transient("start its reaper thread", e));
        }
        log::info!("VM {vm_id}: hypervisor started (pid {pid})");
        Ok(tracked)
    }

    /// Waits until the new VMM's API says Running, it exits, or time runs
    /// out; the latter two kill it and fail with its own account.
    fn await_running(
        &self,
        vm_id: &Id,
        tracked: Tracked,
        deadline: Deadline,
    ) -> Result<(), BoxFailure> {
        let socket = self.socket_path(vm_id);
        let until = deadline.capped(self.cfg.boot_wait);
        let started = Instant::now();
        loop {
            if !tracked.alive() {
                let reason = self.failure_reason(vm_id);
                return Err(Simple::transient(format!(
                    "the hypervisor exited during boot: {reason}"
                ))
                .into());
            }
            if api::vm_state(&socket, Duration::from_millis(500)).as_deref() == Some("Running") {
                return Ok(());
            }
            if until.expired() {
                self.kill(tracked);
                let reason = self.failure_reason(vm_id);
                if deadline.expired() {
                    log::warn!(
                        "VM {vm_id}: killed a hypervisor that did not boot in time: {reason}"
                    );
                    return Err(DeadlineExpired {
                        waiting_for: "waiting for the hypervisor's API",
                    }
                    .into());
                }
                return Err(Simple::transient(format!(
                    "the hypervisor's API did not say Running within {}s; killed it: {reason}",
                    self.cfg.boot_wait.as_secs()
                ))
                .into());
            }
            // A VMM's API is up a few ms after exec: poll finely at first,
            // then back off so a slow guest costs no CPU.
            let pause = if started.elapsed() < Duration::from_millis(50) {
                Duration::from_micros(250)
            } else {
                Duration::from_millis(5)
            };
            std::thread::sleep(pause);
        }
    }

    /// Waits until the process is gone and, if it was this agent's child,
    /// reaped (a zombie reads as not alive, but is still a process).
    fn wait_gone(&self, tracked: Tracked, bound: Deadline) -> bool {
        while tracked.alive() || self.unreaped.lock().contains(&tracked.pid) {
            if bound.expired() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    fn kill(&self, tracked: Tracked) {
        let _ = tracked.signal(Signal::SIGKILL);
        self.wait_gone(tracked, Deadline::after(Duration::from_secs(5)));
    }

    fn stop(&self, vm_id: &Id, deadline: Deadline) -> Result<(), BoxFailure> {
        let Some(tracked) = self.alive(vm_id) else {
            // Already dead; if it was this agent's child, let its reaper
            // finish, so no zombie outlives the stop.
            if let Some(dead) = self.tracked(vm_id) {
                self.wait_gone(dead, Deadline::after(Duration::from_secs(2)));
            }
            return Ok(());
        };
        let socket = self.socket_path(vm_id);
        let call = |path: &str| {
            let _ = api::call(&socket, "PUT", path, Duration::from_secs(2));
        };
        if !deadline.expired() {
            call("/api/v1/vm.power-button");
            let bound = deadline.capped(self.cfg.stop.power_button);
            loop {
                let state = api::vm_state(&socket, Duration::from_millis(500));
                if !tracked.alive()
                    || matches!(state.as_deref(), Some("Shutdown" | "Created"))
                    || bound.expired()
                {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            call("/api/v1/vmm.shutdown");
            if self.wait_gone(tracked, deadline.capped(self.cfg.stop.vmm_shutdown)) {
                return Ok(());
            }
            log::warn!("VM {vm_id}: hypervisor ignored shutdown; sending SIGTERM");
            let _ = tracked.signal(Signal::SIGTERM);
            if self.wait_gone(tracked, deadline.capped(self.cfg.stop.terminate)) {
                return Ok(());
            }
        }
        log::warn!("VM {vm_id}: killing hypervisor {}", tracked.pid);
        tracked.signal(Signal::SIGKILL).map_err(|e| -> BoxFailure {
            Simple::transient(format!("cannot kill hypervisor {}: {e}", tracked.pid)).into()
        })?;
        if self.wait_gone(tracked, Deadline::after(Duration::from_secs(5))) {
            Ok(())
        } else {
            Err(Simple::transient(format!("hypervisor {} survived SIGKILL", tracked.pid)).into())
        }
    }

    /// The first line `--version` prints, within a bound.
    fn version(&self) -> Result<String, String> {
        let mut child = Command::new(&self.cfg.hypervisor)
            .arg("--version")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            match child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(5)),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err("--version did not answer within 5s".into());
                }
            }
        }
        let mut out = String::new();
        if let Some(mut stdout) = child.stdout.take() {
            let _ = stdout.read_to_string(&mut out);
        }
        Ok(out.lines().next().unwrap_or("").trim().to_owned())
    }
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => "unknown status".into(),
    }
}

/// The major version in `cloud-hypervisor v53.0[-suffix]`.
fn major_version(line: &str) -> Option<u32> {
    let v = line.split_whitespace().find(|w| w.starts_with('v'))?;
    v[1..].split(['.', '-']).next()?.parse().ok()
}

/// The last lines of a log, at most `REASON_BYTES`, on one line.
fn log_tail(path: &Path) -> String {
    let Ok(mut file) = fs::File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(REASON_BYTES)));
    let mut bytes = Vec::new();
    let _ = file.read_to_end(&mut bytes);
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    lines[lines.len().saturating_sub(3)..].join(" | ")
}

fn permanent(msg: String) -> Result<(), BoxFailure> {
    Err(Simple::permanent(msg).into())
}

impl Provisioner for CloudHypervisor {
    fn preflight(&self, _deadline: Deadline) -> Result<(), BoxFailure> {
        let hv = &self.cfg.hypervisor;
        let found = if hv.components().count() > 1 {
            Some(hv.clone())
        } else {
            std::env::var_os("PATH").and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|d| d.join(hv))
                    .find(|p| p.is_file())
            })
        };
        let Some(path) = found.filter(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        }) else {
            return permanent(format!(
                "the hypervisor {} is not an executable file; install cloud-hypervisor v{MIN_VERSION} or later, or point --hypervisor at it",
                hv.display()
            ));
        };
        match self.version().map(|line| (major_version(&line), line)) {
            Ok((Some(major), _)) if major >= MIN_VERSION => {}
            Ok((_, line)) => {
                return permanent(format!(
                    "{} reports version {line:?}; this agent needs cloud-hypervisor v{MIN_VERSION} or later",
                    path.display()
                ));
            }
            Err(e) => {
                return Err(Simple::transient(format!(
                    "cannot ask {} its version: {e}",
                    path.display()
                ))
                .into());
            }
        }
        if let Err(e) = OpenOptions::new().read(true).write(true).open("/dev/kvm") {
            return permanent(format!(
                "cannot open /dev/kvm read-write ({e}); load kvm_intel or kvm_amd and give the agent access to it"
            ));
        }
        if !Path::new("/dev/net/tun").exists() {
            return permanent("/dev/net/tun is missing; load the tun module (modprobe tun)".into());
        }
        match (&self.cfg.kernel, &self.cfg.firmware) {
            (Some(p), _) | (None, Some(p)) if p.is_file() => Ok(()),
            (Some(p), _) | (None, Some(p)) => permanent(format!(
                "the guest boot file {} does not exist; fix --kernel or --firmware",
                p.display()
            )),
            (None, None) => permanent(
                "no guest kernel or firmware is configured; give --kernel or --firmware".into(),
            ),
        }
    }

    fn prepare_root_disk(
        &self,
        spec: &VmSpec,
        base: &Path,
        deadline: Deadline,
    ) -> Result<(), BoxFailure> {
        if self.alive(&spec.vm_id).is_some() {
            // A create retried after its record save failed must not clone
            // over the disk of a guest that is running on it.
            return Err(Simple::transient(format!(
                "VM {}: refusing to replace the root disk of a running hypervisor",
                spec.vm_id
            ))
            .into());
        }
        fs::create_dir_all(self.store.vm_dir(&spec.vm_id)).map_err(|e| -> BoxFailure {
            Simple::transient(format!("cannot create the VM directory: {e}")).into()
        })?;
        crate::disk::prepare(
            base,
            &self.store.root_disk_path(&spec.vm_id),
            spec.disk_gb,
            deadline,
        )
        .map(drop)
        .map_err(Into::into)
    }

    fn boot(&self, spec: &VmSpec, deadline: Deadline) -> Result<(), BoxFailure> {
        if self.alive(&spec.vm_id).is_some() {
            return Ok(());
        }
        let tracked = self.spawn(spec)?;
        self.await_running(&spec.vm_id, tracked, deadline)
    }

    fn shutdown(&self, vm_id: &Id, deadline: Deadline) -> Result<(), BoxFailure> {
        self.stop(vm_id, deadline)
    }

    fn destroy(&self, vm_id: &Id, deadline: Deadline) -> Result<(), BoxFailure> {
        self.stop(vm_id, deadline)?;
        for tap in [self.tap_name(vm_id), self.site_tap_name(vm_id)] {
            // The kernel unregisters a tap asynchronously once its last fd
            // closes, so a VMM that just exited can leave its link for a
            // moment: give it that moment before removing a leftover.
            let settle = Deadline::after(Duration::from_secs(2));
            while tap::exists(&tap) && !settle.expired() {
                std::thread::sleep(Duration::from_millis(5));
            }
            if tap::exists(&tap)
                && let Err(e) = tap::remove(&tap)
            {
                return Err(Simple::transient(format!("cannot remove tap {tap}: {e}")).into());
            }
        }
        let socket = self.socket_path(vm_id);
        let lock = PathBuf::from(format!("{}.lock", socket.display()));
        for path in [socket, lock, self.store.pidfile_path(vm_id)] {
            match fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(Simple::transient(format!(
                        "cannot remove {}: {e}",
                        path.display()
                    ))
                    .into());
                }
            }
        }
        self.exits.lock().remove(vm_id);
        if let Some(network) = &self.cfg.network {
            network.release(vm_id, &mac::underlay(vm_id), &mac::second_nic(vm_id))?;
        }
        Ok(())
    }

    fn running(&self, vm_id: &Id) -> bool {
        self.alive(vm_id).is_some()
    }

    fn failure_reason(&self, vm_id: &Id) -> String {
        let tail = log_tail(&self.store.hypervisor_log_path(vm_id));
        match self.exits.lock().get(vm_id) {
            Some(status) if tail.is_empty() => format!("hypervisor {}", describe(*status)),
            Some(status) => format!("hypervisor {}: {tail}", describe(*status)),
            None => tail,
        }
    }

    fn address(&self, vm_id: &Id) -> String {
        self.cfg
            .network
            .as_ref()
            .and_then(|n| n.address(&mac::underlay(vm_id)))
            .map(|ip| ip.to_string())
            .unwrap_or_default()
    }

    fn network_address(&self, vm_id: &Id) -> String {
        self.cfg
            .network
            .as_ref()
            .and_then(|n| n.network_address(&mac::second_nic(vm_id)))
            .map(|ip| ip.to_string())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_from_the_banner() {
        assert_eq!(major_version("cloud-hypervisor v53.0"), Some(53));
        assert_eq!(major_version("cloud-hypervisor v41.0-dirty"), Some(41));
        assert_eq!(major_version("something else"), None);
    }
}
