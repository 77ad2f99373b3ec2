//! Each VMM in its own cgroup, with a memory, a pids and a cpu limit, under
//! the operator's `--cgroup-root`; entered before it execs, kept across
//! agent restarts (the VMM stays in it), removed at destroy.
//!
//! A controller is used where the host has it: on the unified (v2)
//! hierarchy when it is enabled there, else on its own v1 hierarchy (as
//! runc does on hybrid hosts, where memory, pids and cpu are often v1 and
//! only hugetlb is on the unified mount). The VM's cgroup is the same path,
//! `<root>/<vm id>`, in each hierarchy used.

use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use super::lack::Lack;
use crate::model::Id;

/// The controllers a VMM is limited by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Controller {
    Memory,
    Pids,
    Cpu,
}

impl Controller {
    const ALL: [Controller; 3] = [Controller::Memory, Controller::Pids, Controller::Cpu];

    fn name(self) -> &'static str {
        match self {
            Controller::Memory => "memory",
            Controller::Pids => "pids",
            Controller::Cpu => "cpu",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Hierarchy {
    mount: PathBuf,
    unified: bool,
    controllers: Vec<Controller>,
    /// A v1 hierarchy that mounts cpuacct too (`cpu,cpuacct`): it counts
    /// the CPU time its cgroups use.
    cpuacct: bool,
}

/// A VMM's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: u64,
    pub pids: u64,
    /// Relative cpu weight: 1 per vCPU.
    pub vcpus: u32,
    /// Hard cap: CPU time in µs per [`CPU_PERIOD_US`]; `None`, no cap.
    pub cpu_quota_us: Option<u64>,
    /// CPU time in µs per period it may spend above the cap from what it
    /// left unused (0: none).
    pub cpu_burst_us: u64,
}

/// The period a CPU cap's quota is counted over: the kernel's default.
pub const CPU_PERIOD_US: u64 = 100_000;

/// The hierarchies this host has the controllers on, and the root under
/// which each VM gets its cgroup.
#[derive(Clone, Debug)]
pub struct Cgroups {
    root: String,
    hierarchies: Vec<Hierarchy>,
}

impl Cgroups {
    /// Finds memory, pids and cpu in `/proc/self/mountinfo`; why not, when
    /// one of them is nowhere.
    pub fn probe(root: &str) -> Result<Cgroups, Lack> {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").map_err(Lack::Mountinfo)?;
        Cgroups::from_mountinfo(root, &mountinfo, |mount| {
            fs::read_to_string(mount.join("cgroup.controllers")).unwrap_or_default()
        })
    }

    /// As [`Cgroups::probe`], from the text of a mountinfo and a reader of
    /// a unified mount's `cgroup.controllers`.
    fn from_mountinfo(
        root: &str,
        mountinfo: &str,
        controllers_of: impl Fn(&Path) -> String,
    ) -> Result<Cgroups, Lack> {
        let mut unified: Option<Hierarchy> = None;
        let mut v1: Vec<Hierarchy> = Vec::new();
        for line in mountinfo.lines() {
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            let Some(mount) = left.split(' ').nth(4) else {
                continue;
            };
            let mut right = right.split(' ');
            let (fstype, options) = (right.next(), right.nth(1).unwrap_or(""));
            let mount = PathBuf::from(mount);
            match fstype {
                Some("cgroup2") => {
                    let listed = controllers_of(&mount);
                    let controllers = Controller::ALL
                        .into_iter()
                        .filter(|c| listed.split_whitespace().any(|n| n == c.name()))
                        .collect();
                    unified = Some(Hierarchy {
                        mount,
                        unified: true,
                        controllers,
                        cpuacct: false,
                    });
                }
                Some("cgroup") => {
                    let controllers = Controller::ALL
                        .into_iter()
                        .filter(|c| options.split(',').any(|o| o == c.name()))
                        .collect::<Vec<_>>();
                    if !controllers.is_empty() {
                        v1.push(Hierarchy {
                            mount,
                            unified: false,
                            controllers,
                            cpuacct: options.split(',').any(|o| o == "cpuacct"),
                        });
                    }
                }
                _ => {}
            }
        }
        // Each controller once: on the unified hierarchy where it is there.
        let mut hierarchies: Vec<Hierarchy> = Vec::new();
        if let Some(u) = unified.filter(|u| !u.controllers.is_empty()) {
            hierarchies.push(u);
        }
        for mut h in v1 {
            h.controllers
                .retain(|c| !hierarchies.iter().any(|u| u.controllers.contains(c)));
            if !h.controllers.is_empty() {
                hierarchies.push(h);
            }
        }
        for c in Controller::ALL {
            if !hierarchies.iter().any(|h| h.controllers.contains(&c)) {
                return Err(Lack::NoController(c.name()));
            }
        }
        Ok(Cgroups {
            root: root.to_owned(),
            hierarchies,
        })
    }

