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
//! 2. Boot ([`spawn`]): `vfkit` forked with the command line [`argv`]
//!    builds, reaped, and its REST API ([`api`]) polled until it says
//!    Running. A vfkit that exits first fails the boot with its `Error: …`
//!    line.
//! 3. Found again (a restart of the agent): `vfkit.pid` names a live
//!    process whose name is the vfkit binary's ([`process`]). Its exit is
//!    then seen at the next tick (no pidfd here).
//! 4. Stop ([`stop`]): the shared ladder, the power button first.
//! 5. Address: the newest lease for the VM's MAC in bootpd's lease file
//!    ([`leases`]).
//!
//! What every backend does alike (reaping, the boot wait, the ladder) is
//! [`supervise`]'s; this backend is its [`Vmm`](vmm::Vmm) and what only
//! vfkit does.
//!
//! A second NIC on a named host network is refused: vfkit's bridged mode
//! needs the `com.apple.vm.networking` entitlement, which only Apple
//! grants to a signed build; the error says so.

pub mod api;
pub mod argv;
mod error;
pub mod leases;
mod process;
mod spawn;
mod stop;
mod vmm;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use self::argv::Files;
pub use self::error::VfkitError;
use super::supervise::{self, Children};
use super::{
    ExitListener, HostChecks, HypervisorSettings, Lifecycle, SavedGuest, Say, Spend, Suspend,
};
use crate::deadline::Deadline;
use crate::error::Outcome;
use crate::model::{Id, Mac, Saved, VmSpec};
use crate::state::Store;

#[derive(Debug, Clone)]
pub struct VfkitConfig {
    /// The vfkit binary (`--hypervisor`), where its API sockets live
    /// (short: macOS caps a socket path at 103 bytes), how it is stopped.
    pub hypervisor: Arc<HypervisorSettings>,
    /// Bound on waiting for a new VM's API to say Running.
    pub boot_wait: Duration,
    /// bootpd's lease file ([`leases::LEASE_FILE`]).
    pub leases: PathBuf,
}

pub struct Vfkit {
    store: Arc<Store>,
    cfg: VfkitConfig,
    /// The vfkits this agent started, their reapers and exits; who is told
    /// of each exit (the engine).
    children: Children,
}

impl Vfkit {
    pub fn new(store: Arc<Store>, cfg: VfkitConfig) -> Vfkit {
        Vfkit {
            store,
            cfg,
            children: Children::new("vfkit"),
        }
    }

    /// The VM's API socket: short, unique per state dir and VM.
    pub fn socket_path(&self, vm_id: &Id) -> PathBuf {
        self.store
            .layout()
            .api_socket(&self.cfg.hypervisor.run_dir, vm_id)
    }

    pub fn pidfile_path(&self, vm_id: &Id) -> PathBuf {
        self.store.layout().vfkit_pidfile(vm_id)
    }

    fn files(&self, spec: &VmSpec) -> Files {
        let vm_id = &spec.vm_id;
        Files {
            root_disk: self.store.layout().root_disk(vm_id),
            seed: self.store.layout().seed(vm_id),
            volumes: self.store.layout().volumes_of(spec),
            efi_vars: self.store.layout().efi_vars(vm_id),
            console_log: self.store.layout().serial_log(vm_id),
            socket: self.socket_path(vm_id),
            pidfile: self.pidfile_path(vm_id),
        }
    }

    /// The pid of the VM's live vfkit: a child of this agent not yet
    /// reaped, or the pidfile's process when its name is vfkit's.
    pub fn alive(&self, vm_id: &Id) -> Option<u32> {
        self.children
            .unreaped(vm_id)
            .or_else(|| process::live_pid(&self.pidfile_path(vm_id), &self.cfg.hypervisor.binary))
    }

    /// Every VM dir with a pidfile: the VMs a vfkit may run for.
    fn with_pidfiles(&self) -> Vec<Id> {
        fs::read_dir(self.store.layout().vms())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| Id::parse(&e.file_name().to_string_lossy()).ok())
            .filter(|id| self.pidfile_path(id).exists())
            .collect()
    }
}

/// How long one state query or change may take.
const STATE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a guest is given to reach the state asked of it.
const STATE_WAIT: Duration = Duration::from_secs(10);

impl Vfkit {
    /// Waits until the VM's vfkit says `want`, within `deadline` and
    /// [`STATE_WAIT`].
    fn await_state(&self, vm_id: &Id, want: &str, deadline: Deadline) -> Outcome {
        let socket = self.socket_path(vm_id);
        let until = deadline.capped(STATE_WAIT);
        loop {
            match api::state(&socket, STATE_TIMEOUT) {
                Ok(state) if state == want => return Ok(()),
                Ok(_) if !until.expired() => std::thread::sleep(Duration::from_millis(20)),
                Ok(state) => {
                    return Err(VfkitError::State {
                        vm_id: vm_id.clone(),
                        doing: "reach the state asked of it",
                        source: api::RestError::BadAnswer(format!(
                            "still {state} after {} s, asked for {want}",
                            STATE_WAIT.as_secs()
                        )),
                    }
                    .into());
                }
                Err(source) => {
                    return Err(VfkitError::State {
                        vm_id: vm_id.clone(),
                        doing: "say its state",
                        source,
                    }
                    .into());
                }
            }
        }
    }
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

impl Lifecycle for Vfkit {
    fn preflight(&self, _deadline: Deadline) -> Outcome {
        use std::os::unix::fs::PermissionsExt;
        let program = &self.cfg.hypervisor.binary;
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
    ) -> Outcome<crate::state::atomic::Pending> {
        let in_use = self.alive(&spec.vm_id).is_some();
        supervise::prepare_root_disk(&self.store, spec, base, in_use, deadline)
    }

