//! A small filesystem of a test's own: a tmpfs mounted (as root) on a
//! directory and unmounted on drop, for a disk that fills up.

use std::path::{Path, PathBuf};

use super::tools::tool;

pub struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mounts a tmpfs of `size` (as `mount -o size=` reads it, e.g. "512k")
    /// on `dir`, creating it.
    pub fn mount(dir: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).expect("mount point");
        let mounted = tool("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .expect("mount");
        assert!(mounted.success(), "mounting a tmpfs needs root");
        Tmpfs(dir.to_path_buf())
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Fills what is left of it with one file.
    pub fn fill(&self) {
        use std::io::Write;
        let mut f = std::fs::File::create(self.0.join("filler")).expect("filler");
        let block = vec![0x5a; 64 * 1024];
        while f.write_all(&block).is_ok() {}
        let _ = f.sync_all();
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = tool("umount").arg(&self.0).status();
    }
}
