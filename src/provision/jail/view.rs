//! What a VMM sees of the host's files: a mount namespace of its own whose
//! root is an empty tmpfs holding, at their own paths, only what it needs
//! (its binary and loader, its kernel or firmware, its disks, seed,
//! volumes, serial and log files, `/dev/kvm`), each bind-mounted, the
//! inputs read-only. The way firecracker's jailer builds a chroot, but
//! without copying anything: the VMM's command line names the same paths
//! it would on the host, and Landlock (`--landlock`) still applies inside.
//!
//! The plan ([`View::plan`]) is made in the agent, before the fork, by
//! walking each path on the host: a symlink on the way (Debian's `/lib`
//! is one, to `usr/lib`) is made again in the view and followed, so a path
//! resolves there as it does on the host. The forked child, still root,
//! then carries it out with system calls alone ([`View::enter`]):
//!
//! 1. `unshare(CLONE_NEWNS)`, and every mount made private, so nothing it
//!    mounts reaches the host and nothing the host mounts reaches it;
//! 2. a tmpfs on the agent's empty mountpoint, `nosuid,nodev,noexec`;
//! 3. each directory, symlink and mountpoint of the plan made in it, and
//!    each path bind-mounted onto its own, then remounted with its flags
//!    (read-only for an input; `nosuid` always; `nodev` but for devices;
//!    `noexec` but for what it executes);
//! 4. `pivot_root` into it, the old root unmounted (detached) and its
//!    mountpoint removed, and the new root made read-only.
//!
//! No `/proc`, `/sys` or `/etc` but the loader's cache: a real
//! cloud-hypervisor boots, runs, stops and is destroyed without them
//! (layer 5, `tests/cloudhv/`).

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::path::{Component, Path, PathBuf};

use nix::libc;

/// A path the VMM is to see, and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Visible {
    pub path: PathBuf,
    pub access: Access,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read only: a kernel, a seed, a library.
    Read,
    /// Read only, and it may execute it: its binary, its loader.
    Execute,
    /// Read and write: its disks, volumes, serial and log files, devices.
    Write,
}

impl Visible {
    pub fn new(path: impl Into<PathBuf>, access: Access) -> Visible {
        Visible {
            path: path.into(),
            access,
        }
    }
}

/// One step of the plan; every path is the one in the view (under the
/// mountpoint), but a bind's source, which is the host's.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Op {
    Mkdir(CString),
    Symlink {
        target: CString,
        link: CString,
    },
    /// A file made to mount a file on.
    Touch(CString),
    Bind {
        source: CString,
        target: CString,
        flags: libc::c_ulong,
    },
}

/// Where a step of [`View::enter`] failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failed {
    Unshare,
    Private,
    Tmpfs,
    Build,
    Bind,
    Pivot,
    Seal,
}

/// The view one VMM is given: planned in the agent, entered by its child.
#[derive(Clone, Debug)]
pub struct View {
    root: CString,
    old: CString,
    ops: Vec<Op>,
}

/// Links followed along one path before it is called a loop.
const MAX_LINKS: usize = 40;

impl View {
    /// Plans a view holding `visible`, to be built on `mountpoint` (an
    /// empty directory of the agent's; each VMM mounts its own tmpfs on it
    /// in its own namespace). A path that does not exist is an error
    /// naming it.
    pub fn plan(mountpoint: &Path, visible: &[Visible]) -> io::Result<View> {
        let mut plan = Plan {
            mountpoint: mountpoint.to_path_buf(),
            ops: Vec::new(),
            made: Vec::new(),
            bound: Vec::new(),
        };
        for v in visible {
            plan.add(&v.path, v.access, 0)?;
        }
        Ok(View {
            root: cstring(mountpoint)?,
            old: cstring(&mountpoint.join(".old"))?,
            ops: plan.ops,
        })
    }

