//! The host programs the agent runs (`ip`, `nft`, `iptables`, the
//! hypervisor), found once by absolute path. Looking a name up in `PATH`
//! at every call would let whatever directory comes first in it, at any
//! moment, decide what runs as root; here each name is resolved the first
//! time it is asked for (the daemon asks for all of them at start, and
//! logs what it found), and that path is used for the life of the process.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use parking_lot::Mutex;

/// The first executable regular file called `name` in `PATH`'s absolute
/// directories; `name` itself, made absolute, when it is already a path
/// (it has a `/`) to such a file.
pub fn find(name: &str) -> Option<PathBuf> {
    if name.contains('/') {
        let path = std::path::absolute(name).ok()?;
        return is_executable(&path).then_some(path);
    }
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn table() -> &'static Mutex<HashMap<String, Option<PathBuf>>> {
    static TABLE: OnceLock<Mutex<HashMap<String, Option<PathBuf>>>> = OnceLock::new();
    TABLE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// `name`'s absolute path, resolved the first time it is asked for and the
/// same ever after (`None`, ever after, when it was not found then).
pub fn resolved(name: &str) -> Option<PathBuf> {
    let mut table = table().lock();
    if let Some(known) = table.get(name) {
        return known.clone();
    }
    // Not canonicalized: a multi-call binary (iptables → xtables-nft-multi)
    // tells what to be from the name it was run by.
    let found = find(name);
    match &found {
        // A path given as a path needs no line saying it is itself.
        Some(path) if path.as_os_str() == name => {}
        Some(path) => log::info!("using {} for {name}", path.display()),
        None => log::info!("{name}: not found in PATH"),
    }
    table.insert(name.to_owned(), found.clone());
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_found_once_and_kept() {
        let first = resolved("sh").expect("sh is on every PATH");

        assert!(first.is_absolute(), "{}", first.display());
        assert_eq!(resolved("sh"), Some(first));
    }

    #[test]
    fn a_path_that_is_not_executable_is_not_found() {
        let dir = tempfile::tempdir().expect("tempdir");
        let plain = dir.path().join("tool");
        std::fs::write(&plain, "#!/bin/sh\n").expect("write");

        assert_eq!(find(&plain.to_string_lossy()), None);
        assert_eq!(find("/nonexistent/tool"), None);
    }
}
