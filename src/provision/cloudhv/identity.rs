//! Which processes are this agent's VMMs, and of which VM: a VMM is known
//! by its command line (the root disk or snapshot it names in this
//! agent's state dir) and its user (root, or the VM's own), never by its
//! pidfile alone, which a crash can leave stale or a garbled write wrong.
//! At start, every such process is adopted or, if no VM explains it,
//! stopped.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::process::{self, Tracked};
use super::{CloudHypervisor, api};
use crate::deadline::Deadline;
use crate::model::{Id, Mac};

impl CloudHypervisor {
    /// Holds again the ports each recorded VM held (its record says which,
    /// saved once they were held): the ruleset was made afresh at start,
    /// and a VM's ports are its own while it exists, running or not. Each
    /// record holds only what was granted to it, so no two claim one port;
    /// a host process that took one while no agent ran keeps it, and the
    /// VM's row says so at its next pass.
    pub(super) fn hold_recorded_ports(&self) {
        let Some(network) = &self.cfg.network else {
            return;
        };
        for slot in self.store.load_all().values() {
            let crate::state::RecordSlot::Readable(rec) = slot else {
                continue;
            };
            if rec.published.is_empty() {
                continue;
            }
            if let Err(e) = network.set_published(&rec.spec.vm_id, &rec.published) {
                log::warn!(
                    "VM {}: its published ports are not all held again: {}",
                    rec.spec.vm_id,
                    crate::error::chain(&*e)
                );
            }
        }
    }

    /// Gives back the address and VMM id of every VM that holds one with
    /// no record and no live VMM: a create takes them beside the save of
    /// its attempt (see `reconcile::create`), so a crash between the two
    /// leaves them held by a VM this host never recorded, which no destroy
    /// would ever release. A VM with a record keeps its leases while it is
    /// stopped; one whose VMM runs (adopted without a record) keeps them
    /// while it runs.
    pub(super) fn release_unrecorded(&self) {
        let records = self.store.load_all();
        let mut holders = self
            .cfg
            .network
            .as_ref()
            .map(|n| n.holders())
            .unwrap_or_default();
        if let Ok(ids) = &self.confined.ids {
            holders.extend(ids.holders());
        }
        holders.sort();
        holders.dedup();
        for vm_id in holders {
            if records.contains_key(&vm_id) || self.alive(&vm_id).is_some() {
                continue;
            }
            let released = match &self.cfg.network {
                Some(network) => network.release(&vm_id, Mac::second_nic(&vm_id)),
                None => Ok(()),
            }
            .and_then(|()| {
                self.confined
                    .release(&vm_id)
                    .map_err(|e| super::CloudHvError::from(e).into())
            });
            match released {
                Ok(()) => log::info!(
                    "VM {vm_id}: gave back its address and VMM id, held with no record (a create's attempt that a crash kept from being saved)"
                ),
                Err(e) => log::warn!(
                    "VM {vm_id}: cannot give back the leases it holds with no record: {}",
                    crate::error::chain(&*e)
                ),
            }
        }
    }

    /// Finds every VMM of this agent, whatever its pidfile says: every
    /// process whose command line names an API socket in this agent's run
    /// dir. Those `known` explains (a VM with a record, or in the last
    /// desired state) are adopted: pidfile corrected, exits watched, and
    /// (for those with a record) their guests' networks served again, since
    /// their DHCP responders and snoopers lived in the last agent's
    /// process. Those nothing explains are stopped, and said.
    pub(super) fn adopt(&self, known: &[Id]) -> Vec<String> {
        let mut notes = Vec::new();
        for (tracked, arg) in self.scan_ours() {
            let Some(vm_id) = self.vm_of_arg(&arg) else {
                continue;
            };
            if !self.runs_as_ours(tracked, &vm_id) {
                continue;
            }
            if known.contains(&vm_id) && self.restore_cut_short(&vm_id) {
                log::warn!(
                    "VM {vm_id}: stopping its hypervisor (pid {}): it restored the VM's snapshot, but the resume was never recorded, so its guest never ran; the snapshot is kept",
                    tracked.pid
                );
                self.end_restored(&vm_id, tracked);
                notes.push(format!(
                    "stopped a hypervisor (pid {}) of VM {vm_id} whose resume a crash cut short before its guest ran; the VM is still suspended",
                    tracked.pid
                ));
                continue;
            }
            if known.contains(&vm_id) {
                // An older agent left it the VMM's for its whole life:
                // the agent's from now on, and what was kept there gone.
                let work = self.store.layout().snapshot_work(&vm_id);
                if work.is_dir()
                    && let Err(e) = super::suspend::fresh_work_dir(&work)
                {
                    log::warn!(
                        "VM {vm_id}: cannot close {} to its hypervisor: {e}",
                        work.display()
                    );
                }
                // A crash between its start and the agent taking its vsock
                // directory back left it the VMM's.
                let socket = self.guest_socket(&vm_id);
                if socket.parent().is_some_and(Path::is_dir)
                    && let Err(e) = super::spawn::close_vsock_dir(&socket)
                {
                    log::warn!(
                        "VM {vm_id}: cannot close {} to its hypervisor: {e}",
                        socket.display()
                    );
                }
                if Tracked::read(&self.store.layout().pidfile(&vm_id)) != Some(tracked) {
                    self.take_over(&vm_id, tracked);
                } else if let Some(watch) = &self.watch {
                    watch.watch(&vm_id, tracked);
                }
                continue;
            }
            log::warn!(
                "stopping an orphan hypervisor (pid {}) of VM {vm_id}: no record or desired VM explains it",
                tracked.pid
            );
            self.stop_orphan(tracked, &self.socket_path(&vm_id));
            notes.push(format!(
                "stopped an orphan hypervisor (pid {}) of VM {vm_id} that no record or desired VM explains",
                tracked.pid
            ));
        }
        notes.extend(self.confined.notes());
        if let Some(why) = self.memory_restore_why() {
            notes.push(format!(
                "a resumed guest runs only once its whole snapshot is read (seconds for GiBs, not milliseconds): {why}"
            ));
        }
        for slot in self.store.load_all().values() {
            let crate::state::RecordSlot::Readable(rec) = slot else {
                continue;
            };
            let vm_id = &rec.spec.vm_id;
            if self.alive(vm_id).is_none() {
                continue;
            }
            let Some(network) = &self.cfg.network else {
                continue;
            };
            match self.serve(network, rec) {
                Ok(()) => log::info!("VM {vm_id}: adopted; serving its network again"),
                Err(e) => {
                    log::error!(
                        "VM {vm_id}: adopted, but its network is not served: {} (tried again at its every pass; it is not ready until then)",
                        crate::error::chain(&*e as &dyn std::error::Error)
                    );
                    self.unserved.lock().insert(vm_id.clone());
                }
            }
        }
        notes
    }

