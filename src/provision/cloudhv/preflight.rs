//! Whether this host can run guests with cloud-hypervisor at all: each
//! missing piece is a host condition (see [`crate::error::Failure`]) that
//! names it and says how to fix it: no create attempt is spent on it, and
//! it is asked again before every create, so a fixed host is seen within a
//! tick.

use std::fs::OpenOptions;
use std::io::{self, Read};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{CloudHvError, CloudHypervisor, MIN_VERSION};
use crate::error::Outcome;
use crate::provision::jail::paths::{self, Need};

/// What [`MIN_VERSION`] brings.
pub(crate) const FLOOR_NEED: &str = "v53 is the oldest release that passes every check of make compat: v52 resumed a guest busy when it was suspended into one that never answered again, and v51 cannot use the taps the agent hands each VMM inside its own network namespace";

/// The first release that maps huge pages reserved (`reserve=on`):
/// before it, a guest's pages are taken only as it touches them, and a
/// pool run dry kills the running guest's VMM instead of failing a boot.
pub(super) const HUGEPAGES_MIN_VERSION: u32 = 53;
const HUGEPAGES_NEED: &str = "with --guest-hugepages yes it maps each guest's memory reserved (reserve=on), so a pool run dry fails a boot and never kills a running guest";

impl CloudHypervisor {
    pub(super) fn check_host(&self) -> Outcome {
        // Resolved to an absolute path when the backend was made.
        let path = self.cfg.hypervisor.binary.clone();
        if !path.is_absolute() || crate::programs::find(&path.to_string_lossy()).is_none() {
            return Err(CloudHvError::NotExecutable { path }.into());
        }
        // Asked once per binary: `--version` is a fork and an exec (5 ms of
        // every create: the `preflight` stage of `make bench-create`). A
        // binary replaced in place (an upgrade, a downgrade) is another
        // file, and is asked again.
        let binary = Binary::of(&path);
        if binary.is_some() && *self.version_passed.lock() == binary {
            return self.check_devices();
        }
        let (min, why) = match self.cfg.hypervisor.hugepages {
            true => (HUGEPAGES_MIN_VERSION, HUGEPAGES_NEED),
            false => (MIN_VERSION, FLOOR_NEED),
        };
        match self.version().map(|line| (major_version(&line), line)) {
            Ok((Some(major), _)) if major >= min => {
                *self.version_passed.lock() = binary;
            }
            Ok((_, banner)) => {
                return Err(CloudHvError::TooOld {
                    path,
                    banner,
                    min,
                    why,
                }
                .into());
            }
            Err(source) => return Err(CloudHvError::Version { path, source }.into()),
        }
        self.check_devices()
    }

    /// What every create needs of the host besides the hypervisor: the KVM
    /// device, the tun device and the guest's boot file.
    fn check_devices(&self) -> Outcome {
        let kvm = &self.cfg.confinement.kvm;
        if let Err(source) = OpenOptions::new().read(true).write(true).open(kvm) {
            return Err(CloudHvError::Kvm { source }.into());
        }
        if !Path::new("/dev/net/tun").exists() {
            return Err(CloudHvError::NoTun.into());
        }
        match (&self.cfg.hypervisor.kernel, &self.cfg.hypervisor.firmware) {
            (Some(p), _) | (None, Some(p)) if p.is_file() => {}
            (Some(p), _) | (None, Some(p)) => {
                return Err(CloudHvError::BootFileMissing { path: p.clone() }.into());
            }
            (None, None) => return Err(CloudHvError::NoBootFile.into()),
        }
        // A piece of confinement the host lacks and the operator did not
        // allow going without: no VMM can start, so no create begins (its
        // taps would be plugged and unplugged at every tick for nothing).
        for piece in crate::provision::Piece::ALL {
            self.confined.uses(piece).map_err(CloudHvError::from)?;
        }
        self.check_reach()
    }

    /// Every path a jailed VMM is given by name is reachable by its user
    /// (see [`paths`]): its binary, its boot file, and the
    /// directories its VM's files and volumes are in. Any VMM's user
    /// stands for all: none owns a directory above its own VM's.
    fn check_reach(&self) -> Outcome {
        let Ok(ids) = &self.confined.ids else {
            // Unjailed (allowed): the VMM runs as root and reaches all.
            return Ok(());
        };
        let uid = ids.kvm_group.saturating_add(1);
        let groups = [uid, ids.kvm_group];
        let layout = self.store.layout();
        let boot_file = self
            .cfg
            .hypervisor
            .kernel
            .iter()
            .chain(&self.cfg.hypervisor.firmware);
        let needed = std::iter::once((
            self.cfg.hypervisor.binary.clone(),
            Need::Exec,
            "--hypervisor",
        ))
        .chain(boot_file.map(|p| (p.clone(), Need::Read, "--kernel or --firmware")))
        .chain([
            (layout.vms(), Need::Search, "--state-dir"),
            (layout.volumes(), Need::Search, "--state-dir"),
        ]);
        for (path, need, flag) in needed {
            if let Some(blocked) = paths::blocked(&path, uid, &groups, need) {
                return Err(CloudHvError::Unreachable {
                    path,
                    blocked,
                    flag,
                }
                .into());
            }
        }
        Ok(())
    }

    /// The first line `--version` prints, within a bound.
    fn version(&self) -> io::Result<String> {
        version_of(&self.cfg.hypervisor.binary)
    }
}

/// The first line `binary --version` prints, within a bound.
pub(crate) fn version_of(binary: &Path) -> io::Result<String> {
    let mut child = Command::new(binary)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "--version did not answer within 5s",
                ));
            }
        }
    }
    let mut out = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        let _ = stdout.read_to_string(&mut out);
    }
    Ok(out.lines().next().unwrap_or("").trim().to_owned())
}

/// Which file a path names, as far as telling a replaced binary goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Binary {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Binary {
    pub(super) fn of(path: &Path) -> Option<Binary> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        Some(Binary {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }
}

/// The major version in `cloud-hypervisor v53.0[-suffix]`.
pub(crate) fn major_version(line: &str) -> Option<u32> {
    let v = line.split_whitespace().find(|w| w.starts_with('v'))?;
    v[1..].split(['.', '-']).next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_from_the_banner() {
        assert_eq!(major_version("cloud-hypervisor v53.0"), Some(53));
        assert_eq!(major_version("cloud-hypervisor v41.0-dirty"), Some(41));
        assert_eq!(major_version("something else"), None);
    }
}