    /// The root cgroup, in each hierarchy used.
    pub fn roots(&self) -> Vec<PathBuf> {
        self.hierarchies
            .iter()
            .map(|h| h.mount.join(&self.root))
            .collect()
    }

    /// The VM's cgroup in each hierarchy used.
    pub fn dirs(&self, vm_id: &Id) -> Vec<PathBuf> {
        self.hierarchies
            .iter()
            .map(|h| h.mount.join(&self.root).join(vm_id.as_str()))
            .collect()
    }

    /// The CPU time the VM's cgroup has used (ns), where its cpu hierarchy
    /// counts it: `cpu.stat` on the unified one, `cpuacct.usage` where v1
    /// mounts cpuacct with cpu. `None` on a v1 host that mounts cpuacct
    /// apart (the VM is not put in one there).
    pub fn cpu_usage_ns(&self, vm_id: &Id) -> Option<u64> {
        let h = self
            .hierarchies
            .iter()
            .find(|h| h.controllers.contains(&Controller::Cpu))
            .filter(|h| h.unified || h.cpuacct)?;
        let dir = h.mount.join(&self.root).join(vm_id.as_str());
        if h.unified {
            let stat = fs::read_to_string(dir.join("cpu.stat")).ok()?;
            let usec: u64 = stat
                .lines()
                .find_map(|l| l.strip_prefix("usage_usec "))?
                .trim()
                .parse()
                .ok()?;
            Some(usec.saturating_mul(1000))
        } else {
            fs::read_to_string(dir.join("cpuacct.usage"))
                .ok()?
                .trim()
                .parse()
                .ok()
        }
    }

    /// Makes the VM's cgroups (or finds them) and sets their limits.
    pub fn prepare(&self, vm_id: &Id, limits: Limits) -> io::Result<()> {
        for h in &self.hierarchies {
            let dir = h.mount.join(&self.root).join(vm_id.as_str());
            if h.unified {
                enable(&h.mount, &self.root, &h.controllers)?;
            }
            fs::create_dir_all(&dir)?;
            for c in &h.controllers {
                for (file, value) in settings(*c, h.unified, limits) {
                    let path = dir.join(file);
                    if [BURST_V1, BURST_V2].contains(&file) && value == "0" && !path.exists() {
                        continue;
                    }
                    fs::write(path, value)?;
                }
            }
        }
        Ok(())
    }

    /// Opens, in each hierarchy used, the file through which a process
    /// moves itself into the VM's cgroup by writing `0`: a forked VMM does,
    /// before it execs (see `fork`).
    ///
    /// On a v1 hierarchy that is `tasks`, not `cgroup.procs`: a thread
    /// moving only itself is the one move the kernel makes without its
    /// global thread-group lock, whose first taking after a quiet spell
    /// waits out an RCU grace period (9-10 ms per create against 0.04 ms:
    /// the `cgroup enter` and `fork` stages of `make bench-create`). The child is single-threaded before its exec, so
    /// moving its one thread moves the process, and every thread the VMM
    /// starts later is born in the cgroup. The unified hierarchy takes
    /// `cgroup.procs`.
    pub fn entry_files(&self, vm_id: &Id) -> io::Result<Vec<OwnedFd>> {
        self.hierarchies
            .iter()
            .map(|h| {
                let file = if h.unified { "cgroup.procs" } else { "tasks" };
                let path = h.mount.join(&self.root).join(vm_id.as_str()).join(file);
                fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .map(OwnedFd::from)
            })
            .collect()
    }

