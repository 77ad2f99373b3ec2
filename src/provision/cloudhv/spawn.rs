//! Starting a VMM, in order:
//! 1. Its directory, and its API socket, bound by the agent (a stale one of
//!    a VMM that died replaced) and passed in as a listening fd.
//! 2. Its NICs: taps opened on /dev/net/tun (not persistent: a tap lives
//!    exactly as long as a process holds it), and joined to the host's
//!    networks on a thread of their own while the steps below run (see
//!    [`CloudHypervisor::boot`](super::CloudHypervisor)).
//! 3. Its jail (see [`super::jail`]): its own user id, its files made
//!    its own, the KVM device open to its group, its limits.
//! 4. Its command line, from [`argv`] (pure).
//! 5. The fork, held before exec (see [`fork`](super::fork)): the pidfile
//!    (pid and start time) is written and synced, and only then is the
//!    child released to exec. A crash at any point leaves a tracked VMM or
//!    none.
//! 6. Its reaper (see [`supervise::Children`]), which tells the engine when
//!    it exits.
//! 7. The wait for its API to say Running (see [`supervise::await_running`]).

use std::fs::{self, OpenOptions};
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

use nix::sys::signal::Signal;

use super::argv::{GuestImage, Nic, VmFiles, VmShape, argv};
use super::error::CloudHvError;
use super::fork::{FIRST_OWN_FD, Held, Jail, fork_held, wait_raw};
use super::jail;
use super::process::Tracked;
use super::view::{self, Access, View, Visible};
use super::{CloudHypervisor, lack, tap};
use crate::deadline::Deadline;
use crate::error::BoxFailure;
use crate::model::{Id, Mac, VmSpec};
use crate::provision::Piece;
use crate::provision::supervise;
use crate::stages::timed;

impl CloudHypervisor {
    /// Starts the VM's VMM (see the module steps) on its opened `taps`
    /// and returns it, tracked.
    pub(super) fn spawn(
        &self,
        spec: &VmSpec,
        taps: Vec<(OwnedFd, Mac)>,
    ) -> Result<Tracked, BoxFailure> {
        let vm_id = &spec.vm_id;
        timed("vm dir", || supervise::vm_dir(&self.store, vm_id)).map_err(CloudHvError::from)?;
        let files = self.files(spec);
        let api = timed("api socket", || self.bind_api(vm_id))?;
        // The API socket first, then the taps, from FIRST_OWN_FD.
        let nics: Vec<Nic> = taps
            .iter()
            .enumerate()
            .map(|(i, (_, mac))| Nic {
                fd: FIRST_OWN_FD + 1 + i as i32,
                mac: *mac,
            })
            .collect();
        let jail = timed("jail", || self.jail(spec, &files))?;
        let landlock = timed("landlock", || self.confined.uses(Piece::Landlock))?;
        let shape = VmShape {
            api_fd: FIRST_OWN_FD,
            nics: &nics,
            vcpus: spec.vcpus,
            mem_mb: spec.mem_mb,
            landlock,
        };
        let args = argv(self.guest_image(), &files, &shape);
        let mut own = vec![&api];
        own.extend(taps.iter().map(|(fd, _)| fd));
        let cgroups = timed("cgroups", || self.confined.cgroups())?;
        let cgroup_err = |source| CloudHvError::Cgroup {
            vm_id: vm_id.clone(),
            source,
        };
        let entry_files = match cgroups {
            Some(cgroups) => timed("cgroup", || {
                cgroups.prepare(vm_id, jail::cgroup_limits(spec))?;
                cgroups.entry_files(vm_id)
            })
            .map_err(cgroup_err)?,
            None => Vec::new(),
        };
        // It moves itself into its cgroups before it execs: it never runs
        // outside them.
        let held = timed("fork", || {
            self.fork(vm_id, &args, &own, &entry_files, &files.log, jail.as_ref())
        })?;
        let tracked = timed("track", || self.track(vm_id, held))?;
        // The VMM holds its socket and taps now; the agent's copies must
        // not keep them alive after it exits.
        drop(api);
        drop(taps);
        Ok(tracked)
    }

