//! Starting a hypervisor so that no crash of the agent can leave one it
//! does not know about.
//!
//! A plain spawn forks and execs at once: an agent killed between the exec
//! and the pidfile write leaves a VMM running that no file names, and the
//! next agent starts a second one on the same disk. Here, in order:
//!
//! 1. Everything the child needs is prepared before the fork (C strings,
//!    the argv and envp arrays, every fd), because between fork and exec a
//!    child of a multi-threaded process may only call async-signal-safe
//!    functions: no allocation, no lock.
//! 2. fork. The child makes its own session (signals to the agent's group
//!    never reach it; it outlives the agent), keeps only the fds it needs
//!    (copied high) and closes every other (its copy of the release end
//!    among them, and any other child's pipes it inherited), then
//!    **blocks** reading the hold pipe. It runs no hypervisor code yet.
//! 3. The parent records the child (pid and start time) in the pidfile,
//!    durably. Only then does it write the release byte.
//! 4. Released, the child puts stdin (/dev/null), stdout and stderr (the
//!    VM's log) and its own fds (the API socket, the taps: 3, 4, …) in
//!    place, moves itself into its cgroups (through files the parent
//!    opened, see `Cgroups::entry_files`), enters its [`Jail`] (limits, no
//!    capabilities, its own user and groups, no_new_privs) and execs the
//!    hypervisor with an empty environment. If the agent died before the
//!    release, the child reads end-of-file instead and exits without ever
//!    exec'ing: a crash at any point leaves either a tracked VMM or none.
//! 5. The parent learns whether the exec happened from a close-on-exec
//!    report pipe: end-of-file means it did; a stage and an errno mean it
//!    did not, and say where it stopped.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::libc;

use super::view::View;

/// The hypervisor's fds after the exec: 0 /dev/null, 1 and 2 its log, and
/// its own (API socket, taps) from 3.
pub const FIRST_OWN_FD: RawFd = 3;
/// Sources are first copied at or above this, clear of every target.
const HIGH_FD: RawFd = 64;
/// The API socket and two NICs.
pub const MAX_OWN_FDS: usize = 3;
/// A cgroup entry file per controller hierarchy (memory, pids, cpu), or
/// one unified.
pub const MAX_CGROUP_FDS: usize = 3;

/// Who the child becomes before it execs.
#[derive(Clone, Debug)]
pub struct Jail {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups: the one that may open /dev/kvm.
    pub groups: Vec<u32>,
    /// Resource limits, each set as both soft and hard limit.
    pub limits: Vec<(Limit, u64)>,
    /// The files it sees (see [`View`]); all of the host's without one.
    pub view: Option<View>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// Open files.
    Files,
    /// Processes and threads of its user (each VM has its own).
    Processes,
    /// Core dumps (0: a crashed VMM never writes guest memory to disk).
    Core,
    /// The largest file it may make or grow (see `jail::jail_for`); a
    /// write past it fails with EFBIG, SIGXFSZ being ignored.
    FileSize,
}

impl Limit {
    /// The resource number (its C type differs between glibc and musl).
    fn resource(self) -> libc::c_int {
        let resource = match self {
            Limit::Files => libc::RLIMIT_NOFILE,
            Limit::Processes => libc::RLIMIT_NPROC,
            Limit::Core => libc::RLIMIT_CORE,
            Limit::FileSize => libc::RLIMIT_FSIZE,
        };
        resource as libc::c_int
    }
}

/// `struct rlimit64`, as prlimit64(2) takes it on every libc.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Rlimit64 {
    cur: u64,
    max: u64,
}

/// Where a child stopped before its exec, as it reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
enum Stage {
    Fds = 1,
    Limits,
    Capabilities,
    Groups,
    Ids,
    NoNewPrivs,
    Exec,
    Cgroups,
    Namespaces,
    Mounts,
}

impl Stage {
    const ALL: [Stage; 10] = [
        Stage::Fds,
        Stage::Limits,
        Stage::Capabilities,
        Stage::Groups,
        Stage::Ids,
        Stage::NoNewPrivs,
        Stage::Exec,
        Stage::Cgroups,
        Stage::Namespaces,
        Stage::Mounts,
    ];

