//! Who has a file open: read from `/proc/<pid>/fd`, for an error that names
//! the process holding the state dir's lock instead of leaving the operator
//! to guess. Empty where there is no `/proc` (macOS) or nothing is found.

use std::fmt;
use std::fs;
use std::path::Path;

/// A process with the file open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub pid: u32,
    /// Its command name (`/proc/<pid>/comm`), or `?` when it exited meanwhile.
    pub name: String,
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {} ({})", self.pid, self.name)
    }
}

/// `held by pid 7 (eitri-agent), pid 9 (sh)`, or what to say when no
/// holder could be named.
pub fn describe(holders: &[Holder]) -> String {
    if holders.is_empty() {
        return "no process with its lock file open could be named".to_owned();
    }
    let named: Vec<String> = holders.iter().map(Holder::to_string).collect();
    format!("held by {}", named.join(", "))
}

/// Every process (but this one) with `path` open, by pid. Processes whose
/// fds this one may not read are not listed.
pub fn holders(path: &Path) -> Vec<Holder> {
    let Ok(target) = fs::canonicalize(path) else {
        return Vec::new();
    };
    let me = std::process::id();
    let mut found = Vec::new();
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let fds = entry.path().join("fd");
        let open = fs::read_dir(&fds)
            .into_iter()
            .flatten()
            .flatten()
            .any(|fd| fs::read_link(fd.path()).is_ok_and(|link| link == target));
        if open {
            let name = fs::read_to_string(entry.path().join("comm"))
                .map_or_else(|_| "?".to_string(), |s| s.trim_end().to_string());
            found.push(Holder { pid, name });
        }
    }
    found.sort_by_key(|h| h.pid);
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    #[test]
    fn a_process_with_the_file_open_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("lock");
        fs::write(&path, b"").expect("write");
        let file = fs::File::open(&path).expect("open");
        // A child given the file as its stdin holds it.
        let mut child = Command::new("sleep")
            .arg("30")
            .stdin(Stdio::from(std::os::fd::OwnedFd::from(file)))
            .spawn()
            .expect("sleep");

        let found = holders(&path);
        let _ = child.kill();
        let _ = child.wait();

        assert_eq!(
            found,
            vec![Holder {
                pid: child.id(),
                name: "sleep".into()
            }]
        );
    }

    #[test]
    fn a_file_nobody_else_holds_has_no_holders() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("lock");
        fs::write(&path, b"").expect("write");
        let _mine = fs::File::open(&path).expect("open");

        assert_eq!(holders(&path), Vec::new());
    }
}
