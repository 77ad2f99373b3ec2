//! The host's claims as `status` shows them, under its VMs.

use super::render::{dash, table};
use crate::quote::inline;

/// The host's claims (see [`crate::state::claim`]) as a table: whose each
/// is, and what it holds. `mine` is the state dir `status` was asked about.
/// Paths and names come from files any agent on the host wrote: each goes
/// through [`inline`].
pub fn render_claims(
    registry: &str,
    claims: &[crate::state::claim::Listed],
    mine: &std::path::Path,
) -> String {
    use crate::state::claim::Holding;
    let mut out = format!(
        "\nclaims on this host (--agents-dir {}):\n",
        inline(registry)
    );
    if claims.is_empty() {
        out.push_str("(none recorded)\n");
        return out;
    }
    let rows: Vec<[String; 5]> = claims
        .iter()
        .map(|listed| {
            let c = &listed.claim;
            let agent = match &listed.agent {
                Holding::Running(holders) => {
                    let named: Vec<String> = holders.iter().map(ToString::to_string).collect();
                    format!("running, {}", named.join(", "))
                }
                Holding::Stopped => "not running".to_owned(),
                Holding::Gone => "state dir gone: taken back when an agent next starts".to_owned(),
            };
            let agent = if c.state_dir == mine {
                format!("this one, {agent}")
            } else {
                agent
            };
            let network = c.network.as_ref().map_or_else(
                || "-".to_owned(),
                |n| format!("{} {} taps {}*", n.bridge, n.subnet, n.tap_prefix),
            );
            [
                inline(&c.state_dir.display().to_string()),
                inline(&agent),
                format!("{}+{}", c.first_id, c.id_count),
                dash(&c.cgroup_root),
                inline(&network),
            ]
        })
        .collect();
    table(
        &mut out,
        ["STATE DIR", "AGENT", "VMM IDS", "CGROUP ROOT", "NETWORK"],
        &rows,
    );
    out
}
