//! The vfkit backend: guests on macOS's Virtualization.framework, driven
//! through `vfkit` (v0.6.2+), with the same engine, store, image cache,
//! seed and report as cloud-hypervisor's on Linux. Platform-free Rust: the
//! whole backend builds and is tested on Linux against a fake `vfkit`
//! (`tests/standin/vfkit.rs`); what only a Mac can show is listed in the
//! README's macOS section.
//!
//! A VM's life here:
//! 1. Root disk: the base cloned (clonefile(2) on APFS, a sparse copy
//!    elsewhere) and grown; raw only (the image cache refuses QCOW2, and
//!    vfkit would too).
//! 2. Boot: a leftover API socket removed (vfkit's bind fails on one),
//!    then `vfkit` forked in its own process group with the command line
//!    [`argv`] builds, its stdout and stderr appended to the VM's
//!    `hypervisor.log` (vfkit keeps no log of its own: that file is the
//!    failure reason), a reaper thread told of its exit, and its REST API
//!    polled until it says Running. A vfkit that exits first fails the
//!    boot with its `Error: …` line.
//! 3. Found again (a restart of the agent): `vfkit.pid` names a live
//!    process whose name is the vfkit binary's. Its exit is then seen at
//!    the next tick (no pidfd here).
//! 4. Stop, a ladder: the power button (`Stop`), up to
//!    [`StopLadder::power_button`]; `HardStop` (an EOF answer is vfkit
//!    exiting), up to [`StopLadder::hard_stop`]; SIGKILL.
//! 5. Address: the newest lease for the VM's MAC in bootpd's lease file
//!    ([`leases`]).
//!
//! A second NIC on a named host network is refused: vfkit's bridged mode
//! needs the `com.apple.vm.networking` entitlement, which only Apple
//! grants to a signed build; the error says so.

pub mod argv;
pub mod leases;
pub mod rest;

use std::collections::HashMap;
use std::fmt;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sha2::{Digest, Sha256};

use self::argv::{ArgvError, Files, Shape};
use super::{ExitListener, Provisioner, Say};
use crate::deadline::Deadline;
use crate::error::{BoxFailure, DeadlineExpired, Failure};
use crate::model::{Id, Mac, VmSpec};
use crate::state::Store;

/// How long each rung of the stop ladder waits for vfkit to exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopLadder {
    /// After the power button: the guest's own orderly shutdown.
    pub power_button: Duration,
    /// After HardStop.
    pub hard_stop: Duration,
    /// After SIGKILL.
    pub kill: Duration,
}

impl Default for StopLadder {
    fn default() -> StopLadder {
        StopLadder {
            power_button: Duration::from_secs(90),
            hard_stop: Duration::from_secs(5),
            kill: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, Clone)]
pub struct VfkitConfig {
    /// The vfkit binary (`--hypervisor`).
    pub vfkit: PathBuf,
    /// Where API sockets live: short, since macOS caps a socket path at
    /// 103 bytes.
    pub run_dir: PathBuf,
    /// Bound on waiting for a new VM's API to say Running.
    pub boot_wait: Duration,
    pub stop: StopLadder,
    /// bootpd's lease file ([`leases::LEASE_FILE`]).
    pub leases: PathBuf,
}

#[derive(Debug)]
pub enum VfkitError {
    NotInstalled {
        program: PathBuf,
        why: String,
    },
    Argv {
        vm_id: Id,
        source: ArgvError,
    },
    HostNetwork {
        vm_id: Id,
        network: String,
    },
    DiskInUse {
        vm_id: Id,
    },
    Files {
        vm_id: Id,
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    Start {
        vm_id: Id,
        program: PathBuf,
        source: std::io::Error,
    },
    ExitedDuringBoot {
        vm_id: Id,
        reason: String,
    },
    BootTimeout {
        vm_id: Id,
        waited: Duration,
        reason: String,
    },
    StillRunning {
        vm_id: Id,
        pid: u32,
    },
}

impl fmt::Display for VfkitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VfkitError::NotInstalled { program, why } => write!(
                f,
                "vfkit ({}) cannot run: {why}; install it (brew install vfkit) or point --hypervisor at it",
                program.display()
            ),
            VfkitError::Argv { vm_id, source } => write!(f, "VM {vm_id}: {source}"),
            VfkitError::HostNetwork { vm_id, network } => write!(
                f,
                "VM {vm_id}: host network {network:?} cannot be served on macOS: vfkit bridges a NIC only with Apple's com.apple.vm.networking entitlement; remove the VM's network"
            ),
            VfkitError::DiskInUse { vm_id } => write!(
                f,
                "VM {vm_id}: its root disk is in use by a running vfkit; stop it first"
            ),
            VfkitError::Files {
                vm_id, what, path, ..
            } => {
                write!(f, "VM {vm_id}: cannot {what} {}", path.display())
            }
            VfkitError::Start { vm_id, program, .. } => {
                write!(f, "VM {vm_id}: cannot start {}", program.display())
            }
            VfkitError::ExitedDuringBoot { vm_id, reason } => {
                write!(f, "VM {vm_id}: vfkit exited while booting: {reason}")
            }
            VfkitError::BootTimeout {
                vm_id,
                waited,
                reason,
            } => write!(
                f,
                "VM {vm_id}: vfkit did not say Running within {} s (killed): {reason}",
                waited.as_secs()
            ),
            VfkitError::StillRunning { vm_id, pid } => write!(
                f,
                "VM {vm_id}: vfkit (pid {pid}) is still running after the power button, HardStop and SIGKILL"
            ),
        }
    }
}

