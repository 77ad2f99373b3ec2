//! When two agents' claims may not stand side by side (see the module
//! above): their VMM id ranges overlap, one cgroup root is or holds the
//! other, or, in one network namespace, their guest networks meet (one
//! bridge, overlapping subnets, a tap prefix starting the other, one
//! firewall table name). Each refusal names the other agent's state dir
//! and every flag that would clear it.

use std::fs;

use super::Claim;

/// The network namespace the calling thread runs in (the one that makes
/// the agent's bridge and taps), as the kernel names it
/// (`net:[4026531840]`); empty where it cannot be read.
pub fn this_netns() -> String {
    fs::read_link("/proc/thread-self/ns/net").map_or(String::new(), |p| p.display().to_string())
}

impl Claim {
    pub(super) fn ids_overlap(&self, other: &Claim) -> bool {
        let end = |c: &Claim| u64::from(c.first_id) + u64::from(c.id_count);
        u64::from(self.first_id) < end(other) && u64::from(other.first_id) < end(self)
    }

    /// One root is the other, or holds it.
    pub(super) fn cgroups_nest(&self, other: &Claim) -> bool {
        let within = |a: &str, b: &str| a == b || a.starts_with(&format!("{b}/"));
        within(&self.cgroup_root, &other.cgroup_root)
            || within(&other.cgroup_root, &self.cgroup_root)
    }

    /// Why this claim may not stand beside `other`'s.
    pub(super) fn conflict(&self, other: &Claim) -> Option<String> {
        let theirs = other.state_dir.display();
        if self.ids_overlap(other) {
            return Some(format!(
                "VMM ids {}:{} overlap {}:{}, claimed by the agent of {theirs}: two agents would give one uid to VMMs of different tenants; give --vmm-ids a range clear of it",
                self.first_id, self.id_count, other.first_id, other.id_count
            ));
        }
        if self.cgroups_nest(other) {
            return Some(format!(
                "cgroup root {:?} meets {:?}, claimed by the agent of {theirs}: each agent removes cgroups of no VM of its own at start; give --cgroup-root another name",
                self.cgroup_root, other.cgroup_root
            ));
        }
        let (Some(mine), Some(theirs_net)) = (&self.network, &other.network) else {
            return None;
        };
        let apart = !mine.netns.is_empty()
            && !theirs_net.netns.is_empty()
            && mine.netns != theirs_net.netns;
        if apart {
            return None;
        }
        // Every network setting that meets the other agent's, so that one
        // start names all there is to change.
        let mut clashes = Vec::new();
        if mine.bridge == theirs_net.bridge {
            clashes.push(format!(
                "bridge {} is its guest network (two agents on one bridge would serve each other's guests): give --underlay-bridge another name, or --underlay-bridge= for none",
                mine.bridge
            ));
        }
        if mine.subnet.covers(&theirs_net.subnet) || theirs_net.subnet.covers(&mine.subnet) {
            clashes.push(format!(
                "underlay subnet {} overlaps its {} (two bridges cannot route one range): give --underlay-subnet a range clear of it",
                mine.subnet, theirs_net.subnet
            ));
        }
        if mine.tap_prefix.starts_with(&theirs_net.tap_prefix)
            || theirs_net.tap_prefix.starts_with(&mine.tap_prefix)
        {
            clashes.push(format!(
                "tap prefix {:?} meets its {:?} (their taps' names would collide): give --tap-prefix another",
                mine.tap_prefix, theirs_net.tap_prefix
            ));
        }
        if mine.table == theirs_net.table {
            clashes.push(format!(
                "firewall tables {:?} are its (one agent's start would replace the other's): give --cgroup-root another name (the tables are named after it)",
                mine.table
            ));
        }
        (!clashes.is_empty()).then(|| {
            format!(
                "the agent of {theirs} (in this network namespace) holds what this one would take: {}",
                clashes.join("; ")
            )
        })
    }
}
