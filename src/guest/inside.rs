//! The real guest, as `eitri-guest` sees it from inside (Linux): where
//! each answer is read from and how each request is carried out. Every
//! program it runs is the guest's own (`systemctl`, `networkctl`), by
//! fixed name and arguments, bounded in time; nothing the host sends
//! becomes a command or a path but the login user's name, checked against
//! the guest's own user database.

use std::fs;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::pb::guest::{Identity, IdentityApplied, NicMac, Reseeded, Resumed, Status, SystemState};

use super::serve::Inside;

/// The real guest. One per process: it holds what is frozen.
#[derive(Default)]
pub struct Guest {
    frozen: std::sync::Arc<Mutex<Freezing>>,
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

/// Renews the lease of every Ethernet interface through systemd-networkd,
/// where it runs: whether any was renewed.
fn renew_leases() -> bool {
    let ethernet = |name: &String| {
        // ARPHRD_ETHER.
        fs::read_to_string(format!("/sys/class/net/{name}/type")).is_ok_and(|t| t.trim() == "1")
    };
    let links: Vec<String> = fs::read_dir("/sys/class/net")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(ethernet)
                .collect()
        })
        .unwrap_or_default();
    renew_leases_of(&links)
}

/// Renews the leases of `links` through systemd-networkd, where it runs
/// (one at a time: a tunnel or an interface it does not manage fails a
/// renewal named with it). Whether any was renewed.
fn renew_leases_of(links: &[String]) -> bool {
    if !Path::new("/run/systemd/netif").is_dir() {
        return false;
    }
    let mut renewed = false;
    for link in links {
        match run("networkctl", &["renew", link], Duration::from_secs(5)) {
            Ok(_) => renewed = true,
            Err(e) => eprintln!("eitri-guest: {link}'s lease was not renewed: {e}"),
        }
    }
    renewed
}

/// The interface whose MAC is `mac`, by its name in `/sys/class/net`.
fn interface_with(mac: crate::model::Mac) -> Option<String> {
    fs::read_dir("/sys/class/net").ok()?.find_map(|entry| {
        let name = entry.ok()?.file_name().into_string().ok()?;
        let address = fs::read_to_string(format!("/sys/class/net/{name}/address")).ok()?;
        (crate::model::Mac::parse(address.trim()) == Some(mac)).then_some(name)
    })
}

/// An interface whose MAC was changed, and the IPv4 addresses it held
/// before (its template's lease).
struct Moved {
    name: String,
    before: Vec<std::net::Ipv4Addr>,
}

/// Each interface whose MAC is a pair's `from` given its `to` (taken
/// down for it where the driver cannot change it live): the MACs those
/// interfaces have now, and those changed now (one changed by an earlier
/// ask, answered and lost, is not again).
fn change_macs(nics: &[NicMac]) -> Result<(Vec<String>, Vec<Moved>), String> {
    let mut now = Vec::new();
    let mut moved = Vec::new();
    for nic in nics {
        let parse = |text: &str| {
            crate::model::Mac::parse(text).ok_or_else(|| format!("{text:?} is not a MAC"))
        };
        let (from, to) = (parse(&nic.from)?, parse(&nic.to)?);
        let name = match (interface_with(from), interface_with(to)) {
            (Some(name), _) => {
                moved.push(Moved {
                    name: name.clone(),
                    before: ipv4_addresses(&name),
                });
                name
            }
            // Done before: a request asked again after a lost answer.
            (None, Some(name)) => name,
            (None, None) => return Err(format!("no interface has the MAC {from}")),
        };
        // Live where the driver can (virtio-net can), else taken down for
        // it and brought up again.
        let set = || crate::net::packet::set_interface_mac(&name, to.octets());
        if set().is_err() {
            let fail = |what: &str, e: std::io::Error| format!("cannot {what} {name}: {e}");
            crate::net::packet::set_interface_up(&name, false).map_err(|e| fail("take down", e))?;
            let changed = set().map_err(|e| fail(&format!("give {to} to"), e));
            crate::net::packet::set_interface_up(&name, true).map_err(|e| fail("bring up", e))?;
            changed?;
        }
        let address = fs::read_to_string(format!("/sys/class/net/{name}/address"))
            .map_err(|e| format!("cannot read {name}'s MAC: {e}"))?;
        now.push(address.trim().to_owned());
    }
    Ok((now, moved))
}