impl std::error::Error for VfkitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            VfkitError::Argv { source, .. } => Some(source),
            VfkitError::Files { source, .. } | VfkitError::Start { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl Failure for VfkitError {
    fn is_permanent(&self) -> bool {
        matches!(
            self,
            VfkitError::Argv { .. } | VfkitError::HostNetwork { .. }
        )
    }
}

pub struct Vfkit {
    store: Arc<Store>,
    cfg: VfkitConfig,
    /// vfkits this agent started and has not reaped yet: VM → pid.
    children: Arc<Mutex<HashMap<Id, u32>>>,
    /// How each child of this agent ended, until the VM boots again.
    exits: Arc<Mutex<HashMap<Id, ExitStatus>>>,
    listener: Arc<Mutex<Option<ExitListener>>>,
}

impl Vfkit {
    pub fn new(store: Arc<Store>, cfg: VfkitConfig) -> Vfkit {
        Vfkit {
            store,
            cfg,
            children: Arc::new(Mutex::new(HashMap::new())),
            exits: Arc::new(Mutex::new(HashMap::new())),
            listener: Arc::new(Mutex::new(None)),
        }
    }

    /// The VM's API socket: short, unique per state dir and VM.
    pub fn socket_path(&self, vm_id: &Id) -> PathBuf {
        let d = Sha256::new()
            .chain_update(self.store.root().as_os_str().as_encoded_bytes())
            .chain_update([0])
            .chain_update(vm_id.as_str())
            .finalize();
        self.cfg
            .run_dir
            .join(format!("{}.sock", &crate::hex::encode(&d)[..16]))
    }

    pub fn pidfile_path(&self, vm_id: &Id) -> PathBuf {
        self.store.vm_dir(vm_id).join("vfkit.pid")
    }

    fn files(&self, spec: &VmSpec) -> Files {
        let vm_id = &spec.vm_id;
        Files {
            root_disk: self.store.root_disk_path(vm_id),
            seed: self.store.seed_path(vm_id),
            volumes: spec
                .volume_ids
                .iter()
                .map(|v| self.store.volume_path(v))
                .collect(),
            efi_vars: self.store.vm_dir(vm_id).join("efi-vars"),
            console_log: self.store.serial_log_path(vm_id),
            socket: self.socket_path(vm_id),
            pidfile: self.pidfile_path(vm_id),
        }
    }

    /// The pid of the VM's live vfkit: a child of this agent not yet
    /// reaped, or the pidfile's process when its name is vfkit's.
    pub fn alive(&self, vm_id: &Id) -> Option<u32> {
        if let Some(pid) = self.children.lock().get(vm_id) {
            return Some(*pid);
        }
        let pid: u32 = fs::read_to_string(self.pidfile_path(vm_id))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let ours = self.cfg.vfkit.file_name()?.to_string_lossy().into_owned();
        process_name(pid)
            .is_some_and(|name| same_name(&name, &ours))
            .then_some(pid)
    }

    /// Starts the VM's vfkit (see the module steps) and returns its pid.
    fn spawn(&self, spec: &VmSpec) -> Result<u32, BoxFailure> {
        let vm_id = &spec.vm_id;
        let files_err = |what: &'static str, path: &Path| {
            let (vm_id, path) = (vm_id.clone(), path.to_path_buf());
            move |source| VfkitError::Files {
                vm_id,
                what,
                path,
                source,
            }
        };
        let files = self.files(spec);
        let shape = Shape {
            cpus: spec.vcpus,
            mem_mib: spec.mem_mb,
            mac: Mac::underlay(vm_id),
            efi_vars_exist: files.efi_vars.exists(),
        };
        let args = argv::argv(&files, &shape).map_err(|source| VfkitError::Argv {
            vm_id: vm_id.clone(),
            source,
        })?;
        crate::state::perms::make_dir(&self.cfg.run_dir)
            .map_err(files_err("make the run dir", &self.cfg.run_dir))?;
        for stale in [&files.socket, &files.pidfile] {
            match fs::remove_file(stale) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(files_err("remove the stale", stale)(e).into()),
            }
        }
        let log_path = self.store.hypervisor_log_path(vm_id);
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&log_path)
            .map_err(files_err("open the log", &log_path))?;
        let err_log = log
            .try_clone()
            .map_err(files_err("open the log", &log_path))?;
        self.exits.lock().remove(vm_id);
        let mut child = Command::new(&self.cfg.vfkit)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err_log)
            // Its own process group: a ^C meant for the agent's terminal
            // does not reach the guests.
            .process_group(0)
            .spawn()
            .map_err(|source| VfkitError::Start {
                vm_id: vm_id.clone(),
                program: self.cfg.vfkit.clone(),
                source,
            })?;
        let pid = child.id();
        self.children.lock().insert(vm_id.clone(), pid);
        let (children, exits, listener, id) = (
            Arc::clone(&self.children),
            Arc::clone(&self.exits),
            Arc::clone(&self.listener),
            vm_id.clone(),
        );
        let reaper = std::thread::Builder::new()
            .name(format!("reap-{vm_id}"))
            .stack_size(64 * 1024)
            .spawn(move || {
                if let Ok(status) = child.wait() {
                    log::info!("VM {id}: vfkit {pid} exited ({})", describe(status));
                    exits.lock().insert(id.clone(), status);
                }
                children.lock().remove(&id);
                if let Some(tell) = listener.lock().clone() {
                    tell(&id);
                }
            });
        if let Err(source) = reaper {
            // Without its reaper the child would be a zombie: end it.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            self.children.lock().remove(vm_id);
            return Err(VfkitError::Start {
                vm_id: vm_id.clone(),
                program: self.cfg.vfkit.clone(),
                source,
            }
            .into());
        }
        log::info!("VM {vm_id}: vfkit started (pid {pid})");
        Ok(pid)
    }

    /// Waits until the new vfkit says Running, exits, or time runs out
    /// (then it is killed).
    fn await_running(&self, vm_id: &Id, pid: u32, deadline: Deadline) -> Result<(), BoxFailure> {
        let socket = self.socket_path(vm_id);
        let until = deadline.capped(self.cfg.boot_wait);
        let started = Instant::now();
        loop {
            if self.alive(vm_id).is_none() {
                return Err(VfkitError::ExitedDuringBoot {
                    vm_id: vm_id.clone(),
                    reason: self.failure_reason(vm_id),
                }
                .into());
            }
            if rest::state(&socket, Duration::from_millis(500)).is_ok_and(|s| s == rest::RUNNING) {
                return Ok(());
            }
            if until.expired() {
                kill(pid);
                let reason = self.failure_reason(vm_id);
                if deadline.expired() {
                    return Err(DeadlineExpired {
                        waiting_for: "waiting for vfkit's API",
                    }
                    .into());
                }
                return Err(VfkitError::BootTimeout {
                    vm_id: vm_id.clone(),
                    waited: self.cfg.boot_wait,
                    reason,
                }
                .into());
            }
            let pause = if started.elapsed() < Duration::from_millis(50) {
                Duration::from_micros(500)
            } else {
                Duration::from_millis(10)
            };
            std::thread::sleep(pause);
        }
    }

    /// Waits up to `wait` (and the deadline) for the VM's vfkit to be gone.
    fn gone_within(
        &self,
        vm_id: &Id,
        wait: Duration,
        deadline: Deadline,
        say: Say<'_>,
        what: &str,
    ) -> bool {
        let until = deadline.capped(wait);
        let started = Instant::now();
        let mut said = u64::MAX;
        while self.alive(vm_id).is_some() {
            if until.expired() {
                return false;
            }
            let secs = started.elapsed().as_secs();
            if secs != said {
                say(&format!("stopping: {what}, {secs} s of {}", wait.as_secs()));
                said = secs;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    /// The stop ladder (see the module steps).
    fn stop(&self, vm_id: &Id, deadline: Deadline, say: Say<'_>) -> Result<(), BoxFailure> {
        let Some(pid) = self.alive(vm_id) else {
            return Ok(());
        };
        let socket = self.socket_path(vm_id);
        let ladder = self.cfg.stop;
        say("stopping: pressing the power button");
        if let Err(e) = rest::change(&socket, "Stop", Duration::from_secs(2)) {
            log::info!("VM {vm_id}: the power button: {e}");
        }
        if self.gone_within(
            vm_id,
            ladder.power_button,
            deadline,
            say,
            "waiting for the guest to power off",
        ) {
            return Ok(());
        }
        if deadline.expired() {
            return Err(DeadlineExpired {
                waiting_for: "the guest to power off",
            }
            .into());
        }
        say("stopping: the guest ignored the power button; hard stop");
        if let Err(e) = rest::change(&socket, "HardStop", Duration::from_secs(2)) {
            log::info!("VM {vm_id}: HardStop: {e}");
        }
        if self.gone_within(
            vm_id,
            ladder.hard_stop,
            deadline,
            say,
            "waiting for vfkit to stop",
        ) {
            return Ok(());
        }
        say("stopping: killing vfkit");
        kill(pid);
        if self.gone_within(
            vm_id,
            ladder.kill,
            deadline,
            say,
            "waiting for vfkit to die",
        ) {
            return Ok(());
        }
        if deadline.expired() {
            return Err(DeadlineExpired {
                waiting_for: "vfkit to stop",
            }
            .into());
        }
        Err(VfkitError::StillRunning {
            vm_id: vm_id.clone(),
            pid,
        }
        .into())
    }

    /// Every VM dir with a pidfile: the VMs a vfkit may run for.
    fn with_pidfiles(&self) -> Vec<Id> {
        fs::read_dir(self.store.vms_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| Id::parse(&e.file_name().to_string_lossy()).ok())
            .filter(|id| self.pidfile_path(id).exists())
            .collect()
    }
}

fn kill(pid: u32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => "ended".to_owned(),
    }
}

/// Process names are cut short by the kernel (15 bytes on Linux, 16 on
/// macOS): equal where both are whole.
fn same_name(seen: &str, binary: &str) -> bool {
    let cut = |s: &str| s.bytes().take(15).collect::<Vec<u8>>();
    cut(seen) == cut(binary)
}

/// A live (not zombie) process's name.
#[cfg(target_os = "linux")]
fn process_name(pid: u32) -> Option<String> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (head, tail) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1;
    let state = tail.split_whitespace().next()?;
    (state != "Z").then(|| name.to_owned())
}

