//! The cloud-hypervisor backend's errors: each names the VM, the file or
//! process it is about, and keeps its cause as a source, so the report and
//! the log read "VM web-1: cannot open its tap eitri3fa2c9: Device or
//! resource busy" and a caller can still ask what the cause was.
//! Permanence (no retry can succeed) is asked through [`Failure`].

use crate::error::{Failure, Kind};
use crate::model::Id;
use crate::provision::supervise::SuperviseError;
use std::fmt;
use std::io;
use std::path::PathBuf;

#[derive(Debug)]
pub enum CloudHvError {
    // ── whether this host can run guests at all (preflight) ──────────────
    /// The configured hypervisor is not an executable file.
    NotExecutable {
        path: PathBuf,
    },
    /// `--version` named a release older than the backend drives.
    TooOld {
        path: PathBuf,
        banner: String,
        min: u32,
        /// What the agent needs of that release.
        why: &'static str,
    },
    /// `--version` could not be asked.
    Version {
        path: PathBuf,
        source: io::Error,
    },
    Kvm {
        source: io::Error,
    },
    NoTun,
    /// The jail refuses (a piece of confinement the host lacks).
    Jail(crate::provision::jail::JailError),
    /// `--kernel` or `--firmware` names no file.
    BootFileMissing {
        path: PathBuf,
    },
    /// A path the jailed VMMs are given cannot be reached by their users:
    /// `blocked` is the first directory (or the file) that stops them.
    Unreachable {
        path: PathBuf,
        blocked: crate::provision::jail::paths::Blocked,
        /// What to change instead of the mode: the flag naming the path.
        flag: &'static str,
    },
    NoBootFile,

    // ── one VM ────────────────────────────────────────────────────────────
    /// Processes its VMM left (it forked them) outlived every kill: the
    /// cgroup, and the VM's uid, stay held until they are gone.
    Leftovers {
        vm_id: Id,
        source: crate::provision::jail::cgroup::Held,
    },
    /// What its VMM needs to see could not be listed (the binary's
    /// libraries, its kernel or firmware, its disks: one is missing, or a
    /// path of them is not plain).
    Needs {
        vm_id: Id,
        source: io::Error,
    },
    /// What its previous VMM wrote could not be moved aside.
    KeepLogs {
        vm_id: Id,
        source: io::Error,
    },
    /// Its API socket could not be bound.
    ApiSocket {
        vm_id: Id,
        path: PathBuf,
        source: io::Error,
    },
    OpenTap {
        vm_id: Id,
        tap: String,
        source: io::Error,
    },
    /// Its memory is no whole number of the huge pages guests are given
    /// on this host (`--guest-hugepages`).
    HugePageSize {
        vm_id: Id,
        mem_mb: u64,
    },
    /// The host's huge page pool has too few pages left for its memory.
    HugePages {
        vm_id: Id,
        need: u64,
        available: u64,
    },
    /// The host's huge page pool could not be read.
    HugePagePool {
        source: io::Error,
    },
    /// The spec's second NIC names a network this host does not serve.
    NetworkNotServed {
        vm_id: Id,
        network: String,
    },
    OpenLog {
        vm_id: Id,
        path: PathBuf,
        source: io::Error,
    },
    Start {
        vm_id: Id,
        program: PathBuf,
        source: io::Error,
    },
    Pidfile {
        vm_id: Id,
        path: PathBuf,
        source: io::Error,
    },
    /// The thread joining the VM's taps to the host's networks panicked.
    /// No VMM of the VM runs (to suspend).
    NotRunning {
        vm_id: Id,
    },
    /// A step of a suspend or a resume failed: what it was `doing`, and why.
    Suspension {
        vm_id: Id,
        doing: &'static str,
        why: String,
    },
    /// A helper thread of the VM's boot panicked (a bug): what it was
    /// `doing`, and its panic's message.
    Panicked {
        vm_id: Id,
        doing: &'static str,
        why: crate::threads::Panicked,
    },
    RemoveTap {
        vm_id: Id,
        tap: String,
        source: io::Error,
    },
    RemoveVsock {
        vm_id: Id,
        dir: std::path::PathBuf,
        source: io::Error,
    },
    /// The vsock directory could not be taken back from its VMM once it
    /// bound its socket (the VMM was stopped).
    CloseVsock {
        vm_id: Id,
        dir: std::path::PathBuf,
        source: io::Error,
    },
    /// What every backend's supervision can fail at.
    Supervise(SuperviseError),
}