    /// The stage a child's report names; `None` for a code no child
    /// writes (a torn or foreign report), never a guess.
    fn decode(code: i32) -> Option<Stage> {
        Stage::ALL.into_iter().find(|s| *s as i32 == code)
    }

    /// What the child was doing, for the error.
    fn doing(self) -> &'static str {
        match self {
            Stage::Fds => "placing its fds",
            Stage::Limits => "setting its resource limits",
            Stage::Capabilities => "dropping its capabilities",
            Stage::Groups => "setting its groups",
            Stage::Ids => "becoming its own user",
            Stage::NoNewPrivs => "setting no_new_privs",
            Stage::Exec => "exec",
            Stage::Cgroups => "entering its cgroups",
            Stage::Namespaces => "entering its own network namespace",
            Stage::Mounts => "entering its own view of the files (a mount namespace)",
        }
    }
}

/// A child forked and held before exec (step 2).
pub struct Held {
    pub pid: i32,
    release: OwnedFd,
    report: OwnedFd,
}

/// Forks `program` with `args`, held (steps 1 and 2): `log` becomes its
/// stdout and stderr, `own` its fds 3, 4, …; it writes `0` into each of
/// `cgroups` (moving itself in) and enters `jail` (when given) before it
/// execs.
pub fn fork_held(
    program: &Path,
    args: &[std::ffi::OsString],
    log: &OwnedFd,
    own: &[&OwnedFd],
    cgroups: &[OwnedFd],
    jail: Option<&Jail>,
) -> io::Result<Held> {
    if own.len() > MAX_OWN_FDS || cgroups.len() > MAX_CGROUP_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} fds and {} cgroups to pass, at most {MAX_OWN_FDS} and {MAX_CGROUP_FDS}",
                own.len(),
                cgroups.len()
            ),
        ));
    }
    let mut cgroup_fds = [-1; MAX_CGROUP_FDS];
    for (slot, fd) in cgroup_fds.iter_mut().zip(cgroups) {
        *slot = fd.as_raw_fd();
    }
    let groups: Vec<libc::gid_t> = jail.map(|j| j.groups.clone()).unwrap_or_default();
    let limits: Vec<(libc::c_int, Rlimit64)> = jail
        .map(|j| {
            j.limits
                .iter()
                .map(|(l, v)| (l.resource(), Rlimit64 { cur: *v, max: *v }))
                .collect()
        })
        .unwrap_or_default();
    let ids = jail.map(|j| (j.uid, j.gid));
    let program = cstring(program.as_os_str())?;
    let mut owned_args = vec![program.clone()];
    for a in args {
        owned_args.push(cstring(a)?);
    }
    let mut argv: Vec<*const libc::c_char> = owned_args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    // An empty environment: the hypervisor needs nothing of the agent's.
    let envp: [*const libc::c_char; 1] = [std::ptr::null()];
    let null = std::fs::File::open("/dev/null")?;
    let (hold_r, release) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let (report, report_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let mut sources = [-1; 3 + MAX_OWN_FDS];
    sources[0] = null.as_raw_fd();
    sources[1] = log.as_raw_fd();
    sources[2] = log.as_raw_fd();
    for (slot, fd) in sources[3..].iter_mut().zip(own) {
        *slot = fd.as_raw_fd();
    }
    let count = 3 + own.len();
    let entry = Entry {
        ids,
        groups: &groups,
        limits: &limits,
        cgroups: &cgroup_fds[..cgroups.len()],
        view: jail.and_then(|j| j.view.as_ref()),
    };
    let (hold_fd, report_fd) = (hold_r.as_raw_fd(), report_w.as_raw_fd());

    // SAFETY: the child runs only `child`, which calls async-signal-safe
    // functions on data prepared above and never returns.
    match unsafe { nix::unistd::fork() }? {
        nix::unistd::ForkResult::Child => {
            // SAFETY: see `child`; every pointer was built before the fork
            // and stays valid in the child's copy of the address space.
            unsafe {
                child(
                    hold_fd,
                    report_fd,
                    &sources[..count],
                    &entry,
                    &program,
                    &argv,
                    &envp,
                )
            }
        }
        nix::unistd::ForkResult::Parent { child } => Ok(Held {
            pid: child.as_raw(),
            release,
            report,
        }),
    }
}

