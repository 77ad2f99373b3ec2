//! Starting a VMM, in order:
//! 1. Its directory, and no stale API socket.
//! 2. Its NICs: taps opened on /dev/net/tun (not persistent: a tap lives
//!    exactly as long as a process holds it) and joined to the host's
//!    networks.
//! 3. Its command line, from [`argv`] (pure).
//! 4. The fork: own session, stdin /dev/null, output appended to its log,
//!    the taps moved onto fds 3, 4, … and nothing else inherited (every fd
//!    the agent opens is close-on-exec).
//! 5. Its pidfile (pid and start time, atomically) and its reaper thread.
//! 6. The wait for its API to say Running (see [`CloudHypervisor::await_running`]).

use std::fs::{self, OpenOptions};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use super::argv::{GuestImage, Nic, VmFiles, argv};
use super::error::CloudHvError;
use super::process::Tracked;
use super::{CloudHypervisor, api, describe, tap};
use crate::deadline::Deadline;
use crate::error::{BoxFailure, DeadlineExpired};
use crate::model::{Id, Mac, VmSpec};
use crate::provision::Provisioner;

/// The VMM's first NIC is this fd, the second the next one.
const FIRST_NIC_FD: i32 = 3;
/// A VM has an underlay NIC and at most one on a named host network.
const MAX_NICS: usize = 2;

