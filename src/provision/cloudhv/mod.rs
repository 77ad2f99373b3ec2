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
//! Stop: the shared ladder ([`supervise::ladder`]): power button,
//! `vmm.shutdown`, SIGTERM, SIGKILL, each bounded. A process already gone
//! is stopped. A pass whose deadline has passed goes straight to SIGKILL.
//!
//! After an agent restart, VMMs are found again through their pidfiles and
//! /proc; none is restarted. Only a changed boot id (the engine's business)
//! makes them lost.
//!
//! Every VMM exit is told to the engine the moment it happens (a child's by
//! its reaper, an adopted VMM's by the `vmm-exits` watch), so a guest that
//! crashed is booted again at once, not at the next tick.

mod api;
pub mod argv;
mod error;
mod identity;
mod meters;
mod preflight;
mod process;
mod serial;
mod spawn;
mod stop;
mod suspend;
pub mod tap;
mod vet;
mod vmm;
mod wake;
mod watch;
mod window;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

pub use self::error::CloudHvError;
pub(crate) use self::preflight::{FLOOR_NEED, major_version, version_of};
use self::watch::ExitWatch;
use super::jail::{self, netns, view};
use super::supervise::{self, Children};
use super::{
    ExitListener, Holds, HostChecks, HypervisorSettings, Lifecycle, SavedGuest, Say, Spend, Suspend,
};
use crate::deadline::Deadline;
use crate::error::Outcome;
use crate::model::{Id, Mac, Saved, VmSpec};
use crate::stages;
use crate::state::Store;
use crate::state::atomic::Pending;

/// The oldest cloud-hypervisor this backend drives: the oldest release
/// that passes every check of `make compat` (v53.0; v54 passes too).
/// v52.0 resumes a guest that was busy when it was suspended into one that
/// never answers again (`suspend_and_resume_twice_keep_the_guests_boot_and_uptime`,
/// 3 runs of 3 on the test host, with the same kvm_pvm edits v53 passes
/// with); v51.2 fails every boot: it looks each tap it is handed up by its
/// name inside its own network namespace, where the agent's taps are not
/// ("Using existing tap … ioctl (35105) failed: No such device").
pub const MIN_VERSION: u32 = 53;

/// How long `status`'s account of what the host lacks is reused.
const HOST_RECHECK: Duration = Duration::from_secs(5);
#[derive(Clone)]
pub struct CloudHvConfig {
    /// The binary, what it boots, where its sockets go, how it is stopped.
    pub hypervisor: Arc<HypervisorSettings>,
    /// Prefix of this agent's tap names; links with it that no live VMM
    /// holds are removed at start.
    pub tap_prefix: String,
    /// Bound on waiting for a new VMM's API to say Running.
    pub boot_wait: Duration,
    /// The host network taps join; `None` leaves taps unconnected.
    pub network: Option<Arc<crate::net::host::HostNetwork>>,
    pub confinement: Arc<crate::provision::Confinement>,
    /// What a VM whose spec sets none may use; its serial log's bound.
    pub limits: Arc<crate::provision::GuestLimits>,
}

pub struct CloudHypervisor {
    store: Arc<Store>,
    cfg: CloudHvConfig,
    /// The VMMs this agent forked, their reapers and exits; who is told
    /// of each exit (the engine).
    children: Children,
    /// Exits of adopted VMMs; `None` if its thread could not start (then
    /// those exits are seen at the tick).
    watch: Option<ExitWatch>,
    /// What of each VMM's confinement this host can do (see [`jail`]).
    confined: jail::Confined,
    /// The hypervisor binary whose version last passed (see `preflight`).
    version_passed: Mutex<Option<preflight::Binary>>,
    /// What the hypervisor binary needs to run (see `view::runtime_of`),
    /// for the binary it was read from: read again only when it changes.
    runtime: Mutex<Option<(preflight::Binary, Vec<view::Visible>)>>,
    /// The last host check for `status`, and when it ran.
    host_checked: Mutex<Option<(std::time::Instant, Option<String>)>>,
    /// Network namespaces made ahead for jailed VMMs (see [`netns`]);
    /// `None` when VMMs are not jailed or its thread could not start.
    netns: Option<netns::SpareNetns>,
    /// Bounds every guest's serial output (see [`serial`]); `None` if its
    /// thread could not start (said at start).
    _serial: Option<crate::threads::OwnedThread>,
    /// Adopted VMs whose network could not be served: tried again at
    /// each of their passes ([`Holds::network_served`]).
    unserved: Mutex<std::collections::HashSet<Id>>,
    /// The taps of sleeping VMs that wake on traffic (see [`wake`]).
    listening: wake::Held,
    /// Each watched tap's count of its guest's own frames (see [`wake`]).
    counted: wake::Counted,
}

