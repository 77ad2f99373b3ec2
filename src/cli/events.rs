//! `eitri-agent events [VM] [--lines N] [--follow]`: what happened to a
//! VM, or to every VM in time order, from the events each VM's directory
//! keeps (see [`crate::events`]); read without the state dir's lock.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use super::fail;
use crate::events::{Event, Follow};
use crate::model::Id;
use crate::state::Layout;

/// How often `--follow` looks for new events.
const FOLLOW_EVERY: Duration = Duration::from_millis(500);

pub(super) fn run(state_dir: &Path, vm_id: Option<&Id>, lines: usize, follow: bool) -> ExitCode {
    let layout = Layout::new(state_dir);
    if !layout.vms().is_dir() {
        eprintln!(
            "eitri-agent: {} holds no VMs: is --state-dir right?",
            state_dir.display()
        );
        return ExitCode::FAILURE;
    }
    if let Some(vm) = vm_id
        && !layout.vm_dir(vm).is_dir()
    {
        eprintln!(
            "eitri-agent: VM {vm} is not on this host ({} has no directory for it; a destroyed VM keeps no events)",
            layout.vms().display()
        );
        return ExitCode::FAILURE;
    }
    let mut out = std::io::stdout().lock();
    let printed = (|| -> std::io::Result<()> {
        // Taken before the first read: an event written in between is
        // printed twice rather than never.
        let mut following = follow.then(|| Follow::from_now(&layout, vm_id));
        print(&mut out, &crate::events::read(&layout, vm_id, lines))?;
        let Some(following) = following.as_mut() else {
            return Ok(());
        };
        loop {
            std::thread::sleep(FOLLOW_EVERY);
            print(&mut out, &following.added(&layout))?;
        }
    })();
    match printed {
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away (`| head`): done.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

fn print(out: &mut impl Write, events: &[Event]) -> std::io::Result<()> {
    for event in events {
        writeln!(out, "{}", event.line())?;
    }
    out.flush()
}
