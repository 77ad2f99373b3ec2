//! The real guest, as `eitri-guest` sees it from inside (Linux): where
//! each answer is read from and how each request is carried out. Every
//! program it runs is the guest's own (`systemctl`, `networkctl`), by
//! fixed name and arguments, bounded in time; nothing the host sends
//! becomes a command or a path but the login user's name, checked against
//! the guest's own user database.

use std::fs;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::pb::guest::{
    Identity, IdentityApplied, Quieted, Reseeded, Resumed, Status, StepTook, SystemState,
};

use super::serve::Inside;

mod files;
mod network;
mod quiet;
mod sshd;

use files::{authorized_keys, login_user, sync_filesystems, write_whole};
use network::{await_new_leases, change_macs, renew_leases};
use sshd::{host_key, reload_sshd};

/// The real guest. One per process: it holds what is frozen, and the
/// stall check it quieted for a save.
pub struct Guest {
    frozen: std::sync::Arc<Mutex<Freezing>>,
    quiet: quiet::Quiet,
}

impl Default for Guest {
    fn default() -> Self {
        Guest {
            frozen: std::sync::Arc::default(),
            quiet: quiet::Quiet::new(Path::new(quiet::SUPPRESS), quiet::Timing::GUEST),
        }
    }
}

/// The filesystems frozen now, and which freeze froze them (a later
/// freeze's deadline must not be cut by an earlier one's timer).
#[derive(Default)]
struct Freezing {
    mounts: Vec<PathBuf>,
    generation: u64,
}

/// `program args…` run to its end within `limit`: its output, or why not.
fn run(program: &str, args: &[&str], limit: Duration) -> Result<String, String> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    let until = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                use std::io::Read;
                let (mut out, mut err) = (String::new(), String::new());
                if let Some(mut stdout) = child.stdout.take() {
                    let _ = stdout.by_ref().take(4096).read_to_string(&mut out);
                }
                if let Some(mut stderr) = child.stderr.take() {
                    let _ = stderr.by_ref().take(4096).read_to_string(&mut err);
                }
                return if status.success() {
                    Ok(out.trim().to_owned())
                } else {
                    // What it printed: its output where it has one (a
                    // state it exits non-zero for), else its errors.
                    let said = if out.trim().is_empty() { &err } else { &out };
                    Err(format!(
                        "{program} {}: {status} ({})",
                        args.join(" "),
                        said.trim()
                    ))
                };
            }
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{program} {} took over {limit:?}", args.join(" ")));
            }
            Err(e) => return Err(format!("cannot wait for {program}: {e}")),
        }
    }
}

fn systemd() -> bool {
    Path::new("/run/systemd/system").is_dir()
}

/// The system's state: systemd's words where it runs, else up (init ran
/// this agent, so its boot got that far).
fn system_state() -> (SystemState, String) {
    if !systemd() {
        return (
            SystemState::SystemUp,
            "no systemd: the guest agent runs".into(),
        );
    }
    // `is-system-running` exits non-zero for any state but running, and
    // still prints the state.
    let said = match run("systemctl", &["is-system-running"], Duration::from_secs(2)) {
        Ok(words) => words,
        Err(e) => e
            .rsplit_once('(')
            .map_or(e.clone(), |(_, w)| w.trim_end_matches(')').to_owned()),
    };
    let state = match said.as_str() {
        "running" => SystemState::SystemUp,
        "degraded" => SystemState::SystemDegraded,
        "initializing" | "starting" => SystemState::SystemStarting,
        "stopping" => SystemState::SystemStopping,
        _ => SystemState::SystemUnknown,
    };
    (state, format!("systemd: {said}"))
}

/// The guest's status now: systemd's state, its memory, load and root
/// filesystem.
fn status_now() -> Status {
    let (system, system_detail) = system_state();
    let meminfo_text = fs::read_to_string("/proc/meminfo").unwrap_or_default();
    // The counts are u32 on 32-bit guests.
    #[allow(clippy::unnecessary_cast)]
    let (total, free) = nix::sys::statvfs::statvfs("/")
        .map(|s| {
            let block = s.fragment_size() as u64;
            (
                s.blocks() as u64 * block,
                s.blocks_available() as u64 * block,
            )
        })
        .unwrap_or((0, 0));
    Status {
        boot_id: fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default(),
        uptime_ms: milli("/proc/uptime"),
        system: system as i32,
        system_detail,
        memory_total_kib: meminfo(&meminfo_text, "MemTotal"),
        memory_available_kib: meminfo(&meminfo_text, "MemAvailable"),
        load_milli: u32::try_from(milli("/proc/loadavg")).unwrap_or(u32::MAX),
        root_total_bytes: total,
        root_free_bytes: free,
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
    }
}

