//! The VMM's jail, apart from any hypervisor: a guest that breaks out into
//! its VMM must find itself an unprivileged user that can touch its own
//! VM's files and nothing else of the host's (the threat model in the
//! crate's docs). Nothing here knows cloud-hypervisor: a backend hands in
//! a plan — the program and its arguments, the fds it inherits, its
//! [`Jail`] (ids, limits, cgroups, the [`view::Visible`] paths it may see)
//! — and [`fork::start`] hands back a started, confined process. A second
//! Linux hypervisor takes the jail whole (`tests/layers.rs` holds it to
//! importing no backend).
//!
//! - **Its own user and group**, one per VM, from the operator's range
//!   (`--vmm-ids FIRST:COUNT`): FIRST is the group every VMM is in so it may
//!   open /dev/kvm (see [`acl`]); each VM's id is one of the
//!   others, chosen from its VM id, persisted in `STATE_DIR/jail/ids.json`
//!   and so the same after a restart, released at destroy.
//! - **No capabilities, no_new_privs, limits** (open files, its own
//!   processes, the largest file it may write, no core dumps), entered in
//!   the held child just before it execs (see [`fork`]).
//! - **Its files and nothing more** (see [`view`]): a mount namespace
//!   holding only the paths it is given; the files it writes are made its
//!   own before it starts; the directories above them stay root's
//!   (searchable, not writable), so it can neither list nor replace
//!   anything. Its API socket and taps are fds the agent opened and
//!   passed in.
//! - **Its cgroups** (see [`cgroup`]), its own network namespace (see
//!   [`netns`]), and the paths it must reach checked before any VM starts
//!   (see [`paths`]); what the host lacks of all this is a [`Lack`].

pub mod acl;
pub mod cgroup;
mod child;
mod error;
pub mod fork;
pub mod lack;
pub mod netns;
pub mod paths;
mod plan;
pub mod reclaim;
pub mod view;

use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::libc;

use self::cgroup::{Cgroups, Limits};
pub use self::error::JailError;
use self::fork::{Jail, Limit};
pub use self::lack::Lack;
pub use self::plan::{Plan, Prepared};
use crate::model::{Id, VmLimits, VmSpec};
use crate::provision::{Confinement, Piece};
use crate::state::Layout;
use crate::state::atomic::Pending;
use crate::state::leases::{LeaseError, Leases};

/// Open files a VMM may hold: its disks, queues, event fds and sockets.
const FILES: u64 = 4096;

/// [`FILES`], or the agent's own hard limit when lower: the VMM's child
/// sets both its limits without the right to raise the hard one, and an
/// agent run under a hard limit below it would start no VMM at all.
fn files() -> u64 {
    use nix::sys::resource::{Resource, getrlimit};
    getrlimit(Resource::RLIMIT_NOFILE).map_or(FILES, |(_, hard)| FILES.min(hard))
}

/// The VMM ids of this host, persisted.
pub struct VmmIds {
    /// The group that may open /dev/kvm; no VM's id.
    pub kvm_group: u32,
    leases: Leases<u32>,
}

impl VmmIds {
    /// The ids kept in `path` (the state dir's `jail/ids.json`, see
    /// [`Layout::vmm_ids`](crate::state::Layout::vmm_ids)).
    pub fn open(path: &Path, first: u32, count: u32) -> Result<VmmIds, LeaseError> {
        Ok(VmmIds {
            kvm_group: first,
            leases: Leases::open(path, first.saturating_add(1), count.saturating_sub(1))?,
        })
    }

    /// The VM's own id (user and group): the one it has, or a new one.
    pub fn of(&self, vm_id: &Id) -> Result<u32, LeaseError> {
        self.leases.allocate(vm_id.as_str(), vm_id.as_str())
    }

    /// As [`VmmIds::of`], its name left for the caller to make durable
    /// (see [`Leases::reserve`](crate::state::leases::Leases::reserve)).
    pub fn reserve(&self, vm_id: &Id) -> Result<(u32, Pending), LeaseError> {
        self.leases.reserve(vm_id.as_str(), vm_id.as_str())
    }

    /// The VM's id if it has one.
    pub fn get(&self, vm_id: &Id) -> Option<u32> {
        self.leases.get(vm_id.as_str())
    }

    pub fn release(&self, vm_id: &Id) -> Result<(), LeaseError> {
        self.leases.release(vm_id.as_str())
    }

