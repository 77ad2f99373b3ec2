//! The cloned child's side of a start (steps 3 and 4 of
//! [`fork`](super::fork)): what it is handed, prepared before the clone,
//! and what it does with it, async-signal-safe calls only, until it execs
//! or exits with a report of where it stopped.

use std::ffi::CString;
use std::os::fd::RawFd;

use nix::libc;

use super::view::View;

/// The hypervisor's fds after the exec: 0 /dev/null, 1 and 2 its log, and
/// its own (API socket, taps) from 3.
pub const FIRST_OWN_FD: RawFd = 3;
/// Sources are first copied at or above this, clear of every target.
pub(super) const HIGH_FD: RawFd = 64;
/// The API socket and two NICs.
pub const MAX_OWN_FDS: usize = 3;
/// A cgroup entry file per controller hierarchy (memory, pids, cpu), or
/// one unified.
pub const MAX_CGROUP_FDS: usize = 3;

/// `struct rlimit64`, as prlimit64(2) takes it on every libc.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct Rlimit64 {
    pub cur: u64,
    pub max: u64,
}

/// Where a child stopped before its exec, as it reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub(super) enum Stage {
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
    pub(super) fn decode(code: i32) -> Option<Stage> {
        Stage::ALL.into_iter().find(|s| *s as i32 == code)
    }

    /// What the child was doing, for the error.
    pub(super) fn doing(self) -> &'static str {
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

/// The jail as the child applies it: prepared before the clone, in the
/// shapes the system calls take.
pub(super) struct Entry<'a> {
    pub ids: Option<(u32, u32)>,
    pub groups: &'a [libc::gid_t],
    pub limits: &'a [(libc::c_int, Rlimit64)],
    /// Written `0`: the parent's fds, copied high in the child.
    pub cgroups: &'a [RawFd],
    /// A network namespace to enter; `None`: make one.
    pub netns: Option<RawFd>,
    pub view: Option<&'a View>,
    /// The highest capability this kernel knows.
    pub last_cap: libc::c_int,
}

/// Everything the child reads, in the calling thread's frame.
pub(super) struct ChildArgs<'a> {
    pub hold: RawFd,
    pub report: RawFd,
    pub announce: RawFd,
    /// 0-2 and its own fds, as the parent holds them.
    pub sources: [RawFd; 3 + MAX_OWN_FDS],
    pub count: usize,
    pub entry: Entry<'a>,
    pub program: &'a CString,
    pub argv: &'a [*const libc::c_char],
    pub envp: &'a [*const libc::c_char],
    /// The calling thread's signal mask, which the hypervisor gets.
    pub mask: libc::sigset_t,
}