    /// Steps 1 to 4 of the module header: this process in a mount
    /// namespace of its own, whose root is the view.
    ///
    /// # Safety
    /// For a forked child before exec: it calls only async-signal-safe
    /// functions (unshare, umask, mount, mkdir, symlink, open, close,
    /// syscall, chdir, umount2, rmdir) on strings prepared before the fork, and
    /// allocates nothing.
    pub unsafe fn enter(&self) -> Result<(), Failed> {
        let none = std::ptr::null::<libc::c_char>();
        // SAFETY: system calls on NUL-terminated strings that live as long
        // as `self`; null pointers where the calls take none.
        unsafe {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return Err(Failed::Unshare);
            }
            // The agent's umask (077) would make every directory of the
            // view the agent's alone, and the VMM's user could reach
            // nothing in it; its own is put back once the view is built.
            let umask = libc::umask(0o022);
            let private = libc::MS_REC | libc::MS_PRIVATE;
            if libc::mount(none, c"/".as_ptr(), none, private, std::ptr::null()) != 0 {
                return Err(Failed::Private);
            }
            let sealed = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
            if libc::mount(
                c"tmpfs".as_ptr(),
                self.root.as_ptr(),
                c"tmpfs".as_ptr(),
                sealed,
                c"mode=0755,size=1m".as_ptr().cast(),
            ) != 0
            {
                return Err(Failed::Tmpfs);
            }
            for op in &self.ops {
                match op {
                    Op::Mkdir(dir) => {
                        if libc::mkdir(dir.as_ptr(), 0o755) != 0
                            && *libc::__errno_location() != libc::EEXIST
                        {
                            return Err(Failed::Build);
                        }
                    }
                    Op::Symlink { target, link } => {
                        if libc::symlink(target.as_ptr(), link.as_ptr()) != 0 {
                            return Err(Failed::Build);
                        }
                    }
                    Op::Touch(file) => {
                        let fd = libc::open(
                            file.as_ptr(),
                            libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                            0o600,
                        );
                        if fd < 0 {
                            return Err(Failed::Build);
                        }
                        libc::close(fd);
                    }
                    Op::Bind {
                        source,
                        target,
                        flags,
                    } => {
                        if libc::mount(
                            source.as_ptr(),
                            target.as_ptr(),
                            none,
                            libc::MS_BIND,
                            std::ptr::null(),
                        ) != 0
                            || libc::mount(
                                none,
                                target.as_ptr(),
                                none,
                                libc::MS_REMOUNT | libc::MS_BIND | *flags,
                                std::ptr::null(),
                            ) != 0
                        {
                            return Err(Failed::Bind);
                        }
                    }
                }
            }
            if libc::mkdir(self.old.as_ptr(), 0o700) != 0
                || libc::syscall(libc::SYS_pivot_root, self.root.as_ptr(), self.old.as_ptr()) != 0
                || libc::chdir(c"/".as_ptr()) != 0
                || libc::umount2(c"/.old".as_ptr(), libc::MNT_DETACH) != 0
                || libc::rmdir(c"/.old".as_ptr()) != 0
            {
                return Err(Failed::Pivot);
            }
            let read_only = libc::MS_REMOUNT | libc::MS_RDONLY | sealed;
            if libc::mount(none, c"/".as_ptr(), none, read_only, std::ptr::null()) != 0 {
                return Err(Failed::Seal);
            }
            libc::umask(umask);
        }
        Ok(())
    }
}

struct Plan {
    mountpoint: PathBuf,
    ops: Vec<Op>,
    /// Directories and symlinks (the host's paths) made in the view.
    made: Vec<PathBuf>,
    /// Paths bound into the view; what is under a bound directory is in
    /// it already.
    bound: Vec<PathBuf>,
}

impl Plan {
    /// The view's copy of the host path `path`.
    fn inside(&self, path: &Path) -> io::Result<CString> {
        let relative = path.strip_prefix("/").unwrap_or(path);
        cstring(&self.mountpoint.join(relative))
    }

