//! Starting a hypervisor so that no crash of the agent can leave one it
//! does not know about, at a cost that does not grow with the agent.
//!
//! A plain spawn forks and execs at once: an agent killed between the exec
//! and the pidfile write leaves a VMM running that no file names, and the
//! next agent starts a second one on the same disk. A plain fork also
//! copies the agent's page tables, and the exec then tears the copy down:
//! about 2 ms for an 8 MB agent, 5.5 ms at 64 MB and 16 ms at 256 MB on
//! this project's 2-core machine (an agent of 10,000 VMs holds ~220 MB),
//! where a clone sharing the memory takes 0.1 ms. Here, in order:
//!
//! 1. Everything the child needs is prepared before it exists (C strings,
//!    the argv and envp arrays, every fd, the jail's values): it may call
//!    only async-signal-safe functions, allocate nothing, and write no
//!    memory but its own stack.
//! 2. The child is cloned the way `posix_spawn` clones it: sharing the
//!    agent's memory (`CLONE_VM`), on a stack of its own, with every
//!    signal blocked so that no handler of the agent's can run in it, and
//!    the calling thread suspended until the child execs or exits
//!    (`CLONE_VFORK`), so nothing that thread owns (the prepared values,
//!    its `errno`) changes under the child or is changed by it. Its other
//!    threads run on; the child touches none of their memory.
//! 3. The child makes its own session, keeps only the fds it needs (copied
//!    high) and closes every other (its copy of the release end among
//!    them, and any other child's pipes it inherited), and tells its pid on
//!    the announce pipe. A helper thread of the agent records it (pid and
//!    start time, the pidfile) while the child enters its [`Jail`]: its fds
//!    put in place (stdin /dev/null, stdout and stderr the VM's log, its
//!    own from fd 3), its cgroups (through files the agent opened), limits,
//!    namespaces, its view of the files, no capabilities, its own user,
//!    no_new_privs. Then it **blocks** reading the hold pipe, having run no
//!    hypervisor code.
//! 4. Recorded, the helper writes the release byte; the child puts every
//!    signal handler back to the default, unblocks what the agent's thread
//!    had unblocked, and execs the hypervisor with an empty environment.
//!    If the agent died first, or the record failed, the child reads
//!    end-of-file instead and exits without ever exec'ing: a crash at any
//!    point leaves either a tracked VMM or none.
//! 5. The exec (or the exit) resumes the calling thread, which learns from
//!    a close-on-exec report pipe whether the exec happened: end-of-file
//!    means it did; a stage and an errno mean it did not, and say where it
//!    stopped. A child that did not exec is reaped before the error is
//!    returned.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::libc;

use super::child::{ChildArgs, Entry, Rlimit64, Stage, trampoline};
pub use super::child::{FIRST_OWN_FD, MAX_CGROUP_FDS, MAX_OWN_FDS};
use super::view::View;

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

impl Jail {
    /// Its groups and limits as the child sets them.
    fn as_entered(&self) -> (Vec<libc::gid_t>, Vec<(libc::c_int, Rlimit64)>) {
        let limits = self
            .limits
            .iter()
            .map(|(l, v)| (l.resource(), Rlimit64 { cur: *v, max: *v }))
            .collect();
        (self.groups.clone(), limits)
    }
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

/// What to start, and how (see the module steps).
pub struct Start<'a> {
    pub program: &'a Path,
    pub args: &'a [std::ffi::OsString],
    /// Its stdout and stderr.
    pub log: &'a OwnedFd,
    /// Its own fds, from [`FIRST_OWN_FD`]: the API socket, the taps.
    pub own: &'a [&'a OwnedFd],
    /// Written `0` by the child: it moves itself into these cgroups.
    pub cgroups: &'a [OwnedFd],
    /// A network namespace made ahead for it (see
    /// [`SpareNetns`](super::netns::SpareNetns)); without one, the child
    /// makes its own. Only entered with a jail.
    pub netns: Option<&'a OwnedFd>,
    pub jail: Option<&'a Jail>,
}

/// How a start ended with no hypervisor running. Any child is reaped.
#[derive(Debug)]
pub enum StartError {
    /// Nothing was started: no helper thread, no clone.
    Spawn(io::Error),
    /// The child could not be recorded, and exited without exec'ing.
    Record(io::Error),
    /// The child stopped before or at its exec; the error says where.
    Exec(io::Error),
}

/// The child's stack: its own mapping, with a guard page below it.
const STACK_BYTES: usize = 256 * 1024;