/// The IPv4 addresses interface `name` holds now.
fn ipv4_addresses(name: &str) -> Vec<std::net::Ipv4Addr> {
    let Ok(all) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    all.filter(|a| a.interface_name == name)
        .filter_map(|a| Some(a.address?.as_sockaddr_in()?.ip()))
        .collect()
}

/// How long the interfaces a clone's identity moved are given to take
/// their new MACs' leases, and after how long their DHCP client is asked
/// to renew (systemd-networkd restarts its client when a MAC changes, so
/// the nudge is for a client that does not).
const NEW_LEASE: Duration = Duration::from_secs(3);
const NUDGE_AFTER: Duration = Duration::from_secs(1);

/// Waits until each moved interface holds an IPv4 address it did not
/// hold before: whether all do within [`NEW_LEASE`]. Until they do, the
/// guest answers nothing at its new address, and its row must not say
/// ready on the strength of an identity half applied.
fn await_new_leases(moved: &[Moved]) -> bool {
    let started = Instant::now();
    let mut nudged = false;
    loop {
        let waiting: Vec<&Moved> = moved
            .iter()
            .filter(|m| {
                !ipv4_addresses(&m.name)
                    .iter()
                    .any(|a| !m.before.contains(a))
            })
            .collect();
        if waiting.is_empty() {
            return true;
        }
        if started.elapsed() >= NEW_LEASE {
            return false;
        }
        if !nudged && started.elapsed() >= NUDGE_AFTER {
            nudged = true;
            let names: Vec<String> = waiting.iter().map(|m| m.name.clone()).collect();
            renew_leases_of(&names);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
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

/// A directory opened without following a link in its last component.
fn open_dir(path: &Path) -> Result<fs::File, String> {
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_DIRECTORY | nix::libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| format!("cannot open the directory {}: {e}", path.display()))
}

/// `text` written as `name` in `dir`, whole or not at all, with `mode`
/// (and `owner`'s): a new file beside it, created where nothing is (a link
/// a guest user planted there is removed, never followed), written,
/// renamed over `name`. Every step by the directory's descriptor, so a
/// user who owns the directory cannot send the write elsewhere. Not
/// synced: the caller syncs each filesystem it wrote to once, at the end
/// ([`sync_filesystems`]), one flush instead of one per file. A crash
/// before that may leave the old file or an empty new one (ext4 writes a
/// replacing file's data before the rename that commits it; others need
/// not); only a clone's identity writes here, and a clone booted again
/// from its disk takes its identity from its own seed.
fn write_in(
    dir: &fs::File,
    name: &str,
    text: &str,
    mode: u32,
    owner: Option<(nix::unistd::Uid, nix::unistd::Gid)>,
) -> Result<(), String> {
    use nix::fcntl::{OFlag, openat, renameat};
    use nix::sys::stat::Mode;
    let tmp = format!(".{name}.eitri-new");
    let fail = |e: &dyn std::fmt::Display| format!("cannot write {name}: {e}");
    let _ = nix::unistd::unlinkat(dir, tmp.as_str(), nix::unistd::UnlinkatFlags::NoRemoveDir);
    let fd = openat(
        dir,
        tmp.as_str(),
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(mode),
    )
    .map_err(|e| fail(&e))?;
    let mut f = fs::File::from(fd);
    f.write_all(text.as_bytes())
        .and_then(|()| f.set_permissions(fs::Permissions::from_mode(mode)))
        .map_err(|e| fail(&e))?;
    if let Some((uid, gid)) = owner {
        nix::unistd::fchown(&f, Some(uid), Some(gid)).map_err(|e| fail(&e))?;
    }
    renameat(dir, tmp.as_str(), dir, name).map_err(|e| fail(&e))
}

/// `text` written to `path` (a root-owned directory's file) as
/// [`write_in`] does.
fn write_whole(path: &Path, text: &str, mode: u32) -> Result<(), String> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return Err(format!("{} is no file's path", path.display()));
    };
    write_in(&open_dir(dir)?, name, text, mode, None)
}

