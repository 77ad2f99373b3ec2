//! `eitri-agent logs VM [--lines N] [--follow] [--hypervisor]`: a VM's
//! console (or its VMM's own log), read without the state dir's lock.

use std::path::Path;
use std::process::ExitCode;

use super::fail;
use crate::model::Id;
use crate::state::Layout;

pub(super) fn run(
    state_dir: &Path,
    vm_id: &Id,
    lines: usize,
    follow: bool,
    hypervisor: bool,
) -> ExitCode {
    let layout = Layout::new(state_dir);
    let (earlier, file, what) = if hypervisor {
        // The previous VMM's log (say, of one that died), then this one's.
        let earlier = vec![layout.previous_hypervisor_log(vm_id)];
        (earlier, layout.hypervisor_log(vm_id), "hypervisor log")
    } else {
        // What the guest said under its earlier VMMs (boots and resumes),
        // then since.
        let earlier = crate::console::earlier_segments(&layout, vm_id);
        (earlier, layout.serial_log(vm_id), "console")
    };
    let mut out = std::io::stdout().lock();
    match crate::console::print(&earlier, &file, lines, follow, &mut out) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away (`| head`): done.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!(
                "eitri-agent: VM {vm_id} has no {what} on this host ({}): is it created here, and is --state-dir right?",
                file.display()
            );
            ExitCode::FAILURE
        }
        Err(e) => fail(&e),
    }
}
