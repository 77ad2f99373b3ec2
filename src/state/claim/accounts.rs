//! The host's own users, groups and subordinate id ranges, which a VMM
//! id range must stay clear of.

use std::fs;

use super::ClaimError;

/// The host's account files a VMM id range must stay clear of, and how
/// each is read.
const ACCOUNTS: [(&str, Accounts); 4] = [
    ("/etc/passwd", Accounts::Ids),
    ("/etc/group", Accounts::Ids),
    ("/etc/subuid", Accounts::Ranges),
    ("/etc/subgid", Accounts::Ranges),
];

#[derive(Clone, Copy, Debug)]
pub enum Accounts {
    /// `name:x:ID:...`: one id a line (passwd, group).
    Ids,
    /// `name:START:COUNT`: a range a line (subuid, subgid).
    Ranges,
}

/// Why `first:count` may not be VMM ids on this host: an existing user or
/// group, or a subordinate id range, inside it. Unreadable files are
/// skipped (a host without subuid has none).
pub fn check_host_accounts(first: u32, count: u32) -> Result<(), ClaimError> {
    for (path, kind) in ACCOUNTS {
        let Ok(text) = fs::read_to_string(path) else {
            continue;
        };
        if let Some(what) = accounts_overlap(&text, kind, first, count) {
            return Err(ClaimError::Accounts {
                first,
                count,
                what,
                path,
            });
        }
    }
    Ok(())
}

/// The first line of `text` whose id or range meets `first:count`.
pub fn accounts_overlap(text: &str, kind: Accounts, first: u32, count: u32) -> Option<String> {
    let (lo, hi) = (u64::from(first), u64::from(first) + u64::from(count));
    text.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        let (start, len) = match kind {
            Accounts::Ids => (fields.get(2)?.parse::<u64>().ok()?, 1),
            Accounts::Ranges => (
                fields.get(1)?.parse::<u64>().ok()?,
                fields.get(2)?.parse::<u64>().ok()?,
            ),
        };
        let meets = start < hi && lo < start + len;
        meets.then(|| match kind {
            Accounts::Ids => format!("{} (id {start})", fields[0]),
            Accounts::Ranges => format!("{}'s range {start}:{len}", fields[0]),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::claim::LEGACY_FIRST_ID;

    #[test]
    fn a_user_inside_the_range_is_found() {
        let passwd = "root:x:0:0::/root:/bin/sh\nsvc:x:1900000005:1900000005::/:/bin/false\n";

        let found = accounts_overlap(passwd, Accounts::Ids, LEGACY_FIRST_ID, 65_536);

        assert_eq!(found.as_deref(), Some("svc (id 1900000005)"));
    }

    #[test]
    fn a_subordinate_range_meeting_the_range_is_found_and_one_clear_of_it_is_not() {
        let subuid = "alice:100000:65536\nbob:1899990000:20000\n";

        let found = accounts_overlap(subuid, Accounts::Ranges, LEGACY_FIRST_ID, 65_536);
        let clear = accounts_overlap(
            "alice:100000:65536\n",
            Accounts::Ranges,
            LEGACY_FIRST_ID,
            65_536,
        );

        assert_eq!(found.as_deref(), Some("bob's range 1899990000:20000"));
        assert_eq!(clear, None);
    }
}