impl CloudHypervisor {
    /// Builds the backend: its socket dir, and the watch on adopted VMMs
    /// (which watches nothing until [`Lifecycle::recover`] adopts them).
    pub fn new(store: Arc<Store>, mut cfg: CloudHvConfig) -> CloudHypervisor {
        // Found once, by absolute path: what runs as the VMM never depends
        // on PATH after start (and a bare name could not be exec'd at all).
        if let Some(path) = crate::programs::resolved(&cfg.hypervisor.binary.to_string_lossy())
            && path != cfg.hypervisor.binary
        {
            Arc::make_mut(&mut cfg.hypervisor).binary = path;
        }
        if let Err(e) = fs::create_dir_all(&cfg.hypervisor.run_dir).and_then(|()| {
            fs::set_permissions(&cfg.hypervisor.run_dir, fs::Permissions::from_mode(0o700))
        }) {
            log::warn!(
                "cannot prepare the socket dir {}: {e}",
                cfg.hypervisor.run_dir.display()
            );
        }
        let children = Children::new("hypervisor");
        let watch = ExitWatch::start(children.listener().clone())
            .inspect_err(|e| {
                log::warn!(
                    "cannot watch adopted hypervisors ({e}); their exits are seen at the tick"
                );
            })
            .ok();
        let confined = jail::Confined::probe(&cfg.confinement, store.root());
        let serial = serial::start(Arc::clone(&store), cfg.limits.serial_log_bytes)
            .inspect_err(|e| {
                log::error!("cannot start the thread that bounds serial logs ({e}); a chatty guest can fill the disk")
            })
            .ok();
        for note in confined.notes() {
            log::error!("{note}");
        }
        let netns = matches!(confined.jail(), Ok(Some(_)))
            .then(netns::SpareNetns::start)
            .flatten();
        CloudHypervisor {
            store,
            cfg,
            children,
            version_passed: Mutex::new(None),
            runtime: Mutex::new(None),
            host_checked: Mutex::new(None),
            watch,
            confined,
            netns,
            _serial: serial,
            unserved: Mutex::new(std::collections::HashSet::new()),
            listening: Mutex::default(),
            counted: Mutex::default(),
        }
    }

    /// Removes leaked taps with this agent's prefix: links no live VMM
    /// holds (a persistent one left by a crash, or by `ip tuntap add`). A
    /// tap a live VMM holds cannot be attached (EBUSY) and is left alone.
    /// Before adoption and before any boot: a stale tap on the underlay can
    /// swallow a new guest's DHCP replies, and one with a VM's name makes
    /// its next tap open fail.
    fn remove_leaked_taps(&self) {
        for link in tap::with_prefix(&self.cfg.tap_prefix) {
            if tap::remove(&link).is_ok() {
                log::info!("removed leaked tap {link}");
            }
        }
    }
}

