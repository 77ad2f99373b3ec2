//! Where everything lives under the state dir and the run dir: the one
//! place that joins path strings. Every module that reads or writes a file
//! of the agent asks a [`Layout`] for its path.
//!
//! ```text
//! STATE_DIR/                                   0711: a jailed VMM reaches its own files by name
//!   lock                                       flock: one agent per state dir
//!   fence.json                                 highest accepted snapshot epoch, and the signed epoch resets obeyed
//!   epoch                                      the same epoch alone, for agents older than fence.json and for people
//!   host-signing-key                           the host's own key, which signs its reports (with --trusted-keys)
//!   snapshot.pb                                the last accepted desired state
//!   report.json                                the last report, for `status`
//!   vms/                                       0711
//!   vms/<vm_id>/                               0711, root's
//!   vms/<vm_id>/record.json                    the VM's record
//!   vms/<vm_id>/disk.raw                       root disk
//!   vms/<vm_id>/seed.iso                       NoCloud seed
//!   vms/<vm_id>/ssh_host_ed25519_key           the guest's host key
//!   vms/<vm_id>/hypervisor.pid                 cloud-hypervisor: pid and start time
//!   vms/<vm_id>/vfkit.pid                      vfkit: its own pidfile
//!   vms/<vm_id>/hypervisor.log                 the VMM's output
//!   vms/<vm_id>/serial.log                     the guest's serial console
//!   vms/<vm_id>/events.log                     its last events, as logged (see events), bounded
//!   vms/<vm_id>/serial.<n>.log                 its console before its n-th resume (a restored VMM starts its own)
//!   vms/<vm_id>/snapshot.tmp                   cloud-hypervisor: where its VMM writes a snapshot, its own only while it does
//!   vms/<vm_id>/snapshot                       a suspended guest's snapshot, committed by rename, root's
//!   vms/<vm_id>/snapshot/manifest.json         the agent's account of it: its files, the disks it was taken with
//!   vms/<vm_id>/.snapshot-new                  a snapshot being committed, its files moved in from snapshot.tmp
//!   vms/<vm_id>/.snapshot-discarded            a snapshot on its way out
//!   vms/<vm_id>/template                       a running template's save, committed as a snapshot is
//!   vms/<vm_id>/template/manifest.json         its account, naming template.raw as its disk
//!   vms/<vm_id>/.template-new                  a running template's save being committed
//!   vms/<vm_id>/.template-discarded            a running template's save on its way out
//!   vms/<vm_id>/template.raw                   a running template's root disk as it was saved
//!   vms/<vm_id>/efi-vars                       vfkit: the guest's EFI variable store
//!   images/                                    0700
//!   images/<sha256>                            a verified base image
//!   images/.lock                               held by creates, taken by `images prune`
//!   volumes/                                   0711
//!   volumes/<volume_id>                        a sparse volume file
//!   volumes/.tombstoned-<volume_id>            the volume is on its way out
//!   net/addresses.json                         underlay address leases
//!   net/learned.json                           second-NIC addresses learned from the site
//!   jail/ids.json                              VMM user ids, by VM
//!   jail/claim.json                            this state dir's VMM id range and cgroup root (see state::claim)
//! RUN_DIR/                                     0700: sockets, short paths
//!   <digest>.sock                              a VM's VMM API socket
//!   <digest>.sock.lock                         cloud-hypervisor's lock beside it
//! ```
//!
//! Temp files (`.<name>.tmp-…`, see [`atomic`](super::atomic)), half-made
//! downloads (`images/.partial-…`) and half-deleted VM directories
//! (`vms/.deleting-…`) are named by the modules that make and sweep them,
//! always hidden, so no id can collide with one.

use std::path::{Path, PathBuf};

use crate::model::Id;

/// The record's file name in a VM's directory; its loader recognises it.
pub const RECORD_FILE: &str = "record.json";

/// Every path under one state dir (and the run dir beside it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    state: PathBuf,
}

impl Layout {
    pub fn new(state_dir: &Path) -> Layout {
        Layout {
            state: state_dir.to_path_buf(),
        }
    }

    pub fn state_dir(&self) -> &Path {
        &self.state
    }

    pub fn lock(&self) -> PathBuf {
        self.state.join("lock")
    }

    pub fn epoch(&self) -> PathBuf {
        self.state.join("epoch")
    }

    pub fn fence(&self) -> PathBuf {
        self.state.join("fence.json")
    }