/// Starts `what` (the module's steps): `record` is called with the child's
/// pid on a helper thread while the child is held, and the child is
/// released only if it succeeds. Returns the pid of the running hypervisor.
pub fn start(
    what: &Start<'_>,
    record: impl FnOnce(i32) -> io::Result<()> + Send,
) -> Result<i32, StartError> {
    let Start {
        program,
        args,
        log,
        own,
        cgroups,
        netns,
        jail,
    } = *what;
    let cgroup_fds = raw_fds::<MAX_CGROUP_FDS>(cgroups.iter(), "cgroups")?;
    let (groups, limits) = jail.map(Jail::as_entered).unwrap_or_default();
    let program = cstring(program.as_os_str()).map_err(StartError::Spawn)?;
    let mut owned_args = vec![program.clone()];
    for a in args {
        owned_args.push(cstring(a).map_err(StartError::Spawn)?);
    }
    let mut argv: Vec<*const libc::c_char> = owned_args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    // An empty environment: the hypervisor needs nothing of the agent's.
    let envp: [*const libc::c_char; 1] = [std::ptr::null()];
    let null = std::fs::File::open("/dev/null").map_err(StartError::Spawn)?;
    let pipe = || {
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| StartError::Spawn(e.into()))
    };
    let (hold, release) = pipe()?;
    let (report, report_w) = pipe()?;
    let (announced, announce) = pipe()?;
    // Its stdin, stdout and stderr, then its own from FIRST_OWN_FD.
    let standard = [null.as_fd(), log.as_fd(), log.as_fd()];
    let sources = raw_fds::<{ 3 + MAX_OWN_FDS }>(
        standard.into_iter().chain(own.iter().map(|fd| fd.as_fd())),
        "fds",
    )?;
    let stack = Stack::map().map_err(StartError::Spawn)?;
    let mut args = ChildArgs {
        hold: hold.as_raw_fd(),
        report: report_w.as_raw_fd(),
        announce: announce.as_raw_fd(),
        sources,
        count: 3 + own.len(),
        entry: Entry {
            ids: jail.map(|j| (j.uid, j.gid)),
            groups: &groups,
            limits: &limits,
            cgroups: &cgroup_fds[..cgroups.len()],
            netns: netns.map(AsRawFd::as_raw_fd),
            view: jail.and_then(|j| j.view.as_ref()),
            last_cap: last_capability(),
        },
        program: &program,
        argv: &argv,
        envp: &envp,
        // Filled in below, before the clone.
        mask: empty_sigset(),
    };

    std::thread::scope(|scope| {
        // Step 3's helper: records the child it is told of, then releases
        // it. Dropping `release` unsent is what holds a child for good.
        let helper = std::thread::Builder::new()
            .name("vmm-record".into())
            .stack_size(256 * 1024)
            .spawn_scoped(scope, move || {
                record_when_announced(&announced, &release, record)
            })
            .map_err(StartError::Spawn)?;

        let pid = clone_child(&mut args, &stack);
        // The child's copies were its own; these would keep the helper
        // from ever reading the end of the announce pipe, and this thread
        // from reading the end of the report.
        drop((hold, report_w, announce));
        let joined = helper.join();
        let pid = pid.map_err(StartError::Spawn)?;
        let recorded = joined.map_or_else(
            |payload| {
                Some(Err(io::Error::other(format!(
                    "recording the hypervisor's process panicked: {}",
                    crate::threads::panic_message(payload.as_ref())
                ))))
            },
            |(recorded, stages)| {
                crate::stages::absorb(&stages);
                recorded
            },
        );
        outcome(pid, recorded, read_report(&report))
    })
}

/// Clones the child that runs `trampoline` with `args` on `stack`, every
/// signal blocked across the clone; this thread waits (CLONE_VFORK) until
/// the child execs or exits.
fn clone_child(args: &mut ChildArgs<'_>, stack: &Stack) -> io::Result<i32> {
    // SAFETY: the clone runs `trampoline` on a stack of its own with
    // `args`, which lives in the caller's frame; this thread is suspended
    // (CLONE_VFORK) until the child execs or exits, so `args` and
    // everything it points to outlive every use the child makes of them.
    // Every signal is blocked across the clone, so the child starts with
    // none deliverable.
    unsafe {
        let mut all = empty_sigset();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut args.mask);
        let pid = libc::clone(
            trampoline,
            stack.top(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            (args as *mut ChildArgs<'_>).cast(),
        );
        let cloned = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &args.mask, std::ptr::null_mut());
        if pid < 0 { Err(cloned) } else { Ok(pid) }
    }
}