impl CloudHypervisor {
    /// Starts the VM's VMM to do what `launch` says, on taps of its own
    /// (opened here, joined to the host's networks alongside, see
    /// [`Lifecycle::boot`]), and waits for its API to say Running (Paused
    /// for a restore: its guest runs only at `vm.resume`). `started` is
    /// called once the VMM runs, before the wait.
    fn start_vmm(
        &self,
        spec: &VmSpec,
        launch: argv::Launch<'_>,
        deadline: Deadline,
        started: impl FnOnce(),
    ) -> Outcome {
        let vm_id = &spec.vm_id;
        let (taps, joined) = stages::timed("tap open", || self.taps_for_start(spec))?;
        let (plugged, booted) = crate::threads::alongside(
            &format!("plug-{vm_id}"),
            || {
                if joined {
                    stages::timed("awake", || self.awake(vm_id))
                } else {
                    stages::timed("plug", || self.plug_nics(spec))
                }
            },
            || {
                self.spawn(spec, taps, launch).and_then(|tracked| {
                    started();
                    let awaited = match launch {
                        argv::Launch::Boot => supervise::Awaited::Running,
                        argv::Launch::Restore { .. } => supervise::Awaited::Paused,
                    };
                    self.await_state(vm_id, tracked, awaited, deadline)?;
                    let socket = self.guest_socket(vm_id);
                    if let Err(source) = spawn::close_vsock_dir(&socket) {
                        supervise::ladder::kill(&self.vmm(vm_id, tracked));
                        return Err(CloudHvError::CloseVsock {
                            vm_id: vm_id.clone(),
                            dir: socket.parent().map(Path::to_path_buf).unwrap_or_default(),
                            source,
                        }
                        .into());
                    }
                    Ok(tracked)
                })
            },
        );
        let plugged = plugged.unwrap_or_else(|why| {
            log::error!("VM {vm_id}: plugging its taps panicked: {why}");
            Err(CloudHvError::Panicked {
                vm_id: vm_id.clone(),
                doing: "joining its taps to the host's networks (the hypervisor was stopped)",
                why,
            }
            .into())
        });
        match (booted, plugged) {
            (Ok(_), Ok(())) => Ok(()),
            (Ok(tracked), Err(e)) => {
                supervise::ladder::kill(&self.vmm(vm_id, tracked));
                Err(e)
            }
            (Err(e), _) => Err(e),
        }
    }

    /// What a snapshot of the VM is taken with and held to: its disks (its
    /// root disk and volumes, as its record's spec names them), its
    /// guest's memory in bytes (0 when its record cannot be read), and the
    /// whole of what its VMM was started with. The record's spec is the
    /// running boot's: a change to its size or limits waits for the next.
    fn snapshot_of(&self, vm_id: &Id) -> suspend::Taken {
        let layout = self.store.layout();
        let mut disks = vec![layout.root_disk(vm_id)];
        let rec = self.store.get(vm_id).ok().flatten();
        let spec = rec.as_ref().map(|rec| &rec.spec);
        if let Some(spec) = spec {
            disks.extend(layout.volumes_of(spec));
        }
        let (vcpus, mem_mb) = spec.map_or((0, 0), |s| (s.vcpus, s.mem_mb));
        let memory_bytes = mem_mb.saturating_mul(1 << 20);
        let mut in_argv = disks.clone();
        in_argv.insert(1, layout.seed(vm_id));
        let boot = &self.cfg.hypervisor;
        let expected = vet::Expected {
            disks: in_argv,
            serial: layout.serial_log(vm_id),
            vcpus,
            memory_bytes,
            hugepages: boot.hugepages,
            payload: self.guest_image().map(|image| match image {
                argv::GuestImage::Kernel { kernel, cmdline } => vet::Payload::Kernel {
                    kernel: kernel.to_path_buf(),
                    cmdline: cmdline.to_owned(),
                },
                argv::GuestImage::Firmware(firmware) => {
                    vet::Payload::Firmware(firmware.to_path_buf())
                }
            }),
            macs: spec.map(|s| self.macs(s)).unwrap_or_default(),
            buckets: spec.map_or_else(argv::Buckets::default, |s| {
                argv::Buckets::of(s.limits.in_force(s.vcpus, &self.cfg.limits.defaults))
            }),
            landlock_rule: self
                .confined
                .landlock()
                .unwrap_or(false)
                .then(|| layout.snapshot_work(vm_id)),
            guest_socket: self.guest_socket(vm_id),
        };
        suspend::Taken {
            disks,
            memory_bytes,
            expected,
        }
    }
}

