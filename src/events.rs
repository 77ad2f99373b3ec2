//! Each VM's last events, kept in its directory for `status VM`: what the
//! agent logged about it at info and above (created, booted again after
//! its hypervisor died, unhealthy, suspended, an error), one line each,
//! with when, across agent restarts.
//!
//! The agent's log lines about a VM begin `VM <id>: `; the logger hands
//! each to [`note`] besides writing it, so an event is said once, in one
//! voice, and the file holds nothing the log does not. Bounded: past
//! [`MAX_BYTES`] the file keeps its newest half. Nothing is kept until the
//! daemon names its state dir ([`keep_in`]); a VM whose directory is gone
//! (destroyed) gets nothing back.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::OnceLock;

use crate::model::Id;
use crate::state::Layout;

/// The most an events file holds before its older half goes.
pub const MAX_BYTES: u64 = 32 << 10;

/// The state dir whose VMs' events are kept, once the daemon says.
static KEPT_IN: OnceLock<Layout> = OnceLock::new();
/// One writer at a time: a file cut to its newer half must not lose a
/// line another thread appended meanwhile.
static WRITING: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// Keeps the events of the VMs of the state dir at `layout` from now on.
pub fn keep_in(layout: Layout) {
    let _ = KEPT_IN.set(layout);
}

/// A logger that writes as `inner` does, and keeps each line about a VM at
/// info and above as that VM's event.
pub struct Tee<L> {
    pub inner: L,
}

impl<L: log::Log> log::Log for Tee<L> {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        self.inner.enabled(metadata)
    }

    fn log(&self, record: &log::Record<'_>) {
        self.inner.log(record);
        if record.level() <= log::Level::Info && KEPT_IN.get().is_some() {
            note(record.level(), &record.args().to_string());
        }
    }

    fn flush(&self) {
        self.inner.flush();
    }
}

/// Keeps `message` as an event of the VM it is about, if it is about one
/// (`VM <id>: …`) whose directory exists.
pub fn note(level: log::Level, message: &str) {
    let Some(layout) = KEPT_IN.get() else {
        return;
    };
    let Some((vm_id, what)) = about(message) else {
        return;
    };
    let line = format!(
        "{} {:<5} {}\n",
        crate::human::Utc::from(std::time::SystemTime::now()),
        level,
        what.replace('\n', "; ")
    );
    let _one = WRITING.lock();
    let path = layout.events(&vm_id);
    if append(&path, line.as_bytes()).is_ok() {
        let _ = keep_newest_half(&path);
    }
}

/// The VM a log line is about, and what it says of it.
fn about(message: &str) -> Option<(Id, &str)> {
    let rest = message.strip_prefix("VM ")?;
    let (id, what) = rest.split_once(": ")?;
    Some((Id::parse(id).ok()?, what))
}

/// Appends to the file at `path`, made if its directory exists (a VM
/// destroyed has none, and gets nothing back).
fn append(path: &Path, line: &[u8]) -> std::io::Result<()> {
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(crate::state::perms::FILE)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)?
        .write_all(line)
}

/// Past [`MAX_BYTES`], the file keeps its newer half, from a line's start.
fn keep_newest_half(path: &Path) -> std::io::Result<()> {
    if std::fs::metadata(path)?.len() <= MAX_BYTES {
        return Ok(());
    }
    let text = std::fs::read(path)?;
    let from = text.len() - (MAX_BYTES / 2) as usize;
    let start = text[from..]
        .iter()
        .position(|b| *b == b'\n')
        .map_or(text.len(), |i| from + i + 1);
    crate::state::atomic::replace_unsynced(path, &text[start..])
}

/// The newest `n` events of `vm_id` in the state dir at `layout`, oldest
/// first; none when it has kept none.
pub fn last(layout: &Layout, vm_id: &Id, n: usize) -> Vec<String> {
    let text = std::fs::read_to_string(layout.events(vm_id)).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| crate::quote::inline(l))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_about_a_vm_names_it_and_what_it_says() {
        let (vm, what) = about("VM web-1: booted again: its hypervisor died").expect("a VM's");

        assert_eq!(vm.as_str(), "web-1");
        assert_eq!(what, "booted again: its hypervisor died");
        assert!(about("host checks: 11 of 11 ok").is_none());
        assert!(about("VM ../x: no").is_none(), "an id, never a path");
    }

    #[test]
    fn a_file_past_its_bound_keeps_its_newest_half_from_a_lines_start() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("events.log");
        for i in 0..2000 {
            append(&path, format!("event {i:05} of a VM\n").as_bytes()).expect("append");
            keep_newest_half(&path).expect("bound");
        }

        let text = std::fs::read_to_string(&path).expect("read");

        assert!(text.len() as u64 <= MAX_BYTES, "{}", text.len());
        assert!(text.starts_with("event "), "from a line's start");
        assert!(text.ends_with("event 01999 of a VM\n"));
    }
}