    /// The VMs holding an id.
    pub fn holders(&self) -> Vec<Id> {
        self.leases.vm_ids()
    }
}

/// The jail the VM's VMM enters: `id` as user and group, the KVM group,
/// and limits sized for the VM, the largest of its disks (`largest_disk`
/// bytes) among them: no file it writes can grow past that, so a VMM its
/// guest took over cannot grow a disk, a volume or a log to fill the
/// state dir's filesystem. (A limit per file is not to be had; this bounds
/// each.) Its serial file's offset only grows (the backend bounds its
/// blocks by punching holes): a guest that prints
/// more than that in one boot loses the rest of its output, which the
/// VMM drops (it ignores the EFBIG), not the VMM itself.
pub fn jail_for(spec: &VmSpec, id: u32, kvm_group: u32, largest_disk: u64) -> Jail {
    Jail {
        uid: id,
        gid: id,
        groups: vec![kvm_group],
        limits: vec![
            (Limit::Files, files()),
            (Limit::Processes, max_threads(spec.vcpus)),
            (Limit::Core, 0),
            (Limit::FileSize, largest_disk.max(MIN_FILE_SIZE)),
        ],
        view: None,
    }
}

/// The file-size limit's floor: room for a serial log of any sane boot
/// however small the disks.
const MIN_FILE_SIZE: u64 = 1 << 30;

/// Memory a VMM may use beyond its guest's: its own (about 10 MB resident
/// for a real cloud-hypervisor running the tiny test guest, read from its
/// /proc status), page tables, device buffers.
pub const VMM_OVERHEAD_BYTES: u64 = 256 << 20;

/// The cgroup limits of the VM's VMM, its CPU cap from `limits` (those in
/// force, see [`VmLimits::in_force`]).
pub fn cgroup_limits(spec: &VmSpec, limits: &VmLimits) -> Limits {
    let per_period = |millis: u32| u64::from(millis) * cgroup::CPU_PERIOD_US / 1000;
    Limits {
        memory_bytes: (spec.mem_mb << 20).saturating_add(VMM_OVERHEAD_BYTES),
        pids: max_threads(spec.vcpus),
        vcpus: spec.vcpus,
        cpu_quota_us: (limits.cpu_max_millis != 0).then(|| per_period(limits.cpu_max_millis)),
        cpu_burst_us: u64::from(limits.cpu_burst_ms) * 1000,
    }
}

/// A VMM's threads: one per vCPU, and a bounded number for its devices,
/// API and signals.
pub fn max_threads(vcpus: u32) -> u64 {
    64 + 2 * u64::from(vcpus)
}

/// Makes `paths` the VMM's own (owner `id`, mode 0600), creating the
/// files that do not exist yet. Never follows a symlink: a file the VM's
/// last VMM could write is not trusted to be what its name says. A file
/// that is the VMM's already is left untouched, its ctime too: a
/// snapshot knows its disks by it, and a restore whose guest never ran
/// must leave them as the snapshot found them.
pub fn give(paths: &[PathBuf], id: u32) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    for path in paths {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(crate::state::perms::FILE)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
            .open(path)?;
        let meta = file.metadata()?;
        if !meta.is_file() {
            return Err(std::io::Error::other(format!(
                "{} is not a regular file",
                path.display()
            )));
        }
        if (meta.uid(), meta.gid()) != (id, id) {
            std::os::unix::fs::fchown(&file, Some(id), Some(id))?;
        }
        if meta.mode() & 0o7777 != crate::state::perms::FILE {
            file.set_permissions(std::fs::Permissions::from_mode(crate::state::perms::FILE))?;
        }
    }
    Ok(())
}

/// What this host can do of each VMM's confinement, probed once at start.
pub struct Confined {
    /// The VMM ids, or why VMMs cannot be jailed here.
    pub ids: Result<VmmIds, Lack>,
    /// Whether the kernel has Landlock, or why not.
    pub landlock: Result<(), Lack>,
    /// The cgroup hierarchies, or why there are none.
    pub cgroups: Result<Cgroups, Lack>,
    allowed: Vec<Piece>,
    /// The KVM device the jailed VMMs' group is given.
    kvm: PathBuf,
}

