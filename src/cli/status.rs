//! `eitri-agent status [VM] [--json] [--watch]`: the last report, read
//! from the state dir without its lock.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use super::fail;
use crate::model::Id;
use crate::state::Layout;
use crate::status::ReportFile;

/// How many console lines `status VM` shows.
const CONSOLE_LINES: usize = 5;
/// How many of a VM's last events `status VM` shows.
const EVENTS: usize = 10;

/// Shows the report once, or again every tick of the agent with `watch`.
pub(super) fn run(state_dir: &Path, json: bool, vm_id: Option<&Id>, watch: bool) -> ExitCode {
    loop {
        match show(state_dir, json, vm_id, watch) {
            Ok(tick) if watch => std::thread::sleep(tick),
            Ok(_) => return ExitCode::SUCCESS,
            Err(code) => return code,
        }
    }
}

/// Prints the report (or one VM), once; returns the agent's tick, for
/// `--watch`, or the exit code to end with.
fn show(
    state_dir: &Path,
    json: bool,
    vm_id: Option<&Id>,
    watch: bool,
) -> Result<Duration, ExitCode> {
    let file = ReportFile::read(state_dir).map_err(|e| fail(&e))?;
    let tick = Duration::from_millis(file.tick_ms.clamp(200, 60_000));
    if json {
        let text = serde_json::to_string_pretty(&file).map_err(|e| fail(&e))?;
        println!("{text}");
        return Ok(tick);
    }
    let now = SystemTime::now();
    let text = match vm_id {
        None => file.render(now) + &claims(&file, state_dir),
        Some(vm) => {
            let layout = Layout::new(state_dir);
            let earlier = crate::console::earlier_segments(&layout, vm);
            let console =
                crate::console::last_lines_across(&earlier, &layout.serial_log(vm), CONSOLE_LINES)
                    .unwrap_or_default();
            let events = crate::events::last(&layout, vm, EVENTS);
            match file.render_vm(vm.as_str(), &console, &events, now) {
                Some(text) => text,
                None => {
                    eprintln!(
                        "eitri-agent: VM {vm} is not on this host (the last report does not name it)"
                    );
                    return Err(ExitCode::FAILURE);
                }
            }
        }
    };
    if watch {
        let _ = super::redraw(&text);
    } else {
        print!("{text}");
        let _ = std::io::stdout().flush();
    }
    Ok(tick)
}

/// The host's claims, when the agent said where they are recorded; a
/// registry that cannot be read is said, not fatal.
fn claims(file: &ReportFile, state_dir: &Path) -> String {
    if file.agents_dir.is_empty() {
        return String::new();
    }
    let mine = std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
    match crate::state::claim::list(Path::new(&file.agents_dir)) {
        Ok(claims) => crate::status::render_claims(&file.agents_dir, &claims, &mine),
        Err(e) => format!(
            "\nclaims on this host: cannot read {}: {e}\n",
            crate::quote::inline(&file.agents_dir)
        ),
    }
}
