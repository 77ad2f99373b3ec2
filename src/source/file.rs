//! Standalone mode: desired state from a JSON file (the proto's field names).

use std::fs;
use std::path::PathBuf;
use std::time::SystemTime;

use super::{Source, SourceError};
use crate::pb;

/// Re-reads the file when its size, modification time or inode changes. A
/// malformed version is reported once and the previous desired state kept;
/// the next change is read again.
pub struct FileSource {
    path: PathBuf,
    seen: Option<Stamp>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<SystemTime>,
    inode: u64,
}

impl FileSource {
    pub fn new(path: PathBuf) -> FileSource {
        FileSource { path, seen: None }
    }
}

impl Source for FileSource {
    fn fetch(&mut self, _host: &pb::HostInfo) -> Result<Option<pb::Snapshot>, SourceError> {
        use std::os::unix::fs::MetadataExt;
        let read_err = |source| SourceError::ReadFile {
            path: self.path.clone(),
            source,
        };
        let meta = fs::metadata(&self.path).map_err(read_err)?;
        let stamp = Stamp {
            len: meta.len(),
            modified: meta.modified().ok(),
            inode: meta.ino(),
        };
        if self.seen == Some(stamp) {
            return Ok(None);
        }
        let text = fs::read(&self.path).map_err(read_err)?;
        // Marked seen before parsing: a malformed version is reported once,
        // not on every tick until someone fixes it.
        self.seen = Some(stamp);
        serde_json::from_slice(&text)
            .map(Some)
            .map_err(|e| SourceError::Malformed {
                path: self.path.clone(),
                line: e.line(),
                column: e.column(),
                problem: e.to_string(),
            })
    }

    fn send_report(
        &mut self,
        _host: &pb::HostInfo,
        _report: &pb::Report,
    ) -> Result<(), SourceError> {
        Ok(())
    }

    fn is_remote(&self) -> bool {
        false
    }

    fn reload(&mut self) {
        self.seen = None;
    }

    fn describe(&self) -> String {
        format!("desired file {}", self.path.display())
    }
}
