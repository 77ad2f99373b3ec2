//! What tests that start real processes share of the host: the VMMs'
//! confinement and ids, test cgroup roots and their removal, and what a
//! signal or a crash of the test leaves behind, taken back.

use std::path::{Path, PathBuf};
#[cfg(target_os = "linux")]
use std::time::Duration;

#[cfg(target_os = "linux")]
use crate::model::Id;

/// Confinement for tests that start hypervisors: every piece on, with a
/// KVM device stand-in (a root-only file under `dir`) so the grant to the
/// hypervisors' group never touches the host's /dev/kvm, and a cgroup root
/// of the test's own.
pub fn confinement(dir: &std::path::Path) -> crate::provision::Confinement {
    use std::os::unix::fs::PermissionsExt;
    let kvm = dir.join("kvm");
    if !kvm.exists() {
        let _ = std::fs::write(&kvm, b"");
        let _ = std::fs::set_permissions(&kvm, std::fs::Permissions::from_mode(0o600));
    }
    #[cfg(target_os = "linux")]
    {
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(|| {
            sweep_stale_test_roots();
            end_when_signalled(format!("{TEST_ROOT_PREFIX}{}", std::process::id()));
        });
    }
    // A root-only file of the test's own, like its KVM device: no test
    // changes the host's device's ACL (the stand-in faults nothing in).
    let userfaultfd = dir.join("userfaultfd");
    if !userfaultfd.exists() {
        let _ = std::fs::write(&userfaultfd, b"");
        let _ = std::fs::set_permissions(&userfaultfd, std::fs::Permissions::from_mode(0o600));
    }
    crate::provision::Confinement {
        kvm,
        userfaultfd: Some(userfaultfd),
        cgroup_root: format!("{TEST_ROOT_PREFIX}{}", std::process::id()),
        // VMM users of this process's own, as each agent takes its own
        // from the host's registry: a test's VMMs are told apart from
        // another's running beside it by their user too.
        first_id: test_vmm_ids().0,
        id_count: test_vmm_ids().1,
        ..crate::provision::Confinement::default()
    }
}

/// This test process's VMM ids (first, count): its own range, below an
/// agent's default (1.9e9 up), so a test's VMMs are told apart from
/// another's by their user, and the ACL entry its group gets on a host's
/// device is its own to take back.
pub fn test_vmm_ids() -> (u32, u32) {
    (
        TEST_FIRST_ID + (std::process::id() % (1 << 20)) * TEST_ID_COUNT,
        TEST_ID_COUNT,
    )
}

/// Where the test processes' VMM users begin: below an agent's default
/// range (1.9e9 up) at any pid.
const TEST_FIRST_ID: u32 = 200_000_000;
/// How many VMM users each test process has (a bench's bursts included).
const TEST_ID_COUNT: u32 = 1024;

/// A test's cgroup root is this and its process's pid.
const TEST_ROOT_PREFIX: &str = "eitri-test-";

/// Removes a test's cgroup root (see [`confinement`]) from every
/// hierarchy, with the empty VM cgroups left in it. What a VM still runs
/// in stays: tests of one process share the root (`cargo test` runs them
/// as threads), so one test's end must not end another's VMMs.
#[cfg(target_os = "linux")]
pub fn remove_cgroup_root(root: &str) {
    clear_cgroup_root(root, false);
}

/// `vm`'s cgroup file `name` under `root`, trimmed, from whichever
/// hierarchy has it.
#[cfg(target_os = "linux")]
pub fn cgroup_file(root: &str, vm: &Id, name: &str) -> Option<String> {
    let cgroups = crate::provision::jail::cgroup::Cgroups::probe(root).ok()?;
    cgroups
        .dirs(vm)
        .iter()
        .find_map(|d| std::fs::read_to_string(d.join(name)).ok())
        .map(|v| v.trim().to_owned())
}

/// Ends a cgroup root whose whole process is over (a benchmark's end, its
/// ^C, a gone run's root): every process still in it killed, then every
/// cgroup of it removed.
#[cfg(target_os = "linux")]
pub fn end_cgroup_root(root: &str) {
    clear_cgroup_root(root, true);
}

#[cfg(target_os = "linux")]
fn clear_cgroup_root(root: &str, kill: bool) {
    let Ok(cgroups) = crate::provision::jail::cgroup::Cgroups::probe(root) else {
        return;
    };
    for dir in cgroups.roots() {
        let vms: Vec<PathBuf> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        for vm in &vms {
            if kill {
                let deadline = crate::deadline::Deadline::after(Duration::from_secs(2));
                let _ = crate::provision::jail::cgroup::kill_until_empty(vm, deadline);
            }
            let _ = std::fs::remove_dir(vm);
        }
        let _ = std::fs::remove_dir(&dir);
    }
}

