//! `eitri-agent images prune`: removes cached base images no VM record
//! names. It opens the store, so it refuses to run beside a live agent.

use std::path::Path;
use std::process::ExitCode;

use super::fail;
use crate::state::Store;

pub(super) fn prune(state_dir: &Path) -> ExitCode {
    let store = match Store::open(state_dir) {
        Ok(store) => store,
        Err(e) => return fail(&e),
    };
    match crate::image::prune(&store) {
        Ok(pruned) => {
            for sha in &pruned.removed {
                println!("removed {sha}");
            }
            println!(
                "{} image(s) removed, {:.1} MiB freed",
                pruned.removed.len(),
                pruned.bytes as f64 / (1u64 << 20) as f64
            );
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}
