//! Starting a VMM, in order:
//! 1. Its directory, and its API socket, bound by the agent (a stale one of
//!    a VMM that died replaced) and passed in as a listening fd.
//! 2. Its NICs: taps opened on /dev/net/tun (not persistent: a tap lives
//!    exactly as long as a process holds it), and joined to the host's
//!    networks on a thread of their own while the steps below run (see
//!    [`CloudHypervisor::boot`](super::CloudHypervisor)).
//! 3. Its jail, from a [`Plan`] (see [`jail`](crate::provision::jail)): its own user id, its files made
//!    its own, the KVM device open to its group, its limits.
//! 4. Its command line, from [`argv`] (pure).
//! 5. The start, held before exec (see [`fork`]): the pidfile
//!    (pid and start time) is written while the child enters its jail,
//!    and only then is it released to exec. A crash at any point leaves a
//!    tracked VMM or none.
//! 6. Its reaper (see [`supervise::Children`]), which tells the engine when
//!    it exits.
//! 7. The wait for its API to say Running, or Paused for a restore (see
//!    [`supervise::await_state`]).

use std::fs::{self, OpenOptions};
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

use super::argv::{GuestImage, Launch, MemoryRestore, Nic, VmFiles, VmShape, argv, restore_argv};
use super::argv::{what_a_restore_sees, what_a_vmm_sees};
use super::error::CloudHvError;
use super::process::Tracked;
use super::{CloudHypervisor, tap};
use crate::deadline::Deadline;
use crate::error::{BoxFailure, Outcome};
use crate::model::{Id, Mac, VmSpec};
use crate::provision::hugepages;
use crate::provision::jail::Plan;
use crate::provision::jail::fork::{self, FIRST_OWN_FD, Jail, StartError, wait_raw};
use crate::provision::jail::view::{self, Visible};
use crate::provision::supervise::{self, Awaited};
use crate::stages::timed;
use crate::state::atomic::Pending;

impl CloudHypervisor {
    /// Starts the VM's VMM (see the module steps) on its opened `taps`,
    /// to do what `launch` says, and returns it, tracked.
    pub(super) fn spawn(
        &self,
        spec: &VmSpec,
        taps: Vec<(OwnedFd, Mac)>,
        launch: Launch<'_>,
    ) -> Outcome<Tracked> {
        let vm_id = &spec.vm_id;
        self.check_hugepages(spec)?;
        timed("vm dir", || supervise::vm_dir(&self.store, vm_id)).map_err(CloudHvError::from)?;
        let boot = matches!(launch, Launch::Boot);
        timed("logs", || self.keep_logs(vm_id, boot)).map_err(|source| CloudHvError::KeepLogs {
            vm_id: vm_id.clone(),
            source,
        })?;
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
        let limits = spec.limits.in_force(spec.vcpus, &self.cfg.limits.defaults);
        let lend = |id| {
            // The agent's, closed to the VMM but for its snapshots (see
            // `window`).
            super::suspend::fresh_work_dir(&files.snapshot_work)?;
            fresh_vsock_dir(&files.guest_socket, id)?;
            match (launch, id) {
                (Launch::Restore { snapshot, .. }, Some(id)) => super::suspend::lend(snapshot, id),
                _ => Ok(()),
            }
        };
        let sees = self
            .sees(&files, launch)
            .map_err(|source| CloudHvError::Needs {
                vm_id: vm_id.clone(),
                source,
            })?;
        let plan = Plan {
            spec,
            limits: &limits,
            owns: [&files.root_disk, &files.seed, &files.serial_log, &files.log]
                .into_iter()
                .chain(&files.volumes)
                .cloned()
                .collect(),
            disks: std::iter::once(&files.root_disk)
                .chain(&files.volumes)
                .cloned()
                .collect(),
            sees,
            mountpoint: self.cfg.hypervisor.run_dir.join("vmm-root"),
            lend: &lend,
        };
        let prepared =
            timed("jail", || self.confined.prepare(&plan)).map_err(CloudHvError::from)?;
        let landlock = timed("landlock", || self.confined.landlock())?;
        let shape = VmShape {
            api_fd: FIRST_OWN_FD,
            nics: &nics,
            vcpus: spec.vcpus,
            mem_mb: spec.mem_mb,
            hugepages: self.cfg.hypervisor.hugepages,
            landlock,
            limits,
        };
        let args = match launch {
            Launch::Boot => argv(self.guest_image(), &files, &shape),
            Launch::Restore { snapshot, memory } => {
                restore_argv(snapshot, memory, &files.log, &shape)
            }
        };
        let mut own = vec![&api];
        own.extend(taps.iter().map(|(fd, _)| fd));
        // It moves itself into its cgroups before it execs: it never runs
        // outside them.
        let tracked = timed("start", || {
            self.start(
                vm_id,
                &args,
                &own,
                &prepared.cgroups,
                &files.log,
                prepared.jail.as_ref(),
            )
        })?;
        // The VMM holds its socket and taps now; the agent's copies must
        // not keep them alive after it exits.
        drop(api);
        drop(taps);
        Ok(tracked)
    }

