//! Taking back what an ended claim put on the host: its VMM group's entry on
//! the devices' ACLs ([`super::acl`]), its cgroup root in each hierarchy
//! ([`super::cgroup`]), and its guests' bridge and firewall tables
//! ([`crate::net::underlay::take_back`]), and the host's IPv4 forwarding
//! when the last agent with guests goes and an agent had turned it on
//! (`state::claim`'s forwarding note). Without it a host that saw many state dirs came to
//! a device ACL of dozens of groups and dozens of empty cgroup roots: what
//! a host keeps after a year should be what its live agents need.
//!
//! The record a claim is read from is the host-wide registry's, which a
//! forged record could reach: a cgroup root that is not a plain relative
//! path, or a group of 0, is refused, not followed.

use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use super::acl;
use super::cgroup::Cgroups;
use crate::state::claim::{Claim, Reclaim, Reclaimed};

/// The devices whose ACL a VMM group is given: /dev/kvm at every boot,
/// /dev/userfaultfd at a resume.
pub const DEVICES: [&str; 2] = ["/dev/kvm", "/dev/userfaultfd"];

/// Takes back from this host's devices and cgroup hierarchies.
pub struct HostReclaim {
    devices: Vec<PathBuf>,
    /// The mounts a claim's cgroup root is under; `None`, those this
    /// host's mountinfo names (as the VMMs' cgroups were made in), and then
    /// the claim's network (bridge, firewall tables) is taken back too.
    mounts: Option<Vec<PathBuf>>,
}

impl HostReclaim {
    /// Takes back from `devices` and from this host's cgroup hierarchies.
    pub fn on(devices: Vec<PathBuf>) -> HostReclaim {
        HostReclaim {
            devices,
            mounts: None,
        }
    }

    /// Takes back from `devices` and from cgroup roots under `mounts`
    /// (for tests, on files and directories of their own).
    pub fn with(devices: Vec<PathBuf>, mounts: Vec<PathBuf>) -> HostReclaim {
        HostReclaim {
            devices,
            mounts: Some(mounts),
        }
    }

    fn roots(&self, root: &str) -> Vec<PathBuf> {
        match &self.mounts {
            Some(mounts) => mounts.iter().map(|m| m.join(root)).collect(),
            None => Cgroups::probe(root).map(|c| c.roots()).unwrap_or_default(),
        }
    }
}

impl Reclaim for HostReclaim {
    fn take_back(&self, ended: &Claim) -> Reclaimed {
        let mut out = Reclaimed::default();
        let group = ended.first_id;
        if group == 0 {
            out.left
                .push("its VMM group is 0, not an agent's: the ACLs are left as they are".into());
        } else {
            for device in self.devices.iter().filter(|d| d.exists()) {
                match acl::revoke_group(device, group) {
                    Ok(true) => out
                        .taken
                        .push(format!("group {group}'s entry on {}", device.display())),
                    Ok(false) => {}
                    Err(e) => out.left.push(format!(
                        "group {group}'s entry on {}: {e}",
                        device.display()
                    )),
                }
            }
        }
        if !plain(&ended.cgroup_root) {
            out.left.push(format!(
                "cgroup root {:?} is not a plain relative path: not followed",
                ended.cgroup_root
            ));
            return out;
        }
        for root in self.roots(&ended.cgroup_root) {
            if !root.is_dir() {
                continue;
            }
            match remove_tree(&root) {
                Ok(()) => out.taken.push(format!("cgroup {}", root.display())),
                Err(e) => out.left.push(format!("cgroup {}: {e}", root.display())),
            }
        }
        // A VMM still running keeps its guests' network: they would be cut
        // off from it.
        if let Some(network) = &ended.network
            && self.mounts.is_none()
            && out.left.is_empty()
        {
            crate::net::underlay::take_back(network, &mut out.taken, &mut out.left);
        }
        out
    }

    fn stop_forwarding(&self) -> Option<Result<(), String>> {
        // A reclaimer of test mounts leaves the host's network, as it
        // leaves its bridges and tables.
        if self.mounts.is_some() {
            return None;
        }
        let path = crate::net::underlay::IP_FORWARD;
        Some(
            fs::write(path, "0")
                .map(|()| log::info!("turned IPv4 forwarding off again ({path})"))
                .map_err(|e| format!("cannot write 0 to {path}: {e}")),
        )
    }
}