/// The first number after `key:` in /proc/meminfo, in KiB.
fn meminfo(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The first field of a /proc file as thousandths.
fn milli(path: &str) -> u64 {
    let text = fs::read_to_string(path).unwrap_or_default();
    let first = text.split_whitespace().next().unwrap_or("0");
    first.parse::<f64>().map_or(0, |v| (v * 1000.0) as u64)
}

/// Credits `bytes` to the kernel's pool (RNDADDENTROPY), then reseeds its
/// CRNG (RNDRESEEDCRNG): what a snapshot's copy must do before it makes a
/// key.
fn reseed(bytes: &[u8]) -> Result<(), String> {
    let random = fs::OpenOptions::new()
        .write(true)
        .open("/dev/random")
        .map_err(|e| format!("cannot open /dev/random: {e}"))?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + bytes.len());
    let bits = i32::try_from(bytes.len() * 8).map_err(|_| "too many bytes".to_owned())?;
    let len = i32::try_from(bytes.len()).map_err(|_| "too many bytes".to_owned())?;
    info.extend_from_slice(&bits.to_ne_bytes());
    info.extend_from_slice(&len.to_ne_bytes());
    info.extend_from_slice(bytes);
    // Aligned for the kernel's u32 reads.
    let words: Vec<u32> = info
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_ne_bytes(w)
        })
        .collect();
    let add = nix::request_code_write!(b'R', 0x03, 2 * std::mem::size_of::<i32>());
    let reseed = nix::request_code_none!(b'R', 0x07);
    // SAFETY: `words` is a rand_pool_info whose buf_size is the bytes that
    // follow its header, all inside the allocation; the fd is open.
    let added = unsafe { nix::libc::ioctl(random.as_raw_fd(), add as _, words.as_ptr()) };
    if added != 0 {
        return Err(format!(
            "RNDADDENTROPY: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    let reseeded = unsafe { nix::libc::ioctl(random.as_raw_fd(), reseed as _) };
    if reseeded != 0 {
        return Err(format!(
            "RNDRESEEDCRNG: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

fn unix_ns(t: SystemTime) -> i128 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i128,
        Err(e) => -(e.duration().as_nanos() as i128),
    }
}

/// Sets the wall clock to the host's when it is off by more than `slack`;
/// the offset (guest minus host, ms) and whether it was set.
fn clock(host_unix_ns: i64, slack_ms: u32, received: SystemTime) -> Result<(i64, bool), String> {
    let offset_ns = unix_ns(received) - i128::from(host_unix_ns);
    let offset_ms = i64::try_from(offset_ns / 1_000_000).unwrap_or(i64::MAX);
    if offset_ms.unsigned_abs() <= u64::from(slack_ms) {
        return Ok((offset_ms, false));
    }
    // The host's time, moved on by what passed here since the request came.
    let since = SystemTime::now()
        .duration_since(received)
        .unwrap_or_default()
        .as_nanos() as i128;
    let now = i128::from(host_unix_ns) + since;
    let spec = nix::sys::time::TimeSpec::new(
        i64::try_from(now / 1_000_000_000).map_err(|_| "host time out of range".to_owned())?,
        (now % 1_000_000_000) as _,
    );
    nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, spec)
        .map_err(|e| format!("cannot set the clock: {e}"))?;
    Ok((offset_ms, true))
}

/// A hostname of DNS labels (letters, digits, hyphens), 253 bytes at most.
fn hostname_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// The block-device filesystems mounted read-write, deepest first (a
/// filesystem mounted inside another is frozen before it, thawed after).
fn writable_mounts() -> Vec<PathBuf> {
    const FREEZABLE: &[&str] = &["ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "vfat"];
    let text = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut mounts: Vec<PathBuf> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (dev, at, fstype, opts) = (f.first()?, f.get(1)?, f.get(2)?, f.get(3)?);
            let rw = opts.split(',').next() == Some("rw");
            (dev.starts_with("/dev/") && rw && FREEZABLE.contains(fstype))
                .then(|| PathBuf::from(at.replace("\\040", " ")))
        })
        .collect();
    mounts.sort();
    mounts.dedup();
    mounts.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    mounts
}

fn fs_ioctl(mount: &Path, freeze: bool) -> Result<(), String> {
    let dir = fs::File::open(mount).map_err(|e| format!("cannot open {}: {e}", mount.display()))?;
    let code = if freeze {
        nix::request_code_readwrite!(b'X', 119, std::mem::size_of::<i32>())
    } else {
        nix::request_code_readwrite!(b'X', 120, std::mem::size_of::<i32>())
    };
    let mut zero: i32 = 0;
    // SAFETY: FIFREEZE and FITHAW take an int the kernel ignores; the fd
    // is an open directory of the filesystem.
    let done = unsafe { nix::libc::ioctl(dir.as_raw_fd(), code as _, &mut zero) };
    if done != 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!(
            "{} {}: {e}",
            if freeze { "FIFREEZE" } else { "FITHAW" },
            mount.display()
        ));
    }
    Ok(())
}

