//! Hypervisor processes as the agent tracks them: a pidfile holding the pid
//! **and** its start time, checked against /proc, so a pid the kernel has
//! recycled for an unrelated process never counts as the VM.

use std::fs;
use std::io;
use std::path::Path;

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::state::atomic::replace_unsynced;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tracked {
    pub pid: i32,
    /// Field 22 of `/proc/<pid>/stat`: clock ticks after boot.
    pub start: u64,
}

/// What one read of `/proc/<pid>/stat` tells of a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ProcStat {
    pub state: char,
    /// Clock ticks after boot (field 22).
    pub start: u64,
    /// User and system time in clock ticks, its threads' (the dead ones'
    /// too).
    pub cpu_ticks: u64,
    /// Resident memory in pages.
    pub resident_pages: u64,
}

impl ProcStat {
    /// `pid`'s, read into a stack buffer: asked of every VM at every
    /// usage sample.
    pub(crate) fn read(pid: i32) -> Option<ProcStat> {
        // A stat line is some 300 bytes; 52 fields of 20 digits at most.
        let mut buf = [0u8; 4096];
        let text = read_small(Path::new(&format!("/proc/{pid}/stat")), &mut buf)?;
        ProcStat::parse(text)
    }

    /// From the text of a stat file.
    pub(crate) fn parse(text: &str) -> Option<ProcStat> {
        // The command (field 2) may hold spaces and parentheses; the
        // fields after its last ')' are plain, the state (field 3) first.
        let rest = &text[text.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
        Some(ProcStat {
            state: fields.first()?.chars().next()?,
            start: field(22)?,
            cpu_ticks: field(14)?.checked_add(field(15)?)?,
            resident_pages: field(24)?,
        })
    }
}

/// State letter and start time of `pid`, from `/proc/<pid>/stat`.
pub fn stat(pid: i32) -> Option<(char, u64)> {
    ProcStat::read(pid).map(|s| (s.state, s.start))
}

impl Tracked {
    pub fn of(pid: i32) -> Option<Tracked> {
        stat(pid).map(|(_, start)| Tracked { pid, start })
    }

    /// Alive, not a zombie, and the same process that was recorded.
    pub fn alive(&self) -> bool {
        matches!(stat(self.pid), Some((state, start)) if start == self.start && state != 'Z' && state != 'X')
    }

    pub fn read(path: &Path) -> Option<Tracked> {
        let mut buf = [0u8; 64];
        let text = read_small(path, &mut buf)?;
        let mut parts = text.split_whitespace();
        Some(Tracked {
            pid: parts.next()?.parse().ok()?,
            start: parts.next()?.parse().ok()?,
        })
    }

    /// Writes the pidfile, atomically for its readers but not synced. It
    /// must be there before the VMM execs for as long as the agent may
    /// crash, and the page cache outlives an agent's crash; it need not
    /// survive a power cut, which no VMM survives either: a stale pidfile
    /// names a process that is not alive (or not a VMM of this VM, by its
    /// start time and command line), a torn or missing one sends
    /// [`CloudHypervisor::find`](super::CloudHypervisor) to the command
    /// lines. Two fsyncs here were 0.9 ms of every create.
    pub fn write(&self, path: &Path) -> io::Result<()> {
        replace_unsynced(path, format!("{} {}\n", self.pid, self.start).as_bytes())
    }

    /// Sends `signal`, unless the recorded process is gone (or the pid now
    /// belongs to another process): a process that is already gone is
    /// stopped, which is success.
    pub fn signal(&self, signal: Signal) -> io::Result<()> {
        if !self.alive() {
            return Ok(());
        }
        match kill(Pid::from_raw(self.pid), signal) {
            Ok(()) | Err(Errno::ESRCH) => Ok(()),
            Err(e) => Err(io::Error::from(e)),
        }
    }
}

/// The real user id `pid` runs as.
pub fn uid(pid: i32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Every live process with an argument `arg` exactly, or starting with
/// `prefix` when `prefix` is true, and that argument: found by reading
/// `/proc/<pid>/cmdline` of every process. A scan, so used only where a
/// pidfile cannot be trusted (after a crash, a garbled or stale one).
pub fn scan(arg: &[u8], prefix: bool) -> Vec<(Tracked, Vec<u8>)> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let hit = cmdline.split(|b| *b == 0).find(|a| {
            if prefix {
                a.starts_with(arg)
            } else {
                *a == arg
            }
        });
        if let Some(hit) = hit
            && let Some(tracked) = Tracked::of(pid).filter(Tracked::alive)
        {
            found.push((tracked, hit.to_vec()));
        }
    }
    found
}

/// A small file's text, read into `buf` with one open and as few reads as
/// it takes (no size query, no allocation): what is sampled often (a
/// pidfile, a process's stat line) costs three system calls. `None` when
/// it cannot be read, is not text, or does not fit.
pub(crate) fn read_small<'a>(path: &Path, buf: &'a mut [u8]) -> Option<&'a str> {
    use std::io::Read;
    let mut file = fs::File::open(path).ok()?;
    let mut have = 0;
    loop {
        match file.read(&mut buf[have..]) {
            Ok(0) => break,
            Ok(n) => have += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
        if have == buf.len() {
            return None;
        }
    }
    std::str::from_utf8(&buf[..have]).ok()
}
