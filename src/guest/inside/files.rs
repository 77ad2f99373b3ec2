//! Files the guest agent writes for the host: each whole or not at all,
//! by a directory's descriptor (no link a guest user planted is
//! followed), synced once per filesystem; and the login user whose keys
//! they are.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

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
pub(super) fn write_whole(path: &Path, text: &str, mode: u32) -> Result<(), String> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return Err(format!("{} is no file's path", path.display()));
    };
    write_in(&open_dir(dir)?, name, text, mode, None)
}

/// Each filesystem holding one of `dirs` synced, once (syncfs).
pub(super) fn sync_filesystems(dirs: &[&Path]) -> Result<(), String> {
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

/// The guest's login user, for keys sent without one: the one account of
/// a person (uid 1000 to 59999, as Debian and Fedora number them) whose
/// home holds an `.ssh/authorized_keys`, as cloud-init leaves its
/// default user. None, or more than one, is refused: the host names it.
pub(super) fn login_user() -> Result<String, String> {
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

/// Writes `user`'s authorized_keys, whole: the number of keys written,
/// and the user's home.
pub(super) fn authorized_keys(user: &str, keys: &[String]) -> Result<(u32, PathBuf), String> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn the_login_user_is_a_persons_account_holding_keys() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\n\
                      nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n\
                      debian:x:1000:1000::/home/debian:/bin/bash\n\
                      ops:x:1001:1001::/home/ops:/bin/bash\n";

        let users = login_users(passwd, |home| home == "/home/debian" || home == "/root");

        assert_eq!(users, ["debian"]);
    }
}
