//! Stopping a VMM: the shared ladder (see [`supervise::ladder`]) on this
//! backend's [`Vmm`](super::vmm::Vmm); done only once the agent's own child
//! is reaped.

use std::time::Duration;

use super::CloudHypervisor;
use super::error::CloudHvError;
use crate::deadline::Deadline;
use crate::error::Outcome;
use crate::model::Id;
use crate::provision::Say;
use crate::provision::jail::cgroup;
use crate::provision::supervise::{self, Guest, ladder};

/// How long a VMM found dead is given for its reaper to finish.
const REAP_WAIT: Duration = Duration::from_secs(2);

impl CloudHypervisor {
    /// Stops the VM's VMM, telling `say` each rung of the ladder.
    pub(super) fn stop(&self, vm_id: &Id, deadline: Deadline, say: Say<'_>) -> Outcome {
        match self.find(vm_id) {
            Some(tracked) => {
                let vmm = self.vmm(vm_id, tracked);
                let bounds = (self.cfg.hypervisor.stop, deadline);
                supervise::stop(vm_id, &vmm, bounds, Guest::Running, say)?;
            }
            // Already dead; if it was this agent's child, let its reaper
            // finish, so no zombie outlives the stop.
            None => {
                if let Some(dead) = self.tracked(vm_id) {
                    ladder::wait_gone(&self.vmm(vm_id, dead), Deadline::after(REAP_WAIT));
                }
            }
        }
        self.end_leftovers(vm_id, say)
    }

    /// Ends whatever the VM's VMM forked (a VMM its guest took over may
    /// fork anything its jail allows), which the VMM's own end leaves
    /// running: every process of its cgroups, or, without cgroups, every
    /// process of its uid. A stopped VM holds nothing; a destroyed one
    /// releases its cgroups and uid only after this.
    pub(super) fn end_leftovers(&self, vm_id: &Id, say: Say<'_>) -> Outcome {
        let deadline = Deadline::after(LEFTOVER_KILL);
        let ended = match (&self.confined.cgroups, &self.confined.ids) {
            (Ok(cgroups), _) => cgroups.kill(vm_id, LEFTOVER_KILL),
            (Err(_), Ok(ids)) => match ids.get(vm_id) {
                Some(uid) => cgroup::kill_all(
                    &format!("the VMM user {uid}"),
                    || processes_of(uid),
                    deadline,
                ),
                None => Ok(()),
            },
            // Unjailed (allowed by the operator): its VMM ran as the
            // agent's own user, and nothing tells its children apart.
            (Err(_), Err(_)) => Ok(()),
        };
        ended.map_err(|source| {
            say(&format!("{source}"));
            CloudHvError::Leftovers {
                vm_id: vm_id.clone(),
                source,
            }
            .into()
        })
    }
}

/// How long the processes a VMM left are given to die of SIGKILL.
const LEFTOVER_KILL: Duration = Duration::from_secs(2);

/// The pids of every process whose real, effective or saved uid is `uid`.
pub(super) fn processes_of(uid: u32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let uid = uid.to_string();
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|status| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix("Uid:"))
                    .is_some_and(|ids| ids.split_whitespace().take(3).any(|u| u == uid))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_processes_of_a_uid_include_this_one() {
        let uid = nix::unistd::getuid().as_raw();

        let found = processes_of(uid);

        assert!(found.contains(&(std::process::id() as i32)), "{found:?}");
    }

    #[test]
    fn the_processes_of_an_unused_uid_are_none() {
        assert_eq!(processes_of(1_999_999_999), Vec::<i32>::new());
    }
}
