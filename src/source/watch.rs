//! Noticing a change of the desired file the moment it is written, through
//! inotify on its directory (Linux).
//!
//! The directory, not the file: editors and config tools replace a file by
//! renaming a new one over it, which a watch on the old inode never sees.
//! Any event naming the file (written and closed, renamed in or out,
//! created, deleted, its attributes changed) wakes the exchange, which then
//! reads the file as it would at a tick; an event that changed nothing is
//! harmless. The tick stays as the safety net for a change inotify cannot
//! see (a file on a network filesystem).

use std::ffi::OsString;
use std::io;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::Arc;

use crossbeam_channel::Sender;
use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};

use crate::threads::{OwnedThread, StopFlag, Wakeup};

/// The `desired-watch` thread; stopped and joined on drop.
pub struct Watcher {
    _thread: OwnedThread,
}

impl Watcher {
    /// Starts watching `path`; each change sends on `changed` (bounded: a
    /// burst of events is one wake).
    pub fn start(path: &Path, changed: Sender<()>) -> io::Result<Watcher> {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => ".".into(),
        };
        let name: OsString = path
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no file name"))?
            .to_owned();
        // Its detached signature too: signing after writing is a change.
        let mut signature = name.clone();
        signature.push(".sig");
        let names = [name, signature];
        let inotify = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK)?;
        inotify.add_watch(
            &dir,
            AddWatchFlags::IN_CLOSE_WRITE
                | AddWatchFlags::IN_MOVED_TO
                | AddWatchFlags::IN_MOVED_FROM
                | AddWatchFlags::IN_CREATE
                | AddWatchFlags::IN_DELETE
                | AddWatchFlags::IN_ATTRIB,
        )?;
        let wakeup = Arc::new(Wakeup::new()?);
        let thread = {
            let wake = Arc::clone(&wakeup);
            OwnedThread::spawn(
                "desired-watch".into(),
                64 * 1024,
                Some(wakeup),
                move |stop| run(&inotify, &names, &wake, &stop, &changed),
            )?
        };
        Ok(Watcher { _thread: thread })
    }
}

fn run(
    inotify: &Inotify,
    names: &[OsString],
    wakeup: &Wakeup,
    stop: &StopFlag,
    changed: &Sender<()>,
) {
    while !stop.stopped() {
        let mut set = [
            PollFd::new(wakeup.fd(), PollFlags::POLLIN),
            PollFd::new(inotify.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut set, PollTimeout::NONE) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => {
                log::error!(
                    "watching the desired file: poll failed: {e}; changes are read at the tick"
                );
                return;
            }
        }
        wakeup.drain();
        let events = match inotify.read_events() {
            Ok(events) => events,
            Err(Errno::EAGAIN) => continue,
            Err(e) => {
                log::error!("watching the desired file: {e}; changes are read at the tick");
                return;
            }
        };
        // IN_Q_OVERFLOW carries no name: something may have been missed.
        if events
            .iter()
            .any(|e| e.name.as_ref().is_none_or(|n| names.contains(n)))
        {
            let _ = changed.try_send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_file_renamed_into_place_is_noticed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("desired.json");
        let (tx, rx) = crossbeam_channel::bounded(1);
        let _watcher = Watcher::start(&path, tx).expect("watch");

        let temp = dir.path().join(".desired.tmp");
        std::fs::write(&temp, b"{}").expect("write");
        std::fs::rename(&temp, &path).expect("rename");

        assert!(rx.recv_timeout(Duration::from_secs(5)).is_ok());
    }

    #[test]
    fn a_new_signature_beside_the_file_is_noticed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (tx, rx) = crossbeam_channel::bounded(1);
        let _watcher = Watcher::start(&dir.path().join("desired.json"), tx).expect("watch");

        std::fs::write(dir.path().join("desired.json.sig"), b"ed25519 k x").expect("write");

        assert!(rx.recv_timeout(Duration::from_secs(5)).is_ok());
    }

    #[test]
    fn another_file_in_the_directory_is_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (tx, rx) = crossbeam_channel::bounded(1);
        let _watcher = Watcher::start(&dir.path().join("desired.json"), tx).expect("watch");

        std::fs::write(dir.path().join("other.json"), b"{}").expect("write");

        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
    }
}
