//! Readiness: a VM whose spec names a probe is `ready` only once its guest
//! answers it, and `unhealthy` in its row when it stops answering.
//!
//! A probe runs in the VM's own pass, at most once a period (so at least
//! once a tick), bounded by its timeout: a console line containing a text
//! (the agent keeps the console; a boot starts it afresh; once printed it
//! answers for the life of that hypervisor, so the console is not read
//! again), a TCP connection to a port of the guest's underlay address, or
//! an HTTP GET there answering 2xx. What a probe
//! knows lives in memory and starts over with each hypervisor (a new pid):
//! a restarted agent asks again, and a guest that answers at once loses
//! nothing.
//!
//! Until the first answer since its boot the row says `creating` and what
//! it waits for ("waiting for the guest: tcp 22, 4 s of 60 s"); past the
//! grace, and whenever a probe fails after an answer, its error says
//! `unhealthy: …` and each such probe is counted. With `restart_after`, a
//! guest failing that long on end is booted again (its hypervisor stopped
//! by the usual ladder and started afresh), said in its row and counted.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, SystemTime};

use super::pass::{Core, VmResult};
use super::probing::{ProbeState, fresh};
use crate::deadline::Deadline;
use crate::model::{ANSWERED, Check, DesiredVm, Id, Phase, PowerState, Readiness, UNHEALTHY};

/// How much of the console's end is searched for the line.
const CONSOLE_TAIL: u64 = 8 << 20;

impl Core {
    /// Probes a running VM whose spec names a probe, when one is due, and
    /// says in its row what the probe says. A VM with no probe, or not
    /// running and ready by its lifecycle, is left as its pass reported it.
    pub(crate) fn probe(&self, deadline: Deadline, desired: &DesiredVm, res: &mut VmResult) {
        let vm_id = &desired.spec.vm_id;
        if !up(res) {
            self.probes.lock().remove(vm_id);
            return;
        }
        let now = self.host.now();
        let pid = self.prov.pid(vm_id);
        let Some(probe) = &desired.readiness else {
            // Remembered, so a probe added later finds it running.
            let mut all = self.probes.lock();
            if all.get(vm_id).is_none_or(|s| !s.unprobed || s.pid != pid) {
                let seen = ProbeState {
                    unprobed: true,
                    ..fresh(pid, now)
                };
                all.insert(vm_id.clone(), seen);
            }
            return;
        };
        let mut state = {
            let mut all = self.probes.lock();
            let state = all.entry(vm_id.clone()).or_insert_with(|| fresh(pid, now));
            if state.pid != pid {
                *state = fresh(pid, now);
            } else if state.unprobed {
                *state = ProbeState {
                    added_while_running: true,
                    ..fresh(pid, now)
                };
            }
            state.clone()
        };
        let printed = matches!(probe.check, Check::Serial(_)) && state.answered.is_some();
        if now >= state.next_at && !printed {
            state.next_at = now + probe.period;
            let timeout = deadline
                .remaining()
                .map_or(probe.timeout, |left| probe.timeout.min(left));
            let timeout = timeout.max(Duration::from_millis(1));
            match self.ask(vm_id, &probe.check, timeout, &mut state.console_searched) {
                Ok(()) => {
                    state.answered = Some(now);
                    state.failing_since = None;
                    state.last = format!("{}{ANSWERED}", probe.check);
                }
                Err(why) => {
                    state.failing_since.get_or_insert(now);
                    state.last = crate::error::chain(&why);
                    if state.answered.is_some() || past(now, state.since, probe.grace) {
                        self.counts.unhealthy.inc(vm_id.as_str());
                    }
                }
            }
        }
        self.say_flip(vm_id, probe, &mut state, now);
        self.probes.lock().insert(vm_id.clone(), state.clone());
        if self.restart_if_due(deadline, desired, probe, &state, now, res) {
            return;
        }
        say(res, probe, &state, now);
    }

    /// Logs the VM turning unhealthy, or answering again after it was.
    fn say_flip(&self, vm_id: &Id, probe: &Readiness, state: &mut ProbeState, now: SystemTime) {
        let unhealthy = match (state.answered, state.failing_since) {
            (None, _) => past(now, state.since, probe.grace),
            (Some(_), failing) => failing.is_some(),
        };
        if unhealthy == state.unhealthy {
            return;
        }
        state.unhealthy = unhealthy;
        if unhealthy {
            log::warn!(
                "VM {vm_id}: unhealthy: its probe ({}) fails: {}",
                probe.check,
                state.last
            );
        } else {
            log::info!("VM {vm_id}: healthy again: {}", state.last);
        }
    }

