//! `eitri-agent release`: ends a state dir's claim on the host (see
//! `state::claim`). It takes the state dir's lock first, so it refuses to
//! run beside the agent of that dir, and keeps it until done, so none
//! starts meanwhile.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super::fail;
use crate::state::{Store, claim};

pub(super) fn run(
    state_dir: &Path,
    agents_dir: &Path,
    devices: &[PathBuf],
    force: bool,
) -> ExitCode {
    if !state_dir.is_dir() {
        eprintln!(
            "eitri-agent: error: no state dir at {}; a state dir that is gone needs no release (the next agent to start takes its claim back)",
            state_dir.display()
        );
        return ExitCode::FAILURE;
    }
    let store = match Store::open(state_dir) {
        Ok(store) => store,
        // The generic advice ("or choose another --state-dir") is no
        // answer here: it is this dir whose claim is to end.
        Err(crate::state::StoreError::Locked { holders, .. }) => {
            let by = if holders.is_empty() {
                String::new()
            } else {
                format!(
                    " (its lock is {})",
                    crate::state::holders::describe(&holders)
                )
            };
            eprintln!(
                "eitri-agent: error: an agent runs on {}{by}: stop it first; release ends the claim of a state dir no agent runs on",
                state_dir.display()
            );
            return ExitCode::FAILURE;
        }
        Err(e) => return fail(&e),
    };
    let layout = store.layout();
    let vms: Vec<String> = store
        .load_all()
        .keys()
        .map(|id| id.as_str().to_owned())
        .collect();
    let volumes: Vec<String> = std::fs::read_dir(layout.volumes())
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let kept = kept(&vms, &volumes);
    if !kept.is_empty() && !force {
        eprintln!(
            "eitri-agent: error: {} still has {kept}: destroy them through the desired state first, or give --force to release it and leave them",
            state_dir.display()
        );
        return ExitCode::FAILURE;
    }
    let files = claim::Files {
        state_dir,
        registry: agents_dir,
    };
    let released = claim::release(files, &crate::provision::reclaimer(devices));
    match released {
        Ok(reclaimed) => {
            for taken in &reclaimed.taken {
                println!("took back {taken}");
            }
            println!(
                "released the claim of {} (its ids, cgroup root and registry record)",
                state_dir.display()
            );
            if !kept.is_empty() {
                println!(
                    "left in it, as --force asked: {kept}; an agent started on it again claims anew and gives its VMs new ids"
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}

/// "VMs a, b and volumes x" (what of each there is), or "".
fn kept(vms: &[String], volumes: &[String]) -> String {
    let part = |what: &str, names: &[String]| {
        (!names.is_empty()).then(|| format!("{what} {}", names.join(", ")))
    };
    [part("VMs", vms), part("volumes", volumes)]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(" and ")
}
