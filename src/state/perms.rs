//! Who may read the state dir: root, and each VM's jailed hypervisor its
//! own files; nobody else (the threat model in the crate's docs). Records and the
//! persisted snapshot hold user-data, volumes hold tenants' data.
//!
//! Files are 0600. Directories are 0700, except those a jailed VMM must pass
//! through to reach its own files by path (the state dir itself, `vms/`,
//! each `vms/<id>/` and `volumes/`): those are 0711, searchable but not
//! listable, so another local user can reach only names it already knows,
//! and every one of those is 0700 or 0600 (a VMM's own files are 0600 and
//! its user's). New files get these modes from their creation
//! (the agent's umask is 077 and each creation names its mode); a state dir
//! made by an older agent, or by hand, is brought to them at start.

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// The state dir, `vms/`, each VM's directory and `volumes/`.
pub const SEARCHABLE_DIR: u32 = 0o711;
pub const DIR: u32 = 0o700;
pub const FILE: u32 = 0o600;

/// Deepest level below the state dir that holds the agent's files
/// (`vms/<id>/<file>`).
const DEPTH: usize = 3;

/// Makes `dir` and any missing parents, each new one 0700 from its
/// creation (whatever the umask).
pub fn make_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new().recursive(true).mode(DIR).create(dir)
}

/// Makes `dir`, 0700 from its creation, inside a parent that must be
/// there: for a directory of the state dir made while the agent runs (a
/// VM's, `net/`), so that a state dir removed under a running agent (or
/// a test's, after it ended) fails the write, where [`make_dir`] would
/// make a state dir of one file again.
pub fn make_dir_in(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    match fs::DirBuilder::new().mode(DIR).create(dir) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        made => made,
    }
}

/// Brings every entry under `root` to the modes above; returns how many it
/// changed. Symlinks are left alone (the agent makes none), and their
/// targets are never followed.
pub fn tighten(root: &Path) -> io::Result<usize> {
    let mut changed = 0;
    set(root, SEARCHABLE_DIR, &mut changed)?;
    walk(root, 1, &mut changed)?;
    Ok(changed)
}

fn walk(dir: &Path, depth: usize, changed: &mut usize) -> io::Result<()> {
    let in_vms = depth == 2 && dir.file_name().is_some_and(|n| n == "vms");
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        // An entry renamed or removed since it was listed (another agent's
        // atomic write on this state dir, which the lock then refuses) has
        // nothing left to tighten.
        let meta = match fs::symlink_metadata(&path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            meta => meta?,
        };
        if meta.is_dir() {
            let name = entry.file_name();
            // A VM's own directory, not one being deleted (`.deleting-…`).
            let vm_dir = in_vms && !name.to_string_lossy().starts_with('.');
            let searchable = vm_dir || (depth == 1 && (name == "vms" || name == "volumes"));
            set(
                &path,
                if searchable { SEARCHABLE_DIR } else { DIR },
                changed,
            )?;
            if depth < DEPTH {
                walk(&path, depth + 1, changed)?;
            }
        } else if meta.is_file() {
            // Keep the owner's bits (an executable stays executable to
            // its owner); drop everyone else's.
            let mode = meta.permissions().mode() & 0o7777;
            if mode & 0o077 != 0 {
                match set(&path, mode & 0o700, changed) {
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    done => done?,
                }
            }
        }
    }
    Ok(())
}

fn set(path: &Path, mode: u32, changed: &mut usize) -> io::Result<()> {
    let now = fs::symlink_metadata(path)?.permissions().mode() & 0o7777;
    if now != mode {
        fs::set_permissions(path, fs::Permissions::from_mode(mode))?;
        *changed += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        fs::symlink_metadata(p).expect("stat").permissions().mode() & 0o7777
    }

    #[test]
    fn a_state_dir_left_open_is_closed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("state");
        fs::create_dir_all(root.join("vms/web-1")).expect("dirs");
        fs::create_dir_all(root.join("net")).expect("dirs");
        fs::create_dir_all(root.join("volumes")).expect("dirs");
        fs::write(root.join("vms/web-1/record.json"), b"{}").expect("record");
        fs::write(root.join("snapshot.pb"), b"x").expect("snapshot");
        for p in [
            &root,
            &root.join("vms"),
            &root.join("vms/web-1"),
            &root.join("net"),
        ] {
            fs::set_permissions(p, fs::Permissions::from_mode(0o755)).expect("chmod");
        }
        for p in [root.join("vms/web-1/record.json"), root.join("snapshot.pb")] {
            fs::set_permissions(p, fs::Permissions::from_mode(0o644)).expect("chmod");
        }

        let changed = tighten(&root).expect("tighten");

        assert_eq!(changed, 7);
        assert_eq!(mode(&root), 0o711);
        assert_eq!(mode(&root.join("vms")), 0o711);
        assert_eq!(mode(&root.join("volumes")), 0o711);
        assert_eq!(mode(&root.join("vms/web-1")), 0o711);
        assert_eq!(mode(&root.join("net")), 0o700);
        assert_eq!(mode(&root.join("vms/web-1/record.json")), 0o600);
        assert_eq!(mode(&root.join("snapshot.pb")), 0o600);
    }

    #[test]
    fn a_symlink_is_neither_changed_nor_followed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("state");
        fs::create_dir_all(&root).expect("dir");
        let outside = dir.path().join("outside");
        fs::write(&outside, b"x").expect("outside");
        fs::set_permissions(&outside, fs::Permissions::from_mode(0o644)).expect("chmod");
        std::os::unix::fs::symlink(&outside, root.join("link")).expect("symlink");

        tighten(&root).expect("tighten");

        assert_eq!(mode(&outside), 0o644);
    }
}
