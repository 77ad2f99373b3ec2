//! Starting a VMM, in order:
//! 1. Its directory, and no stale API socket.
//! 2. Its NICs: taps opened on /dev/net/tun (not persistent: a tap lives
//!    exactly as long as a process holds it) and joined to the host's
//!    networks.
//! 3. Its command line, from [`argv`] (pure).
//! 4. The fork, held before exec (see [`fork`](super::fork)): the pidfile
//!    (pid and start time) is written and synced, and only then is the
//!    child released to exec. A crash at any point leaves a tracked VMM or
//!    none.
//! 5. Its reaper thread, which tells the engine when it exits.
//! 6. The wait for its API to say Running (see [`CloudHypervisor::await_running`]).

use std::fs::{self, OpenOptions};
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use super::argv::{GuestImage, Nic, VmFiles, argv};
use super::error::CloudHvError;
use super::fork::{Held, fork_held, wait_raw};
use super::process::Tracked;
use super::{CloudHypervisor, api, describe, tap};
use crate::deadline::Deadline;
use crate::error::{BoxFailure, DeadlineExpired};
use crate::model::{Id, Mac, VmSpec};
use crate::provision::Provisioner;

/// The VMM's first NIC is this fd, the second the next one.
const FIRST_NIC_FD: i32 = 3;

impl CloudHypervisor {
    /// Starts the VM's VMM (see the module steps) and returns it, tracked.
    pub(super) fn spawn(&self, spec: &VmSpec) -> Result<Tracked, BoxFailure> {
        let vm_id = &spec.vm_id;
        self.make_vm_dir(vm_id)?;
        let files = self.files(spec);
        // A stale socket of a VMM that died: the new one binds its own.
        let _ = fs::remove_file(&files.api_socket);
        let taps = self.prepare_nics(spec)?;
        let nics: Vec<Nic> = taps
            .iter()
            .enumerate()
            .map(|(i, (_, mac))| Nic {
                fd: FIRST_NIC_FD + i as i32,
                mac: *mac,
            })
            .collect();
        let args = argv(self.guest_image(), &files, &nics, spec.vcpus, spec.mem_mb);
        let held = self.fork(vm_id, &args, &taps, &files.log)?;
        let tracked = self.track(vm_id, held)?;
        // The VMM holds the taps now; the agent's copies must not keep them
        // alive after it exits.
        drop(taps);
        Ok(tracked)
    }

    /// Where the VM's files are, as its command line names them.
    fn files(&self, spec: &VmSpec) -> VmFiles {
        let vm_id = &spec.vm_id;
        VmFiles {
            api_socket: self.socket_path(vm_id),
            root_disk: self.store.root_disk_path(vm_id),
            seed: self.store.seed_path(vm_id),
            volumes: spec
                .volume_ids
                .iter()
                .map(|v| self.store.volume_path(v))
                .collect(),
            serial_log: self.store.serial_log_path(vm_id),
            log: self.store.hypervisor_log_path(vm_id),
        }
    }

