//! A VM's console (the guest's serial output) and its hypervisor's log, as
//! `eitri-agent logs` prints them.
//!
//! Both files are written by the hypervisor, and the guest writes the
//! console: every line is escaped before it reaches a terminal (no escape
//! sequence, no carriage return, no bell). The console is kept bounded by
//! freeing its oldest blocks in place (see `cloudhv::serial`): a freed
//! range reads as NUL bytes, which are dropped here.
//!
//! The newest lines are read from the end of the file, a piece at a time,
//! so a 10 MiB console costs a few reads. `--follow` looks for more every
//! [`FOLLOW_EVERY`]; a file that shrank (a new boot truncates the console)
//! is read again from its start.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::quote::console;

/// How often `--follow` looks for new output: well within a tick.
pub const FOLLOW_EVERY: Duration = Duration::from_millis(200);

/// How much of the file's end is read at most for the newest lines.
const MAX_TAIL: u64 = 8 << 20;

/// A chunk of a log as lines, each escaped; NULs (freed blocks) dropped.
fn lines_of(bytes: &[u8]) -> Vec<String> {
    let kept: Vec<u8> = bytes.iter().copied().filter(|b| *b != 0).collect();
    String::from_utf8_lossy(&kept)
        .split('\n')
        .map(|l| console(l.strip_suffix('\r').unwrap_or(l)))
        .collect()
}

/// The newest `n` complete or final lines of the file at `path`.
pub fn last_lines(path: &Path, n: usize) -> io::Result<Vec<String>> {
    let mut file = File::open(path)?;
    let len = file.metadata()?.len();
    let mut want = 64 * 1024u64;
    loop {
        let start = len.saturating_sub(want);
        file.seek(SeekFrom::Start(start))?;
        let mut bytes = Vec::new();
        Read::by_ref(&mut file)
            .take(len - start)
            .read_to_end(&mut bytes)?;
        let mut lines = lines_of(&bytes);
        // The first piece may be the tail of a longer line; the last is
        // empty when the file ends in a newline.
        if start > 0 && !lines.is_empty() {
            lines.remove(0);
        }
        if lines.last().is_some_and(String::is_empty) {
            lines.pop();
        }
        lines.retain(|l| !l.is_empty() || start == 0);
        if lines.len() >= n || start == 0 || want >= MAX_TAIL {
            let skip = lines.len().saturating_sub(n);
            return Ok(lines.split_off(skip));
        }
        want = want.saturating_mul(4);
    }
}

/// The newest `n` lines across `earlier` (older segments of the same
/// console, oldest first) and then `path`: a resumed VM's console is the
/// segments its resumes moved aside, and the file its VMM writes now.
pub fn last_lines_across(earlier: &[PathBuf], path: &Path, n: usize) -> io::Result<Vec<String>> {
    let mut lines = last_lines(path, n)?;
    for segment in earlier.iter().rev() {
        if lines.len() >= n {
            break;
        }
        let mut older = match last_lines(segment, n - lines.len()) {
            Ok(older) => older,
            // Bounded away (see `cloudhv::suspend`) since it was listed.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        older.append(&mut lines);
        lines = older;
    }
    Ok(lines)
}

/// A VM's console's earlier segments, oldest first (see
/// [`Layout::serial_segment`](crate::state::Layout::serial_segment)).
pub fn earlier_segments(layout: &crate::state::Layout, vm_id: &crate::model::Id) -> Vec<PathBuf> {
    layout
        .serial_segments(vm_id)
        .into_iter()
        .map(|(_, path)| path)
        .collect()
}

/// Prints the newest `n` lines (of `earlier`'s segments too, see
/// [`last_lines_across`]), then (with `follow`) every line written to
/// `path` after, until `out` fails (the reader went away) or the file
/// cannot be read.
pub fn print(
    earlier: &[PathBuf],
    path: &Path,
    n: usize,
    follow: bool,
    out: &mut impl Write,
) -> io::Result<()> {
    for line in last_lines_across(earlier, path, n)? {
        writeln!(out, "{line}")?;
    }
    out.flush()?;
    if !follow {
        return Ok(());
    }
    let mut at = std::fs::metadata(path)?.len();
    let mut partial: Vec<u8> = Vec::new();
    loop {
        std::thread::sleep(FOLLOW_EVERY);
        let len = match std::fs::metadata(path) {
            Ok(m) => m.len(),
            // Between a destroy and a re-create: wait for it to return.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        if len < at {
            at = 0;
            partial.clear();
        }
        if len == at {
            continue;
        }
        let mut file = File::open(path)?;
        file.seek(SeekFrom::Start(at))?;
        let mut bytes = Vec::new();
        file.take(len - at).read_to_end(&mut bytes)?;
        at = len;
        partial.extend_from_slice(&bytes);
        if let Some(end) = partial.iter().rposition(|b| *b == b'\n') {
            let complete: Vec<u8> = partial.drain(..=end).collect();
            let mut lines = lines_of(&complete);
            lines.pop(); // after the last newline: nothing
            for line in lines {
                writeln!(out, "{line}")?;
            }
            out.flush()?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_lines_come_from_the_end() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("serial.log");
        let text: String = (0..100_000).map(|n| format!("line {n}\n")).collect();
        std::fs::write(&path, text).expect("write");

        let lines = last_lines(&path, 3).expect("read");

        assert_eq!(lines, ["line 99997", "line 99998", "line 99999"]);
    }

    #[test]
    fn freed_blocks_and_terminal_escapes_do_not_reach_the_terminal() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("serial.log");
        let mut bytes = vec![0u8; 8192];
        bytes.extend_from_slice(b"ok\n\x1b[2Jwiped\r\n");
        std::fs::write(&path, bytes).expect("write");

        let lines = last_lines(&path, 5).expect("read");

        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0], "ok");
        assert_eq!(lines[1], "wiped", "the sequence left out");
    }

    #[test]
    fn a_console_moved_aside_by_resumes_reads_as_one_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = dir.path().join("serial.1.log");
        let second = dir.path().join("serial.2.log");
        let now = dir.path().join("serial.log");
        std::fs::write(&first, "booted\nworking\n").expect("write");
        std::fs::write(&second, "after the first resume\n").expect("write");
        std::fs::write(&now, "after the second\n").expect("write");

        let all = last_lines_across(&[first.clone(), second.clone()], &now, 10).expect("read");
        let newest = last_lines_across(&[first, second], &now, 2).expect("read");

        assert_eq!(
            all,
            [
                "booted",
                "working",
                "after the first resume",
                "after the second"
            ]
        );
        assert_eq!(newest, ["after the first resume", "after the second"]);
    }

    #[test]
    fn a_last_line_without_a_newline_is_shown() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("serial.log");
        std::fs::write(&path, "a\nb").expect("write");

        assert_eq!(last_lines(&path, 5).expect("read"), ["a", "b"]);
    }
}