    /// Serves a running VM's network again (its egress rules, then its
    /// taps plugged): the ruleset was made afresh at start, and a
    /// sandboxed guest is not let out until its rules are held.
    pub(super) fn serve(
        &self,
        network: &crate::net::host::HostNetwork,
        rec: &crate::state::Record,
    ) -> Result<(), crate::error::BoxFailure> {
        let vm_id = &rec.spec.vm_id;
        network.set_egress(vm_id, &rec.egress)?;
        network.plug(vm_id, Mac::underlay(vm_id))?;
        if !rec.spec.network.is_empty()
            && let Some(taps) = network.taps(vm_id)
        {
            network.plug_named(vm_id, &rec.spec.network, &taps.site, Mac::second_nic(vm_id))?;
        }
        Ok(())
    }

    /// Whether the VM's record says suspended, its snapshot committed:
    /// a live VMM of it can only be one a resume started and a crash cut
    /// short before the resume was recorded (a suspend stops its VMM
    /// before it records one; a resume records itself before its guest
    /// runs), so its guest, restored paused, never ran.
    fn restore_cut_short(&self, vm_id: &Id) -> bool {
        matches!(
            self.store.get(vm_id),
            Ok(Some(rec)) if rec.lifecycle.suspension().saved().is_some()
        )
    }