    /// Adds `path` (absolute), making each of its ancestors as it is on
    /// the host: a directory, or a symlink made again and followed.
    fn add(&mut self, path: &Path, access: Access, links: usize) -> io::Result<()> {
        if !path.is_absolute() {
            return Err(invalid(format!(
                "{} is not an absolute path",
                path.display()
            )));
        }
        let mut at = PathBuf::from("/");
        let parts: Vec<Component<'_>> = path.components().collect();
        for (i, part) in parts.iter().enumerate() {
            let name = match part {
                Component::RootDir => continue,
                Component::Normal(name) => name,
                Component::CurDir | Component::ParentDir | Component::Prefix(_) => {
                    return Err(invalid(format!(
                        "{} has a . or .. in it; name it plainly",
                        path.display()
                    )));
                }
            };
            at.push(name);
            let last = i + 1 == parts.len();
            let meta = std::fs::symlink_metadata(&at)
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", at.display())))?;
            // Seen through a directory bound already: nothing to make, but
            // its symlinks still lead somewhere that must be there too.
            let covered = self.bound.iter().any(|b| at.starts_with(b));
            if meta.file_type().is_symlink() {
                if links >= MAX_LINKS {
                    return Err(invalid(format!("{}: too many symlinks", path.display())));
                }
                let target = std::fs::read_link(&at)?;
                if !covered && !self.made.contains(&at) {
                    self.made.push(at.clone());
                    self.ops.push(Op::Symlink {
                        target: cstring(&target)?,
                        link: self.inside(&at)?,
                    });
                }
                let parent = at.parent().unwrap_or(Path::new("/"));
                let mut resolved = normalize(&parent.join(&target));
                for rest in &parts[i + 1..] {
                    resolved.push(rest);
                }
                return self.add(&resolved, access, links + 1);
            }
            if covered {
                continue;
            }
            let made = self.made.contains(&at);
            if !last {
                if !made {
                    self.made.push(at.clone());
                    self.ops.push(Op::Mkdir(self.inside(&at)?));
                }
                continue;
            }
            let kind = meta.file_type();
            let target = self.inside(&at)?;
            if !made {
                self.ops.push(if kind.is_dir() {
                    Op::Mkdir(target.clone())
                } else {
                    Op::Touch(target.clone())
                });
            }
            let device = kind.is_char_device() || kind.is_block_device();
            let mut flags = libc::MS_NOSUID;
            if !device {
                flags |= libc::MS_NODEV;
            }
            match access {
                Access::Read => flags |= libc::MS_RDONLY | libc::MS_NOEXEC,
                Access::Execute => flags |= libc::MS_RDONLY,
                Access::Write => flags |= libc::MS_NOEXEC,
            }
            if kind.is_dir() {
                flags |= libc::MS_REC;
            }
            self.ops.push(Op::Bind {
                source: cstring(&at)?,
                target,
                flags,
            });
            self.bound.push(at.clone());
        }
        Ok(())
    }
}

/// `path` with `.` and `..` taken out, by name (the symlinks were
/// followed already, one at a time).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for part in path.components() {
        match part {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(name) => out.push(name),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

fn cstring(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| invalid(format!("{} has a NUL byte", path.display())))
}

fn invalid(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, why)
}

/// What a program needs to run besides itself: for a script, its
/// interpreter (and what that needs); for a dynamically linked ELF, its
/// loader and the system's library directories (read-only, executable: a
/// library is mapped to run; a static build needs none). The libraries
/// are the system's, no secret of anyone's; naming each one the program
/// links would mean the loader's own search, done again here.
pub fn runtime_of(program: &Path) -> io::Result<Vec<Visible>> {
    let mut out = Vec::new();
    let mut next = Some(program.to_path_buf());
    let mut depth = 0;
    while let Some(program) = next.take() {
        depth += 1;
        if depth > 4 {
            return Err(invalid(format!(
                "{}: interpreters nested too deep",
                program.display()
            )));
        }
        let head = read_head(&program)?;
        if let Some(interpreter) = shebang(&head) {
            out.push(Visible::new(&interpreter, Access::Execute));
            next = Some(interpreter);
        } else if let Some(loader) = elf_interpreter(&program, &head)? {
            // The directories first: the loader is usually in one of them.
            for dir in LIBRARY_DIRS {
                if std::fs::symlink_metadata(dir).is_ok() {
                    out.push(Visible::new(*dir, Access::Execute));
                }
            }
            out.push(Visible::new(&loader, Access::Execute));
        }
    }
    Ok(out)
}