    /// Ends every process left in the VM's cgroups: whatever its VMM
    /// forked, which its stop did not end. The pids limit bounds how many
    /// can be born while the kill runs, so kill-until-empty ends; on the
    /// unified hierarchy `cgroup.kill` does it in one write.
    pub fn kill(&self, vm_id: &Id, within: std::time::Duration) -> Result<(), Held> {
        let deadline = crate::deadline::Deadline::after(within);
        for (h, dir) in self.hierarchies.iter().zip(self.dirs(vm_id)) {
            if h.unified {
                // Absent before Linux 5.14: the loop below does it then.
                let _ = fs::write(dir.join("cgroup.kill"), "1");
            }
            kill_until_empty(&dir, deadline)?;
        }
        Ok(())
    }

    /// Removes the VM's cgroups, once its VMM is gone (a cgroup a process
    /// just left may stay busy for a moment; a few tries are allowed).
    pub fn remove(&self, vm_id: &Id) -> io::Result<()> {
        for dir in self.dirs(vm_id) {
            let mut tries = 0;
            loop {
                match fs::remove_dir(&dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    Err(e) if tries < 50 && e.raw_os_error() == Some(nix::libc::EBUSY) => {
                        tries += 1;
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    /// Removes the empty cgroups under the root of VMs not in `known`
    /// (left by a crash between a destroy and its cleanup).
    pub fn remove_unknown(&self, known: &[Id]) {
        for h in &self.hierarchies {
            let Ok(entries) = fs::read_dir(h.mount.join(&self.root)) else {
                continue;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                let ours = Id::parse(&entry.file_name().to_string_lossy())
                    .is_ok_and(|id| known.contains(&id));
                if path.is_dir() && !ours && fs::remove_dir(&path).is_ok() {
                    log::info!("removed the cgroup {} of no VM", path.display());
                }
            }
        }
    }
}

/// Processes that outlived every SIGKILL sent to them for as long as a
/// kill may take (in uninterruptible sleep on a hung disk, say).
#[derive(Debug)]
pub struct Held {
    /// The cgroup or the user they are in.
    pub place: String,
    /// Each one's pid and command name.
    pub pids: Vec<(i32, String)>,
}

impl std::fmt::Display for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let named: Vec<String> = self
            .pids
            .iter()
            .map(|(pid, comm)| format!("{pid} ({comm})"))
            .collect();
        write!(
            f,
            "{} still holds {} after SIGKILL: {}",
            self.place,
            if self.pids.len() == 1 {
                "a process"
            } else {
                "processes"
            },
            named.join(", ")
        )
    }
}

impl std::error::Error for Held {}

/// The pids listed in a cgroup's `cgroup.procs` (none when it is gone).
fn procs_in(dir: &Path) -> Vec<i32> {
    fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// A process's command name, as `/proc` has it ("?" once it is gone).
fn comm(pid: i32) -> String {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .map_or_else(|_| "?".to_owned(), |c| c.trim().to_owned())
}

/// SIGKILLs whatever `list` gives until it gives nothing, or the deadline
/// passes; `place` names where they are in the error.
pub fn kill_all(
    place: &str,
    list: impl Fn() -> Vec<i32>,
    deadline: crate::deadline::Deadline,
) -> Result<(), Held> {
    loop {
        let pids = list();
        if pids.is_empty() {
            return Ok(());
        }
        if deadline.expired() {
            return Err(Held {
                place: place.to_owned(),
                pids: pids.into_iter().map(|p| (p, comm(p))).collect(),
            });
        }
        for pid in pids {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Kills every process in the cgroup `dir` until it holds none.
pub fn kill_until_empty(dir: &Path, deadline: crate::deadline::Deadline) -> Result<(), Held> {
    kill_all(
        &format!("the cgroup {}", dir.display()),
        || procs_in(dir),
        deadline,
    )
}

/// Enables `controllers` for the children of every cgroup from the unified
/// mount down to the root (each level must offer them to the next),
/// writing only where one is not enabled yet: the levels above the root
/// are the host's (under systemd, its slices and the unit it delegated to
/// the agent), and a level that already offers them is not written to.
fn enable(mount: &Path, root: &str, controllers: &[Controller]) -> io::Result<()> {
    let mut dir = mount.to_path_buf();
    offer(&dir, controllers)?;
    for part in root.split('/') {
        dir.push(part);
        fs::create_dir_all(&dir)?;
        offer(&dir, controllers)?;
    }
    Ok(())
}

/// Enables for `dir`'s children each of `controllers` it does not enable
/// yet.
fn offer(dir: &Path, controllers: &[Controller]) -> io::Result<()> {
    let file = dir.join("cgroup.subtree_control");
    let enabled = fs::read_to_string(&file).unwrap_or_default();
    let missing: Vec<String> = controllers
        .iter()
        .filter(|c| !enabled.split_whitespace().any(|e| e == c.name()))
        .map(|c| format!("+{}", c.name()))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    fs::write(file, missing.join(" "))
}

/// The files that set `controller`'s limit, and their values.
fn settings(controller: Controller, unified: bool, l: Limits) -> Vec<(&'static str, String)> {
    let vcpus = u64::from(l.vcpus.max(1));
    match (controller, unified) {
        (Controller::Memory, true) => vec![("memory.max", l.memory_bytes.to_string())],
        (Controller::Memory, false) => vec![("memory.limit_in_bytes", l.memory_bytes.to_string())],
        (Controller::Pids, _) => vec![("pids.max", l.pids.to_string())],
        (Controller::Cpu, true) => {
            let quota = format!(
                "{} {CPU_PERIOD_US}",
                l.cpu_quota_us.map_or("max".into(), |q| q.to_string())
            );
            let mut files = vec![("cpu.weight", (100 * vcpus).min(10_000).to_string())];
            files.extend(capped(BURST_V2, ("cpu.max", quota), l.cpu_burst_us));
            files
        }
        (Controller::Cpu, false) => {
            let quota = l.cpu_quota_us.map_or("-1".into(), |q| q.to_string());
            let mut files = vec![
                ("cpu.shares", (1024 * vcpus).to_string()),
                ("cpu.cfs_period_us", CPU_PERIOD_US.to_string()),
            ];
            files.extend(capped(
                BURST_V1,
                ("cpu.cfs_quota_us", quota),
                l.cpu_burst_us,
            ));
            files
        }
    }
}

/// A cap and its burst, in an order every change takes: the kernel refuses
/// a quota below the burst already set and a burst above the quota already
/// set, and a stopped VM's cgroup keeps both for its next boot. So the
/// burst goes to 0 first, then the quota, then the burst (when there is
/// one).
fn capped(
    burst_file: &'static str,
    quota: (&'static str, String),
    burst_us: u64,
) -> Vec<(&'static str, String)> {
    let mut files = vec![(burst_file, "0".to_owned()), quota];
    if burst_us != 0 {
        files.push((burst_file, burst_us.to_string()));
    }
    files
}

/// The burst files, absent before Linux 5.14: with none asked for, a host
/// without them is no error.
const BURST_V1: &str = "cpu.cfs_burst_us";
const BURST_V2: &str = "cpu.max.burst";

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    const UNIFIED: &str = "\
29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate
";

    fn mounts(c: &Cgroups) -> Vec<(String, bool)> {
        c.hierarchies
            .iter()
            .map(|h| (h.mount.display().to_string(), h.unified))
            .collect()
    }

    #[test]
    fn on_a_hybrid_host_each_controller_is_found_on_its_v1_hierarchy() {
        let c = Cgroups::from_mountinfo("eitri", HYBRID, |_| "hugetlb\n".into()).expect("found");

        assert_eq!(
            mounts(&c),
            [
                ("/sys/fs/cgroup/cpu".into(), false),
                ("/sys/fs/cgroup/memory".into(), false),
                ("/sys/fs/cgroup/pids".into(), false),
            ]
        );
    }

    #[test]
    fn on_a_unified_host_one_hierarchy_holds_them_all() {
        let c = Cgroups::from_mountinfo("eitri", UNIFIED, |_| "cpuset cpu io memory pids\n".into())
            .expect("found");

        assert_eq!(mounts(&c), [("/sys/fs/cgroup".into(), true)]);
        assert_eq!(
            c.dirs(&Id::parse("web-1").expect("id")),
            [PathBuf::from("/sys/fs/cgroup/eitri/web-1")]
        );
    }

    #[test]
    fn a_v1_cpu_hierarchy_counts_cpu_time_only_where_cpuacct_is_mounted_with_it() {
        let joined = HYBRID.replace(
            "/sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n",
            "/sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n",
        );
        let counts = |mountinfo: &str| {
            let c =
                Cgroups::from_mountinfo("eitri", mountinfo, |_| "hugetlb\n".into()).expect("found");
            c.hierarchies
                .iter()
                .find(|h| h.controllers.contains(&Controller::Cpu))
                .map(|h| h.cpuacct)
        };

        assert_eq!((counts(HYBRID), counts(&joined)), (Some(false), Some(true)));
    }

    #[test]
    fn a_level_that_already_offers_the_controllers_is_not_written() {
        let mount = tempfile::tempdir().expect("tempdir");
        let delegated = mount.path().join("system.slice/eitri-agent.service");
        fs::create_dir_all(&delegated).expect("dirs");
        for dir in [mount.path(), &mount.path().join("system.slice")] {
            fs::write(dir.join("cgroup.subtree_control"), "cpu io memory pids\n").expect("file");
        }
        let all = [Controller::Memory, Controller::Pids, Controller::Cpu];

        enable(mount.path(), "system.slice/eitri-agent.service/vms", &all).expect("enable");

        let read = |dir: &Path| fs::read_to_string(dir.join("cgroup.subtree_control")).ok();
        assert_eq!(
            read(&mount.path().join("system.slice")).as_deref(),
            Some("cpu io memory pids\n"),
            "the host's own level is left as it was"
        );
        assert_eq!(
            read(&delegated).as_deref(),
            Some("+memory +pids +cpu"),
            "the delegated level is given what it lacks"
        );
    }

    #[test]
    fn a_level_is_given_only_the_controllers_it_lacks() {
        let mount = tempfile::tempdir().expect("tempdir");
        fs::write(mount.path().join("cgroup.subtree_control"), "memory\n").expect("file");

        offer(mount.path(), &[Controller::Memory, Controller::Pids]).expect("offer");

        assert_eq!(
            fs::read_to_string(mount.path().join("cgroup.subtree_control")).ok(),
            Some("+pids".to_owned())
        );
    }

    #[test]
    fn a_missing_controller_is_named() {
        let err = Cgroups::from_mountinfo("eitri", UNIFIED, |_| "cpu memory\n".into())
            .expect_err("no pids");

        assert!(
            err.to_string().contains("no pids cgroup controller"),
            "{err}"
        );
    }

    #[test]
    fn no_cpu_cap_is_written_as_none_in_each_versions_terms() {
        let l = Limits {
            memory_bytes: 512 << 20,
            pids: 68,
            vcpus: 1,
            cpu_quota_us: None,
            cpu_burst_us: 0,
        };

        let v2 = settings(Controller::Cpu, true, l);
        let v1 = settings(Controller::Cpu, false, l);

        assert!(v2.contains(&("cpu.max", "max 100000".into())), "{v2:?}");
        assert!(v1.contains(&("cpu.cfs_quota_us", "-1".into())), "{v1:?}");
    }

    #[test]
    fn limits_are_written_in_each_versions_own_terms() {
        let l = Limits {
            memory_bytes: 512 << 20,
            pids: 68,
            vcpus: 2,
            cpu_quota_us: Some(150_000),
            cpu_burst_us: 20_000,
        };

        assert_eq!(
            settings(Controller::Cpu, true, l),
            [
                ("cpu.weight", "200".into()),
                ("cpu.max.burst", "0".into()),
                ("cpu.max", "150000 100000".into()),
                ("cpu.max.burst", "20000".into())
            ]
        );
        assert_eq!(
            settings(Controller::Cpu, false, l),
            [
                ("cpu.shares", "2048".into()),
                ("cpu.cfs_period_us", "100000".into()),
                ("cpu.cfs_burst_us", "0".into()),
                ("cpu.cfs_quota_us", "150000".into()),
                ("cpu.cfs_burst_us", "20000".into())
            ]
        );
        assert_eq!(
            settings(Controller::Memory, false, l),
            [("memory.limit_in_bytes", (512u64 << 20).to_string())]
        );
    }
}