impl From<SuperviseError> for CloudHvError {
    fn from(e: SuperviseError) -> CloudHvError {
        CloudHvError::Supervise(e)
    }
}

impl From<crate::provision::jail::JailError> for CloudHvError {
    fn from(e: crate::provision::jail::JailError) -> CloudHvError {
        CloudHvError::Jail(e)
    }
}

impl fmt::Display for CloudHvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use CloudHvError as E;
        match self {
            E::NotExecutable { path } => write!(
                f,
                "the hypervisor {} is not an executable file; install cloud-hypervisor v{} or later, or point --hypervisor at it",
                path.display(),
                super::MIN_VERSION
            ),
            E::TooOld {
                path,
                banner,
                min,
                why,
            } => write!(
                f,
                "{} reports version {banner:?}; this agent needs cloud-hypervisor v{min} or later ({why})",
                path.display()
            ),
            E::Version { path, .. } => {
                write!(f, "cannot ask {} its version", path.display())
            }
            E::Kvm { .. } => f.write_str(
                "cannot open /dev/kvm read-write; load kvm_intel or kvm_amd and give the agent access to it",
            ),
            E::NoTun => f.write_str("/dev/net/tun is missing; load the tun module (modprobe tun)"),
            E::HugePageSize { vm_id, mem_mb } => odd_huge_page_size(f, vm_id, *mem_mb),
            E::HugePages {
                vm_id,
                need,
                available,
            } => pool_short(f, vm_id, *need, *available),
            E::HugePagePool { .. } => f.write_str(
                "cannot read this host's 2 MiB huge page pool (/sys/kernel/mm/hugepages/hugepages-2048kB)",
            ),
            E::Jail(e) => e.fmt(f),
            E::Needs { vm_id, .. } => write!(
                f,
                "VM {vm_id}: cannot list the files its hypervisor needs (its binary's libraries, its kernel or firmware, its disks)"
            ),
            E::Leftovers { vm_id, .. } => write!(
                f,
                "VM {vm_id}: processes its hypervisor started outlive it; they are killed again at the next try"
            ),
            E::ApiSocket { vm_id, path, .. } => {
                write!(f, "VM {vm_id}: cannot bind its API socket {}", path.display())
            }
            E::KeepLogs { vm_id, .. } => write!(
                f,
                "VM {vm_id}: cannot move its previous console and hypervisor log aside"
            ),
            E::BootFileMissing { path } => write!(
                f,
                "the guest boot file {} does not exist; fix --kernel or --firmware",
                path.display()
            ),
            E::Unreachable {
                path,
                blocked,
                flag,
            } => write!(
                f,
                "the jailed hypervisors cannot reach {}: {blocked}; {}, or move {flag}",
                path.display(),
                blocked.fix()
            ),
            E::NoBootFile => {
                f.write_str("no guest kernel or firmware is configured; give --kernel or --firmware")
            }
            E::OpenTap { vm_id, tap, .. } => write!(f, "VM {vm_id}: cannot open its tap {tap}"),
            E::NetworkNotServed { vm_id, network } => write!(
                f,
                "VM {vm_id}: host network {network:?} is not served on this host; add it with --host-network {network}=BRIDGE"
            ),
            E::OpenLog { vm_id, path, .. } => {
                write!(f, "VM {vm_id}: cannot open its log {}", path.display())
            }
            E::Start { vm_id, program, .. } => {
                write!(f, "VM {vm_id}: cannot start {}", program.display())
            }
            E::Pidfile { vm_id, path, .. } => {
                write!(f, "VM {vm_id}: cannot write its pidfile {}", path.display())
            }
            E::NotRunning { vm_id } => write!(f, "VM {vm_id}: its hypervisor is not running"),
            E::Suspension { vm_id, doing, why } => {
                write!(f, "VM {vm_id}: cannot {doing}: {why}")
            }
            E::Panicked { vm_id, doing, why } => write!(
                f,
                "VM {vm_id}: {doing} failed inside the agent (a bug: {why}; see the agent's log)"
            ),
            E::RemoveTap { vm_id, tap, .. } => write!(f, "VM {vm_id}: cannot remove tap {tap}"),
            E::RemoveVsock { vm_id, dir, .. } => vsock_dir(f, vm_id, dir, "remove", ""),
            E::CloseVsock { vm_id, dir, .. } => vsock_dir(f, vm_id, dir, "take back", STOPPED),
            E::Supervise(e) => e.fmt(f),
        }
    }
}