impl Lifecycle for CloudHypervisor {
    fn preflight(&self, _deadline: Deadline) -> Outcome {
        self.check_host()
    }

    fn prepare_root_disk(
        &self,
        spec: &VmSpec,
        base: &Path,
        deadline: Deadline,
    ) -> Outcome<Pending> {
        let in_use = self.find(&spec.vm_id).is_some();
        supervise::prepare_root_disk(&self.store, spec, base, in_use, deadline)
    }

    fn reserve(&self, spec: &VmSpec) -> Outcome<Pending> {
        self.reserve_host(spec)
    }

    /// Opens the VM's taps, then joins them to the host's networks on a
    /// thread of its own while the VMM is forked, released and awaited:
    /// neither waits for the other (a create's plug is nft, `ip` and a
    /// packet socket: 5 ms, as long as the rest of the boot; the `plug` and
    /// `wait running` stages of `make bench-create`). A guest's
    /// first frames meet the guard's fail-closed rule, never an open port,
    /// and Running is said only once both are done; a plug that fails
    /// kills the VMM it was for.
    fn boot(&self, spec: &VmSpec, deadline: Deadline) -> Outcome {
        if stages::timed("find", || self.find(&spec.vm_id)).is_some() {
            return Ok(());
        }
        self.start_vmm(spec, argv::Launch::Boot, deadline, || {})
    }

    fn shutdown(&self, vm_id: &Id, deadline: Deadline, say: Say<'_>) -> Outcome {
        self.stop(vm_id, deadline, say)
    }

