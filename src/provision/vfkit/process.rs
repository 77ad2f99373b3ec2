//! vfkit processes as the agent finds them: by the pid in the VM's
//! `vfkit.pid` (vfkit writes it itself, `--pidfile`), believed only while
//! the process it names is alive and carries the vfkit binary's name. No
//! start time is kept (vfkit writes only the pid), so the name is what
//! keeps a recycled pid from counting as the VM.

use std::fs;
use std::path::Path;

/// The pid `pidfile` names, if that process is alive and its name is the
/// binary's (`binary`'s file name).
pub(super) fn live_pid(pidfile: &Path, binary: &Path) -> Option<u32> {
    let pid: u32 = fs::read_to_string(pidfile).ok()?.trim().parse().ok()?;
    let ours = binary.file_name()?.to_string_lossy().into_owned();
    process_name(pid)
        .is_some_and(|name| same_name(&name, &ours))
        .then_some(pid)
}

/// Process names are cut short by the kernel (15 bytes on Linux, 16 on
/// macOS): equal where both are whole.
fn same_name(seen: &str, binary: &str) -> bool {
    let cut = |s: &str| s.bytes().take(15).collect::<Vec<u8>>();
    cut(seen) == cut(binary)
}

/// A live (not zombie) process's name.
#[cfg(target_os = "linux")]
fn process_name(pid: u32) -> Option<String> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (head, tail) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1;
    let state = tail.split_whitespace().next()?;
    (state != "Z").then(|| name.to_owned())
}

/// A live process's name.
#[cfg(target_os = "macos")]
fn process_name(pid: u32) -> Option<String> {
    let mut buf = [0u8; 64];
    // SAFETY: `buf` is valid for writes of its length for the call, and
    // proc_name writes at most that many bytes.
    let n = unsafe { nix::libc::proc_name(pid as i32, buf.as_mut_ptr().cast(), buf.len() as u32) };
    (n > 0).then(|| String::from_utf8_lossy(&buf[..n as usize]).into_owned())
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
fn process_name(_pid: u32) -> Option<String> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_cut_by_the_kernel_still_match() {
        assert!(same_name("eitri-standin-v", "eitri-standin-vfkit"));
        assert!(!same_name("vfkit", "cloud-hypervisor"));
    }
}