/// What [`CloudHvError::CloseVsock`] did about it.
const STOPPED: &str = " from its hypervisor (it was stopped)";

/// [`CloudHvError::RemoveVsock`]'s and [`CloudHvError::CloseVsock`]'s
/// words: what could not be `done` to the directory, and what came of it.
fn vsock_dir(
    f: &mut fmt::Formatter<'_>,
    vm_id: &Id,
    dir: &std::path::Path,
    done: &str,
    then: &str,
) -> fmt::Result {
    write!(
        f,
        "VM {vm_id}: cannot {done} its vsock directory {}{then}",
        crate::quote::path(dir)
    )
}

/// [`CloudHvError::HugePageSize`]'s words.
fn odd_huge_page_size(f: &mut fmt::Formatter<'_>, vm_id: &Id, mem_mb: u64) -> fmt::Result {
    write!(
        f,
        "VM {vm_id}: {mem_mb} MiB of memory is no whole number of the 2 MiB huge pages this host backs guests with (--guest-hugepages); ask for {} or {} MiB",
        mem_mb - 1,
        mem_mb + 1
    )
}

/// [`CloudHvError::HugePages`]'s words.
fn pool_short(f: &mut fmt::Formatter<'_>, vm_id: &Id, need: u64, available: u64) -> fmt::Result {
    write!(
        f,
        "VM {vm_id}: its memory needs {need} huge pages of 2 MiB and this host's pool has {available} left; raise vm.nr_hugepages, or lower --max-mem-mb if something besides the agent's guests uses the pool"
    )
}

impl std::error::Error for CloudHvError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        use CloudHvError as E;
        match self {
            E::Kvm { source }
            | E::ApiSocket { source, .. }
            | E::KeepLogs { source, .. }
            | E::Needs { source, .. }
            | E::OpenTap { source, .. }
            | E::OpenLog { source, .. }
            | E::Start { source, .. }
            | E::Pidfile { source, .. }
            | E::RemoveTap { source, .. }
            | E::RemoveVsock { source, .. }
            | E::CloseVsock { source, .. }
            | E::HugePagePool { source }
            | E::Version { source, .. } => Some(source),
            E::Leftovers { source, .. } => Some(source),
            // Transparent: the wrapped error's own message is this one's.
            E::Supervise(e) => e.source(),
            E::Jail(e) => e.source(),
            E::NotExecutable { .. }
            | E::TooOld { .. }
            | E::NoTun
            | E::BootFileMissing { .. }
            | E::Unreachable { .. }
            | E::NoBootFile
            | E::NetworkNotServed { .. }
            | E::HugePageSize { .. }
            | E::HugePages { .. }
            // Its message is in this one's words.
            | E::Panicked { .. }
            | E::NotRunning { .. }
            | E::Suspension { .. } => None,
        }
    }
}