const HOST_KEY: &str = "/etc/ssh/ssh_host_ed25519_key";
const HOST_CERTIFICATE: &str = "/etc/ssh/ssh_host_ed25519_key-cert.pub";
const SSHD_CONFIG: &str = "/etc/ssh/sshd_config";
const SSHD_DROP_IN: &str = "/etc/ssh/sshd_config.d/10-eitri.conf";

/// The host key files of the other types: a clone's are its template's,
/// the same in every sibling, so they are removed (the guest presents the
/// one key the host made for it).
const OTHER_HOST_KEYS: &[&str] = &[
    "/etc/ssh/ssh_host_rsa_key",
    "/etc/ssh/ssh_host_ecdsa_key",
    "/etc/ssh/ssh_host_dsa_key",
];

/// Where OpenSSH 9.8 and later keep `sshd-session`. Their listener loads
/// the host keys and hands them to each connection's session, so a key
/// changed on disk is served only after a reload; before 9.8 each
/// connection's re-executed sshd loads them from their files itself.
const SSHD_SESSION: &[&str] = &[
    "/usr/lib/openssh/sshd-session",
    "/usr/libexec/openssh/sshd-session",
    "/usr/libexec/sshd-session",
    "/usr/lib/ssh/sshd-session",
    "/usr/local/libexec/sshd-session",
];

/// Installs a host key (and its certificate) where sshd reads its ed25519
/// key, removes the other types' keys, and has sshd serve it: its
/// fingerprint, and whether sshd was reloaded for it.
///
/// A reload (sshd executing itself anew) is the slowest thing a clone's
/// identity did, most of it the restored guest faulting its pages in one
/// by one, so it is done only where a new connection would not otherwise
/// get the new key: sshd's configuration does not name the key or the
/// certificate (a drop-in is written that does), or the sshd is one that
/// hands its connections the keys it loaded at start.
fn host_key(pem: &str, certificate: &str) -> Result<(String, bool), String> {
    let key = crate::hostkey::parse(pem)
        .ok_or_else(|| "the host key is not an unencrypted OpenSSH ed25519 key".to_owned())?;
    let certificate = certificate.trim();
    if certificate.contains('\n') {
        return Err("the host certificate is more than one line".into());
    }
    let fingerprint = crate::hostkey::fingerprint(&key.public_line)
        .ok_or_else(|| "the host key's public half does not parse".to_owned())?;
    write_whole(Path::new(HOST_KEY), pem, 0o600)?;
    write_whole(
        Path::new(&format!("{HOST_KEY}.pub")),
        &format!("{}\n", key.public_line),
        0o644,
    )?;
    if certificate.is_empty() {
        remove(HOST_CERTIFICATE)?;
    } else {
        write_whole(
            Path::new(HOST_CERTIFICATE),
            &format!("{certificate}\n"),
            0o644,
        )?;
    }
    for other in OTHER_HOST_KEYS {
        for suffix in ["", ".pub", "-cert.pub"] {
            remove(&format!("{other}{suffix}"))?;
        }
    }
    let mut reload = SSHD_SESSION.iter().any(|p| Path::new(p).exists());
    if !sshd_names(SSHD_CONFIG).serve(!certificate.is_empty()) {
        let mut conf = format!("HostKey {HOST_KEY}\n");
        if !certificate.is_empty() {
            conf.push_str(&format!("HostCertificate {HOST_CERTIFICATE}\n"));
        }
        write_whole(Path::new(SSHD_DROP_IN), &conf, 0o644)?;
        reload = true;
    }
    Ok((fingerprint, reload && reload_sshd()))
}

/// `path` removed, if it is there.
fn remove(path: &str) -> Result<(), String> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("cannot remove {path}: {e}")),
    }
}

/// The host keys and certificates an sshd configuration names.
#[derive(Debug, Default, PartialEq)]
struct SshdNames {
    host_keys: Vec<String>,
    certificates: Vec<String>,
}

impl SshdNames {
    /// Whether an sshd so configured serves the ed25519 key at its usual
    /// path (and its certificate, where there is one).
    fn serve(&self, certificate: bool) -> bool {
        let key = self.host_keys.is_empty() || self.host_keys.iter().any(|k| k == HOST_KEY);
        key && (!certificate || self.certificates.iter().any(|c| c == HOST_CERTIFICATE))
    }
}