    /// The VM's API socket, bound afresh (a stale one, of a VMM that died,
    /// replaced): the agent's, 0600, in its own run dir; the VMM gets the
    /// listening fd.
    fn bind_api(&self, vm_id: &Id) -> Outcome<OwnedFd> {
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

    /// Takes the VM's address and its VMM's user id, each table's bytes
    /// saved before it is handed out, their names durable once the
    /// returned [`Pending`] is synced (see
    /// [`Lifecycle::reserve`](crate::provision::Lifecycle::reserve)). Both
    /// at once, for the reason the engine asks for them beside the
    /// attempt's save: durable writes made together share a journal commit.
    pub(super) fn reserve_host(&self, spec: &VmSpec) -> Outcome<Pending> {
        let vm_id = &spec.vm_id;
        let address = || match &self.cfg.network {
            Some(network) => timed("address lease", || network.take_address(vm_id)),
            None => Ok(Pending::none()),
        };
        let id =
            || timed("vmm id", || self.confined.reserve_vmm_id(vm_id)).map_err(BoxFailure::from);
        let (address, id) = crate::threads::alongside(&format!("lease-{vm_id}"), address, id);
        let address = address.map_err(|why| CloudHvError::Panicked {
            vm_id: vm_id.clone(),
            doing: "taking its address",
            why,
        })??;
        Ok(address.and(id?))
    }

    /// With guests on huge pages: the VM's memory is whole pages, and the
    /// pool has them. Asked before each start, since the pool is the
    /// operator's to change; two starts at once may both pass, and the
    /// later VMM then fails its boot (its memory is mapped, so reserved,
    /// before its guest runs), never a running guest.
    pub(super) fn check_hugepages(&self, spec: &VmSpec) -> Result<(), CloudHvError> {
        if !self.cfg.hypervisor.hugepages {
            return Ok(());
        }
        let vm_id = &spec.vm_id;
        let need = hugepages::pages_for(spec.mem_mb).ok_or_else(|| CloudHvError::HugePageSize {
            vm_id: vm_id.clone(),
            mem_mb: spec.mem_mb,
        })?;
        let pool =
            hugepages::Pool::of_host().map_err(|source| CloudHvError::HugePagePool { source })?;
        if pool.available < need {
            return Err(CloudHvError::HugePages {
                vm_id: vm_id.clone(),
                need,
                available: pool.available,
            });
        }
        Ok(())
    }

    /// The files the VM's VMM sees (see [`view`]): its binary
    /// and what that needs to run, its kernel or firmware, its seed (read
    /// only: it reads it, and must not grow it), its disks, volumes,
    /// serial and log files, and the devices it opens.
    fn sees(&self, files: &VmFiles, launch: Launch<'_>) -> std::io::Result<Vec<Visible>> {
        let boot: Vec<&std::path::Path> =
            [&self.cfg.hypervisor.kernel, &self.cfg.hypervisor.firmware]
                .into_iter()
                .flatten()
                .map(|p| p.as_path())
                .collect();
        let mut visible = what_a_vmm_sees(
            self.runtime()?,
            &self.cfg.hypervisor.binary,
            &boot,
            files,
            &self.cfg.confinement.kvm,
        );
        if let Launch::Restore { snapshot, memory } = launch {
            let userfaultfd = match memory {
                MemoryRestore::OnDemand => self.cfg.confinement.userfaultfd.as_deref(),
                MemoryRestore::Copy => None,
            };
            visible.extend(what_a_restore_sees(snapshot, userfaultfd));
        }
        Ok(visible)
    }

    /// Moves what the VM's previous VMM wrote aside, as the next one would
    /// truncate it: a guest that died said why on its console, and its VMM
    /// in its log. The console becomes the next of its segments (the
    /// oldest go once they hold more than the console's bound; `logs`
    /// reads them in order), the log becomes the previous log.
    fn keep_logs(&self, vm_id: &Id, boot: bool) -> std::io::Result<()> {
        let layout = self.store.layout();
        let moved = |from: &std::path::Path, to: &std::path::Path| match fs::rename(from, to) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        };
        moved(
            &layout.hypervisor_log(vm_id),
            &layout.previous_hypervisor_log(vm_id),
        )?;
        let next = layout
            .serial_segments(vm_id)
            .last()
            .map_or(1, |(n, _)| n.saturating_add(1));
        let console_moved = moved(
            &layout.serial_log(vm_id),
            &layout.serial_segment(vm_id, next),
        )?;
        if boot {
            // This boot's console is the segment it will be moved to.
            let began = if console_moved { next + 1 } else { next };
            fs::write(layout.serial_boot(vm_id), format!("{began}\n"))?;
        }
        if !console_moved {
            return Ok(());
        }
        let bound = self.cfg.limits.serial_log_bytes;
        let mut kept = layout.serial_segments(vm_id);
        let held = |list: &[(u32, std::path::PathBuf)]| -> u64 {
            list.iter()
                .filter_map(|(_, p)| fs::metadata(p).ok())
                .map(|m| std::os::unix::fs::MetadataExt::blocks(&m).saturating_mul(512))
                .sum()
        };
        while kept.len() > 1 && held(&kept) > bound {
            let (_, oldest) = kept.remove(0);
            fs::remove_file(oldest)?;
        }
        Ok(())
    }