/// On ^C or a TERM, this process exits and a reaper it leaves behind ends
/// every process in the cgroups under `root` once this one is gone, then
/// removes the temp dirs given to [`remove_on_signal`].
///
/// The hypervisors run in sessions of their own, so the signal that ends
/// a test or a benchmark never reaches them; and killing them from here
/// would race the engine's own threads, which go on creating, restarting
/// and spawning until the process is gone (an interrupted real-hypervisor
/// bench left two VMMs that way). After this process's death nothing of
/// it spawns any more, so the reaper's passes end: one VMM whose spawn was
/// in flight lands in its cgroup before it execs, and the next pass has
/// it. A `sh` script, not code of this process: it must outlive it.
#[cfg(target_os = "linux")]
pub fn end_when_signalled(root: String) {
    LEFT_ON_SIGNAL.lock().roots.push(root);
    clean_up_when_signalled();
}

/// Has `dir` (a test's or a benchmark's temp dir) removed when ^C or a
/// TERM ends this process before its own clean-up runs (a benchmark's
/// image and disks are tens of MB): the reaper [`end_when_signalled`]
/// leaves removes it, after the VMMs that may still write there are gone.
pub fn remove_on_signal(dir: &Path) {
    LEFT_ON_SIGNAL.lock().dirs.push(dir.to_path_buf());
    clean_up_when_signalled();
}

/// What the reaper ends and removes if a signal ends this process.
#[derive(Default)]
struct LeftOnSignal {
    /// Cgroup roots: there are none to end off Linux.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    roots: Vec<String>,
    dirs: Vec<PathBuf>,
}

static LEFT_ON_SIGNAL: parking_lot::Mutex<LeftOnSignal> = parking_lot::Mutex::new(LeftOnSignal {
    roots: Vec::new(),
    dirs: Vec::new(),
});

/// Once per process: a thread that, at ^C or a TERM, leaves the reaper
/// and exits as the signal would have.
fn clean_up_when_signalled() {
    static WATCHING: std::sync::Once = std::sync::Once::new();
    WATCHING.call_once(|| {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM]) else {
            return;
        };
        let _ = std::thread::Builder::new()
            .name("end-when-signalled".into())
            .spawn(move || {
                if let Some(signal) = signals.forever().next() {
                    leave_a_reaper(&LEFT_ON_SIGNAL.lock());
                    std::process::exit(128 + signal);
                }
            });
    });
}

/// Waits for this process to be gone, then kills what runs in the VM
/// cgroups of the roots (before `--`) until a pass finds none (at most
/// 5 s), removes those cgroups, and removes the temp dirs (after `--`).
const REAPER: &str = r#"
pid=$1; shift
roots=
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do roots="$roots $1"; shift; done
[ "$#" -gt 0 ] && shift
while [ -d "/proc/$pid" ]; do sleep 0.01; done
pass=0
while [ "$pass" -lt 500 ]; do
    found=
    for procs in $(for root in $roots; do echo "$root"/*/cgroup.procs; done); do
        [ -f "$procs" ] || continue
        for victim in $(cat "$procs"); do
            kill -9 "$victim" 2>/dev/null
            found=1
        done
    done
    [ -z "$found" ] && break
    sleep 0.01
    pass=$((pass + 1))
done
for root in $roots; do
    for vm in "$root"/*/; do [ -d "$vm" ] && rmdir "$vm" 2>/dev/null; done
    rmdir "$root" 2>/dev/null
done
for dir in "$@"; do rm -rf -- "$dir"; done
exit 0
"#;

fn leave_a_reaper(left: &LeftOnSignal) {
    use std::os::unix::process::CommandExt;
    #[cfg(target_os = "linux")]
    let roots: Vec<PathBuf> = left
        .roots
        .iter()
        .filter_map(|root| crate::provision::jail::cgroup::Cgroups::probe(root).ok())
        .flat_map(|cgroups| cgroups.roots())
        .collect();
    #[cfg(not(target_os = "linux"))]
    let roots: Vec<PathBuf> = Vec::new();
    let _ = std::process::Command::new("sh")
        .arg("-c")
        .arg(REAPER)
        .arg("eitri-reaper")
        .arg(std::process::id().to_string())
        .args(roots)
        .arg("--")
        .args(left.dirs.iter().filter(|d| d.exists()))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn();
}

/// Ends the cgroup roots of earlier test and benchmark processes that are
/// gone (killed, interrupted with ^C) with their hypervisors still in
/// them: one run must not leave the next its VMMs. Once per process.
#[cfg(target_os = "linux")]
pub fn sweep_stale_test_roots() {
    let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut stale = std::collections::BTreeSet::new();
    for mount in mountinfo.lines().filter(|l| l.contains(" - cgroup")) {
        let Some(point) = mount.split(' ').nth(4) else {
            continue;
        };
        for entry in std::fs::read_dir(point).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            // `eitri-test-PID`, or a root of its named `eitri-test-PID-what`.
            let gone = name
                .strip_prefix(TEST_ROOT_PREFIX)
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse::<u32>().ok())
                .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
            if gone {
                stale.insert(name);
            }
        }
    }
    for root in stale {
        end_cgroup_root(&root);
    }
}