/// What the configuration `path` and the files it includes name as host
/// keys and certificates (each may be given more than once; no key named
/// means sshd's defaults, the ed25519 key among them). An `Include` is
/// followed where its pattern is a file, or a directory's `*` or `*.conf`;
/// a `Match` ends the global part, where neither may appear.
fn sshd_names(path: &str) -> SshdNames {
    let mut names = SshdNames::default();
    sshd_names_into(Path::new(path), &mut names, 0);
    names
}

/// Adds what `path` names to `names`: false once a `Match` was met.
fn sshd_names_into(path: &Path, names: &mut SshdNames, depth: u32) -> bool {
    let Ok(text) = fs::read_to_string(path) else {
        return true;
    };
    for line in text.lines().map(str::trim) {
        let (word, rest) = line
            .split_once(|c: char| c.is_whitespace() || c == '=')
            .unwrap_or((line, ""));
        let value = rest
            .trim_start_matches(|c: char| c.is_whitespace() || c == '=')
            .trim();
        match word.to_ascii_lowercase().as_str() {
            "hostkey" => names.host_keys.push(value.to_owned()),
            "hostcertificate" => names.certificates.push(value.to_owned()),
            "match" => return false,
            "include" if depth < 8 => {
                for pattern in value.split_whitespace() {
                    for file in included(pattern) {
                        if !sshd_names_into(&file, names, depth + 1) {
                            return false;
                        }
                    }
                }
            }
            _ => {}
        }
    }
    true
}

/// The files an `Include` pattern names, in sshd's (lexical) order: a
/// relative pattern is under /etc/ssh.
fn included(pattern: &str) -> Vec<PathBuf> {
    let pattern = Path::new("/etc/ssh").join(pattern);
    let (Some(dir), Some(name)) = (
        pattern.parent(),
        pattern.file_name().and_then(|n| n.to_str()),
    ) else {
        return Vec::new();
    };
    let suffix = match name {
        "*" => "",
        "*.conf" => ".conf",
        _ if !name.contains(['*', '?', '[']) => return vec![pattern.clone()],
        _ => return Vec::new(),
    };
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| !n.starts_with('.') && n.ends_with(suffix))
                .map(|n| dir.join(n))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// Each filesystem holding one of `dirs` synced, once (syncfs).
fn sync_filesystems(dirs: &[&Path]) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let mut synced = Vec::new();
    for dir in dirs {
        let file = open_dir(dir)?;
        let device = file
            .metadata()
            .map_err(|e| format!("cannot stat {}: {e}", dir.display()))?
            .dev();
        if synced.contains(&device) {
            continue;
        }
        nix::unistd::syncfs(&file)
            .map_err(|e| format!("cannot sync the filesystem of {}: {e}", dir.display()))?;
        synced.push(device);
    }
    Ok(())
}

/// How long a reloaded sshd is given to listen again.
const SSHD_RELOAD: Duration = Duration::from_secs(5);

/// Asks sshd to read its configuration and keys again (SIGHUP to the
/// listener: new connections get the new key, open ones stay), and waits
/// until it listens again: sshd execs itself anew, closing its listening
/// sockets for a moment, and a client the host told "applied" was refused
/// in that moment on a real guest. Whether it listens again in time.
fn reload_sshd() -> bool {
    let pid = ["/run/sshd.pid", "/var/run/sshd.pid"]
        .iter()
        .find_map(|p| fs::read_to_string(p).ok()?.trim().parse::<i32>().ok());
    let Some(pid) = pid.filter(|pid| *pid > 1) else {
        return false;
    };
    let before = listening_sockets(22);
    let signalled = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGHUP,
    )
    .is_ok();
    if !signalled || before.is_empty() {
        return signalled;
    }
    // Listening again: on sockets of its own, none of the old ones.
    let until = Instant::now() + SSHD_RELOAD;
    while Instant::now() < until {
        let now = listening_sockets(22);
        if !now.is_empty() && now.is_disjoint(&before) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// The inodes of the sockets listening on TCP `port` (IPv4 and IPv6), as
/// the kernel lists them.
fn listening_sockets(port: u16) -> std::collections::HashSet<u64> {
    let port = format!("{port:04X}");
    let mut found = std::collections::HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl, local address:port, remote, state, queues, …, inode (10th).
            let (Some(local), Some(state), Some(inode)) =
                (fields.get(1), fields.get(3), fields.get(9))
            else {
                continue;
            };
            if local.rsplit(':').next() == Some(port.as_str())
                && *state == "0A"
                && let Ok(inode) = inode.parse()
            {
                found.insert(inode);
            }
        }
    }
    found
}

