//! Why a host lacks a piece of a VMM's confinement ([`Lack`]), worded for
//! the operator who must fix it or allow running without it.

use crate::state::leases::LeaseError;

/// Why this host lacks a piece of a VMM's confinement.
#[derive(Debug)]
pub enum Lack {
    /// The agent is not root, so it cannot give a VMM another user.
    NotRoot,
    /// The VMM ids cannot be had (see [`describe`]).
    Ids(LeaseError),
    /// The kernel has no Landlock.
    NoLandlock(std::io::Error),
    /// The cgroup mounts cannot be read.
    Mountinfo(std::io::Error),
    /// A controller VMMs are limited by is on no hierarchy.
    NoController(&'static str),
}

impl std::fmt::Display for Lack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lack::NotRoot => f.write_str(
                "the agent does not run as root, so it cannot give a hypervisor another user",
            ),
            Lack::Ids(e) => f.write_str(&describe(e)),
            Lack::NoLandlock(e) => write!(
                f,
                "this kernel has no Landlock ({e}); boot it with lsm=…,landlock"
            ),
            Lack::Mountinfo(e) => write!(f, "cannot read /proc/self/mountinfo: {e}"),
            Lack::NoController(name) => write!(
                f,
                "this host has no {name} cgroup controller (neither on the unified hierarchy nor a v1 one)"
            ),
        }
    }
}

/// Why no VMM id can be had, for the operator.
pub fn describe(e: &LeaseError) -> String {
    match e {
        LeaseError::Full => "every id of --vmm-ids is taken; give a larger range".into(),
        LeaseError::Unreadable { path, problem } => format!(
            "the id map {} is unreadable ({problem}); no id is handed out until it is repaired, since a fresh map could give a live VMM's id to another",
            path.display()
        ),
        LeaseError::Save { path, source } => {
            format!("cannot save the id map {}: {source}", path.display())
        }
    }
}