/// In the forked child: puts `fds[i]` on `first + i`, whatever numbers they
/// have now. Each is first copied above every target (an fd already sitting
/// on a target, say the site tap on 3 when fd 3 happened to be free, would
/// otherwise be overwritten by the first dup2), close-on-exec so the copies
/// vanish at exec; then dup2 puts each in place, which clears
/// close-on-exec on the target.
fn place_fds(fds: &[i32], first: i32) -> std::io::Result<()> {
    let above = first + fds.len() as i32;
    let mut high = [-1; MAX_NICS];
    for (copy, fd) in high.iter_mut().zip(fds) {
        // SAFETY: F_DUPFD_CLOEXEC on an fd this process holds open; it
        // returns a new fd or -1 and touches no memory.
        *copy = unsafe { nix::libc::fcntl(*fd, nix::libc::F_DUPFD_CLOEXEC, above) };
        if *copy < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    for (i, copy) in high.iter().take(fds.len()).enumerate() {
        // SAFETY: dup2 between two fds of this process; it touches no memory.
        if unsafe { nix::libc::dup2(*copy, first + i as i32) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

impl CloudHypervisor {
    /// Starts the VM's VMM (see the module steps) and returns it, tracked.
    pub(super) fn spawn(&self, spec: &VmSpec) -> Result<Tracked, BoxFailure> {
        let vm_id = &spec.vm_id;
        let dir = self.store.vm_dir(vm_id);
        fs::create_dir_all(&dir).map_err(|source| CloudHvError::VmDir {
            vm_id: vm_id.clone(),
            path: dir,
            source,
        })?;
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
        let child = self.fork(vm_id, &args, &taps, &files.log)?;
        // The VMM holds the taps now; the agent's copies must not keep them
        // alive after it exits.
        drop(taps);
        self.track(vm_id, child)
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

    /// Forks the VMM: in its own session (signals to the agent's group never
    /// reach it, and it outlives the agent), stdin from /dev/null, output
    /// appended to its log, and its taps as fds 3, 4, … in NIC order.
    fn fork(
        &self,
        vm_id: &Id,
        args: &[std::ffi::OsString],
        taps: &[(OwnedFd, Mac)],
        log_path: &std::path::Path,
    ) -> Result<Child, BoxFailure> {
        let open_log = |source| CloudHvError::OpenLog {
            vm_id: vm_id.clone(),
            path: log_path.to_path_buf(),
            source,
        };
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(log_path)
            .map_err(open_log)?;
        let log2 = log.try_clone().map_err(open_log)?;
        let mut fds = [-1; MAX_NICS];
        for (slot, (tap, _)) in fds.iter_mut().zip(taps) {
            *slot = tap.as_raw_fd();
        }
        let count = taps.len().min(MAX_NICS);
        let mut cmd = Command::new(&self.cfg.hypervisor);
        cmd.args(args).stdin(Stdio::null()).stdout(log).stderr(log2);
        // SAFETY: the closure runs in the forked child before exec and calls
        // only async-signal-safe functions (setsid, fcntl, dup2) on fixed-size
        // data captured by value; it allocates nothing and touches no memory
        // shared with the parent's other threads.
        unsafe {
            cmd.pre_exec(move || {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                place_fds(&fds[..count], FIRST_NIC_FD)
            });
        }
        cmd.spawn().map_err(|source| {
            CloudHvError::Start {
                vm_id: vm_id.clone(),
                program: self.cfg.hypervisor.clone(),
                source,
            }
            .into()
        })
    }

    /// Records the new VMM (pidfile with its start time) and starts the
    /// thread that reaps it and tells the engine when it exits.
    fn track(&self, vm_id: &Id, mut child: Child) -> Result<Tracked, BoxFailure> {
        let pid = child.id() as i32;
        let tracked = Tracked::of(pid).unwrap_or(Tracked { pid, start: 0 });
        let pidfile = self.store.pidfile_path(vm_id);
        if let Err(source) = tracked.write(&pidfile) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(CloudHvError::Pidfile {
                vm_id: vm_id.clone(),
                path: pidfile,
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
                if let Ok(status) = child.wait() {
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
            let _ = tracked.signal(Signal::SIGKILL);
            let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
            return Err(CloudHvError::Reaper {
                vm_id: vm_id.clone(),
                source,
            }
            .into());
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn inode(fd: i32) -> u64 {
        // SAFETY: fstat on an open fd into a zeroed stat buffer we own.
        unsafe {
            let mut st: nix::libc::stat = std::mem::zeroed();
            assert_eq!(nix::libc::fstat(fd, &mut st), 0);
            st.st_ino
        }
    }

    /// The site tap may sit on fd 3 (fd 3 free when it was opened): it must
    /// still end up on 4, and the underlay tap on 3. Run in a forked child,
    /// since it rearranges the process's fds.
    #[test]
    fn each_tap_lands_on_its_fd_even_when_one_sits_on_anothers_target() {
        let (underlay, _w1) = nix::unistd::pipe().expect("pipe");
        let (site, _w2) = nix::unistd::pipe().expect("pipe");
        let (want_3, want_4) = (inode(underlay.as_raw_fd()), inode(site.as_raw_fd()));

        // SAFETY: the child calls only async-signal-safe functions (dup2,
        // fcntl, fstat, _exit) and allocates nothing.
        let pid = match unsafe { nix::unistd::fork() }.expect("fork") {
            nix::unistd::ForkResult::Child => {
                let code = unsafe {
                    // The underlay tap somewhere high, the site tap on fd 3,
                    // as if fd 3 had been free when it was opened.
                    let high = nix::libc::fcntl(underlay.as_raw_fd(), nix::libc::F_DUPFD, 20);
                    if high < 0 || nix::libc::dup2(site.as_raw_fd(), 3) < 0 {
                        nix::libc::_exit(2);
                    }
                    let placed = place_fds(&[high, 3], 3).is_ok();
                    let mut st: nix::libc::stat = std::mem::zeroed();
                    let on_3 = nix::libc::fstat(3, &mut st) == 0 && st.st_ino == want_3;
                    let on_4 = nix::libc::fstat(4, &mut st) == 0 && st.st_ino == want_4;
                    if placed && on_3 && on_4 { 0 } else { 1 }
                };
                unsafe { nix::libc::_exit(code) }
            }
            nix::unistd::ForkResult::Parent { child } => child,
        };

        let status = nix::sys::wait::waitpid(pid, None).expect("wait");
        assert_eq!(status, nix::sys::wait::WaitStatus::Exited(pid, 0));
    }
}