/// A live process's name.
#[cfg(target_os = "macos")]
fn process_name(pid: u32) -> Option<String> {
    let mut buf = [0u8; 64];
    // SAFETY: `buf` is valid for writes of its length for the call.
    let n = unsafe { nix::libc::proc_name(pid as i32, buf.as_mut_ptr().cast(), buf.len() as u32) };
    (n > 0).then(|| String::from_utf8_lossy(&buf[..n as usize]).into_owned())
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
fn process_name(_pid: u32) -> Option<String> {
    None
}

/// vfkit's own account of a failure: its last `Error: …` line (cobra
/// prints one before exiting 1), else the log's last lines.
fn error_line(log: &Path) -> String {
    let tail = std::fs::read(log).unwrap_or_default();
    let start = tail.len().saturating_sub(4096);
    let text = String::from_utf8_lossy(&tail[start..]);
    match text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with("Error:"))
    {
        Some(line) => crate::quote::inline(line.trim()),
        None => super::log_tail(log),
    }
}

impl Provisioner for Vfkit {
    fn preflight(&self, _deadline: Deadline) -> Result<(), BoxFailure> {
        use std::os::unix::fs::PermissionsExt;
        let program = &self.cfg.vfkit;
        let meta = fs::metadata(program).map_err(|e| VfkitError::NotInstalled {
            program: program.clone(),
            why: e.to_string(),
        })?;
        if meta.permissions().mode() & 0o111 == 0 {
            return Err(VfkitError::NotInstalled {
                program: program.clone(),
                why: "it is not executable".into(),
            }
            .into());
        }
        Ok(())
    }