    fn boot(&self, spec: &VmSpec, deadline: Deadline) -> Outcome {
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

    fn shutdown(&self, vm_id: &Id, deadline: Deadline, say: Say<'_>) -> Outcome {
        self.stop(vm_id, deadline, say)
    }

    fn destroy(&self, vm_id: &Id, deadline: Deadline) -> Outcome {
        self.stop(vm_id, deadline, &|what| log::info!("VM {vm_id}: {what}"))?;
        supervise::remove_files(vm_id, &[self.socket_path(vm_id), self.pidfile_path(vm_id)])
            .map_err(VfkitError::from)?;
        self.children.forget(vm_id);
        Ok(())
    }

    fn running(&self, vm_id: &Id) -> bool {
        self.alive(vm_id).is_some()
    }

    fn pid(&self, vm_id: &Id) -> Option<u32> {
        self.alive(vm_id)
    }

    fn failure_reason(&self, vm_id: &Id) -> Option<String> {
        let said = error_line(&self.store.layout().hypervisor_log(vm_id));
        Some(self.children.failure_reason(vm_id, said)).filter(|r| !r.is_empty())
    }

    fn address(&self, vm_id: &Id) -> Option<std::net::Ipv4Addr> {
        leases::address(&self.cfg.leases, Mac::underlay(vm_id).octets())
    }

    /// vfkit serves no second NIC (see the module header).
    fn network_address(&self, _vm_id: &Id) -> Option<std::net::Ipv4Addr> {
        None
    }

    fn watch_exits(&self, listener: ExitListener) {
        self.children.listener().set(listener);
    }

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

    fn suspender(&self) -> Option<&dyn Suspend> {
        Some(self)
    }

    fn host_checks(&self) -> Option<&dyn HostChecks> {
        Some(self)
    }
}

impl Suspend for Vfkit {
    /// vfkits left by a previous agent are found by their pidfiles: those
    /// `known` explains are adopted (nothing to do: the pidfile tracks
    /// them), the rest are stopped through the ladder, and said.
    /// vfkit cannot save a guest to disk: its guest is paused in place
    /// (`Pause`), and the paused vfkit holds it, memory and all.
    fn suspend(&self, vm_id: &Id, deadline: Deadline, say: Say<'_>) -> Outcome<Saved> {
        if self.alive(vm_id).is_none() {
            return Err(VfkitError::NotRunning {
                vm_id: vm_id.clone(),
            }
            .into());
        }
        say("suspending: pausing the guest in place (vfkit keeps it in memory)");
        let socket = self.socket_path(vm_id);
        api::change(&socket, "Pause", STATE_TIMEOUT).map_err(|source| VfkitError::State {
            vm_id: vm_id.clone(),
            doing: "pause its guest",
            source,
        })?;
        self.await_state(vm_id, api::PAUSED, deadline)?;
        Ok(Saved {
            taken_at_ms: crate::human::unix_ms(std::time::SystemTime::now()),
            bytes: 0,
            in_memory: true,
        })
    }

    /// Its guest, paused in place, runs on once `spend` agrees; refused,
    /// it stays paused, its vfkit holding it as before.
    fn resume(&self, spec: &VmSpec, deadline: Deadline, spend: Spend<'_>) -> Outcome {
        let vm_id = &spec.vm_id;
        let Some(pid) = self.alive(vm_id) else {
            return Err(VfkitError::NotRunning {
                vm_id: vm_id.clone(),
            }
            .into());
        };
        let socket = self.socket_path(vm_id);
        spend()?;
        if api::state(&socket, STATE_TIMEOUT).ok().as_deref() == Some(api::PAUSED) {
            api::change(&socket, "Resume", STATE_TIMEOUT).map_err(|source| VfkitError::State {
                vm_id: vm_id.clone(),
                doing: "resume its paused guest",
                source,
            })?;
        }
        self.await_running(vm_id, pid, deadline)
    }

    /// A paused vfkit holds its guest: nothing of the host is asked.
    fn resumable(&self, _spec: &VmSpec) -> Outcome {
        Ok(())
    }

    /// A guest paused in place, while its vfkit lives.
    fn suspension(&self, vm_id: &Id) -> Option<SavedGuest> {
        self.alive(vm_id)?;
        let state = api::state(&self.socket_path(vm_id), STATE_TIMEOUT).ok()?;
        (state == api::PAUSED).then_some(SavedGuest::Usable(Saved {
            taken_at_ms: 0,
            bytes: 0,
            in_memory: true,
        }))
    }

    /// A paused guest's vfkit is stopped (a paused guest hears no power
    /// button); a running one is not suspended, and is left alone.
    fn discard_suspension(&self, vm_id: &Id, deadline: Deadline) -> Outcome {
        if self.suspension(vm_id).is_none() {
            return Ok(());
        }
        self.stop_paused(vm_id, deadline)
    }
}

impl HostChecks for Vfkit {
    fn host_condition(&self) -> Option<String> {
        let lacks = self.preflight(Deadline::NONE).err()?;
        lacks
            .is_host_condition()
            .then(|| crate::error::chain(&*lacks))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