/// The raw numbers of `fds`, in order, the rest of the `N` slots -1; more
/// than `N` is refused, naming `what` they are.
fn raw_fds<'a, const N: usize>(
    fds: impl IntoIterator<Item = impl AsFd + 'a>,
    what: &str,
) -> Result<[RawFd; N], StartError> {
    let mut out = [-1; N];
    for (i, fd) in fds.into_iter().enumerate() {
        let Some(slot) = out.get_mut(i) else {
            return Err(StartError::Spawn(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("more {what} to pass than the {N} a hypervisor takes"),
            )));
        };
        *slot = fd.as_fd().as_raw_fd();
    }
    Ok(out)
}

/// Step 3, on the helper thread: reads the pid the child announces, has
/// it recorded, and only then releases the child. Dropping `release`
/// unsent is what holds a child for good. `None`: the child said no pid.
fn record_when_announced(
    announced: &OwnedFd,
    release: &OwnedFd,
    record: impl FnOnce(i32) -> io::Result<()>,
) -> (Option<io::Result<()>>, crate::stages::Stages) {
    let recording = crate::stages::record();
    let mut word = [0u8; 4];
    let announced_pid = read_full(announced, &mut word)
        .then(|| i32::from_ne_bytes(word))
        .filter(|pid| *pid > 0);
    let recorded = announced_pid.map(|pid| {
        record(pid).map(|()| {
            // A child that has already failed and exited makes this EPIPE;
            // its report says why.
            let _ = nix::unistd::write(release, &[1]);
        })
    });
    (recorded, recording.finish())
}

/// How a start ended, from what the helper recorded and what the child
/// reported: running, or reaped with why not.
fn outcome(
    pid: i32,
    recorded: Option<io::Result<()>>,
    reported: io::Result<()>,
) -> Result<i32, StartError> {
    let failed = match (recorded, reported) {
        (Some(Ok(())), Ok(())) => return Ok(pid),
        (_, Err(e)) => StartError::Exec(e),
        (Some(Err(e)), Ok(())) => StartError::Record(e),
        (None, Ok(())) => StartError::Exec(io::Error::other(
            "the hypervisor's process ended before it said its pid",
        )),
    };
    wait_raw(pid);
    Err(failed)
}

/// Reads exactly `buf.len()` bytes, retrying on EINTR; false at an early
/// end of file or an error.
fn read_full(fd: &OwnedFd, buf: &mut [u8]) -> bool {
    let mut got = 0;
    while got < buf.len() {
        match nix::unistd::read(fd, &mut buf[got..]) {
            Ok(0) => return false,
            Ok(n) => got += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return false,
        }
    }
    true
}