impl Held {
    /// Lets the child exec (step 4) and waits to learn whether it did
    /// (step 5).
    pub fn release(self) -> io::Result<()> {
        nix::unistd::write(&self.release, &[1])?;
        drop(self.release);
        let mut report = [0u8; 8];
        let mut got = 0;
        while got < report.len() {
            match nix::unistd::read(&self.report, &mut report[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let word =
            |i: usize| i32::from_ne_bytes([report[i], report[i + 1], report[i + 2], report[i + 3]]);
        match got {
            0 => Ok(()),
            8 => {
                let errno = io::Error::from_raw_os_error(word(4));
                match Stage::decode(word(0)) {
                    Some(Stage::Exec) => Err(errno),
                    Some(stage) => Err(io::Error::new(
                        errno.kind(),
                        format!("the hypervisor's process failed {}: {errno}", stage.doing()),
                    )),
                    None => Err(io::Error::other(format!(
                        "the hypervisor's process failed at an unknown stage {} ({errno})",
                        word(0)
                    ))),
                }
            }
            _ => Err(io::Error::other("a torn exec report")),
        }
    }
}

fn cstring(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("{s:?} has a NUL byte")))
}

/// The jail as the child applies it: prepared before the fork, in the
/// shapes the system calls take.
struct Entry<'a> {
    ids: Option<(u32, u32)>,
    groups: &'a [libc::gid_t],
    limits: &'a [(libc::c_int, Rlimit64)],
    /// Written `0`: the parent's fds, copied high in the child.
    cgroups: &'a [RawFd],
    view: Option<&'a View>,
}

/// The child, after fork: steps 2 and 4. Never returns.
///
/// # Safety
/// Only to be called in a freshly forked child. It calls only
/// async-signal-safe functions (setsid, read, fcntl, dup2, close, prlimit64,
/// unshare, prctl, raw set*id/setgroups/capset syscalls, execve, write,
/// _exit) and
/// allocates nothing.
unsafe fn child(
    hold: RawFd,
    report: RawFd,
    sources: &[RawFd],
    entry: &Entry<'_>,
    program: &CString,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
) -> ! {
    // SAFETY: async-signal-safe calls on fds this process holds and on
    // pointers valid for the whole call (see the function's contract).
    unsafe {
        libc::setsid();
        // Everything this child keeps, copied above every target (and
        // close-on-exec), so that nothing below overwrites a source it still
        // needs; then every other fd closed. Closing them now, before the
        // wait, matters: the child's own copy of the release end (or of
        // another child's) would keep the hold pipe from ever reading
        // end-of-file when the agent dies.
        let report = libc::fcntl(report, libc::F_DUPFD_CLOEXEC, HIGH_FD);
        let hold = libc::fcntl(hold, libc::F_DUPFD_CLOEXEC, HIGH_FD);
        if report < 0 || hold < 0 {
            libc::_exit(127);
        }
        let mut high = [-1; 3 + MAX_OWN_FDS];
        for (i, fd) in sources.iter().enumerate() {
            high[i] = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, HIGH_FD);
            if high[i] < 0 {
                fail(report, Stage::Fds);
            }
        }
        let cgroups = entry.cgroups.len();
        let mut cgroup_high = [-1; MAX_CGROUP_FDS];
        for (i, fd) in entry.cgroups.iter().enumerate() {
            cgroup_high[i] = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, HIGH_FD);
            if cgroup_high[i] < 0 {
                fail(report, Stage::Fds);
            }
        }
        let mut keep = [-1; 2 + 3 + MAX_OWN_FDS + MAX_CGROUP_FDS];
        keep[0] = report;
        keep[1] = hold;
        let own_end = 2 + sources.len();
        keep[2..own_end].copy_from_slice(&high[..sources.len()]);
        keep[own_end..own_end + cgroups].copy_from_slice(&cgroup_high[..cgroups]);
        close_all_but(&mut keep[..own_end + cgroups]);
        // Held until the pidfile is durable; end-of-file means the agent
        // died first, and this child must never become a VMM.
        let mut byte = 0u8;
        loop {
            let n = libc::read(hold, (&raw mut byte).cast(), 1);
            if n == 1 {
                break;
            }
            if n < 0 && *libc::__errno_location() == libc::EINTR {
                continue;
            }
            libc::_exit(0);
        }
        for (i, fd) in high.iter().take(sources.len()).enumerate() {
            // 0-2 first, then the hypervisor's own from FIRST_OWN_FD.
            let target = if i < 3 {
                i as RawFd
            } else {
                FIRST_OWN_FD + (i as RawFd - 3)
            };
            if libc::dup2(*fd, target) < 0 {
                fail(report, Stage::Fds);
            }
        }
        // Not the agent's working directory.
        if libc::chdir(c"/".as_ptr()) != 0 {
            fail(report, Stage::Fds);
        }
        // Into its cgroups before anything of the hypervisor's runs; the
        // one write that moves this thread, which is the whole process.
        for fd in &cgroup_high[..cgroups] {
            if libc::write(*fd, c"0".as_ptr().cast(), 1) != 1 {
                fail(report, Stage::Cgroups);
            }
        }
        enter(entry, report);
        // The high copies are close-on-exec: after the exec the hypervisor
        // holds its targets and nothing else of the agent's.
        libc::execve(program.as_ptr(), argv.as_ptr(), envp.as_ptr());
        fail(report, Stage::Exec)
    }
}