/// Thaws what `freezing` holds, in the reverse of its freezing order.
fn thaw_all(freezing: &mut Freezing) -> Vec<String> {
    let mut thawed = Vec::new();
    for mount in freezing.mounts.drain(..).rev() {
        // A filesystem thawed by someone else answers EINVAL: thawed too.
        let _ = fs_ioctl(&mount, false);
        thawed.push(mount.display().to_string());
    }
    freezing.generation += 1;
    thawed
}

fn lock(m: &Mutex<Freezing>) -> std::sync::MutexGuard<'_, Freezing> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Inside for Guest {
    fn status(&self) -> Status {
        status_now()
    }

    fn resumed(&self, r: &Resumed, received: SystemTime) -> Result<Reseeded, String> {
        // It runs again: the stall check quieted for its save comes back
        // once a grace period in flight then has ended.
        self.quiet.resumed();
        // The clock first: the reseed's ioctls take no time worth counting,
        // but the lease renewal's program does.
        let (clock_offset_ms, clock_set) = clock(r.host_unix_ns, r.clock_slack_ms, received)?;
        reseed(&r.entropy)?;
        Ok(Reseeded {
            credited_bytes: u32::try_from(r.entropy.len()).unwrap_or(u32::MAX),
            crng_reseeded: true,
            clock_offset_ms,
            clock_set,
            lease_renewed: r.renew_lease && renew_leases(),
        })
    }

    fn identity(&self, i: &Identity) -> Result<IdentityApplied, String> {
        let mut applied = IdentityApplied::default();
        let mut steps = Steps::new();
        if !i.hostname.is_empty() {
            if !hostname_ok(&i.hostname) {
                return Err(format!("{:?} is not a hostname", i.hostname));
            }
            nix::unistd::sethostname(&i.hostname)
                .map_err(|e| format!("cannot set the hostname: {e}"))?;
            write_whole(
                Path::new("/etc/hostname"),
                &format!("{}\n", i.hostname),
                0o644,
            )?;
            applied.hostname = i.hostname.clone();
            steps.done("hostname");
        }
        let mut reload = false;
        if !i.ssh_host_key.is_empty() {
            let (fingerprint, needed) = host_key(&i.ssh_host_key, &i.ssh_host_certificate)?;
            applied.ssh_host_key_fingerprint = fingerprint;
            reload = needed;
            steps.done("host key");
        }
        // Who may log in, before its MACs: the clone answers nothing at
        // its new address until they change (its guard drops the
        // template's), and must never answer there to its template's keys.
        let user = if !i.user.is_empty() {
            Some(i.user.clone())
        } else if i.set_authorized_keys || !i.authorized_keys.is_empty() {
            Some(login_user()?)
        } else {
            None
        };
        let mut home = None;
        if let Some(user) = user {
            let (written, dir) = authorized_keys(&user, &i.authorized_keys)?;
            applied.authorized_keys = written;
            home = Some(dir);
            steps.done("authorized keys");
        }
        let (macs, moved) = change_macs(&i.nics)?;
        applied.macs = macs;
        steps.done("MACs");
        // Its DHCP client fetches the new leases while what was written is
        // synced. Both waits are done before the answer (each moved NIC's
        // new lease, and sshd listening again with the new key where it
        // must be reloaded), so no one is told the clone is its own while
        // either is not.
        let waited = std::thread::scope(|s| -> Result<(bool, bool), String> {
            let leases = s.spawn(|| await_new_leases(&moved));
            // Its status too, mostly in the waits of the two steps below,
            // so that the host need not ask for it after.
            let status = s.spawn(status_now);
            let mut written = vec![Path::new("/etc")];
            written.extend(home.as_deref());
            sync_filesystems(&written)?;
            steps.done("sync");
            let reloaded = reload && reload_sshd();
            let readdressed = leases.join().unwrap_or(false);
            applied.status = status.join().ok();
            Ok((reloaded, readdressed))
        });
        let (reloaded, readdressed) = waited?;
        steps.done(if reload {
            "sshd reload and leases"
        } else {
            "leases"
        });
        applied.sshd_reloaded = reloaded;
        applied.readdressed = readdressed;
        applied.steps = steps.took;
        Ok(applied)
    }

    fn freeze(&self, thaw_after: Duration) -> Result<Vec<String>, String> {
        let mut freezing = lock(&self.frozen);
        if !freezing.mounts.is_empty() {
            return Err("already frozen: thaw first".into());
        }
        for mount in writable_mounts() {
            if let Err(e) = fs_ioctl(&mount, true) {
                thaw_all(&mut freezing);
                return Err(e);
            }
            freezing.mounts.push(mount);
        }
        freezing.generation += 1;
        let generation = freezing.generation;
        let frozen: Vec<String> = freezing
            .mounts
            .iter()
            .map(|m| m.display().to_string())
            .collect();
        drop(freezing);
        // The thaw that happens whatever the host does: this thread writes
        // nothing before it thaws (a write to a frozen filesystem waits).
        let shared = std::sync::Arc::clone(&self.frozen);
        std::thread::spawn(move || {
            std::thread::sleep(thaw_after);
            let mut freezing = lock(&shared);
            if freezing.generation == generation {
                thaw_all(&mut freezing);
            }
        });
        Ok(frozen)
    }

    fn thaw(&self) -> Result<Vec<String>, String> {
        Ok(thaw_all(&mut lock(&self.frozen)))
    }

    fn saving(&self) -> Result<Quieted, String> {
        self.quiet.saving()
    }

    fn power_off(&self) {
        nix::unistd::sync();
        if systemd()
            && run(
                "systemctl",
                &["poweroff", "--no-block"],
                Duration::from_secs(5),
            )
            .is_ok()
        {
            return;
        }
        let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
    }
}

