//! Guest taps, opened by the agent on /dev/net/tun and handed to the VMM as
//! an inherited fd. Not persistent: the tap exists exactly as long as some
//! process holds it, so a VMM that crashes (even by kill -9) leaks no tap.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;

use nix::libc::{IFF_NO_PI, IFF_TAP, IFF_VNET_HDR, TUNSETIFF, TUNSETPERSIST};

/// `struct ifreq` as TUNSETIFF reads it: a name and the flags.
#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: i16,
    _pad: [u8; 22],
}

nix::ioctl_write_ptr_bad!(tunsetiff, TUNSETIFF, IfReq);
nix::ioctl_write_int_bad!(tunsetpersist, TUNSETPERSIST);

fn ifreq(name: &str, flags: nix::libc::c_int) -> io::Result<IfReq> {
    if name.is_empty() || name.len() > 15 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("tap name {name:?} is not 1-15 bytes"),
        ));
    }
    let mut req = IfReq {
        name: [0; 16],
        // A short in `struct ifreq`: the tun flags are all below 2^15.
        flags: flags as i16,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    Ok(req)
}

fn open_tun() -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(nix::libc::O_CLOEXEC)
        .open("/dev/net/tun")
}

/// Creates (or attaches to) the tap `name`: tap, no packet info, with a
/// virtio-net header, as cloud-hypervisor expects of an fd it is given.
pub fn open(name: &str) -> io::Result<OwnedFd> {
    let tun = open_tun()?;
    let req = ifreq(name, IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)?;
    // SAFETY: TUNSETIFF reads a `struct ifreq` (IfReq is laid out as one)
    // through the pointer, which is valid for the call; the fd is open.
    unsafe { tunsetiff(tun.as_raw_fd(), &req) }.map_err(io::Error::from)?;
    without_ipv6(name);
    Ok(OwnedFd::from(tun))
}

/// Turns the host's own IPv6 off on the tap, before it is up: a guest's
/// underlay is IPv4 (its IPv6 is dropped by the guard), and the host
/// would otherwise send the guest its router solicitations and neighbour
/// discovery, frames for nobody that would wake a sleeping guest. A host
/// without IPv6 has nothing to turn off.
fn without_ipv6(name: &str) {
    let path = format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6");
    if std::path::Path::new(&path).exists()
        && let Err(e) = std::fs::write(&path, "1")
    {
        log::warn!("tap {name}: cannot turn the host's IPv6 off on it: {e}");
    }
}

/// Whether a network link of this name exists, in this process's network
/// namespace (asked of the kernel; /sys shows the namespace that mounted it).
pub fn exists(name: &str) -> bool {
    let Ok(c) = std::ffi::CString::new(name) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated string for the call.
    unsafe { nix::libc::if_nametoindex(c.as_ptr()) != 0 }
}

/// Removes a tap nobody holds: attach, clear its persistence, let go. A tap
/// a live VMM holds cannot be attached (EBUSY) and is left alone.
pub fn remove(name: &str) -> io::Result<()> {
    let tun = open_tun()?;
    let req = ifreq(name, IFF_TAP | IFF_NO_PI)?;
    // SAFETY: as in `open`.
    unsafe { tunsetiff(tun.as_raw_fd(), &req) }.map_err(io::Error::from)?;
    // SAFETY: TUNSETPERSIST takes its flag by value; the fd is the tun fd
    // just attached.
    unsafe { tunsetpersist(tun.as_raw_fd(), 0) }.map_err(io::Error::from)?;
    Ok(())
}

/// Links whose name starts with `prefix`, in this network namespace.
pub fn with_prefix(prefix: &str) -> Vec<String> {
    let mut names = Vec::new();
    // SAFETY: if_nameindex returns an array terminated by a zero entry (or
    // null on failure), valid until if_freenameindex, which is called once.
    unsafe {
        let list = nix::libc::if_nameindex();
        if list.is_null() {
            return names;
        }
        let mut entry = list;
        while (*entry).if_index != 0 && !(*entry).if_name.is_null() {
            let name = std::ffi::CStr::from_ptr((*entry).if_name)
                .to_string_lossy()
                .into_owned();
            if name.starts_with(prefix) {
                names.push(name);
            }
            entry = entry.add(1);
        }
        nix::libc::if_freenameindex(list);
    }
    names
}
