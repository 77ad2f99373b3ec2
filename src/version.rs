//! Release ordering, for the snapshot's `min_agent_version` floor.
//!
//! Versions are dotted numbers compared numerically (`1.10.0 > 1.9.3`), a
//! leading `v` tolerated and missing parts read as zero (`v1.2` = `1.2.0`).
//! A pre-release (`1.4.0-rc1`) sorts below its release, as in semver; build
//! metadata after `+` is ignored. `""` and `"dev"` are unordered: an
//! unstamped build is a developer's, and is never refused by a floor.

use std::cmp::Ordering;

/// This binary's release, stamped at build time from `EITRI_VERSION` or the
/// crate version.
pub const AGENT_VERSION: &str = match option_env!("EITRI_VERSION") {
    Some(v) => v,
    None => env!("CARGO_PKG_VERSION"),
};

/// A parsed release version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    parts: Vec<u64>,
    /// `None` for a release; a pre-release tag sorts below it.
    pre: Option<String>,
}

impl Version {
    /// Parses a release version; `None` for anything unordered (`""`,
    /// `"dev"`, or text that is not a dotted number).
    pub fn parse(raw: &str) -> Option<Version> {
        let raw = raw.trim();
        let raw = raw.strip_prefix(['v', 'V']).unwrap_or(raw);
        let raw = raw.split('+').next().unwrap_or(raw);
        let (core, pre) = match raw.split_once('-') {
            Some((core, pre)) => (core, Some(pre.to_owned())),
            None => (raw, None),
        };
        let parts = core
            .split('.')
            .map(|p| p.parse::<u64>().ok())
            .collect::<Option<Vec<_>>>()?;
        Some(Version { parts, pre })
    }
}

impl Ord for Version {
    fn cmp(&self, other: &Self) -> Ordering {
        let len = self.parts.len().max(other.parts.len());
        let part = |v: &Version, i: usize| v.parts.get(i).copied().unwrap_or(0);
        (0..len)
            .map(|i| part(self, i).cmp(&part(other, i)))
            .find(|o| o.is_ne())
            .unwrap_or_else(|| match (&self.pre, &other.pre) {
                (None, None) => Ordering::Equal,
                (None, Some(_)) => Ordering::Greater,
                (Some(_), None) => Ordering::Less,
                (Some(a), Some(b)) => a.cmp(b),
            })
    }
}

impl PartialOrd for Version {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Why an agent may not act on a snapshot with this floor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FloorVerdict {
    /// The agent may act.
    Allowed,
    /// The agent is older than the floor.
    Below,
    /// The floor is not a version: the control plane asked for something
    /// this agent cannot judge, so it does not act on what it cannot judge.
    UnreadableFloor,
}

/// Judges `agent` against a snapshot's `floor`. An empty floor, and an
/// unordered agent (`""`, `"dev"`, unparsable), are always allowed.
pub fn check_floor(agent: &str, floor: &str) -> FloorVerdict {
    if floor.trim().is_empty() {
        return FloorVerdict::Allowed;
    }
    let Some(agent) = Version::parse(agent) else {
        return FloorVerdict::Allowed;
    };
    match Version::parse(floor) {
        None => FloorVerdict::UnreadableFloor,
        Some(floor) if agent < floor => FloorVerdict::Below,
        Some(_) => FloorVerdict::Allowed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(raw: &str) -> Version {
        Version::parse(raw).unwrap_or_else(|| panic!("{raw} should parse"))
    }

    #[test]
    fn orders_numerically_not_lexically() {
        let cases = [
            ("1.10.0", "1.9.3"),
            ("1.10", "1.9"),
            ("2.0.0", "1.99.99"),
            ("v1.2.1", "1.2"),
            ("1.4.0", "1.4.0-rc1"),
            ("1.4.0-rc2", "1.4.0-rc1"),
        ];
        for (high, low) in cases {
            assert!(v(high) > v(low), "{high} > {low}");
        }
    }

    #[test]
    fn v_prefix_and_missing_parts_are_equal() {
        assert_eq!(v("v1.2").cmp(&v("1.2.0")), Ordering::Equal);
        assert_eq!(v("1.2.0+build7").cmp(&v("1.2.0")), Ordering::Equal);
    }

    #[test]
    fn empty_and_dev_are_unordered() {
        assert_eq!(Version::parse(""), None);
        assert_eq!(Version::parse("dev"), None);
    }

    #[test]
    fn floor_table() {
        let cases = [
            ("1.9.3", "1.10.0", FloorVerdict::Below),
            ("1.10.0", "1.9.3", FloorVerdict::Allowed),
            ("1.2.0", "v1.2", FloorVerdict::Allowed),
            ("v1.1", "1.2", FloorVerdict::Below),
            ("1.0.0", "", FloorVerdict::Allowed),
            ("", "99.0", FloorVerdict::Allowed),
            ("dev", "99.0", FloorVerdict::Allowed),
            ("1.0.0", "latest", FloorVerdict::UnreadableFloor),
        ];
        for (agent, floor, want) in cases {
            assert_eq!(
                check_floor(agent, floor),
                want,
                "agent {agent:?} floor {floor:?}"
            );
        }
    }

    #[test]
    fn stamped_version_is_ordered_or_dev() {
        assert!(AGENT_VERSION == "dev" || Version::parse(AGENT_VERSION).is_some());
    }
}