/// What the child's report pipe says (step 5): nothing, it exec'd; a stage
/// and an errno, it did not.
fn read_report(report: &OwnedFd) -> io::Result<()> {
    let mut bytes = [0u8; 8];
    let mut got = 0;
    while got < bytes.len() {
        match nix::unistd::read(report, &mut bytes[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let word = |i: usize| i32::from_ne_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
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

/// The highest capability this kernel knows, read before the clone so the
/// child drops exactly those (a drop past it fails with EINVAL).
fn last_capability() -> libc::c_int {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(63)
}

fn empty_sigset() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        set
    }
}

/// The child's stack (see [`STACK_BYTES`]), unmapped when dropped, which
/// is only after the child has exec'd or exited.
struct Stack {
    base: *mut libc::c_void,
}

impl Stack {
    fn map() -> io::Result<Stack> {
        // SAFETY: a fresh anonymous mapping, checked before use; its lowest
        // page is made a guard, so an overflow faults instead of writing
        // below it.
        unsafe {
            let base = libc::mmap(
                std::ptr::null_mut(),
                STACK_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK | libc::MAP_NORESERVE,
                -1,
                0,
            );
            if base == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            let stack = Stack { base };
            if libc::mprotect(base, 4096, libc::PROT_NONE) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(stack)
        }
    }

    /// Where the child's stack starts: its highest address, 16-aligned.
    fn top(&self) -> *mut libc::c_void {
        // SAFETY: one past the end of the mapping, which is where a
        // downward-growing stack starts.
        unsafe { self.base.cast::<u8>().add(STACK_BYTES).cast() }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, no longer used by anyone.
        unsafe {
            libc::munmap(self.base, STACK_BYTES);
        }
    }
}

fn cstring(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("{s:?} has a NUL byte")))
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
    fn more_fds_than_a_hypervisor_takes_are_refused_naming_them() {
        let null = std::fs::File::open("/dev/null").expect("null");
        let three = [null.as_fd(), null.as_fd(), null.as_fd()];

        let refused = raw_fds::<2>(three, "cgroups").expect_err("refused");
        let taken = raw_fds::<4>(three, "fds").expect("taken");

        assert!(
            matches!(&refused, StartError::Spawn(e) if e.to_string().contains("more cgroups to pass than the 2")),
            "{refused:?}"
        );
        assert_eq!(taken[3], -1);
        assert_eq!(taken[0], null.as_raw_fd());
    }
    use std::io::Read;
    use std::os::fd::{FromRawFd, RawFd};
    use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

    fn log_file(dir: &Path) -> OwnedFd {
        OwnedFd::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join("log"))
                .expect("log"),
        )
    }

    fn read_log(dir: &Path) -> String {
        let mut text = String::new();
        std::fs::File::open(dir.join("log"))
            .and_then(|mut f| f.read_to_string(&mut text))
            .expect("log");
        text
    }

    /// `program` started with `args`, logging to `log`, recorded by
    /// nothing.
    fn start_plain(
        program: &str,
        args: &[std::ffi::OsString],
        log: &OwnedFd,
        own: &[&OwnedFd],
        cgroups: &[OwnedFd],
        jail: Option<&Jail>,
    ) -> Result<i32, StartError> {
        start(
            &Start {
                program: Path::new(program),
                args,
                log,
                own,
                cgroups,
                netns: None,
                jail,
            },
            |_| Ok(()),
        )
    }

    fn shell(command: String) -> Vec<std::ffi::OsString> {
        vec!["-c".into(), command.into()]
    }

    /// `/bin/sh` with `args`, logging to `log`, nothing else given.
    fn shell_start<'a>(args: &'a [std::ffi::OsString], log: &'a OwnedFd) -> Start<'a> {
        Start {
            program: Path::new("/bin/sh"),
            args,
            log,
            own: &[],
            cgroups: &[],
            netns: None,
            jail: None,
        }
    }

    #[test]
    fn a_held_child_runs_nothing_until_it_is_recorded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());
        let marker = dir.path().join("ran");
        let args = shell(format!("touch {}", marker.display()));
        let ran_before_the_record = AtomicBool::new(true);

        let pid = start(&shell_start(&args, &log), |_| {
            std::thread::sleep(std::time::Duration::from_millis(100));
            ran_before_the_record.store(marker.exists(), Ordering::SeqCst);
            Ok(())
        })
        .expect("started");
        let status = wait_raw(pid);

        assert!(!ran_before_the_record.load(Ordering::SeqCst));
        assert_eq!(status, Some(0));
        assert!(marker.exists());
    }

    #[test]
    fn the_record_is_told_the_pid_of_the_child_it_holds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());
        let told = AtomicI32::new(0);
        let args = shell("true".into());

        let pid = start(&shell_start(&args, &log), |pid| {
            told.store(pid, Ordering::SeqCst);
            Ok(())
        })
        .expect("started");
        wait_raw(pid);

        assert_eq!(told.load(Ordering::SeqCst), pid);
    }

    #[test]
    fn a_child_that_cannot_be_recorded_exits_without_exec_and_is_reaped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());
        let marker = dir.path().join("ran");
        let args = shell(format!("touch {}", marker.display()));
        let told = AtomicI32::new(0);

        // What the agent dying does to the hold pipe too: its write end
        // closes without a byte.
        let result = start(&shell_start(&args, &log), |pid| {
            told.store(pid, Ordering::SeqCst);
            Err(io::Error::other("the pidfile's disk is gone"))
        });

        assert!(matches!(result, Err(StartError::Record(_))), "{result:?}");
        assert!(!marker.exists(), "the child exec'd without a release");
        // Reaped already: not a child of this process any more.
        assert_eq!(wait_raw(told.load(Ordering::SeqCst)), None);
    }

    #[test]
    fn the_child_gets_its_fds_and_nothing_else() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());
        let (tap_r, tap_w) = nix::unistd::pipe().expect("a pipe standing in for a tap");
        // The shell lists its fds into the log.
        let args = shell("ls /proc/self/fd".into());

        let pid = start_plain("/bin/sh", &args, &log, &[&tap_w], &[], None).expect("started");
        wait_raw(pid);
        drop(tap_r);

        let listed = read_log(dir.path());
        let mut fds: Vec<u32> = listed
            .split_whitespace()
            .filter_map(|f| f.parse().ok())
            .collect();
        fds.sort_unstable();
        // 0-2, the tap on 3, and the fd `ls` itself opened on the directory.
        assert_eq!(&fds[..4], &[0, 1, 2, 3], "{listed}");
        assert!(fds.len() <= 5, "{listed}");
    }

    #[test]
    fn a_started_program_has_its_callers_signal_mask() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());
        // grep itself, not a shell: a shell clears its mask as it starts.
        let args = ["^SigBlk:".into(), "/proc/self/status".into()];

        let pid = start_plain("/bin/grep", &args, &log, &[], &[], None).expect("started");
        wait_raw(pid);

        let status = read_log(dir.path());
        // The test's thread blocks nothing: the clone's everything-blocked
        // mask did not outlive the exec.
        assert_eq!(line(&status, "SigBlk:"), "0000000000000000", "{status}");
    }

    /// What `/proc/self/status` says in a child that entered `jail`.
    fn status_in(jail: &Jail) -> String {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());
        let args = shell("cat /proc/self/status; ulimit -n".into());

        let pid = start_plain("/bin/sh", &args, &log, &[], &[], Some(jail)).expect("started");
        wait_raw(pid);
        read_log(dir.path())
    }

    fn line<'a>(status: &'a str, key: &str) -> &'a str {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map_or("", str::trim)
    }

    fn jail(uid: u32) -> Jail {
        Jail {
            uid,
            gid: uid,
            groups: vec![1_900_000_000],
            limits: vec![(Limit::Files, 256), (Limit::Core, 0)],
            view: None,
        }
    }

    #[test]
    fn a_jailed_child_is_its_own_user_with_no_capabilities_and_no_new_privileges() {
        let status = status_in(&jail(1_900_000_123));

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
    fn a_jailed_child_enters_the_network_namespace_made_ahead_for_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());
        let spare = std::thread::spawn(super::super::netns::make)
            .join()
            .expect("the thread ran")
            .expect("a namespace");
        let want =
            std::fs::read_link(format!("/proc/self/fd/{}", spare.as_raw_fd())).expect("its link");
        let args = shell("readlink /proc/self/ns/net".into());

        let pid = start(
            &Start {
                program: Path::new("/bin/sh"),
                args: &args,
                log: &log,
                own: &[],
                cgroups: &[],
                netns: Some(&spare),
                jail: Some(&jail(1_900_000_124)),
            },
            |_| Ok(()),
        )
        .expect("started");
        wait_raw(pid);

        assert_eq!(read_log(dir.path()).trim(), want.display().to_string());
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

        let result = start_plain("/bin/true", &[], &log, &[], &[], Some(&jail));

        let Err(StartError::Exec(err)) = result else {
            panic!("no such limit, yet {result:?}");
        };
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
        let args = shell("readlink /proc/self/fd/3 /proc/self/fd/4".into());

        let pid =
            start_plain("/bin/sh", &args, &log, &[&first, &*on_three], &[], None).expect("started");
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

        let seen = read_log(dir.path());
        let seen: Vec<&str> = seen.lines().collect();
        assert_eq!(seen, [want.0.as_str(), want.1.as_str()]);
    }

    #[test]
    fn a_failed_exec_is_reported_with_its_errno() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());

        let result = start_plain("/nonexistent/vmm", &[], &log, &[], &[], None);

        let Err(StartError::Exec(err)) = result else {
            panic!("no such program, yet {result:?}");
        };
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn a_child_that_cannot_enter_its_cgroup_never_execs_and_says_so() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = log_file(dir.path());
        let ran = dir.path().join("ran");
        let args = shell(format!("touch {}", ran.display()));
        // A write to /dev/full fails (ENOSPC), as a full or removed cgroup would.
        let full: OwnedFd = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full")
            .into();

        let result = start_plain("/bin/sh", &args, &log, &[], &[full], None);

        let Err(StartError::Exec(err)) = result else {
            panic!("the cgroup write fails, yet {result:?}");
        };
        assert!(err.to_string().contains("entering its cgroups"), "{err}");
        assert!(!ran.exists(), "the program ran outside its cgroups");
    }
}