/// Each step of a request, timed from the end of the one before.
struct Steps {
    since: Instant,
    took: Vec<StepTook>,
}

impl Steps {
    fn new() -> Self {
        Self {
            since: Instant::now(),
            took: Vec::new(),
        }
    }

    /// `step` ended now.
    fn done(&mut self, step: &str) {
        let now = Instant::now();
        let micros = now.duration_since(self.since).as_micros();
        self.took.push(StepTook {
            step: step.to_owned(),
            micros: u32::try_from(micros).unwrap_or(u32::MAX),
        });
        self.since = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostnames_are_dns_labels() {
        assert!(hostname_ok("vm-1.example"));
        for bad in ["", "-a", "a-", "a..b", "a/b", "a b", &"x".repeat(64)] {
            assert!(!hostname_ok(bad), "{bad:?}");
        }
    }

    #[test]
    fn meminfo_reads_a_key_in_kib() {
        let text = "MemTotal:       2000 kB\nMemAvailable:   1500 kB\n";
        assert_eq!(
            (meminfo(text, "MemTotal"), meminfo(text, "MemAvailable")),
            (2000, 1500)
        );
    }

    #[test]
    fn a_clock_within_its_slack_is_left_alone() {
        let now = SystemTime::now();
        let host = i64::try_from(unix_ns(now)).expect("now") - 20_000_000;
        assert_eq!(clock(host, 100, now), Ok((20, false)));
    }
}
