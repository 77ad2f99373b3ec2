//! Starting a VMM: its taps and network, the fork (own session, fd 3 and
//! 4 the taps, output to its log), the pidfile and reaper, and the wait
//! for its API to say Running.

use std::fs::{self, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use super::process::Tracked;
use super::{CloudHypervisor, api, describe, tap};
use crate::deadline::Deadline;
use crate::error::{BoxFailure, DeadlineExpired, Simple};
use crate::model::{Id, Mac, VmSpec};
use crate::provision::Provisioner;

impl CloudHypervisor {
    pub(super) fn spawn(&self, spec: &VmSpec) -> Result<Tracked, BoxFailure> {
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
            let ip = network.plug(vm_id, &tap_name, Mac::underlay(vm_id))?;
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
            network.plug_named(vm_id, &spec.network, &name, Mac::second_nic(vm_id))?;
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
            .arg(format!("fd=3,mac={}", Mac::underlay(vm_id)));
        if site_tap.is_some() {
            cmd.arg(format!("fd=4,mac={}", Mac::second_nic(vm_id)));
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
        let (exits, unreaped, listener, id) = (
            Arc::clone(&self.exits),
            Arc::clone(&self.unreaped),
            self.listener.clone(),
            vm_id.clone(),
        );
        let reaper = std::thread::Builder::new()
            .name(format!("reap-{vm_id}"))
            .stack_size(64 * 1024)
            .spawn(move || {
                if let Ok(status) = child.wait() {
                    log::info!("VM {id}: hypervisor {pid} exited ({})", describe(status));
                    exits.lock().insert(id.clone(), status);
                }
                // Reaped first: a stop waiting for this child must be free
                // to return before the engine hears of the exit.
                unreaped.lock().remove(&pid);
                listener.exited(&id);
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
    pub(super) fn await_running(
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
}