    /// The host's own signing key (secret, 0600): it signs the reports.
    pub fn host_signing_key(&self) -> PathBuf {
        self.state.join("host-signing-key")
    }

    pub fn last_snapshot(&self) -> PathBuf {
        self.state.join("snapshot.pb")
    }

    pub fn report(&self) -> PathBuf {
        self.state.join("report.json")
    }

    /// `vms/`, where every VM's directory is.
    pub fn vms(&self) -> PathBuf {
        self.state.join("vms")
    }

    pub fn vm_dir(&self, vm_id: &Id) -> PathBuf {
        self.vms().join(vm_id.as_str())
    }

    pub fn record(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join(RECORD_FILE)
    }

    pub fn root_disk(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join("disk.raw")
    }

    pub fn seed(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join("seed.iso")
    }

    pub fn host_key(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join("ssh_host_ed25519_key")
    }

    /// cloud-hypervisor's pidfile, written by the agent.
    pub fn pidfile(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join("hypervisor.pid")
    }

    /// vfkit's pidfile, written by vfkit (`--pidfile`).
    pub fn vfkit_pidfile(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join("vfkit.pid")
    }

    pub fn hypervisor_log(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join("hypervisor.log")
    }

    /// The log of the VM's previous VMM, moved aside when the next one
    /// starts: a VMM that died says why there, and its successor would
    /// truncate it.
    pub fn previous_hypervisor_log(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join("hypervisor.previous.log")
    }

    pub fn serial_log(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join("serial.log")
    }

    /// The VM's last events (see [`crate::events`]).
    pub fn events(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join("events.log")
    }

    /// The console as it was before the VM's `n`-th VMM start (a boot or a
    /// restore): a VMM truncates the console file it is given, so the agent
    /// moves it aside.
    pub fn serial_segment(&self, vm_id: &Id, n: u32) -> PathBuf {
        self.vm_dir(vm_id).join(format!("serial.{n}.log"))
    }