    fn destroy(&self, vm_id: &Id, deadline: Deadline) -> Outcome {
        self.stop(vm_id, deadline, &|what| log::info!("VM {vm_id}: {what}"))?;
        super::Wake::stop_listening(self, vm_id);
        let taps = self.taps(vm_id).map(|t| [t.underlay, t.site]);
        for tap in taps.into_iter().flatten() {
            // A VMM that just exited can leave its link for a moment: a
            // leftover is removed once that moment has passed.
            if !wake::settled(&tap)
                && let Err(source) = tap::remove(&tap)
            {
                return Err(CloudHvError::RemoveTap {
                    vm_id: vm_id.clone(),
                    tap,
                    source,
                }
                .into());
            }
        }
        let layout = self.store.layout();
        let files = [
            layout.api_socket(&self.cfg.hypervisor.run_dir, vm_id),
            layout.api_socket_lock(&self.cfg.hypervisor.run_dir, vm_id),
            layout.pidfile(vm_id),
        ];
        supervise::remove_files(vm_id, &files).map_err(CloudHvError::from)?;
        let vsock = layout.vsock_dir(&self.cfg.hypervisor.run_dir, vm_id);
        match std::fs::remove_dir_all(&vsock) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(CloudHvError::RemoveVsock {
                    vm_id: vm_id.clone(),
                    dir: vsock,
                    source: e,
                }
                .into());
            }
            _ => {}
        }
        self.children.forget(vm_id);
        if let Some(network) = &self.cfg.network {
            network.release(vm_id, Mac::second_nic(vm_id))?;
        }
        self.confined.release(vm_id).map_err(CloudHvError::from)?;
        Ok(())
    }

    fn running(&self, vm_id: &Id) -> bool {
        self.alive(vm_id).is_some()
    }

    fn pid(&self, vm_id: &Id) -> Option<u32> {
        self.alive(vm_id).and_then(|t| u32::try_from(t.pid).ok())
    }

    fn failure_reason(&self, vm_id: &Id) -> Option<String> {
        let layout = self.store.layout();
        let mut said = super::log_tail(&layout.hypervisor_log(vm_id));
        if said.is_empty() {
            // A VMM that failed without a word: what the one before it said
            // (a crash whose repair cannot start) is the best lead.
            let before = super::log_tail(&layout.previous_hypervisor_log(vm_id));
            if !before.is_empty() {
                said = format!("(its previous hypervisor said: {before})");
            }
        }
        Some(self.children.failure_reason(vm_id, said)).filter(|r| !r.is_empty())
    }

    fn address(&self, vm_id: &Id) -> Option<std::net::Ipv4Addr> {
        self.cfg.network.as_ref().and_then(|n| n.address(vm_id))
    }

    fn network_address(&self, vm_id: &Id) -> Option<std::net::Ipv4Addr> {
        self.cfg
            .network
            .as_ref()
            .and_then(|n| n.network_address(Mac::second_nic(vm_id)))
    }

    fn watch_exits(&self, listener: ExitListener) {
        self.children.listener().set(listener);
    }

    /// 1. Leaked taps go first (see [`CloudHypervisor::remove_leaked_taps`]),
    ///    then every recorded VM's published ports are held again (see
    ///    [`CloudHypervisor::hold_recorded_ports`]).
    /// 2. Then the live VMMs are adopted, or stopped as orphans (see
    ///    [`CloudHypervisor::adopt`]), and every read of a snapshot's
    ///    memory lent for a restore taken back (`suspend::take_back_all`).
    /// 3. Then what no VM holds any more is given back: cgroups of no
    ///    known VM, and the leases of VMs with no record and no VMM (see
    ///    [`CloudHypervisor::release_unrecorded`]).
    fn recover(&self, known: &[Id]) -> Vec<String> {
        self.remove_leaked_taps();
        self.hold_recorded_ports();
        let mut notes = self.adopt(known);
        // After the VMMs whose restore was cut short are stopped.
        for taken in suspend::take_back_all(self.store.layout()) {
            log::warn!("{taken}: lent for a restore a crash cut short");
            notes.push(taken);
        }
        // After the orphans are stopped: their cgroups are empty now.
        if let Ok(cgroups) = &self.confined.cgroups {
            cgroups.remove_unknown(known);
        }
        self.release_unrecorded();
        notes
    }

    fn adopt(&self, vm_id: &Id) -> bool {
        self.find(vm_id).is_some()
    }

    fn suspender(&self) -> Option<&dyn Suspend> {
        Some(self)
    }

    fn holds(&self) -> Option<&dyn Holds> {
        Some(self)
    }

    fn host_checks(&self) -> Option<&dyn HostChecks> {
        Some(self)
    }

    fn waker(&self) -> Option<&dyn super::Wake> {
        Some(self)
    }

    fn guest_doors(&self) -> Option<&dyn super::GuestDoors> {
        Some(self)
    }

    fn meters(&self) -> Option<&dyn super::Meters> {
        Some(self)
    }
}

impl super::GuestDoors for CloudHypervisor {
    fn guest_door(&self, vm_id: &Id) -> Option<super::GuestDoor> {
        let vmm_pid = self.pid(vm_id)?;
        Some(super::GuestDoor {
            socket: self.guest_socket(vm_id),
            vmm_pid,
        })
    }
}

impl Suspend for CloudHypervisor {
    fn suspend(&self, vm_id: &Id, deadline: Deadline, say: Say<'_>) -> Outcome<Saved> {
        self.suspend_vm(&self.snapshot_of(vm_id), vm_id, deadline, say)
    }

    fn resume(&self, spec: &VmSpec, deadline: Deadline, spend: Spend<'_>) -> Outcome {
        self.resume_vm(spec, deadline, spend)
    }

    /// The host's checks, and the huge page pool's room for the guest's
    /// memory, as a boot asks them.
    fn resumable(&self, spec: &VmSpec) -> Outcome {
        self.check_host()?;
        Ok(self.check_hugepages(spec)?)
    }

    fn suspension(&self, vm_id: &Id) -> Option<SavedGuest> {
        self.saved_guest(vm_id)
    }

    fn discard_suspension(&self, vm_id: &Id, _deadline: Deadline) -> Outcome {
        self.discard_saved(vm_id)
    }