impl Confined {
    pub fn probe(cfg: &Confinement, state_dir: &Path) -> Confined {
        let ids = if !nix::unistd::geteuid().is_root() {
            Err(Lack::NotRoot)
        } else {
            VmmIds::open(
                &Layout::new(state_dir).vmm_ids(),
                cfg.first_id,
                cfg.id_count,
            )
            .map_err(Lack::Ids)
        };
        Confined {
            ids,
            landlock: landlock_abi().map(drop),
            cgroups: Cgroups::probe(&cfg.cgroup_root),
            allowed: cfg.allow_without.clone(),
            kvm: cfg.kvm.clone(),
        }
    }

    /// Whether `piece` is used: `Ok(true)` when the host has it,
    /// `Ok(false)` when it lacks it and the operator allowed that, else
    /// the refusal.
    pub fn uses(&self, piece: Piece) -> Result<bool, JailError> {
        let Some(why) = self.why(piece) else {
            return Ok(true);
        };
        if self.allowed.contains(&piece) {
            Ok(false)
        } else {
            Err(JailError::Unconfinable {
                piece: piece.name(),
                why: why.to_string(),
            })
        }
    }

    /// What an operator should know: each piece this host lacks, and
    /// whether VMMs run without it or cannot start.
    pub fn notes(&self) -> Vec<String> {
        Piece::ALL
            .into_iter()
            .filter_map(|piece| match self.uses(piece) {
                Ok(true) => None,
                Ok(false) => Some(format!(
                    "hypervisors run without {} (--allow-without {0}): {}",
                    piece.name(),
                    self.why(piece).map(Lack::to_string).unwrap_or_default()
                )),
                Err(e) => Some(format!("no hypervisor can start: {e}")),
            })
            .collect()
    }

    /// Why the host lacks `piece`; `None` when it has it.
    fn why(&self, piece: Piece) -> Option<&Lack> {
        match piece {
            Piece::Jail => self.ids.as_ref().err(),
            Piece::Landlock => self.landlock.as_ref().err(),
            Piece::Cgroups => self.cgroups.as_ref().err(),
        }
    }

    /// The VMM ids, `None` when VMMs run unjailed.
    pub fn jail(&self) -> Result<Option<&VmmIds>, JailError> {
        Ok(if self.uses(Piece::Jail)? {
            self.ids.as_ref().ok()
        } else {
            None
        })
    }

    /// The cgroups VMMs are put in, `None` when they run without.
    pub fn cgroups(&self) -> Result<Option<&Cgroups>, JailError> {
        Ok(if self.uses(Piece::Cgroups)? {
            self.cgroups.as_ref().ok()
        } else {
            None
        })
    }
}

/// The kernel's Landlock ABI version, or why there is none.
pub fn landlock_abi() -> Result<i64, Lack> {
    const CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: with a null attribute pointer and size 0, this only asks the
    // kernel for its ABI version; nothing is read or written.
    let abi = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            CREATE_RULESET_VERSION,
        )
    };
    if abi > 0 {
        Ok(abi)
    } else {
        Err(Lack::NoLandlock(std::io::Error::last_os_error()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host that cannot jail and has no cgroups, but has Landlock.
    pub(super) fn lacking(allowed: Vec<Piece>) -> Confined {
        Confined {
            ids: Err(Lack::NotRoot),
            landlock: Ok(()),
            cgroups: Err(Lack::NoController("pids")),
            allowed,
            kvm: PathBuf::from("/dev/kvm"),
        }
    }

    #[test]
    fn a_missing_piece_stops_boots_naming_the_flag_unless_allowed() {
        let strict = lacking(vec![]);
        let lenient = lacking(vec![Piece::Jail, Piece::Cgroups]);

        let refused = strict.uses(Piece::Jail).expect_err("refused");

        assert!(
            refused.to_string().contains("--allow-without jail"),
            "{refused}"
        );
        assert!(matches!(lenient.uses(Piece::Jail), Ok(false)));
        assert!(matches!(lenient.uses(Piece::Cgroups), Ok(false)));
        assert!(matches!(strict.uses(Piece::Landlock), Ok(true)));
    }

    #[test]
    fn every_missing_piece_is_a_note_saying_what_follows() {
        let strict = lacking(vec![]).notes();
        let lenient = lacking(vec![Piece::Jail, Piece::Cgroups]).notes();

        assert_eq!(strict.len(), 2, "{strict:?}");
        assert!(
            strict
                .iter()
                .all(|n| n.starts_with("no hypervisor can start")),
            "{strict:?}"
        );
        assert_eq!(lenient.len(), 2, "{lenient:?}");
        assert!(
            lenient
                .iter()
                .all(|n| n.starts_with("hypervisors run without")),
            "{lenient:?}"
        );
    }
}