/// Writes `user`'s authorized_keys, whole: the number of keys written,
/// and the user's home.
/// The guest's login user, for keys sent without one: the one account of
/// a person (uid 1000 to 59999, as Debian and Fedora number them) whose
/// home holds an `.ssh/authorized_keys`, as cloud-init leaves its
/// default user. None, or more than one, is refused: the host names it.
fn login_user() -> Result<String, String> {
    let passwd =
        fs::read_to_string("/etc/passwd").map_err(|e| format!("cannot read /etc/passwd: {e}"))?;
    let users = login_users(&passwd, |home| {
        Path::new(home).join(".ssh/authorized_keys").is_file()
    });
    match users.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err("no login user holds authorized keys in this guest: name the user".into()),
        many => Err(format!(
            "{} users hold authorized keys in this guest ({}): name the user",
            many.len(),
            many.join(", ")
        )),
    }
}

/// The accounts of people in `passwd` whose home `has_keys`.
fn login_users(passwd: &str, has_keys: impl Fn(&str) -> bool) -> Vec<String> {
    passwd
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            let uid: u32 = fields.get(2)?.parse().ok()?;
            let home = fields.get(5)?;
            ((1000..60000).contains(&uid) && has_keys(home)).then(|| fields[0].to_owned())
        })
        .collect()
}

