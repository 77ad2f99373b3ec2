//! The crate's own Rust sources, for tests that hold the code to a rule
//! (layering, who writes lifecycle fields, where crash points are).

use std::path::{Path, PathBuf};

/// One `.rs` file under `src/`.
pub struct Source {
    /// The path relative to `src/`, e.g. `reconcile/create.rs`.
    pub relative: PathBuf,
    pub text: String,
}

/// Every `.rs` file under this crate's `src/`, in path order. Panics on a
/// file it cannot read: for tests only.
pub fn rust_sources() -> Vec<Source> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()));
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path)
                    .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
                let relative = path.strip_prefix(&src).unwrap_or(&path).to_path_buf();
                out.push(Source { relative, text });
            }
        }
    }
    out.sort_by(|a, b| a.relative.cmp(&b.relative));
    out
}