    /// What the hypervisor binary needs to run, read once per binary.
    fn runtime(&self) -> std::io::Result<Vec<Visible>> {
        let hypervisor = &self.cfg.hypervisor.binary;
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
            snapshot_work: self.store.layout().snapshot_work(vm_id),
            guest_socket: self.guest_socket(vm_id),
        }
    }

    pub(super) fn guest_image(&self) -> Option<GuestImage<'_>> {
        match (&self.cfg.hypervisor.kernel, &self.cfg.hypervisor.firmware) {
            (Some(kernel), _) => Some(GuestImage::Kernel {
                kernel,
                cmdline: &self.cfg.hypervisor.cmdline,
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
    pub(super) fn open_nics(&self, spec: &VmSpec) -> Outcome<Vec<(OwnedFd, Mac)>> {
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

    /// The MACs of the NICs [`CloudHypervisor::open_nics`] gives the VM,
    /// in order.
    pub(super) fn macs(&self, spec: &VmSpec) -> Vec<Mac> {
        if self.cfg.network.is_none() {
            return Vec::new();
        }
        let mut macs = vec![Mac::underlay(&spec.vm_id)];
        if !spec.network.is_empty() {
            macs.push(Mac::second_nic(&spec.vm_id));
        }
        macs
    }

    /// Joins the VM's open taps to the host's networks: the underlay one
    /// guarded, on the bridge, with its DHCP responder; the second one
    /// guarded on the named network's bridge, its lease learned.
    pub(super) fn plug_nics(&self, spec: &VmSpec) -> Outcome {
        let vm_id = &spec.vm_id;
        let Some(network) = &self.cfg.network else {
            return Ok(());
        };
        let ip = network.plug(vm_id, Mac::underlay(vm_id))?;
        let Some(names) = network.taps(vm_id) else {
            return Ok(());
        };
        log::info!("VM {vm_id}: plugged: {ip} on its tap {}", names.underlay);
        if !spec.network.is_empty() {
            network.plug_named(vm_id, &spec.network, &names.site, Mac::second_nic(vm_id))?;
        }
        Ok(())
    }

    /// Starts the VMM, held before exec until it is recorded (see
    /// [`fork`]): in its own session, stdin from /dev/null,
    /// output appended to its log, `own` (API socket, taps) as fds 3, 4,
    /// …, moved into `cgroups`, in `jail` when given (in a network
    /// namespace made ahead when one is ready). Recorded means its pidfile
    /// (pid and start time) names it; then the thread that reaps it, and
    /// tells the engine when it exits, is started.
    fn start(
        &self,
        vm_id: &Id,
        args: &[std::ffi::OsString],
        own: &[&OwnedFd],
        cgroups: &[OwnedFd],
        log_path: &std::path::Path,
        jail: Option<&Jail>,
    ) -> Outcome<Tracked> {
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
        let log = OwnedFd::from(log);
        let netns = jail.and(self.netns.as_ref()).and_then(|n| n.take());
        let pidfile = self.store.layout().pidfile(vm_id);
        let started = fork::start(
            &fork::Start {
                program: &self.cfg.hypervisor.binary,
                args,
                log: &log,
                own,
                cgroups,
                netns: netns.as_ref(),
                jail,
            },
            |pid| {
                let tracked = Tracked::of(pid).unwrap_or(Tracked { pid, start: 0 });
                timed("pidfile", || tracked.write(&pidfile))?;
                crate::crash::point("boot.pidfile-written");
                Ok(())
            },
        );
        let failed = |source| CloudHvError::Start {
            vm_id: vm_id.clone(),
            program: self.cfg.hypervisor.binary.clone(),
            source,
        };
        let pid = match started {
            Ok(pid) => pid,
            Err(StartError::Record(source)) => {
                return Err(CloudHvError::Pidfile {
                    vm_id: vm_id.clone(),
                    path: pidfile,
                    source,
                }
                .into());
            }
            Err(StartError::Spawn(source) | StartError::Exec(source)) => {
                return Err(failed(source).into());
            }
        };
        let tracked = Tracked::of(pid).unwrap_or(Tracked { pid, start: 0 });
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
    ) -> Outcome {
        self.await_state(vm_id, tracked, Awaited::Running, deadline)
    }

    /// Waits until the new VMM's API says `awaited` (see
    /// [`supervise::await_state`]).
    pub(super) fn await_state(
        &self,
        vm_id: &Id,
        tracked: Tracked,
        awaited: Awaited,
        deadline: Deadline,
    ) -> Outcome {
        supervise::await_state(
            vm_id,
            &self.vmm(vm_id, tracked),
            awaited,
            self.cfg.boot_wait,
            deadline,
        )
    }
}

/// Takes the vsock socket's directory back from the VMM once it has bound
/// its socket there (cloud-hypervisor binds it while it makes the VM's
/// devices, before the guest runs): the agent's again, 0700, and anything
/// but the socket in it removed. It cannot be storage of the VMM's (it is
/// on the run dir's tmpfs, every agent's), and a guest that connects out
/// to a host port makes the VMM connect beside the socket, where it may
/// not even look.
pub(super) fn close_vsock_dir(socket: &std::path::Path) -> std::io::Result<()> {
    let Some(dir) = socket.parent() else {
        return Ok(());
    };
    let handle = super::window::open_dir(dir)?;
    super::window::close(&handle)?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if Some(entry.file_name().as_os_str()) == socket.file_name() {
            continue;
        }
        // Whatever it is; remove_dir_all follows no link.
        let path = entry.path();
        match entry.file_type()?.is_dir() {
            true => std::fs::remove_dir_all(&path)?,
            false => std::fs::remove_file(&path)?,
        }
    }
    Ok(())
}

/// The vsock socket's directory, made afresh for a new VMM (which binds
/// the socket there, and fails to where one is left) and given to it
/// (`id`, when it is jailed). What its last VMM left in it, whatever that
/// was, goes: `remove_dir_all` follows no link.
fn fresh_vsock_dir(socket: &std::path::Path, id: Option<u32>) -> std::io::Result<()> {
    let Some(dir) = socket.parent() else {
        return Ok(());
    };
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    crate::state::perms::make_dir_in(dir)?;
    if let Some(id) = id {
        std::os::unix::fs::chown(dir, Some(id), Some(id))?;
    }
    Ok(())
}
