//! Letting the jailed hypervisors' group open /dev/kvm (and, for a VMM that
//! resumes, /dev/userfaultfd), and one VMM's user read a file it does not
//! own (a clone's link to its template's memory: see
//! `cloudhv::suspend::clone`).
//!
//! Every VMM runs as its own user, with one shared supplementary group that
//! may open the KVM device. A host whose /dev/kvm already belongs to that
//! group (rw) needs nothing. Otherwise the agent adds a POSIX ACL entry
//! granting that group read and write, the way libvirt and logind grant
//! device access: the owner, the device's group and everyone else keep
//! exactly what they had. udev rebuilds the node (and drops the entry) when
//! the module reloads or the host reboots; the agent checks, and grants
//! again, before every boot.

use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use nix::libc;

const XATTR: &[u8] = b"system.posix_acl_access\0";
const VERSION: u32 = 2;
const USER_OBJ: u16 = 0x01;
const USER: u16 = 0x02;
const GROUP_OBJ: u16 = 0x04;
const GROUP: u16 = 0x08;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;
const NO_ID: u32 = u32::MAX;
const RW: u16 = 0o6;
const READ: u16 = 0o4;

/// Every change is a read of the whole ACL and a write of it back: two at
/// once on one file (two clones lent their template's memory, two VMMs'
/// groups given a device) would lose one's entry. The agent is the one
/// writer of the entries it makes (one agent a host: its claim), so one
/// lock in it orders them.
static EDITING: parking_lot::Mutex<()> = parking_lot::const_mutex(());

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    tag: u16,
    perm: u16,
    id: u32,
}

/// Makes `path` open to group `gid` for reading and writing: nothing if
/// it already is, else an ACL entry, checked after it is written.
pub fn give_group_read_write(path: &Path, gid: u32) -> io::Result<()> {
    if group_may_read_write(path, gid).unwrap_or(false) {
        return Ok(());
    }
    grant_group(path, gid)?;
    if group_may_read_write(path, gid)? {
        log::info!(
            "gave the hypervisors' group {gid} read-write access to {} (an ACL entry)",
            path.display()
        );
        Ok(())
    } else {
        Err(io::Error::other("the entry was written but grants nothing"))
    }
}

/// Whether members of group `gid` may open `path` for reading and writing.
pub fn group_may_read_write(path: &Path, gid: u32) -> io::Result<bool> {
    let meta = std::fs::metadata(path)?;
    let entries = match read(path)? {
        Some(entries) => entries,
        None => return Ok(meta.gid() == gid && (meta.mode() >> 3) as u16 & RW == RW),
    };
    let mask = entries
        .iter()
        .find(|e| e.tag == MASK)
        .map_or(0o7, |e| e.perm);
    let granted = entries.iter().any(|e| {
        let applies = (e.tag == GROUP && e.id == gid) || (e.tag == GROUP_OBJ && meta.gid() == gid);
        applies && e.perm & mask & RW == RW
    });
    Ok(granted)
}

/// Whether a user `uid` in `groups` has every bit of `want` (`r` 4, `w` 2,
/// `x` 1) on `path`, as the kernel decides it for a user who is not root:
/// the owner's bits if it owns the file; else a named user entry; else
/// every group entry that applies (the owning group, named groups), any of
/// which may grant it, and if one applies and none grants, no; else the
/// bits for others. Named entries and the owning group are bounded by the
/// mask (acl(5), "Access check algorithm").
pub fn may(path: &Path, uid: u32, groups: &[u32], want: u16) -> io::Result<bool> {
    let meta = std::fs::metadata(path)?;
    let mode = meta.mode() as u16;
    let entries = read(path)?.unwrap_or_default();
    let has = |perm: u16| perm & want == want;
    if meta.uid() == uid {
        return Ok(has((mode >> 6) & 7));
    }
    let mask = entries
        .iter()
        .find(|e| e.tag == MASK)
        .map_or(0o7, |e| e.perm);
    if let Some(user) = entries.iter().find(|e| e.tag == USER && e.id == uid) {
        return Ok(has(user.perm & mask));
    }
    let owning_group = groups.contains(&meta.gid());
    let group_perms: Vec<u16> = if entries.is_empty() {
        owning_group
            .then_some((mode >> 3) & 7)
            .into_iter()
            .collect()
    } else {
        entries
            .iter()
            .filter(|e| {
                (e.tag == GROUP_OBJ && owning_group) || (e.tag == GROUP && groups.contains(&e.id))
            })
            .map(|e| e.perm & mask)
            .collect()
    };
    if !group_perms.is_empty() {
        return Ok(group_perms.into_iter().any(has));
    }
    Ok(has(mode & 7))
}