    fn guest_image(&self) -> Option<GuestImage<'_>> {
        match (&self.cfg.kernel, &self.cfg.firmware) {
            (Some(kernel), _) => Some(GuestImage::Kernel {
                kernel,
                cmdline: &self.cfg.cmdline,
            }),
            (None, Some(firmware)) => Some(GuestImage::Firmware(firmware)),
            (None, None) => None,
        }
    }

    /// Opens the VM's taps and joins them to the host's networks: the
    /// underlay NIC always; a second NIC on the named host network the spec
    /// asks for, its address learned from the site's own DHCP.
    fn prepare_nics(&self, spec: &VmSpec) -> Result<Vec<(OwnedFd, Mac)>, BoxFailure> {
        let vm_id = &spec.vm_id;
        let open = |name: String| {
            tap::open(&name).map_err(|source| CloudHvError::OpenTap {
                vm_id: vm_id.clone(),
                tap: name,
                source,
            })
        };
        let mut taps = Vec::with_capacity(2);
        let name = self.tap_name(vm_id);
        let mac = Mac::underlay(vm_id);
        taps.push((open(name.clone())?, mac));
        if let Some(network) = &self.cfg.network {
            let ip = network.plug(vm_id, &name, mac)?;
            log::info!("VM {vm_id}: {ip} on its tap {name}");
        }
        if !spec.network.is_empty() {
            let Some(network) = self
                .cfg
                .network
                .as_ref()
                .filter(|n| n.serves(&spec.network))
            else {
                return Err(CloudHvError::NetworkNotServed {
                    vm_id: vm_id.clone(),
                    network: spec.network.clone(),
                }
                .into());
            };
            let name = self.site_tap_name(vm_id);
            let mac = Mac::second_nic(vm_id);
            taps.push((open(name.clone())?, mac));
            network.plug_named(vm_id, &spec.network, &name, mac)?;
        }
        Ok(taps)
    }

    /// Forks the VMM, held before exec (see the module steps): in its own
    /// session, stdin from /dev/null, output appended to its log, its taps
    /// as fds 3, 4, … in NIC order.
    fn fork(
        &self,
        vm_id: &Id,
        args: &[std::ffi::OsString],
        taps: &[(OwnedFd, Mac)],
        log_path: &std::path::Path,
    ) -> Result<Held, BoxFailure> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(log_path)
            .map_err(|source| CloudHvError::OpenLog {
                vm_id: vm_id.clone(),
                path: log_path.to_path_buf(),
                source,
            })?;
        let taps: Vec<&OwnedFd> = taps.iter().map(|(fd, _)| fd).collect();
        fork_held(&self.cfg.hypervisor, args, &OwnedFd::from(log), &taps).map_err(|source| {
            CloudHvError::Start {
                vm_id: vm_id.clone(),
                program: self.cfg.hypervisor.clone(),
                source,
            }
            .into()
        })
    }

    /// Records the held VMM (pidfile with its start time, synced), releases
    /// it to exec, and starts the thread that reaps it and tells the engine
    /// when it exits.
    fn track(&self, vm_id: &Id, held: Held) -> Result<Tracked, BoxFailure> {
        let pid = held.pid;
        let tracked = Tracked::of(pid).unwrap_or(Tracked { pid, start: 0 });
        let pidfile = self.store.pidfile_path(vm_id);
        // A child never released, or whose exec failed: reaped here.
        let end = |held: Option<Held>| {
            drop(held);
            let _ = tracked.signal(Signal::SIGKILL);
            wait_raw(pid);
        };
        if let Err(source) = tracked.write(&pidfile) {
            end(Some(held));
            return Err(CloudHvError::Pidfile {
                vm_id: vm_id.clone(),
                path: pidfile,
                source,
            }
            .into());
        }
        crate::crash::point("boot.pidfile-written");
        if let Err(source) = held.release() {
            end(None);
            return Err(CloudHvError::Start {
                vm_id: vm_id.clone(),
                program: self.cfg.hypervisor.clone(),
                source,
            }
            .into());
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
                if let Some(raw) = wait_raw(pid) {
                    let status = ExitStatus::from_raw(raw);
                    log::info!("VM {id}: hypervisor {pid} exited ({})", describe(status));
                    exits.lock().insert(id.clone(), status);
                }
                // Reaped first: a stop waiting for this child must be free
                // to return before the engine hears of the exit.
                unreaped.lock().remove(&pid);
                listener.exited(&id);
            });
        if let Err(source) = reaper {
            // Without a reaper the child would become a zombie: end it here.
            self.unreaped.lock().remove(&pid);
            end(None);
            return Err(CloudHvError::Reaper {
                vm_id: vm_id.clone(),
                source,
            }
            .into());
        }
        crate::crash::point("boot.hypervisor-started");
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
                return Err(CloudHvError::ExitedDuringBoot {
                    vm_id: vm_id.clone(),
                    reason: self.failure_reason(vm_id),
                }
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
                return Err(CloudHvError::BootTimeout {
                    vm_id: vm_id.clone(),
                    waited: self.cfg.boot_wait,
                    reason,
                }
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