/// Enters the jail: limits first (raising none), then its own network
/// namespace (nothing in it but a loopback that is down: the taps work
/// through their fds, and the host's loopback services, abstract unix
/// sockets and routing tables are out of its reach), then every
/// capability dropped from the bounding set while the child still may,
/// then its groups and its own user (which clears the rest of its
/// capabilities), then no_new_privs, so no setuid file or file capability
/// can give any back. Raw system calls: glibc's set*id wrappers signal every thread of
/// a process, and this child has only itself to change.
///
/// # Safety
/// Async-signal-safe; for the forked child only.
unsafe fn enter(entry: &Entry<'_>, report: RawFd) {
    // SAFETY: system calls on values prepared before the fork.
    unsafe {
        for (resource, limit) in entry.limits {
            let none = std::ptr::null_mut::<Rlimit64>();
            if libc::syscall(
                libc::SYS_prlimit64,
                0,
                *resource,
                limit as *const Rlimit64,
                none,
            ) != 0
            {
                fail(report, Stage::Limits);
            }
        }
        let Some((uid, gid)) = entry.ids else {
            return;
        };
        // A write past the file-size limit fails (EFBIG) instead of
        // killing the VMM: it ignores what it cannot write, serial output
        // included. An ignored disposition survives the exec.
        if libc::signal(libc::SIGXFSZ, libc::SIG_IGN) == libc::SIG_ERR {
            fail(report, Stage::Limits);
        }
        if libc::unshare(libc::CLONE_NEWNET) != 0 {
            fail(report, Stage::Namespaces);
        }
        if let Some(view) = entry.view
            && view.enter().is_err()
        {
            fail(report, Stage::Mounts);
        }
        let mut cap = 0;
        while cap < 64 {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) != 0
                && *libc::__errno_location() != libc::EINVAL
            {
                fail(report, Stage::Capabilities);
            }
            cap += 1;
        }
        if libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        ) != 0
            && *libc::__errno_location() != libc::EINVAL
        {
            fail(report, Stage::Capabilities);
        }
        if libc::syscall(
            libc::SYS_setgroups,
            entry.groups.len(),
            entry.groups.as_ptr(),
        ) != 0
        {
            fail(report, Stage::Groups);
        }
        if libc::syscall(libc::SYS_setresgid, gid, gid, gid) != 0
            || libc::syscall(libc::SYS_setresuid, uid, uid, uid) != 0
        {
            fail(report, Stage::Ids);
        }
        // What setresuid left: the inheritable set (no other is kept by a
        // user that is not root).
        let header = CapHeader {
            version: LINUX_CAPABILITY_VERSION_3,
            pid: 0,
        };
        let data = [CapData::default(); 2];
        if libc::syscall(libc::SYS_capset, &raw const header, data.as_ptr()) != 0 {
            fail(report, Stage::Capabilities);
        }
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            fail(report, Stage::NoNewPrivs);
        }
    }
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// `struct __user_cap_header_struct`.
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Closes every fd but those in `keep` (sorted here, in place: no
/// allocation), a range at a time.
///
/// # Safety
/// Async-signal-safe; for the forked child only.
unsafe fn close_all_but(keep: &mut [RawFd]) {
    // Insertion sort: a handful of fds.
    for i in 1..keep.len() {
        let mut j = i;
        while j > 0 && keep[j - 1] > keep[j] {
            keep.swap(j - 1, j);
            j -= 1;
        }
    }
    let mut lo: RawFd = 0;
    for &k in keep.iter().chain(std::iter::once(&RawFd::MAX)) {
        if k > lo {
            // SAFETY: closes fd numbers; touches no memory.
            unsafe { close_range(lo, k - 1) };
        }
        lo = k.saturating_add(1);
    }
}

/// Closes `lo..=hi`.
///
/// # Safety
/// Async-signal-safe; for the forked child only.
unsafe fn close_range(lo: RawFd, hi: RawFd) {
    // SAFETY: close_range and close take fd numbers and touch no memory.
    unsafe {
        if libc::syscall(
            libc::SYS_close_range,
            lo as libc::c_uint,
            hi as libc::c_uint,
            0,
        ) != 0
        {
            // Before Linux 5.9: one by one, up to a bound no agent reaches.
            let mut fd = lo;
            while fd <= hi.min(1 << 16) {
                libc::close(fd);
                fd += 1;
            }
        }
    }
}

/// Reports the stage and errno to the parent and exits.
///
/// # Safety
/// Async-signal-safe; for the forked child only.
unsafe fn fail(report: RawFd, stage: Stage) -> ! {
    // SAFETY: errno is this thread's; write and _exit are signal-safe.
    unsafe {
        let errno = *libc::__errno_location();
        let mut bytes = [0u8; 8];
        bytes[..4].copy_from_slice(&(stage as i32).to_ne_bytes());
        bytes[4..].copy_from_slice(&errno.to_ne_bytes());
        libc::write(report, bytes.as_ptr().cast(), bytes.len());
        libc::_exit(127)
    }
}

/// Waits for `pid` to exit and returns its raw wait status, retrying on
/// EINTR; `None` if it cannot be waited for (not this process's child).
pub fn wait_raw(pid: i32) -> Option<i32> {
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes the status into the local it is given.
        let got = unsafe { libc::waitpid(pid, &mut status, 0) };
        if got == pid {
            return Some(status);
        }
        if got < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        return None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stage_decodes_to_itself_and_an_unknown_code_to_none() {
        let decoded: Vec<Option<Stage>> = Stage::ALL
            .iter()
            .map(|s| Stage::decode(*s as i32))
            .collect();

        assert!(decoded.iter().zip(Stage::ALL).all(|(d, s)| *d == Some(s)));
        assert_eq!(Stage::decode(0), None);
        assert_eq!(Stage::decode(99), None);
    }
    use std::io::Read;
    use std::os::fd::FromRawFd;

    fn log_file(dir: &Path) -> OwnedFd {
        OwnedFd::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join("log"))
                .expect("log"),
        )
    }

    #[test]
    fn a_held_child_runs_nothing_until_released() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());
        let marker = dir.path().join("ran");
        let args = ["-c".into(), format!("touch {}", marker.display()).into()];

        let held = fork_held(Path::new("/bin/sh"), &args, &log, &[], &[], None).expect("fork");
        std::thread::sleep(std::time::Duration::from_millis(100));
        let before = marker.exists();
        let pid = held.pid;
        held.release().expect("exec");
        let status = wait_raw(pid);

        assert!(!before, "the child ran before its release");
        assert_eq!(status, Some(0));
        assert!(marker.exists());
    }

    #[test]
    fn a_child_whose_parent_never_releases_it_exits_without_exec() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());
        let marker = dir.path().join("ran");
        let args = ["-c".into(), format!("touch {}", marker.display()).into()];

        let held = fork_held(Path::new("/bin/sh"), &args, &log, &[], &[], None).expect("fork");
        let pid = held.pid;
        // What the agent dying does to the pipe: its write end closes.
        drop(held);
        let status = wait_raw(pid);

        assert_eq!(status, Some(0));
        assert!(!marker.exists(), "the held child exec'd without a release");
    }

    #[test]
    fn the_child_gets_its_fds_and_nothing_else() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());
        let (tap_r, tap_w) = nix::unistd::pipe().expect("a pipe standing in for a tap");
        // The shell lists its fds into the log.
        let args = ["-c".into(), "ls /proc/self/fd".into()];

        let held =
            fork_held(Path::new("/bin/sh"), &args, &log, &[&tap_w], &[], None).expect("fork");
        let pid = held.pid;
        held.release().expect("exec");
        wait_raw(pid);
        drop(tap_r);

        let mut listed = String::new();
        std::fs::File::open(dir.path().join("log"))
            .and_then(|mut f| f.read_to_string(&mut listed))
            .expect("log");
        let mut fds: Vec<u32> = listed
            .split_whitespace()
            .filter_map(|f| f.parse().ok())
            .collect();
        fds.sort_unstable();
        // 0-2, the tap on 3, and the fd `ls` itself opened on the directory.
        assert_eq!(&fds[..4], &[0, 1, 2, 3], "{listed}");
        assert!(fds.len() <= 5, "{listed}");
    }

    /// What `/proc/self/status` says in a child that entered `jail`.
    fn status_in(jail: &Jail) -> String {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());
        let args = ["-c".into(), "cat /proc/self/status; ulimit -n".into()];

        let held =
            fork_held(Path::new("/bin/sh"), &args, &log, &[], &[], Some(jail)).expect("fork");
        let pid = held.pid;
        held.release().expect("exec");
        wait_raw(pid);
        std::fs::read_to_string(dir.path().join("log")).expect("log")
    }

    fn line<'a>(status: &'a str, key: &str) -> &'a str {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map_or("", str::trim)
    }

    #[test]
    fn a_jailed_child_is_its_own_user_with_no_capabilities_and_no_new_privileges() {
        let jail = Jail {
            uid: 1_900_000_123,
            gid: 1_900_000_123,
            groups: vec![1_900_000_000],
            limits: vec![(Limit::Files, 256), (Limit::Core, 0)],
            view: None,
        };

        let status = status_in(&jail);

        assert_eq!(
            line(&status, "Uid:"),
            "1900000123\t1900000123\t1900000123\t1900000123"
        );
        assert_eq!(
            line(&status, "Gid:"),
            "1900000123\t1900000123\t1900000123\t1900000123"
        );
        assert_eq!(line(&status, "Groups:"), "1900000000");
        for set in ["CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"] {
            assert_eq!(line(&status, set), "0000000000000000", "{set}");
        }
        assert_eq!(line(&status, "NoNewPrivs:"), "1");
        assert_eq!(status.lines().last(), Some("256"), "{status}");
    }

    #[test]
    fn a_jail_that_cannot_be_entered_says_at_which_stage() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());
        // A hard limit above the agent's own cannot be set.
        let jail = Jail {
            uid: 65534,
            gid: 65534,
            groups: vec![],
            limits: vec![(Limit::Files, u64::MAX - 1)],
            view: None,
        };

        let held =
            fork_held(Path::new("/bin/true"), &[], &log, &[], &[], Some(&jail)).expect("fork");
        let pid = held.pid;
        let err = held.release().expect_err("no such limit");
        wait_raw(pid);

        assert!(err.to_string().contains("resource limits"), "{err}");
    }

    /// The pipe inode an fd of this process is, from /proc.
    fn inode(fd: RawFd) -> String {
        std::fs::read_link(format!("/proc/self/fd/{fd}"))
            .expect("fd")
            .display()
            .to_string()
    }

    #[test]
    fn an_own_fd_that_already_sits_on_a_target_number_lands_where_it_belongs() {
        // It moves this process's fd 3 for a moment: only where each test
        // has a process of its own (nextest, the README's test command).
        if std::env::var_os("NEXTEST").is_none() {
            eprintln!("skipped: needs a process of its own (run under cargo nextest)");
            return;
        }
        // Whatever is on 3 is kept on a high fd (or, if nothing is, 3 is
        // held by /dev/null) so nothing this test opens lands there. Raw
        // fds throughout: none of this is Rust's to close.
        // SAFETY: this test's process has no other thread touching fds.
        let saved = unsafe { libc::fcntl(3, libc::F_DUPFD_CLOEXEC, 200) };
        if saved < 0 {
            // SAFETY: as above; 3 is free, and held here until the end.
            unsafe {
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
                if null != 3 {
                    libc::dup2(null, 3);
                    libc::close(null);
                }
            }
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());
        let (_first_r, first) = nix::unistd::pipe().expect("pipe");
        let (_second_r, second) = nix::unistd::pipe().expect("pipe");
        // The second fd to pass sits on 3, the first's target: the race a
        // closed readiness fd once opened (both NICs got one tap).
        // SAFETY: as above.
        let on_three = unsafe {
            libc::dup2(second.as_raw_fd(), 3);
            std::mem::ManuallyDrop::new(OwnedFd::from_raw_fd(3))
        };
        let want = (inode(first.as_raw_fd()), inode(3));
        let args = [
            "-c".into(),
            "readlink /proc/self/fd/3 /proc/self/fd/4".into(),
        ];

        let held = fork_held(
            Path::new("/bin/sh"),
            &args,
            &log,
            &[&first, &*on_three],
            &[],
            None,
        )
        .expect("fork");
        let pid = held.pid;
        held.release().expect("exec");
        wait_raw(pid);
        // SAFETY: as above; puts back what was on 3, or frees it.
        unsafe {
            if saved >= 0 {
                libc::dup2(saved, 3);
                libc::close(saved);
            } else {
                libc::close(3);
            }
        }

        let seen = std::fs::read_to_string(dir.path().join("log")).expect("log");
        let seen: Vec<&str> = seen.lines().collect();
        assert_eq!(seen, [want.0.as_str(), want.1.as_str()]);
    }

    #[test]
    fn a_failed_exec_is_reported_with_its_errno() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());

        let held =
            fork_held(Path::new("/nonexistent/vmm"), &[], &log, &[], &[], None).expect("fork");
        let pid = held.pid;
        let err = held.release().expect_err("no such program");
        wait_raw(pid);

        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn a_child_that_cannot_enter_its_cgroup_never_execs_and_says_so() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());
        let ran = dir.path().join("ran");
        let args = vec!["-c".into(), format!("touch {}", ran.display()).into()];
        // A write to /dev/full fails (ENOSPC), as a full or removed cgroup would.
        let full: OwnedFd = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full")
            .into();

        let held = fork_held(Path::new("/bin/sh"), &args, &log, &[], &[full], None).expect("fork");
        let pid = held.pid;
        let err = held.release().expect_err("the cgroup write fails");
        wait_raw(pid);

        assert!(err.to_string().contains("entering its cgroups"), "{err}");
        assert!(!ran.exists(), "the program ran outside its cgroups");
    }
}