/// Grants group `gid` read and write on `path` by an ACL entry, changing no
/// other entry's rights.
pub fn grant_group(path: &Path, gid: u32) -> io::Result<()> {
    let _editing = EDITING.lock();
    let mode = std::fs::metadata(path)?.mode();
    let entries = granted(read(path)?, mode, GROUP, gid, RW);
    write(path, &entries)
}

/// Grants user `uid` read on the open file `file` by an ACL entry,
/// changing no other entry's rights; by its descriptor, so that what is
/// granted is the file the caller opened, whatever its name points at now.
pub fn grant_user_read(file: &std::fs::File, uid: u32) -> io::Result<()> {
    let _editing = EDITING.lock();
    let mode = file.metadata()?.mode();
    let entries = granted(read_fd(file)?, mode, USER, uid, READ);
    write_fd(file, &entries)
}

/// Takes user `uid`'s entry off the open file `file`'s ACL (see
/// [`revoke_group`]): whether there was one.
pub fn revoke_user(file: &std::fs::File, uid: u32) -> io::Result<bool> {
    let _editing = EDITING.lock();
    let Some(entries) = read_fd(file)? else {
        return Ok(false);
    };
    match revoked(entries, USER, uid) {
        Some(entries) => write_fd(file, &entries).map(|()| true),
        None => Ok(false),
    }
}

/// The users the open file `file`'s ACL names (none when it has none).
pub fn named_users(file: &std::fs::File) -> io::Result<Vec<u32>> {
    Ok(read_fd(file)?
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.tag == USER)
        .map(|e| e.id)
        .collect())
}

/// `entries` (or, for a file with none, the entries its `mode` makes)
/// with `perm` granted to the named `tag` `id`, and the mask grown to
/// cover it.
fn granted(entries: Option<Vec<Entry>>, mode: u32, tag: u16, id: u32, perm: u16) -> Vec<Entry> {
    let mut entries = entries.unwrap_or_else(|| {
        vec![
            Entry {
                tag: USER_OBJ,
                perm: (mode >> 6) as u16 & 7,
                id: NO_ID,
            },
            Entry {
                tag: GROUP_OBJ,
                perm: (mode >> 3) as u16 & 7,
                id: NO_ID,
            },
            Entry {
                tag: OTHER,
                perm: mode as u16 & 7,
                id: NO_ID,
            },
        ]
    });
    match entries.iter_mut().find(|e| e.tag == tag && e.id == id) {
        Some(e) => e.perm |= perm,
        None => entries.push(Entry { tag, perm, id }),
    }
    // The mask bounds every named entry and the owning group: the union of
    // them, so no one loses what they had.
    let mask = entries
        .iter()
        .filter(|e| matches!(e.tag, USER | GROUP | GROUP_OBJ))
        .fold(0, |m, e| m | e.perm);
    entries.retain(|e| e.tag != MASK);
    entries.push(Entry {
        tag: MASK,
        perm: mask,
        id: NO_ID,
    });
    entries.sort_by_key(|e| (e.tag, e.id));
    entries
}

/// Takes group `gid`'s entry off `path`'s ACL, recomputing the mask from
/// the entries left; once no named entry is left the ACL is only the mode
/// again (the kernel folds such an ACL back into the mode bits). Whether
/// there was an entry to take.
pub fn revoke_group(path: &Path, gid: u32) -> io::Result<bool> {
    let _editing = EDITING.lock();
    let Some(entries) = read(path)? else {
        return Ok(false);
    };
    match revoked(entries, GROUP, gid) {
        Some(entries) => write(path, &entries).map(|()| true),
        None => Ok(false),
    }
}

/// `entries` without the named `tag` `id`'s, the mask recomputed from
/// those left (none once no named entry is left); `None` when it had none.
fn revoked(mut entries: Vec<Entry>, tag: u16, id: u32) -> Option<Vec<Entry>> {
    let before = entries.len();
    entries.retain(|e| !(e.tag == tag && e.id == id));
    if entries.len() == before {
        return None;
    }
    entries.retain(|e| e.tag != MASK);
    if entries.iter().any(|e| matches!(e.tag, USER | GROUP)) {
        let mask = entries
            .iter()
            .filter(|e| matches!(e.tag, USER | GROUP | GROUP_OBJ))
            .fold(0, |m, e| m | e.perm);
        entries.push(Entry {
            tag: MASK,
            perm: mask,
            id: NO_ID,
        });
    }
    entries.sort_by_key(|e| (e.tag, e.id));
    Some(entries)
}