impl CloudHvError {
    /// Which kind of failure this is, in one exhaustive match:
    /// - permanent: a network this host does not serve; no retry of the
    ///   same spec can succeed;
    /// - a host condition: what this host lacks (a hypervisor, its
    ///   version, a device, a boot file, a piece of confinement, a path its
    ///   jailed user can reach), which passes once the host is fixed;
    /// - transient: about a moment (a busy tap, a VMM that crashed, a full
    ///   disk).
    fn kind(&self) -> Kind {
        use CloudHvError as E;
        match self {
            E::NetworkNotServed { .. } | E::HugePageSize { .. } => Kind::Permanent,
            E::NotExecutable { .. }
            | E::TooOld { .. }
            | E::Kvm { .. }
            | E::NoTun
            | E::BootFileMissing { .. }
            | E::NoBootFile
            | E::HugePages { .. }
            | E::HugePagePool { .. }
            | E::Unreachable { .. } => Kind::Host,
            E::Version { .. }
            | E::ApiSocket { .. }
            | E::KeepLogs { .. }
            | E::Needs { .. }
            | E::Leftovers { .. }
            | E::OpenTap { .. }
            | E::OpenLog { .. }
            | E::Start { .. }
            | E::Pidfile { .. }
            | E::Panicked { .. }
            | E::NotRunning { .. }
            | E::Suspension { .. }
            | E::RemoveTap { .. }
            | E::RemoveVsock { .. }
            | E::CloseVsock { .. } => Kind::Transient,
            // What the host lacks is the host's; the rest (a full disk
            // under the VM's files, a busy cgroup) is about a moment.
            E::Jail(e) if e.is_host_condition() => Kind::Host,
            E::Jail(_) => Kind::Transient,
            E::Supervise(e) if e.is_permanent() => Kind::Permanent,
            E::Supervise(e) if e.is_host_condition() => Kind::Host,
            E::Supervise(_) => Kind::Transient,
        }
    }
}

impl Failure for CloudHvError {
    fn is_permanent(&self) -> bool {
        self.kind() == Kind::Permanent
    }

    fn is_host_condition(&self) -> bool {
        self.kind() == Kind::Host
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::chain;

    fn vm() -> Id {
        Id::parse("web-1").expect("id")
    }

    #[test]
    fn a_cause_is_kept_as_the_source_not_flattened() {
        let err = CloudHvError::OpenTap {
            vm_id: vm(),
            tap: "eitri3fa2c9".into(),
            source: io::Error::from_raw_os_error(16),
        };

        assert_eq!(err.to_string(), "VM web-1: cannot open its tap eitri3fa2c9");
        assert!(std::error::Error::source(&err).is_some());
        assert!(
            chain(&err).ends_with("Device or resource busy (os error 16)"),
            "{}",
            chain(&err)
        );
    }

    #[test]
    fn a_jail_failure_is_the_hosts_only_where_the_host_lacks_something() {
        use crate::provision::jail::JailError;
        let unconfinable = CloudHvError::from(JailError::Unconfinable {
            piece: "jail",
            why: "not root".into(),
        });
        let full_disk = CloudHvError::from(JailError::GiveFiles {
            vm_id: vm(),
            source: io::Error::from(io::ErrorKind::StorageFull),
        });

        assert!(unconfinable.is_host_condition());
        assert!(!full_disk.is_host_condition());
        assert!(!full_disk.is_permanent());
    }

    #[test]
    fn an_unserved_network_is_permanent_and_a_busy_tap_is_not() {
        let unserved = CloudHvError::NetworkNotServed {
            vm_id: vm(),
            network: "lab".into(),
        };
        let busy = CloudHvError::OpenTap {
            vm_id: vm(),
            tap: "t".into(),
            source: io::Error::from_raw_os_error(16),
        };

        assert!(unserved.is_permanent());
        assert!(!busy.is_permanent());
    }

    #[test]
    fn a_missing_hypervisor_is_the_hosts_to_fix_not_the_specs() {
        let missing = CloudHvError::NotExecutable {
            path: "/usr/bin/cloud-hypervisor".into(),
        };

        assert!(missing.is_host_condition());
        assert!(!missing.is_permanent());
    }
}