    /// Holds back the row of a VM whose hypervisor was just started, for a
    /// publish before its pass probes it: with a probe in its spec it is
    /// not `ready` until its guest answers, and nothing of this hypervisor
    /// has answered yet.
    pub(crate) fn hold_for_probe(&self, desired: &DesiredVm, res: &mut VmResult) {
        let Some(probe) = &desired.readiness else {
            return;
        };
        if up(res) {
            let state = fresh(self.prov.pid(&desired.spec.vm_id), self.host.now());
            say(res, probe, &state, state.since);
        }
    }

    /// Whether the guest answers `check` now; why not, if it does not.
    /// `searched` is how much of the live console a serial check of this
    /// hypervisor has read (see [`Core::console`]).
    fn ask(
        &self,
        vm_id: &Id,
        check: &Check,
        timeout: Duration,
        searched: &mut Option<u64>,
    ) -> Result<(), Unanswered> {
        let address = |what: &'static str, port: u16| {
            self.prov
                .address(vm_id)
                .ok_or(Unanswered::NoAddress { what, port })
        };
        match check {
            Check::Tcp(port) => {
                let to = SocketAddr::from((address("tcp", *port)?, *port));
                TcpStream::connect_timeout(&to, timeout)
                    .map(drop)
                    .map_err(|source| Unanswered::Tcp { to, source })
            }
            Check::Http { port, path } => {
                let to = SocketAddr::from((address("http", *port)?, *port));
                http_status(to, path, timeout).and_then(|status| {
                    if (200..300).contains(&status) {
                        Ok(())
                    } else {
                        Err(Unanswered::HttpStatus {
                            to,
                            path: path.clone(),
                            status,
                        })
                    }
                })
            }
            Check::Serial(text) => self.console(vm_id, text, searched),
        }
    }

    /// Whether a console line of this boot holds `text`. `searched` is how
    /// much of the live console an earlier look of this hypervisor's
    /// searched: only what the guest printed since is read (the guest picks
    /// how much it prints; reading it all again every period cost tens of
    /// ms a probe), and it is set to what this look searched.
    fn console(
        &self,
        vm_id: &Id,
        text: &str,
        searched: &mut Option<u64>,
    ) -> Result<(), Unanswered> {
        let layout = self.store.layout();
        let live = layout.serial_log(vm_id);
        let needle = text.as_bytes();
        let unread = Unanswered::Console;
        let len = std::fs::metadata(&live).map_err(unread)?.len();
        let holds = if let Some(seen) = searched.filter(|seen| len >= *seen) {
            // A line straddling the last look's end began before it.
            let from = seen.saturating_sub(needle.len() as u64);
            console_holds(&live, needle, from, CONSOLE_TAIL)
                .map_err(unread)?
                .0
        } else {
            // The whole boot's console: a resumed guest does not print its
            // boot line again, and what it printed before its suspend
            // still counts.
            let paths = layout.serial_of_this_boot(vm_id);
            let mut budget = CONSOLE_TAIL;
            let mut holds = false;
            for path in paths.iter().rev() {
                match console_holds(path, needle, 0, budget) {
                    Ok((true, _)) => {
                        holds = true;
                        break;
                    }
                    Ok((false, read)) => budget = budget.saturating_sub(read),
                    // A segment may be gone under it (the oldest are
                    // removed past the bound): the console itself may not.
                    Err(_) if path != &live => {}
                    Err(e) => return Err(unread(e)),
                }
                if budget == 0 {
                    break;
                }
            }
            holds
        };
        *searched = Some(len);
        if holds {
            Ok(())
        } else {
            Err(Unanswered::NotPrinted {
                text: text.to_owned(),
            })
        }
    }

    /// Boots a VM again whose probe has failed `restart_after` on end: its
    /// hypervisor stopped by the usual ladder, a new one started. Whether
    /// it did (the row then says so).
    fn restart_if_due(
        &self,
        deadline: Deadline,
        desired: &DesiredVm,
        probe: &Readiness,
        state: &ProbeState,
        now: SystemTime,
        res: &mut VmResult,
    ) -> bool {
        let (Some(bound), Some(failing)) = (probe.restart_after, state.failing_since) else {
            return false;
        };
        // A guest never ready is given its grace first.
        let from = if state.answered.is_some() {
            failing
        } else {
            state.since + probe.grace
        };
        if !past(now, from, bound) {
            return false;
        }
        let vm_id = &desired.spec.vm_id;
        // It boots as its record says (what it was created with, and what
        // waits for its next boot): never as a spec nothing recorded.
        let Ok(Some(rec)) = self.store.get(vm_id) else {
            return false;
        };
        let mut rec = (*rec).clone();
        let why = format!(
            "unhealthy for {} s ({}): booting it again",
            now.duration_since(from).unwrap_or_default().as_secs(),
            state.last
        );
        log::warn!("VM {vm_id}: {why}");
        self.counts.probe_restarts.inc(vm_id.as_str());
        self.probes.lock().remove(vm_id);
        let say = |what: &str| log::info!("VM {vm_id}: {what}");
        let restarted = self.prov.shutdown(vm_id, deadline, &say).and_then(|()| {
            self.take_next_boot_changes(desired, &mut rec);
            self.prov.boot(&rec.spec, deadline)
        });
        if let Some(row) = res.row.as_mut() {
            row.phase = Some(Phase::Creating);
            match restarted {
                Ok(()) => row.status_detail = why,
                Err(e) => {
                    row.power = Some(PowerState::observed(self.prov.running(vm_id)));
                    row.last_error = format!("{why}, which failed: {}", crate::error::chain(&*e));
                }
            }
        }
        true
    }
}

