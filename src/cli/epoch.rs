//! `eitri-agent epoch`: the epoch fence a stopped agent's state dir holds,
//! shown or moved. The store takes the state dir's lock, so it is refused
//! while that agent runs.

use std::path::Path;
use std::process::ExitCode;

use super::fail;
use crate::state::Store;

/// Prints the state dir's epoch fence, or moves it to `set`.
pub(super) fn run(state_dir: &Path, set: Option<u64>) -> ExitCode {
    if !state_dir.is_dir() {
        eprintln!(
            "eitri-agent: error: no state dir at {}; give the agent's --state-dir",
            state_dir.display()
        );
        return ExitCode::FAILURE;
    }
    let store = match Store::open(state_dir) {
        Ok(store) => store,
        Err(e) => return fail(&e),
    };
    let was = store.epoch();
    let Some(to) = set else {
        println!("{}: the fence is at epoch {was}", state_dir.display());
        return ExitCode::SUCCESS;
    };
    if let Err(e) = store.reset_epoch(to) {
        return fail(&e);
    }
    println!(
        "{}: the fence moved from epoch {was} to {to}; its agent accepts desired state of epoch {to} or later",
        state_dir.display()
    );
    ExitCode::SUCCESS
}