/// Where the clone starts the child.
pub(super) extern "C" fn trampoline(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildArgs` the suspended caller holds; this
    // is a freshly cloned child (see `child`).
    unsafe { child(&*arg.cast::<ChildArgs<'_>>()) }
}

/// The child: steps 3 and 4. Never returns.
///
/// # Safety
/// Only to be called in a freshly cloned child whose parent thread is
/// suspended. It calls only async-signal-safe functions (setsid, getpid,
/// read, write, fcntl, dup2, close, prlimit64, unshare, setns, mount,
/// prctl, raw set*id/setgroups/capset syscalls, sigaction, sigprocmask,
/// execve, _exit), allocates nothing and writes only its own stack (and
/// the suspended thread's `errno`).
unsafe fn child(args: &ChildArgs<'_>) -> ! {
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
        let high_copy = |fd: RawFd| libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, HIGH_FD);
        let report = high_copy(args.report);
        let hold = high_copy(args.hold);
        let announce = high_copy(args.announce);
        if report < 0 || hold < 0 || announce < 0 {
            libc::_exit(127);
        }
        let sources = &args.sources[..args.count];
        let entry = &args.entry;
        let mut high = [-1; 3 + MAX_OWN_FDS];
        for (i, fd) in sources.iter().enumerate() {
            high[i] = high_copy(*fd);
            if high[i] < 0 {
                fail(report, Stage::Fds);
            }
        }
        let cgroups = entry.cgroups.len();
        let mut cgroup_high = [-1; MAX_CGROUP_FDS];
        for (i, fd) in entry.cgroups.iter().enumerate() {
            cgroup_high[i] = high_copy(*fd);
            if cgroup_high[i] < 0 {
                fail(report, Stage::Fds);
            }
        }
        let netns = match entry.netns {
            Some(fd) => {
                let copy = high_copy(fd);
                if copy < 0 {
                    fail(report, Stage::Fds);
                }
                Some(copy)
            }
            None => None,
        };
        let mut keep = [-1; 4 + 3 + MAX_OWN_FDS + MAX_CGROUP_FDS];
        keep[0] = report;
        keep[1] = hold;
        keep[2] = announce;
        keep[3] = netns.unwrap_or(report);
        let own_end = 4 + sources.len();
        keep[4..own_end].copy_from_slice(&high[..sources.len()]);
        keep[own_end..own_end + cgroups].copy_from_slice(&cgroup_high[..cgroups]);
        close_all_but(&mut keep[..own_end + cgroups]);

        // Step 3: its pid to the helper, which records it meanwhile.
        let pid = libc::syscall(libc::SYS_getpid) as i32;
        let word = pid.to_ne_bytes();
        if libc::write(announce, word.as_ptr().cast(), word.len()) != word.len() as isize {
            fail(report, Stage::Fds);
        }
        libc::close(announce);
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
        enter(entry, netns, report);

        wait_for_release(hold);
        // Step 4.
        default_every_handler();
        libc::sigprocmask(libc::SIG_SETMASK, &args.mask, std::ptr::null_mut());
        // The high copies are close-on-exec: after the exec the hypervisor
        // holds its targets and nothing else of the agent's.
        libc::execve(
            args.program.as_ptr(),
            args.argv.as_ptr(),
            args.envp.as_ptr(),
        );
        fail(report, Stage::Exec)
    }
}

/// Holds the child until it is recorded: a byte on `hold` releases it;
/// end-of-file means the agent died or could not record it, and this
/// child must never become a VMM, so it exits.
///
/// # Safety
/// As [`child`]'s: in the cloned child only, async-signal-safe, no
/// allocation.
unsafe fn wait_for_release(hold: RawFd) {
    let mut byte = 0u8;
    loop {
        // SAFETY: a read of one byte into this frame's own byte.
        let n = unsafe { libc::read(hold, (&raw mut byte).cast(), 1) };
        if n == 1 {
            return;
        }
        // SAFETY: this thread's errno, read right after the call.
        if n < 0 && unsafe { *libc::__errno_location() } == libc::EINTR {
            continue;
        }
        // SAFETY: _exit is async-signal-safe and runs nothing of the agent's.
        unsafe { libc::_exit(0) };
    }
}

/// Sets every handler of the agent's back to the default before anything
/// is unblocked: none may run in this child, which shares the agent's
/// memory until the exec. (An ignored signal stays ignored, as a fork and
/// exec would leave it.)
///
/// # Safety
/// As [`child`]'s: in the cloned child only, async-signal-safe, no
/// allocation.
unsafe fn default_every_handler() {
    for signal in 1..65 {
        // SAFETY: sigaction on this process with actions on this frame's
        // stack; an all-zero sigaction is a valid value.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(signal, std::ptr::null(), &mut action) == 0
                && action.sa_sigaction != libc::SIG_DFL
                && action.sa_sigaction != libc::SIG_IGN
            {
                let mut default: libc::sigaction = std::mem::zeroed();
                default.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(signal, &default, std::ptr::null_mut());
            }
        }
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
unsafe fn enter(entry: &Entry<'_>, netns: Option<RawFd>, report: RawFd) {
    // SAFETY: system calls on values prepared before the clone.
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
        let entered = match netns {
            Some(fd) => libc::setns(fd, libc::CLONE_NEWNET),
            None => libc::unshare(libc::CLONE_NEWNET),
        };
        if entered != 0 {
            fail(report, Stage::Namespaces);
        }
        if let Some(view) = entry.view
            && view.enter().is_err()
        {
            fail(report, Stage::Mounts);
        }
        let mut cap = 0;
        while cap <= entry.last_cap {
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
}