/// Whether the pass reports the VM running and ready by its lifecycle:
/// what a probe may hold back.
fn up(res: &VmResult) -> bool {
    res.row
        .as_ref()
        .is_some_and(|r| r.power == Some(PowerState::Running) && r.phase == Some(Phase::Ready))
}

/// Whether `bound` has passed from `from` at `now`.
fn past(now: SystemTime, from: SystemTime, bound: Duration) -> bool {
    now.duration_since(from).is_ok_and(|d| d >= bound)
}

/// The row as the probe has it: `creating` and waiting before the first
/// answer, `unhealthy: …` past the grace or when failing after one.
fn say(res: &mut VmResult, probe: &Readiness, state: &ProbeState, now: SystemTime) {
    let Some(row) = res.row.as_mut() else {
        return;
    };
    let waited = now
        .duration_since(state.since)
        .unwrap_or_default()
        .as_secs();
    row.readiness = match state.failing_since {
        None if state.answered.is_some() => state.last.clone(),
        None => format!("{}: not asked yet", probe.check),
        Some(failing) => format!(
            "failing for {} s: {}",
            now.duration_since(failing).unwrap_or_default().as_secs(),
            state.last
        ),
    };
    match (state.answered, state.failing_since) {
        (None, _) => {
            // Created and running all along: not ready, never `creating`.
            let added = if state.added_while_running {
                " (a probe added while it ran)"
            } else {
                row.phase = Some(Phase::Creating);
                ""
            };
            row.status_detail = format!(
                "waiting for the guest: {}{added}, {waited} s of {} s",
                probe.check,
                probe.grace.as_secs()
            );
            if past(now, state.since, probe.grace) {
                row.last_error = format!(
                    "{UNHEALTHY}the guest has not answered {} in {} s: {}",
                    probe.check,
                    probe.grace.as_secs(),
                    state.last
                );
            }
        }
        (Some(_), Some(failing)) => {
            let for_s = now.duration_since(failing).unwrap_or_default().as_secs();
            row.last_error = format!("{UNHEALTHY}failing for {for_s} s: {}", state.last);
        }
        (Some(_), None) => {}
    }
}

/// The status code a GET of `path` at `to` answers, all of it (connect,
/// request, status line) within `timeout`; the guest is untrusted, so at
/// most its first 512 bytes are read.
fn http_status(to: SocketAddr, path: &str, timeout: Duration) -> Result<u16, Unanswered> {
    use std::io::Write;
    let start = std::time::Instant::now();
    let left = || {
        timeout
            .saturating_sub(start.elapsed())
            .max(Duration::from_millis(1))
    };
    let what = |source: std::io::Error| Unanswered::Http {
        to,
        path: path.to_owned(),
        source,
    };
    let mut conn = TcpStream::connect_timeout(&to, timeout).map_err(what)?;
    conn.set_write_timeout(Some(left())).map_err(what)?;
    conn.write_all(
        format!(
            "GET {path} HTTP/1.0\r\nHost: {}\r\nConnection: close\r\n\r\n",
            to.ip()
        )
        .as_bytes(),
    )
    .map_err(what)?;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 512];
    while head.len() < 512 && !head.contains(&b'\n') {
        conn.set_read_timeout(Some(left())).map_err(what)?;
        let n = conn.read(&mut buf[..512 - head.len()]).map_err(what)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    // "HTTP/1.1 200 OK"
    let line = String::from_utf8_lossy(&head);
    line.split_whitespace()
        .nth(1)
        .filter(|_| line.starts_with("HTTP/"))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| Unanswered::NoStatusLine {
            to,
            path: path.to_owned(),
        })
}