    fn prepare_root_disk(
        &self,
        spec: &VmSpec,
        base: &Path,
        deadline: Deadline,
    ) -> Result<(), BoxFailure> {
        let vm_id = &spec.vm_id;
        if self.alive(vm_id).is_some() {
            return Err(VfkitError::DiskInUse {
                vm_id: vm_id.clone(),
            }
            .into());
        }
        let dir = self.store.vm_dir(vm_id);
        crate::state::perms::make_dir(&dir).map_err(|source| VfkitError::Files {
            vm_id: vm_id.clone(),
            what: "make",
            path: dir.clone(),
            source,
        })?;
        crate::disk::prepare(
            base,
            &self.store.root_disk_path(vm_id),
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
        if !spec.network.is_empty() {
            return Err(VfkitError::HostNetwork {
                vm_id: spec.vm_id.clone(),
                network: spec.network.clone(),
            }
            .into());
        }
        let pid = self.spawn(spec)?;
        self.await_running(&spec.vm_id, pid, deadline)
    }

    fn shutdown(&self, vm_id: &Id, deadline: Deadline, say: Say<'_>) -> Result<(), BoxFailure> {
        self.stop(vm_id, deadline, say)
    }

    fn destroy(&self, vm_id: &Id, deadline: Deadline) -> Result<(), BoxFailure> {
        self.stop(vm_id, deadline, &|what| log::info!("VM {vm_id}: {what}"))?;
        for path in [self.socket_path(vm_id), self.pidfile_path(vm_id)] {
            match fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(VfkitError::Files {
                        vm_id: vm_id.clone(),
                        what: "remove",
                        path,
                        source,
                    }
                    .into());
                }
            }
        }
        self.exits.lock().remove(vm_id);
        Ok(())
    }

    fn running(&self, vm_id: &Id) -> bool {
        self.alive(vm_id).is_some()
    }

    fn pid(&self, vm_id: &Id) -> Option<u32> {
        self.alive(vm_id)
    }

    fn failure_reason(&self, vm_id: &Id) -> String {
        let said = error_line(&self.store.hypervisor_log_path(vm_id));
        match self.exits.lock().get(vm_id) {
            Some(status) if said.is_empty() => format!("vfkit {}", describe(*status)),
            Some(status) => format!("vfkit {}: {said}", describe(*status)),
            None => said,
        }
    }

    fn address(&self, vm_id: &Id) -> String {
        leases::address(&self.cfg.leases, Mac::underlay(vm_id).octets())
            .map(|ip| ip.to_string())
            .unwrap_or_default()
    }

    fn network_address(&self, _vm_id: &Id) -> String {
        String::new()
    }

    fn watch_exits(&self, listener: ExitListener) {
        *self.listener.lock() = Some(listener);
    }

    /// vfkits left by a previous agent are found by their pidfiles: those
    /// `known` explains are adopted (nothing to do: the pidfile tracks
    /// them), the rest are stopped through the ladder, and said.
    fn recover(&self, known: &[Id]) -> Vec<String> {
        let mut notes = Vec::new();
        for vm_id in self.with_pidfiles() {
            let Some(pid) = self.alive(&vm_id) else {
                continue;
            };
            if known.contains(&vm_id) {
                log::info!("VM {vm_id}: adopted its running vfkit (pid {pid})");
                continue;
            }
            log::warn!(
                "stopping an orphan vfkit (pid {pid}) of VM {vm_id}: no record or desired VM explains it"
            );
            let deadline = Deadline::after(Duration::from_secs(30));
            if let Err(e) = self.stop(&vm_id, deadline, &|_| {}) {
                log::error!("VM {vm_id}: {e}");
            }
            notes.push(format!(
                "stopped an orphan vfkit (pid {pid}) of VM {vm_id} that no record or desired VM explains"
            ));
        }
        notes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_cut_by_the_kernel_still_match() {
        assert!(same_name("eitri-standin-v", "eitri-standin-vfkit"));
        assert!(!same_name("vfkit", "cloud-hypervisor"));
    }

    #[test]
    fn the_error_line_is_vfkits_own_account() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("hypervisor.log");
        std::fs::write(
            &log,
            "time=\"…\" level=info msg=\"starting\"\nError: virtio-blk: disk.raw: is a QCOW2 image\nUsage:\n  vfkit [flags]\n",
        )
        .expect("log");

        assert_eq!(
            error_line(&log),
            "Error: virtio-blk: disk.raw: is a QCOW2 image"
        );
    }
}
