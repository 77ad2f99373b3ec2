//! The external programs tests drive (`ip`, `nft`, `udhcpc`, `s6-svscan`, …),
//! looked up before use so a missing one fails the test with its name and the
//! fix, not with a bare `NotFound` from deep inside a helper.
//!
//! Every program named here, or given by name to `Command::new` anywhere in the
//! tree, must be in `.ci/run`'s `need` table: `make programs-check` fails
//! otherwise, because CI runs on a fresh machine where nothing installed by
//! hand exists.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where `program` is on `PATH`. Panics, naming it, when it is not there.
pub fn require(program: &str) -> PathBuf {
    find(program).unwrap_or_else(|| {
        panic!(
            "this test runs `{program}`, which is not installed on this machine; \
             .ci/run installs it (its `need` table names the Debian package)"
        )
    })
}

/// A command for `program`, after [`require`] found it.
pub fn tool(program: &str) -> Command {
    Command::new(require(program))
}

/// The first executable file called `program` on `PATH`.
pub fn find(program: &str) -> Option<PathBuf> {
    crate::programs::find(program)
}

/// Puts failing stand-ins for `tools` first on PATH, as if they were not
/// installed, until dropped. Called first thing in a test, while its
/// process has no other thread (nextest runs each test in its own process).
pub fn without(tools: &[&str]) -> Missing {
    let dir = std::env::temp_dir().join(format!("eitri-missing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for tool in tools {
        script(&dir.join(tool), "exit 127\n");
    }
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // SAFETY: no other thread of this process reads the environment now.
    unsafe { std::env::set_var("PATH", path) };
    Missing(dir)
}

/// The directory of failing stand-ins [`without`] made; removed on drop.
pub struct Missing(PathBuf);

impl Drop for Missing {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes an executable shell script.
pub fn script(path: &Path, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("#!/bin/sh\n{body}")).unwrap_or_else(|e| panic!("script: {e}"));
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("chmod: {e}"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_program_every_system_has() {
        assert!(find("sh").is_some());
    }

    /// Through a constant: a literal here would read as a program the
    /// tests run to `make programs-check`.
    const MISSING: &str = "no-such-program-eitri";

    #[test]
    #[should_panic(expected = "`no-such-program-eitri`, which is not installed")]
    fn a_missing_program_is_named() {
        require(MISSING);
    }
}
