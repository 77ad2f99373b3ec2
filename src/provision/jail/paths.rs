//! Whether a jailed VMM can reach, by path, what it is given: its binary,
//! its guest's kernel or firmware, its VM's directory and its volumes. The
//! VMM runs as its own user, so a state dir under a directory only root may
//! search (`mktemp -d`, `/root`, many CI and home directories) fails every
//! boot with the hypervisor's "Permission denied" - which says nothing of
//! which directory, and used to read as an error that may pass.
//!
//! The check reads each ancestor's mode, owner and ACL (see
//! [`super::acl::may`]) for the VMM's user and groups; it does
//! not switch a thread to that user to try: libc's setuid(2) changes the
//! ids of every thread of the process at once. The first directory (or
//! the file) that stops it is named, with the fix.

use std::fmt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::acl;

/// What the VMM needs of a path's last component.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Search it (a directory it reaches files through).
    Search,
    /// Read it (a kernel, a firmware).
    Read,
    /// Execute it (the hypervisor binary).
    Exec,
}

/// Where a path is blocked for the VMM's user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocked {
    /// The directory (or the file) that stops it.
    pub at: PathBuf,
    /// What the VMM needs there: search, read or execute.
    pub need: Need,
    pub mode: u32,
    pub owner: u32,
    pub group: u32,
}

impl Blocked {
    /// The change that lets every VMM through, and nobody more than that.
    pub fn fix(&self) -> String {
        let at = self.at.display();
        match self.need {
            Need::Search => format!("make it 0711 (chmod o+x {at})"),
            Need::Read => format!("make it readable by others (chmod o+r {at})"),
            Need::Exec => format!("make it executable by others (chmod o+rx {at})"),
        }
    }
}

impl fmt::Display for Blocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let need = match self.need {
            Need::Search => "search",
            Need::Read => "read",
            Need::Exec => "execute",
        };
        write!(
            f,
            "{} is {:04o} {}:{}, which they cannot {need}",
            self.at.display(),
            self.mode & 0o7777,
            self.owner,
            self.group
        )
    }
}

/// Where `path` stops a user `uid` in `groups` that needs `need` of it:
/// every directory on its way (after symlinks) must be searchable, and the
/// path itself must allow `need`. `None`: it is reachable, or it does not
/// exist (which other checks name).
pub fn blocked(path: &Path, uid: u32, groups: &[u32], need: Need) -> Option<Blocked> {
    let real = std::fs::canonicalize(path).ok()?;
    let mut steps: Vec<(PathBuf, Need)> = real
        .ancestors()
        .skip(1)
        .map(|dir| (dir.to_path_buf(), Need::Search))
        .collect();
    steps.reverse();
    steps.push((real, need));
    steps.into_iter().find_map(|(at, need)| {
        let want = match need {
            Need::Search | Need::Exec => 0o1,
            Need::Read => 0o4,
        };
        // A path that cannot be read is no verdict: the VMM finds out.
        let allowed = acl::may(&at, uid, groups, want).unwrap_or(true);
        let meta = std::fs::metadata(&at).ok()?;
        (!allowed).then(|| Blocked {
            at,
            need,
            mode: meta.mode(),
            owner: meta.uid(),
            group: meta.gid(),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// Someone who owns nothing here and is in no group of it.
    const STRANGER: u32 = 1_999_999_999;

    fn mode(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    #[test]
    fn a_0700_directory_on_the_way_is_named_with_its_fix() {
        let dir = tempfile::tempdir().expect("tempdir");
        let closed = dir.path().join("closed");
        let state = closed.join("state");
        std::fs::create_dir_all(&state).expect("dirs");
        mode(dir.path(), 0o711);
        mode(&closed, 0o700);
        mode(&state, 0o711);

        let found = blocked(&state, STRANGER, &[STRANGER], Need::Search).expect("blocked");

        assert_eq!(found.at, closed);
        assert_eq!(
            found.fix(),
            format!("make it 0711 (chmod o+x {})", closed.display())
        );
    }

    #[test]
    fn an_open_path_is_reachable_and_a_0711_fix_lets_it_through() {
        let dir = tempfile::tempdir().expect("tempdir");
        let kernel = dir.path().join("vmlinux");
        std::fs::write(&kernel, b"k").expect("kernel");
        mode(dir.path(), 0o700);
        mode(&kernel, 0o644);
        let before = blocked(&kernel, STRANGER, &[STRANGER], Need::Read);

        mode(dir.path(), 0o711);

        assert!(before.is_some());
        assert_eq!(blocked(&kernel, STRANGER, &[STRANGER], Need::Read), None);
    }

    #[test]
    fn a_file_only_its_owner_may_read_blocks_reading() {
        let dir = tempfile::tempdir().expect("tempdir");
        let kernel = dir.path().join("vmlinux");
        std::fs::write(&kernel, b"k").expect("kernel");
        mode(dir.path(), 0o711);
        mode(&kernel, 0o600);

        let found = blocked(&kernel, STRANGER, &[STRANGER], Need::Read).expect("blocked");

        assert_eq!((found.at, found.need), (kernel, Need::Read));
    }
}