/// A path of names only: no root, no `.` or `..`, not empty.
fn plain(root: &str) -> bool {
    !root.is_empty()
        && Path::new(root)
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
}

/// Removes a cgroup and every cgroup below it, deepest first. A cgroup
/// with a process in it cannot be removed (EBUSY): that is said, and the
/// rest is left.
fn remove_tree(dir: &Path) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            remove_tree(&entry.path())?;
        }
    }
    fs::remove_dir(dir).map_err(|e| {
        if e.raw_os_error() == Some(nix::libc::EBUSY) {
            io::Error::other("processes are still in it")
        } else {
            e
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(first_id: u32, cgroup_root: &str) -> Claim {
        Claim {
            state_dir: PathBuf::from("/nowhere"),
            first_id,
            id_count: 65_536,
            cgroup_root: cgroup_root.into(),
            network: None,
        }
    }

    #[test]
    fn an_ended_claims_acl_entries_and_cgroup_root_are_taken_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let device = dir.path().join("kvm");
        fs::write(&device, b"").expect("device");
        acl::grant_group(&device, 1_900_131_072).expect("grant");
        let mount = dir.path().join("memory");
        fs::create_dir_all(mount.join("eitri-2/vm-1")).expect("cgroups");
        let reclaim = HostReclaim::with(vec![device.clone()], vec![mount.clone()]);

        let reclaimed = reclaim.take_back(&claim(1_900_131_072, "eitri-2"));

        assert_eq!(reclaimed.left, Vec::<String>::new());
        assert_eq!(reclaimed.taken.len(), 2, "{:?}", reclaimed.taken);
        assert_eq!(acl::named_groups(&device).expect("acl"), Vec::<u32>::new());
        assert!(!mount.join("eitri-2").exists());
    }

    #[test]
    fn seventy_state_dirs_claimed_and_released_leave_the_acl_as_it_was() {
        use crate::state::claim::{self, Wish};
        let host = tempfile::tempdir().expect("tempdir");
        let device = host.path().join("kvm");
        fs::write(&device, b"").expect("device");
        let mount = host.path().join("memory");
        fs::create_dir_all(&mount).expect("mount");
        let reclaim = HostReclaim::with(vec![device.clone()], vec![mount.clone()]);
        let registry = host.path().join("agents");
        let wish = Wish {
            ids: None,
            cgroup_root: None,
            default_state_dir: false,
            network: None,
        };

        for n in 0..70 {
            let state = host.path().join(format!("state-{n}"));
            fs::create_dir_all(&state).expect("state dir");
            let files = claim::Files {
                state_dir: &state,
                registry: &registry,
            };
            let c = claim::settle(files, &wish, &reclaim).expect("claimed");
            // What its agent does at a boot: its group on the device, its
            // VM's cgroup under its root.
            acl::give_group_read_write(&device, c.first_id).expect("granted");
            fs::create_dir_all(mount.join(&c.cgroup_root).join("vm-1")).expect("cgroup");
            claim::release(files, &reclaim).expect("released");
        }

        assert_eq!(acl::named_groups(&device).expect("acl"), Vec::<u32>::new());
        assert_eq!(fs::read_dir(&mount).expect("mount").count(), 0);
    }

    #[test]
    fn a_cgroup_root_that_climbs_out_is_not_followed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mount = dir.path().join("memory");
        fs::create_dir_all(&mount).expect("mount");
        let outside = dir.path().join("precious");
        fs::create_dir_all(&outside).expect("outside");
        let reclaim = HostReclaim::with(vec![], vec![mount]);

        let reclaimed = reclaim.take_back(&claim(1_900_131_072, "../precious"));

        assert!(
            outside.exists(),
            "a forged root removed a directory outside"
        );
        assert_eq!(reclaimed.left.len(), 1, "{reclaimed:?}");
    }

    #[test]
    fn group_zero_is_never_taken_off_a_device() {
        let dir = tempfile::tempdir().expect("tempdir");
        let device = dir.path().join("kvm");
        fs::write(&device, b"").expect("device");
        acl::grant_group(&device, 0).expect("grant");
        let reclaim = HostReclaim::with(vec![device.clone()], vec![]);

        let reclaimed = reclaim.take_back(&claim(0, "eitri-2"));

        assert_eq!(acl::named_groups(&device).expect("acl"), [0]);
        assert_eq!(reclaimed.left.len(), 1, "{reclaimed:?}");
    }
}