    /// The VM's API socket, bound afresh (a stale one, of a VMM that died,
    /// replaced): the agent's, 0600, in its own run dir; the VMM gets the
    /// listening fd.
    fn bind_api(&self, vm_id: &Id) -> Result<OwnedFd, BoxFailure> {
        let path = self.socket_path(vm_id);
        let _ = fs::remove_file(&path);
        std::os::unix::net::UnixListener::bind(&path)
            .map(OwnedFd::from)
            .map_err(|source| {
                CloudHvError::ApiSocket {
                    vm_id: vm_id.clone(),
                    path,
                    source,
                }
                .into()
            })
    }

    /// The VM's jail, `None` where the host cannot jail and the operator
    /// allowed that: its id, its files made its own (they must exist
    /// before: the VMM can create nothing), the KVM device open to its
    /// group, limits sized for the VM.
    fn jail(&self, spec: &VmSpec, files: &VmFiles) -> Result<Option<Jail>, BoxFailure> {
        let vm_id = &spec.vm_id;
        let Some(ids) = self.confined.jail()? else {
            return Ok(None);
        };
        self.open_kvm_to(ids.kvm_group)?;
        let id = ids.of(vm_id).map_err(|e| CloudHvError::VmmId {
            vm_id: vm_id.clone(),
            why: lack::describe(&e),
        })?;
        let mut own = vec![
            files.root_disk.clone(),
            files.seed.clone(),
            files.serial_log.clone(),
            files.log.clone(),
        ];
        own.extend(files.volumes.iter().cloned());
        jail::give(&own, id).map_err(|source| CloudHvError::GiveFiles {
            vm_id: vm_id.clone(),
            source,
        })?;
        let largest_disk = [&files.root_disk]
            .into_iter()
            .chain(&files.volumes)
            .filter_map(|disk| fs::metadata(disk).ok())
            .map(|m| m.len())
            .max()
            .unwrap_or(0)
            .max(spec.disk_gb.saturating_mul(1 << 30));
        let mut jail = jail::jail_for(spec, id, ids.kvm_group, largest_disk);
        jail.view = Some(self.view(files).map_err(|source| CloudHvError::View {
            vm_id: vm_id.clone(),
            source,
        })?);
        Ok(Some(jail))
    }

    /// The files the VM's VMM sees (see [`super::view`]): its binary
    /// and what that needs to run, its kernel or firmware, its seed (read
    /// only: it reads it, and must not grow it), its disks, volumes,
    /// serial and log files, and the devices it opens.
    fn view(&self, files: &VmFiles) -> std::io::Result<View> {
        let hypervisor = &self.cfg.hypervisor;
        let mut visible = self.runtime()?;
        visible.push(Visible::new(hypervisor, Access::Execute));
        for boot in [&self.cfg.kernel, &self.cfg.firmware].into_iter().flatten() {
            visible.push(Visible::new(boot, Access::Read));
        }
        visible.push(Visible::new(&files.seed, Access::Read));
        for rw in [&files.root_disk, &files.serial_log, &files.log]
            .into_iter()
            .chain(&files.volumes)
        {
            visible.push(Visible::new(rw, Access::Write));
        }
        visible.push(Visible::new(&self.cfg.confinement.kvm, Access::Write));
        visible.push(Visible::new("/dev/null", Access::Write));
        visible.push(Visible::new("/dev/urandom", Access::Read));
        let mountpoint = self.cfg.run_dir.join("vmm-root");
        crate::state::perms::make_dir(&mountpoint)?;
        View::plan(&mountpoint, &visible)
    }

    /// What the hypervisor binary needs to run, read once per binary.
    fn runtime(&self) -> std::io::Result<Vec<Visible>> {
        let hypervisor = &self.cfg.hypervisor;
        let now = super::preflight::Binary::of(hypervisor);
        let mut cached = self.runtime.lock();
        if let (Some(now), Some((read, needs))) = (now, cached.as_ref())
            && now == *read
        {
            return Ok(needs.clone());
        }
        let needs = view::runtime_of(hypervisor)?;
        if let Some(now) = now {
            *cached = Some((now, needs.clone()));
        }
        Ok(needs)
    }

