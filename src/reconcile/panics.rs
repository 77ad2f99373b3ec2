//! A guest whose kernel panicked is never `ready`: every running VM's
//! console (its live `serial.log`, this hypervisor's) is read on from
//! where its last pass stopped, for the kernel's own words
//! (`Kernel panic - not syncing`). Once seen for a hypervisor, its row says `failed`, the
//! guest panicked, and the line; it is counted in
//! `eitri_vm_guest_panics_total{vm_id}` and logged once. What is done then
//! is the spec's `on_panic`: `stay` leaves the guest as it is for someone
//! to look at (a panic at every boot would otherwise loop), `reboot` boots
//! it again from its disks.
//!
//! What is read is bounded: at most [`LOOK`] bytes a pass, from where the
//! last pass stopped (a guest printing faster is read as it goes, a chunk
//! a pass); a new hypervisor (a boot, a resume: its console file is new)
//! starts over.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};

use super::context::Context;
use super::pass::VmResult;
use crate::model::{DesiredVm, Id, OnPanic, Phase, PowerState};

/// What the kernel prints when it panics.
const PANIC: &[u8] = b"Kernel panic - not syncing";

/// The most of a console one pass reads.
const LOOK: u64 = 1 << 20;

/// The most of the panic's line kept for the row.
const SHOWN: usize = 160;

/// One VM's console as far as it was read, for its hypervisor `pid`.
#[derive(Clone, Debug, Default)]
struct Console {
    pid: Option<u32>,
    read: u64,
    /// The panic's line, once seen.
    panicked: Option<String>,
}

/// Each running VM's console, as far as it was read.
#[derive(Default)]
pub(crate) struct Panics {
    states: parking_lot::Mutex<HashMap<Id, Console>>,
}

impl Panics {
    /// Reads on in the running VM's console; once its guest panicked, its
    /// row says so. Why to boot it again, when its spec says to.
    pub(crate) fn look(
        &self,
        ctx: &Context,
        desired: &DesiredVm,
        res: &mut VmResult,
    ) -> Option<String> {
        let vm_id = &desired.spec.vm_id;
        let running = res
            .row
            .as_ref()
            .is_some_and(|r| r.power == Some(PowerState::Running));
        if !running {
            self.states.lock().remove(vm_id);
            return None;
        }
        let pid = ctx.backend.pid(vm_id);
        let mut state = {
            let mut all = self.states.lock();
            let state = all.entry(vm_id.clone()).or_default();
            if state.pid != pid {
                *state = Console {
                    pid,
                    ..Console::default()
                };
            }
            state.clone()
        };
        if state.panicked.is_none()
            && let Some(line) = read_on(&ctx.store.layout().serial_log(vm_id), &mut state.read)
        {
            log::error!("VM {vm_id}: its guest panicked: {line}");
            ctx.counts.guest_panics.inc(vm_id.as_str());
            state.panicked = Some(line);
        }
        let Some(line) = state.panicked.clone() else {
            self.states.lock().insert(vm_id.clone(), state);
            return None;
        };
        if desired.on_panic == OnPanic::Reboot {
            self.states.lock().remove(vm_id);
            return Some(format!("its guest panicked ({line}): booting it again"));
        }
        self.states.lock().insert(vm_id.clone(), state);
        if let Some(row) = res.row.as_mut() {
            row.phase = Some(Phase::Failed);
            row.last_error = format!(
                "the guest panicked: {line} (on_panic is stay: it is left as it is; its console has the rest)"
            );
        }
        None
    }

    pub(crate) fn forget(&self, vm_id: &Id) {
        self.states.lock().remove(vm_id);
    }
}

/// Reads `console` from `*read` (at most [`LOOK`]), moving `*read` on;
/// the panic's line, printable, if it is in what was read. A file shorter
/// than `*read` is a new one: read from its start.
fn read_on(console: &std::path::Path, read: &mut u64) -> Option<String> {
    // Every running VM's pass asks: a console that did not grow costs a
    // stat, not an open and a read.
    let len = std::fs::metadata(console).ok()?.len();
    if len == *read {
        return None;
    }
    if len < *read {
        *read = 0;
    }
    let mut file = std::fs::File::open(console).ok()?;
    // A panic line straddling the last pass's end began before it.
    let from = read.saturating_sub(PANIC.len() as u64);
    file.seek(SeekFrom::Start(from)).ok()?;
    let mut bytes = Vec::new();
    file.take(LOOK).read_to_end(&mut bytes).ok()?;
    *read = from + bytes.len() as u64;
    let at = bytes.windows(PANIC.len()).position(|w| w == PANIC)?;
    let line = bytes[at..]
        .split(|b| *b == b'\n')
        .next()
        .unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let line = crate::quote::inline(line.trim_end());
    Some(line.chars().take(SHOWN).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_line_is_found_and_kept_whole_to_its_end() {
        let dir = tempfile::tempdir().expect("tempdir");
        let console = dir.path().join("serial.log");
        std::fs::write(
            &console,
            "booting\n[    1.2] Kernel panic - not syncing: VFS: Unable to mount root fs\n[ 1.3] more\n",
        )
        .expect("write");
        let mut read = 0;

        let line = read_on(&console, &mut read);

        assert_eq!(
            line.as_deref(),
            Some("Kernel panic - not syncing: VFS: Unable to mount root fs")
        );
    }

    #[test]
    fn a_panic_split_across_two_looks_is_found() {
        let dir = tempfile::tempdir().expect("tempdir");
        let console = dir.path().join("serial.log");
        std::fs::write(&console, "booting\nKernel pan").expect("write");
        let mut read = 0;
        assert_eq!(read_on(&console, &mut read), None);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&console)
            .expect("open");
        std::io::Write::write_all(&mut f, b"ic - not syncing: Attempted to kill init!\n")
            .expect("append");

        let line = read_on(&console, &mut read);

        assert_eq!(
            line.as_deref(),
            Some("Kernel panic - not syncing: Attempted to kill init!")
        );
    }

    #[test]
    fn escapes_in_the_panic_line_are_shown_not_played() {
        let dir = tempfile::tempdir().expect("tempdir");
        let console = dir.path().join("serial.log");
        std::fs::write(&console, "Kernel panic - not syncing: \x1b[2Jgone\n").expect("write");
        let mut read = 0;

        let line = read_on(&console, &mut read).expect("found");

        assert!(!line.contains('\x1b'), "{line:?}");
    }
}