    /// The console's earlier segments (see [`Layout::serial_segment`]),
    /// oldest first.
    pub fn serial_segments(&self, vm_id: &Id) -> Vec<(u32, PathBuf)> {
        let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir(self.vm_dir(vm_id))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name();
                let n = name
                    .to_str()?
                    .strip_prefix("serial.")?
                    .strip_suffix(".log")?
                    .parse()
                    .ok()?;
                Some((n, entry.path()))
            })
            .collect();
        found.sort();
        found
    }

    /// The number of the console segment the guest's current boot began
    /// in (see [`Layout::serial_segment`]; the console itself once moved
    /// aside): written at each boot, not at a resume, whose guest goes on
    /// with the boot it had. A readiness probe on the console reads from
    /// there, so a resumed guest's boot line still counts.
    pub fn serial_boot(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join("serial.boot")
    }

    /// The console of the guest's current boot, oldest first: the segments
    /// from the one it began in (by [`Layout::serial_boot`]; without it,
    /// none), then the console itself.
    pub fn serial_of_this_boot(&self, vm_id: &Id) -> Vec<PathBuf> {
        let began: Option<u32> = std::fs::read_to_string(self.serial_boot(vm_id))
            .ok()
            .and_then(|t| t.trim().parse().ok());
        let mut out: Vec<PathBuf> = match began {
            Some(began) => self
                .serial_segments(vm_id)
                .into_iter()
                .filter(|(n, _)| *n >= began)
                .map(|(_, p)| p)
                .collect(),
            None => Vec::new(),
        };
        out.push(self.serial_log(vm_id));
        out
    }

    /// Where the VM's VMM writes a snapshot (cloud-hypervisor): made
    /// before it starts and bound into its view, its own only for the
    /// length of a snapshot.
    pub fn snapshot_work(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join("snapshot.tmp")
    }

    /// A suspended guest's committed snapshot.
    pub fn snapshot(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join("snapshot")
    }

    pub fn snapshot_manifest(&self, vm_id: &Id) -> PathBuf {
        self.snapshot(vm_id).join("manifest.json")
    }

    /// A snapshot being committed: its files are moved here from
    /// [`Layout::snapshot_work`], which is the agent's again, then it is renamed
    /// to [`Layout::snapshot`].
    pub fn snapshot_incoming(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join(".snapshot-new")
    }

    /// A snapshot being removed: renamed here first, so no half-removed one
    /// is ever under the committed name.
    pub fn snapshot_discarded(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join(".snapshot-discarded")
    }

    /// A running template's committed snapshot, which clones are made
    /// from, committed as [`Layout::snapshot`] is (by way of
    /// [`Layout::template_incoming`] and [`Layout::template_discarded`]).
    pub fn template(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join("template")
    }

    pub fn template_manifest(&self, vm_id: &Id) -> PathBuf {
        self.template(vm_id).join("manifest.json")
    }

    pub fn template_incoming(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join(".template-new")
    }

    pub fn template_discarded(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join(".template-discarded")
    }

    /// A running template's root disk as it was when its guest was saved.
    pub fn template_disk(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join("template.raw")
    }

    pub fn efi_vars(&self, vm_id: &Id) -> PathBuf {
        self.vm_dir(vm_id).join("efi-vars")
    }

    pub fn images(&self) -> PathBuf {
        self.state.join("images")
    }

    /// The image cache's lock: held shared by a create from finding its
    /// image to making its root disk, exclusively by `images prune`.
    pub fn images_lock(&self) -> PathBuf {
        Layout::images_lock_in(&self.images())
    }

    /// [`Layout::images_lock`] of the cache at `images`.
    pub fn images_lock_in(images: &Path) -> PathBuf {
        images.join(".lock")
    }

    /// A verified base image, named by its sha256 (checked hex).
    pub fn image(&self, sha256: &str) -> PathBuf {
        self.images().join(sha256)
    }

    pub fn volumes(&self) -> PathBuf {
        self.state.join("volumes")
    }

    pub fn volume(&self, volume_id: &Id) -> PathBuf {
        self.volumes().join(volume_id.as_str())
    }

    /// The volume files a VM's spec attaches, in its order.
    pub fn volumes_of(&self, spec: &crate::model::VmSpec) -> Vec<PathBuf> {
        spec.volume_ids.iter().map(|v| self.volume(v)).collect()
    }

    /// Marks a volume the control plane deleted, so a report made without
    /// a snapshot (the fence path) still says it is on its way out.
    /// Hidden, so it can never be mistaken for a volume: ids never start
    /// with a dot.
    pub fn volume_tombstone(&self, volume_id: &Id) -> PathBuf {
        self.volumes()
            .join(format!(".tombstoned-{}", volume_id.as_str()))
    }

    pub fn addresses(&self) -> PathBuf {
        self.state.join("net").join("addresses.json")
    }

    pub fn learned(&self) -> PathBuf {
        self.state.join("net").join("learned.json")
    }

    pub fn vmm_ids(&self) -> PathBuf {
        self.state.join("jail").join("ids.json")
    }

    pub fn claim(&self) -> PathBuf {
        self.state.join("jail").join("claim.json")
    }

    /// The VM's API socket in `run_dir`: not under the VM's directory,
    /// since a unix socket's path is limited to 108 bytes (103 on macOS)
    /// whatever the state dir's length; named by a digest of the state dir
    /// and the id, so two agents sharing a run dir never meet.
    pub fn api_socket(&self, run_dir: &Path, vm_id: &Id) -> PathBuf {
        use sha2::{Digest, Sha256};
        let digest = Sha256::new()
            .chain_update(self.state.as_os_str().as_encoded_bytes())
            .chain_update([0])
            .chain_update(vm_id.as_str())
            .finalize();
        run_dir.join(format!("{}.sock", &crate::hex::encode(&digest)[..16]))
    }

    /// The directory of the VM's vsock socket (cloud-hypervisor), in
    /// `run_dir` for the same reason as [`Layout::api_socket`], named the
    /// same way: a directory of its own, the VMM's, made afresh before
    /// each of its starts, because cloud-hypervisor's Landlock rules give
    /// the VMM write access to the socket's parent, and no other file may
    /// be in it.
    pub fn vsock_dir(&self, run_dir: &Path, vm_id: &Id) -> PathBuf {
        self.api_socket(run_dir, vm_id).with_extension("vsock")
    }

    /// The VMM's vsock socket, through which the host reaches the guest
    /// agent. A guest that connects out to host port P makes the VMM
    /// connect to `guest.sock_P` beside it; nothing ever listens there, so
    /// the guest reaches nothing.
    pub fn guest_socket(&self, run_dir: &Path, vm_id: &Id) -> PathBuf {
        self.vsock_dir(run_dir, vm_id).join("guest.sock")
    }

    /// The lock cloud-hypervisor keeps beside its API socket.
    pub fn api_socket_lock(&self, run_dir: &Path, vm_id: &Id) -> PathBuf {
        let mut name = self.api_socket(run_dir, vm_id).into_os_string();
        name.push(".lock");
        PathBuf::from(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tree in this module's header, as `(path, placeholder-free)`
    /// lines: each entry's first word.
    fn header_entries() -> Vec<String> {
        let source = include_str!("layout.rs");
        let start = source.find("//! ```text").expect("tree");
        let end = source[start + 11..].find("//! ```").expect("tree end") + start + 11;
        source[start..end]
            .lines()
            .skip(1)
            .filter_map(|l| l.strip_prefix("//!"))
            .filter_map(|l| l.split_whitespace().next())
            .map(str::to_owned)
            .collect()
    }

    /// Every path a method gives, written as the header writes it.
    fn method_paths() -> Vec<String> {
        let state = Path::new("/S");
        let run = Path::new("/R");
        let layout = Layout::new(state);
        let vm = Id::parse("VMID").expect("id");
        let vol = Id::parse("VOLID").expect("id");
        let paths = [
            layout.state_dir().to_path_buf(),
            layout.lock(),
            layout.fence(),
            layout.epoch(),
            layout.last_snapshot(),
            layout.report(),
            layout.vms(),
            layout.vm_dir(&vm),
            layout.record(&vm),
            layout.root_disk(&vm),
            layout.seed(&vm),
            layout.host_key(&vm),
            layout.pidfile(&vm),
            layout.vfkit_pidfile(&vm),
            layout.hypervisor_log(&vm),
            layout.serial_log(&vm),
            layout.events(&vm),
            layout.serial_segment(&vm, 7),
            layout.snapshot_work(&vm),
            layout.snapshot(&vm),
            layout.snapshot_manifest(&vm),
            layout.snapshot_incoming(&vm),
            layout.snapshot_discarded(&vm),
            layout.template(&vm),
            layout.template_manifest(&vm),
            layout.template_incoming(&vm),
            layout.template_discarded(&vm),
            layout.template_disk(&vm),
            layout.efi_vars(&vm),
            layout.host_signing_key(),
            layout.images(),
            layout.images_lock(),
            layout.image("SHA"),
            layout.volumes(),
            layout.volume(&vol),
            layout.volume_tombstone(&vol),
            layout.addresses(),
            layout.learned(),
            layout.vmm_ids(),
            layout.claim(),
            layout.api_socket(run, &vm),
            layout.api_socket_lock(run, &vm),
        ];
        let digest = layout.api_socket(run, &vm);
        let digest = digest.file_stem().and_then(|s| s.to_str()).expect("digest");
        paths
            .iter()
            .map(|p| {
                let text = p.to_string_lossy();
                let dir = |p: &Path| {
                    p.is_absolute()
                        && [layout.vms(), layout.images(), layout.volumes()]
                            .contains(&p.to_path_buf())
                };
                let shown = if let Some(rest) = text.strip_prefix("/S/") {
                    rest.to_owned()
                } else if let Some(rest) = text.strip_prefix("/R/") {
                    rest.to_owned()
                } else {
                    text.into_owned()
                };
                let shown = shown
                    .replace("VMID", "<vm_id>")
                    .replace("VOLID", "<volume_id>")
                    .replace("serial.7.log", "serial.<n>.log")
                    .replace("SHA", "<sha256>")
                    .replace(digest, "<digest>");
                match shown.as_str() {
                    "/S" => "STATE_DIR/".to_owned(),
                    _ if dir(p) || shown == "vms/<vm_id>" => format!("{shown}/"),
                    _ => shown,
                }
            })
            .collect()
    }

    #[test]
    fn the_header_tree_lists_every_path_a_method_gives() {
        let tree = header_entries();

        let missing: Vec<String> = method_paths()
            .into_iter()
            .filter(|p| !tree.contains(p))
            .collect();

        assert!(missing.is_empty(), "not in the header's tree: {missing:?}");
    }

    #[test]
    fn every_path_in_the_header_tree_has_a_method() {
        let paths = method_paths();

        let unmade: Vec<String> = header_entries()
            .into_iter()
            .filter(|e| e != "RUN_DIR/" && !paths.contains(e))
            .collect();

        assert!(unmade.is_empty(), "no method gives: {unmade:?}");
    }

    #[test]
    fn a_socket_path_fits_a_unix_socket_whatever_the_state_dir() {
        let long = Path::new("/a").join("b".repeat(200));
        let vm = Id::parse("vm-1").expect("id");

        let socket = Layout::new(&long).api_socket(Path::new("/run/eitri"), &vm);

        assert!(socket.as_os_str().len() < 104, "{}", socket.display());
    }
}