    fn clone_saved(
        &self,
        template: &Id,
        spec: &VmSpec,
        deadline: Deadline,
    ) -> Outcome<crate::disk::Method> {
        self.clone_vm(template, spec, deadline)
    }

    fn save_template(&self, vm_id: &Id, deadline: Deadline) -> Outcome<Duration> {
        self.save_as_template(&self.snapshot_of(vm_id), vm_id, deadline)
    }

    fn template_saved(&self, vm_id: &Id) -> Option<SavedGuest> {
        self.template_guest(vm_id)
    }

    fn discard_template(&self, vm_id: &Id) -> Outcome {
        self.drop_template(vm_id)
    }

    fn unpause(&self, vm_id: &Id, deadline: Deadline) -> Outcome {
        self.unpause_guest(vm_id, deadline)
    }
}

impl Holds for CloudHypervisor {
    fn set_egress(&self, vm_id: &Id, egress: &crate::model::Egress) -> Outcome {
        match &self.cfg.network {
            Some(network) => network.set_egress(vm_id, egress),
            // With the host network off a VM has no NIC: it reaches
            // nothing, whatever its rules would allow.
            None => Ok(()),
        }
    }

    fn limits_in_force(&self, spec: &VmSpec) -> Option<crate::model::VmLimits> {
        Some(spec.limits.in_force(spec.vcpus, &self.cfg.limits.defaults))
    }

    fn set_published(&self, vm_id: &Id, wanted: &[crate::model::Publish]) -> Outcome {
        match &self.cfg.network {
            Some(network) => network.set_published(vm_id, wanted),
            // With the host network off a VM has no NIC to forward to.
            None if wanted.is_empty() => Ok(()),
            None => Err(crate::error::Simple::host(
                "guest networking is off on this host (--underlay-bridge none): no port can reach a guest",
            )
            .into()),
        }
    }

    fn published(&self, vm_id: &Id) -> Vec<crate::model::Publish> {
        self.cfg
            .network
            .as_ref()
            .map(|n| n.published(vm_id))
            .unwrap_or_default()
    }

    fn egress_in_force(&self, vm_id: &Id) -> Option<crate::model::Egress> {
        let held = self.cfg.network.as_ref()?.egress_in_force(vm_id)?;
        (!held.is_open()).then_some(held)
    }

    fn network_served(&self, vm_id: &Id) -> Outcome {
        let Some(network) = &self.cfg.network else {
            return Ok(());
        };
        if self.unserved.lock().contains(vm_id) {
            let rec = self
                .store
                .get(vm_id)
                .map_err(|e| crate::error::Simple::transient(e.to_string()))?;
            if let Some(rec) = rec {
                self.serve(network, &rec)?;
                self.unserved.lock().remove(vm_id);
                log::info!("VM {vm_id}: its network is served again");
            }
        }
        // A tap deleted under a running VMM cannot be made again for it:
        // the guest is cut off until it boots again. Asked of the kernel
        // in the agent's own network namespace (/sys/class/net shows the
        // one sysfs was mounted in).
        if let Some(taps) = network.taps(vm_id)
            && nix::net::if_::if_nametoindex(taps.underlay.as_str()).is_err()
        {
            return Err(crate::error::Simple::transient(format!(
                "its tap {} is gone: the guest is cut off from the network until it boots again",
                taps.underlay
            ))
            .into());
        }
        Ok(())
    }
}

impl HostChecks for CloudHypervisor {
    /// The host check, again when the last is older than
    /// [`HOST_RECHECK`]: what a fixed host no longer says goes from
    /// `status` within that.
    fn host_condition(&self) -> Option<String> {
        let mut checked = self.host_checked.lock();
        if let Some((at, said)) = checked.as_ref()
            && at.elapsed() < HOST_RECHECK
        {
            return said.clone();
        }
        let said = match self.check_host() {
            Err(e) if e.is_host_condition() => Some(crate::error::chain(&*e)),
            Ok(()) | Err(_) => None,
        };
        *checked = Some((std::time::Instant::now(), said.clone()));
        said
    }
}