/// Where a dynamically linked program's libraries are looked for (and the
/// loader's cache of them).
const LIBRARY_DIRS: &[&str] = &[
    "/lib",
    "/lib64",
    "/usr/lib",
    "/usr/lib64",
    "/etc/ld.so.cache",
];

fn read_head(program: &Path) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut head = Vec::with_capacity(256);
    std::fs::File::open(program)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", program.display())))?
        .take(256)
        .read_to_end(&mut head)?;
    Ok(head)
}

/// A script's interpreter: the first word after `#!`.
fn shebang(head: &[u8]) -> Option<PathBuf> {
    let line = head.strip_prefix(b"#!")?;
    let line = &line[..line.iter().position(|b| *b == b'\n').unwrap_or(line.len())];
    let text = std::str::from_utf8(line).ok()?;
    text.split_whitespace().next().map(PathBuf::from)
}

/// A 64-bit little-endian ELF's PT_INTERP (the loader it names), if any.
fn elf_interpreter(program: &Path, head: &[u8]) -> io::Result<Option<PathBuf>> {
    use std::io::{Read, Seek, SeekFrom};
    const PT_INTERP: u32 = 3;
    if head.len() < 64 || &head[..4] != b"\x7fELF" || head[4] != 2 || head[5] != 1 {
        return Ok(None);
    }
    let u16_at = |b: &[u8], at: usize| u16::from_le_bytes([b[at], b[at + 1]]);
    let u32_at = |b: &[u8], at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let u64_at = |b: &[u8], at: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&b[at..at + 8]);
        u64::from_le_bytes(bytes)
    };
    let (phoff, phentsize, phnum) = (
        u64_at(head, 0x20),
        usize::from(u16_at(head, 0x36)),
        usize::from(u16_at(head, 0x38)),
    );
    if phentsize < 56 || phnum > 256 {
        return Ok(None);
    }
    let mut file = std::fs::File::open(program)?;
    let mut table = vec![0u8; phentsize * phnum];
    file.seek(SeekFrom::Start(phoff))?;
    file.read_exact(&mut table)?;
    for entry in table.chunks(phentsize) {
        if u32_at(entry, 0) != PT_INTERP {
            continue;
        }
        let (offset, size) = (u64_at(entry, 8), u64_at(entry, 32));
        if size == 0 || size > 4096 {
            return Ok(None);
        }
        let mut name = vec![0u8; size as usize];
        file.seek(SeekFrom::Start(offset))?;
        file.read_exact(&mut name)?;
        let end = name.iter().position(|b| *b == 0).unwrap_or(name.len());
        return Ok(Some(PathBuf::from(std::ffi::OsStr::from_bytes(
            &name[..end],
        ))));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops(view: &View) -> Vec<String> {
        view.ops
            .iter()
            .map(|op| match op {
                Op::Mkdir(d) => format!("mkdir {}", d.to_string_lossy()),
                Op::Symlink { target, link } => {
                    format!("ln {} {}", target.to_string_lossy(), link.to_string_lossy())
                }
                Op::Touch(f) => format!("touch {}", f.to_string_lossy()),
                Op::Bind { source, target, .. } => {
                    format!(
                        "bind {} {}",
                        source.to_string_lossy(),
                        target.to_string_lossy()
                    )
                }
            })
            .collect()
    }

    #[test]
    fn a_file_is_bound_at_its_own_path_under_the_directories_above_it() {
        let host = tempfile::tempdir().expect("tempdir");
        let file = host.path().join("a/disk.raw");
        std::fs::create_dir_all(file.parent().expect("parent")).expect("mkdir");
        std::fs::write(&file, b"x").expect("file");
        let m = Path::new("/m");

        let view = View::plan(m, &[Visible::new(&file, Access::Write)]).expect("plan");

        let ops = ops(&view);
        let inside = format!("/m{}", file.display());
        assert_eq!(
            ops.last(),
            Some(&format!("bind {} {inside}", file.display()))
        );
        assert!(ops.contains(&format!("touch {inside}")));
        assert!(ops.contains(&format!("mkdir /m{}", host.path().join("a").display())));
    }

    #[test]
    fn a_symlink_on_the_way_is_made_again_and_followed() {
        // As Debian's /lib -> usr/lib.
        let host = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(host.path().join("usr/lib")).expect("mkdir");
        std::fs::write(host.path().join("usr/lib/libc.so"), b"x").expect("lib");
        std::os::unix::fs::symlink("usr/lib", host.path().join("lib")).expect("link");
        let m = Path::new("/m");

        let view = View::plan(
            m,
            &[Visible::new(host.path().join("lib/libc.so"), Access::Read)],
        )
        .expect("plan");

        let ops = ops(&view);
        let h = host.path().display();
        assert!(ops.contains(&format!("ln usr/lib /m{h}/lib")), "{ops:?}");
        assert!(
            ops.contains(&format!("bind {h}/usr/lib/libc.so /m{h}/usr/lib/libc.so")),
            "{ops:?}"
        );
    }

    #[test]
    fn a_path_that_does_not_exist_is_named() {
        let err = View::plan(
            Path::new("/m"),
            &[Visible::new("/no/such/kernel", Access::Read)],
        )
        .expect_err("refused");

        assert!(err.to_string().contains("/no"), "{err}");
    }

    #[test]
    fn a_symlink_loop_is_refused() {
        let host = tempfile::tempdir().expect("tempdir");
        std::os::unix::fs::symlink("b", host.path().join("a")).expect("a");
        std::os::unix::fs::symlink("a", host.path().join("b")).expect("b");

        let err = View::plan(
            Path::new("/m"),
            &[Visible::new(host.path().join("a"), Access::Read)],
        )
        .expect_err("refused");

        assert!(err.to_string().contains("too many symlinks"), "{err}");
    }

    #[test]
    fn an_input_is_read_only_and_a_disk_is_not() {
        let host = tempfile::tempdir().expect("tempdir");
        let (seed, disk) = (host.path().join("seed.iso"), host.path().join("disk.raw"));
        std::fs::write(&seed, b"s").expect("seed");
        std::fs::write(&disk, b"d").expect("disk");

        let view = View::plan(
            Path::new("/m"),
            &[
                Visible::new(&seed, Access::Read),
                Visible::new(&disk, Access::Write),
            ],
        )
        .expect("plan");

        let flags: Vec<libc::c_ulong> = view
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Bind { flags, .. } => Some(*flags),
                _ => None,
            })
            .collect();
        assert_eq!(flags.len(), 2);
        assert_ne!(flags[0] & libc::MS_RDONLY, 0, "the seed");
        assert_eq!(flags[1] & libc::MS_RDONLY, 0, "the disk");
    }

    #[test]
    fn this_test_binary_needs_its_loader_and_libraries() {
        let exe = std::env::current_exe().expect("exe");

        let needs = runtime_of(&exe).expect("runtime");

        // Built against glibc here: a loader, and the library dirs.
        assert!(
            needs
                .iter()
                .any(|v| v.access == Access::Execute && v.path.to_string_lossy().contains("ld-")),
            "{needs:?}"
        );
    }

    #[test]
    fn a_script_needs_its_interpreter() {
        let host = tempfile::tempdir().expect("tempdir");
        let script = host.path().join("hv");
        std::fs::write(&script, b"#!/bin/sh -e\nexit 0\n").expect("script");

        let needs = runtime_of(&script).expect("runtime");

        assert_eq!(
            needs.first(),
            Some(&Visible::new("/bin/sh", Access::Execute))
        );
    }
}