/// Why a probe's check was not answered; its words, with its source's
/// (`error::chain`), are the row's.
#[derive(Debug)]
enum Unanswered {
    NoAddress {
        what: &'static str,
        port: u16,
    },
    Tcp {
        to: SocketAddr,
        source: std::io::Error,
    },
    Http {
        to: SocketAddr,
        path: String,
        source: std::io::Error,
    },
    HttpStatus {
        to: SocketAddr,
        path: String,
        status: u16,
    },
    NoStatusLine {
        to: SocketAddr,
        path: String,
    },
    Console(std::io::Error),
    NotPrinted {
        text: String,
    },
}

impl std::fmt::Display for Unanswered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unanswered::NoAddress { what, port } => {
                write!(f, "{what} {port}: the guest has no address yet")
            }
            Unanswered::Tcp { to, .. } => write!(f, "tcp {} on {}", to.port(), to.ip()),
            Unanswered::Http { to, path, .. } => {
                write!(f, "http {} {path} on {}", to.port(), to.ip())
            }
            Unanswered::HttpStatus { to, path, status } => {
                write!(
                    f,
                    "http {} {path} on {} answered {status}",
                    to.port(),
                    to.ip()
                )
            }
            Unanswered::NoStatusLine { to, path } => write!(
                f,
                "http {} {path} on {}: no HTTP status line in its answer",
                to.port(),
                to.ip()
            ),
            Unanswered::Console(_) => f.write_str("cannot read the console"),
            Unanswered::NotPrinted { text } => write!(f, "no console line holds {text:?} yet"),
        }
    }
}

impl std::error::Error for Unanswered {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Unanswered::Tcp { source, .. }
            | Unanswered::Http { source, .. }
            | Unanswered::Console(source) => Some(source),
            _ => None,
        }
    }
}

/// Whether a line of the console at `path`, from byte `from` on (at most
/// its last `tail` bytes), holds `text`; and how many bytes were read.
fn console_holds(
    path: &std::path::Path,
    text: &[u8],
    from: u64,
    tail: u64,
) -> std::io::Result<(bool, u64)> {
    use std::io::{Seek, SeekFrom};
    let mut file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(tail).max(from)))?;
    let mut bytes = Vec::new();
    file.take(tail).read_to_end(&mut bytes)?;
    let read = bytes.len() as u64;
    if text.is_empty() {
        return Ok((true, read));
    }
    let holds = bytes
        .split(|b| *b == b'\n')
        .any(|line| line.windows(text.len()).any(|w| w == text));
    Ok((holds, read))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;

    /// A loopback peer that answers whatever it is sent with `answer`.
    fn peer(answer: &'static [u8]) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
        let at = listener.local_addr().expect("addr");
        std::thread::spawn(move || {
            if let Ok((mut conn, _)) = listener.accept() {
                let _ = conn.write_all(answer);
                std::thread::sleep(Duration::from_secs(2));
            }
        });
        at
    }

    #[test]
    fn a_status_line_is_read_and_its_code_taken() {
        let at = peer(b"HTTP/1.1 204 No Content\r\n\r\n");

        assert_eq!(
            http_status(at, "/", Duration::from_secs(1)).map_err(|e| e.to_string()),
            Ok(204)
        );
    }

    #[test]
    fn a_guest_answering_no_status_line_is_read_no_further_than_512_bytes() {
        let at = peer(&[b'A'; 64 * 1024]);

        let read = http_status(at, "/", Duration::from_secs(1));

        assert!(
            matches!(read, Err(Unanswered::NoStatusLine { .. })),
            "{read:?}"
        );
    }

    #[test]
    fn a_guest_that_never_answers_fails_within_the_timeout() {
        let at = peer(b"");
        let start = std::time::Instant::now();

        let read = http_status(at, "/", Duration::from_millis(300));

        assert!(read.is_err(), "{read:?}");
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
    }
}