    /// Where the VM's files are, as its command line names them.
    fn files(&self, spec: &VmSpec) -> VmFiles {
        let vm_id = &spec.vm_id;
        VmFiles {
            root_disk: self.store.layout().root_disk(vm_id),
            seed: self.store.layout().seed(vm_id),
            volumes: self.store.layout().volumes_of(spec),
            serial_log: self.store.layout().serial_log(vm_id),
            log: self.store.layout().hypervisor_log(vm_id),
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

    /// Opens the VM's taps (joined to the host's networks by
    /// [`CloudHypervisor::plug_nics`]): the underlay NIC; a second NIC on
    /// the named host network the spec asks for, its address learned from
    /// the site's own DHCP. With networking off a VM gets no NIC at all: a
    /// tap joined to nothing would only be a link for the guest to write
    /// into.
    pub(super) fn open_nics(&self, spec: &VmSpec) -> Result<Vec<(OwnedFd, Mac)>, BoxFailure> {
        let vm_id = &spec.vm_id;
        let not_served = || CloudHvError::NetworkNotServed {
            vm_id: vm_id.clone(),
            network: spec.network.clone(),
        };
        let Some(network) = &self.cfg.network else {
            if !spec.network.is_empty() {
                return Err(not_served().into());
            }
            return Ok(Vec::new());
        };
        if !spec.network.is_empty() && !network.serves(&spec.network) {
            return Err(not_served().into());
        }
        let open = |name: &str| {
            tap::open(name).map_err(|source| CloudHvError::OpenTap {
                vm_id: vm_id.clone(),
                tap: name.to_owned(),
                source,
            })
        };
        let names = network.reserve(vm_id)?;
        let mut taps = vec![(open(&names.underlay)?, Mac::underlay(vm_id))];
        if !spec.network.is_empty() {
            taps.push((open(&names.site)?, Mac::second_nic(vm_id)));
        }
        Ok(taps)
    }

    /// Joins the VM's open taps to the host's networks: the underlay one
    /// guarded, on the bridge, with its DHCP responder; the second one
    /// guarded on the named network's bridge, its lease learned.
    pub(super) fn plug_nics(&self, spec: &VmSpec) -> Result<(), BoxFailure> {
        let vm_id = &spec.vm_id;
        let Some(network) = &self.cfg.network else {
            return Ok(());
        };
        let ip = network.plug(vm_id, Mac::underlay(vm_id))?;
        let Some(names) = network.taps(vm_id) else {
            return Ok(());
        };
        log::info!("VM {vm_id}: {ip} on its tap {}", names.underlay);
        if !spec.network.is_empty() {
            network.plug_named(vm_id, &spec.network, &names.site, Mac::second_nic(vm_id))?;
        }
        Ok(())
    }

    /// Forks the VMM, held before exec (see the module steps): in its own
    /// session, stdin from /dev/null, output appended to its log, `own`
    /// (API socket, taps) as fds 3, 4, …, in `jail` when given.
    fn fork(
        &self,
        vm_id: &Id,
        args: &[std::ffi::OsString],
        own: &[&OwnedFd],
        cgroups: &[OwnedFd],
        log_path: &std::path::Path,
        jail: Option<&Jail>,
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
        fork_held(
            &self.cfg.hypervisor,
            args,
            &OwnedFd::from(log),
            own,
            cgroups,
            jail,
        )
        .map_err(|source| {
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
        let pidfile = self.store.layout().pidfile(vm_id);
        // A child never released, or whose exec failed: reaped here.
        let end = |held: Option<Held>| {
            drop(held);
            let _ = tracked.signal(Signal::SIGKILL);
            wait_raw(pid);
        };
        if let Err(source) = timed("pidfile", || tracked.write(&pidfile)) {
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
        let reaped = self.children.reap(vm_id, pid.unsigned_abs(), move || {
            wait_raw(pid).map(ExitStatus::from_raw)
        });
        reaped.map_err(CloudHvError::from)?;
        crate::crash::point("boot.hypervisor-started");
        log::info!("VM {vm_id}: hypervisor started (pid {pid})");
        Ok(tracked)
    }

    /// Waits until the new VMM's API says Running (see
    /// [`supervise::await_running`]).
    pub(super) fn await_running(
        &self,
        vm_id: &Id,
        tracked: Tracked,
        deadline: Deadline,
    ) -> Result<(), BoxFailure> {
        supervise::await_running(
            vm_id,
            &self.vmm(vm_id, tracked),
            self.cfg.boot_wait,
            deadline,
        )
    }
}