fn authorized_keys(user: &str, keys: &[String]) -> Result<(u32, PathBuf), String> {
    let account = nix::unistd::User::from_name(user)
        .map_err(|e| format!("cannot look up user {user:?}: {e}"))?
        .ok_or_else(|| format!("no user {user:?} in this guest"))?;
    if keys.iter().any(|k| k.contains('\n') || k.trim().is_empty()) {
        return Err("an authorized key is empty or more than one line".into());
    }
    // The home and its .ssh are the user's: each step by descriptor, and
    // a .ssh that is not a directory (a link to /etc, say) refused.
    let home = open_dir(&account.dir)?;
    match nix::sys::stat::mkdirat(
        &home,
        ".ssh",
        nix::sys::stat::Mode::from_bits_truncate(0o700),
    ) {
        Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
        Err(e) => return Err(format!("cannot make {user}'s .ssh: {e}")),
    }
    let ssh = nix::fcntl::openat(
        &home,
        ".ssh",
        nix::fcntl::OFlag::O_RDONLY
            | nix::fcntl::OFlag::O_DIRECTORY
            | nix::fcntl::OFlag::O_NOFOLLOW
            | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map(fs::File::from)
    .map_err(|e| format!("{user}'s .ssh is not a directory of its own: {e}"))?;
    nix::unistd::fchown(&ssh, Some(account.uid), Some(account.gid))
        .and_then(|()| {
            nix::sys::stat::fchmod(&ssh, nix::sys::stat::Mode::from_bits_truncate(0o700))
        })
        .map_err(|e| format!("cannot give {user} its .ssh: {e}"))?;
    let mut text = keys.join("\n");
    if !text.is_empty() {
        text.push('\n');
    }
    write_in(
        &ssh,
        "authorized_keys",
        &text,
        0o600,
        Some((account.uid, account.gid)),
    )?;
    let written = u32::try_from(keys.len()).map_err(|_| "too many keys")?;
    Ok((written, account.dir))
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

    fn resumed(&self, r: &Resumed, received: SystemTime) -> Result<Reseeded, String> {
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
        }
        if !i.ssh_host_key.is_empty() {
            let (fingerprint, reloaded) = host_key(&i.ssh_host_key, &i.ssh_host_certificate)?;
            applied.ssh_host_key_fingerprint = fingerprint;
            applied.sshd_reloaded = reloaded;
        }
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
        }
        let mut written = vec![Path::new("/etc")];
        written.extend(home.as_deref());
        sync_filesystems(&written)?;
        let (macs, moved) = change_macs(&i.nics)?;
        applied.macs = macs;
        applied.readdressed = await_new_leases(&moved);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_socket_is_found_by_its_port_and_gone_once_closed() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();

        let open = listening_sockets(port);
        drop(listener);

        assert_eq!(open.len(), 1, "{open:?}");
        assert!(listening_sockets(port).is_empty());
    }

    #[test]
    fn sshd_with_no_host_key_named_serves_its_default_ed25519_key() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("sshd_config");
        fs::write(&config, "#HostKey /etc/ssh/ssh_host_rsa_key\nPort 22\n").unwrap();

        let named = sshd_names(config.to_str().unwrap());

        assert!(named.serve(false));
        assert!(!named.serve(true), "no HostCertificate is named");
    }

    #[test]
    fn sshd_naming_only_other_host_keys_does_not_serve_the_ed25519_one() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("sshd_config");
        fs::write(&config, "HostKey /etc/ssh/ssh_host_rsa_key\n").unwrap();

        assert!(!sshd_names(config.to_str().unwrap()).serve(false));
    }

    #[test]
    fn sshd_names_are_read_through_includes_until_a_match() {
        let dir = tempfile::tempdir().unwrap();
        let drop_ins = dir.path().join("d");
        fs::create_dir(&drop_ins).unwrap();
        fs::write(
            drop_ins.join("50-cert.conf"),
            format!("HostCertificate = {HOST_CERTIFICATE}\n"),
        )
        .unwrap();
        fs::write(drop_ins.join("README"), "HostKey /not/a/conf\n").unwrap();
        let config = dir.path().join("sshd_config");
        fs::write(
            &config,
            format!(
                "Include {}/*.conf\nhostkey {HOST_KEY}\nMatch User x\nHostKey /after/match\n",
                drop_ins.display()
            ),
        )
        .unwrap();

        let named = sshd_names(config.to_str().unwrap());

        assert_eq!(
            named,
            SshdNames {
                host_keys: vec![HOST_KEY.to_owned()],
                certificates: vec![HOST_CERTIFICATE.to_owned()],
            }
        );
        assert!(named.serve(true));
    }

    #[test]
    fn the_login_user_is_a_persons_account_holding_keys() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\n\
                      nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n\
                      debian:x:1000:1000::/home/debian:/bin/bash\n\
                      ops:x:1001:1001::/home/ops:/bin/bash\n";

        let users = login_users(passwd, |home| home == "/home/debian" || home == "/root");

        assert_eq!(users, ["debian"]);
    }

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
    fn a_link_planted_where_the_new_file_goes_is_not_followed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let elsewhere = dir.path().join("shadow");
        fs::write(&elsewhere, "root:secret\n").expect("write");
        let ssh = dir.path().join("ssh");
        fs::create_dir(&ssh).expect("mkdir");
        std::os::unix::fs::symlink(&elsewhere, ssh.join(".authorized_keys.eitri-new"))
            .expect("link");

        write_in(
            &open_dir(&ssh).expect("open"),
            "authorized_keys",
            "key\n",
            0o600,
            None,
        )
        .expect("written");

        assert_eq!(
            fs::read_to_string(&elsewhere).expect("read"),
            "root:secret\n"
        );
        assert_eq!(
            fs::read_to_string(ssh.join("authorized_keys")).expect("read"),
            "key\n"
        );
    }

    #[test]
    fn a_directory_that_is_a_link_is_not_opened() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::os::unix::fs::symlink("/etc", dir.path().join(".ssh")).expect("link");

        assert!(open_dir(&dir.path().join(".ssh")).is_err());
    }

    #[test]
    fn a_clock_within_its_slack_is_left_alone() {
        let now = SystemTime::now();
        let host = i64::try_from(unix_ns(now)).expect("now") - 20_000_000;
        assert_eq!(clock(host, 100, now), Ok((20, false)));
    }
}