/// The groups `path`'s ACL names (none when it has no ACL).
pub fn named_groups(path: &Path) -> io::Result<Vec<u32>> {
    Ok(read(path)?
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.tag == GROUP)
        .map(|e| e.id)
        .collect())
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in the path"))
}

/// The file's access ACL, `None` when it has none (only its mode bits),
/// of any length: a device that many agents' groups were given has more
/// entries than any fixed buffer holds (a 64-entry one made every boot
/// fail with "Result not representable" once it had 65).
fn read(path: &Path) -> io::Result<Option<Vec<Entry>>> {
    let c = c_path(path)?;
    read_with(|buf| {
        // SAFETY: getxattr writes at most `buf.len()` bytes into `buf`; with
        // a length of 0 it writes nothing and says how many it would.
        unsafe {
            libc::getxattr(
                c.as_ptr(),
                XATTR.as_ptr().cast(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        }
    })
}

/// [`read`], of an open file.
fn read_fd(file: &std::fs::File) -> io::Result<Option<Vec<Entry>>> {
    read_with(|buf| {
        // SAFETY: as in `read`, on a descriptor `file` holds open.
        unsafe {
            libc::fgetxattr(
                file.as_raw_fd(),
                XATTR.as_ptr().cast(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        }
    })
}

/// The ACL that `get` (a getxattr of it into a buffer) reads.
fn read_with(get: impl Fn(&mut [u8]) -> isize) -> io::Result<Option<Vec<Entry>>> {
    let get = |buf: &mut [u8]| usize::try_from(get(buf)).map_err(|_| io::Error::last_os_error());
    let absent = |e: &io::Error| e.raw_os_error() == Some(libc::ENODATA);
    let bytes = loop {
        let size = match get(&mut []) {
            Ok(size) => size,
            Err(e) if absent(&e) => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut buf = vec![0u8; size];
        match get(&mut buf) {
            Ok(n) => {
                buf.truncate(n);
                break buf;
            }
            // It grew between the two calls: ask again.
            Err(e) if e.raw_os_error() == Some(libc::ERANGE) => continue,
            Err(e) if absent(&e) => return Ok(None),
            Err(e) => return Err(e),
        }
    };
    if bytes.len() < 4 || u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) != VERSION {
        return Err(io::Error::other("an ACL of an unknown version"));
    }
    Ok(Some(
        bytes[4..]
            .chunks_exact(8)
            .map(|c| Entry {
                tag: u16::from_le_bytes([c[0], c[1]]),
                perm: u16::from_le_bytes([c[2], c[3]]),
                id: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
            })
            .collect(),
    ))
}

fn write(path: &Path, entries: &[Entry]) -> io::Result<()> {
    let c = c_path(path)?;
    write_with(entries, |bytes| {
        // SAFETY: setxattr reads `bytes.len()` bytes from `bytes`.
        unsafe {
            libc::setxattr(
                c.as_ptr(),
                XATTR.as_ptr().cast(),
                bytes.as_ptr().cast(),
                bytes.len(),
                0,
            )
        }
    })
}

/// [`write()`], to an open file.
fn write_fd(file: &std::fs::File, entries: &[Entry]) -> io::Result<()> {
    write_with(entries, |bytes| {
        // SAFETY: as in `write`, on a descriptor `file` holds open.
        unsafe {
            libc::fsetxattr(
                file.as_raw_fd(),
                XATTR.as_ptr().cast(),
                bytes.as_ptr().cast(),
                bytes.len(),
                0,
            )
        }
    })
}

/// `entries` encoded as the kernel reads an ACL, given to `set` (a
/// setxattr of it).
fn write_with(entries: &[Entry], set: impl Fn(&[u8]) -> libc::c_int) -> io::Result<()> {
    let mut bytes = VERSION.to_le_bytes().to_vec();
    for e in entries {
        bytes.extend_from_slice(&e.tag.to_le_bytes());
        bytes.extend_from_slice(&e.perm.to_le_bytes());
        bytes.extend_from_slice(&e.id.to_le_bytes());
    }
    if set(&bytes) == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const GID: u32 = 1_900_000_000;

    fn private_file() -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("kvm");
        std::fs::write(&path, b"").expect("file");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        (dir, path)
    }

    #[test]
    fn a_root_only_file_grants_the_group_nothing_until_granted() {
        let (_dir, path) = private_file();

        let before = group_may_read_write(&path, GID).expect("check");
        grant_group(&path, GID).expect("grant");
        let after = group_may_read_write(&path, GID).expect("check");

        assert!(!before);
        assert!(after);
    }

    #[test]
    fn a_grant_changes_no_one_elses_rights() {
        let (_dir, path) = private_file();

        grant_group(&path, GID).expect("grant");

        let entries = read(&path).expect("read").expect("an ACL");
        let perm = |tag| entries.iter().find(|e| e.tag == tag).map(|e| e.perm);
        assert_eq!(perm(USER_OBJ), Some(0o6));
        assert_eq!(perm(GROUP_OBJ), Some(0));
        assert_eq!(perm(OTHER), Some(0));
        assert!(!group_may_read_write(&path, GID + 1).expect("check"));
    }

    #[test]
    fn a_file_whose_acl_holds_more_than_64_groups_is_still_granted() {
        let (_dir, path) = private_file();
        for n in 1..=80 {
            grant_group(&path, GID + n).expect("grant one of many");
        }

        grant_group(&path, GID).expect("grant past 80 entries");

        assert!(group_may_read_write(&path, GID).expect("check"));
        let entries = read(&path).expect("read").expect("an ACL");
        assert_eq!(entries.iter().filter(|e| e.tag == GROUP).count(), 81);
    }

    #[test]
    fn granting_twice_adds_one_entry() {
        let (_dir, path) = private_file();

        grant_group(&path, GID).expect("grant");
        grant_group(&path, GID).expect("again");

        let entries = read(&path).expect("read").expect("an ACL");
        assert_eq!(entries.iter().filter(|e| e.tag == GROUP).count(), 1);
    }

    #[test]
    fn revoking_a_grant_gives_back_the_mode_it_had() {
        let (_dir, path) = private_file();
        let before = std::fs::metadata(&path).expect("stat").permissions().mode();
        grant_group(&path, GID).expect("grant");

        let revoked = revoke_group(&path, GID).expect("revoke");

        assert!(revoked);
        assert_eq!(read(&path).expect("read"), None, "an ACL is left");
        let after = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(after, before);
    }

    #[test]
    fn revoking_one_group_keeps_the_others_grants() {
        let (_dir, path) = private_file();
        grant_group(&path, GID).expect("grant");
        grant_group(&path, GID + 1).expect("grant another");

        let revoked = revoke_group(&path, GID).expect("revoke");

        assert!(revoked);
        assert!(!group_may_read_write(&path, GID).expect("check"));
        assert!(group_may_read_write(&path, GID + 1).expect("check"));
        assert_eq!(named_groups(&path).expect("groups"), [GID + 1]);
    }

    #[test]
    fn revoking_a_group_never_granted_changes_nothing() {
        let (_dir, path) = private_file();
        grant_group(&path, GID + 1).expect("grant another");
        let before = read(&path).expect("read");

        let revoked = revoke_group(&path, GID).expect("revoke");

        assert!(!revoked);
        assert_eq!(read(&path).expect("read"), before);
    }

    #[test]
    fn a_users_read_grant_lets_that_user_read_it_and_nothing_more() {
        let (_dir, path) = private_file();
        let file = std::fs::File::open(&path).expect("open");

        grant_user_read(&file, GID).expect("grant");

        assert!(may(&path, GID, &[], 0o4).expect("check"));
        assert!(!may(&path, GID, &[], 0o2).expect("check"));
        assert!(!may(&path, GID + 1, &[], 0o4).expect("check"));
        assert_eq!(named_users(&file).expect("users"), [GID]);
    }

    #[test]
    fn revoking_a_users_grant_gives_back_the_mode_it_had() {
        let (_dir, path) = private_file();
        let before = std::fs::metadata(&path).expect("stat").permissions().mode();
        let file = std::fs::File::open(&path).expect("open");
        grant_user_read(&file, GID).expect("grant");

        let revoked = revoke_user(&file, GID).expect("revoke");

        assert!(revoked);
        assert_eq!(read(&path).expect("read"), None, "an ACL is left");
        let after = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(after, before);
    }

    #[test]
    fn users_lent_one_file_at_once_each_keep_their_entry() {
        let (_dir, path) = private_file();
        let file = std::fs::File::open(&path).expect("open");

        std::thread::scope(|s| {
            for n in 0..16 {
                let file = &file;
                s.spawn(move || grant_user_read(file, GID + n).expect("grant"));
            }
        });

        let mut users = named_users(&file).expect("users");
        users.sort_unstable();
        assert_eq!(users, (0..16).map(|n| GID + n).collect::<Vec<_>>());
    }
}