    /// Stops a VMM no VM explains: asked to shut down, then killed.
    pub(super) fn stop_orphan(&self, tracked: Tracked, socket: &Path) {
        let _ = api::call(
            socket,
            "PUT",
            "/api/v1/vmm.shutdown",
            Duration::from_secs(2),
        );
        let until = Deadline::after(self.cfg.hypervisor.stop.vmm_shutdown);
        while tracked.alive() && !until.expired() {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = tracked.signal(nix::sys::signal::Signal::SIGKILL);
    }

    pub fn socket_path(&self, vm_id: &Id) -> PathBuf {
        self.store
            .layout()
            .api_socket(&self.cfg.hypervisor.run_dir, vm_id)
    }

    /// The VMM's vsock socket, behind which the guest agent answers.
    pub fn guest_socket(&self, vm_id: &Id) -> PathBuf {
        self.store
            .layout()
            .guest_socket(&self.cfg.hypervisor.run_dir, vm_id)
    }

    /// The VM's tap names, while networking is on and it holds an address.
    pub fn taps(&self, vm_id: &Id) -> Option<crate::net::host::Taps> {
        self.cfg.network.as_ref().and_then(|n| n.taps(vm_id))
    }

    pub(super) fn tracked(&self, vm_id: &Id) -> Option<Tracked> {
        Tracked::read(&self.store.layout().pidfile(vm_id))
    }

    /// The VM's hypervisor, if it is alive: the pidfile's process, started
    /// when recorded, not a zombie, and running with this VM's API socket on
    /// its command line (so no other process can pass for it). A pidfile
    /// that is garbled, or names a live process that is not this VM's VMM,
    /// is not believed either way: the VMM is looked for by its command
    /// line, and the pidfile corrected. (A missing pidfile, or one naming a
    /// dead process, is the normal state of a stopped VM, and costs no
    /// scan; [`CloudHypervisor::find`] looks harder, where it matters.)
    pub(super) fn alive(&self, vm_id: &Id) -> Option<Tracked> {
        let pidfile = self.store.layout().pidfile(vm_id);
        match Tracked::read(&pidfile) {
            Some(tracked) if !tracked.alive() => None,
            Some(tracked) if self.is_vmm_of(vm_id, tracked) => Some(tracked),
            Some(_) => self.find_by_cmdline(vm_id),
            None if pidfile.exists() => self.find_by_cmdline(vm_id),
            None => None,
        }
    }

    /// The VM's hypervisor, however the last agent left its pidfile: for
    /// the decisions that must never be wrong (never start a second VMM,
    /// never replace the disk under a live one). It scans only when the
    /// VM's API socket file exists, which it does from a VMM's first start
    /// until the VM is destroyed (so a stopped VM costs a scan on these
    /// rare calls; a VM never started costs none).
    pub(super) fn find(&self, vm_id: &Id) -> Option<Tracked> {
        self.alive(vm_id).or_else(|| {
            self.socket_path(vm_id)
                .exists()
                .then(|| self.find_by_cmdline(vm_id))
                .flatten()
        })
    }

    /// Whether `tracked` is this VM's VMM: its command line names the VM's
    /// root disk (or, restoring it, its snapshot), and it runs as root or
    /// as the VM's own user, which no local user can (so no process of
    /// theirs can pass for a VMM).
    pub(super) fn is_vmm_of(&self, vm_id: &Id, tracked: Tracked) -> bool {
        let names_it = fs::read(format!("/proc/{}/cmdline", tracked.pid)).is_ok_and(|c| {
            c.split(|b| *b == 0)
                .any(|arg| self.vm_of_arg(arg).as_ref() == Some(vm_id))
        });
        names_it && self.runs_as_ours(tracked, vm_id)
    }

    /// The two arguments by which a VMM names its VM: a boot's root disk
    /// (`path=<state>/vms/<id>/disk.raw`) and a restore's snapshot
    /// (`source_url=file://<state>/vms/<id>/snapshot`), each alone or
    /// followed by `,` and options: (the argument's start, the file it
    /// names in the VM's directory).
    pub(super) fn naming_args(&self) -> [(String, &'static [u8]); 2] {
        let vms = self.store.layout().vms();
        [
            (format!("path={}/", vms.display()), b"/disk.raw"),
            (
                format!("source_url=file://{}/", vms.display()),
                b"/snapshot",
            ),
        ]
    }

    /// The VM whose root disk or snapshot `arg` names (see
    /// [`CloudHypervisor::naming_args`]).
    pub(super) fn vm_of_arg(&self, arg: &[u8]) -> Option<Id> {
        self.naming_args().into_iter().find_map(|(prefix, file)| {
            let rest = arg.strip_prefix(prefix.as_bytes())?;
            let slash = rest.iter().position(|b| *b == b'/')?;
            let (id, tail) = rest.split_at(slash);
            let tail = tail.strip_prefix(file)?;
            if !(tail.is_empty() || tail.starts_with(b",")) {
                return None;
            }
            Id::parse(std::str::from_utf8(id).ok()?).ok()
        })
    }

    /// Every process whose command line names one of this agent's VMs (see
    /// [`CloudHypervisor::naming_args`]), with that argument.
    pub(super) fn scan_ours(&self) -> Vec<(Tracked, Vec<u8>)> {
        self.naming_args()
            .iter()
            .flat_map(|(prefix, _)| process::scan(prefix.as_bytes(), true))
            .collect()
    }

    /// Whether the process runs as root or as the VM's own user.
    pub(super) fn runs_as_ours(&self, tracked: Tracked, vm_id: &Id) -> bool {
        let own = self
            .confined
            .ids
            .as_ref()
            .ok()
            .and_then(|ids| ids.get(vm_id));
        process::uid(tracked.pid).is_some_and(|uid| uid == 0 || Some(uid) == own)
    }

    /// The VM's VMM found by its command line, its pidfile rewritten to it
    /// and its exit watched (it is not this agent's child).
    pub(super) fn find_by_cmdline(&self, vm_id: &Id) -> Option<Tracked> {
        let (tracked, _) = self.scan_ours().into_iter().find(|(t, arg)| {
            self.vm_of_arg(arg).as_ref() == Some(vm_id) && self.runs_as_ours(*t, vm_id)
        })?;
        self.take_over(vm_id, tracked);
        Some(tracked)
    }

    /// Makes a VMM found without (or despite) its pidfile this VM's again:
    /// the pidfile names it, and its exit is watched.
    pub(super) fn take_over(&self, vm_id: &Id, tracked: Tracked) {
        match tracked.write(&self.store.layout().pidfile(vm_id)) {
            Ok(()) => log::warn!(
                "VM {vm_id}: found its hypervisor (pid {}) by its command line; its pidfile now names it",
                tracked.pid
            ),
            Err(e) => log::error!(
                "VM {vm_id}: found its hypervisor (pid {}), but cannot correct its pidfile: {e}",
                tracked.pid
            ),
        }
        if let Some(watch) = &self.watch {
            watch.watch(vm_id, tracked);
        }
    }
}
